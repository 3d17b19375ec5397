"""Prefill/decode disaggregation through the router, on emulated replicas that speak vLLM's
hand-off: a long prompt is prefilled on a prefill replica and decoded on the route's decode
replica (the decode side's transfer count grows), a short one is served there alone, and failures
of either side lose no request.

The router introduces each prefill replica to each decode replica before a client's request is
split across them (router.pools.Pairs); those introductions are transfers too, so a test counts
the transfers since its router's pairs met (`introduced`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import orjson
from waiting import until

from router.config import ReplicaSpec
from router.emulator.engine import EngineConfig
from router.emulator.server import Fleet
from router.node import Node

LONG = "the quick brown fox jumps over the lazy dog " * 80  # about 900 tokens
SHORT = "hello there"


def named(fleet: Fleet, prefix: str) -> list[str]:
    return [f"{prefix}{i}={r.url}" for i, r in enumerate(fleet.replicas)]


async def chat(
    url: str, content: str | list[str], session: str, stream: bool = False, max_tokens: int = 6
) -> tuple[int, Any, str]:
    turns = [content] if isinstance(content, str) else content  # user, assistant, user, ...
    messages = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(turns)]
    body = {"model": "emulated-llm", "messages": messages, "max_tokens": max_tokens}
    body["stream"] = stream
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers={"X-Session-ID": session}) as r,
    ):
        data = await r.read()
        return r.status, data if stream else orjson.loads(data), r.headers.get("X-Router-Replica", "")


BEFORE: dict[str, tuple[float, float]] = {}  # a decode replica's transfers when its router's pairs had met


async def transfers(replica: Any) -> tuple[float, float]:
    """A decode replica's transfers, and those that failed, since its router's pairs met."""
    async with aiohttp.ClientSession() as http, http.get(replica.url + "/metrics") as r:
        text = await r.text()
    done = failed = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:nixl_xfer_time_seconds_count"):
            done = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:nixl_num_failed_transfers_total"):
            failed = float(line.rsplit(" ", 1)[1])
    before = BEFORE.get(replica.url, (0.0, 0.0))
    return done - before[0], failed - before[1]


async def introduced(node: Node, decode: Fleet, pairs: int) -> None:
    """Wait until the router's `pairs` pairs have met, then count the decode replicas' transfers from there."""
    await until(lambda: node.pairs is not None and len(node.pairs.met) >= pairs, "the pairs to meet", 10.0)
    for d in decode.replicas:
        BEFORE.pop(d.url, None)
        BEFORE[d.url] = await transfers(d)


async def transferred(fleet: Fleet) -> float:
    """KV transfers done by a fleet's decode replicas."""
    return sum([(await transfers(d))[0] for d in fleet.replicas])


async def disagg(start_fleet, start_router, config: EngineConfig | None = None, **settings: Any):  # type: ignore[no-untyped-def]
    # prefill replicas of a given engine run in real time (the router's model of their queue is in seconds)
    prefill = await start_fleet(2, config, time_scale=1.0) if config is not None else await start_fleet(2)
    decode = await start_fleet(2)
    node, url = await start_router([], prefill=named(prefill, "p"), decode=named(decode, "d"), **settings)
    if settings.get("disagg_introduce", True):
        await introduced(node, decode, 4)
    return prefill, decode, node, url


