"""The fleet's event-fed index: for each replica that publishes KV-cache events, what its engine holds.

One `PrefixIndex` (router.prefix) for the whole fleet, with a holder per replica, data-parallel
rank and medium (router.kvevents.holdings). `held` answers the one question placement asks of
it: how many of this request's tokens does that replica hold, on its GPU and on a second tier —
or None while the replica publishes nothing, or is unsure (a gap replay could not fill, a health
outage not yet explained): placement then reads today's model for that replica alone.

Blocks on a second tier (vLLM's CPU offloading, SGLang's HiCache host memory) are neither hits nor
misses: the engine loads them back instead of computing them, at that tier's speed. `credit`
turns them into the hit they are worth for a replica computing at `seconds_per_token`:
tier tokens x max(0, 1 - tier seconds per token / seconds per token). The tier's speed starts at
`kv_tier_tokens_per_s` and is learnt from the answers that loaded blocks back (`learn_tier`).

What will be held when a request runs, not only what is held now: an engine runs what it was sent
in order, so the prompt blocks of the requests the router sent a replica and that have not ended
(`expect`, until `unexpect`) will be there before a request sent now is scheduled — held, or being
computed and pinned — though no event says so yet. A conversation's next turn sent while its last
turn is still prefilling finds that turn's blocks coming on its replica, and nowhere else: without
them the replica that will hold the whole history looked no better than an idle one.

What those requests will allocate first can evict what is held now. An engine allocates a
request's new blocks when it schedules it, from its free blocks: empty ones first, then cached
blocks no running request uses, the longest unused first (vLLM frees a request's blocks tail
first into that queue when it ends). So the index keeps each replica's blocks in that order: a
request sent there touches the blocks of its prompt held there (it will pin them), and touches
them again when it ends (they are freed then). A request priced now runs after those sent there
before it whose new blocks no event has shown yet: they allocate their prompts' blocks not held
when they were sent and their replies' first. An engine publishes what a request's allocation
evicted no later than the blocks it stores (vLLM 0.32's `allocate_slots` takes the blocks, then
caches them: one step's message; the emulator's come before), so once a request's blocks show,
what it evicted has shown too. If the replica is evicting (a GPU block removed within EVICTING_S:
it has no empty blocks) all of that evicts, otherwise what exceeds its empty blocks (its capacity
less what it holds), and the request is priced on what is left of its prefix
(`PrefixIndex.match_after`): the misses found on real vLLM were blocks evicted between the
decision and the scheduling. A running request's reply growing block by block is not counted,
nor are requests other routers sent.

What a request would push out, not only what it finds: where what it allocates exceeds the empty
blocks, it evicts the oldest free blocks, and some of them are conversations about to come back
(a coding agent's tool loop returns within seconds; a chat's next turn within a minute). The
conversations that ended a turn on a replica are kept (`ended`: the blocks of the prompt it sent,
at most RETURNING_MAX a replica, for RETURN_S), and `evicts` says how many of their blocks a
request sent now would evict there beyond what the requests ahead of it evict anyway: what the
conversations it pushes out will recompute when they come back. A block the request shares with
one of them (a system prompt, its own history) is not counted lost: it pins them. Each is weighed
by how likely its conversation is still alive, exp(-age / back), and by how likely it comes
back before the replica's other traffic would have evicted those blocks anyway: a request
allocating a blocks past the empty ones evicts what the next a blocks of others would, a / rate
seconds later (`Holdings.eviction_rate`), and a conversation returns within s seconds with
1 - exp(-s / back). `back` is how soon a conversation comes back: RETURN_S for one whose answer
ended (a person reads it and replies), TOOLS_BACK_S for one whose answer called tools (`tools`:
the client runs them and sends their results at once; an agent's tool loop). On a cache that
turns over in seconds the blocks at its tail are lost whatever is placed there; on one that
rarely evicts, every block pushed out is a loss. Placement charges that at the replica's prefill
speed.

A replica of several data-parallel ranks has one Holdings per rank (each rank publishes on its
own port and numbers its own messages); a request goes to whichever rank the engine picks, so the
replica holds what its best rank holds.

It is past 450 lines because it is one class, Truth, whose methods all read and keep the same
per-replica state (what is held, queued, coming, returning) by the model this docstring explains;
split, each part would reach into the others' dictionaries.
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router._compat import NO_EXTENSIONS
from router.kvevents.holdings import Holdings
from router.kvevents.mapped import SharedFileError
from router.kvevents.roster import Followed
from router.kvevents.shared import SharedIndex, SharedIndexReader
from router.kvevents.tokens import EngineTokens
from router.kvevents.wire import MEDIUM_GPU
from router.prefix import PrefixIndex

if TYPE_CHECKING or NO_EXTENSIONS:
    from router._held_py import lost
else:
    from _held import lost

log = logging.getLogger("router.kvevents.truth")

TIER_PRIOR = 4  # the configured tier speed counts as this many samples
TIER_ALPHA = 0.05  # ... and each new sample moves the learnt one this much, once many are in
EVICTING_S = 1.0  # a replica that evicted a GPU block this recently has no empty blocks left
RETURN_S = 30.0  # a conversation that ended a turn this long ago weighs exp(-1) of one that just did
TOOLS_BACK_S = 5.0  # ... and one whose answer called tools (the client runs them: seconds, mostly)
RETURNING_MAX = 16  # conversations that ended a turn kept per replica (the most recent)
ROOM_S = 0.05  # a replica found with room for a request is taken to have as much for this long


@dataclass(frozen=True, slots=True)
class Queued:
    """A request sent to a replica whose new blocks its events have not shown yet."""

    keys: array[int]  # its prompt's blocks
    allocates: int  # blocks it allocates when it runs: its prompt's not held, and its reply's
    held: int  # of `keys`, what the replica held when it was sent


@dataclass(frozen=True, slots=True)
class Ended:
    """A conversation that ended a turn on a replica: it may come back for what it left there."""

    keys: array[int]  # its prompt's blocks
    at: float  # when (monotonic seconds)
    back_s: float = RETURN_S  # how soon it comes back: its return's mean time (TOOLS_BACK_S: it called tools)


@dataclass(frozen=True, slots=True)
class Found:
    gpu_tokens: int  # tokens of the prompt its GPU holds
    tier_tokens: int  # ... a second tier holds beyond them
    block_size: int


class Truth:
    def __init__(
        self,
        tier_tokens_per_s: float = 0.0,
        index: PrefixIndex | SharedIndex | SharedIndexReader | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # the event-fed index: this process's own; or one in shared memory it writes for its host's
        # other processes (a SharedIndex); or, in one of those, the reader of it (router.kvevents.shared)
        self.index = PrefixIndex() if index is None else index
        self.clock = clock  # when its engines evicted (monotonic seconds; router-bench simulate's: virtual)
        self.reader = index if isinstance(index, SharedIndexReader) else None
        self._roster = -1  # a reader's: the roster's generation its replicas were last built from
        self.replicas: dict[str, dict[int, Holdings | Followed]] = {}
        self.members = 0  # bumped whenever a replica's ranks are added or dropped (a layout of them is stale)
        # replica -> the blocks of KV it would take: it publishes events, not followed (its feed's
        # kv_events_max_mib is spent; router.engines.kvfeed)
        self.unfollowed: dict[str, int] = {}
        # replica -> why its blocks found no room in shared memory (/dev/shm full): not followed for
        # a while, priced by the router's model (router.engines.kvfeed)
        self.no_room: dict[str, str] = {}
        # bumped whenever one of its ranks' believed, block size or tiers change, as this process
        # keeps them (Holdings, Followed: router.placement.events)
        self.changes = [0]
        self.tier_spt = 1.0 / tier_tokens_per_s if tier_tokens_per_s > 0 else 0.0
        self.tier_samples = 0  # answers that loaded blocks back from a second tier, timed
        # replica -> blocks of the requests in flight there (only replicas with some: a read visits each)
        self.coming: dict[str, Counter[int]] = {}
        # replica -> the requests in flight there whose new blocks no event has shown yet (keyed by
        # their chain's id: the chain is kept, and so alive, until `unexpect`; only replicas with some)
        self.queued: dict[str, dict[int, Queued]] = {}
        # replica -> (its blocks stored so far, `ahead` then): summed again only once events came
        self._ahead: dict[str, tuple[int, int]] = {}
        self.cut: Counter[str] = Counter()  # replica -> prices cut by blocks predicted evicted first
        # replica -> the conversations that ended a turn there lately, oldest first (`ended`; only
        # replicas with some)
        self.returning: dict[str, deque[Ended]] = {}
        self.pushed: Counter[str] = Counter()  # replica -> prices charged for what they evict of those
        # replica -> (until when, the blocks a request may allocate there without evicting): found
        # by `evicts`, kept ROOM_S or until a request comes or goes (most prices find room: a lookup)
        self._room: dict[str, tuple[float, int]] = {}
        # the writer of one shard of a shared index (kv_event_followers): the index whole, read, for
        # what the other shards' processes follow (`figures`: /admin/replicas)
        self.beside: SharedIndexReader | None = None
        self._beside_rows: tuple[int, dict[str, dict[int, int]]] = (-1, {})

    def __bool__(self) -> bool:
        return bool(self.replicas)

    def holdings(self, replica_id: str, rank: int, capacity_blocks: int) -> Holdings:
        """The Holdings of one replica's rank, made on first use (on a shared index, enlisted in
        its roster for the readers)."""
        if self.reader is not None:
            raise TypeError("a reader of a shared index follows the engines' events through its writer")
        ranks = self.replicas.setdefault(replica_id, {})
        h = ranks.get(rank)
        if h is None:
            assert not isinstance(self.index, SharedIndexReader)
            try:
                h = ranks[rank] = Holdings(self.index, capacity_blocks, self.clock, self.changes)
            except SharedFileError:  # (no room for its region in shared memory: nothing of it is kept)
                if not ranks:
                    del self.replicas[replica_id]
                raise
            self.members += 1
            if isinstance(self.index, SharedIndex):
                try:
                    h.row = self.index.roster.enlist(replica_id, rank)
                except SharedFileError as exc:  # (its blocks are kept; the readers price it by their model)
                    log.warning("replica %s's KV events are not shared with the workers: %s", replica_id, exc)
                else:
                    self.index.roster.describe(h.row, h)
        assert isinstance(h, Holdings)
        return h

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Run on `clock` (monotonic seconds), the routing core's: a simulator's is virtual."""
        self.clock = clock
        for ranks in self.replicas.values():
            for h in ranks.values():
                if isinstance(h, Holdings):
                    h.clock = clock

    def share(self, index: SharedIndex | SharedIndexReader) -> None:
        """The event-fed index in shared memory from now on: written here for the host's other
        processes (a SharedIndex), or read here from the one that writes it (a SharedIndexReader).
        Before any replica is followed."""
        if self.replicas:
            raise RuntimeError("the event-fed index is shared before any replica is followed")
        self.index = index
        self.reader = index if isinstance(index, SharedIndexReader) else None

    def published(self, h: Holdings) -> None:
        """What `h` says changed (a message applied, a replay, its capacity): on a shared index,
        told to the readers."""
        if h.row is not None and isinstance(self.index, SharedIndex):
            self.index.roster.describe(h.row, h)

    def follow(self) -> None:
        """A reader's: the replicas' ranks its writer follows, as its roster says now (a no-op
        while the roster has not changed)."""
        reader = self.reader
        if reader is None or reader.roster.generation == self._roster:
            return
        self._roster = reader.roster.generation
        self.members += 1
        listed: dict[str, dict[int, Holdings | Followed]] = {}
        for row, rid, rank in reader.roster.listed():
            kept = self.replicas.get(rid, {}).get(rank)
            same = isinstance(kept, Followed) and kept.at == row * kept.words and kept.current
            listed.setdefault(rid, {})[rank] = (
                kept if same and kept is not None else Followed(reader.roster, reader, row, self.changes)
            )
        for rid in set(self.replicas) - set(listed):
            self.forget(rid)
        self.replicas.update(listed)

    def of(self, replica_id: str) -> list[Holdings | Followed]:
        return list(self.replicas.get(replica_id, {}).values())

    def forget(self, replica_id: str) -> None:
        self.members += 1
        for h in self.replicas.pop(replica_id, {}).values():
            if isinstance(h, Holdings):
                if h.row is not None and isinstance(self.index, SharedIndex):
                    self.index.roster.delist(h.row)
                h.close()
        self.cut.pop(replica_id, None)
        self.pushed.pop(replica_id, None)
        self.returning.pop(replica_id, None)
        self._room.pop(replica_id, None)
        self.coming.pop(replica_id, None)
        self.queued.pop(replica_id, None)
        self._ahead.pop(replica_id, None)

    def block_size(self, replica_id: str) -> int | None:
        """The block size its events say it keys blocks in (None: not said yet)."""
        return next((h.block_size for h in self.replicas.get(replica_id, {}).values() if h.block_size), None)

    def expect(self, replica_id: str, keys: array[int], allocates: int = 0) -> None:
        """A request was sent there: its prompt's blocks will be there when what is sent next runs,
        and it allocates `allocates` new blocks when it runs. The blocks of `keys` held there are
        touched (it will pin them)."""
        coming = self.coming.setdefault(replica_id, Counter())
        coming.update(keys)
        held = self._touch(replica_id, keys)
        self.queued.setdefault(replica_id, {})[id(keys)] = Queued(keys, max(0, allocates), held)
        self._ahead.pop(replica_id, None)
        self._room.pop(replica_id, None)

    def unexpect(self, replica_id: str, keys: array[int]) -> None:
        """... it ended (or failed): its blocks are what the events say from now on, the youngest of
        the engine's free blocks."""
        queued = self.queued.get(replica_id)
        if queued is not None and queued.pop(id(keys), None) is not None:
            self._ahead.pop(replica_id, None)
            self._room.pop(replica_id, None)
            if not queued:  # (only replicas with requests in flight are kept: a read visits each)
                del self.queued[replica_id]
        coming = self.coming.get(replica_id)
        if coming is None:
            return
        for key in keys:  # one pass (a 33k-token prompt has a thousand)
            left = coming.get(key, 0) - 1
            if left > 0:
                coming[key] = left
            else:
                coming.pop(key, None)
        if not coming:
            del self.coming[replica_id]
        self._touch(replica_id, keys)

    def ended(self, replica_id: str, keys: array[int], now: float) -> None:
        """A request sent there was answered: its conversation may come back for `keys`. An earlier
        turn of it (a prefix of `keys`) is replaced; a later one already kept keeps it."""
        if not keys:
            return
        kept = self.returning.setdefault(replica_id, deque())
        n = len(keys)
        for rec in list(kept):
            m = len(rec.keys)
            if m <= n and rec.keys[m - 1] == keys[m - 1]:  # chained keys: equal at m - 1, equal before
                kept.remove(rec)
            elif m > n and rec.keys[n - 1] == keys[n - 1]:
                return
        kept.append(Ended(keys, now))
        while len(kept) > RETURNING_MAX:
            kept.popleft()

    def tools(self, replica_id: str, keys: array[int]) -> None:
        """The answer that ended the turn of `keys` there called tools: its conversation comes back
        within seconds (TOOLS_BACK_S), with their results."""
        kept = self.returning.get(replica_id)
        if not kept or not keys:
            return
        for i in range(len(kept) - 1, -1, -1):
            rec = kept[i]
            if len(rec.keys) == len(keys) and rec.keys[-1] == keys[-1]:
                kept[i] = Ended(rec.keys, rec.at, TOOLS_BACK_S)
                return

    def evicts(self, replica_id: str, chain: array[int], allocates: int, now: float) -> float:
        """Blocks of the conversations that ended a turn there lately (`ended`) that a request of
        prompt `chain` allocating `allocates` blocks there would evict beyond what the requests
        ahead of it evict anyway, weighed by how likely each comes back for them in time (the
        module's docstring); its best rank's."""
        kept = self.returning.get(replica_id)
        if not kept or allocates <= 0:
            return 0.0
        room = self._room.get(replica_id)
        if room is not None and now < room[0] and allocates <= room[1]:
            return 0.0
        ranks = self.replicas.get(replica_id)
        if not ranks:
            return 0.0
        while kept and now - kept[0].at > RETURN_S:
            kept.popleft()
        if not kept:
            del self.returning[replica_id]  # (only replicas with some are kept)
            return 0.0
        ahead = self.ahead(replica_id)
        index = self.index
        least = math.inf
        for h in ranks.values():
            empty = self._empty(h)
            before, after = max(0, ahead - empty), ahead + allocates - empty
            if after <= before:
                self._room[replica_id] = (now + ROOM_S, empty - ahead)
                return 0.0  # it fits in what is empty there
            holder = h.tiers[MEDIUM_GPU].holder
            rate = h.eviction_rate(now)
            # seconds until the others' next (after - before) blocks would evict them anyway
            spare_s = (after - before) / rate if rate > 0 else math.inf
            # what each would keep past the others' `before` blocks and past `after`: one walk of the LRU tail
            counts = index.match_after_many(holder, [rec.keys for rec in kept], (before, after))
            # each one's blocks lost (those it shares with the request are pinned by it), weighed by
            # how likely it comes back for them within spare_s (compiled: `_held.lost`)
            least = min(least, lost(kept, counts, chain, now, spare_s))
        if least > 0:
            self.pushed[replica_id] += 1
        return least

    def _empty(self, h: Holdings | Followed) -> int:
        """Its GPU's empty blocks: none while it is evicting (a block removed within EVICTING_S)."""
        if self.clock() - h.evicted_at < EVICTING_S:
            return 0
        return max(0, h.capacity - h.blocks(MEDIUM_GPU))

    def _touch(self, replica_id: str, keys: array[int]) -> int:
        """Makes the blocks of `keys` held there the youngest (its best rank's); how many it holds."""
        most = 0
        for h in self.replicas.get(replica_id, {}).values():
            t = h.tiers.get(MEDIUM_GPU)
            if t is None:
                continue
            held = self.index.match(t.holder, keys)
            if held and not isinstance(self.index, SharedIndexReader):  # (a reader cannot reorder them)
                self.index.insert(t.holder, keys, held)
            most = max(most, held)
        return most

    def ahead(self, replica_id: str) -> int:
        """Blocks the requests sent to the replica allocate before one sent now runs: those of the
        requests in flight there none of whose new blocks the events have shown (once a request's
        blocks show, what its allocation evicted has shown too). A request that shows them leaves
        the count for good. Summed again only once a block was stored there since, or a request
        came or went (prices come far more often than an engine's steps)."""
        queued = self.queued.get(replica_id)
        if not queued:
            return 0
        ranks = self.replicas.get(replica_id, {}).values()
        stored = sum(h.figures.stored for h in ranks)
        known = self._ahead.get(replica_id)
        if known is not None and known[0] == stored:  # no block stored since: none shown since
            return known[1]
        blocks = 0
        shown = []
        for key, q in queued.items():
            if q.keys and any(self.index.match(h.tiers[MEDIUM_GPU].holder, q.keys) > q.held for h in ranks):
                shown.append(key)
            else:
                blocks += q.allocates
        for key in shown:
            del queued[key]
        if not queued:
            del self.queued[replica_id]
        self._ahead[replica_id] = (stored, blocks)
        return blocks

    def sure(self, replica_id: str) -> bool:
        ranks = self.replicas.get(replica_id)
        return ranks is not None and bool(ranks) and all(h.sure for h in ranks.values())

    def suspect(self, replica_id: str) -> None:
        for h in self.replicas.get(replica_id, {}).values():
            h.suspect()
            if isinstance(h, Holdings):
                self.published(h)

    def held(
        self,
        replica_id: str,
        tokens: EngineTokens,
        matches: dict[int, array[int]],
        block_size: int | None = None,
    ) -> Found | None:
        """What of `tokens` the replica will hold when a request sent now runs, if its events say so
        (None: they do not, or are not believed): what it holds, less what the requests sent ahead of
        it evict first (`ahead`), plus what the requests in flight there compute first.
        `matches`: by block size, how many leading blocks of the request's chain each holder of the
        index keeps, matched for every holder at once on first use (one call into the index for the
        whole fleet, not one per replica)."""
        ranks = self.replicas.get(replica_id)
        if not ranks:
            return None
        found = self.row(ranks, replica_id, tokens, matches, block_size)
        return None if found is None else Found(*found)

    def row(
        self,
        ranks: dict[int, Holdings | Followed],
        replica_id: str,
        tokens: EngineTokens,
        matches: dict[int, array[int]],
        block_size: int | None,
    ) -> tuple[int, int, int] | None:
        """`held` as (GPU tokens, second-tier tokens, block size), for the replica's `ranks` (not
        empty): placement asks it of every replica on every request, so it builds no object."""
        best: tuple[int, int, int] | None = None
        coming = self.coming.get(replica_id)
        allocated = -1  # (what is queued there is summed once, for the first rank that holds some)
        for h in ranks.values():
            if not h.sure:
                return None
            size = h.block_size or block_size
            if not size:
                if any(h.blocks(medium) for medium in h.tiers):
                    return None  # neither its events nor its metrics said its block size yet
                if best is None:
                    best = (0, 0, 0)  # it holds nothing at all (whatever its blocks' size)
                continue
            matched = self.matched(tokens, size, matches)
            gpu = tier = 0
            for medium, t in h.tiers.items():
                if medium == MEDIUM_GPU:
                    gpu = matched[t.holder]
                    if gpu:
                        if allocated < 0:
                            allocated = self.ahead(replica_id)
                        if allocated > 0:
                            empty = self._empty(h)
                            if allocated > empty:
                                kept = self.index.match_after(t.holder, tokens.chain(size), allocated - empty)
                                if kept < gpu:
                                    gpu = kept
                                    self.cut[replica_id] += 1
                else:
                    tier = max(tier, matched[t.holder])
            if coming:  # what the requests in flight there compute before this one runs
                chain = tokens.chain(size)
                while gpu < len(chain) and chain[gpu] in coming:
                    gpu += 1
            found = (gpu * size, max(0, tier - gpu) * size, size)
            if best is None or (found[0], found[1]) > (best[0], best[1]):
                best = found
        return best

    def matched(self, tokens: EngineTokens, size: int, matches: dict[int, array[int]]) -> array[int]:
        """How many leading blocks of `tokens`' chain at block size `size` each holder of the index
        keeps (one call into the index for every holder), kept in `matches` by size: made once a
        request and size."""
        found = matches.get(size)
        if found is not None:
            return found
        chain = tokens.chain(size)
        matched = matches[size] = array("i", bytes(4 * self.index.n_holders))
        if len(chain):
            self.index.match_all(chain, matched)
        return matched

    def credit(self, held: Found, seconds_per_token: float) -> float:
        """The cached tokens `held` is worth at a replica computing a token in `seconds_per_token`."""
        return self.credit_tokens(held.gpu_tokens, held.tier_tokens, seconds_per_token)

    def credit_tokens(self, gpu_tokens: int, tier_tokens: int, seconds_per_token: float) -> float:
        """`credit` of a `row`'s figures."""
        if not tier_tokens or seconds_per_token <= 0:
            return float(gpu_tokens)
        saved = 1.0 - self.tier_spt / seconds_per_token
        return gpu_tokens + tier_tokens * max(0.0, saved)

    def learn_tier(self, seconds_per_token: float) -> None:
        """One answer's time per token loaded back from a second tier (its first token's time, less
        its wait and its prefill of what it computed): the tier's speed is their running mean,
        TIER_ALPHA for each new one once TIER_PRIOR have been seen (the configured speed until then
        counts as that many)."""
        if not (seconds_per_token > 0 and seconds_per_token < 1.0):  # NaN, negative, absurd: noise
            return
        self.tier_samples += 1
        weight = max(TIER_ALPHA, 1.0 / (TIER_PRIOR + self.tier_samples))
        self.tier_spt += weight * (seconds_per_token - self.tier_spt)

    def _followed_beside(self, replica_id: str) -> dict[int, Holdings | Followed]:
        """A replica's ranks as the roster says where another shard's process follows it."""
        reader = self.beside
        if reader is None:
            return {}
        gen, rows = self._beside_rows
        if gen != reader.roster.generation:
            gen, rows = reader.roster.generation, {}
            for row, rid, rank in reader.roster.listed():
                rows.setdefault(rid, {})[rank] = row
            self._beside_rows = (gen, rows)
        return {rank: Followed(reader.roster, reader, row) for rank, row in rows.get(replica_id, {}).items()}

    def follow_beside(self) -> None:
        """Maps the regions the other shards' processes laid out since, letting go of those they
        moved away from (their pages are freed once no process maps them)."""
        if self.beside is not None:
            self.beside.follow()

    def figures(self, replica_id: str) -> dict[str, object] | None:
        ranks = self.replicas.get(replica_id) or self._followed_beside(replica_id)
        if not ranks:
            if replica_id in self.unfollowed:
                return {"followed": False, "why": "kv_events_max_mib", "capacity_blocks": self.unfollowed[replica_id]}
            if replica_id in self.no_room:
                return {"followed": False, "why": "shared memory full", "error": self.no_room[replica_id]}
            return None
        out: dict[str, object] = {
            "followed": True,
            "sure": all(h.sure for h in ranks.values()),
            "evictions_predicted": self.cut[replica_id],
            "returning": len(self.returning.get(replica_id, ())),
            "returning_from_tools": sum(rec.back_s == TOOLS_BACK_S for rec in self.returning.get(replica_id, ())),
            "evictions_priced": self.pushed[replica_id],
        }
        for rank, h in sorted(ranks.items()):
            f = h.figures
            out[f"rank_{rank}" if len(ranks) > 1 else "events"] = {
                "sure": h.sure,
                "seq": h.seq,
                "block_size": h.block_size,
                "blocks": {medium: h.blocks(medium) for medium in h.tiers},
                "capacity_blocks": h.capacity,
                "batches": f.batches,
                "stored": f.stored,
                "removed": f.removed,
                "cleared": f.cleared,
                "orphans": f.orphans,
                "gaps": f.gaps,
                "replayed": f.replayed,
                "duplicates": f.duplicates,
                "restarts": f.restarts,
                "unsure_episodes": f.unsure_episodes,
                "long_way": f.long_way,
            }
        return out


__all__ = ["Ended", "Found", "Queued", "Truth"]
