"""router-serve fed by emulated replicas' KV-cache events: both encodings, lost messages, restarts, workers.

The emulator publishes vLLM's events on the same wire (router.emulator.kvevents) and, as vLLM
started as its docs start it, answers render with 403 and serves /tokenize; the router finds its
tokenizer (the emulator's built-in) from /v1/models, so nothing is configured in the router but
the replicas' URLs, as with vLLM.
These run on both ring implementations (the real-vLLM module, tests/integration/test_vllm_events.py,
pins the same behaviour against the real engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from conftest import WORKERS_TOKEN
from waiting import until

from router.emulator.engine import EngineConfig
from router.emulator.kvevents import KvEventsOptions
from router.emulator.server import Fleet
from router.kvevents.mapped import SharedFileError
from router.kvevents.shared import SharedIndexReader, shard_of
from router.node import Node

SYSTEM = {"role": "system", "content": "You answer questions about rivers and the sea. " * 10}


def conversation(n: int, turns: int) -> list[dict[str, str]]:
    messages = [SYSTEM]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Conversation {n}, question {t}: " + "how deep is it? " * 20})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {t} of {n} " * 8})
    return messages


async def chat(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], session: str | None = None
) -> Any:
    headers = {"Content-Type": "application/json"}
    if session:
        headers["X-Session-ID"] = session
    body = {"model": "emulated-llm", "messages": messages, "max_tokens": 4}
    async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def believed(router: Node, n: int, timeout: float = 15.0) -> None:
    """Until the router believes n replicas' events and has found (and checked) the emulator's
    tokenizer, which it does on its own before the first request."""
    truth = router.placement.truth  # type: ignore[union-attr]
    assert router.feed is not None
    models = router.feed.tokens.models
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sure = len(truth.replicas) == n and all(truth.sure(rid) for rid in truth.replicas)
        if sure and "emulated-llm" in models and models["emulated-llm"].tokenizer is not None:
            assert models["emulated-llm"].source == "builtin"
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the events are not believed: {[truth.figures(r) for r in truth.replicas]}, {models}")


async def quiet(router: Node, seconds: float = 0.3) -> None:
    """Until no event message came for `seconds`."""
    truth = router.placement.truth  # type: ignore[union-attr]
    last: object = None
    while True:
        now = [h.seq for rid in sorted(truth.replicas) for h in truth.of(rid)]
        if now == last:
            return
        last = now
        await asyncio.sleep(seconds)


def exact_share(router: Node) -> tuple[float | None, int]:
    events = router.placement.figures()["by_source"]["events"]  # type: ignore[union-attr, index]
    return events["exact_share"], events["answers"]


async def priced_by_events(http: aiohttp.ClientSession, url: str, at_least: int) -> str | None:
    """The router's /metrics once at least `at_least` requests were priced by the events (a worker
    books a request just after its client read its end), else None."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    count = re.search(r'router_prefix_prediction_error_tokens_count\{source="events"\} (\S+)', text)
    return text if count and float(count[1]) >= at_least else None


async def fleet_with_events(start_fleet: Callable[..., Any], n: int = 2, encoding: str = "tagged") -> Fleet:
    config = EngineConfig(num_blocks=64, block_size=16)  # 1,024 tokens a replica: conversations evict
    return await start_fleet(n, config, kv_events=KvEventsOptions(port=0, replay_port=0, encoding=encoding))


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
async def test_sessions_are_priced_by_the_events_and_predicted_exactly(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any], encoding: str
) -> None:
    fleet = await fleet_with_events(start_fleet, 2, encoding)
    router, url = await start_router([r.url for r in fleet.replicas], probe_interval_s=0.2)
    await believed(router, 2)
    async with aiohttp.ClientSession() as http:
        for turn in range(1, 5):
            for n in range(6):
                await chat(http, url, conversation(n, turn), f"river-{n}")
                await quiet(router, 0.2)  # a next turn comes after its events (seconds, in life)
    share, answers = exact_share(router)
    # on this shared 2-core machine an event can still be on its way when the next turn is priced
    # (a turn comes seconds later in life); the probes of test_vllm_events.py are exact, every one
    assert answers == 24 and share is not None and share >= 0.9, (share, answers)
    removed = sum(
        h.figures.removed
        for rid in router.placement.truth.replicas  # type: ignore[union-attr]
        for h in router.placement.truth.of(rid)
    )  # type: ignore[union-attr]
    assert removed > 0  # the engines evicted, and the index followed


