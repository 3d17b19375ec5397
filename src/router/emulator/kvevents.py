"""vLLM's KV-cache events on the wire: an emulated replica's ZMQ publisher and replay socket.

vLLM 0.32 started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:P", "replay_endpoint": "tcp://*:Q", "topic": "kv-events"}'` publishes what its
prefix cache does, and so does a replica started with `--kv-events-port P --kv-events-replay-port Q`:

- a PUB socket on P sends one message per engine step that changed the cache, three frames: the
  topic (`kv-events`), the sequence number (8 bytes, big-endian, unsigned; 0 for the first message
  after the engine starts, one more for each message), and a msgpack payload
  `[ts, [event, ...], data_parallel_rank]` (a float of wall seconds, the step's events in order, 0);
- an event is a map tagged by "type" (`tagged`, vLLM's encoding since mid-2026):
  `{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None, "token_ids": [...],
  "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [...],
  "group_idx": 0, "kv_cache_spec_kind": "full_attention"}`, `{"type": "BlockRemoved",
  "block_hashes": [h], "medium": "GPU", "group_idx": 0}` (one per evicted block) and
  `{"type": "AllBlocksCleared"}`; or an array (`positional`, vLLM's encoding before that):
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`;
- a ROUTER socket on Q replays: a DEALER sends `[b"", start_seq (8 bytes, big-endian)]` and gets,
  for every buffered message (the last `buffer_steps`) numbered `start_seq` or later,
  `[b"", topic, seq, payload]`, then the end marker `[b"", b"", seq -1 (8 bytes, signed), b""]`.

Block hashes are the emulator's own chained XXH3 keys (unsigned 64-bit ints), token ids its 4-byte
tokens (router.kvevents.emulator_tokens.token_ids). `lora_id` is the adapter's place in `--lora`, from 1,
as vLLM numbers the adapters it starts with. A message the drop fault takes is numbered and
buffered but not sent, so a subscriber sees a gap that a replay repairs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped, unused-ignore]
import zmq
import zmq.asyncio

from router.emulator.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent

ENCODINGS = ("tagged", "positional")
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last answer
MAX_QUEUE_SIZE = 100_000  # vLLM's default, reported as it is (the emulator queues no events)
REPLAY_YIELD_EVERY = 256  # replayed messages sent between two yields to the event loop
REBIND_S = 2.0  # how long a reopened socket retries its port (ZMQ lets go of a closed one in the background)


@dataclass(frozen=True)
class KvEventsOptions:
    """What vLLM's --kv-events-config says, for one replica: its ports (0: any free one), the
    encoding of events, the replay buffer's length, the topic."""

    port: int = 0
    replay_port: int | None = None  # None: no replay socket
    encoding: str = "tagged"
    buffer_steps: int = 10_000  # messages kept for replay (vLLM's default)
    topic: str = "kv-events"
    hwm: int = 100_000  # messages the PUB socket queues per subscriber before it drops (vLLM's default)

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {self.encoding!r}")
        for name in ("port", "replay_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {value}")
        if self.buffer_steps < 1 or self.hwm < 1:
            raise ValueError("buffer_steps and hwm must be positive")


def encode_event(event: CacheEvent, encoding: str, block_size: int, lora_ids: Mapping[str, int]) -> Any:
    """One event as msgpack will carry it, in the `tagged` or the `positional` encoding."""
    if isinstance(event, BlockStored):
        lora_id = lora_ids.get(event.lora_name) if event.lora_name is not None else None
        if encoding == "positional":
            return [
                "BlockStored",
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                block_size,
                lora_id,
                MEDIUM,
                event.lora_name,
            ]
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": block_size,
            "lora_id": lora_id,
            "medium": MEDIUM,
            "lora_name": event.lora_name,
            "extra_keys": event.extra_keys,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(event, BlockRemoved):
        if encoding == "positional":
            return ["BlockRemoved", [event.block_hash], MEDIUM]
        return {"type": "BlockRemoved", "block_hashes": [event.block_hash], "medium": MEDIUM, "group_idx": 0}
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"] if encoding == "positional" else {"type": "AllBlocksCleared"}


