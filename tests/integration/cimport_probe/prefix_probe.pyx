# cython: language_level=3
"""A tiny proxy core that predicts cache hits through the prefix index's C-level API (cimport)."""

from libc.stdint cimport int32_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc

from _prefix cimport PREFIX_NO_HOLDER, PrefixIndex, prefix_chain


def send_and_match(PrefixIndex index, bytes prompt, size_t block_len, uint64_t seed, int32_t holder):
    """Hashes `prompt`, records it as sent to `holder`, then matches it on every holder, all
    with the GIL released. Returns (blocks newly added, matched per holder)."""
    cdef Py_ssize_t n = len(prompt) // block_len, added
    cdef const uint8_t* p = <const uint8_t*><const char*>prompt
    cdef uint64_t* chain = <uint64_t*>malloc(sizeof(uint64_t) * (n if n else 1))
    cdef int32_t* out = <int32_t*>malloc(sizeof(int32_t) * (index._n_holders + 1))
    cdef int32_t h
    try:
        with nogil:
            prefix_chain(p, n, block_len, seed, chain)
            added = index.c_insert(holder, chain, n)
            index.c_match_all(chain, n, out)
        return added, [out[h] for h in range(index._n_holders)]
    finally:
        free(chain)
        free(out)


def match(PrefixIndex index, int32_t holder, const uint64_t[::1] chain):
    """c_match on a typed memoryview; PREFIX_NO_HOLDER (-1) for a holder not in use."""
    cdef int32_t matched
    with nogil:
        matched = index.c_match(holder, &chain[0] if chain.shape[0] else NULL, chain.shape[0])
    return matched


def no_holder():
    return PREFIX_NO_HOLDER


def truncate_and_evict(PrefixIndex index, int32_t holder, const uint64_t[::1] chain, Py_ssize_t keep,
                       Py_ssize_t count):
    cdef Py_ssize_t dropped, evicted
    with nogil:
        dropped = index.c_truncate(holder, &chain[0], chain.shape[0], keep)
        evicted = index.c_evict(holder, count)
    return dropped, evicted
