"""How the router reaches replicas: HTTP/1.1 keep-alive pools of its own, one per replica.

A request is written in one `transport.write` (head and body as bytes) and its answer parsed by
httptools (llhttp, the parser Node.js uses), with no per-request objects beyond the response
itself: no URL objects, header multidicts or tracing hooks, which is most of what a general-purpose
client spends per request.

- Pools are LIFO: the connection used last is used next, so a quiet fleet keeps few warm
  connections, and one idle past `idle_s` is closed instead of reused (servers close idle ones on
  their own clock: uvicorn after 5 s).
- At most `per_host` connections to one replica; past that, requests wait for one to come back.
- A response read to its end (or one that says it is the last, `Connection: close`) releases its
  connection; a response let go before its end closes it, so the replica sees the request cancelled.
- Back-pressure: past `HIGH_WATER` bytes of body read and not yet taken by the caller, the socket
  stops being read until the caller catches up; a slow client slows its replica's stream, it does
  not fill the router's memory.
- A stale connection, one the replica closed while it sat in the pool (llama-server closes one
  after every streamed response although it answers `Keep-Alive`), shows up as a connection that
  ends before any byte of an answer. Only a reused connection can be stale: that request is sent
  once more, at once, on a new connection (`on_reconnect` is told, by URL), with no failover, no
  error charged, and no session jump. A new connection that ends that way is the replica's failure.

Errors are `UpstreamError`s (`ConnectError` when no connection could be made), which are
`OSError`s, so callers treat them as any socket failure.

It is past 450 lines as one room: the connection (an httptools protocol), its pool and the response
it feeds share private state (a response hands its connection back to the pool, back-pressure pauses
the connection's socket); split, those internals would have to become public.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import socket
import ssl
from collections.abc import Callable
from typing import Any, cast, overload
from urllib.parse import urlsplit

import httptools

from router.errors import RouterError

HIGH_WATER = 1 << 18  # body bytes buffered per response before the socket stops being read
LOW_WATER = 1 << 16
IDLE_S = 4.0  # a pooled connection unused this long is closed, not reused (below uvicorn's 5 s)


class UpstreamError(RouterError, ConnectionError):
    """A replica's connection failed: it could not be made, or it ended or broke mid-answer."""


class ConnectError(UpstreamError):
    """No connection to the replica could be made (refused, unreachable, or timed out)."""


class StaleConnection(UpstreamError):
    """A reused keep-alive connection ended before any byte of the answer: the replica had closed it."""


class Headers:
    """A response's headers in arrival order, names as sent; lookups ignore case."""

    __slots__ = ("_index", "_items")

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self._items = items
        index: dict[str, str] = {}
        for name, value in items:
            index.setdefault(name.lower(), value)
        self._index = index

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str) -> str: ...
    def get(self, name: str, default: str | None = None) -> str | None:
        return self._index.get(name.lower(), default)

    def getall(self, name: str, default: Any = ()) -> list[str] | Any:
        lower = name.lower()
        values = [v for k, v in self._items if k.lower() == lower]
        return values if values else default

    def items(self) -> list[tuple[str, str]]:
        return self._items

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._index

    def __repr__(self) -> str:
        return f"Headers({self._items!r})"


