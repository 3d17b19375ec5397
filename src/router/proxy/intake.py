"""Intake of a proxied request: its headers and body within the limits, JSON parsed, routing key found
(the overload queue, which may hold it next, is router.tenancy.admission).

A request that fails gets the answer it deserves (431, 408, 413 or 400), in its API's shape
(OpenAI's, or Anthropic's on the Messages API), and never reaches a replica. What can be refused
from the head is: no valid key (401), two credentials (400, router.tenancy.clients), a `Content-Length`
over `max_body_bytes` (413). Its body is then not read, unless it is small and of a known length
(`KEEP_BODY_BYTES`: read and dropped, so a well-behaved client keeps its connection): the answer
goes out while the client may still be sending, says `Connection: close`, and the connection
closes after it (`LINGER_S`, `LINGER_BYTES`). A chunked body is refused (413) the moment it passes
the limit, the same way. A body that pauses for `client_timeout_s`, or falls below
`min_body_rate_bytes_per_s` once it has had `BODY_GRACE_S` (a slow-body attack: a byte now and
then, never a long pause), gets a 408. One that passes may
be changed on the way: a stream that did not ask for usage is asked for it (`inject_usage`), so
the router learns its token counts, and the client is not shown it. What the rest of the router
asks of the request is decided here, once: its kind (router.apis), whether it streams, and whether a
stream broken mid-way can be resumed on another replica (router.proxy.resume), its priority
class (X-Priority, capped by its tenant's: router.tenancy.clients) and its time-to-first-token target
(x-slo-ttft-ms, which `ttft` placement checks its prediction against).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from router.apis import CHAT, Api, api_of
from router.config.groups import ProxySettings
from router.errors import error_body_for
from router.keys import RoutingKey
from router.proxy.exchange import Exchange
from router.proxy.resume import why_not_continued
from router.routing.request import Keys
from router.tenancy.clients import DEFAULT_RANK, PRIORITIES, RANK, AmbiguousKey, Client, ClientKeys, subject_of
from router.web import JSON, error_response

PRIORITY_HEADERS = ("x-priority", "x-smg-priority")  # ours, and smg's (the same class names)
TARGET_HEADER = "x-slo-ttft-ms"  # as llm-d's predicted-latency scheduling reads it
MAX_TARGET_MS = 3_600_000.0
KEEP_BODY_BYTES = 64 * 1024  # a refused request's body of a known length up to this is read: its connection stays
BODY_GRACE_S = 5.0  # a body's first seconds, before `min_body_rate_bytes_per_s` applies
LINGER_S = 1.0  # after an answer from the head, what the client sends on is dropped this long at most ...
LINGER_BYTES = 256 * 1024  # ... and this much at most: then the connection closes


def peer_subject(request: web.Request) -> str | None:
    """The CN of the client certificate an aiohttp request's connection presented (mTLS), if any."""
    transport = request.transport
    return subject_of(transport.get_extra_info("peercert")) if transport is not None else None


def keeps_connection(content_length: int | None) -> bool:
    """Whether a request refused from its head has its body read and dropped (small, of a known
    length: its connection stays usable) rather than left unread (its connection closes)."""
    return content_length is not None and content_length <= KEEP_BODY_BYTES


def body_deadline(start: float, received: int, min_rate: float) -> float:
    """When a body that began at `start` and has `received` bytes falls below `min_rate` bytes a
    second, its first BODY_GRACE_S given (as Apache's mod_reqtimeout's MinRate: each byte buys
    1/min_rate s more); inf without a floor."""
    return start + BODY_GRACE_S + received / min_rate if min_rate > 0 else math.inf


async def read_body(request: web.Request, limit: int, pause_s: float, total_s: float, min_rate: float = 0.0) -> bytes:
    """The request body as it arrives. TimeoutError if it pauses for `pause_s` (a client stuck, or
    slow on purpose), falls below `min_rate` bytes a second (`body_deadline`) or takes more than
    `total_s` in all; HTTPRequestEntityTooLarge past `limit`."""
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    parts: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with asyncio.timeout(total_s):
        while True:
            wait = min(pause_s, body_deadline(start, size, min_rate) - loop.time())
            if wait <= 0:
                raise TimeoutError
            async with asyncio.timeout(wait):
                chunk = await request.content.readany()
            if not chunk:
                return b"".join(parts)
            size += len(chunk)
            if size > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
            parts.append(chunk)


