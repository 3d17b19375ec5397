"""Where a request's journey ends: one record (`Ending`) that the ledger counts and logs.

Every way a journey ends (refused at intake, no such model, shed, no replica left, the client gone,
served) fills one `Ending`: the request's key, its status, the replica that answered and the
decision that chose it, the attempt's outcome (its facts and legs: where it broke and was resumed,
how it was split), how many attempts it took, the routing core's verdict, and who sent it (tenant,
priority class). The journey (router.proxy.journey) hands it to its `Accounting`: the proxy's
`Ledger` (metrics by replica, policy, key kind, status and model; latencies; the legs of a split;
`log_requests`: the access-log line), router-bench simulate's tally of its figures; then closes its
trace and settles its tenant's budget from the same record.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from router.fleet import ReplicaState
from router.keys import NO_KEY, RoutingKey
from router.metrics import RouterMetrics
from router.policy import Decision
from router.proxy.exchange import Exchange
from router.proxy.forward import Outcome
from router.proxy.intake import Intake, Refused
from router.routing import Verdict
from router.tenancy.budgets import Reservation
from router.tenancy.clients import DEFAULT_RANK, PRIORITIES, Client
from router.tracing import RequestTrace

access_log = logging.getLogger("router.access")


@dataclass(slots=True)
class Ending:
    """How one request's journey ended, filled as it goes (router.proxy.journey)."""

    exchange: Exchange
    t0: float  # when it arrived (monotonic seconds)
    intake: Intake | Refused | None = None
    key: RoutingKey = NO_KEY
    status: int = 0
    replica: ReplicaState | None = None  # None: no replica answered
    decision: Decision | None = None
    result: Outcome | None = None
    attempts: int = 0
    verdict: Verdict | None = None  # how the routing core counted a served keyed request
    client: Client | None = None  # whose key it brought, with client keys on
    priority: int | None = None  # the class it got (None: the default class)
    trace: RequestTrace | None = None  # its trace, where it is traced
    reserved: Reservation | None = None  # its tenant's tokens, reserved until it is settled


class Accounting(Protocol):
    """Where a request's journey ends: the proxy's `Ledger`; router-bench simulate's tally."""

    def finish(self, end: Ending) -> None: ...


class Ledger:
    """Counts and logs each request's `Ending`: by replica, policy, key kind, status and model, its
    latencies, and (`log_requests`) its access-log line."""

    def __init__(
        self,
        metrics: RouterMetrics,
        policy: str,
        model_label: Callable[[str | None], str],
        log_requests: bool,
        tenants: bool = False,
    ) -> None:
        self.metrics = metrics
        self.policy = policy
        self.model_label = model_label
        self.log_requests = log_requests
        self.tenants = tenants  # client keys are on: requests and tokens counted by tenant

    def finish(self, end: Ending) -> None:
        elapsed = time.monotonic() - end.t0
        replica, key, result, client, status = end.replica, end.key, end.result, end.client, end.status
        name = replica.id if replica is not None else "none"
        m = self.metrics
        m.child(m.requests, name, self.policy, key.kind, str(status), self.model_label(key.model)).inc()
        rank = DEFAULT_RANK if end.priority is None else end.priority
        m.child(m.class_requests, PRIORITIES[rank], str(status)).inc()
        if self.tenants:
            self._tenant(client, status, result)
        legs = None
        if replica is not None:
            m.child(m.e2e, name).observe(elapsed)
            if result is not None and result.facts.ttft_s is not None:
                m.child(m.ttft, name).observe(result.facts.ttft_s)
                if result.split is not None:  # prefilled elsewhere (router.proxy.disagg)
                    legs = result.split.legs(result.facts.ttft_s, elapsed)
                    for leg, seconds in legs.items():
                        m.child(m.legs, leg).observe(seconds)
        if self.log_requests:
            self._log(end, elapsed, rank, legs)

    def _log(self, end: Ending, elapsed: float, rank: int, legs: dict[str, float] | None) -> None:
        result, client, decision, verdict = end.result, end.client, end.decision, end.verdict
        facts = result.facts if result is not None else None
        tenant = {"tenant": client.tenant, "key_id": client.key_id} if client is not None else {}
        tenant["priority"] = PRIORITIES[rank]
        if end.trace is not None:
            tenant["trace_id"] = end.trace.trace_id
        split: dict[str, Any] = {}
        if legs is not None and result is not None and result.split is not None:
            split = {"prefill_replica": result.split.replica} | {
                f"{leg}_ms": round(seconds * 1000, 2) for leg, seconds in legs.items()
            }
        access_log.info(
            json.dumps(
                {
                    "ts": round(time.time(), 3),
                    "method": end.exchange.method,
                    "path": end.exchange.path,
                    "status": end.status,
                    "replica": end.replica.id if end.replica else None,
                    "policy": self.policy,
                    "key_kind": end.key.kind,
                    "key_source": end.key.source,
                    "reason": decision.reason if decision else None,
                    "jump": verdict.jump if verdict else None,
                    "attempts": end.attempts,
                    "ttft_ms": round(facts.ttft_s * 1000, 2) if facts and facts.ttft_s is not None else None,
                    "e2e_ms": round(elapsed * 1000, 2),
                    "prompt_tokens": facts.prompt_tokens if facts else None,
                    "cached_tokens": facts.cached_tokens if facts else None,
                    "stream_error": result.stream_error if result else None,
                    "broke_on": result.broke_on if result else None,
                    "resumed_on": result.resumed_on if result else None,
                }
                | tenant
                | split
            )
        )

    def _tenant(self, client: Client | None, status: int, result: Outcome | None) -> None:
        m = self.metrics
        tenant, key_id = (client.tenant, client.key_id) if client is not None else ("none", "none")
        m.child(m.tenant_requests, tenant, key_id, str(status)).inc()
        if client is not None and result is not None:
            facts = result.facts
            if facts.prompt_tokens:
                m.child(m.tenant_tokens, tenant, "prompt").inc(facts.prompt_tokens)
            if facts.completion_tokens:
                m.child(m.tenant_tokens, tenant, "completion").inc(facts.completion_tokens)


__all__ = ["Accounting", "Ending", "Ledger", "access_log"]
