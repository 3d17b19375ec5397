# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, always_allow_keywords=False, embedsignature=True
"""Consistent-hash ring with virtual nodes, XXH3-64 keys and bounded loads (compiled core).

Replica ``r`` owns ``vnodes`` points on a 64-bit ring; point ``i`` sits at
``xxh3_64(f"{r}#{i}", seed)``. A key hashes with the same function and goes to the owner of
the first point at or after its hash, wrapping past the top. A replica of weight ``w`` places
only its first ``ceil(w * vnodes)`` points, so a weight change moves just the keys of the
toggled points. Unavailable replicas place none, which sends their keys to the next replica
clockwise, exactly as if they had left.

Bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads",
2016): with total load ``m`` over ``n`` routing replicas, a replica takes a new request only
while its load is below ``ceil(c * (m + 1) / n)``; otherwise the walk moves on clockwise.
Example: 4 replicas, loads [5, 0, 0, 0], c = 1.25 -> cap = ceil(1.25 * 6 / 4) = 2, so a key
whose ring owner is replica 0 spills to the next replica clockwise.

Every published ``RingSnapshot`` is immutable: a mutation builds a new one off to the side,
swaps ``Ring.current`` and reports the hash ranges whose owner changed. Readers, including
``nogil`` code that cimports this module, keep whatever snapshot they started with.

DO NOT CHANGE the vnode label format, the hash function or how weights pick vnodes: any of
them silently remaps every session of every fleet, and other proxies must agree with us.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_Check
from cpython cimport array
from cpython.object cimport PyObject
from libc.math cimport ceil
from libc.stdint cimport INT64_MAX, UINT64_MAX, uint32_t
from libc.stdlib cimport free, malloc, qsort
from libc.string cimport memcpy, memset

import array as _array
import math
from collections import namedtuple

__all__ = ["MovedRange", "Ring", "active_vnodes", "xxh3_64"]

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if !defined(__SIZEOF_INT128__)
    #error "_ring needs a compiler with 128-bit integers (gcc or clang on a 64-bit target)"
    #endif
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    #define RING_LE64(x) __builtin_bswap64(x)
    #define RING_LE32(x) __builtin_bswap32(x)
    #else
    #define RING_LE64(x) (x)
    #define RING_LE32(x) (x)
    #endif
    /* XXH3 reads every word little-endian, whatever the host. */
    static inline uint64_t ring_read64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return RING_LE64(v); }
    static inline uint32_t ring_read32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return RING_LE32(v); }
    static inline void ring_write64(uint8_t *p, uint64_t v) { v = RING_LE64(v); memcpy(p, &v, 8); }
    static inline uint64_t ring_bswap64(uint64_t x) { return __builtin_bswap64(x); }
    static inline uint32_t ring_bswap32(uint32_t x) { return __builtin_bswap32(x); }
    static inline uint64_t ring_rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
    static inline uint64_t ring_mul128_fold64(uint64_t a, uint64_t b) {
        __uint128_t r = (__uint128_t)a * b;
        return (uint64_t)r ^ (uint64_t)(r >> 64);
    }
    /* Key bytes without a call: compact ASCII str is already its UTF-8, bytes are themselves. */
    static inline const uint8_t *ring_fast_key(PyObject *k, Py_ssize_t *n) {
        if (PyUnicode_CheckExact(k) && PyUnicode_IS_COMPACT_ASCII(k)) {
            *n = PyUnicode_GET_LENGTH(k);
            return (const uint8_t *)PyUnicode_DATA(k);
        }
        if (PyBytes_CheckExact(k)) {
            *n = PyBytes_GET_SIZE(k);
            return (const uint8_t *)PyBytes_AS_STRING(k);
        }
        return NULL;
    }
    static inline void ring_prefetch(const void *p) { __builtin_prefetch(p); }
    static const uint64_t RING_P32_1 = 0x9E3779B1ULL;
    static const uint64_t RING_P32_2 = 0x85EBCA77ULL;
    static const uint64_t RING_P32_3 = 0xC2B2AE3DULL;
    static const uint64_t RING_P64_1 = 0x9E3779B185EBCA87ULL;
    static const uint64_t RING_P64_2 = 0xC2B2AE3D27D4EB4FULL;
    static const uint64_t RING_P64_3 = 0x165667B19E3779F9ULL;
    static const uint64_t RING_P64_4 = 0x85EBCA77C2B2AE63ULL;
    static const uint64_t RING_P64_5 = 0x27D4EB2F165667C5ULL;
    static const uint64_t RING_PMX_1 = 0x165667919E3779F9ULL;
    static const uint64_t RING_PMX_2 = 0x9FB21C651E98DF25ULL;
    /* XXH3's default secret, from the algorithm's specification. */
    static const uint8_t RING_DEFAULT_SECRET[192] = {
      0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
      0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
      0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
      0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
      0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
      0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
      0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
      0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
      0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
      0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
      0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
      0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
    };
    """
    const uint8_t* ring_fast_key(object k, Py_ssize_t* n) noexcept
    const uint8_t* ring_fast_key_ptr "ring_fast_key"(PyObject* k, Py_ssize_t* n) noexcept
    PyObject* ring_list_item "PyList_GET_ITEM"(object lst, Py_ssize_t i) noexcept
    void ring_prefetch(const void* p) noexcept nogil
    uint64_t ring_read64(const uint8_t* p) noexcept nogil
    uint32_t ring_read32(const uint8_t* p) noexcept nogil
    void ring_write64(uint8_t* p, uint64_t v) noexcept nogil
    uint64_t ring_bswap64(uint64_t x) noexcept nogil
    uint32_t ring_bswap32(uint32_t x) noexcept nogil
    uint64_t ring_rotl64(uint64_t x, int r) noexcept nogil
    uint64_t ring_mul128_fold64(uint64_t a, uint64_t b) noexcept nogil
    const uint64_t RING_P32_1, RING_P32_2, RING_P32_3
    const uint64_t RING_P64_1, RING_P64_2, RING_P64_3, RING_P64_4, RING_P64_5
    const uint64_t RING_PMX_1, RING_PMX_2
    const uint8_t RING_DEFAULT_SECRET[192]

