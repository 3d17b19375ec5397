"""One upstream attempt: send the request to a replica and stream its answer to the client.

The client's response is not started until the replica's first body bytes arrive, so anything
that goes wrong before then (refused connection, reset, 5xx, time-out) is reported as a
`Retry` and the caller tries the next replica. Once bytes have gone out, a broken upstream
ends the client's stream with an SSE error event and `[DONE]`, never a silent cut.

Streams pass through byte for byte, framed only at event boundaries (`\\n\\n`) so the router can
read the usage event; when the router asked upstream for usage on the client's behalf, that one
event is dropped. Non-streamed bodies pass through unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.errors import sse_error_event

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
RESPONSE_DROP = HOP_BY_HOP | {"content-length", "date", "server"}


@dataclass
class Retry:
    """This attempt failed before any byte reached the client; another replica may serve it."""

    cause: str  # connect | timeout | http_5xx | reset
    status: int = 502
    body: bytes = b""
    content_type: str = "application/json"


@dataclass
class Outcome:
    """What one attempt did: the response given to the client and what was learned from it."""

    response: web.StreamResponse
    status: int
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    stream_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Timeouts:
    connect_s: float
    first_byte_s: float
    idle_s: float
    total_s: float

    @functools.cached_property
    def upstream(self) -> aiohttp.ClientTimeout:
        """aiohttp's own timer covers connecting; the rest is timed by `attempt`."""
        return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_s, sock_read=None)


