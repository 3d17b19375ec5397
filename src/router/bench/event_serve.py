"""`router-bench events --serve-workers N`: `router-serve --workers N` itself as the subscriber.

The publishers are the bench's own (router.bench.event_publishers); the router is a `router-serve`
child process started as an operator would start it (`--workers N`, its replicas and their
`kv_event_endpoints` in a TOML file, health probes off: the publishers serve no HTTP; with
`--followers K`, its `kv_event_followers`: the control process and K - 1 processes beside it each
follow a shard of the replicas), joining when
the in-process subscriber would. What is measured is what a host running it pays: the CPU of the
whole process tree (the control process and its N workers, each of which follows every replica),
its memory (the sum of their resident sets, and its files' pages in /dev/shm), the time until its
/metrics say every replica is believed, and the lag from a batch's timestamp to its application, from the router's own
histogram (`router_kv_event_lag_seconds`, merged over the workers, read at its buckets' bounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.bench.common import free_port
from router.bench.event_publishers import Shape
from router.bench.replicas import Child

MIB = 1 << 20
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


def config_text(
    endpoints: list[tuple[str, int, int]], workers: int, port: int, kv_tokens: int, followers: int = 1
) -> str:
    """The TOML an operator would write: each replica, where it publishes, its KV cache's size
    (the publishers serve no metrics that would say it), the workers, and the processes that
    follow the events (`kv_event_followers`)."""
    replicas = ", ".join(f'"{rid}=http://127.0.0.1:9/{rid}"' for rid, _, _ in endpoints)
    events = ", ".join(f'"{rid}=tcp://127.0.0.1:{p};tcp://127.0.0.1:{q}"' for rid, p, q in endpoints)
    return (
        f'host = "127.0.0.1"\nport = {port}\nworkers = {workers}\nstate = "none"\nhealth_checks = false\n'
        f'replicas = [{replicas}]\nkv_event_endpoints = [{events}]\nkv_capacity_tokens = ["*={kv_tokens}"]\n'
        f"kv_event_followers = {followers}\n"
    )


class Scrape:
    """What one read of the router's /metrics says of its KV events."""

    def __init__(self, text: str) -> None:
        self.believed: dict[str, float] = {}
        self.lag: dict[float, float] = {}  # bucket bound -> cumulative count
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "router_kv_events_believed":
                    self.believed[s.labels["replica"]] = s.value
                elif s.name == "router_kv_event_lag_seconds_bucket":
                    self.lag[float(s.labels["le"])] = s.value


