"""Pure-Python twin of the compiled `_ring`: same names, same answers, no compiler needed.

It is the oracle the compiled core is tested against and the fallback where no compiler
exists (ROUTER_NO_EXTENSIONS=1). The algorithm is documented in `src/_ring.pyx`; this file
follows it step by step with Python ints and `bisect`, hashing with the `xxhash` package. It is
one file, as long as it is, because it mirrors the compiled module name for name and step for
step: a reader checks the two side by side.

It is past 450 lines because it is the twin of src/_ring.pyx: it mirrors the compiled ring function
for function, with the same names, signatures and answers, and a twin cut differently from its
original would be harder to hold equal.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import xxhash

__all__ = ["MovedRange", "Ring", "RingSnapshot", "active_vnodes", "xxh3_64"]

_SPAN_MAX = (1 << 64) - 1
_MAX_VNODES = 65536
_MAX_POINTS = 0x7FFFFFFF - 8  # as the compiled core: int32 indices plus sentinels
_INT64_MAX = (1 << 63) - 1

Key = str | bytes | bytearray | memoryview


class MovedRange(NamedTuple):
    """Keys whose hash lies in [lo, hi] moved from replica id `old` to `new` (None: nobody)."""

    lo: int
    hi: int
    old: str | None
    new: str | None

    @property
    def width(self) -> int:
        return self.hi - self.lo + 1


def _seed_value(seed: object) -> int:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    if not 0 <= seed <= _SPAN_MAX:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def _hash_any(key: object, seed: int) -> int:
    if isinstance(key, str):
        return xxhash.xxh3_64_intdigest(key.encode("utf-8"), seed)
    try:
        view = memoryview(key)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"keys must be str or bytes-like, not {type(key).__name__}") from None
    with view:
        return xxhash.xxh3_64_intdigest(view, seed)


def xxh3_64(data: Key, seed: int = 0) -> int:
    """XXH3-64 of `data` (bytes-like, or str as UTF-8), equal to xxhash.xxh3_64_intdigest."""
    return _hash_any(data, _seed_value(seed))


class RingSnapshot:
    """One immutable, published state of a ring: sorted points and their owners."""

    __slots__ = ("hashes", "n_routing", "origins", "owners", "replica_ids", "routing", "vnodes")

    def __init__(self, replica_ids: tuple[str, ...], points: list[tuple[int, int, int, int]]) -> None:
        self.replica_ids = replica_ids
        self.hashes = [p[0] for p in points]
        self.owners = [p[1] for p in points]
        self.origins = [p[2] for p in points]
        self.vnodes = [p[3] for p in points]
        routing = [False] * len(replica_ids)
        for owner in self.owners:
            routing[owner] = True
        self.routing = tuple(routing)
        self.n_routing = sum(routing)

    @property
    def size(self) -> int:
        """Number of points that route in this snapshot."""
        return len(self.hashes)

    def point_index(self, h: int) -> int:
        if not self.hashes:
            return -1
        i = bisect_left(self.hashes, h)
        return 0 if i == len(self.hashes) else i


class Ring:
    """Consistent-hash ring of `replica_ids` with `vnodes` points each, hashed with `seed`."""

    def __init__(self, replica_ids: Sequence[str], vnodes: int = 128, seed: int = 0) -> None:
        ids = _check_ids(replica_ids)
        if not isinstance(vnodes, int) or isinstance(vnodes, bool):
            raise TypeError(f"vnodes must be an int, not {type(vnodes).__name__}")
        if not 1 <= vnodes <= _MAX_VNODES:
            raise ValueError(f"vnodes must be in [1, {_MAX_VNODES}], got {vnodes}")
        if len(ids) * vnodes > _MAX_POINTS:
            raise ValueError(f"too many points: replicas * vnodes must stay at most {_MAX_POINTS}")
        self.seed = _seed_value(seed)
        self.vnodes = vnodes
        self._ids = ids
        self._weights = [1.0] * len(ids)
        self._available = [True] * len(ids)
        self._overrides: dict[tuple[str, int], str] = {}
        self._all: list[tuple[int, int, int, int]] = []
        self._place_all()
        self.current = self._build()

    def __repr__(self) -> str:
        return f"Ring({len(self._ids)} replicas, vnodes={self.vnodes}, seed={self.seed}, points={self.current.size})"

    # -- introspection ----------------------------------------------------------------------

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(self._ids)

    @property
    def n_replicas(self) -> int:
        return len(self._ids)

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(self._weights)

    @property
    def available(self) -> tuple[bool, ...]:
        return tuple(self._available)

    @property
    def overrides(self) -> dict[tuple[str, int], str]:
        """{(origin replica id, vnode number): replica id that serves it}."""
        return dict(self._overrides)

    @property
    def size(self) -> int:
        """Number of points that route now (active vnodes of available replicas)."""
        return self.current.size

    def index(self, replica_id: str) -> int:
        """Index of `replica_id` in replica_ids."""
        try:
            return self._ids.index(replica_id)
        except ValueError:
            raise KeyError(f"unknown replica {replica_id!r}") from None

    def shares(self) -> list[float]:
        """Each replica's share of the hash space, in replica_ids order (sums to 1 or 0)."""
        s = self.current
        owned = [0] * len(s.replica_ids)
        if not s.hashes:
            return [0.0] * len(s.replica_ids)
        owned[s.owners[0]] = s.hashes[0] + 1 + (_SPAN_MAX - s.hashes[-1])
        for k in range(1, len(s.hashes)):
            owned[s.owners[k]] += s.hashes[k] - s.hashes[k - 1]
        return [x / (1 << 64) for x in owned]

    def points(self) -> list[tuple[int, int, int, int]]:
        """The routing points in ring order: (hash, owner index, origin index, vnode number)."""
        s = self.current
        return list(zip(s.hashes, s.owners, s.origins, s.vnodes, strict=True))

    def key_hash(self, key: Key) -> int:
        """The ring position of `key`: xxh3_64(key, seed)."""
        return _hash_any(key, self.seed)

    # -- lookups ----------------------------------------------------------------------------

    def lookup(self, key: Key) -> int:
        """Index of the replica that owns `key` (str or bytes-like), or -1 if none can serve."""
        s = self.current
        i = s.point_index(_hash_any(key, self.seed))
        return -1 if i < 0 else s.owners[i]

    def lookup_hash(self, h: int) -> int:
        """Owner of ring position `h` (an int in [0, 2**64))."""
        s = self.current
        i = s.point_index(_position(h))
        return -1 if i < 0 else s.owners[i]

    def lookup_many(self, keys: Iterable[Key]) -> array[int]:
        """Owners of many keys at once, as array('q'); same answers as lookup()."""
        s = self.current
        out = array("q")
        for key in keys:
            i = s.point_index(_hash_any(key, self.seed))
            out.append(-1 if i < 0 else s.owners[i])
        return out

    def lookup_bounded(self, key: Key, loads: Sequence[int], c: float = 1.25) -> int:
        """Owner of `key` under bounded loads: the first replica clockwise whose load is below
        ceil(c * (total routing load + 1) / routing replicas). `loads` has one int per replica."""
        s = self.current
        la = _loads_array(loads, len(s.replica_ids))
        cap = _load_cap(s, la, _check_c(c))
        h = _hash_any(key, self.seed)
        return _walk(s, h, lambda owner: la[owner] < cap)

    def load_cap(self, loads: Sequence[int], c: float = 1.25) -> int:
        """The bounded-load cap for these loads: ceil(c * (routing load + 1) / routing replicas)."""
        s = self.current
        return _load_cap(s, _loads_array(loads, len(s.replica_ids)), _check_c(c))

    def lookup_excluding(self, key: Key, excluded: Iterable[int]) -> int:
        """Owner of `key` when the replica indices in `excluded` cannot serve (a retry walk)."""
        s = self.current
        flags = _exclusion_flags(excluded, len(s.replica_ids))
        h = _hash_any(key, self.seed)
        return _walk(s, h, lambda owner: not flags[owner])

    def successors(self, key: Key, limit: int | None = None) -> list[int]:
        """Distinct replicas in ring-walk order from `key`: the owner first, then who takes over
        if it fails, and so on (at most `limit`)."""
        s = self.current
        h = _hash_any(key, self.seed)
        want = s.n_routing if limit is None else max(0, min(int(limit), s.n_routing))
        i = s.point_index(h)
        out: list[int] = []
        if i < 0 or want <= 0:
            return out
        seen = set()
        n = len(s.hashes)
        for _ in range(n):
            owner = s.owners[i]
            if owner not in seen:
                seen.add(owner)
                out.append(owner)
                if len(out) == want:
                    break
            i = i + 1 if i + 1 < n else 0
        return out

    def locate(self, key: Key) -> tuple[int, int, int] | None:
        """(owner index, origin replica index, vnode number) of the point `key` lands on, or
        None on an empty ring. Origin and vnode name the point for per-vnode counters."""
        s = self.current
        i = s.point_index(_hash_any(key, self.seed))
        if i < 0:
            return None
        return (s.owners[i], s.origins[i], s.vnodes[i])

    # -- mutations: each publishes a new snapshot and returns what moved --------------------

    def set_weight(self, index: int, weight: float) -> list[MovedRange]:
        """Activate the first ceil(weight * vnodes) vnodes of replica `index` (weight in [0, 1])."""
        i = self._index_arg(index)
        self._weights[i] = _check_weight(weight)
        return self._publish()

    def set_available(self, index: int, available: bool) -> list[MovedRange]:
        """Take replica `index` in or out of routing; its keys go to the next replica clockwise."""
        i = self._index_arg(index)
        self._available[i] = bool(available)
        return self._publish()

    def add_replica(self, replica_id: str, weight: float = 1.0, available: bool = True) -> list[MovedRange]:
        """Append a replica (index n_replicas - 1); only keys landing on its points move."""
        ids = _check_ids([*self._ids, replica_id])
        w = _check_weight(weight)
        flag = bool(available)
        if len(ids) * self.vnodes > _MAX_POINTS:
            raise ValueError(f"too many points: replicas * vnodes must stay at most {_MAX_POINTS}")
        self._ids = ids
        self._weights.append(w)
        self._available.append(flag)
        self._place_all()
        return self._publish()

    def add_replicas(
        self,
        replica_ids: Sequence[str],
        weights: Sequence[float] | None = None,
        available: Sequence[bool] | None = None,
    ) -> list[MovedRange]:
        """Append several replicas at once, in order: one placement and one snapshot for them all."""
        new = list(replica_ids)
        ws = [1.0] * len(new) if weights is None else [_check_weight(w) for w in weights]
        flags = [True] * len(new) if available is None else [bool(a) for a in available]
        if len(ws) != len(new) or len(flags) != len(new):
            raise ValueError(f"weights and available must have one entry per replica ({len(new)})")
        ids = _check_ids([*self._ids, *new])
        if len(ids) * self.vnodes > _MAX_POINTS:
            raise ValueError(f"too many points: replicas * vnodes must stay at most {_MAX_POINTS}")
        self._ids = ids
        self._weights.extend(ws)
        self._available.extend(flags)
        self._place_all()
        return self._publish()

    def remove_replica(self, index: int) -> list[MovedRange]:
        """Remove replica `index`; later replicas shift down by one. Its keys move clockwise,
        and vnode overrides that name it are dropped."""
        i = self._index_arg(index)
        gone = self._ids.pop(i)
        del self._weights[i]
        del self._available[i]
        self._overrides = {k: v for k, v in self._overrides.items() if k[0] != gone and v != gone}
        self._place_all()
        return self._publish()

    def reassign_vnode(self, origin: int, vnode: int, owner: int) -> list[MovedRange]:
        """Serve vnode `vnode` of replica `origin` from replica `owner` (the rebalancer's move).
        Reassigning it to its origin clears the override."""
        o = self._index_arg(origin)
        w = self._index_arg(owner)
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

    def clear_override(self, origin: int, vnode: int) -> list[MovedRange]:
        """Give vnode `vnode` of replica `origin` back to its origin."""
        return self.reassign_vnode(origin, vnode, origin)

    # -- building ---------------------------------------------------------------------------

    def _index_arg(self, index: object) -> int:
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"replica index must be an int, not {type(index).__name__}")
        if not 0 <= index < len(self._ids):
            raise IndexError(f"replica index {index} out of range for {len(self._ids)} replicas")
        return index

    def _place_all(self) -> None:
        # (hash, rank of origin id, vnode, origin index), sorted: the order the compiled core uses
        ranks = {rid: rank for rank, rid in enumerate(sorted(self._ids))}
        points = []
        for r, rid in enumerate(self._ids):
            for v in range(self.vnodes):
                points.append((xxhash.xxh3_64_intdigest(f"{rid}#{v}".encode(), self.seed), ranks[rid], v, r))
        points.sort()
        self._all = points

    def _build(self) -> RingSnapshot:
        index_of = {rid: i for i, rid in enumerate(self._ids)}
        active = [active_vnodes(w, self.vnodes) for w in self._weights]
        served_by = {(index_of[o], v): index_of[w] for (o, v), w in self._overrides.items()}
        points = []
        for h, _rank, v, origin in self._all:
            if v < active[origin]:
                owner = served_by.get((origin, v), origin)
                if self._available[owner]:
                    points.append((h, owner, origin, v))
        return RingSnapshot(tuple(self._ids), points)

    def _publish(self) -> list[MovedRange]:
        old = self.current
        self.current = self._build()
        return _moved_ranges(old, self.current)


