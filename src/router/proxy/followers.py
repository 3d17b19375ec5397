"""`kv_event_followers`: processes beside the control process, each following a shard of the engines' KV events.

Under `router-serve --workers N` the control process follows the engines' KV-cache events into
the host's index in shared memory, which the workers read (router.kvevents.shared). One process
applies about 400,000 stored blocks a second (docs/benchmarks.md, "Fleet scale"): some 300
H200-shaped replicas. With `kv_event_followers = K` it follows only the replicas `shard_of` gives
shard 0, and starts K - 1 processes (spawned, as workers are), each following shard k into the
same index: it reads the replica table as a worker does (the fleet, each engine's block size and
capacity, from the control process's probes), asks the replicas of its shard where they publish,
subscribes, and writes their holders and roster rows. The workers read one index whoever follows
which replica. A follower that dies is found within WATCH_S: the control process clears what it
left at once (its replicas are read as followed by none, priced by the router's model, not as it
last left them) and starts another, waiting longer between starts while they keep failing. The
followers stop with the control process, or when it goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import aiohttp
from prometheus_client import multiprocess

from router._runtime import run, until_stopped
from router.config import RouterConfig
from router.engines.kvfeed import SHARED_BYTES_PER_BLOCK, Feed, IndexBudget
from router.health.states import Hysteresis
from router.kvevents.mapped import SharedFileError
from router.kvevents.shared import SharedIndex, clear_shard
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
WATCH_S = 0.2  # how often the control process looks whether its followers live
RESTART_BACKOFF_S = 1.0  # the wait before a dead follower's first restart, doubled while they keep failing ...
RESTART_BACKOFF_MAX_S = 30.0  # ... up to this
STEADY_S = 30.0  # a follower that lived this long starts its next restart's wait afresh


@dataclass(frozen=True)
class Shard:
    """What a follower process is told: its shard of how many, the index's name and budget."""

    shard: int
    shards: int
    shm_name: str
    budget_blocks: int
    budget_source: str
    parent: int  # the control process's pid: the follower stops once it is gone


def follower_main(config: RouterConfig, task: Shard, ready: Connection) -> None:
    """Entry point of a spawned follower: follow its shard until SIGINT/SIGTERM, or until the
    control process goes."""
    with contextlib.suppress(KeyboardInterrupt):
        run(_follow(config, task, ready))


async def _follow(config: RouterConfig, task: Shard, ready: Connection) -> None:
    shard, shards, shm_name = task.shard, task.shards, task.shm_name
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
                budget=IndexBudget(task.budget_blocks, task.budget_source, SHARED_BYTES_PER_BLOCK),
                shard=(shard, shards),
            )
            following = asyncio.create_task(feed.run(), name=f"kv events, shard {shard} of {shards}")
            ready.send(None)
            ready.close()
            stop = asyncio.create_task(until_stopped())
            try:
                while not stop.done() and not following.done() and os.getppid() == task.parent:
                    follower.sync()
                    await asyncio.wait([stop], timeout=SYNC_INTERVAL_S)
            finally:
                # (a feed that failed raises here: the process exits, and the control process starts another)
                for running in (stop, following):
                    running.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await running
                await feed.close()
    finally:
        if index is not None:
            index.close()  # (its holders named no more: the others' stay read)
        table.close()


class Followers:
    """The control process's side: start shards 1 .. K - 1, restart those that die, stop them.
    `budget` is the control process's own shard's (router.engines.kvfeed.shard_budget), measured
    once: each follower, however often restarted, has the same."""

    def __init__(self, config: RouterConfig, table: SlotTable, budget: IndexBudget, metrics_dir: str) -> None:
        self.config = config
        self.table = table
        self.budget = budget
        self.metrics_dir = metrics_dir
        self.shards = config.placement.kv_event_followers
        self.ctx = mp.get_context("spawn")
        self.procs: dict[int, BaseProcess] = {}
        self.stopping = False

    def _start(self, shard: int) -> str | None:
        """Starts shard `shard`'s process; why it did not start, or None once it follows."""
        if self.stopping:
            return "the router is stopping"
        receive, send = self.ctx.Pipe(duplex=False)
        task = Shard(shard, self.shards, self.table.name, self.budget.blocks, self.budget.source, os.getpid())
        # (daemonic: one started as the router stops is ended with it, never waited for)
        proc = self.ctx.Process(
            target=follower_main, args=(self.config, task, send), name=f"router-serve kv events {shard}", daemon=True
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

    def _bury(self, shard: int, proc: BaseProcess) -> None:
        """A follower is gone: what it left in the index is cleared, its live gauges go."""
        with contextlib.suppress(SharedFileError):  # (no index: nothing to clear)
            clear_shard(f"{self.table.name}-kv", shard, self.shards)
        if proc.pid is not None:
            multiprocess.mark_process_dead(proc.pid, self.metrics_dir)  # type: ignore[no-untyped-call]

    async def watch(self) -> None:
        """Restarts followers that die, each on its own: the first time RESTART_BACKOFF_S after it
        died, and twice as long after each start that did not live STEADY_S, up to RESTART_BACKOFF_MAX_S."""
        loop = asyncio.get_running_loop()
        started = dict.fromkeys(self.procs, time.monotonic())
        wait = dict.fromkeys(self.procs, RESTART_BACKOFF_S / 2)  # (doubled at its first death)
        due: dict[int, float] = {}  # shard -> when its next start is due (it is dead)
        starting: dict[int, asyncio.Future[str | None]] = {}
        while not self.stopping:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            for shard, start in list(starting.items()):
                if start.done():
                    del starting[shard]
                    started[shard] = now
                    if start.result() is not None:
                        print(f"router-serve: kv events follower {shard}: {start.result()}; trying again", flush=True)
            for shard, proc in list(self.procs.items()):
                if self.stopping or shard in starting or proc.is_alive():
                    continue
                if shard not in due:
                    print(
                        f"router-serve: kv events follower {shard} (pid {proc.pid}) exited ({proc.exitcode}); "
                        "restarting",
                        flush=True,
                    )
                    self._bury(shard, proc)
                    lived = now - started.get(shard, now)
                    wait[shard] = (
                        RESTART_BACKOFF_S if lived >= STEADY_S else min(2 * wait[shard], RESTART_BACKOFF_MAX_S)
                    )
                    due[shard] = now + wait[shard]
                if now >= due[shard]:
                    del due[shard]
                    starting[shard] = loop.run_in_executor(None, self._start, shard)

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


__all__ = ["Followers", "Shard", "follower_main"]
