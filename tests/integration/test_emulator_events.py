"""The emulator's KV-cache events on the wire (a real ZMQ SUB and DEALER), its render endpoints, their faults."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgpack  # type: ignore[import-untyped, unused-ignore]
import orjson
import pytest
import zmq
import zmq.asyncio
from waiting import until

from router.bench.common import free_port
from router.emulator.engine import EngineConfig
from router.emulator.kvevents import KvEventsOptions
from router.emulator.server import Fleet, Replica

TOPIC = b"kv-events"
END = (-1).to_bytes(8, "big", signed=True)
BS = 16
SYSTEM = {"role": "system", "content": "You answer in one word. " * 12}


def chat(*turns: str) -> list[dict[str, str]]:
    """A conversation: the system prompt, then user and assistant turns alternating."""
    roles = ("user", "assistant")
    return [SYSTEM] + [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]


class Subscriber:
    """A ZMQ SUB socket on a replica's KV events, connected and subscribed before it is returned."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock

    @classmethod
    async def connect(cls, port: int) -> Subscriber:
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(f"tcp://127.0.0.1:{port}")
        try:
            await asyncio.wait_for(monitor.recv_multipart(), 5)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
        await asyncio.sleep(0.1)  # the subscription reaches the publisher after the handshake
        return cls(sock)

    async def next(self, timeout: float = 5.0) -> tuple[int, list[Any]]:
        """The next message's sequence number and events (the frames checked on the way)."""
        frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        return decode(frames)

    async def drain(self, quiet: float = 0.3) -> list[tuple[int, list[Any]]]:
        """Every message until none comes for `quiet` seconds."""
        out = []
        with contextlib.suppress(TimeoutError):
            while True:
                out.append(await self.next(quiet))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


def decode(frames: list[bytes]) -> tuple[int, list[Any]]:
    topic, seq, payload = frames
    assert topic == TOPIC and len(seq) == 8
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0 and isinstance(events, list) and events
    return int.from_bytes(seq, "big"), events


