"""Paged KV cache with prefix caching, modelled on vLLM's block manager.

GPU memory for KV is `num_blocks` blocks of `block_size` tokens. A full block that has been
computed is kept, keyed by its chained hash (see tokenizer.block_hashes), so a later request
whose prompt starts with the same blocks skips their prefill: its cached tokens are the longest
run of leading blocks still resident. Blocks that a running request references are pinned;
cached blocks that nobody references are evicted least recently used first when a request needs
room. Hits are whole blocks only, and, as in vLLM, at least the prompt's last token is always
computed, so a fully cached prompt reports at most `prompt_tokens - 1` rounded down to blocks.

Worked example (block_size 4): request A with a 10-token prompt allocates ceil((10 + 6) / 4) = 4
blocks for prompt and output, computes all 10 tokens, and caches its 2 full prompt blocks when
prefill ends. Request B shares A's first 9 tokens: its first 2 blocks (8 tokens) hit.

Admission reserves blocks for the prompt and the whole reply up front (vLLM allocates decode
blocks as it goes and preempts when out of room; reserving avoids modelling preemption, and
shows up as fragmentation: reserved but unwritten token slots).

Given a journal, the cache writes down what vLLM's block pool reports as KV-cache events: a
`BlockRemoved` per evicted block, `AllBlocksCleared` when `reset` empties it (the engine writes
the `BlockStored` events, which carry token ids the cache does not know).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TypeAlias


@dataclass
class Allocation:
    """The blocks one request holds: cached blocks it pins by hash, plus anonymous blocks."""

    pinned: list[int] = field(default_factory=list)
    anonymous: int = 0
    hit_blocks: int = 0


@dataclass(frozen=True)
class BlockStored:
    """Full blocks of one request that just got their cached identity, in chain order."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the block before the first (None: the first is the prompt's first)
    token_ids: list[int]  # block_size ids per block, concatenated
    lora_name: str | None
    extra_keys: list[list[str] | None]  # per block: the adapter's name, and the cache_salt on block 0


@dataclass(frozen=True)
class BlockRemoved:
    """One cached block evicted (vLLM sends one event per block)."""

    block_hash: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole cache emptied by a prefix-cache reset."""


CacheEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int, journal: list[CacheEvent] | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.journal = journal  # where evictions and resets are written down, if anywhere
        self._refs: dict[int, int] = {}  # cached block hash -> requests pinning it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refs == 0, oldest first
        self._free = num_blocks  # blocks holding nothing
        self._anonymous = 0  # blocks held by requests without a cached identity
        self.evictions = 0

    # -- accounting ----------------------------------------------------------------------------

    @property
    def cached_blocks(self) -> int:
        """Blocks with a cached identity (pinned or evictable)."""
        return len(self._refs)

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by running requests."""
        return self.num_blocks - self._free - len(self._evictable)

    @property
    def usage(self) -> float:
        """Share of blocks that running requests hold (vLLM's kv_cache_usage_perc, 0..1)."""
        return self.used_blocks / self.num_blocks

    def check(self) -> None:
        """Assert the bookkeeping invariants (tests call this after every operation)."""
        pinned = sum(1 for r in self._refs.values() if r > 0)
        assert all(r >= 0 for r in self._refs.values())
        assert set(self._evictable) == {h for h, r in self._refs.items() if r == 0}
        assert pinned + len(self._evictable) + self._anonymous + self._free == self.num_blocks

    def is_cached(self, h: int) -> bool:
        return h in self._refs

    # -- requests ------------------------------------------------------------------------------

    def hit_blocks(self, hashes: list[int], prompt_tokens: int) -> int:
        """Leading blocks of a prompt that are resident, capped so the last token is computed."""
        cap = (prompt_tokens - 1) // self.block_size if prompt_tokens > 0 else 0
        k = 0
        limit = min(cap, len(hashes))
        while k < limit and hashes[k] in self._refs:
            k += 1
        return k

    def allocate(self, hashes: list[int], prompt_tokens: int, total_tokens: int) -> Allocation | None:
        """Reserve blocks for a request of `total_tokens` (prompt + reply), pinning its cached
        prefix. None when the blocks are not free, even after evicting every unpinned block."""
        needed = -(-total_tokens // self.block_size)
        hits = self.hit_blocks(hashes, prompt_tokens)
        fresh = needed - hits
        hits_evictable = sum(1 for h in hashes[:hits] if self._refs[h] == 0)
        if fresh > self._free + len(self._evictable) - hits_evictable:
            return None
        for h in hashes[:hits]:
            self._pin(h)
        for _ in range(fresh - min(fresh, self._free)):
            self._evict_one()
        self._free -= fresh
        self._anonymous += fresh
        return Allocation(pinned=list(hashes[:hits]), anonymous=fresh, hit_blocks=hits)

    def commit(self, alloc: Allocation, hashes: list[int], upto_blocks: int) -> None:
        """The request has computed its first `upto_blocks` full blocks: give them their cached
        identity so other requests can hit them."""
        self.store(alloc, hashes[len(alloc.pinned) : upto_blocks])

    def store(self, alloc: Allocation, new_hashes: list[int]) -> None:
        """The request has computed its next full blocks, `new_hashes` in chain order: give them
        their cached identity. A block another request cached meanwhile is shared instead, and
        this request's duplicate goes back to the free pool."""
        for h in new_hashes:
            alloc.anonymous -= 1
            self._anonymous -= 1
            if h in self._refs:
                self._pin(h)
                self._free += 1
            else:
                self._refs[h] = 1
            alloc.pinned.append(h)

    def release(self, alloc: Allocation) -> None:
        """The request is done (or aborted): unpin its blocks, free its anonymous ones."""
        # Last block first, as vLLM frees them: the end of a chain becomes the oldest and is
        # evicted first, so an evicted conversation still leaves a usable prefix.
        for h in reversed(alloc.pinned):
            refs = self._refs[h] - 1
            self._refs[h] = refs
            if refs == 0:
                self._evictable[h] = None  # most recently used end
        alloc.pinned = []
        self._anonymous -= alloc.anonymous
        self._free += alloc.anonymous
        alloc.anonymous = 0

    def clear(self) -> None:
        """Drop every unpinned cached block (a cache reset), each an eviction."""
        while self._evictable:
            self._evict_one()

    def reset(self) -> bool:
        """Forget every cached block at once, as vLLM's `reset_prefix_cache`: refused (False) while
        a request holds blocks."""
        if self.used_blocks:
            return False
        self._free += len(self._evictable)
        self._evictable.clear()
        self._refs.clear()
        if self.journal is not None:
            self.journal.append(AllBlocksCleared())
        return True

    def _pin(self, h: int) -> None:
        refs = self._refs[h]
        if refs == 0:
            del self._evictable[h]
        self._refs[h] = refs + 1

    def _evict_one(self) -> None:
        h, _ = self._evictable.popitem(last=False)
        del self._refs[h]
        self._free += 1
        self.evictions += 1
        if self.journal is not None:
            self.journal.append(BlockRemoved(h))
