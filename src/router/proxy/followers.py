"""`kv_event_followers`: processes beside the control process, each following a shard of the engines' KV events.

Under `router-serve --workers N` the control process follows the engines' KV-cache events into
the host's index in shared memory, which the workers read (router.kvevents.shared). One process
applies about 400,000 stored blocks a second (docs/benchmarks.md, "Fleet scale"): some 300
H200-shaped replicas. With `kv_event_followers = K` it follows only the replicas `shard_of` gives
shard 0, and starts K - 1 processes (spawned, as workers are), each following shard k into the
same index: it reads the replica table as a worker does (the fleet, each engine's block size and
capacity, from the control process's probes), asks the replicas of its shard where they publish,
subscribes, and writes their holders and roster rows. The workers read one index whoever follows
which replica. A follower that dies is restarted, and first clears what it left; the followers
stop with the control process, or when it goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import aiohttp

from router._runtime import run, until_stopped
from router.config import RouterConfig
from router.engines.kvfeed import Feed, shard_budget
from router.health.states import Hysteresis
from router.kvevents.mapped import SharedFileError
from router.kvevents.shared import SharedIndex
from router.metrics import RouterMetrics
from router.monitor import latency_window_s
from router.node import SYNC_INTERVAL_S
from router.policy import make_policy
from router.policy.ttft import Ttft
from router.pools import replica_fleet
from router.shm.table import SlotTable
from router.state.replica_table import Follower
from router.tls import replica_context

START_TIMEOUT_S = 60.0
RESTART_BACKOFF_S = 1.0


def follower_main(config: RouterConfig, shm_name: str, shard: int, shards: int, ready: Connection) -> None:
    """Entry point of a spawned follower: follow shard `shard` of `shards` until SIGINT/SIGTERM,
    or until the control process goes."""
    with contextlib.suppress(KeyboardInterrupt):
        run(_follow(config, shm_name, shard, shards, ready))


async def _follow(config: RouterConfig, shm_name: str, shard: int, shards: int, ready: Connection) -> None:
    parent = os.getppid()
    try:
        table = SlotTable.attach(shm_name)
    except (OSError, ValueError) as exc:
        ready.send(f"cannot attach shared memory {shm_name!r}: {exc}")
        return
    index: SharedIndex | None = None
    try:
        fleet = replica_fleet(config, (), Hysteresis())
        follower = Follower(fleet, table, None, latency_window_s(config.probe_interval_s))
        follower.reload()
        policy = make_policy(config.policy, fleet, config)
        if not isinstance(policy, Ttft):
            ready.send(f"the {config.policy} policy reads no KV events")
            return
        try:
            index = SharedIndex(f"{table.name}-kv", shard=shard, shards=shards)
        except SharedFileError as exc:
            ready.send(str(exc))
            return
        policy.placement.truth.share(index)
        connector = aiohttp.TCPConnector(limit=0, ssl=replica_context(config.tls) or True)
        async with aiohttp.ClientSession(connector=connector) as http:
            feed = Feed(
                fleet,
                policy.placement,
                config.placement,
                lambda: http,
                RouterMetrics(),
                routes=False,
                budget=shard_budget(config.placement.kv_events_max_mib, shards),
                shard=(shard, shards),
            )
            following = asyncio.create_task(feed.run(), name=f"kv events, shard {shard} of {shards}")
            ready.send(None)
            ready.close()
            stop = asyncio.create_task(until_stopped())
            try:
                while not stop.done() and not following.done() and os.getppid() == parent:
                    follower.sync()
                    await asyncio.wait([stop], timeout=SYNC_INTERVAL_S)
            finally:
                for task in (stop, following):  # (a feed that failed raises here: the process exits, and is restarted)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                await feed.close()
    finally:
        if index is not None:
            index.close()  # (its holders named no more: the others' stay read)
        table.close()


class Followers:
    """The control process's side: start shards 1 .. K - 1, restart those that die, stop them."""

    def __init__(self, config: RouterConfig, table: SlotTable) -> None:
        self.config = config
        self.table = table
        self.shards = config.placement.kv_event_followers
        self.ctx = mp.get_context("spawn")
        self.procs: dict[int, BaseProcess] = {}
        self.stopping = False

    def _start(self, shard: int) -> str | None:
        """Starts shard `shard`'s process; why it did not start, or None once it follows."""
        receive, send = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(
            target=follower_main,
            args=(self.config, self.table.name, shard, self.shards, send),
            name=f"router-serve kv events {shard}",
        )
        proc.start()
        send.close()
        self.procs[shard] = proc
        try:
            if not receive.poll(START_TIMEOUT_S):
                problem: str | None = f"not ready after {START_TIMEOUT_S:.0f} s"
            else:
                problem = receive.recv()
        except (EOFError, OSError):
            problem = "exited while starting"
        finally:
            receive.close()
        if problem is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.join(5)
        return problem

    async def start_all(self) -> list[str]:
        """Starts every shard beyond the first; what each that did not start said."""
        loop = asyncio.get_running_loop()
        said = await asyncio.gather(*(loop.run_in_executor(None, self._start, k) for k in range(1, self.shards)))
        return [f"kv events follower {k}: {problem}" for k, problem in enumerate(said, 1) if problem is not None]

    async def watch(self) -> None:
        """Restarts followers that die (at most one start each RESTART_BACKOFF_S)."""
        loop = asyncio.get_running_loop()
        last = dict.fromkeys(self.procs, time.monotonic())
        while not self.stopping:
            await asyncio.sleep(0.2)
            for shard, proc in list(self.procs.items()):
                if self.stopping or proc.is_alive() or time.monotonic() - last.get(shard, 0.0) < RESTART_BACKOFF_S:
                    continue
                print(
                    f"router-serve: kv events follower {shard} (pid {proc.pid}) exited ({proc.exitcode}); restarting",
                    flush=True,
                )
                last[shard] = time.monotonic()
                problem = await loop.run_in_executor(None, self._start, shard)
                if problem is not None:
                    print(f"router-serve: kv events follower {shard}: {problem}; trying again", flush=True)

    async def stop(self) -> None:
        self.stopping = True
        loop = asyncio.get_running_loop()
        for proc in self.procs.values():
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    proc.terminate()
        for proc in self.procs.values():
            await loop.run_in_executor(None, proc.join, 10)
            if proc.is_alive():
                proc.kill()
                await loop.run_in_executor(None, proc.join, 5)


__all__ = ["Followers", "follower_main"]
