"""Routing state survives a restart: membership changes, drains, overrides and sessions."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from chat import turn

from router.config import load
from router.node import Node
from router.proxy.app import build_app
from router.state.file import RoutingState, StateError, StateFile


async def serve(config: Any) -> tuple[Node, web.AppRunner, str]:
    router = Node(config)
    runner = web.AppRunner(build_app(router), handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return router, runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def test_a_restart_brings_back_membership_drains_overrides_and_sessions(start_fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(5)
    named = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    settings = {
        "replicas": named[:4],
        "state": f"file:{tmp_path}",
        "admin_token": "tttttttttttttttt",
        "health_checks": "false",
    }
    config = load(None, {}, settings)
    router, runner, url = await serve(config)
    auth = {"Authorization": "Bearer tttttttttttttttt"}
    sessions = [f"s{i}" for i in range(40)]
    served = {s: await turn(url, s) for s in sessions}
    async with aiohttp.ClientSession() as s:
        async with s.post(
            url + "/admin/replicas", json={"id": "emu-4", "url": fleet.replicas[4].url}, headers=auth
        ) as r:
            assert r.status == 201
        async with s.delete(url + "/admin/replicas/emu-3", headers=auth) as r:
            assert r.status == 200
        async with s.post(url + "/admin/replicas/emu-2/drain", headers=auth) as r:
            assert r.status == 200
    ring = router.fleet.ring
    ring.reassign_vnode(ring.index("emu-0"), 5, ring.index("emu-1"))  # as a rebalancing move does
    router.publish()
    for s in sessions:  # sessions of the removed replica move on; the others stay where they were
        served[s] = await turn(url, s)
    overrides = dict(ring.overrides)
    await runner.cleanup()  # saves on the way down
    saved = StateFile(str(tmp_path), config.host, config.port).load()
    assert saved is not None and saved.added == [("emu-4", fleet.replicas[4].url)] and saved.removed == ["emu-3"]

    again, runner2, url2 = await serve(config)
    try:
        assert [r.id for r in again.fleet.replicas] == ["emu-0", "emu-1", "emu-2", "emu-4"]
        assert again.fleet.find("emu-2").state == "draining"  # type: ignore[union-attr]
        assert again.fleet.ring.overrides == overrides
        assert len(again.sessions) == len(sessions)
        for s in sessions:  # each session's next turn lands where its cache is
            assert await turn(url2, s) == served[s]
    finally:
        await runner2.cleanup()


def test_a_bad_state_file_is_one_line(tmp_path: Path) -> None:
    path = StateFile(str(tmp_path), "127.0.0.1", 18999).path
    path.write_text("{not json")
    with pytest.raises(StateError, match="unreadable routing state"):
        StateFile(str(tmp_path), "127.0.0.1", 18999).load()
    out = subprocess.run(
        [
            *(sys.executable, "-m", "router.proxy.cli", "--replica", "http://127.0.0.1:9"),
            *("--port", "18999", "--state", f"file:{tmp_path}"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("router-serve: cannot use the saved routing state: unreadable routing state")


def test_state_round_trip_and_atomic_save(tmp_path: Path) -> None:
    state = RoutingState(
        saved_at=5.0,
        added=[("a", "http://a:1")],
        removed=["b"],
        draining=["c"],
        overrides=[("a", 3, "c")],
        sessions=[(b"\xff\x00key", "a", 12.5)],
    )
    file = StateFile(str(tmp_path / "new-dir"), "::1", 8080)
    file.save(state)
    assert file.load() == state and file.path.name == "routing-state-__1-8080.json"
    assert [p.name for p in file.directory.iterdir()] == [file.path.name]  # no temporary file left
    with pytest.raises(StateError, match="version"):
        RoutingState.from_json(b'{"version": 99}')


async def test_drains_and_discovered_replicas_carry_over_a_restart(start_fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    named = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    listing = tmp_path / "replicas.txt"
    listing.write_text(f"{named[1]}\n{named[2]}\n")
    settings = {
        "replicas": named[:1],
        "state": f"file:{tmp_path}",
        "admin_token": "tttttttttttttttt",
        "health_checks": "false",
        "discovery": f"file:{listing}",
        "discovery_interval_s": "0.05",
        "drain_timeout_s": "0.5",
    }
    config = load(None, {}, settings)
    router, runner, _ = await serve(config)
    deadline = time.monotonic() + 5
    while len(router.fleet.replicas) < 3:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await runner.cleanup()
    saved = StateFile(str(tmp_path), config.host, config.port).load()
    assert saved is not None and saved.discovered == ["emu-1", "emu-2"]
    # while it was down: emu-2 left the listing, and a drain with removal was under way for emu-0
    listing.write_text(f"{named[1]}\n")
    saved.draining, saved.removing = ["emu-0"], ["emu-0"]
    StateFile(str(tmp_path), config.host, config.port).save(saved)
    again, runner2, _ = await serve(config)
    try:
        deadline = time.monotonic() + 5
        while sorted(r.id for r in again.fleet.replicas) != ["emu-1"]:
            assert time.monotonic() < deadline, [(r.id, r.state) for r in again.fleet.replicas]
            await asyncio.sleep(0.05)
    finally:
        await runner2.cleanup()


def test_sessions_of_replicas_no_longer_in_the_fleet_are_not_restored(tmp_path: Path) -> None:
    # a demo's (or a re-deployed fleet's) replicas are new: sessions saved for the old ones point nowhere
    config = load(None, {}, {"replicas": ["a=http://127.0.0.1:9"], "state": f"file:{tmp_path}"})
    StateFile(str(tmp_path), config.host, config.port).save(
        RoutingState(
            saved_at=time.time(),
            added=[],
            removed=[],
            draining=[],
            overrides=[],
            sessions=[(b"kept", "a", 300.0), (b"gone-1", "emu-1", 300.0), (b"gone-2", "emu-2", 300.0)],
        )
    )
    router = Node(config)
    assert len(router.sessions) == 1
    assert router.state_line().endswith(
        "restored: 0 added, 0 removed, 0 draining, 0 overrides, 1 sessions, "
        "2 sessions of replicas no longer in the fleet, dropped"
    )
