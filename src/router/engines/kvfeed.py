"""The engines' KV-cache events, read: one ZMQ subscriber per replica that publishes, and requests cut into its tokens.

`Feed.run` looks at every replica (every `FIND_EVERY_S`): one whose health probes show vLLM's
`vllm:cache_config_info` (vLLM, router-emulator: the engines that say where they publish; worker
processes see it in the shared table) and that answers `GET /kv_event_sources` with a ZMQ
publisher (vLLM started with `--kv-events-config`), or one named in `kv_event_endpoints`, gets a
subscriber per data-parallel rank. Nothing else is sent to a replica: with `health_checks = false`
only the configured endpoints are read. An endpoint that binds (`tcp://*:P`, `tcp://0.0.0.0:P`)
is reached at the replica's own host; one that connects (`tcp://HOST:P`: the engine pushes to a
socket its subscriber binds) is not supported, and said so once in the log. A replica that
publishes nothing (llama.cpp, older vLLM, events off) is left to the router's own model.

A subscriber (`_follow`) connects its SUB socket, then asks the replay socket (where there is one)
for everything from sequence 0, so it starts from what the engine has held since it started
rather than from whenever it joined; every message then goes to the replica's `Holdings`
(router.kvevents.holdings), which checks the sequence: a gap is filled from the replay socket,
and what replay cannot fill leaves that replica unsure (routed by the model) until rebuilt.

The index is bounded (`kv_events_max_mib`): each replica followed is counted at its KV capacity,
and one that would take the sum past the budget is not followed (`Feed.unfollowed`).

`Feed.tokenized` gives a request the engine's tokens when a replica that serves its model is fed
by events, without a round trip (router.engines.tokens: the model's tokenizer, found from what the
engines serve and checked against them off the path, else a conversation's history as an engine
tokenized it in the background); what is not known in tokens is priced by the router's model.

It is past 450 lines because it is one subscriber's life whole: which replicas are followed (found,
counted against the budget, let go), each one's sockets, replays and messages, and the requests
cut into its tokens; the parts others use are apart (router.kvevents, router.engines.tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp
import orjson
import zmq
import zmq.asyncio

from router._runtime import memory_limit_bytes
from router.apis import Api
from router.config import event_endpoints, kv_capacities, tokenizer_dirs
from router.config.groups import PlacementSettings
from router.engines.tokens import EngineTokenizers
from router.fleet import Fleet, ReplicaState
from router.keys import RoutingKey
from router.kvevents.holdings import Holdings, take
from router.kvevents.mapped import SHM_DIR, TAKE_STEP, SharedFileError
from router.kvevents.roster import Followed
from router.kvevents.shared import shard_of
from router.kvevents.wire import END_SEQ, Batch, WireError, frames_of, seq_of
from router.metrics import RouterMetrics
from router.placement import Placement
from router.prefix import IMPLEMENTATION as INDEX_IMPLEMENTATION

log = logging.getLogger("router.engines.kvfeed")

FIND_EVERY_S = 5.0  # replicas are asked where they publish this often (until they say)
SOURCES_TIMEOUT_S = 2.0
REPLAY_TIMEOUT_S = 3.0  # a replay socket's answer is given up after this long without a message of it
# ... and after this long in all, however it flows. (A router joining a busy fleet shares its CPU
# between the replays and the live streams: a replay of 20 s of an H200's events took 10-20 s to
# read, and one timed out on its whole answer after 3 s was never read at all.)
REPLAY_MAX_S = 120.0
DEFAULT_CAPACITY_BLOCKS = 1 << 20  # until the engine says how many blocks it has (or kv_capacity_tokens)
ASSUMED_BLOCK_TOKENS = 16  # a block's tokens until an engine's metrics or events say (vLLM's default)
# What the event-fed index is counted to cost a block of an engine's KV capacity, against
# kv_events_max_mib: a block held costs 50-60 bytes in a router's own compiled index and 60-67 in
# the shared one in full regions (docs/benchmarks.md, "Fleet scale"); the pure-Python twin's
# dicts (ROUTER_NO_EXTENSIONS=1) up to 235 (its memory_bytes, filled to a third, half and whole)
INDEX_BYTES_PER_BLOCK = 68 if INDEX_IMPLEMENTATION == "compiled" else 240
# ... and in the index in shared memory a control process writes for its workers: its regions are
# the same bytes in either implementation (router.kvevents.shared)
SHARED_BYTES_PER_BLOCK = 68
NO_ROOM_RETRY_S = 30.0  # a replica whose blocks found no room in shared memory is tried again after this long
DRAIN_RUN = 64  # messages one subscriber reads in a row before the others' turn
FOLLOW_EVERY_S = 0.05  # a worker on its host's shared index looks at its roster this often


def index_budget_blocks(max_mib: int, processes: int = 1, per_block: int | None = None) -> int:
    """`kv_events_max_mib` as blocks of engines' KV capacity (0: a quarter of this host's memory,
    or of its container's limit, shared by `processes`: the workers of one router), each counted
    at `per_block` bytes (INDEX_BYTES_PER_BLOCK unless said)."""
    budget = max_mib << 20 if max_mib > 0 else memory_limit_bytes() // 4 // max(processes, 1)
    return max(1, budget // (per_block or INDEX_BYTES_PER_BLOCK))


def shm_room_blocks(directory: str = SHM_DIR) -> int | None:
    """The blocks of engines' KV capacity the room left in `directory` (/dev/shm) holds, less
    the shared index's directory and roster (None: no such folder)."""
    try:
        room = os.statvfs(directory)
    except OSError:
        return None
    return max(0, room.f_bavail * room.f_frsize - 2 * TAKE_STEP) // SHARED_BYTES_PER_BLOCK


