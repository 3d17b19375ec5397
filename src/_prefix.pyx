# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
# distutils: extra_compile_args = -ffp-contract=off
# (price must not fuse a * b + c into one FMA, as gcc does by default where FMA is in the
# baseline, aarch64 or x86-64-v3: its costs would no longer be bit-equal to the twin's)
"""Prefix index: per replica, an LRU of cached KV block keys, and how much of a prompt each keeps (compiled core).

A prompt is rendered to bytes and cut into ``block_len``-byte blocks; block ``i``'s key is
XXH3-64 of its bytes seeded with block ``i - 1``'s key (block 0 with a per-model seed), so a
key names the whole prefix up to its block: the chaining of vLLM's automatic prefix caching,
with this router's own hash. For every holder (a replica) the index keeps the keys the router
sent there in LRU order, at most ``capacity`` of them.

``insert`` touches a chain tail first, ``chain[n-1]`` down to ``chain[0]``, then evicts from
the least-recent end. Every block is therefore more recent than the blocks after it, the LRU
tail is always a leaf, and what a holder keeps of any chain is a prefix of it, which is how
vLLM frees a finished request's blocks (tail first). ``match`` can then gallop: probe the
first 1, 2, 4, 8, ... blocks' last key, then bisect between the last hit and the first miss,
O(log matched) probes, each likely a cache miss in a large table. After ``truncate`` a chain
may have a gap; the answer is then whatever that exact probe order finds, in both twins.

Example: capacity 3, ``insert([a, b, c, d])`` touches d, c, b, a and evicts d, keeping
a b c. ``match([a, b, x])`` probes a (1 block: hit), b (2: hit), x (4, clamped to 3: miss),
then nothing is left between 2 and 3: the answer is 2.

Layout: one open-addressing table for all holders, linear probing with backward-shift
deletion, a power-of-two number of int32 slots at load <= 1/2, mapping (holder, key) to a
24-byte entry (key, holder, LRU links) in one pool that grows by a quarter. A held block costs
24 bytes of entry, 8 to 16 of slots and at most 6 of idle pool: 32 to 46 bytes, about 35 at a
million blocks.

``chain_of_parts`` keys a prompt given as its pieces (the role markers and texts a chat renders
to) without joining them: blocks inside a piece are hashed in place, a block across pieces is
assembled in a carry buffer. With 4-byte blocks, ``["ab", "cdefg", "h"]`` keys "abcd" (carried
"ab", then "cd") and "efgh" (carried "efg", then "h"), as ``block_chain(b"abcdefgh")`` does.
``price`` is one routing decision over the fleet: per candidate replica the prompt's cached
tokens (its match), its wait and cost, then the cheapest replica under its load cap and the
near-ties, in one loop over raw buffers that touches no Python object (see ``PrefixIndex.price``).
Given how many requests each replica was sent lately, a replica above the fleet's mean also pays
a spread term, so a hot prefix does not pile every request onto its one holder.

DO NOT CHANGE the block key (XXH3-64, parent-seeded, via _ring): routers that share what
they predict, and everything checked against tests/data/prefix_golden.json, key blocks alike.
"""

from cpython.buffer cimport PyBUF_FULL_RO, PyBUF_SIMPLE, PyBuffer_IsContiguous, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from cpython cimport array
from cpython.object cimport Py_SIZE
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdint cimport uint32_t
from libc.stdlib cimport free, malloc, qsort, realloc
from libc.string cimport memcpy, memset

from _aged cimport aged_clear, aged_cut, aged_put, aged_size

from _ring cimport RING_SECRET_SIZE, ring_derive_secret, ring_xxh3_64

import array as _array
import sys

__all__ = [
    "PRICE_CANDIDATE", "PRICE_GATED", "PRICE_NEAR", "SPREAD_SMOOTH", "PrefixIndex", "block_chain", "chain_of_parts",
]

cdef extern from *:
    """
    #include <stdint.h>
    static const uint64_t PREFIX_HOLDER_MIX = 0x9E3779B97F4A7C15ULL;
    static const uint64_t PREFIX_FMIX_1 = 0xFF51AFD7ED558CCDULL;
    static const uint64_t PREFIX_FMIX_2 = 0xC4CEB9FE1A85EC53ULL;
    static inline void prefix_prefetch(const void *p) { __builtin_prefetch(p); }
    """
    const uint64_t PREFIX_HOLDER_MIX, PREFIX_FMIX_1, PREFIX_FMIX_2
    void prefix_prefetch(const void* p) noexcept nogil

cdef enum:
    _MIN_SLOTS = 16
    _MIN_ENTRIES = 64
    _NOGIL_BYTES = 16384         # block_chain drops the GIL only for inputs at least this long
    _MAX_CHAIN = 0x7FFFFFFF      # matches are int32
    _AHEAD = 16                  # insert prefetches the blocks this far down the chain
    _STACK_PARTS = 16            # chain_of_parts keeps this many pieces' spans on the stack
    _PRICE_BUFFERS = 16          # price's buffer arguments

cdef array.array _UINT64 = _array.array("Q")
cdef bint _LITTLE = sys.byteorder == "little"
cdef object _SEED_SPAN = 1 << 64
cdef object _CAPACITY_SPAN = 1 << 63

# price's flags (bits of flags_out)
PRICE_CANDIDATE = PREFIX_CANDIDATE
PRICE_GATED = PREFIX_GATED
PRICE_NEAR = PREFIX_NEAR
# price's spread: requests added to the mean: a handful of requests is no imbalance yet
SPREAD_SMOOTH = <double>PREFIX_SPREAD_SMOOTH


# ---------------------------------------------------------------------------------------------
# Block keys.

cdef inline uint64_t _block_key(const uint8_t* block, size_t block_len, uint64_t parent,
                                uint8_t* secret) noexcept nogil:
    # the secret depends on the seed, which is the parent's key: only long blocks read it
    if block_len > PREFIX_SHORT_BLOCK:
        ring_derive_secret(parent, secret)
    return ring_xxh3_64(block, block_len, parent, secret)


cdef void prefix_chain(const uint8_t* data, Py_ssize_t n_blocks, size_t block_len, uint64_t seed,
                       uint64_t* out) noexcept nogil:
    cdef uint8_t secret[RING_SECRET_SIZE]
    cdef Py_ssize_t i
    for i in range(n_blocks):
        seed = _block_key(data + <size_t>i * block_len, block_len, seed, secret)
        out[i] = seed


cdef Py_ssize_t prefix_chain_spans(const prefix_span_t* spans, Py_ssize_t n_spans, size_t block_len,
                                   uint64_t seed, uint64_t* out) noexcept nogil:
    cdef uint8_t secret[RING_SECRET_SIZE]
    cdef uint8_t stack_carry[PREFIX_SHORT_BLOCK]
    cdef uint8_t* carry = stack_carry
    cdef const uint8_t* p
    cdef size_t left, take, fill = 0    # fill: bytes of the current block in `carry` (< block_len)
    cdef Py_ssize_t i, k = 0
    if block_len > PREFIX_SHORT_BLOCK:
        carry = <uint8_t*>malloc(block_len)
        if carry == NULL:
            return PREFIX_NO_MEMORY
    for i in range(n_spans):
        p = spans[i].data
        left = <size_t>spans[i].len
        if fill:
            take = block_len - fill
            if take > left:
                take = left
            memcpy(carry + fill, p, take)
            fill += take
            p += take
            left -= take
            if fill < block_len:
                continue
            seed = _block_key(carry, block_len, seed, secret)
            out[k] = seed
            k += 1
            fill = 0
        while left >= block_len:
            seed = _block_key(p, block_len, seed, secret)
            out[k] = seed
            k += 1
            p += block_len
            left -= block_len
        if left:
            memcpy(carry, p, left)
            fill = left
    if carry != stack_carry:
        free(carry)
    return k


cdef uint64_t _seed_value(object seed) except? 0:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    if not 0 <= seed < _SEED_SPAN:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return <uint64_t>seed


