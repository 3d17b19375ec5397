"""Replica discovery: a watched file, or DNS (A/AAAA or SRV records of a headless service).

`discovery` setting:
- `file:PATH`: one replica per line, `[NAME=]URL` (blank lines and `#` comments ignored); the
  file is re-read when its modification time or size changes.
- `dns:NAME:PORT`: every address NAME resolves to is a replica `http://ADDRESS:PORT` (id
  `ADDRESS:PORT`), e.g. `dns:vllm-headless.default.svc.cluster.local:8000`.
- `srv:NAME`: every SRV record of NAME is a replica `http://TARGET:PORT` (id `TARGET:PORT`), e.g.
  `srv:_http._tcp.vllm-headless.default.svc.cluster.local`.
Re-resolved every `discovery_interval_s`. Replicas found are added like `POST /admin/replicas`
(slow start, warm-up); replicas no longer found are drained and removed like
`POST /admin/replicas/{id}/drain?remove=true`. Replicas from `--replica` are never touched. A
lookup that fails, or finds nothing at all, changes nothing (a DNS hiccup must not empty the
fleet); the failure is counted and logged.

With prefill/decode disaggregation, `discovery` finds the decode replicas (role `decode`) and
`prefill_discovery` the prefill replicas, with the same kinds of source: those join and leave the
prefill replicas' own fleet (`PrefillReplicas`; every process keeps one and runs their
discovery), with no slow start or warm-up (nothing is routed to them by session), their requests
in flight finishing on their own.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import dns.asyncresolver
import dns.exception
import dns.resolver

from router.config import ReplicaSpec, parse_replica, parse_source
from router.errors import RouterError
from router.fleet import Fleet
from router.membership import Clash, NoRoom
from router.metrics import RouterMetrics

log = logging.getLogger("router.engines.discovery")


class DiscoveryError(RouterError, RuntimeError):
    """This round's lookup failed; nothing changes."""


def read_replica_file(path: str) -> list[ReplicaSpec]:
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DiscoveryError(f"cannot read {path}: {exc}") from None
    specs = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            specs.append(parse_replica(line))
        except ValueError as exc:
            raise DiscoveryError(f"{path}:{number}: {exc}") from None
    return specs


async def resolve_dns(name: str, port: int, nameserver: tuple[str, int] | None = None) -> list[ReplicaSpec]:
    resolver = _resolver(nameserver)
    addresses: list[str] = []
    for rtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, rtype)
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            continue
        except dns.exception.DNSException as exc:
            raise DiscoveryError(f"{name} {rtype}: {exc}") from None
        addresses += [r.to_text() for r in answer]
    return [
        ReplicaSpec(f"{a}:{port}", f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}")
        for a in sorted(set(addresses))
    ]


async def resolve_srv(name: str, nameserver: tuple[str, int] | None = None) -> list[ReplicaSpec]:
    resolver = _resolver(nameserver)
    try:
        answer = await resolver.resolve(name, "SRV")
    except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
        return []
    except dns.exception.DNSException as exc:
        raise DiscoveryError(f"{name} SRV: {exc}") from None
    found = {(r.target.to_text(omit_final_dot=True), int(r.port)) for r in answer}
    return [ReplicaSpec(f"{host}:{port}", f"http://{host}:{port}") for host, port in sorted(found)]


def _resolver(nameserver: tuple[str, int] | None) -> dns.asyncresolver.Resolver:
    if nameserver is None:
        return dns.asyncresolver.Resolver()
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [nameserver[0]]
    resolver.port = nameserver[1]
    resolver.lifetime = 2.0
    return resolver


class Members(Protocol):
    """Where discovered replicas join and leave: the fleet's membership (router.membership), or the
    prefill replicas (`PrefillReplicas`)."""

    fleet: Fleet
    discovery: bool
    discovered: set[str]

    async def add(self, spec: ReplicaSpec, discovered: bool = False) -> Any: ...

    async def drain(self, replica_id: str, remove: bool) -> Any: ...