def encode_batch(
    events: list[CacheEvent], encoding: str, block_size: int, lora_ids: Mapping[str, int], ts: float
) -> bytes:
    """A message's payload: `[ts, [event, ...], data_parallel_rank]`."""
    encoded = [encode_event(e, encoding, block_size, lora_ids) for e in events]
    payload: bytes = msgpack.packb([ts, encoded, 0], use_bin_type=True)
    return payload


def zmq_host(host: str) -> str:
    """The address a ZMQ socket binds for an HTTP host setting (every interface: `*`)."""
    if host in ("", "0.0.0.0", "*"):
        return "*"
    return "127.0.0.1" if host == "localhost" else host


def bound_port(sock: zmq.Socket[Any]) -> int:
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(endpoint.rpartition(":")[2])


class Publisher:
    """One replica's KV-event sockets: numbers, buffers and sends each step's events, and answers
    replays. `open` binds (the sequence starts at 0, the buffer empty, as in a starting engine),
    `close` unbinds; `restart` starts the sequence and the buffer again on the open sockets."""

    def __init__(self, options: KvEventsOptions, host: str, block_size: int, lora_ids: Mapping[str, int]) -> None:
        self.options = options
        self.host = zmq_host(host)
        self.block_size = block_size
        self.lora_ids = dict(lora_ids)
        self.port = options.port  # the bound ports once open (a port of 0 becomes the one the kernel gave)
        self.replay_port = options.replay_port
        self.topic = options.topic.encode()
        self.sent = 0  # messages sent on the PUB socket
        self.dropped = 0  # messages the drop fault kept off it
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=options.buffer_steps)
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._opened_before = False  # its ports, bound again after a close, may still be letting go

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def open(self) -> None:
        if self._pub is not None:
            return
        # the PUB socket is a plain one (a send never waits); the replay socket is read in the loop
        pub: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PUB)
        self._pub = pub
        self.port = await self._bind(pub, self.port, "KV events")
        if self.replay_port is not None:
            replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            self._replay = replay
            self.replay_port = await self._bind(replay, self.replay_port, "KV events replay")
            self._replay_task = asyncio.create_task(self._serve_replays(replay), name=f"kv-events replay :{self.port}")
        self._opened_before = True
        self.restart()

    async def _bind(self, sock: zmq.Socket[Any], port: int, what: str) -> int:
        """Bind `sock` to `port` (0: any free one) and return the port; OSError (and the sockets
        closed) when it cannot. A port this publisher bound before is retried a little: ZMQ
        unbinds a closed socket in the background."""
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.options.hwm)
        deadline = time.monotonic() + REBIND_S
        while True:
            try:
                sock.bind(f"tcp://{self.host}:{port or '*'}")
                return bound_port(sock)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EADDRINUSE and self._opened_before and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                    continue
                await self.close()
                raise OSError(exc.errno, f"{what} port {port}: {exc.strerror}") from None

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None

    def restart(self) -> None:
        """The engine starts again: the next message is numbered 0 and nothing is left to replay."""
        self._next_seq = 0
        self._buffer.clear()

    def publish(self, events: list[CacheEvent], deliver: bool = True) -> int:
        """Number, buffer and (unless `deliver` is false: the drop fault) send one step's events;
        returns the message's sequence number."""
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(events, self.options.encoding, self.block_size, self.lora_ids, time.time())
        self._buffer.append((seq, payload))
        if self._pub is None:
            return seq
        if deliver:
            # PUB never blocks: past the high-water mark it drops, as vLLM's publisher does
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            self.sent += 1
        else:
            self.dropped += 1
        return seq

    def sources(self) -> dict[str, Any]:
        """`GET /kv_event_sources`: the config per data-parallel rank, as vLLM 0.32 answers."""
        replay = f"tcp://*:{self.replay_port}" if self.replay_port is not None else None
        return {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.port}",
                "replay_endpoint": replay,
                "buffer_steps": self.options.buffer_steps,
                "hwm": self.options.hwm,
                "max_queue_size": MAX_QUEUE_SIZE,
                "topic": self.options.topic,
            }
        }

    async def _serve_replays(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                continue  # not [identity, b"", start_seq]: vLLM ignores it too
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            wanted = [(seq, payload) for seq, payload in list(self._buffer) if seq >= start_seq]
            for n, (seq, payload) in enumerate(wanted, 1):
                await sock.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
                if n % REPLAY_YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # a long replay does not hold up the replica's requests
            await sock.send_multipart([identity, b"", b"", END_SEQ, b""])
