"""Routing keys: every source, the order they are tried in, and hostile values."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from router.keys import RoutingKey, routing_key

HEADERS = ("x-session-id", "conversation-id")
FIELDS = ("session_id", "metadata.session_id", "user")


def key(headers: dict[str, str] | None = None, body: Any = None, limit: int = 64) -> RoutingKey:
    return routing_key(
        headers or {}, body, header_names=HEADERS, body_fields=FIELDS, prefix_chars=32, max_key_bytes=limit
    )


CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
}


def test_first_source_wins() -> None:
    body = CHAT | {"session_id": "s-body", "user": "u-1", "metadata": {"session_id": "s-meta"}}
    assert key({"x-session-id": "s-h"}, body) == RoutingKey(b"s-h", "header", "x-session-id")
    assert key({"conversation-id": "c-h"}, body).key == b"c-h"
    assert key({}, body) == RoutingKey(b"s-body", "body", "session_id")
    assert key({}, CHAT | {"metadata": {"session_id": "s-meta"}, "user": "u"}).source == "metadata.session_id"
    assert key({}, CHAT | {"user": "u-1"}) == RoutingKey(b"u-1", "body", "user")
    assert key({}, CHAT | {"session_id": 42}).key == b"42"


def test_prefix_fingerprint_skips_the_system_prompt_and_is_stable_across_turns() -> None:
    first = key({}, CHAT)
    assert first.kind == "prefix"
    later = key(
        {},
        CHAT
        | {
            "messages": [
                *CHAT["messages"],
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And Italy?"},
            ]
        },
    )
    assert later.key == first.key
    other = key({}, CHAT | {"messages": [CHAT["messages"][0], {"role": "user", "content": "Hi there"}]})
    assert other.key != first.key  # same system prompt, different conversation
    assert key({}, CHAT | {"model": "n"}).key != first.key  # the model is part of it
    parts = key(
        {},
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}],
        },
    )
    assert parts.key == first.key
    assert key({}, {"model": "m", "prompt": "Once upon a time"}).kind == "prefix"
    assert key({}, {"model": "m", "input": ["embed me"]}).kind == "prefix"
    assert key({}, {"model": "m", "messages": [{"role": "system", "content": "only a system prompt"}]}).kind == "none"


def test_hostile_values_never_crash() -> None:
    assert key({"x-session-id": "   "}, CHAT).kind == "prefix"  # blank header: fall through
    assert key({"x-session-id": "caf\udce9"}, None).key == b"caf\xe9"  # raw non-UTF-8 bytes kept
    long = key({"x-session-id": "z" * 1000}, None, limit=64)
    assert long.kind == "header" and len(long.key) <= 64 and long.key != key({"x-session-id": "z" * 999}).key
    for body in (
        None,
        [],
        {"messages": "nope"},
        {"messages": [None, 3, {"role": "user"}]},
        {"session_id": None},
        {"session_id": True},
        {"metadata": "x"},
        {"prompt": [1, 2, 3]},
        {"user": {"a": 1}},
    ):
        result = key({}, body)
        assert isinstance(result, RoutingKey)
    assert key({}, {"messages": [{"role": "user", "content": "\ud800 lone surrogate"}]}).kind == "prefix"


# -- properties: any headers and any JSON body give a key, never an exception --------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
# header values as aiohttp hands them over: text, where bytes that are not UTF-8 arrive as surrogate escapes
HEADER_VALUES = st.binary(max_size=300).map(lambda b: b.decode("utf-8", "surrogateescape"))
BODIES = st.fixed_dictionaries(
    {},
    optional={
        "model": JSON,
        "messages": JSON,
        "prompt": JSON,
        "input": JSON,
        "session_id": JSON,
        "user": JSON,
        "metadata": JSON,
    },
)


@given(
    headers=st.dictionaries(st.sampled_from((*HEADERS, "other")), HEADER_VALUES, max_size=3),
    body=BODIES | JSON,
    limit=st.integers(min_value=1, max_value=128),
)
def test_any_request_gives_a_bounded_deterministic_key(headers: dict[str, str], body: Any, limit: int) -> None:
    got = key(headers, body, limit)
    assert got == key(dict(headers), body, limit)  # the same request, the same key
    assert got.kind in ("header", "body", "prefix", "none")
    assert (got.kind == "none") == (got.key == b"")
    assert len(got.key) <= max(limit, 34)  # at most the limit, or the fixed-length hash of a longer key
    if got.kind == "header":
        assert got.source in HEADERS and headers[got.source].strip()


@given(session=HEADER_VALUES.filter(lambda v: bool(v.strip())), body=BODIES | JSON)
def test_a_session_header_wins_over_any_body(session: str, body: Any) -> None:
    got = key({"x-session-id": session}, body, 1 << 16)
    assert got == RoutingKey(session.strip().encode("utf-8", "surrogateescape"), "header", "x-session-id")


@given(turns=st.lists(st.text(min_size=1, max_size=60), min_size=2, max_size=6), model=st.text(max_size=10))
def test_a_growing_conversation_keeps_its_prefix_key(turns: list[str], model: str) -> None:
    history: list[dict[str, str]] = [{"role": "system", "content": "shared system prompt"}]
    keys = set()
    for i, text in enumerate(turns):
        history = [*history, {"role": "user" if i % 2 == 0 else "assistant", "content": text}]
        keys.add(key({}, {"model": model, "messages": history}))
    assert len(keys) == 1 and next(iter(keys)).kind == "prefix"


def test_coding_agents_session_headers_key_first_and_a_sub_agent_names_its_parent() -> None:
    configured = {"conversation-id": "c-1"}  # a configured header: an agent's own goes first
    # Claude Code: its session header on every request; a top-level sub-agent adds its own id
    root = key(configured | {"x-claude-code-session-id": "cc-1"}, CHAT)
    assert root == RoutingKey(b"cc-1", "header", "x-claude-code-session-id") and root.parent is None
    sub = key({"x-claude-code-session-id": "cc-1", "x-claude-code-agent-id": "agent-7"}, CHAT)
    assert sub == RoutingKey(b"cc-1/agent-7", "header", "x-claude-code-agent-id") and sub.parent == b"cc-1"
    nested = key(
        {
            "x-claude-code-session-id": "cc-1",
            "x-claude-code-agent-id": "a-9",
            "x-claude-code-parent-agent-id": "agent-7",
        }
    )
    assert nested.key == b"cc-1/a-9" and nested.parent == b"cc-1/agent-7"  # under its parent agent, not the root
    other = key({"x-claude-code-session-id": "cc-2", "x-claude-code-agent-id": "agent-7"})
    assert other.key == b"cc-2/agent-7" != sub.key  # an agent id is only unique within its session
    same = key({"x-claude-code-session-id": "cc-1", "x-claude-code-agent-id": "cc-1"})
    assert same.key == b"cc-1" and same.parent is None  # an agent id equal to the session's is the root
    # OpenCode, the X-Dynamo-Session-ID convention, Codex CLI
    assert key({"x-session-id": "oc-2", "x-parent-session-id": "oc-1"}).parent == b"oc-1"
    dyn = key({"x-dynamo-session-id": "run:researcher", "x-dynamo-parent-session-id": "run"})
    assert dyn.key == b"run:researcher" and dyn.source == "x-dynamo-session-id" and dyn.parent == b"run"
    assert key({"session-id": "cx-1"}) == RoutingKey(b"cx-1", "header", "session-id")
    # a parent that is the session itself, or empty, names none; long ids are hashed alike on both sides
    assert key({"x-session-id": "oc-1", "x-parent-session-id": "oc-1"}).parent is None
    assert key({"x-session-id": "oc-1", "x-parent-session-id": "  "}).parent is None
    long = "p" * 100
    child = key({"x-session-id": "c", "x-parent-session-id": long}, limit=64)
    assert child.parent == key({"x-session-id": long}, limit=64).key and len(child.parent) < 64
    # turned off, the configured headers alone
    off = routing_key(
        configured | {"x-claude-code-session-id": "cc-1"},
        CHAT,
        header_names=HEADERS,
        body_fields=FIELDS,
        prefix_chars=32,
        max_key_bytes=64,
        agents=False,
    )
    assert off == RoutingKey(b"c-1", "header", "conversation-id")
