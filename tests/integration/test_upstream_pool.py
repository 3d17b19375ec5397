"""The router's own keep-alive pools (router.engines.upstream), against a raw replica that does exactly
what each test scripts.

Each test's replica is an asyncio server whose `answer` decides, per request, the bytes to send
back and whether to close the connection after them; it counts connections and requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from waiting import until

from router.engines import upstream as upstream_module
from router.engines.upstream import ConnectError, StaleConnection, Upstream, UpstreamError

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def chunked(*pieces: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


class Raw:
    """A replica that reads each request whole and answers with `answer(n, head)` → (bytes, close?)."""

    def __init__(self, answer: Callable[[int, bytes], tuple[bytes, bool]]) -> None:
        self.answer = answer
        self.later: dict[int, tuple[float, bytes]] = {}  # request number -> (after s, bytes) sent after its answer
        self.requests: list[bytes] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                self.bodies.append(await reader.readexactly(length))
                self.requests.append(head)
                data, close = self.answer(len(self.requests), head)
                if data:
                    writer.write(data)
                    await writer.drain()
                if len(self.requests) in self.later:
                    after, tail = self.later[len(self.requests)]
                    await asyncio.sleep(after)
                    writer.write(tail)
                    await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client went, or the test ended
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def raw() -> AsyncIterator[Callable[..., Any]]:
    servers: list[Raw] = []

    async def start(answer: Callable[[int, bytes], tuple[bytes, bool]]) -> Raw:
        r = Raw(answer)
        r.server = await asyncio.start_server(r.handle, "127.0.0.1", 0)
        servers.append(r)
        return r

    yield start
    for r in servers:
        assert r.server is not None
        r.server.close()
        for w in r.writers:
            w.close()
        with contextlib.suppress(Exception):
            await r.server.wait_closed()


async def post(client: Upstream, url: str, body: bytes = b"{}") -> tuple[int, bytes]:
    resp = await client.post(url + "/v1/chat/completions", body, {"Content-Type": "application/json"}, 1.0)
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()


async def test_a_connection_is_reused_and_the_request_goes_out_as_written(raw) -> None:  # type: ignore[no-untyped-def]
    replica = await raw(lambda n, head: (OK, False))
    client = Upstream()
    for _ in range(5):
        assert await post(client, replica.url, b'{"a":1}') == (200, b"{}")
    assert replica.connections == 1 and len(replica.requests) == 5
    head = replica.requests[0].decode()
    port = replica.url.rsplit(":", 1)[1]
    assert head.startswith("POST /v1/chat/completions HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{port}\r\n" in head and "Content-Length: 7\r\n" in head
    assert "Content-Type: application/json\r\n" in head and replica.bodies == [b'{"a":1}'] * 5
    client.close()


async def test_chunked_and_length_and_close_delimited_bodies(raw) -> None:  # type: ignore[no-untyped-def]
    answers = {
        1: (chunked(b"data: a\n\n", b"data: b\n\n"), False),
        2: (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", False),
        3: (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", True),  # no length: ends with the connection
        4: (OK, False),
    }
    replica = await raw(lambda n, head: answers[n])
    client = Upstream()
    assert await post(client, replica.url) == (200, b"data: a\n\ndata: b\n\n")
    assert await post(client, replica.url) == (200, b"hello")
    assert await post(client, replica.url) == (200, b"until the end")
    assert await post(client, replica.url) == (200, b"{}")
    assert replica.connections == 2  # a new one after the replica said Connection: close
    assert client.reconnects == 0
    client.close()


async def test_a_pooled_connection_the_replica_closed_is_resent_once_on_a_new_one(raw) -> None:  # type: ignore[no-untyped-def]
    # the replica reads every second request on a connection and closes it unanswered: a stale pooled connection
    per_conn: dict[int, int] = {}

    def answer(n: int, head: bytes) -> tuple[bytes, bool]:
        conn = replica.connections
        per_conn[conn] = per_conn.get(conn, 0) + 1
        return (OK, False) if per_conn[conn] == 1 else (b"", True)

    replica = await raw(answer)
    seen: list[str] = []
    client = Upstream(on_reconnect=seen.append)
    for _ in range(4):
        assert await post(client, replica.url) == (200, b"{}")
    assert client.reconnects == 3 and len(seen) == 3 and seen[0].endswith("/v1/chat/completions")
    client.close()


async def test_a_new_connection_closed_unanswered_is_the_replicas_failure(raw) -> None:  # type: ignore[no-untyped-def]
    replica = await raw(lambda n, head: (b"", True))
    client = Upstream()
    with pytest.raises(UpstreamError) as info:
        await post(client, replica.url)
    assert not isinstance(info.value, StaleConnection) and client.reconnects == 0
    assert len(replica.requests) == 1  # sent once: never twice to a replica that drops it
    client.close()


async def test_a_replica_that_refuses_connections_is_a_connect_error(unused_tcp_port: int) -> None:
    client = Upstream()
    with pytest.raises(ConnectError):
        await post(client, f"http://127.0.0.1:{unused_tcp_port}")
    assert client.pools[("http", "127.0.0.1", unused_tcp_port)].open == 0
    client.close()


async def test_an_answer_cut_mid_body_raises_and_the_connection_is_not_reused(raw) -> None:  # type: ignore[no-untyped-def]
    cut = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n"
    )
    replica = await raw(lambda n, head: (cut, True) if n == 1 else (OK, False))
    client = Upstream()
    resp = await client.post(replica.url + "/x", b"{}", {}, 1.0)
    assert resp.status == 200 and await resp.readany() == b"data: a\n\n"
    with pytest.raises(UpstreamError):
        await resp.readany()
    resp.release()
    assert await post(client, replica.url) == (200, b"{}")
    assert replica.connections == 2 and client.reconnects == 0
    client.close()


async def test_a_response_let_go_early_closes_its_connection(raw) -> None:  # type: ignore[no-untyped-def]
    stream_head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    replica = await raw(lambda n, head: (stream_head + b"9\r\ndata: a\n\n\r\n", False) if n == 1 else (OK, False))
    client = Upstream()
    resp = await client.post(replica.url + "/x", b"{}", {}, 1.0)
    assert await resp.readany() == b"data: a\n\n"
    resp.close()  # the client left: the replica must see the request cancelled, and nobody reuse the connection
    assert await post(client, replica.url) == (200, b"{}")
    assert replica.connections == 2
    pool = next(iter(client.pools.values()))
    assert pool.open == 1 and len(pool.idle) == 1
    client.close()


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
DONE = b"e\r\ndata: [DONE]\n\n\r\n"  # a stream's own end, its HTTP end (the last chunk) to come


async def test_a_stream_released_before_its_http_end_goes_back_to_the_pool_when_the_end_comes(raw) -> None:  # type: ignore[no-untyped-def]
    # llama-server writes [DONE] and the empty last chunk apart: the caller lets the answer go at
    # [DONE], and the connection waits for its end off the caller's time, then serves the next request
    replica = await raw(lambda n, head: (STREAM_HEAD + DONE, False) if n == 1 else (OK, False))
    replica.later[1] = (0.3, b"0\r\n\r\n")
    client = Upstream()
    resp = await client.post(replica.url + "/x", b"{}", {}, 1.0)
    assert await resp.readany() == b"data: [DONE]\n\n"
    resp.release_at_end(2.0)
    pool = next(iter(client.pools.values()))
    assert pool.open == 1 and not pool.idle  # not yet: its end has not come
    await until(lambda: len(pool.idle) == 1, "the connection back in its pool once the stream's end came")
    assert await post(client, replica.url) == (200, b"{}")
    assert replica.connections == 1 and len(replica.requests) == 2
    client.close()


async def test_a_stream_whose_http_end_does_not_come_in_time_closes_its_connection(raw) -> None:  # type: ignore[no-untyped-def]
    replica = await raw(lambda n, head: (STREAM_HEAD + DONE + b"5\r\nlate!\r\n", False) if n == 1 else (OK, False))
    replica.later[1] = (5.0, b"0\r\n\r\n")
    client = Upstream()
    resp = await client.post(replica.url + "/x", b"{}", {}, 1.0)
    assert (await resp.readany()).startswith(b"data: [DONE]\n\n")
    resp.release_at_end(0.2)
    pool = next(iter(client.pools.values()))
    await until(lambda: pool.open == 0, "the connection closed: its end did not come within the wait")
    assert await post(client, replica.url) == (200, b"{}")
    assert replica.connections == 2 and len(pool.idle) == 1  # a new one, back in the pool
    # an answer already read to its end is simply released
    resp = await client.post(replica.url + "/x", b"{}", {}, 1.0)
    assert await resp.read() == b"{}"
    resp.release_at_end(0.2)
    assert len(pool.idle) == 1 and replica.connections == 2
    client.close()


async def test_bytes_past_the_end_of_an_answer_spoil_the_connection(raw) -> None:  # type: ignore[no-untyped-def]
    replica = await raw(lambda n, head: (OK + b"HTTP/1.1 200 OK\r\n" if n == 1 else OK, False))
    client = Upstream()
    assert await post(client, replica.url) == (200, b"{}")
    pool = next(iter(client.pools.values()))
    await until(lambda: pool.open == 0, "the connection that carried bytes past its answer dropped")
    assert await post(client, replica.url) == (200, b"{}")
    assert replica.connections == 2  # the first was dropped, not reused with a stray half-answer in it
    client.close()


async def test_an_interim_100_continue_is_skipped(raw) -> None:  # type: ignore[no-untyped-def]
    replica = await raw(lambda n, head: (b"HTTP/1.1 100 Continue\r\n\r\n" + OK, False))
    client = Upstream()
    assert await post(client, replica.url) == (200, b"{}")
    assert await post(client, replica.url) == (200, b"{}")
    assert replica.connections == 1
    client.close()


async def test_malformed_answers_are_errors_not_hangs(raw) -> None:  # type: ignore[no-untyped-def]
    replica = await raw(lambda n, head: (b"SPDY/9 what\r\n\r\n", False))
    client = Upstream()
    with pytest.raises(UpstreamError, match="not valid HTTP"):
        await asyncio.wait_for(post(client, replica.url), 2)
    client.close()


async def test_at_most_per_host_connections_and_the_rest_wait(raw) -> None:  # type: ignore[no-untyped-def]
    gate = asyncio.Event()
    stream_head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 3\r\n\r\n"
    replica = await raw(lambda n, head: (stream_head, False))
    client = Upstream(per_host=2)

    async def one() -> bytes:
        resp = await client.post(replica.url + "/x", b"{}", {}, 1.0)
        await gate.wait()
        resp.close()
        return b""

    tasks = [asyncio.create_task(one()) for _ in range(5)]
    await until(
        lambda: client.pools and len(next(iter(client.pools.values())).waiters) == 3 and len(replica.requests) == 2,
        "two requests at the replica and three waiting in the pool",
    )
    assert replica.connections == 2 and len(replica.requests) == 2  # three wait for a connection
    gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert len(replica.requests) == 5 and next(iter(client.pools.values())).open <= 2
    client.close()


async def test_a_caller_that_stops_reading_stops_the_socket_being_read(raw, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(upstream_module, "HIGH_WATER", 1000)
    piece = b"data: " + b"x" * 500 + b"\n\n"
    replica = await raw(lambda n, head: (chunked(*[piece] * 4000), False))  # ~2 MB
    client = Upstream()
    resp = await client.post(replica.url + "/x", b"{}", {}, 1.0)
    conn = next(iter(client.pools.values())).conns.copy().pop()
    await until(lambda: conn.paused, "the connection's reading paused")
    assert conn.paused and resp._buffered < 300_000  # not the whole answer in memory
    body = await resp.read()
    assert body == piece * 4000 and not conn.paused
    resp.release()
    client.close()


async def test_idle_connections_past_their_time_are_not_reused(raw, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(upstream_module, "IDLE_S", 0.05)
    replica = await raw(lambda n, head: (OK, False))
    client = Upstream()
    assert await post(client, replica.url) == (200, b"{}")
    await asyncio.sleep(0.1)
    assert await post(client, replica.url) == (200, b"{}")
    assert replica.connections == 2 and client.reconnects == 0
    client.close()


async def test_a_cancelled_request_closes_its_connection(raw) -> None:  # type: ignore[no-untyped-def]
    replica = await raw(lambda n, head: (b"", False) if n == 1 else (OK, False))  # never answers the first
    client = Upstream()
    task = asyncio.create_task(post(client, replica.url))
    await until(lambda: replica.requests, "the first request at the replica")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await post(client, replica.url) == (200, b"{}")
    assert replica.connections == 2 and next(iter(client.pools.values())).open == 1
    client.close()
