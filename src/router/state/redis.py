"""Routing state shared by several routers through Redis (`--state redis://HOST:PORT/DB`).

Every instance routes by the same ring: membership (with drains) and vnode overrides live in
Redis, and each instance follows them; sessions (where each was served last) live there too, so a
session's next turn lands on the same replica whichever instance takes it.

Keys, under `kvar:<state_namespace>:`
- `replicas`: hash, replica id -> {"url", "draining", "remove", "since", "role"} (JSON): "since" is
  the unix time its slow start (or its drain) began, so that every instance ramps its weight alike;
  "role" is there for a decode replica (aggregated ones have none), which every instance then
  routes as one;
  `removed`: hash, id -> unix time (a removal made on one instance removes the replica everywhere);
- `overrides`: hash, "origin#vnode" -> owner id; `discovered`: hash of the replicas discovery
  added (and may remove); a replica entry's "remove" marks a drain that removes it at the end;
- `version`: a counter bumped by every change, announced on the channel `changes`;
- `reconcile`: a lock held by the instance (re)connecting, while it seeds or catches up Redis;
- `leader`: which instance rebalances (a lease of 3 s renewed every second; the others follow its
  moves, so N routers never make N conflicting moves);
- `s:<hex of the session key>`: the replica that served the session last and when (unix ms,
  after a NUL byte), expiring after `sticky_ttl_s`; of two records of a session, the newer wins.
- the channel `placements` (under `ttft`): each prompt an instance placed that added blocks to
  its prefix index, as `instance NUL replica NUL block keys` (8 bytes each, little-endian, at most
  MAX_SHARED_BLOCKS): the other instances put those blocks into their own index for that replica,
  so routers on one Redis send a new reader of a document where another router sent the first.

An instance applies its own changes locally at once and writes them to Redis; it follows the
others' changes when `changes` announces them and, as a fallback, when it sees `version` move
(checked every second). Session writes are batched every 100 ms; a session this instance has not
seen is looked up in Redis (with a short time-out) before it is routed.

If Redis is unreachable, routing goes on with the last known state; changes made meanwhile are
kept and written when Redis is back. If Redis comes back empty (restarted without its data), the
instance writes its whole state back first. Then every instance follows Redis again.

It is past 450 lines as one room: membership, sessions and placements in Redis each follow it
the same way (an instance that loses Redis keeps routing on what it knows, and writes back what
changed when Redis returns), and share its keys' names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.config import ReplicaSpec
from router.membership import Facts, Membership

log = logging.getLogger("router.state.redis")
POLL_S = 1.0
FLUSH_S = 0.1
LOOKUP_TIMEOUT_S = 0.05
LEASE_S = 3
CLOSE_TIMEOUT_S = 2.0
RECONCILE_LOCK_S = 5.0  # an instance that dies while reconciling holds the others back this long, at most
RECONCILE_WAIT_S = 2.0  # how long an instance waits for another's reconciling, then tries again later
MAX_PENDING_SESSIONS = 200_000  # session writes kept while Redis is away, at most
MAX_PENDING_PLACEMENTS = 1024  # placements waiting to be told; older ones are dropped (the index is a guess)
MAX_SHARED_BLOCKS = 8192  # blocks of one placement told at most (64 KiB; 512k bytes of prompt)


class RedisState:
    """This instance's membership, drains and overrides, shared with the others (membership's `Peers`)."""

    def __init__(
        self, url: str, namespace: str, membership: Membership, configured: tuple[ReplicaSpec, ...], sticky_ttl_s: float
    ) -> None:
        """`configured`: the replicas the router was started with; `sticky_ttl_s`: how long a session lives."""
        self.membership = membership
        self.configured = configured
        self.url = url
        self.prefix = f"kvar:{namespace}:"
        self.redis = aioredis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self.sessions = RedisSessions(self.redis, self.prefix, sticky_ttl_s)
        self.version: int | None = None
        self._pending: list[tuple[str, Any]] = []  # changes made while Redis was away
        self._tasks: list[asyncio.Task[None]] = []
        self.instance = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.leader = False  # this instance holds the lease: it alone rebalances

    def key(self, name: str) -> str:
        return self.prefix + name

    @property
    def online(self) -> bool:
        """Redis answers (as far as this instance knows); session traffic follows the same flag."""
        return self.sessions.online

    @online.setter
    def online(self, value: bool) -> None:
        self.sessions.online = value

    # -- life ------------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._connect()
        except (RedisError, OSError) as exc:
            log.warning("Redis at %s is unreachable (%s); routing on local state until it is back", self.url, exc)
        self._tasks = [
            asyncio.create_task(self._follow(), name="redis follow"),
            asyncio.create_task(self._listen(), name="redis listen"),
            asyncio.create_task(self.sessions.run(), name="redis sessions"),
        ]

    async def close(self) -> None:
        """Stop following; write what is pending if Redis answers. Every step is bounded: closing
        a connection whose server died can otherwise wait for ever (redis-py issue 3941)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
        await self.sessions.close()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self.redis.aclose(), CLOSE_TIMEOUT_S)

    async def _connect(self) -> None:
        """Seed what Redis lacks, write what changed while away, then follow Redis. One instance
        at a time (a lock in Redis): two that found an emptied Redis together would both seed it,
        and a replica one of them removed meanwhile would come back from the other's state."""
        r = self.redis
        async with r.lock(self.key("reconcile"), timeout=RECONCILE_LOCK_S, blocking_timeout=RECONCILE_WAIT_S):
            if not await r.exists(self.key("version")):
                await self._write_everything()  # a new (or emptied) Redis: our state is the best there is
            else:
                for op, arg in self._pending:
                    await self._apply_remote(op, arg)
                fleet = self.membership.fleet
                removed = await r.hgetall(self.key("removed"))
                for spec in self.configured:  # configured replicas nobody removed join
                    if spec.id.encode() not in removed and fleet.find(spec.id) is not None:
                        entry = orjson.dumps(_with_role({"url": spec.url, "draining": False}, spec.role))
                        await r.hsetnx(self.key("replicas"), spec.id, entry)
        self._pending.clear()
        self.online = True
        await self._lease()
        await self.pull()

    async def _write_everything(self) -> None:
        facts = self.membership.facts()
        pipe = self.redis.pipeline(transaction=True)
        for rid, url in facts.replicas.items():
            pipe.hset(self.key("replicas"), rid, orjson.dumps(self._entry(facts, rid, url)))
        for rid in facts.discovered:
            pipe.hset(self.key("discovered"), rid, 1)
        for op, arg in self._pending:
            if op == "remove":
                pipe.hset(self.key("removed"), arg, time.time())
        for (origin, number), owner in facts.overrides.items():
            pipe.hset(self.key("overrides"), f"{origin}#{number}", owner)
        pipe.incr(self.key("version"))
        await pipe.execute()

    def _entry(self, facts: Facts, rid: str, url: str) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "url": url,
            "draining": rid in facts.draining,
            "remove": facts.draining.get(rid, False),
        }
        since = facts.drained.get(rid) if rid in facts.draining else facts.warming.get(rid)
        if since is not None:
            entry["since"] = since
        return _with_role(entry, facts.roles.get(rid, "both"))

    # -- following ------------------------------------------------------------------------------

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                if not self.online:
                    await self._connect()
                    log.info("Redis at %s is back; state reconciled", self.url)
                    continue
                await self._lease()
                version = int(await self.redis.get(self.key("version")) or 0)
                if version != self.version:
                    await self.pull()
            except (RedisError, OSError) as exc:
                if self.online:
                    log.warning("lost Redis at %s (%s); routing on the last known state", self.url, exc)
                self.online = False
                self.leader = False  # without Redis nobody can be sure to be alone: nobody rebalances

    async def _lease(self) -> None:
        r, key = self.redis, self.key("leader")
        if await r.set(key, self.instance, nx=True, ex=LEASE_S):
            self.leader = True
        else:
            holder = await r.get(key)
            self.leader = holder == self.instance.encode()
            if self.leader:
                await r.expire(key, LEASE_S)

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(self.key("changes"))
                async for message in pubsub.listen():
                    if message.get("type") == "message" and self.online:
                        with contextlib.suppress(RedisError, OSError):
                            await self.pull()
            except (RedisError, OSError):
                await asyncio.sleep(POLL_S)

    async def pull(self) -> None:
        """Make this instance's membership, drains and overrides what Redis says."""
        r = self.redis
        pipe = r.pipeline(transaction=True)
        pipe.get(self.key("version"))
        pipe.hgetall(self.key("replicas"))
        pipe.hgetall(self.key("removed"))
        pipe.hgetall(self.key("overrides"))
        pipe.hkeys(self.key("discovered"))
        version, replicas, removed, overrides, discovered = await pipe.execute()
        self.version = int(version or 0)
        facts = Facts(removed={k.decode() for k in removed}, discovered={d.decode() for d in discovered})
        for field, value in replicas.items():
            rid, entry = field.decode(), orjson.loads(value)
            facts.replicas[rid] = str(entry["url"])
            if isinstance(role := entry.get("role"), str):
                facts.roles[rid] = role
            since = entry.get("since")
            started = float(since) if isinstance(since, (int, float)) else None
            if entry.get("draining"):
                facts.draining[rid] = bool(entry.get("remove"))
                if started is not None:
                    facts.drained[rid] = started
            elif started is not None:
                facts.warming[rid] = started
        for field, owner in overrides.items():
            origin, _, number = field.decode().rpartition("#")
            if number.isdigit():
                facts.overrides[(origin, int(number))] = owner.decode()
        # the whole state is followed at once (no await in between), then scale-out and drains go on
        await self.membership.settle(self.membership.reconcile(facts))

    # -- this instance's changes --------------------------------------------------------------------

    def changed(self, op: str, arg: Any) -> None:
        """A change made here (already applied locally): write it to Redis, or keep it for later."""
        if not self.online:
            self._pending.append((op, arg))
            return
        task = asyncio.ensure_future(self._write_change(op, arg))
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _write_change(self, op: str, arg: Any) -> None:
        try:
            await self._apply_remote(op, arg)
        except (RedisError, OSError):
            self.online = False
            self._pending.append((op, arg))

    async def _apply_remote(self, op: str, arg: Any) -> None:
        pipe = self.redis.pipeline(transaction=True)
        if op == "add":
            rid, url, since, role = arg
            entry = _with_role({"url": url, "draining": False, "since": since}, role)
            pipe.hset(self.key("replicas"), rid, orjson.dumps(entry))
            pipe.hdel(self.key("removed"), rid)
        elif op == "remove":
            pipe.hdel(self.key("replicas"), arg)
            pipe.hset(self.key("removed"), arg, time.time())
        elif op == "drain":
            rid, url, remove, since = arg
            replica = self.membership.fleet.find(rid)
            role = replica.role if replica is not None else "both"
            entry = _with_role({"url": url, "draining": True, "remove": remove, "since": since}, role)
            pipe.hset(self.key("replicas"), rid, orjson.dumps(entry))
        elif op == "discovered":
            pipe.hset(self.key("discovered"), arg, 1)
        elif op == "override":
            origin, number, owner = arg
            if owner is None:
                pipe.hdel(self.key("overrides"), f"{origin}#{number}")
            else:
                pipe.hset(self.key("overrides"), f"{origin}#{number}", owner)
        pipe.incr(self.key("version"))
        version, *_ = reversed(await pipe.execute())
        self.version = int(version)  # our own change: nothing to pull for it
        await self.redis.publish(self.key("changes"), str(version))


