"""What one replica's engine holds, as its KV-cache events say: the blocks, per tier, and whether to believe it.

A `Holdings` turns a replica's event batches into blocks of the router's own keys, kept in a
`PrefixIndex` (router.prefix) of their own, one holder per medium (GPU first; vLLM's CPU
offloading tier, SGLang's HiCache host tier are others). A stored block's key is the router's
chained hash of its token ids (router.kvevents.tokens: the parent's key seeds the child's, the
chain's first block is seeded by its LoRA adapter and cache_salt), so a request cut into the same
tokens finds exactly the blocks the engine computed. The engine's own hashes (as 64-bit names,
router.kvevents.wire.engine_name) are kept only to map its removals back to keys: each block of
the index carries its engine's name (`PrefixIndex.insert(..., aliases)`), so a removal is one
compiled call (`forget`) and a block and its name leave together.

Sequence numbers decide what is believed (`accept`):
- the next number: applied;
- a number already seen, or lower (a live publisher never goes back): the engine restarted, its
  cache empty: cleared, then applied if it is 0, else its first messages were lost: a gap from 0;
- a gap (or a first message that is not 0: the router joined late): `GAP`, and the caller asks
  the engine's replay socket for what is missing (`replayed`); what replay cannot cover leaves the
  replica `unsure`: its blocks are still kept and updated, but routing reads today's model for it
  until the cache has turned over once (as many blocks stored since as it holds) or the engine
  cleared it (AllBlocksCleared, a restart), whichever comes first.
- `suspect()` (its health went down): unsure until the next message says whether the engine
  restarted (sequence 0: it starts empty) or only paused (the next number: nothing was missed).

`match` gallops as the model's index does (router.prefix): it assumes what an engine keeps of a
chain is a prefix of it, which is how vLLM evicts (a request's blocks are freed tail first into
an LRU queue, and a block in use keeps its parents in use), so a removal leaves no hole a later
block could be reached across.

A stored block whose parent the router never saw (stored before the router joined, its removal
already applied) cannot be keyed: it is counted (`orphans`) and skipped; a prefix match could
never reach it anyway. Memory is bounded by the engine's KV capacity: each tier's holder keeps at
most as many blocks as the engine says it has (its LRU drops the oldest past that, which happens
only if removals were missed), and their names with them.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from router.kvevents.tokens import root_of, token_chain
from router.kvevents.wire import MEDIUM_GPU, Batch, Cleared, Removed, Stored

if TYPE_CHECKING:
    from typing_extensions import Buffer

OK, RESTART, GAP, DUPLICATE = "ok", "restart", "gap", "duplicate"
RATE_S = 5.0  # its GPU's eviction rate is measured over whole windows this long


class MatchIndex(Protocol):
    """What is asked of the index a replica's tiers are in, to answer for them."""

    def size(self, holder: int) -> int: ...
    def match(self, holder: int, chain: Buffer) -> int: ...


class BlockIndex(MatchIndex, Protocol):
    """What Holdings asks of the index its blocks are in: a PrefixIndex (router.prefix), or a
    SharedIndex that other processes read (router.kvevents.shared)."""

    def add_holder(self, capacity: int) -> int: ...
    def remove_holder(self, holder: int) -> None: ...
    def set_capacity(self, holder: int, capacity: int) -> int: ...
    def clear(self, holder: int) -> int: ...
    def key_of(self, holder: int, alias: int) -> int | None: ...
    def insert(self, holder: int, chain: Buffer, n: int = -1, aliases: Buffer | None = None) -> int: ...
    def forget(self, holder: int, aliases: Buffer) -> int: ...


@dataclass(slots=True)
class Tier:
    holder: int  # its number in the events index (its blocks named by the engine's hashes)


@dataclass(slots=True)
class Figures:
    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0  # stored blocks whose parent the router never saw
    gaps: int = 0
    replayed: int = 0  # batches that came from the replay socket and were applied
    restarts: int = 0
    duplicates: int = 0  # live messages the replay had applied already (they waited in the socket's queue)
    unsure_episodes: int = 0
    long_way: int = 0  # batches the compiled scanner left to the long decoder (router.kvevents.wire)


