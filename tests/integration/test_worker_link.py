"""The control process's line to its workers: answers merged, a silent worker stood in for."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from router.balance.view import LinkDown
from router.proxy.internal import WorkerLink


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
        assert {k for k, *_ in await link.live("r1")} == {b"k1", b"k2"}  # per replica: no stand-in
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


async def test_no_answer_ever_is_link_down(tmp_path: Path) -> None:
    link = WorkerLink([str(tmp_path / "none.sock")], timeout_s=0.5)
    try:
        with pytest.raises(LinkDown):
            await link.live()
        assert await link.traffic() == {}
    finally:
        await link.close()
