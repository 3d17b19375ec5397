"""Prefill/decode disaggregation: an attempt that prefills on a prefill replica and decodes on the
replica the route chose.

The route (router.routing) chooses among the decode replicas (and aggregated ones), as for any
request: a conversation's turns stay on one decode replica, whose cache holds its blocks too. Then
`DisaggAttempts.send`, in place of a plain attempt:

- serves the request there alone when it is not worth splitting: an API the engines' connectors do
  not see (router.handoff.SPLITTABLE), or fewer than `min_tokens` left to prefill there: the prompt
  less what the prefix index predicted the decode replica holds when ttft chose it, so a short
  prompt and a conversation's next turn on the replica that holds its history stay whole (a prefill
  that small costs less than a transfer's round trip);
- else asks a prefill replica (`PrefillPool`: `ttft`'s pick over the prefill fleet, the one whose
  first token would come soonest from the prefix index of what each holds and their prefill
  queues, so a document is prefilled where it was before) for the prompt's KV
  with the protocol's prefill body (router.handoff), a failed one on the next, and sends the decode
  replica the client's body with the params that came back; its answer is relayed as any other;
- falls back to decoding alone (the decode replica recomputes the prompt) when no prefill replica
  answers with params, and when the decode replica fails the transfer (the lease ran out, or the
  prefill replica went away: vLLM answers a 5xx, or in a stream its opening event then an error
  event, so a split stream is held until its second event): a failed transfer is never the
  client's error while a replica can still answer;
- sends a decode that timed out before its first byte to the same replica again without params:
  a read from a prefill replica that died can hang on real vLLM, with no error, and the lease
  (30 s) has likely run out by the first-byte time-out;
- keeps the params of a decode that failed before its first byte otherwise (unreachable, reset):
  the journey's next decode replica reads the same lease, and no prefill is redone.

A broken decode stream is resumed as any other (router.proxy.resume), aggregated.

A split request's outcome carries its legs for the ledger (router.proxy.ledger): its `Split`
(router.proxy.forward) says which replica prefilled it, how long that took, and when, after its
arrival, the decode was sent: its transfer leg is from there to the decode's first byte, its
decode leg from there to the last.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from router.fleet import Fleet, ReplicaState
from router.handoff import SPLITTABLE, Handoff
from router.keys import RoutingKey
from router.policy import Decision, Policy
from router.prompt import BYTES_PER_TOKEN
from router.proxy.attempts import HttpAttempts
from router.proxy.forward import Outcome, Retry, Split, Timeouts, Trip
from router.proxy.sse import StreamFramer
from router.ring import xxh3_64
from router.upstream import Upstream, UpstreamError

LEASE_S = 30.0  # vLLM's kv_lease_duration: how long a prefill's params stay worth retrying with
AFFINITY_BLOCKS = 4  # the prompt's first blocks choose its prefill replica


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A prompt's prefill: the params its decode reads the KV with, where it was done, and how long it took."""

    params: dict[str, Any]
    replica: str
    seconds: float