cdef Py_ssize_t _block_len_arg(object block_len) except -1:
    # a block longer than any input is clamped by the callers; this only bounds it to Py_ssize_t
    if isinstance(block_len, bool) or not isinstance(block_len, int):
        raise TypeError(f"block_len must be an int, not {type(block_len).__name__}")
    if block_len <= 0:
        raise ValueError(f"block_len must be positive, got {block_len}")
    return block_len if block_len < PY_SSIZE_T_MAX else PY_SSIZE_T_MAX


def block_chain(data, block_len, seed=0):
    """Keys of the whole `block_len`-byte blocks of `data` (str as UTF-8), as array('Q'):
    key[0] = xxh3_64(block 0, seed), key[i] = xxh3_64(block i, key[i-1]). A trailing partial
    block has no key. Two inputs share their first k keys exactly when they share k whole blocks,
    which is what a paged prefix cache keys its blocks by."""
    cdef uint64_t s = _seed_value(seed)
    cdef Py_ssize_t length = _block_len_arg(block_len)
    cdef Py_buffer view
    cdef Py_ssize_t blen, n_blocks
    cdef array.array out
    if isinstance(data, str):
        data = (<str>data).encode("utf-8")
    try:
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    except (TypeError, BufferError):
        raise TypeError(f"data must be str or bytes-like, not {type(data).__name__}") from None
    try:
        blen = length if length <= view.len else view.len + 1
        n_blocks = view.len // blen
        out = array.clone(_UINT64, n_blocks, zero=False)
        if view.len >= _NOGIL_BYTES:
            with nogil:
                prefix_chain(<const uint8_t*>view.buf, n_blocks, <size_t>blen, s,
                             <uint64_t*>out.data.as_ulonglongs)
        else:
            prefix_chain(<const uint8_t*>view.buf, n_blocks, <size_t>blen, s,
                         <uint64_t*>out.data.as_ulonglongs)
    finally:
        PyBuffer_Release(&view)
    return out


def chain_of_parts(parts, block_len, seed, mark):
    """(block_chain of the concatenation of `parts`, its length in bytes, the bytes before part
    number `mark`), the parts being str (as UTF-8, lone surrogates passed through) and bytes-like
    pieces, in a list or tuple; 0 <= mark <= len(parts). The pieces are never joined: a compact
    ASCII str is its own UTF-8, another str gives the UTF-8 CPython caches in it (made once)."""
    cdef uint64_t s = _seed_value(seed)
    cdef Py_ssize_t length = _block_len_arg(block_len)
    cdef tuple items
    cdef Py_ssize_t n_parts, at, i, size, total = 0, head = 0, blen, n_blocks, written
    cdef const char* text
    cdef prefix_span_t stack_spans[_STACK_PARTS]
    cdef Py_buffer stack_views[_STACK_PARTS]
    cdef prefix_span_t* spans = stack_spans
    cdef Py_buffer* views = stack_views
    cdef list encoded = None             # surrogatepass encodings made here, alive until hashed
    cdef array.array out
    if isinstance(parts, tuple):
        items = <tuple>parts
    elif isinstance(parts, list):
        items = tuple(<list>parts)       # what is hashed is then safe from the list changing
    else:
        raise TypeError(f"parts must be a list or tuple of str and bytes-like pieces, not {type(parts).__name__}")
    n_parts = len(items)
    if isinstance(mark, bool) or not isinstance(mark, int):
        raise TypeError(f"mark must be an int, not {type(mark).__name__}")
    if not 0 <= mark <= n_parts:
        raise ValueError(f"mark must be in [0, {n_parts}], got {mark}")
    at = <Py_ssize_t>mark
    if n_parts > _STACK_PARTS:
        spans = <prefix_span_t*>malloc(sizeof(prefix_span_t) * n_parts)
        views = <Py_buffer*>malloc(sizeof(Py_buffer) * n_parts)
        if spans == NULL or views == NULL:
            free(spans)
            free(views)
            raise MemoryError()
    memset(views, 0, sizeof(Py_buffer) * n_parts)   # obj NULL: PyBuffer_Release skips it
    try:
        for i in range(n_parts):
            if i == at:
                head = total
            part = items[i]
            if isinstance(part, str):
                try:
                    text = PyUnicode_AsUTF8AndSize(part, &size)
                except UnicodeEncodeError:   # a lone surrogate: not UTF-8, but the router's rendering passes it
                    part = (<str>part).encode("utf-8", "surrogatepass")
                    if encoded is None:
                        encoded = []
                    encoded.append(part)
                    text = PyBytes_AS_STRING(part)
                    size = PyBytes_GET_SIZE(part)
                spans[i].data = <const uint8_t*>text
            elif PyBytes_CheckExact(part):
                spans[i].data = <const uint8_t*>PyBytes_AS_STRING(part)
                size = PyBytes_GET_SIZE(part)
            else:
                try:
                    PyObject_GetBuffer(part, &views[i], PyBUF_SIMPLE)
                except (TypeError, BufferError):
                    memset(&views[i], 0, sizeof(Py_buffer))
                    raise TypeError(f"parts[{i}] must be str or bytes-like, not {type(part).__name__}") from None
                spans[i].data = <const uint8_t*>views[i].buf
                size = views[i].len
            spans[i].len = size
            total += size
        if at == n_parts:
            head = total
        blen = length if length <= total else total + 1
        n_blocks = total // blen
        out = array.clone(_UINT64, n_blocks, zero=False)
        if n_blocks == 0:
            written = 0
        elif total >= _NOGIL_BYTES:
            with nogil:
                written = prefix_chain_spans(spans, n_parts, <size_t>blen, s, <uint64_t*>out.data.as_ulonglongs)
        else:
            written = prefix_chain_spans(spans, n_parts, <size_t>blen, s, <uint64_t*>out.data.as_ulonglongs)
        if written == PREFIX_NO_MEMORY:
            raise MemoryError()
    finally:
        for i in range(n_parts):
            PyBuffer_Release(&views[i])
        if spans != stack_spans:
            free(spans)
            free(views)
    return out, total, head


# ---------------------------------------------------------------------------------------------
# The table and the LRU lists, on raw pointers.

cdef inline uint64_t _slot_hash(uint64_t key, int32_t holder) noexcept nogil:
    # Keys are already uniform, but one block is often held by several holders: mixing the
    # holder in and finalising keeps their copies apart instead of in one probe run.
    cdef uint64_t h = key ^ (<uint64_t><uint32_t>holder * PREFIX_HOLDER_MIX)
    h ^= h >> 33
    h *= PREFIX_FMIX_1
    h ^= h >> 33
    h *= PREFIX_FMIX_2
    return h ^ (h >> 33)


cdef inline uint64_t _filed(const prefix_entry_t* entries, const uint64_t* aliases, int32_t e) noexcept nogil:
    # What entry e is filed under in a table: its key, or (aliases given) its engine's name.
    return entries[e].key if aliases == NULL else aliases[e]


cdef void _vacate(int32_t* slots, uint64_t mask, uint64_t hole, const prefix_entry_t* entries,
                  const uint64_t* aliases) noexcept nogil:
    # Empties slot `hole` of a table by backward-shift deletion: every later entry of the probe
    # run that may move into the hole does, so there are no tombstones.
    cdef uint64_t j = hole, home
    cdef int32_t moved
    while True:
        j = (j + 1) & mask
        moved = slots[j]
        if moved == PREFIX_NONE:
            break
        home = _slot_hash(_filed(entries, aliases, moved), entries[moved].holder) & mask
        if ((j - home) & mask) >= ((j - hole) & mask):
            slots[hole] = moved
            hole = j
    slots[hole] = PREFIX_NONE


cdef int32_t* _doubled(const int32_t* slots, uint64_t mask, const prefix_entry_t* entries,
                       const uint64_t* aliases) noexcept nogil:
    # The table's entries filed again in one twice as large (the caller frees the old one);
    # NULL when it could not be allocated.
    cdef uint64_t n_old = mask + 1, new_mask = 2 * n_old - 1, i, j
    cdef int32_t* grown = <int32_t*>malloc(sizeof(int32_t) * 2 * n_old)
    cdef int32_t e
    if grown == NULL:
        return NULL
    memset(grown, 0xFF, sizeof(int32_t) * 2 * n_old)
    for i in range(n_old):
        e = slots[i]
        if e != PREFIX_NONE:
            j = _slot_hash(_filed(entries, aliases, e), entries[e].holder) & new_mask
            while grown[j] != PREFIX_NONE:
                j = (j + 1) & new_mask
            grown[j] = e
    return grown


