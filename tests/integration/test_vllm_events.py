"""The event-fed index against real vLLM: what the router says each engine holds is what the engine holds.

Two vLLM 0.32 replicas (scripts/build-vllm.sh; skipped elsewhere with that message, failing under
CI), started as vLLM's docs start them: KV-cache events on ZMQ with a replay socket
(`--kv-events-config`), no `--enable-scale-out` (their render endpoints answer 403), no dev mode.
They hold 48 blocks of 32 tokens each: a few conversations evict one another. Nothing is configured
in the router but the replicas' URLs: it finds where they publish through `/kv_event_sources`, and
the model's tokenizer from the `root` their `/v1/models` lists, checked against their `/tokenize`.
A replica started with `--enable-scale-out` is the extra case.

"Holds" is asked of the engine itself: a probe request (`max_tokens: 1`) sent straight to it
reports in `cached_tokens` how much of its prompt the engine found cached, and the router's
prediction for that prompt, made just before, must be that number exactly.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from engine_streams import vllm_or_why
from prometheus_client import generate_latest

from router.bench.common import free_port
from router.bench.vllm import MODEL_NAME, VllmServer, start_all
from router.kvevents.tokens import Tokenizer
from router.node import Node
from router.proxy.intake import Intake, take_in_body
from router.routing.request import Keys

BLOCKS = 48  # KV blocks of each replica: 1,536 tokens, two or three of the conversations below
SYSTEM = {"role": "system", "content": "You answer questions about the weather in the mountains. " * 6}

ROOT, WHY = vllm_or_why()
pytestmark = [pytest.mark.real_engine, pytest.mark.skipif(ROOT is None, reason=WHY)]


def publishing(name: str, log_dir: Path, **settings: Any) -> VllmServer:
    assert ROOT is not None
    return VllmServer(
        ROOT,
        free_port(),
        name=name,
        log=log_dir / f"{name}.log",
        max_num_seqs=4,
        kv_blocks=BLOCKS,
        max_model_len=(BLOCKS - 1) * 32,
        events_port=free_port(),
        replay_port=free_port(),
        **settings,
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    logs = tmp_path_factory.mktemp("vllm-events")
    servers = [publishing("e-0", logs, adapters=("lora-0",)), publishing("e-1", logs)]
    asyncio.run(start_all(servers))
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
async def own_replica(tmp_path: Path) -> Any:
    started: list[VllmServer] = []

    async def start(**settings: Any) -> VllmServer:
        server = publishing("own", tmp_path, **settings)
        started.append(server)
        await server.start()
        return server

    yield start
    for server in started:
        server.stop()


def specs(servers: list[VllmServer]) -> list[str]:
    return [f"{s.name}={s.url}" for s in servers]


def conversation(n: int, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [SYSTEM]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Conversation {n}, question {t}: " + "is it snowing? " * 25})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"Answer {t} of {n}: " + "clear skies ahead. " * 10})
    return messages


async def post(http: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1, **extra}
    async with http.post(
        url + "/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        return answer


async def probe(http: aiohttp.ClientSession, server: VllmServer, messages: list[dict[str, Any]], **extra: Any) -> int:
    """The tokens of this prompt the engine finds cached, as it reports them (and then holds it all)."""
    usage = (await post(http, server.url, messages, **extra))["usage"]
    cached: int = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return cached


async def settled(router: Node, timeout: float = 10.0) -> None:
    """Until every replica's events are believed and no new message came for a while."""
    truth = router.placement.truth  # type: ignore[union-attr]
    deadline = time.monotonic() + timeout
    last: object = None
    quiet = 0
    while time.monotonic() < deadline:
        now = [(rid, [(h.seq, h.sure) for h in truth.of(rid)]) for rid in sorted(truth.replicas)]
        believed = all(truth.sure(rid) for rid in truth.replicas) and len(now) == len(router.fleet.replicas)
        quiet = quiet + 1 if now == last and believed else 0
        if quiet >= 4:
            return
        last = now
        await asyncio.sleep(0.1)
    raise AssertionError(f"the events did not settle: {last}")


