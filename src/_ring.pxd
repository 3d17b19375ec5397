# cython: language_level=3
# The C-level contract of the ring, for Cython code that embeds it:
#
#     from _ring cimport Ring, RingSnapshot, ring_view_t, ring_hash, ring_lookup_hash
#
#     cdef RingSnapshot snap = ring.current      # hold this reference while you route
#     with nogil:
#         owner = ring_lookup_hash(&snap.view, ring_hash(&snap.view, key_ptr, key_len))
#
# A snapshot never changes after it is published; `Ring` mutations publish a new one. Every
# function here is `noexcept nogil`, touches no Python object and allocates nothing; -1 means
# "no replica can serve".

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

cdef enum:
    RING_NO_REPLICA = -1
    RING_SECRET_SIZE = 192       # XXH3's default secret length, in bytes
    RING_SCAN = 4                # points compared without branches per lookup; `hashes` has
                                 # RING_SCAN sentinel entries (2**64 - 1) past its end


ctypedef struct ring_point_t:
    uint64_t hash                # position on the ring: xxh3_64(f"{origin_id}#{vnode}", seed)
    int32_t owner                # replica index that serves this vnode (after overrides)
    int32_t origin               # replica index whose label placed the vnode here
    int32_t vnode                # vnode number within the origin replica
    int32_t _pad


ctypedef struct ring_view_t:
    const uint64_t* hashes       # sorted point positions; only vnodes that route (weight, availability)
    const int32_t* owners        # owners[k]: replica that serves hashes[k]
    const ring_point_t* points   # the same points with their origin and vnode number (off the hot path)
    const int32_t* bucket        # bucket[b] = first point whose top `64 - shift` bits are >= b
    const uint8_t* routing       # per replica: 1 when it owns at least one point
    const uint8_t* secret        # XXH3 secret derived from `seed` (used for keys over 240 bytes)
    uint64_t seed
    int32_t n_points
    int32_t n_replicas
    int32_t n_routing            # replicas with routing[i] == 1
    int32_t shift


# XXH3-64 of `n` bytes: bit-exact with xxhash.xxh3_64_intdigest(data, seed). `secret` must be
# the secret derived from `seed` (see ring_derive_secret); short inputs only use the seed.
cdef uint64_t ring_xxh3_64(const uint8_t* data, size_t n, uint64_t seed,
                           const uint8_t* secret) noexcept nogil
cdef void ring_derive_secret(uint64_t seed, uint8_t* out) noexcept nogil

# Walks that skip replicas: first owner clockwise from h whose load is under `cap`, or that
# is not flagged in `excluded` (one byte per replica). Each walks at most one lap.
cdef int32_t ring_lookup_bounded_hash(const ring_view_t* v, uint64_t h, const int64_t* loads,
                                      int64_t cap) noexcept nogil
cdef int32_t ring_lookup_excluding_hash(const ring_view_t* v, uint64_t h,
                                        const uint8_t* excluded) noexcept nogil
# Sum of the loads of routing replicas; the bounded-load cap for that total.
cdef int64_t ring_routing_load(const ring_view_t* v, const int64_t* loads) noexcept nogil
cdef int64_t ring_load_cap(const ring_view_t* v, int64_t total_load, double c) noexcept nogil


cdef inline uint64_t ring_hash(const ring_view_t* v, const uint8_t* key, size_t n) noexcept nogil:
    return ring_xxh3_64(key, n, v.seed, v.secret)


cdef inline int32_t ring_point_index(const ring_view_t* v, uint64_t h) noexcept nogil:
    # Lower bound of h among the sorted points, wrapping to 0 past the last one. The bucket
    # table narrows the search to the points that share h's top bits (about one); they are
    # counted without branches, since every point past the bucket is above h anyway.
    cdef int32_t lo, hi, mid
    cdef uint64_t b
    if v.n_points == 0:
        return RING_NO_REPLICA
    b = h >> v.shift
    lo = v.bucket[b]
    hi = v.bucket[b + 1]
    while hi - lo > RING_SCAN:
        mid = lo + ((hi - lo) >> 1)
        if v.hashes[mid] < h:
            lo = mid + 1
        else:
            hi = mid
    lo += ((v.hashes[lo] < h) + (v.hashes[lo + 1] < h) + (v.hashes[lo + 2] < h)
           + (v.hashes[lo + 3] < h))
    if lo == v.n_points:
        lo = 0
    return lo


cdef inline int32_t ring_lookup_hash(const ring_view_t* v, uint64_t h) noexcept nogil:
    # Unavailable replicas own no points in a snapshot, so the first point is the answer.
    cdef int32_t i = ring_point_index(v, h)
    if i < 0:
        return RING_NO_REPLICA
    return v.owners[i]


cdef class RingSnapshot:
    """One immutable, published state of a ring."""
    cdef ring_view_t view
    cdef ring_point_t* _points
    cdef uint64_t* _hashes
    cdef int32_t* _owners
    cdef int32_t* _bucket
    cdef uint8_t* _routing
    cdef uint8_t _secret[RING_SECRET_SIZE]

    cdef readonly tuple replica_ids


cdef class Ring:
    """Mutable handle that publishes a new RingSnapshot on every change."""
    cdef readonly RingSnapshot current
    cdef readonly int vnodes
    cdef readonly uint64_t seed
    cdef list _ids
    cdef list _weights
    cdef list _available
    cdef dict _overrides
    cdef ring_point_t* _all            # every vnode of every member, sorted; owner unused
    cdef int32_t _n_all
    cdef uint8_t _secret[RING_SECRET_SIZE]

    cdef void _place_all(self) except *
    cdef RingSnapshot _build(self)
    cdef list _publish(self)
