"""Resuming a stream that a replica broke mid-way, on another replica, in the same client stream.

While a stream is forwarded, the events sent to the client are kept (raw bytes, at most
`resume_buffer_bytes` per stream; past that the stream can no longer be resumed). When the
replica cuts the stream, stalls past the idle time-out or closes it before `[DONE]`, the router
reads back what the client already has — the text, and the number of content chunks as the count
of tokens generated (one token per chunk, as vLLM streams by default) — and sends the original
request to the next replica, continued:

- chat completions: the text so far becomes a final assistant message with vLLM's
  `continue_final_message: true` and `add_generation_prompt: false` (a final assistant message the
  client sent with `continue_final_message` gets the text appended instead);
- completions: the text so far is appended to the prompt (a single string prompt only);
- `max_tokens` / `max_completion_tokens` shrink by the tokens already generated.

The continuation's events are rewritten to look like the original's (its `id` and `created`; the
chat role-only opening chunk dropped; the usage event's prompt and completion counts put back in
the original request's terms) and spliced into the client's stream, which sees one response. A
request that cannot be continued ends with an SSE error event, as does one whose replicas all
fail: several choices, `echo`, a prompt that is not a string, structured output (a grammar would
restart after the prefix), tool calls or reasoning already streamed, a stream past the buffer.

What the body alone rules out (`why_not_continued`) is decided where the request is taken in
(router.proxy.intake): such a stream is not even recorded. What the stream rules out is known only
once it broke (`read_so_far`); `continued` then builds the continuation, and `continuation` does
both for a caller that holds only the body.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from router.proxy.sse import DATA_LINE, EVENT, usage_of

# the fields of an OpenAI stream chunk; anything else on the usage chunk the router hides (such as
# llama-server's `timings`) is the engine's and goes to the client on the finish chunk instead
CHUNK_FIELDS = frozenset(
    ("id", "object", "created", "model", "system_fingerprint", "service_tier", "choices", "usage", "obfuscation")
)


def finishes(data: bytes) -> bool:
    """Whether serialised events name a finish reason (not `"finish_reason":null`)."""
    return b'"finish_reason":"' in data or b'"finish_reason": "' in data


class FinishHold:
    """Holds a stream's finish event back until the next event arrives (at once, in practice): if
    that is the usage event the router asked for on the client's behalf and hides, the engine's own
    fields riding on it are added to the held event; otherwise the held event goes out unchanged."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = b""

    def hold(self, event: bytes) -> bytes:
        """Keep `event` (whole, with its blank line); return what was held before it."""
        out, self.held = self.held, event
        return out

    def hidden(self, usage_event: Any) -> bytes:
        """The hidden usage event's extra fields onto the held event, which is returned."""
        held, self.held = self.held, b""
        extras = {k: v for k, v in usage_event.items() if k not in CHUNK_FIELDS} if held else {}
        if not extras:
            return held
        line = DATA_LINE.search(held)
        try:
            event = orjson.loads(line.group(1).strip()) if line is not None else None
        except orjson.JSONDecodeError:
            event = None
        if not isinstance(event, dict) or any(k in event for k in extras):
            return held
        assert line is not None
        end = line.start(1) + line.group(1).rstrip().rfind(b"}")
        return held[:end] + b"," + orjson.dumps(extras)[1:-1] + held[end:]

    def release(self) -> bytes:
        out, self.held = self.held, b""
        return out


class StreamRecord:
    """The bytes forwarded to the client so far, up to `cap`; past it, only the fact it overflowed."""

    __slots__ = ("buf", "cap", "overflowed")

    def __init__(self, cap: int) -> None:
        self.buf = bytearray()
        self.cap = cap
        self.overflowed = False

    def add(self, data: bytes) -> None:
        if self.overflowed:
            return
        if len(self.buf) + len(data) > self.cap:
            self.overflowed = True
            self.buf = bytearray()  # the memory goes back at once
            return
        self.buf += data


@dataclass
class SoFar:
    """What the client has received of a stream."""

    text: str = ""
    chunks: int = 0  # chunks that carried text: the tokens generated, at one token per chunk
    id: Any = None
    created: Any = None
    finished: bool = False  # a choice carried its finish_reason: nothing is left to generate
    role: bool = False  # the client got the chat opening chunk (the role)
    other: bool = False  # tool calls or reasoning were streamed: text alone cannot continue them


