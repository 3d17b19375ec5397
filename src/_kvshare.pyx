# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""The event-fed index's holders in shared memory: one writer, any number of reader processes (compiled core).

A holder (one replica's medium) is one *region*: a buffer the writer lays out and fills, which
reader processes map read-only. It keeps what `_prefix.PrefixIndex` keeps for a holder, the block
keys in LRU order, each with its engine's name (alias), and answers the same questions in the same
probe order (`match` gallops then bisects, `match_after` walks the LRU tail), so an index made of
regions decides as a `PrefixIndex` does. `Regions` numbers the holders and answers `match_all`
for all of them in one compiled loop.

Layout of a region (little-endian, native alignment), sized for `pool` entries:

    header   128 bytes: magic, seq, capacity, pool, mask, size, n_aliased, head, tail, free,
             fresh, retired
    entries  32 bytes each: key, alias, prev, next, aliased, used
    kslots   int32 per slot, (mask + 1) of them: key -> entry + 1 (0: empty)
    aslots   the same for aliases

Both tables probe linearly from fmix64 of what is filed and delete by backward shift; slots hold
entry + 1 so a fresh (zero-filled) region is empty without being written: its pages are taken
only as blocks arrive. Entries come from a bump counter (`fresh`), then from the free list.

Readers never block the writer. The writer makes `seq` odd before it changes a region and even
after; a reader reads `seq`, answers, reads `seq` again, and answers again if it changed (at most
READ_TRIES times). One that finds `seq` odd waits a moment (SPINS looks) for the change to end;
past that, or past READ_TRIES, its last answer stands and is counted in `torn`. Every index a reader
follows is checked against the region's bounds and every probe run and LRU walk is bounded, so a
read racing the writer can be wrong (as stale as an event in flight) but never crash or hang. A
holder that outgrows its region moves to a larger one (`move`): the old one is marked `retired`
and the readers look for the new one (router.kvevents.shared).

Its pure-Python twin is router/_kvshare_py.py: the same layout, so a region written by one is
read by the other.
"""

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_IsContiguous, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, qsort, realloc
from libc.string cimport memset

from _aged cimport aged_clear, aged_cut, aged_put, aged_size
from cpython cimport array

import array as _array

__all__ = ["HEADER_BYTES", "ENTRY_BYTES", "MAGIC", "READ_TRIES", "Regions", "region_bytes", "slots_for"]

cdef extern from *:
    """
    #include <stdint.h>
    static inline uint64_t shx_load64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline int64_t shx_loadi64(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline int32_t shx_load32(const int32_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline uint64_t shx_loadu64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline void shx_store64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
    /* a seqlock's fences: the writer's orders its stores around the odd sequence number, the
       reader's its loads before the second look at it (neither is an instruction on x86) */
    static inline void shx_release(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }
    static inline void shx_acquire(void) { __atomic_thread_fence(__ATOMIC_ACQUIRE); }
    static inline void shx_prefetch(const void *p) { __builtin_prefetch(p); }
    """
    uint64_t shx_load64(const uint64_t* p) noexcept nogil
    int64_t shx_loadi64(const int64_t* p) noexcept nogil
    int32_t shx_load32(const int32_t* p) noexcept nogil
    uint64_t shx_loadu64(const uint64_t* p) noexcept nogil
    void shx_store64(uint64_t* p, uint64_t v) noexcept nogil
    void shx_release() noexcept nogil
    void shx_acquire() noexcept nogil
    void shx_prefetch(const void* p) noexcept nogil

DEF _HEADER = 128
DEF _ENTRY = 32
DEF _MIN_SLOTS = 16
DEF _TRIES = 64
DEF _SPINS = 100000
DEF _MAX_POOL = 0x3FFFFFFF

HEADER_BYTES = _HEADER
ENTRY_BYTES = _ENTRY
MAGIC = 0x3178692D7261766B  # b"kvar-ix1", little-endian
READ_TRIES = _TRIES  # a reader answers again at most this many times while the writer changes the region

cdef uint64_t _MAGIC = 0x3178692D7261766B
cdef int32_t _NONE = -1
cdef array.array _UINT64 = _array.array("Q")


ctypedef struct shx_header_t:
    uint64_t magic
    uint64_t seq                 # odd while the writer changes the region
    int64_t capacity             # blocks the holder may keep
    int64_t pool                 # entries laid out
    uint64_t mask                # slots per table - 1
    int64_t size                 # blocks held
    int64_t n_aliased
    int32_t head                 # most recent entry, or -1
    int32_t tail                 # least recent entry, or -1
    int32_t free                 # first entry of the free list, or -1
    int32_t fresh                # entries below this have been used (the rest are zero)
    uint64_t retired             # 1: the holder moved to another region
    uint64_t spare[6]


ctypedef struct shx_entry_t:
    uint64_t key
    uint64_t alias
    int32_t prev                 # toward the most recent
    int32_t next                 # toward the least recent; the free list's link
    int32_t aliased
    int32_t used


ctypedef struct shx_region_t:
    shx_header_t* hd
    shx_entry_t* entries
    int32_t* kslots
    int32_t* aslots
    int64_t pool
    uint64_t mask
    Py_buffer view
    bint attached


cdef inline uint64_t _hash(uint64_t x) noexcept nogil:
    x ^= x >> 33
    x *= 0xFF51AFD7ED558CCDULL
    x ^= x >> 33
    x *= 0xC4CEB9FE1A85EC53ULL
    return x ^ (x >> 33)


def slots_for(pool):
    """Slots per table for `pool` entries: the power of two at least twice as many (load <= 1/2)."""
    cdef int64_t n = _MIN_SLOTS
    if isinstance(pool, bool) or not isinstance(pool, int):
        raise TypeError(f"pool must be an int, not {type(pool).__name__}")
    if not 1 <= pool <= _MAX_POOL:
        raise ValueError(f"pool must be in [1, {_MAX_POOL}], got {pool}")
    while n < 2 * <int64_t>pool:
        n *= 2
    return n


def region_bytes(pool):
    """Bytes of a region of `pool` entries."""
    return _HEADER + _ENTRY * pool + 8 * slots_for(pool)


cdef int _compare_u64(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const uint64_t*>a)[0], y = (<const uint64_t*>b)[0]
    return (x > y) - (x < y)


# ---------------------------------------------------------------------------------------------
# One region, on raw pointers. The writer's side reads plainly (it alone writes); what readers
# run loads every shared word once and checks it before following it.

cdef inline int32_t _probe(shx_region_t* r, const int32_t* slots, uint64_t value, bint aliases,
                           uint64_t* slot) noexcept nogil:
    # The entry filed under `value` in `slots` (by its key, or with `aliases` its engine's name),
    # or -1; `slot` is where it is, or the empty slot where it would go. Bounded, and every entry
    # checked: safe on a region being written (then maybe wrong).
    cdef uint64_t i = _hash(value) & r.mask, probes = 0
    cdef int32_t e
    while probes <= r.mask:
        e = shx_load32(&slots[i]) - 1
        if e < 0 or e >= r.pool:
            slot[0] = i
            return _NONE
        if shx_loadu64(&r.entries[e].alias if aliases else &r.entries[e].key) == value:
            slot[0] = i
            return e
        i = (i + 1) & r.mask
        probes += 1
    slot[0] = i
    return _NONE


cdef inline int32_t _find(shx_region_t* r, uint64_t key, uint64_t* slot) noexcept nogil:
    return _probe(r, r.kslots, key, False, slot)


cdef inline int32_t _afind(shx_region_t* r, uint64_t alias, uint64_t* slot) noexcept nogil:
    return _probe(r, r.aslots, alias, True, slot)


cdef void _vacate(shx_region_t* r, int32_t* slots, uint64_t hole, bint aliases) noexcept nogil:
    # Empties slot `hole` by backward shift (writer only).
    cdef uint64_t j = hole, home, mask = r.mask
    cdef int32_t moved
    while True:
        j = (j + 1) & mask
        moved = slots[j]
        if moved == 0:
            break
        home = _hash(r.entries[moved - 1].alias if aliases else r.entries[moved - 1].key) & mask
        if ((j - home) & mask) >= ((j - hole) & mask):
            slots[hole] = moved
            hole = j
    slots[hole] = 0


cdef inline void _link_front(shx_region_t* r, int32_t e) noexcept nogil:
    cdef shx_header_t* hd = r.hd
    r.entries[e].prev = _NONE
    r.entries[e].next = hd.head
    if hd.head != _NONE:
        r.entries[hd.head].prev = e
    else:
        hd.tail = e
    hd.head = e


cdef inline void _unlink(shx_region_t* r, int32_t e) noexcept nogil:
    cdef shx_header_t* hd = r.hd
    cdef int32_t p = r.entries[e].prev, n = r.entries[e].next
    if p != _NONE:
        r.entries[p].next = n
    else:
        hd.head = n
    if n != _NONE:
        r.entries[n].prev = p
    else:
        hd.tail = p


cdef void _unalias(shx_region_t* r, int32_t e) noexcept nogil:
    cdef uint64_t hole
    _afind(r, r.entries[e].alias, &hole)
    _vacate(r, r.aslots, hole, True)
    r.entries[e].aliased = 0
    r.hd.n_aliased -= 1


cdef void _alias(shx_region_t* r, int32_t e, uint64_t alias) noexcept nogil:
    # Names entry e `alias` (another entry named so loses the name). The table has room: it has
    # twice the slots of the pool.
    cdef int32_t other
    cdef uint64_t slot
    if r.entries[e].aliased:
        if r.entries[e].alias == alias:
            return
        _unalias(r, e)
    other = _afind(r, alias, &slot)
    if other != _NONE:
        _unalias(r, other)
        _afind(r, alias, &slot)
    r.entries[e].alias = alias
    r.entries[e].aliased = 1
    r.aslots[slot] = e + 1
    r.hd.n_aliased += 1


cdef void _drop(shx_region_t* r, int32_t e) noexcept nogil:
    cdef uint64_t hole
    if r.entries[e].aliased:
        _unalias(r, e)
    _find(r, r.entries[e].key, &hole)
    _vacate(r, r.kslots, hole, False)
    _unlink(r, e)
    r.hd.size -= 1
    r.entries[e].used = 0
    r.entries[e].next = r.hd.free
    r.hd.free = e


cdef int32_t _add(shx_region_t* r, uint64_t key, uint64_t slot) noexcept nogil:
    # Adds `key` as the most recent block at the empty `slot`; -1 when the pool is full.
    cdef int32_t e
    if r.hd.free != _NONE:
        e = r.hd.free
        r.hd.free = r.entries[e].next
    elif r.hd.fresh < r.pool:
        e = r.hd.fresh
        r.hd.fresh += 1
    else:
        return _NONE
    r.entries[e].key = key
    r.entries[e].aliased = 0
    r.entries[e].used = 1
    _link_front(r, e)
    r.kslots[slot] = e + 1
    r.hd.size += 1
    return e


cdef Py_ssize_t _insert(shx_region_t* r, const uint64_t* chain, const uint64_t* aliases, Py_ssize_t n) noexcept nogil:
    # PrefixIndex.insert's touches and evictions. A pool out of entries mid-insert (more new
    # blocks at once than its slack past the capacity) evicts the least recent block first.
    cdef Py_ssize_t i = n - 1, added = 0
    cdef uint64_t slot
    cdef int32_t e
    while i >= 0:
        if i >= 8:
            shx_prefetch(&r.kslots[_hash(chain[i - 8]) & r.mask])
        e = _find(r, chain[i], &slot)
        if e == _NONE:
            e = _add(r, chain[i], slot)
            if e == _NONE:
                _drop(r, r.hd.tail)
                _find(r, chain[i], &slot)
                e = _add(r, chain[i], slot)
            added += 1
        elif r.hd.head != e:
            _unlink(r, e)
            _link_front(r, e)
        if aliases != NULL:
            _alias(r, e, aliases[i])
        i -= 1
    while r.hd.size > r.hd.capacity:
        _drop(r, r.hd.tail)
    return added


cdef inline bint _holds(shx_region_t* r, uint64_t key) noexcept nogil:
    cdef uint64_t slot
    return _find(r, key, &slot) != _NONE


cdef int32_t _match(shx_region_t* r, const uint64_t* chain, Py_ssize_t n) noexcept nogil:
    # PrefixIndex.c_match's probes: gallop over 1, 2, 4, ... blocks, then bisect.
    cdef Py_ssize_t lo = 0, k = 1, mid
    if n > 0x7FFFFFFF:
        n = 0x7FFFFFFF
    if n == 0 or shx_loadi64(&r.hd.size) == 0:
        return 0
    while True:
        if k > n:
            k = n
        if not _holds(r, chain[k - 1]):
            break
        lo = k
        if k == n:
            return <int32_t>n
        k *= 2
    while k - lo > 1:
        mid = lo + (k - lo) // 2
        if _holds(r, chain[mid - 1]):
            lo = mid
        else:
            k = mid
    return <int32_t>lo


cdef int32_t _match_after(shx_region_t* r, const uint64_t* chain, Py_ssize_t n, Py_ssize_t evicted) noexcept nogil:
    # PrefixIndex.c_match_after: the matched blocks' entries sorted, then the `evicted` oldest
    # entries (walked from the tail, at most the pool's length) looked up among them. -2: no memory.
    cdef int32_t matched = _match(r, chain, n)
    cdef int32_t kept, i, e
    cdef uint64_t slot, want
    cdef uint64_t* marks
    cdef Py_ssize_t lo, hi, mid, walked = 0
    if matched <= 0 or evicted <= 0:
        return matched
    marks = <uint64_t*>malloc(matched * sizeof(uint64_t))
    if marks == NULL:
        return -2
    for i in range(matched):
        e = _find(r, chain[i], &slot)
        marks[i] = (<uint64_t><uint32_t>e << 32) | <uint32_t>i
    qsort(marks, matched, sizeof(uint64_t), _compare_u64)
    kept = matched
    e = shx_load32(&r.hd.tail)
    while walked < evicted and walked < r.pool and 0 <= e < r.pool:
        want = <uint64_t><uint32_t>e << 32
        lo, hi = 0, matched
        while lo < hi:
            mid = (lo + hi) // 2
            if marks[mid] < want:
                lo = mid + 1
            else:
                hi = mid
        if lo < matched and (marks[lo] >> 32) == (want >> 32):
            i = <int32_t><uint32_t>marks[lo]
            if i < kept:
                kept = i
        e = shx_load32(&r.entries[e].prev)
        walked += 1
    free(marks)
    return kept


cdef int _match_after_many(shx_region_t* r, const uint64_t** chains, const Py_ssize_t* lengths,
                           Py_ssize_t n_chains, const Py_ssize_t* evicted, Py_ssize_t n_evicted,
                           int32_t* out) noexcept nogil:
    # PrefixIndex.c_match_after_many: the max(evicted) oldest entries (at most the pool's length)
    # walked into a small table of key -> age rank (_aged.pxd), then each chain's matched blocks
    # looked up there in order. -2: no memory.
    cdef Py_ssize_t i, j, most = 0, walked = 0, size
    cdef uint64_t* keys
    cdef int32_t* ranks
    cdef int32_t matched, e
    for j in range(n_evicted):
        if evicted[j] > most:
            most = evicted[j]
    for i in range(n_chains):
        matched = _match(r, chains[i], lengths[i])
        for j in range(n_evicted):
            out[i * n_evicted + j] = matched if matched > 0 else 0
    if most > r.pool:
        most = r.pool
    if most <= 0:
        return 0
    size = aged_size(most)
    keys = <uint64_t*>malloc(size * sizeof(uint64_t))
    ranks = <int32_t*>malloc(size * sizeof(int32_t))
    if keys == NULL or ranks == NULL:
        free(keys)
        free(ranks)
        return -2
    aged_clear(ranks, size)
    e = shx_load32(&r.hd.tail)
    while walked < most and 0 <= e < r.pool:
        aged_put(keys, ranks, <uint64_t>(size - 1), shx_loadu64(&r.entries[e].key), <int32_t>walked)
        e = shx_load32(&r.entries[e].prev)
        walked += 1
    aged_cut(chains, n_chains, evicted, n_evicted, out, keys, ranks, <uint64_t>(size - 1))
    free(keys)
    free(ranks)
    return 0


# ---------------------------------------------------------------------------------------------
# Python face.

cdef Py_ssize_t _chain_arg(object obj, Py_buffer* view, str name) except -1:
    # A one-dimensional contiguous buffer of unsigned 64-bit integers (array('Q'), a memoryview
    # cast to 'Q'); the caller releases `view`.
    cdef bytes fmt
    try:
        PyObject_GetBuffer(obj, view, PyBUF_FORMAT)
    except (TypeError, BufferError):
        raise TypeError(f"{name} must be a buffer of unsigned 64-bit integers, not {type(obj).__name__}") from None
    fmt = b"B" if view.format == NULL else <bytes>view.format
    if fmt[:1] in (b"@", b"=", b"<"):
        fmt = fmt[1:]
    if view.itemsize != 8 or fmt not in (b"Q", b"L") or view.ndim != 1 or not PyBuffer_IsContiguous(view, b"C"):
        PyBuffer_Release(view)
        raise TypeError(f"{name} must be a one-dimensional buffer of unsigned 64-bit integers")
    return view.len // 8


cdef Py_ssize_t _holder_number(object holder) except -1:
    if isinstance(holder, bool) or not isinstance(holder, int):
        raise TypeError(f"holder must be an int, not {type(holder).__name__}")
    if not 0 <= holder < _MAX_POOL:
        raise ValueError(f"holder must be in [0, {_MAX_POOL}), got {holder}")
    return holder


cdef class Regions:
    """Holders numbered from 0, each a region in a buffer (router.kvevents.shared maps them).

    A writer's Regions formats and changes regions in writable buffers; a reader's attaches
    read-only ones and asks. Not thread-safe: the GIL serialises the methods."""

    cdef shx_region_t* _r
    cdef Py_ssize_t _n          # holder numbers in use or ever attached: 1 + the highest
    cdef Py_ssize_t _cap
    cdef readonly long long torn  # reads answered on a region that kept changing (READ_TRIES times)

    def __cinit__(self):
        self._r = NULL
        self._n = 0
        self._cap = 0
        self.torn = 0

    def __dealloc__(self):
        cdef Py_ssize_t h
        for h in range(self._n):
            if self._r[h].attached:
                PyBuffer_Release(&self._r[h].view)
        free(self._r)

    def __repr__(self):
        return f"Regions({sum(1 for h in range(self._n) if self._r[h].attached)} holders)"

    @property
    def n_holders(self):
        """1 + the highest holder number attached: the length `match_all` fills."""
        return self._n

    cdef shx_region_t* _region(self, object holder) except NULL:
        if isinstance(holder, bool) or not isinstance(holder, int):
            raise TypeError(f"holder must be an int, not {type(holder).__name__}")
        if not 0 <= holder < self._n or not self._r[<Py_ssize_t>holder].attached:
            raise ValueError(f"holder {holder} is not attached")
        return &self._r[<Py_ssize_t>holder]

    cdef shx_region_t* _writable(self, object holder) except NULL:
        cdef shx_region_t* r = self._region(holder)
        if r.view.readonly:
            raise ValueError(f"holder {holder}'s region is read-only here")
        return r

    cdef shx_region_t* _slot(self, object holder) except NULL:
        cdef shx_region_t* grown
        _holder_number(holder)
        if holder >= self._cap:
            grown = <shx_region_t*>realloc(self._r, sizeof(shx_region_t) * (2 * holder + 4))
            if grown == NULL:
                raise MemoryError()
            memset(grown + self._cap, 0, sizeof(shx_region_t) * (2 * holder + 4 - self._cap))
            self._r = grown
            self._cap = 2 * holder + 4
        if holder >= self._n:
            self._n = holder + 1
        return &self._r[<Py_ssize_t>holder]

    cdef void _set(self, shx_region_t* r) noexcept:
        r.hd = <shx_header_t*>r.view.buf
        r.pool = r.hd.pool
        r.mask = r.hd.mask
        r.entries = <shx_entry_t*>(<char*>r.view.buf + _HEADER)
        r.kslots = <int32_t*>(<char*>r.view.buf + _HEADER + _ENTRY * r.pool)
        r.aslots = r.kslots + (r.mask + 1)
        r.attached = True

    def format(self, holder, buf, capacity, pool):
        """Lays out an empty region of `pool` entries for `capacity` blocks in `buf` (writable,
        zero-filled, at least region_bytes(pool) long) and attaches it as `holder`."""
        cdef Py_buffer view
        cdef shx_region_t* r
        cdef shx_header_t* hd
        _holder_number(holder)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 <= capacity <= _MAX_POOL:
            raise ValueError(f"capacity must be an int in [0, {_MAX_POOL}], got {capacity!r}")
        need = region_bytes(pool)
        PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE | PyBUF_WRITABLE)
        if view.len < need:
            PyBuffer_Release(&view)
            raise ValueError(f"a region of {pool} entries needs {need} bytes, the buffer has {view.len}")
        hd = <shx_header_t*>view.buf
        memset(hd, 0, _HEADER)
        hd.capacity = capacity
        hd.pool = pool
        hd.mask = slots_for(pool) - 1
        hd.head = hd.tail = hd.free = _NONE
        hd.magic = _MAGIC
        self._detach(holder)
        r = self._slot(holder)
        r.view = view
        self._set(r)

    def attach(self, holder, buf):
        """Attaches the region laid out in `buf` as `holder` (a read-only buffer: to read it)."""
        cdef Py_buffer view
        cdef shx_header_t* hd
        cdef shx_region_t* r
        _holder_number(holder)
        PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
        try:
            if view.len < _HEADER:
                raise ValueError("the buffer is too short for a region's header")
            hd = <shx_header_t*>view.buf
            if shx_load64(&hd.magic) != _MAGIC:
                raise ValueError("the buffer holds no region (bad magic)")
            if not 1 <= hd.pool <= _MAX_POOL or view.len < region_bytes(hd.pool) or hd.mask + 1 != slots_for(hd.pool):
                raise ValueError("the region's header does not fit its buffer")
        except BaseException:
            PyBuffer_Release(&view)
            raise
        self._detach(holder)
        r = self._slot(holder)
        r.view = view
        self._set(r)

    cdef void _detach(self, object holder) except *:
        if isinstance(holder, int) and 0 <= holder < self._n and self._r[<Py_ssize_t>holder].attached:
            PyBuffer_Release(&self._r[<Py_ssize_t>holder].view)
            memset(&self._r[<Py_ssize_t>holder], 0, sizeof(shx_region_t))

    def detach(self, holder):
        """Lets go of `holder`'s buffer (its number reads as holding nothing)."""
        self._region(holder)
        self._detach(holder)

    def attached(self, holder):
        return isinstance(holder, int) and 0 <= holder < self._n and bool(self._r[<Py_ssize_t>holder].attached)

    def retired(self, holder):
        """True once the writer moved the holder to another region (look for it again)."""
        return shx_load64(&self._region(holder).hd.retired) != 0

    # -- what readers ask ------------------------------------------------------------------------

    def capacity(self, holder):
        return shx_loadi64(&self._region(holder).hd.capacity)

    def size(self, holder):
        return shx_loadi64(&self._region(holder).hd.size)

    def pool(self, holder):
        return self._region(holder).pool

    def total(self):
        cdef Py_ssize_t h
        cdef int64_t n = 0
        for h in range(self._n):
            if self._r[h].attached:
                n += shx_loadi64(&self._r[h].hd.size)
        return n

    def memory_bytes(self):
        """Bytes of the regions attached (their mapped length)."""
        cdef Py_ssize_t h
        cdef int64_t n = 0
        for h in range(self._n):
            if self._r[h].attached:
                n += self._r[h].view.len
        return n

    cdef int32_t _read_match(self, shx_region_t* r, const uint64_t* chain, Py_ssize_t n, Py_ssize_t evicted) noexcept nogil:
        cdef uint64_t before, after
        cdef int32_t answer = 0
        cdef int tries, spins
        if not r.view.readonly:  # the writer's own: nothing changes it meanwhile
            return _match_after(r, chain, n, evicted) if evicted > 0 else _match(r, chain, n)
        for tries in range(_TRIES):
            before = shx_load64(&r.hd.seq)
            spins = 0
            while before & 1 and spins < _SPINS:  # the writer is at it: a few microseconds
                before = shx_load64(&r.hd.seq)
                spins += 1
            answer = _match_after(r, chain, n, evicted) if evicted > 0 else _match(r, chain, n)
            if before & 1:
                break  # a writer held up (or gone) mid-change: this answer, as it read, stands
            shx_acquire()
            after = shx_load64(&r.hd.seq)
            if before == after:
                return answer
        self.torn += 1
        return answer

    def match(self, holder, chain):
        """How many leading blocks of `chain` the holder keeps."""
        cdef shx_region_t* r = self._region(holder)
        cdef Py_buffer view
        cdef Py_ssize_t n = _chain_arg(chain, &view, "chain")
        cdef int32_t m = self._read_match(r, <const uint64_t*>view.buf, n, 0)
        PyBuffer_Release(&view)
        return m

    def match_after(self, holder, chain, evicted):
        """`match` as it would be once the holder's `evicted` least-recent blocks were dropped."""
        cdef shx_region_t* r = self._region(holder)
        cdef Py_buffer view
        cdef Py_ssize_t n, count
        cdef int32_t m
        if isinstance(evicted, bool) or not isinstance(evicted, int):
            raise TypeError(f"evicted must be an int, not {type(evicted).__name__}")
        count = min(max(evicted, 0), 0x7FFFFFFF)
        n = _chain_arg(chain, &view, "chain")
        m = self._read_match(r, <const uint64_t*>view.buf, n, count)
        PyBuffer_Release(&view)
        if m == -2:
            raise MemoryError()
        return m

    cdef int _read_many(self, shx_region_t* r, const uint64_t** chains, const Py_ssize_t* lengths,
                        Py_ssize_t n_chains, const Py_ssize_t* evicted, Py_ssize_t n_evicted,
                        int32_t* out) noexcept nogil:
        # _read_match's seqlock, around one _match_after_many
        cdef uint64_t before, after
        cdef int status = 0, tries, spins
        if not r.view.readonly:
            return _match_after_many(r, chains, lengths, n_chains, evicted, n_evicted, out)
        for tries in range(_TRIES):
            before = shx_load64(&r.hd.seq)
            spins = 0
            while before & 1 and spins < _SPINS:
                before = shx_load64(&r.hd.seq)
                spins += 1
            status = _match_after_many(r, chains, lengths, n_chains, evicted, n_evicted, out)
            if before & 1 or status != 0:
                break
            shx_acquire()
            after = shx_load64(&r.hd.seq)
            if before == after:
                return status
        if status == 0:
            self.torn += 1
        return status

    def match_after_many(self, holder, chains, evicted):
        """[match_after(holder, c, k) for c in chains for k in evicted], in one walk of the holder's
        LRU tail (its max(evicted) least-recent blocks), read as one consistent state."""
        cdef shx_region_t* r = self._region(holder)
        cdef list chain_list = list(chains)
        cdef list counts = []
        cdef Py_ssize_t n_chains = len(chain_list), n_evicted, i, got = 0
        cdef Py_buffer* views
        cdef const uint64_t** starts
        cdef Py_ssize_t* lengths
        cdef Py_ssize_t* ks
        cdef int32_t* out
        cdef int status
        for k in evicted:
            if isinstance(k, bool) or not isinstance(k, int):
                raise TypeError(f"evicted must be an int, not {type(k).__name__}")
            counts.append(min(max(k, 0), 0x7FFFFFFF))
        n_evicted = len(counts)
        if n_chains == 0 or n_evicted == 0:
            return []
        views = <Py_buffer*>malloc(n_chains * sizeof(Py_buffer))
        starts = <const uint64_t**>malloc(n_chains * sizeof(uint64_t*))
        lengths = <Py_ssize_t*>malloc(n_chains * sizeof(Py_ssize_t))
        ks = <Py_ssize_t*>malloc(n_evicted * sizeof(Py_ssize_t))
        out = <int32_t*>malloc(n_chains * n_evicted * sizeof(int32_t))
        try:
            if views == NULL or starts == NULL or lengths == NULL or ks == NULL or out == NULL:
                raise MemoryError()
            for i in range(n_evicted):
                ks[i] = counts[i]
            while got < n_chains:
                lengths[got] = _chain_arg(chain_list[got], &views[got], "chain")
                starts[got] = <const uint64_t*>views[got].buf
                got += 1
            status = self._read_many(r, starts, lengths, n_chains, ks, n_evicted, out)
            if status == -2:
                raise MemoryError()
            return [out[i] for i in range(n_chains * n_evicted)]
        finally:
            for i in range(got):
                PyBuffer_Release(&views[i])
            free(views)
            free(starts)
            free(lengths)
            free(ks)
            free(out)

    def match_all(self, chain, out):
        """out[h] = match(h, chain) for every attached holder h < n_holders, 0 for the others."""
        cdef Py_buffer cv, ov
        cdef Py_ssize_t n = _chain_arg(chain, &cv, "chain"), h
        cdef int32_t* o
        cdef shx_region_t* r
        try:
            PyObject_GetBuffer(out, &ov, PyBUF_FORMAT | PyBUF_WRITABLE)
        except BaseException:
            PyBuffer_Release(&cv)
            raise
        try:
            fmt = b"B" if ov.format == NULL else <bytes>ov.format
            if ov.itemsize != 4 or fmt[len(fmt) - 1 :] not in (b"i", b"l") or ov.len // 4 < self._n:
                raise ValueError(f"out must hold {self._n} int32 values")
            o = <int32_t*>ov.buf
            if n > 0:
                for h in range(self._n):
                    r = &self._r[h]
                    if r.attached:
                        shx_prefetch(&r.kslots[_hash((<const uint64_t*>cv.buf)[0]) & r.mask])
            for h in range(self._n):
                r = &self._r[h]
                o[h] = self._read_match(r, <const uint64_t*>cv.buf, n, 0) if r.attached else 0
        finally:
            PyBuffer_Release(&ov)
            PyBuffer_Release(&cv)

    def key_of(self, holder, alias):
        """The key of the holder's block its engine names `alias`, or None."""
        cdef shx_region_t* r = self._region(holder)
        cdef uint64_t slot
        cdef int32_t e
        if isinstance(alias, bool) or not isinstance(alias, int) or not 0 <= alias < (1 << 64):
            raise ValueError(f"alias must be an int in [0, 2**64), got {alias!r}")
        e = _afind(r, <uint64_t>alias, &slot)
        return None if e < 0 else r.entries[e].key

    def blocks(self, holder):
        """(keys, aliases, named) of the holder's blocks, least recent first: two array('Q') and
        bytes (aliases[i] counts only where named[i]); for moving them to another region."""
        cdef shx_region_t* r = self._writable(holder)
        cdef Py_ssize_t n = r.hd.size, i = 0
        cdef int32_t e = r.hd.tail
        cdef array.array keys = array.clone(_UINT64, n, False)
        cdef array.array aliases = array.clone(_UINT64, n, False)
        cdef bytearray named = bytearray(n)
        while e != _NONE and i < n:
            keys.data.as_ulonglongs[i] = r.entries[e].key
            aliases.data.as_ulonglongs[i] = r.entries[e].alias
            named[i] = 1 if r.entries[e].aliased else 0
            e = r.entries[e].prev
            i += 1
        return keys, aliases, bytes(named)

    # -- what the writer does --------------------------------------------------------------------

    cdef void _begin(self, shx_region_t* r) noexcept nogil:
        shx_store64(&r.hd.seq, r.hd.seq + 1)
        shx_release()

    cdef void _end(self, shx_region_t* r) noexcept nogil:
        shx_release()
        shx_store64(&r.hd.seq, r.hd.seq + 1)

    def insert(self, holder, chain, n=-1, aliases=None):
        """PrefixIndex.insert: touches chain[n-1] .. chain[0] (naming chain[i] aliases[i]), then
        evicts least-recent blocks down to the capacity; the number of blocks it did not hold."""
        cdef shx_region_t* r = self._writable(holder)
        cdef Py_buffer view, names
        cdef Py_ssize_t length = _chain_arg(chain, &view, "chain"), count, added, n_names = 0
        cdef bint named = aliases is not None
        try:
            if named:
                n_names = _chain_arg(aliases, &names, "aliases")
        except BaseException:
            PyBuffer_Release(&view)
            raise
        try:
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"n must be an int, not {type(n).__name__}")
            if n != -1 and not 0 <= n <= length:
                raise ValueError(f"n must be -1 or in [0, {length}], got {n}")
            if named and n_names != length:
                raise ValueError(f"aliases has {n_names} entries, not one per block of the chain ({length})")
            count = length if n == -1 else <Py_ssize_t>n
            self._begin(r)
            added = _insert(r, <const uint64_t*>view.buf, <const uint64_t*>names.buf if named else NULL, count)
            self._end(r)
        finally:
            if named:
                PyBuffer_Release(&names)
            PyBuffer_Release(&view)
        return added

    def forget(self, holder, aliases):
        """Drops the blocks its engine names `aliases`; how many it held."""
        cdef shx_region_t* r = self._writable(holder)
        cdef Py_buffer view
        cdef Py_ssize_t n = _chain_arg(aliases, &view, "aliases"), i, dropped = 0
        cdef uint64_t slot
        cdef int32_t e
        cdef const uint64_t* a = <const uint64_t*>view.buf
        self._begin(r)
        for i in range(n):
            e = _afind(r, a[i], &slot)
            if e != _NONE:
                _drop(r, e)
                dropped += 1
        self._end(r)
        PyBuffer_Release(&view)
        return dropped

    def evict(self, holder, count):
        """Drops the `count` least-recent blocks; how many it dropped."""
        cdef shx_region_t* r = self._writable(holder)
        cdef Py_ssize_t dropped = 0, k
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"count must be an int, not {type(count).__name__}")
        k = min(max(count, 0), 0x7FFFFFFF)
        self._begin(r)
        while dropped < k and r.hd.tail != _NONE:
            _drop(r, r.hd.tail)
            dropped += 1
        self._end(r)
        return dropped

    def clear(self, holder):
        """Drops every block; how many it dropped."""
        return self.evict(holder, self.size(holder))

    def set_capacity(self, holder, capacity):
        """Sets the capacity (at most the pool), evicting the least recent down to it; how many it evicted."""
        cdef shx_region_t* r = self._writable(holder)
        cdef Py_ssize_t dropped = 0
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 <= capacity <= _MAX_POOL:
            raise ValueError(f"capacity must be an int in [0, {_MAX_POOL}], got {capacity!r}")
        self._begin(r)
        r.hd.capacity = capacity
        while r.hd.size > capacity:
            _drop(r, r.hd.tail)
            dropped += 1
        self._end(r)
        return dropped

    def retire(self, holder):
        """Marks the holder's region retired (it moved) and detaches it."""
        cdef shx_region_t* r = self._writable(holder)
        shx_release()
        shx_store64(&r.hd.retired, 1)
        self._detach(holder)
