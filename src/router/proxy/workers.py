"""`router-serve --workers N`: N proxy processes on one port, one control process behind them.

The process that runs `router-serve` becomes the control process. It creates the shared-memory
segment (router.shm), probes and scores replicas, owns membership (the admin API's replica
routes reach it over a Unix socket in a private directory) and publishes the replica table
(router.state.replica_table). It then starts N worker processes (spawned, not forked: each starts clean),
each listening on the same host and port with SO_REUSEPORT, so the kernel spreads connections
over them. Workers follow the table and publish their counters; metrics from all of them are
merged by prometheus_client's multiprocess mode, so any worker's /metrics shows the whole router.
A worker that dies is restarted; workers stop when the control process does, or goes away.

It is past 450 lines as one room: the worker processes, the control process that starts and watches
them and the shutdown they share are one lifecycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import socket
import ssl
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import aiohttp
from aiohttp import web, web_urldispatcher
from aiohttp.http_exceptions import BadHttpMessage
from prometheus_client import multiprocess, values

from router._runtime import run, settle, stop_event, until_stopped
from router.apis import PROXIED
from router.balance.link import WorkerLink, worker_socket
from router.config import RouterConfig
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.node import Node
from router.proxy.app import admin_app, build_app
from router.proxy.followers import Followers
from router.proxy.front import PROXY
from router.proxy.front_server import FrontRunner
from router.proxy.intake import Refused, peer_subject, too_large, unread_bodies, who
from router.shm.layout import COUNTER_CELL
from router.shm.table import SlotTable
from router.web import error_response

log = logging.getLogger("router.workers")
START_TIMEOUT_S = 60.0
RESTART_BACKOFF_S = 1.0
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"


class CannotListen(RouterError, OSError):
    """An address the router was told to listen on is taken or not ours; says which."""

    def __init__(self, host: str, port: int, exc: OSError) -> None:
        # asyncio wraps bind errors in a long message of its own; a lookup error (negative errno) has its text
        reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else (exc.strerror or str(exc))
        super().__init__(f"cannot listen on {host}:{port}: {reason}")


async def listen(
    runner: web.AppRunner, host: str, port: int, reuse_port: bool = False, ssl_context: ssl.SSLContext | None = None
) -> None:
    """Serve `runner` on host:port (HTTPS with `ssl_context`); CannotListen names the address if that fails."""
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port, ssl_context=ssl_context)
        await site.start()
    except OSError as exc:
        raise CannotListen(host, port, exc) from None


HANDOVER_S = 1.0  # on stop, how long keep-alive connections may still bring a last request
CLOSING: web.AppKey[list[bool]] = web.AppKey("closing", list)  # [True] once the process stops


async def _close_after_answer(request: web.Request, response: web.StreamResponse) -> None:
    if request.app[CLOSING]:
        # the headers are made by now: say it, and close after it; the client's next request goes elsewhere
        response.headers["Connection"] = "close"
        response.force_close()


class _ClientsMalformedRequests(logging.Filter):
    """aiohttp logs a traceback at ERROR for every request its parser refuses (a malformed target,
    `GET *`): the client's fault, answered with a 400, and a way for anyone to flood the log. Dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], BadHttpMessage))


MALFORMED = _ClientsMalformedRequests()


async def _expect_unrouted(request: web.Request) -> web.StreamResponse | None:
    """The Expect handler of a request no route takes (aiohttp answers it 404 or 405 itself: a
    CONNECT's target matches no path): as aiohttp's own, except that any value but `100-continue`
    gets a JSON 417, not aiohttp's text echoing the value (a byte that is not UTF-8 there made it
    a 500 and a traceback)."""
    if request.version != aiohttp.HttpVersion11:
        return None
    if request.headers.get("Expect", "").lower() != "100-continue":
        return error_response("the request's Expect header is not 100-continue", 417, "expectation_failed")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return None


# (aiohttp makes the route of an unrouted request per request, with its module's default handler)
setattr(web_urldispatcher, "_default_expect_handler", _expect_unrouted)  # noqa: B010