def _events(data: bytes) -> list[Any]:
    """The JSON objects of the `data:` lines of whole events in `data` (others skipped)."""
    out = []
    for m in EVENT.finditer(data):
        for line in DATA_LINE.finditer(m.group(1)):
            payload = line.group(1).strip()
            if not payload or payload == b"[DONE]":
                continue
            try:
                out.append(orjson.loads(payload))
            except orjson.JSONDecodeError:
                continue
    return out


def read_so_far(record: StreamRecord) -> SoFar | None:
    """What the client already has; None when the record overflowed."""
    if record.overflowed:
        return None
    so_far = SoFar()
    parts: list[str] = []
    for event in _events(bytes(record.buf)):
        if not isinstance(event, dict):
            continue
        if so_far.id is None and "id" in event:
            so_far.id, so_far.created = event.get("id"), event.get("created")
        choices = event.get("choices")
        if not isinstance(choices, list):
            continue
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            piece = choice.get("text")
            delta = choice.get("delta")
            if isinstance(delta, dict):
                so_far.role = so_far.role or "role" in delta
                so_far.other = so_far.other or bool(delta.get("tool_calls") or delta.get("reasoning_content"))
                if piece is None:
                    piece = delta.get("content")
            if isinstance(piece, str) and piece:
                parts.append(piece)
                so_far.chunks += 1
            if choice.get("finish_reason"):
                so_far.finished = True
    so_far.text = "".join(parts)
    return so_far


# a chat chunk's text: its delta's `content` string (a logprobs `content` is a list; a
# `reasoning_content` has no quote before `content`)
_CONTENT = re.compile(rb'"content": ?"([^"\\]*(?:\\.[^"\\]*)*)"')  # (the loop unrolled: twice as fast)


def streamed_text(record: StreamRecord) -> str | None:
    """The text of a whole chat stream of one choice, as its client got it; None when the record
    overflowed or holds none. One pass of a regex over the bytes, one JSON string decoded: 37 us
    for 200 events, a sixteenth of `read_so_far`'s cost, for a stream that did not break (whose
    events are whole)."""
    if record.overflowed:
        return None
    pieces = _CONTENT.findall(record.buf)
    if not pieces:
        return None
    try:
        text = orjson.loads(b'"' + b"".join(pieces) + b'"')
    except orjson.JSONDecodeError:
        return None
    return text if isinstance(text, str) and text else None


STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def why_not_continued(body: dict[str, Any], chat: bool) -> str | None:
    """Why `body` cannot be continued after a break, whatever the stream held, in a word (None: it
    can): `n`, `best_of`, `echo`, `structured_outputs`, `response_format`, `tool_choice`,
    `messages` (chat: none, or a final message to continue that is not an assistant's text) or
    `prompt` (completions: not a single string)."""
    if body.get("n", 1) not in (1, None):
        return "n"
    if body.get("best_of", 1) not in (1, None):
        return "best_of"
    if body.get("echo"):
        return "echo"
    if any(body.get(name) for name in STRUCTURED):
        return "structured_outputs"
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return "response_format"
    tool_choice = body.get("tool_choice")
    if tool_choice is not None and tool_choice not in ("auto", "none"):
        return "tool_choice"  # a forced tool call is a grammar too
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages"
        last = messages[-1]
        if body.get("continue_final_message") and not (
            isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), str)
        ):
            return "messages"
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str)):
        return None
    return "prompt"


