"""Per-tenant token budgets: each tenant may use so many tokens a minute (prompt and completion).

A token bucket per tenant. Its capacity is the tenant's `tokens_per_minute` and it refills
continuously at a sixtieth of that per second, never above capacity. At admission a request
reserves what it is estimated to use (`estimate`): if the bucket holds that many they are taken,
else nothing is taken and the caller is told how many seconds until enough has refilled (its
Retry-After, at least 1). A request whose own completion cap is more than the whole budget could
never fit: the caller refuses it at once (`exceeds`: a 429 `request_exceeds_budget`, no
Retry-After), rather than let it through on a full bucket and lock the tenant out for as long as
its reservation takes to refill. Any other request larger than the budget (its prompt estimated
large) is let through by a full bucket, whose level goes negative, so that it is delayed, not
refused forever. When the request ends it settles with what it really used: the difference is given back,
or taken, so a request that used more than reserved delays the tenant's next ones. A stream cut
before its usage came is settled on what passed: its prompt's estimate and the token-carrying
events the router forwarded (router.proxy.framer counts them). Unknown usage otherwise (an answer
whose client left before it was sent) keeps the reservation as charged.

Example: 6000 tokens a minute refill 100 a second. From a full bucket a request reserves 2500
(3500 left); another that needs 4000 is told to wait ceil(500 / 100) = 5 s. If the first ends
having used 1500, 1000 come back: 4500 are there and the 4000 fit.

A tenant with no budget costs one dict lookup. Two stores keep the buckets:

- LocalStore (the default): in this process. Each router process, and each worker process of one
  router, keeps its own buckets: dividing a tenant's limit by the number of processes is the
  caller's job.
- RedisStore: in Redis, shared by every router pod on it. A Lua script reserves (refill, check,
  take) and another settles (refill, adjust), each atomic, on Redis' clock (`TIME`), so concurrent
  pods lose no update and their own clocks do not matter. A tenant's bucket is the hash
  `{prefix}budget:{tenant}` with fields `level` and `at` (unix seconds), expiring two minutes after
  it would be full again: an idle tenant costs nothing, and a missing key is a full bucket.
  Reserving is on a request's path, one script; settling is not, and a process sums each
  tenant's settlements and sends them every SETTLE_EVERY_S as one (the refund comes that late).
  When Redis fails (unreachable, timed out, refusing writes) a request is let through uncharged,
  counted in `errors` and logged at most once a minute: the fleet staying available matters more
  than a budget staying exact for the seconds Redis is away. `RedisStore.connect` gives the client a
  short socket timeout, so that a request waits on a dead Redis that long at most, and a blocking
  connection pool: a plain one refuses a burst beyond its size, and those requests would pass
  uncharged; its short wait for a free connection (POOL_WAIT_S) keeps a stalled Redis from costing
  every request the stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("router.tenancy.budgets")
WARN_EVERY_S = 60.0
IDLE_TTL_S = 120  # a bucket's key outlives the moment it is full again by this much
POOL_WAIT_S = 0.02  # the longest a request waits for a free connection to Redis (RedisStore.connect)
SETTLE_EVERY_S = 0.1  # a tenant's settlements go to Redis summed, this often
CLOSE_TIMEOUT_S = 2.0  # the longest closing waits on Redis for what is owed, and for the client


@dataclass(slots=True, frozen=True)
class Reservation:
    """Tokens taken from a tenant's bucket at admission, settled when the request ends.

    `charged` is False where nothing was taken (no budget, or Redis was away): settling it does nothing.
    """

    tenant: str
    tokens: int
    charged: bool = True
    prompt: int = 0  # its prompt's tokens as estimated from the body's size (a stream that ends early is charged it)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request a tenant's budget turns away: why (`reason`, a label of router_shed_total), in
    words, and the whole seconds to wait before asking again (0: waiting would not help)."""

    message: str
    reason: str
    retry_after_s: int


class Store(Protocol):
    """Where the buckets live. `capacity` and `per_s` come with every call, so a changed limit
    applies at once."""

    async def take(self, tenant: str, tokens: int, capacity: int, per_s: float) -> Reservation | int:
        """The tokens taken, or the whole seconds (at least 1) until they could be."""
        ...

    def give_now(self, tenant: str, tokens: int, capacity: int, per_s: float) -> None:
        """Add `tokens` to the bucket (negative: take them), at most up to capacity; without
        awaiting (a settlement is never on a request's path: a store that writes elsewhere
        queues it)."""
        ...


