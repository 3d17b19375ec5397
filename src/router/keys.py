"""Routing keys: which conversation a request belongs to, as bytes, and where that came from.

First match wins: a coding agent's own session headers (`AGENTS`: Claude Code, Codex, OpenCode and
the `X-Dynamo-Session-ID` convention; a sub-agent is a session of its own that names its parent's),
then a configured header (`X-Session-ID`, ...), then configured body fields
(`session_id`, `metadata.session_id`, `metadata.user_id` (Anthropic's), `user`), then a prefix
fingerprint: the model plus the first non-system message of a chat (or the start of a completion
prompt / embedding input; an Anthropic request's system prompt is a field of its own),
which stays the same across the turns of one conversation because history only grows. The system
prompt alone is never the key: many sessions share it and would pile onto one replica.

Keys are bytes. Header values keep their raw bytes (non-UTF-8 survives as surrogate escapes);
keys longer than `max_key_bytes` are replaced by a fixed-length hash of themselves; empty values
fall through to the next source. Nothing here raises on client input.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.prompt import Prompt
from router.ring import xxh3_64

KINDS = ("response", "header", "body", "prefix", "none")
MAX_PARTS = 64  # content parts looked at for a fingerprint: bounded work whatever the body holds
MAX_MESSAGES = 64  # messages skipped looking for the first non-system one


@dataclass(frozen=True)
class RoutingKey:
    key: bytes
    kind: str  # one of KINDS: a metric label
    source: str  # the header or field it came from, for /admin/route and logs
    prompt: Prompt | None = field(default=None, compare=False)  # its blocks, for policies that read them
    model: str | None = field(default=None, compare=False)  # the model it names: only replicas serving it take it
    # a sub-agent's session: the key of the session that started it (it begins on that one's replica)
    parent: bytes | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class AgentHeaders:
    """The session headers one coding agent (or convention) sends on every request of a session."""

    sender: str
    session: str  # the session's id
    agent: str | None = None  # a sub-agent's own id, sent beside its root session's (the sub-agent's key)
    parent: str | None = None  # a sub-agent's parent: a session id, or (nested) its parent agent's id


# Looked up in order; the first whose session header a request carries keys it. Values are the
# agents' own: Claude Code sends its session id on every request and, from a sub-agent, that
# agent's id and its parent agent's (keyed as SESSION/AGENT; the root session stands for a
# top-level sub-agent's parent); OpenCode its session and parent session; Codex CLI one session
# id per thread.
AGENTS: tuple[AgentHeaders, ...] = (
    AgentHeaders("X-Dynamo-Session-ID convention", "x-dynamo-session-id", parent="x-dynamo-parent-session-id"),
    AgentHeaders(
        "Claude Code",
        "x-claude-code-session-id",
        agent="x-claude-code-agent-id",
        parent="x-claude-code-parent-agent-id",
    ),
    AgentHeaders("OpenCode", "x-session-id", parent="x-parent-session-id"),
    AgentHeaders("Codex CLI", "session-id"),
)

AGENT_SESSIONS = frozenset(agent.session for agent in AGENTS)


def agent_key(headers: Mapping[str, str], max_key_bytes: int, model: str | None) -> RoutingKey | None:
    """The key of a request that carries a coding agent's session headers (`AGENTS`), with its
    parent's key for a sub-agent; None when it carries none."""
    get = headers.get
    for agent in AGENTS:  # (most requests carry none: one lookup each, nothing else)
        value = get(agent.session)
        if not value:
            continue
        session = _encode(value.strip())
        if not session:
            continue
        own = _header(headers, agent.agent) if agent.agent else b""
        if own and own != session:
            # a sub-agent: a session of its own within its root session (its id may be unique only
            # there), under its parent agent's, else under the root's
            up = _header(headers, agent.parent) if agent.parent else b""
            parent = session + b"/" + up if up and up != session else session
            return RoutingKey(
                bounded_key(session + b"/" + own, max_key_bytes),
                "header",
                agent.agent or "",
                model=model,
                parent=bounded_key(parent, max_key_bytes),
            )
        parent = _header(headers, agent.parent) if agent.parent else b""
        return RoutingKey(
            bounded_key(session, max_key_bytes),
            "header",
            agent.session,
            model=model,
            parent=bounded_key(parent, max_key_bytes) if parent and parent != session else None,
        )
    return None


@functools.cache
def _after_agents(header_names: tuple[str, ...]) -> tuple[str, ...]:
    """`header_names` without the agents' session headers, which `agent_key` looked up already."""
    return tuple(n for n in header_names if n.lower() not in AGENT_SESSIONS)


