"""`ttft` (default): the replica whose first token would come soonest, from what it holds and what it has queued.

For each routable replica not yet tried, router.placement prices the request in seconds of time
to first token: the wait for the prefill already sent there (and queued by others, and its decode
load) plus this prompt's tokens it does not hold, at its learnt prefill speed — counted once more
for each request running there, which that prefill delays — plus, for a conversation new to it,
the traffic it recently got above the fleet's mean (router.placement has the formula). What it holds comes
from the prefix index (blocks the router sent there, corrected by the `cached_tokens` it reports);
the replica a session was served on last holds that session's whole history, its replies too.

1. Gate: a replica with more in flight than max(ceil(ttft_gate_c x (in flight + 1) / replicas),
   ceil((in flight + 1) / replicas) + bounded_load_floor) — capped by its capacity while another
   has a free slot, as for `affinity` — is not a candidate while another is (the slack over the
   mean is absolute, so a surge that loads every replica spills no session over a few requests).
   Cache alone never draws traffic onto a replica already far past the fleet (the "death
   spiral" of routers that send every miss to the emptiest cache).
2. The cheapest candidate wins. Costs within max(`ttft_tie_s`, `ttft_tie_share` x the cheapest)
   of it are equal — a shared system prompt held on one replica is not a reason to send every new
   conversation there: the session's last replica among them keeps it, else the least full of
   them, else the first of those clockwise on the ring from the key: an idle fleet places new
   sessions as consistent hashing would (routers with no shared state agree), never by list order.
3. A keyless request's home (the replica holding at least half its prompt) keeps it unless another
   costs less than 1 / (1 + `ttft_stay_share`) of its cost: a move leaves a cache behind, and
   near-equal guesses are noise. A new conversation's (`Prompt.opening`: no assistant turn yet)
   home must hold some of its last message (another reader of the same document, sent ahead of
   it): one holding only its messages before the last holds a prefix others sent (a shared system
   or tool prompt), and the spread term, not a stay margin, decides whether that draws it there.
4. A keyed session's replica, while it is not past the gate, keeps the session unless the time a
   move saves this turn pays for what the move costs the fleet (`move_price`):

       cost(home) - cost(other) > ttft_stay_share x cost(other) + ttft_move_weight x price
       price = history x s/token x (1 + behind) + (history - free)+ x s/token

   where history = uncached(other) - uncached(home) is the session's context computed again
   there, behind the requests in flight there and those others queued there (probed), each of
   which waits for that recompute, free the room left in that replica's LRU (past it, the history
   evicts as much of other conversations' context, recomputed when they come back), and s/token
   its learnt prefill speed. A session that moved so (reason `cost`) makes no other such move for
   `ttft_move_cooldown_s`, and none back to the replica it left while the router remembers the
   move (`sticky_ttl_s`): a conversation does not flip between two replicas on guesses. Spills
   (its replica past the gate) and retries move it as before.
5. A hot shared prefix gains a second holder by itself: once its holder's queue costs more than
   recomputing the prefix elsewhere, the next request goes elsewhere, and that replica holds it too.

Worked example, 10,000 tokens a second everywhere, a 2,000-token history: its replica has 0.5 s
of prefill queued, another is idle but its KV cache is full. Staying costs 0.5 s, moving 0.2 s
(the recompute), and the move's price is 0.2 s of recompute plus 0.2 s of others' context it
evicts: 0.5 - 0.2 = 0.3 s saved is less than 1 x 0.2 + 1 x 0.4, so the session stays (it moved
before, 0.5 s being more than twice 0.2 s). With 5 s queued it moves (4.8 s saved). With the other
replica's cache half empty and three requests queued there instead, the price is 0.2 x 4 = 0.8 s.

A request that asks for its first token within a target (x-slo-ttft-ms) is placed as above
where that replica's predicted time meets it, else on the fastest replica that meets it (reason
`target`: a session moves for it, with no cool-down), else as above, marked late (the journey
turns a `sheddable` one away with a 429 instead; router.proxy.journey).

A session jumps only when moving pays as above (reason `cost`), when its replica is past the gate
(`spill`), when it asks for a target only another meets (`target`), or on a retry (`failover`).
One whose replica cannot take it goes where a new conversation would, with reason `ring`
(router.routing counts its jump by that replica's state: gone, draining, out of routing), or
`spill` where that replica is routable yet no candidate (full, or not serving the model).
Requests whose prompt the index cannot use (no whole block: an embedding of a word, an empty
prompt) are placed as by `affinity`.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Self

from router.config import RouterConfig
from router.config.groups import PlacementSettings, RingSettings, SessionSettings
from router.fleet import Fleet, ReplicaState
from router.keys import RoutingKey
from router.placement import Answer, Candidate, Placed, Placement, Prediction, Priced
from router.policy.affinity import Affinity
from router.policy.base import Decision, Explained, Policy, clockwise
from router.prompt import Prompt

HOME_SHARE = 0.5  # a keyless conversation's home holds at least this share of its prompt (not only an opening)
# the reasons for placing a request by its prompt where no session says where it lives: for a key
# that is a fingerprint (its first message), a jump so placed counts as `prefix` (no session id
# says it is one conversation: another may open alike)
PLACED = frozenset({"cost", "prefix", "ring"})


@dataclass(frozen=True, slots=True)
class Move:
    """A keyed session sent away from its replica by cost: when, from where, to where."""

    at: float  # the placement's clock
    left: str  # the replica it left
    to: str  # the replica it was sent to (the move took only if its next turn says it was served there)


class PlacementHearing:
    """A route's attempts, told to the prefix index and the prefill queues (router.placement): a
    priced attempt's blocks and queue time there from the moment it is sent, undone if it fails
    before its first byte, checked against its answer's usage; every attempt's end (a replica
    with nothing left in flight has nothing queued)."""

    __slots__ = ("left", "placed", "placement", "prompt")

    def __init__(self, placement: Placement, prompt: Prompt | None) -> None:
        self.placement = placement
        self.prompt = prompt
        self.placed: tuple[ReplicaState, Placed] | None = None  # what the latest priced attempt expected there
        self.left: tuple[str, array[int]] | None = None  # the blocks its latest ended attempt left, and where

    def sent(self, replica: ReplicaState, decision: Decision, now: float) -> None:
        if self.prompt is not None and decision.cost is not None:
            self.placed = (replica, self.placement.sent(replica, self.prompt, decision.cost, now))

    def _there(self, replica: ReplicaState) -> Placed | None:
        placed = self.placed
        return placed[1] if placed is not None and placed[0] is replica else None

    def released(self, replica: ReplicaState, now: float) -> None:
        placed = self._there(replica)
        if placed is not None and placed.coming is not None:
            self.left = placed.coming  # (released, it expects nothing more there)
        self.placement.released(replica, now, placed)

    def called_tools(self, replica: ReplicaState) -> None:
        left = self.left
        if left is not None and left[0] == replica.id:
            self.placement.truth.tools(*left)

    def failed(self, replica: ReplicaState) -> None:
        placed = self._there(replica)
        if self.prompt is not None and placed is not None:
            self.placement.failed(replica, self.prompt, placed)
            self.placed = None

    def answered(self, replica: ReplicaState, answer: Answer) -> Prediction | None:
        if self.prompt is None:
            return None
        return self.placement.answered(replica, self.prompt, self._there(replica), answer)

    def blocks_held(self, replica: ReplicaState) -> int:
        return self.placement.blocks_held(replica.id)


class Ttft(Policy):
    name = "ttft"
    keyed = True
    reads_prompts = True

    def __init__(
        self, fleet: Fleet, ring: RingSettings, placement: PlacementSettings, sessions: SessionSettings
    ) -> None:
        """`sessions`: how long and how many sessions are kept (its moves are remembered as long)."""
        super().__init__(fleet, ring)
        self.placement: Placement = Placement(fleet, placement, ring.bounded_load_floor, self.clock)
        self.fallback = Affinity(fleet, ring)
        self.fallback.passes_over = "ring"  # a keyed session left behind counts by its replica's state
        self.stay_share = placement.ttft_stay_share
        self.move_weight = placement.ttft_move_weight
        self.cooldown_s = placement.ttft_move_cooldown_s
        # the sessions moved by cost, oldest first: no move again within the cool-down, none back
        # while remembered (as long as a session entry lives, and as many)
        self.moves: dict[bytes, Move] = {}
        self.moves_ttl_s = max(sessions.sticky_ttl_s, self.cooldown_s)
        self.moves_kept = sessions.sticky_max_sessions

    @classmethod
    def from_config(cls, fleet: Fleet, config: RouterConfig) -> Self:
        return cls(fleet, config.ring, config.placement, config.sessions)

    def use_clock(self, clock: Callable[[], float]) -> None:
        super().use_clock(clock)
        self.placement.clock = clock  # its prefill queues run on the same clock
        self.placement.truth.use_clock(clock)  # ... and what its engines evict

    def hear(self, key: RoutingKey) -> PlacementHearing:
        return PlacementHearing(self.placement, key.prompt)

    def pick(
        self,
        key: RoutingKey,
        last: str | None,
        exclude: Collection[int],
        *,
        parent: bool = False,
        target_s: float | None = None,
    ) -> Decision | None:
        prompt = key.prompt
        if prompt is None:
            decision = self.fallback.pick(key, last, exclude)
        else:
            decision, priced = self.decide(key, prompt, last, exclude)
            if target_s is not None and decision is not None:
                decision = self.within(decision, priced, target_s)
            if (
                decision is not None
                and decision.reason == "cost"
                and last is not None
                and not parent  # a sub-agent's first turn leaving its parent's replica: no session moved
                and self.evidence(key, last)
            ):
                # a keyed session leaves a replica that could have kept it (only `pick` remembers:
                # /admin/route's explanations send nothing)
                self._moved(key.key, Move(self.placement.clock(), last, self.fleet.replicas[decision.index].id))
        return self._counted(key, decision)

    def within(self, decision: Decision, priced: Priced, target_s: float) -> Decision:
        """After `decide` (`priced`: its rows): a request that asks for its first token within `target_s` goes where the
        prediction meets it: the replica decided on if it does, else the fastest that does (reason
        `target`, not past the gate where one is not); where none does, the decision stands,
        marked `late` (the journey turns a sheddable request away rather than serve it late)."""
        chosen = decision.cost
        if chosen is None or chosen.ttft_s <= target_s:
            return decision
        rows = priced.rows()
        fastest = min(rows, key=lambda c: (c.gated, c.ttft_s))
        if fastest.ttft_s <= target_s:
            return Decision(fastest.index, "target", fastest)
        return replace(decision, late=True)

    @staticmethod
    def _counted(key: RoutingKey, decision: Decision | None) -> Decision | None:
        """`decision`, a jump it causes counted as `prefix` where the key is a fingerprint and the
        request was placed by its prompt: the replica the key went to last may have served another
        conversation that opens alike, so it is no session moving."""
        if decision is not None and key.kind == "prefix" and decision.reason in PLACED:
            return replace(decision, jump="prefix")
        return decision

    def explain(self, key: RoutingKey, last: str | None) -> Explained:
        """As `pick` would decide a first attempt (no move remembered), with every candidate's
        predicted cached tokens, wait and cost."""
        prompt = key.prompt
        if prompt is None:
            return Explained(self._counted(key, self.fallback.pick(key, last, ())))
        decision, priced = self.decide(key, prompt, last, (), every_row=True)
        fleet, placement = self.fleet, self.placement
        candidates = priced.rows() if decision is not None else []
        details = {
            "blocks": len(prompt.chain),
            "prompt_tokens": (
                prompt.tokens.count if prompt.tokens is not None else round(prompt.nbytes / placement.bytes_per_token)
            ),
            "candidates": [
                {
                    "replica": fleet.replicas[c.index].id,
                    "cached_tokens": round(c.cached_tokens),
                    "cached_from": c.source,  # its engine's KV events, or the model
                    "uncached_tokens": round(c.uncached_tokens),
                    "wait_s": round(c.wait_s, 6),
                    "cost_s": round(c.cost_s, 6),
                    "spread_s": round(c.spread_s, 6),
                    "evicts_s": round(c.evicts_s, 6),  # what it pushes out of conversations likely back
                    "gated": c.gated,
                    "prefill_tokens_per_s": round(1 / placement.of(fleet.replicas[c.index]).seconds_per_token),
                }
                for c in sorted(candidates, key=lambda c: c.cost_s)
            ],
        }
        return Explained(self._counted(key, decision), details)

    @staticmethod
    def evidence(key: RoutingKey, last: str | None) -> str | None:
        """Where a session's history lives, if the key says so: a fingerprint (the first message)
        is shared by every conversation that opens alike, so it proves nothing; the index knows."""
        return last if key.kind in ("header", "body") else None

    def decide(
        self, key: RoutingKey, prompt: Prompt, last: str | None, exclude: Collection[int], every_row: bool = False
    ) -> tuple[Decision | None, Priced]:
        """The decision (its `cost` the chosen replica's row), and the price it was made from (every
        candidate's row, for a target's second choice and /admin/route; with `every_row`, what it
        would evict there priced on every row, not only where the decision reads it)."""
        fleet = self.fleet
        placement = self.placement
        tried = exclude
        exclude = self.avoiding(key, exclude)  # and the replicas not serving its model
        last_index = self.session_replica(self.evidence(key, last), exclude)
        # a conversation's home: a keyed session's replica, else the one holding most of the prompt
        staying = self.stay_share and last_index is None
        priced = placement.price(
            prompt,
            exclude,
            last_index,
            placement.clock(),
            HOME_SHARE if staying else -1.0,
            cold=fleet.adapter_cold(key.model),
            every_row=every_row,
        )
        best, holding = priced.best, priced.holding
        if best == -2:
            return None, priced
        if holding >= 0 and prompt.opening and priced.row(holding).cached_tokens <= placement.history_tokens(prompt):
            holding = -1  # a new conversation's home holds its own last message, not only a prefix others sent
        tie = priced.ties > 1
        if best == -1:  # every one past the gate: the least full of them (a queue still beats an error)
            rows = priced.rows()
            best = min(rows, key=lambda c: (fleet.fullness(c.index), c.cost_s)).index
        elif tie:
            # within the tie margin: the session's replica, else the least full, else the ring
            close = priced.near()
            if last_index in close:
                best = last_index
            else:
                fewest = min(fleet.fullness(i) for i in close)
                least = {i for i in close if fleet.fullness(i) == fewest}
                ring_key = key.key if key.kind != "none" else prompt.chain.tobytes()[:8]
                best = next((i for i in clockwise(fleet.ring, ring_key) if i in least), min(least))
        if last_index is not None:
            # a keyed session's replica keeps it unless the move pays for what it costs the fleet
            home = priced.row(last_index)
            if best != last_index and not home.gated and self.keeps(key.key, priced, last_index, best):
                best = last_index
        elif self.stay_share and holding >= 0 and holding != best and priced.stays(holding, best, self.stay_share):
            # the replica that holds a keyless conversation keeps it unless moving saves a real share
            # of its cost: a move costs the cache it leaves behind, and near-equal guesses are noise
            best = holding
        chosen = priced.row(best)
        orphan = None
        if last_index is None and (session := self.evidence(key, last)) is not None:
            previous = fleet.find(session)
            orphan = previous is not None and previous.index is not None and fleet.routable(previous.index)
        return Decision(best, self._reason(chosen, last_index, tried, priced, tie, orphan), chosen), priced

    def keeps(self, session: bytes, priced: Priced, home: int, other: int) -> bool:
        """Priced so: the session's replica `home` (not past the gate) keeps it from the cheaper
        `other`: the move is within the session's cool-down, or back to the replica it left, or
        saves less than `ttft_stay_share` of the other's cost plus `ttft_move_weight` times its
        price to the fleet (`move_price`)."""
        placement, replicas = self.placement, self.fleet.replicas
        move = self._move_of(session, replicas[home].id, placement.clock())
        if move is not None and (placement.clock() - move.at < self.cooldown_s or replicas[other].id == move.left):
            return True
        stay, there = priced.row(home), priced.row(other)
        saving = stay.cost_s - there.cost_s
        return saving <= self.stay_share * there.cost_s + self.move_weight * self.move_price(stay, there)

    def move_price(self, stay: Candidate, there: Candidate) -> float:
        """Seconds of the fleet's time a session's move from `stay` to `there` costs beyond its own
        first token (rows of the latest `price`): the history it recomputes there, once for itself
        and once for each request in flight or queued there, which waits for it; and the tokens of
        other conversations' context it pushes out of that KV cache (the history past the free room
        of the replica's LRU), recomputed when they come back. At that replica's prefill speed."""
        placement, fleet = self.placement, self.fleet
        replica = fleet.replicas[there.index]
        held = placement.of(replica)
        spt = held.seconds_per_token
        history = max(there.uncached_tokens - stay.uncached_tokens, 0.0)
        load = fleet.loads[there.index]
        waiting = replica.engine.waiting
        behind = load + max((waiting or 0) - load, 0)  # as priced: what others queued there beyond ours
        block_tokens = placement.block_bytes / placement.bytes_per_token
        free = max(held.blocks - placement.blocks_held(replica.id), 0) * block_tokens  # its LRU's room
        return history * spt * (1 + behind) + max(history - free, 0.0) * spt

    def _move_of(self, session: bytes, serving: str, now: float) -> Move | None:
        """The session's remembered move, if it took (it is served where it was sent) and is not
        forgotten yet."""
        move = self.moves.get(session)
        if move is None:
            return None
        if move.to != serving or now - move.at > self.moves_ttl_s:
            del self.moves[session]  # it did not take (a retry went elsewhere), or it is old
            return None
        return move

    def _moved(self, session: bytes, move: Move) -> None:
        moves = self.moves
        moves.pop(session, None)  # (to the end: the dict is oldest first)
        moves[session] = move
        while moves:
            oldest = next(iter(moves.values()))
            if len(moves) <= self.moves_kept and move.at - oldest.at <= self.moves_ttl_s:
                break
            del moves[next(iter(moves))]

    @staticmethod
    def _reason(
        chosen: Candidate,
        last_index: int | None,
        exclude: Collection[int],
        priced: Priced,
        tie: bool,
        orphan: bool | None,
    ) -> str:
        """`orphan`: for a keyed session whose replica is no candidate, whether that replica is
        routable (None for every other request)."""
        if exclude:
            return "failover"
        if last_index is not None:
            if chosen.index == last_index:
                return "sticky"
            return "spill" if priced.row(last_index).gated else "cost"
        if orphan is not None:
            # a keyed session whose replica cannot take it: no cost of this policy moved it; its
            # jump counts by that replica's state (router.routing: gone, draining, out of routing),
            # or as a spill where it is in routing yet no candidate (full, or not serving the model)
            return "spill" if orphan else "ring"
        if chosen.cached_tokens > 0:
            return "prefix"
        return "ring" if tie else "cost"
