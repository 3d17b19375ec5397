"""The forwarding framer: a replica's SSE stream cut into whole events, its usage read, the injected usage hidden."""

from __future__ import annotations

import re
from typing import Any

import orjson

from router.proxy.resume import FinishHold, finishes
from router.proxy.sse import DATA_LINE, EVENT, EVENT_END, calls_tools, usage_of

_DONE = re.compile(rb"(?:^|[\r\n])data: ?\[DONE\][ \t]*(?:\r\n|\r|\n|$)")


class EventCutter:
    """Bytes of an SSE stream cut at event ends: `take` returns the whole events a chunk completes."""

    __slots__ = ("_buf", "_scanned")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already searched for an event end

    @property
    def pending(self) -> bool:
        return bool(self._buf)

    def take(self, chunk: bytes) -> bytes:
        buf = self._buf
        buf += chunk
        end = -1
        # only the new bytes (and the three before them) can hold a new event end: linear overall
        for m in EVENT_END.finditer(buf, max(0, self._scanned - 3)):
            end = m.end()
        if end < 0:
            self._scanned = len(buf)
            return b""
        complete = bytes(buf[:end])
        del buf[:end]
        self._scanned = len(buf)
        return complete

    def rest(self) -> bytes:
        """What is left after the last whole event; the cutter starts over."""
        rest = bytes(self._buf)
        self._buf.clear()
        self._scanned = 0
        return rest


class SseFramer:
    """Splits a byte stream into SSE events (any of the spec's line endings); reads usage, drops
    the injected usage event, notices `[DONE]`. Events are forwarded byte for byte, except that when
    the router hides the usage event, the engine's own fields on it (llama-server's `timings`) are
    added to the finish event, held back until then (FinishHold). `events` counts the `data:` lines
    forwarded: about one generated token each (an engine that batches tokens into one event makes
    it fewer; the opening, finish, usage and `[DONE]` events a few more), what a stream cut before its
    usage is charged for (router.tenancy.budgets). `tools`: an event called tools (router.proxy.sse.calls_tools),
    looked for only where the request offered tools (`watch_tools`: 0.1 us a chunk saved on every other)."""

    __slots__ = ("_events", "_hold", "done", "events", "strip_usage", "tools", "usage", "watch_tools")

    def __init__(self, strip_usage: bool, watch_tools: bool = False) -> None:
        self.watch_tools = watch_tools
        self._events = EventCutter()
        self._hold = FinishHold()
        self.strip_usage = strip_usage
        self.usage: tuple[int, int, int] | None = None
        self.done = False
        self.events = 0
        self.tools = False

    def feed(self, chunk: bytes) -> bytes:
        if not self._events.pending and chunk.endswith(b"\n\n") and b"\r" not in chunk:
            # the common case: whole events ending in \n\n, nothing pending — no copy, no regex
            self.events += chunk.count(b"data:")
            if self.watch_tools and not self.tools and calls_tools(chunk):
                self.tools = True
            if b"[DONE]" in chunk and not self.done and _DONE.search(chunk):
                self.done = True
            if b'"usage"' not in chunk and not (self.strip_usage and (self._hold.held or finishes(chunk))):
                return chunk
            return self._filter(chunk)
        complete = self._events.take(chunk)
        if not complete:
            return b""
        self.events += complete.count(b"data:")
        if self.watch_tools and not self.tools and calls_tools(complete):
            self.tools = True
        if b"[DONE]" in complete and not self.done and _DONE.search(complete):
            self.done = True
        if b'"usage"' not in complete and not (self.strip_usage and (self._hold.held or finishes(complete))):
            return complete  # forward untouched
        return self._filter(complete)

    def _filter(self, complete: bytes) -> bytes:
        """Read the usage event out of whole events; drop it if the router injected the request."""
        kept = []
        hold = self._hold
        for m in EVENT.finditer(complete):
            event = m.group(1)
            body = event.strip()
            if b'"usage"' in body and body.startswith(b"data:"):
                try:
                    obj = orjson.loads(body[5:].strip())
                except orjson.JSONDecodeError:
                    obj = None
                usage = usage_of(obj)
                if usage is not None:
                    self.usage = usage
                    if self.strip_usage and not obj.get("choices"):
                        kept.append(hold.hidden(obj))
                        continue
            if self.strip_usage and finishes(event):
                kept.append(hold.hold(m.group(0)))
                continue
            kept.append(hold.release())
            kept.append(m.group(0))
        return b"".join(kept)

    def release(self) -> bytes:
        """The finish event held back, if any (the stream ended or broke before the next event)."""
        return self._hold.release()

    def pending(self) -> bytes:
        """Bytes after the last complete event (a cut-off event, or a last one without its blank line)."""
        rest = self._events.rest()
        if not self.done and _DONE.search(rest):
            self.done = True
        return rest


