"""The front's side of one request: the request as it is parsed (`Message`) and the `Exchange` it is answered through.

router.proxy.front parses requests off a client connection; a proxied one is answered through a
`FrontExchange` on that connection (router.proxy.exchange.Exchange: a whole answer, or a stream's
head, its bytes, its end), written straight to the connection's transport: HTTP/1.1 with
`Content-Length` or chunked, HTTP/1.0 until the connection closes, `Connection: close` where the
client or a stopping router says so, waiting while the client's write buffer drains.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Protocol

from multidict import CIMultiDict, CIMultiDictProxy

from router.proxy.intake import Refused
from router.tenancy.clients import Client

REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class Stopping(Protocol):
    @property
    def closing(self) -> Callable[[], bool]:
        """Whether the router is stopping: answers then close their connections."""


class Connection(Protocol):
    """What an exchange needs of its connection (router.proxy.front.Front)."""

    remote: str | None
    transport: asyncio.Transport | None
    drained: asyncio.Future[None] | None  # set while the client's write buffer is over its limit

    @property
    def server(self) -> Stopping:
        """Its server (router.proxy.front.FrontServer)."""

    async def wait_drained(self) -> None: ...


class _Date:
    """The Date header's value, made once a second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        t = int(time.time())
        if t != cls.second:
            cls.second, cls.value = t, formatdate(t, usegmt=True).encode()
        return cls.value


def _head(status: int, headers: Mapping[str, str], extra: bytes) -> bytes:
    """A response's head; HTTP/1.1 to every client (a server answers with its own version)."""
    lines = [b"HTTP/1.1 %d " % status, REASONS.get(status, b"Unknown"), b"\r\n"]
    for name, value in headers.items():
        lines += (name.encode("utf-8"), b": ", value.encode("utf-8", "surrogateescape"), b"\r\n")
    lines += (b"Date: ", _Date.now(), b"\r\n", extra, b"\r\n")
    return b"".join(lines)


class Message:
    """One request as it is parsed."""

    __slots__ = (
        "body",
        "body_deadline",
        "body_size",
        "body_start",
        "client",
        "complete",
        "content_length",
        "header_size",
        "headers",
        "hot",
        "keep_alive",
        "last_body",
        "method",
        "path",
        "raw",
        "refused",
        "t0",
        "url",
        "version",
    )

    def __init__(self, raw: list[bytes] | None) -> None:
        self.raw = raw  # every byte of it read so far, when it began a read (None: it came pipelined)
        self.url = b""
        self.headers: list[tuple[str, str]] = []
        self.header_size = 0
        self.method = b""
        self.path = b""
        self.version = b"1.1"
        self.hot = False
        self.keep_alive = True
        self.body: list[bytes] = []
        self.body_size = 0
        self.body_start = 0.0
        self.content_length: int | None = None  # as its head says (None: chunked, or none said)
        self.refused: Refused | None = None
        self.client: Client | None = None  # whose key it brought (client keys on)
        self.complete = False
        self.t0 = 0.0
        self.last_body = 0.0
        self.body_deadline = 0.0


class FrontExchange:
    """An `Exchange` on a front connection."""

    __slots__ = (
        "_chunked",
        "_front",
        "_prepared",
        "_status",
        "closes",
        "headers",
        "method",
        "path",
        "remote",
        "transport",
        "unended",
    )

    def __init__(self, front: Connection, msg: Message) -> None:
        self._front = front
        self.method = "POST"
        self.path = msg.path.decode()
        self.headers = CIMultiDictProxy(CIMultiDict(msg.headers))
        self.remote = front.remote
        self.transport = front.transport
        self._status = 0
        self._prepared = False
        self.unended = False  # a stream's head went out and its end did not
        self._chunked = msg.version == b"1.1"
        # the connection closes after this answer: the client said so, or the router is stopping
        self.closes = not msg.keep_alive

    @property
    def status(self) -> int:
        return self._status

    @property
    def prepared(self) -> bool:
        return self._prepared

    def _connection(self) -> bytes:
        if self.closes or self._front.server.closing():
            self.closes = True
            return b"Connection: close\r\n"
        return b""

    def answer(self, status: int, body: bytes, headers: Mapping[str, str], close: bool = False) -> None:
        self._status = status
        self.closes = self.closes or close
        extra = b"Content-Length: %d\r\n" % len(body) + self._connection()
        transport = self._front.transport
        if transport is not None and not transport.is_closing():
            transport.write(_head(status, headers, extra) + body)
        self._prepared = True

    async def prepare(self, status: int, headers: Mapping[str, str]) -> None:
        transport = self._front.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client has gone")
        self._status = status
        if self._chunked:
            extra = b"Transfer-Encoding: chunked\r\n" + self._connection()
        else:  # HTTP/1.0: the stream ends with the connection
            self.closes = True
            extra = b"Connection: close\r\n"
        transport.write(_head(status, headers, extra))
        self._prepared = self.unended = True

    async def write(self, data: bytes) -> None:
        transport = self._front.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client has gone")
        if not data:
            return
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        if self._front.drained is not None:
            await self._front.wait_drained()

    async def write_eof(self) -> None:
        transport = self._front.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client has gone")
        if self._chunked:
            transport.write(b"0\r\n\r\n")
        self.unended = False


__all__ = ["REASONS", "Connection", "FrontExchange", "Message"]