async def predicted(
    router: Node, messages: list[dict[str, Any]], source: str = "tokenizer", **extra: Any
) -> dict[str, int | None]:
    """The cached tokens the router's event-fed index predicts for this prompt on each replica
    (None where it does not know: events not believed, or the replica does not serve the model)."""
    raw = orjson.dumps({"model": MODEL_NAME, "messages": messages, "max_tokens": 1, **extra})
    admitted = take_in_body("/v1/chat/completions", {}, raw, router.config.proxying, Keys.of(router.config, True))
    assert isinstance(admitted, Intake) and router.feed is not None
    key = router.feed.tokenized(admitted.key, admitted.api, admitted.body)
    assert key.prompt is not None and key.prompt.tokens is not None and key.prompt.tokens.source == source
    truth = router.placement.truth  # type: ignore[union-attr]
    out: dict[str, int | None] = {}
    for replica in router.fleet.replicas:
        found = truth.held(replica.id, key.prompt.tokens, {})
        out[replica.id] = None if found is None else found.gpu_tokens
    return out


async def start(start_router: Callable[..., Any], servers: list[VllmServer], **settings: Any) -> tuple[Node, str]:
    """A router in front of `servers`, once it believes their events and has found their model's tokenizer."""
    router, url = await start_router(specs(servers), probe_interval_s=0.5, replica_capacity=("*=4",), **settings)
    await settled(router, timeout=30.0)
    assert router.feed is not None
    models = router.feed.tokens.models
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if MODEL_NAME in models and models[MODEL_NAME].tokenizer is not None:
            break
        await asyncio.sleep(0.1)
    assert models[MODEL_NAME].tokenizer is not None, "the router did not find the model's tokenizer"
    return router, url


async def test_the_index_equals_what_each_engine_holds(
    pair: list[VllmServer], start_router: Callable[..., Any]
) -> None:
    async with aiohttp.ClientSession() as http:
        router, url = await start(start_router, pair, admin_token="events-test-token")
        # six keyed conversations of three turns through the router: more than both caches hold
        for turn in range(1, 4):
            for n in range(6):
                async with http.post(
                    url + "/v1/chat/completions",
                    data=orjson.dumps({"model": MODEL_NAME, "messages": conversation(n, turn), "max_tokens": 4}),
                    headers={"Content-Type": "application/json", "X-Session-ID": f"snow-{n}"},
                ) as r:
                    assert r.status == 200, await r.text()
        await settled(router)
        evicted = sum(
            h.figures.removed
            for rid in router.placement.truth.replicas  # type: ignore[union-attr]
            for h in router.placement.truth.of(rid)
        )  # type: ignore[union-attr]
        assert evicted > 0  # the caches were too small for all of them: the engines evicted
        # every message vLLM sent was read by the scanner (none left to the long decoder)
        holdings = [h for rid in router.placement.truth.replicas for h in router.placement.truth.of(rid)]  # type: ignore[union-attr]
        assert all(h.figures.batches > 0 and h.figures.long_way == 0 for h in holdings), [h.figures for h in holdings]
        # every conversation's next turn, on every replica: the prediction is what the engine then finds
        checked = 0
        for n in range(6):
            for server in pair:
                messages = conversation(n, 4)
                expected = (await predicted(router, messages))[server.name]
                assert expected == await probe(http, server, messages), (n, server.name)
                checked += 1
                await settled(router)
        assert checked == 12
        # /admin/route explains the next turn from the events too, as a real route prices it
        probe_body = {"model": MODEL_NAME, "messages": conversation(0, 5), "max_tokens": 1}
        async with http.post(
            url + "/admin/route",
            data=orjson.dumps(probe_body),
            headers={"X-Session-ID": "snow-0", "Authorization": "Bearer events-test-token"},
        ) as r:
            assert r.status == 200, await r.text()
            explained = await r.json()
        assert {c["cached_from"] for c in explained["candidates"]} == {"events"}
        assert explained["replica"] in (s.name for s in pair)
        # the routed requests themselves: each answer's cached tokens were predicted from the events
        figures = router.placement.figures()  # type: ignore[union-attr]
        events = figures["by_source"]["events"]  # type: ignore[index]
        assert events["answers"] >= 12 and events["exact_share"] >= 0.9, events