class Rate:
    """A count's rate a second over the latest whole window of RATE_S seconds of its clock, the
    windows fixed on the clock (multiples of RATE_S): what it says depends on when the count
    grew, never on who read it when. Written where the count grows (`add`); its state (`window`,
    `start`, `before`) is what a reader in another process needs to say the same (`of`)."""

    __slots__ = ("before", "count", "start", "window")

    def __init__(self) -> None:
        self.window = -1  # the window of the latest growth (-1: none yet)
        self.start = 0  # the count when that window began
        self.before = 0.0  # the rate over the window before it
        self.count = 0

    def add(self, now: float, n: int) -> None:
        """The count grew by `n` at `now`."""
        w = math.floor(now / RATE_S)
        if w != self.window:
            self.before = (self.count - self.start) / RATE_S if w == self.window + 1 else 0.0
            self.window, self.start = w, self.count
        self.count += n

    def at(self, now: float) -> float:
        """The rate over the last whole window before `now`'s (0 until a count grew)."""
        return Rate.of(now, self.window, self.start, self.before, self.count)

    @staticmethod
    def of(now: float, window: int, start: int, before: float, count: int) -> float:
        """`at` for a rate whose state is (`window`, `start`, `before`) and count `count`."""
        if window < 0:
            return 0.0
        w = math.floor(now / RATE_S)
        if w <= window:
            return before
        return (count - start) / RATE_S if w == window + 1 else 0.0


class Tiers:
    """What a replica's rank holds on each medium, asked of the index its tiers' holders are in
    (Holdings writes them; router.kvevents.roster.Followed reads them from another process)."""

    index: MatchIndex
    tiers: dict[str, Tier]

    def blocks(self, medium: str = MEDIUM_GPU) -> int:
        t = self.tiers.get(medium)
        return 0 if t is None else self.index.size(t.holder)

    def match(self, chain: array[int], medium: str = MEDIUM_GPU) -> int:
        """How many of `chain`'s leading blocks it holds on `medium`."""
        t = self.tiers.get(medium)
        return 0 if t is None or not chain else self.index.match(t.holder, chain)


