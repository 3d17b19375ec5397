"""Cache warm-up: before the router moves sessions to a replica, it replays their latest prompts
there as prefill-only requests, so their next turn finds its prefix in that replica's KV cache.

`PromptStore` keeps the latest request body of each session (bounded by total bytes, per-entry
size and a time to live; least recently used first out). `prefill_only` turns a stored chat,
completion or Anthropic Messages request into one that computes the prompt and generates one
token (`max_tokens: 1`, not streamed). `warm` sends such requests to one replica, a few at a time, each marked with
`X-Router-Warmup: 1` so it is never mistaken for user traffic, and gives up on what is left when
its time is up.

Where the sessions' KV can travel (`Source`: every replica prefills for another, prefill_anywhere,
and the replica they leave is up: drained, or passing a vnode on), a warm-up is a split rather
than a recompute: the replica that served the session prefills its prompt (nearly all cache there)
and keeps its blocks for a remote decode (router.engines.handoff), and the new replica reads them and
computes one token: the real KV moves, and it costs the new replica a transfer, not the prompt's
prefill. Where that fails (no params, a failed read) or takes more than half the time left, the
new replica computes the prompt.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson

from router.apis import PROXIED, api_of
from router.engines.handoff import SPLITTABLE, Handoff
from router.engines.upstream import Response

WARMUP_HEADER = "X-Router-Warmup"
WARMABLE = frozenset(api.path for api in PROXIED.values() if api.prompt)  # what leaves a KV cache behind


class PromptStore:
    def __init__(
        self,
        max_bytes: int,
        ttl_s: float,
        max_entry_bytes: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[str, bytes, float]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: bytes, path: str, body: bytes) -> None:
        if path not in WARMABLE or len(body) > self.max_entry_bytes or self.max_bytes <= 0:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= len(old[1])
        now = self._clock()
        self._entries[key] = (path, body, now + self.ttl_s)
        self.bytes += len(body)
        # expired prompts go first (oldest first: one TTL for all keeps them in expiry order), so the
        # store holds the sessions alive within the TTL, not max_bytes of dead ones
        while self._entries:
            oldest = next(iter(self._entries))
            if self._entries[oldest][2] >= now and self.bytes <= self.max_bytes:
                break
            _, dropped, _ = self._entries.pop(oldest)
            self.bytes -= len(dropped)

    def get(self, key: bytes) -> tuple[str, bytes] | None:
        entry = self.entry(key)
        return None if entry is None else (entry[0], entry[1])

    def entry(self, key: bytes) -> tuple[str, bytes, float] | None:
        """(path, body, expiry on the monotonic clock) of the key's latest request, if it lives."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[2] < self._clock():
            del self._entries[key]
            self.bytes -= len(entry[1])
            return None
        return entry


def prefill_only(body: bytes, path: str = "/v1/chat/completions") -> bytes | None:
    """The request, computing its prompt and one token only; None if it is not a JSON object."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    data["max_tokens"] = 1
    data["stream"] = False
    api = api_of(path)
    if api is not None and api.anthropic:
        return orjson.dumps(data)  # Anthropic's API has neither n nor stream_options
    if "max_completion_tokens" in data:
        data["max_completion_tokens"] = 1
    data.pop("stream_options", None)
    data["n"] = 1
    return orjson.dumps(data)


@dataclass
class WarmupResult:
    sent: int = 0
    ok: int = 0  # ... and computed there
    moved: int = 0  # ... warmed with the KV read from the `Source`
    failed: int = 0
    skipped: int = 0  # not sent: time ran out
    succeeded: list[bool] = field(default_factory=list)  # per request, in order


@dataclass(frozen=True, slots=True)
class Source:
    """The replica the sessions leave, which holds their KV, and the hand-off its engine speaks."""

    url: str
    auth: dict[str, str]
    protocol: Handoff


# how warm-up sends one request: the router's upstream client (router.engines.upstream.Upstream.post),
# which resends a request whose pooled connection the replica had closed
Post = Callable[[str, bytes, dict[str, str], float], Awaitable[Response]]


async def warm(
    post: Post,
    base_url: str,
    requests: list[tuple[str, bytes]],
    concurrency: int,
    timeout_s: float,
    auth: dict[str, str] | None = None,
    source: Source | None = None,
) -> WarmupResult:
    """Replay `requests` (path, stored body) on one replica as prefill-only requests (`auth`: its
    engine's key, router.fleet.ReplicaState.auth); with a `source`, each reads its KV from there
    where it can (this module's docstring)."""
    result = WarmupResult(succeeded=[False] * len(requests))
    queue = list(enumerate(requests))
    deadline = time.monotonic() + timeout_s
    plain = {"Content-Type": "application/json", WARMUP_HEADER: "1"}
    headers = {**plain, **(auth or {})}

    async def send(url: str, payload: bytes, sent_with: dict[str, str]) -> tuple[int, bytes]:
        left = max(deadline - time.monotonic(), 0.1)
        async with asyncio.timeout(left):
            resp = await post(url, payload, sent_with, left)
            try:
                return resp.status, await resp.read()
            finally:
                resp.release()

    async def travelled(path: str, payload: bytes) -> bool:
        """The prompt prefilled at the source and its KV read here (one token computed)."""
        assert source is not None
        api = api_of(path)
        if api is None or api.name not in SPLITTABLE:
            return False
        data = orjson.loads(payload)
        at_source = {**plain, **source.auth}  # (its own engine key, never the new replica's)
        status, answer = await send(source.url + path, orjson.dumps(source.protocol.prefill_body(api, data)), at_source)
        params = source.protocol.params(orjson.loads(answer)) if status == 200 else None
        if params is None:
            return False
        status, _ = await send(base_url + path, orjson.dumps(source.protocol.decode_body(data, params)), headers)
        return status == 200

    async def one(i: int, path: str, body: bytes) -> None:
        payload = prefill_only(body, path)
        if payload is None:
            result.skipped += 1
            return
        result.sent += 1
        try:
            if source is not None:
                try:
                    # half the time left at most: the rest computes it here where the transfer is slow
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0.2) / 2):
                        if await travelled(path, payload):
                            result.moved += 1
                            result.succeeded[i] = True
                            return
                except (OSError, ValueError, TimeoutError):  # (unreachable, not JSON, slow): computed here
                    pass
            status, _ = await send(base_url + path, payload, headers)
            if status == 200:
                result.ok += 1
                result.succeeded[i] = True
            else:
                result.failed += 1
        except (OSError, TimeoutError):
            result.failed += 1

    async def worker() -> None:
        while queue and time.monotonic() < deadline:
            i, (path, body) = queue.pop(0)
            await one(i, path, body)

    await asyncio.gather(*(worker() for _ in range(max(concurrency, 1))))
    result.skipped += len(queue)
    return result
