# cython: language_level=3
"""A tiny proxy core that embeds the ring through its C-level API (cimport), as other proxies do."""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc

from _ring cimport (Ring, RingSnapshot, ring_hash, ring_load_cap, ring_lookup_bounded_hash,
                    ring_lookup_excluding_hash, ring_lookup_hash, ring_routing_load, ring_xxh3_64)


def route_all(Ring ring, list keys):
    """Owners of `keys`, hashed and looked up with the GIL released."""
    cdef RingSnapshot snap = ring.current
    cdef Py_ssize_t i, n = len(keys)
    cdef int32_t* out = <int32_t*>malloc(sizeof(int32_t) * (n if n else 1))
    cdef bytes k
    cdef const char* p
    cdef Py_ssize_t klen
    try:
        for i in range(n):
            k = keys[i]
            p = k
            klen = len(k)
            with nogil:
                out[i] = ring_lookup_hash(&snap.view, ring_hash(&snap.view, <const uint8_t*>p, <size_t>klen))
        return [out[i] for i in range(n)]
    finally:
        free(out)


def route_bounded(Ring ring, bytes key, list loads, double c):
    cdef RingSnapshot snap = ring.current
    cdef int64_t* lp = <int64_t*>malloc(sizeof(int64_t) * len(loads))
    cdef int64_t cap
    cdef int32_t owner
    cdef uint64_t h
    try:
        for i, load in enumerate(loads):
            lp[i] = load
        h = ring_hash(&snap.view, <const uint8_t*><const char*>key, len(key))
        with nogil:
            cap = ring_load_cap(&snap.view, ring_routing_load(&snap.view, lp), c)
            owner = ring_lookup_bounded_hash(&snap.view, h, lp, cap)
        return owner
    finally:
        free(lp)


def route_excluding(Ring ring, bytes key, bytes excluded_flags):
    cdef RingSnapshot snap = ring.current
    cdef uint64_t h = ring_hash(&snap.view, <const uint8_t*><const char*>key, len(key))
    return ring_lookup_excluding_hash(&snap.view, h, <const uint8_t*><const char*>excluded_flags)


def hash_bytes(bytes data, uint64_t seed, Ring ring_with_that_seed):
    cdef RingSnapshot snap = ring_with_that_seed.current
    return ring_xxh3_64(<const uint8_t*><const char*>data, len(data), seed, snap.view.secret)


def snapshot_points(Ring ring):
    cdef RingSnapshot snap = ring.current
    return snap.view.n_points, snap.view.n_routing, snap.view.n_replicas
