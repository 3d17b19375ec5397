"""Routers in processes of their own (`router-bench events --routers N --router-procs`).

In one process, routers that follow the same publishers share an event loop, which hands each a
burst of messages in turn: their skew is that loop's scheduling. Here every router after the first
is a process of its own, as router processes on a host are: its own interpreter, loop, sockets and
index (`subscriber`, the same as the in-process ones), its own core when the machine has one. The
bench speaks to each over a pipe:

- `join`: it starts following (asks every replay socket for what it missed), at the moment the
  in-process routers do;
- `sure`: how many replicas it believes;
- `decide` with prompts' chains of keys: the replica its events say holds most of each
  (router.bench.event_agreement.decision), answered from its index as it stands when the question
  arrives, so decisions are compared across processes as a request sent to several routers would
  be, events in flight to some and not yet to others;
- `end`: it stops, and answers with its CPU seconds since it joined.

With `--shared-index` the first router's index is in shared memory (router.kvevents.shared) and
every other process only reads it (`SharedIndexReader`): no sockets, no decoding, no index of its
own. Its `decide` also gets, per replica, the first router's holder numbers of its GPU tiers (none
for a replica not believed), as the workers of one host would read them beside the index, and
answers from the regions as they stand when the question arrives.

A child that dies or does not answer within ANSWER_S fails the run with one line, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import time
from array import array
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import aiohttp
import uvloop

from router.bench.event_agreement import best_of, decision
from router.bench.event_publishers import Shape
from router.config import RouterConfig
from router.engines.kvfeed import Feed
from router.health.states import Hysteresis
from router.kvevents.shared import SharedIndex, SharedIndexReader
from router.metrics import RouterMetrics
from router.placement import Placement
from router.pools import replica_fleet

ANSWER_S = 30.0  # the longest a child may take to answer one question


def subscriber(
    config: RouterConfig,
    shape: Shape,
    metrics: RouterMetrics,
    http: aiohttp.ClientSession,
    index: SharedIndex | None = None,
) -> Feed:
    """One router's subscriber: its fleet, its placement's index (`index`: one in shared memory),
    its Feed (not yet following)."""
    fleet = replica_fleet(config, config.replicas, Hysteresis())
    for replica in fleet.replicas:  # what its probes would have read off the engine
        replica.engine = replace(
            replica.engine, kv_tokens=shape.capacity_blocks * shape.block_size, block_size=shape.block_size
        )
    placement = Placement(fleet, config.placement, config.bounded_load_floor)
    if index is not None:
        placement.truth.index = index  # before any replica's Holdings are made on it
    return Feed(fleet, placement, config.placement, lambda: http, metrics)


class Remote:
    """One router in a child process, asked over its pipe."""

    def __init__(self, config: RouterConfig, shape: Shape, shared: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.conn = parent
        self.shared = shared
        self.rss_mib = math.nan  # its resident memory at the end
        self.private_mib = math.nan  # ... of which its own (not pages of files it maps, as a shared index's)
        self.proc: BaseProcess = ctx.Process(target=remote_main, args=(config, shape, child, shared), daemon=True)
        self.proc.start()
        child.close()

    def _ask(self, message: tuple[Any, ...]) -> Any:
        try:
            self.conn.send(message)
            if not self.conn.poll(ANSWER_S):
                raise RuntimeError(f"a router process did not answer {message[0]!r} within {ANSWER_S:.0f} s")
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(1.0)
            raise RuntimeError(
                f"a router process ended (exit code {self.proc.exitcode}) before answering {message[0]!r}"
            ) from None

    async def ask(self, message: tuple[Any, ...]) -> Any:
        return await asyncio.to_thread(self._ask, message)

    async def end(self) -> float:
        """Stops it; its CPU seconds since it joined (NaN if it could not say). Its resident
        memory then is kept in `rss_mib`, and what of it is its own in `private_mib`."""
        try:
            cpu, self.rss_mib, self.private_mib = await self.ask(("end",))
        except (RuntimeError, OSError):
            cpu = math.nan
        await asyncio.to_thread(self.proc.join, 10.0)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5.0)
        self.conn.close()
        return float(cpu)


def remote_main(config: RouterConfig, shape: Shape, conn: Connection, shared: str | None = None) -> None:
    """A child process's body: one subscriber (or, with `shared`, a reader of the shared index
    named so), answering the bench's questions until `end`."""
    with contextlib.suppress(KeyboardInterrupt):
        if shared is not None:
            _read(len(config.replicas), shared, conn)
        else:
            uvloop.run(_serve(config, shape, conn))


def _memory_mib() -> tuple[float, float]:
    """(resident, private) MiB: what it maps of a shared index is resident but not its own."""
    fields: dict[str, int] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                fields[name] = int(rest.split()[0])
    return fields.get("Rss", 0) / 1024, (fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)) / 1024


def _read(replicas: int, shared: str, conn: Connection) -> None:
    """A reader's body: the shared index mapped at `join`, each `decide` matched on it."""
    cpu0 = time.process_time()
    reader: SharedIndexReader | None = None
    while True:
        try:
            kind, *rest = conn.recv()
        except EOFError:
            return
        if kind == "join":
            cpu0 = time.process_time()
            reader = SharedIndexReader(shared)
            conn.send(True)
        elif kind == "sure":
            conn.send(replicas)  # what the writer believes comes with each question
        elif kind == "decide":
            chains, holders = rest
            answers = []
            for chain in chains:
                matched = array("i", bytes(4 * (reader.n_holders if reader is not None else 0)))
                if reader is not None:
                    reader.match_all(chain, matched)
                answers.append(best_of(matched, holders))
            conn.send(answers)
        else:
            break
    with contextlib.suppress(OSError):
        conn.send((time.process_time() - cpu0, *_memory_mib()))


async def _serve(config: RouterConfig, shape: Shape, conn: Connection) -> None:
    # the pipe is read in a thread, blocking: an event loop's reader would make its descriptor
    # non-blocking, and a large question would then be read in parts
    loop = asyncio.get_running_loop()
    cpu0 = time.process_time()
    async with aiohttp.ClientSession() as http:
        feed = subscriber(config, shape, RouterMetrics(), http)
        ids = [r.id for r in feed.fleet.replicas]
        finding: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    kind, *rest = await asyncio.to_thread(conn.recv)
                except EOFError:  # the bench went away
                    break
                if kind == "join":
                    cpu0 = time.process_time()
                    finding = loop.create_task(feed.find())
                    conn.send(True)
                elif kind == "sure":
                    conn.send(sum(feed.truth.sure(rid) for rid in ids))
                elif kind == "decide":
                    conn.send([decision(feed.truth, ids, chain) for chain in rest[0]])
                else:  # "end"
                    break
        finally:
            if finding is not None:
                await finding
            await feed.close()
    with contextlib.suppress(OSError):
        conn.send((time.process_time() - cpu0, *_memory_mib()))


async def decide_all(
    remotes: list[Remote], chains: list[array[int]], holders: Callable[[], list[list[int]]] | None = None
) -> list[list[int]]:
    """Every remote router's decisions for `chains`, asked of all at once (readers of a shared
    index also get `holders()`: router.bench.event_agreement.gpu_holders)."""
    message: tuple[Any, ...] = ("decide", chains) if holders is None else ("decide", chains, holders())
    return list(await asyncio.gather(*(r.ask(message) for r in remotes)))


__all__ = ["Remote", "decide_all", "remote_main", "subscriber"]
