"""One request's routing: the replicas it is offered, what each attempt taught, the session's next home.

`Routing` is a process's decision-maker: the fleet, the policy, the session directory and the
metrics the decision feeds. `Routing.route` opens a `Route` for one request. The caller (the HTTP
handler, a resumed stream, the simulator) then asks `next` for a replica, makes its attempt and
reports back: `failed` before the first byte, `served` with what the attempt showed (status, time
to first token, tokens, whether it streamed and whether the stream broke), `resumed` for a broken
stream continued elsewhere. `release` ends an attempt's in-flight count and must run however it
ended.

A route offers at most `max_attempts` replicas, never past its deadline, and never one it has tried
but once: where no other replica is left and the last one tried failed as a passing fault does (it
could not be reached, or closed the connection unanswered), that one is offered once more after
`AGAIN_PAUSE_S` (`once_more`), so a fleet of one replica, or a route with one left, does not answer
a 502 for a dropped connection. Served, it remembers the session where it was served (unless the
router moved the session while the request ran), counts a follow-up turn served elsewhere as a
jump with its cause, and feeds the replica's latency samples, its token counts and the balance
loop's per-vnode traffic.

It is past 450 lines as one room: `Routing` opens each `Route`, and a route reads its routing's
fleet, policy, directory and metrics at every step; apart, each module would import the other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Protocol

from router.fleet import TPOT_PREFILL_TOKENS, TTFT_FLOOR_TOKENS, Fleet, ReplicaState
from router.keys import RoutingKey, stored_key
from router.metrics import RouterMetrics
from router.policy import Answer, Decision, Explained, Hearing, Policy
from router.prompt import BYTES_PER_TOKEN
from router.routing.directory import SessionDirectory

# a move is stamped by the control process before it reaches the workers: one that arrives while a
# request starts counts as made while it ran (the line to the workers answers within this)
MOVE_SLACK_MS = 2000
# the policy's own reasons, which say why a session left its replica better than the fleet can
POLICY_REASONS = frozenset({"failover", "spill", "round_robin", "least_load", "cost", "prefix", "target"})
# failures a replica may not fail again a moment later: it could not be reached (a restart, a full
# accept queue, a connect time-out on a starved host) or closed a new connection before answering
# (a pooled one it had closed is sent again at once, below the route: router.engines.upstream).
# A time-out or a 5xx would only be waited for, or answered, again.
AGAIN_CAUSES = frozenset({"connect", "reset"})
AGAIN_PAUSE_S = 0.25  # how long a route waits before it offers such a replica once more


@dataclass(slots=True)
class Served:
    """What a served attempt showed."""

    status: int
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    streamed: bool = False
    cut: bool = False  # the stream broke (an error event, or cut off)
    client_gone: bool = False  # the client left mid-stream: not the replica's fault
    token_s: float | None = None  # time to the first generated token (past a bare opening event)
    response_id: str | None = None  # a Responses API answer's id: where it is stored, for a follow-up
    events: int = 0  # a stream's events forwarded that carry generated tokens (router.proxy.framer)
    tools: bool = False  # the answer called tools: its conversation comes back within seconds


@dataclass(frozen=True, slots=True)
class Verdict:
    """How a served keyed request counted: a follow-up turn, and the cause of its jump if it jumped."""

    followup: bool = False
    jump: str | None = None  # a label of router_session_jumps
    moved: bool = False  # the jump was the router's own move (warmed first)


NO_VERDICT = Verdict()  # (frozen: shared by every request that counted as nothing)


class Observer(Protocol):
    """Who else learns of a served keyed request (the balance loop: vnode traffic, prompts for warm-up)."""

    def served(self, key: bytes, path: str, body: bytes) -> None: ...


class Routing:
    def __init__(
        self,
        fleet: Fleet,
        policy: Policy,
        directory: SessionDirectory,
        metrics: RouterMetrics,
        max_attempts: int,
        observer: Observer | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        move_slack_ms: float = MOVE_SLACK_MS,
        counted: bool = True,
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.directory = directory
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.observer = observer
        self.clock = clock  # monotonic seconds: request starts, latency samples
        policy.use_clock(clock)  # what it learns from answers runs on the same clock
        self.wall = wall  # unix seconds: session entries
        self.move_slack_ms = move_slack_ms
        # its routes are requests the metrics count (retries, failovers, tokens, the prefix index's
        # accuracy); False for a request's legs routed apart (router.pools: a prefill leg), which
        # the request's own route counts, and which have metrics of their own
        self.counted = counted

    async def route(self, key: RoutingKey, t0: float, deadline: float, target_at: float | None = None) -> Route:
        """A route for a request that arrived at `t0` (clock) and must end by `deadline` (the
        clock its caller passes to `next`); `target_at`: when it asks for its first token by (on
        that clock too: x-slo-ttft-ms)."""
        last, local = await self.directory.last_served(key.key) if key.kind != "none" else (None, False)
        parent = None
        if last is None and key.parent is not None:  # a sub-agent's first turn: where its parent is
            parent, _ = await self.directory.last_served(key.parent, remember=False)
        return Route(self, key, last, local, t0, deadline, parent=parent, target_at=target_at)

    def local_route(self, key: RoutingKey, t0: float, deadline: float, target_at: float | None = None) -> Route:
        """A route by this process's own session table alone: what `route` opens when no other
        store is configured (the simulator has none), without waiting on one."""
        table = self.directory.table
        last = table.get(key.key) if key.kind != "none" else None
        parent = table.get(key.parent) if last is None and key.parent is not None else None
        return Route(self, key, last, last is not None, t0, deadline, parent=parent, target_at=target_at)

    def peek(self, key: RoutingKey, exclude: Collection[int]) -> Decision | None:
        """Where a keyless first attempt for `key` would go, never to a replica in `exclude`, with
        nothing acquired, counted or remembered (a keyless pick moves no session)."""
        return self.policy.pick(key if key.kind == "none" else replace(key, kind="none"), None, exclude)

    async def explain(self, key: RoutingKey) -> tuple[Explained, str | None]:
        """Where a first attempt for `key` would go, as `route(key).next()` decides it (a stored
        response's replica included), and where its session was served last; nothing is counted,
        sent or remembered."""
        last, _ = await self.directory.last_served(key.key, remember=False) if key.kind != "none" else (None, False)
        route = Route(self, key, last, False, self.clock(), float("inf"), hearing=False)
        holder = route.holder()
        if holder is not None:
            return Explained(holder), last
        if last is None and key.parent is not None:
            route.parent, _ = await self.directory.last_served(key.parent, remember=False)
        explained = self.policy.explain(key, route.start)
        return replace(explained, decision=route.from_parent(explained.decision)), last

    def jump_reason(self, last: str, decision: Decision) -> str:
        """Why a session left `last` for `decision`: a label of router_session_jumps."""
        if decision.jump is not None:
            return decision.jump  # the policy knows better than the replica's state
        if decision.reason in POLICY_REASONS:
            return decision.reason
        previous = self.fleet.find(last)
        if previous is None:
            return "membership"  # its replica left the fleet
        if previous.state == "draining":
            return "drain"
        if not previous.health.routable:
            return "health"
        # routable and not tried, yet passed over: `ring` where the key's ring owner changed
        # (membership, weights or an override), `spill` where the policy passes over only a full one
        return decision.passed_over


class Route:
    __slots__ = (
        "again",
        "again_due",
        "alone",
        "avoid",
        "deadline",
        "decision",
        "first",
        "hearing",
        "key",
        "last",
        "late",
        "local",
        "parent",
        "pinned",
        "prompt_mark",
        "refuse_late",
        "repeated",
        "routing",
        "t0",
        "target_at",
        "timed_out",
        "tried",
    )

    def __init__(
        self,
        routing: Routing,
        key: RoutingKey,
        last: str | None,
        local: bool,
        t0: float,
        deadline: float,
        hearing: bool = True,
        parent: str | None = None,
        target_at: float | None = None,
    ) -> None:
        self.routing = routing
        self.key = key
        self.last = last  # where the session was served last (None: new, or keyless)
        self.parent = parent  # a new sub-agent session: where its parent session was served last
        self.local = local  # ... as this process's own entry says (else newer news from elsewhere)
        self.t0 = t0
        self.deadline = deadline
        self.target_at = target_at  # when its first token is asked for (the clock of `next`): x-slo-ttft-ms
        self.tried: list[ReplicaState] = []  # by replica, not index: an admin removal shifts indices
        self.first: ReplicaState | None = None
        self.decision: Decision | None = None  # the latest pick for the request itself
        self.alone = False  # the latest pick had nothing else in flight when acquired
        self.prompt_mark = 0.0  # its replica's prompt_sent once its own prompt was counted there
        # what the policy learns from this route's attempts (ttft: its prefix index and prefill queues)
        self.hearing: Hearing | None = routing.policy.hear(key) if hearing else None
        self.timed_out = False  # `next` refused for the deadline
        # replicas (indices) `next` passes over besides those tried: for a prefill leg, the prefill
        # replicas its decode replica has not met yet (router.pools.Pairs)
        self.avoid: frozenset[int] = frozenset()
        # the replica the first attempt goes to, whatever the policy would pick, while it is in the
        # fleet: a moved session's prefill leg, on the replica that holds its blocks (draining too)
        self.pinned: ReplicaState | None = None
        # a first pick that no replica is predicted to serve by `target_at` is not sent (a sheddable
        # request's, which is better refused at once than served late): `next` says None, and `late`
        self.refuse_late = False
        self.late = False
        # the last replica tried, where it failed as a passing fault does (AGAIN_CAUSES); `once_more`
        # offers it again (`again_due`: the next `next`), at most once a route (`repeated`), where
        # no other is left
        self.again: ReplicaState | None = None
        self.again_due = False
        self.repeated = False

    @property
    def attempts(self) -> int:
        return len(self.tried)

    @property
    def start(self) -> str | None:
        """The replica the policy is asked to keep the request on when it has room: the session's
        last, or for a sub-agent's first turn its parent's (whose context, system prompt and tools
        it mostly shares)."""
        return self.last if self.last is not None else self.parent

    def from_parent(self, decision: Decision | None) -> Decision | None:
        """`decision`, its reason `parent` where it keeps a new sub-agent on its parent's replica."""
        if decision is not None and self.last is None and self.parent is not None and decision.reason == "sticky":
            return replace(decision, reason="parent")
        return decision

    def next(self, now: float, resuming: bool = False) -> ReplicaState | None:
        """The next replica to try, counted in flight there (`release` it); None when the attempts
        or the time are spent or no replica is left. `resuming`: for the continuation of a broken
        stream, which goes by the ring, not back to the replica it broke on."""
        routing = self.routing
        if len(self.tried) >= routing.max_attempts:
            return None
        if now >= self.deadline:
            self.timed_out = True  # no replica is charged for an attempt that was never made
            return None
        if self.again_due and not resuming:
            return self._offer_again(now)
        if self.key.kind == "response" and self.last is not None and not resuming and self.tried:
            return None  # only the replica holding a stored response can continue it: no retry elsewhere
        decision = None if resuming else self.holder()
        pinned = self.pinned
        if pinned is not None and not self.tried and pinned.index is not None:
            decision = Decision(pinned.index, "sticky")
        if decision is None:
            decision = routing.policy.pick(
                self.key,
                None if resuming else self.start,
                {r.index for r in self.tried if r.index is not None} | self.avoid,
                parent=self.last is None and self.parent is not None,
                target_s=None if self.target_at is None or resuming else self.target_at - now,
            )
            if self.parent is not None:
                decision = self.from_parent(decision)
            last = self.last
            # the first pick moves the session from `last` (a failover's does not: its home failed here)
            if (
                decision is not None
                and last is not None
                and not self.tried
                and not resuming
                and routing.fleet.replicas[decision.index].id != last
            ):
                decision = replace(decision, left=last)
        if decision is None:
            return None
        if decision.late and self.refuse_late and not self.tried:
            self.late = True
            return None
        return self._offer(routing.fleet.replicas[decision.index], decision, now, resuming)

    def _offer(self, replica: ReplicaState, decision: Decision, now: float, resuming: bool) -> ReplicaState:
        """`replica`, offered on `decision`: tried, counted in flight, its prompt counted there."""
        fleet = self.routing.fleet
        self.tried.append(replica)
        if self.first is None:
            self.first = replica
        if not resuming:
            self.decision = decision
        fleet.acquire(replica)
        model = self.key.model
        if model is not None and model in fleet.adapter_names:
            fleet.sent_adapter(replica, model)  # its engine loads it: the next request for it knows
        # nothing else in flight there: its time to first token measures the replica, not a queue
        self.alone = replica.index is not None and fleet.loads[replica.index] <= 1
        replica.prompt_sent += _to_prefill(self.key, decision)
        self.prompt_mark = replica.prompt_sent
        if self.hearing is not None:
            self.hearing.sent(replica, decision, now)
        return replica

    def once_more(self, now: float) -> bool:
        """Where `next` offered no replica: whether the last one tried, which failed as a passing
        fault does (AGAIN_CAUSES), is offered once more, after AGAIN_PAUSE_S (the caller waits it,
        then asks `next`). Once a route, within `max_attempts` and the deadline, and only while
        that replica is still in the fleet and routable."""
        replica = self.again
        if replica is None or self.repeated or self.late or self.timed_out:
            return False
        if len(self.tried) >= self.routing.max_attempts or now + AGAIN_PAUSE_S >= self.deadline:
            return False
        if replica.index is None or not self.routing.fleet.routable(replica.index):
            return False
        self.repeated = self.again_due = True
        return True

    def _offer_again(self, now: float) -> ReplicaState | None:
        """The replica `once_more` said would be offered again, on the pick that chose it last."""
        replica = self.again
        self.again, self.again_due = None, False
        if replica is None or replica.index is None or not self.routing.fleet.routable(replica.index):
            return None  # (removed, or out of routing, during the pause)
        decision = self.decision
        decision = Decision(replica.index, "failover") if decision is None else replace(decision, index=replica.index)
        return self._offer(replica, decision, now, False)

    def holder(self) -> Decision | None:
        """For a `response` key: a stored response (or conversation) lives on the replica that
        produced it, and only that one can continue it, whatever its load: that replica while it is
        in the fleet, serves the model and takes requests (routable, or draining: it finishes what
        it holds); else None (then the policy places it, and the replica there says what it knows)."""
        last = self.last
        if self.key.kind != "response" or last is None:
            return None
        fleet = self.routing.fleet
        holder = fleet.find(last)
        if holder is None or holder.index is None or holder.index in fleet.not_serving(self.key.model):
            return None
        if not (fleet.routable(holder.index) or holder.state == "draining"):
            return None
        return Decision(holder.index, "sticky")

    def produced(self, response_id: str, replica: ReplicaState, max_key_bytes: int, tenant: str | None = None) -> None:
        """`replica` stored a Responses API answer under `response_id`: a request continuing it
        (`previous_response_id`) goes there, as a session's turn would (TTL, sharing, saving)."""
        self._remember(replica, stored_key(response_id, max_key_bytes, tenant))
        if tenant is not None:  # and that some tenant made it: another's continuation is then refused
            self._remember(replica, stored_key(response_id, max_key_bytes))

    def release(self, replica: ReplicaState) -> None:
        routing = self.routing
        routing.fleet.release(replica)
        if self.hearing is not None:
            self.hearing.released(replica, routing.clock())

    def failed(self, replica: ReplicaState, cause: str) -> None:
        """The attempt on `replica` failed before its first byte (`cause`: connect, timeout, http_5xx, reset)."""
        replica.errors += 1
        self.again = replica if cause in AGAIN_CAUSES else None
        m = self.routing.metrics
        if self.routing.counted:
            m.child(m.retries, cause).inc()
        if self.hearing is not None:
            self.hearing.failed(replica)

    def served(self, replica: ReplicaState, facts: Served, path: str = "", body: bytes = b"") -> Verdict:
        """`replica` answered (`facts`): feed its samples and counts; a keyed success remembers the
        session there and tells the observer (`path` and `body`: the request, for warm-up)."""
        routing = self.routing
        m = routing.metrics
        if facts.prompt_tokens:
            replica.prompt_tokens += facts.prompt_tokens
            replica.cached_tokens += facts.cached_tokens
            if routing.counted:
                m.child(m.prompt_tokens, replica.id).inc(facts.prompt_tokens)
                m.child(m.cached_tokens, replica.id).inc(facts.cached_tokens)
        if facts.streamed and facts.ttft_s is not None and not facts.cut:
            now = routing.clock()
            decoded = facts.completion_tokens - 1
            if decoded >= 1 and replica.prompt_sent - self.prompt_mark <= TPOT_PREFILL_TOKENS * decoded:
                # time per output token after the first: the latency signal, normalised by reply
                # length, from replies that shared their engine with little of others' prefill
                replica.tpot.append((now, (now - self.t0 - facts.ttft_s) / decoded))
            if facts.prompt_tokens and self.alone:
                # time to first token per prompt token computed (cached ones are nearly free), from
                # requests that found the replica otherwise idle: a queue is load, not sickness
                computed = max(facts.prompt_tokens - facts.cached_tokens, TTFT_FLOOR_TOKENS)
                replica.ttft.append((now, facts.ttft_s / computed))
        if facts.cut and not facts.client_gone:
            replica.errors += 1
            m.child(m.stream_errors, replica.id).inc()
        if replica is not self.first and routing.counted:
            m.failovers.inc()
        key = self.key
        if self.hearing is not None and key.prompt is not None and facts.status < 400:
            self._heard(self.hearing, replica, facts)
        if key.kind == "none" or facts.status >= 400:
            return NO_VERDICT
        verdict = NO_VERDICT
        last = self.last
        if last is not None:
            m.followups.inc()
            table = routing.directory.table
            moved = table.moved(key.key) if self.local else None  # else the news came from elsewhere
            if moved is not None and last == replica.id == table.get(key.key):
                verdict = Verdict(True, moved, moved=True)  # the router moved it here (its cache was warmed first)
            elif last != replica.id and self.decision is not None:
                verdict = Verdict(True, routing.jump_reason(last, self.decision))
            else:
                verdict = Verdict(True)
            if verdict.jump is not None:
                m.child(m.jumps, verdict.jump).inc()
        self._remember(replica)
        if routing.observer is not None:
            routing.observer.served(key.key, path, body)
        return verdict

    def _heard(self, hearing: Hearing, replica: ReplicaState, facts: Served) -> None:
        """Tell the policy what the answer showed (ttft: its prefix index and prefill model)."""
        routing = self.routing
        # a prefill speed is learnt only from a request that had the replica to itself: with others
        # there, its first token also waited for their decode steps and for room in a full KV cache,
        # which the model does not see, and busy replicas would look slow and idle ones fast (every
        # new conversation then herds onto whichever was measured last while idle)
        ttft = facts.token_s if facts.streamed and not facts.cut and self.alone else None
        # how long a reply holds its KV blocks once it runs (router.placement's KV-bound queues)
        reply_s = None
        if facts.streamed and not facts.cut and facts.ttft_s is not None and facts.completion_tokens >= 2:
            reply_s = routing.clock() - self.t0 - facts.ttft_s
        first = self.t0 + facts.token_s if facts.streamed and not facts.cut and facts.token_s is not None else None
        predicted = hearing.answered(
            replica, Answer(facts.prompt_tokens, facts.cached_tokens, ttft, facts.completion_tokens, reply_s, first)
        )
        if routing.counted:
            m = routing.metrics
            rid = replica.id
            if predicted is not None:
                m.child(m.prefix_prompt_tokens, rid).inc(facts.prompt_tokens)
                m.child(m.prefix_predicted_tokens, rid).inc(predicted.tokens)
                m.child(m.prefix_reported_tokens, rid).inc(facts.cached_tokens)
                m.child(m.prefix_error_tokens, rid).inc(abs(predicted.tokens - facts.cached_tokens))
                m.child(m.prefix_prediction_error, predicted.source).observe(predicted.tokens - facts.cached_tokens)
            m.child(m.prefix_index_blocks, rid).set(hearing.blocks_held(replica))
        if facts.tools:
            hearing.called_tools(replica)

    def resumed(self, replica: ReplicaState, whole: bool) -> None:
        """A broken stream was continued on `replica`; `whole`: the continuation ended well (else it broke too)."""
        if not whole:
            replica.errors += 1
            m = self.routing.metrics
            m.child(m.stream_errors, replica.id).inc()
        elif self.key.kind != "none":
            self._remember(replica)  # its cache now holds the whole conversation

    def _remember(self, replica: ReplicaState, key: bytes | None = None) -> None:
        routing = self.routing
        started_ms = (routing.wall() - (routing.clock() - self.t0)) * 1000 - routing.move_slack_ms
        routing.directory.remember(self.key.key if key is None else key, replica, started_ms)


def _to_prefill(key: RoutingKey, decision: Decision) -> float:
    """The prompt tokens a request sends its replica to compute: what the decision priced as not
    cached there, else its whole prompt as the key measures it (bytes / BYTES_PER_TOKEN), else none known."""
    if decision.cost is not None:
        return decision.cost.uncached_tokens
    prompt = key.prompt
    if prompt is None:
        return 0.0
    return float(prompt.tokens.count) if prompt.tokens is not None else prompt.nbytes / BYTES_PER_TOKEN
