"""The router's aiohttp application: OpenAI-compatible routes, failover, metrics, health.

Per request: read and parse the body, find its routing key, ask the policy for a replica,
forward, and on a failure before the first byte try the next replica the policy offers (never
one already tried), up to `max_attempts`. In-flight counts go up before the upstream request
and down exactly once, in a `finally`, however the attempt ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest, multiprocess

from router.balance.controller import Balancer
from router.balance.view import LinkDown, LocalSessions, SessionEntry, SessionSource
from router.config import ReplicaSpec, RouterConfig, replica_capacities, score_weights
from router.discovery import Discovery
from router.errors import error_response
from router.fleet import TTFT_FLOOR_TOKENS, Fleet, ReplicaState
from router.health.monitor import HealthMonitor, latency_window_s
from router.health.states import Hysteresis
from router.keys import NO_KEY, RoutingKey, routing_key
from router.metrics import PER_REPLICA_GAUGES, RouterMetrics, replica_gauge_families
from router.policy import Decision, make_policy
from router.proxy.forward import Outcome, Retry, Timeouts, attempt, end_stream, forward_headers, resume
from router.proxy.internal import serve_internal, worker_socket
from router.proxy.resume import SoFar, Splicer, continuation, read_so_far
from router.redis_state import RedisSessions, RedisState
from router.ring import xxh3_64
from router.sessions import SessionTable
from router.shared import Follower, Publisher, SharedSessions
from router.shm.table import SlotTable
from router.state import RoutingState, StateFile, default_directory, describe
from router.upstream import Upstream

access_log = logging.getLogger("router.access")


async def read_body(request: web.Request, limit: int, pause_s: float, total_s: float) -> bytes:
    """The request body as it arrives. TimeoutError if it pauses for `pause_s` (a client stuck, or
    slow on purpose) or takes more than `total_s` in all; HTTPRequestEntityTooLarge past `limit`."""
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    parts: list[bytes] = []
    size = 0
    async with asyncio.timeout(total_s):
        while True:
            async with asyncio.timeout(pause_s):
                chunk = await request.content.readany()
            if not chunk:
                return b"".join(parts)
            size += len(chunk)
            if size > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
            parts.append(chunk)


def _matches(resource: Any, path: str) -> bool:
    """Whether `path` is `resource`'s path (plain or with {placeholders})."""
    info = resource.get_info()
    if "path" in info:
        return bool(info["path"] == path)
    pattern = info.get("pattern")
    return bool(pattern is not None and pattern.fullmatch(path))


PROXIED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
STREAMABLE = ("/v1/chat/completions", "/v1/completions")

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router")
WORKER_HEADER = "X-Router-Worker"  # which worker process answered, next to the replica header
STATE_SAVE_S = 5.0  # how often the routing state is saved while it changes
MOVE_SLACK_MS = 2000  # the control process's line to its workers answers within this (LINK_TIMEOUT_S)
SESSIONS_SAVE_S = 30.0  # with worker processes: how often their sessions are asked for, to save
SYNC_INTERVAL_S = 0.05  # how often a worker follows the shared table and publishes its counters


