"""Pure-Python twin of the compiled shared regions `_kvshare`: the same names, layout and answers.

Each region is read and written through memoryviews cast over its buffer, field for field as
src/_kvshare.pyx lays it out, so a region written by one is read by the other (the tests do).
See src/_kvshare.pyx for the layout, the probe order and how readers stay safe while the writer
changes a region.

It is past 450 lines because it is the twin of src/_kvshare.pyx: it mirrors the compiled regions
function for function, and a twin cut differently from its original would be harder to hold equal.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

from router._gallop import gallop

if TYPE_CHECKING:
    from collections.abc import Iterable

    from typing_extensions import Buffer

__all__ = ["ENTRY_BYTES", "HEADER_BYTES", "MAGIC", "READ_TRIES", "Regions", "region_bytes", "slots_for"]

HEADER_BYTES = 128
ENTRY_BYTES = 32
MAGIC = 0x3178692D7261766B  # b"kvar-ix1", little-endian
READ_TRIES = 64
_SPINS = 100_000
_MIN_SLOTS = 16
_MAX_POOL = 0x3FFFFFFF
_MASK64 = (1 << 64) - 1
_NONE = -1
# header: uint64 words, and the int32 fields (head, tail, free, fresh) after the first seven words
_SEQ, _CAPACITY, _POOL, _SLOTMASK, _SIZE, _ALIASED, _RETIRED = 1, 2, 3, 4, 5, 6, 9
_HEAD, _TAIL, _FREE, _FRESH = 14, 15, 16, 17


def _hash(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK64
    return x ^ (x >> 33)


def _int_arg(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def slots_for(pool: int) -> int:
    """Slots per table for `pool` entries: the power of two at least twice as many (load <= 1/2)."""
    _int_arg("pool", pool, 1, _MAX_POOL)
    n = _MIN_SLOTS
    while n < 2 * pool:
        n *= 2
    return n


def region_bytes(pool: int) -> int:
    """Bytes of a region of `pool` entries."""
    return HEADER_BYTES + ENTRY_BYTES * pool + 8 * slots_for(pool)


def _chain(obj: object, name: str) -> memoryview:
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be a buffer of unsigned 64-bit integers, not {type(obj).__name__}") from None
    fmt = view.format.lstrip("@=<")
    if view.itemsize != 8 or fmt not in ("Q", "L") or view.ndim != 1 or not view.c_contiguous:
        raise TypeError(f"{name} must be a one-dimensional buffer of unsigned 64-bit integers")
    return view.cast("B").cast("Q")


class _Region:
    """One holder's region: its buffer seen as the header's words and the tables' cells."""

    __slots__ = ("aslots", "buf", "entries32", "entries64", "hd32", "hd64", "kslots", "mask", "pool", "readonly")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.readonly = buf.readonly
        self.hd64 = buf[:HEADER_BYTES].cast("Q")
        self.hd32 = buf[:HEADER_BYTES].cast("i")
        self.pool = pool = self.hd64[_POOL]
        self.mask = mask = self.hd64[_SLOTMASK]
        start = HEADER_BYTES
        self.entries64 = buf[start : start + ENTRY_BYTES * pool].cast("Q")
        self.entries32 = buf[start : start + ENTRY_BYTES * pool].cast("i")
        start += ENTRY_BYTES * pool
        self.kslots = buf[start : start + 4 * (mask + 1)].cast("i")
        start += 4 * (mask + 1)
        self.aslots = buf[start : start + 4 * (mask + 1)].cast("i")

    # -- tables --------------------------------------------------------------------------------------

    def find(self, key: int, aliases: bool = False) -> tuple[int, int]:
        """(entry or -1, its slot or the empty slot where it would go); bounded, entries checked."""
        slots, mask, pool, e64 = (self.aslots if aliases else self.kslots), self.mask, self.pool, self.entries64
        field = 1 if aliases else 0
        i = _hash(key) & mask
        for _ in range(mask + 1):
            e = slots[i] - 1
            if e < 0 or e >= pool:
                return _NONE, i
            if e64[4 * e + field] == key:
                return e, i
            i = (i + 1) & mask
        return _NONE, i

    def vacate(self, hole: int, aliases: bool) -> None:
        slots, mask, e64 = (self.aslots if aliases else self.kslots), self.mask, self.entries64
        field = 1 if aliases else 0
        j = hole
        while True:
            j = (j + 1) & mask
            moved = slots[j]
            if moved == 0:
                break
            home = _hash(e64[4 * (moved - 1) + field]) & mask
            if ((j - home) & mask) >= ((j - hole) & mask):
                slots[hole] = moved
                hole = j
        slots[hole] = 0

    # -- the LRU list ------------------------------------------------------------------------------

    def link_front(self, e: int) -> None:
        e32, hd = self.entries32, self.hd32
        head = hd[_HEAD]
        e32[8 * e + 4] = _NONE
        e32[8 * e + 5] = head
        if head != _NONE:
            e32[8 * head + 4] = e
        else:
            hd[_TAIL] = e
        hd[_HEAD] = e

    def unlink(self, e: int) -> None:
        e32, hd = self.entries32, self.hd32
        p, n = e32[8 * e + 4], e32[8 * e + 5]
        if p != _NONE:
            e32[8 * p + 5] = n
        else:
            hd[_HEAD] = n
        if n != _NONE:
            e32[8 * n + 4] = p
        else:
            hd[_TAIL] = p

    def unalias(self, e: int) -> None:
        _, hole = self.find(self.entries64[4 * e + 1], True)
        self.vacate(hole, True)
        self.entries32[8 * e + 6] = 0
        self.hd64[_ALIASED] -= 1

    def alias(self, e: int, alias: int) -> None:
        e64, e32 = self.entries64, self.entries32
        if e32[8 * e + 6]:
            if e64[4 * e + 1] == alias:
                return
            self.unalias(e)
        other, slot = self.find(alias, True)
        if other != _NONE:
            self.unalias(other)
            _, slot = self.find(alias, True)
        e64[4 * e + 1] = alias
        e32[8 * e + 6] = 1
        self.aslots[slot] = e + 1
        self.hd64[_ALIASED] += 1

    def drop(self, e: int) -> None:
        e32, hd = self.entries32, self.hd32
        if e32[8 * e + 6]:
            self.unalias(e)
        _, hole = self.find(self.entries64[4 * e])
        self.vacate(hole, False)
        self.unlink(e)
        self.hd64[_SIZE] -= 1
        e32[8 * e + 7] = 0
        e32[8 * e + 5] = hd[_FREE]
        hd[_FREE] = e

    def add(self, key: int, slot: int) -> int:
        hd, e32 = self.hd32, self.entries32
        if hd[_FREE] != _NONE:
            e = hd[_FREE]
            hd[_FREE] = e32[8 * e + 5]
        elif hd[_FRESH] < self.pool:
            e = hd[_FRESH]
            hd[_FRESH] = e + 1
        else:
            return _NONE
        self.entries64[4 * e] = key
        e32[8 * e + 6] = 0
        e32[8 * e + 7] = 1
        self.link_front(e)
        self.kslots[slot] = e + 1
        self.hd64[_SIZE] += 1
        return e

    def insert(self, chain: memoryview, aliases: memoryview | None, n: int) -> int:
        added = 0
        for i in range(n - 1, -1, -1):
            key = chain[i]
            e, slot = self.find(key)
            if e == _NONE:
                e = self.add(key, slot)
                if e == _NONE:
                    self.drop(self.hd32[_TAIL])
                    _, slot = self.find(key)
                    e = self.add(key, slot)
                added += 1
            elif self.hd32[_HEAD] != e:
                self.unlink(e)
                self.link_front(e)
            if aliases is not None:
                self.alias(e, aliases[i])
        while self.hd64[_SIZE] > self.hd64[_CAPACITY]:
            self.drop(self.hd32[_TAIL])
        return added

    # -- answers -------------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self.find(key)[0] != _NONE

    def match(self, chain: memoryview, n: int) -> int:
        return 0 if self.hd64[_SIZE] == 0 else gallop(self, chain, n)

    def match_after(self, chain: memoryview, n: int, evicted: int) -> int:
        matched = self.match(chain, n)
        if matched <= 0 or evicted <= 0:
            return matched
        position: dict[int, int] = {}
        for i in range(matched):
            e, _ = self.find(chain[i])
            position.setdefault(e, i)
        kept, walked, pool = matched, 0, self.pool
        e = self.hd32[_TAIL]
        while walked < evicted and walked < pool and 0 <= e < pool:
            at = position.get(e)
            if at is not None and at < kept:
                kept = at
            e = self.entries32[8 * e + 4]
            walked += 1
        return kept


