"""How a request reaches a replica: an attempt sent (or a broken stream resumed) over HTTP.

The journey (router.proxy.journey) asks its `Attempts` to send a request to the replica its route
offers; `HttpAttempts` does it on the process's keep-alive pools (router.engines.upstream), with the
replica's own engine key in place of the client's where it has one, and names the replica (and,
in a worker process, the worker) on every answer. router-bench simulate's modelled replicas and
the unit tests' scripts are `Attempts` too; the split attempt (router.proxy.disagg) wraps these.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Protocol

from router.engines.upstream import Upstream
from router.fleet import ReplicaState
from router.policy import Decision
from router.proxy.forward import Outcome, Retry, Timeouts, Trip, attempt, resume
from router.proxy.sse import StreamFramer
from router.tenancy.clients import KEY_HEADERS

WORKER_HEADER = "X-Router-Worker"  # which worker process answered, next to the replica header


class Attempts(Protocol):
    """How a request reaches a replica: `send` it (a `Retry` when it failed before its first
    byte; `decision`: the pick that chose the replica, with its predicted cost where the policy
    prices, for attempts that weigh it), or `resume` a broken stream's `outcome` there with the
    continuation `body`, its new bytes spliced by `splicer` (a `Retry` when the continuation failed
    before its first byte)."""

    def send(
        self, replica: ReplicaState, trip: Trip, deadline: float, decision: Decision | None = None
    ) -> Awaitable[Retry | Outcome]: ...

    def resume(
        self, replica: ReplicaState, trip: Trip, body: bytes, deadline: float, outcome: Outcome, splicer: StreamFramer
    ) -> Awaitable[Retry | None]: ...


class HttpAttempts:
    """Attempts over HTTP, on the process's keep-alive pools (router.engines.upstream); every answer names
    the replica (`replica_header`) and, in a worker process, the worker."""

    def __init__(
        self,
        client: Callable[[], Upstream],
        timeouts: Timeouts,
        replica_header: str,
        worker: int | None,
    ) -> None:
        self.client = client  # the pools exist once the app runs
        self.timeouts = timeouts
        self.replica_header = replica_header
        self.worker = worker

    @staticmethod
    def keyed(replica: ReplicaState, trip: Trip) -> Trip:
        """`trip` as sent to `replica`: with its engine's key (replica_api_keys) in place of the
        client's, where it has one."""
        auth = replica.auth
        if not auth:
            return trip
        headers = {k: v for k, v in trip.headers.items() if k.lower() not in KEY_HEADERS}
        return replace(trip, headers=headers | auth)

    def named(self, replica: ReplicaState) -> dict[str, str]:
        name = self.replica_header
        if not name:
            return {}
        if self.worker is not None:
            return {name: replica.id, WORKER_HEADER: str(self.worker)}
        return {name: replica.id}

    def send(
        self, replica: ReplicaState, trip: Trip, deadline: float, decision: Decision | None = None
    ) -> Awaitable[Retry | Outcome]:
        # the attempt's own coroutine, not one around it: one frame less per request
        if replica.auth:
            trip = self.keyed(replica, trip)
        return attempt(
            self.client(), trip, replica.url + trip.exchange.path, self.named(replica), self.timeouts, deadline
        )

    def send_settled(self, replica: ReplicaState, trip: Trip, deadline: float) -> Awaitable[Retry | Outcome]:
        """`send`, a stream held until its second event: one that errs there is a `Retry`
        (router.proxy.forward.attempt's `settle`)."""
        if replica.auth:
            trip = self.keyed(replica, trip)
        return attempt(
            self.client(), trip, replica.url + trip.exchange.path, self.named(replica), self.timeouts, deadline, True
        )

    def resume(
        self, replica: ReplicaState, trip: Trip, body: bytes, deadline: float, outcome: Outcome, splicer: StreamFramer
    ) -> Awaitable[Retry | None]:
        url, keyed = replica.url + trip.exchange.path, self.keyed(replica, trip)
        return resume(self.client(), keyed, url, body, self.timeouts, deadline, outcome, splicer)


__all__ = ["WORKER_HEADER", "Attempts", "HttpAttempts"]
