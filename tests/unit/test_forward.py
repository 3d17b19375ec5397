"""The stream pump when the client leaves: no error blamed on the replica, nothing raised."""

from __future__ import annotations

import asyncio
from typing import Any

from router.proxy.forward import Outcome, _pump, _SseFramer


class Upstream:
    def __init__(self, chunks: list[bytes]) -> None:
        self.content = self
        self._chunks = list(chunks)
        self.reads = 0

    async def readany(self) -> bytes:
        self.reads += 1
        return self._chunks.pop(0) if self._chunks else b""

    def at_eof(self) -> bool:
        return not self._chunks


class GoneClient:
    def __init__(self, after: int) -> None:
        self.after = after
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        if len(self.written) >= self.after:
            raise ConnectionResetError("Cannot write to closing transport")
        self.written.append(data)


async def test_a_client_that_leaves_mid_stream_is_not_an_upstream_error() -> None:
    events = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
    upstream = Upstream(events[1:])
    client = GoneClient(after=2)
    outcome = Outcome(response=None, status=200, streamed=True)  # type: ignore[arg-type]
    loop: Any = asyncio.get_running_loop()
    await _pump(upstream, client, events[0], _SseFramer(False), outcome, 5.0, loop.time() + 5, None, 0.0)  # type: ignore[arg-type]
    assert outcome.client_gone and outcome.stream_error is None
    assert len(client.written) == 2 and upstream.reads == 2  # stopped reading the replica at once
