"""`router-bench simulate --events`: the modelled replicas publish KV-cache events, and the router
follows them with its own event-fed index.

Each turn then carries its prompt in the engine's tokens (`Turns.key`), as a router with the
engines' tokenizers sees it: the session's shared system prompt, then its history, each token an
id of its own place in the conversation, so two turns share exactly the blocks of the prefix they
share. The policy (`ttft`, the router's default, is the one that reads them) prices each replica
from what that replica's events say it holds, where it believes them, else by its own model.

Each modelled replica is an engine of `--block-tokens`-token blocks. When a turn is scheduled
there its prompt is cached, and when it ends its reply; each time it publishes one message (a
`Batch`, numbered per replica, as vLLM numbers its own): a `BlockRemoved` for every block of the
conversations its cache evicted to make room, then a `BlockStored` for the system prompt's blocks
if they are new there, and one for the whole blocks of the conversation not stored before
(chained to the block before them, with their token ids). The model's cache is kept by
conversation, least recently used first (router.bench.simulate.Model), and its events say
exactly that (vLLM evicts block by block, the chain's tail first).

A message reaches the router `--event-delay-ms` after it was published, or never: each is lost
with probability `--event-loss`. The router applies each with its own code
(router.kvevents.holdings.take): in order; past a gap it asks the engine's replay buffer (its last
`--replay-keep` messages) for what it missed, which answers `--replay-ms` later; a gap the buffer
no longer covers leaves the replica unsure, priced by the model, until its cache has turned over.
A replica that dies publishes nothing again; one that joins is followed from its first message.

Reported besides the run's figures: messages published, lost and applied, gaps, replays, unsure
episodes; the share of decisions priced by events; and the error of the cached tokens each
decision counted on against those the replica then computed from cache (per prompt token).
"""

from __future__ import annotations

import random
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.keys import RoutingKey
from router.kvevents.holdings import Holdings, take
from router.kvevents.tokens import EngineTokens
from router.kvevents.wire import MEDIUM_GPU, Batch, Event, Removed, Stored
from router.prompt import BYTES_PER_TOKEN, Prompt

if TYPE_CHECKING:
    from router.bench.virtual_time import LightLoop
    from router.kvevents.truth import Truth

SYSTEM_BASE = 1 << 60  # token ids of the shared system prompts: SYSTEM_BASE + prompt x its tokens + place
# a session's own tokens: its first is (session + 1) x SESSION_SPAN, the rest OWN_BASE + place, the
# same in every session (a block's key chains its parent's: from the first block on, no two sessions'
# keys are the same), so a turn's ids are copies of two arrays, not thousands of numbers made
SESSION_SPAN = 1 << 22
OWN_BASE = 1 << 59
SYSTEM_NAME = 1 << 63  # the engines' names of the system prompts' blocks: SYSTEM_NAME | prompt << 22 | block


@dataclass
class Figures:
    published: int = 0
    lost: int = 0
    applied: int = 0  # messages applied by the router (live or from a replay)


@dataclass
class Engine:
    """What one modelled replica has published: its next number, its replay buffer, and how many
    of each conversation's own blocks (past the system prompt) it has said it stores."""

    keep: int
    seq: int = 0
    buffer: deque[Batch] = field(default_factory=deque)
    stored: dict[int, int] = field(default_factory=dict)  # session -> its blocks stored
    systems: set[int] = field(default_factory=set)  # system prompts stored
    inbox: deque[Batch] = field(default_factory=deque)  # arrived at the router, not yet applied
    applying: bool = False
    dead: bool = False