async def test_an_answer_that_called_tools_marks_its_conversation_as_coming_back_soon(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    """The router reads, from the answer itself (whole or streamed), whether it called tools; the
    conversations that ended a turn on the replica are kept, those that called tools marked as
    coming back within seconds (router.kvevents.truth)."""
    config = EngineConfig(num_blocks=64, block_size=16)
    fleet = await start_fleet(1, config, kv_events=KvEventsOptions(port=0, replay_port=0), tools=True)
    router, url = await start_router([fleet.replicas[0].url], probe_interval_s=0.2)
    await believed(router, 1)
    tools = {"tools": [{"type": "function", "function": {"name": "read_file"}}], "tool_choice": "required"}
    async with aiohttp.ClientSession() as http:
        for n, extra, stream in ((1, {}, False), (2, tools, False), (3, tools, True), (4, {}, True)):
            body = {"model": "emulated-llm", "messages": conversation(n, 1), "max_tokens": 4, "stream": stream}
            async with http.post(url + "/v1/chat/completions", json={**body, **extra}) as r:
                text = await r.text()
                assert r.status == 200 and ('"tool_calls"' in text) == bool(extra), text
    figures = router.placement.truth.figures(router.fleet.replicas[0].id)  # type: ignore[union-attr]
    assert figures is not None and (figures["returning"], figures["returning_from_tools"]) == (4, 2)


async def test_a_lost_message_is_replayed_and_a_restart_empties(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    fleet = await fleet_with_events(start_fleet, 1)
    replica = fleet.replicas[0]
    router, url = await start_router([replica.url], probe_interval_s=0.2)
    await believed(router, 1)
    holdings = router.placement.truth.of(router.fleet.replicas[0].id)[0]  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as http:
        async with http.post(replica.url + "/emulator/faults", data=orjson.dumps({"kv_events_drop_next": 1})) as r:
            assert r.status == 200, await r.text()
        await chat(http, url, conversation(1, 1), "sea")  # its BlockStored message is lost
        # the next request is priced before the gap shows (its shared system prompt looks cold), and
        # its own message shows the gap, which replay fills
        await chat(http, url, conversation(2, 1), "lake")
        await quiet(router)
        assert holdings.figures.gaps >= 1 and holdings.figures.replayed >= 1 and holdings.sure
        accuracy = router.placement.learnt.events_accuracy  # type: ignore[union-attr]
        exact = accuracy.exact
        await chat(http, url, conversation(1, 2), "sea")  # the lost blocks are known again
        assert accuracy.exact == exact + 1
        async with http.post(replica.url + "/emulator/restart-engine") as r:
            assert r.status == 200, await r.text()
        await chat(http, url, conversation(3, 1), "bay")  # the new engine's first message
        await quiet(router)
        assert holdings.figures.restarts == 1 and holdings.sure
        exact = accuracy.exact
        answer = await chat(http, url, conversation(1, 3), "sea")
        # the restart was seen: only the system prompt (the new engine's first request had it) is held
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] < len(SYSTEM["content"]) // 4
        assert accuracy.exact == exact + 1


async def test_every_worker_routes_from_the_events(
    start_fleet: Callable[..., Any], serve_workers: Callable[..., Any]
) -> None:
    fleet = await fleet_with_events(start_fleet, 2)
    served = await serve_workers([r.url for r in fleet.replicas])
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the control process follows, both workers believe both replicas
            async with http.get(served.url + "/metrics") as r:
                text = await r.text()
            believing = len(re.findall(r"router_kv_events_believed\{.*\} 1\.0", text)) >= 2
            if believing and 'router_tokenizer{model="emulated-llm",source="builtin"} 2.0' in text:  # each worker
                break
            await asyncio.sleep(0.2)
        for turn in range(1, 4):
            for n in range(8):
                await chat(http, served.url, conversation(n, turn), f"w-{n}")

        text = await until(
            lambda: priced_by_events(http, served.url, 24),
            "the 24 requests priced by the events in the workers' merged metrics",
            10,
            0.1,
        )
    count = re.search(r'router_prefix_prediction_error_tokens_count\{source="events"\} (\S+)', text)
    exact = re.search(r'router_prefix_prediction_error_tokens_bucket\{le="0\.5",source="events"\} (\S+)', text)
    below = re.search(r'router_prefix_prediction_error_tokens_bucket\{le="-0\.5",source="events"\} (\S+)', text)
    assert count and exact and below, text[-2000:]
    assert float(count[1]) == 24  # every request, whichever worker took it, priced by the events
    assert (float(exact[1]) - float(below[1])) / float(count[1]) >= 0.95
    # one subscriber on the host: the control process follows the engines into the index in shared
    # memory the workers read; each message reached the router once, not once a worker
    assert Path(f"/dev/shm/{served.shm}-kv.dir").exists() and Path(f"/dev/shm/{served.shm}-kv.roster").exists()
    sent = sum(r.publisher.sent for r in fleet.replicas if r.publisher is not None)

    async def once() -> float | None:  # every message the engines sent, applied once on the host
        async with aiohttp.ClientSession() as http, http.get(served.url + "/metrics") as r:
            lagged = re.search(r"router_kv_event_lag_seconds_count (\S+)", await r.text())
        return float(lagged[1]) if lagged and float(lagged[1]) >= sent else None

    assert sent > 0 and await until(once, f"the {sent} messages applied", 10, 0.1) == sent
    # a worker that dies is replaced by one that reads the same index: it believes at once, no
    # replica is followed twice, and every request it takes is priced by the events
    os.kill(served.pids[0], signal.SIGKILL)
    await asyncio.to_thread(served.line, r"worker 0 \(pid \d+\) exited \(-9\); restarting", 20)
    async with aiohttp.ClientSession() as http:

        async def both() -> bool:  # the new worker found its tokenizer: it serves, reading the index
            async with http.get(served.url + "/metrics") as r:
                return 'router_tokenizer{model="emulated-llm",source="builtin"} 2.0' in await r.text()

        await until(both, "the restarted worker serving", 30, 0.2)
        for n in range(8):
            await chat(http, served.url, conversation(n, 4), f"w-{n}")

        await until(
            lambda: priced_by_events(http, served.url, 32),
            "the 8 requests after the restart priced by the events too",
            10,
            0.1,
        )
    sent = sum(r.publisher.sent for r in fleet.replicas if r.publisher is not None)
    assert await until(once, f"the {sent} messages applied once", 10, 0.1) == sent
    served.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.proc.wait, 20) == 0
    assert not list(Path("/dev/shm").glob(f"{served.shm}-kv*"))  # its files go with it