class Holdings(Tiers):
    index: BlockIndex

    def __init__(
        self,
        index: BlockIndex,
        capacity_blocks: int,
        clock: Callable[[], float] = time.monotonic,
        changes: list[int] | None = None,
    ) -> None:
        self.index = index
        self.clock = clock  # when its engine evicts (`evicted_at`)
        # bumped whenever what a read of it depends on changes (believed, block size, tiers):
        # shared by a Truth's holdings, so a layout of their verdicts knows when it is stale
        self.changes = [0] if changes is None else changes
        self.capacity = max(1, capacity_blocks)
        self.tiers: dict[str, Tier] = {}
        self.seq: int | None = None  # the last sequence number applied (None: none since it joined)
        self._block_size: int | None = None  # tokens per block, as its events say
        self._unsure = True  # nothing is known until the first message (and replay) says so
        self._suspect_since_seq: int | None = None  # health went down: the next message decides
        self._turnover = 0  # blocks stored since it became unsure
        self.evicted_at = -math.inf  # when its engine last evicted a GPU block (monotonic seconds)
        self.rate = Rate()  # GPU blocks its engine removed (`evicted`), and a second (`eviction_rate`)
        self.figures = Figures()
        self.row: int | None = None  # its roster row, where the index is shared (router.kvevents.shared)
        # the latest replay's messages, sequence number -> timestamp: the same messages arriving live
        # after it (queued in the subscriber's socket while it ran) are copies, not a restart
        self._replayed: dict[int, float] = {}
        self.tier(MEDIUM_GPU)

    # -- what it holds -----------------------------------------------------------------------------

    def tier(self, medium: str) -> Tier:
        t = self.tiers.get(medium)
        if t is None:
            t = self.tiers[medium] = Tier(self.index.add_holder(self.capacity))
            self.changes[0] += 1
        return t

    @property
    def sure(self) -> bool:
        return not self._unsure and self._suspect_since_seq is None

    # (each write that changes one of these is counted in `changes`)
    @property
    def unsure(self) -> bool:
        return self._unsure

    @unsure.setter
    def unsure(self, value: bool) -> None:
        if value != self._unsure:
            self._unsure = value
            self.changes[0] += 1

    @property
    def suspect_since_seq(self) -> int | None:
        return self._suspect_since_seq

    @suspect_since_seq.setter
    def suspect_since_seq(self, value: int | None) -> None:
        if value != self._suspect_since_seq:
            self._suspect_since_seq = value
            self.changes[0] += 1

    @property
    def block_size(self) -> int | None:
        return self._block_size

    @block_size.setter
    def block_size(self, value: int | None) -> None:
        if value != self._block_size:
            self._block_size = value
            self.changes[0] += 1

    def set_capacity(self, blocks: int) -> None:
        self.capacity = max(1, blocks)
        for t in self.tiers.values():
            self.index.set_capacity(t.holder, self.capacity)

    def close(self) -> None:
        for t in self.tiers.values():
            self.index.remove_holder(t.holder)
        self.tiers.clear()
        self.changes[0] += 1

    # -- what its engine says ------------------------------------------------------------------------

    def accept(self, batch: Batch) -> str:
        """Applies `batch` if it is the next one (or a restarted engine's first); says what it was.
        A live publisher never sends a number twice nor goes back: one that does started again
        (its cache empty); if its first messages were lost on the way, that is a GAP from 0. A
        message the latest replay applied already (the same number and timestamp), queued in the
        socket while the replay ran, is a DUPLICATE: skipped."""
        seq = batch.seq
        last = self.seq
        if self._replayed:
            if last is not None and seq <= last and self._replayed.get(seq) == batch.ts:
                self.figures.duplicates += 1
                return DUPLICATE
            self._replayed = {}  # past the replay (or an engine that did restart): no copies to expect
        restarted = False
        if last is not None and seq <= last:
            self._restarted()
            restarted = True
            last = None
        if last is None and seq != 0:
            self.figures.gaps += 1
            return GAP
        if last is not None and seq != last + 1:
            self.figures.gaps += 1
            return GAP
        if last is None:  # message 0: the engine's first, it started empty (and so does this)
            self._clear()
            self._believe()
        self.suspect_since_seq = None  # the next message after a health outage: nothing was missed
        self.apply(batch)
        return RESTART if restarted else OK

    def replayed(self, batches: list[Batch], wanted: int) -> bool:
        """The replay socket's answer to a request from `wanted` on, applied in order. True when it
        covered the gap (its first batch is `wanted`); else the replica is unsure until rebuilt,
        and what replay had is applied from where it starts."""
        batches = sorted((b for b in batches if b.seq >= wanted), key=lambda b: b.seq)
        covered = bool(batches) and batches[0].seq == wanted
        if covered and wanted == 0:  # everything since the engine started
            self._clear()
            self.seq = -1
            self._believe()
        elif not covered:
            self.make_unsure()
            if batches and (self.seq is None or batches[0].seq > self.seq):
                self.seq = batches[0].seq - 1
        if covered:
            self.suspect_since_seq = None
        for b in batches:
            if self.seq is not None and b.seq <= self.seq:
                continue
            if self.seq is not None and b.seq != self.seq + 1:
                self.make_unsure()  # a hole inside the replay itself
            self.apply(b)
            self.figures.replayed += 1
            self._replayed[b.seq] = b.ts
        return covered

    def filled(self, batches: list[Batch] | None, wanted: int) -> bool:
        """The replay socket's whole answer to a request from `wanted` on: its batches ([]: it has
        none; None: it fell silent), applied (`replayed`). True when the gap is covered."""
        if batches is None:
            self.make_unsure()
            return False
        if not batches:
            if wanted == 0:  # nothing published since the engine started
                self.caught_up()
                return True
            self.make_unsure()
            return False
        return self.replayed(batches, wanted)

    def caught_up(self) -> None:
        """The replay socket has nothing at all: the engine has published nothing since it started,
        so its cache is empty and the next message is its first (sequence 0)."""
        if self.seq is None:
            self._clear()
            self._believe()

    def force(self, batch: Batch) -> None:
        """Applies `batch` after a gap nothing could fill (the replica is unsure already)."""
        self.make_unsure()
        self.seq = batch.seq - 1
        self.apply(batch)

    def apply(self, batch: Batch) -> None:
        self.seq = batch.seq
        f = self.figures
        f.batches += 1
        f.long_way += not batch.scanned
        # vLLM sends one BlockRemoved per evicted block: a run of them on one medium is applied at once
        gone: array[int] = array("Q")
        medium = MEDIUM_GPU
        for e in batch.events:
            if isinstance(e, Removed):
                if gone and e.medium != medium:
                    self._remove(gone, medium)
                    gone = array("Q")
                medium = e.medium
                gone.extend(e.hashes)
                continue
            if gone:
                self._remove(gone, medium)
                gone = array("Q")
            if isinstance(e, Stored):
                self._store(e)
            elif isinstance(e, Cleared):
                f.cleared += 1
                self._clear()
                if self.unsure:
                    self._believe()
        if gone:
            self._remove(gone, medium)

    def suspect(self) -> None:
        """Its health went down: believe nothing until the next message says what happened."""
        if self.suspect_since_seq is None:
            self.suspect_since_seq = -1 if self.seq is None else self.seq

    def make_unsure(self) -> None:
        if not self.unsure:
            self.figures.unsure_episodes += 1
            self._turnover = 0
        self.unsure = True

    # -- inside -------------------------------------------------------------------------------------

    def _believe(self) -> None:
        self.unsure = False
        self._turnover = 0

    def _restarted(self) -> None:
        self.figures.restarts += 1
        self._clear()
        self.seq = None
        self.suspect_since_seq = None

    def _clear(self) -> None:
        for t in self.tiers.values():
            self.index.clear(t.holder)

    def _store(self, e: Stored) -> None:
        t = self.tier(e.medium)
        if e.block_size != self._block_size:
            self.block_size = e.block_size
        if e.parent is None:
            seed = root_of(e.lora_name, e.salt)
        else:
            parent = self.index.key_of(t.holder, e.parent)
            if parent is None and e.medium != MEDIUM_GPU:  # offloaded children of a GPU-held parent
                parent = self.index.key_of(self.tiers[MEDIUM_GPU].holder, e.parent)
            if parent is None:
                self.figures.orphans += len(e.hashes)
                return
            seed = parent
        chain = token_chain(e.token_ids, e.block_size, seed)
        if len(chain) != len(e.hashes):
            return
        self.index.insert(t.holder, chain, -1, e.hashes)
        self.figures.stored += len(chain)
        if self.unsure:
            self._turnover += len(chain)
            if self._turnover >= self.capacity:  # the cache has turned over once since: rebuilt
                self._believe()

    def _remove(self, hashes: array[int], medium: str) -> None:
        t = self.tiers.get(medium)
        if t is None:
            return
        gone = self.index.forget(t.holder, hashes)
        if gone:
            self.figures.removed += gone
            if medium == MEDIUM_GPU:
                self.evicted_at = self.clock()
                self.rate.add(self.evicted_at, gone)

    @property
    def evicted(self) -> int:
        """GPU blocks its engine removed."""
        return self.rate.count

    def eviction_rate(self, now: float) -> float:
        """GPU blocks its engine removed a second, over the last whole window of RATE_S seconds
        of its clock before `now`'s (`Rate`: the same whoever asks, and however often)."""
        return self.rate.at(now)


async def take(holdings: Holdings, batch: Batch, fill: Callable[[int], Awaitable[object]] | None) -> bool:
    """One message as it arrives from its engine (router.engines.kvfeed, and router-bench
    simulate's modelled engines), applied in order. Past a gap, what the engine's replay socket
    holds from the first number missing is asked for (`fill(wanted)`; None: it has no replay
    socket), then the message is applied after it, or over the gap where nothing filled it (the
    replica is then unsure until its cache turns over). False: a copy of a message the latest
    replay applied already, skipped."""
    verdict = holdings.accept(batch)
    if verdict == DUPLICATE:
        return False
    if verdict == GAP:
        if fill is not None:
            await fill(0 if holdings.seq is None else holdings.seq + 1)
        missing = holdings.seq is None or batch.seq > holdings.seq  # else the replay had it
        if missing and holdings.accept(batch) == GAP:
            holdings.force(batch)
    return True


__all__ = ["DUPLICATE", "GAP", "OK", "RESTART", "Holdings", "take"]
