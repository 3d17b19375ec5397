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

`Pairs` keeps which prefill replica has met which decode replica, and introduces those that have
not, so that no client request pays for the engines' first handshake (its docstring).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson

from router.apis import COMPLETION
from router.config import ReplicaSpec, RouterConfig, pinned_models, replica_api_keys, replica_capacities, score_weights
from router.engines.discovery import Discovery, PrefillReplicas
from router.engines.handoff import Handoff
from router.engines.kvfeed import Feed, IndexBudget
from router.fleet import Fleet, ReplicaState
from router.health.states import Hysteresis
from router.keys import RoutingKey
from router.metrics import RouterMetrics
from router.monitor import HealthMonitor
from router.placement import Placement
from router.policy import Policy
from router.policy.ttft import Ttft
from router.routing import Routing, SessionDirectory
from router.sessions import SessionTable

log = logging.getLogger("router.pools")

MAX_PREFILLS = 2  # prefill replicas a split request asks at most before its decode replica computes alone
# a pair's introduction: a prompt of some 100 tokens (a few KV blocks, so that the prefill keeps
# some for the decode side to read: vLLM keeps none of a prompt shorter than a block)
MEETING = "the router introduces a prefill replica to a decode replica before any request crosses. " * 6
MEETING_TIMEOUT_S = 90.0  # one introduction's two requests at most (the decode side may wait for a lease)


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
        replica_capacities(config.fleet) if config.capacity_caps else {},
        capacity_caps=config.capacity_caps,
        models=pinned_models(config.fleet),
        keys=replica_api_keys(config.tenancy),
    )


def prefill_pool(
    config: RouterConfig,
    rules: Hysteresis,
    metrics: RouterMetrics,
    http: Callable[[], aiohttp.ClientSession],
    routes: bool,
    budget: IndexBudget | None = None,
) -> Pool | None:
    """The prefill pool of a disaggregated fleet (None without prefill replicas): probed and found
    by every process (the control process too: its admin API and console show them); its events
    read where this process `routes` requests."""
    if not (config.prefill or config.prefill_discovery):
        return None
    fleet = replica_fleet(config, config.prefill, rules)
    policy = Ttft.from_config(fleet, config)
    # legs are keyless: its session table holds only requests served whole (`Pool.whole`), rarely
    directory = SessionDirectory(SessionTable(1024, config.sticky_ttl_s), config.sticky_ttl_s)
    routing = Routing(fleet, policy, directory, metrics, MAX_PREFILLS, counted=False)  # legs, not requests
    monitor = HealthMonitor(
        fleet, http, config.probe_interval_s, config.probe_timeout_s, weights=score_weights(config.health)
    )
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
    feed = (
        Feed(fleet, policy.placement, config.placement, http, metrics, budget=budget)
        if config.kv_events and routes
        else None
    )
    return Pool("prefill", fleet, policy, routing, monitor, discovery, feed)


def lending_pool(serve: Pool, config: RouterConfig, metrics: RouterMetrics) -> Pool:
    """With `prefill_anywhere`: the serve pool's own replicas, fleet and policy (one prefix index,
    one count of what is in flight), lending their prefill to one another; a routing core of its
    own routes the legs (uncounted, keyless), and the serve pool's loops keep them true."""
    directory = SessionDirectory(SessionTable(16, config.sticky_ttl_s), config.sticky_ttl_s)
    routing = Routing(serve.fleet, serve.policy, directory, metrics, MAX_PREFILLS, counted=False)
    return Pool("prefill", serve.fleet, serve.policy, routing)


