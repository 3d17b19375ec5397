"""The feed's replay requests against replay sockets on loopback: an answer that keeps coming is read
whole however long it takes (a router joining a busy fleet reads its replays slowly), a silent
socket is given up."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from router.bench.common import free_port
from router.config import ReplicaSpec, RouterConfig
from router.engines import kvfeed
from router.engines.kvfeed import Feed
from router.health.states import Hysteresis
from router.metrics import RouterMetrics
from router.placement import Placement
from router.pools import replica_fleet

END = (-1).to_bytes(8, "big", signed=True)


def make_feed() -> Feed:
    config = RouterConfig(replicas=(ReplicaSpec("r0", "http://127.0.0.1:9/r0"),), health_checks=False)
    fleet = replica_fleet(config, config.replicas, Hysteresis())
    placement = Placement(fleet, config.placement, config.bounded_load_floor)
    return Feed(fleet, placement, config.placement, lambda: None, RouterMetrics())  # type: ignore[arg-type,return-value]


class Busy:
    """Requests being answered at once, across the sockets that share it, and the most seen."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0


class ReplaySocket:
    """A replay ROUTER socket that answers each request with `messages` batches, `gap_s` apart, after
    `delay_s`; `busy` counts the requests being answered at once."""

    def __init__(
        self, ctx: zmq.asyncio.Context, messages: int, gap_s: float, delay_s: float = 0.0, busy: Busy | None = None
    ) -> None:
        self.busy = busy or Busy()
        self.port = free_port()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.messages, self.gap_s, self.delay_s = messages, gap_s, delay_s
        self.answering: set[asyncio.Task[None]] = set()
        self.task = asyncio.create_task(self._serve())

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        while True:
            identity, _, start = await self.sock.recv_multipart()
            task = asyncio.create_task(self._answer(identity, int.from_bytes(start, "big", signed=True)))
            self.answering.add(task)
            task.add_done_callback(self.answering.discard)

    async def _answer(self, identity: bytes, start: int) -> None:
        self.busy.now += 1
        self.busy.most = max(self.busy.most, self.busy.now)
        await asyncio.sleep(self.delay_s)
        for seq in range(start, start + self.messages):
            payload = msgpack.packb([1.0, [{"type": "AllBlocksCleared"}], 0])
            await self.sock.send_multipart([identity, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await asyncio.sleep(self.gap_s)
        await self.sock.send_multipart([identity, b"", b"", END, b""])
        self.busy.now -= 1

    def close(self) -> None:
        self.task.cancel()
        for task in self.answering:
            task.cancel()
        self.sock.close(linger=0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def test_an_answer_that_keeps_coming_is_read_whole(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvfeed, "REPLAY_TIMEOUT_S", 0.3)
    server = ReplaySocket(ctx, messages=12, gap_s=0.1)  # 1.2 s in all, never 0.3 s silent
    feed = make_feed()
    try:
        got = await feed.replay(server.endpoint, 5)
        assert got is not None and [b.seq for b in got] == list(range(5, 17))
    finally:
        server.close()
        await feed.close()


async def test_a_silent_replay_socket_is_given_up(ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvfeed, "REPLAY_TIMEOUT_S", 0.2)
    server = ReplaySocket(ctx, messages=3, gap_s=0.0, delay_s=5.0)
    feed = make_feed()
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await feed.replay(server.endpoint, 0) is None
        assert loop.time() - start < 1.0
    finally:
        server.close()
        await feed.close()


async def test_a_subscriber_reads_what_queued_while_it_was_busy_in_order_and_lets_go_of_its_socket() -> None:
    """The feed's reader (`_messages`) reads every message queued, in order, past DRAIN_RUN at a time,
    wakes for the next one, and stops watching the socket's descriptor when it is closed."""
    ctx = zmq.asyncio.Context()
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    loop = asyncio.get_running_loop()
    fd = sub.getsockopt(zmq.FD)
    try:
        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        n = 3 * kvfeed.DRAIN_RUN + 5
        for i in range(n):  # all queued before the reader starts
            await pub.send_multipart([b"t", i.to_bytes(8, "big")])
        await asyncio.sleep(0.2)
        got: list[int] = []

        async def read(until: int) -> None:
            async with contextlib.aclosing(kvfeed._messages(sub)) as messages:
                async for frames in messages:
                    got.append(int.from_bytes(frames[1], "big"))
                    if len(got) == until:
                        return

        reader = asyncio.create_task(read(n + 1))
        await asyncio.sleep(0.2)
        assert got == list(range(n))  # the backlog, whole and in order; then it waits
        assert not reader.done()
        await pub.send_multipart([b"t", n.to_bytes(8, "big")])  # one more, later: it wakes for it
        await asyncio.wait_for(reader, 2.0)
        assert got == list(range(n + 1))
        assert not loop.remove_reader(fd)  # it stopped watching the descriptor when it ended

        cancelled = asyncio.create_task(read(10**6))  # and when it is cancelled while waiting
        await asyncio.sleep(0.1)
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        assert not loop.remove_reader(fd)
    finally:
        sub.close(linger=0)
        pub.close(linger=0)
        ctx.term()
