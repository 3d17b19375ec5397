"""Anthropic's Messages API in the router: its kind, its stream's framer and usage, its keys and
prompt blocks, its warm-up request, its errors."""

from __future__ import annotations

import orjson
import pytest

from router.apis import CHAT, COUNT_TOKENS, MESSAGES, PROXIED, anthropic, api_of
from router.balance.warmup import WARMABLE, prefill_only
from router.config import RouterConfig
from router.errors import (
    anthropic_error_body,
    error_body,
    error_body_for,
    in_shape,
    messages_error_event,
    openai_type,
    wrapped,
)
from router.prompt import prompt_of, render
from router.proxy.framer import MessagesFramer
from router.proxy.intake import Intake, Refused, take_in_body
from router.proxy.sse import usage_of
from router.routing.request import Keys

CFG = RouterConfig(replicas=("http://127.0.0.1:1",))


def event(kind: str, **fields: object) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def stream(start_usage: dict[str, int], final_usage: dict[str, int], crlf: bool = False) -> bytes:
    raw = (
        event("message_start", message={"id": "msg_1", "content": [], "usage": start_usage})
        + event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        + event("ping")
        + event("content_block_delta", index=0, delta={"type": "text_delta", "text": 'say "message_stop" here'})
        + event("content_block_stop", index=0)
        + event("message_delta", delta={"stop_reason": "end_turn"}, usage=final_usage)
        + event("message_stop")
    )
    return raw.replace(b"\n", b"\r\n") if crlf else raw


VLLM_START = {"input_tokens": 278, "output_tokens": 0}  # vLLM 0.32: the whole prompt, no split yet
VLLM_FINAL = {"input_tokens": 22, "output_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 256}
# Anthropic's own API: the split at the start, the output count at the end
ANTHROPIC_START = {
    "input_tokens": 22,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 256,
    "output_tokens": 1,
}
ANTHROPIC_FINAL = {"output_tokens": 4}


@pytest.mark.parametrize("crlf", [False, True])
@pytest.mark.parametrize("size", [1, 9, 64, 10_000])
@pytest.mark.parametrize(("start", "final"), [(VLLM_START, VLLM_FINAL), (ANTHROPIC_START, ANTHROPIC_FINAL)])
def test_the_framer_passes_a_stream_unchanged_and_reads_its_usage_and_end(
    size: int, crlf: bool, start: dict[str, int], final: dict[str, int]
) -> None:
    raw = stream(start, final, crlf)
    framer = MessagesFramer()
    out = b""
    for i in range(0, len(raw), size):
        assert not framer.done or i + size >= len(raw)  # the quoted "message_stop" in a delta ends nothing
        out += framer.feed(raw[i : i + size])
    out += framer.pending()
    assert out == raw and framer.done
    assert framer.usage == (278, 256, 4)  # the prompt is what was computed and what was read from cache


def test_a_cut_stream_is_not_done_and_an_error_event_ends_one() -> None:
    raw = stream(VLLM_START, VLLM_FINAL)
    cut = MessagesFramer()
    cut.feed(raw[: raw.index(b"event: message_delta")])
    assert not cut.done and cut.usage == (278, 0, 0)  # what message_start said: nothing known cached
    failed = MessagesFramer()
    failed.feed(raw[: raw.index(b"event: content_block_stop")] + event("error", error={"type": "overloaded_error"}))
    assert failed.done


def test_usage_in_anthropics_names_counts_cache_writes_and_reads_into_the_prompt() -> None:
    cold = {"usage": {"input_tokens": 30, "cache_creation_input_tokens": 128, "cache_read_input_tokens": 0}}
    warm = {"usage": {"input_tokens": 30, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 128}}
    plain = {"usage": {"input_tokens": 158, "output_tokens": 2}}  # no cache fields: input is the prompt
    assert usage_of(cold) == (158, 0, 0) and usage_of(warm) == (158, 128, 0) and usage_of(plain) == (158, 0, 2)
    assert usage_of({"usage": {"input_tokens": 3, "cache_read_input_tokens": "x"}}) is None  # odd: unread


def test_the_kinds_of_requests() -> None:
    assert api_of("/v1/messages") is MESSAGES and api_of("/v1/messages/count_tokens") is COUNT_TOKENS
    assert api_of("/v1/messages/batches") is None and api_of("/v1/chat/completions") is CHAT
    assert anthropic("/v1/messages/anything") and not anthropic("/v1/messagesx") and not anthropic("/v1/responses")
    assert MESSAGES.prompt and not MESSAGES.resumable and not COUNT_TOKENS.queued
    assert (
        WARMABLE
        == {a.path for a in PROXIED.values() if a.prompt}
        == {
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/messages",
        }
    )


def test_a_messages_request_is_keyed_and_cut_into_blocks_like_the_same_chat() -> None:
    system = "You answer questions about foxes. " * 4
    messages = {
        "model": "m",
        "system": [{"type": "text", "text": system}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "why does the fox run?"}]},
            {"role": "assistant", "content": "it is late"},
            {"role": "user", "content": "and now?"},
        ],
        "max_tokens": 8,
    }
    chat = {"model": "m", "messages": [{"role": "system", "content": system}, *messages["messages"]]}  # type: ignore[list-item]
    assert render(messages) == render(chat)
    one, other = prompt_of(messages, 16), prompt_of(chat, 16)
    assert one is not None and other is not None and list(one.chain) == list(other.chain)
    assert one.history_blocks == other.history_blocks > 0
    keyed = take_in_body(
        "/v1/messages", {}, orjson.dumps({**messages, "metadata": {"user_id": "u-7"}}), CFG.proxying, Keys.of(CFG, True)
    )
    assert isinstance(keyed, Intake) and keyed.api is MESSAGES
    assert (keyed.key.kind, keyed.key.source, keyed.key.key) == ("body", "metadata.user_id", b"u-7")
    assert keyed.key.prompt is not None and keyed.keep == 0  # not resumable
    # streamed: never asked for usage (it always comes), so nothing is hidden from the client
    streamed = take_in_body(
        "/v1/messages", {}, orjson.dumps({**messages, "stream": True}), CFG.proxying, Keys.of(CFG, True)
    )
    assert isinstance(streamed, Intake) and not streamed.strip_usage and "stream_options" not in streamed.body
    keyless = take_in_body("/v1/messages", {}, orjson.dumps(messages), CFG.proxying, Keys.of(CFG))
    assert isinstance(keyless, Intake) and keyless.key.kind == "prefix"  # the first user message, not the system


