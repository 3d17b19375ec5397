"""One proxied request's journey, below the two HTTP servers that parse it (router.proxy.exchange).

A request taken in (router.proxy.intake) that names a model some replica serves reserves its
tenant's tokens (router.tenancy.budgets: or gets a 429; settled on its usage where it ends), is keyed in
the engines' tokens where replicas publish KV events, given a `Route` (router.routing), held by the
overload queue while every replica for its model is full (router.tenancy.admission: or shed with a 429),
then sent to each replica its route offers until one answers: a failure before the first byte goes
to the next (never one already tried, within `max_attempts` and the deadline, but for the last one
tried once more after a pause where none is left and it failed to connect or closed the connection
unanswered: router.routing.route), and a stream broken
mid-way is continued on another replica by the same route (router.proxy.resume). Each attempt's
in-flight count goes up when the route offers the replica and down exactly once, in a `finally`,
however the attempt ends. The journey ends in the ledger: the request's metrics and access-log line.
With traces on (router.tracing), each of those steps is a span of the request's trace, and each
attempt hands its replica its own trace context.

It is built from narrow collaborators, never the node: the routing core (and a spare one, whose
replicas serve a request whole where the route offers none: a disaggregated fleet's prefill
pool), the overload queue, the attempts (router.proxy.attempts: HTTP to replicas in the proxy; the
modelled replicas of router-bench simulate, which drives this same loop on a virtual clock; fakes
in its unit tests), where it ends (router.proxy.ledger: one `Ending` record, counted and logged),
and the engines' tokens where they are read (`Tokens`: a request cut into them before it is
routed, a chat's answer kept for its next turn once it has gone).

It is past 450 lines as one room: its steps (intake's checks, a tenant's budget, the overload
queue, the attempts' loop, a broken stream's resume) read one request's state top to bottom.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import orjson

from router.apis import CHAT, RESPONSES, Api
from router.errors import error_body_for, in_shape, wrapped
from router.fleet import ReplicaState
from router.keys import RoutingKey, stored_key
from router.metrics import RouterMetrics
from router.policy import Decision
from router.proxy.attempts import Attempts
from router.proxy.exchange import Exchange
from router.proxy.forward import (
    Outcome,
    Retry,
    Trip,
    end_stream,
    forward_headers,
    reply_text,
)
from router.proxy.intake import Intake, Refused, no_such_model, unknown_response
from router.proxy.ledger import Accounting, Ending
from router.proxy.resume import Splicer, continued, read_so_far
from router.routing import AGAIN_PAUSE_S, Route, Routing, Verdict
from router.tenancy.admission import Admission, Shed, client_of
from router.tenancy.budgets import COMPLETION_CAPS, Budgets, Refusal, Reservation
from router.tenancy.clients import DEFAULT_RANK, PRIORITIES, SHEDDABLE, ClientKeys
from router.tracing import TRACE_HEADERS, AttemptTrace, RequestTrace, Tracing
from router.web import JSON

# a 429's `code`, by why it was shed
SHED_CODES = {
    "queue_full": "queue_full",
    "timeout": "queue_timeout",
    "sheddable": "sheddable_shed",
    "target": "ttft_target_unmet",
    "budget": "tokens_per_minute_exceeded",
    "exceeds_budget": "request_exceeds_budget",
    "late": "queue_wait_past_target",
    "cold": "no_replica_ready",
}


class Tokens(Protocol):
    """The engines' tokens (router.engines.kvfeed.Feed, router.engines.tokens); neither call waits."""

    def tokenized(self, key: RoutingKey, api: Api, body: dict[str, Any]) -> RoutingKey:
        """`key` with its prompt in the engine's tokens, as far as they are known now."""
        ...

    def replied(self, key: RoutingKey, api: Api, body: dict[str, Any], reply: Callable[[], str | None]) -> None:
        """A chat's answer has gone to its client: keep its tokens for the next turn (`reply` reads
        its text, only where a tokenizer will keep it: 37 us for a 200-event stream)."""
        ...


def traced_headers(headers: dict[str, str], span: AttemptTrace) -> dict[str, str]:
    """`headers` with the attempt's trace context in place of any other (a client's, an earlier attempt's)."""
    return {k: v for k, v in headers.items() if k.lower() not in TRACE_HEADERS} | span.headers()


