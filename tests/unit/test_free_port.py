"""The one free-port helper of the tests and benchmarks: ports nobody holds, that no process's
next outgoing connection can take first, and never the same twice."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from router.bench import common
from router.bench.common import free_port


def test_ports_come_from_below_the_ephemeral_range_each_once_and_free() -> None:
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    runs = [free_port(3) for _ in range(50)] + [free_port() for _ in range(50)]
    handed = [p for base in runs[:50] for p in range(base, base + 3)] + runs[50:]
    assert len(set(handed)) == len(handed)  # never twice
    assert all(p < ephemeral for p in handed)
    for port in handed[::10]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nobody holds it


def test_a_held_port_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = free_port(10)
    with socket.socket() as held:
        held.bind(("127.0.0.1", taken + 1))
        picks = iter([taken, taken + 2])  # a run of two over the held port, then one clear of it

        class Picks:
            def randrange(self, low: int, high: int) -> int:
                return next(picks)

        monkeypatch.setattr(common.random, "Random", Picks)
        monkeypatch.setattr(common, "_handed", set())
        assert free_port(2) == taken + 2
