"""Fixtures that start emulated replicas in the test's event loop, on free loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import psutil
import pytest
from aiohttp import web

from router.bench.common import free_port
from router.bench.faults import RedisServer
from router.config import load
from router.emulator.engine import EngineConfig
from router.emulator.server import Faults, Fleet, Replica, ReplicaOptions
from router.node import Node
from router.proxy.app import build_app
from router.proxy.front_server import FrontRunner
from router.proxy.workers import runner_for

WORKERS_TOKEN = "workers-test-token"  # the admin token of the routers `serve_workers` starts
FAST = 100.0  # engine seconds per wall second: a 10 ms step sleeps 0.1 ms


LEFT_RUNNING: list[str] = []  # processes a module's tests left running, for the session's summary


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After a module's last test (its fixtures torn down with it), no process it started may still
    run: an engine left behind would load this machine's two cores for every module after it, and
    their timing-sensitive tests fail for it. Those found are ended (they are this process's
    children) and named in the session's summary."""
    yield
    if nextitem is not None and nextitem.module is item.module:
        return
    mine = [p for p in psutil.Process().children(recursive=True) if not _shared_helper(p)]
    _, alive = psutil.wait_procs(mine, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            LEFT_RUNNING.append(f"{item.module.__name__}: pid {p.pid} {' '.join(p.cmdline())[:200]}")
            p.kill()


def _shared_helper(p: psutil.Process) -> bool:
    """multiprocessing's resource tracker (or fork server) lives as long as the session, by design."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE or "multiprocessing" in " ".join(p.cmdline())
    except psutil.Error:
        return True


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if LEFT_RUNNING:
        terminalreporter.section("processes the tests left running (ended after their module)")
        for line in LEFT_RUNNING:
            terminalreporter.write_line(line)


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
async def redis_server() -> AsyncIterator[RedisServer]:
    """A real redis-server on a free loopback port, for the tests of routers sharing state."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    server = RedisServer(binary)
    await server.start()
    yield server
    await server.stop()


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
    """Start router-serve's app in this event loop in front of the given replica URLs, its proxied
    endpoints on the front as router-serve serves them (unless `front=False` is among the settings)."""
    runners: list[web.AppRunner] = []

    async def start(urls: list[str], **settings: Any) -> tuple[Node, str]:
        config = load(None, {}, {"replicas": urls, "state": "none", **settings})
        router = Node(config)
        runner = FrontRunner(
            build_app(router), config, lambda: False, handle_signals=False, access_log=None, handler_cancellation=True
        )
        await runner.setup()
        tls = router.tls.context if router.tls is not None else None  # (tls_cert_file: HTTPS, as router-serve)
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return router, f"{'https' if tls else 'http'}://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def sse_upstream() -> AsyncIterator[Callable[..., Any]]:
    """A stand-in replica that answers every chat request with fixed bytes in fixed pieces, and
    records the headers it got; returns (base URL, list of received headers)."""
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
        return await serve_on_loopback(app, runners), seen

    yield start
    for runner in runners:
        await runner.cleanup()


async def serve_on_loopback(app: web.Application, runners: list[web.AppRunner]) -> str:
    """Serve `app` on a free loopback port (its runner joins `runners`, to clean up); its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    runners.append(runner)
    return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


@pytest.fixture
async def serve_app() -> AsyncIterator[Callable[[web.Application], Any]]:
    """Serve stand-in apps on free loopback ports for one test; each call returns its base URL."""
    runners: list[web.AppRunner] = []

    async def serve(app: web.Application) -> str:
        return await serve_on_loopback(app, runners)

    yield serve
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def serve_node() -> AsyncIterator[Callable[[Node], Any]]:
    """Serve router nodes on free loopback ports for one test, each as router-serve serves it
    (`runner_for`: its parser limits, slow-client time-outs, early refusals); a call returns its port."""
    runners: list[web.AppRunner] = []

    async def serve(node: Node) -> int:
        runner = runner_for(build_app(node), node.config)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    yield serve
    for runner in runners:
        await runner.cleanup()


class Served:
    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc = proc
        self.url = url
        self.lines: queue.Queue[str] = queue.Queue()
        self.pids: list[int] = []
        self.shm = ""
        assert proc.stdout is not None
        stdout = proc.stdout
        self.history: list[str] = []  # every line so far, also those `line` went past

        def read() -> None:
            for line in stdout:
                self.history.append(line)
                self.lines.put(line)

        threading.Thread(target=read, daemon=True).start()

    def said(self, pattern: str, timeout: float = 30) -> re.Match[str]:
        """A line matching `pattern` that it said already (before its start-up banner too, which
        starting it read past) or says within `timeout` seconds."""
        for said in list(self.history):
            found = re.search(pattern, said)
            if found:
                return found
        return self.line(pattern, timeout)

    def line(self, pattern: str, timeout: float = 30) -> re.Match[str]:
        """The next line of its output that matches `pattern`; not within `timeout` seconds, an
        assertion that shows the pattern and the last lines it said."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                said = "".join(self.history[-40:])
                raise AssertionError(f"no line matched {pattern!r} in {timeout} s; the last it said:\n{said}") from None
            found = re.search(pattern, line)
            if found:
                return found


@pytest.fixture
async def serve_workers() -> AsyncIterator[Callable[..., Any]]:
    started: list[Served] = []

    async def start(
        replicas: list[str], *flags: str, port: int | None = None, wrap: tuple[str, ...] = (), errors: bool = False
    ) -> Served:
        """`router-serve --workers 2` in a child process; `--state none` unless flags say otherwise;
        run by `wrap` (a command that ends by running its arguments) if given; with `errors`, its
        standard error (its log) read with its output."""
        port = port or free_port()
        args = [*wrap, sys.executable, "-m", "router.proxy.cli", "--workers", "2", "--port", str(port)]
        if "--state" not in flags:
            args += ["--state", "none"]
        for r in replicas:
            args += ["--replica", r]
        proc = subprocess.Popen(
            [*args, "--admin-token", WORKERS_TOKEN, *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if errors else None,
            text=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1"},
        )
        served = Served(proc, f"http://127.0.0.1:{port}")
        started.append(served)
        # the event loop must keep serving the in-process replicas while the router starts
        banner = r"workers: 2 processes \(pids (\d+), (\d+)\); shared memory: (\S+)"
        match = await asyncio.to_thread(served.line, banner)
        served.pids = [int(match[1]), int(match[2])]
        served.shm = match[3]
        return served

    yield start
    for served in started:
        if served.proc.poll() is None:
            served.proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(served.proc.wait, 20)
