"""`router-bench simulate`: the router's routing code against modelled replicas, on a virtual clock.

No sockets and no processes: one loop of timed events, so a fleet of 1000 replicas and a million
sessions runs in minutes on a laptop-class CPU. What routes is the router's own code: each turn
is one journey of the proxy (`router.proxy.journey.Journey.serve`, the same loop every HTTP request
takes: the route, attempts until one answers, failover, the finish), whose attempts are the
modelled replicas below instead of HTTP; beneath it the routing core (`router.routing`: picks
within `max_attempts` and the deadline, jump causes, session entries and their moves), the ring
(`_ring`, or its pure-Python twin), the policy objects (`router.policy`), the session table
(`router.sessions`), the fleet's in-flight loads and ring weights (`router.fleet`), and the health
state machine with its slow start (`router.health.states`), fed one score per probe interval. It
all runs on a light event loop whose clock is virtual (router.bench.virtual_time): time jumps to the
next timer instead of passing. What serves is a model of a replica, coarser than the emulator's:

- KV cache: a replica holds up to `--kv-tokens` tokens of conversation context. A session's
  context stays there after each turn and is evicted least recently used first. A turn that
  lands where its session's context still is computes only its new tokens (the emulator's
  paged prefix cache, counted per session instead of per block). Every session opens with one of
  `--system-prompts` shared system prompts of 400 tokens; a replica that has served one keeps it,
  so a turn landing anywhere else still hits those 400 tokens.
- Scheduler: `--slots` requests run at once, the rest wait in arrival order. A request takes
  `--prefill-s-per-token` per prompt token it computes plus a time per output token that grows
  with the batch it starts in: `--tpot-s` x (1 + `--batch-slowdown` x (running - 1) / (slots - 1)),
  so a full batch decodes each token `1 + batch-slowdown` times slower than a lone request.

The emulator's engine (block-level cache, token-by-token continuous batching) is the model the
fleet benchmark runs; here it would cost one event per step per replica, far too many for a
thousand replicas, so this coarser model stands in, with the same knobs in the same places.

Balance: with the `affinity` policy the rebalancer runs in the loop as in the router's control
loop: every virtual second each routable replica's in-flight count feeds `Rebalancer.observe`,
served requests count per vnode, and `plan` picks vnodes to move; a move carries the vnode's
live sessions (up to the router's `warmup_sessions`, their cached context copied to the target as
warm-up would) and reassigns the vnode on the ring. `--no-rebalance` turns it off.

Sessions arrive at `--rate` per second (Poisson), take 3 to 8 turns (`--turns`), each user
message 50 to 200 tokens and each reply 50 to 250, with an exponential think time between turns.

Events, each optional: at `--scale-out-at` a replica joins (slow start: `warming`, its weight
ramping over `--ramp-s`); at `--scale-in-at` one leaves (removed at once; its requests in flight
finish); at `--fail-at` one dies: its requests in flight and queued fail and are retried on the
policy's next choice, new ones routed there fail over the same way, its cache is lost, and it
leaves the ring after `--remove-after` probes (`--probe-s` apart) score 0.

Prompts and KV-cache events (`--policy ttft`, the router's default, which prices each replica by
what it holds): with `--prompts` each turn carries its prompt in the engine's tokens (the
session's system prompt, then its history) and the policy prices replicas by the router's own
model of their caches; with `--events` the modelled replicas also publish what their caches
store and evict, as vLLM does, `--event-delay-ms` late, each message lost with probability
`--event-loss` and asked again of an engine's replay buffer (`--replay-keep` messages,
`--replay-ms` away), and the router's own event-fed index follows them
(router.bench.simulate_events has the model).

Reported: KV hit rate (cached / prompt tokens), load CV (requests per replica), jump rate
(turns served elsewhere than the session's previous turn), latency P50/P99 and time to first
token P99 in virtual seconds, failed attempts, the share of live sessions whose ring owner each
event moved, and the run's wall time and peak memory; with prompts, how far the cached tokens
each decision counted on were from those the replica computed from cache, and the share priced
by events; with events, the messages published, lost, applied and replayed, the gaps, and the
replicas unsure and believed.
"""

# It is past 450 lines as one benchmark: the modelled replicas, the simulation's loop and its
# tallies share one virtual clock, and the docstring above is `router-bench simulate --help`.

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from router.apis import CHAT
from router.balance.rebalance import Move, Rebalancer, RebalanceSettings, VnodeTraffic
from router.bench.simulate_events import Publishers, Turns
from router.bench.simulate_jumps import JumpWatch
from router.bench.simulate_jumps import print_report as print_jumps
from router.bench.virtual_time import LightLoop, Timer, Wait
from router.config import ReplicaSpec, load
from router.fleet import Fleet, ReplicaState
from router.health.states import Hysteresis
from router.keys import RoutingKey
from router.measures import coefficient_of_variation, kv_hit_rate, percentile
from router.metrics import RouterMetrics
from router.policy import Decision, make_policy
from router.policy.ttft import Ttft
from router.prompt import BYTES_PER_TOKEN
from router.proxy.forward import Outcome, Retry, Trip
from router.proxy.intake import Intake
from router.proxy.journey import Journey
from router.proxy.ledger import Ending
from router.proxy.sse import StreamFramer
from router.routing import Routing, Served, SessionDirectory
from router.sessions import SessionTable
from router.tenancy.admission import Admission

