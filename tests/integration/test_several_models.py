"""Several models behind one router, on emulated vLLM replicas: each request goes only to replicas
that serve the model it names (as their /v1/models lists them, or as pinned), and a model no
replica serves gets the router's own 404, forwarded nowhere."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from router.emulator.engine import EngineConfig
from router.emulator.server import Fleet, Replica

TOKEN = "models-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def models_fleet(make_replica: Callable[..., Replica]) -> AsyncIterator[Fleet]:
    """emu-0, emu-1: model-a; emu-2: model-b with the adapter b-lora; emu-3: model-a, also named model-b."""
    fleet = Fleet(
        [
            make_replica("emu-0", model="model-a"),
            make_replica("emu-1", model="model-a"),
            make_replica("emu-2", model="model-b", adapters=("b-lora",)),
            make_replica("emu-3", model="model-a", aliases=("model-b",)),
        ]
    )
    await fleet.start()
    yield fleet
    await fleet.stop()


def named(fleet: Fleet) -> list[str]:
    return [f"emu-{i}={r.url}" for i, r in enumerate(fleet.replicas)]


async def chat(url: str, model: str | None, session: str, stream: bool = False) -> tuple[int, str | None, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": f"hello from {session}"}], "max_tokens": 4}
    if model is not None:
        body["model"] = model
    if stream:
        body["stream"] = True
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": session}) as r,
    ):
        data = await r.text() if stream else await r.json(content_type=None)
        return r.status, r.headers.get("X-Router-Replica"), data


async def known(node: Any, count: int, timeout: float = 10.0) -> None:
    """Until the router's probes have read `count` replicas' models."""
    deadline = time.monotonic() + timeout
    while sum(r.models is not None for r in node.fleet.replicas) < count:
        assert time.monotonic() < deadline, [r.models for r in node.fleet.replicas]
        await asyncio.sleep(0.05)


SERVES = {"model-a": {"emu-0", "emu-1", "emu-3"}, "model-b": {"emu-2", "emu-3"}, "b-lora": {"emu-2"}}


@pytest.mark.parametrize("policy", ["ttft", "affinity", "round_robin"])
async def test_requests_go_only_to_replicas_serving_their_model(
    models_fleet: Fleet, start_router: Callable[..., Any], policy: str
) -> None:
    node, url = await start_router(named(models_fleet), policy=policy, probe_interval_s=0.2)
    await known(node, 4)
    assert node.fleet.find("emu-2").models == {"model-b", "b-lora"}
    for model, allowed in SERVES.items():
        seen = set()
        for i in range(24):
            status, replica, _ = await chat(url, model, f"{model}-{i}", stream=i % 2 == 1)
            assert status == 200, (model, replica)
            seen.add(replica)
        assert seen <= allowed, (model, seen)
        if model != "b-lora":
            assert len(seen) > 1, (model, seen)  # spread over the model's replicas
    # a request naming no model goes anywhere, as before
    answers = [await chat(url, None, f"any-{i}") for i in range(24)]
    assert {status for status, _, _ in answers} == {200}
    assert len({replica for _, replica, _ in answers}) > 2


async def test_a_model_no_replica_serves_gets_the_routers_404(
    models_fleet: Fleet, start_router: Callable[..., Any]
) -> None:
    node, url = await start_router(named(models_fleet), probe_interval_s=0.2, admin_token=TOKEN)
    await known(node, 4)
    async with aiohttp.ClientSession() as s, s.get(url + "/admin/replicas", headers=AUTH) as r:
        rows = {row["id"]: row for row in await r.json()}
    assert rows["emu-2"]["models"] == ["b-lora", "model-b"] and rows["emu-3"]["models"] == ["model-a", "model-b"]
    for stream in (False, True):
        status, replica, body = await chat(url, "model-z", "s", stream=stream)
        assert status == 404 and replica is None  # answered by the router: no replica saw it
        text = body if isinstance(body, str) else str(body)
        assert "model-z" in text and "no replica behind this router serves it" in text
    status, _, body = await chat(url, "model-z", "s")
    assert body["error"]["param"] == "model" and body["error"]["code"] == "model_not_found"
    status, replica, _ = await chat(url, "b-lora", "t")
    assert status == 200 and replica == "emu-2"
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
        # a name no replica serves is `other` (a label per client-chosen name would grow without bound)
        line = 'router_requests_total{key_kind="header",model="other",policy="ttft",replica="none",status="404"} 3.0'
        assert line in metrics and "model-z" not in metrics
        line = 'router_requests_total{key_kind="header",model="b-lora",policy="ttft",replica="emu-2",status="200"} 1.0'
        assert line in metrics
        async with s.get(url + "/admin/route", params={"key": "s", "model": "model-z"}, headers=AUTH) as r:
            explained = await r.json()
        assert explained["replica"] is None and "model-z" in explained["reason"]
        async with s.get(url + "/admin/route", params={"key": "s", "model": "model-b"}, headers=AUTH) as r:
            explained = await r.json()
        assert explained["replica"] in SERVES["model-b"] and explained["model"] == "model-b"
        assert {w["replica"] for w in explained["walk"] if not w["serves_model"]} <= {"emu-0", "emu-1"}
        body = {"model": "model-z", "messages": [{"role": "user", "content": "hi"}]}
        async with s.post(url + "/admin/route", json=body, headers=AUTH) as r:
            explained = await r.json()
        assert explained["replica"] is None and explained["model"] == "model-z"


async def test_without_their_models_known_the_replica_answers_as_before(
    models_fleet: Fleet, start_router: Callable[..., Any]
) -> None:
    """The contrast: with no probes and no pins, the router cannot know, and a replica's own 404 comes back."""
    node, url = await start_router(named(models_fleet), health_checks=False)
    await asyncio.sleep(0.3)
    assert all(r.models is None for r in node.fleet.replicas)
    status, replica, body = await chat(url, "model-z", "s")
    assert status == 404 and replica is not None  # forwarded: the replica refused it
    assert body["error"]["message"] == "The model `model-z` does not exist."