def continued(body: dict[str, Any], chat: bool, so_far: SoFar) -> dict[str, Any]:
    """The request that continues `body`, which `why_not_continued` passed, after `so_far`."""
    new = dict(body)
    for name in ("max_tokens", "max_completion_tokens"):
        limit = body.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            new[name] = max(limit - so_far.chunks, 1)
    floor = body.get("min_tokens")
    if isinstance(floor, int) and not isinstance(floor, bool):
        new["min_tokens"] = max(floor - so_far.chunks, 0)
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(new.get(name), int):
                new["min_tokens"] = min(new["min_tokens"], new[name])
    if chat:
        messages = body["messages"]
        if body.get("continue_final_message"):
            last = messages[-1]
            new["messages"] = [*messages[:-1], {**last, "content": last["content"] + so_far.text}]
        else:
            new["messages"] = [*messages, {"role": "assistant", "content": so_far.text}]
        new["continue_final_message"] = True
        new["add_generation_prompt"] = False
    else:
        prompt = body["prompt"]
        new["prompt"] = prompt + so_far.text if isinstance(prompt, str) else [prompt[0] + so_far.text]
    return new


def continuation(body: dict[str, Any], chat: bool, so_far: SoFar) -> dict[str, Any] | None:
    """The request that continues `body` after `so_far`; None when it cannot be continued (the
    body fails `why_not_continued`, or tool calls or reasoning were streamed)."""
    if so_far.other or why_not_continued(body, chat) is not None:
        return None
    return continued(body, chat, so_far)


class Splicer:
    """A continuation's SSE stream, rewritten into the original's: same `id` and `created`, no
    second role chunk, usage in the original request's terms (and dropped when the router asked
    for it on the client's behalf). A `StreamFramer`, as the forwarding framer is."""

    __slots__ = ("_buf", "_hold", "chat", "done", "events", "so_far", "strip_usage", "usage")
    tools = False  # a stream that called tools is never continued (`read_so_far`'s `other`)

    def __init__(self, so_far: SoFar, chat: bool, strip_usage: bool) -> None:
        self._buf = bytearray()
        self._hold = FinishHold()
        self.so_far = so_far
        self.chat = chat
        self.strip_usage = strip_usage
        self.usage: tuple[int, int, int] | None = None
        self.done = False
        self.events = 0  # the continuation's events forwarded (as SseFramer's `events`)

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        out = bytearray()
        end = 0
        for m in EVENT.finditer(self._buf):
            end = m.end()
            out += self._event(m.group(1))
        del self._buf[:end]
        self.events += out.count(b"data:")
        return bytes(out)

    def pending(self) -> bytes:
        rest = bytes(self._buf)
        self._buf.clear()
        last = self._event(rest) if rest.strip() else b""
        return last + self._hold.release()

    def release(self) -> bytes:
        """The finish event held back, if any (the stream ended or broke before the next event)."""
        return self._hold.release()

    def _event(self, raw: bytes) -> bytes:
        line = DATA_LINE.search(raw)
        if line is None:
            return b""  # comments and other fields are not needed in a spliced stream
        payload = line.group(1).strip()
        if payload == b"[DONE]":
            self.done = True
            return self._hold.release() + b"data: [DONE]\n\n"
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return b""
        if not isinstance(event, dict):
            return b""
        if self.so_far.id is not None:
            event["id"] = self.so_far.id
        if self.so_far.created is not None:
            event["created"] = self.so_far.created
        choices = event.get("choices")
        if (
            self.chat
            and self.so_far.role
            and isinstance(choices, list)
            and choices
            and all(_role_only(c) for c in choices)
        ):
            return b""  # the continuation's opening chunk: the client had its own
        usage = event.get("usage")
        if isinstance(usage, dict):
            figures = usage_of(event)
            if figures is not None:  # odd figures are passed on as they came
                # the text generated so far is in the continuation's prompt: in the original's terms it is output
                generated = self.so_far.chunks
                prompt = max(figures[0] - generated, 0)
                cached = min(figures[1], prompt)
                completion = figures[2] + generated
                self.usage = (prompt, cached, completion)
                usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict):
                    details["cached_tokens"] = cached
            if self.strip_usage and not choices:
                return self._hold.hidden(event)
        out = b"data: " + orjson.dumps(event) + b"\n\n"
        if self.strip_usage and isinstance(choices, list) and any(_finished(c) for c in choices):
            return self._hold.hold(out)
        return self._hold.release() + out


def _finished(choice: Any) -> bool:
    return isinstance(choice, dict) and bool(choice.get("finish_reason"))


def _role_only(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return isinstance(delta, dict) and "role" in delta and not delta.get("content") and not choice.get("finish_reason")
