"""Overload held at the edge: when every replica that serves a request's model is full, the request
waits here, in a bounded queue, instead of in an engine's queue.

A replica is full when its engine's queue reaches `full_waiting` requests or its KV cache
`full_kv_usage` (as last probed), counting between probes what this router sent it and what ended
there since its figures were read: a request sent first takes a slot the engine had free (its
capacity, reported or configured, less what it ran; else what it ran when it last queued), then
waits; each one answered frees a slot or moves a waiting one up. Where the engine does not report
its queue but its capacity is known (llama-server's slots), it is full once that many plus
`full_waiting` are in flight. A replica whose load nothing says is never full.

While some replica that may serve the model has room, and nobody waits for that model, a request
goes on at once: admission costs one check per request. Otherwise it waits, up to `max_queued`
requests in all (the next gets a 429 at once) and up to `queue_timeout_s` each (then a 429), both
with `Retry-After`. Whenever a request ends, or a probe round finds room, the next waiter is let
through by this order:

1. the higher priority class first (router.tenancy.clients.PRIORITIES: by the tenant's table, or the
   request's X-Priority header within it); a `sheddable` request never waits: where it would,
   it gets its 429 at once;
2. within a class, turns of sessions already running (the router has served the session: its
   cache is warm, its user mid-conversation) before new sessions and keyless requests;
3. within each, the clients in turn (round robin by API key, else the body's `user`, else the
   client's address), so one client's burst does not hold the others back; and when the queue is
   full, a request of a higher class takes the place of the newest request of the lowest class
   waiting, and within a class a request from a client with fewer waiting takes the place of the
   newest request of the client with the most (which gets the 429), as does a running session's
   turn over new work;
4. each client's own requests in the order they came.

A waiter is let through only for a model some replica has room for, so one full model never holds
another's requests back. Where no replica of a request's model is ready at all (a fleet scaled to
zero: its autoscaler, following the scale signal that a waiting request raises, starts one), it
waits so for up to `cold_s` (scale_from_zero_s; off by default), then gets a 503 with Retry-After.

Nothing here is unbounded: the queue's size is capped and every waiter's wait is timed. It is on by
default (`max_queued = auto`); with it off (`max_queued = 0`) every request is forwarded at once,
whatever the engines' queues.

`max_queued = auto` bounds by time, not by a count alone. A request has a time-to-first-token
target (`ttft_target_ms`, default 2 s; its tenant's `ttft_target_ms`; its own `x-slo-ttft-ms`).
The router holds it only while it can still start in time, from the service rate it measures
(each replica's answers a second, over the last RATE_SPAN_S):

- an engine is full once its queue holds what it starts in ENGINE_SHARE of the target (at most
  `full_waiting`): a request sent to it waits that long at most there;
- a request that must wait here is refused at once (429, `Retry-After` the wait it would have)
  when the requests ahead of it in its class and above, over the fleet's rate, would hold it
  past QUEUE_SHARE of its target; one that waits is refused when it has waited that long;
- the rest of the target is the engine's own time to the first token.

Until a replica's first answer is RATE_SPAN_S old its rate is unknown: it is full at one round of
its work queued (its capacity, or what it ran when it last queued; at most `full_waiting`), and
the count bound alone holds the router's queue. The count bound (`bound`: as many as the engines
run at once, at least AUTO_SLOTS) stays as the queue's size cap. At three times a small fleet's capacity, as shipped,
this keeps late answers to a few percent (docs/benchmarks.md); a fleet not overloaded never waits.

It is past 450 lines as one room: the queue, its priority classes and their rates, and fair shedding
are one state that every request held and every slot released reads and writes.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.config import AUTO_QUEUED
from router.errors import RouterError
from router.fleet import NONE, Fleet, ReplicaState
from router.ring import xxh3_64
from router.tenancy.clients import DEFAULT_RANK, SHEDDABLE

AUTO_SLOTS = 16  # max_queued = auto: what an engine whose capacity nothing says counts for
RATE_SPAN_S = 3.0  # a replica's service rate: its answers over the last this many seconds ...
RATE_BUCKETS = 6  # ... counted in this many buckets
QUEUE_SHARE = 0.5  # of a request's TTFT target, what it may wait in the router's queue (max_queued auto)
ENGINE_SHARE = 0.25  # ... and in an engine's (full at what that engine starts in this long)
COLD_RETRY_S = 10  # the Retry-After of a request that waited scale_from_zero_s for a first replica in vain


class Shed(RouterError):
    """The request is not forwarded: every replica for its model is full and it waited its fill."""

    def __init__(self, status: int, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        # queue_full | late | timeout | sheddable | target | budget | exceeds_budget | cold: a metric label
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class _Waiter:
    model: str | None
    client: str
    future: asyncio.Future[None]
    since: float
    running: bool  # a turn of a session already running
    rank: int = DEFAULT_RANK  # its priority class

    @property
    def line(self) -> int:
        """Its line among the queue's classes: by priority, a running session's turn first."""
        return self.rank * 2 + (0 if self.running else 1)


class _Rate:
    """One replica's answers a second, over the last RATE_SPAN_S, in RATE_BUCKETS buckets (memory
    stays the same however fast it answers)."""

    __slots__ = ("at", "counts", "since")
    WIDTH = RATE_SPAN_S / RATE_BUCKETS

    def __init__(self, now: float) -> None:
        self.since = now  # its first answer counted
        self.counts = [0] * RATE_BUCKETS
        self.at = int(now / self.WIDTH)  # the bucket the latest count went to

    def add(self, now: float) -> None:
        bucket = self._roll(now)
        self.counts[bucket % RATE_BUCKETS] += 1

    def per_s(self, now: float) -> float | None:
        """None until its first answer is RATE_SPAN_S old."""
        if now - self.since < RATE_SPAN_S:
            return None
        bucket = self._roll(now)
        covered = (RATE_BUCKETS - 1) * self.WIDTH + (now - bucket * self.WIDTH)  # the last bucket in part
        return sum(self.counts) / covered

    def _roll(self, now: float) -> int:
        bucket = int(now / self.WIDTH)
        if bucket - self.at >= RATE_BUCKETS:
            self.counts = [0] * RATE_BUCKETS
        else:
            for b in range(self.at + 1, bucket + 1):
                self.counts[b % RATE_BUCKETS] = 0
        self.at = max(self.at, bucket)
        return bucket


@dataclass
class _Class:
    """The waiters of one priority class: by client, clients in turn."""

    clients: collections.OrderedDict[str, collections.deque[_Waiter]] = field(default_factory=collections.OrderedDict)

    @property
    def count(self) -> int:
        return sum(len(line) for line in self.clients.values())

    def add(self, waiter: _Waiter) -> None:
        self.clients.setdefault(waiter.client, collections.deque()).append(waiter)

    def remove(self, waiter: _Waiter) -> None:
        line = self.clients.get(waiter.client)
        if line is not None and waiter in line:
            line.remove(waiter)
            if not line:
                del self.clients[waiter.client]

    def next_for(self, room: Callable[[str | None], bool]) -> _Waiter | None:
        """The first waiter, clients in turn, whose model has room; its client goes to the back."""
        for client, line in self.clients.items():
            for waiter in line:
                if room(waiter.model):
                    line.remove(waiter)
                    if line:
                        self.clients.move_to_end(client)
                    else:
                        del self.clients[client]
                    return waiter
        return None


def client_of(headers: Mapping[str, str], body: Mapping[str, Any] | None, remote: str | None) -> str:
    """Who a request is from, for fairness: its API key (hashed), else the body's `user`, else its address."""
    auth = headers.get("authorization") or headers.get("Authorization")
    if auth:
        return f"key:{xxh3_64(auth.encode('utf-8', 'surrogateescape')):016x}"
    user = body.get("user") if body is not None else None
    if isinstance(user, str) and user:
        return "user:" + user[:128]
    return "addr:" + (remote or "")


