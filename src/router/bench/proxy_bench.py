"""`router-bench proxy`: what a proxy costs, side by side on the same replica, in one run.

Contenders, each its own process in front of one emulated replica (`router-emulator`, time
scale 1000, so the replica answers at once): direct (no proxy), a bare aiohttp pass-through
(the floor for any aiohttp proxy; it lives here, in the benchmark), `router-serve` with the
affinity policy, the same with `--no-resume-streams` (what keeping streams resumable costs),
and the peer routers that are installed: `sglang-router` (cache_aware), `smg` (the Shepherd Model
Gateway, sglang-router's successor; cache_aware) and `vllm-router` (consistent_hash).

For each: CPU time of the proxy process (user + system, all threads, from /proc) per small
non-streamed request and per forwarded SSE event, and the median time to first token of
unloaded streamed requests over one keep-alive connection. Ratios compare medians of the same
run. The client runs in this process; its CPU is not counted.

The peers are launched here the same way for every benchmark (`PEERS`, `peer_command`; `router-bench
fleet` and `faults` use them too): on loopback (they bind 0.0.0.0 for their API and metrics
unless told otherwise), `HF_ENDPOINT` pointed at a closed loopback port (sglang-router tries to
download a tokenizer from the Hugging Face hub when a worker registers; it only warns). smg is
started as `python -m smg.launch_router`, a module of the smg package: its `smg` console script
has the name of one sglang-router 0.3.2 installs too, so with both installed `smg` runs whichever
package pip installed last (sglang-router's CLI when `.[test]` installs them together), and
uninstalling either removes it. smg is also given `--shutdown-grace-period-secs 0`: it is stopped
only once its requests are done, and otherwise it waits 5 s on every SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from aiohttp import web

from router.bench.common import free_port

SMALL = {"model": "emulated-llm", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
# the peers this benchmark runs when installed, with the policy each runs under (vllm-router's
# cache_aware asks every worker to tokenize every request: consistent_hash is its plain policy)
PEER_POLICIES = (("sglang", "cache_aware"), ("smg", "cache_aware"), ("vllm", "consistent_hash"))


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "proxy",
        help="CPU per request and per SSE event, and added TTFT, of proxies side by side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=2000, help="small requests per contender (default 2000)")
    p.add_argument("--streams", type=int, default=40, help="streamed requests per contender (default 40)")
    p.add_argument("--tokens", type=int, default=200, help="tokens (SSE events) per stream (default 200)")
    p.add_argument("--ttft-samples", type=int, default=200, help="sequential TTFT probes (default 200)")
    p.add_argument("--concurrency", type=int, default=8, help="parallel clients for the CPU runs (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, contenders taking turns; medians reported (3)")
    p.add_argument(
        "--no-peers", action="store_true", help="leave the peer routers (sglang-router, smg, vllm-router) out"
    )
    p.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="NAME=PYTHON",
        help="also router-serve as another installation runs it (e.g. an older checkout's venv: "
        "base=/tmp/old/.venv/bin/python), side by side in the same run; repeatable",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_cli)


# -- the floor: a bare aiohttp pass-through --------------------------------------------------------


def bare_proxy_main(port: int, upstream: str) -> None:
    """The least an aiohttp proxy can do: forward the body, stream the answer back."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        session: aiohttp.ClientSession = request.app["client"]
        async with session.post(upstream + request.path, data=body, headers={"Content-Type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def client_ctx(app: web.Application) -> Any:
        app["client"] = aiohttp.ClientSession()
        yield
        await app["client"].close()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.cleanup_ctx.append(client_ctx)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# -- processes ---------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime, all threads


async def wait_ready(url: str, path: str = "/health", timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + path, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status < 500:
                        return
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up within {timeout:g} s")


def spawn(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=(os.environ | env) if env else None,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End the child's whole process group (its own children too, even after it exited itself)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- the peer routers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """How one peer router is started: `python -m module`, or a console script where it has no module."""

    package: str  # its distribution on PyPI, and its name in tables
    module: str | None = None
    script: str | None = None
    launch_args: tuple[str, ...] = ()  # given at every launch, before the policy's


PEERS = {
    "sglang": Peer("sglang-router", module="sglang_router.launch_router"),
    # smg's own module, never the `smg` script (sglang-router 0.3.2 installs one of that name too);
    # without a grace period of 0 it holds its listener open for 5 s after SIGTERM, idle or not
    "smg": Peer("smg", module="smg.launch_router", launch_args=("--shutdown-grace-period-secs", "0")),
    "vllm": Peer("vllm-router", script="vllm-router"),
}


def _script(name: str) -> str | None:
    beside = Path(sys.executable).parent / name  # this venv's, even when it is not on PATH
    return str(beside) if beside.exists() else shutil.which(name)


def peer_installed(kind: str) -> bool:
    peer = PEERS[kind]
    if peer.module is not None:
        try:
            return importlib.util.find_spec(peer.module) is not None
        except ModuleNotFoundError:  # its package is not installed
            return False
    return peer.script is not None and _script(peer.script) is not None


def peer_command(
    kind: str, port: int, worker_urls: Sequence[str], args: Sequence[str]
) -> tuple[list[str], dict[str, str] | None]:
    """The command line and extra environment of peer `kind` on loopback port `port` (its metrics on
    another free one), in front of `worker_urls`, with its policy `args`."""
    peer = PEERS[kind]
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1"]
    common += ["--prometheus-port", str(free_port()), "--log-level", "error", *peer.launch_args]
    common += ["--worker-urls", *worker_urls]
    if peer.module is not None:
        # a tokenizer download at worker registration stays on loopback and fails (it only warns)
        return [sys.executable, "-m", peer.module, *common, *args], {"HF_ENDPOINT": "http://127.0.0.1:9"}
    assert peer.script is not None
    exe = _script(peer.script)
    if exe is None:
        raise RuntimeError(f"{peer.package} is not installed (pip install '.[bench]')")
    return [exe, *common, *args], None


async def first_answer(url: str, timeout: float = 60.0) -> None:
    """Until a just-started router answers one completion (a peer may answer /health before its
    workers are registered)."""
    body = orjson.dumps(SMALL)
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):
                async with s.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=5),
                ) as r:
                    await r.read()
                    if r.status == 200:
                        return
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} answered no completion within {timeout:g} s")