async def replay(port: int, start: int) -> tuple[list[tuple[int, list[Any]]], list[list[bytes]]]:
    """Ask the replay socket for every buffered message from `start`: the messages, and the raw
    frames (the end marker last)."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        raw = []
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), 5)
            raw.append(frames)
            if frames[1] == b"":
                break
    finally:
        sock.close(linger=0)
    assert raw[-1] == [b"", b"", END, b""]
    return [decode(f[1:]) for f in raw[:-1]], raw


def stored(messages: list[tuple[int, list[Any]]]) -> list[dict[str, Any]]:
    return [e for _, events in messages for e in events if e["type"] == "BlockStored"]


async def post(url: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, data=orjson.dumps(body) if body is not None else None) as r:
        return r.status, orjson.loads(await r.read())


async def get(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        return orjson.loads(await r.read())


@pytest.fixture
async def start(make_replica: Callable[..., Replica]) -> AsyncIterator[Callable[..., Any]]:
    """Start a replica with KV events on free ports (and what else a test needs), then a subscriber
    on it; everything is stopped and closed after the test."""
    started: list[tuple[Replica, Subscriber]] = []

    async def run(config: EngineConfig | None = None, **kv: Any) -> tuple[Replica, Subscriber]:
        options = KvEventsOptions(**({"port": 0, "replay_port": 0} | kv))
        r = make_replica(
            "ev",
            config or EngineConfig(num_blocks=4000),
            adapters=("lora-0",),
            kv_events=options,
            enable_scale_out=True,
        )
        await r.start()
        assert r.publisher is not None
        sub = await Subscriber.connect(r.publisher.port)
        started.append((r, sub))
        return r, sub

    yield run
    for r, sub in started:
        sub.close()
        await r.stop()


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
async def test_frames_and_payload_in_both_encodings(start: Callable[..., Any], encoding: str) -> None:
    r, sub = await start(encoding=encoding)
    status, body = await post(r.url + "/v1/chat/completions", {"messages": chat("Hi " * 40), "max_tokens": 40})
    assert status == 200
    messages = await sub.drain()
    assert [seq for seq, _ in messages] == list(range(len(messages)))  # from 0, one more each
    assert len(messages) >= 2  # the prompt's blocks, then the reply's as decoding fills them
    first = messages[0][1][0]
    prompt_blocks = body["usage"]["prompt_tokens"] // BS
    if encoding == "tagged":
        assert first["type"] == "BlockStored" and first["parent_block_hash"] is None
        assert len(first["block_hashes"]) == prompt_blocks and first["block_size"] == BS
        assert first["medium"] == "GPU" and first["lora_id"] is None and first["extra_keys"] == [None] * prompt_blocks
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first["block_hashes"])
    else:
        kind, hashes, parent, tokens, block_size, lora_id, medium, lora_name = first
        assert (kind, parent, block_size, lora_id, medium, lora_name) == ("BlockStored", None, BS, None, "GPU", None)
        assert len(tokens) == len(hashes) * BS == prompt_blocks * BS


async def test_stored_tokens_are_the_render_endpoints_and_a_conversation_chains(start: Callable[..., Any]) -> None:
    r, sub = await start()
    # 384 bytes: 96 whole tokens (a prompt whose last token is short leaves its last block to the
    # reply's first token: the bytes that complete it are the reply's, as the next turn cuts them)
    turn1 = chat("What is the capital of France, in one word, please?")
    _, rendered = await post(r.url + "/v1/chat/completions/render", {"messages": turn1, "max_tokens": 50})
    _, reply = await post(r.url + "/v1/chat/completions", {"messages": turn1, "max_tokens": 50})
    ids1 = rendered["token_ids"]
    assert len(ids1) == reply["usage"]["prompt_tokens"]
    events1 = stored(await sub.drain())
    first = events1[0]
    full = len(first["block_hashes"])
    assert full == len(ids1) // BS and first["token_ids"] == ids1[: full * BS]
    chain1 = [h for e in events1 for h in e["block_hashes"]]  # prompt blocks, then the reply's
    assert all(e["parent_block_hash"] == chain1[i - 1] for i, e in zip(_starts(events1), events1, strict=True) if i)

    answer = reply["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And of Spain? " * 8}]
    _, rendered2 = await post(r.url + "/v1/chat/completions/render", {"messages": turn2, "max_tokens": 5})
    ids2 = rendered2["token_ids"]
    assert ids2[: len(ids1) - 1] == ids1[:-1]  # the earlier prompt is a prefix (its last token may be cut)
    # every block the first turn stored, its reply's too, has the tokens the second turn renders there
    assert [t for e in events1 for t in e["token_ids"]] == ids2[: len(chain1) * BS]
    _, reply2 = await post(r.url + "/v1/chat/completions", {"messages": turn2, "max_tokens": 5})
    hit = reply2["usage"]["prompt_tokens_details"]["cached_tokens"] // BS
    assert hit > full  # the second turn hit the first turn's reply blocks too
    second = stored(await sub.drain())[0]
    assert second["parent_block_hash"] == chain1[hit - 1]
    assert second["token_ids"] == ids2[hit * BS : (hit + len(second["block_hashes"])) * BS]


def _starts(events: list[dict[str, Any]]) -> list[int]:
    """Each event's first block's index in the chain its events make."""
    out, n = [], 0
    for e in events:
        out.append(n)
        n += len(e["block_hashes"])
    return out


async def test_eviction_is_a_block_removed_per_block(start: Callable[..., Any]) -> None:
    r, sub = await start(EngineConfig(num_blocks=12))
    for tag in "abcd":  # four 5-block prompts, one at a time, in a cache of 12 blocks
        status, _ = await post(r.url + "/v1/completions", {"prompt": tag * 320, "max_tokens": 1})
        assert status == 200
    messages = await sub.drain()
    events = [e for _, step in messages for e in step]
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    assert removed and all(len(e["block_hashes"]) == 1 and e["medium"] == "GPU" for e in removed)
    stored_before: set[int] = set()
    for e in events:  # every removed block was stored before, and is gone once removed
        if e["type"] == "BlockStored":
            stored_before.update(e["block_hashes"])
        else:
            assert e["block_hashes"][0] in stored_before
            stored_before.discard(e["block_hashes"][0])
    assert len(stored_before) == r.engine.cache.cached_blocks


async def test_reset_prefix_cache_sends_all_blocks_cleared_at_the_next_step(start: Callable[..., Any]) -> None:
    r, sub = await start()
    body = {"prompt": "z" * 400, "max_tokens": 2}
    await post(r.url + "/v1/completions", body)
    before = await sub.drain()
    assert await post(r.url + "/reset_prefix_cache") == (200, {"success": True})
    assert await sub.drain(0.3) == []  # not at once: with the engine's next step
    _, again = await post(r.url + "/v1/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    seq, events = (await sub.drain())[0]
    assert seq == before[-1][0] + 1 and events[0] == {"type": "AllBlocksCleared"}
    assert events[1]["type"] == "BlockStored" and events[1]["parent_block_hash"] is None


async def test_replay_answers_the_buffered_messages_then_the_end_marker(start: Callable[..., Any]) -> None:
    r, sub = await start(buffer_steps=3)
    for tag in "abc":
        await post(r.url + "/v1/completions", {"prompt": tag * 200, "max_tokens": 20})
    live = await sub.drain()
    n = len(live)
    assert n > 3
    assert r.publisher is not None
    got, raw = await replay(r.publisher.replay_port, 0)  # the buffer holds the last 3
    assert got == live[-3:]
    assert all(f[0] == b"" and f[1] == TOPIC for f in raw[:-1])
    got, _ = await replay(r.publisher.replay_port, n - 1)
    assert got == live[-1:]
    assert (await replay(r.publisher.replay_port, n))[0] == []  # nothing that new: the end marker alone


async def test_dropped_messages_leave_a_gap_that_replay_fills(start: Callable[..., Any]) -> None:
    r, sub = await start()
    status, faults = await post(r.url + "/emulator/faults", {"kv_events_drop_next": 2})
    assert status == 200 and faults["kv_events_drop_next"] == 2
    await post(r.url + "/v1/completions", {"prompt": "d" * 200, "max_tokens": 100})  # 7 messages
    live = await sub.drain()
    assert [seq for seq, _ in live][:2] == [2, 3]  # 0 and 1 were numbered but not sent
    assert (await get(r.url + "/emulator/faults"))["kv_events_drop_next"] == 0
    assert r.publisher is not None
    repaired, _ = await replay(r.publisher.replay_port, 0)
    assert [seq for seq, _ in repaired] == list(range(len(live) + 2))
    assert repaired[2:] == live and repaired[0][1][0]["type"] == "BlockStored"
    # a share: every message dropped, the sequence still advancing
    await post(r.url + "/emulator/faults", {"kv_events_drop": 1.0})
    await post(r.url + "/v1/completions", {"prompt": "e" * 200, "max_tokens": 2})
    assert await sub.drain() == []
    state = (await get(r.url + "/emulator/state"))["kv_events"]
    assert state["next_seq"] > len(live) + 2 and state["dropped"] == state["next_seq"] - len(live)
    status, _ = await post(r.url + "/emulator/faults", {"kv_events_drop": 2})
    assert status == 400


async def test_restart_engine_starts_the_sequence_again_with_an_empty_cache(start: Callable[..., Any]) -> None:
    r, sub = await start()
    body = {"prompt": "r" * 400, "max_tokens": 20}
    await post(r.url + "/v1/completions", body)
    assert len(await sub.drain()) > 1
    status, state = await post(r.url + "/emulator/restart-engine")
    assert status == 200 and state["kv_events"]["next_seq"] == 0 and state["engine"]["cached_blocks"] == 0
    _, again = await post(r.url + "/v1/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the cache came back empty
    after = await sub.drain()
    assert after[0][0] == 0  # the sequence starts again, no AllBlocksCleared first
    assert all(e["type"] != "AllBlocksCleared" for _, events in after for e in events)
    assert r.publisher is not None
    assert (await replay(r.publisher.replay_port, 0))[0] == after  # the old messages are gone


async def test_restart_engine_fails_requests_in_flight(make_replica: Callable[..., Replica]) -> None:
    r = make_replica("slow", time_scale=1.0, kv_events=KvEventsOptions())
    await r.start()
    try:
        pending = asyncio.ensure_future(post(r.url + "/v1/completions", {"prompt": "w" * 100, "max_tokens": 300}))
        await until(r.engine.has_work, "the request running in the engine")
        r.restart_engine()
        status, body = await asyncio.wait_for(pending, 5)
        assert status == 500 and "restarted" in body["error"]["message"]
    finally:
        await r.stop()


async def test_control_port_restarts_the_engine_and_a_crash_restart_rebinds(
    start_fleet: Callable[..., Any],
) -> None:
    control = free_port()
    fleet: Fleet = await start_fleet(1, control_port=control, kv_events=KvEventsOptions(port=0, replay_port=0))
    r = fleet.replicas[0]
    assert r.publisher is not None
    port, replay_port = r.publisher.port, r.publisher.replay_port
    sub = await Subscriber.connect(port)
    try:
        await post(r.url + "/v1/completions", {"prompt": "c" * 200, "max_tokens": 2})
        assert (await sub.drain())[0][0] == 0
        status, state = await post(f"http://127.0.0.1:{control}/replicas/0/restart-engine")
        assert status == 200 and state["kv_events"]["next_seq"] == 0
        await post(r.url + "/v1/completions", {"prompt": "c" * 200, "max_tokens": 2})
        assert (await sub.drain())[0][0] == 0
        await post(f"http://127.0.0.1:{control}/replicas/0/crash")
        await post(f"http://127.0.0.1:{control}/replicas/0/restart")
        assert (r.publisher.port, r.publisher.replay_port) == (port, replay_port)  # the same ports again
        sub.close()
        sub = await Subscriber.connect(port)
        await post(r.url + "/v1/completions", {"prompt": "c" * 200, "max_tokens": 2})
        assert (await sub.drain())[0][0] == 0
        assert replay_port is not None and len((await replay(replay_port, 0))[0]) == 1
    finally:
        sub.close()


async def test_kv_event_sources_as_vllm_answers(start: Callable[..., Any], replica: Replica) -> None:
    assert await get(replica.url + "/kv_event_sources") == {}  # events off
    r, _ = await start()
    assert r.publisher is not None
    assert await get(r.url + "/kv_event_sources") == {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{r.publisher.port}",
            "replay_endpoint": f"tcp://*:{r.publisher.replay_port}",
            "buffer_steps": 10_000,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": "kv-events",
        }
    }


@pytest.fixture
async def scaled_out(make_replica: Callable[..., Replica]) -> AsyncIterator[Replica]:
    """A replica serving the render endpoints (vLLM's --enable-scale-out)."""
    r = make_replica("scaled-out", enable_scale_out=True)
    await r.start()
    yield r
    await r.stop()


async def test_render_endpoints_answer_the_prompts_token_ids(scaled_out: Replica) -> None:
    replica = scaled_out
    messages = [{"role": "user", "content": "Hello, world!"}]
    status, one = await post(replica.url + "/v1/chat/completions/render", {"messages": messages})
    assert status == 200 and set(one) >= {"request_id", "token_ids"}
    text = b"<|user|>Hello, world!<|end|><|assistant|>"  # 41 bytes: the last token is ">" and 3 zero bytes
    ids = [int.from_bytes(text[i : i + 4].ljust(4, b"\0"), "little") for i in range(0, len(text), 4)]
    assert one["token_ids"] == ids and ids[-1] == ord(">")
    status, anthropic = await post(
        replica.url + "/v1/messages/render", {"model": "emulated-llm", "messages": messages, "max_tokens": 5}
    )
    assert status == 200 and anthropic["token_ids"] == one["token_ids"]  # a Messages request is that chat
    status, batch = await post(replica.url + "/v1/completions/render", {"prompt": ["abcd", "efghi"]})
    assert status == 200 and [b["token_ids"] for b in batch] == [[0x64636261], [0x68676665, ord("i")]]
    status, single = await post(replica.url + "/v1/completions/render", {"prompt": "abcd", "cache_salt": "s"})
    assert status == 200 and len(single) == 1 and single[0]["cache_salt"] == "s"
    assert replica.engine.steps == 0  # the engine never saw them


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
        ("/v1/chat/completions", {"messages": []}, 400),
        ("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400),
        ("/v1/messages", {"model": "nope", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, 404),
        ("/v1/messages", {"model": "emulated-llm", "messages": [{"role": "user", "content": "x"}]}, 400),
    ],
)
async def test_render_errors_are_the_generating_endpoints(
    scaled_out: Replica, path: str, body: dict[str, Any], status: int
) -> None:
    replica = scaled_out
    assert await post(replica.url + path + "/render", body) == await post(replica.url + path, body)
    assert (await post(replica.url + path + "/render", body))[0] == status


async def test_without_scale_out_render_is_refused_and_tokenize_answers(replica: Replica, scaled_out: Replica) -> None:
    """As vLLM 0.32 started as its docs start it: render answers 403 (PermissionDeniedError, the same
    body), /tokenize answers the ids render would, for a chat with and without the generation
    prompt and for a completion's prompt."""
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello, world!"}]
    for path in ("/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render"):
        status, refused = await post(replica.url + path, {"messages": messages, "prompt": "x", "max_tokens": 1})
        assert status == 403 and refused["error"]["type"] == "PermissionDeniedError", refused
        assert "--enable-scale-out" in refused["error"]["message"]
    _, rendered = await post(scaled_out.url + "/v1/chat/completions/render", {"messages": messages})
    status, whole = await post(replica.url + "/tokenize", {"model": "emulated-llm", "messages": messages})
    assert status == 200 and whole["tokens"] == rendered["token_ids"] and whole["count"] == len(whole["tokens"])
    status, history = await post(replica.url + "/tokenize", {"messages": messages, "add_generation_prompt": False})
    # less `<|assistant|>`; the history's last token is cut short (4-byte tokens), as a BPE's may be merged
    n = len(history["tokens"])
    assert status == 200 and n < len(whole["tokens"]) and whole["tokens"][: n - 1] == history["tokens"][:-1]
    _, prompt = await post(replica.url + "/tokenize", {"prompt": "abcdefghi"})
    assert prompt["tokens"] == [0x64636261, 0x68676665, ord("i")]
    assert (await post(replica.url + "/tokenize", {"model": "nope", "prompt": "x"}))[0] == 404
    assert (await post(replica.url + "/tokenize", {"model": "emulated-llm"}))[0] == 400
    assert replica.engine.steps == 0


async def test_a_lora_request_with_a_salt_stores_vllms_extra_keys(start: Callable[..., Any]) -> None:
    r, sub = await start()
    body = {"model": "lora-0", "messages": chat("Salted " * 30), "max_tokens": 1, "cache_salt": "abc"}
    await post(r.url + "/v1/chat/completions", body)
    (event,) = stored(await sub.drain())
    n = len(event["block_hashes"])
    assert event["lora_id"] == 1 and event["lora_name"] == "lora-0"
    assert event["extra_keys"] == [["lora-0", "abc"]] + [["lora-0"]] * (n - 1)
    # the base model, or another salt, has blocks of its own: no hit, other hashes
    for other in ({"model": "emulated-llm"}, {"cache_salt": "xyz"}, {"cache_salt": None}):
        _, reply = await post(r.url + "/v1/chat/completions", body | other)
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        (again,) = stored(await sub.drain())
        assert not set(again["block_hashes"]) & set(event["block_hashes"])


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router.emulator.cli", *args], capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--kv-events-replay-port", "7000"],
        ["--kv-events-encoding", "positional"],
        ["--port", "9001", "--kv-events-port", "9001"],
        ["--replicas", "3", "--kv-events-port", "7000", "--kv-events-replay-port", "7002"],
        ["--kv-events-port", "0", "--kv-events-buffer", "0"],
    ],
)
def test_bad_kv_events_command_lines_exit_2_with_one_line(args: list[str]) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("router-emulator: ")


async def test_a_fleet_publishes_on_consecutive_ports_in_a_real_process() -> None:
    http, pub, rep = (free_port(2) for _ in range(3))  # a fleet of two binds consecutive ports
    args = ["--replicas", "2", "--base-port", str(http), "--time-scale", "100"]
    args += ["--kv-events-port", str(pub), "--kv-events-replay-port", str(rep), "--kv-events-encoding", "positional"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.emulator.cli", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(4)]
        assert lines[3] == f"emu-{http + 1} publishing KV events on port {pub + 1}, replays on port {rep + 1}"
        sources = await get(f"http://127.0.0.1:{http + 1}/kv_event_sources")
        assert sources["0"]["endpoint"] == f"tcp://*:{pub + 1}"
        assert sources["0"]["replay_endpoint"] == f"tcp://*:{rep + 1}"
        sub = await Subscriber.connect(pub + 1)
        try:
            await post(f"http://127.0.0.1:{http + 1}/v1/completions", {"prompt": "p" * 100, "max_tokens": 1})
            seq, events = await sub.next()
            assert seq == 0 and events[0][0] == "BlockStored"
        finally:
            sub.close()
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