class Turns:
    """The engine tokens of the simulation's turns, and the RoutingKey that carries them (its
    `Prompt.chain` in the prefix index's blocks, `index_block` tokens each, for the router's model)."""

    def __init__(self, system_tokens: int, system_prompts: int, block: int, index_block: int) -> None:
        self.system_tokens = system_tokens
        self.block = block
        self.index_block = index_block
        self.system_blocks = system_tokens // block
        self.systems = [
            array("Q", range(SYSTEM_BASE + p * system_tokens, SYSTEM_BASE + (p + 1) * system_tokens))
            for p in range(system_prompts)
        ]
        self.own = array("Q")  # OWN_BASE + place, as long as the longest conversation so far

    def ids(self, session: int, system: int, tokens: int) -> array[int]:
        """The first `tokens` token ids of `session`'s conversation (its system prompt's first)."""
        own = tokens - self.system_tokens
        if own <= 0:
            return self.systems[system][:tokens]
        if own > len(self.own):
            self.own.extend(range(OWN_BASE + len(self.own), OWN_BASE + own))
        ids = self.systems[system] + self.own[:own]
        ids[self.system_tokens] = (session + 1) * SESSION_SPAN  # its first: its own
        return ids

    def key(self, key: RoutingKey, session: int, system: int, history: int, message: int) -> RoutingKey:
        """`key` with the turn's prompt: the conversation's first `history` tokens, then its message."""
        tokens = history + message
        ids = tuple(self.ids(session, system, tokens))
        engine = EngineTokens(tokens, ids, None, None, "tokenizer")
        chain = engine.chain(self.index_block)
        opening = history <= self.system_tokens
        prompt = Prompt(chain, int(tokens * BYTES_PER_TOKEN), history // self.index_block, engine, opening=opening)
        return RoutingKey(key.key, key.kind, key.source, prompt, key.model)


class Publishers:
    """The modelled replicas' events, and the router's subscriber to them (its `Truth`)."""

    def __init__(
        self,
        loop: LightLoop,
        truth: Truth,
        turns: Turns,
        capacity_blocks: int,
        delay_s: float,
        loss: float,
        replay_s: float,
        keep: int,
        seed: int,
    ) -> None:
        self.loop = loop
        self.truth = truth
        self.turns = turns
        self.capacity_blocks = capacity_blocks
        self.delay_s = delay_s
        self.loss = loss
        self.replay_s = replay_s
        self.keep = keep
        self.settle_s = 2 * (delay_s + replay_s) + 1.0  # enough for every message sent to arrive and be applied
        self.rng = random.Random(seed)  # (a stream of its own: losses never shift the sessions' draws)
        self.engines: dict[str, Engine] = {}
        self.holdings: dict[str, Holdings] = {}
        self.figures = Figures()

    def join(self, replica_id: str) -> None:
        """A replica the router follows from its engine's start (its replay buffer is empty)."""
        self.engines[replica_id] = Engine(self.keep)
        h = self.holdings[replica_id] = self.truth.holdings(replica_id, 0, self.capacity_blocks)
        h.caught_up()

    def die(self, replica_id: str) -> None:
        engine = self.engines.get(replica_id)
        if engine is not None:
            engine.dead = True

    def kept(self, replica_id: str, session: int, system: int, dropped: list[tuple[int, int]], cached: int) -> None:
        """The replica's cache now keeps `cached` tokens of `session`'s conversation (0: none, it
        was evicted itself) and evicted the conversations `dropped`: a turn of it was scheduled
        there (its prompt), or ended (its reply)."""
        engine = self.engines[replica_id]
        if engine.dead:
            return
        t = self.turns
        events: list[Event] = []
        for gone, _ in dropped:
            held = engine.stored.pop(gone, 0)
            if held:
                events.append(Removed(array("Q", _names(gone, 0, held)), MEDIUM_GPU))
        if system not in engine.systems:
            engine.systems.add(system)
            names = array("Q", (SYSTEM_NAME | system << 22 | b for b in range(t.system_blocks)))
            events.append(
                Stored(names, None, t.systems[system][: t.system_blocks * t.block], t.block, MEDIUM_GPU, None, None)
            )
        now = max(0, cached // t.block - t.system_blocks)
        held = engine.stored.get(session, 0)
        if now > held:
            parent = _name(session, held - 1) if held else SYSTEM_NAME | system << 22 | (t.system_blocks - 1)
            ids = t.ids(session, system, (t.system_blocks + now) * t.block)[(t.system_blocks + held) * t.block :]
            events.append(Stored(array("Q", _names(session, held, now)), parent, ids, t.block, MEDIUM_GPU, None, None))
            engine.stored[session] = now
        if events:
            self._publish(replica_id, engine, events)

    def _publish(self, replica_id: str, engine: Engine, events: list[Event]) -> None:
        batch = Batch(engine.seq, self.loop.time(), 0, tuple(events), True)
        engine.seq += 1
        engine.buffer.append(batch)
        if len(engine.buffer) > engine.keep:
            engine.buffer.popleft()
        self.figures.published += 1
        if self.loss and self.rng.random() < self.loss:
            self.figures.lost += 1
            return
        self.loop.call_at(self.loop.time() + self.delay_s, self._arrive, (replica_id, batch))

    def _arrive(self, payload: tuple[str, Batch]) -> None:
        replica_id, batch = payload
        engine = self.engines.get(replica_id)
        if engine is None or replica_id not in self.holdings:
            return  # no longer followed
        engine.inbox.append(batch)
        if not engine.applying:  # one subscriber a replica: its messages applied in order
            engine.applying = True
            self.loop.spawn(self._apply(replica_id, engine))

    async def _apply(self, replica_id: str, engine: Engine) -> None:
        holdings = self.holdings[replica_id]

        async def fill(wanted: int) -> bool:
            await self.loop.sleep(self.replay_s)  # the replay socket's round trip
            return holdings.filled([b for b in engine.buffer if b.seq >= wanted], wanted)

        while engine.inbox:
            batch = engine.inbox.popleft()
            if await take(holdings, batch, fill):
                self.figures.applied += 1
        engine.applying = False

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet: the router follows it no more."""
        self.holdings.pop(replica_id, None)

    def report(self) -> dict[str, Any]:
        f = self.figures
        h = list(self.holdings.values())
        return {
            "published": f.published,
            "lost": f.lost,
            "applied": f.applied,
            "gaps": sum(x.figures.gaps for x in h),
            "replayed": sum(x.figures.replayed for x in h),
            "unsure_episodes": sum(x.figures.unsure_episodes for x in h),
            "orphans": sum(x.figures.orphans for x in h),
            "believed_at_end": sum(x.sure for x in h),
            "followed_at_end": len(h),
        }


def _name(session: int, block: int) -> int:
    """The engine's name of a conversation's own block (counted past the system prompt)."""
    return (session + 1) << 22 | block


def _names(session: int, start: int, end: int) -> range:
    first = _name(session, start)
    return range(first, first + end - start)
