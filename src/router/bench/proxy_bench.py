"""`router-bench proxy`: what a proxy costs, side by side on the same replica, in one run.

Contenders, each its own process in front of one emulated replica (`router-emulator`, time
scale 1000, so the replica answers at once): direct (no proxy); two floors that live here, in
the benchmark: a bare aiohttp pass-through (the least any aiohttp proxy costs) and a uvloop +
httptools one (router.bench.lean: the least the front can cost); `router-serve` as shipped
(policy ttft, the front on), with `--no-resume-streams`, with that and `--no-inject-usage` too
(what keeping streams resumable and asking for usage cost), and with `--no-front` (aiohttp's
server for every path); and the peer routers that are installed: `sglang-router` (cache_aware),
`smg` (the Shepherd Model Gateway, sglang-router's successor; cache_aware) and `vllm-router`
(consistent_hash).

For each: CPU time of the proxy process (user + system, all threads, from /proc) per small
non-streamed request at each `--concurrency` level of parallel clients and per forwarded SSE
event, and the median time to first token of unloaded streamed requests over one keep-alive
connection. Ratios compare medians of the same run. The client runs in this process; its CPU is
not counted.

Saturation (`--saturate-s`, on a machine of 2 CPUs or more): each contender again, alone and
pinned to one CPU (all its threads: a Rust router's runtime sees one core), in front of a canned
replica (router.bench.lean) that this process and the replica share the other CPU with;
`--saturate-connections` keep-alive clients send small requests back to back on raw connections;
requests per second and the P50/P99 latency the clients saw.

`--shared-fleet` measures instead what a fleet shared by many clients costs: `router-serve`
plain, then with client keys (every request brings one), with a token budget for its tenant
(reserved and settled per request, never reached), and with traces too (every request traced,
then 1 in 100, exported over OTLP/HTTP to a sink in a process of its own), side by side in the
same rounds; every contender gets the same requests, key included.

`--tls` measures what HTTPS costs: `router-serve` over plain HTTP against the same with
`tls_cert_file` (a self-signed certificate the `openssl` command makes for the run, ECDSA P-256),
side by side in the same rounds: CPU per request on keep-alive connections as above, and on a new
connection per request (`cpu_us_per_request_new_connection`, 8 clients: the handshake's cost).

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

# It is past 450 lines as one benchmark: its contenders (the peers, the lean floors, TLS and
# shared-fleet variants), how each is started and measured, and the report; the docstring above is
# `router-bench proxy --help`.

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from aiohttp import web

from router.bench import lean
from router.bench.common import free_port
from router.bench.live import PROGRESS_ENV, Stop, Stopped, partial_headline, run_until
from router.measures import percentile

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
    p.add_argument(
        "--concurrency",
        default="1,8,64",
        help="comma-separated numbers of parallel clients, CPU per small request measured at each (default 1,8,64)",
    )
    p.add_argument(
        "--saturate-s", type=float, default=5.0, help="seconds of saturation per contender, pinned to one CPU (0: skip)"
    )
    p.add_argument("--saturate-connections", type=int, default=64, help="keep-alive clients at saturation (default 64)")
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
    p.add_argument(
        "--shared-fleet",
        action="store_true",
        help="router-serve with client keys, token budgets and traces on against off, instead of the peers",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="router-serve over HTTPS against plain HTTP (keep-alive, and a new connection per request)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_cli)


# the client's trust in --tls's self-signed certificate (None: plain HTTP, or the system's CAs)
TRUSTED: list[ssl.SSLContext] = []


def _connector(**options: Any) -> aiohttp.TCPConnector:
    return aiohttp.TCPConnector(ssl=TRUSTED[0] if TRUSTED else True, **options)


def tls_files(folder: Path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (the `openssl` command makes them)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    TRUSTED[:] = [ssl.create_default_context(cafile=str(cert))]
    return str(cert), str(key)


def tls_contenders(backend: str, folder: Path) -> list[tuple[str, list[str], dict[str, str] | None, str]]:
    """router-serve over plain HTTP, and over HTTPS."""
    cert, key = tls_files(folder)
    out: list[tuple[str, list[str], dict[str, str] | None, str]] = []
    for name, extra, scheme in (
        ("router-serve, HTTP", [], "http"),
        ("router-serve, HTTPS", ["--tls-cert-file", cert, "--tls-key-file", key], "https"),
    ):
        port = free_port()
        serve = [sys.executable, "-m", "router.proxy.cli", "--port", str(port), "--replica", backend, "--state", "none"]
        out.append((name, [*serve, *extra], None, f"{scheme}://127.0.0.1:{port}"))
    return out


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


def otlp_sink_main(port: int) -> None:
    """Where the traced contenders export: takes every OTLP/HTTP export and keeps nothing (an
    empty body is an empty ExportTraceServiceResponse)."""

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")  # (wait_ready)

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/health", health)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# -- a shared fleet: keys, budgets, traces -----------------------------------------------------------

BENCH_KEY = "sk-bench"


def shared_fleet_files(folder: Path) -> Path:
    """A keys file with the benchmark's key, and a budget for its tenant that it never reaches."""
    digest = hashlib.sha256(BENCH_KEY.encode()).hexdigest()
    keys = folder / "keys.toml"
    keys.write_text(f'[[keys]]\nid = "bench"\ntenant = "bench"\nsha256 = "{digest}"\n')
    budget = folder / "keys-budget.toml"
    budget.write_text(keys.read_text() + '[[tenants]]\nname = "bench"\ntokens_per_minute = 1000000000\n')
    return folder


