"""The balance control loop of a router process: rebalancing, warm-up, scale-out, drain.

Every second: ramps of warming and recovering replicas move on; each routable replica's load
(in flight plus waiting) feeds the rebalancer; its planned moves are carried out one at a time:
the sessions on the moved vnode that were last served by the hot replica are warmed on the cool
one (their latest prompts replayed as prefill-only requests), then the vnode's override and
their session entries switch together.

Scale-out (`added`): the new replica is `warming` (router.membership started its slow start,
its ring weight ramping up); the most recent sessions whose keys now belong to it are warmed there and moved; the
others stay where their cache is until their session entry expires. Drain (`drain`): the replica
takes no new sessions; its sessions are warmed on their new ring owners and moved, batch by
batch; it keeps serving the ones not moved yet and its in-flight requests; with `remove`, it
leaves the fleet once nothing is in flight (or after `drain_timeout_s`).

In a router with worker processes these act in the control process, which asks the workers
for what they saw (sessions, prompts, per-vnode traffic) and tells them what moved, through
its `SessionSource` (router.balance.view, router.balance.link). Membership changes it makes
(a drained replica's removal, a migrated vnode's override) go through router.membership.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from router.balance.rebalance import Move, Rebalancer, RebalanceSettings, VnodeTraffic
from router.balance.warmup import PromptStore, Source, warm
from router.config.groups import BalanceSettings
from router.engines.handoff import VLLM
from router.engines.upstream import Upstream
from router.fleet import Fleet, ReplicaState
from router.membership import Membership
from router.metrics import RouterMetrics
from router.routing import PeerSessions
from router.sessions import LinkDown, SessionEntry, SessionSource

log = logging.getLogger("router.balance")
TICK_S = 1.0


class Balancer:
    def __init__(
        self,
        config: BalanceSettings,
        fleet: Fleet,
        metrics: RouterMetrics,
        membership: Membership,
        sessions: Callable[[], SessionSource | None],
        upstream: Callable[[], Upstream],
        gather: Callable[[], None] = lambda: None,
        leader: Callable[[], bool] = lambda: True,
        peers: PeerSessions | None = None,
        share: int = 1,
        warmed: Callable[[ReplicaState, bytes], None] | None = None,
        by_ring: bool = True,
        *,
        sticky_ttl_s: float,
        prefill_anywhere: bool,
    ) -> None:
        """`sessions`: where sessions are found, once they can be asked for; `upstream`: the client
        warm-ups go out on; `gather`: brings the workers' in-flight counts in; `leader`: whether
        this router is the one that rebalances; `peers`: the other routers' sessions (Redis), told
        of moves; `share`: of the prompt store's cap, this process keeps 1/share (a worker); `warmed`:
        told of each request body a warm-up computed on a replica (the prefix index learns it);
        `by_ring`: the policy places sessions by the ring, so a hot replica's traffic is its vnodes'
        and overheat moves vnodes (under `ttft` it is not: placement by cost steers new work off a
        hot replica, and only scale-out and drain move sessions); `sticky_ttl_s`: how long a session
        (and its prompt, kept for warm-up) lives; `prefill_anywhere`: a session that moves warms
        up by a prefill on the replica it leaves (router.proxy.disagg)."""
        cfg = self.config = config
        self.fleet = fleet
        self.metrics = metrics
        self.membership = membership
        self._sessions = sessions
        self._upstream = upstream
        self._gather = gather
        self._leader = leader
        self._peers = peers
        self._warmed = warmed
        self.prefill_anywhere = prefill_anywhere
        self.migrates = cfg.rebalance and by_ring  # overheat moves vnodes (and counts their traffic)
        # requests held in this process because every replica was full (router.tenancy.admission): load too
        self.held: Callable[[], int] = lambda: 0
        # with worker processes each keeps the prompts of the requests it proxies: a share of the cap
        self.prompts = PromptStore(cfg.prompt_store_bytes // share, sticky_ttl_s)
        self.traffic = VnodeTraffic()
        self.rebalancer = Rebalancer(
            RebalanceSettings(
                threshold=cfg.rebalance_threshold,
                window_s=cfg.rebalance_window_s,
                cooldown_s=cfg.rebalance_cooldown_s,
                max_vnodes=cfg.rebalance_max_vnodes,
            )
        )
        self.tasks: set[asyncio.Task[None]] = set()
        self._migrating: set[tuple[str, int]] = set()
        self._migrating_replicas: set[str] = set()
        self._idle_since: float | None = None
        # the latest scale signal (router_scale_recommended_replicas, /admin/scale) and whether idle
        self.recommended = 1
        self.idle = False

    # -- from the proxy ----------------------------------------------------------------------------

    def served(self, key: bytes, path: str, body: bytes) -> None:
        """A keyed request was served: count its vnode's traffic, keep its prompt for warm-up."""
        located = self.fleet.ring.locate(key) if self.migrates else None
        if located is not None:  # (the fleet's replicas are the ring's, by index: the ring's ids are a copy a read)
            self.traffic.record(self.fleet.replicas[located[1]].id, located[2])
        self.prompts.put(key, path, body)

    # -- the loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                await self.tick(time.monotonic())
            except Exception:  # a bug here must not stop routing; it is logged and the loop goes on
                log.exception("balance tick failed")
            # on the wall clock's whole ticks: routers on one fleet step slow starts at the same moment
            await asyncio.sleep(TICK_S - time.time() % TICK_S)

    async def tick(self, now: float) -> None:
        fleet = self.fleet
        changed = False
        for replica in fleet.replicas:
            if replica.health.tick(now) is not None or replica.state in ("warming", "recovering"):
                changed |= bool(fleet.apply_health(replica, now))
        if changed:
            self.membership.publish()
        # a replica's load here: its requests in flight plus those waiting in its engine's queue
        self._gather()  # with worker processes: their in-flight counts, summed
        loads = {
            r.id: r.inflight + (r.engine.waiting or 0.0)
            for r in fleet.replicas
            if r.index is not None and r.state in ("healthy", "suspect")
        }
        self.rebalancer.observe(loads, now)
        self._scale_signals(now)
        m = self.metrics
        for rid in loads:
            m.child(m.replica_load, rid).set(self.rebalancer.load(rid))
        view = self._sessions()
        if view is not None and self.migrates:
            for vnode, count in (await view.traffic()).items():  # what the workers counted
                self.traffic.recent[vnode] += count
        # (none hot for the window: nothing to plan, and the vnodes' owners are not gathered)
        if view is not None and self.migrates and self._leader() and self.rebalancer.overheated(now):
            ring = fleet.ring
            overrides = ring.overrides
            present = {rid for rid, up in zip(ring.replica_ids, ring.available, strict=True) if up}
            owners = {v: overrides.get(v, v[0]) for v in self.traffic.recent if v[0] in present}
            busy = self._migrating
            traffic = Counter({v: c for v, c in self.traffic.recent.items() if v not in busy})
            moves = [
                m
                for m in self.rebalancer.plan(now, traffic, owners)
                if m.source not in self._migrating_replicas and m.target not in self._migrating_replicas
            ]
            for move in moves:  # in the background: warm-up takes seconds, the loop must go on ticking
                self._spawn(self.migrate(move))
            self.rebalancer.moved(moves, now)
        self.traffic.decay()

    def _scale_signals(self, now: float) -> None:
        """Signals for an autoscaler: sustained overheat, sustained idleness, replicas needed."""
        m = self.metrics
        target = self.config.scale_target_load
        held = self.held()
        total = self.rebalancer.total() + held  # held requests want a replica as much as queued ones
        m.overheated.set(len(self.rebalancer.overheated(now)))
        routable = max(len(self.rebalancer.loads()), 1)
        if total / routable < target / 4:
            self._idle_since = self._idle_since if self._idle_since is not None else now
        else:
            self._idle_since = None
        idle = self._idle_since is not None and now - self._idle_since >= self.rebalancer.settings.window_s
        # at least one replica, unless the fleet may scale to zero (scale_from_zero_s: a request
        # then waits for one) and has been idle with nothing held: any request held asks for one
        floor = 0 if self.config.scale_from_zero_s and idle and not held else 1
        self.recommended = max(floor, math.ceil(total / target - 1e-9))
        self.idle = idle
        m.scale_recommended.set(self.recommended)
        m.scale_idle.set(1 if idle else 0)

    # -- moving sessions ----------------------------------------------------------------------------

    async def _warm_and_move(
        self, target: ReplicaState, keys: list[bytes], reason: str, all_keys: bool, source: ReplicaState | None = None
    ) -> int:
        """Warm the most recent of `keys` on `target` and move those whose warm-up succeeded (or,
        with warm-up off, the same most recent ones, cold); with `all_keys`, move the rest too.
        `source`: the replica they leave; with prefill_anywhere, while it is up, their warm-up
        reads their KV from there (router.balance.warmup.Source). Returns how many moved."""
        cfg = self.config
        m = self.metrics
        view = self._sessions()
        if view is None:
            return 0
        hottest = list(reversed(keys[-cfg.warmup_sessions :])) if cfg.warmup_sessions else []
        stored = await view.prompts(hottest)
        chosen = [(key, stored[key]) for key in hottest if key in stored]
        if cfg.warmup and chosen:
            result = await warm(
                self._upstream().post,
                target.url,
                [prompt for _, prompt in chosen],
                cfg.warmup_concurrency,
                cfg.warmup_timeout_s,
                target.auth,
                self._source(source, target),
            )
            counts = (
                ("ok", result.ok),
                ("moved", result.moved),
                ("failed", result.failed),
                ("skipped", result.skipped),
            )
            for outcome, count in counts:
                if count:
                    m.child(m.warmups, outcome).inc(count)
            ready = [key for (key, _), ok in zip(chosen, result.succeeded, strict=True) if ok]
            if self._warmed is not None:
                for (_, (_, body)), ok in zip(chosen, result.succeeded, strict=True):
                    if ok:
                        self._warmed(target, body)
        else:
            ready = [key for key, _ in chosen]
        if target.index is None:
            return 0  # it left the fleet while we warmed
        moved = await view.move(keys if all_keys else ready, target.id, reason)
        if self._peers is not None:
            for key, written in moved:
                self._peers.served(key, target.id, written)
        if moved:
            m.child(m.sessions_moved, reason).inc(len(moved))
        return len(moved)

    def _source(self, source: ReplicaState | None, target: ReplicaState) -> Source | None:
        """Where the sessions' KV can be read from: the replica they leave, where every replica
        prefills for another (prefill_anywhere) and it is up (routable, or drained by an operator:
        its engine serves what it holds)."""
        if not self.prefill_anywhere or source is None or source is target or source.index is None:
            return None
        if not source.health.up:
            return None
        return Source(source.url, source.auth, VLLM)

    async def migrate(self, move: Move) -> None:
        """Warm the vnode's sessions on the target, then hand the vnode over (one at a time per
        vnode and per replica: planning leaves both alone while this runs)."""
        vnode = (move.origin, move.number)
        self._migrating.add(vnode)
        self._migrating_replicas.update((move.source, move.target))
        try:
            await self._migrate(move)
        finally:
            self._migrating.discard(vnode)
            self._migrating_replicas.difference_update((move.source, move.target))

    async def _migrate(self, move: Move) -> None:
        fleet, ring = self.fleet, self.fleet.ring
        source, target = fleet.find(move.source), fleet.find(move.target)
        if source is None or target is None or move.origin not in ring.replica_ids:
            return
        found = await self._live(source.id)
        if found is None:
            return  # its sessions cannot be asked for now: no move without their warm-up
        keys = []
        ids = ring.replica_ids  # (a copy a read: once, not once a session)
        for key, *_ in found:
            located = ring.locate(key)
            if located is not None and ids[located[1]] == move.origin and located[2] == move.number:
                keys.append(key)
        # sessions whose warm-up did not succeed stay where their cache is until their entry ends
        await self._warm_and_move(target, keys, "migration", all_keys=False, source=source)
        if target.index is None or move.origin not in ring.replica_ids:
            return  # the fleet changed while we warmed
        self.membership.override(move.origin, move.number, target.id)
        self.metrics.migrations.inc()
        log.info(
            "moved vnode %s#%d from %s to %s (%d sessions)", move.origin, move.number, source.id, target.id, len(keys)
        )

    async def added(self, replica: ReplicaState) -> int | None:
        """Scale-out (its slow start is under way): warm-up and move of the sessions that now belong
        to it. Returns how many sessions will be warmed and moved (None: the sessions cannot be
        asked for now, so none are)."""
        if replica.index is None or not self.config.warmup_sessions:
            return 0
        sessions = await self._live(None)
        if sessions is None:
            return None
        keys = self._owned_at_full_weight(replica, [key for key, owner, _, _ in sessions if owner != replica.id])
        keys = keys[-self.config.warmup_sessions :]
        if keys:
            self._spawn(self._warm_and_move(replica, keys, "scale_out", all_keys=False))
        return len(keys)

    async def _live(self, replica: str | None) -> list[SessionEntry] | None:
        """The live sessions (of `replica`); None while the view cannot answer (worker processes
        starting, or none answering)."""
        view = self._sessions()
        if view is None:
            return None
        try:
            return await view.live(replica)
        except LinkDown:
            return None

    def _owned_at_full_weight(self, replica: ReplicaState, keys: list[bytes]) -> list[bytes]:
        """The keys the ring gives `replica` once its slow start is over."""
        ring = self.fleet.ring
        i = replica.index
        if i is None:
            return []
        weight, available = ring.weights[i], ring.available[i]
        # local only, with no await in between: nothing is published, nothing routes by it
        ring.set_available(i, True)
        ring.set_weight(i, 1.0)
        try:
            return [key for key in keys if ring.lookup(key) == i]
        finally:
            ring.set_weight(i, weight)
            ring.set_available(i, available)

    async def drain(self, replica: ReplicaState, remove: bool) -> int | None:
        """Move a draining replica's sessions to their ring owners, warming first; then remove it
        if asked. Returns how many sessions are to move (None: not known yet; the drain asks
        again until it knows, or until `drain_timeout_s`)."""
        found = await self._live(replica.id)
        keys = None if found is None else [key for key, *_ in found]
        self._spawn(self._drain(replica, keys, remove))
        return None if keys is None else len(keys)

    async def _drain(self, replica: ReplicaState, keys: list[bytes] | None, remove: bool) -> None:
        fleet = self.fleet
        deadline = time.monotonic() + self.config.drain_timeout_s
        rounds = 0
        # a membership change while we warm: group what is left again, three times at most
        while rounds < 3 and time.monotonic() < deadline and replica.index is not None:
            if keys is None:  # the sessions cannot be asked for yet: never remove it blind
                await asyncio.sleep(1.0)
                found = await self._live(replica.id)
                keys = None if found is None else [key for key, *_ in found]
                continue
            rounds += 1
            groups: dict[int, tuple[ReplicaState, list[bytes]]] = {}
            for key in keys:
                owner = fleet.ring.lookup(key)
                if owner >= 0 and fleet.replicas[owner] is not replica:
                    target = fleet.replicas[owner]  # by replica, not by index: indices shift
                    groups.setdefault(id(target), (target, []))[1].append(key)
            for target, group in groups.values():
                if target.index is not None:
                    await self._warm_and_move(target, group, "drain", all_keys=True, source=replica)
            found = await self._live(replica.id)
            keys = None if found is None else [key for key, *_ in found]
            if keys == [] or replica.state != "draining":
                break
        if keys is None and replica.index is not None and replica.state == "draining":
            log.warning("drain of %s: its sessions could not be asked for; it stays draining", replica.id)
            self.membership.removing.discard(replica.id)
            return  # never removed blind: a later drain (or a removal by hand) finishes it
        if not remove:
            return
        while time.monotonic() < deadline:
            self._gather()  # with worker processes: their in-flight counts, summed
            if replica.inflight <= 0:
                break
            await asyncio.sleep(0.1)
        self.membership.removing.discard(replica.id)
        if replica.index is not None and replica.state == "draining":
            self.membership.remove(replica.id)
            log.info("drained and removed %s", replica.id)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
