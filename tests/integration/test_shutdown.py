"""A router that stops hands its keep-alive connections over instead of closing them under a request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

from router.bench.common import free_port
from router.config import load
from router.node import Node
from router.proxy.app import build_app
from router.proxy.workers import listen, runner_for, stop_serving

BODY = orjson.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
SLOW = orjson.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 64, "stream": True})


async def serving(start_fleet: Any) -> tuple[Any, str]:
    fleet = await start_fleet(2)
    config = load(None, {}, {"replicas": [r.url for r in fleet.replicas], "state": "none", "health_checks": "false"})
    runner = runner_for(build_app(Node(config)), config)
    await runner.setup()
    port = free_port()
    await listen(runner, "127.0.0.1", port)
    return runner, f"http://127.0.0.1:{port}"


async def test_a_busy_client_gets_answers_until_connection_close_then_a_refusal(start_fleet) -> None:  # type: ignore[no-untyped-def]
    runner, url = await serving(start_fleet)
    answers: list[str] = []  # the Connection header of each answer
    outcome: list[str] = []

    async def client() -> None:
        async with aiohttp.ClientSession() as http:  # one keep-alive connection, reused
            for _ in range(500):
                try:
                    async with http.post(url + "/v1/chat/completions", data=BODY) as r:
                        assert r.status == 200
                        await r.read()
                        answers.append(r.headers.get("Connection", "keep-alive").lower())
                except aiohttp.ClientConnectorError:
                    outcome.append("refused")  # a new connection, once the router no longer listens
                    return
                except aiohttp.ClientError as exc:
                    outcome.append(f"cut: {type(exc).__name__}")
                    return
                await asyncio.sleep(0.01)
            outcome.append("never refused")

    task = asyncio.create_task(client())
    while len(answers) < 5:
        await asyncio.sleep(0.01)
    started = time.monotonic()
    await stop_serving(runner, 1.0)
    took = time.monotonic() - started
    await asyncio.wait_for(task, 10)
    assert outcome == ["refused"]
    # answered with "Connection: close" once the stop began, and not kept waiting the whole handover
    assert answers[-1] == "close" and answers.count("close") == 1
    assert took < 1.0


async def test_a_stream_finishes_and_an_idle_connection_waits_the_handover_at_most(start_fleet) -> None:  # type: ignore[no-untyped-def]
    runner, url = await serving(start_fleet)
    async with aiohttp.ClientSession() as idle, aiohttp.ClientSession() as streaming:
        async with idle.post(url + "/v1/chat/completions", data=BODY) as r:
            await r.read()  # its connection stays open, idle
        async with streaming.post(url + "/v1/chat/completions", data=SLOW) as r:
            assert r.status == 200
            await r.content.readline()  # the stream is under way
            stopping = asyncio.create_task(stop_serving(runner, 0.5))
            rest = await r.read()
        assert rest.rstrip().endswith(b"data: [DONE]")  # the whole stream, though the router stops
        started = time.monotonic()
        await asyncio.wait_for(stopping, 5)
        assert time.monotonic() - started < 1.5  # the idle connection held it for the handover at most