def shard_budget(max_mib: int, shards: int) -> IndexBudget:
    """The budget of one of `shards` processes that follow a host's engines into its index in
    /dev/shm (the control process of workers, and those beside it: router.proxy.followers): a
    share of `kv_events_max_mib`, or by default of a quarter of memory, and then of the room in
    /dev/shm, so that the replicas left out are left out whole, rather than found without room for
    their blocks."""
    blocks = index_budget_blocks(max_mib, shards, SHARED_BYTES_PER_BLOCK)
    if max_mib > 0:
        blocks = max(1, blocks // shards)  # (the default's share is taken there)
    room = shm_room_blocks() if max_mib == 0 else None
    if room is not None and room // shards < blocks:
        source = "kv_events_max_mib 0: the room in /dev/shm (a quarter of memory is more)"
        return IndexBudget(room // shards, source, SHARED_BYTES_PER_BLOCK)
    return IndexBudget(blocks, per_block=SHARED_BYTES_PER_BLOCK)


class IndexBudget:
    """The blocks of engines' KV capacity one process's event-fed indexes may be counted at
    (`kv_events_max_mib`), shared by its feeds: a disaggregated router follows its prefill
    replicas in a feed of their own. `source`: what set it, as its log lines say; `per_block`:
    the bytes a block is counted at (SHARED_BYTES_PER_BLOCK where the index is the host's shared one)."""

    def __init__(self, blocks: int, source: str = "kv_events_max_mib", per_block: int | None = None) -> None:
        self.blocks = blocks
        self.source = source
        self.per_block = per_block or INDEX_BYTES_PER_BLOCK
        self._counted: dict[int, int] = {}  # id(feed) -> the blocks it counts now

    def left(self, feed: object) -> int:
        """What `feed` may count: the budget less what the other feeds count."""
        return self.blocks - sum(n for f, n in self._counted.items() if f != id(feed))

    def count(self, feed: object, blocks: int) -> None:
        self._counted[id(feed)] = blocks

    def release(self, feed: object) -> None:
        self._counted.pop(id(feed), None)


def reachable(endpoint: str, replica_url: str) -> str | None:
    """The endpoint a subscriber connects to, from what the engine says it binds; None where the
    engine connects instead (it binds nothing the router could reach)."""
    if not endpoint.startswith("tcp://"):
        return endpoint if endpoint.startswith("ipc://") else None
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit():
        return None
    if host in ("*", "0.0.0.0", "[::]", "::", "[*]"):
        own = urlsplit(replica_url).hostname or "127.0.0.1"
        return f"tcp://{own}:{port}" if ":" not in own else f"tcp://[{own}]:{port}"
    return None  # the engine connects to HOST: a SUB socket the router would have to bind


def sources_of(answer: Any, replica_url: str) -> dict[int, tuple[str, str | None]]:
    """vLLM's /kv_event_sources answer ({rank: its KVEventsConfig}) as {rank: (pub, replay)}."""
    out: dict[int, tuple[str, str | None]] = {}
    if not isinstance(answer, Mapping):
        return out
    for rank_text, config in answer.items():
        try:
            rank = int(rank_text)
        except (TypeError, ValueError):
            continue
        if not isinstance(config, Mapping) or not config.get("enable_kv_cache_events"):
            continue
        if config.get("publisher", "zmq") != "zmq" or not isinstance(config.get("endpoint"), str):
            continue
        pub = reachable(config["endpoint"], replica_url)
        if pub is None:
            log.warning(
                "replica %s publishes KV events to %s (it connects to a subscriber): not read; bind instead "
                "(tcp://*:PORT)",
                replica_url,
                config["endpoint"],
            )
            continue
        replay = config.get("replay_endpoint")
        out[rank] = (pub, reachable(replay, replica_url) if isinstance(replay, str) else None)
    return out


MAX_SOCKETS = 16_384  # the feed's ZMQ sockets at most: subscribers and replay dealers, two a replica


class Feed:
    def __init__(
        self,
        fleet: Fleet,
        placement: Placement,
        config: PlacementSettings,
        http: Callable[[], aiohttp.ClientSession],
        metrics: RouterMetrics,
        routes: bool = True,
        budget: IndexBudget | None = None,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        self.fleet = fleet
        # (k, n): one of n processes that follow the host's engines, following only the replicas
        # `shard_of` gives it (router.kvevents.shared; router.proxy.followers)
        self.shard = shard
        self.placement = placement
        self.truth = placement.truth
        self.routes = routes  # False: the control process of workers (it follows for them; it tokenizes nothing)
        self.http = http
        self.metrics = metrics
        self.configured = event_endpoints(config)
        self.capacities = kv_capacities(config)  # KV tokens where an engine does not say
        # The index's memory, bounded: every replica followed is counted at its KV capacity (each
        # rank, each tier), and one that would take the sum past this is not followed (priced by
        # the router's model); one whose capacity grew past it is let go, the last followed first.
        self.budget = budget or IndexBudget(index_budget_blocks(config.kv_events_max_mib))
        self.unfollowed = self.truth.unfollowed  # replica id -> the blocks it would take
        # replica id -> why its blocks found no room in shared memory (the host's /dev/shm is full):
        # let go, priced by the router's model, and followed again once NO_ROOM_RETRY_S have passed
        self.no_room = self.truth.no_room
        self._no_room_until: dict[str, float] = {}
        self.tokens = EngineTokenizers(
            fleet, tokenizer_dirs(config), config.token_check_share, http, metrics, lambda: placement.bytes_per_token
        )
        # a context of its own: ZMQ's default holds 1,023 sockets, and each replica followed takes a
        # subscriber (and a replay dealer while it catches up): a thousand replicas need more
        self.ctx = _context()
        self.tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.asked: dict[str, float] = {}  # replica id -> when its /kv_event_sources was last asked
        self.bad_messages = 0
        # replica id -> messages to lose on arrival, as a network would (how tests reach the replay path)
        self.lose: dict[str, int] = {}
        # told of each live batch once applied, with its replica's id (router-bench events measures by it)
        self.applied: Callable[[str, Batch], None] | None = None

    # -- subscribers -------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            if self.truth.reader is not None:
                await self._read()
            while True:
                await self.find()
                await asyncio.sleep(FIND_EVERY_S / 5)
        finally:
            await self.close()

    async def _read(self) -> None:
        """A worker on its host's shared index: no subscriber of its own; the replicas its control
        process follows, taken from the roster every FOLLOW_EVERY_S (their blocks are read from the
        shared regions at each request)."""
        turns = 0
        while True:
            self.truth.follow()
            if turns % round(FIND_EVERY_S / 5 / FOLLOW_EVERY_S) == 0:
                self._watch({r.id: r for r in self.fleet.replicas})
            turns += 1
            await asyncio.sleep(FOLLOW_EVERY_S)

    def _watch(self, present: dict[str, ReplicaState]) -> None:
        """Finds the tokenizers of the models the believed replicas serve, before their first request."""
        if not self.routes:
            return
        models: dict[str, list[ReplicaState]] = {}
        for rid, replica in present.items():
            if replica.models and self.truth.sure(rid):
                for model in replica.models:
                    models.setdefault(model, []).append(replica)
        self.tokens.watch(models)

    async def find(self) -> None:
        """Subscribe to the replicas that publish and are not followed yet; stop following gone ones."""
        shard, shards = self.shard
        present = {r.id: r for r in self.fleet.replicas if shards == 1 or shard_of(r.id, shards) == shard}
        now = time.monotonic()
        self._let_go_without_room(present, now)
        for (rid, rank), task in list(self.tasks.items()):
            if rid not in present or task.done():
                task.cancel()
                del self.tasks[(rid, rank)]
                if rid not in present:
                    self.truth.forget(rid)
                    self.asked.pop(rid, None)
        m = self.metrics
        self._watch(present)
        for rid in [rid for rid in self.unfollowed if rid not in present]:
            del self.unfollowed[rid]
        before = set(self.unfollowed)
        for rid, replica in present.items():
            for h in self.truth.of(rid):
                blocks = _capacity_blocks(replica, h, self.capacities)
                if isinstance(h, Holdings) and blocks != h.capacity:
                    h.set_capacity(blocks)
                    self.truth.published(h)
        allowed = self.budget.left(self)
        reserved = self._within_budget(present, allowed)
        followed = {rid for rid, _ in self.tasks}  # (a set: a thousand replicas asked of a list took 50 ms)
        for rid, replica in present.items():
            ranks = self.truth.of(rid)
            if ranks:
                m.child(m.kv_events_believed, rid).set(1 if self.truth.sure(rid) else 0)
                for medium in {medium for h in ranks for medium in h.tiers}:
                    m.child(m.kv_event_blocks, rid, medium).set(sum(h.blocks(medium) for h in ranks))
            if rid in followed:
                continue
            if rid not in self.configured and replica.engine.block_size is None:
                continue  # its probes have not shown vLLM's cache_config_info: not an engine that says
            if rid in self.unfollowed and reserved + self.unfollowed[rid] > allowed:
                continue  # it still does not fit (as it was counted when last asked)
            if now < self._no_room_until.get(rid, now):
                continue  # its blocks found no room in shared memory a moment ago
            if now - self.asked.get(rid, -FIND_EVERY_S) < FIND_EVERY_S:
                continue
            self.asked[rid] = now
            sources = await self._sources(replica)
            need = _capacity_blocks(replica, None, self.capacities) * len(sources)
            if not sources or reserved + need > allowed:
                if sources:
                    self.unfollowed[rid] = need  # (the budget's reason, not the room's, from now on)
                    self.no_room.pop(rid, None)
                    self._no_room_until.pop(rid, None)
                else:  # (it publishes nothing now)
                    self.unfollowed.pop(rid, None)
                continue
            reserved += need
            self.unfollowed.pop(rid, None)
            self.no_room.pop(rid, None)
            self._no_room_until.pop(rid, None)
            for rank, (pub, replay) in sources.items():
                self.tasks[(rid, rank)] = asyncio.create_task(
                    self._follow(replica, rank, pub, replay), name=f"kv events {rid}/{rank}"
                )
        fresh = [rid for rid in self.unfollowed if rid not in before]
        for rid in fresh:
            m.kv_events_not_followed(rid)
        if fresh:
            self._say_unfollowed(fresh, reserved)
        self.budget.count(self, reserved)
        m.kv_events_unfollowed.set(len(self.unfollowed) + len(self.no_room))
        self.truth.follow_beside()

    def _let_go_without_room(self, present: Mapping[str, ReplicaState], now: float) -> None:
        """Lets go of the replicas whose blocks found no room in shared memory since the last round
        (each rank's subscriber, its regions), in one log line however many: they are priced by the
        router's model until NO_ROOM_RETRY_S have passed and they are tried again."""
        for rid in [rid for rid in self.no_room if rid not in present]:
            del self.no_room[rid]
            self._no_room_until.pop(rid, None)
        fresh = [rid for rid in self.no_room if rid not in self._no_room_until]
        for rid in fresh:
            for key in [key for key in self.tasks if key[0] == rid]:
                self.tasks.pop(key).cancel()
            self.truth.forget(rid)  # (its regions' files go: room for the others)
            self._no_room_until[rid] = now + NO_ROOM_RETRY_S
            self.metrics.kv_events_not_followed(rid)
        if fresh:
            log.warning(
                "%d replicas' KV events not followed for %.0f s (priced by the router's model): no room for their "
                "blocks in shared memory, which the host's worker processes read them from (%s); give /dev/shm "
                "more room (docker run --shm-size, a Kubernetes emptyDir of medium Memory with a larger sizeLimit) "
                "or set kv_events_max_mib below it: %s%s",
                len(fresh),
                NO_ROOM_RETRY_S,
                self.no_room[fresh[0]],
                ", ".join(fresh[:5]),
                f" and {len(fresh) - 5} more" if len(fresh) > 5 else "",
            )

    def _within_budget(self, present: Mapping[str, ReplicaState], allowed: int) -> int:
        """The blocks the replicas followed are counted at (each rank's capacity, each tier), after
        letting go of those that took the sum past `allowed` (their capacity, or a tier, grew since
        they were followed), the last followed first."""
        ranks = Counter(rid for rid, _ in self.tasks)  # (in the order they were followed)
        counted: dict[str, int] = {}
        for rid, n in ranks.items():
            held = [h for h in self.truth.of(rid) if isinstance(h, Holdings)]
            if held:
                counted[rid] = sum(h.capacity * max(1, len(h.tiers)) for h in held)
            else:  # its subscribers have not started: as it was counted when followed
                counted[rid] = _capacity_blocks(present[rid], None, self.capacities) * n
        reserved = sum(counted.values())
        for rid in reversed(counted):
            if reserved <= allowed:
                break
            for key in [key for key in self.tasks if key[0] == rid]:
                self.tasks.pop(key).cancel()
            self.truth.forget(rid)
            self.asked.pop(rid, None)
            reserved -= counted[rid]
            self.unfollowed[rid] = counted[rid]
        return reserved

    def _say_unfollowed(self, fresh: list[str], reserved: int) -> None:
        """One line a round for the replicas newly not followed, however many."""
        named = ", ".join(f"{rid} ({self.unfollowed[rid]} blocks)" for rid in fresh[:5])
        log.warning(
            "%d replicas' KV events not followed (priced by the router's model), each past the event-fed index's "
            "budget, %s (%.0f MiB: %d blocks of engines' KV at %d bytes, %d of them taken): %s%s",
            len(fresh),
            self.budget.source,
            self.budget.blocks * self.budget.per_block / (1 << 20),
            self.budget.blocks,
            self.budget.per_block,
            reserved,
            named,
            f" and {len(fresh) - 5} more" if len(fresh) > 5 else "",
        )

    async def _sources(self, replica: ReplicaState) -> dict[int, tuple[str, str | None]]:
        configured = self.configured.get(replica.id)
        if configured is not None:
            return {0: configured}
        try:
            async with self.http().get(
                replica.url + "/kv_event_sources",
                timeout=aiohttp.ClientTimeout(total=SOURCES_TIMEOUT_S),
                headers=replica.auth,
            ) as r:
                if r.status != 200:
                    return {}
                answer = await r.json(content_type=None, loads=orjson.loads)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError):
            return {}
        return sources_of(answer, replica.url)

    async def _follow(self, replica: ReplicaState, rank: int, pub: str, replay: str | None) -> None:
        try:
            await self._subscribe(replica, rank, pub, replay)
        except SharedFileError as exc:  # (the host's /dev/shm is full: the next round lets it go)
            self.no_room[replica.id] = str(exc)

    async def _subscribe(self, replica: ReplicaState, rank: int, pub: str, replay: str | None) -> None:
        holdings = self.truth.holdings(replica.id, rank, _capacity_blocks(replica, None, self.capacities))
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        log.info("replica %s: reading its KV events from %s (replay: %s)", replica.id, pub, replay or "none")
        try:
            await asyncio.sleep(0.2)  # the subscription reaches the publisher before replay is asked
            fill = None if replay is None else functools.partial(self._fill, holdings, replay)
            if fill is not None:
                await fill(0)
            async with contextlib.aclosing(_messages(sub)) as messages:
                async for frames in messages:
                    if self.lose.get(replica.id):
                        self.lose[replica.id] -= 1
                        continue
                    try:
                        batch = frames_of(frames)
                    except WireError as exc:
                        self._bad(replica.id, exc)
                        continue
                    if not await take(holdings, batch, fill):
                        continue  # the replay applied it already
                    self.truth.published(holdings)
                    if batch.ts > 0:
                        self.metrics.kv_event_lag.observe(max(time.time() - batch.ts, 0.0))
                    if self.applied is not None:
                        self.applied(replica.id, batch)
        finally:
            sub.close(linger=0)

    async def _fill(self, holdings: Holdings, endpoint: str, wanted: int) -> bool:
        """Asks the replay socket for everything from `wanted` on and applies it."""
        try:
            return await self._replayed(holdings, endpoint, wanted)
        finally:
            self.truth.published(holdings)

    async def _replayed(self, holdings: Holdings, endpoint: str, wanted: int) -> bool:
        return holdings.filled(await self.replay(endpoint, wanted), wanted)

    async def replay(self, endpoint: str, start: int) -> list[Batch] | None:
        """The replay socket's batches from `start` on ([] when it has none); None when it fell
        silent for REPLAY_TIMEOUT_S before its end (or took REPLAY_MAX_S)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        out: list[Batch] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            end = time.monotonic() + REPLAY_MAX_S
            while True:
                left = min(REPLAY_TIMEOUT_S, end - time.monotonic())
                if left <= 0 or not await dealer.poll(left * 1000):
                    return None
                frames = await dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                try:
                    if len(frames) >= 2 and seq_of(frames[1]) == END_SEQ:
                        return out
                    out.append(frames_of(frames))
                except WireError as exc:
                    self._bad(endpoint, exc)
        finally:
            dealer.close(linger=0)

    def _bad(self, where: str, exc: WireError) -> None:
        self.bad_messages += 1
        if self.bad_messages <= 10 or self.bad_messages % 1000 == 0:
            log.warning("KV events from %s: %s (%d such messages)", where, exc, self.bad_messages)

    async def close(self) -> None:
        self.budget.release(self)
        await self.tokens.close()
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()
        self.ctx.destroy(linger=0)  # its I/O thread ends with it
        self.ctx = _context()  # (a feed closed may run again)

    # -- the engine's tokens -------------------------------------------------------------------------

    def fed(self, model: str | None) -> list[ReplicaState]:
        """The replicas serving `model` whose events the index believes."""
        skip = self.fleet.not_serving(model)
        return [r for r in self.fleet.replicas if r.index not in skip and self.truth.sure(r.id)]

    def tokenized(self, key: RoutingKey, api: Api, body: Mapping[str, Any]) -> RoutingKey:
        """`key` with its prompt in the engine's tokens as far as they are known now, where a replica
        serving its model is fed by events (router.engines.tokens); else `key` as it is. Never waits."""
        if key.prompt is None or not self.truth:
            return key
        return self.tokens.tokenized(key, api, body, self.fed(key.model))

    def replied(self, key: RoutingKey, api: Api, body: Mapping[str, Any], reply: Callable[[], str | None]) -> None:
        """A chat's answer has gone to its client: its tokens kept for the conversation's next turn
        (router.engines.tokens). Never waits."""
        if key.prompt is not None and self.truth:
            self.tokens.replied(key.model, api, body, reply)


async def _messages(sub: zmq.asyncio.Socket) -> AsyncGenerator[list[bytes], None]:
    """The socket's messages as they come, read without a future each: the event loop watches
    its file descriptor, and each wake-up reads every message queued (DRAIN_RUN at a time, then
    the other sockets' turn). (pyzmq's awaited receive cost more than the decoding and indexing of
    a 64-block message.) ZMQ's descriptor only says that its events may have changed: they are
    read again after each pass, and before each wait."""
    raw: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)  # (its non-blocking calls, without futures)
    fd = cast(int, raw.getsockopt(zmq.FD))
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    loop.add_reader(fd, ready.set)
    try:
        while True:
            n = 0
            while _readable(raw):
                yield raw.recv_multipart(zmq.NOBLOCK)
                n += 1
                if n >= DRAIN_RUN:
                    n = 0
                    await asyncio.sleep(0)
            ready.clear()
            if not _readable(raw):
                await ready.wait()
    finally:
        loop.remove_reader(fd)


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's flags make an enum an `&`


def _readable(raw: zmq.Socket[bytes]) -> bool:
    return bool(cast(int, raw.getsockopt(_EVENTS)) & _POLLIN)


def _context() -> zmq.asyncio.Context:
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, min(MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT)))
    return ctx


def _capacity_blocks(replica: ReplicaState, holdings: Holdings | Followed | None, configured: Mapping[str, int]) -> int:
    """The blocks a replica's KV cache holds: its tokens as its engine says, else as
    `kv_capacity_tokens` says (`configured`), in blocks of the size its metrics or events say (until
    they do, vLLM's default); else DEFAULT_CAPACITY_BLOCKS."""
    size = (holdings.block_size if holdings is not None else None) or replica.engine.block_size
    tokens = replica.engine.kv_tokens or configured.get(replica.id, configured.get("*"))
    if tokens:
        return max(1, int(tokens // (size or ASSUMED_BLOCK_TOKENS)))
    return DEFAULT_CAPACITY_BLOCKS


__all__ = ["Feed", "reachable", "sources_of"]