async def test_pinned_models_route_without_probes(models_fleet: Fleet, start_router: Callable[..., Any]) -> None:
    pins = ["emu-2=model-b", "emu-3=model-b", "*=model-a"]
    node, url = await start_router(named(models_fleet), health_checks=False, replica_models=pins)
    assert node.fleet.find("emu-0").models == {"model-a"}
    seen = {(await chat(url, "model-b", f"b-{i}"))[1] for i in range(20)}
    assert seen == {"emu-2", "emu-3"}
    status, replica, _ = await chat(url, "b-lora", "s")  # not pinned anywhere: the router's 404
    assert (status, replica) == (404, None)


async def test_worker_processes_route_by_the_models_the_control_process_reads(
    models_fleet: Fleet, serve_workers: Callable[..., Any]
) -> None:
    served = await serve_workers(named(models_fleet), "--probe-interval-s", "0.2")
    deadline = time.monotonic() + 20
    while (await chat(served.url, "model-z", "s"))[:2] != (404, None):  # until both workers know
        assert time.monotonic() < deadline, "the workers never learnt the replicas' models"
        await asyncio.sleep(0.1)
    workers = set()
    seen = set()
    for i in range(40):
        async with (
            aiohttp.ClientSession() as s,  # a connection each: both workers take some
            s.post(
                served.url + "/v1/chat/completions",
                json={"model": "b-lora", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2},
                headers={"X-Session-ID": f"w{i}"},
            ) as r,
        ):
            assert r.status == 200
            seen.add(r.headers["X-Router-Replica"])
            workers.add(r.headers["X-Router-Worker"])
    assert seen == {"emu-2"} and workers == {"0", "1"}
    assert (await chat(served.url, "model-z", "t"))[:2] == (404, None)


