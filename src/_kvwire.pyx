# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""vLLM's KV-event payloads read at C speed: the shapes engines send, straight from msgpack bytes (compiled core).

``scan(payload)`` reads a message's msgpack payload ``[ts, [event, ...], rank]`` without building
a Python object per value: the block hashes and token ids go straight into ``array('Q')``, and a
run of ``BlockRemoved`` events on one medium (vLLM sends one per evicted block) becomes one
removal. It answers ``(ts, rank, events)``, each event a tuple:

    (0, hashes, parent, token_ids, block_size, medium, lora_name, salt)   a BlockStored
    (1, hashes, medium)                                                   a run of BlockRemoved
    (2,)                                                                  AllBlocksCleared

or None for anything it does not read: positional events, negative or bytes hashes, extension
types, map keys that are not strings, nesting deeper than MAX_DEPTH, and every malformed
message. The caller then decodes it the long way (router.kvevents.wire), which also says what is
wrong. What it does read, it reads as that decoder does (the tests compare them): the same
values, the same defaults (medium "GPU", rank 0, ts 0.0), the cache salt found the same way, and
every string in the message checked as UTF-8, as msgpack would check it.

Its pure-Python twin is router/_kvwire_py.py.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from cpython cimport array
from cpython.object cimport Py_SIZE
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

import array as _array

__all__ = ["MAX_DEPTH", "scan"]

DEF _MAX_DEPTH = 64
MAX_DEPTH = _MAX_DEPTH  # containers nested deeper than this are left to the long way

cdef array.array _UINT64 = _array.array("Q")
cdef str _GPU = "GPU"

cdef enum:
    _NO = -1                     # not a shape scan reads (or malformed): the caller decodes it the long way
    # kinds of value
    _NIL = 0                     # (0: a zeroed _value is nil)
    _BOOL = 1
    _UINT = 2                    # a non-negative int (any encoding)
    _NEG = 3                     # a negative int
    _FLOAT = 4
    _STR = 5
    _BIN = 6
    _ARRAY = 7
    _MAP = 8


ctypedef struct _reader:
    const uint8_t* p
    const uint8_t* end


ctypedef struct _value:          # one value's head, as _head reads it
    int kind
    uint64_t u                   # _UINT: the value; _BOOL: 0 or 1; _STR, _BIN, _ARRAY, _MAP: the count
    int64_t i                    # _NEG: the value
    double f                     # _FLOAT: the value
    const uint8_t* data          # _STR, _BIN: the bytes


cdef inline bint _take(_reader* r, Py_ssize_t n, const uint8_t** out) noexcept nogil:
    if r.end - r.p < n:
        return False
    out[0] = r.p
    r.p += n
    return True


cdef inline uint64_t _be(const uint8_t* p, int n) noexcept nogil:
    cdef uint64_t v = 0
    cdef int k
    for k in range(n):
        v = (v << 8) | p[k]
    return v


cdef bint _utf8(const uint8_t* s, Py_ssize_t n) noexcept nogil:
    """Strict UTF-8 as Python decodes it (RFC 3629: no overlongs, no surrogates, nothing past U+10FFFF)."""
    cdef Py_ssize_t k = 0
    cdef uint8_t c, c1
    while k < n:
        c = s[k]
        if c < 0x80:
            k += 1
            continue
        if c < 0xC2 or c > 0xF4:
            return False
        if c < 0xE0:
            if k + 1 >= n or (s[k + 1] & 0xC0) != 0x80:
                return False
            k += 2
            continue
        if k + 1 >= n:
            return False
        c1 = s[k + 1]
        if c < 0xF0:
            if k + 2 >= n or (c1 & 0xC0) != 0x80 or (s[k + 2] & 0xC0) != 0x80:
                return False
            if (c == 0xE0 and c1 < 0xA0) or (c == 0xED and c1 >= 0xA0):
                return False
            k += 3
            continue
        if k + 3 >= n or (c1 & 0xC0) != 0x80 or (s[k + 2] & 0xC0) != 0x80 or (s[k + 3] & 0xC0) != 0x80:
            return False
        if (c == 0xF0 and c1 < 0x90) or (c == 0xF4 and c1 >= 0x90):
            return False
        k += 4
    return True


cdef extern from *:
    """
    #include <string.h>
    #include <stdint.h>
    static inline double kvwire_f32(uint32_t bits) { float f; memcpy(&f, &bits, 4); return (double)f; }
    static inline int64_t kvwire_signed(uint64_t v, int n) {
        if (n == 1) return (int64_t)(int8_t)v;
        if (n == 2) return (int64_t)(int16_t)v;
        if (n == 4) return (int64_t)(int32_t)v;
        return (int64_t)v;
    }
    """
    double _f32 "kvwire_f32"(uint32_t bits) noexcept nogil
    int64_t _signed "kvwire_signed"(uint64_t v, int n) noexcept nogil


cdef bint _head(_reader* r, _value* v) noexcept nogil:
    """Reads one value's head (a scalar whole; a container's count): False where the bytes are
    not one this scanner reads (extension types, 0xc1, a truncated message, bad UTF-8)."""
    cdef const uint8_t* q
    cdef uint8_t b
    cdef uint64_t n
    if not _take(r, 1, &q):
        return False
    b = q[0]
    if b <= 0x7F:
        v.kind = _UINT
        v.u = b
        return True
    if b >= 0xE0:
        v.kind = _NEG
        v.i = <int64_t>b - 256
        return True
    if b <= 0x8F:
        v.kind = _MAP
        v.u = b & 0x0F
        return True
    if b <= 0x9F:
        v.kind = _ARRAY
        v.u = b & 0x0F
        return True
    if b <= 0xBF:
        n = b & 0x1F
        v.kind = _STR
    elif b == 0xC0:
        v.kind = _NIL
        return True
    elif b == 0xC2 or b == 0xC3:
        v.kind = _BOOL
        v.u = b - 0xC2
        return True
    elif 0xC4 <= b <= 0xC6:
        if not _take(r, 1 << (b - 0xC4), &q):
            return False
        n = _be(q, 1 << (b - 0xC4))
        v.kind = _BIN
    elif b == 0xCA:
        if not _take(r, 4, &q):
            return False
        n = _be(q, 4)
        v.kind = _FLOAT
        v.f = _f32(<uint32_t>n)
        return True
    elif b == 0xCB:
        if not _take(r, 8, &q):
            return False
        n = _be(q, 8)
        v.kind = _FLOAT
        memcpy(&v.f, &n, 8)
        return True
    elif 0xCC <= b <= 0xCF:
        if not _take(r, 1 << (b - 0xCC), &q):
            return False
        v.kind = _UINT
        v.u = _be(q, 1 << (b - 0xCC))
        return True
    elif 0xD0 <= b <= 0xD3:
        if not _take(r, 1 << (b - 0xD0), &q):
            return False
        n = _be(q, 1 << (b - 0xD0))
        v.i = _signed(n, 1 << (b - 0xD0))
        if v.i >= 0:
            v.kind = _UINT
            v.u = <uint64_t>v.i
        else:
            v.kind = _NEG
        return True
    elif 0xD9 <= b <= 0xDB:
        if not _take(r, 1 << (b - 0xD9), &q):
            return False
        n = _be(q, 1 << (b - 0xD9))
        v.kind = _STR
    elif b == 0xDC or b == 0xDD:
        if not _take(r, 2 if b == 0xDC else 4, &q):
            return False
        v.kind = _ARRAY
        v.u = _be(q, 2 if b == 0xDC else 4)
        return True
    elif b == 0xDE or b == 0xDF:
        if not _take(r, 2 if b == 0xDE else 4, &q):
            return False
        v.kind = _MAP
        v.u = _be(q, 2 if b == 0xDE else 4)
        return True
    else:
        return False  # 0xc1 (never used), the extension types
    if <uint64_t>(r.end - r.p) < n:
        return False
    v.u = n
    v.data = r.p
    r.p += n
    return v.kind != _STR or _utf8(v.data, <Py_ssize_t>n)


cdef bint _skip_rest(_reader* r, const _value* v, int depth) noexcept nogil:
    """Passes what follows a value's head: a container's elements (a map's keys strings)."""
    cdef uint64_t k
    if v.kind != _ARRAY and v.kind != _MAP:
        return True
    if depth >= _MAX_DEPTH or v.u > <uint64_t>(r.end - r.p):  # (each element takes a byte at least)
        return False
    for k in range(v.u):
        if v.kind == _MAP and not _key(r):
            return False
        if not _skip(r, depth + 1):
            return False
    return True


cdef bint _skip(_reader* r, int depth) noexcept nogil:
    """Passes one whole value, checking it as msgpack would read it."""
    cdef _value v
    return _head(r, &v) and _skip_rest(r, &v, depth)


cdef inline bint _key(_reader* r) noexcept nogil:
    """Passes a map's key: a string (any other kind is left to the long way)."""
    cdef _value v
    return _head(r, &v) and v.kind == _STR