def _header(headers: Mapping[str, str], name: str) -> bytes:
    value = headers.get(name)
    return _encode(value.strip()) if value else b""


NO_KEY = RoutingKey(b"", "none", "")


def bounded_key(raw: bytes, limit: int) -> bytes:
    """The key itself, or a fixed-length hash of it when it is longer than `limit` bytes."""
    if len(raw) <= limit:
        return raw
    return b"h:%016x%016x" % (xxh3_64(raw), xxh3_64(raw, 0x9E3779B97F4A7C15))


def _encode(text: str) -> bytes:
    """UTF-8, keeping raw bytes that arrived as surrogate escapes, and never failing."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def _to_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return _encode(value)
    if isinstance(value, bool) or value is None:
        return b""
    if isinstance(value, (int, float)):
        return str(value).encode()
    return b""


def _field(body: Mapping[str, Any], dotted: str) -> Any:
    node: Any = body
    for part in dotted.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _text_of(content: Any, limit: int) -> str:
    if isinstance(content, str):
        return content[:limit]
    if isinstance(content, list):  # content parts: the text ones, until `limit` characters
        out: list[str] = []
        have = 0
        for part in content[:MAX_PARTS]:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                out.append(part["text"])
                have += len(part["text"])
                if have >= limit:
                    break
        return "".join(out)[:limit]
    return ""


def prefix_text(body: Mapping[str, Any], limit: int) -> str:
    """The stable start of a conversation: the first non-system message, else the prompt or input."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages[:MAX_MESSAGES]:
            if isinstance(message, Mapping) and message.get("role") not in ("system", "developer"):
                text = _text_of(message.get("content"), limit)
                if text:
                    return text
        return ""
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, str):
            return value[:limit]
    return ""


def response_key(body: Mapping[str, Any], max_key_bytes: int, tenant: str | None = None) -> RoutingKey | None:
    """A Responses API request that continues a stored response (`previous_response_id`) or a
    conversation (`conversation`, an id or {"id": ...}): its key names that state, which lives on
    one replica alone (kind `response`: pinned there, router.routing.route). None otherwise.
    `tenant`: whose request it is (client keys on): a stored response is known under its tenant's
    name only (`stored_key`)."""
    named = body.get("model")
    model = named if isinstance(named, str) and named else None
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and previous:
        return RoutingKey(stored_key(previous, max_key_bytes, tenant), "response", "previous_response_id", model=model)
    conversation = body.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    if isinstance(conversation, str) and conversation:
        return RoutingKey(
            bounded_key(b"conv\x00" + _encode(conversation), max_key_bytes), "response", "conversation", model=model
        )
    return None


def stored_key(response_id: str, max_key_bytes: int, tenant: str | None = None) -> bytes:
    """The session key under which the replica holding a stored response is remembered; with a
    `tenant` (client keys on), in that tenant's name: another tenant's request finds nothing."""
    scope = b"" if tenant is None else _encode(tenant) + b"\x00"
    return bounded_key(b"resp\x00" + scope + _encode(response_id), max_key_bytes)


def routing_key(
    headers: Mapping[str, str],
    body: Mapping[str, Any] | None,
    *,
    header_names: tuple[str, ...],
    body_fields: tuple[str, ...],
    prefix_chars: int,
    max_key_bytes: int,
    agents: bool = True,
) -> RoutingKey:
    """A request's key from the first source that gives one (see the module's doc); `agents`:
    coding agents' session headers first (`AGENTS`)."""
    named = body.get("model") if isinstance(body, Mapping) else None
    model = named if isinstance(named, str) and named else None
    if agents:
        found = agent_key(headers, max_key_bytes, model)
        if found is not None:
            return found
        header_names = _after_agents(header_names)
    for name in header_names:
        value = headers.get(name)
        if value:
            raw = _encode(value.strip())
            if raw:
                return RoutingKey(bounded_key(raw, max_key_bytes), "header", name, model=model)
    if not isinstance(body, Mapping):
        return NO_KEY
    for dotted in body_fields:
        raw = _to_bytes(_field(body, dotted))
        if raw:
            return RoutingKey(bounded_key(raw, max_key_bytes), "body", dotted, model=model)
    text = prefix_text(body, prefix_chars)
    if text:
        raw = _encode(model or "") + b"\x00" + _encode(text)
        source = "messages" if "messages" in body else "prompt"
        return RoutingKey(bounded_key(raw, max_key_bytes), "prefix", source, model=model)
    return NO_KEY if model is None else RoutingKey(b"", "none", "", model=model)
