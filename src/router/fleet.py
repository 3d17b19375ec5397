"""The replicas a router sends to: their state and counters, and the ring over them.

`Fleet` owns one `Ring` whose replica indices match `replicas`; membership and drain change
both together. In-flight counts live on each `ReplicaState` (which a request holds on to, so a
replica removed mid-request is still released correctly) and are mirrored, by index, in `loads`
for the ring's bounded-load walk (plus, with load_queue_weight, a share of the engine's queue).
A request increments in-flight before it goes upstream and decrements exactly once however it
ends.

Capacity: a replica may say (or be told, `replica_capacity`) how many requests it runs at once
(k). Bounded-load caps then respect it (`LoadCaps`): replica i's cap is ceil(U · k_i / mean k) for
the uniform cap U, the load floor is never above k_i, and while the fleet's in-flight total is
below its total capacity (a slot is free somewhere) no cap is above k_i: a 2-slot llama-server
spills its third request to an idle replica instead of queueing it, and once every slot is busy
the queues are shared out by the caps. Replicas of unknown capacity count as the mean of the
known ones. With no capacity known, every cap is max(U, floor), as before.

It is past 450 lines as one room: every index Fleet keeps over its replicas (the ring, `loads`, the
model and adapter memos, the capacity ratios) goes by position in `replicas` and must change with it
in one place, so membership, models, capacity and in-flight accounting stay in one class.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.config import ReplicaSpec
from router.health.score import HealthInputs
from router.health.signals import EngineStats
from router.health.states import Hysteresis, ReplicaHealth
from router.ring import MovedRange, Ring
from router.shm.layout import COUNTER_CELL

NONE: frozenset[int] = frozenset()
MODEL_MEMO = 1024  # models whose replica sets are remembered between fleet changes
UNLISTED_LABELS = 16  # model names a metric label may carry though no replica lists them (Fleet.model_label)
TTFT_FLOOR_TOKENS = 256  # a short prompt's first token costs a fixed overhead: normalise by at least this
# a reply's time per output token is a latency sample only while the prompt tokens sent to its replica
# during it (others' prefill, which shares the engine's steps) stay within this many per token it
# decoded: past that it measures their prompts, not the replica (a long prompt's prefill chunks
# stretch every decode step beside it: on the Mooncake traces, replicas 4 to 33 times their
# peers' time per token, and healthy, were taken out of routing)
TPOT_PREFILL_TOKENS = 64
WEIGHT_STEP = 0.05  # ring weights follow health in steps at least this big (each change rebuilds the ring)


@dataclass(eq=False)
class ReplicaState:
    id: str
    url: str
    index: int | None = None  # position in Fleet.replicas; None once removed
    inflight: int = 0
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    health: ReplicaHealth = field(default_factory=ReplicaHealth)
    engine: EngineStats = field(default_factory=EngineStats)
    # what was in flight there (every worker's) when `engine` was read: admission counts what was
    # sent and answered since then; None where this process did not read it (a worker process)
    inflight_at_read: int | None = None
    inputs: HealthInputs | None = None  # what the last score was computed from
    agent: str = "none"  # its router-agent's last reading: none (no agent), fresh, stale or gone
    # (when, seconds per output token) of recent streamed replies, for the latency signal
    tpot: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))
    prompt_sent: float = 0.0  # prompt tokens this process sent there so far (to prefill), as estimated
    # (when, time to first token per prompt token computed, at least TTFT_FLOOR_TOKENS of them)
    ttft: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))
    # with worker processes: this replica's slot in the shared table, and (median, samples) of
    # the workers' recent time per output token, pooled by the control loop (router.state.replica_table)
    queue_load: int = 0  # load_queue_weight x the engine's waiting requests, part of `Fleet.loads`
    capacity: int | None = None  # requests it runs at once: reported by its engine, else configured
    # the models (and adapters) it serves: pinned by config, else as its /v1/models lists them; None: unknown
    models: frozenset[str] | None = None
    # the LoRA adapters its engine has loaded: running, queued or run lately (vLLM's
    # lora_requests_info, router.health.signals.lora_state), and how many its GPU slots hold
    # (max_lora); None: it does not say
    adapters: frozenset[str] | None = None
    max_lora: int | None = None
    # what its engine's key (replica_api_keys) asks of every request the router sends it: {} without one
    auth: dict[str, str] = field(default_factory=dict, repr=False)
    # `adapters`, least recently used first, as far as the router knows (its own sends since the probe last)
    adapter_order: list[str] = field(default_factory=list)
    slot: int | None = None
    epoch: int = 0
    owner_tag: int = 0
    pooled_tpot: tuple[float, int] | None = None
    pooled_ttft: tuple[float, int] | None = None
    role: str = "both"  # both (aggregated), decode, or prefill (in the prefill replicas' own fleet)

    @property
    def state(self) -> str:
        return self.health.state

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


class LoadCaps:
    """Bounded-load caps for one routing decision. Replica i's cap is the uniform cap U (scaled by
    capacity / mean capacity where capacities differ), at least the floor, but the floor never
    above its capacity k; and while the fleet has a free slot somewhere, never above k either."""

    __slots__ = ("floor", "ratios", "replicas", "spare", "uniform")

    def __init__(
        self, replicas: list[ReplicaState], uniform: int, floor: int, ratios: list[float] | None, spare: bool
    ) -> None:
        self.replicas = replicas
        self.uniform = uniform
        self.floor = floor
        self.ratios = ratios
        self.spare = spare

    def of(self, index: int) -> int:
        cap = self.uniform if self.ratios is None else math.ceil(self.uniform * self.ratios[index])
        capacity = self.replicas[index].capacity
        if capacity is None:
            return max(cap, self.floor)
        cap = max(cap, min(self.floor, capacity))
        return min(cap, capacity) if self.spare else cap


class Fleet:
    def __init__(
        self,
        specs: tuple[ReplicaSpec, ...] | list[ReplicaSpec],
        vnodes: int = 128,
        seed: int = 0,
        rules: Hysteresis | None = None,
        capacities: dict[str, int] | None = None,
        capacity_caps: bool = True,
        models: dict[str, frozenset[str]] | None = None,
        keys: dict[str, str] | None = None,
    ) -> None:
        self.rules = rules or Hysteresis()
        self.keys = dict(keys or {})  # engines' API keys by replica id ("*": every replica not named)
        # pinned models by replica id ("*": every replica not named), for engines that list none
        self.pinned_models = dict(models or {})
        self.capacity_caps = capacity_caps  # off: capacities are shown, never routed by
        # configured capacities by replica id ("*": every replica not named), for engines that report none
        self.capacities = dict(capacities or {})
        self.replicas = [
            ReplicaState(
                s.id,
                s.url,
                index=i,
                health=ReplicaHealth(self.rules),
                capacity=self._configured(s.id),
                models=self._pinned(s.id),
                auth=self._auth(s.id),
                role=s.role,
            )
            for i, s in enumerate(specs)
        ]
        self._by_id = {r.id: r for r in self.replicas}
        self.version = 0  # bumped by every add and remove: positions may have moved
        self.by_slot: dict[int, ReplicaState] = {}  # with worker processes: shared-table slot -> replica
        self.ring = Ring([r.id for r in self.replicas], vnodes, seed)
        self.loads = array("q", [0] * len(self.replicas))
        # with worker processes (router.state.replica_table.Follower): this worker's in-flight cells in shared
        # memory, kept current on every acquire and release, and a way to re-read every worker's
        # counts into `loads` before a decision that depends on them (a spill)
        self.shared_inflight: memoryview | None = None
        self.refresh_loads: Callable[[], None] | None = None
        self._capacity_changes = 0
        self._known_capacities = sum(1 for r in self.replicas if r.capacity is not None)
        self._ratios: list[float] | None = None  # capacity / mean capacity by index; None: uniform
        self._ratios_for: tuple[object, int] | None = None  # the ring snapshot and capacities they are for
        self._total_capacity = 0.0
        self._not_routing: list[int] = []  # indices out of the ring, as of `_ratios_for`
        # with admission on (router.tenancy.admission): the replicas, of those not in the given set, that
        # are full while another of them has room (policies pass them over); None: off
        self.full_of: Callable[[frozenset[int]], frozenset[int]] | None = None
        self._models_changes = 0
        self._unserving: dict[str, frozenset[int]] = {}  # model -> indices known not to serve it
        self._unserving_for: tuple[int, int] = (-1, -1)  # the (version, models changes) it is for
        self._adapter_changes = 0
        self._cold: dict[str, frozenset[int]] = {}  # adapter -> indices serving it without it loaded
        self.adapter_names: set[str] = set()  # names some engine has said are its LoRA adapters (bounded)
        self._cold_for: tuple[int, int, int] = (-1, -1, -1)
        self._names: frozenset[str] = frozenset()  # every model (and adapter) some replica serves
        self._names_for: tuple[int, int] = (-1, -1)
        self._unlisted: set[str] = set()  # names labelled as themselves though no replica lists them

    def __len__(self) -> int:
        return len(self.replicas)

    def find(self, replica_id: str) -> ReplicaState | None:
        return self._by_id.get(replica_id)

    def routable(self, index: int) -> bool:
        return self.replicas[index].health.routable

    # -- models --------------------------------------------------------------------------------

    def _pinned(self, replica_id: str) -> frozenset[str] | None:
        pins = self.pinned_models
        return pins.get(replica_id, pins.get("*"))

    def set_models(self, replica: ReplicaState, listed: frozenset[str] | None) -> bool:
        """What the replica's engine lists (None: it does not say); pinned models win. True if it changed."""
        models = self._pinned(replica.id)
        if models is None:
            models = listed
        if models == replica.models:
            return False
        replica.models = models
        self._models_changes += 1
        return True

    def not_serving(self, model: str | None) -> frozenset[int]:
        """The indices of the replicas known not to serve `model`; empty when any may (no model
        named, or no replica's models known). A replica whose models are unknown may serve any."""
        if model is None:
            return NONE
        key = (self.version, self._models_changes)
        if key != self._unserving_for:
            self._unserving.clear()
            self._unserving_for = key
        found = self._unserving.get(model)
        if found is None:
            if len(self._unserving) >= MODEL_MEMO:
                self._unserving.clear()  # clients name any model they like: the memo stays bounded
            found = self._unserving[model] = frozenset(
                i for i, r in enumerate(self.replicas) if r.models is not None and model not in r.models
            )
        return found

    def model_label(self, model: str | None) -> str:
        """`model` as a metric label, from a bounded set (clients name any model they like, and a
        label per name would grow without bound): its name where some replica lists it (or is
        pinned to it); `other` where none does; where a replica that does not say what it serves
        might (an engine that answers any name, or one not probed yet), its name for the first
        UNLISTED_LABELS such names, `other` past them. `none` for a request that names none."""
        if model is None:
            return "none"
        key = (self.version, self._models_changes)
        if key != self._names_for:
            self._names = frozenset().union(*(r.models for r in self.replicas if r.models is not None))
            self._names_for = key
        if model in self._names or model in self._unlisted:
            return model
        if len(self._unlisted) < UNLISTED_LABELS and any(r.models is None for r in self.replicas):
            self._unlisted.add(model)
            return model
        return "other"

    def note_adapters(self, names: frozenset[str]) -> None:
        """Names a replica's /v1/models lists as LoRA adapters (before any has run there)."""
        if names and len(self.adapter_names) < MODEL_MEMO:
            self.adapter_names.update(names)

    def set_adapters(self, replica: ReplicaState, active: frozenset[str] | None, max_lora: int | None) -> bool:
        """The adapters its engine has loaded (None: it does not say). True if they changed."""
        replica.max_lora = max_lora
        if active and len(self.adapter_names) < MODEL_MEMO:
            self.adapter_names.update(active)
        if active == replica.adapters:
            return False
        replica.adapters = active
        replica.adapter_order = sorted(active) if active else []
        self._adapter_changes += 1
        return True

    def sent_adapter(self, replica: ReplicaState, adapter: str) -> None:
        """A request for LoRA adapter `adapter` went to `replica`: its engine loads it there if it
        had not (evicting the least recently used past its `max_lora`). Known from now on, not from
        the next probe, so the requests for it that follow find it loaded."""
        order = replica.adapter_order
        if replica.adapters is None:
            return  # its engine says nothing of its adapters
        if adapter in replica.adapters:
            if adapter in order and order[-1] != adapter:
                order.remove(adapter)
                order.append(adapter)
            return
        order.append(adapter)
        if replica.max_lora is not None and len(order) > replica.max_lora:
            del order[: len(order) - replica.max_lora]
        replica.adapters = frozenset(order)
        self._adapter_changes += 1

    def adapter_cold(self, model: str | None) -> frozenset[int]:
        """Where `model` is a LoRA adapter some replica has loaded (runs, queues or ran lately),
        the indices of the replicas that serve it without: a request there waits for the adapter
        to load, or for a free adapter slot. Empty when no replica has it loaded (nowhere is
        better) or no replica says what it has loaded."""
        if model is None:
            return NONE
        key = (self.version, self._models_changes, self._adapter_changes)
        if key != self._cold_for:
            self._cold.clear()
            self._cold_for = key
        found = self._cold.get(model)
        if found is None:
            if len(self._cold) >= MODEL_MEMO:
                self._cold.clear()
            loaded = [r.adapters is not None and model in r.adapters for r in self.replicas]
            found = NONE
            if any(loaded):
                skip = self.not_serving(model)
                found = frozenset(
                    i for i, r in enumerate(self.replicas) if i not in skip and r.adapters is not None and not loaded[i]
                )
            self._cold[model] = found
        return found

    def unserved(self, model: str | None) -> bool:
        """No replica in the fleet, in any state, serves `model` (as far as every one of them says)."""
        return bool(self.replicas) and len(self.not_serving(model)) == len(self.replicas)

    # -- in-flight accounting -----------------------------------------------------------------

    def acquire(self, replica: ReplicaState) -> None:
        replica.inflight += 1
        replica.requests += 1
        if replica.index is not None:
            self.loads[replica.index] += 1
        if self.shared_inflight is not None and replica.slot is not None:
            self.shared_inflight[replica.slot * COUNTER_CELL] = replica.inflight

    def set_queue_load(self, replica: ReplicaState, value: int) -> None:
        """The bounded-load cap may count the engine's queue too (load_queue_weight)."""
        if replica.index is not None:
            self.loads[replica.index] += value - replica.queue_load
        replica.queue_load = value

    def release(self, replica: ReplicaState) -> None:
        replica.inflight -= 1
        if replica.index is not None:
            self.loads[replica.index] -= 1
        if self.shared_inflight is not None and replica.slot is not None:
            self.shared_inflight[replica.slot * COUNTER_CELL] = replica.inflight

    # -- capacity -----------------------------------------------------------------------------

    def _configured(self, replica_id: str) -> int | None:
        return self.capacities.get(replica_id, self.capacities.get("*"))

    def set_capacity(self, replica: ReplicaState, reported: float | None) -> None:
        """The capacity its engine reported (None: it reports none, so the configured one holds)."""
        value = int(reported) if reported is not None and reported >= 1 else self._configured(replica.id)
        if value != replica.capacity:
            self._known_capacities += (value is not None) - (replica.capacity is not None)
            replica.capacity = value
            self._capacity_changes += 1

    def capacity_ratios(self) -> list[float] | None:
        """Each replica's capacity over the mean capacity of routable replicas (unknown ones count as
        the mean); None while no capacity is known, or all are alike."""
        return self._capacity_view()[0] if self._known_capacities and self.capacity_caps else None

    def _capacity_view(self) -> tuple[list[float] | None, float]:
        """(capacity ratios, total capacity of routable replicas; 0 while none is known)."""
        key = (self.ring.current, self._capacity_changes)
        if key != self._ratios_for:
            weights = self.routing_weights()
            routing = [r for r, w in zip(self.replicas, weights, strict=True) if w > 0]
            self._not_routing = [i for i, w in enumerate(weights) if w <= 0]
            known = [r.capacity for r in routing if r.capacity]
            mean = sum(known) / len(known) if known else 0.0
            self._total_capacity = mean * len(routing)
            if not known or min(known) == max(known):
                self._ratios = None  # nothing known, or all alike: every replica takes the uniform cap
            else:
                self._ratios = [(r.capacity if r.capacity is not None else mean) / mean for r in self.replicas]
            self._ratios_for = key
        return self._ratios, self._total_capacity

    def load_limit(self, uniform: int, floor: int) -> int | LoadCaps:
        """The bounded-load cap of one decision given the uniform cap and the floor: one number for
        every replica while no capacity is known (the common case, kept cheap), else per replica."""
        if not (self._known_capacities and self.capacity_caps):
            return max(uniform, floor)
        return self.load_caps(uniform, floor)

    def load_caps(self, uniform: int, floor: int) -> LoadCaps:
        """Each replica's bounded-load cap for one decision, given the uniform cap and the floor."""
        ratios, total = self._capacity_view()
        # a full replica spills while some other has a free slot; once all are full, queues are shared
        # (in flight on replicas out of the ring, draining say, takes no routable slot)
        spare = total > 0 and sum(self.loads) - sum(self.loads[i] for i in self._not_routing) < total
        return LoadCaps(self.replicas, uniform, floor, ratios, spare)

    def load_cap_among(self, skip: frozenset[int], c: float) -> int:
        """The ring's bounded-load cap counted over the routing replicas not in `skip` alone (those
        serving one model): ceil(c * (their load + 1) / their number), at least their mean + 1."""
        members = [i for i, w in enumerate(self.routing_weights()) if i not in skip and w > 0]
        if not members:
            return 0
        total = sum(self.loads[i] for i in members)
        return max(math.ceil(c * (total + 1) / len(members)), total // len(members) + 1)

    def fullness(self, index: int) -> float:
        """In-flight load against capacity (the load alone while capacities are unknown or alike)."""
        ratios = self.capacity_ratios()
        return self.loads[index] if ratios is None else self.loads[index] / ratios[index]

    # -- membership ---------------------------------------------------------------------------

    def _auth(self, rid: str) -> dict[str, str]:
        key = self.keys.get(rid) or self.keys.get("*")
        return {"Authorization": f"Bearer {key}"} if key else {}

    def add(self, spec: ReplicaSpec) -> list[MovedRange]:
        return self.add_all([spec])

    def add_all(self, specs: Sequence[ReplicaSpec]) -> list[MovedRange]:
        """Adds replicas at the end, in order: the ring places its points once for them all (a
        worker following a thousand replicas, one at a time, placed every point a thousand times)."""
        ids, urls = set(self._by_id), {r.url for r in self.replicas}
        for spec in specs:
            if spec.id in ids:
                raise ValueError(f"replica {spec.id!r} is already in the fleet")
            if spec.url in urls:
                raise ValueError(f"a replica with url {spec.url} is already in the fleet")
            ids.add(spec.id)
            urls.add(spec.url)
        if not specs:
            return []
        moved = self.ring.add_replicas([spec.id for spec in specs])
        for spec in specs:
            replica = ReplicaState(
                spec.id,
                spec.url,
                index=len(self.replicas),
                health=ReplicaHealth(self.rules),
                capacity=self._configured(spec.id),
                models=self._pinned(spec.id),
                auth=self._auth(spec.id),
                role=spec.role,
            )
            self.replicas.append(replica)
            self._by_id[replica.id] = replica
            self.loads.append(0)
            self._known_capacities += replica.capacity is not None
        self.version += 1
        return moved

    def remove(self, replica_id: str) -> list[MovedRange]:
        replica = self.find(replica_id)
        if replica is None:
            raise KeyError(replica_id)
        assert replica.index is not None
        moved = self.ring.remove_replica(replica.index)
        del self.replicas[replica.index]
        del self.loads[replica.index]
        del self._by_id[replica_id]
        self._known_capacities -= replica.capacity is not None
        replica.index = None
        replica.slot = None  # a late release must not write into a slot that another replica may get
        for i, r in enumerate(self.replicas):
            r.index = i
        self.version += 1
        return moved

    def drain(self, replica_id: str) -> list[MovedRange]:
        """Stop sending new requests to a replica; its in-flight requests finish."""
        replica = self.find(replica_id)
        if replica is None:
            raise KeyError(replica_id)
        assert replica.index is not None
        replica.health.drain(time.monotonic())
        return self.ring.set_available(replica.index, False)

    def apply_health(self, replica: ReplicaState, now: float) -> list[MovedRange]:
        """Make the ring follow a replica's health: out while not routable, else its health weight."""
        return self.set_routing(replica, replica.health.weight(now))

    def set_routing(self, replica: ReplicaState, weight: float, exact: bool = False) -> list[MovedRange]:
        """Ring availability and weight: out at 0, else `weight`, changed in steps of at least
        WEIGHT_STEP unless `exact` (a worker copying the control loop's ring weight)."""
        if replica.index is None:
            return []
        i = replica.index
        moved: list[MovedRange] = []
        if (weight > 0) != self.ring.available[i]:
            moved += self.ring.set_available(i, weight > 0)
        current = self.ring.weights[i]
        if weight > 0 and (
            (exact and weight != current) or abs(weight - current) >= WEIGHT_STEP or (weight == 1.0 and current != 1.0)
        ):
            moved += self.ring.set_weight(i, weight)
        return moved

    def routing_weight(self, index: int) -> float:
        """The weight the ring routes by: 0 while out of the ring."""
        return self.ring.weights[index] if self.ring.available[index] else 0.0

    def routing_weights(self) -> list[float]:
        """Every replica's `routing_weight`, by index (the ring's `weights` and `available` are
        copies made on each read: a loop over the fleet reads them once, not once a replica)."""
        return [w if a else 0.0 for w, a in zip(self.ring.weights, self.ring.available, strict=True)]


LATENCY_RECENT = 9  # and of the rest, only the latest this many count: a slowdown shows within a few replies


def recent_samples(replica: ReplicaState, kind: str, horizon: float) -> list[float]:
    """The replica's latest latency samples of `kind` ("tpot": time per output token, "ttft":
    time to first token per prompt token) since `horizon`. Samples age out, so a replica removed
    for being slow (and sent nothing since) is judged afresh by its probes later."""
    samples: deque[tuple[float, float]] = getattr(replica, kind)
    return [value for when, value in samples if when >= horizon][-LATENCY_RECENT:]