class PrefillPool:
    """The prefill replicas, in a fleet of their own (probed and scored as any other), ordered per
    request. With a `policy` over that fleet (`ttft`: a prefix index of what each prefill replica
    holds, fed by their KV-cache events where they publish them, and their prefill queues): its
    picks, the one whose first token would come soonest first. Without one, or for a request
    without a prompt's blocks: by the prompt's leading blocks (highest random weight, so the same
    document goes to the same replica and a replica leaving moves only its own), those loaded past
    their share last."""

    def __init__(self, fleet: Fleet, policy: Policy | None = None, slack: float = 1.25) -> None:
        self.fleet = fleet
        self.policy = policy
        self.slack = slack

    def order(self, key: RoutingKey, limit: int) -> list[tuple[ReplicaState, Decision | None]]:
        fleet = self.fleet
        prompt = key.prompt
        if self.policy is not None and prompt is not None and len(prompt.chain):
            picked: list[tuple[ReplicaState, Decision | None]] = []
            tried: set[int] = set()
            while len(picked) < limit:
                decision = self.policy.pick(key, None, tried)
                if decision is None:
                    break
                picked.append((fleet.replicas[decision.index], decision))
                tried.add(decision.index)
            return picked
        skip = fleet.not_serving(key.model)
        ready = [r for r in fleet.replicas if r.health.routable and r.index not in skip]
        if not ready:
            return []
        if prompt is not None and len(prompt.chain):
            anchor = int(prompt.chain[min(len(prompt.chain), AFFINITY_BLOCKS) - 1]).to_bytes(8, "little")
        else:
            anchor = key.key
        ranked = sorted(ready, key=lambda r: xxh3_64(anchor + r.id.encode()), reverse=True)
        share = math.ceil(self.slack * (sum(r.inflight for r in ready) + 1) / len(ready))
        order = [r for r in ranked if r.inflight < share] + [r for r in ranked if r.inflight >= share]
        return [(r, None) for r in order[:limit]]


