"""Prefill/decode disaggregation: an attempt that prefills on a prefill replica and decodes on the
replica the route chose.

The route (router.routing) chooses among the decode replicas (and aggregated ones), as for any
request: a conversation's turns stay on one decode replica, whose cache holds its blocks too. Then
`DisaggAttempts.send`, in place of a plain attempt:

- serves the request there alone when its decode replica has met no prefill replica yet (mode
  `cold`): the engines' first handshake between a pair costs seconds, which the router pays with
  requests of its own (router.pools.Pairs), never a client's; the prefill leg passes over the
  prefill replicas the decode replica has not met;
- serves the request there alone when it is not worth splitting: an API the engines' connectors do
  not see (router.engines.handoff.SPLITTABLE), or fewer than `min_tokens` left to prefill there: the prompt
  less what the prefix index predicted the decode replica holds when ttft chose it, so a short
  prompt and a conversation's next turn on the replica that holds its history stay whole (a prefill
  that small costs less than a transfer's round trip);
- else routes a prefill leg through the prefill pool (router.pools: its own `Routing`, `ttft` over
  the prefill fleet, the replica whose first token would come soonest from the prefix index of
  what each holds and their prefill queues, so a document is prefilled where it was before): the
  leg's route offers a prefill replica, which is asked for the prompt's KV with the protocol's
  prefill body (router.engines.handoff), a failed one the next (at most MAX_PREFILLS), and the decode
  replica is sent the client's body with the params that came back; its answer is relayed as any
  other. The leg is a route like any request's: picked, counted in flight, released, failed or
  served through the pool's routing core, never by hand;
- falls back to decoding alone (the decode replica recomputes the prompt) when no prefill replica
  answers with params, and when the decode replica fails the transfer (the lease ran out, or the
  prefill replica went away: vLLM answers a 5xx, or in a stream its opening event then an error
  event, so a split stream is held until its second event): a failed transfer is never the
  client's error while a replica can still answer;
- sends a decode that timed out before its first byte to the same replica again without params:
  a read from a prefill replica that died can hang on real vLLM, with no error, and the lease
  (30 s) has likely run out by the first-byte time-out;
- sends a decode whose stream the replica closed before its first event (a reset: it is up, and
  may be the journey's only decode replica) to the same replica again without params;
- keeps the params of a decode that failed before its first byte otherwise (unreachable), and of
  a reset one until its recompute answers: the journey's next decode replica reads the same lease,
  and no prefill is redone.

A broken decode stream is resumed as any other (router.proxy.resume), aggregated.

With `prefill_anywhere` (`lends`), there are no prefill replicas: every replica may prefill for
another (vLLM's kv_both), and the prefill pool is the route's own fleet and policy. A request worth
splitting is then split only where a prefill elsewhere costs the fleet less waiting than one on
its own replica (`lend_worth`): the prompt priced on the other replicas (ttft's prefix index and
prefill queues), the cheapest one's time to first token plus the transfer, plus the prefill time
it would stall the streams in flight there for, against the same on the request's replica
(router.routing.lend_worth). So a document goes to be prefilled where its blocks are or where
little is decoding, and its conversation stays where it was routed. A session the route moves (its
turn's first pick leaves the replica that served it last, still up: drained by an operator, or
passed over for a cheaper or cooler home: the decision's `left`) is split with that replica as the
prefill side, where it has met the new one (`holder`): its prefill there is nearly all cache, so
the conversation's blocks travel instead of being computed again (mode `moved`); where that
prefill fails, the new replica computes the prompt.

A split request's outcome carries its legs for the ledger (router.proxy.ledger): its `Split`
(router.proxy.forward) says which replica prefilled it, how long that took, and when, after its
arrival, the decode was sent: its transfer leg is from there to the decode's first byte, its
decode leg from there to the last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from router.engines.handoff import SPLITTABLE, Handoff
from router.engines.upstream import Upstream, UpstreamError
from router.fleet import ReplicaState
from router.policy import Decision
from router.pools import Pairs, Pool
from router.prompt import BYTES_PER_TOKEN
from router.proxy.attempts import HttpAttempts
from router.proxy.forward import Outcome, Retry, Split, Timeouts, Trip
from router.proxy.sse import StreamFramer
from router.routing import Served, lend_worth

log = logging.getLogger("router.disagg")

LEASE_S = 30.0  # vLLM's kv_lease_duration: how long a prefill's params stay worth retrying with


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A prompt's prefill: the params its decode reads the KV with, where it was done, and how long it took."""

    params: dict[str, Any]
    replica: str
    seconds: float