async def test_an_eviction_by_another_prompt_is_seen(pair: list[VllmServer], start_router: Callable[..., Any]) -> None:
    async with aiohttp.ClientSession() as http:
        router, _url = await start(start_router, pair)
        server = pair[0]
        mine = conversation(10, 2)
        await post(http, server.url, mine)
        await settled(router)
        before = (await predicted(router, mine))[server.name]
        assert before is not None and before >= 10 * 32
        # someone else's long prompts, straight to the engine, push it out
        for n in range(20, 24):
            await post(http, server.url, [{"role": "user", "content": f"Other {n}: " + "rain and wind " * 150}])
        await settled(router)
        after = (await predicted(router, mine))[server.name]
        assert after is not None and after < before
        assert after == await probe(http, server, mine)


async def test_a_lost_message_is_replayed(pair: list[VllmServer], start_router: Callable[..., Any]) -> None:
    async with aiohttp.ClientSession() as http:
        router, _url = await start(start_router, pair)
        assert router.feed is not None
        server = pair[1]
        holdings = router.placement.truth.of(server.name)[0]  # type: ignore[union-attr]
        gaps, replayed = holdings.figures.gaps, holdings.figures.replayed
        router.feed.lose[server.name] = 1  # the next message never arrives
        first = conversation(30, 1)
        await post(http, server.url, first)  # its BlockStored is lost
        await post(
            http, server.url, [{"role": "user", "content": "a question of two blocks or more " * 12}]
        )  # the gap shows
        await settled(router)
        assert holdings.figures.gaps > gaps and holdings.figures.replayed > replayed and holdings.sure
        expected = (await predicted(router, conversation(30, 2)))[server.name]
        assert expected is not None and expected >= 4 * 32  # the lost blocks were replayed
        assert expected == await probe(http, server, conversation(30, 2))


async def test_adapters_and_salts_are_kept_apart_as_the_engine_keeps_them(
    pair: list[VllmServer], start_router: Callable[..., Any]
) -> None:
    async with aiohttp.ClientSession() as http:
        router, _url = await start(start_router, pair)
        assert await until_known(router, "lora-0")  # its /v1/models lists it with a parent
        server = pair[0]
        messages = conversation(70, 2)
        await post(http, server.url, messages, model="lora-0", cache_salt="team-a")
        await settled(router)
        ways: list[dict[str, Any]] = [
            {"model": "lora-0", "cache_salt": "team-a"},  # as it was computed: held
            {"model": "lora-0", "cache_salt": "team-b"},  # another salt: nothing
            {"model": "lora-0"},
            {},  # the base model: nothing
        ]
        for extra in ways:
            expected = (await predicted(router, messages, **extra))[server.name]
            assert expected == await probe(http, server, messages, **extra), extra
            await settled(router)
            if extra == ways[0]:
                assert expected is not None and expected >= 4 * 32


