"""The console's routes: the page, its two assets, and the data it polls.

- `GET /console`: the page (static HTML; no data in it, so it needs no token);
- `GET /console/assets/{console.js,console.css}`;
- `GET /console/api/state?since=T`: the replica table now, and the history's points and events
  after unix time T (router.console.history);
- `GET /console/api/route?key=K`: where key K goes, the admin API's route explanation;
- `GET /console/api/auth`: `{"required": bool, "accepted": bool}`, whether the data needs the
  admin token and whether the request carried it (never a 401, so the page can ask first).

The data routes need `Authorization: Bearer <admin token>` when a token is configured (the page
asks for it and keeps it in the tab's session storage, never in a URL); without one they are
open, like `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from router.admin.api import AdminApi, token_ok
from router.console.history import History
from router.fleet import ReplicaState
from router.node import Node
from router.web import error_response

log = logging.getLogger("router.console")
ASSETS = {
    "console.js": "application/javascript",
    "console.css": "text/css",
}
SECURITY_HEADERS = {
    # everything the page needs is its own: no other origin may serve it code, styles or fonts
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> bytes:
    return resources.files("router.console").joinpath("static", name).read_bytes()


def add_console_routes(app: web.Application, node: Node) -> None:
    history = History(
        lambda: node.metrics_registry().collect(),
        interval_s=node.config.console_interval_s,
        history_s=node.config.console_history_s,
    )
    page = _asset("console.html")
    assets = {name: _asset(name) for name in ASSETS}
    admin = AdminApi(node)

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers=SECURITY_HEADERS)

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in assets:
            return error_response(f"no console asset {name!r}", 404, "not_found")
        return web.Response(body=assets[name], content_type=ASSETS[name], charset="utf-8", headers=SECURITY_HEADERS)

    def allowed(request: web.Request) -> web.Response | None:
        token = node.config.admin_token
        if token and not token_ok(request, token):
            return error_response(
                "the console's data needs the admin token",
                401,
                "invalid_admin_token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return None

    async def state(request: web.Request) -> web.Response:
        refused = allowed(request)
        if refused is not None:
            return refused
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            return error_response("since must be a unix time in seconds", param="since")
        body = {
            "now": time.time(),
            "worker": node.worker,
            "policy": node.policy.name,
            "replicas": replica_rows(node, history),
            **history.since(since),
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def auth(request: web.Request) -> web.Response:
        """Whether the data needs a token, and whether the one sent (if any) is it: the page asks
        this first, so that opening it without a token is not an error."""
        token = node.config.admin_token
        body = {"required": bool(token), "accepted": not token or token_ok(request, token)}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def route(request: web.Request) -> web.Response:
        refused = allowed(request)
        if refused is not None:
            return refused
        return await admin.explain_route(request)

    async def sampling(app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                try:
                    history.sample()
                except Exception:  # the console must never take the router down
                    log.exception("console sample failed")
                await asyncio.sleep(history.interval_s)

        task = asyncio.create_task(loop(), name="console history")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.router.add_get("/console", index)
    app.router.add_get("/console/assets/{name}", asset)
    app.router.add_get("/console/api/auth", auth)
    app.router.add_get("/console/api/state", state)
    app.router.add_get("/console/api/route", route)
    app.cleanup_ctx.append(sampling)


def replica_rows(node: Node, history: History) -> list[dict[str, Any]]:
    """Each replica now: the admin API's figures, with QPS and hit rate from the latest point;
    replicas that left the fleet stay listed, as `left`, while the history still shows them. With
    prefill replicas, each row has its role, the prefill replicas last, and a decode replica the
    KV transfers its engine reports (their mean time and those that failed)."""
    fleet = node.fleet
    node.metrics_registry()  # the same refresh as a scrape: every worker's in-flight counts, health
    shares = fleet.ring.shares()
    latest = history.points[-1]["replicas"] if history.points else {}
    rows = []
    weights = fleet.routing_weights()  # (read once: the ring's tables are copies a read)
    for i, r in enumerate(fleet.replicas):
        seen = latest.get(r.id, {})
        rows.append(
            {
                "id": r.id,
                "state": r.state,
                "models": None if r.models is None else sorted(r.models),
                "adapters": None if r.adapters is None else sorted(r.adapters),
                "score": round(r.health.score, 4),
                "weight": round(weights[i], 4),
                "ring_share": round(shares[i], 4),
                "inflight": fleet.loads[i] - r.queue_load,
                "qps": seen.get("qps", 0.0),
                "hit": seen.get("hit"),
                "ttft_p99": seen.get("ttft_p99"),
                "state_changes": r.health.transitions,
                "inputs": _inputs(r.inputs),
                "role": r.role,
                **_transfers(r),
            }
        )
    # the other roles' replicas (prefill): not on the route's ring, not in its request metrics
    for r in (r for pool in node.pools[1:] for r in pool.fleet.replicas):
        rows.append(
            {
                "id": r.id,
                "state": r.state,
                "models": None if r.models is None else sorted(r.models),
                "score": round(r.health.score, 4),
                "inflight": r.inflight,
                "inputs": _inputs(r.inputs),
                "role": r.role,
            }
        )
    present = {r.id for pool in node.pools for r in pool.fleet.replicas}
    for rid in sorted(set(latest) - present):
        rows.append({"id": rid, "state": "left", "score": None, "weight": 0.0, "ring_share": 0.0, "inflight": 0})
    return rows


def _transfers(r: ReplicaState) -> dict[str, Any]:
    """A decode replica's KV transfers as its engine counts them since it started: their mean time
    (ms) and those that failed; nothing for a replica whose engine reports none."""
    e = r.engine
    if not e.transfers:
        return {}
    mean_ms = round(1000 * (e.transfer_s or 0.0) / e.transfers, 2)
    return {"transfer_ms": mean_ms, "failed_transfers": e.failed_transfers or 0.0}


def _inputs(inputs: Any) -> dict[str, Any] | None:
    if inputs is None:
        return None
    return {k: v for k, v in dataclasses.asdict(inputs).items() if v is not None}