def forward_headers(request: web.Request) -> dict[str, str]:
    drop = set(HOP_BY_HOP)
    connection = request.headers.get("Connection")
    if connection:
        drop.update(h.strip().lower() for h in connection.split(","))
    out = {k: v for k, v in request.headers.items() if k.lower() not in drop}
    peer = request.remote or ""
    prior = request.headers.get("X-Forwarded-For")
    out["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    out["Content-Type"] = "application/json"
    return out


def _usage_of(obj: Any) -> tuple[int, int] | None:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    try:
        return int(usage.get("prompt_tokens") or 0), int(cached or 0)
    except (TypeError, ValueError):
        return None


async def attempt(
    client: aiohttp.ClientSession,
    request: web.Request,
    url: str,
    body: bytes,
    headers: dict[str, str],
    extra_headers: dict[str, str],
    timeouts: Timeouts,
    deadline: float,
    strip_usage: bool,
    t0: float,
) -> Retry | Outcome:
    # One timer per attempt, moved forward as the attempt progresses (asyncio.wait_for would
    # start a task per read: measurably slower per SSE event). `deadline` is on the loop clock.
    loop = asyncio.get_running_loop()
    if deadline - loop.time() <= 0:
        return Retry("timeout", 504)
    upstream: aiohttp.ClientResponse | None = None
    try:
        try:
            async with asyncio.timeout_at(min(loop.time() + timeouts.first_byte_s, deadline)) as timer:
                upstream = await client.post(url, data=body, headers=headers, timeout=timeouts.upstream)
                if upstream.status >= 500:
                    timer.reschedule(min(loop.time() + timeouts.idle_s, deadline))
                    try:
                        data = await upstream.read()
                    except (aiohttp.ClientError, OSError):
                        data = b""
                    return Retry(
                        "http_5xx", upstream.status, data, upstream.headers.get("Content-Type", "application/json")
                    )
                # until the first body bytes arrive, failing over is invisible to the client
                first = await upstream.content.readany()
        except TimeoutError:
            return Retry("timeout", 504)
        except (aiohttp.ClientError, OSError):
            return Retry("connect" if upstream is None else "reset", 502)
        if not first:
            return Retry("reset", 502)
        return await _relay(request, upstream, first, extra_headers, timeouts, deadline, strip_usage, t0)
    finally:
        if upstream is not None:
            if upstream.content.at_eof():
                upstream.release()  # read to the end: the keep-alive connection goes back to the pool
            else:
                upstream.close()  # abandoned (client gone, error): the replica sees the request cancelled


async def _relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    first: bytes,
    extra_headers: dict[str, str],
    timeouts: Timeouts,
    deadline: float,
    strip_usage: bool,
    t0: float,
) -> Retry | Outcome:
    loop = asyncio.get_running_loop()
    content_type = upstream.headers.get("Content-Type", "")
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in RESPONSE_DROP}
    headers.update(extra_headers)
    idle = timeouts.idle_s
    if not content_type.startswith("text/event-stream"):
        chunks = [first]
        try:
            async with asyncio.timeout_at(None) as timer:
                while True:
                    timer.reschedule(min(loop.time() + idle, deadline))
                    chunk = await upstream.content.readany()
                    if not chunk:
                        break
                    chunks.append(chunk)
        except TimeoutError:
            return Retry("timeout", 504)
        except (aiohttp.ClientError, OSError):
            return Retry("reset", 502)
        data = b"".join(chunks)
        outcome = Outcome(web.Response(status=upstream.status, body=data, headers=headers), upstream.status)
        outcome.ttft_s = time.monotonic() - t0
        if upstream.status == 200 and content_type.startswith("application/json"):
            try:
                usage = _usage_of(orjson.loads(data))
            except orjson.JSONDecodeError:
                usage = None
            if usage:
                outcome.prompt_tokens, outcome.cached_tokens = usage
        return outcome
    resp = web.StreamResponse(status=upstream.status, headers=headers)
    await resp.prepare(request)
    outcome = Outcome(resp, upstream.status)
    framer = _SseFramer(strip_usage)
    chunk = first
    # The idle timer is moved only when a quarter of the idle time has passed since it was last
    # set, to 1.25 x idle: a stream that goes quiet is cut between idle and 1.25 x idle after its
    # last chunk, and a busy stream costs a clock read per chunk instead of a timer per chunk.
    slack = idle / 4
    try:
        async with asyncio.timeout_at(min(loop.time() + idle + slack, deadline)) as timer:
            moved = loop.time()
            while chunk:
                out = framer.feed(chunk)
                if out:
                    await resp.write(out)
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.monotonic() - t0
                now = loop.time()
                if now - moved > slack:
                    timer.reschedule(min(now + idle + slack, deadline))
                    moved = now
                chunk = await upstream.content.readany()
        tail = framer.flush()
        if tail:
            await resp.write(tail)
        if not framer.done:
            outcome.stream_error = "upstream closed the stream early"
    except TimeoutError:
        outcome.stream_error = "upstream stopped sending (idle time-out)"
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError):
        outcome.stream_error = "upstream connection lost mid-stream"
    if outcome.stream_error:
        await resp.write(sse_error_event(outcome.stream_error))
    if framer.usage:
        outcome.prompt_tokens, outcome.cached_tokens = framer.usage
    await resp.write_eof()
    return outcome


class _SseFramer:
    """Splits a byte stream into SSE events; reads usage, drops the injected usage event."""

    __slots__ = ("_buf", "done", "strip_usage", "usage")

    def __init__(self, strip_usage: bool) -> None:
        self._buf = b""
        self.strip_usage = strip_usage
        self.usage: tuple[int, int] | None = None
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        buf = self._buf + chunk if self._buf else chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        complete, self._buf = buf[: end + 2], buf[end + 2 :]
        if complete.startswith(b"data: [DONE]") or b"\n\ndata: [DONE]" in complete:
            self.done = True
        if b'"usage"' not in complete:
            return complete  # the common case: forward untouched
        kept = []
        for event in complete.split(b"\n\n")[:-1]:
            if b'"usage"' in event and event.startswith(b"data:"):
                try:
                    obj = orjson.loads(event[5:].strip())
                except orjson.JSONDecodeError:
                    obj = None
                usage = _usage_of(obj)
                if usage is not None:
                    self.usage = usage
                    if self.strip_usage and not obj.get("choices"):
                        continue
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest
