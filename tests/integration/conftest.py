"""Fixtures that start emulated replicas in the test's event loop, on free loopback ports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from router.emulator.engine import EngineConfig
from router.emulator.server import Faults, Fleet, Replica, ReplicaOptions

FAST = 100.0  # engine seconds per wall second: a 10 ms step sleeps 0.1 ms


def make_replica(
    name: str = "r0", config: EngineConfig | None = None, faults: Faults | None = None, **options: Any
) -> Replica:
    opts = {"replica_id": name, "port": 0, "time_scale": FAST} | options
    return Replica(ReplicaOptions(**opts), config or EngineConfig(num_blocks=4000), faults)


@pytest.fixture(name="make_replica")
def make_replica_fixture() -> Callable[..., Replica]:
    """An unstarted replica factory, for tests that set faults or engine settings first."""
    return make_replica


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    r = make_replica()
    await r.start()
    yield r
    await r.stop()


@pytest.fixture
async def start_fleet() -> AsyncIterator[Callable[..., Any]]:
    fleets: list[Fleet] = []

    async def start(
        n: int, config: EngineConfig | None = None, control_port: int | None = None, **options: Any
    ) -> Fleet:
        fleet = Fleet([make_replica(f"emu-{i}", config, **options) for i in range(n)], control_port=control_port)
        await fleet.start()
        fleets.append(fleet)
        return fleet

    yield start
    for fleet in fleets:
        await fleet.stop()


@pytest.fixture
async def start_router() -> AsyncIterator[Callable[..., Any]]:
    """Start router-serve's app in this event loop in front of the given replica URLs."""
    from aiohttp import web

    from router.config import load
    from router.proxy.app import Router

    runners: list[web.AppRunner] = []

    async def start(urls: list[str], **settings: Any) -> tuple[Router, str]:
        config = load(None, {}, {"replicas": urls, "state": "none", **settings})
        router = Router(config)
        runner = web.AppRunner(router.app(), handle_signals=False, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return router, f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def sse_upstream() -> AsyncIterator[Callable[..., Any]]:
    """A stand-in replica that answers every chat request with fixed bytes in fixed pieces, and
    records the headers it got; returns (base URL, list of received headers)."""
    from aiohttp import web

    runners: list[web.AppRunner] = []

    async def start(
        chunks: list[bytes],
        delay: float = 0.0,
        headers: dict[str, str] | None = None,
        status: int = 200,
        content_type: str = "text/event-stream",
        hold_open: float = 0.0,
    ) -> tuple[str, list[dict[str, str]]]:
        seen: list[dict[str, str]] = []

        async def handler(request: web.Request) -> web.StreamResponse:
            seen.append(dict(request.headers))
            resp = web.StreamResponse(status=status, headers={"Content-Type": content_type, **(headers or {})})
            await resp.prepare(request)
            for chunk in chunks:
                await resp.write(chunk)
                await asyncio.sleep(delay)
            await asyncio.sleep(hold_open)  # an upstream that keeps the response open after its last bytes
            return resp

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", seen  # type: ignore[union-attr]

    yield start
    for runner in runners:
        await runner.cleanup()