class DisaggAttempts:
    """Attempts that split a request between a prefill replica and the route's decode replica
    (this module's docstring); `observe(mode)` hears how each request was served (split, alone,
    fallback, recomputed)."""

    def __init__(
        self,
        inner: HttpAttempts,
        pool: PrefillPool,
        protocol: Handoff,
        min_tokens: int,
        timeouts: Timeouts,
        observe: Callable[[str], None] | None = None,
        max_prefills: int = 2,
    ) -> None:
        self.inner = inner
        self.pool = pool
        self.protocol = protocol
        self.min_tokens = min_tokens
        self.timeouts = timeouts
        self.observe = observe or (lambda mode: None)
        self.max_prefills = max_prefills
        # a decode that failed before its first byte: its params, for the journey's next decode
        # replica, by request (its exchange's identity and arrival), until the lease runs out
        self._kept: dict[tuple[int, float], tuple[float, Prefilled]] = {}

    def split(self, replica: ReplicaState, trip: Trip, decision: Decision | None) -> bool:
        """Whether the request is worth splitting: what `replica` would prefill alone (what the
        decision that chose it predicted: its prompt less what the prefix index says it holds;
        else the whole prompt, estimated) is at least `min_tokens`."""
        intake = trip.intake
        if intake.api.name not in SPLITTABLE or not self.pool.fleet.replicas:
            return False
        if decision is not None and decision.cost is not None and decision.index == replica.index:
            return decision.cost.uncached_tokens >= self.min_tokens
        prompt = intake.key.prompt
        tokens = int((prompt.nbytes if prompt is not None else len(intake.raw)) // BYTES_PER_TOKEN)
        return tokens >= self.min_tokens

    def send(
        self, replica: ReplicaState, trip: Trip, deadline: float, decision: Decision | None = None
    ) -> Awaitable[Retry | Outcome]:
        if not self.split(replica, trip, decision):
            self.observe("alone")
            return self.inner.send(replica, trip, deadline)
        return self._split(replica, trip, deadline)

    def resume(
        self, replica: ReplicaState, trip: Trip, body: bytes, deadline: float, outcome: Outcome, splicer: StreamFramer
    ) -> Awaitable[Retry | None]:
        return self.inner.resume(replica, trip, body, deadline, outcome, splicer)

    async def _split(self, replica: ReplicaState, trip: Trip, deadline: float) -> Retry | Outcome:
        body = orjson.loads(trip.intake.raw)  # as forwarded (usage asked for where the router strips it)
        request = (id(trip.exchange), trip.t0)
        kept = self._kept.pop(request, None)
        prefilled = kept[1] if kept is not None and kept[0] > time.monotonic() else None
        if prefilled is None:
            prefilled = await self._prefill(trip, body, deadline)
            self.observe("split" if prefilled is not None else "fallback")
        if prefilled is None:
            return await self.inner.send(replica, trip, deadline)  # decoded alone: it recomputes the prompt
        raw = orjson.dumps(self.protocol.decode_body(body, prefilled.params))
        decoding = replace(trip, intake=replace(trip.intake, raw=raw))
        sent = time.monotonic() - trip.t0
        # a stream is held until its second event: under vLLM's "fail" policy a failed transfer
        # answers 200, its opening event, then an error event, which the client must not see
        result = await self.inner.send_settled(replica, decoding, deadline)
        if isinstance(result, Retry):
            # the transfer failed there (a 5xx), or hung: vLLM's read from a prefill replica that
            # died can wait with no error (seen on real vLLM), and the lease has likely run out by
            # the first-byte time-out anyway. It recomputes instead.
            if result.cause in ("http_5xx", "timeout"):
                self.observe("recomputed")
                return await self.inner.send(replica, trip, deadline)
            now = time.monotonic()
            for gone in [k for k, (until, _) in self._kept.items() if until < now]:
                del self._kept[gone]  # requests whose journey ended without another decode
            self._kept[request] = (now + LEASE_S, prefilled)  # the next decode replica reads it
            return result
        result.split = Split(prefilled.replica, prefilled.seconds, sent)
        return result

    async def _prefill(self, trip: Trip, body: dict[str, Any], deadline: float) -> Prefilled | None:
        """A prefill done on the first prefill replica that answers with params; the pool's policy
        hears each (sent, failed or answered with its usage, released)."""
        raw = orjson.dumps(self.protocol.prefill_body(trip.intake.api, body))
        for replica, decision in self.pool.order(trip.intake.key, self.max_prefills):
            started = time.monotonic()
            params = await self._prefill_on(replica, decision, trip, raw, deadline)
            if params is not None:
                return Prefilled(params, replica.id, time.monotonic() - started)
            replica.errors += 1
        return None

    async def _prefill_on(
        self, replica: ReplicaState, decision: Decision | None, trip: Trip, raw: bytes, deadline: float
    ) -> dict[str, Any] | None:
        """One prefill: its params, or None where it failed or kept nothing."""
        policy = self.pool.policy
        hearing = policy.hear(trip.intake.key) if policy is not None and decision is not None else None
        keyed = self.inner.keyed(replica, trip)
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        self.pool.fleet.acquire(replica)
        if hearing is not None and decision is not None:
            hearing.sent(replica, decision, started)
        params = None
        try:
            async with asyncio.timeout_at(min(loop.time() + self.timeouts.first_byte_s, deadline)):
                url = replica.url + trip.exchange.path
                answer = await _post(self.inner.client(), url, raw, keyed.headers, self.timeouts)
            params = self.protocol.params(answer)
        except (TimeoutError, OSError, UpstreamError, ValueError):
            pass
        finally:
            if params is None and hearing is not None:
                hearing.failed(replica)  # it holds none of it
            self.pool.fleet.release(replica)
            if hearing is not None:
                hearing.released(replica, time.monotonic())
        if params is None:
            return None
        prompt_tokens, cached_tokens = _usage(answer)
        replica.prompt_tokens += prompt_tokens
        replica.cached_tokens += cached_tokens
        if hearing is not None:
            now = time.monotonic()  # its one token is its first: the answer's time is its TTFT
            hearing.answered(replica, prompt_tokens, cached_tokens, now - started, 1, None, now)
        return params


async def _post(client: Upstream, url: str, raw: bytes, headers: dict[str, str], timeouts: Timeouts) -> Any:
    """A prefill's JSON answer; None for an answer other than a 200."""
    response = await client.post(url, raw, headers, timeouts.connect_s)
    try:
        data = await response.read()
    finally:
        response.release() if response.at_eof() else response.close()
    return orjson.loads(data) if response.status == 200 else None


def _usage(answer: Any) -> tuple[int, int]:
    """The prompt tokens a prefill replica's answer reports, and of them those it found cached."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens") or usage.get("input_tokens")
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (prompt if isinstance(prompt, int) else 0), (cached if isinstance(cached, int) else 0)