def _with_role(entry: dict[str, Any], role: str) -> dict[str, Any]:
    """A replica's entry, with its role where it has one (a decode replica's: another router must
    not take it for an aggregated one)."""
    return entry if role == "both" else entry | {"role": role}


class RedisSessions:
    """Sessions in Redis: where each was served last, looked up and written in batches.

    A lone router (or the control process) has one inside its `RedisState`, which tells it when
    Redis is there. A worker process has its own, `standalone`: it finds out itself, by pinging
    Redis every second while it is away.
    """

    def __init__(self, client: Any, prefix: str, ttl_s: float, standalone: bool = False) -> None:
        self.redis = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.standalone = standalone
        self.online = False
        self._pending: dict[bytes, tuple[str, int]] = {}  # session writes (replica, unix ms) waiting for a flush

    @classmethod
    def connect(cls, url: str, namespace: str, ttl_s: float) -> RedisSessions:
        client = aioredis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        return cls(client, f"kvar:{namespace}:", ttl_s, standalone=True)

    def _key(self, key: bytes) -> str:
        return self.prefix + "s:" + key.hex()

    def served(self, key: bytes, replica: str, written_ms: int) -> None:
        self._pending.pop(key, None)
        self._pending[key] = (replica, written_ms)  # latest last
        if len(self._pending) > MAX_PENDING_SESSIONS:  # Redis is away for long: keep the newest
            del self._pending[next(iter(self._pending))]

    async def lookup(self, key: bytes) -> tuple[str, int] | None:
        """Where the session was served last by any instance, and when (unix ms); None: nowhere,
        or Redis is away. A write of ours not flushed yet is the newest news."""
        pending = self._pending.get(key)
        if pending is not None:
            return pending
        if not self.online:
            return None
        try:
            value = await asyncio.wait_for(self.redis.get(self._key(key)), LOOKUP_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError):
            return None
        if not value:
            return None
        replica, _, written = (value if isinstance(value, bytes) else str(value).encode()).partition(b"\0")
        return replica.decode(), int(written or 0)

    async def run(self) -> None:
        """Write what was served every FLUSH_S while Redis is there (standalone: find it again)."""
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                if self.standalone and not self.online:
                    await self.redis.ping()
                    self.online = True
                if self.online and self._pending:
                    await self._flush()
            except (RedisError, OSError):
                self.online = False
                if self.standalone:
                    await asyncio.sleep(POLL_S)

    async def close(self, own_client: bool = False) -> None:
        """Write what is pending if Redis answers; every step bounded (redis-py issue 3941)."""
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self._flush(), CLOSE_TIMEOUT_S)
        if own_client:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await asyncio.wait_for(self.redis.aclose(), CLOSE_TIMEOUT_S)

    async def _flush(self) -> None:
        batch, self._pending = self._pending, {}
        if not batch:
            return
        ttl = max(int(self.ttl_s), 1)
        pipe = self.redis.pipeline(transaction=False)
        for key, (replica, written) in batch.items():
            pipe.set(self._key(key), f"{replica}\0{written}", ex=ttl)
        try:
            await pipe.execute()
        except (RedisError, OSError):
            for key, entry in batch.items():  # keep them for the next flush (newer writes win)
                self._pending.setdefault(key, entry)
            raise