cdef inline bint _same(const uint8_t* a, Py_ssize_t na, const uint8_t* b, Py_ssize_t nb) noexcept nogil:
    return na == nb and memcmp(a, b, na) == 0


cdef inline bint _is(const _value* v, const char* name, Py_ssize_t n) noexcept nogil:
    """`v` is the string `name` (`n` bytes)."""
    return v.kind == _STR and _same(v.data, <Py_ssize_t>v.u, <const uint8_t*>name, n)


cdef inline str _text(const uint8_t* data, Py_ssize_t n):
    return PyUnicode_DecodeUTF8(<const char*>data, n, NULL)


cdef bint _uints(const uint8_t* at, const uint8_t* end, array.array out) except -1:
    """Appends the array at `at` of non-negative ints to `out`; False where it is anything else."""
    cdef _reader r
    cdef _value v, x
    cdef uint64_t k
    cdef Py_ssize_t start = Py_SIZE(out)
    cdef uint64_t* data
    r.p = at
    r.end = end
    if not _head(&r, &v) or v.kind != _ARRAY or v.u > <uint64_t>(r.end - r.p):
        return False
    array.resize_smart(out, start + <Py_ssize_t>v.u)
    data = <uint64_t*>out.data.as_voidptr + start
    for k in range(v.u):
        if not _head(&r, &x) or x.kind != _UINT:
            array.resize(out, start)
            return False
        data[k] = x.u
    return True


cdef int _salt(const uint8_t* at, const uint8_t* end, const _value* lora, _value* salt) noexcept nogil:
    """extra_keys' cache salt as router.kvevents.wire._salt finds it: the last string among the
    first entry's items, the first item left out when it is the adapter's name. 1: found (in
    `salt`), 0: none, -1: not read."""
    cdef _reader r
    cdef _value v, item
    cdef uint64_t k
    cdef int found = 0
    r.p = at
    r.end = end
    if not _head(&r, &v) or v.kind != _ARRAY or v.u == 0:
        return 0
    if not _head(&r, &v) or v.kind != _ARRAY:
        return 0
    for k in range(v.u):
        if not _head(&r, &item):
            return -1
        if item.kind == _STR:
            if k == 0 and lora.kind == _STR and lora.u > 0 and _same(lora.data, lora.u, item.data, item.u):
                continue  # the adapter's own name
            salt[0] = item
            found = 1
        elif not _skip_rest(&r, &item, 2):
            return -1
    return found


ctypedef struct _fields:         # one event map's fields of interest (the last of each name wins;
    _value type                  # an absent one reads as nil)
    _value medium
    _value lora_name
    _value parent
    _value block_size
    const uint8_t* block_hashes  # where the value starts; NULL: absent
    const uint8_t* token_ids
    const uint8_t* extra_keys


cdef bint _event_fields(_reader* r, _fields* f) noexcept nogil:
    """Reads an event map (its head included) into `f`, passing every value."""
    cdef _value m, key, v
    cdef uint64_t k
    cdef const uint8_t* start
    memset(f, 0, sizeof(_fields))  # (every value nil: _NIL is 0)
    if not _head(r, &m) or m.kind != _MAP or m.u > <uint64_t>(r.end - r.p):
        return False
    for k in range(m.u):
        if not _head(r, &key) or key.kind != _STR:
            return False
        start = r.p
        if not _head(r, &v) or not _skip_rest(r, &v, 2):
            return False
        if _is(&key, b"type", 4):
            f.type = v
        elif _is(&key, b"block_hashes", 12):
            f.block_hashes = start
        elif _is(&key, b"token_ids", 9):
            f.token_ids = start
        elif _is(&key, b"parent_block_hash", 17):
            f.parent = v
        elif _is(&key, b"block_size", 10):
            f.block_size = v
        elif _is(&key, b"medium", 6):
            f.medium = v
        elif _is(&key, b"lora_name", 9):
            f.lora_name = v
        elif _is(&key, b"extra_keys", 10):
            f.extra_keys = start
    return True


cdef const uint8_t* _GPU_BYTES = b"GPU"


cdef inline void _medium_of(const _value* v, const uint8_t** data, Py_ssize_t* n) noexcept nogil:
    if v.kind == _STR and v.u > 0:
        data[0] = v.data
        n[0] = <Py_ssize_t>v.u
    else:
        data[0] = _GPU_BYTES
        n[0] = 3


cdef object _medium_str(const uint8_t* data, Py_ssize_t n):
    return _GPU if _same(data, n, _GPU_BYTES, 3) else _text(data, n)


