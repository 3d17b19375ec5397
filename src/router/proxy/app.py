"""The router's HTTP face, wired: the proxied endpoints (each request's way is router.proxy.journey),
stored responses, models, health, metrics, and the admin API and console beside them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import generate_latest

from router.admin.api import add_admin_routes, token_ok
from router.apis import PROXIED, RESPONSES
from router.console.routes import add_console_routes
from router.engines.handoff import VLLM
from router.fleet import ReplicaState
from router.keys import stored_key
from router.node import Node
from router.proxy.attempts import Attempts, HttpAttempts
from router.proxy.disagg import DisaggAttempts
from router.proxy.exchange import AioExchange
from router.proxy.forward import Timeouts
from router.proxy.front import PROXY
from router.proxy.intake import Refused, peer_subject, take_in, who
from router.proxy.journey import Journey
from router.proxy.ledger import Ledger
from router.routing.request import Keys
from router.tenancy.clients import Client
from router.web import error_response


def build_app(node: Node, control_only: bool = False) -> web.Application:
    """A proxying process's application (a lone router or a worker); with `control_only`, the
    control process's (admin replica routes over its socket, and the control loops)."""
    app = web.Application(client_max_size=node.config.max_body_bytes)
    app.cleanup_ctx.append(node.client_context)
    if control_only:
        add_admin_routes(app, node, replica_routes_only=True)
        app.cleanup_ctx.extend(node.contexts(control_only=True))
        return app
    journey = journey_of(node)
    app[PROXY] = journey  # a runner that has the front serves the proxied endpoints on it (router.proxy.front)
    proxy = Proxy(node, journey)
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
        _add_admin(app, node, proxy, beside_api=True)
    # last: any other method or path gets an OpenAI-shaped 404 or 405, not aiohttp's plain text
    app.router.add_route("*", "/{tail:.*}", no_route)
    app.cleanup_ctx.extend(node.contexts())  # after the console's sampler, as it always was
    return app


def admin_app(node: Node) -> web.Application:
    """The admin API, console and /metrics on an address of their own (`admin_port`); it runs
    beside `build_app`'s application, whose upstream client and control loops it shares."""
    app = web.Application(client_max_size=1 << 20)
    proxy = Proxy(node, journey_of(node))
    app.router.add_get("/health", proxy.health)
    _add_admin(app, node, proxy)
    app.router.add_route("*", "/{tail:.*}", no_route)
    return app


def journey_of(node: Node) -> Journey:
    """The journey of this process's proxied requests, from the node's parts."""
    cfg = node.config
    http = HttpAttempts(
        node.upstream_client,
        Timeouts(cfg.connect_timeout_s, cfg.first_byte_timeout_s, cfg.idle_timeout_s),
        cfg.replica_header,
        node.worker,
    )
    attempts: Attempts = http
    prefill = node.pool("prefill")
    lender = prefill if prefill is not None else node.lending
    if lender is not None:  # a disaggregated fleet, or one lending prefill: prefill there, decode where routed
        metrics = node.metrics

        def observe(mode: str) -> None:
            metrics.disagg.labels(mode).inc()

        def abandoned(why: str) -> None:
            metrics.abandoned_prefills.labels(why).inc()

        attempts = DisaggAttempts(
            http,
            lender,
            VLLM,
            cfg.disagg_min_prompt_tokens,
            http.timeouts,
            observe,
            abandoned,
            node.pairs,
            lends=prefill is None,
        )
    ledger = Ledger(node.metrics, node.policy.name, node.fleet.model_label, cfg.log_requests, node.clients is not None)
    spare = prefill.whole(node.metrics, cfg.max_attempts) if prefill is not None else None
    return Journey(
        node.routing,
        node.admission,
        attempts,
        ledger,
        node.metrics,
        cfg.total_timeout_s,
        cfg.max_key_bytes,
        node.feed,
        clients=node.clients,
        budgets=node.budgets,
        tracing=node.tracing,
        spare=spare,
    )


def _add_admin(app: web.Application, node: Node, proxy: Proxy, beside_api: bool = False) -> None:
    """The admin API, console and /metrics; `beside_api`: on the API's own address, where with client
    keys on /metrics too asks for the admin token (the console's data and the admin API always do)."""
    guarded = beside_api and node.clients is not None
    app.router.add_get("/metrics", proxy.guarded_metrics_page if guarded else proxy.metrics_page)
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


