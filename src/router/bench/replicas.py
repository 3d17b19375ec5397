"""The replicas of one fleet-benchmark run, started and read: an emulated fleet (router-emulator),
llama-server processes, or the benchmark's kept vLLM replicas (router.bench.vllm.VllmReplicas);
`Fleet` says where they answer and how to read their counters into a `Sample`, and `Child` is a
process the bench starts in its own process group (a fleet, a router in front of it)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from router.bench.common import free_port
from router.bench.llama_server import LlamaServer, NotBuilt, find_binary, model_for
from router.bench.proxy_bench import stop
from router.bench.vllm import VLLM_COUNTERS, vllm_metrics
from router.config import FIELDS
from router.health.signals import samples


@dataclass
class Child:
    """A child process in its own process group, its stderr kept in a file for the error line."""

    proc: subprocess.Popen[bytes]
    stderr: Any  # a temporary file
    what: str

    @classmethod
    def spawn(cls, cmd: list[str], what: str, env: dict[str, str] | None = None) -> Child:
        """Start `cmd` with this environment, less any router setting (`ROUTER_<SETTING>`) that
        would change a router child behind the bench's back, plus `env`."""
        err = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        inherited = {k: v for k, v in os.environ.items() if not (k.startswith("ROUTER_") and k[7:].lower() in FIELDS)}
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            env=inherited | (env or {}),
        )
        return cls(proc, err, what)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def problem(self) -> str:
        """The last line the child wrote to stderr (why it stopped), if any."""
        self.stderr.seek(0)
        lines = [ln.strip() for ln in self.stderr.read()[-4000:].decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else "no message"

    def keep_log(self, path: Path, limit: int = 1 << 20) -> Path:
        """What the child has written to stderr so far (its last `limit` bytes), written to `path`."""
        self.stderr.flush()
        size = self.stderr.seek(0, os.SEEK_END)
        self.stderr.seek(max(0, size - limit))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.stderr.read())
        return path

    async def wait_up(self, url: str, path: str, timeout: float) -> None:
        """Until `url + path` answers below 500; RuntimeError at once if the child exits meanwhile."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.what} exited with status {self.proc.returncode}: {self.problem()}")
                with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):
                    async with http.get(url + path, timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status < 500:
                            return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.what} did not answer {url}{path} within {timeout:g} s")

    def stop(self) -> None:
        try:
            stop(self.proc)
        finally:
            self.stderr.close()


@dataclass
class Sample:
    wall_s: float  # since the replay began
    engine_s: list[float]
    busy_s: list[float]
    queued: list[int]  # running + waiting
    finished: list[int]
    counters: dict[str, float] | None = None  # the real engine's own (VLLM_COUNTERS), the fleet's totals


@dataclass
class Fleet:
    """The replicas of one run: where they answer, their processes, how to read their counters."""

    urls: list[str]
    pids: list[int]
    read: Callable[[aiohttp.ClientSession, float], Awaitable[Sample]]  # (http, seconds since t0)
    stop: Callable[[], None]
    what: str  # for the tables: "emulated replicas", "llama-server replicas", "vLLM replicas"
    control: str | None = None  # the emulator's control URL (faults, crashes, caches); None for real engines
    events: bool = False  # its replicas publish KV-cache events (router-serve waits until it believes them)


async def start_fleet(replicas: int, args: argparse.Namespace, emulator_args: list[str]) -> Fleet:
    """The replicas of one run; `emulator_args` (the workload's engine shape and `--emulator-arg`)
    go to router-emulator."""
    if args.engine == "llama-server":
        return await start_llama_fleet(replicas, args)
    if args.engine == "vllm":
        return await start_vllm_fleet(replicas, args)
    problem = ""
    for _ in range(3):  # a port of the run can be taken between the check and the bind: try another run
        base, control = free_port(replicas), free_port()
        cmd = [
            sys.executable,
            "-m",
            "router.emulator.cli",
            "--replicas",
            str(replicas),
            "--base-port",
            str(base),
            "--control-port",
            str(control),
            "--time-scale",
            str(args.time_scale),
            "--stream-interval",
            str(args.stream_interval),
            *emulator_args,
        ]
        child = Child.spawn(cmd, "router-emulator")
        urls = [f"http://127.0.0.1:{p}" for p in range(base, base + replicas)]
        control_url = f"http://127.0.0.1:{control}"
        try:
            await child.wait_up(control_url, "/replicas", timeout=30)
            for url in urls:
                await child.wait_up(url, "/health", timeout=10)
        except RuntimeError as exc:
            child.stop()
            problem = str(exc)
            if child.proc.returncode not in (None, -signal.SIGTERM) and "address" not in problem.lower():
                break  # it refused its arguments: another port will not help
            continue
        except BaseException:  # cancelled, interrupted: no fleet left behind
            child.stop()
            raise

        async def read(http: aiohttp.ClientSession, wall_s: float, control_url: str = control_url) -> Sample:
            async with http.get(control_url + "/replicas", timeout=aiohttp.ClientTimeout(total=5)) as r:
                rows = await r.json(loads=orjson.loads)
            return Sample(
                wall_s=wall_s,
                engine_s=[float(x["engine_time_s"]) for x in rows],
                busy_s=[float(x["engine"]["busy_seconds"]) for x in rows],
                queued=[int(x["engine"]["running"]) + int(x["engine"]["waiting"]) for x in rows],
                finished=[int(x["engine"]["finished_total"]) for x in rows],
            )

        events = any(a.startswith("--kv-events-port") for a in emulator_args)
        return Fleet(urls, [child.pid], read, child.stop, "emulated replicas", control_url, events)
    raise RuntimeError(f"the emulated fleet did not start: {problem}")


async def start_llama_fleet(replicas: int, args: argparse.Namespace) -> Fleet:
    """`replicas` llama-server processes of `--slots` slots, on the random model written for the run."""
    try:
        binary = find_binary()
    except NotBuilt as exc:
        raise RuntimeError(str(exc)) from None
    if args.llama_model is None:  # one model for the whole benchmark, removed when it ends (run_cli)
        args.llama_model = model_for(Path(tempfile.mkdtemp(prefix="kvar-llama-")), binary)
    servers = [
        LlamaServer(
            args.llama_model,
            free_port(),
            slots=args.slots,
            context=args.slots * args.slot_context,
            binary=binary,
            extra=tuple(args.llama_arg),
            name=f"llama-{i}",
        )
        for i in range(replicas)
    ]

    def stop_all() -> None:
        for server in servers:
            server.stop()

    try:
        await asyncio.gather(*(s.start() for s in servers))
    except BaseException:
        stop_all()
        raise

    async def read(http: aiohttp.ClientSession, wall_s: float) -> Sample:
        async def one(server: LlamaServer) -> dict[str, float]:
            async with http.get(server.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                values, _ = samples(await r.text())
            return {name: sum(series) for name, series in values.items()}  # a missing one: KeyError, no sample

        rows = await asyncio.gather(*(one(s) for s in servers))
        return Sample(
            wall_s=wall_s,
            # slot-seconds: a replica of k slots has k of them each wall second
            engine_s=[wall_s * args.slots] * len(rows),
            busy_s=[m["llamacpp:prompt_seconds_total"] + m["llamacpp:tokens_predicted_seconds_total"] for m in rows],
            queued=[int(m["llamacpp:requests_processing"] + m["llamacpp:requests_deferred"]) for m in rows],
            finished=[int(m["llamacpp:tokens_predicted_total"]) for m in rows],
        )

    return Fleet(
        [s.url for s in servers], [s.proc.pid for s in servers if s.proc], read, stop_all, "llama-server replicas"
    )


def group_pids(pgid: int) -> list[int]:
    """The processes of process group `pgid` (a vLLM replica: its API server, engine core, worker)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
    return pids


async def start_vllm_fleet(replicas: int, args: argparse.Namespace) -> Fleet:
    """The benchmark's kept vLLM replicas (args.vllm_replicas), idle and with cold caches, and how
    to read their counters during one run. Stopping this fleet leaves them running for the next."""
    servers = await args.vllm_replicas.ready(replicas)
    busy = [0.0] * len(servers)  # seconds each replica has had a request running, sampled
    previous: tuple[float, list[float]] | None = None  # the last sample's time and requests running

    async def read(http: aiohttp.ClientSession, wall_s: float) -> Sample:
        nonlocal previous
        rows = await asyncio.gather(*(vllm_metrics(http, s.url) for s in servers))
        running = [m["vllm:num_requests_running"] for m in rows]
        if previous is not None:  # by the trapezoid rule between samples
            then, before = previous
            for i, (a, b) in enumerate(zip(before, running, strict=True)):
                busy[i] += (wall_s - then) * ((a > 0) + (b > 0)) / 2
        previous = (wall_s, running)
        return Sample(
            wall_s=wall_s,
            engine_s=[wall_s] * len(rows),
            busy_s=list(busy),
            queued=[int(m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]) for m in rows],
            finished=[int(m["vllm:request_success_total"]) for m in rows],
            counters={name: sum(m[name] for m in rows) for name in VLLM_COUNTERS},
        )

    pids = [pid for s in servers if s.proc is not None for pid in group_pids(s.proc.pid)]
    return Fleet([s.url for s in servers], pids, read, lambda: None, "vLLM replicas", events=True)
