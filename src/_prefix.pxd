# cython: language_level=3
# The C-level contract of the prefix index, for Cython code that embeds it:
#
#     from _prefix cimport PrefixIndex, prefix_chain, prefix_chain_spans
#
#     cdef PrefixIndex index = router_index       # a PrefixIndex built from Python
#     with nogil:
#         prefix_chain(prompt_ptr, n_blocks, block_len, model_seed, chain)
#         index.c_match_all(chain, n_blocks, matched)   # matched[h]: leading blocks holder h keeps
#         best = index.c_price(chain, n_blocks, &fleet, &request, &costs, &n_near)
#
# The structs c_price reads have no defaults: set every field, fleet.recent and costs.spread to
# NULL (and request.spread_tokens to 0) where the spread term is not wanted, request.interference
# to 0, history_from_all to 0 and home_share to -1 where those are not.
#
# `_prefix` cimports `_ring` (for XXH3), so both .pxd files must be on the include path; they
# ship side by side. Every function and method here is `noexcept nogil`, touches no Python
# object and returns a sentinel instead of raising: PREFIX_NO_HOLDER for a holder number not in
# use, PREFIX_NO_MEMORY when growing failed (the index is still consistent; the call did part
# of its work). The index is not thread-safe: the GIL serialises its `def` methods, and C
# callers that drop the GIL must serialise their own calls, mutations and lookups alike.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

cdef enum:
    PREFIX_NO_HOLDER = -1
    PREFIX_NO_MEMORY = -2
    PREFIX_NONE = -1             # empty table slot; end of an LRU list or of the free list
    PREFIX_SHORT_BLOCK = 240     # longest block XXH3 keys from the seed alone; prefix_chain_spans
                                 # carries a partial block this long on the stack
    # prefix_costs_t.flags bits
    PREFIX_CANDIDATE = 1         # a candidate: its row of the costs was written
    PREFIX_GATED = 2             # at or over its load cap: never the best, never near
    PREFIX_NEAR = 4              # within the tie margin of the best (the best included)
    # price's spread: requests added to the mean: a handful of requests is no imbalance yet
    PREFIX_SPREAD_SMOOTH = 4


ctypedef struct prefix_entry_t:
    uint64_t key                 # block key: XXH3-64 of the block, seeded with its parent's key
    int32_t holder               # holder that keeps it; -1 while the entry is on the free list
    int32_t prev                 # neighbour toward the holder's most recent block
    int32_t next                 # neighbour toward the least recent block; the free list's link
    int32_t aliased              # 1: _aliases[entry] is its engine's name for it (in the alias table)


ctypedef struct prefix_holder_t:
    int64_t capacity             # blocks it may keep; 0 keeps nothing
    int32_t size                 # blocks it keeps now
    int32_t head                 # most recent entry (PREFIX_NONE when empty)
    int32_t tail                 # least recent entry: always a leaf of what it keeps
    int32_t in_use               # 0: the number is free for add_holder to reuse


ctypedef struct prefix_span_t:   # one piece of a prompt, in the prompt's order
    const uint8_t* data
    Py_ssize_t len


ctypedef struct prefix_fleet_t:  # one decision's view of the fleet: n positions, each array n long
    Py_ssize_t n
    const int32_t* holders       # holder number of position i, or -1: it holds nothing yet
    const double* busy_until     # when what was sent there is prefilled (the clock of `now`)
    const double* seconds_per_token
    const int64_t* loads         # requests in flight there
    const double* waiting        # requests its engine says are waiting; < 0: unknown
    const int64_t* caps          # load cap: at or over it a position is gated
    const uint8_t* excluded      # nonzero: not a candidate
    const double* recent         # requests recently sent there, in a shared decay frame (times
                                 # recent_scale: the value now); NULL: no spread term
    const double* known          # tokens of the prompt position i is known to hold (its engine's
                                 # KV events), < 0: ask the index; NULL: ask it everywhere
    const double* evicts         # seconds of prefill its allocation there costs the conversations
                                 # likely to come back (what it evicts of theirs); NULL: none


