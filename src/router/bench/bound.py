"""The limit of a fleet run: the KV hit rate no router could beat on its request sequence, and a TTFT floor.

However a router places requests, a fleet of N replicas with C KV blocks each caches no more than
one cache of N x C blocks would, and no cache does better on a known sequence than Belady's
eviction (evict the block whose next use is farthest away; Belady 1966). So the bound replays a
run's requests, in the order they were sent, through one cache of the fleet's whole KV:

- a request's hit is the longest run of its leading blocks the cache holds (a prefix cache hits no
  block after a miss), at most `(prompt tokens - 1) // block_size` blocks (the engine always
  computes the last token), as the emulated engine counts it;
- then its prompt's blocks are in the cache, and once it is answered its reply's too (the emulator
  caches a reply's blocks as decoding fills them: a conversation's next turn hits them), each with
  the index of the next request whose prompt holds it;
- over capacity, the block whose next use is farthest goes first; among blocks next used by the
  same request, the deepest of its chain (a child is never kept over its parent: a block after a
  missing one is worth nothing).

Queueing, the blocks running requests pin and the replies' room are ignored: each makes the bound
higher, never lower, so a contender's hit rate over it (`share of the bound`) is at most 1.

The TTFT floor: each request alone on an idle engine of the fleet's shape, its uncached tokens
(those the bound's cache missed) prefilled in chunks of `max_num_batched_tokens`, each step
`step_base_s + attention_per_token_s x context + chunk / prefill_tokens_per_s`: no router can
give that request its first token sooner.

The hit rate is over the requests answered, each prompt's tokens as the emulator counts them (as the
contenders' hit rates are over their answers' usage).

Worked example, capacity 3 blocks, block size 16: requests A = [a1 a2 a3], B = [b1], A' = [a1 a2
a3 a4] (each prompt one token past its blocks). A misses all three; B misses, and the cache must
drop one of a1..a3 or b1: b1 is never used again, so b1 goes; A' hits a1 a2 a3 (48 tokens). LRU
would have dropped a1 and hit nothing.

Only runs on router-emulator fleets are bounded: the prompts' blocks are the emulator's 4-byte
tokens (router.kvevents.emulator_tokens); a real engine's tokenizer would have to run here.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from router.emulator.engine import EngineConfig
from router.kvevents.emulator_tokens import block_hashes, count_tokens, render_chat
from router.measures import latency_summary

NEVER = 1 << 62  # the next use of a block no later request holds


@dataclass
class Sent:
    """One request as the bound sees it: its prompt's blocks and tokens; or, with `answered`, the
    blocks its answer leaves cached (prompt and reply) once it ends."""

    chain: array[int]
    tokens: int
    answered: bool = False


class BoundTrace:
    """The requests of a run and their answers, in the order they were sent and ended, cut into the
    emulator's blocks; `sent` is the requests alone, in order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[Sent] = []
        self.sent: list[Sent] = []
        self._prompts: dict[int, bytes] = {}  # requests in flight: their prompt, for their answer's chain

    def add(self, path: str, body: Mapping[str, Any]) -> int:
        """A request about to be sent (path /v1/chat/completions or /v1/completions); its number."""
        try:
            if path.endswith("/chat/completions"):
                text: Any = render_chat(body["messages"])
            else:
                prompt = body.get("prompt")
                text = prompt[0] if isinstance(prompt, list) else prompt
            data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else b""
        except (KeyError, ValueError, TypeError):
            data = b""
        request = Sent(array("Q", block_hashes(data, self.block_size)), count_tokens(data))
        self.events.append(request)
        self.sent.append(request)
        self._prompts[len(self.sent) - 1] = data
        return len(self.sent) - 1

    def ended(self, number: int, reply: str | None) -> None:
        """Request `number` ended: with its reply's text, or None (it failed: nothing more cached)."""
        prompt = self._prompts.pop(number, b"")
        if reply:
            data = prompt + reply.encode("utf-8", "surrogatepass")
            self.events.append(Sent(array("Q", block_hashes(data, self.block_size)), count_tokens(data), True))


def belady_hits(events: Sequence[Sent], capacity_blocks: int, block_size: int) -> list[int]:
    """Each request's cached tokens in one cache of `capacity_blocks` with Belady's eviction, over
    `events` (requests sent, and answers that leave their blocks cached) in their order."""
    # each block's next use (the next request that holds it) after event i, computed backwards
    next_use: list[list[int]] = [[] for _ in events]
    seen: dict[int, int] = {}
    for i in range(len(events) - 1, -1, -1):
        chain = events[i].chain
        next_use[i] = [seen.get(key, NEVER) for key in chain]
        if not events[i].answered:
            for key in chain:
                seen[key] = i
    held: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block): the farthest, then the deepest, first
    hits: list[int] = []
    for i, request in enumerate(events):
        chain = request.chain
        if not request.answered:
            limit = max(0, (request.tokens - 1) // block_size)
            hit = 0
            while hit < len(chain) and hit < limit and chain[hit] in held:
                hit += 1
            hits.append(hit * block_size)
        for depth, key in enumerate(chain):
            nxt = next_use[i][depth]
            held[key] = nxt
            heapq.heappush(heap, (-nxt, -depth, key))
        while len(held) > capacity_blocks and heap:
            neg, _, key = heapq.heappop(heap)
            if held.get(key) == -neg:  # else a stale entry: the block was used again since
                del held[key]
    return hits


def ttft_floor(uncached: int, context: int, engine: EngineConfig) -> float:
    """Engine seconds to the first token of a request alone on an idle engine: its `uncached`
    tokens prefilled in chunks after `context` cached ones."""
    left, done, seconds = max(1, uncached), context, 0.0
    while left > 0:
        chunk = min(left, engine.max_num_batched_tokens)
        done += chunk
        left -= chunk
        seconds += engine.step_base_s + engine.attention_per_token_s * done + chunk / engine.prefill_tokens_per_s
    return seconds


def bound_figures(
    trace: BoundTrace, counted: Sequence[bool], later: Sequence[bool], replicas: int, engine: EngineConfig
) -> dict[str, Any]:
    """The bound of a run: the hit rate over the requests `counted` (those answered, as the
    contender's hit rate counts them), and the TTFT floor's P50/P99 over them and over `later`
    turns."""
    hits = belady_hits(trace.events, replicas * engine.num_blocks, trace.block_size)
    hit = prompt = 0
    floors: list[float] = []
    later_floors: list[float] = []
    for sent, cached, ok, is_later in zip(trace.sent, hits, counted, later, strict=False):
        if not ok:
            continue
        hit += cached
        prompt += sent.tokens
        floor = ttft_floor(sent.tokens - cached, cached, engine)
        floors.append(floor)
        if is_later:
            later_floors.append(floor)
    return {
        "bound_hit_rate": hit / prompt if prompt else math.nan,
        "ttft_floor_s": latency_summary(floors),
        "ttft_floor_later_s": latency_summary(later_floors),
        "capacity_blocks": replicas * engine.num_blocks,
        "requests": len(trace.sent),
        "answers": len(trace.events) - len(trace.sent),
    }


__all__ = ["BoundTrace", "Sent", "belady_hits", "bound_figures", "ttft_floor"]