class Pairs:
    """Which prefill replica has met which decode replica, and the introductions that make them meet.

    A decode replica's first read of a prefill replica's KV begins with the engines' handshake
    (NIXL's: the decode side fetches the prefill side's agent metadata over its side channel). On
    vLLM 0.32's CPU build here it cost the request that paid it 10 to 30 s, or failed it: the decode
    side gives the handshake up after 5 s, and the prefill engine often answers it only once the
    lease it holds has run out. Once met, a pair's reads take milliseconds.

    So the router pays it. Every `interval_s`, each routable prefill replica is introduced, one
    decode replica at a time (its engine holds the blocks of one introduction until they are read),
    to each routable decode replica it has not met, with a split request of the router's own: about
    100 tokens prefilled there, one token decoded here. A pair that fails is tried again next round.

    A client request is split only across a pair that has met: its prefill leg passes over the
    prefill replicas its decode replica has not met (`strangers`), and one whose decode replica has
    met none is served there alone (router.proxy.disagg, mode `cold`). A pair is forgotten when
    either replica is removed by its health or leaves the fleet (an engine that comes back may be a
    new one, which needs a new handshake) and when a transfer between them fails (`forget`); the
    next round introduces it again. A drained replica keeps its pairs (its engine is the same one,
    and hands its sessions' KV over to where they move: router.proxy.disagg's mode `moved`).

    Each routing process keeps its own pairs (the engines' handshake is per pair of engines, so a
    second process's introduction of a met pair takes milliseconds)."""

    def __init__(
        self,
        prefill: Fleet,
        decode: Fleet,
        protocol: Handoff,
        http: Callable[[], aiohttp.ClientSession],
        met: Callable[[str, float], None] | None = None,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.protocol = protocol
        self.http = http
        self.heard = met or (lambda outcome, seconds: None)  # told of each introduction: met or failed, its time
        self.met: dict[tuple[str, str], float] = {}  # (prefill id, decode id) -> seconds its introduction took
        self._partners: dict[str, int] = {}  # decode id -> how many prefill replicas it has met (read per request)
        self.tries: dict[tuple[str, str], int] = {}  # introductions tried and failed, by pair not yet met
        self.rounds = 0  # rounds of introductions done
        self._nonce = itertools.count()
        self._models: dict[str, str] = {}  # a prefill replica's model as its /v1/models lists it

    def has_met(self, decode: ReplicaState) -> bool:
        """Whether some prefill replica has met `decode`."""
        return self._partners.get(decode.id, 0) > 0

    def strangers(self, decode: ReplicaState) -> frozenset[int]:
        """The indices of the prefill replicas that have not met `decode`."""
        return frozenset(
            p.index for p in self.prefill.replicas if p.index is not None and (p.id, decode.id) not in self.met
        )

    def record(self, prefill: str, decode: str, seconds: float) -> None:
        """The pair has met (its introduction took `seconds`)."""
        if (prefill, decode) not in self.met:
            self._partners[decode] = self._partners.get(decode, 0) + 1
        self.met[(prefill, decode)] = seconds

    def forget(self, prefill: str, decode: str) -> None:
        """The pair's transfer failed: it is introduced again (an engine may have restarted)."""
        if self.met.pop((prefill, decode), None) is not None:
            self._partners[decode] -= 1

    def apart(self) -> list[tuple[ReplicaState, ReplicaState]]:
        """The routable pairs not yet met."""
        prefills = [p for p in self.prefill.replicas if p.index is not None and self.prefill.routable(p.index)]
        decodes = [d for d in self.decode.replicas if d.index is not None and self.decode.routable(d.index)]
        return [(p, d) for p in prefills for d in decodes if p is not d and (p.id, d.id) not in self.met]

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.introduce()
            except Exception:  # a round that broke: logged, and the next one tries again
                log.exception("introducing prefill and decode replicas failed")
            await asyncio.sleep(interval_s)

    async def introduce(self) -> None:
        """One round: every routable pair not yet met, introduced; prefill replicas side by side,
        each one decode replica at a time."""
        here = _up(self.prefill), _up(self.decode)
        for pair in [pair for pair in (*self.met, *self.tries) if pair[0] not in here[0] or pair[1] not in here[1]]:
            # a replica that left, or that its health removed: met again if it comes back, whose
            # engine may be a new one
            self.forget(*pair)
            self.tries.pop(pair, None)
        by_prefill: dict[str, list[tuple[ReplicaState, ReplicaState]]] = {}
        for p, d in self.apart():
            by_prefill.setdefault(p.id, []).append((p, d))
        await asyncio.gather(*(self._introduce_all(pairs) for pairs in by_prefill.values()))
        self.rounds += 1

    async def _introduce_all(self, pairs: list[tuple[ReplicaState, ReplicaState]]) -> None:
        for p, d in pairs:
            began = time.monotonic()
            met = await self.meet(p, d)
            took = time.monotonic() - began
            self.heard("met" if met else "failed", took)
            pair = (p.id, d.id)
            if met:
                tries = self.tries.pop(pair, 0) + 1
                self.record(p.id, d.id, took)
                log.info("prefill replica %s met decode replica %s in %.1f s (%d tries)", p.id, d.id, took, tries)
                continue
            self.tries[pair] = self.tries.get(pair, 0) + 1
            if self.tries[pair] in (1, 10, 100):
                log.warning("prefill replica %s has not met decode replica %s (%d tries)", p.id, d.id, self.tries[pair])

    async def meet(self, prefill: ReplicaState, decode: ReplicaState) -> bool:
        """One introduction: a prefill on `prefill` for a decode on `decode`, which reads its KV;
        whether the decode answered (under vLLM's "fail" policy a failed read is a 5xx)."""
        http = self.http()
        try:
            async with asyncio.timeout(MEETING_TIMEOUT_S):
                model = await self._model(http, prefill, decode)
                if model is None:
                    return False
                body = {"model": model, "prompt": f"{next(self._nonce)} {MEETING}", "max_tokens": 1}
                answer = await _post(http, prefill, self.protocol.prefill_body(COMPLETION, body))
                params = self.protocol.params(answer)
                if params is None:
                    return False
                return await _post(http, decode, self.protocol.decode_body(body, params)) is not None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return False

    async def _model(self, http: aiohttp.ClientSession, prefill: ReplicaState, decode: ReplicaState) -> str | None:
        """A model both serve: as their probes found them listed, else as the prefill replica lists it."""
        if prefill.models and decode.models and (both := sorted(prefill.models & decode.models)):
            return both[0]
        if prefill.id not in self._models:
            async with http.get(prefill.url + "/v1/models", headers=prefill.auth) as r:
                listed = orjson.loads(await r.read()) if r.status == 200 else None
            data = listed.get("data") if isinstance(listed, dict) else None
            ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
            if not ids or not isinstance(ids[0], str):
                return None
            self._models[prefill.id] = ids[0]
        return self._models[prefill.id]


def _up(fleet: Fleet) -> set[str]:
    """The replicas routable or draining (an operator's drain: its engine serves what it holds)."""
    return {r.id for r in fleet.replicas if r.index is not None and r.health.up}


async def _post(http: aiohttp.ClientSession, replica: ReplicaState, body: dict[str, Any]) -> Any:
    """A replica's JSON answer to a completion, None for an answer other than a 200."""
    headers = {"Content-Type": "application/json", **replica.auth}
    async with http.post(replica.url + COMPLETION.path, data=orjson.dumps(body), headers=headers) as r:
        data = await r.read()
        return orjson.loads(data) if r.status == 200 else None


__all__ = ["MAX_PREFILLS", "Pairs", "Pool", "lending_pool", "prefill_pool", "replica_fleet"]
