"""The front: the proxied endpoints served straight off the socket, on httptools.

aiohttp is the application framework (admin API, console, `/metrics`, `/v1/models`, health, the
lifecycle of everything); its server machinery (a request object, a router lookup, a response
object and its writer per request) is most of what a small proxied request costs. The front is an
`asyncio.Protocol` on each client connection that parses requests with httptools (llhttp) and
answers `POST` to the proxied endpoints itself, through the same request journey aiohttp's
handler takes (`Journey.serve`, router.proxy.journey, with a `FrontExchange`): same intake, routing, attempts,
resuming, metrics and access log.

Any other request is aiohttp's. When the first request on a connection is not a proxied one, the
connection is handed to aiohttp's own protocol with the bytes read so far, and stays with it. A
later one on a front connection is handed over the same way when it starts a read (the usual case:
a client that waits for each answer); when it comes pipelined behind others, its parsed head and
body are handed over as one request with `Connection: close`, so that connection closes after its
answer (a client retries what it had pipelined behind it, RFC 9112 §9.3.2).

Limits and time-outs are those aiohttp applies on the same settings (router.proxy.workers):
- `keepalive_timeout_s`: an idle connection closes, and so does one that has not sent a whole
  request's head within it (slowloris);
- a header block over `max_header_bytes` gets an OpenAI-shaped 431; one header line over the
  field limit, more headers than the count limit, or a head over `HEAD_CAP` get a 400 and close;
- what can be refused from the head (no valid key, two credentials, a `Content-Length` over
  `max_body_bytes`) is answered from it, its body not read unless small and of a known length
  (router.proxy.intake); a chunked body is refused as it passes `max_body_bytes`. The answer says
  `Connection: close`; the router then half-closes, drops what the client sends on for at most
  `LINGER_S` and `LINGER_BYTES`, and closes (`_linger`: the client reads the answer, not a reset);
- a body that pauses for `client_timeout_s`, falls below `min_body_rate_bytes_per_s` after its
  first `BODY_GRACE_S`, or takes longer than `total_timeout_s` gets a 408 and the connection closes;
- ambiguous or malformed framing (smuggling: Content-Length with Transfer-Encoding, two lengths,
  chunked not last) is refused by llhttp's strict parser: 400, connection closed.

Pipelined requests are answered in order, one at a time; reading stops while `PIPELINE` requests
wait. A client that goes away cancels its request, as aiohttp's `handler_cancellation` does (the
access log records 499). Streams are sent chunked (HTTP/1.1) or until the connection closes
(HTTP/1.0); a slow reader pauses the stream at the socket's write-buffer limit.

A request's parsed message and the exchange it is answered through are router.proxy.front_exchange;
the server that makes a `Front` per connection and sweeps their time-outs, router.proxy.front_server.

It is past 450 lines as one room: the protocol's parsing, answering, time-outs and hand-over share
the connection's state (the parser's callbacks, the pipeline, the write buffer), and the hand-over
to aiohttp needs all of it at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Callable
from typing import Protocol, cast

import httptools
from aiohttp import web

from router.apis import PROXIED
from router.config.groups import ProxySettings
from router.errors import error_body, error_body_for
from router.proxy.exchange import Exchange
from router.proxy.front_exchange import REASONS, FrontExchange, Message
from router.proxy.intake import (
    LINGER_BYTES,
    LINGER_S,
    Intake,
    Refused,
    body_deadline,
    keeps_connection,
    take_in_body,
    too_large,
    too_many_header_bytes,
    too_slow,
    who,
)
from router.routing.request import Keys
from router.tenancy.clients import KEY_HEADERS, ClientKeys, subject_of
from router.web import JSON

log = logging.getLogger("router.front")

HOT = frozenset(p.encode() for p in PROXIED)
HEAD_CAP = 2 << 20  # bytes of one request's head buffered at most (aiohttp's parser keeps about as much)
PIPELINE = 8  # parsed requests waiting behind the one being answered before reading stops
WRITE_HIGH = 64 * 1024  # a client's write buffer past this pauses the stream until it drains
SWEEP_S = 0.25  # how often the server checks its connections' time-outs
HANDOVER_BODY_CAP = 1 << 20  # a pipelined request handed to aiohttp carries at most this much body


class Serving(Protocol):
    """What the front hands a proxied request to (router.proxy.journey.Journey)."""

    prompts: bool  # the policy reads prompts: intake cuts them into blocks
    clients: ClientKeys | None  # who may use the API (router.tenancy.clients): intake checks keys first

    async def serve(self, exchange: Exchange, intake: Intake | Refused, t0: float) -> None: ...


# the application's journey, set by router.proxy.app.build_app: a runner with one serves its endpoints on the front
PROXY: web.AppKey[Serving] = web.AppKey("proxy", Serving)


class Server(Protocol):
    """What a connection needs of its server (router.proxy.front_server.FrontServer)."""

    loop: asyncio.AbstractEventLoop
    cfg: ProxySettings  # the limits requests are taken in within
    keys: Keys  # how their routing keys are read
    proxy: Serving
    inner: web.Server  # aiohttp's own: the connections handed over
    fronts: set[Front]  # its connections (their time-outs are swept from there)
    field_size: int  # a header line's limit
    max_headers: int

    @property
    def closing(self) -> Callable[[], bool]:
        """Whether the router is stopping."""


class Front(asyncio.Protocol):
    """One client connection: parses requests, answers the proxied ones, hands the rest to aiohttp."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = server.loop
        self.cfg = server.cfg
        self.keys = server.keys
        self.transport: asyncio.Transport | None = None
        self.remote: str | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.msg: Message | None = None  # the one being parsed
        self.queue: collections.deque[Message] = collections.deque()  # parsed, waiting to be answered
        self.task: asyncio.Task[None] | None = None  # the one being answered
        self.idle_at = 0.0  # when an idle connection, or one whose head is not whole, closes (0: not timed)
        self.body_msg: Message | None = None  # the request whose body is being timed
        self.drained: asyncio.Future[None] | None = None
        self.clean_start = True  # this read began at a request boundary
        self.begun = 0  # requests begun in this read
        self.head_bytes = 0
        self.handover: Message | None = None
        self.error: str | None = None  # a 400 to send once what is before it is answered
        self.error_status = 400  # (405 for CONNECT)
        self.read = b""  # the bytes being parsed
        self.in_head = False  # between a request's first byte and the end of its head
        self.paused = False
        self.gone = False
        self.discarding = -1  # bytes still dropped unread after an answer from the head (-1: none)
        self.subject: str | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = t = cast(asyncio.Transport, transport)
        t.set_write_buffer_limits(high=WRITE_HIGH)
        sock = t.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = t.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, tuple) and peer else None
        self.subject = subject_of(t.get_extra_info("peercert"))  # a verified client certificate's CN (mTLS)
        self.server.fronts.add(self)
        self._arm(self.cfg.keepalive_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.discarding >= 0:  # after an answer from the head: dropped unparsed, within bounds
            self.discarding -= len(data)
            if self.discarding < 0 and self.transport is not None:
                self.transport.close()
            return
        if self.error is not None:
            return  # past a request that could not be read: nothing more is
        msg = self.msg
        self.clean_start = msg is None and not self.queue and self.task is None
        self.begun = 0
        self.read = data
        if msg is not None and msg.raw is not None:
            msg.raw.append(data)
        if msg is None or self.in_head:  # httptools buffers a head's pieces itself: bound them here
            self.head_bytes += len(data)
            if self.head_bytes > HEAD_CAP:
                self._fail("the request's head is larger than the router reads")
                return
        error = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # an upgrade (a websocket) is never a proxied request: aiohttp takes it below
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _Refusing):
                pass  # answered from its head (queued): nothing after it is parsed
            elif isinstance(exc.__context__, _TooBig):
                error = str(exc.__context__)
            else:
                log.error("front: parsing a request failed", exc_info=exc.__context__)
                error = "the request could not be read"
        except httptools.HttpParserError as exc:
            error = f"malformed HTTP request: {exc}"
        self.read = b""
        if self.handover is not None:
            self._hand_over()  # aiohttp's from the start of that request, errors and all
        elif error is not None:
            self._fail(error)
        else:
            self._next()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.transport = None
        self._disarm()
        self.server.fronts.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went: its request is cancelled (as aiohttp's handler_cancellation)
        if self.drained is not None and not self.drained.done():
            self.drained.set_exception(ConnectionResetError("the client has gone"))
            self.drained.exception()  # whether or not a stream waits on it

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.drained is not None:
            if not self.drained.done():
                self.drained.set_result(None)
            self.drained = None

    async def wait_drained(self) -> None:
        if self.drained is not None:
            await asyncio.shield(self.drained)

    # -- httptools callbacks -----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        # the keep-alive timer runs on until the head is whole: a head sent slowly is cut off by it
        self.begun += 1
        self.in_head = True
        clean = self.clean_start and self.begun == 1
        self.msg = Message([self.read] if clean else None)

    def on_url(self, url: bytes) -> None:
        assert self.msg is not None
        self.msg.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        msg = self.msg
        assert msg is not None
        size = len(name) + len(value) + 4
        msg.header_size += size
        if size > self.server.field_size:
            raise _TooBig(f"a header line is longer than {self.server.field_size} bytes")
        if len(msg.headers) >= self.server.max_headers:
            raise _TooBig(f"more than {self.server.max_headers} headers")
        msg.headers.append((name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        msg = self.msg
        assert msg is not None
        self.in_head = False
        self.head_bytes = 0
        msg.method = self.parser.get_method()
        msg.version = self.parser.get_http_version().encode()
        msg.keep_alive = self.parser.should_keep_alive()
        url = msg.url
        if msg.method == b"CONNECT":  # authority-form: a forward proxy's request
            self._refuse_target(405, "CONNECT is not served: the router is not a forward proxy")
        if url.startswith(b"/"):
            msg.path = url.split(b"?", 1)[0]
        elif url.startswith((b"http://", b"https://")):  # absolute-form: only the path is ours
            try:
                msg.path = httptools.parse_url(url).path or b"/"
            except httptools.HttpParserInvalidURLError:
                self._refuse_target(400, "malformed request target: not a URL")
        else:  # asterisk-form (`OPTIONS *`) or none the router serves
            self._refuse_target(400, "the request target must be a path (`/v1/...`) or an absolute URL")
        msg.hot = msg.method == b"POST" and msg.path in HOT
        msg.last_body = self.loop.time()
        if not msg.hot and msg.raw is not None:
            self.handover = msg  # the whole connection goes to aiohttp, with every byte read so far
            self._disarm()
            return
        self._arm_body(msg)
        msg.raw = None  # only a request handed over at once needs its bytes
        if not msg.hot:
            return
        msg.t0 = time.monotonic()
        for name, value in msg.headers:
            if name.lower() == "content-length":  # llhttp let one valid length through, or refused it
                msg.content_length = int(value)
        if msg.header_size > self.cfg.max_header_bytes:
            msg.refused = too_many_header_bytes(msg.header_size, self.cfg)
        elif self.parser.should_upgrade():  # llhttp reads no body for it: the rest would be read as a request
            msg.refused = Refused(400, f"{msg.path.decode()} is not upgraded to another protocol", close=True)
        else:
            clients = self.server.proxy.clients
            # the key before the body: a small body of a request without one is read and dropped
            # unparsed (its connection kept); any other is answered from its head
            found = None
            if clients is not None:
                pairs = [(k, v) for k, v in msg.headers if k.lower() in KEY_HEADERS]
                found = who(clients, pairs, self.subject)
            if isinstance(found, Refused):
                if not keeps_connection(msg.content_length):
                    self._refuse_from_head(msg, found)
                msg.refused = dataclasses.replace(found, close=False)
            elif msg.content_length is not None and msg.content_length > self.cfg.max_body_bytes:
                # (no anonymous client learns the limit)
                self._refuse_from_head(msg, dataclasses.replace(too_large(self.cfg), client=found))
            else:
                msg.client = found
        if not self.queue and self.task is None:
            expect = next((v for k, v in msg.headers if k.lower() == "expect"), "")
            if expect.lower() == "100-continue" and self.transport is not None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        msg = self.msg
        assert msg is not None
        if msg.hot and msg.refused is not None:  # read and dropped (and timed: the rate floor counts it)
            msg.body_size += len(body)
            msg.last_body = self.loop.time()
            return
        msg.body_size += len(body)
        if msg.hot and msg.body_size > self.cfg.max_body_bytes:
            # a chunked body, as it passes the limit
            self._refuse_from_head(msg, dataclasses.replace(too_large(self.cfg), client=msg.client))
        if not msg.hot and msg.body_size > HANDOVER_BODY_CAP:
            msg.refused = Refused(
                413,
                f"a request pipelined behind others may carry at most {HANDOVER_BODY_CAP} bytes of body",
                "request_too_large",
                close=True,
            )
            msg.body = []
            return
        msg.body.append(body)
        msg.last_body = self.loop.time()

    def on_message_complete(self) -> None:
        msg = self.msg
        assert msg is not None
        self.msg = None
        self._disarm()
        if msg.complete:  # already answered: its body was too slow
            return
        msg.complete = True
        self.queue.append(msg)
        if len(self.queue) > PIPELINE:
            self._pause()

    # -- answering ---------------------------------------------------------------------------------

    def _next(self) -> None:
        """Start answering the next parsed request, if none is being answered."""
        if self.task is not None or self.gone:
            return
        while self.queue:
            msg = self.queue.popleft()
            if not msg.hot and msg.refused is None:
                self._hand_over_parsed(msg)  # pipelined behind others: handed over with the connection
                return
            self.task = self.loop.create_task(self._serve(msg))
            return
        if self.error is not None:
            self._send_error()
            return
        if self.paused:
            self._resume()
        if self.msg is None:
            self._arm(self.cfg.keepalive_timeout_s)

    async def _serve(self, msg: Message) -> None:
        exchange = FrontExchange(self, msg)
        try:
            if not msg.hot:  # another server's request, refused before it could be handed over
                assert msg.refused is not None
                msg.refused.answer(exchange)
                exchange.closes = True
            else:
                intake: Intake | Refused
                if msg.refused is not None:
                    intake = msg.refused
                else:
                    raw = msg.body[0] if len(msg.body) == 1 else b"".join(msg.body)
                    intake = take_in_body(exchange.path, exchange.headers, raw, self.cfg, self.keys, msg.client)
                await self.server.proxy.serve(exchange, intake, msg.t0)
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("front: serving %s failed", exchange.path)
            if not exchange.prepared:
                message = "the router failed to serve the request"
                exchange.answer(500, error_body_for(exchange.path, message, 500, "internal_error"), JSON)
            exchange.closes = True
        finally:
            self.task = None
        if self.transport is None or self.transport.is_closing():
            return
        if msg.refused is not None and msg.refused.close:  # its body was left unread
            self._linger()
            return
        if exchange.closes or self.server.closing() or not exchange.prepared or exchange.unended:
            self.transport.close()
            return
        self._next()

    # -- handing over to aiohttp ---------------------------------------------------------------------

    def _hand_over(self) -> None:
        """The request now being parsed is aiohttp's, and this connection with it: every byte read
        since the request began goes to aiohttp's protocol, which reads the rest off the socket."""
        msg = self.handover
        assert msg is not None and msg.raw is not None and self.transport is not None
        self.handover = None
        self._give(b"".join(msg.raw))

    def _hand_over_parsed(self, msg: Message) -> None:
        """A request that came pipelined behind proxied ones: its head and body as one request that
        closes the connection after it."""
        target = msg.url
        lines = [msg.method, b" ", target, b" HTTP/", msg.version, b"\r\n"]
        drop = {"connection", "content-length", "transfer-encoding", "keep-alive", "expect"}
        for name, value in msg.headers:
            if name.lower() not in drop:
                lines += (
                    name.encode("utf-8", "surrogateescape"),
                    b": ",
                    value.encode("utf-8", "surrogateescape"),
                    b"\r\n",
                )
        body = b"".join(msg.body)
        lines += (b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body), body)
        self._pause()  # what follows is not read: the connection closes after this answer
        self._give(b"".join(lines))

    def _give(self, data: bytes) -> None:
        transport = self.transport
        assert transport is not None
        self._disarm()
        self.server.fronts.discard(self)
        self.gone = True  # no longer ours
        handler = self.server.inner()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        handler.data_received(data)

    # -- errors and timers ---------------------------------------------------------------------------

    def _refuse_from_head(self, msg: Message, refused: Refused) -> None:
        """Answer `msg` with `refused` as soon as its turn comes, from what is known of it now (in a
        parser callback): it is queued as a whole request, and nothing after it is parsed or read."""
        msg.refused = refused
        msg.complete = True
        msg.body = []
        self.msg = None
        self._disarm()
        self.queue.append(msg)
        self._pause()
        raise _Refusing

    def _linger(self) -> None:
        """After answering a request whose body was left unread: half-close (where the transport
        can: not under TLS), drop what the client still sends for LINGER_S and LINGER_BYTES at most
        (a close with unread bytes would reset the connection, and the client could lose the
        answer), then close."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.can_write_eof():  # (TLS cannot half-close: the answer says Connection: close)
            transport.write_eof()
        self.queue.clear()
        self.discarding = LINGER_BYTES
        self.paused = False
        transport.resume_reading()
        self.idle_at = self.loop.time() + LINGER_S  # the sweep closes it

    def _fail(self, reason: str) -> None:
        """A request that cannot be read: a 400 once what is before it is answered, then close."""
        self._pause()
        self.msg = None
        self.error = reason
        self._next()

    def _refuse_target(self, status: int, reason: str) -> None:
        """A request target the router serves nothing at (in a parser callback): answered by the
        front in JSON, once what is before it is answered, then the connection closes (aiohttp's
        parser would log a traceback for some and answer in plain text)."""
        self.msg = None
        self.error, self.error_status = reason, status
        self._pause()
        raise _Refusing

    def _send_error(self) -> None:
        if self.transport is None:
            return
        status = self.error_status
        body = error_body(self.error or "bad request", status)
        head = b"HTTP/1.1 %d %b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % (
            status,
            REASONS.get(status, b"Unknown"),
            len(body),
        )
        self.transport.write(head + b"Connection: close\r\n\r\n" + body)
        self.transport.close()

    # The time-outs are coarse: the server sweeps its connections every `SWEEP_S` (a timer per
    # request, armed and cancelled, costs more than the rest of the front's parsing).

    def _arm(self, after: float) -> None:
        """Close the connection after `after` seconds unless a request begins meanwhile."""
        self.idle_at = self.loop.time() + after
        self.body_msg = None

    def _arm_body(self, msg: Message) -> None:
        """Time the body: `client_timeout_s` without a byte, or `total_timeout_s` in all, is a 408."""
        msg.body_start = msg.last_body
        msg.body_deadline = msg.last_body + self.cfg.total_timeout_s
        self.body_msg = msg
        self.idle_at = 0.0

    def _disarm(self) -> None:
        self.idle_at = 0.0
        self.body_msg = None

    def sweep(self, now: float) -> None:
        if self.idle_at and now >= self.idle_at:
            self.idle_at = 0.0
            if self.task is None and not self.queue and self.transport is not None:
                self.transport.close()  # idle, or a head that never finished: as aiohttp's keep-alive time-out
        msg = self.body_msg
        if msg is None:
            return
        floor = body_deadline(msg.body_start, msg.body_size, self.cfg.min_body_rate_bytes_per_s)
        if now < min(msg.last_body + self.cfg.client_timeout_s, msg.body_deadline, floor):
            return
        self.body_msg = None
        if msg is not self.msg or self.error is not None:
            return
        msg.refused = dataclasses.replace(too_slow(self.cfg), client=msg.client)
        msg.complete = True
        msg.body = []
        self.msg = None
        self.queue.append(msg)
        self._pause()  # the rest of that body must not be read as a next request
        self._next()

    def _pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self.paused and self.transport is not None and self.error is None:
            self.paused = False
            self.transport.resume_reading()

    # -- shutting down -------------------------------------------------------------------------------

    def close_if_idle(self) -> None:
        if self.task is None and not self.queue and self.msg is None and self.transport is not None:
            self.transport.close()

    async def finish(self, timeout: float | None) -> None:
        """Let the request being answered finish within `timeout`, then close."""
        task = self.task
        if task is not None and not task.done():
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                async with asyncio.timeout(timeout):
                    await asyncio.shield(task)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.queue.clear()
        if self.transport is not None:
            self.transport.close()


class _TooBig(Exception):
    """A header line or count past the parser's limits (a 400, as aiohttp's parser gives)."""


class _Refusing(Exception):
    """Stops the parser: the request being parsed is answered from what is known of it."""