def _wait_s(tokens: int, level: float, capacity: int, per_s: float) -> int:
    # a full bucket lets any size through, so no more than `capacity` need refill
    return max(1, math.ceil((min(tokens, capacity) - level) / per_s))


class LocalStore:
    """The buckets of this process: tenant -> (level, clock time of that level)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.buckets: dict[str, tuple[float, float]] = {}

    def _refill(self, tenant: str, capacity: int, per_s: float) -> tuple[float, float]:
        now = self.clock()
        level, at = self.buckets.get(tenant, (capacity, now))
        return min(capacity, level + (now - at) * per_s), now

    def take_now(self, tenant: str, tokens: int, capacity: int, per_s: float) -> Reservation | int:
        """`take`, without awaiting anything (this process's buckets need no I/O)."""
        level, now = self._refill(tenant, capacity, per_s)
        if level >= tokens or level >= capacity:
            self.buckets[tenant] = (level - tokens, now)
            return Reservation(tenant, tokens)
        self.buckets[tenant] = (level, now)
        return _wait_s(tokens, level, capacity, per_s)

    def give_now(self, tenant: str, tokens: int, capacity: int, per_s: float) -> None:
        """`give`, without awaiting anything."""
        level, now = self._refill(tenant, capacity, per_s)
        self.buckets[tenant] = (min(capacity, level + tokens), now)

    async def take(self, tenant: str, tokens: int, capacity: int, per_s: float) -> Reservation | int:
        return self.take_now(tenant, tokens, capacity, per_s)


# Both scripts: KEYS[1] the bucket; ARGV tokens, capacity, per second. Numbers are written with
# string.format: Redis would turn a bare Lua number into a string of 14 digits, too few for `at`.
_REFILL = """
local tokens, capacity, per_s = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local level = capacity
local held = redis.call('HMGET', KEYS[1], 'level', 'at')
if held[1] then
  level = math.min(capacity, tonumber(held[1]) + math.max(0, now - tonumber(held[2])) * per_s)
end
"""
_KEEP = """
redis.call('HSET', KEYS[1], 'level', string.format('%.6f', level), 'at', string.format('%.6f', now))
redis.call('EXPIRE', KEYS[1], string.format('%d', math.ceil((capacity - level) / per_s) + tonumber(ARGV[4])))
"""
# 0 when taken, else the whole seconds until they could be (a Lua number returns as an integer)
RESERVE_LUA = (
    _REFILL
    + """
local wait = 0
if level >= tokens or level >= capacity then
  level = level - tokens
else
  wait = math.max(1, math.ceil((math.min(tokens, capacity) - level) / per_s))
end
"""
    + _KEEP
    + "return wait\n"
)
SETTLE_LUA = _REFILL + "level = math.min(capacity, level + tokens)\n" + _KEEP + "return 0\n"


class RedisStore:
    """Buckets in Redis, shared by every router pod on it; fails open when Redis does.

    A reservation is one script on the request's path. Settlements are off it, and summed: every
    SETTLE_EVERY_S each tenant's go to Redis as one script (a tenant's refund arrives that much
    later), so a request costs Redis one script and a fraction, not two.
    """

    def __init__(self, redis: aioredis.Redis, prefix: str = "") -> None:
        self.redis = redis
        self.prefix = prefix
        self.errors = 0  # reservations let through, and settlements dropped, while Redis failed
        self.answered = 0  # scripts Redis ran and answered: reservations, and tenants' summed settlements
        self._reserve = redis.register_script(RESERVE_LUA)
        self._settle = redis.register_script(SETTLE_LUA)
        self._warned_at = -math.inf
        self._owed: dict[str, list[Any]] = {}  # tenant -> [tokens, capacity, per_s, settlements summed]
        self._settling: asyncio.Task[None] | None = None

    @classmethod
    def connect(cls, url: str, prefix: str) -> RedisStore:
        """A store on its own pool of at most 32 connections. A request waits for Redis' answer
        0.5 s at most, and for a free connection POOL_WAIT_S: all 32 busy that long means Redis
        has stalled (healthy, each holds a connection for a fraction of a millisecond), and then
        the requests behind them pass uncharged at once instead of each waiting out the stall."""
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=32, timeout=POOL_WAIT_S, socket_timeout=0.5, socket_connect_timeout=0.5
        )
        return cls(aioredis.Redis(connection_pool=pool), prefix)

    def key(self, tenant: str) -> str:
        return f"{self.prefix}budget:{tenant}"

    async def take(self, tenant: str, tokens: int, capacity: int, per_s: float) -> Reservation | int:
        try:
            wait = await self._reserve(keys=[self.key(tenant)], args=[tokens, capacity, per_s, IDLE_TTL_S])
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return Reservation(tenant, tokens, charged=False)
        self.answered += 1
        return Reservation(tenant, tokens) if wait == 0 else int(wait)

    def give_now(self, tenant: str, tokens: int, capacity: int, per_s: float) -> None:
        """Owed to the tenant's bucket, sent with its other settlements within SETTLE_EVERY_S."""
        owed = self._owed.get(tenant)
        if owed is None:
            self._owed[tenant] = [tokens, capacity, per_s, 1]
        else:  # summed; the latest limits apply
            owed[0] += tokens
            owed[1], owed[2] = capacity, per_s
            owed[3] += 1
        if self._settling is None:
            self._settling = asyncio.ensure_future(self._settle_soon())

    async def _settle_soon(self) -> None:
        await asyncio.sleep(SETTLE_EVERY_S)
        self._settling = None  # what is owed from here on waits for the next round
        await self.flush()

    async def flush(self) -> None:
        """Send every tenant's summed settlements now, one script each (dropped, and counted in
        `errors` one a settlement, where Redis fails)."""
        if self._settling is not None:  # the round waiting is sent now
            self._settling.cancel()
            self._settling = None
        owed, self._owed = self._owed, {}
        await asyncio.gather(*(self._send(tenant, *entry) for tenant, entry in owed.items()))

    async def _send(self, tenant: str, tokens: int, capacity: int, per_s: float, settlements: int) -> None:
        if tokens == 0:
            return
        try:
            await self._settle(keys=[self.key(tenant)], args=[tokens, capacity, per_s, IDLE_TTL_S])
        except (RedisError, OSError) as exc:
            self._failed(exc, settlements)
            return
        self.answered += 1

    async def close(self) -> None:
        """Send what is owed (if Redis answers in time), then close the client."""
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self.flush(), CLOSE_TIMEOUT_S)
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self.redis.aclose(), CLOSE_TIMEOUT_S)

    def _failed(self, exc: Exception, count: int = 1) -> None:
        self.errors += count
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("token budgets: Redis failed (%s); requests pass uncharged (%d so far)", exc, self.errors)