cdef enum:
    _MAX_BUCKET_BITS = 20        # bucket table of at most 4 MiB; larger rings bisect within buckets
    _MAX_VNODES = 65536
    _MAX_POINTS = 0x7FFFFFFF - 8  # int32 point indices, plus the RING_SCAN sentinels
    _BATCH = 64                  # lookup_many hashes this many keys, then searches for them


# ---------------------------------------------------------------------------------------------
# XXH3-64, following the algorithm's published specification (doc/xxhash_spec.md in xxHash).

cdef inline uint64_t _avalanche(uint64_t h) noexcept nogil:
    h ^= h >> 37
    h *= RING_PMX_1
    return h ^ (h >> 32)


cdef inline uint64_t _avalanche_xxh64(uint64_t h) noexcept nogil:
    h ^= h >> 33
    h *= RING_P64_2
    h ^= h >> 29
    h *= RING_P64_3
    return h ^ (h >> 32)


cdef inline uint64_t _mix16(const uint8_t* p, const uint8_t* s, uint64_t seed) noexcept nogil:
    return ring_mul128_fold64(ring_read64(p) ^ (ring_read64(s) + seed),
                              ring_read64(p + 8) ^ (ring_read64(s + 8) - seed))


cdef inline uint64_t _len_1to3(const uint8_t* p, size_t n, uint64_t seed) noexcept nogil:
    cdef uint32_t combined = ((<uint32_t>p[0] << 16) | (<uint32_t>p[n >> 1] << 24)
                              | <uint32_t>p[n - 1] | (<uint32_t>n << 8))
    cdef uint64_t flip = (<uint64_t>(ring_read32(RING_DEFAULT_SECRET) ^
                                     ring_read32(RING_DEFAULT_SECRET + 4))) + seed
    return _avalanche_xxh64(<uint64_t>combined ^ flip)


cdef inline uint64_t _len_4to8(const uint8_t* p, size_t n, uint64_t seed) noexcept nogil:
    seed ^= (<uint64_t>ring_bswap32(<uint32_t>seed)) << 32
    cdef uint64_t flip = (ring_read64(RING_DEFAULT_SECRET + 8) ^
                          ring_read64(RING_DEFAULT_SECRET + 16)) - seed
    cdef uint64_t h = (<uint64_t>ring_read32(p + n - 4) + ((<uint64_t>ring_read32(p)) << 32)) ^ flip
    # rrmxmx: a stronger finaliser, since this class folds 8 bytes with no multiply of its own
    h ^= ring_rotl64(h, 49) ^ ring_rotl64(h, 24)
    h *= RING_PMX_2
    h ^= (h >> 35) + n
    h *= RING_PMX_2
    return h ^ (h >> 28)


cdef inline uint64_t _len_9to16(const uint8_t* p, size_t n, uint64_t seed) noexcept nogil:
    cdef uint64_t lo = ring_read64(p) ^ ((ring_read64(RING_DEFAULT_SECRET + 24) ^
                                           ring_read64(RING_DEFAULT_SECRET + 32)) + seed)
    cdef uint64_t hi = ring_read64(p + n - 8) ^ ((ring_read64(RING_DEFAULT_SECRET + 40) ^
                                                   ring_read64(RING_DEFAULT_SECRET + 48)) - seed)
    return _avalanche(n + ring_bswap64(lo) + hi + ring_mul128_fold64(lo, hi))


cdef inline uint64_t _len_17to128(const uint8_t* p, size_t n, uint64_t seed) noexcept nogil:
    # Pairs of 16-byte chunks from both ends, inward, until they cover the input.
    cdef const uint8_t* s = RING_DEFAULT_SECRET
    cdef uint64_t acc = n * RING_P64_1
    if n > 32:
        if n > 64:
            if n > 96:
                acc += _mix16(p + 48, s + 96, seed)
                acc += _mix16(p + n - 64, s + 112, seed)
            acc += _mix16(p + 32, s + 64, seed)
            acc += _mix16(p + n - 48, s + 80, seed)
        acc += _mix16(p + 16, s + 32, seed)
        acc += _mix16(p + n - 32, s + 48, seed)
    acc += _mix16(p, s, seed)
    acc += _mix16(p + n - 16, s + 16, seed)
    return _avalanche(acc)


cdef inline uint64_t _len_129to240(const uint8_t* p, size_t n, uint64_t seed) noexcept nogil:
    cdef const uint8_t* s = RING_DEFAULT_SECRET
    cdef uint64_t acc = n * RING_P64_1
    cdef size_t i, rounds = n >> 4
    for i in range(8):
        acc += _mix16(p + 16 * i, s + 16 * i, seed)
    acc = _avalanche(acc)
    for i in range(8, rounds):
        acc += _mix16(p + 16 * i, s + 16 * (i - 8) + 3, seed)
    acc += _mix16(p + n - 16, s + 119, seed)
    return _avalanche(acc)


