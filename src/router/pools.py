"""A pool per replica role: one routing core (fleet, policy, routing) and the loops that keep it true.

A router serves from one pool, `serve`: its whole replicas, or with prefill/decode disaggregation
its decode replicas (a request's route chooses among them). A disaggregated fleet has a second
pool, `prefill`, whose replicas prefill a split request's prompt (router.proxy.disagg); each pool
has its own fleet (probed, scored, found by its discovery), its own policy (`ttft` for prefill:
a prefix index of what each holds, fed by their KV-cache events, and their prefill queues), and its
own `Routing`, through which a prefill leg is routed as any request is: `next` picks and counts it
in flight, `release`, `failed` or `served` tell the policy and the fleet what happened. The node
(router.node) holds its pools; the admin API, the console and the metrics go through them.

A prefill leg's key is keyless (`Pool.leg_key`): a conversation's prefill goes where its prompt's
blocks are, not to the prefill replica its session went to last, and nothing is remembered for it.
Where no decode replica can serve a request at all, the prefill replicas serve it whole
(`Pool.whole`: the journey's spare routing core, router.proxy.journey).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import aiohttp

from router.config import ReplicaSpec, RouterConfig, pinned_models, replica_api_keys, replica_capacities, score_weights
from router.discovery import Discovery, PrefillReplicas
from router.fleet import Fleet
from router.health.states import Hysteresis
from router.keys import RoutingKey
from router.kvfeed import Feed
from router.metrics import RouterMetrics
from router.monitor import HealthMonitor
from router.placement import Placement
from router.policy import Policy
from router.policy.ttft import Ttft
from router.routing import Routing, SessionDirectory
from router.sessions import SessionTable

MAX_PREFILLS = 2  # prefill replicas a split request asks at most before its decode replica computes alone


@dataclass(eq=False)
class Pool:
    """One role's routing core and its loops (None where this process runs none)."""

    role: str  # "serve" (whole or decode replicas) or "prefill"
    fleet: Fleet
    policy: Policy
    routing: Routing
    monitor: HealthMonitor | None = None
    discovery: Discovery | None = None
    feed: Feed | None = None  # the replicas' KV-cache events, where they publish and this process routes

    @property
    def placement(self) -> Placement | None:
        """`ttft`'s prefix index and prefill queues over this pool's replicas (None for other policies)."""
        return self.policy.placement if isinstance(self.policy, Ttft) else None

    def whole(self, metrics: RouterMetrics, max_attempts: int) -> Routing:
        """A routing core over this pool's replicas for requests they serve whole (counted as the
        route's are): a disaggregated fleet's prefill replicas, when no decode replica can (every
        one gone, drained or out of routing). vLLM's replicas with a KV connector serve a request
        that asks for no transfer as any replica does. Its sessions are remembered apart: their
        next turns go back to the decode replicas once there are some."""
        return Routing(self.fleet, self.policy, self.routing.directory, metrics, max_attempts)

    @staticmethod
    def leg_key(key: RoutingKey) -> RoutingKey:
        """The key a prefill leg is routed by: the request's prompt and model, no session."""
        return key if key.kind == "none" else replace(key, kind="none")


def replica_fleet(config: RouterConfig, specs: tuple[ReplicaSpec, ...], rules: Hysteresis) -> Fleet:
    """A fleet of `specs` with the router's ring, capacities, pinned models and engine keys."""
    return Fleet(
        specs,
        config.vnodes,
        config.hash_seed,
        rules,
        replica_capacities(config) if config.capacity_caps else {},
        capacity_caps=config.capacity_caps,
        models=pinned_models(config),
        keys=replica_api_keys(config),
    )


def prefill_pool(
    config: RouterConfig,
    rules: Hysteresis,
    metrics: RouterMetrics,
    http: Callable[[], aiohttp.ClientSession],
    routes: bool,
) -> Pool | None:
    """The prefill pool of a disaggregated fleet (None without prefill replicas): probed and found
    by every process (the control process too: its admin API and console show them); its events
    read where this process `routes` requests."""
    if not (config.prefill or config.prefill_discovery):
        return None
    fleet = replica_fleet(config, config.prefill, rules)
    policy = Ttft(fleet, config)
    # legs are keyless: its session table holds only requests served whole (`Pool.whole`), rarely
    directory = SessionDirectory(SessionTable(1024, config.sticky_ttl_s), config.sticky_ttl_s)
    routing = Routing(fleet, policy, directory, metrics, MAX_PREFILLS, counted=False)  # legs, not requests
    monitor = HealthMonitor(fleet, http, config.probe_interval_s, config.probe_timeout_s, weights=score_weights(config))
    discovery = None
    if config.prefill_discovery:
        discovery = Discovery(
            PrefillReplicas(fleet, metrics.forget_replica),
            metrics,
            config.prefill_discovery,
            config.discovery_interval_s,
            config.prefill,
            role="prefill",
        )
    feed = Feed(fleet, policy.placement, config, http, metrics) if config.kv_events and routes else None
    return Pool("prefill", fleet, policy, routing, monitor, discovery, feed)


__all__ = ["MAX_PREFILLS", "Pool", "prefill_pool", "replica_fleet"]