class Proxy:
    """The proxied endpoints on aiohttp (a connection the front handed over), and the router's
    other routes: models, stored responses, health, metrics."""

    def __init__(self, node: Node, journey: Journey) -> None:
        self.node = node
        self.config = node.config
        self.routing = node.routing
        self.journey = journey
        self.keys = Keys.of(node.config, journey.prompts)  # how the requests' routing keys are read

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """A proxied endpoint, served by aiohttp (a connection the front handed over)."""
        t0 = time.monotonic()
        exchange = AioExchange(request)
        intake = await take_in(request, self.config.proxying, self.keys, self.node.clients)
        await self.journey.serve(exchange, intake, t0)
        assert exchange.response is not None
        return exchange.response

    # -- other routes ------------------------------------------------------------------------

    def refused_without_key(self, request: web.Request) -> web.Response | None:
        """With client keys on (router.tenancy.clients), the 401 of a request without a valid key (400 with two)."""
        clients = self.node.clients
        refusal = None if clients is None else who(clients, request.headers, peer_subject(request))
        if not isinstance(refusal, Refused):
            return None
        return error_response(refusal.message, refusal.status, refusal.code, path=request.path)

    async def models(self, request: web.Request) -> web.Response:
        """The union of every routable replica's models (first listing of an id wins)."""
        refused = self.refused_without_key(request)
        if refused is not None:
            return refused
        http = self.node.http
        replicas = [r for i, r in enumerate(self.node.fleet.replicas) if self.node.fleet.routable(i)]

        async def fetch(replica: ReplicaState) -> list[dict[str, Any]]:
            try:
                async with http.get(
                    replica.url + "/v1/models",
                    headers=replica.auth,
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
        for models in await asyncio.gather(*(fetch(r) for r in replicas)):
            for model in models:
                merged.setdefault(str(model["id"]), model)
        return web.Response(
            body=orjson.dumps({"object": "list", "data": list(merged.values())}), content_type="application/json"
        )

    async def stored(self, request: web.Request) -> web.Response:
        """Retrieve, delete or cancel a stored response, or list its input items: on the replica that
        produced it, as the router remembers (a 404 of its own for an id it does not know)."""
        refused = self.refused_without_key(request)
        if refused is not None:
            return refused
        response_id = request.match_info["id"]
        clients = self.node.clients
        found = None if clients is None else who(clients, request.headers, peer_subject(request))
        tenant = found.tenant if isinstance(found, Client) else None  # another tenant's id is unknown here
        key = stored_key(response_id, self.config.max_key_bytes, tenant)
        last, _ = await self.routing.directory.last_served(key)
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
                request.method,
                replica.url + request.path_qs,
                data=await request.read() or None,
                timeout=timeout,
                headers=replica.auth,
            ) as resp:
                body = await resp.read()
                headers = {"Content-Type": resp.headers.get("Content-Type", "application/json")}
                if self.config.replica_header:
                    headers[self.config.replica_header] = replica.id
                return web.Response(status=resp.status, body=body, headers=headers)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return error_response(f"the replica holding response '{response_id}' did not answer", 502, "upstream_error")

    async def health(self, request: web.Request) -> web.Response:
        """Ready while some replica is routable; with scale_from_zero_s, also while none is (the
        router holds requests until the autoscaler starts one, and must stay in its Service for
        the first request, and the autoscaler's poll, to reach it)."""
        fleet = self.node.fleet
        routable = sum(1 for i in range(len(fleet)) if fleet.routable(i))
        waits = not routable and self.config.scale_from_zero_s > 0
        body = {
            "status": "ok" if routable else "scaled_to_zero" if waits else "unavailable",
            "replicas": len(fleet),
            "routable": routable,
            "worker": self.node.worker,
        }
        ready = routable or waits
        return web.Response(status=200 if ready else 503, body=orjson.dumps(body), content_type="application/json")

    async def metrics_page(self, request: web.Request) -> web.Response:
        body = generate_latest(self.node.metrics_registry())
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def guarded_metrics_page(self, request: web.Request) -> web.Response:
        """/metrics on the API's address with client keys on: for the admin token alone."""
        if not token_ok(request, self.config.admin_token):
            return error_response(
                "/metrics on the API's address needs the admin token while client keys are on",
                401,
                "invalid_admin_token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await self.metrics_page(request)