def bucket_percentile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The q-th percentile of what a cumulative histogram counted between two reads, as the upper
    bound of the bucket it falls in (inf: past the last bound; nan: nothing counted)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return math.nan
    for bound, count in zip(bounds, counts, strict=True):
        if count >= total * q / 100:
            return bound
    return math.inf


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc (Linux: where the bench runs)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
                parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def _tree_cpu(pid: int) -> float:
    """Seconds of CPU (user and system) the process tree has used."""
    ticks = 0
    for p in _tree(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _tree_memory(pid: int) -> tuple[int, int, int]:
    """(the tree's resident bytes, its proportional bytes, its processes). Resident memory counts
    a page every process maps once in each (the workers' shared index: in every worker); the
    proportional set size divides it among them, so the tree's sum is what the host pays."""
    procs = _tree(pid)
    rss = pss = 0
    for p in procs:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                name, _, rest = line.partition(":")
                if name in ("Rss", "Pss"):
                    kib = int(rest.split()[0]) * 1024
                    rss += kib if name == "Rss" else 0
                    pss += kib if name == "Pss" else 0
    return rss, pss, len(procs)


def _shm_bytes(pid: int) -> int:
    """The memory the router's files in /dev/shm take (its replica table, its shared index's
    regions, directory and roster): their pages taken, mapped by a process or not."""
    total = 0
    for path in Path("/dev/shm").glob(f"kvar-{pid}*"):
        with contextlib.suppress(OSError):
            total += path.stat().st_blocks * 512
    return total


async def _scrape(http: aiohttp.ClientSession, url: str) -> Scrape:
    async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
        return Scrape(await r.text())


async def measure_serve(
    endpoints: list[tuple[str, int, int]],
    shape: Shape,
    workers: int,
    join_at: float,
    end: float,
    stop_publishers: Callable[[], dict[str, Any]],
    followers: int = 1,
) -> dict[str, Any]:
    """`router-serve --workers N` following the publishers at `endpoints` from `join_at` to `end`
    (wall clock), in `followers` processes (`kv_event_followers`); `stop_publishers` stops them
    and says what they sent."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="events-serve-") as tmp:
        config = Path(tmp) / "router.toml"
        config.write_text(config_text(endpoints, workers, port, shape.capacity_blocks * shape.block_size, followers))
        await asyncio.sleep(max(join_at - time.time(), 0.0))
        joined = time.monotonic()
        child = Child.spawn([sys.executable, "-m", "router.proxy.cli", "--config", str(config)], "router-serve")
        try:
            row = await _follow(child, url, endpoints, shape, workers, joined, end, stop_publishers)
            return row | {"followers": followers}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(child.proc.wait, STOP_GRACE_S)
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                await asyncio.to_thread(child.proc.wait)
            child.stderr.close()


async def _follow(
    child: Child,
    url: str,
    endpoints: list[tuple[str, int, int]],
    shape: Shape,
    workers: int,
    joined: float,
    end: float,
    stop_publishers: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    await child.wait_up(url, "/health", timeout=START_TIMEOUT_S)
    pid = child.pid
    ids = [rid for rid, _, _ in endpoints]
    async with aiohttp.ClientSession() as http:
        # joining: until its /metrics say every replica is believed (each worker sets the gauge
        # about once a second; the most recent write is shown), or the run ends first
        believe_s, believed = math.nan, 0
        while time.time() < end:
            got = await _scrape(http, url)
            believed = sum(got.believed.get(rid, 0.0) >= 1 for rid in ids)
            if believed == len(ids):
                believe_s = time.monotonic() - joined
                break
            await asyncio.sleep(0.25)
        first, cpu1, t1 = await _scrape(http, url), _tree_cpu(pid), time.monotonic()
        await asyncio.sleep(max(end - time.time(), 0.0))
        last, cpu2, t2 = await _scrape(http, url), _tree_cpu(pid), time.monotonic()
        rss, pss, procs = _tree_memory(pid)
        shm = _shm_bytes(pid)
    sent = stop_publishers()
    steady = t2 - t1 if believed == len(ids) else 0.0
    rate = sent["stored"] / sent["seconds"] if sent["seconds"] else 0.0
    # what the engines hold at the end, which is what each worker holds once it believes them all (it
    # replayed their history from the start): the router's own gauge is set only once a second
    held = sent["stored"] - sent["removed"]
    return {
        "publishers": len(ids),
        "workers": workers,
        "processes": procs,
        "believed": believed,
        "believe_s": believe_s,
        "sent_blocks_per_s": rate,
        "asked_blocks_per_s": shape.blocks_per_s * len(ids),
        "steady_s": steady,
        "host_cpu_cores": (cpu2 - cpu1) / steady if steady > 0 else math.nan,
        "cpu_cores_per_worker": (cpu2 - cpu1) / steady / workers if steady > 0 else math.nan,
        "host_cpu_us_per_block": (cpu2 - cpu1) / (rate * steady) * 1e6 if steady > 0 and rate > 0 else math.nan,
        "lag_p50_le_s": bucket_percentile(first.lag, last.lag, 50) if steady else math.nan,
        "lag_p99_le_s": bucket_percentile(first.lag, last.lag, 99) if steady else math.nan,
        "held_blocks": held,
        "rss_mib": rss / MIB,
        "pss_mib": pss / MIB,
        # its files in /dev/shm: their pages are taken when laid out (router.kvevents.mapped), so some
        # no process has touched yet, which no process's PSS counts
        "shm_mib": shm / MIB,
        # the host's memory for each million blocks the fleet holds (proportional: a page the
        # processes share counted once)
        "rss_mib_per_million_blocks_held": rss / MIB / (held / 1e6) if held else math.nan,
        "pss_mib_per_million_blocks_held": pss / MIB / (held / 1e6) if held else math.nan,
    }


def render_serve(rows: list[dict[str, Any]]) -> str:
    lines = [
        "`router-serve --workers N` as the subscriber (its whole process tree: the control process, "
        "N workers, and the processes beside it that follow a shard of the events each, if more than one "
        "follows). Lag: the bound of the router's histogram bucket the percentile falls in. Memory: "
        "resident (a page several processes map counted in each) and proportional (counted once: what "
        "the host pays).",
        "",
        "| publishers | workers | followers | believed (s) | blocks/s sent (asked) | host cores | cores per worker "
        "| µs CPU per block sent | lag P50 ≤ (ms) | lag P99 ≤ (ms) | blocks the engines hold "
        "| RSS, all processes (MiB) | PSS, all processes (MiB) | PSS MiB per million blocks held "
        "| its files in /dev/shm (MiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        believe = f"{r['believe_s']:.2f}" if r["believed"] == r["publishers"] else f"— ({r['believed']:,} believed)"
        lines.append(
            f"| {r['publishers']:,} | {r['workers']} | {r.get('followers', 1)} | {believe} "
            f"| {r['sent_blocks_per_s']:,.0f} ({r['asked_blocks_per_s']:,.0f}) | {_num(r['host_cpu_cores'], '.2f')} "
            f"| {_num(r['cpu_cores_per_worker'], '.2f')} | {_num(r['host_cpu_us_per_block'], '.2f')} "
            f"| {_num(r['lag_p50_le_s'] * 1e3, ',.1f')} | {_num(r['lag_p99_le_s'] * 1e3, ',.1f')} "
            f"| {r['held_blocks']:,} | {r['rss_mib']:,.0f} | {r['pss_mib']:,.0f} "
            f"| {_num(r['pss_mib_per_million_blocks_held'], ',.0f')} | {r['shm_mib']:,.0f} |"
        )
    return "\n".join(lines)


def _num(value: float, spec: str) -> str:
    return "—" if math.isnan(value) else format(value, spec)


__all__ = ["Scrape", "bucket_percentile", "config_text", "measure_serve", "render_serve"]