cdef object _stored(const _fields* f, const uint8_t* end):
    """A BlockStored's tuple, or None where the long way must read it."""
    cdef array.array hashes = array.clone(_UINT64, 0, False)
    cdef array.array ids = array.clone(_UINT64, 0, False)
    cdef object parent = None
    cdef uint64_t size, n_keys, n_ids
    cdef const uint8_t* medium
    cdef Py_ssize_t n_medium
    cdef _value salt
    cdef int has_salt = 0
    memset(&salt, 0, sizeof(_value))
    if f.block_hashes == NULL or not _uints(f.block_hashes, end, hashes):
        return None
    if f.parent.kind != _NIL:
        if f.parent.kind != _UINT:
            return None
        parent = f.parent.u
    if f.block_size.kind != _UINT or f.block_size.u < 1:
        return None
    if f.token_ids == NULL or not _uints(f.token_ids, end, ids):
        return None
    size = f.block_size.u
    n_keys = <uint64_t>Py_SIZE(hashes)
    n_ids = <uint64_t>Py_SIZE(ids)
    if n_keys == 0:
        if n_ids != 0:
            return None
    elif size > n_ids // n_keys or n_keys * size != n_ids:
        return None
    if f.extra_keys != NULL:
        has_salt = _salt(f.extra_keys, end, &f.lora_name, &salt)
        if has_salt < 0:
            return None
    _medium_of(&f.medium, &medium, &n_medium)
    return (
        0,
        hashes,
        parent,
        ids,
        size,
        _medium_str(medium, n_medium),
        _text(f.lora_name.data, <Py_ssize_t>f.lora_name.u) if f.lora_name.kind == _STR and f.lora_name.u > 0 else None,
        _text(salt.data, <Py_ssize_t>salt.u) if has_salt else None,
    )


def scan(payload):
    """A KV-event message's payload as (ts, rank, events) (see the module's text), or None: not a
    shape this reads, or not a message at all; router.kvevents.wire then decodes it the long way."""
    cdef _reader r
    cdef _value top, ts_v, events_v, rank_v
    cdef _fields f
    cdef uint64_t k
    cdef double ts = 0.0
    cdef object rank = 0
    cdef list events = []
    cdef array.array gone = None             # the run of removals being gathered
    cdef const uint8_t* gone_medium = NULL
    cdef Py_ssize_t n_gone_medium = 0
    cdef const uint8_t* medium
    cdef Py_ssize_t n_medium
    cdef object stored
    if type(payload) is not bytes:
        return None
    r.p = <const uint8_t*>PyBytes_AS_STRING(payload)
    r.end = r.p + PyBytes_GET_SIZE(payload)
    if not _head(&r, &top) or top.kind != _ARRAY or top.u < 2:
        return None
    if not _head(&r, &ts_v) or not _skip_rest(&r, &ts_v, 1):
        return None
    if ts_v.kind == _UINT or ts_v.kind == _BOOL:
        ts = <double>ts_v.u
    elif ts_v.kind == _NEG:
        ts = <double>ts_v.i
    elif ts_v.kind == _FLOAT:
        ts = ts_v.f
    if not _head(&r, &events_v) or events_v.kind != _ARRAY or events_v.u > <uint64_t>(r.end - r.p):
        return None
    for k in range(events_v.u):
        if not _event_fields(&r, &f):
            return None
        if _is(&f.type, b"BlockRemoved", 12):
            _medium_of(&f.medium, &medium, &n_medium)
            if gone is not None and not _same(medium, n_medium, gone_medium, n_gone_medium):
                events.append((1, gone, _medium_str(gone_medium, n_gone_medium)))
                gone = None
            if gone is None:
                gone = array.clone(_UINT64, 0, False)
                gone_medium, n_gone_medium = medium, n_medium
            if f.block_hashes == NULL or not _uints(f.block_hashes, r.end, gone):
                return None
            continue
        if gone is not None:
            events.append((1, gone, _medium_str(gone_medium, n_gone_medium)))
            gone = None
        if _is(&f.type, b"BlockStored", 11):
            stored = _stored(&f, r.end)
            if stored is None:
                return None
            events.append(stored)
        elif _is(&f.type, b"AllBlocksCleared", 16):
            events.append((2,))
        else:
            return None
    if gone is not None:
        events.append((1, gone, _medium_str(gone_medium, n_gone_medium)))
    if top.u > 2:
        if not _head(&r, &rank_v) or not _skip_rest(&r, &rank_v, 1):
            return None
        if rank_v.kind == _UINT:
            rank = rank_v.u
    for k in range(3, top.u):
        if not _skip(&r, 1):
            return None
    if r.p != r.end:
        return None  # more after the message
    return ts, rank, events
