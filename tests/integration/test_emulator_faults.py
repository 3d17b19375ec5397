"""Every fault mode of the emulator, set at run time or at start-up."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from typing import Any

import aiohttp
import orjson
import pytest
from waiting import until

from router.bench.common import free_port
from router.emulator.cli import UsageError, build_fleet, build_parser, parse_fault
from router.emulator.server import Faults, Replica

PROMPT = {"prompt": "p" * 400, "max_tokens": 6}
STREAM = PROMPT | {"stream": True}


async def set_faults(r: Replica, patch: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(r.url + "/emulator/faults", json=patch) as resp:
        return resp.status, await resp.json()


async def read_events(resp: aiohttp.ClientResponse, timeout: float) -> tuple[list[bytes], str]:
    """SSE events read until the stream ends, breaks or goes quiet for `timeout` seconds."""
    buf = b""
    while True:
        try:
            chunk = await asyncio.wait_for(resp.content.readany(), timeout)
        except TimeoutError:
            return [e for e in buf.split(b"\n\n") if e], "quiet"
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionResetError):
            return [e for e in buf.split(b"\n\n") if e], "cut"
        if not chunk:
            events = [e for e in buf.split(b"\n\n") if e]
            return events, "done" if events and events[-1] == b"data: [DONE]" else "cut"
        buf += chunk


async def test_hang_accepts_but_never_answers_until_cleared(replica: Replica) -> None:
    status, faults = await set_faults(replica, {"hang": True})
    assert status == 200 and faults["hang"] is True
    async with aiohttp.ClientSession() as s:
        pending = asyncio.ensure_future(s.get(replica.url + "/health"))
        done, _ = await asyncio.wait([pending], timeout=0.3)
        assert not done  # connected, no answer
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(replica.url + "/v1/completions", json=PROMPT, timeout=aiohttp.ClientTimeout(total=0.3)):
                pass
        await set_faults(replica, {"hang": False})
        resp = await asyncio.wait_for(pending, 2)
        assert resp.status == 200


async def test_slow_multiplies_engine_time(make_replica) -> None:  # type: ignore[no-untyped-def]
    spent = []
    for slow in (1.0, 4.0):
        r = make_replica(faults=Faults(slow=slow))
        await r.start()
        async with aiohttp.ClientSession() as s, s.post(r.url + "/v1/completions", json=PROMPT) as resp:
            assert resp.status == 200
        spent.append(r.engine.busy_seconds)
        await r.stop()
    assert spent[1] == pytest.approx(4 * spent[0])


async def test_error_rate_answers_a_share_with_5xx(replica: Replica) -> None:
    await set_faults(replica, {"error_rate": 0.5})
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(60):
            async with s.post(replica.url + "/v1/completions", json=PROMPT | {"max_tokens": 1}) as resp:
                statuses.append(resp.status)
                if resp.status != 200:
                    err = await resp.json()
                    assert err["error"]["code"] == resp.status and "injected" in err["error"]["message"]
    errors = [x for x in statuses if x != 200]
    assert set(errors) == {500, 503}
    assert 15 <= len(errors) <= 45
    await set_faults(replica, {"error_rate": 1.0, "error_status": 503})
    async with aiohttp.ClientSession() as s, s.post(replica.url + "/v1/completions", json=PROMPT) as resp:
        assert resp.status == 503


async def test_stall_keeps_the_connection_open_and_sends_nothing_more(replica: Replica) -> None:
    await set_faults(replica, {"stall_after": 2})
    async with aiohttp.ClientSession() as s, s.post(replica.url + "/v1/completions", json=STREAM) as resp:
        events, how = await read_events(resp, timeout=0.5)
    assert how == "quiet" and len(events) == 2


async def test_drop_closes_the_connection_mid_stream(replica: Replica) -> None:
    await set_faults(replica, {"drop_after": 3})
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            replica.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True},
        ) as resp,
    ):
        events, how = await read_events(resp, timeout=2)
    assert how == "cut" and len(events) == 3
    await until(lambda: not replica.engine.has_work(), "the abandoned sequence aborted")
    assert not replica.engine.has_work()  # the abandoned sequence was aborted, its blocks freed
    assert replica.engine.cache.used_blocks == 0


async def test_end_late_sends_the_streams_http_end_apart_from_its_done(replica: Replica) -> None:
    # as llama-server writes them: [DONE], then (here half a second later) the empty last chunk
    await set_faults(replica, {"end_late": 0.5})
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s, s.post(replica.url + "/v1/completions", json=STREAM) as resp:
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                break
        done_at = loop.time()
        assert not (await resp.content.read()).strip()  # nothing more (the blank line ending [DONE]), only the end
        assert loop.time() - done_at >= 0.4


async def test_crash_refuses_connections_cuts_streams_and_restarts_cold(start_fleet) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        control = sock.getsockname()[1]
    fleet = await start_fleet(2, control_port=control)
    r = fleet.replicas[0]
    async with aiohttp.ClientSession() as s:
        async with s.post(r.url + "/v1/completions", json=PROMPT) as resp:
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        long = PROMPT | {"stream": True, "max_tokens": 20_000}  # ~2 s at this time scale: the crash lands mid-stream
        async with s.post(r.url + "/v1/completions", json=long) as resp:
            await resp.content.readline()
            async with s.post(f"http://127.0.0.1:{control}/replicas/0/crash") as c:
                assert c.status == 200 and (await c.json())["crashed"] is True
            _, how = await read_events(resp, timeout=2)
        assert how == "cut"
        with pytest.raises(aiohttp.ClientConnectorError):
            async with s.get(r.url + "/health"):
                pass
        async with s.get(fleet.replicas[1].url + "/health") as resp:
            assert resp.status == 200  # the rest of the fleet is unaffected
        async with s.post(f"http://127.0.0.1:{control}/replicas/0/restart") as c:
            assert (await c.json())["crashed"] is False
        async with s.post(r.url + "/v1/completions", json=PROMPT) as resp:
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # cold
        async with s.post(f"http://127.0.0.1:{control}/replicas/7/crash") as c:
            assert c.status == 404
        async with s.post(f"http://127.0.0.1:{control}/replicas/-1/crash") as c:
            assert c.status == 404
        async with s.get(f"http://127.0.0.1:{control}/replicas") as c:
            assert [x["replica_id"] for x in await c.json()] == ["emu-0", "emu-1"]


async def test_crash_from_the_replicas_own_endpoint(replica: Replica) -> None:
    async with aiohttp.ClientSession() as s, s.post(replica.url + "/emulator/crash") as resp:
        assert resp.status == 202
    await until(lambda: replica.crashed, "the replica crashed")
    assert replica.crashed
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectorError):
            await s.get(replica.url + "/health")


@pytest.mark.parametrize(
    "patch",
    [
        *({"slow": 0}, {"error_rate": 2}, {"error_status": 404}, {"stall_after": -1}, {"hang": "yes"}),
        *({"explode": True}, {"end_late": -1}, {"end_late": "soon"}),
    ],
)
async def test_bad_fault_settings_are_refused_whole(replica: Replica, patch: dict[str, Any]) -> None:
    status, err = await set_faults(replica, patch | {"error_rate": 0.25} if "error_rate" not in patch else patch)
    assert status == 400 and err["error"]["message"]
    assert replica.faults == Faults()


def test_fault_specs_from_the_command_line() -> None:
    assert parse_fault("hang", 3) == ([0, 1, 2], "hang", True)
    assert parse_fault("2:slow=3.5", 3) == ([2], "slow", 3.5)
    assert parse_fault("0:crash-after=10", 1) == ([0], "crash_after", 10.0)
    for bad in ("boom", "5:hang", "slow", "slow=fast", "x:hang", "hang=maybe"):
        with pytest.raises(UsageError):
            parse_fault(bad, 3)
    fleet, crash = build_fleet(
        build_parser().parse_args(
            ["--replicas", "3", "--fault", "1:error-rate=0.5", "--fault", "drop-after=2", "--fault", "2:crash-after=5"]
        )
    )
    assert [r.faults.error_rate for r in fleet.replicas] == [0, 0.5, 0]
    assert all(r.faults.drop_after == 2 for r in fleet.replicas) and crash == {2: 5.0}
    assert [r.options.replica_id for r in fleet.replicas] == ["emu-9001", "emu-9002", "emu-9003"]


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "9001", "--replicas", "2"],
        ["--replicas", "0"],
        ["--time-scale", "0"],
        ["--block-size", "0"],
        ["--fault", "1:hang"],
        ["--fault", "slow=0"],
        ["--replicas", "2", "--replica-id", "x"],
    ],
)
def test_bad_command_lines_exit_2_with_one_line(args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "router.emulator.cli", *args], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("router-emulator: ")


async def test_start_up_faults_in_a_real_process() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.emulator.cli",
            "--port",
            str(port),
            "--time-scale",
            "100",
            "--fault",
            "error-rate=1",
            "--fault",
            "crash-after=1.0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"emu-{port} listening on http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", data=orjson.dumps(PROMPT)) as resp:
                assert resp.status in (500, 503)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    async with s.get(f"http://127.0.0.1:{port}/health"):
                        pass
                except aiohttp.ClientConnectorError:
                    break  # crashed on schedule
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the replica did not crash after 1 s")
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


async def test_stop_does_not_wait_on_a_hung_request(make_replica) -> None:  # type: ignore[no-untyped-def]
    r = make_replica(faults=Faults(hang=True))
    await r.start()
    async with aiohttp.ClientSession() as s:
        pending = asyncio.ensure_future(s.get(r.url + "/health"))
        await until(lambda: r.held, "the request held by the hang fault")
        await asyncio.wait_for(r.stop(), 10)  # bounded by the shutdown grace, not by the hung request
        pending.cancel()


@pytest.mark.parametrize(("fault", "expect"), [({"stall_after": 0}, "quiet"), ({"drop_after": 0}, "cut")])
async def test_stall_and_drop_on_unstreamed_requests(replica: Replica, fault: dict[str, Any], expect: str) -> None:
    await set_faults(replica, fault)
    async with aiohttp.ClientSession() as s:
        try:
            async with s.post(
                replica.url + "/v1/completions", json=PROMPT, timeout=aiohttp.ClientTimeout(total=0.5)
            ) as resp:
                await resp.read()
            got = "answered"
        except TimeoutError:
            got = "quiet"
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            got = "cut"
    assert got == expect


@pytest.mark.parametrize("patch", [{"error_status": 500.0}, {"error_status": False}])
async def test_error_status_must_be_an_integer(replica: Replica, patch: dict[str, Any]) -> None:
    status, _ = await set_faults(replica, patch)
    assert status == 400