@functools.lru_cache(maxsize=4096)
def _target(url: str) -> tuple[tuple[str, str, int], bytes, bytes]:
    """(origin, request target, Host header) of an http(s) URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    default = port == (443 if parts.scheme == "https" else 80)
    host = parts.hostname if default else f"{parts.hostname}:{port}"
    if ":" in parts.hostname:  # an IPv6 literal keeps its brackets in the Host header
        host = f"[{parts.hostname}]" if default else f"[{parts.hostname}]:{port}"
    return (parts.scheme, parts.hostname, port), path.encode("ascii"), host.encode("idna")


class Response:
    """One answer from a replica: its status and headers at once, the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_eof",
        "_exc",
        "_tail",
        "_waiter",
        "headers",
        "resent",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers: Headers = Headers([])
        self._conn = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._eof = False  # the whole body was read from the socket
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._done = False  # released or closed
        self._tail: asyncio.TimerHandle | None = None  # released before its end (release_at_end): the wait
        self.resent = False  # sent again on a new connection: the pooled one it went out on was stale

    @property
    def content(self) -> Response:
        """The body's reader (this object, as in aiohttp: `content.readany()`, `content.at_eof()`)."""
        return self

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some), b"" at its end; raises if it broke."""
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def at_eof(self) -> bool:
        return self._eof and not self._chunks

    def release(self) -> None:
        """Done with it: a connection whose answer was read to the end goes back to its pool."""
        if not self._done:
            self._done = True
            self._conn.finished(self, reusable=self.at_eof())

    def close(self) -> None:
        """Let go before the end: the connection is closed (the replica sees the request cancelled)."""
        if not self._done:
            self._done = True
            self._conn.finished(self, reusable=False)

    def release_at_end(self, wait_s: float) -> None:
        """Done with it, though its end has not come (an answer whole by its own framing, `[DONE]`,
        whose HTTP end follows): what more arrives is dropped, and the connection goes back to its
        pool at the end, or is closed if the end has not come within `wait_s`. Nothing waits on it."""
        if self._done:
            return
        if self.at_eof():
            self.release()
            return
        self._done = True
        self._chunks.clear()
        self._buffered = 0
        self._conn.resume()
        if self._eof or self._exc is not None:  # ended with bytes unread (reusable), or broke (not)
            self._conn.finished(self, reusable=self._exc is None)
            return
        self._tail = self._conn.loop.call_later(wait_s, self._conn.finished, self, False)

    # -- from the connection -----------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._done:
            return  # after release_at_end: nobody reads it
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _end(self, exc: BaseException | None) -> None:
        if exc is None:
            self._eof = True
        elif self._exc is None and not self._eof:
            self._exc = exc
        self._wake()
        if self._tail is not None:  # released at its end (release_at_end): this is it
            self._tail.cancel()
            self._tail = None
            self._conn.loop.call_soon(self._ended)  # once the parser is done with these bytes

    def _ended(self) -> None:
        """The end of an answer released before it (release_at_end) came: its connection goes back."""
        self._conn.finished(self, reusable=self._exc is None and self._conn.usable())

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica, answering one request at a time."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.head: asyncio.Future[Response] | None = None
        self.items: list[tuple[str, str]] = []
        self.closed = False
        self.used = 0  # requests sent on it
        self.idle_since = 0.0
        self.paused = False
        self.keep_alive = True
        self.framed = False  # the answer has a length or chunks (else it ends with the connection)
        self.answered = False  # a byte of the current answer has arrived
        self.complete = False  # the current answer has been read to its end
        self.garbage = False  # bytes past the end of an answer: the connection cannot be trusted

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it
        self.pool.conns.add(self)
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.response is None or self.complete:  # bytes nobody asked for: the connection cannot be trusted
            self._lost(UpstreamError("the replica sent bytes outside any answer"))
            return
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._lost(UpstreamError("the replica answered with a protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._lost(UpstreamError(f"the replica's answer is not valid HTTP/1.1: {exc}"))
        if self.garbage:
            self._lost(UpstreamError("the replica sent bytes past the end of its answer"))

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        response = self.response
        if response is not None and self.head is not None and not self.head.done():
            if not self.answered and self.used > 1:
                error: UpstreamError = StaleConnection("the replica had closed this keep-alive connection")
            else:
                error = UpstreamError("the replica closed the connection before answering")
            self.head.set_exception(error)
        elif response is not None and not response._eof:
            if self.framed:
                response._end(UpstreamError("the replica's connection ended mid-answer"))
            else:
                response._end(None)  # an answer without a length ends with its connection
        self._gone()

    # -- httptools callbacks -----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.garbage:
            self.items.append((name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))

    def on_message_begin(self) -> None:
        if self.complete:
            self.garbage = True

    def on_headers_complete(self) -> None:
        response = self.response
        if self.garbage or response is None or self.head is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            self.items = []
            return
        response.status = status
        response.headers = headers = Headers(self.items)
        self.items = []
        self.keep_alive = self.parser.should_keep_alive()
        self.framed = "content-length" in headers or "chunked" in (headers.get("transfer-encoding") or "").lower()
        if not self.head.done():
            self.head.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None and not self.garbage:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is None or self.garbage:
            return
        if response.status == 0:  # an interim answer ended; the real one follows
            return
        self.complete = True
        response._end(None)
        if not self.keep_alive:
            self.close()

    # -- for the pool and the response ----------------------------------------------------------------

    def send(self, data: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.response = Response(self)
        self.head = self.loop.create_future()
        self.answered = self.complete = self.framed = False
        self.used += 1
        self.transport.write(data)
        return self.head

    def finished(self, response: Response, reusable: bool) -> None:
        if response is not self.response:
            return
        self.response = None
        self.head = None
        self.resume()
        if reusable and self.keep_alive and not self.closed:
            self.idle_since = self.loop.time()
            self.pool.put(self)
        else:
            self.close()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self._gone()

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def _gone(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.lost(self)

    def _lost(self, exc: UpstreamError) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        elif self.response is not None:
            self.response._end(exc)
        if self.transport is not None:
            self.transport.abort()


class _Pool:
    """The connections to one replica (one origin)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        origin: tuple[str, str, int],
        per_host: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.loop = loop
        self.ssl_context = ssl_context
        self.scheme, self.host, self.port = origin
        self.per_host = per_host
        self.idle: list[_Connection] = []  # a stack: the last one put back is taken first
        self.open = 0  # connections open or being opened
        self.conns: set[_Connection] = set()
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def get(self, connect_s: float) -> _Connection:
        now = self.loop.time()
        while self.idle:
            conn = self.idle.pop()
            if conn.usable() and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        while self.open >= self.per_host:
            waiter = self.loop.create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
            if self.idle:
                return await self.get(connect_s)
        return await self.connect(connect_s)

    async def connect(self, connect_s: float) -> _Connection:
        self.open += 1
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self),
                    self.host,
                    self.port,
                    ssl=(self.ssl_context or _ssl_context()) if self.scheme == "https" else None,
                )
        except TimeoutError as exc:
            self._gone()
            raise ConnectError(f"connecting to {self.host}:{self.port} timed out") from exc
        except OSError as exc:
            self._gone()
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from exc
        except BaseException:
            self._gone()
            raise
        return conn

    def put(self, conn: _Connection) -> None:
        self.idle.append(conn)
        self._wake()

    def lost(self, conn: _Connection) -> None:
        """`conn` closed (once per connection)."""
        if conn in self.idle:
            self.idle.remove(conn)
        self.conns.discard(conn)
        self._gone()

    def _gone(self) -> None:
        self.open -= 1
        self._wake()

    def _wake(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for conn in list(self.conns):
            conn.close()
        self.idle.clear()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    return ssl.create_default_context()


class Upstream:
    """The router's client for replicas: one keep-alive pool per replica origin."""

    def __init__(
        self,
        per_host: int = 256,
        on_reconnect: Callable[[str], None] = lambda url: None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.per_host = per_host
        self.on_reconnect = on_reconnect
        self.ssl_context = ssl_context  # for https:// replicas (router.tls); None: the system's default
        self.loop = asyncio.get_running_loop()
        self.pools: dict[tuple[str, str, int], _Pool] = {}
        self.reconnects = 0

    async def post(self, url: str, body: bytes, headers: dict[str, str], connect_s: float) -> Response:
        """POST `body` to `url` with `headers` (end-to-end ones: Host, Content-Length and the
        connection's own are set here); the answer once its status and headers are in.
        `connect_s` bounds making a new connection; the caller times the rest."""
        origin, target, host = _target(url)
        pool = self.pools.get(origin)
        if pool is None:
            pool = self.pools[origin] = _Pool(self.loop, origin, self.per_host, self.ssl_context)
        head = _head(target, host, headers, len(body))
        data = head + body if len(body) < 65536 else None
        conn = await pool.get(connect_s)
        try:
            return await _exchange(conn, head, body, data)
        except StaleConnection:
            pass
        conn = await pool.connect(connect_s)  # a new one: never stale, and not one of the idle ones
        response = await _exchange(conn, head, body, data)
        response.resent = True
        self.reconnects += 1
        self.on_reconnect(url)  # counted once the new connection answered: else it is the replica's failure
        return response

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


async def _exchange(conn: _Connection, head: bytes, body: bytes, data: bytes | None) -> Response:
    if data is not None:
        future = conn.send(data)
    else:  # a large body is not copied into one buffer with the head
        future = conn.send(head)
        assert conn.transport is not None
        conn.transport.write(body)
    try:
        return await future
    except BaseException:
        if conn.response is not None:
            conn.response.close()  # cancelled or failed while waiting: this connection is spent
        raise


def _head(target: bytes, host: bytes, headers: dict[str, str], length: int) -> bytes:
    lines = [b"POST ", target, b" HTTP/1.1\r\nHost: ", host, b"\r\nContent-Length: ", str(length).encode()]
    for name, value in headers.items():
        # as aiohttp decoded them from the client (a value holds no CR or LF: its parser refuses those)
        lines += (b"\r\n", name.encode("utf-8", "surrogateescape"), b": ", value.encode("utf-8", "surrogateescape"))
    lines.append(b"\r\n\r\n")
    return b"".join(lines)
