# cython: language_level=3
# What a holder's oldest blocks would take of chains: the part of `match_after_many` that does not
# depend on where the index keeps its entries, inlined into `_prefix` and `_kvshare` (each walks
# its own LRU list, with its own loads, and puts each block it walks here).
#
#     size = aged_size(most); keys, ranks = malloc(size * 8), malloc(size * 4)
#     aged_clear(ranks, size)
#     for each of the `most` oldest blocks, oldest first, rank 0, 1, ...:
#         aged_put(keys, ranks, size - 1, key, rank)
#     aged_cut(chains, n_chains, evicted, n_evicted, out, keys, ranks, size - 1)
#
# `out[i * n_evicted + j]` holds chain i's match before it (each count's the same) and its match
# once the evicted[j] oldest blocks were gone after. Every function is `noexcept nogil`.

from libc.stdint cimport int32_t, uint64_t
from libc.string cimport memset


cdef inline uint64_t aged_hash(uint64_t key) noexcept nogil:
    key ^= key >> 33
    key *= 0xFF51AFD7ED558CCDULL
    key ^= key >> 33
    key *= 0xC4CEB9FE1A85EC53ULL
    return key ^ (key >> 33)


cdef inline Py_ssize_t aged_size(Py_ssize_t most) noexcept nogil:
    # a power of two at least twice `most`: the table stays at most half full
    cdef Py_ssize_t size = 16
    while size < 2 * most:
        size *= 2
    return size


cdef inline void aged_clear(int32_t* ranks, Py_ssize_t size) noexcept nogil:
    memset(ranks, 0xFF, size * sizeof(int32_t))  # -1: a free slot


cdef inline void aged_put(uint64_t* keys, int32_t* ranks, uint64_t mask, uint64_t key, int32_t rank) noexcept nogil:
    cdef uint64_t slot = aged_hash(key) & mask
    while ranks[slot] >= 0:
        slot = (slot + 1) & mask
    keys[slot] = key
    ranks[slot] = rank


cdef inline void aged_cut(const uint64_t** chains, Py_ssize_t n_chains, const Py_ssize_t* evicted,
                          Py_ssize_t n_evicted, int32_t* out, const uint64_t* keys, const int32_t* ranks,
                          uint64_t mask) noexcept nogil:
    # each chain's matched blocks in order: the first one ranked below a count ends its match there
    cdef Py_ssize_t i, j, p, left
    cdef uint64_t key, slot
    cdef int32_t matched, rank
    for i in range(n_chains):
        left = n_evicted  # counts whose end this chain has not met yet
        matched = out[i * n_evicted]
        for p in range(matched):
            key = chains[i][p]
            slot = aged_hash(key) & mask
            rank = -1
            while ranks[slot] >= 0:
                if keys[slot] == key:
                    rank = ranks[slot]
                    break
                slot = (slot + 1) & mask
            if rank < 0:
                continue
            for j in range(n_evicted):
                if rank < evicted[j] and out[i * n_evicted + j] > p:
                    out[i * n_evicted + j] = <int32_t>p
                    left -= 1
            if left == 0:
                break