def _walk(s: RingSnapshot, h: int, can_serve: object) -> int:
    i = s.point_index(h)
    if i < 0:
        return -1
    n = len(s.hashes)
    for _ in range(n):
        owner = s.owners[i]
        if can_serve(owner):  # type: ignore[operator]
            return owner
        i = i + 1 if i + 1 < n else 0
    return -1


def _load_cap(s: RingSnapshot, loads: array[int], c: float) -> int:
    # as the compiled core: a saturating total, never below the exact ceil((L + 1) / n)
    if s.n_routing == 0:
        return 0
    total = min(sum(load for load, routing in zip(loads, s.routing, strict=True) if routing), _INT64_MAX)
    if total == _INT64_MAX:  # saturated: the true mean is unknown, so nothing is over it
        return _INT64_MAX
    f = math.ceil(c * (float(total) + 1.0) / float(s.n_routing))
    cap = _INT64_MAX if f >= 9223372036854775807.0 else int(f)
    return max(cap, total // s.n_routing + 1)


def _moved_ranges(a: RingSnapshot, b: RingSnapshot) -> list[MovedRange]:
    # See the compiled twin: walk the union of both point sets; each arc between boundaries
    # has one owner per ring; report arcs whose owner changed as non-wrapping [lo, hi] ranges.
    out: list[MovedRange] = []
    na, nb = len(a.hashes), len(b.hashes)
    if na == 0 and nb == 0:
        return out
    wrap_old = a.replica_ids[a.owners[0]] if na else None
    wrap_new = b.replica_ids[b.owners[0]] if nb else None
    i = j = lo = 0
    while i < na or j < nb:
        bound = a.hashes[i] if j >= nb or (i < na and a.hashes[i] <= b.hashes[j]) else b.hashes[j]
        old = a.replica_ids[a.owners[i]] if i < na else wrap_old
        new = b.replica_ids[b.owners[j]] if j < nb else wrap_new
        _emit(out, lo, bound, old, new)
        while i < na and a.hashes[i] == bound:
            i += 1
        while j < nb and b.hashes[j] == bound:
            j += 1
        if bound == _SPAN_MAX:
            return out
        lo = bound + 1
    _emit(out, lo, _SPAN_MAX, wrap_old, wrap_new)
    return out


def _emit(out: list[MovedRange], lo: int, hi: int, old: str | None, new: str | None) -> None:
    if old == new:
        return
    if out:
        last = out[-1]
        if last.old == old and last.new == new and last.hi + 1 == lo:
            out[-1] = MovedRange(last.lo, hi, old, new)
            return
    out.append(MovedRange(lo, hi, old, new))


def _position(h: object) -> int:
    if not isinstance(h, int) or isinstance(h, bool):
        raise TypeError(f"ring positions must be ints, not {type(h).__name__}")
    if not 0 <= h <= _SPAN_MAX:
        raise ValueError(f"ring positions must be in [0, 2**64), got {h}")
    return h


def active_vnodes(weight: float, vnodes: int) -> int:
    """How many vnodes a weight activates: ceil(weight * vnodes), with a 1e-9 tolerance so that
    weight k / vnodes activates exactly k, and at least one for any weight above 0.
    DO NOT CHANGE: which vnodes a weight activates decides where keys live."""
    if weight <= 0:
        return 0
    return max(1, min(vnodes, math.ceil(weight * vnodes - 1e-9)))


def _check_ids(replica_ids: object) -> list[str]:
    if isinstance(replica_ids, (str, bytes)):
        raise TypeError("replica_ids must be a sequence of str, not a single string")
    ids: list[str] = []
    for rid in replica_ids:  # type: ignore[attr-defined]
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


def _check_weight(weight: object) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(f"weight must be a number, not {type(weight).__name__}")
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight!r}")
    return float(weight)


def _check_c(c: object) -> float:
    if isinstance(c, bool) or not isinstance(c, (int, float)):
        raise TypeError(f"c must be a number, not {type(c).__name__}")
    if not 1.0 <= c < math.inf:
        raise ValueError(f"c must be a finite number >= 1, got {c!r}")
    return float(c)


def _loads_array(loads: Sequence[int], n: int) -> array[int]:
    la = loads if isinstance(loads, array) and loads.typecode == "q" else array("q", loads)
    if len(la) != n:
        raise ValueError(f"loads has {len(la)} entries for {n} replicas")
    for i, load in enumerate(la):
        if load < 0:
            raise ValueError(f"loads must not be negative (replica {i}: {load})")
    return la


def _exclusion_flags(excluded: Iterable[int], n: int) -> bytearray:
    flags = bytearray(n)
    for i in excluded:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"excluded replica indices must be ints, not {type(i).__name__}")
        if not 0 <= i < n:
            raise IndexError(f"excluded replica index {i} out of range for {n} replicas")
        flags[i] = 1
    return flags