class Regions:
    """Holders numbered from 0, each a region in a buffer (router.kvevents.shared maps them)."""

    def __init__(self) -> None:
        self._r: list[_Region | None] = []
        self.torn = 0  # reads answered on a region that kept changing (READ_TRIES times)

    def __repr__(self) -> str:
        return f"Regions({sum(r is not None for r in self._r)} holders)"

    @property
    def n_holders(self) -> int:
        return len(self._r)

    def _region(self, holder: object) -> _Region:
        if isinstance(holder, bool) or not isinstance(holder, int):
            raise TypeError(f"holder must be an int, not {type(holder).__name__}")
        r = self._r[holder] if 0 <= holder < len(self._r) else None
        if r is None:
            raise ValueError(f"holder {holder} is not attached")
        return r

    def _writable(self, holder: object) -> _Region:
        r = self._region(holder)
        if r.readonly:
            raise ValueError(f"holder {holder}'s region is read-only here")
        return r

    def _put(self, holder: int, region: _Region | None) -> None:
        while len(self._r) <= holder:
            self._r.append(None)
        self._r[holder] = region

    def format(self, holder: int, buf: Buffer, capacity: int, pool: int) -> None:
        _int_arg("holder", holder, 0, _MAX_POOL - 1)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 <= capacity <= _MAX_POOL:
            raise ValueError(f"capacity must be an int in [0, {_MAX_POOL}], got {capacity!r}")
        need = region_bytes(pool)
        view = memoryview(buf).cast("B")
        if view.readonly:
            raise TypeError("a region is formatted in a writable buffer")
        if len(view) < need:
            raise ValueError(f"a region of {pool} entries needs {need} bytes, the buffer has {len(view)}")
        view[:HEADER_BYTES] = bytes(HEADER_BYTES)
        hd64 = view[:HEADER_BYTES].cast("Q")
        hd32 = view[:HEADER_BYTES].cast("i")
        hd64[_CAPACITY] = capacity
        hd64[_POOL] = pool
        hd64[_SLOTMASK] = slots_for(pool) - 1
        hd32[_HEAD] = hd32[_TAIL] = hd32[_FREE] = _NONE
        hd64[0] = MAGIC
        self._put(holder, _Region(view))

    def attach(self, holder: int, buf: Buffer) -> None:
        _int_arg("holder", holder, 0, _MAX_POOL - 1)
        view = memoryview(buf).cast("B")
        if len(view) < HEADER_BYTES:
            raise ValueError("the buffer is too short for a region's header")
        hd64 = view[:HEADER_BYTES].cast("Q")
        if hd64[0] != MAGIC:
            raise ValueError("the buffer holds no region (bad magic)")
        pool, mask = hd64[_POOL], hd64[_SLOTMASK]
        if not 1 <= pool <= _MAX_POOL or len(view) < region_bytes(pool) or mask + 1 != slots_for(pool):
            raise ValueError("the region's header does not fit its buffer")
        self._put(holder, _Region(view))

    def detach(self, holder: int) -> None:
        self._region(holder)
        self._r[holder] = None

    def attached(self, holder: object) -> bool:
        return isinstance(holder, int) and 0 <= holder < len(self._r) and self._r[holder] is not None

    def retired(self, holder: int) -> bool:
        return self._region(holder).hd64[_RETIRED] != 0

    # -- what readers ask ----------------------------------------------------------------------------

    def capacity(self, holder: int) -> int:
        return int(self._region(holder).hd64[_CAPACITY])

    def size(self, holder: int) -> int:
        return int(self._region(holder).hd64[_SIZE])

    def pool(self, holder: int) -> int:
        return self._region(holder).pool

    def total(self) -> int:
        return sum(int(r.hd64[_SIZE]) for r in self._r if r is not None)

    def memory_bytes(self) -> int:
        return sum(len(r.buf) for r in self._r if r is not None)

    def _read(self, r: _Region, chain: memoryview, evicted: int) -> int:
        n = len(chain)
        if not r.readonly:
            return r.match_after(chain, n, evicted) if evicted > 0 else r.match(chain, n)
        answer = 0
        hd = r.hd64
        for _ in range(READ_TRIES):
            before = hd[_SEQ]
            spins = 0
            while before & 1 and spins < _SPINS:
                before = hd[_SEQ]
                spins += 1
            answer = r.match_after(chain, n, evicted) if evicted > 0 else r.match(chain, n)
            if before & 1:
                break  # a writer held up (or gone) mid-change: this answer, as it read, stands
            if hd[_SEQ] == before:
                return answer
        self.torn += 1
        return answer

    def match(self, holder: int, chain: Buffer) -> int:
        r = self._region(holder)
        return self._read(r, _chain(chain, "chain"), 0)

    def match_after(self, holder: int, chain: Buffer, evicted: int) -> int:
        r = self._region(holder)
        if isinstance(evicted, bool) or not isinstance(evicted, int):
            raise TypeError(f"evicted must be an int, not {type(evicted).__name__}")
        return self._read(r, _chain(chain, "chain"), min(max(evicted, 0), 0x7FFFFFFF))

    def match_after_many(self, holder: int, chains: Iterable[Buffer], evicted: Iterable[int]) -> list[int]:
        """[match_after(holder, c, k) for c in chains for k in evicted] (the compiled one walks the
        LRU tail once for them all, read as one state; here each is its own read)."""
        r = self._region(holder)
        counts = []
        for k in evicted:
            if isinstance(k, bool) or not isinstance(k, int):
                raise TypeError(f"evicted must be an int, not {type(k).__name__}")
            counts.append(min(max(k, 0), 0x7FFFFFFF))
        views = [_chain(chain, "chain") for chain in chains]
        return [self._read(r, view, k) for view in views for k in counts]

    def match_all(self, chain: Buffer, out: Buffer) -> None:
        view = _chain(chain, "chain")
        o = memoryview(out)
        if o.itemsize != 4 or o.format[-1:] not in ("i", "l") or o.readonly or len(o) < len(self._r):
            raise ValueError(f"out must hold {len(self._r)} int32 values")
        for h, r in enumerate(self._r):
            o[h] = 0 if r is None else self._read(r, view, 0)

    def key_of(self, holder: int, alias: int) -> int | None:
        r = self._region(holder)
        if isinstance(alias, bool) or not isinstance(alias, int) or not 0 <= alias < (1 << 64):
            raise ValueError(f"alias must be an int in [0, 2**64), got {alias!r}")
        e, _ = r.find(alias, True)
        return None if e < 0 else int(r.entries64[4 * e])

    def blocks(self, holder: int) -> tuple[array[int], array[int], bytes]:
        r = self._writable(holder)
        keys, aliases, named = array("Q"), array("Q"), bytearray()
        e = r.hd32[_TAIL]
        while e != _NONE:
            keys.append(r.entries64[4 * e])
            aliases.append(r.entries64[4 * e + 1])
            named.append(1 if r.entries32[8 * e + 6] else 0)
            e = r.entries32[8 * e + 4]
        return keys, aliases, bytes(named)

    # -- what the writer does ------------------------------------------------------------------------

    def _changing(self, r: _Region, change: Any) -> Any:
        r.hd64[_SEQ] += 1
        try:
            return change()
        finally:
            r.hd64[_SEQ] += 1

    def insert(self, holder: int, chain: Buffer, n: int = -1, aliases: Buffer | None = None) -> int:
        r = self._writable(holder)
        view = _chain(chain, "chain")
        names = None if aliases is None else _chain(aliases, "aliases")
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, not {type(n).__name__}")
        if n != -1 and not 0 <= n <= len(view):
            raise ValueError(f"n must be -1 or in [0, {len(view)}], got {n}")
        if names is not None and len(names) != len(view):
            raise ValueError(f"aliases has {len(names)} entries, not one per block of the chain ({len(view)})")
        count = len(view) if n == -1 else n
        return int(self._changing(r, lambda: r.insert(view, names, count)))

    def forget(self, holder: int, aliases: Buffer) -> int:
        r = self._writable(holder)
        names = _chain(aliases, "aliases")

        def change() -> int:
            dropped = 0
            for alias in names:
                e, _ = r.find(alias, True)
                if e != _NONE:
                    r.drop(e)
                    dropped += 1
            return dropped

        return int(self._changing(r, change))

    def evict(self, holder: int, count: int) -> int:
        r = self._writable(holder)
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"count must be an int, not {type(count).__name__}")
        k = min(max(count, 0), 0x7FFFFFFF)

        def change() -> int:
            dropped = 0
            while dropped < k and r.hd32[_TAIL] != _NONE:
                r.drop(r.hd32[_TAIL])
                dropped += 1
            return dropped

        return int(self._changing(r, change))

    def clear(self, holder: int) -> int:
        return self.evict(holder, self.size(holder))

    def set_capacity(self, holder: int, capacity: int) -> int:
        r = self._writable(holder)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 <= capacity <= _MAX_POOL:
            raise ValueError(f"capacity must be an int in [0, {_MAX_POOL}], got {capacity!r}")

        def change() -> int:
            r.hd64[_CAPACITY] = capacity
            dropped = 0
            while r.hd64[_SIZE] > capacity:
                r.drop(r.hd32[_TAIL])
                dropped += 1
            return dropped

        return int(self._changing(r, change))

    def retire(self, holder: int) -> None:
        r = self._writable(holder)
        r.hd64[_RETIRED] = 1
        self._r[holder] = None
