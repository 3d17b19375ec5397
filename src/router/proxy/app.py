"""The router's HTTP face: OpenAI-compatible routes proxied through the routing core; models, health, metrics.

Per request: read and parse the body, find its routing key, open a `Route` (router.routing) and
forward to each replica it offers until one answers; a failure before the first byte goes to the
next (never one already tried, within `max_attempts` and the deadline), and a stream broken
mid-way is continued on another replica by the same route (router.proxy.resume). In-flight counts
go up before the upstream request and down exactly once, in a `finally`, however the attempt ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import generate_latest

from router.admin.api import add_admin_routes
from router.admission import Shed, client_of
from router.apis import CHAT, PROXIED, RESPONSES
from router.console.routes import add_console_routes
from router.errors import error_body_for, error_response, in_shape, wrapped
from router.fleet import ReplicaState
from router.keys import NO_KEY, RoutingKey, stored_key
from router.node import Node
from router.policy import Decision
from router.proxy.exchange import JSON, AioExchange, Exchange
from router.proxy.forward import Outcome, Retry, Timeouts, attempt, end_stream, forward_headers, resume
from router.proxy.front import PROXY
from router.proxy.intake import Intake, Refused, no_such_model, take_in
from router.proxy.resume import Splicer, continuation, read_so_far
from router.routing import Route, Served

access_log = logging.getLogger("router.access")


SHED_CODES = {"queue_full": "queue_full", "timeout": "queue_timeout"}  # a 429's `code`, by why it was shed
WORKER_HEADER = "X-Router-Worker"  # which worker process answered, next to the replica header


def build_app(node: Node, control_only: bool = False) -> web.Application:
    """A proxying process's application (a lone router or a worker); with `control_only`, the
    control process's (admin replica routes over its socket, and the control loops)."""
    app = web.Application(client_max_size=node.config.max_body_bytes)
    app.cleanup_ctx.append(node.client_context)
    if control_only:
        add_admin_routes(app, node, replica_routes_only=True)
        app.cleanup_ctx.extend(node.contexts(control_only=True))
        return app
    proxy = Proxy(node)
    app[PROXY] = proxy  # a runner that has the front serves these on it (router.proxy.front)
    for path in PROXIED:
        app.router.add_post(path, proxy.handle)
    app.router.add_get("/v1/models", proxy.models)
    # a stored response's own operations go to the replica that holds it
    stored = RESPONSES.path + "/{id}"
    app.router.add_get(stored, proxy.stored)
    app.router.add_delete(stored, proxy.stored)
    app.router.add_post(stored + "/cancel", proxy.stored)
    app.router.add_get(stored + "/input_items", proxy.stored)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/health/live", live)
    if not node.config.admin_port:
        _add_admin(app, node, proxy)
    # last: any other method or path gets an OpenAI-shaped 404 or 405, not aiohttp's plain text
    app.router.add_route("*", "/{tail:.*}", no_route)
    app.cleanup_ctx.extend(node.contexts())  # after the console's sampler, as it always was
    return app


def admin_app(node: Node) -> web.Application:
    """The admin API, console and /metrics on an address of their own (`admin_port`); it runs
    beside `build_app`'s application, whose upstream client and control loops it shares."""
    app = web.Application(client_max_size=1 << 20)
    proxy = Proxy(node)
    app.router.add_get("/health", proxy.health)
    _add_admin(app, node, proxy)
    app.router.add_route("*", "/{tail:.*}", no_route)
    return app


def _add_admin(app: web.Application, node: Node, proxy: Proxy) -> None:
    app.router.add_get("/metrics", proxy.metrics_page)
    add_admin_routes(app, node)
    if node.config.console:
        add_console_routes(app, node)


def _matches(resource: Any, path: str) -> bool:
    """Whether `path` is `resource`'s path (plain or with {placeholders})."""
    info = resource.get_info()
    if "path" in info:
        return bool(info["path"] == path)
    pattern = info.get("pattern")
    return bool(pattern is not None and pattern.fullmatch(path))