class DisaggAttempts:
    """Attempts that split a request between a prefill replica and the route's decode replica
    (this module's docstring); `observe(mode)` hears how each request was served (split, alone,
    fallback, recomputed)."""

    def __init__(
        self,
        inner: HttpAttempts,
        pool: Pool,
        protocol: Handoff,
        min_tokens: int,
        timeouts: Timeouts,
        observe: Callable[[str], None] | None = None,
        abandoned: Callable[[str], None] | None = None,
        pairs: Pairs | None = None,
        lends: bool = False,
    ) -> None:
        self.inner = inner
        self.pool = pool  # the prefill pool (router.pools): its routing core routes each prefill leg
        self.protocol = protocol
        self.min_tokens = min_tokens
        self.timeouts = timeouts
        self.observe = observe or (lambda mode: None)
        # told of a prefill whose KV no decode replica read (why): vLLM 0.32 frees its blocks when
        # its lease runs out (30 s); as vLLM serves by its docs, no endpoint frees them sooner
        self.abandoned = abandoned or (lambda why: None)
        # which prefill replica has met which decode replica (None: any pair is split across)
        self.pairs = pairs
        # the pool's fleet is the route's own: every replica may prefill for another, where worth it
        self.lends = lends
        self.transfer_s = 0.0  # a split's transfer leg (its decode sent to its first byte), as measured lately
        # a decode that failed before its first byte: its params, for the journey's next decode
        # replica, by request (its exchange's identity and arrival), until the lease runs out
        self._kept: dict[tuple[int, float], tuple[float, Prefilled]] = {}

    def split(self, replica: ReplicaState, trip: Trip, decision: Decision | None) -> bool:
        """Whether the request is worth splitting: what `replica` would prefill alone (what the
        decision that chose it predicted: its prompt less what the prefix index says it holds;
        else the whole prompt, estimated) is at least `min_tokens`."""
        intake = trip.intake
        if intake.api.name not in SPLITTABLE or not self.pool.fleet.replicas or replica.role == "prefill":
            return False  # (a prefill replica serves whole where no decode replica can: router.pools)
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
        if self.pairs is not None and not self.pairs.has_met(replica):
            self.observe("cold")  # the router is introducing it to the prefill replicas: not at a client's cost
            return self.inner.send(replica, trip, deadline)
        if self.lends:
            holder = self.holder(replica, decision)
            if holder is not None:
                return self._split(replica, trip, deadline, holder)  # the session's KV moves with it
            if not self.lend(replica, trip, decision):
                self.observe("alone")  # its own replica prefills it at no more cost to the fleet
                return self.inner.send(replica, trip, deadline)
        return self._split(replica, trip, deadline)

    def holder(self, replica: ReplicaState, decision: Decision | None) -> ReplicaState | None:
        """Where the route moves a session to `replica` from a replica still up (drained, or
        passed over for a cheaper or cooler home) that has met it: the replica to prefill its turn,
        which holds its blocks (its prefill there is nearly all cache), so they travel instead of
        being computed again."""
        if decision is None or decision.left is None:
            return None
        holder = self.pool.fleet.find(decision.left)
        if holder is None or holder is replica or holder.index is None:
            return None
        if not holder.health.up:
            return None  # removed by its health: its engine may be gone
        if self.pairs is not None and (holder.id, replica.id) not in self.pairs.met:
            return None
        return holder

    def lend(self, replica: ReplicaState, trip: Trip, decision: Decision | None) -> bool:
        """With every replica able to prefill for another: whether the cheapest other replica
        (that `replica` has met) prefilling the prompt costs less waiting than `replica` itself."""
        if decision is None or decision.index != replica.index or replica.index is None:
            return False
        exclude = {replica.index} | (self.pairs.strangers(replica) if self.pairs is not None else set())
        other = self.pool.routing.peek(trip.intake.key, exclude)
        if other is None:
            return False
        loads = self.pool.fleet.loads
        # (the request itself is in flight on its replica already: the route acquired it)
        return lend_worth(decision, loads[replica.index] - 1, other, loads[other.index], self.transfer_s)

    def resume(
        self, replica: ReplicaState, trip: Trip, body: bytes, deadline: float, outcome: Outcome, splicer: StreamFramer
    ) -> Awaitable[Retry | None]:
        return self.inner.resume(replica, trip, body, deadline, outcome, splicer)

    async def _split(
        self, replica: ReplicaState, trip: Trip, deadline: float, holder: ReplicaState | None = None
    ) -> Retry | Outcome:
        body = orjson.loads(trip.intake.raw)  # as forwarded (usage asked for where the router strips it)
        request = (id(trip.exchange), trip.t0)
        kept = self._kept.pop(request, None)
        prefilled = kept[1] if kept is not None and kept[0] > time.monotonic() else None
        if kept is not None and prefilled is None:
            self.abandoned("lease_over")  # the next decode replica came after the lease: prefilled again
        if prefilled is not None and self.pairs is not None and (prefilled.replica, replica.id) not in self.pairs.met:
            self.abandoned("strangers")  # the next decode replica has not met that prefill replica: prefilled again
            prefilled = None
        if prefilled is None:
            prefilled = await self._prefill(trip, body, deadline, replica, holder)
            self.observe(("moved" if holder is not None else "split") if prefilled is not None else "fallback")
        if prefilled is None:
            log.info("no prefill replica answered: %s computes the prompt alone", replica.id)
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
                log.info(
                    "%s failed to read %s's KV (%s): it computes the prompt itself",
                    replica.id,
                    prefilled.replica,
                    result.cause,
                )
                self.observe("recomputed")
                self.abandoned("transfer_failed")
                if self.pairs is not None:  # an engine may have restarted: the pair is introduced again
                    self.pairs.forget(prefilled.replica, replica.id)
                return await self.inner.send(replica, trip, deadline)
            self._keep(request, prefilled)  # the next decode replica reads it
            if result.cause == "reset":
                # it answered, then closed the stream before its first event: it is up, and most
                # likely its read of the lease failed (vLLM 0.32's CPU build began a split decode's
                # read 0.2-60 s after scheduling it, often after the lease ran out: a CI run's 502).
                # The route would offer it once more with the same lease, which would fail alike: it
                # recomputes there instead; should that fail too, the route's next attempt (another
                # decode replica, or this one once more) reads the kept lease
                log.info("%s closed a split decode unanswered: it computes the prompt itself", replica.id)
                self.observe("recomputed")
                recomputed = await self.inner.send(replica, trip, deadline)
                if not isinstance(recomputed, Retry) and self._kept.pop(request, None) is not None:
                    self.abandoned("transfer_failed")
                return recomputed
            return result
        result.split = Split(prefilled.replica, prefilled.seconds, sent)
        if result.facts.streamed and result.facts.ttft_s is not None:  # (a whole answer's time is its decode's too)
            self.transfer_s += 0.2 * (max(0.0, result.facts.ttft_s - sent) - self.transfer_s)
        return result

    def _keep(self, request: tuple[int, float], prefilled: Prefilled) -> None:
        """Keep a failed decode's params for the journey's next decode replica, until the lease
        runs out (and let go of those whose journey ended without another decode)."""
        now = time.monotonic()
        for gone in [k for k, (until, _) in self._kept.items() if until < now]:
            del self._kept[gone]  # requests whose journey ended without another decode
            self.abandoned("no_decode")
        self._kept[request] = (now + LEASE_S, prefilled)

    async def _prefill(
        self, trip: Trip, body: dict[str, Any], deadline: float, decode: ReplicaState, holder: ReplicaState | None
    ) -> Prefilled | None:
        """A prefill done on the first prefill replica the leg's route offers that answers with
        params (of those `decode` has met; `holder` alone, where the session moves from it); the
        route hears of each (failed, or served with its usage, and released)."""
        raw = orjson.dumps(self.protocol.prefill_body(trip.intake.api, body))
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        route = self.pool.routing.local_route(Pool.leg_key(trip.intake.key), started, deadline)
        if self.pairs is not None:
            route.avoid = self.pairs.strangers(decode)
        if self.lends and decode.index is not None:
            route.avoid |= {decode.index}  # prefilled elsewhere, or not split at all
        route.pinned = holder
        while (replica := route.next(loop.time())) is not None:
            began = time.monotonic()
            try:
                cause, answer, params = await self._prefill_on(replica, trip, raw, route.deadline)
            finally:
                route.release(replica)
            if params is None:
                route.failed(replica, cause)
                if holder is not None:
                    return None  # only the holder's prefill is nearly free: the decode replica computes it
                continue
            now = time.monotonic()
            # its one token is its first: the answer's time is the leg's time to first token (from
            # the leg's start, as a request's counts from its arrival)
            first = now - started
            prompt_tokens, cached_tokens = _usage(answer)
            route.served(replica, Served(200, first, prompt_tokens, cached_tokens, 1, streamed=True, token_s=first))
            return Prefilled(params, replica.id, now - began)
        return None

    async def _prefill_on(
        self, replica: ReplicaState, trip: Trip, raw: bytes, deadline: float
    ) -> tuple[str, Any, dict[str, Any] | None]:
        """One prefill: its answer and params, or why it failed (a cause of router_retries_total:
        `timeout`, `connect`, or `http_5xx` for an answer other than a 200 with params)."""
        keyed = self.inner.keyed(replica, trip)
        loop = asyncio.get_running_loop()
        url = replica.url + trip.exchange.path
        try:
            async with asyncio.timeout_at(min(loop.time() + self.timeouts.first_byte_s, deadline)):
                answer = await _post(self.inner.client(), url, raw, keyed.headers, self.timeouts)
            params = self.protocol.params(answer)
        except TimeoutError:
            return "timeout", None, None
        except (OSError, UpstreamError):
            return "connect", None, None
        except ValueError:  # an answer that is no JSON, or params that are no params
            return "http_5xx", None, None
        return ("http_5xx", answer, None) if params is None else ("", answer, params)


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