async def test_a_long_prompt_is_prefilled_apart_and_decoded_on_its_route(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    _, decode, node, url = await disagg(start_fleet, start_router, admin_token="tttttttttttttttt")
    admin = {"Authorization": "Bearer tttttttttttttttt"}
    async with aiohttp.ClientSession() as http, http.get(url + "/admin/replicas", headers=admin) as r:
        listed = await r.json()
    assert [(r["id"], r["role"]) for r in listed] == [
        ("d0", "decode"),
        ("d1", "decode"),
        ("p0", "prefill"),
        ("p1", "prefill"),
    ]
    assert [r.role for r in node.fleet.replicas] == ["decode", "decode"]
    assert [r.role for r in node.pools[1].fleet.replicas] == ["prefill", "prefill"]
    status, answer, replica = await chat(url, LONG, "s1")
    assert status == 200 and answer["usage"]["completion_tokens"] == 6 and replica in ("d0", "d1")
    d = decode.replicas[int(replica[1])]
    assert await transfers(d) == (1.0, 0.0)  # its prompt's KV came from a prefill replica
    assert sum(r.requests for r in node.pools[1].fleet.replicas) == 1
    assert sum(r.prompt_tokens for r in node.pools[1].fleet.replicas) == answer["usage"]["prompt_tokens"]
    # the conversation's next turn: its decode replica holds its history, what is left is short,
    # so it is served there alone (the prefix index's prediction)
    status, _, again = await chat(url, [LONG, answer["choices"][0]["message"]["content"], "and then?"], "s1")
    assert status == 200 and again == replica and await transfers(d) == (1.0, 0.0)
    # streamed: the answer is relayed as any other
    status, streamed, other = await chat(url, "another document: " + LONG, "s2", stream=True)
    assert status == 200 and streamed.rstrip().endswith(b"data: [DONE]")
    assert (await transfers(decode.replicas[int(other[1])]))[0] == 1.0 + (other == replica)
    # a short prompt is not worth a transfer: its decode replica serves it alone
    status, _, _ = await chat(url, SHORT, "s3")
    assert status == 200 and sum(r.requests for r in node.pools[1].fleet.replicas) == 2
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'router_disagg_requests_total{mode="split"} 2.0' in text
    assert 'router_disagg_requests_total{mode="alone"} 2.0' in text
    # each replica's role, and the prefill replicas in the per-replica gauges too
    for rid, role in (("d0", "decode"), ("d1", "decode"), ("p0", "prefill"), ("p1", "prefill")):
        assert f'router_replica_role{{replica="{rid}",role="{role}"}} 1.0' in text
        assert f'router_replica_score{{replica="{rid}"}}' in text


async def test_a_prefill_replica_down_is_skipped_and_with_none_decode_recomputes(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    prefill, decode, _, url = await disagg(start_fleet, start_router, health_checks=False)
    await prefill.replicas[0].crash()
    for i in range(4):  # whichever prefill replica a prompt's blocks choose, the live one prefills it
        status, _, _ = await chat(url, f"{i} {LONG}", f"a{i}")
        assert status == 200
    assert await transferred(decode) == 4
    await prefill.replicas[1].crash()
    status, answer, _ = await chat(url, "x " + LONG, "b")
    assert status == 200 and answer["usage"]["completion_tokens"] == 6  # decoded alone, the prompt recomputed
    assert await transferred(decode) == 4


async def test_a_failed_transfer_is_recomputed_and_a_dead_decode_is_passed_over(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    # (no introductions: a pair whose transfer failed is introduced again, and these prefill
    # replicas lose every lease, the introductions' too; test_a_pair_that_fails_a_transfer_...)
    prefill, decode, node, url = await disagg(start_fleet, start_router, health_checks=False, disagg_introduce=False)
    # the prefill replicas lose their KV between prefill and decode: the transfer fails, the decode recomputes
    for p in prefill.replicas:
        p.lease_s = -1.0
    status, answer, replica = await chat(url, LONG, "c")
    assert status == 200 and answer["usage"]["completion_tokens"] == 6
    assert (await transfers(decode.replicas[int(replica[1])]))[1] == 1.0
    # streamed, the decode replica answers 200, its opening event, then an error event (as vLLM
    # does under its "fail" policy): the router holds the opening, sees the error, recomputes
    status, streamed, replica = await chat(url, "streamed: " + LONG, "c2", stream=True)
    assert status == 200 and b'"error"' not in streamed and streamed.rstrip().endswith(b"data: [DONE]")
    assert streamed.count(b'"role":"assistant"') == 1 and streamed.count(b'"finish_reason":"length"') == 1
    assert sum([(await transfers(d))[1] for d in decode.replicas]) == 2.0
    for p in prefill.replicas:
        p.lease_s = 30.0
    # a decode replica that is gone before its first byte: the next one decodes with the same lease
    owner = next(f"k{i}" for i in range(100) if node.fleet.ring.lookup(f"k{i}".encode()) == 0)
    before = await transfers(decode.replicas[1])
    await decode.replicas[0].crash()
    status, answer, replica = await chat(url, LONG, owner)
    assert status == 200 and replica == "d1"
    assert await transfers(decode.replicas[1]) == (before[0] + 1, before[1])
    assert sum(r.requests for r in node.pools[1].fleet.replicas) == 3  # no second prefill for it


async def test_prefill_replicas_serve_whole_when_no_decode_replica_can(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    """Both decode replicas drained (out of routing): a request is not refused while the prefill
    replicas, engines that can serve as well as prefill, are up; it is served whole by one of them,
    and once a decode replica is back, the next request is split again."""
    _, decode, node, url = await disagg(start_fleet, start_router, health_checks=False)
    for replica in ("d0", "d1"):
        await node.membership.drain(replica, remove=False)
    status, answer, replica = await chat(url, LONG, "w")
    assert status == 200 and replica in ("p0", "p1") and answer["usage"]["completion_tokens"] == 6
    assert await transferred(decode) == 0 and sum(r.requests for r in node.pools[1].fleet.replicas) == 1
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'router_disagg_requests_total{mode="alone"} 1.0' in text
    # counted as any request served, on the prefill replica that served it
    served = [line for line in text.splitlines() if line.startswith("router_requests_total{")]
    assert any(f'replica="{replica}"' in line and 'status="200"' in line for line in served), served
    # a decode replica back (removed, and added again): split again, the prefill pool prefilling
    node.membership.remove("d0")
    await node.membership.add(ReplicaSpec("d0", decode.replicas[0].url, "decode"))
    await introduced(node, decode, 2)  # (met again, if a round forgot it while it was out of routing)
    status, _, replica = await chat(url, "again: " + LONG, "w2")
    assert status == 200 and replica == "d0" and await transferred(decode) == 1


async def test_no_client_request_pays_a_pair_s_first_handshake(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    """A decode replica's first read of a prefill engine waits for their handshake (2 s here, as
    NIXL's costs seconds): the router's own introductions pay it. A long prompt that comes before
    its decode replica has met any prefill replica is served there whole; once pairs have met,
    long prompts are split, and no client's request waited for a handshake."""
    prefill = await start_fleet(2)
    decode = await start_fleet(2, EngineConfig(kv_handshake_s=200.0))  # engine seconds: 2 s at the fleet's pace
    node, url = await start_router([], prefill=named(prefill, "p"), decode=named(decode, "d"), health_checks=False)
    status, answer, _ = await chat(url, "early " + LONG, "early")
    assert status == 200 and answer["usage"]["completion_tokens"] == 6
    assert node.pairs is not None and not node.pairs.met  # answered while the introductions wait
    await introduced(node, decode, 4)
    for i in range(4):
        status, answer, _ = await chat(url, f"{i} {LONG}", f"s{i}")
        assert status == 200 and answer["usage"]["completion_tokens"] == 6
    assert await transferred(decode) == 4
    waited = [body for d in decode.replicas for body in d.handshake_waits]
    assert len(waited) == 4 and all("introduces a prefill replica" in body["prompt"] for body in waited), waited
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'router_disagg_requests_total{mode="cold"} 1.0' in text
    assert 'router_disagg_requests_total{mode="split"} 4.0' in text
    assert 'router_disagg_pair_meetings_total{outcome="met"} 4.0' in text
    assert 'router_disagg_pair_meeting_seconds_bucket{le="1.0"} 0.0' in text  # each paid its handshake


async def test_a_prefill_replica_busy_with_a_long_prompt_is_passed_over(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    # prefill replicas at 4,000 tokens a second, in real time, as the router expects them: the huge
    # prompt (~16,000 tokens) keeps one busy for about 4 s, a document (~900) another for 0.2 s
    config = EngineConfig(num_blocks=4000, prefill_tokens_per_s=4000)
    _, _, node, url = await disagg(start_fleet, start_router, config, prefill_tokens_per_s=4000)
    huge = asyncio.create_task(chat(url, "a huge document: " + LONG * 18, "huge"))
    for _ in range(200):
        busy = [r for r in node.pools[1].fleet.replicas if r.inflight]
        if busy:
            break
        await asyncio.sleep(0.01)
    assert len(busy) == 1
    idle = next(r for r in node.pools[1].fleet.replicas if r is not busy[0])
    # whichever replica their leading blocks would choose, the prefill queue there sends them to the idle one
    for i in range(4):
        status, _, _ = await chat(url, f"document {i}: " + LONG, f"q{i}")
        assert status == 200
    assert (busy[0].requests, idle.requests) == (1, 4)
    status, _, _ = await huge
    assert status == 200
    # a question on the huge document goes to the decode replica that holds it, which serves it alone
    status, _, _ = await chat(url, "a huge document: " + LONG * 18 + " and a question", "huge-2")
    assert status == 200 and (busy[0].requests, idle.requests) == (1, 4)


async def test_a_split_request_s_legs_are_measured_logged_and_on_the_console(  # type: ignore[no-untyped-def]
    start_fleet, start_router, caplog
) -> None:
    _, decode, _, url = await disagg(
        start_fleet,
        start_router,
        admin_token="tttttttttttttttt",
        log_requests=True,
        console_interval_s=0.1,
        probe_interval_s=0.2,
    )
    admin = {"Authorization": "Bearer tttttttttttttttt"}
    with caplog.at_level(logging.INFO, logger="router.access"):
        for i, stream in enumerate((False, True)):
            status, _, _ = await chat(url, f"{i} {LONG}", f"l{i}", stream=stream, max_tokens=20)
            assert status == 200
        status, _, _ = await chat(url, SHORT, "l2")
        assert status == 200
    lines = [orjson.loads(record.getMessage()) for record in caplog.records if record.name == "router.access"]
    split, whole = lines[:2], lines[2]
    for line in split:  # each leg of a split request, in its access-log line
        assert line["prefill_replica"] in ("p0", "p1") and line["replica"] in ("d0", "d1")
        assert line["prefill_ms"] > 0 and line["transfer_ms"] > 0 and line["decode_ms"] > 0
        # the legs are the request: its first byte came after the prefill and the transfer
        assert line["ttft_ms"] >= line["prefill_ms"] + line["transfer_ms"] - 1
        assert abs(line["ttft_ms"] + line["decode_ms"] - line["e2e_ms"]) < 5
    assert "prefill_ms" not in whole and "transfer_ms" not in whole  # served whole
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        for leg in ("prefill", "transfer", "decode"):
            assert f'router_disagg_leg_seconds_count{{leg="{leg}"}} 2.0' in text
        # the console: every replica with its role, a decode replica's transfers as its engine
        # counts them, and the legs' means over the last window
        deadline = time.monotonic() + 10
        while True:
            async with http.get(url + "/console/api/state", headers=admin) as r:
                state = await r.json()
            rows = {row["id"]: row for row in state["replicas"]}
            legs = state["points"][-1]["legs"] if state["points"] else {}
            if any("transfer_ms" in row for row in rows.values()) and legs.get("decode"):
                break
            assert time.monotonic() < deadline, (rows, state["points"][-1:])
            await asyncio.sleep(0.1)
    roles = {i: row["role"] for i, row in rows.items()}
    assert roles == {"d0": "decode", "d1": "decode", "p0": "prefill", "p1": "prefill"}
    for i, d in enumerate(decode.replicas):
        done, failed = await transfers(d)
        if done:
            assert rows[f"d{i}"]["transfer_ms"] > 0 and rows[f"d{i}"]["failed_transfers"] == failed
    assert all(legs[leg] > 0 for leg in ("prefill", "transfer", "decode"))
    assert state["points"][-1]["split"] == round(2 / 3, 4)


async def test_prefill_replicas_found_by_discovery_join_and_leave(start_fleet, start_router, tmp_path) -> None:  # type: ignore[no-untyped-def]
    prefill, decode = await start_fleet(2), await start_fleet(2)
    source, decoders = tmp_path / "prefill.txt", tmp_path / "decode.txt"
    source.write_text(f"p0={prefill.replicas[0].url}\n")
    decoders.write_text("\n".join(named(decode, "d")) + "\n")
    node, url = await start_router(
        [],
        discovery=f"file:{decoders}",
        prefill_discovery=f"file:{source}",
        discovery_interval_s=0.1,
        health_checks=False,
    )
    deadline = time.monotonic() + 5
    while len(node.fleet.replicas) < 2:  # the replicas `discovery` finds decode: they have prefill replicas
        assert time.monotonic() < deadline, "no decode replicas found"
        await asyncio.sleep(0.05)
    assert [r.role for r in node.fleet.replicas] == ["decode", "decode"]

    async def listed() -> list[str]:
        deadline = time.monotonic() + 5
        while not node.pools[1].fleet.replicas:
            assert time.monotonic() < deadline, "no prefill replica found"
            await asyncio.sleep(0.05)
        return [r.id for r in node.pools[1].fleet.replicas]

    assert await listed() == ["p0"] and node.pools[1].fleet.replicas[0].role == "prefill"
    await introduced(node, decode, 2)
    status, _, _ = await chat(url, "1 " + LONG, "s1")
    assert status == 200 and node.pools[1].fleet.find("p0").requests == 1  # split, prefilled on p0
    # p0 is gone from the source and p1 is there: the next long prompt is prefilled on p1
    source.write_text(f"# the prefill replicas' service\np1={prefill.replicas[1].url}\n")
    deadline = time.monotonic() + 5
    while [r.id for r in node.pools[1].fleet.replicas] != ["p1"]:
        assert time.monotonic() < deadline, [r.id for r in node.pools[1].fleet.replicas]
        await asyncio.sleep(0.05)
    await until(lambda: node.pairs is not None and {p for p, _ in node.pairs.met} == {"p1"}, "p1 to meet", 10.0)
    await introduced(node, decode, 2)  # p0's pairs forgotten, p1's met
    status, _, _ = await chat(url, "2 " + LONG, "s2")
    assert status == 200 and node.pools[1].fleet.find("p1").requests == 1
    assert await transferred(decode) == 1
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'router_replica_role{replica="p1",role="prefill"} 1.0' in text
    assert 'replica="p0"' not in text.replace('router_requests_total{replica="p0"', "")  # p0's gauges went


async def test_worker_processes_split_and_the_admin_api_shows_prefill_replicas_probed(  # type: ignore[no-untyped-def]
    start_fleet, serve_workers
) -> None:
    prefill, decode = await start_fleet(1), await start_fleet(2)
    flags = [a for spec in named(prefill, "p") for a in ("--prefill", spec)]
    flags += [a for spec in named(decode, "d") for a in ("--decode", spec)]
    served = await serve_workers([], *flags, "--probe-interval-s", "0.2")

    async def met() -> bool:  # each worker introduces its pairs (two each): the workers' counts merged
        async with aiohttp.ClientSession() as http, http.get(served.url + "/metrics") as r:
            return 'router_disagg_pair_meetings_total{outcome="met"} 4.0' in await r.text()

    await until(met, "each worker's pairs to meet", 15.0, every=0.2)
    for d in decode.replicas:
        BEFORE[d.url] = await transfers(d)
    for i in range(2):
        status, answer, _ = await chat(served.url, f"{i} {LONG}", f"w{i}")
        assert status == 200 and answer["usage"]["completion_tokens"] == 6
    assert await transferred(decode) == 2  # split in whichever worker took it
    auth = {"Authorization": "Bearer workers-test-token"}
    deadline = time.monotonic() + 15
    async with aiohttp.ClientSession() as http:
        while True:  # the admin API's process probes the prefill replicas too
            async with http.get(served.url + "/admin/replicas", headers=auth) as r:
                rows = {row["id"]: row for row in await r.json()}
            if rows["p0"]["engine"]["kind"] == "emulator":
                break
            assert time.monotonic() < deadline, rows["p0"]
            await asyncio.sleep(0.1)
        async with http.get(served.url + "/metrics") as r:
            text = await r.text()
    assert rows["p0"]["role"] == "prefill" and rows["p0"]["inputs"]["probe_ok"] is True
    assert 'router_disagg_requests_total{mode="split"} 2.0' in text  # the workers' counts merged
    assert 'router_replica_role{replica="p0",role="prefill"} 1.0' in text


async def served_on_d0_both_ways(url: str, session: str) -> None:
    """A long prompt answered whole by d0, then streamed to its end, neither with an error."""
    for stream in (False, True):
        status, answer, replica = await chat(url, f"{stream} {LONG}", f"{session}{stream}", stream=stream)
        assert status == 200 and replica == "d0"
        if stream:
            assert answer.rstrip().endswith(b"data: [DONE]") and b'"error"' not in answer
        else:
            assert answer["usage"]["completion_tokens"] == 6


async def test_a_decode_whose_transfer_hangs_is_recomputed_not_refused(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    # on real vLLM a read from a prefill replica that died between the legs can hang with no error;
    # the only decode replica here hangs so on its transfer, past the router's first-byte time-out
    prefill, decode = await start_fleet(1), await start_fleet(1)
    node, url = await start_router(  # (without introductions, which would hang as well)
        [],
        prefill=named(prefill, "p"),
        decode=named(decode, "d"),
        health_checks=False,
        first_byte_timeout_s=1,
        disagg_introduce=False,
    )
    d = decode.replicas[0]

    async def hung(params: Any, prompt_tokens: int) -> int | None:
        await asyncio.sleep(30)
        return None

    d._pull_kv = hung  # type: ignore[method-assign]
    await served_on_d0_both_ways(url, "h")  # recomputed there, whole
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'router_disagg_requests_total{mode="recomputed"} 2.0' in text
    assert sum(r.requests for r in node.pools[1].fleet.replicas) == 2  # prefilled once each, not again


async def test_a_split_stream_closed_unanswered_is_recomputed_not_refused(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    # a decode replica that answers a split stream's head, then closes it before its first event
    # (a reset, not a 5xx): with one decode replica there is no other to read the lease, and the
    # router answered 502; it recomputes there. (A CI run on vLLM 0.32's CPU build, one decode
    # replica, answered a client 502, most likely so: there a split decode's read began 0.2-60 s
    # after its engine scheduled it, often after the prefill's lease had run out.)
    prefill, decode = await start_fleet(1), await start_fleet(1)
    node, url = await start_router(
        [], prefill=named(prefill, "p"), decode=named(decode, "d"), health_checks=False, disagg_introduce=False
    )
    d = decode.replicas[0]
    pull, cut = d._pull_kv, d._cut

    async def reads_then_cuts(params: Any, prompt_tokens: int) -> int | None:
        d.faults.drop_after = 0  # this stream is closed before its first event
        return await pull(params, prompt_tokens)

    def cut_once(request: Any) -> None:
        d.faults.drop_after = None  # (the recompute that follows is not)
        cut(request)

    d._pull_kv, d._cut = reads_then_cuts, cut_once  # type: ignore[method-assign]
    status, answer, replica = await chat(url, LONG, "r", stream=True)
    assert status == 200 and replica == "d0", answer[:300]
    assert answer.rstrip().endswith(b"data: [DONE]") and b'"error"' not in answer
    assert answer.count(b'"role":"assistant"') == 1 and answer.count(b'"finish_reason":"length"') == 1
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'router_disagg_requests_total{mode="recomputed"} 1.0' in text
    assert sum(r.requests for r in node.pools[1].fleet.replicas) == 1  # prefilled once, not again


async def test_a_decode_whose_read_begins_after_the_lease_is_recomputed(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    # vLLM 0.32's CPU build here began a split decode's read 0.2-60 s after scheduling it, often
    # after the prefill's lease ran out: the emulator's decode replica begins its read 1 s late
    # (kv_read_delay_s, engine seconds at the fleet's pace), the prefill replica holds its KV 0.5 s
    prefill, decode = await start_fleet(1), await start_fleet(1, EngineConfig(kv_read_delay_s=100.0))
    node, url = await start_router(
        [], prefill=named(prefill, "p"), decode=named(decode, "d"), health_checks=False, disagg_introduce=False
    )
    prefill.replicas[0].lease_s = 0.5
    await served_on_d0_both_ways(url, "late")
    assert (await transfers(decode.replicas[0]))[1] == 2.0  # both reads found the lease gone, as vLLM counts
    # read within the lease, it is a split like any other
    prefill.replicas[0].lease_s = 30.0
    status, _, _ = await chat(url, "in time: " + LONG, "late-ok")
    assert status == 200 and await transfers(decode.replicas[0]) == (1.0, 2.0)
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'router_disagg_requests_total{mode="recomputed"} 2.0' in text
    assert 'router_disagg_requests_total{mode="split"} 3.0' in text
    assert sum(r.requests for r in node.pools[1].fleet.replicas) == 3  # prefilled once each, not again


async def test_with_prefill_anywhere_a_drained_replica_s_sessions_take_their_kv_where_they_move(  # type: ignore[no-untyped-def]
    start_fleet, start_router
) -> None:
    """A drain moves a conversation to its ring owner, warmed first: with every replica able to
    prefill for another, its warm-up is a split whose prefill side is the drained replica (nearly
    all cache there), so the new replica reads the conversation's KV instead of computing it, and
    its next turn finds it cached there."""
    fleet = await start_fleet(2)
    token = "moved-kv-admin-token"
    node, url = await start_router(
        [r.url for r in fleet.replicas], prefill_anywhere=True, health_checks=False, admin_token=token
    )
    await introduced(node, fleet, 2)
    history = ["first: " + LONG, "an answer"]
    status, _, home = await chat(url, history[0], "x")
    assert status == 200
    other = next(r for r in node.fleet.replicas if r.id != home)
    emulated = {r.id: e for r, e in zip(node.fleet.replicas, fleet.replicas, strict=True)}
    before = await transfers(emulated[other.id])
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/admin/replicas/{home}/drain", headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        assert r.status == 200 and (await r.json())["sessions_to_move"] == 1
    await until(lambda: node.sessions.get(b"x") == other.id, "the session moved, warmed")
    assert (await transfers(emulated[other.id]))[0] == before[0] + 1  # its warm-up read the KV from home
    status, answer, replica = await chat(url, [*history, "and then?"], "x")
    assert status == 200 and replica == other.id
    details = answer["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] >= answer["usage"]["prompt_tokens"] - 64  # all but the new turn's blocks
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'router_warmup_requests_total{result="moved"} 1.0' in text
    assert 'router_warmup_requests_total{result="ok"}' not in text


async def test_with_prefill_anywhere_a_busy_replica_s_long_prompt_is_prefilled_by_an_idle_one(  # type: ignore[no-untyped-def]
    start_fleet, start_router
) -> None:
    """No prefill replicas: every replica serves, and prefills for another where that costs the
    fleet less waiting. A conversation's replica busy with two long answers has its next long
    prompt prefilled by an idle replica (it reads the KV and decodes); idle, it prefills its own."""
    fleet = await start_fleet(3, time_scale=1.0)  # real time: the answers in flight last seconds
    node, url = await start_router([r.url for r in fleet.replicas], prefill_anywhere=True, health_checks=False)
    await introduced(node, fleet, 6)  # each replica to each other one
    history = ["first: " + LONG, "an answer"]
    status, _, home = await chat(url, history[0], "x")
    assert status == 200
    busy = [asyncio.create_task(chat(url, [*history, f"story {i}"], "x", stream=True, max_tokens=400)) for i in (1, 2)]
    await until(lambda: sum(node.fleet.loads) == 2, "the two answers in flight")
    owner = fleet.replicas[[r.id for r in node.fleet.replicas].index(home)]
    before = await transfers(owner)
    status, answer, replica = await chat(url, [*history, "second: " + LONG], "x")
    assert status == 200 and replica == home and answer["usage"]["completion_tokens"] == 6
    assert (await transfers(owner))[0] == before[0] + 1  # its KV came from another replica
    lent = [r for r in node.fleet.replicas if r.id != home and r.requests > 0]
    assert len(lent) == 1, [(r.id, r.requests) for r in node.fleet.replicas]
    for task in busy:
        assert (await task)[0] == 200
    # idle again: its own replica prefills it
    status, _, replica = await chat(url, [*history, "third: " + LONG], "x")
    assert status == 200 and replica == home and (await transfers(owner))[0] == before[0] + 1
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'router_disagg_requests_total{mode="split"} 1.0' in text