class Budgets:
    """Tenants' token budgets, in tokens a minute, kept in `store` (this process's, by default)."""

    def __init__(self, limits: Mapping[str, int], store: Store | None = None, *, reserve_tokens: int) -> None:
        """`reserve_tokens`: what a request naming no max_tokens reserves for its answer."""
        self.store: Store = store if store is not None else LocalStore()
        self.reserve_tokens = reserve_tokens
        self.limits: dict[str, int] = {}
        self.update(limits)

    def update(self, limits: Mapping[str, int]) -> None:
        """Take new limits (the keys file changed); the buckets of tenants that remain keep their level."""
        for tenant, per_minute in limits.items():
            if type(per_minute) is not int or per_minute <= 0:
                raise ValueError(f"tenant {tenant!r}: tokens a minute must be a positive integer, not {per_minute!r}")
        self.limits = dict(limits)

    def limited(self, tenant: str) -> bool:
        return tenant in self.limits

    def exceeds(self, tenant: str, completion: int | None) -> bool:
        """Whether a request's own completion cap (`completion_cap`; None: it names none) is more
        than the tenant's whole budget: it could never fit, whatever its prompt (a prompt's
        estimate from its bytes is too rough to refuse on: an image, a tool schema)."""
        per_minute = self.limits.get(tenant)
        return per_minute is not None and completion is not None and completion > per_minute

    @property
    def local(self) -> LocalStore | None:
        """This process's store, from which the caller may reserve without awaiting
        (`reserve_now`: no coroutine or task per request); None where the buckets are in Redis."""
        store = self.store
        return store if isinstance(store, LocalStore) else None

    def reserve_now(self, tenant: str, tokens: int) -> Reservation | int:
        """`reserve` from this process's own buckets (`local`), without awaiting."""
        local = self.local
        assert local is not None
        per_minute = self.limits.get(tenant)
        if per_minute is None:
            return Reservation(tenant, tokens, charged=False)
        return local.take_now(tenant, tokens, per_minute, per_minute / 60)

    def settle_now(self, reservation: Reservation, used: int | None) -> None:
        """Correct a reservation by what the request used (None: unknown, it stays as charged),
        without awaiting: into this process's buckets, or queued for Redis' next round."""
        per_minute = self.limits.get(reservation.tenant)
        if not reservation.charged or used is None or per_minute is None or used == reservation.tokens:
            return
        self.store.give_now(reservation.tenant, reservation.tokens - used, per_minute, per_minute / 60)

    async def reserve(self, tenant: str, tokens: int) -> Reservation | int:
        """A reservation of `tokens`, or the whole seconds (at least 1) to wait before asking again."""
        per_minute = self.limits.get(tenant)
        if per_minute is None:
            return Reservation(tenant, tokens, charged=False)
        return await self.store.take(tenant, tokens, per_minute, per_minute / 60)

    def admit_now(self, tenant: str, body: Mapping[str, Any], raw_size: int) -> Reservation | Refusal:
        """`admit` from this process's own buckets (`local`), without awaiting."""
        refused = self._never_fits(tenant, body)
        if refused is not None:
            return refused
        return self._admitted(tenant, self.reserve_now(tenant, estimate(body, raw_size, self.reserve_tokens)), raw_size)

    async def admit(self, tenant: str, body: Mapping[str, Any], raw_size: int) -> Reservation | Refusal:
        """A request's admission by its tenant's budget: its tokens (`estimate`) reserved, or why
        not: its own completion cap is more than the whole budget (`exceeds_budget`: it could
        never fit), or the budget is spent for now (`budget`, with the seconds to wait)."""
        refused = self._never_fits(tenant, body)
        if refused is not None:
            return refused
        return self._admitted(
            tenant, await self.reserve(tenant, estimate(body, raw_size, self.reserve_tokens)), raw_size
        )

    def _never_fits(self, tenant: str, body: Mapping[str, Any]) -> Refusal | None:
        cap = completion_cap(body)
        if not self.exceeds(tenant, cap):
            return None
        message = (
            f"this request asks for up to {cap} completion tokens, more than tenant {tenant}'s "
            f"whole budget of {self.limits[tenant]} tokens a minute: it could never fit; lower its max_tokens"
        )
        return Refusal(message, "exceeds_budget", 0)

    def _admitted(self, tenant: str, reserved: Reservation | int, raw_size: int) -> Reservation | Refusal:
        if isinstance(reserved, int):
            limit = self.limits[tenant]
            return Refusal(
                f"tenant {tenant} has used its {limit} tokens a minute: retry in {reserved} s", "budget", reserved
            )
        return replace(reserved, prompt=prompt_estimate(raw_size))


COMPLETION_CAPS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def prompt_estimate(raw_size: int) -> int:
    """A request body's prompt tokens, guessed from its size: ~4 bytes of JSON per token of English
    text (settling with the engine's usage corrects it)."""
    return -(-raw_size // 4)


def completion_cap(body: Mapping[str, Any]) -> int | None:
    """The completion tokens a request asks for at most (times `n`), None where it names no cap."""
    for name in COMPLETION_CAPS:
        cap = body.get(name)
        if type(cap) is int and cap > 0:
            n = body.get("n")
            return cap * n if type(n) is int and n > 1 else cap
    return None


def estimate(body: Mapping[str, Any], raw_size: int, default_completion: int) -> int:
    """The tokens a request is reserved at admission: its prompt and its completion cap.

    Chat and legacy completions, Responses and Anthropic Messages name the cap differently; the
    first that holds a positive integer counts, else `default_completion`. `n` choices each
    complete, but the prompt is read once.
    """
    prompt = prompt_estimate(raw_size)
    completion = default_completion
    for name in COMPLETION_CAPS:
        cap = body.get(name)
        if type(cap) is int and cap > 0:
            completion = cap
            break
    n = body.get("n")
    if type(n) is int and n > 1:
        completion *= n
    return prompt + completion
