"""What the real-engine tests (llama-server, vLLM) read of a router's answers and a replica's bytes
(imported as `engine_streams`): SSE events, their text, metrics, and a tap on a replica's socket."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from router.bench.vllm import NotBuilt, find_vllm


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples (counters by their _total name) whose labels include `labels`."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def metrics_of(http: aiohttp.ClientSession, url: str, token: str) -> str:
    async with http.get(url + "/metrics", headers={"Authorization": f"Bearer {token}"}) as r:
        return await r.text()


def events_of(raw: bytes) -> list[Any]:
    """A chat or completion stream's `data:` events, parsed (`[DONE]` as the string)."""
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


def text_of(events: list[Any]) -> str:
    return "".join(
        (c.get("delta") or {}).get("content") or c.get("text") or ""
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices") or ()
    )


class Tap:
    """A TCP relay between the router and one replica that keeps every byte the replica sent."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.from_replica: list[bytes] = []  # one entry per connection
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            got = bytearray()
            self.from_replica.append(b"")
            index = len(self.from_replica) - 1

            async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, keep: bytearray | None) -> None:
                with contextlib.suppress(ConnectionError):
                    while data := await src.read(65536):
                        if keep is not None:
                            keep += data
                            self.from_replica[index] = bytes(keep)
                        dst.write(data)
                        await dst.drain()
                dst.close()

            await asyncio.gather(pipe(reader, up_writer, None), pipe(up_reader, writer, got))

        self.server = await asyncio.start_server(relay, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def settled(self, timeout: float = 10.0) -> list[bytes]:
        """Every connection's bytes once each answer on it has come to its HTTP end: the router ends
        its client's stream at `[DONE]` and the engine's last chunk may come after (llama-server,
        vLLM write it apart), so a client can have its answer before the tap has all of it."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                for connection in self.from_replica:
                    chunked_bodies(connection)
            except Incomplete:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.01)
            else:
                return list(self.from_replica)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


class Incomplete(AssertionError):
    """A connection's bytes end inside an answer (its last chunk not yet relayed)."""


def chunked_body(response: bytes) -> bytes:
    """The body of the first HTTP/1.1 response in `response`, with chunked transfer coding."""
    return chunked_bodies(response)[0]


def chunked_bodies(connection: bytes) -> list[bytes]:
    """The bodies of the HTTP/1.1 responses one keep-alive connection carried, each with chunked
    transfer coding, in order; `Incomplete` where the bytes end inside one."""
    bodies = []
    rest = connection
    while rest:
        head, found, rest = rest.partition(b"\r\n\r\n")
        if not found:
            raise Incomplete("the bytes end inside an answer's head")
        assert b"transfer-encoding: chunked" in head.lower(), head
        body = bytearray()
        while True:
            size_line, found, rest = rest.partition(b"\r\n")
            if not found:
                raise Incomplete("the bytes end before an answer's last chunk")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                if not rest.startswith(b"\r\n"):
                    raise Incomplete("the bytes end inside an answer's last chunk")
                rest = rest[2:]  # the blank line after the last chunk
                break
            if len(rest) < size + 2:
                raise Incomplete("the bytes end inside a chunk")
            body += rest[:size]
            rest = rest[size + 2 :]
        bodies.append(bytes(body))
    return bodies


def normalised(events: list[Any]) -> list[Any]:
    """Events without what differs between two runs of the same request: id, time, timing figures
    and what the engine found cached."""
    out = []
    for e in events:
        if isinstance(e, dict):
            e = {k: v for k, v in e.items() if k not in ("id", "created", "system_fingerprint")}
            if "timings" in e:
                e["timings"] = sorted(e["timings"])
            if "usage" in e:
                e["usage"] = {k: e["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
        out.append(e)
    return out


def vllm_or_why() -> tuple[Path | None, str]:
    """The built vLLM environment (scripts/build-vllm.sh), or None and why not; under CI
    (KVAR_CI set) a missing one is an error: the vLLM tests must run there."""
    try:
        return find_vllm(), ""
    except NotBuilt as exc:
        if os.environ.get("KVAR_CI"):
            raise RuntimeError(f"under CI the vLLM tests must run: {exc}") from None
        return None, str(exc)