class Router:
    """One router process. Alone (the default) it probes, scores and proxies. With worker
    processes (router.proxy.workers) the control process is a Router given the shared `table`
    and no `worker` number, serving `app(control_only=True)`: it probes, scores, owns membership
    and publishes; each worker is a Router given the table, its number and the control socket:
    it proxies by the table's view. A lone router given a table publishes to it too, for
    colocated router-agents to find their slots."""

    def __init__(
        self,
        config: RouterConfig,
        table: SlotTable | None = None,
        worker: int | None = None,
        control_socket: str | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.config = config
        self.worker = worker
        self.control_socket = control_socket
        self.control: aiohttp.ClientSession | None = None  # a worker's line to the control process
        self.fleet = Fleet(
            () if worker is not None else config.replicas,
            config.vnodes,
            config.hash_seed,
            Hysteresis(
                config.remove_below,
                config.return_above,
                config.remove_after,
                config.return_after,
                config.recovery_ramp_s,
                flap_backoff=config.flap_backoff,
            ),
            replica_capacities(config) if config.capacity_caps else {},
            capacity_caps=config.capacity_caps,
        )
        self.policy = make_policy(config.policy, self.fleet, config)
        self.sessions = SessionTable(config.sticky_max_sessions, config.sticky_ttl_s)
        self.metrics = metrics or RouterMetrics()
        self.timeouts = Timeouts(config.connect_timeout_s, config.first_byte_timeout_s, config.idle_timeout_s)
        self.client: aiohttp.ClientSession | None = None
        self.upstream: Upstream | None = None  # the client, and a pool-less one for stale connections
        self.publisher = Publisher(self.fleet, table) if table is not None and worker is None else None
        self.follower: Follower | None = None
        self.shared_sessions: SharedSessions | None = None
        if table is not None and worker is not None:
            self.follower = Follower(
                self.fleet,
                table,
                worker,
                latency_window_s(config.probe_interval_s),
                on_removed=self._forget_id,
                queue_weight=config.load_queue_weight,
            )
            self.follower.reload()
            if table.sticky_entries:
                self.shared_sessions = SharedSessions(table, worker, self.fleet, config.sticky_ttl_s)
        self.monitor = HealthMonitor(
            self.fleet,
            lambda: self.http,
            config.probe_interval_s,
            config.probe_timeout_s,
            weights=score_weights(config),
            agents=dict(entry.split("=", 1) for entry in config.agents),
            table=table,
            queue_weight=config.load_queue_weight,
            before_round=self.gather,
            after_round=self._publish_table,
        )
        self.multiprocess_metrics = self._multiprocess_registry() if worker is not None else None
        self.balancer = Balancer(self)
        self.balance_task: asyncio.Task[None] | None = None
        self.changes = 0  # membership, drain and override changes (saved with the routing state)
        self.discovery = (
            Discovery(self, config.discovery, config.discovery_interval_s)
            if config.discovery and worker is None
            else None
        )
        # where the balance loop finds sessions: here (a lone router), or, for the control process of
        # worker processes, the workers (router.proxy.workers sets it); a worker has none
        self.view: SessionSource | None = LocalSessions(self) if worker is None and config.workers <= 1 else None
        self.view_ready = asyncio.Event()  # the view answers (workers: once they have started)
        if self.view is not None:
            self.view_ready.set()
        self._restored_sessions: list[SessionEntry] = []  # for the workers, once they answer
        self._saved_sessions: list[SessionEntry] = []  # the sessions as last asked for ...
        self._sessions_at = -SESSIONS_SAVE_S  # ... then (monotonic seconds)
        self.state_file: StateFile | None = None
        self._restored: dict[str, int] | None = None  # what the saved routing state brought back
        self._restored_drains: list[tuple[str, bool]] = []
        self.redis: RedisState | None = None
        self.redis_sessions: RedisSessions | None = None  # where sessions are looked up and written in Redis
        if config.state.startswith(("redis://", "rediss://")):
            if worker is None:
                self.redis = RedisState(self, config.state, config.state_namespace)
                self.redis_sessions = self.redis.sessions
            else:  # a worker looks sessions up and writes them itself; the control process does the rest
                self.redis_sessions = RedisSessions.connect(config.state, config.state_namespace, config.sticky_ttl_s)
        elif worker is None and config.state != "none":
            directory = config.state[5:] if config.state.startswith("file:") else default_directory()
            self.state_file = StateFile(directory, config.host, config.port)
            saved = self.state_file.load()  # StateError: the caller says so and stops
            if saved is not None:
                self._restore(saved)
        self._saved_at: tuple[int, int | None] = (-1, -1)
        self._save_lock = asyncio.Lock()

    def state_line(self) -> str:
        """Where the routing state lives, for the start-up banner."""
        if self.redis is not None:
            return f"routing state: shared through {self.config.state} (namespace {self.config.state_namespace})"
        if self.state_file is not None:
            line = f"routing state: saved to {self.state_file.path} (--state none turns it off)"
            if self._restored is not None:
                restored = ", ".join(f"{count} {what}" for what, count in self._restored.items())
                line += f"; restored: {restored}"
            return line
        return "routing state: not saved (--state none)"

    # -- routing state that survives a restart ----------------------------------------------------

    def _restore(self, saved: RoutingState) -> None:
        fleet, ring = self.fleet, self.fleet.ring
        for rid in saved.removed:
            if fleet.find(rid) is not None:
                fleet.remove(rid)
        for rid, url in saved.added:
            if fleet.find(rid) is None:
                with contextlib.suppress(ValueError):  # its URL is now another configured replica's
                    fleet.add(ReplicaSpec(rid, url))
        for rid in saved.draining:
            if fleet.find(rid) is not None:
                fleet.drain(rid)
                self._restored_drains.append((rid, rid in saved.removing))  # resumed when the loop runs
        if self.discovery is not None:
            self.discovery.managed |= {rid for rid in saved.discovered if fleet.find(rid) is not None}
        for origin, number, owner in saved.overrides:
            if origin in ring.replica_ids and owner in ring.replica_ids and 0 <= number < ring.vnodes:
                ring.reassign_vnode(ring.index(origin), number, ring.index(owner))
        down = max(time.time() - saved.saved_at, 0.0)
        now_ms = int(time.time() * 1000)
        live = [(key, replica, left - down, now_ms) for key, replica, left in saved.sessions if left > down]
        if isinstance(self.view, LocalSessions):
            for key, replica, left, written in live:
                self.sessions.restore(key, replica, left, written)
        else:  # the workers get them when they answer (`_after_start`)
            self._restored_sessions = live
        self._saved_sessions, self._sessions_at = live, time.monotonic()
        self._restored = describe(saved)
        access_log.info("routing state restored: %s", self._restored)

    def routing_state(self, sessions: list[SessionEntry]) -> RoutingState:
        fleet = self.fleet
        configured = {r.id for r in self.config.replicas}
        present = {r.id for r in fleet.replicas}
        return RoutingState(
            saved_at=time.time(),
            added=[(r.id, r.url) for r in fleet.replicas if r.id not in configured],
            removed=[rid for rid in configured if rid not in present],
            draining=[r.id for r in fleet.replicas if r.state == "draining"],
            removing=sorted(self.balancer.removing),
            discovered=sorted(self.discovery.managed) if self.discovery is not None else [],
            overrides=[(origin, number, owner) for (origin, number), owner in fleet.ring.overrides.items()],
            sessions=[(key, replica, left) for key, replica, left, _ in sessions if left > 0 and replica in present],
        )

    async def save_state(self, force: bool = False) -> None:
        """Save the routing state if it changed since the last save (or `force`). A lone router
        saves its sessions whenever they changed; with worker processes their sessions are asked
        for every SESSIONS_SAVE_S (and when forced), while a membership change is saved at once
        with the sessions last asked for, their time left counted down since."""
        if self.state_file is None:
            return
        view = self.view
        # not while restored sessions wait for the workers: they are the sessions until then
        answering = view is not None and self.view_ready.is_set() and not self._restored_sessions
        lone = isinstance(view, LocalSessions)
        due = time.monotonic() - self._sessions_at >= SESSIONS_SAVE_S
        ask = answering and (lone or force or due)
        mark = (self.changes, await view.version() if view is not None and ask else self._saved_at[1])
        if mark == self._saved_at and not force:
            return
        async with self._save_lock:  # one save at a time: an older snapshot never lands last
            if view is not None and ask:
                with contextlib.suppress(LinkDown):  # no worker answers, and none ever has
                    self._saved_sessions = await view.live()
                    self._sessions_at = time.monotonic()
            aged = time.monotonic() - self._sessions_at
            state = self.routing_state([(k, r, left - aged, w) for k, r, left, w in self._saved_sessions])
            await asyncio.to_thread(self.state_file.save, state)
            self._saved_at = mark

    def shared_change(self, op: str, arg: Any) -> None:
        """A routing change made here (add, remove, drain, override): share it with the other
        routers when the state lives in Redis."""
        if self.redis is not None:
            self.redis.changed(op, arg)

    async def _redis_ctx(self, app: web.Application) -> AsyncIterator[None]:
        assert self.redis is not None
        await self.redis.start()
        yield
        await self.redis.close()

    async def _discovery_ctx(self, app: web.Application) -> AsyncIterator[None]:
        assert self.discovery is not None
        task = asyncio.create_task(self.discovery.run(), name="discovery")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _state_ctx(self, app: web.Application) -> AsyncIterator[None]:
        stop = asyncio.Event()

        async def loop() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), STATE_SAVE_S)
                    return  # stopping: the final save follows
                try:
                    await self.save_state()
                except OSError as exc:
                    logging.getLogger("router.state").error("cannot save the routing state: %s", exc)

        task = asyncio.create_task(loop(), name="routing state")
        yield
        stop.set()
        await task  # a save under way finishes first, never cut off in its thread
        try:
            await self.save_state(force=True)
        except OSError as exc:
            logging.getLogger("router.state").error("cannot save the routing state: %s", exc)

    def prefill_shared_sessions(self, table: SlotTable) -> None:
        """Control process, before the workers start: write the restored sessions into the
        workers' shared session tables (each its share by key hash; nobody writes them yet), so
        that the first requests already go where the sessions' caches are. The workers' own
        tables get them too, once they answer (`_after_start`), for saving and drains."""
        if not self._restored_sessions or not table.sticky_entries or table.workers < 1:
            return
        rows = [SharedSessions(table, w, self.fleet, self.config.sticky_ttl_s) for w in range(table.workers)]
        now_ms = time.time() * 1000
        for key, replica_id, left, _ in self._restored_sessions:
            replica = self.fleet.find(replica_id)
            if replica is not None:
                # the entry's age is what makes it expire there: written so that `left` remains
                written = int(now_ms - (self.config.sticky_ttl_s - left) * 1000)
                rows[xxh3_64(key) % len(rows)].put(key, replica, written)

    async def _after_start(self) -> None:
        """Once the view answers: restored sessions to the workers, restored drains go on."""
        await self.view_ready.wait()
        for tries in range(5):
            if not self._restored_sessions or self.view is None:
                break
            try:
                await self.view.restore(self._restored_sessions)
                self._restored_sessions = []
            except LinkDown:  # a worker did not take its share: all again (a restore skips what is newer)
                await asyncio.sleep(1.0 + tries)
        if self._restored_sessions:
            logging.getLogger("router.state").warning(
                "%d restored sessions did not all reach the workers; those not taken start over",
                len(self._restored_sessions),
            )
        self._restored_sessions = []
        for rid, remove in self._restored_drains:  # drains under way when the router stopped go on
            replica = self.fleet.find(rid)
            if replica is not None and replica.state == "draining":
                await self.balancer.drain(replica, remove)
        self._restored_drains.clear()

    async def _balance_ctx(self, app: web.Application) -> AsyncIterator[None]:
        self.balance_task = task = asyncio.create_task(self.balancer.run(), name="balance")
        start = asyncio.create_task(self._after_start(), name="restored drains")
        yield
        for t in (start, task):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.balancer.close()

    # -- shared state (worker processes) ---------------------------------------------------------

    def publish(self) -> None:
        """Routing changed (membership, drain, overrides): write the fleet to the shared table
        (control process) and mark the routing state for saving."""
        self.changes += 1
        self._publish_table()

    def _publish_table(self) -> None:
        if self.publisher is not None:
            self.publisher.publish()

    def gather(self) -> None:
        """Control process: add up the workers' counters (no-op for a lone router)."""
        if self.publisher is not None:
            self.publisher.collect()

    def follow(self) -> None:
        """Worker: catch up with the shared table now."""
        if self.follower is not None:
            self.follower.sync()

    def worker_restarted(self, worker: int) -> None:
        """Control process: worker `worker` was restarted and counts from zero."""
        if self.publisher is not None:
            self.publisher.worker_restarted(worker)

    def has_room(self) -> bool:
        return self.publisher is None or self.publisher.has_room()

    def forget(self, replica: ReplicaState | None) -> None:
        """A replica left the fleet: drop its gauges and shared slot."""
        if replica is None:
            return
        self._forget_id(replica.id)
        if self.publisher is not None:
            self.publisher.forget(replica)
        self.publish()

    def _forget_id(self, replica_id: str) -> None:
        # its sessions stay in the table: their next turns go to the ring and count as membership jumps
        self.metrics.forget_replica(replica_id)

    def _multiprocess_registry(self) -> CollectorRegistry | None:
        """A worker's /metrics: every worker's counters and histograms (prometheus_client's
        multiprocess files), and per-replica gauges from this worker's copy of the table."""
        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not path:
            return None
        registry = CollectorRegistry()
        files = multiprocess.MultiProcessCollector(None, path)  # type: ignore[no-untyped-call]
        fleet = self.fleet

        class FromFiles:
            """Every process's counters, histograms and the control process's gauges; the
            per-replica gauges come from the table instead, and only for replicas still there."""

            def collect(self) -> list[Any]:
                present = {r.id for r in fleet.replicas if r.index is not None}
                families = []
                for family in files.collect():  # type: ignore[no-untyped-call]
                    if family.name in PER_REPLICA_GAUGES:
                        continue
                    if family.name == "router_replica_load":
                        family.samples = [s for s in family.samples if s.labels.get("replica") in present]
                    families.append(family)
                return families

        class ReplicaGauges:
            def collect(self) -> list[Any]:
                return replica_gauge_families(
                    [
                        (
                            r.id,
                            fleet.loads[r.index] - r.queue_load,
                            r.health.score,
                            r.health.routable,
                            r.health.transitions,
                            r.state,
                            r.inputs,
                        )
                        for r in fleet.replicas
                        if r.index is not None
                    ]
                )

        registry.register(FromFiles())
        registry.register(ReplicaGauges())
        return registry

    async def _follower_ctx(self, app: web.Application) -> AsyncIterator[None]:
        follower = self.follower
        assert follower is not None
        self.control = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.control_socket or ""))

        async def tick() -> None:
            last_refresh = 0.0
            while True:
                now = time.monotonic()
                try:
                    follower.sync()
                    if now - last_refresh >= 1.0:  # scores and states for display; routing follows the generation
                        follower.refresh()
                        last_refresh = now
                    follower.publish(now)
                    follower.pull_loads()
                except Exception:  # a bug in one tick must not freeze this worker's view for good
                    logging.getLogger("router.workers").exception("following the shared table failed")
                await asyncio.sleep(SYNC_INTERVAL_S)

        tasks = [asyncio.create_task(tick(), name="shared table follower")]
        if self.redis_sessions is not None:
            tasks.append(asyncio.create_task(self.redis_sessions.run(), name="redis sessions"))
        internal = await serve_internal(self, worker_socket(self.control_socket or "", follower.worker))
        yield
        await internal.cleanup()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.redis_sessions is not None:
            await self.redis_sessions.close(own_client=True)
        await self.control.close()

    async def _monitor_ctx(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.monitor.run(), name="health monitor")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    @property
    def upstream_client(self) -> Upstream:
        assert self.upstream is not None, "the router application is not running"
        return self.upstream

    @property
    def http(self) -> aiohttp.ClientSession:
        """The upstream client session; it exists while the application runs."""
        assert self.client is not None, "the router application is not running"
        return self.client

    # -- application -----------------------------------------------------------------------

    def app(self, control_only: bool = False) -> web.Application:
        from router.admin.api import add_admin_routes

        app = web.Application(client_max_size=self.config.max_body_bytes)
        app[ROUTER_KEY] = self
        app.cleanup_ctx.append(self._client_ctx)
        if control_only:  # the control process of workers: admin (over its socket) and the control loop
            add_admin_routes(app, self, replica_routes_only=True)
            self._control_loops(app)
            return app
        for path in PROXIED:
            app.router.add_post(path, self._proxy)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health/live", self._live)
        if not self.config.admin_port:
            self._add_admin(app)
        # last: any other method or path gets an OpenAI-shaped 404 or 405, not aiohttp's plain text
        app.router.add_route("*", "/{tail:.*}", self._no_route)
        if self.follower is not None:
            app.cleanup_ctx.append(self._follower_ctx)  # a worker: the control process runs the loops
        else:
            self._control_loops(app)
        return app

    def admin_app(self) -> web.Application:
        """The admin API, console and /metrics on an address of their own (`admin_port`); it runs
        beside `app()`, whose upstream client and control loops it shares."""
        app = web.Application(client_max_size=1 << 20)
        app[ROUTER_KEY] = self
        app.router.add_get("/health", self._health)
        self._add_admin(app)
        app.router.add_route("*", "/{tail:.*}", self._no_route)
        return app

    def _add_admin(self, app: web.Application) -> None:
        from router.admin.api import add_admin_routes
        from router.console.routes import add_console_routes

        app.router.add_get("/metrics", self._metrics)
        add_admin_routes(app, self)
        if self.config.console:
            add_console_routes(app, self)

    async def _no_route(self, request: web.Request) -> web.Response:
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
            )
        return error_response(f"no route {request.method} {request.path}", 404, "not_found")

    def _control_loops(self, app: web.Application) -> None:
        """Health probes, the balance loop, routing state, Redis and discovery, as configured."""
        if self.config.health_checks:
            app.cleanup_ctx.append(self._monitor_ctx)
        app.cleanup_ctx.append(self._balance_ctx)
        app.cleanup_ctx.append(self._state_ctx)
        if self.redis is not None:
            app.cleanup_ctx.append(self._redis_ctx)
        if self.discovery is not None:
            app.cleanup_ctx.append(self._discovery_ctx)

    async def _client_ctx(self, app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=self.config.upstream_connections, enable_cleanup_closed=True
        )
        self.client = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0,
                limit_per_host=self.config.upstream_connections,
                force_close=True,
                enable_cleanup_closed=True,
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        self.upstream = Upstream(self.client, fresh, self._reconnected)
        yield
        await self.client.close()
        await fresh.close()

    def _reconnected(self, url: str) -> None:
        """A request went out again on a new connection: its pooled one was closed by the replica."""
        replica = next((r for r in self.fleet.replicas if url.startswith(r.url + "/")), None)
        self.metrics.child(self.metrics.reconnects, replica.id if replica is not None else "none").inc()

    # -- proxying ----------------------------------------------------------------------------

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        cfg = self.config
        # checked here rather than in a middleware: a middleware wraps every request's handler
        size = sum(len(k) + len(v) + 4 for k, v in request.raw_headers)
        if size > cfg.max_header_bytes:
            return self._finish(
                request,
                error_response(
                    f"request headers are {size} bytes; the limit is {cfg.max_header_bytes}", 431, "request_too_large"
                ),
                None,
                NO_KEY,
                None,
                t0,
            )
        try:
            raw = await read_body(request, cfg.max_body_bytes, cfg.client_timeout_s, cfg.total_timeout_s)
        except TimeoutError:
            slow = error_response(
                f"the request body paused for client_timeout_s ({cfg.client_timeout_s:g} s) or took longer "
                f"than total_timeout_s ({cfg.total_timeout_s:g} s)",
                408,
                "request_timeout",
            )
            slow.force_close()  # the rest of that body must not be read as a next request
            return self._finish(request, slow, None, NO_KEY, None, t0)
        except web.HTTPRequestEntityTooLarge:
            return self._finish(
                request,
                error_response(
                    f"request body is larger than the limit of {cfg.max_body_bytes} bytes", 413, "request_too_large"
                ),
                None,
                NO_KEY,
                None,
                t0,
            )
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return self._finish(
                request, error_response(f"the request body is not valid JSON: {exc}"), None, NO_KEY, None, t0
            )
        if not isinstance(body, dict):
            return self._finish(
                request, error_response("the request body must be a JSON object"), None, NO_KEY, None, t0
            )
        key = routing_key(
            request.headers,
            body,
            header_names=cfg.key_headers,
            body_fields=cfg.key_body_fields,
            prefix_chars=cfg.prefix_chars,
            max_key_bytes=cfg.max_key_bytes,
        )
        strip_usage = False
        if request.path in STREAMABLE and body.get("stream") is True and cfg.inject_usage:
            options = body.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage")):
                body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
                raw = orjson.dumps(body)
                strip_usage = True
        last, local = await self.last_served(key.key) if key.kind != "none" else (None, False)
        headers = forward_headers(request)
        deadline = asyncio.get_running_loop().time() - (time.monotonic() - t0) + cfg.total_timeout_s
        tried: list[ReplicaState] = []  # by replica, not index: an admin removal shifts indices
        failure: Retry | None = None
        # a stream broken mid-way is resumed on another replica when it can be (see resume.py)
        keep = 0
        chat = request.path == "/v1/chat/completions"
        streamed = request.path in STREAMABLE and body.get("stream") is True
        if cfg.resume_streams and streamed and continuation(body, chat, SoFar()) is not None:
            keep = cfg.resume_buffer_bytes
        first_choice: ReplicaState | None = None
        loop = asyncio.get_running_loop()
        for _ in range(cfg.max_attempts):
            if loop.time() >= deadline:
                failure = failure or Retry("timeout", 504)
                break  # no replica is charged for an attempt that was never made
            decision = self.policy.pick(key, last, {r.index for r in tried if r.index is not None})
            if decision is None:
                break
            replica = self.fleet.replicas[decision.index]
            tried.append(replica)
            if first_choice is None:
                first_choice = replica
            extra = {cfg.replica_header: replica.id} if cfg.replica_header else {}
            if self.worker is not None and cfg.replica_header:
                extra[WORKER_HEADER] = str(self.worker)
            self.fleet.acquire(replica)
            # nothing else in flight there: its time to first token measures the replica, not a queue
            alone = replica.index is not None and self.fleet.loads[replica.index] <= 1
            try:
                result = await attempt(
                    self.upstream_client,
                    request,
                    replica.url + request.path,
                    raw,
                    headers,
                    extra,
                    self.timeouts,
                    deadline,
                    strip_usage,
                    t0,
                    keep,
                )
            except asyncio.CancelledError:  # the client went away; the upstream request is closed
                self._finish(request, web.Response(status=499), replica, key, decision, t0, None, len(tried))
                raise
            finally:
                self.fleet.release(replica)
            if isinstance(result, Retry):
                replica.errors += 1
                failure = result
                self.metrics.child(self.metrics.retries, result.cause).inc()
                continue
            self._account(key, last, replica, decision, result, first_choice, t0, alone, local)
            if keep and result.streamed:
                try:
                    replica = await self._resume(request, body, key, result, replica, tried, headers, deadline, t0)
                except asyncio.CancelledError:  # the client went away during the continuation
                    self._finish(request, web.Response(status=499), replica, key, decision, t0, None, len(tried))
                    raise
            if key.kind != "none" and result.status < 400:
                self.balancer.served(key.key, request.path, raw)
            return self._finish(request, result.response, replica, key, decision, t0, result, len(tried))
        return self._finish(request, self._no_replica(failure, bool(tried)), None, key, None, t0, None, len(tried))

    async def _resume(
        self,
        request: web.Request,
        body: dict[str, Any],
        key: RoutingKey,
        result: Outcome,
        broke: ReplicaState,
        tried: list[ReplicaState],
        headers: dict[str, str],
        deadline: float,
        t0: float,
    ) -> ReplicaState:
        """Continue `result`'s broken stream on another replica (within `max_attempts` in all and the
        deadline) and return the replica that ended the stream. A stream is resumed once: if its
        continuation breaks too, the request itself may be what breaks replicas, so it ends there
        with an SSE error event, as when it cannot be continued or no replica takes it."""
        m = self.metrics
        if not result.broken:
            if result.stream_error and not result.client_gone:
                m.child(m.stream_resumes, "timeout").inc()  # broke at the deadline: no time left
            return broke
        result.extra["broke_on"] = broke.id
        chat = request.path == "/v1/chat/completions"
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
        follow = continuation(body, chat, so_far) if so_far is not None else None
        if follow is None or so_far is None:
            m.child(m.stream_resumes, "impossible").inc()
            await end_stream(result)
            return broke
        raw = orjson.dumps(follow)
        strip = result.framer is not None and result.framer.strip_usage
        loop = asyncio.get_running_loop()
        while len(tried) < self.config.max_attempts and loop.time() < deadline:
            decision = self.policy.pick(key, None, {r.index for r in tried if r.index is not None})
            if decision is None:
                break
            replica = self.fleet.replicas[decision.index]
            tried.append(replica)
            self.fleet.acquire(replica)
            try:
                failed = await resume(
                    self.upstream_client,
                    replica.url + request.path,
                    raw,
                    headers,
                    self.timeouts,
                    deadline,
                    result,
                    Splicer(so_far, chat, strip),
                    t0,
                )
            finally:
                self.fleet.release(replica)
            if failed is not None and failed.cause == "refused":
                m.child(m.stream_resumes, "refused").inc()  # the continuation itself was refused (4xx)
                await end_stream(result)
                return broke
            if failed is not None:
                replica.errors += 1
                m.child(m.retries, failed.cause).inc()
                continue
            result.extra["resumed_on"] = replica.id
            if result.client_gone:
                return replica
            if result.stream_error:
                replica.errors += 1
                m.child(m.stream_errors, replica.id).inc()
                m.child(m.stream_resumes, "failed").inc()
                if result.broken:
                    await end_stream(result)  # broken twice: not resumed again
            else:
                m.child(m.stream_resumes, "resumed").inc()
                if key.kind != "none":
                    self._remember(key, replica, t0)  # its cache now holds the whole conversation
            return replica
        m.child(m.stream_resumes, "failed").inc()
        await end_stream(result)
        return broke

    async def last_served(self, key: bytes, remember: bool = True) -> tuple[str | None, bool]:
        """Where the session was served last, and whether this process's own entry says so (else
        another worker's or router's newer news does): the newest of the three wins. A session
        found in Redis is entered here too, unless not `remember` (a lookup that routes nothing)."""
        last = self.sessions.get(key)
        local = last is not None
        if self.shared_sessions is None and self.redis_sessions is None:
            return last, local
        newest = self.sessions.written_ms(key) if last is not None else 0
        if self.shared_sessions is not None:
            found = self.shared_sessions.get(key)
            if found is not None and found[1] > newest:
                last, newest, local = found[0].id, found[1], False
        if self.redis_sessions is not None:
            shared = await self.redis_sessions.lookup(key)
            if shared is not None and shared[1] > newest:
                last, local = shared[0], False
                if remember:
                    left = self.config.sticky_ttl_s - (time.time() * 1000 - shared[1]) / 1000
                    self.sessions.restore(key, last, left, shared[1])
        return last, local

    def _no_replica(self, failure: Retry | None, tried: bool) -> web.Response:
        if failure is not None and failure.cause == "http_5xx" and failure.body:
            return web.Response(status=failure.status, body=failure.body, content_type=failure.content_type)
        if failure is not None:
            what = {"timeout": "timed out", "connect": "could not be reached", "reset": "closed the connection"}
            return error_response(
                f"no replica could serve the request: the last one tried {what.get(failure.cause, 'failed')}",
                failure.status,
                "upstream_error",
            )
        if not tried:
            return error_response("no replica is available to serve the request", 503, "service_unavailable")
        return error_response("no replica could serve the request", 502, "upstream_error")

    def _account(
        self,
        key: RoutingKey,
        last: str | None,
        replica: ReplicaState,
        decision: Decision,
        result: Outcome,
        first_choice: ReplicaState | None,
        t0: float,
        alone: bool = False,
        local: bool = True,
    ) -> None:
        m = self.metrics
        if result.prompt_tokens:
            replica.prompt_tokens += result.prompt_tokens
            replica.cached_tokens += result.cached_tokens
            m.child(m.prompt_tokens, replica.id).inc(result.prompt_tokens)
            m.child(m.cached_tokens, replica.id).inc(result.cached_tokens)
        if result.streamed and result.ttft_s is not None and not result.stream_error:
            now = time.monotonic()
            if result.completion_tokens >= 2:
                # time per output token after the first: the latency signal, normalised by reply length
                replica.tpot.append((now, (now - t0 - result.ttft_s) / (result.completion_tokens - 1)))
            if result.prompt_tokens and alone:
                # time to first token per prompt token computed (cached ones are nearly free), from
                # requests that found the replica otherwise idle: a queue is load, not sickness
                computed = max(result.prompt_tokens - result.cached_tokens, TTFT_FLOOR_TOKENS)
                replica.ttft.append((now, result.ttft_s / computed))
        if result.stream_error and not result.client_gone:
            replica.errors += 1
            m.child(m.stream_errors, replica.id).inc()
        if replica is not first_choice:
            m.failovers.inc()
        if key.kind != "none" and result.status < 400:
            if last is not None:
                m.followups.inc()
                moved = self.sessions.moved(key.key) if local else None  # else the news came from elsewhere
                if moved is not None and last == replica.id == self.sessions.get(key.key):
                    m.child(m.jumps, moved).inc()  # the router moved it here (its cache was warmed first)
                elif last != replica.id:
                    m.child(m.jumps, self._jump_reason(last, decision)).inc()
            self._remember(key, replica, t0)

    def _remember(self, key: RoutingKey, replica: ReplicaState, t0: float) -> None:
        """The session was served by `replica` (a request that started at `t0`): its next turn goes
        there, unless the router moved the session while the request ran."""
        # a move is stamped by the control process before it reaches the workers: one that
        # arrives while this request starts counts as made while it ran
        started_ms = (time.time() - (time.monotonic() - t0)) * 1000 - MOVE_SLACK_MS
        if (
            self.sessions.moved(key.key) is not None
            and self.sessions.written_ms(key.key) > started_ms
            and self.sessions.get(key.key) != replica.id
        ):
            return  # the router moved it (drain, migration) while this request ran: its next turn goes there
        self.sessions.put(key.key, replica.id)
        written = self.sessions.written_ms(key.key)
        if self.shared_sessions is not None:
            self.shared_sessions.put(key.key, replica, written)
        if self.redis_sessions is not None:
            self.redis_sessions.served(key.key, replica.id, written)

    def _jump_reason(self, last: str, decision: Decision) -> str:
        """Why a session left `last`: the reason is a label of router_session_jumps."""
        if decision.reason in ("failover", "spill", "round_robin", "least_load"):
            return decision.reason
        previous = self.fleet.find(last)
        if previous is None:
            return "membership"  # its replica left the fleet
        if previous.state == "draining":
            return "drain"
        if not previous.health.routable:
            return "health"
        if self.policy.name == "affinity":
            return "spill"  # routable and not tried, yet passed over: it was at its load cap
        return "ring"  # the key's ring owner changed (membership, weights or an override)

    def _finish(
        self,
        request: web.Request,
        response: web.StreamResponse,
        replica: ReplicaState | None,
        key: RoutingKey,
        decision: Decision | None,
        t0: float,
        result: Outcome | None = None,
        attempts: int = 0,
    ) -> web.StreamResponse:
        elapsed = time.monotonic() - t0
        name = replica.id if replica is not None else "none"
        status = response.status
        m = self.metrics
        m.child(m.requests, name, self.policy.name, key.kind, str(status)).inc()
        if replica is not None:
            m.child(m.e2e, name).observe(elapsed)
            if result is not None and result.ttft_s is not None:
                m.child(m.ttft, name).observe(result.ttft_s)
        if self.config.log_requests:
            access_log.info(
                json.dumps(
                    {
                        "ts": round(time.time(), 3),
                        "method": request.method,
                        "path": request.path,
                        "status": status,
                        "replica": replica.id if replica else None,
                        "policy": self.policy.name,
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
        return response

    # -- other routes ------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        """The union of every routable replica's models (first listing of an id wins)."""
        http = self.http
        urls = [r.url for i, r in enumerate(self.fleet.replicas) if self.fleet.routable(i)]

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

    async def _health(self, request: web.Request) -> web.Response:
        routable = sum(1 for i in range(len(self.fleet)) if self.fleet.routable(i))
        body = {
            "status": "ok" if routable else "unavailable",
            "replicas": len(self.fleet),
            "routable": routable,
            "worker": self.worker,
        }
        return web.Response(status=200 if routable else 503, body=orjson.dumps(body), content_type="application/json")

    async def _live(self, request: web.Request) -> web.Response:
        """Liveness: this process answers, whatever its replicas do (for a Kubernetes liveness
        probe, which must not restart routers because their replicas are down; /health is readiness)."""
        return web.Response(body=b'{"status":"alive"}', content_type="application/json")

    def metrics_registry(self) -> CollectorRegistry:
        """What /metrics serves, brought up to date: the per-replica gauges as of now."""
        m = self.metrics
        if self.follower is not None:  # this worker's view of every worker's in-flight requests, and of health
            self.follower.refresh()
            self.follower.pull_loads()
        for r in self.fleet.replicas if self.multiprocess_metrics is None else ():
            if r.index is None:
                continue
            m.inflight.labels(r.id).set(self.fleet.loads[r.index] - r.queue_load)
            m.score.labels(r.id).set(r.health.score)
            m.routable.labels(r.id).set(1 if r.health.routable else 0)
            m.state_changes.labels(r.id).set(r.health.transitions)
            m.show_health(r.id, r.state, r.inputs)
        return self.multiprocess_metrics or self.metrics.registry

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics_registry())
        return web.Response(body=body, content_type="text/plain", charset="utf-8")