# -- load --------------------------------------------------------------------------------------------


async def small_requests(url: str, n: int, concurrency: int) -> int:
    ok = 0
    body = orjson.dumps(SMALL)
    async with aiohttp.ClientSession() as s:

        async def worker(count: int) -> None:
            nonlocal ok
            for i in range(count):
                async with s.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json", "X-Session-ID": f"w{i % 50}"},
                ) as r:
                    await r.read()
                    ok += r.status == 200

        await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
    return ok


async def streams(url: str, n: int, tokens: int, concurrency: int) -> int:
    events = 0
    body = orjson.dumps(SMALL | {"max_tokens": tokens, "stream": True})
    async with aiohttp.ClientSession() as s:

        async def worker(count: int) -> None:
            nonlocal events
            for i in range(count):
                async with s.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json", "X-Session-ID": f"s{i}"},
                ) as r:
                    async for line in r.content:
                        events += line.startswith(b"data:")

        await asyncio.gather(*(worker(max(1, n // concurrency)) for _ in range(concurrency)))
    return events


async def ttft_probe(url: str, samples: int) -> list[float]:
    body = orjson.dumps(SMALL | {"max_tokens": 2, "stream": True})
    out = []
    connector = aiohttp.TCPConnector(limit=1)  # one keep-alive connection, reused
    async with aiohttp.ClientSession(connector=connector) as s:
        for i in range(samples + 5):
            t0 = time.perf_counter()
            async with s.post(
                url + "/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json", "X-Session-ID": "ttft"},
            ) as r:
                first = None
                async for line in r.content:
                    if first is None and b'"content":"' in line and b'"content":""' not in line:
                        first = time.perf_counter() - t0
                if i >= 5 and first is not None:  # the first few warm the connections up
                    out.append(first)
    return out


async def measure(
    name: str, url: str, pid: int | None, args: argparse.Namespace, progress: Callable[[str], None]
) -> dict[str, Any]:
    progress(f"{name}: small requests")
    c0 = cpu_seconds(pid) if pid else 0.0
    ok = await small_requests(url, args.requests, args.concurrency)
    c1 = cpu_seconds(pid) if pid else 0.0
    progress(f"{name}: streams")
    events = await streams(url, args.streams, args.tokens, args.concurrency)
    c2 = cpu_seconds(pid) if pid else 0.0
    progress(f"{name}: TTFT")
    ttfts = await ttft_probe(url, args.ttft_samples)
    n_streams = max(1, args.streams // args.concurrency) * args.concurrency
    per_request = (c1 - c0) / max(ok, 1) * 1e6 if pid else None
    return {
        "contender": name,
        "small_ok": ok,
        "cpu_us_per_request": per_request,
        "events": events,
        # stream CPU less what the stream requests themselves cost as small requests
        "cpu_us_per_event": (((c2 - c1) * 1e6 - n_streams * (per_request or 0)) / max(events, 1)) if pid else None,
        "ttft_ms_median": statistics.median(ttfts) * 1000 if ttfts else None,
        "ttft_ms_p90": statistics.quantiles(ttfts, n=10)[8] * 1000 if len(ttfts) >= 10 else None,
    }


async def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        backend_port = free_port()
        procs.append(
            spawn(
                [
                    sys.executable,
                    "-m",
                    "router.emulator.cli",
                    "--port",
                    str(backend_port),
                    "--time-scale",
                    "1000",
                    "--replica-id",
                    "backend",
                ]
            )
        )
        backend = f"http://127.0.0.1:{backend_port}"
        await wait_ready(backend)
        contenders: list[tuple[str, list[str], dict[str, str] | None, str]] = []
        port = free_port()
        contenders.append(
            (
                "bare aiohttp",
                [sys.executable, "-m", "router.bench.proxy_bench", "--bare-proxy", str(port), backend],
                None,
                f"http://127.0.0.1:{port}",
            )
        )
        # router-serve as shipped, and without resuming (what keeping streams resumable costs)
        for name, extra in (
            ("router-serve (affinity)", []),
            ("router-serve (affinity, resume off)", ["--no-resume-streams"]),
        ):
            port = free_port()
            serve = [sys.executable, "-m", "router.proxy.cli", "--port", str(port), "--replica", backend]
            contenders.append((name, [*serve, "--state", "none", *extra], None, f"http://127.0.0.1:{port}"))
        for name, python in args.against_pythons:  # another installation of router-serve, in the same run
            port = free_port()
            serve = [python, "-m", "router.proxy.cli", "--port", str(port), "--replica", backend, "--state", "none"]
            contenders.append((f"router-serve (affinity, {name})", serve, None, f"http://127.0.0.1:{port}"))
        for kind, policy in PEER_POLICIES:
            if args.no_peers or not peer_installed(kind):
                continue
            port = free_port()
            cmd, env = peer_command(kind, port, [backend], ["--policy", policy])
            contenders.append((f"{PEERS[kind].package} ({policy})", cmd, env, f"http://127.0.0.1:{port}"))
        running: list[tuple[str, str, int | None]] = [("direct", backend, None)]
        for name, cmd, env, url in contenders:
            proc = spawn(cmd, env)
            procs.append(proc)
            await wait_ready(url, "/health")
            await first_answer(url)  # its worker registered
            await small_requests(url, 200, 4)  # warm-up
            running.append((name, url, proc.pid))
        # contenders take turns, round after round, so machine noise falls on all of them alike
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in running}
        for k in range(args.rounds):
            for name, url, pid in running:
                rounds[name].append(await measure(f"{name} (round {k + 1})", url, pid, args, progress))
        results = [_median_of(name, rows) for name, rows in rounds.items()]
    finally:
        for proc in procs:
            stop(proc)
    direct = results[0]["ttft_ms_median"]
    for r in results:
        r["ttft_ms_added"] = (r["ttft_ms_median"] - direct) if r["ttft_ms_median"] is not None and direct else None
    return {
        "benchmark": "proxy",
        "rounds": args.rounds,
        "requests": args.requests,
        "streams": args.streams,
        "tokens": args.tokens,
        "concurrency": args.concurrency,
        "machine": f"{os.cpu_count()} CPUs",
        "results": results,
    }


def _median_of(name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"contender": name}
    for field in rows[0]:
        values = [r[field] for r in rows if isinstance(r[field], (int, float))]
        if field != "contender":
            out[field] = statistics.median(values) if values else None
    return out


def render(result: dict[str, Any]) -> str:
    def f(x: float | None, digits: int = 1) -> str:
        return "—" if x is None else f"{x:,.{digits}f}"

    lines = [
        f"proxy cost, median of {result['rounds']} rounds: {result['requests']} small requests, {result['streams']} "
        f"streams of {result['tokens']} tokens, {result['concurrency']} clients; TTFT: sequential, one keep-alive "
        "connection",
        "",
        "| contender | CPU µs / request | CPU µs / SSE event | TTFT median (ms) | TTFT p90 (ms) | TTFT added (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['contender']} | {f(r['cpu_us_per_request'], 0)} | {f(r['cpu_us_per_event'], 1)} "
            f"| {f(r['ttft_ms_median'], 3)} | {f(r['ttft_ms_p90'], 3)} | {f(r['ttft_ms_added'], 3)} |"
        )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    for name in ("requests", "streams", "tokens", "ttft_samples", "concurrency", "rounds"):
        if getattr(args, name) < 1:
            print(f"router-bench proxy: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    args.against_pythons = []
    for entry in args.against:
        name, sep, python = entry.partition("=")
        if not (sep and name and os.access(python, os.X_OK)):
            print(f"router-bench proxy: --against {entry!r} is not NAME=PATH of a Python executable", file=sys.stderr)
            return 2
        args.against_pythons.append((name, python))
    if not os.path.exists("/proc/self/stat"):
        print("router-bench proxy: needs Linux /proc to read process CPU time", file=sys.stderr)
        return 2
    live = not args.json and sys.stderr.isatty()

    def progress(msg: str) -> None:
        if live:
            print(f"\r\x1b[K  {msg} ...", end="", file=sys.stderr, flush=True)

    result = uvloop.run(run(args, progress))
    if live:
        print("\r\x1b[K", end="", file=sys.stderr)
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--bare-proxy":
        bare_proxy_main(int(sys.argv[2]), sys.argv[3])
    else:
        print("usage: python -m router.bench.proxy_bench --bare-proxy PORT UPSTREAM_URL", file=sys.stderr)
        sys.exit(2)
