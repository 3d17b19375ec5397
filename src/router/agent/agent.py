"""The agent: every interval, read the GPUs (NVML) and the local engine's /metrics, then publish.

Remote: `GET /stats` on the agent's port returns the latest reading as JSON, for a router's
control loop to fetch. Colocated with the router: the same figures go straight into the router
host's shared-memory replica table (`--shm NAME --slot I`). A figure that could not be read is
null / None, with the reason in `missing`; nothing is invented.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.agent.nvml import NvmlReader, NvmlReading
from router.health.signals import EngineStats, parse_engine_metrics
from router.shm.layout import ReplicaSlot
from router.shm.table import SlotTable


@dataclasses.dataclass(frozen=True)
class Reading:
    replica_id: str
    taken_at: float
    engine: EngineStats
    nvml: NvmlReading
    missing: tuple[str, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "taken_at": self.taken_at,
            "engine": dataclasses.asdict(self.engine),
            "gpus": [dataclasses.asdict(g) for g in self.nvml.gpus],
            "missing": list(self.missing),
        }

    def as_slot(self, base: ReplicaSlot | None = None) -> ReplicaSlot:
        """The reading as a replica-table row: GPUs summed (memory, ECC), averaged (utilisation),
        or worst (temperature, throttle bits); None where no GPU reported the figure."""
        gpus = self.nvml.gpus

        def values(name: str) -> list[Any]:
            return [getattr(g, name) for g in gpus if getattr(g, name) is not None]

        def total(name: str) -> int | None:
            found = values(name)
            return sum(found) if found else None

        util = values("util")
        temps = values("temperature_c")
        reasons = values("throttle_reasons")
        row = base or ReplicaSlot(replica_id=self.replica_id, state="healthy", weight=1.0, score=1.0)
        return dataclasses.replace(
            row,
            waiting=self.engine.waiting,
            running=self.engine.running,
            kv_usage=self.engine.kv_usage,
            fragmentation=self.engine.fragmentation,
            gpu_util=sum(util) / len(util) if util else None,
            temperature_c=max(temps) if temps else None,
            mem_used=total("mem_used"),
            mem_total=total("mem_total"),
            throttle_reasons=_or(reasons) if reasons else None,
            ecc_errors=total("ecc_uncorrected"),
            updated_at=self.taken_at,
        )


def _or(bits: list[int]) -> int:
    out = 0
    for b in bits:
        out |= b
    return out


class Agent:
    def __init__(
        self,
        replica_id: str,
        engine_url: str | None,
        nvml: NvmlReader,
        interval_s: float = 1.0,
        table: SlotTable | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.engine_url = engine_url.rstrip("/") if engine_url else None
        self.nvml = nvml
        self.interval_s = interval_s
        self.table = table
        self.slot: int | None = None  # our replica's slot in `table`, once the router has given it one
        self.latest: Reading | None = None
        self._client: aiohttp.ClientSession | None = None

    async def read_once(self) -> Reading:
        missing: list[str] = []
        engine = EngineStats()
        if self.engine_url is None:
            missing.append("engine: no --engine URL given")
        else:
            if self._client is None:
                self._client = aiohttp.ClientSession()
            try:
                async with self._client.get(
                    self.engine_url + "/metrics", timeout=aiohttp.ClientTimeout(total=max(self.interval_s, 0.5))
                ) as r:
                    if r.status == 200:
                        engine = parse_engine_metrics(await r.text())
                    else:
                        missing.append(f"engine: /metrics answered HTTP {r.status}")
            except (aiohttp.ClientError, OSError, TimeoutError, UnicodeDecodeError) as exc:
                missing.append(f"engine: /metrics unreachable ({type(exc).__name__})")
        nvml = self.nvml.read()
        if nvml.error:
            missing.append(f"gpu: {nvml.error}")
        reading = Reading(self.replica_id, time.time(), engine, nvml, tuple(missing))
        self.latest = reading
        if self.table is not None:
            slot = self._find_slot(self.table)
            if slot is not None:
                self.table.write_agent(slot, reading.as_slot())
        return reading

    def _find_slot(self, table: SlotTable) -> int | None:
        # the router may remove and re-add the replica elsewhere: check the slot still holds it
        if self.slot is None or table.read(self.slot).replica_id != self.replica_id:
            self.slot = table.find(self.replica_id)
        return self.slot

    async def run(self) -> None:
        while True:
            await self.read_once()
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
        self.nvml.close()

    def app(self) -> web.Application:
        app = web.Application()

        async def stats(request: web.Request) -> web.Response:
            reading = self.latest or await self.read_once()
            return web.Response(body=orjson.dumps(reading.as_json()), content_type="application/json")

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def loop_ctx(app: web.Application) -> Any:
            task = asyncio.create_task(self.run(), name="agent loop")
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self.close()

        app.router.add_get("/stats", stats)
        app.router.add_get("/health", health)
        app.cleanup_ctx.append(loop_ctx)
        return app