class Journey:
    """Serves proxied requests (router.proxy.front.Serving): one `serve` per request."""

    def __init__(
        self,
        routing: Routing,
        admission: Admission,
        attempts: Attempts,
        ledger: Accounting,
        metrics: RouterMetrics,
        total_timeout_s: float,
        max_key_bytes: int,
        tokens: Tokens | None = None,
        clock: Callable[[], float] = time.monotonic,
        clients: ClientKeys | None = None,
        budgets: Budgets | None = None,
        tracing: Tracing | None = None,
        spare: Routing | None = None,
        pause: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.routing = routing
        # where a request goes whole when the route offers no replica: a disaggregated fleet's
        # prefill replicas (router.pools.Pool.whole), which can serve as well as prefill
        self.spare = spare
        self.fleet = routing.fleet
        self.admission = admission
        self.attempts = attempts
        self.ledger = ledger
        self.metrics = metrics
        self.total_timeout_s = total_timeout_s
        self.max_key_bytes = max_key_bytes
        self.tokens = tokens
        self.clock = clock  # what a request's t0 was read on (router-bench simulate: its virtual loop's time)
        self.pause = pause  # waits before a replica is tried once more (router-bench simulate: its virtual loop's)
        self.clients = clients  # who may use the API (router.tenancy.clients); None: anyone
        self.budgets = budgets  # tenants' tokens a minute (router.tenancy.budgets); None: no budgets
        self.tracing = tracing  # OpenTelemetry (router.tracing); None: off, and no cost
        self.prompts = routing.policy.reads_prompts  # the keys carry the prompt's blocks

    async def serve(self, exchange: Exchange, intake: Intake | Refused, t0: float) -> None:
        """Answer one proxied request, taken in or refused, through `exchange`."""
        end = Ending(exchange, t0, intake)
        trace = None
        if self.tracing is not None:
            trace = end.trace = self.tracing.request(exchange.method, exchange.path, exchange.headers, t0)
            trace.intake(t0, self.clock(), len(intake.raw) if isinstance(intake, Intake) else None)
        # (with client keys on, a request without one is refused at intake; one with a valid key
        # is counted by its tenant, as a request served)
        client = end.client = intake.client
        if not isinstance(intake, Intake):
            intake.answer(exchange)
            self._finish(end, exchange.status)
            return
        if intake.rank != DEFAULT_RANK:  # (the default class is the Ledger's when none is said)
            end.priority = intake.rank
        key = end.key = intake.key
        if key.model is not None and self.fleet.unserved(key.model):
            no_such_model(key.model).answer(exchange)  # nothing is forwarded
            self._finish(end, exchange.status)
            return
        if client is not None and key.source == "previous_response_id":
            # a stored response is its tenant's alone: one the router knows another tenant made is
            # not found, and the request is not sent where it is (the engine itself does not ask
            # whose); one it knows of no tenant (forgotten, or made before) goes on as before
            previous = str(intake.body.get("previous_response_id"))
            mine, _ = await self.routing.directory.last_served(key.key)
            someones = None
            if mine is None:
                someones, _ = await self.routing.directory.last_served(stored_key(previous, self.max_key_bytes))
            if someones is not None:
                unknown_response(previous).answer(exchange)
                self._finish(end, exchange.status)
                return
        budgets = self.budgets
        if budgets is not None and client is not None and budgets.limited(client.tenant):
            if budgets.local is not None:  # this process's buckets: no coroutine to await
                admitted = budgets.admit_now(client.tenant, intake.body, len(intake.raw))
            else:
                admitted = await budgets.admit(client.tenant, intake.body, len(intake.raw))
            if isinstance(admitted, Refusal):
                shed = Shed(429, admitted.message, admitted.reason, admitted.retry_after_s)
                self._shed(exchange, shed, key.model, intake.rank)
                self._finish(end, exchange.status)
                return
            end.reserved = admitted  # settled at the end
        if self.tokens is not None and key.prompt is not None:
            # the engine's tokens, where events feed
            key = end.key = self.tokens.tokenized(key, intake.api, intake.body)
        loop = asyncio.get_running_loop()
        routing = self.routing
        deadline = loop.time() - (self.clock() - t0) + self.total_timeout_s
        target_at = None if intake.target_s is None else deadline - self.total_timeout_s + intake.target_s
        if routing.directory.local_only:  # the same route, without a coroutine around a dict lookup
            route = routing.local_route(key, t0, deadline, target_at)
        else:
            route = await routing.route(key, t0, deadline, target_at)
        if target_at is not None and intake.rank >= SHEDDABLE:
            route.refuse_late = True  # better refused at once than served late
        admission = self.admission
        # (nobody waiting and room for its model: on at once, without a coroutine or the client's name)
        if admission.on and intake.api.queued and (admission.queued or not admission.room(key.model)):
            # fair between tenants where client keys say who they are, else between clients as requests name them
            who = f"tenant:{client.tenant}" if client is not None else None
            try:
                waited = await admission.enter(
                    key.model,
                    who or client_of(exchange.headers, intake.body, exchange.remote),
                    route.last is not None,
                    t0 + self.total_timeout_s,
                    intake.rank,
                    intake.target_s or (client.ttft_target_s if client is not None else None),
                )
            except Shed as shed:
                self._shed(exchange, shed, key.model, intake.rank)
                self._finish(end, exchange.status)
                return
            if waited:
                self.metrics.queue_wait.observe(waited)
                if trace is not None:
                    now = self.clock()
                    trace.queued(now - waited, now)
        # with client keys on, a client's key is the router's business alone: never forwarded
        trip = Trip(exchange, intake, forward_headers(exchange.headers, exchange.remote, self.clients is None), t0)
        failure: Retry | None = None
        routing_since = self.clock() if trace is not None else 0.0
        span = None
        # the route's replicas; where it offers none (every decode replica gone, drained or out of
        # routing), the spare's (a disaggregated fleet's prefill replicas), which serve it whole
        offered = self._offered(route, key, t0)
        for route in offered:  # (after the loop, `route` is the last one offered: it says why none served)
            while True:
                replica = route.next(loop.time())
                if replica is None:
                    # none left: the last one tried, where it failed as a passing fault does, once more
                    if not route.once_more(loop.time()):
                        break
                    try:
                        await self.pause(AGAIN_PAUSE_S)
                    except asyncio.CancelledError:  # the client went away meanwhile
                        self._finish(end, 499, None, route.decision, trip.streaming, route.attempts)
                        raise
                    continue
                if trace is not None:
                    span = self._attempt_span(trace, route, replica, trip, routing_since)
                try:
                    result = await self.attempts.send(replica, trip, route.deadline, route.decision)
                except asyncio.CancelledError:  # the client went away; the upstream request is closed
                    if span is not None:
                        span.end("client_gone")
                    self._finish(end, 499, replica, route.decision, trip.streaming, route.attempts)
                    raise
                finally:
                    route.release(replica)
                    if intake.api.queued:
                        admission.released()
                if span is not None:
                    if isinstance(result, Retry):
                        span.end(result.cause, result.status or None)
                    else:
                        outcome = "ok" if result.stream_error is None else "stream_error"
                        span.end(outcome, result.facts.status, result.resent)
                if isinstance(result, Retry):
                    route.failed(replica, result.cause)
                    failure = result
                    continue
                if intake.api.queued and result.facts.status < 400:  # (a quick refusal is no service)
                    admission.answered(replica)
                verdict = route.served(replica, result.facts, exchange.path, intake.raw)
                if (
                    intake.api is RESPONSES
                    and result.facts.response_id is not None
                    and result.facts.status == 200
                    and intake.body.get("store") is not False
                ):
                    tenant = intake.client.tenant if intake.client is not None else None
                    route.produced(result.facts.response_id, replica, self.max_key_bytes, tenant)
                if intake.resumable and result.facts.streamed:
                    try:
                        replica = await self._resume(trip, route, result, replica, trace)
                    except asyncio.CancelledError:  # the client went away during the continuation
                        self._finish(end, 499, replica, route.decision, trip.streaming, route.attempts)
                        raise
                self._finish(end, result.facts.status, replica, route.decision, result, route.attempts, verdict)
                if self.tokens is not None and key.prompt is not None and intake.api is CHAT:
                    self._replied(key, intake, result)
                return
        if route.late:
            late = Shed(429, "no replica is predicted to send the first token within x-slo-ttft-ms", "target", 1)
            self._shed(exchange, late, key.model, intake.rank)
            self._finish(end, exchange.status)
            return
        if route.timed_out:
            failure = failure or Retry("timeout", 504)
        self._no_replica(exchange, failure, bool(route.tried))
        self._finish(end, exchange.status, attempts=route.attempts)

    def _offered(self, route: Route, key: RoutingKey, t0: float) -> Iterator[Route]:
        """`route`, then, where it offered no replica (none tried, not refused as late, not timed
        out), a route of the spare routing core (`spare`) for the same request."""
        yield route
        if self.spare is not None and not route.tried and not route.late and not route.timed_out:
            yield self.spare.local_route(key, t0, route.deadline)

    def _replied(self, key: RoutingKey, intake: Intake, result: Outcome) -> None:
        """A chat answer that ended well, whole and in text, to the engines' tokens for its next turn."""
        facts = result.facts
        if facts.status != 200 or facts.tools or result.stream_error is not None or result.broke_on:
            return
        if self.tokens is not None:
            self.tokens.replied(key, intake.api, intake.body, functools.partial(reply_text, result))

    def _attempt_span(
        self, trace: RequestTrace, route: Route, replica: ReplicaState, trip: Trip, since: float
    ) -> AttemptTrace:
        """An attempt's span (the first one's routing decision's too), its trace context on the
        headers sent (vLLM's own spans join the trace under it)."""
        if route.attempts == 1:
            decision = route.decision
            cost = decision.cost if decision is not None else None
            trace.routed(
                since,
                self.clock(),
                self.routing.policy.name,
                replica.id,
                decision.reason if decision is not None else None,
                route.key.kind,
                round(cost.ttft_s * 1000, 3) if cost is not None else None,
                round(cost.cached_tokens) if cost is not None else None,
            )
        span = trace.attempt(replica.id, replica.url + trip.exchange.path, route.attempts)
        trip.headers = traced_headers(trip.headers, span)
        return span

    def _finish(
        self,
        end: Ending,
        status: int,
        replica: ReplicaState | None = None,
        decision: Decision | None = None,
        result: Outcome | None = None,
        attempts: int = 0,
        verdict: Verdict | None = None,
    ) -> None:
        """The journey ended with `status` (`replica`: the one that answered, None where none
        did): its ledger counts and logs it, its trace ends, its tenant's reservation is settled."""
        end.status, end.replica, end.decision, end.result, end.attempts, end.verdict = (
            status, replica, decision, result, attempts, verdict
        )  # fmt: skip
        self.ledger.finish(end)
        if end.trace is not None:
            self._traced(end)
        if end.reserved is not None:
            self._settle(end, end.reserved)

    @staticmethod
    def _traced(end: Ending) -> None:
        """The request's span ends: its tokens, tenant and outcome."""
        assert end.trace is not None
        result, client, intake = end.result, end.client, end.intake
        facts = result.facts if result is not None else None
        cap = None
        if isinstance(intake, Intake):
            cap = next((v for n in COMPLETION_CAPS if type(v := intake.body.get(n)) is int), None)
        end.trace.finish(
            end.status,
            end.key.model,
            facts.prompt_tokens if facts is not None else None,
            facts.completion_tokens if facts is not None else None,
            cap,
            client.tenant if client is not None else None,
            client.key_id if client is not None else None,
            end.replica.id if end.replica is not None else None,
            result.stream_error if result is not None else None,
        )

    def _settle(self, end: Ending, reserved: Reservation) -> None:
        """Settle the tenant's reservation on what the request used: its usage; none where no
        replica answered or one refused it; for a stream that ended early (the client gone, the
        engine broken), its prompt (as the engine said, else its estimate) and the token-carrying
        events that passed (or the completion tokens said, if more); as reserved where nothing
        says (a whole answer whose client left before it was sent)."""
        result, status = end.result, end.status
        facts = result.facts if result is not None else None
        spent: int | None
        if (
            result is not None
            and facts is not None
            and facts.streamed
            and (facts.cut or facts.client_gone or status == 499)
        ):
            # ended early: what passed (a framer still counting, if the client left mid-read)
            events = max(facts.events, result.framer.events if result.framer is not None else 0)
            spent = (facts.prompt_tokens or reserved.prompt) + max(facts.completion_tokens, events)
        elif status == 499:
            spent = None
        elif facts is None or facts.prompt_tokens or facts.completion_tokens or facts.status >= 400:
            spent = facts.prompt_tokens + facts.completion_tokens if facts is not None else 0
        else:
            spent = None
        assert self.budgets is not None
        self.budgets.settle_now(reserved, spent)  # (in Redis: queued for its next round, off the answer's time)

    def _shed(self, exchange: Exchange, shed: Shed, model: str | None, rank: int) -> None:
        """The answer of a request turned away before any replica: its 429 (every replica for its
        model too full, its class shed, its target unmet, its tenant's budget spent), or its 503
        (no replica started while it waited: scale_from_zero_s), with Retry-After."""
        m = self.metrics
        m.child(m.shed, shed.reason, self.fleet.model_label(model), PRIORITIES[rank]).inc()
        # (0: waiting would not help, as for a request larger than its tenant's whole budget)
        headers = {**JSON, "Retry-After": str(shed.retry_after_s)} if shed.retry_after_s else JSON
        exchange.answer(
            shed.status, error_body_for(exchange.path, shed.message, shed.status, SHED_CODES[shed.reason]), headers
        )

    async def _resume(
        self, trip: Trip, route: Route, result: Outcome, broke: ReplicaState, trace: RequestTrace | None = None
    ) -> ReplicaState:
        """Continue `result`'s broken stream on another replica the route offers and return the
        replica that ended the stream. A stream is resumed once: if its continuation breaks too,
        the request itself may be what breaks replicas, so it ends there with an SSE error event,
        as when it cannot be continued or no replica takes it."""
        m = self.metrics
        if not result.broken:
            if result.stream_error and not result.facts.client_gone:
                m.child(m.stream_resumes, "timeout").inc()  # broke at the deadline: no time left
            return broke
        result.broke_on = broke.id
        chat = trip.intake.api is CHAT
        assert result.record is not None
        so_far = read_so_far(result.record)
        if so_far is not None and so_far.finished:
            # the answer was whole; only its end was missing: close it as a finished stream
            m.child(m.stream_resumes, "finished").inc()
            result.stream_error = None
            result.broken = False
            with contextlib.suppress(ConnectionResetError):
                await result.response.write(b"data: [DONE]\n\n")
                await result.response.write_eof()
            return broke
        if so_far is None or so_far.other:  # (the body itself passed at intake: it is resumable)
            m.child(m.stream_resumes, "impossible").inc()  # nothing readable, or tool calls or reasoning
            await end_stream(result)
            return broke
        raw = orjson.dumps(continued(trip.intake.body, chat, so_far))
        strip = result.framer is not None and result.framer.strip_usage
        loop = asyncio.get_running_loop()
        while (replica := route.next(loop.time(), resuming=True)) is not None:
            span = None
            if trace is not None:
                span = trace.resume(replica.id, replica.url + trip.exchange.path, route.attempts, broke.id)
                trip.headers = traced_headers(trip.headers, span)
            try:
                failed = await self.attempts.resume(
                    replica, trip, raw, route.deadline, result, Splicer(so_far, chat, strip)
                )
            finally:
                route.release(replica)
            if span is not None:
                span.end(failed.cause if failed is not None else "ok" if not result.stream_error else "stream_error")
            if failed is not None and failed.cause == "refused":
                m.child(m.stream_resumes, "refused").inc()  # the continuation itself was refused (4xx)
                await end_stream(result)
                return broke
            if failed is not None:
                route.failed(replica, failed.cause)
                continue
            result.resumed_on = replica.id
            if result.facts.client_gone:
                return replica
            route.resumed(replica, whole=not result.stream_error)
            if result.stream_error:
                m.child(m.stream_resumes, "failed").inc()
                if result.broken:
                    await end_stream(result)  # broken twice: not resumed again
            else:
                m.child(m.stream_resumes, "resumed").inc()
            return replica
        m.child(m.stream_resumes, "failed").inc()
        await end_stream(result)
        return broke

    @staticmethod
    def _no_replica(exchange: Exchange, failure: Retry | None, tried: bool) -> None:
        if failure is not None and failure.cause == "http_5xx" and failure.body:
            if in_shape(exchange.path, failure.body):
                exchange.answer(failure.status, failure.body, {"Content-Type": failure.content_type})
            else:
                exchange.answer(failure.status, wrapped(exchange.path, failure.status, failure.body), JSON)
            return
        if failure is not None:
            what = {"timeout": "timed out", "connect": "could not be reached", "reset": "closed the connection"}
            refusal = Refused(
                failure.status,
                f"no replica could serve the request: the last one tried {what.get(failure.cause, 'failed')}",
                "upstream_error",
            )
        elif not tried:
            refusal = Refused(503, "no replica is available to serve the request", "no_replica_available")
        else:
            refusal = Refused(502, "no replica could serve the request", "upstream_error")
        refusal.answer(exchange)