def _expect_everywhere(app: web.Application, config: RouterConfig) -> None:
    """Every route's Expect handler (aiohttp takes one per route, as it is added) answers as
    aiohttp's own does, except: any value but `100-continue` gets a JSON 417 (aiohttp's echoes the
    value into its text, and a byte that is not UTF-8 there made it a 500 and a traceback); and a
    proxied request that will be refused from its head (no valid key, two credentials, a length
    over `max_body_bytes`) gets its refusal instead of `100 Continue`, so its body is never sent."""
    proxy = app.get(PROXY)

    async def expect(request: web.Request) -> web.StreamResponse | None:
        if request.version != aiohttp.HttpVersion11:
            return None
        if request.headers.get("Expect", "").lower() != "100-continue":
            message = "the request's Expect header is not 100-continue"
            return error_response(message, 417, "expectation_failed", path=request.path)
        if proxy is not None and request.method == "POST" and request.path in PROXIED:
            refused: Refused | None = None
            if proxy.clients is not None:
                found = who(proxy.clients, request.headers, peer_subject(request))
                refused = found if isinstance(found, Refused) else None
            length = request.content_length
            if refused is None and length is not None and length > config.max_body_bytes:
                refused = too_large(config.proxying)
            if refused is not None:
                answer = error_response(refused.message, refused.status, refused.code, path=request.path)
                answer.force_close()
                return answer
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (the answer's own size starts after it)
        return None

    for route in app.router.routes():
        if isinstance(route, web.ResourceRoute):
            route._expect_handler = expect  # (no public setter once a route is added)


def runner_for(app: web.Application, config: RouterConfig) -> web.AppRunner:
    """The aiohttp runner of a proxying process (a lone router or a worker), its proxied endpoints on
    the front (router.proxy.front); stop it with `stop_serving`."""
    field_size = max(config.max_header_bytes + 1024, 8190)
    logging.getLogger("aiohttp.server").addFilter(MALFORMED)  # (once: a filter is added at most once)
    _expect_everywhere(app, config)
    app[CLOSING] = []
    app.on_response_prepare.append(_close_after_answer)
    app.middlewares.append(unread_bodies)
    return FrontRunner(
        app,
        config,
        lambda: bool(app[CLOSING]),
        handle_signals=False,
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=config.drain_timeout_s,  # on stop, requests in flight get this long to finish
        # an idle keep-alive connection is closed after this, and so is one that has not sent a whole
        # request's headers within it (slow clients, slowloris); aiohttp's own default is an hour
        keepalive_timeout=config.keepalive_timeout_s,
        # after an early answer (413, 408) the rest of the body is read and dropped for this long, so
        # the client sees the answer rather than a reset; a slow client gets no longer than usual
        lingering_time=min(config.client_timeout_s, 10.0),
        # one header line may be as long as the whole block may be, so that the router's own check
        # answers an OpenAI-shaped 431; the line count keeps what the parser buffers per connection
        # near 2 MiB (about aiohttp's own default; a count over it gets the parser's plain 400)
        max_field_size=field_size,
        max_line_size=field_size,
        max_headers=max(128, (2 << 20) // field_size),
    )


async def stop_serving(runner: web.AppRunner, handover_s: float = HANDOVER_S) -> float:
    """Stop serving: no new connections; for `handover_s` (less once none is left) an open
    keep-alive connection may still bring a request, answered with `Connection: close`; then what
    is in flight gets `drain_timeout_s` to finish and the rest is closed. A keep-alive connection
    closed while idle can meet a request already on its way (the client sees a disconnect, not
    an answer); handed over, a busy client's connection closes after an answer instead (one
    with an answer under way when the stop came takes its next request in the handover). Returns
    when (monotonic) the drain of what is in flight began."""
    for site in list(runner.sites):
        await site.stop()  # the listening sockets: new connections are refused from here on
    server = runner.server
    if server is not None and runner.app is not None and handover_s > 0:
        runner.app[CLOSING].append(True)
        deadline = time.monotonic() + handover_s
        while server.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    drain = time.monotonic()
    await runner.cleanup()
    return drain


class Shutdown:
    """What a stopping router says on stdout: the signal and that draining began, with what was in
    flight (and held by the overload queue); then, once it ended, how long it took and whether the
    drain limit cut requests off."""

    def __init__(self, signal: str, node: Node, workers: int = 0) -> None:
        self.node = node
        self.limit_s = node.config.drain_timeout_s
        self.began = time.monotonic()
        inflight, held = self.in_flight()
        self.seen = [(self.began, inflight + held)]  # (when, requests not done), while it drains
        where = f"{workers} worker processes" if workers else "the router"
        print(
            f"router-serve: {signal or 'stop'} received: draining {where}: no new connections; "
            f"{_count(inflight, 'request')} in flight to replicas"
            + (f", {held} held waiting for room" if held else "")  # (a worker's queue is its own)
            + f"; they have up to {self.limit_s:g} s (drain_timeout_s)",
            flush=True,
        )
        self._watch = asyncio.create_task(self._follow(), name="drain watch")

    def in_flight(self) -> tuple[int, int]:
        """(requests in flight to replicas, requests held by this process's overload queue)."""
        node = self.node
        node.gather()  # a control process: the workers' counts, as they last wrote them
        return sum(r.inflight for r in node.fleet.replicas), node.admission.queued

    async def _follow(self) -> None:
        while True:  # what is still not done, for the count cut off at the limit
            await asyncio.sleep(0.05)
            self.seen.append((time.monotonic(), sum(self.in_flight())))

    async def ended(self, drain_began: float | None = None) -> None:
        """`drain_began`: when the limit's clock started (after the hand-over); else the signal."""
        self._watch.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # the line below is said whatever
            await self._watch
        now = time.monotonic()
        limit_at = (drain_began or self.began) + self.limit_s
        # what was still not done just before the limit closed it (cancelled, it counts as gone)
        left = next((n for t, n in reversed(self.seen) if t < limit_at - 0.06), 0) if now >= limit_at else 0
        if left:
            outcome = f"the drain limit was reached: {_count(left, 'request')} still in flight, cut off"
        else:
            outcome = "every request in flight finished"
        took = now - self.began
        print(f"router-serve: stopped after {took:.1f} s: {outcome}", flush=True)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


# -- a worker process ------------------------------------------------------------------------------


def worker_main(config: RouterConfig, shm_name: str, control_socket: str, index: int, ready: Connection) -> None:
    """Entry point of a spawned worker: serve until SIGINT/SIGTERM or until the control process goes."""
    if config.log_requests:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        run(_worker(config, shm_name, control_socket, index, ready))


async def _worker(config: RouterConfig, shm_name: str, control_socket: str, index: int, ready: Connection) -> None:
    parent = os.getppid()
    try:
        table = SlotTable.attach(shm_name)
    except (OSError, ValueError) as exc:
        ready.send(f"cannot attach shared memory {shm_name!r}: {exc}")
        return
    runner = None
    runners: list[web.AppRunner] = []
    try:
        node = Node(config, table=table, worker=index, control_socket=control_socket)
        runner = runner_for(build_app(node), config)
        await runner.setup()
        sites = [(runner, config.host, config.port)]
        if config.admin_port:
            admin = runner_for(admin_app(node), config)
            await admin.setup()
            runners.append(admin)
            sites.append((admin, config.admin_host, config.admin_port))
        context = node.tls.context if node.tls is not None else None
        for serving, host, port in sites:
            try:
                await listen(serving, host, port, reuse_port=True, ssl_context=context)
            except CannotListen as exc:
                ready.send(str(exc))
                return
        settle()
        ready.send(None)
        ready.close()
        stop = asyncio.create_task(until_stopped())
        while not stop.done():  # also stop if the control process went away without telling us
            await asyncio.wait([stop], timeout=1.0)
            if os.getppid() != parent:
                break
        stop.cancel()
    finally:
        try:
            for other in runners:
                with contextlib.suppress(Exception):  # the proxy's own runner is cleaned up whatever happens
                    await other.cleanup()
            if runner is not None:
                await stop_serving(runner, min(HANDOVER_S, config.drain_timeout_s))
        finally:
            table.close()


# -- the control process ---------------------------------------------------------------------------


class WorkerFailed(RouterError, RuntimeError):
    """A worker process did not start: it exited, was not ready in time, or said why; str() names the worker."""


class WorkerPool:
    def __init__(
        self,
        config: RouterConfig,
        table: SlotTable,
        control_socket: str,
        metrics_dir: str,
        on_restart: Callable[[int], None] = lambda worker: None,
    ) -> None:
        self.config = config
        self.on_restart = on_restart
        self.table = table
        self.control_socket = control_socket
        self.metrics_dir = metrics_dir
        self.ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess | None] = [None] * config.workers
        self.stopping = False
        # the workers' config: same settings, but replicas come from the table and the demo is ours
        self.worker_config = dataclasses.replace(config, demo=0)

    def _spawn(self, index: int) -> tuple[BaseProcess, Connection]:
        receive, send = self.ctx.Pipe(duplex=False)
        previous = os.environ.get(METRICS_ENV)
        os.environ[METRICS_ENV] = self.metrics_dir  # read by prometheus_client when the worker imports it
        try:
            proc = self.ctx.Process(
                target=worker_main,
                args=(self.worker_config, self.table.name, self.control_socket, index, send),
                name=f"router-serve worker {index}",
            )
            proc.start()
        finally:
            if previous is None:
                del os.environ[METRICS_ENV]
            else:
                os.environ[METRICS_ENV] = previous
        send.close()
        return proc, receive

    @staticmethod
    def _wait_ready(receive: Connection) -> str | None:
        try:
            if not receive.poll(START_TIMEOUT_S):
                return f"not ready after {START_TIMEOUT_S:.0f} s"
            message: str | None = receive.recv()
            return message
        except (EOFError, OSError):
            return "exited while starting"
        finally:
            receive.close()

    async def start(self, index: int) -> None:
        proc, receive = self._spawn(index)
        self.procs[index] = proc
        problem = await asyncio.get_running_loop().run_in_executor(None, self._wait_ready, receive)
        if problem is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            raise WorkerFailed(f"worker {index}: {problem}")

    async def start_all(self) -> None:
        await asyncio.gather(*(self.start(i) for i in range(len(self.procs))))

    def _bury(self, index: int, proc: BaseProcess) -> None:
        """A worker is gone: its in-flight counts are void, its live gauges go."""
        row = self.table.counters(index)
        for cell in range(self.table.slots):
            row[cell * COUNTER_CELL] = 0
        assert proc.pid is not None
        multiprocess.mark_process_dead(proc.pid, self.metrics_dir)  # type: ignore[no-untyped-call]
        self.on_restart(index)

    async def watch(self) -> None:
        """Restart workers that die (at most one start per worker per RESTART_BACKOFF_S)."""
        last_start = [time.monotonic()] * len(self.procs)
        while not self.stopping:
            await asyncio.sleep(0.2)
            for i, proc in enumerate(self.procs):
                if self.stopping or proc is None or proc.is_alive():
                    continue
                if time.monotonic() - last_start[i] < RESTART_BACKOFF_S:
                    continue
                print(f"router-serve: worker {i} (pid {proc.pid}) exited ({proc.exitcode}); restarting", flush=True)
                self._bury(i, proc)
                last_start[i] = time.monotonic()
                try:
                    await self.start(i)
                except WorkerFailed as exc:
                    print(f"router-serve: {exc}; trying again", flush=True)

    async def stop(self) -> None:
        self.stopping = True
        procs = [p for p in self.procs if p is not None]
        for proc in procs:
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    proc.terminate()  # SIGTERM: the worker finishes its requests and exits
        loop = asyncio.get_running_loop()
        for proc in procs:  # a worker waits drain_timeout_s for its requests; a little more for itself
            await loop.run_in_executor(None, proc.join, self.config.drain_timeout_s + 10)
            if proc.is_alive():
                proc.kill()
                await loop.run_in_executor(None, proc.join, 5)


def check_port(host: str, port: int) -> None:
    """Fail early, in the control process, if anything listens on the port already (another
    router's workers included: the probe does not join a SO_REUSEPORT group)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise CannotListen(host, port, exc) from None


async def share_models(node: Node, link: WorkerLink, interval_s: float) -> None:
    """Every probe interval, the models and loaded adapters the control process's probes read, to
    every worker (each routes by them): always the whole list, so a worker that restarted has it within one interval.
    The workers answer with the requests they hold, which the scale signal counts."""
    held = 0
    node.balancer.held = lambda: held
    while True:
        await asyncio.sleep(interval_s)
        replicas = node.fleet.replicas
        listing = {r.id: sorted(r.models) if r.models is not None else None for r in replicas}
        adapters = {r.id: [sorted(r.adapters) if r.adapters is not None else None, r.max_lora] for r in replicas}
        try:
            held = await link.models(listing, adapters)
        except Exception:  # a bug here must not stop the sharing for good
            log.exception("sharing the replicas' models with the workers failed")


async def serve_workers(config: RouterConfig, banner: str) -> None:
    stop = stop_event()  # from here on a SIGTERM is a clean stop, also while workers start
    check_port(config.host, config.port)
    if config.admin_port:
        check_port(config.admin_host, config.admin_port)
    # each worker's session table holds all of sticky_max_sessions (a power of two): connections,
    # and so sessions, need not spread evenly over the workers
    sticky = min(max(1 << (config.sticky_max_sessions - 1).bit_length(), 1024), 1 << 22)
    table = SlotTable.create(
        config.shm_name or f"kvar-{os.getpid()}", config.shm_slots, config.workers, sticky_entries=sticky
    )
    private = tempfile.mkdtemp(prefix="router-serve-")  # mode 0700: the control socket is ours alone
    try:
        metrics_dir = os.path.join(private, "metrics")
        os.mkdir(metrics_dir)
        control_socket = os.path.join(private, "control.sock")
        # the control process's own metrics (moves, warm-ups, migrations, scale signals) go to the
        # multiprocess files too, so any worker's /metrics shows them (and only the router's: a
        # demo fleet's emulators in this process keep theirs in memory)
        os.environ[METRICS_ENV] = metrics_dir
        files = RouterMetrics(values.MultiProcessValue())  # type: ignore[no-untyped-call]
        node = Node(config, table=table, metrics=files)
        link = WorkerLink([worker_socket(control_socket, i) for i in range(config.workers)])
        node.view.attach(link, ready=False)  # ready once the workers have started
        node.publish()
        node.prefill_shared_sessions(table)  # restored sessions route right from the first request
        pool = WorkerPool(config, table, control_socket, metrics_dir, on_restart=node.worker_restarted)
        # the processes that follow a shard of the engines' KV events each, beside this one (router.proxy.followers)
        followers = (
            Followers(config, table, node.feed.budget, metrics_dir)
            if node.feed is not None and node.shared_index is not None and config.placement.kv_event_followers > 1
            else None
        )
        if followers is None and config.placement.kv_event_followers > 1:
            banner += (
                "\nkv_event_followers: none started (no shared index: not the ttft policy, kv_events off, "
                "or no room in /dev/shm)"
            )
        runner = web.AppRunner(build_app(node, control_only=True), handle_signals=False, access_log=None)
        await runner.setup()
        try:
            await web.UnixSite(runner, control_socket).start()
            watcher = sharing = following = None
            shutdown: Shutdown | None = None
            try:
                if followers is not None:
                    for problem in await followers.start_all():
                        print(f"router-serve: {problem}; tried again (its replicas priced by the model)", flush=True)
                    pids = ", ".join(str(followers.procs[k].pid) for k in sorted(followers.procs))
                    print(f"kv events: {followers.shards} followers (this process and pids {pids})", flush=True)
                    following = asyncio.create_task(followers.watch())
                await pool.start_all()
                node.view.ready.set()  # the balance loop can ask the workers now
                print(banner, flush=True)
                print(node.state_line(), flush=True)
                print(
                    f"workers: {config.workers} processes (pids {', '.join(str(p.pid) for p in pool.procs if p)}); "
                    f"shared memory: {table.name} (router-agent --shm {table.name})",
                    flush=True,
                )
                watcher = asyncio.create_task(pool.watch())
                sharing = asyncio.create_task(share_models(node, link, config.probe_interval_s))
                shutdown = Shutdown(await until_stopped(stop), node, config.workers)
            finally:
                with contextlib.suppress(OSError):  # the workers' sessions, while they can still tell
                    await node.save_state(force=True)
                node.view.ready.clear()  # from here on, saves keep the sessions saved above
                stopping = time.monotonic()  # the workers get their SIGTERM now; their drains follow the hand-over
                try:
                    await pool.stop()
                    if followers is not None:
                        await followers.stop()
                finally:
                    if shutdown is not None:
                        await shutdown.ended(stopping + min(HANDOVER_S, config.drain_timeout_s))
                for task in (watcher, sharing, following):
                    if task is not None:
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
        finally:
            await runner.cleanup()
            await link.close()
    finally:
        table.close()
        shutil.rmtree(private, ignore_errors=True)