cdef int _compare_u64(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const uint64_t*>a)[0], y = (<const uint64_t*>b)[0]
    return (x > y) - (x < y)


cdef inline void _link_front(prefix_entry_t* entries, prefix_holder_t* hd, int32_t e) noexcept nogil:
    entries[e].prev = PREFIX_NONE
    entries[e].next = hd.head
    if hd.head != PREFIX_NONE:
        entries[hd.head].prev = e
    else:
        hd.tail = e
    hd.head = e


cdef inline void _unlink(prefix_entry_t* entries, prefix_holder_t* hd, int32_t e) noexcept nogil:
    cdef int32_t p = entries[e].prev, n = entries[e].next
    if p != PREFIX_NONE:
        entries[p].next = n
    else:
        hd.head = n
    if n != PREFIX_NONE:
        entries[n].prev = p
    else:
        hd.tail = p


# ---------------------------------------------------------------------------------------------
# Python face: argument checks, one conversion point for errors.

cdef int64_t _capacity_arg(object capacity) except -1:
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"capacity must be an int, not {type(capacity).__name__}")
    if not 0 <= capacity < _CAPACITY_SPAN:
        raise ValueError(f"capacity must be in [0, 2**63), got {capacity}")
    return <int64_t>capacity


cdef Py_ssize_t _count_arg(str name, object value, Py_ssize_t clamp) except -1:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")
    return clamp if value > clamp else <Py_ssize_t>value


cdef enum _Kind:                 # what a buffer argument holds
    _CHAIN                       # uint64 block keys
    _MATCHED                     # writable int32 (match_all's out)
    _INT32
    _INT64
    _FLOAT64
    _UINT8
    _FLOAT64_OUT
    _UINT8_OUT

cdef tuple _KIND_TEXT = (
    "a buffer of uint64 (array('Q'))",
    "a writable buffer of int32 (array('i'))",
    "a buffer of int32 (array('i'))",
    "a buffer of int64 (array('q'))",
    "a buffer of float64 (array('d'))",
    "a buffer of uint8 (array('B'))",
    "a writable buffer of float64 (array('d'))",
    "a writable buffer of uint8 (array('B'))",
)


cdef bint _format_is(const char* fmt, Py_ssize_t itemsize, char a, char b, Py_ssize_t size) noexcept:
    # native codes only; '@', '=' and (on little-endian hosts) '<' all mean native order
    if fmt == NULL:
        fmt = b"B"
    if fmt[0] == b"@" or fmt[0] == b"=" or (_LITTLE and fmt[0] == b"<"):
        fmt += 1
    return itemsize == size and (fmt[0] == a or fmt[0] == b) and fmt[1] == 0


cdef bint _format_of(const Py_buffer* view, _Kind kind) noexcept:
    # 'L' and 'l' are 8 bytes on LP64 hosts, 4 on Windows: the item size decides
    if kind == _CHAIN:
        return _format_is(view.format, view.itemsize, b"Q", b"L", 8)
    if kind == _MATCHED or kind == _INT32:
        return _format_is(view.format, view.itemsize, b"i", b"l", 4)
    if kind == _INT64:
        return _format_is(view.format, view.itemsize, b"q", b"l", 8)
    if kind == _FLOAT64 or kind == _FLOAT64_OUT:
        return _format_is(view.format, view.itemsize, b"d", b"d", 8)
    return _format_is(view.format, view.itemsize, b"B", b"B", 1)


cdef Py_ssize_t _get_buffer(object obj, Py_buffer* view, str name, _Kind kind) except -1:
    # Fills `view` (the caller releases it) and returns its length in items.
    cdef str what = _KIND_TEXT[<int>kind]
    cdef bint out = kind == _MATCHED or kind == _FLOAT64_OUT or kind == _UINT8_OUT
    try:
        PyObject_GetBuffer(obj, view, PyBUF_FULL_RO)
    except (TypeError, BufferError):
        raise TypeError(f"{name} must be {what}, not {type(obj).__name__}") from None
    try:
        if not _format_of(view, kind):
            fmt = "B" if view.format == NULL else view.format.decode("ascii", "replace")
            raise TypeError(f"{name} must be {what}, not one of format {fmt!r}")
        if view.ndim != 1 or not PyBuffer_IsContiguous(view, b"C"):
            raise TypeError(f"{name} must be a one-dimensional contiguous buffer")
        if out and view.readonly:
            raise TypeError(f"{name} must be {what}, not a read-only one")
        if view.shape[0] > _MAX_CHAIN:
            raise ValueError(f"{name} is longer than 2**31 - 1 entries")
    except BaseException:
        PyBuffer_Release(view)
        raise
    return view.shape[0]


cdef char* _ARRAY_CODE = b"QiiqdBdB"  # per _Kind: the array.array typecode read in place


cdef Py_ssize_t _arg_buffer(object obj, Py_buffer* view, str name, _Kind kind, Py_ssize_t n, int k,
                            uint32_t* in_place, uint32_t* taken) except -1:
    # price's buffer argument number k: its length in items, at least n (n < 0: any). An
    # array.array of the kind's own typecode is not exported (bit k of in_place is set and
    # _items reads it later): taking and releasing a view costs more than the whole loop.
    # Bit k of `taken`: `view` holds a view the caller must release.
    cdef Py_ssize_t length
    if type(obj) is array.array and (<array.array>obj).ob_descr.typecode == _ARRAY_CODE[<int>kind]:
        length = Py_SIZE(obj)
        if length > _MAX_CHAIN:
            raise ValueError(f"{name} is longer than 2**31 - 1 entries")
        in_place[0] |= 1u << k
    else:
        length = _get_buffer(obj, view, name, kind)
        taken[0] |= 1u << k
    if length < n:
        raise ValueError(f"{name} has {length} entries, fewer than holders ({n})")
    return length


cdef void* _items(object obj, Py_buffer* view, bint in_place, Py_ssize_t n, str name) except? NULL:
    # The items of an argument _arg_buffer checked. One read in place is checked again: Python
    # code run by a later argument's checks may have shrunk it.
    if not in_place:
        return view.buf
    if Py_SIZE(obj) < n:
        raise ValueError(f"{name} has {Py_SIZE(obj)} entries, fewer than holders ({n})")
    return (<array.array>obj).data.as_voidptr


cdef double _float_arg(str name, object value) except? -1.0:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, not {type(value).__name__}")
    return float(value)


cdef int32_t _holder_arg(PrefixIndex index, object holder) except -1:
    if isinstance(holder, bool) or not isinstance(holder, int):
        raise TypeError(f"holder must be an int, not {type(holder).__name__}")
    if not 0 <= holder < index._n_holders or not index._holders[<Py_ssize_t>holder].in_use:
        raise ValueError(f"holder {holder} is not in use")
    return <int32_t>holder