SYSTEM_TOKENS = 400
TICK_S = 1.0  # the balance loop's period, as in the router
SAMPLE = 200_000  # latencies kept for the percentiles (a uniform reservoir)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="the router's routing code against modelled replicas on a virtual clock (no sockets)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=1000, help="replicas at the start (default 1000)")
    p.add_argument("--sessions", type=int, default=1_000_000, help="sessions in all (default 1,000,000)")
    p.add_argument("--rate", type=float, default=0.0, help="new sessions per second (default: ~70%% busy)")
    p.add_argument("--policy", default="affinity", help="affinity, consistent_hash, round_robin or least_load")
    p.add_argument("--turns", default="3-8", help="turns per session, MIN-MAX (default 3-8)")
    p.add_argument("--think-s", type=float, default=10.0, help="mean think time between turns (default 10)")
    p.add_argument("--slots", type=int, default=32, help="requests a replica runs at once (default 32)")
    p.add_argument("--kv-tokens", type=int, default=400_000, help="context tokens a replica caches (default 400k)")
    p.add_argument("--prefill-s-per-token", type=float, default=0.0002, help="default 0.0002 (5k tokens/s)")
    p.add_argument("--tpot-s", type=float, default=0.02, help="seconds per output token alone (default 0.02)")
    p.add_argument(
        "--batch-slowdown",
        type=float,
        default=1.0,
        help="a full batch decodes each token 1 + this times slower (default 1)",
    )
    p.add_argument("--system-prompts", type=int, default=4, help="shared system prompts (default 4)")
    p.add_argument(
        "--rebalance",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the rebalancer in the loop (affinity only; default on)",
    )
    p.add_argument("--scale-out-at", type=float, default=None, help="virtual second a replica joins")
    p.add_argument("--scale-in-at", type=float, default=None, help="virtual second a replica leaves")
    p.add_argument("--fail-at", type=float, default=None, help="virtual second a replica dies")
    p.add_argument("--probe-s", type=float, default=2.0, help="health probe interval (default 2)")
    p.add_argument("--remove-after", type=int, default=3, help="failed probes before removal (default 3)")
    p.add_argument("--ramp-s", type=float, default=30.0, help="slow start of a joining replica (default 30)")
    p.add_argument(
        "--prompts",
        action="store_true",
        help="turns carry their prompts, which ttft prices by the router's own model of what each replica holds",
    )
    p.add_argument(
        "--events",
        action="store_true",
        help="the replicas publish KV-cache events the router's event-fed index follows (needs --policy ttft)",
    )
    p.add_argument("--block-tokens", type=int, default=16, help="with --events: tokens a KV block (default 16)")
    p.add_argument(
        "--event-delay-ms", type=float, default=5.0, help="with --events: a message's way to the router (default 5)"
    )
    p.add_argument("--event-loss", type=float, default=0.0, help="with --events: share of messages lost (default 0)")
    p.add_argument("--replay-ms", type=float, default=2.0, help="with --events: a replay's round trip (default 2)")
    p.add_argument(
        "--replay-keep",
        type=int,
        default=16,
        help="with --events: messages an engine's replay buffer keeps (default 16)",
    )
    p.add_argument(
        "--explain-jumps",
        action="store_true",
        help="with --policy ttft: for the follow-ups that leave their session's replica, the two rows the "
        "decision compared and what the modelled engine held there; and each kind of turn's KV hit",
    )
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_cli)


@dataclass
class Model:
    """A replica's KV cache and scheduler."""

    kv_tokens: int
    slots: int
    cache: OrderedDict[int, int] = field(default_factory=OrderedDict)  # session -> context tokens
    cached_tokens: int = 0
    running: int = 0
    queue: deque[Any] = field(default_factory=deque)
    # the turns running, in the order they started (a dict: a set of them would iterate in the order
    # of their addresses, and a failure would cut them in an order that differs run to run)
    active: dict[Any, None] = field(default_factory=dict)
    dead: bool = False
    systems: set[int] = field(default_factory=set)  # shared system prompts it has cached (never evicted)
    born: float = 0.0  # virtual second it joined
    gone: float | None = None  # ... and left or died
    dropped: list[tuple[int, int]] | None = None  # with --events: the sessions evicted, and their tokens

    def keep_system(self, system: int) -> None:
        """A shared system prompt joins the cache for good (its tokens count against the capacity)."""
        if system not in self.systems:
            self.systems.add(system)
            self.cached_tokens += SYSTEM_TOKENS
            self._evict()

    def cached(self, session: int) -> int:
        found = self.cache.get(session)
        if found is not None:
            self.cache.move_to_end(session)
        return found or 0

    def keep(self, session: int, tokens: int) -> None:
        self.cached_tokens += tokens - self.cache.pop(session, 0)
        self.cache[session] = tokens
        self._evict()

    def _evict(self) -> None:
        while self.cached_tokens > self.kv_tokens and self.cache:
            session, dropped = self.cache.popitem(last=False)
            self.cached_tokens -= dropped
            if self.dropped is not None:
                self.dropped.append((session, dropped))


@dataclass(eq=False)
class Turn:
    session: int
    number: int
    turns: int
    context: int  # tokens of the conversation before this turn's message
    message: int
    output: int
    started: float = 0.0
    cached: int = 0
    replica: ReplicaState | None = None  # where its attempt is (or was last)
    ttft: float = 0.0
    busy_s: float = 0.0  # the slot time it took
    answer: Wait[Retry | Outcome] | None = None  # what its attempt there ends in
    timer: Timer | None = None  # ... when it runs: its end
    exchange: SimExchange | None = None


NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


class SimExchange:
    """A turn's client side (router.proxy.exchange.Exchange): the answer's status, nothing sent."""

    method = "POST"
    path = "/v1/chat/completions"
    headers = NO_HEADERS
    remote: str | None = None
    transport: Any = None
    prepared = False

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.status = 0

    def answer(self, status: int, body: bytes, headers: Mapping[str, str], close: bool = False) -> None:
        self.status = status

    async def prepare(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status

    async def write(self, data: bytes) -> None:
        pass

    async def write_eof(self) -> None:
        pass


class ModelledReplicas:
    """The journey's attempts (router.proxy.attempts.Attempts) on the modelled replicas: a turn joins
    the replica's slots or its queue and ends when the model says; a dead replica refuses it at
    once (`connect`), and one that dies while the turn waits or runs there cuts it (`reset`), both
    failed over by the journey as the proxy fails over HTTP attempts."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    async def send(
        self, replica: ReplicaState, trip: Trip, deadline: float, decision: Decision | None = None
    ) -> Retry | Outcome:
        sim = self.sim
        exchange = trip.exchange
        assert isinstance(exchange, SimExchange)
        turn = exchange.turn
        model = sim.models[replica.id]
        if model.dead:
            sim.stats.failed_attempts += 1
            return Retry("connect")
        turn.replica = replica
        turn.answer = answer = sim.loop.wait()
        if model.running < model.slots:
            sim._start(turn, model)
        else:
            model.queue.append(turn)
        result: Retry | Outcome = await answer
        turn.answer = None  # (the turn, its answer and the journey's frame no longer hold each other)
        return result

    async def resume(
        self, replica: ReplicaState, trip: Trip, body: bytes, deadline: float, outcome: Outcome, splicer: StreamFramer
    ) -> Retry | None:
        raise RuntimeError("a modelled turn is never resumable (its intake keeps no stream)")


class Tally:
    """The journey's ledger in the simulation: each turn's end counted into the run's figures."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def finish(self, end: Ending) -> None:
        exchange, replica, key, verdict = end.exchange, end.replica, end.key, end.verdict
        assert isinstance(exchange, SimExchange)
        sim, turn = self.sim, exchange.turn
        s = sim.stats
        if replica is None:  # no replica left to try: the turn fails, and its session ends
            s.failed_requests += 1
            return
        if verdict is not None and verdict.followup:
            s.followups += 1
            if verdict.jump is not None and not verdict.moved:  # a move is counted as migrated
                s.jumps += 1
                s.jump_causes[verdict.jump] = s.jump_causes.get(verdict.jump, 0) + 1
        if sim.jumps is not None:
            sim.jumps.finished(turn, verdict is not None and verdict.jump is not None and not verdict.moved)
        current = sim.sessions.get(key.key)
        if current is not None:
            sim._placed(turn.session, current)
        sim._sample("latency", s.latencies, sim.now - turn.started)
        sim._sample("ttft", s.ttfts, turn.ttft)
        cost = end.decision.cost if end.decision is not None else None
        if cost is not None:  # a priced decision: what it counted on held, against what was
            s.priced += 1
            s.priced_by_events += cost.source == "events"
            s.counted_off += abs(cost.cached_tokens - turn.cached)
            s.priced_prompt_tokens += turn.context + turn.message


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    failed_attempts: int = 0  # attempts on a dead replica, retried elsewhere
    failed_requests: int = 0  # turns no replica could serve
    followups: int = 0
    jumps: int = 0
    jump_causes: dict[str, int] = field(default_factory=dict)  # by router_session_jumps' cause
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    seen: int = 0
    per_replica: dict[str, int] = field(default_factory=dict)
    moved: dict[str, float] = field(default_factory=dict)
    live_at: dict[str, int] = field(default_factory=dict)  # live sessions when each event happened
    slot_seconds: float = 0.0  # summed service time of completed requests
    migrations: int = 0  # vnodes the rebalancer moved
    migrated_sessions: int = 0
    priced: int = 0  # turns placed by a priced decision (ttft, with --prompts or --events)
    priced_by_events: int = 0  # ... whose replica's cached tokens its events said
    counted_off: float = 0.0  # |cached tokens the decision counted on - cached tokens computed|, summed
    priced_prompt_tokens: int = 0  # ... over their prompts


def default_rate(args: argparse.Namespace, turns: tuple[int, int]) -> float:
    """New sessions per second that keep the fleet about 70% busy, assuming most turns hit."""
    mean_turns = sum(turns) / 2
    # new tokens, then the reply at a half-full batch's speed
    service_s = 125 * args.prefill_s_per_token * 2 + 150 * args.tpot_s * (1 + args.batch_slowdown / 2)
    capacity = args.replicas * args.slots / service_s  # requests per second
    return float(0.7 * capacity / mean_turns)


class Simulation:
    def __init__(self, args: argparse.Namespace) -> None:
        check(args)
        low, _, high = args.turns.partition("-")
        if not (low.isdigit() and (high.isdigit() or not high)):
            raise ValueError(f"--turns {args.turns!r} is not MIN-MAX")
        self.turns = (int(low), int(high or low))
        if not (1 <= self.turns[0] <= self.turns[1]):
            raise ValueError("--turns must be MIN-MAX with 1 <= MIN <= MAX")
        self.args = args
        self.rate = args.rate or default_rate(args, self.turns)
        # three streams, none drawn in an order the routing could change, so every policy and every
        # event replays the same sessions at the same times: arrivals; each session's shape (turns,
        # message and reply sizes, think times), drawn when it arrives; the latency sample
        self.arrivals = random.Random(args.seed)
        self.shapes = random.Random(args.seed + 1)
        self.rng = random.Random(args.seed + 2)
        self.loop = LightLoop()  # `now` is its clock
        specs = [ReplicaSpec(f"r{i}", f"http://sim/{i}") for i in range(args.replicas)]
        self.config = load(None, {}, {"replicas": [f"{s.id}={s.url}" for s in specs], "policy": args.policy})
        self.rules = Hysteresis(remove_after=args.remove_after, ramp_s=args.ramp_s)
        self.fleet = Fleet(specs, self.config.vnodes, self.config.hash_seed, self.rules)
        self.policy = make_policy(args.policy, self.fleet, self.config)
        clock = self.loop.time
        self.sessions = SessionTable(args.sessions + 1, 3600.0, clock=clock, wall=self._wall_ms)
        # the router's routing core on the virtual clock; a move reaches no worker process, so no slack
        metrics = RouterMetrics()
        self.routing = Routing(
            self.fleet,
            self.policy,
            SessionDirectory(self.sessions, 3600.0, wall=self._wall_ms),
            metrics,
            self.config.max_attempts,
            observer=self,
            clock=clock,
            wall=clock,
            move_slack_ms=0,
        )
        # the proxy's journey, its attempts on the modelled replicas; no overload queue (max_queued
        # 0): a modelled replica queues what it has no slot for
        c = self.config
        self.journey = Journey(
            self.routing,
            Admission(self.fleet, 0, c.queue_timeout_s, c.full_waiting, c.full_kv_usage),
            ModelledReplicas(self),
            Tally(self),
            metrics,
            c.total_timeout_s,
            c.max_key_bytes,
            clock=clock,
            pause=self.loop.sleep,
        )
        self.models = {r.id: Model(args.kv_tokens, args.slots) for r in self.fleet.replicas}
        # --events: the replicas' KV-cache events, and the router's index of them (router.bench.simulate_events)
        self.prompts: Turns | None = None
        self.events: Publishers | None = None
        if args.prompts or args.events:
            index_block = max(1, int(self.config.placement.prefix_block_bytes / BYTES_PER_TOKEN))
            self.prompts = Turns(SYSTEM_TOKENS, args.system_prompts, args.block_tokens, index_block)
        if args.events:
            assert isinstance(self.policy, Ttft) and self.prompts is not None
            self.events = Publishers(
                self.loop,
                self.policy.placement.truth,
                self.prompts,
                args.kv_tokens // args.block_tokens,
                args.event_delay_ms / 1000,
                args.event_loss,
                args.replay_ms / 1000,
                args.replay_keep,
                args.seed + 3,
            )
            for r in self.fleet.replicas:
                self._publishing(r)
        # --explain-jumps: why follow-ups leave their session's replica (router.bench.simulate_jumps)
        self.jumps = JumpWatch(self) if args.explain_jumps else None
        self.handlers: dict[str, Callable[[Any], None]] = {
            "arrive": self._arrive,
            "scale_out": self._scale_out,
            "scale_in": self._scale_in,
            "fail": self._fail,
            "probe": self._probe,
            "tick": self._tick,
        }
        self.finished = False  # every session has arrived and ended
        self.ended_at = 0.0  # ... at this virtual second
        self.stats = Stats()
        self.live: set[int] = set()
        self.started = 0
        self.keys: dict[int, RoutingKey] = {}
        self._offered: dict[str, int] = {}
        self.touched: set[str] = set()  # replicas an event changed (left out of the load CV)
        self._owners_at_fail: dict[int, str] = {}
        self.shape: dict[int, list[tuple[int, int, float]]] = {}  # live session -> per turn: message, reply, think
        self.system: dict[int, int] = {}  # live session -> its system prompt
        # live sessions by the replica that last served them, most recent last (what the router's
        # session table gives a migration), and where each is now
        self.served_by: dict[str, OrderedDict[int, None]] = {}
        self.home: dict[int, str] = {}
        self.rebalancing = args.rebalance and args.policy == "affinity"
        self.rebalancer = Rebalancer(
            RebalanceSettings(
                threshold=self.config.rebalance_threshold,
                window_s=self.config.rebalance_window_s,
                cooldown_s=self.config.rebalance_cooldown_s,
                max_vnodes=self.config.rebalance_max_vnodes,
            )
        )
        self.traffic = VnodeTraffic()

    # -- the event loop ----------------------------------------------------------------------

    @property
    def now(self) -> float:
        """Virtual seconds since the run began."""
        return self.loop.time()

    @now.setter
    def now(self, t: float) -> None:
        """Move the clock on to `t` (tests that drive the handlers themselves)."""
        self.loop.advance(t - self.loop.time())

    def at(self, t: float, kind: str, payload: Any = None) -> None:
        self.loop.call_at(t, self.handlers[kind], payload)

    def run(self) -> dict[str, Any]:
        a = self.args
        wall0 = time.perf_counter()
        self.at(0.0, "arrive")
        self.at(TICK_S, "tick")
        for when, kind in ((a.scale_out_at, "scale_out"), (a.scale_in_at, "scale_in"), (a.fail_at, "fail")):
            if when is not None:
                self.at(when, kind)
        # a turn leaves no reference cycle behind (a test holds it to that), so the collector,
        # which would walk every live session's objects again and again, is off while it runs
        collecting = gc.isenabled()
        gc.disable()
        try:
            # (an event handler or a session that raises, a bug, stops the run and is raised here,
            # rather than run on with a turn that never ends: its clock would tick on forever)
            self.loop.run(until=lambda: self.finished)
            self.ended_at = self.now
            if self.events is not None:  # the messages on their way (and any replay they ask) arrive
                self.loop.run_until(self.now + self.events.settle_s)
        finally:
            self.loop.close()
            if collecting:
                gc.enable()
        return self._report(time.perf_counter() - wall0)

    # -- sessions ------------------------------------------------------------------------------

    def _arrive(self, _: Any) -> None:
        session = self.started
        self.started += 1
        if self.started < self.args.sessions:
            self.at(self.now + self.arrivals.expovariate(self.rate), "arrive")
        shapes = self.shapes
        turns = shapes.randint(*self.turns)
        self.keys[session] = RoutingKey(f"session-{session}".encode(), "header", "sim")
        think = 1 / self.args.think_s
        self.shape[session] = [
            (shapes.randint(50, 200), shapes.randint(50, 250), shapes.expovariate(think)) for _ in range(turns)
        ]
        self.system[session] = shapes.randrange(self.args.system_prompts)
        self.live.add(session)
        self.loop.spawn(self._session(session))

    async def _session(self, session: int) -> None:
        """A conversation: its turns one after another, each after the think time that follows the
        last; a failed turn ends it."""
        # (a bug that raises here stops the run and is raised by it, rather than hang or go quiet)
        shape = self.shape[session]
        context = SYSTEM_TOKENS
        for number, (message, output, think) in enumerate(shape):
            if not await self.serve(Turn(session, number, len(shape), context, message, output, self.now)):
                break
            context += message + output
            if number + 1 < len(shape):
                await self.loop.sleep(think)
        self._ended(session)

    async def serve(self, turn: Turn) -> bool:
        """One turn through the proxy's journey; whether it was served."""
        turn.exchange = exchange = SimExchange(turn)
        key = self.keys[turn.session]
        if self.prompts is not None:  # the prompt in the engine's tokens, as a router with its tokenizer reads it
            key = self.prompts.key(key, turn.session, self.system[turn.session], turn.context, turn.message)
        intake = Intake(body={}, raw=b"", key=key, strip_usage=False, keep=0, api=CHAT, streams=True)
        await self.journey.serve(exchange, intake, self.now)
        turn.exchange = None  # (the turn and its exchange no longer hold each other)
        return exchange.status == 200

    def _publishing(self, replica: ReplicaState) -> None:
        """--events: the replica's engine publishes, and says its blocks' size and its cache's, as
        an engine's metrics do."""
        assert self.events is not None
        replica.engine = replace(replica.engine, block_size=self.args.block_tokens, kv_tokens=self.args.kv_tokens)
        self.models[replica.id].dropped = []
        self.events.join(replica.id)

    def _wall_ms(self) -> int:
        return int(self.now * 1000)

    def served(self, key: bytes, path: str, body: bytes) -> None:
        """The route's observer, as the balance loop is the router's: a keyed turn was served."""
        if self.rebalancing:
            located = self.fleet.ring.locate(key)
            if located is not None:
                self.traffic.record(self.fleet.replicas[located[1]].id, located[2])  # (the ring's, by index)

    def _start(self, turn: Turn, model: Model) -> None:
        model.running += 1
        model.active[turn] = None
        a = self.args
        prompt = turn.context + turn.message
        shared = SYSTEM_TOKENS if self.system[turn.session] in model.systems else 0
        turn.cached = min(max(model.cached(turn.session), shared), prompt - 1)
        prefill = (prompt - turn.cached) * a.prefill_s_per_token
        turn.ttft = self.now - turn.started + prefill  # sampled when it completes (a cut one is not)
        tpot = a.tpot_s * (1 + a.batch_slowdown * (model.running - 1) / max(model.slots - 1, 1))
        turn.busy_s = prefill + turn.output * tpot
        turn.timer = self.loop.call_at(self.now + turn.busy_s, self._done, turn)
        if self.prompts is not None:
            # with prompts, a prompt's blocks are cached as it is scheduled (vLLM allocates and caches
            # them then; its events say so at once), its reply's as it ends
            self._keep(turn, model, prompt)

    def _keep(self, turn: Turn, model: Model, tokens: int) -> None:
        """The replica's cache keeps `tokens` of the turn's conversation, and its system prompt; its
        engine publishes what that stored and evicted (--events)."""
        model.keep(turn.session, tokens)
        model.keep_system(self.system[turn.session])
        if self.events is not None and model.dropped is not None and turn.replica is not None:
            cached = model.cache.get(turn.session, 0)
            self.events.kept(turn.replica.id, turn.session, self.system[turn.session], model.dropped, cached)
            model.dropped.clear()

    def _done(self, turn: Turn) -> None:
        """The model finished `turn`: its slot frees for the next queued one, its replica keeps its
        context, and its attempt answers (the journey then ends the turn)."""
        replica, answer, exchange = turn.replica, turn.answer, turn.exchange
        assert replica is not None and answer is not None and exchange is not None
        if turn.timer is not None:
            turn.timer.cancel()  # (a test may end a turn itself)
            turn.timer = None  # (the turn and its timer no longer hold each other)
        model = self.models[replica.id]
        model.running -= 1
        model.active.pop(turn, None)
        while model.queue and model.running < model.slots:
            self._start(model.queue.popleft(), model)
        prompt = turn.context + turn.message
        s = self.stats
        s.requests += 1
        s.prompt_tokens += prompt
        s.cached_tokens += turn.cached
        s.per_replica[replica.id] = s.per_replica.get(replica.id, 0) + 1
        s.slot_seconds += turn.busy_s
        self._keep(turn, model, prompt + turn.output)
        exchange.status = 200
        answer.set(Outcome(exchange, Served(200, turn.ttft, prompt, turn.cached, turn.output, streamed=True)))

    def _ended(self, session: int) -> None:
        self.live.discard(session)
        if self.jumps is not None:
            self.jumps.ended(session)
        self.keys.pop(session, None)
        last = self.home.pop(session, None)
        recent = self.served_by.get(last) if last is not None else None
        if recent is not None:
            recent.pop(session, None)
        self.shape.pop(session, None)
        self.system.pop(session, None)
        if not self.live and self.started >= self.args.sessions:
            self.finished = True

    def _placed(self, session: int, now: str) -> None:
        """The session's entry points at `now` (served there, or moved there)."""
        before = self.home.get(session)
        if before is not None and before != now:
            previous = self.served_by.get(before)
            if previous is not None:
                previous.pop(session, None)
        self.home[session] = now
        recent = self.served_by.setdefault(now, OrderedDict())
        recent[session] = None
        recent.move_to_end(session)

    def _sample(self, name: str, into: list[float], value: float) -> None:
        """A uniform reservoir of SAMPLE values (Algorithm R)."""
        n = self._offered[name] = self._offered.get(name, 0) + 1
        if len(into) < SAMPLE:
            into.append(value)
        else:
            j = self.rng.randrange(n)
            if j < SAMPLE:
                into[j] = value

    # -- balance -----------------------------------------------------------------------------------

    def _tick(self, _: Any) -> None:
        """The balance loop's turn: loads into the rebalancer; with affinity, its moves made."""
        if not self.finished:  # the run goes on while sessions do
            self.at(self.now + TICK_S, "tick")
        if not self.rebalancing:
            return
        fleet, ring = self.fleet, self.fleet.ring
        loads = {
            r.id: float(r.inflight) for r in fleet.replicas if r.index is not None and r.state in ("healthy", "suspect")
        }
        self.rebalancer.observe(loads, self.now)
        if not self.rebalancer.overheated(self.now):  # none hot for the window: nothing to plan (as `plan` says)
            self.traffic.decay()
            return
        present = {rid for rid, up in zip(ring.replica_ids, ring.available, strict=True) if up}
        overrides = ring.overrides  # (the ring's `replica_ids`, `available`, `overrides` are copies made on each read)
        owners = {v: overrides.get(v, v[0]) for v in self.traffic.recent if v[0] in present}
        moves = self.rebalancer.plan(self.now, self.traffic.recent, owners)
        for move in moves:
            self._migrate(move)
        self.rebalancer.moved(moves, self.now)
        self.traffic.decay()

    def _migrate(self, move: Move) -> None:
        """What the router's migration does, at once: the vnode's live sessions on the source (up to
        `warmup_sessions`) get their context warmed on the target and move there; then the vnode."""
        fleet, ring = self.fleet, self.fleet.ring
        source, target = fleet.find(move.source), fleet.find(move.target)
        if source is None or target is None or target.index is None or move.origin not in ring.replica_ids:
            return
        src, dst = self.models[source.id], self.models[target.id]
        chosen: list[int] = []
        ids = ring.replica_ids
        for session in reversed(self.served_by.get(source.id, OrderedDict())):  # the most recent first
            if len(chosen) >= self.config.warmup_sessions:
                break
            located = ring.locate(self.keys[session].key)
            if located is not None and ids[located[1]] == move.origin and located[2] == move.number:
                chosen.append(session)
        for session in chosen:
            context = src.cache.get(session)
            if context and self.config.warmup:
                dst.keep(session, context)  # warmed: free and at once here (see the module doc)
                dst.keep_system(self.system[session])
            if self.sessions.move(self.keys[session].key, target.id, "migration"):  # as the router's view does
                self._placed(session, target.id)
        moved = len(chosen)
        ring.reassign_vnode(ring.index(move.origin), move.number, target.index)
        self.stats.migrations += 1
        self.stats.migrated_sessions += moved

    # -- membership and health -----------------------------------------------------------------

    def _moved_share(self, change: Any, event: str = "") -> float:
        """Apply `change` (a callable) and return the share of live sessions whose ring owner moved."""
        keys = [self.keys[s].key for s in self.live]
        if event:
            self.stats.live_at[event] = len(keys)
        before = self._owners(keys)
        change()
        after = self._owners(keys)
        return sum(b != c for b, c in zip(before, after, strict=True)) / max(len(keys), 1)

    def _owners(self, keys: list[bytes]) -> list[str | None]:
        """Each key's ring owner now (the ring's `replica_ids` is a copy made on each read: once here)."""
        ids = self.fleet.ring.replica_ids
        return [ids[i] if i >= 0 else None for i in self.fleet.ring.lookup_many(keys)]

    def _scale_out(self, _: Any) -> None:
        rid = f"r{len(self.models)}"
        self.models[rid] = Model(self.args.kv_tokens, self.args.slots, born=self.now)

        def join() -> None:
            self.fleet.add(ReplicaSpec(rid, f"http://sim/{rid}"))
            replica = self.fleet.replicas[-1]
            if self.events is not None:
                self._publishing(replica)
            replica.health.start_warming(self.now)
            self.fleet.apply_health(replica, self.now)

        live = list(self.live)
        keys = [self.keys[x].key for x in live]
        before = self._owners(keys)
        self.stats.moved["scale_out_at_slow_start"] = self._moved_share(join, "scale_out")
        joined = self.fleet.replicas[-1]
        self.touched.add(joined.id)
        self.fleet.set_routing(joined, 1.0)  # what its slow start ends in, from before it joined
        after = self._owners(keys)
        self.stats.moved["scale_out_full_weight"] = sum(b != c for b, c in zip(before, after, strict=True)) / max(
            len(keys), 1
        )
        self.fleet.apply_health(joined, self.now)  # back to the ramp's weight; probes take it up
        self.at(self.now + self.args.probe_s, "probe", (joined.id, 1.0))

    def _scale_in(self, _: Any) -> None:
        victim = self.fleet.replicas[0].id
        self.touched.add(victim)
        self.models[victim].gone = self.now
        self.stats.moved["scale_in"] = self._moved_share(lambda: self.fleet.remove(victim), "scale_in")
        if self.events is not None:
            self.events.forget(victim)

    def _fail(self, _: Any) -> None:
        victim = self.fleet.replicas[len(self.fleet.replicas) // 2]
        self.touched.add(victim.id)
        model = self.models[victim.id]
        model.dead = True
        model.gone = self.now
        if self.events is not None:
            self.events.die(victim.id)  # it publishes nothing again
        model.cache.clear()
        model.cached_tokens = 0
        # what waits or runs there is cut: each attempt fails, and its journey fails over
        for turn in [*model.queue, *model.active]:
            if turn.timer is not None:
                turn.timer.cancel()
                turn.timer = None
            assert turn.answer is not None
            turn.answer.set(Retry("reset"))
            self.stats.failed_attempts += 1
        model.queue.clear()
        model.active.clear()
        model.running = 0
        self.at(self.now + self.args.probe_s, "probe", (victim.id, 0.0))
        # ring owners now, to compare with once health has taken it out (its weight drops at the
        # first bad score already, then it leaves: the share counts both steps)
        live = list(self.live)
        owners = self._owners([self.keys[s].key for s in live])
        self._owners_at_fail = {s: owner for s, owner in zip(live, owners, strict=True) if owner is not None}
        self.stats.live_at["failure"] = len(live)

    def _probe(self, payload: tuple[str, float]) -> None:
        rid, score = payload
        replica = self.fleet.find(rid)
        if replica is None:
            return
        before = replica.state
        replica.health.observe(score, self.now)
        if replica.state == "removed" and before != "removed":
            self.fleet.apply_health(replica, self.now)
            live = [s for s in self.live if s in self._owners_at_fail]
            now_owner = self._owners([self.keys[s].key for s in live])
            # moves for the failure's sake only: to or from the dead replica (a joining replica's
            # ramp may move others meanwhile)
            moved = sum(
                before != after and rid in (before, after)
                for before, after in zip((self._owners_at_fail[s] for s in live), now_owner, strict=True)
            )
            self.stats.moved["failure"] = moved / max(len(live), 1)
            if self.events is not None:
                self.events.forget(rid)
            return  # out of the ring; nobody probes it back here
        self.fleet.apply_health(replica, self.now)
        if replica.state != "healthy" or score < 1.0:
            self.at(self.now + self.args.probe_s, "probe", payload)

    # -- report --------------------------------------------------------------------------------

    def _report(self, wall_s: float) -> dict[str, Any]:
        s = self.stats
        # slot time the fleet had: each replica from when it joined until it left, died or the end
        slot_time = self.args.slots * sum(
            (m.gone if m.gone is not None else self.ended_at) - m.born for m in self.models.values()
        )

        def pct(values: list[float], q: int) -> float | None:
            return round(percentile(values, q), 3) if values else None

        return {
            "policy": self.args.policy,
            "replicas": self.args.replicas,
            "sessions": self.started,
            "requests": s.requests,
            "rate_sessions_per_s": round(self.rate, 2),
            "virtual_s": round(self.ended_at, 1),
            "kv_hit_rate": round(kv_hit_rate(s.cached_tokens, s.prompt_tokens), 4),
            # over the replicas in the fleet the whole run: one that joined, died or left late
            # would count its partial run as imbalance
            "load_cv": round(
                coefficient_of_variation([n for rid, n in s.per_replica.items() if rid not in self.touched]), 4
            ),
            "jump_rate": round(s.jumps / s.followups, 4) if s.followups else 0.0,
            # each cause's share of the follow-up turns (they sum to the jump rate)
            "jumps_by": {k: round(v / s.followups, 4) for k, v in sorted(s.jump_causes.items())} if s.followups else {},
            "latency_p50_s": pct(s.latencies, 50),
            "latency_p99_s": pct(s.latencies, 99),
            "ttft_p99_s": pct(s.ttfts, 99),
            "failed_attempts": s.failed_attempts,
            "failed_requests": s.failed_requests,
            # share of the fleet's slots busy serving, over the run (the model's "GPU busy")
            "slot_occupancy": round(s.slot_seconds / slot_time if slot_time else 0.0, 4),
            "migrations": s.migrations,
            "migrated_sessions": s.migrated_sessions,
            "moved_share": {k: round(v, 4) for k, v in s.moved.items()},
            "live_sessions_at": s.live_at,
            "priced": None
            if self.prompts is None
            else {
                "decisions": s.priced,
                "by_events": round(s.priced_by_events / s.priced, 4) if s.priced else 0.0,
                # how far the cached tokens a decision counted on were from those its replica computed
                # from cache, per prompt token (events count whole blocks: up to a block short a turn)
                "off_per_prompt_token": round(s.counted_off / s.priced_prompt_tokens, 4) if s.priced else 0.0,
            },
            "events": None if self.events is None else self.events.report(),
            "jumps_explained": None if self.jumps is None else self.jumps.report(),
            "wall_s": round(wall_s, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # Linux: KiB
        }


def check(args: argparse.Namespace) -> None:
    """ValueError, one line, for arguments the simulation cannot run with."""
    if args.replicas < 2 or args.sessions < 1 or args.slots < 1 or args.kv_tokens < 1 or args.system_prompts < 1:
        raise ValueError(
            "need --replicas >= 2, --sessions >= 1, --slots >= 1, --kv-tokens >= 1 and --system-prompts >= 1"
        )
    if not args.batch_slowdown >= 0:
        raise ValueError("--batch-slowdown must be >= 0")
    if not (args.rate >= 0 and args.think_s > 0 and args.probe_s > 0 and args.ramp_s >= 0 and args.remove_after >= 1):
        raise ValueError("need --rate >= 0, --think-s > 0, --probe-s > 0, --ramp-s >= 0 and --remove-after >= 1")
    if not (args.prefill_s_per_token >= 0 and args.tpot_s >= 0 and args.prefill_s_per_token + args.tpot_s > 0):
        raise ValueError("--prefill-s-per-token and --tpot-s must be >= 0, and not both 0")
    if args.explain_jumps and args.policy != "ttft":
        raise ValueError("--explain-jumps needs --policy ttft (the policy that prices each replica)")
    if args.events or args.prompts:
        if args.policy != "ttft":
            raise ValueError("--prompts and --events need --policy ttft (the policy that prices what replicas hold)")
        if not 1 <= args.block_tokens <= SYSTEM_TOKENS:
            raise ValueError(f"--block-tokens must be 1 to {SYSTEM_TOKENS}")
        if not (
            args.event_delay_ms >= 0 and args.replay_ms >= 0 and 0 <= args.event_loss < 1 and args.replay_keep >= 0
        ):
            raise ValueError(
                "need --event-delay-ms >= 0, --replay-ms >= 0, 0 <= --event-loss < 1 and --replay-keep >= 0"
            )


def run_cli(args: argparse.Namespace) -> int:
    try:
        sim = Simulation(args)
    except ValueError as exc:
        print(f"router-bench simulate: {exc}")
        return 2
    out = sim.run()
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"simulate {out['policy']}: {out['replicas']} replicas, {out['sessions']:,} sessions, "
        f"{out['requests']:,} requests over {out['virtual_s']:,} virtual s ({out['rate_sessions_per_s']} sessions/s)"
    )
    print(
        f"  KV hit {out['kv_hit_rate']:.1%}, load CV {out['load_cv']:.3f}, jump rate {out['jump_rate']:.1%}, "
        f"latency p50 {out['latency_p50_s']} s p99 {out['latency_p99_s']} s, TTFT p99 {out['ttft_p99_s']} s, "
        f"attempts failed over {out['failed_attempts']}, requests failed {out['failed_requests']}"
    )
    print(
        f"  slots busy {out['slot_occupancy']:.0%}; rebalancer: {out['migrations']} vnodes moved, "
        f"{out['migrated_sessions']:,} sessions with them"
    )
    if out["jumps_by"]:
        print("  jumps by cause (of follow-up turns): " + ", ".join(f"{k} {v:.1%}" for k, v in out["jumps_by"].items()))
    for event, share in out["moved_share"].items():
        live = out["live_sessions_at"].get(event.split("_at_")[0].replace("_full_weight", ""), 0)
        print(f"  {event}: {share:.2%} of the {live:,} live sessions changed ring owner")
    priced = out["priced"]
    if priced is not None:
        print(
            f"  {priced['decisions']:,} priced decisions, {priced['by_events']:.1%} by events; the cached tokens "
            f"counted on were off by {priced['off_per_prompt_token']:.2%} of the prompt tokens"
        )
    ev = out["events"]
    if ev is not None:
        print(
            f"  events: {ev['published']:,} messages, {ev['lost']:,} lost, {ev['applied']:,} applied, "
            f"{ev['gaps']:,} gaps, {ev['replayed']:,} replayed, {ev['unsure_episodes']:,} times unsure; "
            f"{ev['believed_at_end']} of {ev['followed_at_end']} replicas believed at the end"
        )
    if out["jumps_explained"] is not None:
        print_jumps(out["jumps_explained"])
    print(f"  ran in {out['wall_s']} s wall, peak memory {out['peak_rss_mib']} MiB")
    return 0
