"""The stream pump and framer: a client that leaves, and what the router hides of a stream."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import orjson
import pytest

from router.proxy.forward import Outcome, _pump
from router.proxy.framer import MessagesFramer, ResponsesFramer, SseFramer
from router.proxy.resume import SoFar, Splicer
from router.proxy.sse import StreamFramer
from router.routing import Served


class Upstream:
    def __init__(self, chunks: list[bytes]) -> None:
        self.content = self
        self._chunks = list(chunks)
        self.reads = 0

    async def readany(self) -> bytes:
        self.reads += 1
        return self._chunks.pop(0) if self._chunks else b""

    def at_eof(self) -> bool:
        return not self._chunks


class GoneClient:
    def __init__(self, after: int) -> None:
        self.after = after
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        if len(self.written) >= self.after:
            raise ConnectionResetError("Cannot write to closing transport")
        self.written.append(data)


async def test_a_client_that_leaves_mid_stream_is_not_an_upstream_error() -> None:
    events = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
    upstream = Upstream(events[1:])
    client = GoneClient(after=2)
    outcome = Outcome(client, Served(200, streamed=True))  # type: ignore[arg-type]
    outcome.framer = SseFramer(False)
    loop: Any = asyncio.get_running_loop()
    await _pump(upstream, outcome, events[0], 5.0, loop.time() + 5, 0.0)  # type: ignore[arg-type]
    assert outcome.facts.client_gone and outcome.stream_error is None and not outcome.facts.cut
    assert len(client.written) == 2 and upstream.reads == 2  # stopped reading the replica at once


# llama-server's stream when asked for usage (recorded): `timings` ride on the usage chunk, and
# on the finish chunk when usage was not asked for
LLAMA = [
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],'
    b'"created":1796132651,"id":"chatcmpl-J","model":"tiny.gguf","object":"chat.completion.chunk"}\n\n',
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" TCP"}}],'
    b'"created":1796132651,"id":"chatcmpl-J","model":"tiny.gguf","object":"chat.completion.chunk"}\n\n',
    b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],'
    b'"created":1796132651,"id":"chatcmpl-J","model":"tiny.gguf","object":"chat.completion.chunk"}\n\n',
    b'data: {"choices":[],"created":1796132651,"id":"chatcmpl-J","model":"tiny.gguf",'
    b'"object":"chat.completion.chunk","usage":{"completion_tokens":1,"prompt_tokens":18,"total_tokens":19,'
    b'"prompt_tokens_details":{"cached_tokens":17}},"timings":{"cache_n":17,"prompt_n":1,"predicted_n":1}}\n\n',
    b"data: [DONE]\n\n",
]


def run_framer(framer: StreamFramer, pieces: list[bytes]) -> bytes:
    out = b"".join(framer.feed(p) for p in pieces)
    return out + framer.release() + framer.pending()


def pieces_of(data: bytes, how: str) -> list[bytes]:
    if how == "events":
        return [e + b"\n\n" for e in data.split(b"\n\n") if e]
    if how == "bytes":
        return [data[i : i + 1] for i in range(len(data))]
    if how == "whole":
        return [data]
    rng = random.Random(how)
    cuts = sorted(rng.sample(range(1, len(data)), 12))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@pytest.mark.parametrize("how", ["events", "bytes", "whole", "seed-1", "seed-2"])
def test_timings_on_the_hidden_usage_chunk_reach_the_client_on_the_finish_chunk(how: str) -> None:
    framer = SseFramer(strip_usage=True)
    out = run_framer(framer, pieces_of(b"".join(LLAMA), how))
    events = [e for e in out.split(b"\n\n") if e]
    assert events[:2] == [e.strip() for e in LLAMA[:2]]  # untouched, byte for byte
    assert b'"usage"' not in out and events[-1] == b"data: [DONE]"
    finish = orjson.loads(events[2][5:])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["timings"] == {"cache_n": 17, "prompt_n": 1, "predicted_n": 1}
    assert events[2].startswith(LLAMA[2].strip()[:-1])  # the engine's bytes, the field added at the end
    assert framer.usage == (18, 17, 1) and framer.done


@pytest.mark.parametrize("how", ["events", "bytes", "seed-3"])
def test_a_stream_is_unchanged_when_nothing_is_hidden(how: str) -> None:
    data = b"".join(LLAMA)
    assert run_framer(SseFramer(strip_usage=False), pieces_of(data, how)) == data  # the client asked for usage
    plain = b"".join([*LLAMA[:3], LLAMA[4]])  # no usage chunk: the finish chunk goes out as it came
    assert run_framer(SseFramer(strip_usage=True), pieces_of(plain, how)) == plain
    vllm_usage = LLAMA[3].replace(b',"timings":{"cache_n":17,"prompt_n":1,"predicted_n":1}', b"")
    no_extras = b"".join([*LLAMA[:3], vllm_usage, LLAMA[4]])
    assert run_framer(SseFramer(strip_usage=True), pieces_of(no_extras, how)) == plain


def test_a_finish_chunk_held_when_the_stream_breaks_still_reaches_the_client() -> None:
    framer = SseFramer(strip_usage=True)
    assert framer.feed(b"".join(LLAMA[:3])) == b"".join(LLAMA[:2])
    assert framer.release() == LLAMA[2]  # the replica broke before its usage chunk
    assert framer.release() == b""


def test_the_splicer_keeps_timings_too() -> None:
    so_far = SoFar(text="x", chunks=1, id="chatcmpl-A", created=1, role=True)
    splicer = Splicer(so_far, chat=True, strip_usage=True)
    out = run_framer(splicer, pieces_of(b"".join(LLAMA), "events"))
    events = [orjson.loads(e[5:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert [e["id"] for e in events] == ["chatcmpl-A", "chatcmpl-A"]  # role chunk dropped, ids rewritten
    assert "usage" not in events[-1] and events[-1]["timings"]["cache_n"] == 17
    assert out.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("usage", "figures"),
    [
        ({"prompt_tokens": 18, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 17}}, (18, 17, 1)),
        ({"prompt_tokens": -4, "completion_tokens": -2, "prompt_tokens_details": {"cached_tokens": 9}}, (0, 0, 0)),
        ({"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 9}}, (5, 5, 2)),
    ],
)
def test_the_framer_and_the_splicer_read_usage_alike(usage: dict[str, Any], figures: tuple[int, int, int]) -> None:
    data = b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n"
    framer = SseFramer(strip_usage=False)
    splicer = Splicer(SoFar(), chat=True, strip_usage=False)  # nothing generated before: no figure moves
    run_framer(framer, [data])
    run_framer(splicer, [data])
    assert framer.usage == splicer.usage == figures  # odd figures never go negative nor past the prompt


def test_the_framers_count_the_events_that_carry_tokens_however_the_bytes_are_cut() -> None:
    tokens = [{"choices": [{"index": 0, "delta": {"content": f"t{i} data: x"}}]} for i in range(7)]
    chat = b"".join(b"data: " + orjson.dumps(t) + b"\n\n" for t in tokens) + b"data: [DONE]\n\n"
    anthropic = b"".join(
        b"event: content_block_delta\r\ndata: "
        + orjson.dumps({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "delta\\n"}})
        + b"\r\n\r\n"
        for _ in range(5)
    )
    responses = b"".join(
        b"event: response.output_text.delta\ndata: "
        + orjson.dumps({"type": "response.output_text.delta", "delta": "x"})
        + b"\n\n"
        for _ in range(4)
    )
    rng = random.Random(3)
    for framer, stream, at_least, at_most in (
        (SseFramer(False), chat, 7, 8 + 7),  # seven tokens, [DONE]; "data:" in a token's text counts too
        (MessagesFramer(), anthropic, 5, 5),
        (ResponsesFramer(), responses, 4, 4),
    ):
        cut = sorted(rng.sample(range(1, len(stream)), 6))
        for a, b in zip([0, *cut], [*cut, len(stream)], strict=True):
            framer.feed(stream[a:b])
        assert at_least <= framer.events <= at_most, (type(framer).__name__, framer.events)


def _events(*objects: dict[str, Any], named: bool = False, crlf: bool = False) -> bytes:
    end = b"\r\n\r\n" if crlf else b"\n\n"
    out = b""
    for o in objects:
        head = b"event: " + str(o["type"]).encode() + end[: len(end) // 2] if named else b""
        out += head + b"data: " + orjson.dumps(o) + end
    return out


def test_the_framers_read_whether_an_answer_called_tools_in_every_api_however_the_bytes_are_cut() -> None:
    """A chat choice's tool-call deltas (whatever its finish reason: vLLM ends a named tool choice
    with `stop`), an Anthropic `tool_use` block, a Responses API `function_call` item; a reply that
    only mentions those names, or an empty `tool_calls` list, calls none."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "read", "arguments": ""}}
    chat_tools = _events(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    )
    chat_text = _events(
        {"choices": [{"index": 0, "delta": {"content": 'call "tool_use" or "tool_calls":[{'}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "", "tool_calls": []}, "finish_reason": "stop"}]},
    )
    block = {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}
    anthropic_tools = _events(
        {"type": "content_block_start", "index": 0, "content_block": block},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 3}},
        named=True,
        crlf=True,
    )
    anthropic_text = _events(
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}},
        named=True,
    )
    item = {"type": "function_call", "call_id": "c", "name": "read", "arguments": ""}
    responses_tools = _events({"type": "response.output_item.added", "output_index": 0, "item": item}, named=True)
    responses_text = _events({"type": "response.output_text.delta", "delta": '"function_call"'}, named=True)
    rng = random.Random(5)
    for make, stream, tools in (
        (lambda: SseFramer(False, True), chat_tools, True),
        (lambda: SseFramer(True, True), chat_text, False),
        (lambda: MessagesFramer(True), anthropic_tools, True),
        (lambda: MessagesFramer(True), anthropic_text, False),
        (lambda: ResponsesFramer(True), responses_tools, True),
        (lambda: ResponsesFramer(True), responses_text, False),
        # a request that offered no tools: its answer is not searched for calls (none can be there)
        (lambda: SseFramer(False), chat_tools, False),
        (MessagesFramer, anthropic_tools, False),
        (ResponsesFramer, responses_tools, False),
    ):
        for cuts in (0, 1, 5):
            framer = make()
            cut = sorted(rng.sample(range(1, len(stream)), cuts))
            for a, b in zip([0, *cut], [*cut, len(stream)], strict=True):
                framer.feed(stream[a:b])
            framer.pending()
            assert framer.tools is tools, (type(framer).__name__, stream, cut)
    assert Splicer(SoFar(), chat=True, strip_usage=False).tools is False


