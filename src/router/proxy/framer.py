"""The forwarding framer: a replica's SSE stream cut into whole events, its usage read, the injected usage hidden."""

from __future__ import annotations

import re

import orjson

from router.proxy.resume import FinishHold, finishes
from router.proxy.sse import EVENT, EVENT_END, usage_of

_DONE = re.compile(rb"(?:^|[\r\n])data: ?\[DONE\][ \t]*(?:\r\n|\r|\n|$)")


class SseFramer:
    """Splits a byte stream into SSE events (any of the spec's line endings); reads usage, drops
    the injected usage event, notices `[DONE]`. Events are forwarded byte for byte, except that when
    the router hides the usage event, the engine's own fields on it (llama-server's `timings`) are
    added to the finish event, held back until then (FinishHold)."""

    __slots__ = ("_buf", "_hold", "_scanned", "done", "strip_usage", "usage")

    def __init__(self, strip_usage: bool) -> None:
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already searched for an event end
        self._hold = FinishHold()
        self.strip_usage = strip_usage
        self.usage: tuple[int, int, int] | None = None
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        buf = self._buf
        if not buf and chunk.endswith(b"\n\n") and b"\r" not in chunk:
            # the common case: whole events ending in \n\n, nothing pending — no copy, no regex
            if b"[DONE]" in chunk and not self.done and _DONE.search(chunk):
                self.done = True
            if b'"usage"' not in chunk and not (self.strip_usage and (self._hold.held or finishes(chunk))):
                return chunk
            return self._filter(chunk)
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
        rest = bytes(self._buf)
        self._buf.clear()
        self._scanned = 0
        if not self.done and _DONE.search(rest):
            self.done = True
        return rest
