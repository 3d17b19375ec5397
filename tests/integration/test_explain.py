"""/admin/route explains a request as its route decides it (router.routing.Routing.explain): the
same key, the same decision, nothing counted or remembered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

AUTH = {"Authorization": "Bearer tttttttttttttttt"}


async def test_a_follow_up_to_a_stored_response_is_explained_where_it_goes(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    fleet = await start_fleet(3)
    node, url = await start_router(
        [f"emu-{i}={r.url}" for i, r in enumerate(fleet.replicas)],
        admin_token="tttttttttttttttt",
        health_checks=False,
        bounded_load_floor=1,
        bounded_load_c=1.0,
    )
    async with aiohttp.ClientSession() as http:
        first = {"model": "emulated-llm", "input": "remember this", "max_output_tokens": 6}
        async with http.post(url + "/v1/responses", data=orjson.dumps(first)) as r:
            holder, stored = r.headers["X-Router-Replica"], await r.json()
        follow = {"model": "emulated-llm", "input": "go on", "previous_response_id": stored["id"]}
        replica = node.fleet.find(holder)
        for _ in range(20):  # its replica far busier than the rest: a session would be placed elsewhere
            node.fleet.acquire(replica)
        try:
            inflight = [r.inflight for r in node.fleet.replicas]
            async with http.post(url + "/admin/route", data=orjson.dumps(follow), headers=AUTH) as r:
                explained = await r.json()
            assert [r.inflight for r in node.fleet.replicas] == inflight  # nothing sent, nothing counted
            assert (explained["replica"], explained["reason"], explained["key_kind"]) == (holder, "sticky", "response")
            async with http.post(url + "/v1/responses", data=orjson.dumps(follow)) as r:
                assert r.status == 200 and r.headers["X-Router-Replica"] == explained["replica"]
        finally:
            for _ in range(20):
                node.fleet.release(replica)


async def test_explaining_a_session_moves_nothing(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    fleet = await start_fleet(4)
    node, url = await start_router(
        [f"emu-{i}={r.url}" for i, r in enumerate(fleet.replicas)], admin_token="tttttttttttttttt"
    )
    body = {"model": "emulated-llm", "messages": [{"role": "user", "content": "a long question " * 60}]}
    headers = {"X-Session-ID": "s-1"}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/admin/route", data=orjson.dumps(body), headers=AUTH | headers) as r:
            before = await r.json()
        assert before["sticky"] is None and before["key_kind"] == "header" and before["candidates"]
        async with http.post(
            url + "/v1/chat/completions", data=orjson.dumps(body | {"max_tokens": 4}), headers=headers
        ) as r:
            assert r.status == 200 and r.headers["X-Router-Replica"] == before["replica"]  # as explained
        for _ in range(3):  # asked again and again: the same answer, and no session remembered anew
            async with http.post(url + "/admin/route", data=orjson.dumps(body), headers=AUTH | headers) as r:
                again = await r.json()
            assert (again["replica"], again["sticky"]) == (before["replica"], before["replica"])
    assert node.routing.metrics.followups._value.get() == 0  # explanations are no follow-up turns
