"""Prefill/decode disaggregation through the router on real vLLM: vLLM 0.32's CPU build moves the
prefilled KV blocks from a prefill replica to a decode replica with its NixlConnector (NIXL over
UCX on loopback TCP; scripts/build-vllm.sh installs NIXL beside vLLM).

Five replicas start once for the module (two to prefill, three to decode; float32, as bf16 dies
in this CPU's AMX attention after a transfer), each with its own NIXL side channel, under vLLM's
default `kv_load_failure_policy` "fail": a decode whose transfer fails answers an error, which the
router must keep from the client. That a transfer happened is read from the decode side itself
(`vllm:nixl_xfer_time_seconds_count` grows); that none failed, from
`vllm:nixl_num_failed_transfers_total`. The tests go in the order the module needs: a drained
replica's conversation moves with its KV (prefill_anywhere), a decode replica is killed
(mid-stream, then before a request's first byte), then both prefill replicas go away, each
between its prefill and the decode that reads it (their params name an engine that is gone: the
read fails and the router recomputes, in front of the two decode replicas left).

A pair's first read waits for NIXL's handshake (10 to 30 s here). The first test's router
introduces its pairs itself (router.pools.Pairs) before it splits a client's request; the module
introduces d-2, which only the last test uses (without introductions: its relays go away after
their first prefill, an introduction's too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from engine_streams import events_of, metric, metrics_of, text_of, vllm_or_why
from waiting import until

from router.bench.common import free_port
from router.bench.vllm import MODEL_NAME, VllmServer, nixl_handshakes, nixl_transfer, start_all

TOKEN = "vllm-disagg-token"
LONG = "The quick brown fox jumps over the lazy dog while the weather turns. " * 60  # ~900 tokens

ROOT, WHY = vllm_or_why()
pytestmark = [pytest.mark.real_engine, pytest.mark.skipif(ROOT is None, reason=WHY)]


def replica(name: str, log_dir: Path) -> VllmServer:
    assert ROOT is not None
    return VllmServer(
        ROOT,
        free_port(),
        name=name,
        log=log_dir / f"{name}.log",
        max_num_seqs=4,
        dtype="float32",
        kv_transfer=nixl_transfer(lease_s=15),  # a first handshake waits for one (nixl_handshakes)
        nixl_port=free_port(),
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    logs = tmp_path_factory.mktemp("vllm-disagg")
    servers = [replica(name, logs) for name in ("p-0", "p-1", "d-0", "d-1", "d-2")]
    try:
        asyncio.run(start_all(servers))
        print("d-2's handshakes took", asyncio.run(nixl_handshakes(servers[:2], servers[4:])))
        yield {s.name: s for s in servers}
    finally:
        for server in servers:
            server.stop()


def handshakes(server: VllmServer) -> int:
    """The NIXL handshakes a replica's log shows: vLLM 0.32's worker logs its compatibility check
    with each remote engine it meets ("NIXL compatibility check passed"), once."""
    assert server.log is not None
    return server.log.read_bytes().count(b"NIXL compatibility check passed")


def specs(*servers: VllmServer) -> list[str]:
    return [f"{s.name}={s.url}" for s in servers]


async def transfers(http: aiohttp.ClientSession, server: VllmServer) -> tuple[float, float]:
    """The transfers a decode replica has read, and those that failed."""
    async with http.get(server.url + "/metrics") as r:
        text = await r.text()
    return metric(text, "vllm:nixl_xfer_time_seconds_count"), metric(text, "vllm:nixl_num_failed_transfers_total")


async def settled(
    http: aiohttp.ClientSession, servers: list[VllmServer], at_least: float = 0.0
) -> dict[str, tuple[float, float]]:
    """The decode replicas' transfers once their sum is at least `at_least` and the same on two
    reads a second apart (vLLM updates these counters after the request, not with its answer)."""
    last: dict[str, tuple[float, float]] | None = None
    for _ in range(20):
        now = {s.name: await transfers(http, s) for s in servers}
        if now == last and sum(done for done, _ in now.values()) >= at_least:
            return now
        last = now
        await asyncio.sleep(1.0)
    raise AssertionError(f"the decode replicas' transfer counts did not settle: {last}")


async def post(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], session: str
) -> tuple[int, bytes, str]:
    headers = {"Content-Type": "application/json", "X-Session-ID": session}
    async with http.post(url + path, data=orjson.dumps({"model": MODEL_NAME, **body}), headers=headers) as r:
        return r.status, await r.read(), r.headers.get("X-Router-Replica", "")


def chat(text: str, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}


async def test_prompts_are_prefilled_apart_and_decoded_for_each_api_streamed_and_not(
    fleet: dict[str, VllmServer], start_router: Callable[..., Any]
) -> None:
    p, d = [fleet["p-0"], fleet["p-1"]], [fleet["d-0"], fleet["d-1"]]
    node, url = await start_router([], prefill=specs(*p), decode=specs(*d), admin_token=TOKEN, health_checks=False)
    # the router introduces each prefill replica to each decode replica (NIXL's first handshake)
    # before it splits a client's request across them; one that comes before is served whole
    async with aiohttp.ClientSession() as http:
        status, raw, _ = await post(http, url, "/v1/chat/completions", chat("0 " + LONG), "s-early")
        assert status == 200, raw[:300]
    assert node.pairs is not None
    await until(lambda: len(node.pairs.met) == 4, "the router's four pairs to meet", 300.0, every=0.5)
    print("the router's introductions took", node.pairs.met, "tries failed", node.pairs.tries)
    slowest = max(node.pairs.met.values())
    # a decode replica logs NIXL's compatibility check once for each prefill replica it meets:
    # both met in the introductions, and none again while clients' requests are split below
    met = [handshakes(s) for s in d]
    assert all(n >= 2 for n in met), met
    asks = [
        ("/v1/chat/completions", chat("1 " + LONG)),
        ("/v1/chat/completions", chat("2 " + LONG, stream=True)),
        ("/v1/completions", {"prompt": "3 " + LONG, "max_tokens": 8}),
        ("/v1/completions", {"prompt": "4 " + LONG, "max_tokens": 8, "stream": True}),
        ("/v1/responses", {"input": "5 " + LONG, "max_output_tokens": 8}),
        ("/v1/responses", {"input": "6 " + LONG, "max_output_tokens": 8, "stream": True}),
    ]
    async with aiohttp.ClientSession() as http:
        before = await settled(http, d)  # the introductions' transfers counted
        # (the early request may have been split after all: its first attempt, starved of CPU by
        # the introductions, can time out, and its next comes once a pair has met)
        counted = await metrics_of(http, url, TOKEN)
        splits, alone = (metric(counted, "router_disagg_requests_total", mode=m) for m in ("split", "alone"))
        prefills = sum(r.requests for r in node.pools[1].fleet.replicas)
        prompts = sum(r.prompt_tokens for r in node.pools[1].fleet.replicas)
        for i, (path, body) in enumerate(asks):
            began = time.monotonic()
            status, raw, chosen = await post(http, url, path, body, f"s{i}")
            took = time.monotonic() - began
            assert status == 200, raw[:300]
            if i == 0:  # the first split request: no handshake of its own (the introductions made them)
                print(f"the first split request took {took:.2f} s; the slowest introduction {slowest:.2f} s")
                assert [handshakes(s) for s in d] == met
            if body.get("stream"):
                assert b'"error"' not in raw and (path == "/v1/responses" or raw.rstrip().endswith(b"data: [DONE]"))
            else:
                answer = orjson.loads(raw)
                assert answer.get("choices") or answer.get("output"), answer
            # its decode replica read the prompt's KV from a prefill replica, once, without failure
            after = await settled(http, d, sum(done for done, _ in before.values()) + 1)
            assert after[chosen] == (before[chosen][0] + 1, before[chosen][1]), (path, before, after)
            assert all(after[n] == before[n] for n in after if n != chosen)
            before = after
        # a short prompt is served by its decode replica alone: no transfer
        status, raw, _ = await post(http, url, "/v1/chat/completions", chat("hello there"), "short")
        assert status == 200 and await settled(http, d) == before
        text = await metrics_of(http, url, TOKEN)
    assert metric(text, "router_disagg_requests_total", mode="split") == splits + len(asks)
    assert metric(text, "router_disagg_requests_total", mode="alone") == alone + 1
    assert metric(text, "router_disagg_pair_meetings_total", outcome="met") == 4
    # the prompts were computed on the prefill side and counted there
    assert sum(r.requests for r in node.pools[1].fleet.replicas) == prefills + len(asks)
    assert sum(r.prompt_tokens for r in node.pools[1].fleet.replicas) > prompts + len(asks) * 600


async def test_a_drained_replica_s_session_takes_its_kv_where_it_moves(
    fleet: dict[str, VllmServer], start_router: Callable[..., Any]
) -> None:
    """With every replica prefilling for another (prefill_anywhere; these are kv_both), a drain's
    warm-up of a moving conversation is a split: the drained replica prefills it from its own cache
    and the new replica reads the blocks over NIXL. p-0 and d-0 met in the first test."""
    home, new = fleet["p-0"], fleet["d-0"]
    node, url = await start_router(
        [f"p-0={home.url}", f"d-0={new.url}"],
        prefill_anywhere=True,
        disagg_introduce=False,  # (p-0 prefills for d-0 below: that pair has met)
        admin_token=TOKEN,
        health_checks=False,
        # five engines on two cores: a read can wait for the prefill engine's starved NIXL side
        # (a transfer over half the time left is computed instead)
        warmup_timeout_s=60,
    )
    session = next(f"m{i}" for i in range(200) if node.fleet.ring.lookup(f"m{i}".encode()) == 0)  # owned by p-0
    history = "a conversation held on p-0. " + LONG
    async with aiohttp.ClientSession() as http:
        status, raw, chosen = await post(http, url, "/v1/chat/completions", chat(history), session)
        assert status == 200 and chosen == "p-0", raw[:300]
        reply = orjson.loads(raw)["choices"][0]["message"]["content"]
        before = (await settled(http, [new]))["d-0"]
        began = time.monotonic()
        async with http.post(url + "/admin/replicas/p-0/drain", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200 and (await r.json())["sessions_to_move"] == 1
        await until(lambda: node.sessions.get(session.encode()) == "d-0", "the session moved", 120.0, every=0.1)
        warmed = time.monotonic() - began
        text = await metrics_of(http, url, TOKEN)
        warmups = {r: metric(text, "router_warmup_requests_total", result=r) for r in ("moved", "ok", "failed")}
        assert warmups["moved"] == 1, warmups
        # its warm-up read the conversation's KV from p-0: one transfer more on d-0, none failed
        assert await settled(http, [new], before[0] + 1) == {"d-0": (before[0] + 1, before[1])}
        turn = {
            "messages": [
                {"role": "user", "content": history},
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "and then?"},
            ],
            "max_tokens": 8,
        }
        began = time.monotonic()
        status, raw, chosen = await post(http, url, "/v1/chat/completions", turn, session)
        moved_s = time.monotonic() - began
        assert status == 200 and chosen == "d-0", raw[:300]
        usage = orjson.loads(raw)["usage"]
        # the same conversation's shape, never seen on d-0: its prompt computed there
        fresh = {
            **turn,
            "messages": [{**turn["messages"][0], "content": "another one. " + LONG}, *turn["messages"][1:]],
        }
        began = time.monotonic()
        status, raw, _ = await post(http, new.url, "/v1/chat/completions", fresh, "none")
        computed_s = time.monotonic() - began
        assert status == 200
    print(
        f"warm-up with the KV read from p-0 {warmed:.2f} s; the moved turn {moved_s:.2f} s "
        f"({usage['prompt_tokens_details']['cached_tokens']} of {usage['prompt_tokens']} tokens cached) "
        f"against {computed_s:.2f} s for one computed there"
    )
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]  # all but the new turn


async def test_a_decode_replica_killed_mid_stream_or_before_its_first_byte_loses_no_request(
    fleet: dict[str, VllmServer], start_router: Callable[..., Any]
) -> None:
    p, d = [fleet["p-0"], fleet["p-1"]], [fleet["d-0"], fleet["d-1"]]
    node, url = await start_router(  # (the engines met in the test above: no introductions to count)
        [],
        prefill=specs(*p),
        decode=specs(*d),
        admin_token=TOKEN,
        health_checks=False,
        policy="affinity",
        disagg_introduce=False,
    )
    owner = next(f"k{i}" for i in range(200) if node.fleet.ring.lookup(f"k{i}".encode()) == 0)  # on d-0
    async with aiohttp.ClientSession() as http:
        # killed mid-stream, a few events in: the stream is resumed on d-1, the client sees one whole stream
        # (200 tokens: the resumed stream must finish on cores shared by five engines, at a few tokens a second)
        body = {**chat("tell a long story. " + LONG, stream=True, max_tokens=200), "ignore_eos": True, "temperature": 0}
        raw = bytearray()
        headers = {"Content-Type": "application/json", "X-Session-ID": owner}
        async with http.post(
            url + "/v1/chat/completions", data=orjson.dumps({"model": MODEL_NAME, **body}), headers=headers
        ) as r:
            assert r.status == 200 and r.headers["X-Router-Replica"] == "d-0"
            async for chunk in r.content.iter_any():
                raw += chunk
                if raw.count(b"\n\n") >= 6 and d[0].proc is not None and d[0].proc.poll() is None:
                    d[0].kill()  # the server, its engine and worker
        events = events_of(bytes(raw))
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
        choices = [c for e in events if isinstance(e, dict) for c in e["choices"]]
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
        assert len({e["id"] for e in events if isinstance(e, dict)}) == 1
        assert len(text_of(events)) > 0
        # d-0 is gone before a request's first byte (the router has not noticed: no health checks):
        # d-1 decodes it with the params of the same prefill, none redone
        prefills = sum(r.requests for r in node.pools[1].fleet.replicas)
        before = (await settled(http, d[1:]))["d-1"]
        status, raw2, chosen = await post(http, url, "/v1/chat/completions", chat("again: " + LONG), owner)
        assert status == 200 and chosen == "d-1", raw2[:300]
        assert (await settled(http, d[1:], before[0] + 1))["d-1"] == (before[0] + 1, before[1])
        assert sum(r.requests for r in node.pools[1].fleet.replicas) == prefills + 1
        text = await metrics_of(http, url, TOKEN)
    assert metric(text, "router_stream_resumes_total", outcome="resumed") == 1


class GoneAfterPrefill:
    """A prefill replica that goes away between the two legs: in front of a vLLM replica, it relays
    what is sent there; the params of its first prefill name an engine that is gone (another
    engine id, at a port where nobody listens, as a replica restarted or moved answers), and from
    then on it answers every request 502, as a proxy in front of a dead replica does.

    (The replica itself is not killed: on vLLM 0.32's CPU build, a decode engine that had met a
    prefill engine which then died stalled for minutes, its requests neither run nor failed,
    seen in CI: then no replica is left to recompute on, whatever the router does.)"""

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.url = ""
        self.gone = False
        self.runner: web.AppRunner | None = None

    async def relay(self, request: web.Request) -> web.Response:
        if self.gone:
            return web.Response(status=502, text="the replica is gone")
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        async with (
            aiohttp.ClientSession() as http,
            http.request(request.method, self.server.url + request.path_qs, data=body, headers=headers) as r,
        ):
            status, data, kind = r.status, await r.read(), r.content_type
        if b"do_remote_decode" in body and status == 200:
            self.gone = True
            answer = orjson.loads(data)
            params = answer["kv_transfer_params"]
            answer["kv_transfer_params"] = params | {
                "remote_engine_id": f"gone-{params['remote_engine_id']}",
                "remote_port": free_port(),
            }
            data = orjson.dumps(answer)
        return web.Response(status=status, body=data, content_type=kind)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.relay)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self.url


async def test_prefill_replicas_gone_between_the_legs_lose_no_request(
    fleet: dict[str, VllmServer], start_router: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    # the router's own account of each attempt (its causes, what it recomputed), shown if this fails
    caplog.set_level(logging.INFO, logger="router")
    # after the tests above d-1 and d-2 decode; each prefill replica goes away right after its first prefill
    relays = [GoneAfterPrefill(fleet["p-0"]), GoneAfterPrefill(fleet["p-1"])]
    prefill = [f"p-{i}={await relay.start()}" for i, relay in enumerate(relays)]
    d = [fleet["d-1"], fleet["d-2"]]
    _, url = await start_router(
        [],
        prefill=prefill,
        decode=specs(*d),
        admin_token=TOKEN,
        health_checks=False,
        policy="affinity",
        disagg_introduce=False,
        log_requests=True,
    )
    try:
        async with aiohttp.ClientSession() as http:
            before = await settled(http, d)
            # the decode replica cannot reach the engine its params name: vLLM gives the handshake
            # up and answers 500, and the router sends the request again without params (it recomputes)
            status, raw, _ = await post(http, url, "/v1/chat/completions", chat("a " + LONG), "x1")
            assert status == 200 and orjson.loads(raw)["choices"][0]["message"]["content"] is not None
            # streamed: vLLM answers 200, its opening event, then an error event; the client sees
            # none of it. (The gone one is asked first or second; the other prefills, then goes.)
            status, raw, _ = await post(http, url, "/v1/chat/completions", chat("b " + LONG, stream=True), "x2")
            events = events_of(raw)
            assert status == 200 and events[-1] == "[DONE]", raw[:400]
            assert not any(isinstance(e, dict) and "error" in e for e in events)
            assert sum(1 for e in events if isinstance(e, dict) and e["choices"][0]["delta"].get("role")) == 1
            # no prefill replica left: a decode replica serves it alone
            status, raw, _ = await post(http, url, "/v1/chat/completions", chat("c " + LONG), "x3")
            assert status == 200, raw[:300]
            text = await metrics_of(http, url, TOKEN)
            after = await settled(http, d)
        # both decodes failed their transfers (vLLM counts them) and were sent again to recompute,
        # and no client saw it
        assert metric(text, "router_disagg_requests_total", mode="recomputed") == 2
        assert metric(text, "router_disagg_requests_total", mode="fallback") >= 1
        assert sum(f for _, f in after.values()) > sum(f for _, f in before.values()), (before, after)
    finally:
        for relay in relays:
            if relay.runner is not None:
                await relay.runner.cleanup()