@web.middleware
async def unread_bodies(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's side (its path to the proxied endpoints, the admin API, the console): an error
    answered before a body that is not small was read goes out at once, and the connection closes
    after at most LINGER_S and LINGER_BYTES of what the client sends on (aiohttp's own lingering
    reads the whole body, for up to `lingering_time`). An HTTP error aiohttp raises itself (a
    method its router has no route for, as CONNECT) is answered in the API's JSON shape."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}  # (405: what is allowed)
        response = error_response(exc.reason, exc.status, path=request.path, headers=allow)
    if response.status < 400 or response.prepared or keeps_connection(request.content_length):
        return response
    if request.content.is_eof():
        return response
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    transport = request.transport
    if transport is not None and not transport.is_closing() and transport.can_write_eof():
        transport.write_eof()  # the answer, then our end: the client reads it, not a reset
    left = LINGER_BYTES
    # what comes now is dropped unparsed; a broken or endless body ends the wait as well as its end
    with contextlib.suppress(Exception):
        async with asyncio.timeout(LINGER_S):
            while left > 0 and (data := await request.content.readany()):
                left -= len(data)
    request.protocol.force_close()
    return response


@dataclass(slots=True)
class Intake:
    """A request taken in: its kind, its body parsed, its key found, usage asked for if hidden,
    whether it streams and whether it can be resumed."""

    body: dict[str, Any]
    raw: bytes
    key: RoutingKey
    strip_usage: bool  # the router asked for usage: the client is not shown it
    keep: int  # bytes of the stream kept to resume it elsewhere (0: not resumable)
    api: Api
    streams: bool  # the client asked for a stream (`"stream": true`)
    client: Client | None = None  # whose key it brought, with client keys on (router.tenancy.clients)
    rank: int = DEFAULT_RANK  # its priority class (router.tenancy.clients.PRIORITIES)
    target_s: float | None = None  # the time to first token it asks for (x-slo-ttft-ms), in seconds

    @property
    def resumable(self) -> bool:
        """A stream broken mid-way is continued on another replica (router.proxy.resume)."""
        return self.keep > 0


@dataclass(frozen=True, slots=True)
class Refused:
    """The answer a request gets instead of being forwarded (OpenAI-shaped)."""

    status: int
    message: str
    code: str | None = None  # OpenAI's `code`: what went wrong, in a word (its `type` follows the status)
    close: bool = False  # the connection closes after it (what is left of the body must not be read as a request)
    param: str | None = None  # the request's field at fault
    client: Client | None = None  # whose valid key it brought, if it did: its tenant is counted and logged

    def answer(self, exchange: Exchange) -> None:
        body = error_body_for(exchange.path, self.message, self.status, self.code, self.param)
        exchange.answer(self.status, body, JSON, self.close)


def unauthorized(close: bool = False) -> Refused:
    """A request without a valid client key (router.tenancy.clients), in its API's shape; `close`: its
    body was not read, so the connection closes after the answer."""
    return Refused(
        401,
        "a valid API key is needed: send it as `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`)",
        "invalid_api_key",
        close,
    )


def ambiguous(why: AmbiguousKey, close: bool = False) -> Refused:
    """A request that presents two credentials (router.tenancy.clients.presented_key): never guessed between."""
    return Refused(400, str(why), "ambiguous_credentials", close)


def who(
    clients: ClientKeys, headers: Mapping[str, str] | list[tuple[str, str]], subject: str | None = None
) -> Client | Refused:
    """The client a request's credential names (its key, or `subject`: its client certificate's CN),
    or its refusal (401, or 400 for two), `close` set: the caller keeps the connection
    (`keeps_connection`) where it reads the small body."""
    try:
        client = clients.client(headers, subject)
    except AmbiguousKey as exc:
        return ambiguous(exc, close=True)
    return client if client is not None else unauthorized(close=True)


def unknown_response(response_id: object) -> Refused:
    """A `previous_response_id` this tenant's requests did not produce (client keys on)."""
    return Refused(
        404,
        f"Previous response with id '{response_id}' not found.",
        "previous_response_not_found",
        param="previous_response_id",
    )


def no_such_model(model: str) -> Refused:
    """No replica in the fleet serves `model` (as each one's /v1/models or the pinned models say)."""
    return Refused(
        404,
        f"The model `{model}` does not exist: no replica behind this router serves it.",
        "model_not_found",
        param="model",
    )


def too_many_header_bytes(size: int, cfg: ProxySettings) -> Refused:
    return Refused(431, f"request headers are {size} bytes; the limit is {cfg.max_header_bytes}", "request_too_large")


def too_slow(cfg: ProxySettings) -> Refused:
    return Refused(
        408,
        f"the request body paused for client_timeout_s ({cfg.client_timeout_s:g} s), came slower than "
        f"min_body_rate_bytes_per_s ({cfg.min_body_rate_bytes_per_s:g}) or took longer than total_timeout_s "
        f"({cfg.total_timeout_s:g} s)",
        "request_timeout",
        close=True,
    )


def too_large(cfg: ProxySettings) -> Refused:
    """A body over the limit: refused from its head (Content-Length) or as it passes it (chunked);
    the rest is not read, so the connection closes."""
    return Refused(
        413, f"request body is larger than the limit of {cfg.max_body_bytes} bytes", "request_too_large", close=True
    )


async def take_in(
    request: web.Request, cfg: ProxySettings, keys: Keys, clients: ClientKeys | None = None
) -> Intake | Refused:
    """An aiohttp request's body and key, or the answer it gets instead (431, 401, 408, 413, 400);
    with client keys on, its key is checked before its body is read. `cfg`: the limits it is
    taken in within; `keys`: how its routing key is read."""
    # checked here rather than in a middleware: a middleware wraps every request's handler
    size = sum(len(k) + len(v) + 4 for k, v in request.raw_headers)
    if size > cfg.max_header_bytes:
        return too_many_header_bytes(size, cfg)
    client = None
    if clients is not None:
        found = who(clients, request.headers, peer_subject(request))
        if isinstance(found, Refused):
            if keeps_connection(request.content_length):  # small: read and dropped, the connection kept
                try:
                    await read_body(
                        request,
                        KEEP_BODY_BYTES,
                        cfg.client_timeout_s,
                        cfg.total_timeout_s,
                        cfg.min_body_rate_bytes_per_s,
                    )
                except (TimeoutError, web.HTTPRequestEntityTooLarge):
                    return found
                return dataclasses.replace(found, close=False)
            return found  # its body is not read (router.proxy.workers closes the connection)
        client = found
    try:
        raw = await read_body(
            request, cfg.max_body_bytes, cfg.client_timeout_s, cfg.total_timeout_s, cfg.min_body_rate_bytes_per_s
        )
    except TimeoutError:
        return dataclasses.replace(too_slow(cfg), client=client)
    except web.HTTPRequestEntityTooLarge:
        return dataclasses.replace(too_large(cfg), client=client)
    return take_in_body(request.path, request.headers, raw, cfg, keys, client)


def wishes(headers: Mapping[str, str], client: Client | None) -> tuple[int, float | None] | Refused:
    """The priority class and time-to-first-token target a request asks for, or the 400 it gets
    for a value that is neither. Its tenant's class caps the ask (a header never raises a request
    above it) and is the class of a request that asks none; without client keys, as asked."""
    rank = client.rank if client is not None else DEFAULT_RANK
    for name in PRIORITY_HEADERS:
        asked = headers.get(name)
        if asked is not None:
            wanted = RANK.get(asked.strip().lower())
            if wanted is None:
                return Refused(400, f"{name} must be one of {', '.join(PRIORITIES)}", "invalid_priority")
            rank = max(wanted, client.rank) if client is not None else wanted
            break
    target = headers.get(TARGET_HEADER)
    if target is None:
        return rank, None
    try:
        ms = float(target)
    except ValueError:
        ms = -1.0
    if not 0 < ms <= MAX_TARGET_MS:  # (nan fails too)
        return Refused(400, f"{TARGET_HEADER} must be milliseconds in (0, {MAX_TARGET_MS:.0f}]", "invalid_ttft_target")
    return rank, ms / 1000


def take_in_body(
    path: str,
    headers: Mapping[str, str],
    raw: bytes,
    cfg: ProxySettings,
    keys: Keys,
    client: Client | None = None,
) -> Intake | Refused:
    """The request's parsed body and key, or the 400 it gets. `keys`: how its routing key is read
    (with the prompt's blocks for a policy that reads them, router.prompt); `client`: whose key it
    brought (checked before: `take_in`, and the front as the head arrives), kept on a refusal."""
    taken = _take_in_body(path, headers, raw, cfg, keys, client)
    if client is not None and isinstance(taken, Refused):
        return dataclasses.replace(taken, client=client)
    return taken


def _take_in_body(
    path: str,
    headers: Mapping[str, str],
    raw: bytes,
    cfg: ProxySettings,
    keys: Keys,
    client: Client | None,
) -> Intake | Refused:
    api = api_of(path)
    if api is None:
        return Refused(404, f"no route POST {path}", "not_found")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Refused(400, f"the request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return Refused(400, "the request body must be a JSON object")
    rank, target_s = DEFAULT_RANK, None
    if client is not None or "x-priority" in headers or "x-smg-priority" in headers or TARGET_HEADER in headers:
        wished = wishes(headers, client)
        if isinstance(wished, Refused):
            return wished
        rank, target_s = wished
    key = keys.request(api, headers, body, client.tenant if client is not None else None)
    streams = body.get("stream") is True
    strip_usage = False
    if streams and api.usage_option and cfg.inject_usage:
        options = body.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage")):
            body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
            raw = orjson.dumps(body)
            strip_usage = True
    # a stream broken mid-way is resumed on another replica when its body allows it (see resume.py)
    resumable = cfg.resume_streams and streams and api.resumable and why_not_continued(body, api is CHAT) is None
    keep = cfg.resume_buffer_bytes if resumable else 0
    return Intake(body, raw, key, strip_usage, keep, api, streams, client, rank, target_s)
