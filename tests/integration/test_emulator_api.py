"""The emulator speaks OpenAI: formats, usage with cached tokens, models, health, errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from waiting import until

from router.emulator.engine import EngineConfig
from router.emulator.server import Replica
from router.health.signals import parse_engine_metrics

CHAT = [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "Tell me a story."}]


async def post(r: Replica, path: str, body: object, raw: bytes | None = None) -> tuple[int, dict, dict]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            r.url + path,
            data=raw if raw is not None else orjson.dumps(body),
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        return resp.status, dict(resp.headers), orjson.loads(await resp.read())


async def test_chat_completion_with_usage_and_replica_header(replica: Replica) -> None:
    status, headers, body = await post(
        replica, "/v1/chat/completions", {"model": "emulated-llm", "messages": CHAT, "max_tokens": 7}
    )
    assert status == 200 and headers["X-Replica-Id"] == "r0"
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and len(message["content"]) == 7 * 4
    usage = body["usage"]
    assert usage["completion_tokens"] == 7 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7
    # the next turn resends the history: its prompt, the reply and the new question
    turn2 = [*CHAT, message, {"role": "user", "content": "Shorter."}]
    _, _, body2 = await post(replica, "/v1/chat/completions", {"messages": turn2, "max_tokens": 3})
    cached = body2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % 16 == 0 and usage["prompt_tokens"] + 7 - 16 < cached <= usage["prompt_tokens"] + 7
    # as vLLM 0.32: what each request wrote to the cache in whole blocks of its prompt
    created = usage["prompt_tokens_details"]["created_cache_tokens"]
    assert created == usage["prompt_tokens"] // 16 * 16
    assert body2["usage"]["prompt_tokens_details"]["created_cache_tokens"] == (
        body2["usage"]["prompt_tokens"] // 16 * 16 - cached
    )


async def test_requests_waiting_for_a_lora_slot_are_deferred_as_vllm_counts_them(
    make_replica: Callable[..., Replica],
) -> None:
    """vLLM 0.32 splits its waiting requests: those for room in the batch, and those deferred (a LoRA
    slot, a KV transfer) whatever room there is; the router reads the first as the queue."""
    replica = make_replica(
        "lora", EngineConfig(num_blocks=4000, max_num_seqs=4, max_loras=1), adapters=("a", "b"), time_scale=1.0
    )
    await replica.start()
    try:
        async with aiohttp.ClientSession() as http:

            async def ask(model: str) -> int:
                body = {"model": model, "messages": [{"role": "user", "content": model}], "max_tokens": 40}
                async with http.post(replica.url + "/v1/chat/completions", json=body) as r:
                    return r.status

            sent = [asyncio.create_task(ask(m)) for m in ("a", "b", "b")]
            engine = replica.engine
            await until(
                lambda: len(engine.running) == 1 and len(engine.running) + len(engine.waiting) == 3,
                "the three requests in the engine, one of them running",
            )
            async with http.get(replica.url + "/metrics") as r:
                text = await r.text()
            assert await asyncio.gather(*sent) == [200, 200, 200]
    finally:
        await replica.stop()
    stats = parse_engine_metrics(text)
    # a runs; both b wait for its slot while the batch has room: deferred, and no queue for room
    assert (stats.running, stats.waiting, stats.deferred) == (1.0, 0.0, 2.0)
    assert 'vllm:num_requests_waiting{model_name="emulated-llm"} 2.0' in text


async def test_streamed_chat_through_the_openai_client(replica: Replica) -> None:
    client = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="unused")
    stream = await client.chat.completions.create(
        model="emulated-llm", messages=CHAT, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    await client.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}},
]


@pytest.mark.parametrize(
    ("choice", "name", "finish"),
    [("required", "read_file", "tool_calls"), ({"type": "function", "function": {"name": "run"}}, "run", "stop")],
)
async def test_a_chat_that_must_call_a_tool_is_answered_with_a_call_streamed_or_not(
    make_replica: Callable[..., Replica], choice: object, name: str, finish: str
) -> None:
    """As vLLM 0.32 with a tool parser answers a required tool (finish `tool_calls`) or a named one
    (`stop`): one call, its arguments JSON whole, streamed or not alike; the next turn carries the
    call and its result, and finds the call's turn cached. Without the parser: vLLM's 400."""
    plain = await post(
        await _started(make_replica("plain")),
        "/v1/chat/completions",
        {"messages": CHAT, "tools": TOOLS, "tool_choice": choice},
    )
    wanted = '"required"' if choice == "required" else f'function "{name}"'
    assert (
        plain[0] == 400
        and plain[2]["error"]["message"] == f"tool_choice={wanted} requires --tool-call-parser to be set"
    )
    replica = await _started(make_replica("tools", tools=True))
    client = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="unused")
    asked = {"model": "emulated-llm", "messages": CHAT, "max_tokens": 6, "tools": TOOLS, "tool_choice": choice}
    done = await client.chat.completions.create(**asked)  # type: ignore[call-overload]
    message = done.choices[0].message
    assert done.choices[0].finish_reason == finish and message.content is None
    assert message.tool_calls is not None and [c.function.name for c in message.tool_calls] == [name]
    arguments = message.tool_calls[0].function.arguments
    assert len(orjson.loads(arguments)["text"]) == 6 * 4
    stream = await client.chat.completions.create(**asked, stream=True)  # type: ignore[call-overload]
    chunks = [c async for c in stream if c.choices]
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert [c.id for c in calls if c.id] == [calls[0].id] and calls[0].function.name == name
    assert "".join(c.function.arguments or "" for c in calls) == arguments  # the same prompt, the same reply
    assert [c.choices[0].finish_reason for c in chunks][-1] == finish
    assert not any(c.choices[0].delta.content for c in chunks)
    turn2 = [
        *CHAT,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": "ok"},
    ]
    again = await client.chat.completions.create(model="emulated-llm", messages=turn2, max_tokens=2)  # type: ignore[arg-type]
    await client.close()
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= done.usage.prompt_tokens // 16 * 16  # type: ignore[union-attr]


async def test_auto_tool_choice_needs_the_parser_too_and_is_answered_in_text(
    make_replica: Callable[..., Replica],
) -> None:
    body = {"messages": CHAT, "max_tokens": 3, "tools": TOOLS, "tool_choice": "auto"}
    status, _, err = await post(await _started(make_replica("plain")), "/v1/chat/completions", body)
    assert (status, err["error"]["message"]) == (
        400,
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
    )
    status, _, answer = await post(await _started(make_replica("tools", tools=True)), "/v1/chat/completions", body)
    assert (
        status == 200
        and answer["choices"][0]["message"]["content"]
        and "tool_calls" not in answer["choices"][0]["message"]
    )


def test_the_tool_flags_are_vllms() -> None:
    from router.emulator.cli import UsageError, build_fleet, build_parser  # noqa: PLC0415

    with pytest.raises(UsageError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        build_fleet(build_parser().parse_args(["--enable-auto-tool-choice"]))
    for flags, tools in (
        ([], False),
        (["--tool-call-parser", "hermes"], False),
        (["--tool-call-parser", "hermes", "--enable-auto-tool-choice"], True),
    ):
        fleet, _ = build_fleet(build_parser().parse_args(flags))
        assert [r.served.tools for r in fleet.replicas] == [tools]  # (vLLM 0.32 loads the parser with both)


_STARTED: list[Replica] = []


async def _started(replica: Replica) -> Replica:
    await replica.start()
    _STARTED.append(replica)
    return replica


@pytest.fixture(autouse=True)
async def _stop_started() -> Any:
    yield
    while _STARTED:
        await _STARTED.pop().stop()


async def test_completions_streaming_and_not(replica: Replica) -> None:
    client = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="unused")
    done = await client.completions.create(model="emulated-llm", prompt="x" * 400, max_tokens=4)
    assert done.usage is not None and done.usage.prompt_tokens == 100 and len(done.choices[0].text) == 16
    stream = await client.completions.create(model="emulated-llm", prompt="x" * 400, max_tokens=4, stream=True)
    parts = [c.choices[0].text async for c in stream if c.choices]
    await client.close()
    assert "".join(parts) == done.choices[0].text  # the same prompt gets the same reply


async def test_raw_stream_ends_with_done_and_hides_usage_unless_asked(replica: Replica) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(replica.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "stream": True}) as resp,
    ):
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in (await resp.read()).split(b"\n\n") if line]
    assert events[-1] == b"data: [DONE]"
    assert all(b'"usage"' not in e for e in events)
    assert len(events) == 1 + 3 + 1  # role chunk, one chunk per token, [DONE]


async def test_stream_interval_groups_tokens(start_fleet) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1, stream_interval=4)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            fleet.replicas[0].url + "/v1/completions", json={"prompt": "abcd" * 10, "max_tokens": 10, "stream": True}
        ) as r,
    ):
        events = [e for e in (await r.read()).split(b"\n\n") if e]
    texts = [orjson.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert [len(t) // 4 for t in texts] == [1, 4, 4, 1]  # the first token alone, then chunks of 4


async def test_models_health_and_metrics(replica: Replica) -> None:
    for _ in range(2):
        await post(replica, "/v1/completions", {"prompt": "y" * 800, "max_tokens": 2})
    async with aiohttp.ClientSession() as s:
        async with s.get(replica.url + "/v1/models") as resp:
            models = await resp.json()
        async with s.get(replica.url + "/health") as resp:
            assert resp.status == 200 and resp.headers["X-Replica-Id"] == "r0"
        async with s.get(replica.url + "/metrics") as resp:
            metrics = await resp.text()
    assert models["data"][0]["id"] == "emulated-llm"
    values = {}
    for line in metrics.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    label = '{model_name="emulated-llm"}'
    assert values[f"vllm:prefix_cache_queries_total{label}"] == 400
    assert values[f"vllm:prefix_cache_hits_total{label}"] == 192  # 199 cacheable tokens: 12 blocks of 16
    assert values[f"vllm:prompt_tokens_total{label}"] == 400
    assert values[f"vllm:generation_tokens_total{label}"] == 4
    assert values[f"vllm:num_requests_running{label}"] == 0
    assert values[f"vllm:num_requests_waiting{label}"] == 0
    assert values[f"vllm:kv_cache_usage_perc{label}"] == 0
    assert values[f"vllm:time_to_first_token_seconds_count{label}"] == 2
    assert values[f"vllm:e2e_request_latency_seconds_count{label}"] == 2
    assert 0 <= values[f"emulator:kv_fragmentation{label}"] <= 1
    assert 0 < values[f"emulator:gpu_busy_fraction{label}"] <= 1


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "n": 2}, 400, "n"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-9"}, 404, "model"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, 400, "stream"),
        ("/v1/completions", {"prompt": [1, 2, 3]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 200_000}, 400, "max_tokens"),
        ("/v1/completions", [1, 2], 400, None),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": "", "max_tokens": 2}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/v1/chat/completions", {"messages": CHAT, "add_generation_prompt": "no"}, 400, "add_generation_prompt"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "any"}, 400, "tool_choice"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "required"}, 400, None),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            400,
            "tool_choice",
        ),
    ],
)
async def test_bad_requests_get_openai_shaped_errors(
    replica: Replica, path: str, body: object, status: int, param: str | None
) -> None:
    got, headers, err = await post(replica, path, body)
    assert got == status and headers["X-Replica-Id"] == "r0"
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param


async def test_invalid_json_is_a_clear_400(replica: Replica) -> None:
    status, _, err = await post(replica, "/v1/chat/completions", None, raw=b"{not json")
    assert status == 400 and "not valid JSON" in err["error"]["message"]


async def test_queue_and_kv_gauges_under_load(make_replica) -> None:  # type: ignore[no-untyped-def]
    r = make_replica(config=EngineConfig(max_num_seqs=2, num_blocks=500), time_scale=1.0)  # 0.6 s per request
    await r.start()
    try:
        async with aiohttp.ClientSession() as s:
            jobs = [
                asyncio.ensure_future(
                    s.post(r.url + "/v1/completions", json={"prompt": f"{i:04d}" * 100, "max_tokens": 60})
                )
                for i in range(6)
            ]
            await until(  # all six have arrived; the first two are still running, decoding
                lambda: (
                    (len(r.engine.running), len(r.engine.waiting)) == (2, 4)
                    and all(seq.output_tokens for seq in r.engine.running)
                ),
                "two requests running and decoding, four waiting",
            )
            async with s.get(r.url + "/metrics") as resp:
                text = await resp.text()
            for job in jobs:
                (await job).release()
        gauges = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("vllm:num_requests", "vllm:kv_cache", "emulator:kv_frag"))
        }
        assert gauges["vllm:num_requests_running"] == 2
        assert gauges["vllm:num_requests_waiting"] == 4
        assert 0 < gauges["vllm:kv_cache_usage_perc"] < 1
        assert 0 < gauges["emulator:kv_fragmentation"] < 1
    finally:
        await r.stop()