class NamedEvents:
    """A stream of named events (`event: NAME`, then `data:`), cut into whole events and forwarded
    byte for byte, without `[DONE]`: the events whose bytes hold one of `READ` are parsed and handed
    to `_on`; every other event passes unread. The router never asks such streams for usage (they
    carry their own), so nothing is hidden. `events` counts the events forwarded whose name ends in
    `delta` (Anthropic's `content_block_delta`, the Responses API's `response.output_text.delta`):
    about one generated token each (SseFramer's `events`); `tools`, an event called tools (an
    Anthropic `tool_use` block, a Responses API `function_call` item), where the request offered tools."""

    __slots__ = ("_events", "done", "events", "strip_usage", "tools", "usage", "watch_tools")
    READ: tuple[bytes, ...] = ()

    def __init__(self, watch_tools: bool = False) -> None:
        self.watch_tools = watch_tools
        self._events = EventCutter()
        self.strip_usage = False
        self.usage: tuple[int, int, int] | None = None
        self.done = False
        self.events = 0
        self.tools = False

    def feed(self, chunk: bytes) -> bytes:
        complete = self._events.take(chunk)
        if complete:  # an event line `event: NAME` ends with its line; a data line ends with JSON
            self.events += complete.count(b"delta\n") + complete.count(b"delta\r")
            if self.watch_tools and not self.tools and calls_tools(complete):
                self.tools = True
        if complete and any(name in complete for name in self.READ):
            for m in EVENT.finditer(complete):
                self._read(m.group(1))
        return complete

    def _read(self, event: bytes) -> None:
        if not any(name in event for name in self.READ):
            return
        data = b"\n".join(m.group(1) for m in DATA_LINE.finditer(event.replace(b"\r\n", b"\n").replace(b"\r", b"\n")))
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if isinstance(obj, dict):
            self._on(obj)

    def _on(self, event: dict[str, Any]) -> None:
        """Read one parsed event named in READ."""

    def release(self) -> bytes:
        return b""

    def pending(self) -> bytes:
        rest = self._events.rest()
        if rest.strip():
            self._read(rest)  # a last event without its blank line
        return rest


_TERMINAL = frozenset(("response.completed", "response.incomplete", "response.failed"))
_SEQUENCE = re.compile(rb'"sequence_number": ?(\d+)')


class ResponsesFramer(NamedEvents):
    """A Responses API stream (`event: response.*`): the router reads the response's id from
    `response.created`, its usage from the final event, and knows the stream is whole at
    `response.completed` (or `incomplete`, `failed`)."""

    __slots__ = ("_last", "response_id")
    READ = (b"response.created", b"response.completed", b"response.incomplete", b"response.failed")

    def __init__(self, watch_tools: bool = False) -> None:
        super().__init__(watch_tools)
        self._last = b""  # the latest whole events forwarded: where the stream's numbering stands
        self.response_id: str | None = None

    def next_sequence(self) -> int:
        """The `sequence_number` an event added after those forwarded would carry."""
        found = _SEQUENCE.findall(self._last)
        return int(found[-1]) + 1 if found else 0

    def feed(self, chunk: bytes) -> bytes:
        complete = super().feed(chunk)
        if complete:
            self._last = complete
        return complete

    def _on(self, event: dict[str, Any]) -> None:
        response = event.get("response")
        if not isinstance(response, dict):
            return
        kind = event.get("type")
        if kind == "response.created" and isinstance(response.get("id"), str):
            self.response_id = response["id"]
        elif kind in _TERMINAL:
            self.done = True
            if isinstance(response.get("id"), str):
                self.response_id = self.response_id or response["id"]
            self.usage = usage_of(response) or self.usage


_USAGE_FIELDS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


class MessagesFramer(NamedEvents):
    """An Anthropic Messages stream (`event: message_start`, `content_block_*`, `message_delta`,
    `message_stop`). Its usage comes in parts: `message_start` carries the prompt's (vLLM sends the
    whole prompt there; Anthropic, what it computed and what it read from cache), `message_delta`
    the final figures (vLLM adds the cache split there); the latest value of each field counts. The
    stream is whole at `message_stop`, or at an `error` event (the API's way to end a stream that
    failed)."""

    __slots__ = ("_usage",)
    READ = (b"message_start", b"message_delta", b"message_stop", b"event: error")

    def __init__(self, watch_tools: bool = False) -> None:
        super().__init__(watch_tools)
        self._usage: dict[str, Any] = {}

    def _on(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind in ("message_stop", "error"):
            self.done = True
            return
        holder = event.get("message") if kind == "message_start" else event
        usage = holder.get("usage") if isinstance(holder, dict) else None
        if isinstance(usage, dict):
            self._usage.update((k, usage[k]) for k in _USAGE_FIELDS if usage.get(k) is not None)
            self.usage = usage_of({"usage": self._usage}) or self.usage
