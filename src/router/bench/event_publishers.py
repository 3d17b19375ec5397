"""The publishers of `router-bench events`: light engines speaking vLLM's KV-event wire.

Each is an engine's KV-event sockets (router.emulator.kvevents.Publisher: a PUB socket numbering
its messages from 0, a replay ROUTER socket keeping the last `replay_steps`) driven by `Engine`, a
light model of an engine's prefix cache shaped by `Shape` (the defaults: an H200 serving an 8B
model). `publishers_main` runs a share of the fleet in a child process, from a start time until the
parent says stop, then sends back what they sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import uvloop
import zmq
import zmq.asyncio

from router._runtime import raise_open_files
from router.emulator.kvcache import BlockRemoved, BlockStored, CacheEvent
from router.emulator.kvevents import KvEventsOptions, Publisher

TICK_S = 0.002  # the publishers' clock: a step due is sent within this
BEHIND_S = 1.0  # a publisher this far behind its schedule skips ahead (the sent rate says so)


@dataclass(frozen=True)
class Shape:
    """One replica's engine, as its events show it."""

    blocks_per_s: float = 1250.0
    batch_blocks: int = 64
    block_size: int = 16
    capacity_blocks: int = 80_000
    chain_blocks: int = 256  # a request's blocks (4,096 tokens): a new chain after this many
    replay_steps: int = 10_000  # vLLM's buffer_steps

    def __post_init__(self) -> None:
        if self.capacity_blocks < self.chain_blocks + self.batch_blocks:
            raise ValueError(
                f"--capacity-blocks {self.capacity_blocks} must hold a chain and a step "
                f"(--chain-blocks {self.chain_blocks} + --batch-blocks {self.batch_blocks})"
            )

    @property
    def period_s(self) -> float:
        return self.batch_blocks / self.blocks_per_s


class Engine:
    """An engine's prefix cache as light as it can be: chains of unique blocks, stored a step at a
    time; past its capacity the oldest chain is evicted from its tail, one event per block (vLLM
    frees a finished request's blocks tail first into its LRU queue)."""

    def __init__(self, index: int, shape: Shape) -> None:
        self.shape = shape
        self.base = (index + 1) << 40  # its block hashes and token ids are its own
        self.made = 0
        self.chain_left = 0
        self.parent: int | None = None
        self.chains: deque[list[int]] = deque()  # the blocks held, by chain, oldest chain first
        self.held = 0
        self.stored = 0
        self.removed = 0

    def step(self) -> list[CacheEvent]:
        shape = self.shape
        events: list[CacheEvent] = []
        # room first: vLLM evicts as it allocates a step's blocks, before they are full and stored
        while self.held + shape.batch_blocks > shape.capacity_blocks and self.chains:
            oldest = self.chains[0]
            events.append(BlockRemoved(oldest.pop()))
            if not oldest:
                self.chains.popleft()
            self.held -= 1
            self.removed += 1
        left = shape.batch_blocks
        while left:
            if not self.chain_left:
                self.chain_left, self.parent = shape.chain_blocks, None
                self.chains.append([])
            n = min(left, self.chain_left)
            first = self.base + self.made
            hashes = list(range(first, first + n))
            size = shape.block_size
            # the chain's first block starts with its own number: no two chains share a root key
            tokens = list(range((first * size) & 0x3FFFFFFF, ((first * size) & 0x3FFFFFFF) + n * size))
            events.append(BlockStored(hashes, self.parent, tokens, None, [None] * n))
            self.parent = hashes[-1]
            self.made += n
            self.chain_left -= n
            left -= n
            self.chains[-1].extend(hashes)
            self.held += n
            self.stored += n
        return events


def start_publishers(
    ports: list[tuple[int, int]], shape: Shape, procs: int, start_at: float
) -> list[tuple[BaseProcess, Connection]]:
    """Publishers on `ports` (PUB, replay) in `procs` child processes, publishing from `start_at`
    (wall clock); returns once every child has opened its sockets. End them with `end_publishers`."""
    ctx = mp.get_context("spawn")
    children: list[tuple[BaseProcess, Connection]] = []
    per = math.ceil(len(ports) / procs)
    for k in range(0, len(ports), per):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=publishers_main, args=(k, ports[k : k + per], shape, start_at, child), daemon=True)
        proc.start()
        children.append((proc, parent))
    for _, parent in children:
        if not parent.poll(60) or parent.recv() != "ready":
            end_publishers(children)
            raise RuntimeError("a publisher process did not start")
    return children


def stop_publishers(children: list[tuple[BaseProcess, Connection]]) -> dict[str, Any]:
    """Tells the publishers to stop; what they sent, all together."""
    for _, parent in children:
        parent.send("stop")
    sent: dict[str, Any] = {"messages": 0, "stored": 0, "removed": 0, "skipped_steps": 0, "seconds": 0.0}
    for _, parent in children:
        counts = parent.recv()
        for k in sent:
            sent[k] = sent[k] + counts[k] if k != "seconds" else max(sent[k], counts[k])
    return sent


def end_publishers(children: list[tuple[BaseProcess, Connection]]) -> None:
    """The publishers' processes ended (stopped or not)."""
    for proc, parent in children:
        with contextlib.suppress(OSError, BrokenPipeError):
            parent.send("end")
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def publishers_main(first: int, ports: list[tuple[int, int]], shape: Shape, start_at: float, conn: Connection) -> None:
    raise_open_files()
    # the publishers' PUB and replay sockets: ZMQ's default context holds 1,023
    zmq.Context.instance().set(zmq.MAX_SOCKETS, 16_384)
    zmq.asyncio.Context.instance().set(zmq.MAX_SOCKETS, 16_384)
    uvloop.run(_publish(first, ports, shape, start_at, conn))


async def _publish(first: int, ports: list[tuple[int, int]], shape: Shape, start_at: float, conn: Connection) -> None:
    """Publishers on `ports` (PUB, replay) from `start_at` (wall clock) until the parent says stop;
    then their counts go back on `conn`."""
    options = [KvEventsOptions(port=p, replay_port=q, buffer_steps=shape.replay_steps) for p, q in ports]
    pubs = [Publisher(o, "127.0.0.1", shape.block_size, {}) for o in options]
    for pub in pubs:
        await pub.open()
    engines = [Engine(first + i, shape) for i in range(len(pubs))]
    conn.send("ready")
    await asyncio.sleep(max(start_at - time.time(), 0.0))
    period = shape.period_s
    t0 = time.monotonic()
    due = [t0 + period * i / len(pubs) for i in range(len(pubs))]  # staggered, as engines are
    skipped = 0
    while not conn.poll():
        now = time.monotonic()
        for i, pub in enumerate(pubs):
            if due[i] > now:
                continue
            if now - due[i] > BEHIND_S:
                skipped += int((now - due[i]) / period)
                due[i] = now
            pub.publish(engines[i].step())
            due[i] += period
        await asyncio.sleep(max(min(due) - time.monotonic(), TICK_S))  # (replays are answered meanwhile)
    conn.recv()
    conn.send(
        {
            "messages": sum(p.sent for p in pubs),
            "stored": sum(e.stored for e in engines),
            "removed": sum(e.removed for e in engines),
            "skipped_steps": skipped,
            "seconds": time.monotonic() - t0,
        }
    )
    # the replays a late subscriber may still ask for are answered until the parent ends this process
    while not conn.poll(0):
        await asyncio.sleep(0.05)
    for pub in pubs:
        await pub.close()


__all__ = ["Engine", "Shape", "publishers_main"]
