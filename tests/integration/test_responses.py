"""The Responses API through the router: a response is stored on the replica that produced it (as
vLLM stores it, in that replica's memory), so a follow-up naming it (`previous_response_id`) must
go there. Without the router a client spreading requests over replicas loses the chain; through
it, through two routers on one Redis, and across a router restart, every follow-up is answered."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from waiting import until

from router.bench.faults import RedisServer
from router.config import load
from router.emulator.server import Faults, Fleet
from router.keys import stored_key
from router.node import Node
from router.proxy.app import build_app
from router.proxy.front_server import FrontRunner


async def ask(
    url: str, text: str, previous: str | None = None, stream: bool = False, **extra: Any
) -> tuple[int, str | None, dict[str, Any]]:
    """One /v1/responses turn: (status, the replica that answered, the response or the error)."""
    body: dict[str, Any] = {"model": "emulated-llm", "input": text, "max_output_tokens": 6, **extra}
    if previous is not None:
        body["previous_response_id"] = previous
    if stream:
        body["stream"] = True
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/responses", data=orjson.dumps(body)) as r:
        replica = r.headers.get("X-Router-Replica") or r.headers.get("X-Replica-Id")
        if not stream or r.status != 200:
            return r.status, replica, await r.json(content_type=None)
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in (await r.read()).split(b"\n\n") if e.strip()]
        kinds = [e.split(b"\n", 1)[0] for e in events]
        assert kinds[0] == b"event: response.created" and kinds[-1] == b"event: response.completed", kinds
        assert all(k == b"event: response.output_text.delta" for k in kinds[1:-1]) and len(kinds) > 2
        last = orjson.loads(events[-1].split(b"data: ", 1)[1])
        return r.status, replica, last["response"]


async def chain(urls: list[str], turns: int = 5) -> list[tuple[str | None, dict[str, Any]]]:
    """A conversation of `turns` turns, each continuing the last by id, turn i sent to urls[i % len]."""
    out: list[tuple[str | None, dict[str, Any]]] = []
    previous = None
    for i in range(turns):
        status, replica, response = await ask(
            urls[i % len(urls)], f"turn {i} of the chain", previous, stream=i % 2 == 1
        )
        assert status == 200, (i, response)
        assert response["previous_response_id"] == previous and response["status"] == "completed"
        previous = response["id"]
        out.append((replica, response))
    return out


async def test_the_emulator_stores_responses_as_vllm_does(start_fleet: Callable[..., Any]) -> None:
    fleet = await start_fleet(2)
    one, other = (r.url for r in fleet.replicas)
    status, _, first = await ask(one, "remember this")
    assert status == 200 and first["id"].startswith("resp_") and first["output"][0]["content"][0]["text"]
    assert first["usage"]["input_tokens"] > 0 and first["usage"]["output_tokens"] == 6
    status, _, second = await ask(one, "and now?", first["id"], stream=True)
    assert status == 200 and second["previous_response_id"] == first["id"]
    # the second turn's prompt starts with the first turn's prompt and reply: cached here
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    status, _, error = await ask(other, "and now?", first["id"])  # another replica never stored it
    assert status == 404 and error["error"]["message"] == f"Response with id '{first['id']}' not found."
    status, _, unstored = await ask(one, "forget this", store=False)
    assert status == 200 and not unstored["store"]
    assert (await ask(one, "so?", unstored["id"]))[0] == 404


async def test_without_the_router_a_chain_breaks(start_fleet: Callable[..., Any]) -> None:
    fleet = await start_fleet(3)
    with pytest.raises(AssertionError):
        await chain([r.url for r in fleet.replicas])  # a client taking the replicas in turn


@pytest.mark.parametrize("policy", ["ttft", "round_robin"])
async def test_through_the_router_every_follow_up_finds_its_response(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any], policy: str
) -> None:
    fleet = await start_fleet(4)
    _, url = await start_router([r.url for r in fleet.replicas], policy=policy, health_checks=False)
    chains = [await chain([url]) for _ in range(4)]
    for turns in chains:
        assert len({replica for replica, _ in turns}) == 1  # every turn where the first was stored
        assert all(r["usage"]["input_tokens_details"]["cached_tokens"] > 0 for _, r in turns[1:])
    # round_robin spreads first turns; every chain stays put all the same
    if policy == "round_robin":
        assert len({turns[0][0] for turns in chains}) > 1
    # the router counted the usage the Responses API reports
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        metrics = await r.text()
    cached = sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("router_cached_tokens_total{")
    )
    assert cached > 0


async def test_a_follow_up_stays_on_a_busy_replica_and_is_not_retried_elsewhere(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    fleet = await start_fleet(3)
    node, url = await start_router(
        [f"emu-{i}={r.url}" for i, r in enumerate(fleet.replicas)],
        policy="affinity",
        health_checks=False,
        bounded_load_floor=1,
        bounded_load_c=1.0,
    )
    status, holder, first = await ask(url, "start")
    assert status == 200 and holder is not None
    replica = node.fleet.find(holder)
    node.fleet.acquire(replica)  # as if it were far busier than the rest
    for _ in range(20):
        node.fleet.acquire(replica)
    try:
        status, again, _ = await ask(url, "next", first["id"])
        assert (status, again) == (200, holder)  # a session would spill; a stored response cannot
    finally:
        for _ in range(21):
            node.fleet.release(replica)
    await fleet.replicas[int(holder.split("-")[1])].crash()
    status, again, error = await ask(url, "after the crash", first["id"])
    assert status in (502, 503) and again is None, error  # its holder is gone: no other replica has it


async def in_redis(router: Node, key: bytes, replica: str | None) -> bool:
    """The session records in Redis say `replica` served `key` last (`router` has no write of its own for it)."""
    assert router.redis is not None
    found = await router.redis.sessions.lookup(key)
    return found is not None and found[0] == replica


async def test_a_chain_through_two_routers_on_redis(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any], redis_server: RedisServer
) -> None:
    fleet = await start_fleet(4)
    named = [f"emu-{i}={r.url}" for i, r in enumerate(fleet.replicas)]
    settings = {"state": redis_server.url, "health_checks": False, "rebalance": False}
    a, url_a = await start_router(named, **settings)
    b, url_b = await start_router(named, **settings)
    await until(lambda: a.redis.online and b.redis.online, "both routers on Redis")  # type: ignore[union-attr]
    previous = None
    replica = None
    where = set()
    for i in range(5):
        if i:  # session writes reach Redis every 100 ms: until this turn's router finds the last answer there
            key = stored_key(previous, a.config.max_key_bytes)  # type: ignore[arg-type]
            await until(partial(in_redis, (a, b)[i % 2], key, replica), f"the answer to turn {i - 1} in Redis")
        status, replica, response = await ask((url_a, url_b)[i % 2], f"turn {i}", previous, stream=i == 3)
        assert status == 200, (i, response)
        previous = response["id"]
        where.add(replica)
    assert len(where) == 1


async def serve(config: Any) -> tuple[web.AppRunner, str]:
    runner = FrontRunner(build_app(Node(config)), config, lambda: False, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def test_a_chain_goes_on_across_a_router_restart(start_fleet: Callable[..., Any], tmp_path: Path) -> None:
    fleet = await start_fleet(4)
    named = [f"emu-{i}={r.url}" for i, r in enumerate(fleet.replicas)]
    config = load(None, {}, {"replicas": named, "state": f"file:{tmp_path}", "health_checks": False})
    runner, url = await serve(config)
    try:
        first = await chain([url], turns=2)
    finally:
        await runner.cleanup()  # saves on the way down
    runner, url = await serve(config)
    try:
        previous = first[-1][1]["id"]
        for i in range(3):
            status, replica, response = await ask(url, f"after the restart {i}", previous)
            assert (status, replica) == (200, first[0][0]), response
            previous = response["id"]
    finally:
        await runner.cleanup()


async def test_a_stored_responses_own_operations_reach_its_replica(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    fleet = await start_fleet(4)
    _, url = await start_router([r.url for r in fleet.replicas], health_checks=False)
    status, holder, first = await ask(url, "keep this")
    assert status == 200
    async with aiohttp.ClientSession() as s:
        for _ in range(4):  # wherever the ring would have sent the id, it goes to its holder
            async with s.get(url + f"/v1/responses/{first['id']}") as r:
                assert r.status == 200 and r.headers["X-Router-Replica"] == holder
                assert (await r.json())["output_text"] == first["output"][0]["content"][0]["text"]
        async with s.delete(url + f"/v1/responses/{first['id']}") as r:
            assert r.status == 200 and (await r.json())["deleted"]
        async with s.get(url + f"/v1/responses/{first['id']}") as r:
            assert r.status == 404  # the replica forgot it
        async with s.get(url + "/v1/responses/resp_never") as r:
            body = await r.json()
            assert r.status == 404 and "not known to this router" in body["error"]["message"]


async def test_a_responses_stream_that_breaks_ends_with_the_apis_own_error_event(
    make_replica: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    """A Responses stream cut mid-way cannot be continued elsewhere (that API has no way to continue
    a reply, and a stored response lives on the replica that broke): the client gets the API's
    `error` event, numbered after the last event it got, and no chat-style `[DONE]`."""
    fleet = Fleet([make_replica(f"emu-{i}", faults=Faults(drop_after=3)) for i in range(2)])
    await fleet.start()
    try:
        _, url = await start_router([r.url for r in fleet.replicas], health_checks=False)
        body = {"model": "emulated-llm", "input": "a long answer", "max_output_tokens": 40, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/responses", data=orjson.dumps(body)) as r:
            assert r.status == 200
            raw = await r.read()
    finally:
        await fleet.stop()
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    kinds = [e.split(b"\n", 1)[0] for e in events]
    assert kinds == [b"event: response.created", *[b"event: response.output_text.delta"] * 2, b"event: error"], kinds
    error = orjson.loads(events[-1].split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["sequence_number"] == 3 and error["param"] is None
    assert error["code"] == "upstream_error" and error["error"]["message"] == error["message"]
    assert b"[DONE]" not in raw


async def test_a_tenant_reads_deletes_and_continues_only_its_own_stored_responses(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any], tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        "".join(
            f'[[keys]]\nid = "{t}"\ntenant = "{t}"\nsha256 = "{hashlib.sha256(f"sk-{t}".encode()).hexdigest()}"\n'
            for t in ("alice", "bob")
        )
    )
    fleet = await start_fleet(2)
    _, url = await start_router(
        [r.url for r in fleet.replicas], health_checks=False, client_keys_file=str(keys), admin_token="a" * 20
    )
    alice, bob = ({"Authorization": f"Bearer sk-{t}"} for t in ("alice", "bob"))
    body = {"model": "emulated-llm", "input": "a secret of alice's", "max_output_tokens": 6}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/responses", json=body, headers=alice) as r:
            assert r.status == 200
            rid = (await r.json())["id"]
        # another tenant's key: the id is not known to it, whatever it asks
        for method in ("GET", "DELETE"):
            async with s.request(method, url + f"/v1/responses/{rid}", headers=bob) as r:
                assert r.status == 404 and "not known" in (await r.json())["error"]["message"]
        follow = {**body, "input": "and then?", "previous_response_id": rid}
        async with s.post(url + "/v1/responses", json=follow, headers=bob) as r:
            error = (await r.json())["error"]
            assert r.status == 404 and error["code"] == "previous_response_not_found", error
            assert error["param"] == "previous_response_id"
        # its own tenant still has it all
        async with s.get(url + f"/v1/responses/{rid}", headers=alice) as r:
            assert r.status == 200 and (await r.json())["id"] == rid
        async with s.post(url + "/v1/responses", json=follow, headers=alice) as r:
            assert r.status == 200 and (await r.json())["previous_response_id"] == rid