def shared_fleet_contenders(
    backend: str, folder: Path, sink: str
) -> list[tuple[str, list[str], dict[str, str] | None, str]]:
    """router-serve plain, with keys, with keys and a budget, and with traces too (all, then 1 %)."""
    keyed = ["--client-keys-file", str(folder / "keys.toml"), "--admin-token", "bench-admin-token"]
    budget = ["--client-keys-file", str(folder / "keys-budget.toml"), "--admin-token", "bench-admin-token"]
    traced = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink}
    sampled = traced | {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
    out = []
    for name, extra, env in (
        ("router-serve", [], None),
        ("router-serve, client keys", keyed, None),
        ("router-serve, keys + budgets", budget, None),
        ("router-serve, keys + budgets + traces (all)", budget, traced),
        ("router-serve, keys + budgets + traces (1 %)", budget, sampled),
    ):
        port = free_port()
        serve = [sys.executable, "-m", "router.proxy.cli", "--port", str(port), "--replica", backend, "--state", "none"]
        out.append((name, [*serve, *extra], {**os.environ, **env} if env else None, f"http://127.0.0.1:{port}"))
    return out


# -- processes ---------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime, all threads


async def wait_ready(url: str, path: str = "/health", timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(connector=_connector()) as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + path, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status < 500:
                        return
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up within {timeout:g} s")


def spawn(cmd: list[str], env: dict[str, str] | None = None, cpus: set[int] | None = None) -> subprocess.Popen[bytes]:
    """`cmd` in a session of its own; pinned to `cpus` from its start, so every thread it makes is too."""
    return subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=(os.environ | env) if env else None,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
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


def role_flags(prefill: Sequence[str], decode: Sequence[str]) -> list[str]:
    """`--prefill URL ... --decode URL ...`: how router-serve and the peers' PD modes are given roles."""
    return [a for url in prefill for a in ("--prefill", url)] + [a for url in decode for a in ("--decode", url)]


def peer_command(
    kind: str,
    port: int,
    worker_urls: Sequence[str],
    args: Sequence[str],
    roles: tuple[Sequence[str], Sequence[str]] | None = None,
) -> tuple[list[str], dict[str, str] | None]:
    """The command line and extra environment of peer `kind` on loopback port `port` (its metrics on
    another free one), in front of `worker_urls`, with its policy `args`; `roles`: (prefill, decode)
    replicas instead, for its PD mode (its `--prefill`/`--decode` flags)."""
    peer = PEERS[kind]
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1"]
    common += ["--prometheus-port", str(free_port()), "--log-level", "error", *peer.launch_args]
    if roles is None:
        common += ["--worker-urls", *worker_urls]
    else:
        common += role_flags(*roles)
    if peer.module is not None:
        # a tokenizer download at worker registration stays on loopback and fails (it only warns)
        return [sys.executable, "-m", peer.module, *common, *args], {"HF_ENDPOINT": "http://127.0.0.1:9"}
    assert peer.script is not None
    exe = _script(peer.script)
    if exe is None:
        raise RuntimeError(f"{peer.package} is not installed (pip install '.[bench]')")
    return [exe, *common, *args], None


async def first_answer(
    url: str, timeout: float = 60.0, headers: dict[str, str] | None = None, each_s: float = 5.0
) -> None:
    """Until a just-started router answers one completion (a peer may answer /health before its
    workers are registered), each try given `each_s`: a try cut short by the client is a request
    the replicas may still be working on (a split one holds its prefill's blocks for their lease),
    so where the first answer is slow, give it long enough rather than try again."""
    body = orjson.dumps(SMALL)
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(connector=_connector()) as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):
                async with s.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json", **(headers or {})},
                    timeout=aiohttp.ClientTimeout(total=max(0.1, min(each_s, deadline - time.monotonic()))),
                ) as r:
                    await r.read()
                    if r.status == 200:
                        return
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} answered no completion within {timeout:g} s")