def test_a_messages_warm_up_request_has_no_openai_fields() -> None:
    stored = orjson.dumps({"model": "m", "messages": [], "max_tokens": 500, "stream": True, "system": "s"})
    warm = orjson.loads(prefill_only(stored, "/v1/messages") or b"")
    assert warm == {"model": "m", "messages": [], "max_tokens": 1, "stream": False, "system": "s"}
    chat = orjson.loads(prefill_only(stored, "/v1/chat/completions") or b"")
    assert chat["n"] == 1 and chat["max_tokens"] == 1


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "api_error"),
    ],
)
def test_errors_on_the_messages_api_take_its_shape(status: int, kind: str) -> None:
    body = orjson.loads(error_body_for("/v1/messages", "no", status, "whatever_openai_kind", "model"))
    assert body == {"type": "error", "error": {"type": kind, "message": "no"}}
    assert orjson.loads(anthropic_error_body("no", status)) == body
    openai = orjson.loads(error_body_for("/v1/chat/completions", "no", status, "queue_full", "model"))
    assert openai == {"error": {"message": "no", "type": openai_type(status), "param": "model", "code": "queue_full"}}


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "invalid_request_error"),  # OpenAI's for an unknown model or path, told apart by `code`
        (413, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (502, "server_error"),
        (503, "service_unavailable_error"),
    ],
)
def test_the_routers_own_errors_use_openais_types_and_a_string_code(status: int, kind: str) -> None:
    error = orjson.loads(error_body("no", status))["error"]
    assert error == {"message": "no", "type": kind, "param": None, "code": None}


