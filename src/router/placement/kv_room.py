"""Room in the replicas' KV caches: which replicas their requests in flight fill, and how long a request waits there.

An engine admits a request only once its blocks fit. The router counts, per replica, the tokens of
its requests in flight (their prompts and the mean reply: `Held.kv_tokens`); past its KV capacity
C, a request of r tokens waits (in flight + r - C) / C x the fleet's mean reply time (a cache's
worth of requests finishes every reply). Only the replicas within KV_NEAR of full are looked at
when pricing (`bound`), so a fleet with room costs nothing here.
"""

from __future__ import annotations

from array import array

from router.placement.learnt import Learnt
from router.placement.records import Held
from router.placement.rows import Rows

KV_NEAR = 0.9  # a replica whose requests in flight and one more fill this share of its KV cache is checked


class KvRoom:
    def __init__(self, learnt: Learnt, rows: Rows, block_bytes: int, wait: bool) -> None:
        self.learnt = learnt
        self.rows = rows
        self.block_bytes = block_bytes
        self.wait = wait  # ttft_kv_wait: a replica whose requests in flight fill its KV cache costs the wait
        self.full: dict[int, Held] = {}  # replicas whose requests in flight (nearly) fill their KV cache, by holder

    def capacity(self, held: Held) -> float:
        """Tokens its KV cache holds (its engine's figure, else the configured one)."""
        return held.engine_blocks * self.block_bytes / self.learnt.bytes_per_token

    def mark(self, held: Held) -> None:
        """Keep `held` among the replicas `bound` looks at while its requests in flight and one
        more of the usual size would not fit its KV cache."""
        learnt = self.learnt
        if held.kv_tokens + learnt.mean_prompt + learnt.mean_output > self.capacity(held) * KV_NEAR:
            self.full[held.holder] = held
        else:
            self.full.pop(held.holder, None)

    def wait_s(self, held: Held, request_tokens: float) -> float:
        """How long a request of `request_tokens` (prompt and reply) waits at `held` for room in
        its KV cache: an engine admits a request only once its blocks fit, so past the capacity C
        the queue drains as running requests finish, C tokens every reply time (the fleet's mean
        time from a reply's first token to its last). 0 while they fit, or before any reply was timed."""
        reply_s = self.learnt.reply_s
        if not self.wait or reply_s is None:
            return 0.0
        capacity = self.capacity(held)
        over = held.kv_tokens + request_tokens - capacity
        return over / capacity * reply_s if over > 0 else 0.0

    def bound(self, busy: array[float], now: float, request_tokens: float) -> array[float]:
        """`busy` (by position) with each KV-bound replica's prefill queue drained no sooner than
        its KV wait: `busy` itself where none waits, else a copy."""
        if not (self.full and self.wait):
            return busy
        out = busy
        for held in self.full.values():
            if not self.rows.holds(held):
                continue
            wait = self.wait_s(held, request_tokens)
            pos = held.pos
            if wait > 0 and now + wait > out[pos]:
                if out is busy:
                    out = array("d", busy)
                out[pos] = now + wait
        return out


__all__ = ["KV_NEAR", "KvRoom"]