async def test_followers_beside_the_control_process_each_follow_a_shard_of_the_engines(
    start_fleet: Callable[..., Any], serve_workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """kv_event_followers = 3: the control process and two processes beside it each follow the
    replicas of their shard into the one index both workers read. Every replica is believed and
    every request priced by the events; each message is applied once on the host. A follower
    killed is restarted: it clears what it left, follows its replicas again, and they are believed
    again; the index's files go with the router."""
    fleet = await fleet_with_events(start_fleet, 6)
    ids = sorted(r.url.removeprefix("http://") for r in fleet.replicas)  # (a replica's id: its host and port)
    # the follower killed below: the one beside the control process with more of the replicas
    victim = max((1, 2), key=lambda k: sum(shard_of(rid, 3) == k for rid in ids))
    first = [rid for rid in ids if shard_of(rid, 3) == victim]
    assert first, "six replicas, none followed beside the control process (a chance of 1 in 729)"
    monkeypatch.setenv("ROUTER_KV_EVENT_FOLLOWERS", "3")
    served = await serve_workers([r.url for r in fleet.replicas])
    pids = [int(pid) for pid in served.said(r"kv events: 3 followers \(this process and pids (\d+), (\d+)\)").groups()]
    reader = None
    try:
        deadline = time.monotonic() + 30
        while reader is None and time.monotonic() < deadline:  # (the index is laid out once the router starts)
            with contextlib.suppress(SharedFileError):
                reader = SharedIndexReader(f"{served.shm}-kv")
            await asyncio.sleep(0.1)
        assert reader is not None

        def sure() -> list[str]:  # the replicas the index's roster says are believed, whoever wrote them
            return sorted(rid for row, rid, _ in reader.roster.listed() if reader.roster.rows[row * 48 + 2])

        async def all_believed() -> bool:
            return sure() == ids

        await until(all_believed, "all six replicas believed through the three followers", 30, 0.2)
        async with aiohttp.ClientSession() as http:

            async def tokenizing() -> bool:  # each worker found the model's tokenizer (the replicas' are believed)
                async with http.get(served.url + "/metrics") as r:
                    return 'router_tokenizer{model="emulated-llm",source="builtin"} 2.0' in await r.text()

            await until(tokenizing, "both workers tokenizing", 20, 0.2)
            # the admin API (the control process's) says every replica is followed and believed,
            # whichever process follows it
            auth = {"Authorization": f"Bearer {WORKERS_TOKEN}"}
            async with http.get(served.url + "/admin/replicas", headers=auth) as r:
                rows = {row["id"]: row["kv_events"] for row in await r.json()}
            assert sorted(rows) == ids and all(row["followed"] and row["sure"] for row in rows.values()), rows
            assert all(row["events"]["gaps"] == 0 for row in rows.values()), list(rows.values())
            for turn in range(1, 3):
                for n in range(6):
                    await chat(http, served.url, conversation(n, turn), f"s-{n}")

            text = await until(
                lambda: priced_by_events(http, served.url, 12), "the 12 requests priced by the events", 10, 0.1
            )
            count = re.search(r'router_prefix_prediction_error_tokens_count\{source="events"\} (\S+)', text)
            assert count and float(count[1]) == 12
            sent = sum(r.publisher.sent for r in fleet.replicas if r.publisher is not None)

            async def once() -> float | None:  # every message the engines sent, applied once on the host
                async with http.get(served.url + "/metrics") as r:
                    lagged = re.search(r"router_kv_event_lag_seconds_count (\S+)", await r.text())
                return float(lagged[1]) if lagged and float(lagged[1]) >= sent else None

            assert sent > 0 and await until(once, f"the {sent} messages applied", 10, 0.1) == sent
        # a follower dies: its replicas leave the roster, and come back believed once it is restarted
        os.kill(pids[victim - 1], signal.SIGKILL)
        exited = rf"kv events follower {victim} \(pid \d+\) exited \(-9\); restarting"
        await asyncio.to_thread(served.line, exited, 20)
        await until(lambda: not set(first) & set(sure()), "the dead follower's replicas cleared by its successor", 20)
        await until(all_believed, "its replicas believed again after its restart", 30, 0.2)
        regions = list(Path("/dev/shm").glob(f"{served.shm}-kv-*"))
        assert len(regions) == 6, (regions, first)  # one region a replica: what the dead follower left is gone
    finally:
        if reader is not None:
            reader.close()
    served.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.proc.wait, 20) == 0
    assert not list(Path("/dev/shm").glob(f"{served.shm}-kv*"))
    for pid in pids:  # (the followers stopped with it)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