class RedisPlacements:
    """Placements of new prefixes, told to the other routers on one Redis and learnt from them.

    `placed(replica, chain)` queues what this router's prefix index just learnt; every FLUSH_S the
    queue is published on `placements` in one pipeline. Messages from other instances go to
    `learn(replica, chain)`. Best effort by design: the index is a prediction that the replicas'
    own reports correct, so a placement lost while Redis is away costs a guess, never a request.
    """

    def __init__(self, url: str, namespace: str, learn: Callable[[str, array[int]], None]) -> None:
        # its own connection: a subscribed connection can do nothing else
        self.redis = aioredis.from_url(url, socket_timeout=None, socket_connect_timeout=0.5)
        self.channel = f"kvar:{namespace}:placements"
        self.learn = learn
        self.instance = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}".encode()
        self._pending: deque[bytes] = deque(maxlen=MAX_PENDING_PLACEMENTS)
        self.told = 0
        self.learnt = 0

    def placed(self, replica: str, chain: array[int]) -> None:
        keys = chain[:MAX_SHARED_BLOCKS]
        if sys.byteorder != "little":
            keys = array("Q", keys)
            keys.byteswap()
        self._pending.append(b"%s\0%s\0%s" % (self.instance, replica.encode(), keys.tobytes()))

    def received(self, message: bytes) -> None:
        """One message from the channel: learnt unless it is this instance's own, or malformed."""
        instance, _, rest = message.partition(b"\0")
        replica, sep, keys = rest.partition(b"\0")
        if instance == self.instance or not sep or not keys or len(keys) % 8:
            return
        chain = array("Q", keys)
        if sys.byteorder != "little":
            chain.byteswap()
        self.learnt += 1
        self.learn(replica.decode("utf-8", "replace"), chain)

    async def run(self) -> None:
        await asyncio.gather(self._tell(), self._listen())

    async def _tell(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            if not self._pending:
                continue
            batch = list(self._pending)
            self._pending.clear()
            pipe = self.redis.pipeline(transaction=False)
            for message in batch:
                pipe.publish(self.channel, message)
            try:
                await pipe.execute()
                self.told += len(batch)
            except (RedisError, OSError):
                await asyncio.sleep(POLL_S)  # dropped: Redis is away, and these were guesses

    async def _listen(self) -> None:
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    async for message in pubsub.listen():
                        if message.get("type") == "message" and isinstance(message.get("data"), bytes):
                            self.received(message["data"])
            except (RedisError, OSError):
                await asyncio.sleep(POLL_S)

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self.redis.aclose(), CLOSE_TIMEOUT_S)
