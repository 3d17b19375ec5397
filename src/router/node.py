"""The composition root: builds a lone router, the control process of workers, or a worker, from config.

A node owns what lives as long as the process: the fleet and its policy, the session table and
directory, the routing core, membership, health monitor, balance loop, discovery, Redis, the saved
routing state, shared memory, metrics, and the upstream client. Each piece gets the narrow
collaborators it uses; none reaches back into the node. The roles:

- lone (the default): probes, scores, balances and proxies; given a shared table, publishes to it
  for colocated router-agents;
- control (with `table`, no `worker`): probes, scores, owns membership and publishes the fleet to
  the shared table; its workers proxy (router.proxy.workers);
- worker (with `table` and `worker`): follows the shared table and proxies by its view; the
  control process runs the loops.

`contexts()` are the node's background work, for an aiohttp application's `cleanup_ctx`.
It is past 450 lines as the composition root: it builds every part a process has, for each of the
three kinds, in one order, and hands each part only the collaborators it uses; split, the order
that wiring needs would be spread over files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from router import tracing
from router.balance.controller import Balancer
from router.balance.link import internal_app, serve_internal, worker_socket
from router.balance.view import LocalSessions
from router.config import (
    RouterConfig,
    score_weights,
    shared_through_redis,
)
from router.engines.discovery import Discovery
from router.engines.handoff import VLLM
from router.engines.kvfeed import Feed, IndexBudget, index_budget_blocks, shard_budget
from router.engines.upstream import Upstream
from router.fleet import ReplicaState
from router.health.states import Hysteresis
from router.kvevents.mapped import SharedFileError
from router.kvevents.shared import SharedIndex, SharedIndexReader
from router.membership import Membership
from router.metrics import RouterMetrics, multiprocess_registry, show_replica_gauges
from router.monitor import HealthMonitor, latency_window_s
from router.placement import Placement
from router.policy import make_policy
from router.policy.ttft import Ttft
from router.pools import Pairs, Pool, lending_pool, prefill_pool, replica_fleet
from router.ring import xxh3_64
from router.routing import Routing, SessionDirectory
from router.sessions import LinkDown, SessionTable, SessionView
from router.shm.table import SlotTable
from router.state.file import Persistence, state_file
from router.state.redis import RedisPlacements, RedisSessions, RedisState
from router.state.replica_table import Follower, Publisher
from router.state.session_table import SharedSessions
from router.tenancy.admission import Admission
from router.tenancy.budgets import Budgets, LocalStore, RedisStore, Store
from router.tenancy.clients import ClientKeys
from router.tls import ServerTls, replica_context, server_tls
from router.tracing import Tracing

log = logging.getLogger("router.node")
SYNC_INTERVAL_S = 0.05  # how often a worker follows the shared table and publishes its counters

Context = Callable[[web.Application], AsyncIterator[None]]


class Node:
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
        # who may use the API (router.tenancy.clients); None: anyone
        self.clients = ClientKeys(config.client_keys_file) if config.client_keys_file else None
        # HTTPS to clients (None: plain HTTP) and the context https:// replicas are reached with (router.tls)
        self.tls: ServerTls | None = server_tls(config.tls)
        self.replica_ssl = replica_context(config.tls)
        # OpenTelemetry traces of the requests this process serves (router.tracing): OTEL_* turns them on
        self.tracing: Tracing | None = tracing.setup() if worker is not None or config.workers <= 1 else None
        self.budgets: Budgets | None = None  # the tenants' tokens a minute (router.tenancy.budgets), with keys on
        if self.clients is not None:
            self.budgets = self._budgets(self.clients)
        self.control: aiohttp.ClientSession | None = None  # a worker's line to the control process
        self.client: aiohttp.ClientSession | None = None
        self.upstream: Upstream | None = None  # the proxied requests' keep-alive pools
        rules = Hysteresis(
            config.remove_below,
            config.return_above,
            config.remove_after,
            config.return_after,
            config.recovery_ramp_s,
            flap_backoff=config.flap_backoff,
        )
        self.fleet = fleet = replica_fleet(config, () if worker is not None else config.replicas, rules)
        self.metrics = metrics or RouterMetrics()
        # a disaggregated fleet's prefill replicas (router.pools, router.proxy.disagg): a pool of
        # their own, out of the route's reach
        routes = worker is not None or config.workers <= 1  # this process routes requests
        # the event-fed indexes' budget, the process's (its feeds': a prefill pool's and the route's);
        # by default a quarter of the host's memory, or under --workers the control process's (it
        # follows the engines for the host) and a share of it each worker's (one follows them itself
        # only where the host's shared index could not be laid out)
        # the control process follows the engines into the host's index in /dev/shm (with
        # kv_event_followers, the first shard of them; router.proxy.followers starts the others)
        shared = table is not None and worker is None and not routes
        followers = config.placement.kv_event_followers if shared else 1
        if shared:
            budget = shard_budget(config.placement.kv_events_max_mib, followers)
        else:
            processes = max(config.workers, 1) if worker is not None else 1
            budget = IndexBudget(index_budget_blocks(config.placement.kv_events_max_mib, processes))
        prefill = prefill_pool(config, rules, self.metrics, lambda: self.http, routes, budget)
        disaggregated = prefill is not None
        self.policy = make_policy(config.policy, fleet, config)
        # ttft's prefix index and prefill queues: what the KV-event feed, shared placements, warm-up
        # and the admin API read and feed (the root knows the concrete policy; nothing else asks)
        self.placement: Placement | None = self.policy.placement if isinstance(self.policy, Ttft) else None
        self.sessions = SessionTable(config.sticky_max_sessions, config.sticky_ttl_s)
        self.publisher = Publisher(fleet, table) if table is not None and worker is None else None
        self.membership = Membership(
            fleet,
            forget=self.metrics.forget_replica,  # its sessions stay: their next turns count as membership jumps
            room=self.publisher.has_room if self.publisher is not None else lambda: True,
        )
        if self.publisher is not None:
            self.membership.published.append(self.publisher.publish)
            self.membership.released.append(self.publisher.forget)
        self.follower: Follower | None = None
        self.shared_sessions: SharedSessions | None = None
        if table is not None and worker is not None:
            self.follower = Follower(
                fleet,
                table,
                worker,
                latency_window_s(config.probe_interval_s),
                on_removed=self.metrics.forget_replica,
                queue_weight=config.load_queue_weight,
            )
            self.follower.reload()
            if table.sticky_entries:
                self.shared_sessions = SharedSessions(table, worker, fleet, config.sticky_ttl_s)
        self.redis: RedisState | None = None
        self.redis_sessions: RedisSessions | None = None  # where sessions are looked up and written in Redis
        # ttft: prompts placed by this process and by the other routers (and workers) on one Redis
        self.placements: RedisPlacements | None = None
        placement = self.placement
        redis = shared_through_redis(config.state)
        if redis and placement is not None and (worker is not None or config.workers <= 1):
            self.placements = RedisPlacements(config.state, config.state_namespace, placement.learned)
            placement.share = self.placements.placed
        if redis:
            if worker is None:
                self.redis = RedisState(
                    config.state, config.state_namespace, self.membership, config.replicas, config.sticky_ttl_s
                )
                self.redis_sessions = self.redis.sessions
                self.membership.peers = self.redis
            else:  # a worker looks sessions up and writes them itself; the control process does the rest
                self.redis_sessions = RedisSessions.connect(config.state, config.state_namespace, config.sticky_ttl_s)
        # where the balance loop finds sessions: here (a lone router), or, for the control process of
        # worker processes, the workers (router.proxy.workers sets it); a worker has none
        lone = worker is None and config.workers <= 1
        self.view = SessionView(None, lone)
        self.balancer = Balancer(
            config.balance,
            fleet,
            self.metrics,
            self.membership,
            self.view.current,
            self.upstream_client,
            gather=self.gather,
            leader=lambda: self.redis is None or self.redis.leader,
            peers=self.redis_sessions if worker is None else None,
            share=max(config.workers, 1) if worker is not None else 1,
            warmed=self.placement.warmed if self.placement is not None else None,
            by_ring=self.placement is None,
            sticky_ttl_s=config.sticky_ttl_s,
            prefill_anywhere=config.prefill_anywhere,
        )
        self.membership.mover = self.balancer
        if lone:
            self.view.attach(LocalSessions(self.sessions, self.balancer.prompts))
        self.directory = SessionDirectory(
            self.sessions, config.sticky_ttl_s, siblings=self.shared_sessions, peers=self.redis_sessions
        )
        self.routing = Routing(fleet, self.policy, self.directory, self.metrics, config.max_attempts, self.balancer)
        self.admission = Admission(
            fleet,
            config.max_queued,
            config.queue_timeout_s,
            config.full_waiting,
            config.full_kv_usage,
            on_change=self.metrics.queued.set,
            inflight=self.follower.fleet_inflight if self.follower is not None else None,
            # a worker sees the others' sends only as they publish them: of the slots an engine
            # had free, it fills its share before it counts its sends as queued
            free_share=1 / table.workers if self.follower is not None and table is not None else 1.0,
            cold_s=config.scale_from_zero_s,
            ttft_target_s=config.ttft_target_ms / 1000,
        )
        self.balancer.held = lambda: self.admission.queued
        if self.admission.on:
            fleet.full_of = self.admission.full_of  # a full replica is no candidate while another has room
        self.monitor = HealthMonitor(
            fleet,
            lambda: self.http,
            config.probe_interval_s,
            config.probe_timeout_s,
            weights=score_weights(config.health),
            agents=dict(entry.split("=", 1) for entry in config.agents),
            table=table,
            queue_weight=config.load_queue_weight,
            before_round=self.gather,
            after_round=self._probed,
            inflight=self.admission.inflight,
        )
        self.discovery = (
            Discovery(
                self.membership,
                self.metrics,
                config.discovery,
                config.discovery_interval_s,
                config.replicas,
                role="decode" if disaggregated else None,
            )
            if config.discovery and worker is None
            else None
        )
        self.persistence: Persistence | None = None
        file = state_file(config.state, config.host, config.port) if worker is None else None
        if file is not None:
            self.persistence = Persistence(file, self.membership, config.replicas, self.view)
            self.persistence.restore(self.sessions)  # StateError: the caller says so and stops
        # ttft: the engines' KV-cache events. A lone router follows them itself. Under --workers the
        # control process follows them once for the host, into an index in shared memory that its
        # workers read (router.kvevents.shared); a worker whose control process could not lay one
        # out follows them itself, as a lone router does.
        self.feed: Feed | None = None
        self.shared_index: SharedIndex | None = None
        if placement is not None and config.kv_events:
            name = f"{table.name}-kv" if table is not None else None
            if name is not None and worker is None and not routes:
                self.shared_index = _shared_index(name, followers)
                if self.shared_index is not None:
                    placement.truth.share(self.shared_index)
                    if followers > 1:  # (what the other shards follow, for the admin API)
                        placement.truth.beside = _index_reader(name)
                    self.feed = Feed(
                        fleet,
                        placement,
                        config.placement,
                        lambda: self.http,
                        self.metrics,
                        routes=False,
                        budget=budget,
                        shard=(0, followers),
                    )
            elif routes:
                reader = _index_reader(name) if name is not None and worker is not None else None
                if reader is not None:
                    placement.truth.share(reader)
                self.feed = Feed(fleet, placement, config.placement, lambda: self.http, self.metrics, budget=budget)
        # the roles' routing cores: the route's, and a disaggregated fleet's prefill pool
        self.pools = [Pool("serve", fleet, self.policy, self.routing, self.monitor, self.discovery, self.feed)]
        if prefill is not None:
            self.pools.append(prefill)
        # with prefill_anywhere, the replicas lend one another their prefill: the legs' routing
        # core over the route's own fleet and policy (router.pools.lending_pool)
        self.lending = lending_pool(self.pools[0], config, self.metrics) if config.prefill_anywhere else None
        # which replica that prefills has met which that decodes: introduced by every process
        # that routes, before a client's request is split across them (router.pools.Pairs)
        lender = prefill if prefill is not None else self.lending
        self.pairs: Pairs | None = None
        if lender is not None and config.disagg_introduce and routes:
            self.pairs = Pairs(lender.fleet, fleet, VLLM, lambda: self.http, self._pair_met)
        self.multiprocess_metrics = (
            multiprocess_registry(*(pool.fleet for pool in self.pools)) if worker is not None else None
        )

    def _pair_met(self, outcome: str, seconds: float) -> None:
        self.metrics.pair_meetings.labels(outcome).inc()
        self.metrics.pair_meeting_seconds.observe(seconds)

    def _budgets(self, clients: ClientKeys) -> Budgets:
        """The tenants' budgets: in Redis where the routing state is (every router and worker on it
        shares one), else this process's share of each (a worker's, of its router's)."""
        config = self.config
        store: Store
        if shared_through_redis(config.state):
            store, share = RedisStore.connect(config.state, f"kvar:{config.state_namespace}:"), 1.0
        else:
            store, share = LocalStore(), 1 / max(config.workers, 1)

        def limits() -> dict[str, int]:
            return {tenant: max(1, int(n * share)) for tenant, n in clients.budgets().items()}

        budgets = Budgets(limits(), store, reserve_tokens=self.config.budget_reserve_tokens)
        clients.changed.append(lambda: budgets.update(limits()))
        return budgets

    def pool(self, role: str) -> Pool | None:
        """The pool of `role` ("serve", "prefill"), if this router has one."""
        return next((p for p in self.pools if p.role == role), None)

    def pool_of(self, replica: ReplicaState) -> Pool:
        """The pool whose fleet `replica` is in (the route's, for one in none)."""
        return next((p for p in self.pools if p.fleet.find(replica.id) is replica), self.pools[0])

    def state_line(self) -> str:
        """Where the routing state lives, for the start-up banner."""
        if self.redis is not None:
            return f"routing state: shared through {self.config.state} (namespace {self.config.state_namespace})"
        if self.persistence is not None:
            return self.persistence.line()
        return "routing state: not saved (--state none)"

    async def save_state(self, force: bool = False) -> None:
        """Save the routing state now if it changed (or `force`), where it is saved to a file."""
        if self.persistence is not None:
            await self.persistence.save(force)

    # -- shared state (worker processes) ---------------------------------------------------------

    def publish(self) -> None:
        """Routing changed: write the fleet to the shared table (if any), mark the state for saving."""
        self.membership.publish()

    def _probed(self) -> None:
        """A probe round ended: the workers' table is written, and held requests may go where there is room."""
        if self.publisher is not None:
            self.publisher.publish()
            self.publisher.table.bump_probe_round()  # the workers' admission counts its sends from here
        self.admission.probed()

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

    def prefill_shared_sessions(self, table: SlotTable) -> None:
        """Control process, before the workers start: write the restored sessions into the
        workers' shared session tables (each its share by key hash; nobody writes them yet), so
        that the first requests already go where the sessions' caches are. The workers' own
        tables get them too, once they answer (`_after_start`), for saving and drains."""
        restored = self.persistence.restored_sessions if self.persistence is not None else []
        if not restored or not table.sticky_entries or table.workers < 1:
            return
        rows = [SharedSessions(table, w, self.fleet, self.config.sticky_ttl_s) for w in range(table.workers)]
        now_ms = time.time() * 1000
        for key, replica_id, left, _ in restored:
            replica = self.fleet.find(replica_id)
            if replica is not None:
                # the entry's age is what makes it expire there: written so that `left` remains
                written = int(now_ms - (self.config.sticky_ttl_s - left) * 1000)
                rows[xxh3_64(key) % len(rows)].put(key, replica, written)

    def metrics_registry(self) -> CollectorRegistry:
        """What /metrics serves, brought up to date: the per-replica gauges as of now."""
        if self.follower is not None:  # this worker's view of every worker's in-flight requests, and of health
            self.follower.refresh()
            self.follower.pull_loads()
        if self.multiprocess_metrics is not None:
            return self.multiprocess_metrics
        show_replica_gauges(self.metrics, *(pool.fleet for pool in self.pools))
        return self.metrics.registry

    @property
    def http(self) -> aiohttp.ClientSession:
        """The upstream client session; it exists while the application runs."""
        assert self.client is not None, "the router application is not running"
        return self.client

    def upstream_client(self) -> Upstream:
        assert self.upstream is not None, "the router application is not running"
        return self.upstream

    # -- background work -------------------------------------------------------------------------

    def contexts(self, control_only: bool = False) -> list[Context]:
        """The node's background work, for `cleanup_ctx` after `client_context` (which the
        routes' own contexts may need): a worker's line to the control process, or the control
        loops (health probes, balance, routing state, Redis, discovery, as configured)."""
        contexts: list[Context] = []
        if self.budgets is not None and isinstance(self.budgets.store, RedisStore) and not control_only:
            contexts.append(self._budgets_ctx)  # first in, so closed last: it sends what the requests owe
        if self.tls is not None and not control_only:  # each serving process reads its certificate again
            contexts.append(self._tls_ctx)
        # the other roles' pools (prefill): probed and found by every process, the control process
        # too (its admin API and console show them)
        for pool in self.pools[1:]:
            if pool.monitor is not None and self.config.health_checks:
                contexts.append(self._monitor_context(pool.monitor, f"{pool.role} health monitor"))
            if pool.discovery is not None:
                contexts.append(self._discovery_context(pool.discovery, f"{pool.role} discovery"))
            if pool.feed is not None and not control_only:
                contexts.append(self._feed_context(pool.feed, f"{pool.role} kv events"))
        if self.pairs is not None and not control_only:
            contexts.append(self._pairs_ctx)
        if self.follower is not None and not control_only:
            contexts.append(self._follower_ctx)
            if self.placements is not None:
                contexts.append(self._placements_ctx)
            if self.feed is not None:
                contexts.append(self._feed_context(self.feed, "kv events"))
            return contexts
        if self.placements is not None and not control_only:
            contexts.append(self._placements_ctx)
        if self.feed is not None and not control_only:
            contexts.append(self._feed_context(self.feed, "kv events"))
        if self.feed is not None and self.shared_index is not None:  # the control process, for its workers
            contexts.append(self._feed_context(self.feed, "kv events (for the workers)"))
        if self.config.health_checks:
            contexts.append(self._monitor_context(self.monitor, "health monitor"))
        contexts.append(self._balance_ctx)
        if self.persistence is not None:
            contexts.append(self.persistence.context)
        if self.redis is not None:
            contexts.append(self._redis_ctx)
        if self.discovery is not None:
            contexts.append(self._discovery_context(self.discovery, "discovery"))
        return contexts

    async def client_context(self, app: web.Application) -> AsyncIterator[None]:
        """The upstream client, while the application runs (first in `cleanup_ctx`)."""
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=self.config.upstream_connections,
            enable_cleanup_closed=True,
            ssl=self.replica_ssl if self.replica_ssl is not None else True,
        )
        self.client = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        # the proxied requests' own keep-alive pools (router.engines.upstream); probes and the rest use `client`
        self.upstream = Upstream(self.config.upstream_connections, self._reconnected, self.replica_ssl)
        yield
        self.upstream.close()
        await self.client.close()
        if self.tracing is not None:  # the spans still batched are sent (blocking: off the loop)
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)

    def _reconnected(self, url: str) -> None:
        """A request went out again on a new connection: its pooled one was closed by the replica."""
        replica = next((r for r in self.fleet.replicas if url.startswith(r.url + "/")), None)
        self.metrics.child(self.metrics.reconnects, replica.id if replica is not None else "none").inc()

    @staticmethod
    async def _run(task: asyncio.Task[Any]) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _monitor_context(self, monitor: HealthMonitor, name: str) -> Context:
        """A health monitor's probe rounds, run while the app runs (the route's pool's, or another role's)."""

        async def context(app: web.Application) -> AsyncIterator[None]:
            task = asyncio.create_task(monitor.run(), name=name)
            yield
            await self._run(task)

        return context

    async def _pairs_ctx(self, app: web.Application) -> AsyncIterator[None]:
        assert self.pairs is not None
        task = asyncio.create_task(self.pairs.run(self.config.probe_interval_s), name="pair introductions")
        yield
        await self._run(task)

    async def _balance_ctx(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.balancer.run(), name="balance")
        start = asyncio.create_task(self._after_start(), name="restored drains")
        yield
        for t in (start, task):
            await self._run(t)
        await self.balancer.close()

    async def _after_start(self) -> None:
        """Once the sessions can be asked for: restored sessions to the workers, restored drains go on."""
        await self.view.ready.wait()
        persistence = self.persistence
        if persistence is None:
            return
        source = self.view.source
        for tries in range(5):
            if not persistence.restored_sessions or source is None:
                break
            try:
                await source.restore(persistence.restored_sessions)
                persistence.restored_sessions = []
            except LinkDown:  # a worker did not take its share: all again (a restore skips what is newer)
                await asyncio.sleep(1.0 + tries)
        if persistence.restored_sessions:
            logging.getLogger("router.state.file").warning(
                "%d restored sessions did not all reach the workers; those not taken start over",
                len(persistence.restored_sessions),
            )
        persistence.restored_sessions = []
        settle, persistence.settle = persistence.settle, None  # drains under way when the router stopped go on
        if settle is not None:
            await self.membership.settle(settle)

    async def _redis_ctx(self, app: web.Application) -> AsyncIterator[None]:
        assert self.redis is not None
        await self.redis.start()
        yield
        await self.redis.close()

    async def _tls_ctx(self, app: web.Application) -> AsyncIterator[None]:
        assert self.tls is not None
        task = asyncio.create_task(self.tls.watch(), name="tls certificate")
        yield
        await self._run(task)

    async def _budgets_ctx(self, app: web.Application) -> AsyncIterator[None]:
        yield
        assert self.budgets is not None and isinstance(self.budgets.store, RedisStore)
        await self.budgets.store.close()  # what its tenants are owed, sent

    async def _placements_ctx(self, app: web.Application) -> AsyncIterator[None]:
        assert self.placements is not None
        task = asyncio.create_task(self.placements.run(), name="shared placements")
        yield
        await self._run(task)
        await self.placements.close()

    def _feed_context(self, feed: Feed, name: str) -> Context:
        """A KV-event feed's reader, run while the app runs (the fleet's, or the prefill replicas')."""

        async def context(app: web.Application) -> AsyncIterator[None]:
            task = asyncio.create_task(feed.run(), name=name)
            yield
            await self._run(task)
            await feed.close()
            if feed is self.feed and self.shared_index is not None:
                self.shared_index.close()  # its files unlinked (a worker keeps what it mapped)

        return context

    def _discovery_context(self, discovery: Discovery, name: str) -> Context:
        """A discovery's lookups, run while the app runs (the fleet's, or the prefill replicas')."""

        async def context(app: web.Application) -> AsyncIterator[None]:
            task = asyncio.create_task(discovery.run(), name=name)
            yield
            await self._run(task)

        return context

    async def _follower_ctx(self, app: web.Application) -> AsyncIterator[None]:
        follower = self.follower
        assert follower is not None
        self.control = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.control_socket or ""))

        async def tick() -> None:
            last_refresh = 0.0
            probe_round = follower.table.probe_round
            while True:
                now = time.monotonic()
                try:
                    follower.sync()
                    if follower.table.probe_round != probe_round:
                        # the engines' queues are new: admission counts sends from here, and lets
                        # waiters through where there is room now
                        probe_round = follower.table.probe_round
                        follower.refresh()
                        last_refresh = now
                        self.admission.probed()
                    elif now - last_refresh >= 1.0:  # scores and states for display; routing follows the generation
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
        internal = await serve_internal(
            worker_socket(self.control_socket or "", self.worker or 0),
            internal_app(
                self.sessions,
                self.shared_sessions,
                self.balancer.traffic,
                self.balancer.prompts,
                self.fleet,
                self.follow,
                self.config.sticky_ttl_s,
                held=lambda: self.admission.queued,
            ),
        )
        yield
        await internal.cleanup()
        for task in tasks:
            await self._run(task)
        if self.redis_sessions is not None:
            await self.redis_sessions.close(own_client=True)
        await self.control.close()


def _shared_index(name: str, shards: int) -> SharedIndex | None:
    """The control process's index in shared memory for its workers (the first of `shards`), or
    None where it cannot lay one out (each worker then follows the engines itself)."""
    try:
        return SharedIndex(name, shard=0, shards=shards)
    except SharedFileError as exc:
        log.warning("%s: each worker follows the engines' KV events itself", exc)
        return None


def _index_reader(name: str) -> SharedIndexReader | None:
    """A worker's reader of its control process's shared index (None: there is none)."""
    try:
        return SharedIndexReader(name)
    except SharedFileError:
        return None