async def until_known(router: Node, adapter: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while adapter not in router.fleet.adapter_names and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return adapter in router.fleet.adapter_names


async def test_two_routers_agree(pair: list[VllmServer], start_router: Callable[..., Any]) -> None:
    async with aiohttp.ClientSession() as http:
        one, url = await start(start_router, pair)
        other, _ = await start(start_router, pair)
        for n in range(4):
            async with http.post(
                url + "/v1/chat/completions",
                data=orjson.dumps({"model": MODEL_NAME, "messages": conversation(40 + n, 2), "max_tokens": 2}),
                headers={"Content-Type": "application/json"},
            ) as r:
                assert r.status == 200
        await settled(one)
        await settled(other)
        for n in range(4):
            ours, theirs = (
                await predicted(one, conversation(40 + n, 2)),
                await predicted(other, conversation(40 + n, 2)),
            )
            assert ours == theirs and any(v for v in ours.values())


async def test_a_restarted_engine_is_seen_as_empty(
    own_replica: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    server = await own_replica()
    async with aiohttp.ClientSession() as http:
        router, url = await start(start_router, [server])
        messages = conversation(50, 2)
        await post(http, url, messages)
        await settled(router)
        assert ((await predicted(router, messages))["own"] or 0) >= 10 * 32
        holdings = router.placement.truth.of("own")[0]  # type: ignore[union-attr]
        server.kill()  # the whole group: API server, engine core, worker
        await server.start()  # same ports, a new engine: its cache is empty, its messages start at 0
        await post(http, server.url, [{"role": "user", "content": "hello after the restart " * 3}])
        await settled(router, timeout=30.0)
        assert holdings.figures.restarts >= 1
        assert (await predicted(router, messages))["own"] == 0 == await probe(http, server, messages)


async def test_as_shipped_every_request_is_priced_by_the_events_in_tokens_found_here(
    pair: list[VllmServer], start_router: Callable[..., Any]
) -> None:
    """Nothing configured but the URLs, vLLM without --enable-scale-out: the router finds the model's
    tokenizer from /v1/models (its `root`, a folder this host reads), checks it against /tokenize
    (render answered 403 once and is not asked again), and every routed request is then priced by the
    events, checked against the engine in the background (token_check_share 1 here)."""
    async with aiohttp.ClientSession() as http:
        router, url = await start(start_router, pair, token_check_share=1.0)
        assert router.feed is not None
        tokens = router.feed.tokens
        assert tokens.models[MODEL_NAME].source == "path"
        assert {family for (_, family), _until in tokens.refused.items()} == {"render"}
        for turn in range(1, 4):
            for n in range(3):
                async with http.post(
                    url + "/v1/chat/completions",
                    data=orjson.dumps({"model": MODEL_NAME, "messages": conversation(60 + n, turn), "max_tokens": 2}),
                    headers={"Content-Type": "application/json", "X-Session-ID": f"tok-{n}"},
                ) as r:
                    assert r.status == 200
        await settled(router)
        while tokens.tasks:  # the checks against /tokenize, in the background
            await asyncio.sleep(0.05)
        m = router.metrics
        assert m.child(m.token_checks, MODEL_NAME, "match")._value.get() >= 10  # the first, then all nine
        assert m.child(m.token_checks, MODEL_NAME, "mismatch")._value.get() == 0
        text = generate_latest(m.registry).decode()
        assert 'router_prefix_prediction_error_tokens_count{source="events"} 9.0' in text
        assert 'router_prefix_prediction_error_tokens_count{source="model"}' not in text
        assert 'router_tokenize_seconds_count{source="engine"}' not in text  # nothing asked of an engine
        for n in range(3):
            for server in pair:
                messages = conversation(60 + n, 4)
                expected = (await predicted(router, messages))[server.name]
                assert expected == await probe(http, server, messages), (n, server.name)
                await settled(router)


async def test_an_answer_is_tokenized_after_it_went_and_its_next_turn_only_the_new_message(
    pair: list[VllmServer], start_router: Callable[..., Any]
) -> None:
    """A chat's answer, streamed or whole, is kept in the engine's tokens once the client has it; its
    next turn, sending that answer back, tokenizes on its path only the message it adds, and its
    tokens are still the engine's (its prediction is what the engine then finds cached)."""
    async with aiohttp.ClientSession() as http:
        router, url = await start(start_router, pair)
        assert router.feed is not None
        tokenizer = router.feed.tokens.models[MODEL_NAME].tokenizer
        assert isinstance(tokenizer, Tokenizer)

        def replies() -> float:
            text = generate_latest(router.metrics.registry).decode()
            found = re.search(r'router_tokenize_seconds_count\{source="reply"\} ([0-9.]+)', text)
            return float(found.group(1)) if found else 0.0

        async def turn(messages: list[dict[str, Any]], stream: bool, session: str) -> str:
            body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 24, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            answered = replies()
            async with http.post(
                url + "/v1/chat/completions",
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json", "X-Session-ID": session},
            ) as r:
                assert r.status == 200, await r.text()
                raw = await r.read()
            deadline = time.monotonic() + 10
            while replies() < answered + 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert replies() == answered + 1  # kept once the client had it
            if not stream:
                return str(orjson.loads(raw)["choices"][0]["message"]["content"])
            events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
            return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])

        for stream in (True, False):
            session = f"reply-{stream}"
            messages = conversation(90 + stream, 1)
            reply = await turn(messages, stream, session)
            assert reply
            answered = [*messages, {"role": "assistant", "content": reply}]
            nxt = [*answered, {"role": "user", "content": "And tomorrow, in the valley?"}]
            before = tokenizer.tokenized
            second = await turn(nxt, stream, session)
            # what was tokenized since: this turn's new message on its path, and its own answer after
            # it went; never the first answer again
            whole = tokenizer.render([*nxt, {"role": "assistant", "content": second}], False)
            assert tokenizer.tokenized - before == len(whole) - len(tokenizer.render(answered, False))
            await settled(router)
            follow = [*nxt, {"role": "assistant", "content": second}, {"role": "user", "content": "Thanks."}]
            for server in pair:
                assert (await predicted(router, follow))[server.name] == await probe(http, server, follow)
                await settled(router)


async def test_a_document_an_engine_holds_is_found_by_the_next_keyless_request(
    pair: list[VllmServer], start_router: Callable[..., Any]
) -> None:
    """A document warmed straight on one replica, whoever sent it there: the next request about it,
    with no session key, goes through the router to that replica, every time."""
    async with aiohttp.ClientSession() as http:
        router, url = await start(start_router, pair)
        found = 0
        for n in range(10):
            holder = pair[n % 2]
            document = f"Document {n}: " + f"the pass at {n} is closed by snow and wind. " * 40
            await post(http, holder.url, [SYSTEM, {"role": "user", "content": document}])
            await settled(router)
            follow_up = [SYSTEM, {"role": "user", "content": document + " Is the pass open?"}]
            async with http.post(
                url + "/v1/chat/completions",
                data=orjson.dumps({"model": MODEL_NAME, "messages": follow_up, "max_tokens": 1}),
                headers={"Content-Type": "application/json"},
            ) as r:
                assert r.status == 200, await r.text()
                found += r.headers.get("X-Router-Replica") == holder.name
                cached = (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= 10 * 32 or r.headers.get("X-Router-Replica") != holder.name
        assert found == 10


async def test_with_scale_out_the_render_endpoint_checks_the_tokenizer(
    own_replica: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    """The extra case: a replica started with --enable-scale-out serves render, which the router
    then checks its tokenizer against (nothing is refused), and prices requests the same way."""
    server = await own_replica(scale_out=True)
    async with aiohttp.ClientSession() as http:
        router, url = await start(start_router, [server])
        assert router.feed is not None and not router.feed.tokens.refused
        m = router.metrics
        assert m.child(m.token_checks, MODEL_NAME, "match")._value.get() == 1
        messages = conversation(80, 2)
        await post(http, url, messages)
        await settled(router)
        expected = (await predicted(router, messages))["own"]
        assert expected is not None and expected >= 10 * 32
        assert expected == await probe(http, server, messages)