cdef inline void _accumulate_stripe(uint64_t* acc, const uint8_t* p, const uint8_t* s) noexcept nogil:
    cdef int i
    cdef uint64_t value, key
    for i in range(8):
        value = ring_read64(p + 8 * i)
        key = value ^ ring_read64(s + 8 * i)
        acc[i ^ 1] += value
        acc[i] += (key & 0xFFFFFFFFULL) * (key >> 32)


cdef inline void _scramble(uint64_t* acc, const uint8_t* s) noexcept nogil:
    cdef int i
    for i in range(8):
        acc[i] ^= acc[i] >> 47
        acc[i] ^= ring_read64(s + 8 * i)
        acc[i] *= RING_P32_1


cdef uint64_t _hash_long(const uint8_t* p, size_t n, const uint8_t* s) noexcept nogil:
    # Blocks of 16 stripes of 64 bytes, scrambled after each block; the last block (full or
    # not) and the last 64 bytes are accumulated at the end, then the 8 lanes are merged.
    cdef uint64_t acc[8]
    acc[0] = RING_P32_3
    acc[1] = RING_P64_1
    acc[2] = RING_P64_2
    acc[3] = RING_P64_3
    acc[4] = RING_P64_4
    acc[5] = RING_P32_2
    acc[6] = RING_P64_5
    acc[7] = RING_P32_1
    cdef size_t stripes_per_block = (RING_SECRET_SIZE - 64) // 8
    cdef size_t block_len = 64 * stripes_per_block
    cdef size_t blocks = (n - 1) // block_len
    cdef size_t b, k, stripes
    for b in range(blocks):
        for k in range(stripes_per_block):
            _accumulate_stripe(acc, p + b * block_len + k * 64, s + k * 8)
        _scramble(acc, s + RING_SECRET_SIZE - 64)
    stripes = ((n - 1) - block_len * blocks) // 64
    for k in range(stripes):
        _accumulate_stripe(acc, p + blocks * block_len + k * 64, s + k * 8)
    _accumulate_stripe(acc, p + n - 64, s + RING_SECRET_SIZE - 64 - 7)
    cdef uint64_t result = n * RING_P64_1
    for k in range(4):
        result += ring_mul128_fold64(acc[2 * k] ^ ring_read64(s + 11 + 16 * k),
                                     acc[2 * k + 1] ^ ring_read64(s + 11 + 16 * k + 8))
    return _avalanche(result)


cdef void ring_derive_secret(uint64_t seed, uint8_t* out) noexcept nogil:
    cdef int i
    for i in range(RING_SECRET_SIZE // 16):
        ring_write64(out + 16 * i, ring_read64(RING_DEFAULT_SECRET + 16 * i) + seed)
        ring_write64(out + 16 * i + 8, ring_read64(RING_DEFAULT_SECRET + 16 * i + 8) - seed)


cdef uint64_t ring_xxh3_64(const uint8_t* p, size_t n, uint64_t seed,
                           const uint8_t* secret) noexcept nogil:
    if n <= 16:
        if n > 8:
            return _len_9to16(p, n, seed)
        if n >= 4:
            return _len_4to8(p, n, seed)
        if n > 0:
            return _len_1to3(p, n, seed)
        return _avalanche_xxh64(seed ^ ring_read64(RING_DEFAULT_SECRET + 56)
                                ^ ring_read64(RING_DEFAULT_SECRET + 64))
    if n <= 128:
        return _len_17to128(p, n, seed)
    if n <= 240:
        return _len_129to240(p, n, seed)
    return _hash_long(p, n, secret)


# ---------------------------------------------------------------------------------------------
# Walks.

cdef int64_t ring_routing_load(const ring_view_t* v, const int64_t* loads) noexcept nogil:
    # saturates at INT64_MAX rather than wrapping
    cdef int64_t total = 0
    cdef int32_t i
    for i in range(v.n_replicas):
        if v.routing[i]:
            if loads[i] > INT64_MAX - total:
                return INT64_MAX
            total += loads[i]
    return total


cdef int64_t ring_load_cap(const ring_view_t* v, int64_t total_load, double c) noexcept nogil:
    # ceil(c * (L + 1) / n), never below the exact integer ceil((L + 1) / n) = L // n + 1 (so
    # some replica is always under it, even where doubles lose precision), saturating at INT64_MAX.
    cdef double f
    cdef int64_t cap, floor_cap
    if v.n_routing == 0:
        return 0
    if total_load == INT64_MAX:  # saturated: the true mean is unknown, so nothing is over it
        return INT64_MAX
    floor_cap = total_load // v.n_routing + 1
    f = ceil(c * (<double>total_load + 1.0) / <double>v.n_routing)
    cap = INT64_MAX if f >= 9223372036854775807.0 else <int64_t>f
    return cap if cap > floor_cap else floor_cap


cdef int32_t ring_lookup_bounded_hash(const ring_view_t* v, uint64_t h, const int64_t* loads,
                                      int64_t cap) noexcept nogil:
    cdef int32_t i = ring_point_index(v, h)
    cdef int32_t step, owner
    if i < 0:
        return RING_NO_REPLICA
    for step in range(v.n_points):
        owner = v.owners[i]
        if loads[owner] < cap:
            return owner
        i += 1
        if i == v.n_points:
            i = 0
    return RING_NO_REPLICA


cdef int32_t ring_lookup_excluding_hash(const ring_view_t* v, uint64_t h,
                                        const uint8_t* excluded) noexcept nogil:
    cdef int32_t i = ring_point_index(v, h)
    cdef int32_t step, owner
    if i < 0:
        return RING_NO_REPLICA
    for step in range(v.n_points):
        owner = v.owners[i]
        if not excluded[owner]:
            return owner
        i += 1
        if i == v.n_points:
            i = 0
    return RING_NO_REPLICA


# ---------------------------------------------------------------------------------------------
# Python face.

class MovedRange(namedtuple("MovedRange", "lo hi old new")):
    """Keys whose hash lies in [lo, hi] moved from replica id `old` to `new` (None: nobody)."""
    __slots__ = ()

    @property
    def width(self):
        return self.hi - self.lo + 1


cdef array.array _INT64 = _array.array("q")
cdef uint64_t _RING_SPAN_MAX = UINT64_MAX


cdef uint64_t _hash_any(object key, uint64_t seed, const uint8_t* secret) except? 0:
    cdef Py_ssize_t n
    cdef const uint8_t* p
    cdef Py_buffer view
    cdef uint64_t h
    if PyUnicode_Check(key):
        p = <const uint8_t*>PyUnicode_AsUTF8AndSize(key, &n)
        return ring_xxh3_64(p, <size_t>n, seed, secret)
    if PyBytes_Check(key):
        return ring_xxh3_64(<const uint8_t*>PyBytes_AS_STRING(key),
                            <size_t>PyBytes_GET_SIZE(key), seed, secret)
    try:
        PyObject_GetBuffer(key, &view, PyBUF_SIMPLE)
    except TypeError:
        raise TypeError(f"keys must be str or bytes-like, not {type(key).__name__}") from None
    try:
        h = ring_xxh3_64(<const uint8_t*>view.buf, <size_t>view.len, seed, secret)
    finally:
        PyBuffer_Release(&view)
    return h


cdef uint64_t _seed_value(object seed) except? 0:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    if not 0 <= seed <= 0xFFFFFFFFFFFFFFFF:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return <uint64_t>seed


def xxh3_64(data, seed=0):
    """XXH3-64 of `data` (bytes-like, or str as UTF-8), equal to xxhash.xxh3_64_intdigest."""
    cdef uint64_t s = _seed_value(seed)
    cdef uint8_t secret[RING_SECRET_SIZE]
    if s == 0:
        return _hash_any(data, 0, RING_DEFAULT_SECRET)
    ring_derive_secret(s, secret)
    return _hash_any(data, s, secret)


cdef class RingSnapshot:
    """One immutable, published state of a ring: points, bucket table, routing flags."""

    def __dealloc__(self):
        free(self._points)
        free(self._hashes)
        free(self._owners)
        free(self._bucket)
        free(self._routing)

    @property
    def size(self):
        """Number of points that route in this snapshot."""
        return self.view.n_points


cdef RingSnapshot _new_snapshot(tuple ids, int32_t n_points, uint64_t seed, const uint8_t* secret):
    cdef RingSnapshot s = RingSnapshot.__new__(RingSnapshot)
    cdef int32_t n = <int32_t>len(ids)
    cdef int bits = 1
    while (1 << bits) < n_points and bits < _MAX_BUCKET_BITS:
        bits += 1
    s.replica_ids = ids
    s._points = <ring_point_t*>malloc(sizeof(ring_point_t) * (n_points if n_points else 1))
    s._hashes = <uint64_t*>malloc(sizeof(uint64_t) * (n_points + RING_SCAN))
    s._owners = <int32_t*>malloc(sizeof(int32_t) * (n_points if n_points else 1))
    s._bucket = <int32_t*>malloc(sizeof(int32_t) * ((1 << bits) + 1))
    s._routing = <uint8_t*>malloc(n if n else 1)
    if (s._points == NULL or s._hashes == NULL or s._owners == NULL or s._bucket == NULL
            or s._routing == NULL):
        raise MemoryError()
    memset(s._routing, 0, n if n else 1)
    memcpy(s._secret, secret, RING_SECRET_SIZE)
    s.view.points = s._points
    s.view.hashes = s._hashes
    s.view.owners = s._owners
    s.view.bucket = s._bucket
    s.view.routing = s._routing
    s.view.secret = s._secret
    s.view.seed = seed
    s.view.n_points = n_points
    s.view.n_replicas = n
    s.view.n_routing = 0
    s.view.shift = 64 - bits
    return s


cdef void _finish_snapshot(RingSnapshot s) noexcept nogil:
    # Bucket table and routing flags, once the points are in place.
    cdef int32_t j = 0, k
    cdef uint64_t b, n_buckets = (<uint64_t>1) << (64 - s.view.shift)
    for k in range(s.view.n_points):
        s._hashes[k] = s._points[k].hash
        s._owners[k] = s._points[k].owner
        if not s._routing[s._owners[k]]:
            s._routing[s._owners[k]] = 1
            s.view.n_routing += 1
    for k in range(RING_SCAN):
        s._hashes[s.view.n_points + k] = _RING_SPAN_MAX
    for b in range(n_buckets):
        while j < s.view.n_points and (s._hashes[j] >> s.view.shift) < b:
            j += 1
        s._bucket[b] = j
    s._bucket[n_buckets] = s.view.n_points


cdef int32_t _index_arg(Ring ring, object index) except -1:
    if not isinstance(index, int) or isinstance(index, bool):
        raise TypeError(f"replica index must be an int, not {type(index).__name__}")
    if not 0 <= index < len(ring._ids):
        raise IndexError(f"replica index {index} out of range for {len(ring._ids)} replicas")
    return <int32_t>index


cdef class Ring:
    """Consistent-hash ring of `replica_ids` with `vnodes` points each, hashed with `seed`."""

    def __cinit__(self):
        self._all = NULL
        self._n_all = 0
        self._ids, self._weights, self._available, self._overrides = [], [], [], {}
        ring_derive_secret(0, self._secret)
        # a Ring whose __init__ never ran (a subclass that forgot it) is an empty ring, not a crash
        self.current = _new_snapshot((), 0, 0, self._secret)
        _finish_snapshot(self.current)

    def __dealloc__(self):
        free(self._all)

    def __init__(self, replica_ids, vnodes=128, seed=0):
        ids = _check_ids(replica_ids)
        if not isinstance(vnodes, int) or isinstance(vnodes, bool):
            raise TypeError(f"vnodes must be an int, not {type(vnodes).__name__}")
        if not 1 <= vnodes <= _MAX_VNODES:
            raise ValueError(f"vnodes must be in [1, {_MAX_VNODES}], got {vnodes}")
        if len(ids) * vnodes > _MAX_POINTS:
            raise ValueError(f"too many points: replicas * vnodes must stay at most {_MAX_POINTS}")
        self.seed = _seed_value(seed)
        self.vnodes = vnodes
        ring_derive_secret(self.seed, self._secret)
        self._ids = ids
        self._weights = [1.0] * len(ids)
        self._available = [True] * len(ids)
        self._overrides = {}
        self._place_all()
        self.current = self._build()

    def __repr__(self):
        return (f"Ring({len(self._ids)} replicas, vnodes={self.vnodes}, seed={self.seed}, "
                f"points={self.current.view.n_points})")

    # -- introspection ----------------------------------------------------------------------

    @property
    def replica_ids(self):
        return tuple(self._ids)

    @property
    def n_replicas(self):
        return len(self._ids)

    @property
    def weights(self):
        return tuple(self._weights)

    @property
    def available(self):
        return tuple(self._available)

    @property
    def overrides(self):
        """{(origin replica id, vnode number): replica id that serves it}."""
        return dict(self._overrides)

    @property
    def size(self):
        """Number of points that route now (active vnodes of available replicas)."""
        return self.current.view.n_points

    def index(self, replica_id):
        """Index of `replica_id` in replica_ids."""
        try:
            return self._ids.index(replica_id)
        except ValueError:
            raise KeyError(f"unknown replica {replica_id!r}") from None

    def shares(self):
        """Each replica's share of the hash space, in replica_ids order (sums to 1 or 0)."""
        cdef RingSnapshot s = self.current
        cdef int32_t k, n = s.view.n_points
        owned = [0] * s.view.n_replicas
        if n == 0:
            return [0.0] * s.view.n_replicas
        # The first point also owns the arc that wraps past the top of the ring.
        owned[s._points[0].owner] = (<object>s._points[0].hash + 1
                                     + (<object>_RING_SPAN_MAX - <object>s._points[n - 1].hash))
        for k in range(1, n):
            owned[s._points[k].owner] += <object>(s._points[k].hash - s._points[k - 1].hash)
        return [x / 18446744073709551616 for x in owned]

    def points(self):
        """The routing points in ring order: (hash, owner index, origin index, vnode number)."""
        cdef RingSnapshot s = self.current
        cdef int32_t k
        return [(s._points[k].hash, s._points[k].owner, s._points[k].origin, s._points[k].vnode)
                for k in range(s.view.n_points)]

    def key_hash(self, key):
        """The ring position of `key`: xxh3_64(key, seed)."""
        return _hash_any(key, self.seed, self._secret)

    # -- lookups ----------------------------------------------------------------------------

    def lookup(self, key):
        """Index of the replica that owns `key` (str or bytes-like), or -1 if none can serve."""
        cdef RingSnapshot s = self.current
        cdef Py_ssize_t n
        cdef const uint8_t* p = ring_fast_key(key, &n)
        if p != NULL:
            return ring_lookup_hash(&s.view, ring_xxh3_64(p, <size_t>n, s.view.seed, s.view.secret))
        return ring_lookup_hash(&s.view, _hash_any(key, s.view.seed, s.view.secret))

    def lookup_hash(self, h):
        """Owner of ring position `h` (an int in [0, 2**64))."""
        cdef RingSnapshot s = self.current
        return ring_lookup_hash(&s.view, _position(h))

    def lookup_many(self, keys):
        """Owners of many keys at once, as array('q'); same answers as lookup()."""
        cdef RingSnapshot s = self.current
        cdef list seq = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t i, j, start, end, n = len(seq), klen
        cdef array.array out = array.clone(_INT64, n, zero=False)
        cdef long long* o = out.data.as_longlongs
        cdef const uint8_t* p
        cdef PyObject* key
        cdef uint64_t hashes[_BATCH]
        # Hash a batch of keys (streaming through the key objects, borrowed: no refcount writes),
        # then search for the whole batch (random reads in the ring): two access patterns that
        # overlap instead of alternating. Keys a batch ahead are prefetched.
        for start in range(0, n, _BATCH):
            end = min(start + _BATCH, n)
            for i in range(start, end):
                if i + _BATCH < n:
                    ring_prefetch(ring_list_item(seq, i + _BATCH))
                key = ring_list_item(seq, i)
                p = ring_fast_key_ptr(key, &klen)
                if p != NULL:
                    hashes[i - start] = ring_xxh3_64(p, <size_t>klen, s.view.seed, s.view.secret)
                else:
                    # may run Python code (a buffer's __buffer__), which could change the list
                    obj = <object>key
                    hashes[i - start] = _hash_any(obj, s.view.seed, s.view.secret)
                    if len(seq) != n:
                        raise RuntimeError("keys changed size during lookup_many")
                ring_prefetch(&s.view.bucket[hashes[i - start] >> s.view.shift])
            for j in range(end - start):
                o[start + j] = ring_lookup_hash(&s.view, hashes[j])
        return out

    def lookup_bounded(self, key, loads, c=1.25):
        """Owner of `key` under bounded loads: the first replica clockwise whose load is below
        ceil(c * (total routing load + 1) / routing replicas). `loads` has one int per replica."""
        cdef RingSnapshot s = self.current
        cdef array.array la = _loads_array(loads, s.view.n_replicas)
        cdef double cc = _check_c(c)
        cdef uint64_t h = _hash_any(key, s.view.seed, s.view.secret)
        cdef const int64_t* lp = <const int64_t*>la.data.as_longlongs
        cdef int64_t cap = ring_load_cap(&s.view, ring_routing_load(&s.view, lp), cc)
        return ring_lookup_bounded_hash(&s.view, h, lp, cap)

    def load_cap(self, loads, c=1.25):
        """The bounded-load cap for these loads: ceil(c * (routing load + 1) / routing replicas)."""
        cdef RingSnapshot s = self.current
        cdef array.array la = _loads_array(loads, s.view.n_replicas)
        cdef double cc = _check_c(c)
        return ring_load_cap(&s.view, ring_routing_load(&s.view, <const int64_t*>la.data.as_longlongs), cc)

    def lookup_excluding(self, key, excluded):
        """Owner of `key` when the replica indices in `excluded` cannot serve (a retry walk)."""
        cdef RingSnapshot s = self.current
        cdef bytearray flags = _exclusion_flags(excluded, s.view.n_replicas)
        cdef uint64_t h = _hash_any(key, s.view.seed, s.view.secret)
        cdef const uint8_t* fp = <const uint8_t*><char*>flags
        return ring_lookup_excluding_hash(&s.view, h, fp)

    def successors(self, key, limit=None):
        """Distinct replicas in ring-walk order from `key`: the owner first, then who takes over
        if it fails, and so on (at most `limit`)."""
        cdef RingSnapshot s = self.current
        cdef uint64_t h = _hash_any(key, s.view.seed, s.view.secret)
        cdef int32_t want = s.view.n_routing if limit is None else max(0, min(int(limit), s.view.n_routing))
        cdef int32_t i = ring_point_index(&s.view, h)
        cdef int32_t step, owner
        cdef bytearray seen = bytearray(s.view.n_replicas)
        out = []
        if i < 0 or want <= 0:
            return out
        for step in range(s.view.n_points):
            owner = s._points[i].owner
            if not seen[owner]:
                seen[owner] = 1
                out.append(owner)
                if len(out) == want:
                    break
            i += 1
            if i == s.view.n_points:
                i = 0
        return out

    def locate(self, key):
        """(owner index, origin replica index, vnode number) of the point `key` lands on, or
        None on an empty ring. Origin and vnode name the point for per-vnode counters."""
        cdef RingSnapshot s = self.current
        cdef int32_t i = ring_point_index(&s.view, _hash_any(key, s.view.seed, s.view.secret))
        if i < 0:
            return None
        return (s._points[i].owner, s._points[i].origin, s._points[i].vnode)

    # -- mutations: each publishes a new snapshot and returns what moved --------------------

    def set_weight(self, index, weight):
        """Activate the first ceil(weight * vnodes) vnodes of replica `index` (weight in [0, 1])."""
        cdef int32_t i = _index_arg(self, index)
        self._weights[i] = _check_weight(weight)
        return self._publish()

    def set_available(self, index, available):
        """Take replica `index` in or out of routing; its keys go to the next replica clockwise."""
        cdef int32_t i = _index_arg(self, index)
        self._available[i] = bool(available)
        return self._publish()

    def add_replica(self, replica_id, weight=1.0, available=True):
        """Append a replica (index n_replicas - 1); only keys landing on its points move."""
        ids = _check_ids(self._ids + [replica_id])
        w = _check_weight(weight)
        flag = bool(available)
        if len(ids) * self.vnodes > _MAX_POINTS:
            raise ValueError(f"too many points: replicas * vnodes must stay at most {_MAX_POINTS}")
        self._ids = ids
        self._weights.append(w)
        self._available.append(flag)
        self._place_all()
        return self._publish()

    def add_replicas(self, replica_ids, weights=None, available=None):
        """Append several replicas at once, in order (weights and availability per replica; all
        1.0 and True by default): one placement of the points and one snapshot for them all,
        where add_replica for each places every point again (a worker that joins a thousand
        replicas). Only keys landing on their points move."""
        new = list(replica_ids)
        ws = [1.0] * len(new) if weights is None else [_check_weight(w) for w in weights]
        flags = [True] * len(new) if available is None else [bool(a) for a in available]
        if len(ws) != len(new) or len(flags) != len(new):
            raise ValueError(f"weights and available must have one entry per replica ({len(new)})")
        ids = _check_ids(self._ids + new)
        if len(ids) * self.vnodes > _MAX_POINTS:
            raise ValueError(f"too many points: replicas * vnodes must stay at most {_MAX_POINTS}")
        self._ids = ids
        self._weights.extend(ws)
        self._available.extend(flags)
        self._place_all()
        return self._publish()

    def remove_replica(self, index):
        """Remove replica `index`; later replicas shift down by one. Its keys move clockwise,
        and vnode overrides that name it are dropped."""
        cdef int32_t i = _index_arg(self, index)
        gone = self._ids.pop(i)
        del self._weights[i]
        del self._available[i]
        self._overrides = {k: v for k, v in self._overrides.items() if k[0] != gone and v != gone}
        self._place_all()
        return self._publish()

    def reassign_vnode(self, origin, vnode, owner):
        """Serve vnode `vnode` of replica `origin` from replica `owner` (the rebalancer's move).
        Reassigning it to its origin clears the override."""
        cdef int32_t o = _index_arg(self, origin)
        cdef int32_t w = _index_arg(self, owner)
        if not isinstance(vnode, int) or isinstance(vnode, bool):
            raise TypeError(f"vnode must be an int, not {type(vnode).__name__}")
        if not 0 <= vnode < self.vnodes:
            raise IndexError(f"vnode {vnode} out of range for {self.vnodes} vnodes")
        k = (self._ids[o], vnode)
        if o == w:
            self._overrides.pop(k, None)
        else:
            self._overrides[k] = self._ids[w]
        return self._publish()

    def clear_override(self, origin, vnode):
        """Give vnode `vnode` of replica `origin` back to its origin."""
        return self.reassign_vnode(origin, vnode, origin)

    # -- building ---------------------------------------------------------------------------

    cdef void _place_all(self) except *:
        # Hash every vnode label of every member and sort once; snapshots filter this table.
        cdef int32_t n = <int32_t>len(self._ids), r, v, V = self.vnodes, k = 0
        cdef Py_ssize_t label_len
        cdef char* label = NULL
        ranks = {rid: rank for rank, rid in enumerate(sorted(self._ids))}
        cdef ring_point_t* all_points = <ring_point_t*>malloc(sizeof(ring_point_t) * (n * V if n else 1))
        if all_points == NULL:
            raise MemoryError()
        try:
            for r in range(n):
                prefix = (self._ids[r] + "#").encode("utf-8")
                label = <char*>malloc(len(prefix) + 12)
                if label == NULL:
                    raise MemoryError()
                for v in range(V):
                    label_len = _format_label(label, prefix, v)
                    all_points[k].hash = ring_xxh3_64(<const uint8_t*>label, <size_t>label_len,
                                                      self.seed, self._secret)
                    all_points[k].owner = r
                    all_points[k].origin = r
                    all_points[k].vnode = v
                    all_points[k]._pad = ranks[self._ids[r]]
                    k += 1
                free(label)
                label = NULL
            qsort(all_points, <size_t>k, sizeof(ring_point_t), _point_cmp)
        except BaseException:
            free(label)
            free(all_points)
            raise
        free(self._all)
        self._all = all_points
        self._n_all = k

    cdef RingSnapshot _build(self):
        cdef int32_t n = <int32_t>len(self._ids), V = self.vnodes, k, count = 0, owner
        cdef int32_t* active = <int32_t*>malloc(sizeof(int32_t) * (n if n else 1))
        cdef int32_t* served_by = <int32_t*>malloc(sizeof(int32_t) * (n * V if n else 1))
        cdef uint8_t* avail = <uint8_t*>malloc(n if n else 1)
        cdef RingSnapshot s
        cdef ring_point_t p
        try:
            if active == NULL or served_by == NULL or avail == NULL:
                raise MemoryError()
            ids, weights, available = tuple(self._ids), tuple(self._weights), tuple(self._available)
            if not len(ids) == len(weights) == len(available) == n:
                raise RuntimeError("ring state is inconsistent (concurrent mutation?)")
            index_of = {rid: i for i, rid in enumerate(ids)}
            for k in range(n):
                active[k] = active_vnodes(weights[k], V)
                avail[k] = 1 if available[k] else 0
            for k in range(n * V):
                served_by[k] = -1
            for (origin_id, vnode), owner_id in self._overrides.items():
                served_by[index_of[origin_id] * V + vnode] = index_of[owner_id]
            for k in range(self._n_all):
                p = self._all[k]
                if p.vnode < active[p.origin]:
                    owner = served_by[p.origin * V + p.vnode]
                    if avail[owner if owner >= 0 else p.origin]:
                        count += 1
            s = _new_snapshot(tuple(self._ids), count, self.seed, self._secret)
            count = 0
            for k in range(self._n_all):
                p = self._all[k]
                if p.vnode < active[p.origin]:
                    owner = served_by[p.origin * V + p.vnode]
                    if owner < 0:
                        owner = p.origin
                    if avail[owner]:
                        p.owner = owner
                        p._pad = 0
                        s._points[count] = p
                        count += 1
            _finish_snapshot(s)
        finally:
            free(active)
            free(served_by)
            free(avail)
        return s

    cdef list _publish(self):
        cdef RingSnapshot old = self.current
        cdef RingSnapshot new = self._build()
        self.current = new
        return _moved_ranges(old, new)


cdef int _point_cmp(const void* pa, const void* pb) noexcept nogil:
    # Order of the full vnode table: hash, then the origin id's rank (held in _pad), then vnode.
    cdef const ring_point_t* a = <const ring_point_t*>pa
    cdef const ring_point_t* b = <const ring_point_t*>pb
    if a.hash != b.hash:
        return -1 if a.hash < b.hash else 1
    if a._pad != b._pad:
        return -1 if a._pad < b._pad else 1
    return (a.vnode > b.vnode) - (a.vnode < b.vnode)


cdef Py_ssize_t _format_label(char* out, bytes prefix, int32_t v) except -1:
    # prefix + decimal(v), without building a Python object per vnode
    cdef Py_ssize_t n = len(prefix), digits = 0, i
    cdef char tmp[12]
    memcpy(out, PyBytes_AS_STRING(prefix), n)
    if v == 0:
        out[n] = 48
        return n + 1
    while v > 0:
        tmp[digits] = <char>(48 + v % 10)
        v //= 10
        digits += 1
    for i in range(digits):
        out[n + i] = tmp[digits - 1 - i]
    return n + digits


cdef list _moved_ranges(RingSnapshot a, RingSnapshot b):
    # Walk the union of both point sets in hash order. Between two consecutive boundaries each
    # ring has one owner (its first point at or after the boundary, wrapping), so every arc is
    # compared once. Arcs are reported as inclusive [lo, hi] ranges, never wrapping.
    cdef int32_t na = a.view.n_points, nb = b.view.n_points, i = 0, j = 0
    cdef uint64_t bound, lo = 0
    cdef bint done = False
    out = []
    if na == 0 and nb == 0:
        return out
    a_ids = a.replica_ids
    b_ids = b.replica_ids
    wrap_old = a_ids[a._points[0].owner] if na else None
    wrap_new = b_ids[b._points[0].owner] if nb else None
    while i < na or j < nb:
        if j >= nb or (i < na and a._points[i].hash <= b._points[j].hash):
            bound = a._points[i].hash
        else:
            bound = b._points[j].hash
        old = a_ids[a._points[i].owner] if i < na else wrap_old
        new = b_ids[b._points[j].owner] if j < nb else wrap_new
        _emit(out, lo, bound, old, new)
        while i < na and a._points[i].hash == bound:
            i += 1
        while j < nb and b._points[j].hash == bound:
            j += 1
        if bound == _RING_SPAN_MAX:
            done = True
            break
        lo = bound + 1
    if not done:
        _emit(out, lo, _RING_SPAN_MAX, wrap_old, wrap_new)
    return out


cdef inline void _emit(list out, uint64_t lo, uint64_t hi, object old, object new) except *:
    if old == new:
        return
    cdef Py_ssize_t n = len(out)
    if n:
        last = out[n - 1]
        if last.old == old and last.new == new and last.hi + 1 == lo:
            out[n - 1] = MovedRange(last.lo, hi, old, new)
            return
    out.append(MovedRange(lo, hi, old, new))


cdef uint64_t _position(object h) except? 0:
    if not isinstance(h, int) or isinstance(h, bool):
        raise TypeError(f"ring positions must be ints, not {type(h).__name__}")
    if not 0 <= h <= 0xFFFFFFFFFFFFFFFF:
        raise ValueError(f"ring positions must be in [0, 2**64), got {h}")
    return <uint64_t>h


def active_vnodes(weight, vnodes):
    """How many vnodes a weight activates: ceil(weight * vnodes), with a 1e-9 tolerance so that
    weight k / vnodes activates exactly k, and at least one for any weight above 0.
    DO NOT CHANGE: which vnodes a weight activates decides where keys live."""
    if weight <= 0:
        return 0
    return max(1, min(vnodes, math.ceil(weight * vnodes - 1e-9)))


cdef list _check_ids(object replica_ids):
    if isinstance(replica_ids, (str, bytes)):
        raise TypeError("replica_ids must be a sequence of str, not a single string")
    ids = []
    for rid in replica_ids:
        if not isinstance(rid, str):
            raise TypeError(f"replica ids must be str, not {type(rid).__name__}")
        rid = str.__str__(rid)  # the plain string value: subclasses (enums) must place like it
        if not rid:
            raise ValueError("replica ids must not be empty")
        rid.encode("utf-8")
        ids.append(rid)
    if len(set(ids)) != len(ids):
        dup = next(r for r in ids if ids.count(r) > 1)
        raise ValueError(f"duplicate replica id {dup!r}")
    return ids


cdef double _check_weight(object weight) except -1.0:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(f"weight must be a number, not {type(weight).__name__}")
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight!r}")
    return <double>weight


cdef double _check_c(object c) except -1.0:
    if isinstance(c, bool) or not isinstance(c, (int, float)):
        raise TypeError(f"c must be a number, not {type(c).__name__}")
    if not (1.0 <= c < math.inf):
        raise ValueError(f"c must be a finite number >= 1, got {c!r}")
    return <double>c


cdef array.array _loads_array(object loads, int32_t n):
    cdef array.array la
    cdef Py_ssize_t i
    if type(loads) is array.array and (<array.array>loads).ob_descr.typecode == c"q":
        la = <array.array>loads
    else:
        la = _array.array("q", loads)
    if len(la) != n:
        raise ValueError(f"loads has {len(la)} entries for {n} replicas")
    for i in range(n):
        if la.data.as_longlongs[i] < 0:
            raise ValueError(f"loads must not be negative (replica {i}: {la.data.as_longlongs[i]})")
    return la


cdef bytearray _exclusion_flags(object excluded, int32_t n):
    flags = bytearray(n)
    for i in excluded:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"excluded replica indices must be ints, not {type(i).__name__}")
        if not 0 <= i < n:
            raise IndexError(f"excluded replica index {i} out of range for {n} replicas")
        flags[i] = 1
    return flags
