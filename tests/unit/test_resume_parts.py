"""Resuming broken streams: what the client has, the continuation request, the spliced events."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.apis import CHAT, COMPLETION, EMBEDDING, MESSAGES, RESPONSES
from router.config import RouterConfig
from router.proxy.intake import Intake, take_in_body
from router.proxy.resume import (
    SoFar,
    Splicer,
    StreamRecord,
    continuation,
    read_so_far,
    streamed_text,
    why_not_continued,
)
from router.routing.request import Keys


def sse(*events: Any) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else orjson.dumps(e)) + b"\n\n" for e in events)


def chat_chunk(content: str | None, role: bool = False, finish: str | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": content or ""}
    if role:
        delta["role"] = "assistant"
    return {
        "id": "c-1",
        "created": 7,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def test_a_whole_streams_text_is_read_as_the_record_reads_it_back() -> None:
    record = StreamRecord(100_000)
    pieces = ["", "Hel", 'lo "quoted" \\ back', "slash\n", " caf\u00e9 \U0001f600", ' and "content": "no"']
    record.add(sse(chat_chunk(pieces[0], role=True), *(chat_chunk(p) for p in pieces[1:])))
    # logprobs name `content` too, as a list; reasoning is not the answer's text
    record.add(sse({"choices": [{"index": 0, "delta": {"content": "!"}, "logprobs": {"content": [{"token": "!"}]}}]}))
    record.add(sse({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}, chat_chunk(None, finish="stop")))
    record.add(b"data: [DONE]\n\n")
    so_far = read_so_far(record)
    assert so_far is not None and streamed_text(record) == so_far.text == "".join(pieces) + "!"
    assert streamed_text(StreamRecord(100)) is None  # nothing said
    over = StreamRecord(10)
    over.add(sse(chat_chunk("too long for the record")))
    assert streamed_text(over) is None


def test_the_record_reads_back_text_chunks_and_ids() -> None:
    record = StreamRecord(10_000)
    record.add(sse(chat_chunk("", role=True), chat_chunk("Hel")))
    record.add(sse(chat_chunk("lo")) + b": a comment\n\n" + b"data: not json\n\n")
    so_far = read_so_far(record)
    assert so_far is not None
    assert (so_far.text, so_far.chunks, so_far.id, so_far.created, so_far.finished) == ("Hello", 2, "c-1", 7, False)
    assert so_far.role and not so_far.other
    record.add(sse(chat_chunk("!", finish="length")))
    assert read_so_far(record).finished  # type: ignore[union-attr]
    tools = StreamRecord(10_000)
    tools.add(sse({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}, {"choices": "odd"}, {"choices": 5}))
    assert read_so_far(tools).other  # type: ignore[union-attr]
    small = StreamRecord(50)
    small.add(sse(chat_chunk("x" * 100)))
    assert small.overflowed and not small.buf and read_so_far(small) is None


def test_continuations() -> None:
    so_far = SoFar(text="Once upon", chunks=3)
    chat = {"messages": [{"role": "user", "content": "a story"}], "max_tokens": 10, "stream": True}
    follow = continuation(chat, True, so_far)
    assert follow is not None
    assert follow["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert follow["continue_final_message"] is True and follow["add_generation_prompt"] is False
    assert follow["max_tokens"] == 7 and chat["max_tokens"] == 10  # the original is left alone
    # a client already continuing an assistant message gets the text appended to it
    prefilled = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A: "}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_completion_tokens": 2,
    }
    follow = continuation(prefilled, True, so_far)
    assert follow is not None and follow["messages"][-1]["content"] == "A: Once upon" and len(follow["messages"]) == 2
    assert follow["max_completion_tokens"] == 1  # never below one
    assert continuation({"prompt": "Tell: ", "max_tokens": 5}, False, so_far) == {
        "prompt": "Tell: Once upon",
        "max_tokens": 2,
    }
    assert continuation({"prompt": ["Tell: "]}, False, so_far) == {"prompt": ["Tell: Once upon"]}
    assert continuation({"prompt": "x", "max_tokens": 5, "min_tokens": 4}, False, so_far) == {
        "prompt": "xOnce upon",
        "max_tokens": 2,
        "min_tokens": 1,
    }
    assert continuation({"prompt": "x", "response_format": {"type": "text"}}, False, so_far) is not None
    assert continuation({"messages": [{"role": "user", "content": "q"}], "tool_choice": "auto"}, True, so_far)
    assert continuation({"prompt": "x"}, False, SoFar(text="t", chunks=1, other=True)) is None  # tool calls seen
    # bodies it cannot continue: test_the_body_alone_says_why_it_cannot_be_continued


ASK = [{"role": "user", "content": "q"}]


@pytest.mark.parametrize(
    ("body", "chat", "reason"),
    [
        ({"prompt": "x", "n": 2}, False, "n"),
        ({"messages": ASK, "n": 3}, True, "n"),
        ({"prompt": "x", "best_of": 3}, False, "best_of"),
        ({"prompt": "x", "echo": True}, False, "echo"),
        ({"prompt": "x", "guided_json": {"type": "object"}}, False, "structured_outputs"),
        ({"messages": ASK, "guided_choice": ["a", "b"]}, True, "structured_outputs"),
        ({"messages": ASK, "structured_outputs": {"regex": "a+"}}, True, "structured_outputs"),
        ({"prompt": "x", "response_format": {"type": "json_object"}}, False, "response_format"),
        ({"messages": ASK, "response_format": "text"}, True, "response_format"),  # not even an object
        ({"messages": ASK, "tool_choice": "required"}, True, "tool_choice"),
        ({"messages": ASK, "tool_choice": {"type": "function", "function": {"name": "f"}}}, True, "tool_choice"),
        ({"messages": []}, True, "messages"),
        ({"messages": "hi"}, True, "messages"),
        ({}, True, "messages"),
        (
            {
                "messages": [{"role": "assistant", "content": [{"type": "text", "text": "A"}]}],
                "continue_final_message": True,
            },
            True,
            "messages",
        ),
        ({"messages": ASK, "continue_final_message": True}, True, "messages"),  # the last is not the assistant's
        ({"prompt": [1, 2, 3]}, False, "prompt"),
        ({"prompt": ["a", "b"]}, False, "prompt"),
        ({"prompt": None}, False, "prompt"),
        ({"messages": ASK}, False, "prompt"),  # a chat body on the completions API
    ],
)
def test_the_body_alone_says_why_it_cannot_be_continued(body: dict[str, Any], chat: bool, reason: str) -> None:
    assert why_not_continued(body, chat) == reason
    assert continuation(body, chat, SoFar(text="t", chunks=1)) is None  # journey.py's call agrees


def test_a_body_that_can_be_continued_passes_the_checks() -> None:
    for body, chat in (
        ({"messages": ASK, "n": 1, "best_of": None, "echo": False, "tool_choice": "none"}, True),
        ({"messages": ASK, "response_format": {"type": "text"}, "tool_choice": "auto", "guided_json": None}, True),
        ({"messages": [*ASK, {"role": "assistant", "content": "A"}], "continue_final_message": True}, True),
        ({"prompt": "x"}, False),
        ({"prompt": ["x"]}, False),
    ):
        assert why_not_continued(body, chat) is None, body
        assert continuation(body, chat, SoFar(text="t", chunks=1)) is not None, body


def taken_in(path: str, body: dict[str, Any], cfg: RouterConfig | None = None) -> Intake:
    cfg = cfg or RouterConfig()
    intake = take_in_body(path, {}, orjson.dumps(body), cfg.proxying, Keys.of(cfg))
    assert isinstance(intake, Intake)
    return intake


def test_the_intake_decides_once_whether_a_request_streams_and_can_be_resumed() -> None:
    keep = RouterConfig().resume_buffer_bytes
    chat = taken_in(CHAT.path, {"model": "m", "messages": ASK, "stream": True})
    assert (chat.api, chat.streams, chat.resumable, chat.keep) == (CHAT, True, True, keep)
    completion = taken_in(COMPLETION.path, {"model": "m", "prompt": "x", "stream": True})
    assert (completion.api, completion.streams, completion.resumable, completion.keep) == (COMPLETION, True, True, keep)
    # the body is checked as it goes upstream: usage asked for on the client's behalf does not stop a resume
    assert completion.strip_usage and completion.body["stream_options"] == {"include_usage": True}
    # streams the router cannot continue: their kind has no continuation, or their body rules it out
    for path, body in (
        (RESPONSES.path, {"model": "m", "input": "hi", "stream": True}),
        (MESSAGES.path, {"model": "m", "messages": ASK, "max_tokens": 8, "stream": True}),
        (CHAT.path, {"model": "m", "messages": ASK, "stream": True, "n": 2}),
        (COMPLETION.path, {"model": "m", "prompt": [1, 2], "stream": True}),
    ):
        intake = taken_in(path, body)
        assert intake.streams and not intake.resumable and intake.keep == 0, (path, body)
    # not streamed: nothing to resume, whatever the kind
    for path, whole in (
        (CHAT.path, {"model": "m", "messages": ASK}),
        (CHAT.path, {"model": "m", "messages": ASK, "stream": "true"}),  # only JSON's true streams
        (COMPLETION.path, {"model": "m", "prompt": "x", "stream": False}),
        (EMBEDDING.path, {"model": "m", "input": "x"}),
        (RESPONSES.path, {"model": "m", "input": "hi"}),
        (MESSAGES.path, {"model": "m", "messages": ASK, "max_tokens": 8}),
    ):
        intake = taken_in(path, whole)
        assert not intake.streams and not intake.resumable and intake.keep == 0, (path, whole)
        assert intake.api.path == path
    # resuming turned off: a stream is still a stream
    off = taken_in(CHAT.path, {"model": "m", "messages": ASK, "stream": True}, RouterConfig(resume_streams=False))
    assert off.streams and not off.resumable and off.keep == 0


def test_the_splicer_rewrites_a_continuation_into_the_original_stream() -> None:
    so_far = SoFar(text="Hello", chunks=2, id="c-1", created=7, role=True)
    splicer = Splicer(so_far, chat=True, strip_usage=False)
    cont = sse(
        {
            "id": "c-9",
            "created": 99,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        },
        {
            "id": "c-9",
            "created": 99,
            "choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": "length"}],
        },
        {
            "id": "c-9",
            "created": 99,
            "choices": [],
            "usage": {
                "prompt_tokens": 52,
                "completion_tokens": 3,
                "total_tokens": 55,
                "prompt_tokens_details": {"cached_tokens": 51},
            },
        },
        b"[DONE]",
    )
    out = splicer.feed(cont[:40]) + splicer.feed(cont[40:])  # split anywhere
    events = [orjson.loads(b[6:]) if b != b"data: [DONE]" else "[DONE]" for b in out.split(b"\n\n") if b]
    assert len(events) == 3 and events[-1] == "[DONE]" and splicer.done
    assert (
        events[0]["id"] == "c-1"
        and events[0]["created"] == 7
        and events[0]["choices"][0]["delta"]["content"] == " world"
    )
    usage = events[1]["usage"]
    # the original request's terms: its prompt (52 less the 2 tokens it already had), all 5 generated
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (50, 5, 55)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 50 and splicer.usage == (50, 50, 5)
    # when the router asked for usage on the client's behalf, that event is not sent
    hidden = Splicer(so_far, chat=True, strip_usage=True)
    assert b"usage" not in hidden.feed(cont) and hidden.usage == (50, 50, 5)
    # a client that never got the role chunk (cut before it) gets the continuation's
    bare = Splicer(SoFar(text="", chunks=0), chat=True, strip_usage=False)
    assert b'"role"' in bare.feed(cont)
    # odd usage figures are passed on untouched rather than failing the stream
    odd = Splicer(so_far, chat=True, strip_usage=False)
    assert b'"prompt_tokens":"many"' in odd.feed(sse({"choices": [], "usage": {"prompt_tokens": "many"}}))
    # completions keep every chunk; a last event without its blank line comes out of pending()
    plain = Splicer(SoFar(text="ab", chunks=1, id="t-1", created=1), chat=False, strip_usage=False)
    assert plain.feed(b'data: {"id":"t-2","choices":[{"text":"cd"}]}') == b""
    assert orjson.loads(plain.pending()[6:]) == {"id": "t-1", "created": 1, "choices": [{"text": "cd"}]}
