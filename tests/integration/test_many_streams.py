"""A thousand streams at once through one router-serve process: every one arrives whole."""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys

import aiohttp
import orjson
import pytest

from router.bench.common import free_port
from router.bench.faults import classify
from router.emulator.engine import EngineConfig
from router.emulator.server import Fleet, Replica, ReplicaOptions

STREAMS = 1000
TOKENS = 100  # at 50 ms a decoding step: every stream outlasts the opening of all the others


async def test_a_thousand_concurrent_streams(tmp_path) -> None:  # type: ignore[no-untyped-def]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * STREAMS + 256  # this process: client and replica sockets; the router: its two legs
    if hard < need:
        pytest.skip(f"the open-file limit is {hard}; {need} are needed (ulimit -n)")
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    engine = EngineConfig(num_blocks=20_000, max_num_seqs=STREAMS, max_num_batched_tokens=16_384, step_base_s=0.05)
    fleet = Fleet([Replica(ReplicaOptions(replica_id=f"emu-{i}", port=0), engine) for i in range(4)])
    await fleet.start()
    port = free_port()
    cmd = [sys.executable, "-m", "router.proxy.cli", "--port", str(port), "--state", "none"]
    for r in fleet.replicas:
        cmd += ["--replica", f"{r.options.replica_id}={r.url}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            for _ in range(300):
                assert proc.poll() is None, "router-serve exited"
                try:
                    async with http.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("router-serve did not come up in 30 s")
            peak = 0.0
            done = asyncio.Event()

            async def inflight() -> float:
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("router_inflight{"))

            async def sample() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, await inflight())
                    await asyncio.sleep(0.1)

            async def one(i: int) -> str:
                body = {"model": "emulated-llm", "messages": [{"role": "user", "content": f"stream {i}"}]}
                body |= {"max_tokens": TOKENS, "stream": True}
                async with http.post(
                    url + "/v1/chat/completions", data=orjson.dumps(body), headers={"X-Session-ID": f"s{i}"}
                ) as r:
                    return classify(r.status, await r.read(), True, TOKENS)[0]

            sampler = asyncio.create_task(sample())
            async with asyncio.timeout(240):
                verdicts = await asyncio.gather(*(one(i) for i in range(STREAMS)))
            done.set()
            await sampler
            assert verdicts.count("succeeded") == STREAMS, {v: verdicts.count(v) for v in set(verdicts)}
            assert peak == STREAMS  # every stream under way at the router at once
            assert await inflight() == 0  # each went down exactly once
        assert proc.poll() is None
        with open(f"/proc/{proc.pid}/status") as f:
            rss_kib = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        assert rss_kib < 400 * 1024, f"router RSS {rss_kib} KiB after {STREAMS} streams"
    finally:
        proc.terminate()
        _, err = await asyncio.to_thread(proc.communicate, timeout=30)
        await fleet.stop()
    assert "Traceback" not in err, err[-2000:]