class PrefillReplicas:
    """The prefill replicas' fleet as discovery changes it: a replica found joins it, one gone
    leaves it at once (its prefills in flight finish: their releases are harmless)."""

    def __init__(self, fleet: Fleet, removed: Callable[[str], None] = lambda replica_id: None) -> None:
        self.fleet = fleet
        self.removed = removed  # a replica left: its gauges go
        self.discovery = True
        self.discovered: set[str] = set()

    async def add(self, spec: ReplicaSpec, discovered: bool = False) -> None:
        try:
            self.fleet.add(spec)
        except ValueError as exc:  # its id or URL is another replica's
            raise Clash(str(exc)) from None
        if discovered:
            self.discovered.add(spec.id)

    async def drain(self, replica_id: str, remove: bool) -> None:
        self.discovered.discard(replica_id)
        if self.fleet.find(replica_id) is not None:
            self.fleet.remove(replica_id)
            self.removed(replica_id)


class Discovery:
    def __init__(
        self,
        membership: Members,
        metrics: RouterMetrics,
        source: str,
        interval_s: float,
        static: Sequence[ReplicaSpec] = (),
        lookup: Callable[[], Awaitable[list[ReplicaSpec]]] | None = None,
        role: str | None = None,
    ) -> None:
        """`static`: the replicas from `--replica`, which discovery never touches; `role`: the
        role of the replicas it finds (`decode`, `prefill`; None: as found, `both`)."""
        self.membership = membership
        membership.discovery = True  # which replicas it added is kept and shared from now on
        self.metrics = metrics
        self.static = {r.id for r in static}
        self.kind, self.name, self.port = parse_source(source)
        self.interval_s = interval_s
        self._lookup = lookup or self._default_lookup
        self.role = role
        self._file_mark: tuple[float, int] | None = None
        self.rounds = 0

    @property
    def managed(self) -> set[str]:
        """The replicas discovery added (and may remove): a fleet-wide fact, kept by membership."""
        return self.membership.discovered

    async def _default_lookup(self) -> list[ReplicaSpec]:
        if self.kind == "file":
            return read_replica_file(self.name)
        if self.kind == "dns":
            return await resolve_dns(self.name, self.port)
        return await resolve_srv(self.name)

    def _file_changed(self) -> bool:
        try:
            st = os.stat(self.name)
        except OSError:
            return True  # let the read report it
        mark = (st.st_mtime, st.st_size)
        changed = mark != self._file_mark
        self._file_mark = mark
        return changed

    async def run(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(self.interval_s)

    async def once(self) -> None:
        if self.kind == "file" and not self._file_changed() and self.rounds:
            return
        m = self.metrics
        try:
            found = await self._lookup()
        except DiscoveryError as exc:
            m.discovery_errors.inc()
            log.warning("discovery: %s; keeping the replicas we have", exc)
            self._file_mark = None  # read the file again next round
            return
        self.rounds += 1
        if not found:
            m.discovery_errors.inc()
            log.warning("discovery found no replica at all; keeping the replicas we have")
            return
        await self.apply(found)

    async def apply(self, found: list[ReplicaSpec]) -> None:
        membership, m = self.membership, self.metrics
        fleet = membership.fleet
        role = self.role
        wanted = {s.id: replace(s, role=role) if role else s for s in found if s.id not in self.static}
        for rid in sorted(self.managed - wanted.keys()):
            replica = fleet.find(rid)
            self.managed.discard(rid)
            if replica is not None and replica.state != "draining":
                await membership.drain(rid, remove=True)
                m.child(m.discovery_changes, "removed").inc()
                log.info("discovery: %s is gone; draining and removing it", rid)
        for rid, spec in wanted.items():
            if fleet.find(rid) is not None:
                self.managed.add(rid)
                continue
            try:
                await membership.add(spec, discovered=True)
            except NoRoom:
                log.warning("discovery: no room for %s in the shared replica table", rid)
                continue
            except Clash as exc:  # its URL is another replica's
                log.warning("discovery: cannot add %s: %s", rid, exc)
                continue
            m.child(m.discovery_changes, "added").inc()
            log.info("discovery: added %s (%s)", rid, spec.url)
