"""router-agent: NVML (a fake module standing in for pynvml), the engine's metrics, /stats, shared memory."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.agent.agent import Agent
from router.agent.nvml import NvmlReader
from router.config import load
from router.node import Node
from router.proxy.app import build_app
from router.shm.layout import ReplicaSlot
from router.shm.table import SlotTable


class NVMLError(Exception):
    pass


class FakeNvml:
    """The pynvml calls the agent makes, answering for two GPUs; GPU 1 does not support ECC."""

    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVMLError = NVMLError

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.shut = False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(used=(60 + h) << 30, total=141 << 30)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=80 + 10 * h)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 60 + 5 * h

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return 1 << h

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        if h == 1:
            raise NVMLError("Not Supported")
        return 3


def test_nvml_figures_and_unsupported_ones() -> None:
    fake = FakeNvml()
    reader = NvmlReader(fake)
    reading = reader.read()
    assert reading.error is None and [g.index for g in reading.gpus] == [0, 1]
    g0, g1 = reading.gpus
    assert (g0.name, g0.mem_used, g0.mem_total, g0.util, g0.temperature_c) == (
        "NVIDIA H200",
        60 << 30,
        141 << 30,
        0.8,
        60.0,
    )
    assert g0.ecc_uncorrected == 3 and g1.ecc_uncorrected is None  # unsupported: missing, not 0
    reader.close()
    assert fake.shut


def test_no_driver_means_missing_not_zero() -> None:
    reading = NvmlReader(FakeNvml(fail_init=True)).read()
    assert reading.gpus == [] and "NVML is unavailable" in (reading.error or "")
    real = NvmlReader().read()  # this machine: either a real GPU or a stated reason there is none
    assert real.gpus or real.error


async def test_agent_reads_the_engine_and_publishes(replica) -> None:  # type: ignore[no-untyped-def]
    table = SlotTable.create(f"kvar-agent-{os.getpid()}-{uuid.uuid4().hex[:6]}", 2)
    try:
        agent = Agent("emu-a", replica.url, NvmlReader(FakeNvml()), interval_s=0.05, table=table)
        await agent.read_once()  # the router has not given emu-a a slot yet: nothing is written
        assert agent.slot is None and table.read_agent(0) == table.read_agent(1) == ReplicaSlot()
        table.write(1, ReplicaSlot("emu-a", replica.url, "healthy"))  # as the router's control loop does
        reading = await agent.read_once()
        assert reading.engine.waiting == 0 and reading.engine.kv_usage == 0 and reading.missing == ()
        assert agent.slot == 1 and table.read_agent(0) == ReplicaSlot()
        row = table.read_agent(1)
        assert row.replica_id == "emu-a" and row.waiting == 0 and row.running == 0
        assert row.mem_used == (60 + 61) << 30 and row.mem_total == 282 << 30
        assert row.gpu_util == pytest.approx(0.85) and row.temperature_c == 65.0
        assert row.throttle_reasons == 0b11 and row.ecc_errors == 3
        await agent.close()
        blind = Agent("emu-b", "http://127.0.0.1:9", NvmlReader(FakeNvml(fail_init=True)))
        reading = await blind.read_once()
        assert reading.engine.waiting is None and reading.nvml.gpus == []
        assert any(m.startswith("engine:") for m in reading.missing) and any(
            m.startswith("gpu:") for m in reading.missing
        )
        assert reading.as_slot().mem_used is None and reading.as_slot().waiting is None
        await blind.close()
    finally:
        table.close()


async def test_stats_endpoint(replica) -> None:  # type: ignore[no-untyped-def]
    agent = Agent("emu-a", replica.url, NvmlReader(FakeNvml()), interval_s=0.05)
    runner = web.AppRunner(agent.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/stats") as r:
            stats = await r.json()
        assert stats["replica_id"] == "emu-a" and len(stats["gpus"]) == 2 and stats["missing"] == []
        assert stats["engine"]["running"] == 0 and stats["gpus"][1]["ecc_uncorrected"] is None
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    "args", [["--interval", "0"], ["--engine", "localhost:8000"], ["--shm", "no-such-table"], ["--port", "70000"]]
)
def test_bad_command_lines_exit_2(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "router.agent.cli", *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.startswith("router-agent: ") and proc.stderr.count("\n") == 1


async def test_a_colocated_agent_reaches_the_score_through_shared_memory(start_fleet) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    specs = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    name = f"kvar-agent-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    config = load(None, {}, {"replicas": specs, "probe_interval_s": "0.05", "shm_name": name, "state": "none"})
    table = SlotTable.create(config.shm_name, config.shm_slots)
    runner = None
    try:
        router = Node(config, table=table)
        router.publish()  # as router-serve --shm-name does at start
        runner = web.AppRunner(build_app(router))
        await runner.setup()
        nvml = FakeNvml()
        agent = Agent("emu-1", fleet.replicas[1].url, NvmlReader(nvml), interval_s=0.05, table=SlotTable.attach(name))
        task = asyncio.create_task(agent.run())
        sick = router.fleet.find("emu-1")
        assert sick is not None
        deadline = asyncio.get_running_loop().time() + 5
        while sick.state != "removed":  # the agent's uncorrected ECC errors take it out of routing
            assert asyncio.get_running_loop().time() < deadline, sick.state
            await asyncio.sleep(0.05)
        assert table.read_agent(sick.slot or 0).ecc_errors == 3
        assert router.fleet.find("emu-0").state == "healthy"  # type: ignore[union-attr]  # no agent: probes only
        task.cancel()
        await agent.close()
        assert agent.table is not None
        agent.table.close()
    finally:
        if runner is not None:
            await runner.cleanup()
        table.close()