async def no_route(request: web.Request) -> web.Response:
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource.get_info().get("formatter") == "/{tail}":
            continue  # this catch-all
        if _matches(resource, request.path):
            allowed.update(route.method for route in resource)
    allowed -= {"HEAD", "*"}
    if allowed:
        methods = ", ".join(sorted(allowed))
        return error_response(
            f"{request.method} is not allowed on {request.path}; use {methods}",
            405,
            "method_not_allowed",
            headers={"Allow": methods},
            path=request.path,
        )
    return error_response(f"no route {request.method} {request.path}", 404, "not_found", path=request.path)


async def live(request: web.Request) -> web.Response:
    """Liveness: this process answers, whatever its replicas do (for a Kubernetes liveness
    probe, which must not restart routers because their replicas are down; /health is readiness)."""
    return web.Response(body=b'{"status":"alive"}', content_type="application/json")


def served(result: Outcome) -> Served:
    return Served(
        result.status,
        result.ttft_s,
        result.prompt_tokens,
        result.cached_tokens,
        result.completion_tokens,
        result.streamed,
        bool(result.stream_error),
        result.client_gone,
        result.token_s,
    )


class Proxy:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.config = cfg = node.config
        self.routing = node.routing
        self.metrics = node.metrics
        self.timeouts = Timeouts(cfg.connect_timeout_s, cfg.first_byte_timeout_s, cfg.idle_timeout_s)
        self.prompts = node.policy.reads_prompts  # the keys carry the prompt's blocks

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """A proxied endpoint, served by aiohttp (a connection the front handed over)."""
        t0 = time.monotonic()
        exchange = AioExchange(request)
        await self.serve(exchange, await take_in(request, self.config, self.prompts), t0)
        assert exchange.response is not None
        return exchange.response

    async def serve(self, exchange: Exchange, intake: Intake | Refused, t0: float) -> None:
        """Answer one proxied request, taken in or refused, through `exchange`."""
        if not isinstance(intake, Intake):
            intake.answer(exchange)
            self._finish(exchange, exchange.status, None, NO_KEY, None, t0)
            return
        key, raw = intake.key, intake.raw
        if key.model is not None and self.node.fleet.unserved(key.model):
            no_such_model(key.model).answer(exchange)  # nothing is forwarded
            self._finish(exchange, exchange.status, None, key, None, t0)
            return
        feed = self.node.feed
        if feed is not None and key.prompt is not None:
            key = await feed.tokenized(key, intake.api, intake.body)  # the engine's tokens, where events feed
        loop = asyncio.get_running_loop()
        route = await self.routing.route(key, t0, loop.time() - (time.monotonic() - t0) + self.config.total_timeout_s)
        admission = self.node.admission
        if admission.on and intake.api.queued:
            try:
                waited = await admission.enter(
                    key.model,
                    client_of(exchange.headers, intake.body, exchange.remote),
                    route.last is not None,
                    t0 + self.config.total_timeout_s,
                )
            except Shed as shed:
                self._shed(exchange, shed, key.model)
                self._finish(exchange, exchange.status, None, key, None, t0)
                return
            if waited:
                self.metrics.queue_wait.observe(waited)
        headers = forward_headers(exchange.headers, exchange.remote)
        failure: Retry | None = None
        while (replica := route.next(loop.time())) is not None:
            try:
                result = await attempt(
                    self.node.upstream_client(),
                    exchange,
                    replica.url + exchange.path,
                    raw,
                    headers,
                    self._extra_headers(replica),
                    self.timeouts,
                    route.deadline,
                    intake.strip_usage,
                    t0,
                    intake.keep,
                    intake.api.events,
                )
            except asyncio.CancelledError:  # the client went away; the upstream request is closed
                self._finish(exchange, 499, replica, key, route.decision, t0, None, route.attempts)
                raise
            finally:
                route.release(replica)
                if intake.api.queued:
                    admission.released()
            if isinstance(result, Retry):
                route.failed(replica, result.cause)
                failure = result
                continue
            route.served(replica, served(result), exchange.path, raw)
            if (
                intake.api is RESPONSES
                and result.response_id is not None
                and result.status == 200
                and intake.body.get("store") is not False
            ):
                route.produced(result.response_id, replica, self.config.max_key_bytes)
            if intake.keep and result.streamed:
                try:
                    replica = await self._resume(exchange, intake, route, result, replica, headers)
                except asyncio.CancelledError:  # the client went away during the continuation
                    self._finish(exchange, 499, replica, key, route.decision, t0, None, route.attempts)
                    raise
            self._finish(exchange, result.status, replica, key, route.decision, t0, result, route.attempts)
            return
        if route.timed_out:
            failure = failure or Retry("timeout", 504)
        self._no_replica(exchange, failure, bool(route.tried))
        self._finish(exchange, exchange.status, None, key, None, t0, None, route.attempts)

    def _shed(self, exchange: Exchange, shed: Shed, model: str | None) -> None:
        """The 429 of a request every replica for its model was too full for."""
        m = self.metrics
        m.child(m.shed, shed.reason, self.node.fleet.model_label(model)).inc()
        headers = {**JSON, "Retry-After": str(shed.retry_after_s)}
        exchange.answer(
            shed.status, error_body_for(exchange.path, shed.message, shed.status, SHED_CODES[shed.reason]), headers
        )

    def _extra_headers(self, replica: ReplicaState) -> dict[str, str]:
        name = self.config.replica_header
        if not name:
            return {}
        if self.node.worker is not None:
            return {name: replica.id, WORKER_HEADER: str(self.node.worker)}
        return {name: replica.id}

    async def _resume(
        self,
        exchange: Exchange,
        intake: Intake,
        route: Route,
        result: Outcome,
        broke: ReplicaState,
        headers: dict[str, str],
    ) -> ReplicaState:
        """Continue `result`'s broken stream on another replica the route offers and return the
        replica that ended the stream. A stream is resumed once: if its continuation breaks too,
        the request itself may be what breaks replicas, so it ends there with an SSE error event,
        as when it cannot be continued or no replica takes it."""
        m = self.metrics
        if not result.broken:
            if result.stream_error and not result.client_gone:
                m.child(m.stream_resumes, "timeout").inc()  # broke at the deadline: no time left
            return broke
        result.extra["broke_on"] = broke.id
        chat = intake.api is CHAT
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
        follow = continuation(intake.body, chat, so_far) if so_far is not None else None
        if follow is None or so_far is None:
            m.child(m.stream_resumes, "impossible").inc()
            await end_stream(result)
            return broke
        raw = orjson.dumps(follow)
        strip = result.framer is not None and result.framer.strip_usage
        loop = asyncio.get_running_loop()
        while (replica := route.next(loop.time(), resuming=True)) is not None:
            try:
                failed = await resume(
                    self.node.upstream_client(),
                    replica.url + exchange.path,
                    raw,
                    headers,
                    self.timeouts,
                    route.deadline,
                    result,
                    Splicer(so_far, chat, strip),
                    route.t0,
                )
            finally:
                route.release(replica)
            if failed is not None and failed.cause == "refused":
                m.child(m.stream_resumes, "refused").inc()  # the continuation itself was refused (4xx)
                await end_stream(result)
                return broke
            if failed is not None:
                route.failed(replica, failed.cause)
                continue
            result.extra["resumed_on"] = replica.id
            if result.client_gone:
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

    def _finish(
        self,
        exchange: Exchange,
        status: int,
        replica: ReplicaState | None,
        key: RoutingKey,
        decision: Decision | None,
        t0: float,
        result: Outcome | None = None,
        attempts: int = 0,
    ) -> None:
        elapsed = time.monotonic() - t0
        name = replica.id if replica is not None else "none"
        m = self.metrics
        model = self.node.fleet.model_label(key.model)
        m.child(m.requests, name, self.node.policy.name, key.kind, str(status), model).inc()
        if replica is not None:
            m.child(m.e2e, name).observe(elapsed)
            if result is not None and result.ttft_s is not None:
                m.child(m.ttft, name).observe(result.ttft_s)
        if self.config.log_requests:
            access_log.info(
                json.dumps(
                    {
                        "ts": round(time.time(), 3),
                        "method": exchange.method,
                        "path": exchange.path,
                        "status": status,
                        "replica": replica.id if replica else None,
                        "policy": self.node.policy.name,
                        "key_kind": key.kind,
                        "key_source": key.source,
                        "reason": decision.reason if decision else None,
                        "attempts": attempts,
                        "ttft_ms": round(result.ttft_s * 1000, 2) if result and result.ttft_s is not None else None,
                        "e2e_ms": round(elapsed * 1000, 2),
                        "prompt_tokens": result.prompt_tokens if result else None,
                        "cached_tokens": result.cached_tokens if result else None,
                        "stream_error": result.stream_error if result else None,
                        "broke_on": result.extra.get("broke_on") if result else None,
                        "resumed_on": result.extra.get("resumed_on") if result else None,
                    }
                )
            )

    # -- other routes ------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        """The union of every routable replica's models (first listing of an id wins)."""
        http = self.node.http
        urls = [r.url for i, r in enumerate(self.node.fleet.replicas) if self.node.fleet.routable(i)]

        async def fetch(url: str) -> list[dict[str, Any]]:
            try:
                async with http.get(
                    url + "/v1/models",
                    timeout=aiohttp.ClientTimeout(
                        total=self.config.first_byte_timeout_s, sock_connect=self.config.connect_timeout_s
                    ),
                ) as resp:
                    if resp.status != 200:
                        return []
                    data = orjson.loads(await resp.read()).get("data")
                    return [m for m in data if isinstance(m, dict) and "id" in m] if isinstance(data, list) else []
            except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError, AttributeError):
                return []

        merged: dict[str, dict[str, Any]] = {}
        for models in await asyncio.gather(*(fetch(u) for u in urls)):
            for model in models:
                merged.setdefault(str(model["id"]), model)
        return web.Response(
            body=orjson.dumps({"object": "list", "data": list(merged.values())}), content_type="application/json"
        )

    async def stored(self, request: web.Request) -> web.Response:
        """Retrieve, delete or cancel a stored response, or list its input items: on the replica that
        produced it, as the router remembers (a 404 of its own for an id it does not know)."""
        response_id = request.match_info["id"]
        last, _ = await self.routing.directory.last_served(stored_key(response_id, self.config.max_key_bytes))
        replica = self.node.fleet.find(last) if last is not None else None
        if replica is None or replica.index is None:
            return error_response(
                f"Response with id '{response_id}' is not known to this router (or its replica left).",
                404,
                param="response_id",
            )
        timeout = aiohttp.ClientTimeout(
            total=self.config.first_byte_timeout_s, sock_connect=self.config.connect_timeout_s
        )
        try:
            async with self.node.http.request(
                request.method, replica.url + request.path_qs, data=await request.read() or None, timeout=timeout
            ) as resp:
                body = await resp.read()
                headers = {"Content-Type": resp.headers.get("Content-Type", "application/json")}
                if self.config.replica_header:
                    headers[self.config.replica_header] = replica.id
                return web.Response(status=resp.status, body=body, headers=headers)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return error_response(f"the replica holding response '{response_id}' did not answer", 502, "upstream_error")

    async def health(self, request: web.Request) -> web.Response:
        fleet = self.node.fleet
        routable = sum(1 for i in range(len(fleet)) if fleet.routable(i))
        body = {
            "status": "ok" if routable else "unavailable",
            "replicas": len(fleet),
            "routable": routable,
            "worker": self.node.worker,
        }
        return web.Response(status=200 if routable else 503, body=orjson.dumps(body), content_type="application/json")

    async def metrics_page(self, request: web.Request) -> web.Response:
        body = generate_latest(self.node.metrics_registry())
        return web.Response(body=body, content_type="text/plain", charset="utf-8")
