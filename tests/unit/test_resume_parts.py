"""Resuming broken streams: what the client has, the continuation request, the spliced events."""

from __future__ import annotations

from typing import Any

import orjson

from router.proxy.resume import SoFar, Splicer, StreamRecord, continuation, read_so_far


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
    for impossible, is_chat in (
        ({"prompt": "x", "response_format": {"type": "json_object"}}, False),
        ({"prompt": "x", "guided_json": {"type": "object"}}, False),
        ({"messages": [{"role": "user", "content": "q"}], "tool_choice": "required"}, True),
        (
            {
                "messages": [{"role": "assistant", "content": [{"type": "text", "text": "A"}]}],
                "continue_final_message": True,
            },
            True,
        ),
        ({"prompt": "x", "n": 2}, False),
        ({"prompt": "x", "best_of": 3}, False),
        ({"prompt": "x", "echo": True}, False),
        ({"prompt": [1, 2, 3]}, False),
        ({"prompt": ["a", "b"]}, False),
        ({"messages": []}, True),
        ({"messages": "hi"}, True),
    ):
        assert continuation(impossible, is_chat, so_far) is None, impossible


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