ctypedef struct prefix_request_t:  # the prompt's side of the decision
    double now
    double decode_s              # wait a request in flight there adds (its decode steps)
    double mean_uncached         # tokens a request queued by someone else computes, on average
    double block_tokens          # tokens per block
    double total_tokens          # the prompt's tokens
    double tie_s                 # near: cost <= best + max(tie_s, best * tie_share)
    double tie_share
    int64_t history_blocks       # blocks position `last` holds for sure (the session's history)
    Py_ssize_t last              # the position that served the session last, or -1
    double recent_scale          # fleet.recent[i] * recent_scale: requests recently sent to i now
    double spread_tokens         # tokens of extra prefill charged per unit of excess; <= 0: no spread
    bint spread_whole            # the spread charged whole (a new conversation), not by the share computed
    double interference          # seconds_per_token x (1 + interference x loads): 0 leaves it as it is
    bint history_from_all        # with last >= 0: history_blocks raised to the most any holder keeps
    double home_share            # < 0: no home; else costs.home is found (see PrefixIndex.price)


ctypedef struct prefix_costs_t:  # written at candidate positions only
    double* cached               # tokens predicted cached there
    double* wait                 # seconds before its prefill of this prompt starts
    double* cost                 # wait + uncached tokens x seconds per token + spread + evicts
    uint8_t* flags               # PREFIX_CANDIDATE | PREFIX_GATED | PREFIX_NEAR
    double* spread               # the spread term of the cost; NULL: not wanted
    Py_ssize_t home              # out: the candidate holding the most of the prompt, or -1


# Hashes the `n_blocks` whole blocks of `data` (`block_len` bytes each) into `out`: out[0] is
# XXH3-64 of block 0 seeded with `seed`, out[i] that of block i seeded with out[i-1]: the keys
# of _prefix.block_chain, which wraps it.
cdef void prefix_chain(const uint8_t* data, Py_ssize_t n_blocks, size_t block_len, uint64_t seed,
                       uint64_t* out) noexcept nogil
# The same chain of the concatenation of `n_spans` spans, without joining them: blocks inside a
# span are hashed in place, a block across spans is assembled in a carry buffer (on the stack up
# to PREFIX_SHORT_BLOCK bytes, else on the heap). `out` must have room for sum(len) // block_len
# keys; returns how many it wrote, or PREFIX_NO_MEMORY. block_len must be positive.
cdef Py_ssize_t prefix_chain_spans(const prefix_span_t* spans, Py_ssize_t n_spans, size_t block_len,
                                   uint64_t seed, uint64_t* out) noexcept nogil