@pytest.mark.parametrize(
    ("path", "body", "shaped"),
    [
        ("/v1/chat/completions", b'{"error": {"message": "m", "type": "BadRequestError", "code": 400}}', True),
        ("/v1/chat/completions", b"404: Not Found", False),
        ("/v1/chat/completions", b'{"detail": "Not Found"}', False),  # FastAPI's
        ("/v1/chat/completions", b'{"error": "m"}', False),
        ("/v1/messages", b'{"type": "error", "error": {"type": "api_error", "message": "m"}}', True),
        ("/v1/messages", b'{"error": {"message": "m", "type": "BadRequestError", "code": 400}}', False),  # OpenAI's
        # Anthropic's shape with vLLM's exception name for its type: not one of Anthropic's
        ("/v1/messages", b'{"type": "error", "error": {"type": "BadRequestError", "message": "m"}}', False),
    ],
)
def test_a_replicas_error_is_kept_when_in_the_apis_shape(path: str, body: bytes, shaped: bool) -> None:
    assert in_shape(path, body) is shaped


def test_a_replicas_error_out_of_shape_is_wrapped_with_its_words() -> None:
    openai = b'{"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}'
    assert orjson.loads(wrapped("/v1/messages", 400, openai)) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "the replica answered 400: prompt too long"},
    }
    vllm = b'{"type": "error", "error": {"type": "BadRequestError", "message": "max_tokens is too large"}}'
    for status, kind in ((400, "invalid_request_error"), (404, "not_found_error"), (500, "api_error")):
        assert orjson.loads(wrapped("/v1/messages", status, vllm)) == {
            "type": "error",
            "error": {"type": kind, "message": "max_tokens is too large"},  # its words kept, its type by status
        }
    fastapi = orjson.loads(wrapped("/v1/responses", 404, b'{"detail": "Not Found"}'))["error"]
    assert fastapi["message"] == "the replica answered 404: Not Found" and fastapi["code"] == "upstream_error"
    empty = orjson.loads(wrapped("/v1/completions", 500, b""))["error"]
    assert empty["message"] == "the replica answered 500 with no message" and empty["type"] == "server_error"
    long = orjson.loads(wrapped("/v1/completions", 500, b"x" * 10_000 + b"\xff"))["error"]["message"]
    assert len(long) < 2100  # bounded, and bytes that are not UTF-8 do not break it


def test_a_broken_messages_stream_ends_with_its_apis_error_event() -> None:
    raw = messages_error_event("upstream connection lost mid-stream")
    assert raw.startswith(b"event: error\ndata: ") and raw.endswith(b"\n\n") and raw.count(b"\n\n") == 1
    assert orjson.loads(raw.split(b"data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "api_error", "message": "upstream connection lost mid-stream"},
    }


def test_a_body_that_is_not_an_object_is_refused() -> None:
    refused = take_in_body("/v1/messages", {}, b"[]", CFG.proxying, Keys.of(CFG))
    assert isinstance(refused, Refused) and refused.status == 400


def test_claude_codes_attribution_line_is_left_out_of_the_prompt_as_vllm_leaves_it_out() -> None:
    """Its `cch` hash is new in every request: kept, no two requests of a session would share a block."""

    def claude_code(cch: str) -> dict[str, object]:
        header = f"x-anthropic-billing-header: cc_version=2.1.37; cc_entrypoint=cli; cch={cch};"
        system = [{"type": "text", "text": header}, {"type": "text", "text": "You are Claude Code. " * 8}]
        return {"model": "m", "system": system, "messages": [{"role": "user", "content": "fix the bug"}]}

    one, other = prompt_of(claude_code("0a1b2"), 16), prompt_of(claude_code("ffe93"), 16)
    assert one is not None and other is not None and list(one.chain) == list(other.chain)
    # in a chat request's system message (a gateway's translation), its first line goes
    chat = {"model": "m", "messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=1;\nBe terse."}]}
    assert render(chat)[0] == b"<|system|>Be terse.<|end|>"
    user = {"model": "m", "messages": [{"role": "user", "content": "x-anthropic-billing-header: is a header"}]}
    assert b"billing" in render(user)[0]  # only a system text loses it
