"""The paged prefix cache: hits on whole leading blocks, pinning, LRU eviction, accounting."""

from __future__ import annotations

import random

import pytest

from router.emulator.kvcache import PrefixCache


def chain(*ids: int) -> list[int]:
    # stand-ins for chained block hashes: unique per (position, content id)
    return [hash((i, x)) for i, x in enumerate(ids)]


def test_miss_then_hit_on_whole_leading_blocks() -> None:
    c = PrefixCache(num_blocks=100, block_size=4)
    a = c.allocate(chain(1, 2, 3), prompt_tokens=12 + 1, total_tokens=20)
    assert a is not None and a.hit_blocks == 0 and a.anonymous == 5
    c.commit(a, chain(1, 2, 3), 3)
    c.release(a)
    c.check()
    assert c.hit_blocks(chain(1, 2, 3, 4), 17) == 3
    assert c.hit_blocks(chain(1, 2, 9, 4), 17) == 2  # stops at the first block that differs
    assert c.hit_blocks(chain(9, 2, 3), 13) == 0  # chains: a later equal block does not count alone


def test_last_token_is_always_computed() -> None:
    c = PrefixCache(num_blocks=10, block_size=4)
    a = c.allocate(chain(1, 2), 8, 9)
    assert a is not None
    c.commit(a, chain(1, 2), 2)
    c.release(a)
    # the same 8-token prompt again: only the first block may hit, the last token is recomputed
    assert c.hit_blocks(chain(1, 2), 8) == 1
    assert c.hit_blocks(chain(1, 2), 9) == 2


def test_pinned_blocks_are_never_evicted_and_lru_goes_first() -> None:
    c = PrefixCache(num_blocks=6, block_size=1)
    x = c.allocate(chain(1, 2), 3, 3)  # pins nothing yet, holds 3 blocks
    assert x is not None
    c.commit(x, chain(1, 2), 2)  # blocks (1, 2) cached and pinned by x
    y = c.allocate(chain(7), 2, 2)
    assert y is not None
    c.commit(y, chain(7), 1)
    c.release(y)  # (7) cached, evictable
    z = c.allocate(chain(8), 2, 2)
    assert z is not None
    c.commit(z, chain(8), 1)
    c.release(z)  # (8) cached, evictable, more recent than (7)
    c.check()
    assert c.used_blocks == 3 and c.cached_blocks == 4
    # 3 blocks needed, 1 free: evicts the least recently used (7) then (8); never x's pinned ones
    w = c.allocate(chain(5, 6, 7), 4, 3)
    assert w is not None and c.evictions == 2
    assert not c.is_cached(chain(7)[0]) and not c.is_cached(chain(8)[0])
    assert c.is_cached(chain(1, 2)[0]) and c.is_cached(chain(1, 2)[1])
    c.check()
    # nothing left to evict: a request that needs a block must wait
    assert c.allocate(chain(9), 2, 1) is None
    c.release(x)
    assert c.allocate(chain(9), 2, 1) is not None
    c.check()


def test_a_hit_touches_the_block_so_it_survives_eviction() -> None:
    c = PrefixCache(num_blocks=3, block_size=1)
    for ids in ((1,), (2,)):
        a = c.allocate(chain(*ids), 2, 1)
        assert a is not None
        c.commit(a, chain(*ids), 1)
        c.release(a)
    hit = c.allocate(chain(1), 2, 2)  # (1) is hit and becomes most recently used
    assert hit is not None and hit.hit_blocks == 1
    c.release(hit)
    fresh = c.allocate(chain(3, 4), 3, 2)  # needs 2: one free, one evicted: (2), the older
    assert fresh is not None
    assert c.is_cached(chain(1)[0]) and not c.is_cached(chain(2)[0])


def test_duplicate_blocks_computed_concurrently_are_shared() -> None:
    c = PrefixCache(num_blocks=10, block_size=2)
    a = c.allocate(chain(1, 2), 5, 6)
    b = c.allocate(chain(1, 2), 5, 6)  # arrives before a finished prefill: no hits yet
    assert a is not None and b is not None and b.hit_blocks == 0
    c.commit(a, chain(1, 2), 2)
    c.commit(b, chain(1, 2), 2)  # b's copies go back to the pool, b pins a's blocks
    c.check()
    assert c.cached_blocks == 2 and c.used_blocks == 2 + 1 + 1  # shared pair + one reply block each
    c.release(a)
    c.release(b)
    c.check()
    assert c.used_blocks == 0 and c.cached_blocks == 2


def test_random_operations_keep_the_books_balanced() -> None:
    rng = random.Random(3)
    c = PrefixCache(num_blocks=40, block_size=2)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            alloc, hashes, n = live.pop(rng.randrange(len(live)))
            c.commit(alloc, hashes, n)
            c.release(alloc)
        else:
            ids = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
            hashes = chain(*ids)
            tokens = len(ids) * 2 + rng.randrange(2)
            alloc = c.allocate(hashes, tokens, tokens + rng.randrange(1, 5))
            if alloc is not None:
                live.append((alloc, hashes, len(ids)))
        c.check()
        assert 0 <= c.used_blocks <= c.num_blocks


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError):
        PrefixCache(0, 16)


def test_eviction_takes_the_end_of_a_chain_first() -> None:
    # vLLM frees a request's blocks last-first, so under pressure a conversation loses its tail and
    # keeps a prefix that still hits; evicting its head would strand every block after it.
    c = PrefixCache(num_blocks=8, block_size=1)
    chain6 = chain(1, 2, 3, 4, 5, 6)
    a = c.allocate(chain6, 7, 6)
    assert a is not None
    c.commit(a, chain6, 6)
    c.release(a)
    b = c.allocate(chain(9, 9, 9), 4, 3)  # needs 3: 2 free, 1 evicted
    assert b is not None and c.evictions == 1
    assert c.hit_blocks(chain6, 7) == 5