cdef class PrefixIndex:
    """Per holder (replica), an LRU set of block keys of at most `capacity` blocks.

    Holders are numbered from 0; add_holder takes the lowest free number. Not thread-safe:
    the GIL serialises the methods (none of them releases it)."""

    def __cinit__(self):
        self._entries = NULL
        self._holders = NULL
        self._slots = <int32_t*>malloc(sizeof(int32_t) * _MIN_SLOTS)
        if self._slots == NULL:
            raise MemoryError()
        memset(self._slots, 0xFF, sizeof(int32_t) * _MIN_SLOTS)
        self._mask = _MIN_SLOTS - 1
        self._n_entries = 0
        self._n_used = 0
        self._free = PREFIX_NONE
        self._n_holders = 0
        self._holders_cap = 0
        self._aliases = NULL
        self._aslots = NULL
        self._amask = 0
        self._n_aliased = 0

    def __init__(self):
        pass

    def __dealloc__(self):
        free(self._entries)
        free(self._slots)
        free(self._holders)
        free(self._aliases)
        free(self._aslots)

    def __repr__(self):
        return f"PrefixIndex({self._n_holders} holders, {self._n_used} blocks)"

    # -- holders --------------------------------------------------------------------------------

    @property
    def n_holders(self):
        """1 + the highest holder number ever in use: the length `match_all` fills."""
        return self._n_holders

    def add_holder(self, capacity):
        """A new holder of `capacity` blocks; its number is the lowest free one."""
        cdef int64_t cap = _capacity_arg(capacity)
        cdef int32_t h
        cdef prefix_holder_t* grown
        for h in range(self._n_holders):
            if not self._holders[h].in_use:
                break
        else:
            h = self._n_holders
            if h == self._holders_cap:
                if h >= _MAX_CHAIN // 2:
                    raise MemoryError("too many holders")
                grown = <prefix_holder_t*>realloc(self._holders, sizeof(prefix_holder_t) * (2 * h + 4))
                if grown == NULL:
                    raise MemoryError()
                self._holders = grown
                self._holders_cap = 2 * h + 4
            self._n_holders += 1
        self._holders[h].capacity = cap
        self._holders[h].size = 0
        self._holders[h].head = PREFIX_NONE
        self._holders[h].tail = PREFIX_NONE
        self._holders[h].in_use = 1
        return h

    def remove_holder(self, holder):
        """Drops the holder's blocks; its number becomes free for add_holder."""
        cdef int32_t h = _holder_arg(self, holder)
        self.c_evict(h, self._holders[h].size)
        self._holders[h].in_use = 0

    def capacity(self, holder):
        """Blocks the holder may keep."""
        return self._holders[_holder_arg(self, holder)].capacity

    def set_capacity(self, holder, capacity):
        """Sets the holder's capacity, evicting its least-recent blocks down to it; how many it evicted."""
        cdef int32_t h = _holder_arg(self, holder)
        cdef int64_t cap = _capacity_arg(capacity)
        self._holders[h].capacity = cap
        if self._holders[h].size <= cap:
            return 0
        return self.c_evict(h, <Py_ssize_t>(self._holders[h].size - cap))

    def size(self, holder):
        """Blocks the holder keeps now."""
        return self._holders[_holder_arg(self, holder)].size

    def clear(self, holder):
        """Drops every block of the holder (its engine restarted); how many it dropped."""
        cdef int32_t h = _holder_arg(self, holder)
        return self.c_evict(h, self._holders[h].size)

    def total(self):
        """Blocks held, all holders together."""
        return self._n_used

    def memory_bytes(self):
        """Bytes the index has allocated: entry pool, slot table and holder table (and, once a
        block was named by its engine, the names and their table)."""
        cdef int64_t named = 0
        if self._aslots != NULL:
            named = (self._n_entries * <int64_t>sizeof(uint64_t)
                     + <int64_t>(self._amask + 1) * <int64_t>sizeof(int32_t))
        return (self._n_entries * <int64_t>sizeof(prefix_entry_t)
                + <int64_t>(self._mask + 1) * <int64_t>sizeof(int32_t)
                + <int64_t>self._holders_cap * <int64_t>sizeof(prefix_holder_t) + named)

    # -- blocks ---------------------------------------------------------------------------------

    def insert(self, holder, chain, n=-1, aliases=None):
        """Records that `holder` now caches chain[:n] (all of it for n = -1): touches chain[n-1]
        down to chain[0], each becoming the most recent, then evicts least-recent blocks down
        to the capacity. Returns how many of those blocks it did not hold before (some may
        have been evicted again when n exceeds the capacity).

        With `aliases` (uint64, as long as `chain`), block chain[i] is also named aliases[i]:
        its engine's hash of it, by which `forget` drops it and `key_of` finds it. A block has
        one name (a new one replaces it), a name one block of a holder (another block named
        alike loses it); a block that leaves the holder takes its name along."""
        cdef int32_t h = _holder_arg(self, holder)
        cdef Py_buffer view, names
        cdef Py_ssize_t length = _get_buffer(chain, &view, "chain", _CHAIN)
        cdef Py_ssize_t count, added, n_names = 0
        cdef bint named = aliases is not None
        try:
            if named:
                n_names = _get_buffer(aliases, &names, "aliases", _CHAIN)
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
            added = self._insert(h, <const uint64_t*>view.buf,
                                 <const uint64_t*>names.buf if named else NULL, count)
        finally:
            if named:
                PyBuffer_Release(&names)
            PyBuffer_Release(&view)
        if added == PREFIX_NO_MEMORY:
            raise MemoryError()
        return added

    def forget(self, holder, aliases):
        """Drops the holder's blocks its engine names `aliases` (uint64): the engine removed
        them. How many of them it held; a name it does not know is passed over."""
        cdef int32_t h = _holder_arg(self, holder)
        cdef Py_buffer view
        cdef Py_ssize_t length = _get_buffer(aliases, &view, "aliases", _CHAIN)
        cdef Py_ssize_t dropped = self.c_forget(h, <const uint64_t*>view.buf, length)
        PyBuffer_Release(&view)
        return dropped

    def key_of(self, holder, alias):
        """The key of the holder's block its engine names `alias`, or None: it holds none."""
        cdef int32_t h = _holder_arg(self, holder)
        cdef int32_t e
        if isinstance(alias, bool) or not isinstance(alias, int):
            raise TypeError(f"alias must be an int, not {type(alias).__name__}")
        if not 0 <= alias < _SEED_SPAN:
            raise ValueError(f"alias must be in [0, 2**64), got {alias}")
        e = self.c_named(h, <uint64_t>alias)
        return None if e < 0 else self._entries[e].key

    def match(self, holder, chain):
        """How many leading blocks of `chain` the holder keeps."""
        cdef int32_t h = _holder_arg(self, holder)
        cdef Py_buffer view
        cdef Py_ssize_t length = _get_buffer(chain, &view, "chain", _CHAIN)
        cdef int32_t matched = self.c_match(h, <const uint64_t*>view.buf, length)
        PyBuffer_Release(&view)
        return matched

    def match_after(self, holder, chain, evicted):
        """How many leading blocks of `chain` the holder would keep once its `evicted` least-recent
        blocks were gone: match() as it would be after evict(holder, evicted), nothing dropped."""
        cdef int32_t h = _holder_arg(self, holder)
        cdef Py_buffer view
        cdef Py_ssize_t length = _get_buffer(chain, &view, "chain", _CHAIN)
        cdef Py_ssize_t count
        cdef int32_t kept
        try:
            count = _count_arg("evicted", evicted, self._holders[h].size)
            kept = self.c_match_after(h, <const uint64_t*>view.buf, length, count)
        finally:
            PyBuffer_Release(&view)
        if kept == PREFIX_NO_MEMORY:
            raise MemoryError()
        return kept

    def match_after_many(self, holder, chains, evicted):
        """[match_after(holder, c, k) for c in chains for k in evicted], in one walk of the holder's
        LRU tail (its max(evicted) least-recent blocks) rather than one for each chain and count:
        what each of a replica's returning conversations would keep were its oldest blocks gone."""
        cdef int32_t h = _holder_arg(self, holder)
        cdef Py_ssize_t size = self._holders[h].size
        cdef list chain_list = list(chains)
        cdef Py_ssize_t n_chains = len(chain_list), n_evicted, i, got = 0
        cdef list counts = [_count_arg("evicted", k, size) for k in evicted]
        cdef Py_buffer* views
        cdef const uint64_t** starts
        cdef Py_ssize_t* lengths
        cdef Py_ssize_t* ks
        cdef int32_t* out
        cdef int status = 0
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
                lengths[got] = _get_buffer(chain_list[got], &views[got], "chain", _CHAIN)
                starts[got] = <const uint64_t*>views[got].buf
                got += 1
            status = self.c_match_after_many(h, starts, lengths, n_chains, ks, n_evicted, out)
            if status == PREFIX_NO_MEMORY:
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
        """out[h] = match(h, chain) for every holder number h < n_holders (0 for free numbers)."""
        cdef Py_buffer cv, ov
        cdef Py_ssize_t length = _get_buffer(chain, &cv, "chain", _CHAIN)
        cdef Py_ssize_t n_out
        try:
            n_out = _get_buffer(out, &ov, "out", _MATCHED)
        except BaseException:
            PyBuffer_Release(&cv)
            raise
        try:
            if n_out < self._n_holders:
                raise ValueError(f"out has {n_out} entries, fewer than n_holders ({self._n_holders})")
            self.c_match_all(<const uint64_t*>cv.buf, length, <int32_t*>ov.buf)
        finally:
            PyBuffer_Release(&ov)
            PyBuffer_Release(&cv)

    def price(self, chain, holders, busy_until, seconds_per_token, loads, waiting, caps, excluded,
              now, decode_s, mean_uncached, block_tokens, total_tokens, last, history_blocks, tie_s,
              tie_share, cached_out, wait_out, cost_out, flags_out, recent=None, recent_scale=1.0,
              spread_tokens=0.0, spread_out=None, interference=0.0, history_from_all=False, home_share=-1.0,
              known=None, spread_whole=False, evicts=None):
        """One routing decision over n = len(holders) fleet positions; returns (best, near, home).

        Per position i: holders[i] (int32, -1: holds nothing yet), busy_until[i],
        seconds_per_token[i], waiting[i] (float64, < 0: unknown), loads[i], caps[i] (int64),
        excluded[i] (uint8, nonzero: not a candidate), and optionally recent[i] (float64: requests
        recently sent there, in a shared decay frame). With r[i] = recent[i] * recent_scale and
        mean = sum(r[i]) / count over the candidates (gated ones included, in position order),
        for every candidate:

            blocks   = match(holders[i], chain), or history_blocks at `last` if that is more
                       (with history_from_all and last >= 0, history_blocks is first raised to
                       the most any position's holder keeps, excluded positions included)
            cached   = min(blocks * block_tokens, total_tokens); uncached = total_tokens - cached
                       (with `known` given and known[i] >= 0: min(known[i], total_tokens), the
                       tokens its engine's KV events say it holds: no match, no history credit)
            wait     = max(0, busy_until[i] - now) + loads[i] * decode_s
                       + (waiting[i] - loads[i]) * mean_uncached * spt   when waiting[i] > loads[i]
            excess   = (r[i] - mean) / (mean + SPREAD_SMOOTH)
            spread   = spread_tokens * spt * excess * uncached / total_tokens   (left to right)
                       when recent is given, spread_tokens > 0, i != last, r[i] > mean and
                       total_tokens > 0; else 0 (with spread_whole, a new conversation, which
                       commits its turns to whichever replica it goes: total_tokens in uncached's
                       place, and max(min(cached, history_blocks x block_tokens), spread_tokens)
                       in spread_tokens': what a replica holds of its messages before the last (a
                       shared system or tool prompt) draws it there no further than the excess allows)
            cost     = wait + uncached * spt + spread (+ evicts[i], when evicts is given and
                       evicts[i] != 0: seconds of prefill what it would evict there costs others)
            gated    = loads[i] >= caps[i]

        where spt = seconds_per_token[i] x (1 + interference x loads[i]) (a prefill there delays
        every request running there; exactly seconds_per_token[i] when interference is 0)

        and cached_out, wait_out, cost_out (float64), flags_out (uint8: PRICE_CANDIDATE,
        PRICE_GATED, PRICE_NEAR) and spread_out (float64, when given) get its row; other
        positions are left as they were. SPREAD_SMOOTH (4.0) is requests added to the mean: a
        handful of requests is no imbalance yet. best is the non-gated candidate of lowest cost
        (the lowest position among equals), -1 when there is none; near counts the non-gated
        candidates with cost <= best's + max(tie_s, best's * tie_share), best included, each
        flagged PRICE_NEAR. home (when home_share >= 0, else -1) is the candidate, gated or not,
        with the most cached tokens (the highest position among equals) if that is at least
        home_share x total_tokens and more than 0, else -1. The defaults (no recent,
        spread_tokens 0, interference 0) add no term: the costs are those without it, bit for bit."""
        cdef Py_buffer views[_PRICE_BUFFERS]
        cdef uint32_t in_place = 0       # bit k: buffer argument k is an array.array read in place
        cdef uint32_t taken = 0          # bit k: views[k] holds a view to release
        cdef Py_ssize_t n, n_chain, i, best, near = 0
        cdef int32_t h
        cdef prefix_fleet_t fleet
        cdef prefix_request_t request
        cdef prefix_costs_t costs
        try:
            # Every check first, in argument order; they may run Python code (a subclass's
            # __float__ or __index__), which could resize an array read in place, so the
            # pointers are read after the last of them.
            n_chain = _arg_buffer(chain, &views[0], "chain", _CHAIN, -1, 0, &in_place, &taken)
            n = _arg_buffer(holders, &views[1], "holders", _INT32, -1, 1, &in_place, &taken)
            _arg_buffer(busy_until, &views[2], "busy_until", _FLOAT64, n, 2, &in_place, &taken)
            _arg_buffer(seconds_per_token, &views[3], "seconds_per_token", _FLOAT64, n, 3, &in_place, &taken)
            _arg_buffer(loads, &views[4], "loads", _INT64, n, 4, &in_place, &taken)
            _arg_buffer(waiting, &views[5], "waiting", _FLOAT64, n, 5, &in_place, &taken)
            _arg_buffer(caps, &views[6], "caps", _INT64, n, 6, &in_place, &taken)
            _arg_buffer(excluded, &views[7], "excluded", _UINT8, n, 7, &in_place, &taken)
            request.now = _float_arg("now", now)
            request.decode_s = _float_arg("decode_s", decode_s)
            request.mean_uncached = _float_arg("mean_uncached", mean_uncached)
            request.block_tokens = _float_arg("block_tokens", block_tokens)
            request.total_tokens = _float_arg("total_tokens", total_tokens)
            if isinstance(last, bool) or not isinstance(last, int):
                raise TypeError(f"last must be an int, not {type(last).__name__}")
            if not -1 <= last < n:
                raise ValueError(f"last must be -1 or in [0, {n}), got {last}")
            request.last = <Py_ssize_t>last
            request.history_blocks = _count_arg("history_blocks", history_blocks, PY_SSIZE_T_MAX)
            request.tie_s = _float_arg("tie_s", tie_s)
            request.tie_share = _float_arg("tie_share", tie_share)
            _arg_buffer(cached_out, &views[8], "cached_out", _FLOAT64_OUT, n, 8, &in_place, &taken)
            _arg_buffer(wait_out, &views[9], "wait_out", _FLOAT64_OUT, n, 9, &in_place, &taken)
            _arg_buffer(cost_out, &views[10], "cost_out", _FLOAT64_OUT, n, 10, &in_place, &taken)
            _arg_buffer(flags_out, &views[11], "flags_out", _UINT8_OUT, n, 11, &in_place, &taken)
            if recent is not None:
                _arg_buffer(recent, &views[12], "recent", _FLOAT64, n, 12, &in_place, &taken)
            request.recent_scale = _float_arg("recent_scale", recent_scale)
            request.spread_tokens = _float_arg("spread_tokens", spread_tokens)
            if not isinstance(spread_whole, bool):
                raise TypeError(f"spread_whole must be a bool, not {type(spread_whole).__name__}")
            request.spread_whole = spread_whole
            if spread_out is not None:
                _arg_buffer(spread_out, &views[13], "spread_out", _FLOAT64_OUT, n, 13, &in_place, &taken)
            request.interference = _float_arg("interference", interference)
            if not isinstance(history_from_all, bool):
                raise TypeError(f"history_from_all must be a bool, not {type(history_from_all).__name__}")
            request.history_from_all = history_from_all
            request.home_share = _float_arg("home_share", home_share)
            if known is not None:
                _arg_buffer(known, &views[14], "known", _FLOAT64, n, 14, &in_place, &taken)
            if evicts is not None:
                _arg_buffer(evicts, &views[15], "evicts", _FLOAT64, n, 15, &in_place, &taken)
            # from here on no Python code runs until the loop is done
            fleet.n = n
            fleet.holders = <const int32_t*>_items(holders, &views[1], in_place & (1 << 1), n, "holders")
            fleet.busy_until = <const double*>_items(busy_until, &views[2], in_place & (1 << 2), n, "busy_until")
            fleet.seconds_per_token = <const double*>_items(
                seconds_per_token, &views[3], in_place & (1 << 3), n, "seconds_per_token")
            fleet.loads = <const int64_t*>_items(loads, &views[4], in_place & (1 << 4), n, "loads")
            fleet.waiting = <const double*>_items(waiting, &views[5], in_place & (1 << 5), n, "waiting")
            fleet.caps = <const int64_t*>_items(caps, &views[6], in_place & (1 << 6), n, "caps")
            fleet.excluded = <const uint8_t*>_items(excluded, &views[7], in_place & (1 << 7), n, "excluded")
            costs.cached = <double*>_items(cached_out, &views[8], in_place & (1 << 8), n, "cached_out")
            costs.wait = <double*>_items(wait_out, &views[9], in_place & (1 << 9), n, "wait_out")
            costs.cost = <double*>_items(cost_out, &views[10], in_place & (1 << 10), n, "cost_out")
            costs.flags = <uint8_t*>_items(flags_out, &views[11], in_place & (1 << 11), n, "flags_out")
            fleet.recent = NULL
            if recent is not None:
                fleet.recent = <const double*>_items(recent, &views[12], in_place & (1 << 12), n, "recent")
            fleet.known = NULL
            if known is not None:
                fleet.known = <const double*>_items(known, &views[14], in_place & (1 << 14), n, "known")
            fleet.evicts = NULL
            if evicts is not None:
                fleet.evicts = <const double*>_items(evicts, &views[15], in_place & (1 << 15), n, "evicts")
            costs.spread = NULL
            if spread_out is not None:
                costs.spread = <double*>_items(spread_out, &views[13], in_place & (1 << 13), n, "spread_out")
            if in_place & 1:
                n_chain = Py_SIZE(chain)
            for i in range(n):
                h = fleet.holders[i]
                if not fleet.excluded[i] and h != -1 and not (
                        0 <= h < self._n_holders and self._holders[h].in_use):
                    raise ValueError(f"holders[{i}] is {h}, not -1 or a holder in use")
            best = self.c_price(<const uint64_t*>_items(chain, &views[0], in_place & 1, 0, "chain"), n_chain,
                                &fleet, &request, &costs, &near)
        finally:
            for i in range(_PRICE_BUFFERS):
                if taken & (1u << i):
                    PyBuffer_Release(&views[i])
        return best, near, costs.home

    def truncate(self, holder, chain, keep):
        """The holder's engine keeps only `keep` blocks of `chain`: drops chain[keep:] from the
        holder; how many of them it held."""
        cdef int32_t h = _holder_arg(self, holder)
        cdef Py_buffer view
        cdef Py_ssize_t length = _get_buffer(chain, &view, "chain", _CHAIN)
        cdef Py_ssize_t k, dropped
        try:
            k = _count_arg("keep", keep, length)
            dropped = self.c_truncate(h, <const uint64_t*>view.buf, length, k)
        finally:
            PyBuffer_Release(&view)
        return dropped

    def evict(self, holder, count):
        """Drops the holder's `count` least-recent blocks; how many it dropped."""
        cdef int32_t h = _holder_arg(self, holder)
        return self.c_evict(h, _count_arg("count", count, self._holders[h].size))

    # -- the C-level API (see _prefix.pxd) -----------------------------------------------------

    cdef int32_t _find(self, int32_t holder, uint64_t key, uint64_t* slot) noexcept nogil:
        # The entry of (holder, key), or PREFIX_NONE; `slot` is where it is, or the empty slot
        # where it would go.
        cdef uint64_t i = _slot_hash(key, holder) & self._mask
        cdef int32_t e
        while True:
            e = self._slots[i]
            if e == PREFIX_NONE or (self._entries[e].key == key and self._entries[e].holder == holder):
                slot[0] = i
                return e
            i = (i + 1) & self._mask

    cdef bint _holds(self, int32_t holder, uint64_t key) noexcept nogil:
        cdef uint64_t slot
        return self._find(holder, key, &slot) != PREFIX_NONE

    cdef bint _grow_table(self) noexcept nogil:
        cdef int32_t* slots = _doubled(self._slots, self._mask, self._entries, NULL)
        if slots == NULL:
            return False
        free(self._slots)
        self._slots = slots
        self._mask = 2 * self._mask + 1
        return True

    cdef bint _grow_pool(self) noexcept nogil:
        # grow by a quarter: at most 25% of the pool idles, and glibc remaps large blocks
        # instead of copying them
        cdef int64_t n_old = self._n_entries, n_new = n_old + (n_old >> 2) if n_old else _MIN_ENTRIES, i
        cdef prefix_entry_t* grown
        cdef uint64_t* names
        if n_new > _MAX_CHAIN:
            n_new = _MAX_CHAIN
        if n_new <= n_old:
            return False
        if self._aslots != NULL:  # the names grow first: a longer array is harmless if the pool cannot
            names = <uint64_t*>realloc(self._aliases, sizeof(uint64_t) * <size_t>n_new)
            if names == NULL:
                return False
            self._aliases = names
        grown = <prefix_entry_t*>realloc(self._entries, sizeof(prefix_entry_t) * <size_t>n_new)
        if grown == NULL:
            return False
        # new entries go on the free list in order, so a fresh pool fills front to back
        for i in range(n_old, n_new):
            grown[i].holder = PREFIX_NONE
            grown[i].aliased = 0
            grown[i].next = <int32_t>(i + 1)
        grown[n_new - 1].next = self._free
        self._free = <int32_t>n_old
        self._entries = grown
        self._n_entries = n_new
        return True

    cdef int32_t _add(self, int32_t holder, uint64_t key, uint64_t slot) noexcept nogil:
        # Adds (holder, key) as the holder's most recent block; `slot` is the empty slot _find
        # gave. The entry, or PREFIX_NO_MEMORY.
        cdef int32_t e
        if 2 * (self._n_used + 1) > <int64_t>(self._mask + 1):
            if not self._grow_table():
                return PREFIX_NO_MEMORY
            self._find(holder, key, &slot)
        if self._free == PREFIX_NONE and not self._grow_pool():
            return PREFIX_NO_MEMORY
        e = self._free
        self._free = self._entries[e].next
        self._entries[e].key = key
        self._entries[e].holder = holder
        self._entries[e].aliased = 0
        self._slots[slot] = e
        _link_front(self._entries, &self._holders[holder], e)
        self._holders[holder].size += 1
        self._n_used += 1
        return e

    cdef void _drop(self, int32_t e) noexcept nogil:
        # Removes entry e from its holder and from the table (and its name from theirs).
        cdef prefix_entry_t* entries = self._entries
        cdef int32_t holder = entries[e].holder
        cdef uint64_t hole
        if entries[e].aliased:
            self._unalias(e)
        self._find(holder, entries[e].key, &hole)
        _vacate(self._slots, self._mask, hole, entries, NULL)
        _unlink(entries, &self._holders[holder], e)
        self._holders[holder].size -= 1
        self._n_used -= 1
        entries[e].holder = PREFIX_NONE
        entries[e].next = self._free
        self._free = e

    cdef int32_t c_match_after(self, int32_t holder, const uint64_t* chain, Py_ssize_t n,
                               Py_ssize_t evicted) noexcept nogil:
        # The matched blocks' entries, sorted (entry << 32 | position), then the `evicted` oldest
        # entries looked up among them: the first position found is where the match would end.
        cdef int32_t matched = self.c_match(holder, chain, n)
        cdef int32_t kept, i, e
        cdef uint64_t slot, want
        cdef uint64_t* marks
        cdef Py_ssize_t lo, hi, mid, walked = 0
        if matched <= 0 or evicted <= 0:
            return matched
        marks = <uint64_t*>malloc(matched * sizeof(uint64_t))
        if marks == NULL:
            return PREFIX_NO_MEMORY
        for i in range(matched):
            e = self._find(holder, chain[i], &slot)
            marks[i] = (<uint64_t><uint32_t>e << 32) | <uint32_t>i
        qsort(marks, matched, sizeof(uint64_t), _compare_u64)
        kept = matched
        e = self._holders[holder].tail
        while walked < evicted and e != PREFIX_NONE:
            want = <uint64_t><uint32_t>e << 32
            lo, hi = 0, matched
            while lo < hi:  # the first mark at or past this entry
                mid = (lo + hi) // 2
                if marks[mid] < want:
                    lo = mid + 1
                else:
                    hi = mid
            if lo < matched and (marks[lo] >> 32) == (want >> 32):
                i = <int32_t><uint32_t>marks[lo]
                if i < kept:
                    kept = i
            e = self._entries[e].prev
            walked += 1
        free(marks)
        return kept

    cdef int c_match_after_many(self, int32_t holder, const uint64_t** chains, const Py_ssize_t* lengths,
                                Py_ssize_t n_chains, const Py_ssize_t* evicted, Py_ssize_t n_evicted,
                                int32_t* out) noexcept nogil:
        # The max(evicted) oldest entries walked first into a small table of key -> age rank (0:
        # the oldest; _aged.pxd), then each chain's matched blocks looked up there in order: the
        # first block ranked below a count is where its match would end for that count. Its cost
        # is the walk (short: what a request allocates past the empty blocks) and one probe of a
        # table that fits in cache per block matched.
        cdef Py_ssize_t i, j, most = 0, walked = 0, size
        cdef uint64_t* keys
        cdef int32_t* ranks
        cdef int32_t matched, e
        for j in range(n_evicted):
            if evicted[j] > most:
                most = evicted[j]
        for i in range(n_chains):
            matched = self.c_match(holder, chains[i], lengths[i])
            for j in range(n_evicted):
                out[i * n_evicted + j] = matched if matched > 0 else 0
        if most > self._holders[holder].size:
            most = self._holders[holder].size
        if most <= 0:
            return 0
        size = aged_size(most)
        keys = <uint64_t*>malloc(size * sizeof(uint64_t))
        ranks = <int32_t*>malloc(size * sizeof(int32_t))
        if keys == NULL or ranks == NULL:
            free(keys)
            free(ranks)
            return PREFIX_NO_MEMORY
        aged_clear(ranks, size)
        e = self._holders[holder].tail
        while walked < most and e != PREFIX_NONE:
            aged_put(keys, ranks, <uint64_t>(size - 1), self._entries[e].key, <int32_t>walked)
            e = self._entries[e].prev
            walked += 1
        aged_cut(chains, n_chains, evicted, n_evicted, out, keys, ranks, <uint64_t>(size - 1))
        free(keys)
        free(ranks)
        return 0

    cdef int32_t c_match(self, int32_t holder, const uint64_t* chain, Py_ssize_t n) noexcept nogil:
        cdef Py_ssize_t lo = 0, k = 1, mid
        if holder < 0 or holder >= self._n_holders or not self._holders[holder].in_use:
            return PREFIX_NO_HOLDER
        if n > _MAX_CHAIN:
            n = _MAX_CHAIN
        if n == 0 or self._holders[holder].size == 0:
            return 0
        # gallop: does the holder keep the first 1, 2, 4, ... blocks (the last one, by the prefix property)?
        while True:
            if k > n:
                k = n
            if not self._holds(holder, chain[k - 1]):
                break
            lo = k
            if k == n:
                return <int32_t>n
            k *= 2
        # bisect: the first `lo` blocks are kept, block k - 1 is not
        while k - lo > 1:
            mid = lo + (k - lo) // 2
            if self._holds(holder, chain[mid - 1]):
                lo = mid
            else:
                k = mid
        return <int32_t>lo

    cdef void c_match_all(self, const uint64_t* chain, Py_ssize_t n, int32_t* out) noexcept nogil:
        cdef int32_t h
        if n > 0:
            # most holders miss on the first probe: start all their first loads at once
            for h in range(self._n_holders):
                if self._holders[h].in_use:
                    prefix_prefetch(&self._slots[_slot_hash(chain[0], h) & self._mask])
        for h in range(self._n_holders):
            out[h] = self.c_match(h, chain, n) if self._holders[h].in_use else 0

    cdef Py_ssize_t c_price(self, const uint64_t* chain, Py_ssize_t n_chain, const prefix_fleet_t* fleet,
                            const prefix_request_t* request, prefix_costs_t* costs,
                            Py_ssize_t* n_near) noexcept nogil:
        # The twin does the same float operations in the same order (Python's min and max
        # included: the first argument unless the second is strictly past it), so both give
        # equal costs, not only close ones. A spread is added only where it applies, so without
        # one every cost is the same double as before the term existed.
        cdef Py_ssize_t i, best = -1, near = 0, n_candidates = 0, home = -1
        cdef int32_t h, matched
        cdef int64_t blocks, history = request.history_blocks
        cdef double cached, uncached, spt, queued, wait, cost, load, best_cost = 0.0, slack, limit, most
        cdef double recent, recent_sum = 0.0, mean = 0.0, excess, spread, shared
        # a new conversation's messages before its last: the prefix others may have sent (a system or tool prompt)
        cdef double opening_history = (<double>request.history_blocks) * request.block_tokens
        cdef bint spreading = fleet.recent != NULL and request.spread_tokens > 0.0
        cdef uint8_t flags
        if request.history_from_all and request.last >= 0:
            # a keyed session's replica holds whatever of this prompt any replica holds
            for i in range(fleet.n):
                h = fleet.holders[i]
                if 0 <= h < self._n_holders and self._holders[h].in_use:
                    matched = self.c_match(h, chain, n_chain)
                    if matched > history:
                        history = matched
        if n_chain > 0:
            # most holders miss on the first probe: start all their first loads at once
            for i in range(fleet.n):
                h = fleet.holders[i]
                if not fleet.excluded[i] and 0 <= h < self._n_holders:
                    prefix_prefetch(&self._slots[_slot_hash(chain[0], h) & self._mask])
        if spreading:
            # the candidates' mean of recent requests, gated ones included, in position order
            for i in range(fleet.n):
                if not fleet.excluded[i]:
                    recent_sum = recent_sum + fleet.recent[i] * request.recent_scale
                    n_candidates += 1
            if n_candidates > 0:
                mean = recent_sum / <double>n_candidates
        for i in range(fleet.n):
            if fleet.excluded[i]:
                continue
            h = fleet.holders[i]
            if fleet.known != NULL and fleet.known[i] >= 0.0:
                cached = fleet.known[i]  # what its engine says it holds: no model, no history credit
            else:
                matched = self.c_match(h, chain, n_chain) if h >= 0 else 0
                blocks = matched if matched > 0 else 0
                if i == request.last and history > blocks:
                    blocks = history
                cached = <double>blocks * request.block_tokens
            if request.total_tokens < cached:
                cached = request.total_tokens
            uncached = request.total_tokens - cached
            spt = fleet.seconds_per_token[i]
            load = <double>fleet.loads[i]
            if request.interference != 0.0:
                spt = spt * (1.0 + request.interference * load)
            queued = fleet.busy_until[i] - request.now
            wait = (queued if queued > 0.0 else 0.0) + load * request.decode_s
            if fleet.waiting[i] >= 0.0 and fleet.waiting[i] > load:  # queued there by someone else
                wait = wait + (fleet.waiting[i] - load) * request.mean_uncached * spt
            cost = wait + uncached * spt
            spread = 0.0
            if spreading and i != request.last and request.total_tokens > 0.0:
                recent = fleet.recent[i] * request.recent_scale
                if recent > mean:
                    # spread_tokens of prefill per unit of excess, times the share of the prompt it computes
                    excess = (recent - mean) / (mean + <double>PREFIX_SPREAD_SMOOTH)
                    if request.spread_whole:
                        # a new conversation: charged whole, and at least what the shared prefix there saves it
                        shared = opening_history if opening_history < cached else cached
                        spread = ((((shared if shared > request.spread_tokens else request.spread_tokens) * spt)
                                   * excess) * request.total_tokens) / request.total_tokens
                    else:
                        spread = ((((request.spread_tokens * spt) * excess) * uncached) / request.total_tokens)
                    cost = cost + spread
            if fleet.evicts != NULL and fleet.evicts[i] != 0.0:
                cost = cost + fleet.evicts[i]  # what it pushes out of conversations likely back soon
            flags = PREFIX_CANDIDATE
            if fleet.loads[i] >= fleet.caps[i]:
                flags |= PREFIX_GATED
            elif best < 0 or cost < best_cost:
                best = i
                best_cost = cost
            costs.cached[i] = cached
            costs.wait[i] = wait
            costs.cost[i] = cost
            costs.flags[i] = flags
            if costs.spread != NULL:
                costs.spread[i] = spread
        if best >= 0:
            slack = request.tie_s
            if best_cost * request.tie_share > slack:
                slack = best_cost * request.tie_share
            limit = best_cost + slack
            for i in range(fleet.n):
                if (not fleet.excluded[i] and not (costs.flags[i] & PREFIX_GATED)
                        and costs.cost[i] <= limit):
                    costs.flags[i] |= PREFIX_NEAR
                    near += 1
        if request.home_share >= 0.0:
            most = request.home_share * request.total_tokens
            for i in range(fleet.n):
                if not fleet.excluded[i] and costs.cached[i] >= most and costs.cached[i] > 0.0:
                    home = i
                    most = costs.cached[i]
        costs.home = home
        n_near[0] = near
        return best

    cdef Py_ssize_t c_insert(self, int32_t holder, const uint64_t* chain, Py_ssize_t n) noexcept nogil:
        return self._insert(holder, chain, NULL, n)

    cdef Py_ssize_t c_insert_aliased(self, int32_t holder, const uint64_t* chain, const uint64_t* aliases,
                                     Py_ssize_t n) noexcept nogil:
        return self._insert(holder, chain, aliases, n)

    cdef Py_ssize_t _insert(self, int32_t holder, const uint64_t* chain, const uint64_t* aliases,
                            Py_ssize_t n) noexcept nogil:
        cdef prefix_holder_t* hd
        cdef Py_ssize_t i, added = 0
        cdef uint64_t slot
        cdef int32_t e, ahead
        cdef bint failed = False
        if holder < 0 or holder >= self._n_holders or not self._holders[holder].in_use:
            return PREFIX_NO_HOLDER
        hd = &self._holders[holder]
        i = n - 1
        while i >= 0:
            # Two stages of prefetch, so the walk down the chain is not one cache miss at a
            # time: the slot of the block _AHEAD further, the entry of the block _AHEAD/2 further.
            if i >= _AHEAD:
                prefix_prefetch(&self._slots[_slot_hash(chain[i - _AHEAD], holder) & self._mask])
            if i >= _AHEAD // 2:
                ahead = self._slots[_slot_hash(chain[i - _AHEAD // 2], holder) & self._mask]
                if ahead != PREFIX_NONE:
                    prefix_prefetch(&self._entries[ahead])
            e = self._find(holder, chain[i], &slot)
            if e == PREFIX_NONE:
                e = self._add(holder, chain[i], slot)
                if e == PREFIX_NO_MEMORY:
                    failed = True
                    break
                added += 1
            elif hd.head != e:
                _unlink(self._entries, hd, e)
                _link_front(self._entries, hd, e)
            if aliases != NULL and not self._alias(e, aliases[i]):
                failed = True
                break
            i -= 1
        while hd.size > hd.capacity:
            # the tail walks toward the head: fetch the next tail's slot and the one after it
            e = self._entries[hd.tail].prev
            if e != PREFIX_NONE:
                prefix_prefetch(&self._slots[_slot_hash(self._entries[e].key, holder) & self._mask])
                if self._entries[e].prev != PREFIX_NONE:
                    prefix_prefetch(&self._entries[self._entries[e].prev])
            self._drop(hd.tail)
        return PREFIX_NO_MEMORY if failed else added

    cdef Py_ssize_t c_truncate(self, int32_t holder, const uint64_t* chain, Py_ssize_t n,
                               Py_ssize_t keep) noexcept nogil:
        cdef Py_ssize_t i, dropped = 0
        cdef uint64_t slot
        cdef int32_t e
        if holder < 0 or holder >= self._n_holders or not self._holders[holder].in_use:
            return PREFIX_NO_HOLDER
        for i in range(keep, n):
            e = self._find(holder, chain[i], &slot)
            if e != PREFIX_NONE:
                self._drop(e)
                dropped += 1
        return dropped

    cdef Py_ssize_t c_evict(self, int32_t holder, Py_ssize_t count) noexcept nogil:
        cdef Py_ssize_t dropped = 0
        if holder < 0 or holder >= self._n_holders or not self._holders[holder].in_use:
            return PREFIX_NO_HOLDER
        while dropped < count and self._holders[holder].tail != PREFIX_NONE:
            self._drop(self._holders[holder].tail)
            dropped += 1
        return dropped

    cdef Py_ssize_t c_forget(self, int32_t holder, const uint64_t* aliases, Py_ssize_t n) noexcept nogil:
        cdef Py_ssize_t i, dropped = 0
        cdef uint64_t slot
        cdef int32_t e
        if holder < 0 or holder >= self._n_holders or not self._holders[holder].in_use:
            return PREFIX_NO_HOLDER
        if self._aslots == NULL:
            return 0
        for i in range(n):
            e = self._afind(holder, aliases[i], &slot)
            if e != PREFIX_NONE:
                self._drop(e)
                dropped += 1
        return dropped

    cdef int32_t c_named(self, int32_t holder, uint64_t alias) noexcept nogil:
        cdef uint64_t slot
        if holder < 0 or holder >= self._n_holders or not self._holders[holder].in_use:
            return PREFIX_NO_HOLDER
        if self._aslots == NULL:
            return PREFIX_NONE
        return self._afind(holder, alias, &slot)

    # -- engines' names: a second table over the same entries ------------------------------------

    cdef int32_t _afind(self, int32_t holder, uint64_t alias, uint64_t* slot) noexcept nogil:
        # The entry `holder`'s engine names `alias`, or PREFIX_NONE; `slot` as _find's.
        cdef uint64_t i = _slot_hash(alias, holder) & self._amask
        cdef int32_t e
        while True:
            e = self._aslots[i]
            if e == PREFIX_NONE or (self._aliases[e] == alias and self._entries[e].holder == holder):
                slot[0] = i
                return e
            i = (i + 1) & self._amask

    cdef bint _alias(self, int32_t e, uint64_t alias) noexcept nogil:
        # Names entry e `alias` in its holder; False when a table could not grow (e keeps no name).
        cdef int32_t holder = self._entries[e].holder, other
        cdef uint64_t slot
        if self._aslots == NULL:
            self._aslots = <int32_t*>malloc(sizeof(int32_t) * _MIN_SLOTS)
            self._aliases = <uint64_t*>malloc(sizeof(uint64_t) * <size_t>(self._n_entries if self._n_entries else 1))
            if self._aslots == NULL or self._aliases == NULL:
                free(self._aslots)
                free(self._aliases)
                self._aslots = NULL
                self._aliases = NULL
                return False
            memset(self._aslots, 0xFF, sizeof(int32_t) * _MIN_SLOTS)
            self._amask = _MIN_SLOTS - 1
        if self._entries[e].aliased:
            if self._aliases[e] == alias:
                return True
            self._unalias(e)
        other = self._afind(holder, alias, &slot)
        if other != PREFIX_NONE:  # the name moves to this block
            self._unalias(other)
            self._afind(holder, alias, &slot)
        if 2 * (self._n_aliased + 1) > <int64_t>(self._amask + 1):
            if not self._grow_aliases():
                return False
            self._afind(holder, alias, &slot)
        self._aliases[e] = alias
        self._entries[e].aliased = 1
        self._aslots[slot] = e
        self._n_aliased += 1
        return True

    cdef void _unalias(self, int32_t e) noexcept nogil:
        # Takes entry e's name out of the alias table.
        cdef uint64_t hole
        self._afind(self._entries[e].holder, self._aliases[e], &hole)
        _vacate(self._aslots, self._amask, hole, self._entries, self._aliases)
        self._entries[e].aliased = 0
        self._n_aliased -= 1

    cdef bint _grow_aliases(self) noexcept nogil:
        cdef int32_t* slots = _doubled(self._aslots, self._amask, self._entries, self._aliases)
        if slots == NULL:
            return False
        free(self._aslots)
        self._aslots = slots
        self._amask = 2 * self._amask + 1
        return True
