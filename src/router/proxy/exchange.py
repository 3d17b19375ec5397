"""The client's side of one proxied request, whichever server parsed it.

Two servers face clients. The front (router.proxy.front) parses the proxied endpoints itself on
httptools and answers them on its own connections; aiohttp serves everything else, and the
proxied endpoints too on a connection whose first request was not one of them. The request's
journey (admission, routing, attempts, resuming, the access log) is written once, against
`Exchange`; each server supplies one.

The answer is either whole (`answer`) or a stream: `prepare` sends its head, `write` its bytes as
they come (waiting while a slow client drains), `write_eof` its end. A client gone shows as
`ConnectionResetError` from any of them. `prepared` is exactly the "first byte sent" line:
before it, another replica may still serve the request; after it, the stream is the client's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDictProxy


class Exchange(Protocol):
    method: str
    path: str  # without the query
    headers: CIMultiDictProxy[str]
    remote: str | None  # the client's address
    transport: asyncio.Transport | None  # the client's connection (its write buffer, and to abort it)

    @property
    def status(self) -> int:
        """The answer's status once one is given (0 before)."""

    @property
    def prepared(self) -> bool:
        """Whether any byte of the answer has been sent."""

    def answer(self, status: int, body: bytes, headers: Mapping[str, str], close: bool = False) -> None:
        """Answer with a whole response; `close`: the connection closes after it."""

    async def prepare(self, status: int, headers: Mapping[str, str]) -> None:
        """Send a stream's head."""

    async def write(self, data: bytes) -> None:
        """Send a stream's bytes; waits while the client's buffer is full."""

    async def write_eof(self) -> None:
        """End the stream."""


class AioExchange:
    """An `Exchange` on an aiohttp request; the handler returns `response`."""

    __slots__ = ("headers", "method", "path", "remote", "request", "response", "transport")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.method = request.method
        self.path = request.path
        self.headers = request.headers
        self.remote = request.remote
        self.transport = request.transport
        self.response: web.StreamResponse | None = None

    @property
    def status(self) -> int:
        return self.response.status if self.response is not None else 0

    @property
    def prepared(self) -> bool:
        return self.response is not None and self.response.prepared

    def answer(self, status: int, body: bytes, headers: Mapping[str, str], close: bool = False) -> None:
        self.response = web.Response(status=status, body=body, headers=headers)
        if close:
            self.response.force_close()

    async def prepare(self, status: int, headers: Mapping[str, str]) -> None:
        self.response = web.StreamResponse(status=status, headers=headers)
        await self.response.prepare(self.request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def write_eof(self) -> None:
        assert self.response is not None
        await self.response.write_eof()