async def test_an_adapter_loaded_but_idle_still_draws_its_new_sessions(
    make_replica: Callable[..., Replica], start_router: Callable[..., Any]
) -> None:
    """vLLM names an adapter in the newest series of lora_requests_info only while it has requests;
    the older series say it ran lately, and it stays in the GPU slots until `max_lora` others have
    run since. So an adapter whose requests have all ended still reads as loaded where it ran, and
    as evicted once enough others have run there."""
    fleet = Fleet(
        [
            make_replica(
                f"emu-{i}",
                EngineConfig(num_blocks=4000, max_loras=2),
                model="model-b",
                adapters=("sql-lora", "x-lora", "y-lora"),
                time_scale=1.0,
            )
            for i in range(3)
        ]
    )
    await fleet.start()
    try:
        node, url = await start_router(named(fleet), policy="affinity", probe_interval_s=0.1)
        await known(node, 3)
        emu2 = node.fleet.find("emu-2")

        async def run_there(model: str) -> None:  # straight to emu-2, to its end
            body = {"model": model, "messages": [{"role": "user", "content": "once"}], "max_tokens": 4}
            target = fleet.replicas[2].url + "/v1/chat/completions"
            async with aiohttp.ClientSession() as s, s.post(target, json=body) as r:
                assert r.status == 200, await r.text()

        async def reads(expected: frozenset[str]) -> None:
            deadline = time.monotonic() + 10
            while emu2.adapters != expected or emu2.engine.running != 0:
                assert time.monotonic() < deadline, (emu2.adapters, emu2.engine)
                await asyncio.sleep(0.05)

        await run_there("sql-lora")
        await reads(frozenset({"sql-lora"}))  # idle, and still loaded
        assert list(fleet.replicas[2].engine.adapters) == ["sql-lora"]  # as the engine has it
        assert node.fleet.find("emu-0").adapters == frozenset()
        drawn = {(await chat(url, "sql-lora", f"a{i}"))[1] for i in range(8)}
        assert drawn == {"emu-2"}
        for other in ("x-lora", "y-lora"):  # two others run there since: sql-lora is evicted
            await run_there(other)
        await reads(frozenset({"x-lora", "y-lora"}))
        assert "sql-lora" not in fleet.replicas[2].engine.adapters
    finally:
        await fleet.stop()


@pytest.mark.parametrize("policy", ["ttft", "affinity"])
async def test_new_sessions_of_an_adapter_go_where_it_is_loaded(
    make_replica: Callable[..., Replica], start_router: Callable[..., Any], policy: str
) -> None:
    """Three replicas serve sql-lora; one is running a request with it (vLLM's lora_requests_info
    says so): new sessions for it go there, while the base model's spread."""
    fleet = Fleet([make_replica(f"emu-{i}", model="model-b", adapters=("sql-lora",), time_scale=1.0) for i in range(3)])
    await fleet.start()
    try:
        node, url = await start_router(named(fleet), policy=policy, probe_interval_s=0.1, admin_token=TOKEN)
        await known(node, 3)
        body = {"model": "sql-lora", "messages": [{"role": "user", "content": "a long report"}], "max_tokens": 2000}
        async with aiohttp.ClientSession() as s:
            long = asyncio.create_task(s.post(fleet.replicas[2].url + "/v1/chat/completions", json=body))
            deadline = time.monotonic() + 10
            while node.fleet.find("emu-2").adapters != {"sql-lora"}:
                assert time.monotonic() < deadline, [r.adapters for r in node.fleet.replicas]
                await asyncio.sleep(0.05)
            assert node.fleet.find("emu-0").adapters == frozenset() and node.fleet.find("emu-2").max_lora == 4
            async with s.get(url + "/admin/replicas", headers=AUTH) as r:
                shown = {row["id"]: (row["adapters"], row["max_lora"]) for row in await r.json()}
            assert shown["emu-2"] == (["sql-lora"], 4)
            adapter = {(await chat(url, "sql-lora", f"a{i}"))[1] for i in range(12)}
            base = {(await chat(url, "model-b", f"b{i}"))[1] for i in range(24)}
            long.cancel()
    finally:
        await fleet.stop()
    assert adapter == {"emu-2"}
    assert len(base) > 1  # the base model is loaded everywhere: no preference