def _let_through(waiter: _Waiter) -> bool:
    """Whether the queue is done with this waiter: let through by `wake`, or pushed out (its 429
    set); a wait cut short leaves its future cancelled, and the waiter still to account for."""
    return waiter.future.done() and not waiter.future.cancelled()


class Admission:
    def __init__(
        self,
        fleet: Fleet,
        max_queued: int,
        queue_timeout_s: float,
        full_waiting: int,
        full_kv_usage: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[int], None] | None = None,
        inflight: Callable[[ReplicaState], int] | None = None,
        free_share: float = 1.0,
        cold_s: float = 0.0,
        ttft_target_s: float = 2.0,
    ) -> None:
        self.fleet = fleet
        self.auto = max_queued == AUTO_QUEUED  # the bound follows the engines' capacity (`bound`)
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.full_waiting = full_waiting
        self.full_kv_usage = full_kv_usage
        self.clock = clock
        self.on_change = on_change  # told how many wait, whenever that changes (a gauge)
        # what every sender has in flight at a replica: this process's own count, or, for a worker
        # process, every worker's (router.state.replica_table.Follower.fleet_inflight)
        self.inflight: Callable[[ReplicaState], int] = inflight or (lambda r: r.inflight)
        self.free_share = free_share  # of an engine's free slots, the part this process may fill
        self.cold_s = cold_s  # scale_from_zero_s: how long a request waits for a first ready replica
        self.ttft_target_s = ttft_target_s  # a request's target unless its tenant's or its own says
        # each replica's service rate (max_queued auto), and the engine queue at which that makes
        # it full (`full_at`), kept as each answer ends and each probe round
        self._rates: dict[str, _Rate] = {}
        self._full_at: dict[str, float] = {}
        # by priority class, and within each running sessions' turns first, then the rest (_Waiter.line)
        self.classes = tuple(_Class() for _ in range(2 * SHEDDABLE))
        self.queued = 0
        self.waiting_models: collections.Counter[str | None] = collections.Counter()
        self.shed = collections.Counter[str]()  # by reason, since start
        self.waits: collections.deque[float] = collections.deque(maxlen=256)  # recent waits of those let through
        # each replica's in flight when its engine was last probed: what was sent since waits there too
        self._at_probe: dict[str, int] = {}
        # what each replica's engine ran the last time it queued: its limit, where it reports none
        self._limit: dict[str, float] = {}
        if self.auto:
            self.max_queued = self.bound()

    def bound(self) -> int:
        """`max_queued = auto`: as many requests as the fleet's engines run at once (each one's
        capacity, reported or configured, else what it ran when it last queued, else AUTO_SLOTS),
        this process's share of it: the router holds one more round of the fleet's work at most,
        which the engines take in about one request's time, and turns away the rest at once."""
        total = 0.0
        for r in self.fleet.replicas:
            limit = r.capacity if r.capacity is not None else self._limit.get(r.id)
            total += limit if limit is not None else AUTO_SLOTS
        return max(math.ceil(total * self.free_share), AUTO_SLOTS)

    @property
    def on(self) -> bool:
        return self.max_queued > 0

    # -- fullness ----------------------------------------------------------------------------

    def probed(self) -> None:
        """A probe round read every replica's engine: count what is sent from the moment each
        engine's queue was read (else from now), and let waiters through where there is room now.

        The moment matters: a round ends after its slowest replica answers, and the requests that
        ended meanwhile at a faster one have left its queue already; counted from the round's end,
        that queue would look longer than it is until the next round, leaving the engine short."""
        inflight = self.inflight
        self._at_probe = {
            r.id: r.inflight_at_read if r.inflight_at_read is not None else inflight(r) for r in self.fleet.replicas
        }
        for r in self.fleet.replicas:
            engine = r.engine
            if engine.waiting is not None and engine.waiting > 0 and engine.running is not None:
                self._limit[r.id] = engine.running  # it queues: this is what it runs at most, for now
        if self.auto:
            self.max_queued = self.bound()
            for r in self.fleet.replicas:  # (what it ran when it last queued may have changed)
                self._full_at[r.id] = self.full_at(r)
        self.wake(len(self.fleet.replicas))

    def queue_of(self, replica: ReplicaState) -> float | None:
        """The replica's engine queue now, as far as the router knows (None: unknown).

        What was sent since the read first takes the slots its engine had free then: none if it
        was queueing; else its capacity (reported or configured) less what it ran, or, where that
        is not known, what it ran the last time it queued (None until it has queued once: its
        limit is unknown, so nothing says it is full but its KV cache).

        The engine's figures are its scheduler's at its last step: a request that reached it since
        is in neither its running nor its waiting count (vLLM: until the step after its arrival, a
        few tens of milliseconds on an idle CPU engine, longer on a busy one). So what the router
        had in flight there when the figures arrived, beyond what they count, is counted as sent
        since: it takes a free slot or waits like the rest. (A reply the engine has finished and
        the router still relays counts so too, until it ends: the router errs full, never empty.)"""
        engine = replica.engine
        waiting = engine.waiting
        inflight = self.inflight(replica)
        if waiting is not None:
            at_read = self._at_probe.get(replica.id, inflight)
            sent: float = inflight - at_read
            running = engine.running
            if running is not None:
                sent += max(at_read - running - waiting, 0.0)  # in flight at the read, not in its figures yet
            if waiting > 0 or running is None:
                return max(waiting + sent, 0.0)
            limit = replica.capacity if replica.capacity is not None else self._limit.get(replica.id)
            if limit is None:
                return None
            return max(sent - max(limit - running, 0.0) * self.free_share, 0.0)
        if replica.capacity is not None:
            return max(inflight - replica.capacity, 0)
        return None

    def rate(self, replica: ReplicaState) -> float | None:
        """The replica's answers a second, over the last RATE_SPAN_S (None: not known yet)."""
        rate = self._rates.get(replica.id)
        return None if rate is None else rate.per_s(self.clock())

    def fleet_rate(self) -> float | None:
        """The fleet's answers a second: the sum of the rates its routable replicas have shown (a
        replica whose rate is not known yet adds none; None: none is known)."""
        total = 0.0
        fleet = self.fleet
        for i, r in enumerate(fleet.replicas):
            if fleet.routable(i):
                total += self.rate(r) or 0.0
        return total or None

    def full_at(self, replica: ReplicaState) -> float:
        """The engine queue at which the replica is full: `full_waiting`; with max_queued auto, at
        most what it starts in ENGINE_SHARE of the default target (at least one), or before its
        rate is known one round of its work (its capacity, or what it ran when it last queued).
        (A worker process sees its share of the answers: the engine's rate is its rate over that.)"""
        if not self.auto:
            return self.full_waiting
        rate = self.rate(replica)
        if rate is None:
            limit = replica.capacity if replica.capacity is not None else self._limit.get(replica.id)
            return self.full_waiting if limit is None else min(self.full_waiting, max(1.0, limit))
        engine_rate = rate / self.free_share
        return min(self.full_waiting, max(1.0, math.floor(engine_rate * self.ttft_target_s * ENGINE_SHARE)))

    def full(self, replica: ReplicaState) -> bool:
        queue = self.queue_of(replica)
        if queue is not None and queue >= self._full_at.get(replica.id, self.full_waiting):
            return True
        kv = replica.engine.kv_usage
        return kv is not None and kv >= self.full_kv_usage

    def full_of(self, skip: frozenset[int]) -> frozenset[int]:
        """The routable replicas not in `skip` that are full, while another of them has room (else
        none: when all are full, the policy chooses as it would without admission)."""
        fleet = self.fleet
        full, room = [], False
        for i, r in enumerate(fleet.replicas):
            if i in skip or not fleet.routable(i):
                continue
            if self.full(r):
                full.append(i)
            else:
                room = True
        return frozenset(full) if room and full else NONE

    def room(self, model: str | None) -> bool:
        """Some routable replica that may serve `model` is not full."""
        fleet = self.fleet
        skip = fleet.not_serving(model)
        return any(fleet.routable(i) and not self.full(r) for i, r in enumerate(fleet.replicas) if i not in skip)

    def _servable(self, model: str | None) -> bool:
        fleet = self.fleet
        skip = fleet.not_serving(model)
        return any(fleet.routable(i) for i in range(len(fleet.replicas)) if i not in skip)

    # -- the queue ---------------------------------------------------------------------------

    async def enter(
        self,
        model: str | None,
        client: str,
        running: bool,
        deadline: float,
        rank: int = DEFAULT_RANK,
        target_s: float | None = None,
    ) -> float:
        """Return once the request may go on (the seconds it waited), or raise Shed. `deadline`:
        the request's own end (monotonic): it never waits past it; `rank`: its priority class;
        `target_s`: its time-to-first-token target (None: the default), with max_queued auto."""
        if not self.on or (not self.waiting_models[model] and self.room(model)):
            return 0.0
        cold = not self._servable(model)
        if cold and not self.cold_s:
            return 0.0  # nothing routable at all: the router's 503 says so, not a queue
        if rank >= SHEDDABLE:
            self.shed["sheddable"] += 1
            raise Shed(429, "every replica is full and this request is sheddable: it does not wait", "sheddable", 1)
        wait_s = self.queue_timeout_s
        if self.auto and not cold:
            wait_s = min(wait_s, (target_s or self.ttft_target_s) * QUEUE_SHARE)
            rate = self.fleet_rate()
            if rate is not None:
                expected = (self._ahead(rank) + 1) / rate
                if expected > wait_s:  # (before the count bound: no one is pushed out for it)
                    self.shed["late"] += 1
                    message = (
                        f"every replica is full: this request would wait about {expected:.1f} s for room, "
                        f"past the {wait_s:.1f} s its time-to-first-token target leaves it"
                    )
                    raise Shed(429, message, "late", max(1, math.ceil(expected)))
        if self.queued >= self.max_queued and not self._push_out(client, running, rank):
            self.shed["queue_full"] += 1
            message = f"every replica is full and {self.queued} requests wait already"
            raise Shed(429, message, "queue_full", self._retry())
        now = self.clock()
        waiter = _Waiter(model, client, asyncio.get_running_loop().create_future(), now, running, rank)
        self.classes[waiter.line].add(waiter)
        self.queued += 1
        self.waiting_models[model] += 1
        if self.on_change is not None:
            self.on_change(self.queued)
        if self.room(model):
            self.wake(1)  # it queued behind others while there is room: the first in order goes now
        # a request with no replica to go to waits for one to start (scale_from_zero_s), else for room
        limit = max(min(self.cold_s if cold else wait_s, deadline - now), 0.0)
        try:
            async with asyncio.timeout(limit):
                await waiter.future
        except TimeoutError:
            if not _let_through(waiter):
                self._drop(waiter)
                if cold and not self._servable(model):
                    self.shed["cold"] += 1
                    message = f"no replica is ready to serve the request: waited {limit:.0f} s for one to start"
                    raise Shed(503, message, "cold", COLD_RETRY_S) from None
                self.shed["timeout"] += 1
                raise Shed(
                    429, f"every replica is full: waited {limit:.1f} s for room", "timeout", self._retry()
                ) from None
            # let through just as its time ran out: it goes on
        except BaseException:  # the client went away while it waited
            if not _let_through(waiter):
                self._drop(waiter)
            raise
        waited = self.clock() - waiter.since
        self.waits.append(waited)
        return waited

    def _push_out(self, client: str, running: bool, rank: int) -> bool:
        """Make room in a full queue for a request of class `rank` from `client`: the newest request
        of the lowest class below it gets its 429 instead (of its client with the most waiting, new
        work before running sessions' turns); within its own class, the newest new-work request of
        the client with the most waiting, if that client has more waiting than `client` would (a
        running session's turn always goes before new work). False: no room."""
        classes = self.classes
        lower = next((n for n in range(len(classes) - 1, rank * 2 + 1, -1) if classes[n].clients), None)
        if lower is not None:
            return self._push(classes[lower].clients)
        line_of = classes[rank * 2 + 1].clients
        if not line_of:
            return False
        if not running:
            most = max(len(line) for line in line_of.values())
            if most <= len(line_of.get(client, ())) + 1:
                return False  # it has no more than this client would: fair as it is
        return self._push(line_of)

    def _push(self, line_of: collections.OrderedDict[str, collections.deque[_Waiter]]) -> bool:
        """The newest waiter of the client with the most waiting in a class gets its 429."""
        victim_client = max(line_of, key=lambda c: len(line_of[c]))
        line = line_of[victim_client]
        victim = line[-1]
        if victim.future.done():
            return False  # its wait is ending anyway
        line.pop()
        if not line:
            del line_of[victim_client]
        self._left(victim)
        self.shed["queue_full"] += 1
        message = "every replica is full and the queue is too: this request made room for another client's"
        victim.future.set_exception(Shed(429, message, "queue_full", self._retry()))
        return True

    def _drop(self, waiter: _Waiter) -> None:
        """A waiter that was not let through leaves (it may have been taken off its line already)."""
        waiter.future.cancel()
        self.classes[waiter.line].remove(waiter)
        self._left(waiter)

    def _left(self, waiter: _Waiter) -> None:
        self.queued -= 1
        self.waiting_models[waiter.model] -= 1
        if not self.waiting_models[waiter.model]:
            del self.waiting_models[waiter.model]
        if self.on_change is not None:
            self.on_change(self.queued)

    def released(self) -> None:
        """A request ended: a slot may have freed."""
        if self.queued:
            self.wake(1)

    def answered(self, replica: ReplicaState) -> None:
        """`replica` answered a request (not a failure): its service rate counts it (max_queued auto)."""
        if not self.auto:
            return
        now = self.clock()
        rate = self._rates.get(replica.id)
        if rate is None:
            rate = self._rates[replica.id] = _Rate(now)
        rate.add(now)
        self._full_at[replica.id] = self.full_at(replica)

    def _ahead(self, rank: int) -> int:
        """Requests waiting that go before a new one of class `rank` (its class and those above)."""
        return sum(c.count for c in self.classes[: rank * 2 + 2])

    def wake(self, at_most: int) -> None:
        """Let through up to `at_most` waiters whose models have room, in order."""
        woken = 0
        while woken < at_most:
            waiter = None
            for line in self.classes:
                if line.clients and (waiter := line.next_for(self.room)) is not None:
                    break
            if waiter is None:
                return
            if waiter.future.done():
                continue  # its wait is being cut short (time-out, client gone): its task accounts for it
            self._left(waiter)
            waiter.future.set_result(None)
            woken += 1

    def _retry(self) -> int:
        """Retry-After: the recent median wait of those let through, at least a second."""
        waits = sorted(self.waits)
        typical = waits[len(waits) // 2] if waits else self.queue_timeout_s / 2
        return max(1, math.ceil(min(typical, self.queue_timeout_s)))
