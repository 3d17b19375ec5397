"""The control process's line to its workers: answers merged, a silent worker stood in for."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.balance.link import WorkerLink, internal_app
from router.balance.rebalance import VnodeTraffic
from router.balance.warmup import PromptStore
from router.config import ReplicaSpec
from router.fleet import Fleet, ReplicaState
from router.sessions import LinkDown, SessionTable


class FakeWorker:
    """A worker's internal socket answering /live and /restore with what the test sets."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.live: list[Any] = []
        self.restored: list[Any] = []
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def live(request: web.Request) -> web.Response:
            return web.json_response(self.live)

        async def restore(request: web.Request) -> web.Response:
            self.restored += (await request.json())["sessions"]
            return web.json_response({"restored": 0})

        app = web.Application()
        app.router.add_post("/live", live)
        app.router.add_post("/restore", restore)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.UnixSite(self.runner, self.path).start()

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()
        if os.path.exists(self.path):
            os.unlink(self.path)


async def test_answers_merge_and_a_silent_worker_is_stood_in_for(tmp_path: Path) -> None:
    a, b = FakeWorker(str(tmp_path / "w0.sock")), FakeWorker(str(tmp_path / "w1.sock"))
    await a.start()
    await b.start()
    link = WorkerLink([a.path, b.path], timeout_s=1.0)
    try:
        a.live = [[b"k1".hex(), "r1", 100.0, 1000], [b"k2".hex(), "r1", 100.0, 1000]]
        b.live = [[b"k1".hex(), "r2", 100.0, 2000]]  # k1 served later through b, elsewhere
        merged = await link.live()
        assert [(k, r, w) for k, r, _, w in merged] == [(b"k2", "r1", 1000), (b"k1", "r2", 2000)]  # oldest first
        await b.stop()  # b stops answering: its last whole list stands in, counted down
        time.sleep(0.05)
        again = {k: (r, left) for k, r, left, _ in await link.live()}
        assert again[b"k1"][0] == "r2" and again[b"k1"][1] < 100.0
        with pytest.raises(LinkDown):  # per replica, no stand-in: a partial list is no answer
            await link.live("r1")
        # a restore that cannot reach a worker says so (and may be sent again)
        entries = [(f"s{i}".encode(), "r1", 50.0, 3000) for i in range(20)]
        with pytest.raises(LinkDown):
            await link.restore(entries)
        assert 0 < len(a.restored) < 20  # a got its share, by key hash
        await a.stop()
        stale = await link.live()  # both silent: both stand-ins
        assert {k for k, *_ in stale} == {b"k1", b"k2"}
    finally:
        await link.close()


async def test_a_worker_that_hangs_costs_the_link_time_out_not_for_ever(tmp_path: Path) -> None:
    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hang)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    path = str(tmp_path / "hung.sock")
    await web.UnixSite(runner, path).start()
    link = WorkerLink([path], timeout_s=0.3)
    try:
        start = time.monotonic()
        with pytest.raises(LinkDown):
            await link.live()
        with pytest.raises(LinkDown):
            await link.restore([(b"k", "r", 10.0, 1)])
        assert await link.version() == hash(())
        assert time.monotonic() - start < 3  # three calls, each cut at 0.3 s
    finally:
        await link.close()
        await runner.cleanup()


async def test_a_partial_answer_for_one_replica_is_not_the_whole_truth(tmp_path: Path) -> None:
    a = FakeWorker(str(tmp_path / "w0.sock"))
    await a.start()
    link = WorkerLink([a.path, str(tmp_path / "gone.sock")], timeout_s=0.5)
    try:
        with pytest.raises(LinkDown):  # "none on r1" from one worker of two would let a drain remove blind
            await link.live("r1")
    finally:
        await link.close()
        await a.stop()


async def test_traffic_is_the_difference_of_running_totals(tmp_path: Path) -> None:
    totals: list[Any] = [["a", 1, 5]]

    async def traffic(request: web.Request) -> web.Response:
        return web.json_response(totals)

    app = web.Application()
    app.router.add_get("/traffic", traffic)
    runner = web.AppRunner(app)
    await runner.setup()
    path = str(tmp_path / "t.sock")
    await web.UnixSite(runner, path).start()
    link = WorkerLink([path])
    try:
        assert await link.traffic() == {("a", 1): 5}
        totals[:] = [["a", 1, 8], ["b", 2, 1]]
        assert await link.traffic() == {("a", 1): 3, ("b", 2): 1}
        assert await link.traffic() == {}
        totals[:] = [["a", 1, 2]]  # the worker restarted: its totals start over
        assert await link.traffic() == {("a", 1): 2}
    finally:
        await link.close()
        await runner.cleanup()


async def test_no_answer_ever_is_link_down(tmp_path: Path) -> None:
    link = WorkerLink([str(tmp_path / "none.sock")], timeout_s=0.5)
    try:
        with pytest.raises(LinkDown):
            await link.live()
        assert await link.traffic() == {}
    finally:
        await link.close()


class TornShared:
    """The workers' shared session table at the moment another worker rewrites this session's
    entry for the same move: the entry reads as absent."""

    def __init__(self) -> None:
        self.puts: list[tuple[bytes, str, int]] = []

    def get(self, key: bytes) -> tuple[ReplicaState, int] | None:
        return None

    def put(self, key: bytes, replica: ReplicaState, written_ms: int) -> None:
        self.puts.append((key, replica.id, written_ms))


async def test_a_move_reaches_a_worker_that_never_served_the_session_while_its_entry_is_rewritten() -> None:
    fleet = Fleet([ReplicaSpec("r0", "http://127.0.0.1:1"), ReplicaSpec("r1", "http://127.0.0.1:2")], 16, 0)
    sessions, shared = SessionTable(100, 600), TornShared()
    app = internal_app(sessions, shared, VnodeTraffic(), PromptStore(1 << 20, 600), fleet, lambda: None, 600)
    written = int(time.time() * 1000)
    async with TestClient(TestServer(app)) as client:
        payload = {"keys": [b"s1".hex()], "replica": "r1", "reason": "scale_out", "written": written}
        response = await client.post("/move", data=orjson.dumps(payload))
        assert await response.json() == [[b"s1".hex(), written]]
    # its next turn, whichever worker takes it, counts the jump under the move's reason
    assert sessions.get(b"s1") == "r1" and sessions.moved(b"s1") == "scale_out"
    assert sessions.written_ms(b"s1") == written and shared.puts == [(b"s1", "r1", written)]