def test_a_whole_answer_that_called_tools_is_read_as_one() -> None:
    from router.proxy.sse import calls_tools  # noqa: PLC0415

    message = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}
    assert calls_tools(orjson.dumps({"choices": [{"message": message, "finish_reason": "tool_calls"}]}))
    assert calls_tools(orjson.dumps({"content": [{"type": "tool_use", "id": "t"}], "stop_reason": "tool_use"}))
    assert calls_tools(orjson.dumps({"output": [{"type": "function_call", "name": "read"}]}))
    text = {"role": "assistant", "content": 'say "tool_calls": [{ "tool_use"', "tool_calls": []}
    assert not calls_tools(orjson.dumps({"choices": [{"message": text, "finish_reason": "stop"}]}))
    assert not calls_tools(b'{"function_call": null, "stop_reason": "end_turn"}')


def test_real_vllms_tool_call_stream_is_read_as_calling_tools() -> None:
    """Recorded from vLLM 0.32 here (`--enable-auto-tool-choice --tool-call-parser hermes`, a
    tiny random model, `tool_choice: required`): the call's opening delta, then a `length` finish
    (its arguments were cut at max_tokens): the call is what counts, not the finish reason."""
    from pathlib import Path  # noqa: PLC0415

    stream = (Path(__file__).resolve().parents[1] / "data" / "engines" / "vllm-0.32-tool-call-stream.txt").read_bytes()
    framer = SseFramer(False, watch_tools=True)
    run_framer(framer, [stream])
    assert framer.tools and framer.done
    plain = b"".join(line for line in stream.splitlines(keepends=True) if b"tool_calls" not in line)
    framer = SseFramer(False, watch_tools=True)
    run_framer(framer, [plain])
    assert not framer.tools