# -- load --------------------------------------------------------------------------------------------


async def small_requests(
    url: str,
    n: int,
    concurrency: int,
    headers: dict[str, str] | None = None,
    new_connections: bool = False,
    failed: Counter[str] | None = None,
) -> int:
    """How many of `n` small completions answered 200; the others counted in `failed` by status and
    the error's `code` where the answer has one ("429 queue_full")."""
    ok = 0
    body = orjson.dumps(SMALL)
    async with aiohttp.ClientSession(connector=_connector(force_close=new_connections)) as s:

        async def worker(count: int) -> None:
            nonlocal ok
            for i in range(count):
                async with s.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json", "X-Session-ID": f"w{i % 50}", **(headers or {})},
                ) as r:
                    data = await r.read()
                    ok += r.status == 200
                    if r.status != 200 and failed is not None:
                        failed[_failure(r.status, data)] += 1

        await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
    return ok


def _failure(status: int, data: bytes) -> str:
    """A failed answer's status, with its error's `code` where it is JSON in OpenAI's shape."""
    try:
        code = orjson.loads(data)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return str(status)
    return f"{status} {code}" if isinstance(code, str) and code else str(status)


async def streams(url: str, n: int, tokens: int, concurrency: int, headers: dict[str, str] | None = None) -> int:
    events = 0
    body = orjson.dumps(SMALL | {"max_tokens": tokens, "stream": True})
    async with aiohttp.ClientSession(connector=_connector()) as s:

        async def worker(count: int) -> None:
            nonlocal events
            for i in range(count):
                async with s.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json", "X-Session-ID": f"s{i}", **(headers or {})},
                ) as r:
                    async for line in r.content:
                        events += line.startswith(b"data:")

        await asyncio.gather(*(worker(max(1, n // concurrency)) for _ in range(concurrency)))
    return events


async def ttft_probe(url: str, samples: int, headers: dict[str, str] | None = None) -> list[float]:
    body = orjson.dumps(SMALL | {"max_tokens": 2, "stream": True})
    out = []
    connector = _connector(limit=1)  # one keep-alive connection, reused
    async with aiohttp.ClientSession(connector=connector) as s:
        for i in range(samples + 5):
            t0 = time.perf_counter()
            async with s.post(
                url + "/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json", "X-Session-ID": "ttft", **(headers or {})},
            ) as r:
                first = None
                async for line in r.content:
                    if first is None and b'"content":"' in line and b'"content":""' not in line:
                        first = time.perf_counter() - t0
                if i >= 5 and first is not None:  # the first few warm the connections up
                    out.append(first)
    return out


STREAM_CLIENTS = 8  # parallel clients of the stream and TTFT runs
QUIET_WAIT_S = 10.0  # the longest a contender's measurement waits for its router to read the replica idle


async def quiet(url: str, headers: dict[str, str] | None = None) -> None:
    """Until a router that reports the replica's queue as it last read it (router-serve's
    `router_replica_health_input{input="waiting"}`) reads it empty; any other contender: at once.
    The replica is shared: a router whose last probe saw the queue another contender's load left
    would hold, or refuse as past its target (its overload hold, as shipped), what the replica has
    had room for since (CI saw one contender answer none of its 40 small requests)."""
    deadline = time.monotonic() + QUIET_WAIT_S
    async with aiohttp.ClientSession(connector=_connector()) as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    text = await r.text() if r.status == 200 else ""
            except (TimeoutError, aiohttp.ClientError, OSError):
                return
            waiting = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("router_replica_health_input{") and 'input="waiting"' in line
            ]
            if not any(waiting):
                return
            await asyncio.sleep(0.1)


async def measure(
    name: str, url: str, pid: int | None, args: argparse.Namespace, progress: Callable[[str], None]
) -> dict[str, Any]:
    at: dict[str, float | None] = {}
    oks = []
    failed: Counter[str] = Counter()
    await quiet(url, args.headers)
    for level in args.levels:
        progress(f"{name}: small requests, {level} clients")
        c0 = cpu_seconds(pid) if pid else 0.0
        ok = await small_requests(url, args.requests, level, args.headers, failed=failed)
        c1 = cpu_seconds(pid) if pid else 0.0
        oks.append(ok)
        at[str(level)] = (c1 - c0) / max(ok, 1) * 1e6 if pid else None
    # the headline figure: at the middle level (8 of 1,8,64)
    per_request = at[str(args.levels[len(args.levels) // 2])]
    near = min(args.levels, key=lambda level: abs(level - STREAM_CLIENTS))
    progress(f"{name}: streams")
    c1 = cpu_seconds(pid) if pid else 0.0
    events = await streams(url, args.streams, args.tokens, STREAM_CLIENTS, args.headers)
    c2 = cpu_seconds(pid) if pid else 0.0
    progress(f"{name}: TTFT")
    ttfts = await ttft_probe(url, args.ttft_samples, args.headers)
    n_streams = max(1, args.streams // STREAM_CLIENTS) * STREAM_CLIENTS
    at_streams = at[str(near)] or 0.0
    fresh = {}
    if args.tls:  # a new connection (and handshake) per request
        progress(f"{name}: a new connection per request")
        c3 = cpu_seconds(pid) if pid else 0.0
        ok = await small_requests(url, max(1, args.requests // 4), STREAM_CLIENTS, args.headers, new_connections=True)
        c4 = cpu_seconds(pid) if pid else 0.0
        fresh["cpu_us_per_request_new_connection"] = (c4 - c3) / max(ok, 1) * 1e6 if pid else None
    return {
        "contender": name,
        "small_ok": min(oks),
        "small_failed": dict(sorted(failed.items())),  # by HTTP status and error code
        "cpu_us_per_request": per_request,
        **{f"cpu_us_per_request_c{level}": at[str(level)] for level in args.levels},
        "events": events,
        # stream CPU less what the stream requests themselves cost as small requests
        "cpu_us_per_event": (((c2 - c1) * 1e6 - n_streams * at_streams) / max(events, 1)) if pid else None,
        "ttft_ms_median": statistics.median(ttfts) * 1000 if ttfts else None,
        "ttft_ms_p90": percentile(ttfts, 90) * 1000 if len(ttfts) >= 10 else None,
        **fresh,
    }


def contenders_for(backend: str, args: argparse.Namespace) -> list[tuple[str, list[str], dict[str, str] | None, str]]:
    """(name, command, extra environment, URL) of every contender in front of `backend`."""
    out: list[tuple[str, list[str], dict[str, str] | None, str]] = []
    port = free_port()
    bare = [sys.executable, "-m", "router.bench.proxy_bench", "--bare-proxy", str(port), backend]
    out.append(("bare aiohttp", bare, None, f"http://127.0.0.1:{port}"))
    port = free_port()
    floor = [sys.executable, "-m", "router.bench.lean", "--floor", str(port), backend]
    out.append(("floor: uvloop + httptools", floor, None, f"http://127.0.0.1:{port}"))
    # router-serve as shipped; without resuming, and without asking for usage too (what they cost); on aiohttp alone
    for name, extra in (
        ("router-serve", []),
        ("router-serve, resume off", ["--no-resume-streams"]),
        ("router-serve, resume and usage injection off", ["--no-resume-streams", "--no-inject-usage"]),
        ("router-serve --no-front", ["--no-front"]),
    ):
        port = free_port()
        serve = [sys.executable, "-m", "router.proxy.cli", "--port", str(port), "--replica", backend]
        out.append((name, [*serve, "--state", "none", *extra], None, f"http://127.0.0.1:{port}"))
    for name, python in args.against_pythons:  # another installation of router-serve, in the same run
        port = free_port()
        serve = [python, "-m", "router.proxy.cli", "--port", str(port), "--replica", backend, "--state", "none"]
        out.append((f"router-serve ({name})", serve, None, f"http://127.0.0.1:{port}"))
    for kind, policy in PEER_POLICIES:
        if args.no_peers or not peer_installed(kind):
            continue
        port = free_port()
        cmd, env = peer_command(kind, port, [backend], ["--policy", policy])
        out.append((f"{PEERS[kind].package} ({policy})", cmd, env, f"http://127.0.0.1:{port}"))
    return out


async def start(
    cmd: list[str],
    env: dict[str, str] | None,
    url: str,
    cpus: set[int] | None = None,
    headers: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """A contender, up and answering completions (pinned to `cpus`, all its threads, if given)."""
    proc = spawn(cmd, env, cpus)
    try:
        await wait_ready(url, "/health")
        await first_answer(url, headers=headers)  # its worker registered
        await small_requests(url, 200, 4, headers)  # warm-up
    except BaseException:
        stop(proc)
        raise
    return proc


async def saturation(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Each contender alone on CPU 1 in front of a canned replica, loaded to saturation from CPU 0."""
    out: dict[str, dict[str, Any]] = {}
    mine = os.sched_getaffinity(0)
    port = free_port()
    canned = spawn([sys.executable, "-m", "router.bench.lean", "--canned", str(port)], None, {0})
    backend = f"http://127.0.0.1:{port}"
    os.sched_setaffinity(0, {0})  # the clients share CPU 0 with the replica
    try:
        await wait_ready(backend)
        body = orjson.dumps(SMALL)
        direct = await lean.saturate(backend, args.saturate_connections, min(args.saturate_s, 2.0), body)
        out["direct"] = direct
        for name, cmd, env, url in contenders_for(backend, args):
            progress(f"{name}: saturation")
            proc = await start(cmd, env, url, {1})
            try:
                c0 = cpu_seconds(proc.pid)
                result = await lean.saturate(url, args.saturate_connections, args.saturate_s, body)
                result["cpu_share"] = (cpu_seconds(proc.pid) - c0) / args.saturate_s
                out[name] = result
            finally:
                stop(proc)
    finally:
        os.sched_setaffinity(0, mine)
        stop(canned)
    return out


async def run(
    args: argparse.Namespace, progress: Callable[[str], None], stopping: asyncio.Event | None = None
) -> dict[str, Any]:
    """Every contender, round after round, then saturation. `stopping` set (a signal): the rounds
    under way end there, and what the finished ones measured is reported (each contender's median
    of the rounds it finished; no saturation)."""
    stopping = stopping or asyncio.Event()
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
        running: list[tuple[str, str, int | None]] = [("direct", backend, None)]
        if args.shared_fleet:
            sink_port = free_port()
            procs.append(spawn([sys.executable, "-m", "router.bench.proxy_bench", "--otlp-sink", str(sink_port)]))
            sink = f"http://127.0.0.1:{sink_port}"
            await wait_ready(sink)
            folder = shared_fleet_files(Path(tempfile.mkdtemp(prefix="router-bench-")))
            contenders = shared_fleet_contenders(backend, folder, sink)
        elif args.tls:
            contenders = tls_contenders(backend, Path(tempfile.mkdtemp(prefix="router-bench-")))
        else:
            contenders = contenders_for(backend, args)
        for name, cmd, env, url in contenders:
            proc = await start(cmd, env, url, headers=args.headers)
            procs.append(proc)
            running.append((name, url, proc.pid))
        # contenders take turns, round after round, so machine noise falls on all of them alike
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in running}
        for k in range(args.rounds):
            for name, url, pid in running:
                label = f"{name} (round {k + 1})"
                if not await run_until(_measured(rounds[name], label, url, pid, args, progress), stopping):
                    break  # a signal: this round is left out, its time window unlike the others'
            if stopping.is_set():
                break
        results = [_median_of(name, rows) for name, rows in rounds.items() if rows]
    finally:
        for proc in procs:
            stop(proc)
    direct = results[0]["ttft_ms_median"] if results and results[0]["contender"] == "direct" else None
    for r in results:
        r["ttft_ms_added"] = (r["ttft_ms_median"] - direct) if r["ttft_ms_median"] is not None and direct else None
    saturated: dict[str, dict[str, Any]] = {}
    if (
        not stopping.is_set()
        and not args.shared_fleet  # (its requests would need the key: the figures above are its point)
        and not args.tls
        and args.saturate_s > 0
        and len(os.sched_getaffinity(0)) >= 2
        and {0, 1} <= os.sched_getaffinity(0)
    ):
        saturated = await saturation(args, progress)
    for r in results:
        r["saturation"] = saturated.get(r["contender"])
    return {
        "benchmark": "proxy",
        "rounds": args.rounds,
        "requests": args.requests,
        "streams": args.streams,
        "tokens": args.tokens,
        "concurrency": args.levels,
        "saturate_s": args.saturate_s if saturated else 0,
        "saturate_connections": args.saturate_connections,
        "machine": f"{os.cpu_count()} CPUs",
        "results": results,
    }


async def _measured(
    into: list[dict[str, Any]],
    label: str,
    url: str,
    pid: int | None,
    args: argparse.Namespace,
    progress: Callable[[str], None],
) -> None:
    into.append(await measure(label, url, pid, args, progress))  # only once the round is whole


def _median_of(name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"contender": name}
    for field in rows[0]:
        if field == "small_failed":  # statuses summed over the rounds
            out[field] = dict(sum((Counter(r[field]) for r in rows), Counter()))
            continue
        values = [r[field] for r in rows if isinstance(r[field], (int, float))]
        if field != "contender":
            out[field] = statistics.median(values) if values else None
    return out


PEER_NAMES = tuple(f"{PEERS[kind].package} ({policy})" for kind, policy in PEER_POLICIES)


def render(result: dict[str, Any]) -> str:
    def f(x: float | None, digits: int = 1) -> str:
        return "—" if x is None else f"{x:,.{digits}f}"

    levels = result["concurrency"]
    lines = [partial_headline(result)] if "partial" in result else []
    finished = " (or of those each contender finished)" if "partial" in result else ""
    lines += [
        f"proxy cost, median of {result['rounds']} rounds{finished}: {result['requests']} small requests at "
        f"{', '.join(map(str, levels))} clients, {result['streams']} streams of {result['tokens']} tokens "
        f"({STREAM_CLIENTS} clients); TTFT: sequential, one keep-alive connection",
        "",
        "| contender | "
        + " | ".join(f"CPU µs / request, {n} clients" for n in levels)
        + " | CPU µs / SSE event | TTFT median (ms) | TTFT added (ms) |",
        "|---|" + "---:|" * (len(levels) + 3),
    ]
    for r in result["results"]:
        cells = [f(r.get(f"cpu_us_per_request_c{n}"), 0) for n in levels]
        lines.append(
            f"| {r['contender']} | {' | '.join(cells)} | {f(r['cpu_us_per_event'], 1)} "
            f"| {f(r['ttft_ms_median'], 3)} | {f(r['ttft_ms_added'], 3)} |"
        )
    if any(r.get("cpu_us_per_request_new_connection") is not None for r in result["results"]):
        lines += ["", "a new connection per request (8 clients): CPU µs / request", ""]
        lines += ["| contender | CPU µs / request |", "|---|---:|"]
        for r in result["results"]:
            if r.get("cpu_us_per_request_new_connection") is not None:
                lines.append(f"| {r['contender']} | {f(r['cpu_us_per_request_new_connection'], 0)} |")
    if result.get("saturate_s"):
        lines += [
            "",
            f"saturation, one CPU each, {result['saturate_connections']} keep-alive clients for "
            f"{result['saturate_s']:g} s, canned replica:",
            "",
            "| contender | requests / s | latency P50 (ms) | latency P99 (ms) | CPU used | errors |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in result["results"]:
            sat = r.get("saturation")
            if sat:
                lines.append(
                    f"| {r['contender']} | {f(sat['requests_per_s'], 0)} | {f(sat['latency_ms_p50'], 2)} "
                    f"| {f(sat['latency_ms_p99'], 2)} | {f(sat.get('cpu_share'), 2)} | {sat['errors']} |"
                )
    ours = next((r for r in result["results"] if r["contender"] == "router-serve"), None)
    peers = [r for r in result["results"] if r["contender"] in PEER_NAMES]
    if ours and peers:
        lines += ["", "router-serve against the cheapest peer on each figure:"]
        for field, label in (("cpu_us_per_request", "CPU per request"), ("cpu_us_per_event", "CPU per event")):
            figures = [(r[field], r["contender"]) for r in peers if r.get(field) is not None]
            if figures and ours.get(field) is not None:
                best, who = min(figures)
                lines.append(f"- {label}: {ours[field] / best:.2f}x {who} ({ours[field]:.0f} vs {best:.0f})")
        sats = [(r["saturation"]["requests_per_s"], r["contender"]) for r in peers if r.get("saturation")]
        if sats and ours.get("saturation"):
            best, who = max(sats)
            mine = ours["saturation"]["requests_per_s"]
            lines.append(f"- requests per second on one CPU: {mine / best:.2f}x {who} ({mine:.0f} vs {best:.0f})")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    for name in ("requests", "streams", "tokens", "ttft_samples", "rounds", "saturate_connections"):
        if getattr(args, name) < 1:
            print(f"router-bench proxy: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    try:
        args.levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    except ValueError:
        args.levels = []
    if not args.levels or min(args.levels) < 1:
        print(f"router-bench proxy: --concurrency {args.concurrency!r} is not a list of numbers >= 1", file=sys.stderr)
        return 2
    if not args.saturate_s >= 0:
        print("router-bench proxy: --saturate-s must be a number of seconds >= 0", file=sys.stderr)
        return 2
    args.headers = {"Authorization": f"Bearer {BENCH_KEY}"} if args.shared_fleet else None
    if args.tls and args.shared_fleet:
        print("router-bench proxy: --tls and --shared-fleet are two different runs: choose one", file=sys.stderr)
        return 2
    if args.tls and shutil.which("openssl") is None:
        print("router-bench proxy: --tls makes its certificate with the openssl command, not found", file=sys.stderr)
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
    asked = os.environ.get(PROGRESS_ENV, "").strip()
    live = not args.json and sys.stderr.isatty() and asked != "0"
    plain = not live and asked not in ("", "0")  # ROUTER_BENCH_PROGRESS: a plain line per step

    def progress(msg: str) -> None:
        if live:
            print(f"\r\x1b[K  {msg} ...", end="", file=sys.stderr, flush=True)
        elif plain:
            print(f"  {msg}", file=sys.stderr, flush=True)

    async def main() -> tuple[dict[str, Any], Stopped | None]:
        stop = Stop().install()
        try:
            return await run(args, progress, stop.event), stop.stopped
        finally:
            stop.uninstall()

    result, stopped = uvloop.run(main())
    if live:
        print("\r\x1b[K", end="", file=sys.stderr)
    if stopped is not None:
        stopped.mark(result)
    print(json.dumps(result, indent=1) if args.json else render(result))
    return stopped.exit_status if stopped is not None else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--bare-proxy":
        bare_proxy_main(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "--otlp-sink":
        otlp_sink_main(int(sys.argv[2]))
    else:
        print(
            "usage: python -m router.bench.proxy_bench --bare-proxy PORT UPSTREAM_URL | --otlp-sink PORT",
            file=sys.stderr,
        )
        sys.exit(2)