cdef class PrefixIndex:
    """Per-holder LRU sets of block keys in one open-addressing table."""
    cdef prefix_entry_t* _entries      # entry pool; free entries are chained through `next`
    cdef int32_t* _slots               # (holder, key) -> entry, linear probing, load <= 1/2
    cdef prefix_holder_t* _holders
    cdef uint64_t _mask                # number of slots - 1 (a power of two)
    cdef int64_t _n_entries            # entries allocated in the pool
    cdef int64_t _n_used               # entries that hold a block (== held blocks, all holders)
    cdef int32_t _free                 # first free entry
    cdef int32_t _n_holders            # 1 + highest holder number ever in use
    cdef int32_t _holders_cap
    # An event-fed holder's blocks also carry their engine's name (its block hash, 64 bits):
    # allocated at the first aliased insert, so an index that never sees one pays nothing.
    cdef uint64_t* _aliases            # per entry (as long as the pool), valid where entry.aliased
    cdef int32_t* _aslots              # (holder, alias) -> entry, linear probing, load <= 1/2; NULL: none yet
    cdef uint64_t _amask
    cdef int64_t _n_aliased

    # Leading blocks of chain[:n] that `holder` keeps, found by galloping (probing 1, 2, 4, ...
    # blocks) then bisection; PREFIX_NO_HOLDER for a holder not in use.
    cdef int32_t c_match(self, int32_t holder, const uint64_t* chain, Py_ssize_t n) noexcept nogil
    # c_match as it would be once the holder's `evicted` least-recent blocks were dropped (none is);
    # PREFIX_NO_MEMORY when its scratch could not be allocated.
    cdef int32_t c_match_after(self, int32_t holder, const uint64_t* chain, Py_ssize_t n,
                               Py_ssize_t evicted) noexcept nogil
    # out[i * n_evicted + j] = c_match_after(holder, chains[i], lengths[i], evicted[j]), in one
    # walk of the holder's LRU tail (max(evicted) entries): 0, or PREFIX_NO_MEMORY.
    cdef int c_match_after_many(self, int32_t holder, const uint64_t** chains, const Py_ssize_t* lengths,
                                Py_ssize_t n_chains, const Py_ssize_t* evicted, Py_ssize_t n_evicted,
                                int32_t* out) noexcept nogil
    # out[h] = c_match(h, chain, n) for every h < n_holders, 0 for free numbers.
    cdef void c_match_all(self, const uint64_t* chain, Py_ssize_t n, int32_t* out) noexcept nogil
    # One routing decision: per candidate position, the prompt's cached tokens, wait and cost
    # (and its spread term, where costs.spread is not NULL) into `costs`, then the near-tie
    # flags; fleet.recent NULL or request.spread_tokens <= 0 adds no spread. Returns the
    # non-gated candidate of lowest cost (the lowest position among equals), or -1 when there is
    # none; `n_near` gets the near count. A holder number not in use matches nothing. See
    # PrefixIndex.price for the arithmetic.
    cdef Py_ssize_t c_price(self, const uint64_t* chain, Py_ssize_t n_chain, const prefix_fleet_t* fleet,
                            const prefix_request_t* request, prefix_costs_t* costs,
                            Py_ssize_t* n_near) noexcept nogil
    # Touches chain[n-1] .. chain[0], then evicts least-recent blocks down to the capacity;
    # the number of blocks that were not held before, or a sentinel.
    cdef Py_ssize_t c_insert(self, int32_t holder, const uint64_t* chain, Py_ssize_t n) noexcept nogil
    # c_insert, and block chain[i] is named aliases[i] by its engine (a name another block of
    # the holder had moves to this one; the block's earlier name is forgotten).
    cdef Py_ssize_t c_insert_aliased(self, int32_t holder, const uint64_t* chain, const uint64_t* aliases,
                                     Py_ssize_t n) noexcept nogil
    # Drops the blocks of `holder` its engine names aliases[:n]; how many it held, or PREFIX_NO_HOLDER.
    cdef Py_ssize_t c_forget(self, int32_t holder, const uint64_t* aliases, Py_ssize_t n) noexcept nogil
    # The entry `holder`'s engine names `alias`, or PREFIX_NONE (PREFIX_NO_HOLDER for a holder not in use).
    cdef int32_t c_named(self, int32_t holder, uint64_t alias) noexcept nogil
    # Drops chain[keep:n] from `holder`; how many it held, or PREFIX_NO_HOLDER.
    cdef Py_ssize_t c_truncate(self, int32_t holder, const uint64_t* chain, Py_ssize_t n,
                               Py_ssize_t keep) noexcept nogil
    # Drops the `count` least-recent blocks of `holder`; how many it dropped, or PREFIX_NO_HOLDER.
    cdef Py_ssize_t c_evict(self, int32_t holder, Py_ssize_t count) noexcept nogil

    cdef bint _holds(self, int32_t holder, uint64_t key) noexcept nogil
    cdef int32_t _find(self, int32_t holder, uint64_t key, uint64_t* slot) noexcept nogil
    cdef int32_t _add(self, int32_t holder, uint64_t key, uint64_t slot) noexcept nogil
    cdef void _drop(self, int32_t e) noexcept nogil
    cdef bint _grow_table(self) noexcept nogil
    cdef bint _grow_pool(self) noexcept nogil
    cdef Py_ssize_t _insert(self, int32_t holder, const uint64_t* chain, const uint64_t* aliases,
                            Py_ssize_t n) noexcept nogil
    cdef int32_t _afind(self, int32_t holder, uint64_t alias, uint64_t* slot) noexcept nogil
    cdef bint _alias(self, int32_t e, uint64_t alias) noexcept nogil
    cdef void _unalias(self, int32_t e) noexcept nogil
    cdef bint _grow_aliases(self) noexcept nogil
