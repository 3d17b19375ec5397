"""Discovery: a watched file and DNS (A and SRV records from a DNS server started by the test)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import dns.message
import dns.rcode
import dns.rrset
import pytest
from waiting import until

from router.config import ConfigError, ReplicaSpec, load
from router.engines.discovery import Discovery, resolve_dns, resolve_srv


async def test_a_watched_file_adds_and_removes_replicas(start_fleet, start_router, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    urls = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    listing = tmp_path / "replicas.txt"
    listing.write_text(f"# the fleet\n{urls[0]}\n\n{urls[1]}\n")
    router, _ = await start_router([], discovery=f"file:{listing}", discovery_interval_s="0.05", health_checks="false")

    def ids() -> list[str]:
        return sorted(r.id for r in router.fleet.replicas)

    await until(lambda: ids() == ["emu-0", "emu-1"], 'ids() == ["emu-0", "emu-1"]')
    assert router.fleet.find("emu-1").state == "warming"  # type: ignore[union-attr]  # slow start
    listing.write_text(f"{urls[1]}\n{urls[2]}  # a comment\n")
    await until(lambda: ids() == ["emu-1", "emu-2"], 'ids() == ["emu-1", "emu-2"]')  # emu-0 drained, then removed
    listing.write_text("this is not a url\n")
    errors = router.metrics.discovery_errors._value.get()
    await until(
        lambda: router.metrics.discovery_errors._value.get() > errors,
        "router.metrics.discovery_errors._value.get() > errors",
    )
    assert ids() == ["emu-1", "emu-2"]  # a bad file changes nothing
    discovery = router.discovery
    assert discovery is not None
    rounds = discovery.rounds  # a read that finds the file (the bad one raised before counting)
    listing.write_text("")
    await until(lambda: discovery.rounds > rounds, "a discovery round that read the empty file")
    assert ids() == ["emu-1", "emu-2"]  # nor does an empty one


class DnsServer(asyncio.DatagramProtocol):
    """Answers A and SRV questions from a table; anything else NXDOMAIN."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[str]] = {}
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        question = query.question[0]
        key = (question.name.to_text(), dns.rdatatype.to_text(question.rdtype))
        if key in self.records:
            response.answer.append(dns.rrset.from_text_list(question.name, 30, "IN", key[1], self.records[key]))
        elif not any(name == key[0] for name, _ in self.records):
            response.set_rcode(dns.rcode.NXDOMAIN)
        self.transport.sendto(response.to_wire(), addr)


async def test_dns_a_and_srv_records() -> None:
    loop = asyncio.get_running_loop()
    transport, server = await loop.create_datagram_endpoint(DnsServer, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    ns = ("127.0.0.1", port)
    try:
        server.records[("vllm.test.", "A")] = ["10.0.0.7", "10.0.0.5"]
        server.records[("_http._tcp.vllm.test.", "SRV")] = ["0 0 8000 pod-a.vllm.test.", "0 0 8001 pod-b.vllm.test."]
        assert await resolve_dns("vllm.test", 8000, ns) == [
            ReplicaSpec("10.0.0.5:8000", "http://10.0.0.5:8000"),
            ReplicaSpec("10.0.0.7:8000", "http://10.0.0.7:8000"),
        ]
        assert await resolve_srv("_http._tcp.vllm.test", ns) == [
            ReplicaSpec("pod-a.vllm.test:8000", "http://pod-a.vllm.test:8000"),
            ReplicaSpec("pod-b.vllm.test:8001", "http://pod-b.vllm.test:8001"),
        ]
        assert await resolve_dns("nothing.test", 80, ns) == []
    finally:
        transport.close()


async def test_dns_discovery_follows_the_records(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    ports = [int(r.url.rsplit(":", 1)[1]) for r in fleet.replicas]
    loop = asyncio.get_running_loop()
    transport, server = await loop.create_datagram_endpoint(DnsServer, local_addr=("127.0.0.1", 0))
    ns = ("127.0.0.1", transport.get_extra_info("sockname")[1])
    name = "_vllm._tcp.fleet.test"
    try:
        server.records[(name + ".", "SRV")] = [f"0 0 {ports[1]} localhost."]
        static = f"emu-0={fleet.replicas[0].url}"  # configured: discovery never touches it
        router, _ = await start_router([static], health_checks="false")
        discovery = Discovery(
            router.membership,
            router.metrics,
            "srv:" + name,
            0.05,
            router.config.replicas,
            lambda: resolve_srv(name, ns),
        )

        def ids() -> list[str]:
            return sorted(r.id for r in router.fleet.replicas)

        await discovery.once()
        assert ids() == ["emu-0", f"localhost:{ports[1]}"]
        server.records[(name + ".", "SRV")] = [f"0 0 {ports[2]} localhost."]
        await discovery.once()
        await until(lambda: ids() == ["emu-0", f"localhost:{ports[2]}"], 'ids() == ["emu-0", f"localhost:{ports[2]}"]')
        transport.close()  # the DNS server is gone: the fleet stays as it is
        await discovery.once()
        assert ids() == ["emu-0", f"localhost:{ports[2]}"]
        assert router.metrics.discovery_errors._value.get() == 1
    finally:
        transport.close()


def test_bad_discovery_settings() -> None:
    for bad in ("consul:x", "dns:name-without-port", "dns:x:99999", "file:"):
        with pytest.raises(ConfigError, match="discovery"):
            load(None, {}, {"discovery": bad})
    assert load(None, {}, {"discovery": "srv:_http._tcp.x"}).replicas == ()  # no static replicas needed
