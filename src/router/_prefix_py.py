"""Pure-Python twin of the compiled prefix index `_prefix`: the same names, signatures and answers.

Per holder, an OrderedDict of block keys in LRU order (last = most recent), each with its
engine's name for it (or None), and a dict of those names back to the keys. Block keys are
XXH3-64 by the xxhash package, each block seeded with its parent's key; `match` probes in the
compiled core's exact order (galloping over 1, 2, 4, ... blocks, then bisection), so the two
agree even where a chain has a gap. `chain_of_parts` joins the pieces and keys the join; `price`
does the compiled loop's float operations in its order, so the costs are equal, not only close.
See src/_prefix.pyx for the algorithm and its invariants.
It is one file, as long as it is, because it mirrors the compiled module name for name and step
for step: a reader checks the two side by side.

It is past 450 lines because it is the twin of src/_prefix.pyx: it mirrors the compiled index
function for function, with the same names, signatures and answers, and a twin cut differently from
its original would be harder to hold equal.
"""

from __future__ import annotations

import itertools
import math
import sys
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import xxhash

from router._gallop import gallop

if TYPE_CHECKING:
    from collections.abc import Iterable

    from typing_extensions import Buffer

__all__ = [
    "PRICE_CANDIDATE",
    "PRICE_GATED",
    "PRICE_NEAR",
    "SPREAD_SMOOTH",
    "PrefixIndex",
    "block_chain",
    "chain_of_parts",
]

# price's flags (bits of flags_out)
PRICE_CANDIDATE = 1
PRICE_GATED = 2
PRICE_NEAR = 4
# price's spread: requests added to the mean: a handful of requests is no imbalance yet
SPREAD_SMOOTH = 4.0

_SEED_SPAN = 1 << 64
_CAPACITY_SPAN = 1 << 63
_MAX_CHAIN = 0x7FFFFFFF  # as the compiled core: matches are int32
_MAX_SSIZE = sys.maxsize
_NATIVE_ORDER = ("@", "=", "<") if sys.byteorder == "little" else ("@", "=")


class _Kind(NamedTuple):
    """What a buffer argument holds: its format codes of `size` bytes, as memoryview.cast reads it."""

    codes: str
    size: int
    cast: Literal["Q", "i", "q", "d", "B"]
    writable: bool
    text: str


# 'L' and 'l' are 8 bytes on LP64 hosts, 4 on Windows: the item size decides
_CHAIN = _Kind("QL", 8, "Q", False, "a buffer of uint64 (array('Q'))")
_MATCHED = _Kind("il", 4, "i", True, "a writable buffer of int32 (array('i'))")
_INT32 = _Kind("il", 4, "i", False, "a buffer of int32 (array('i'))")
_INT64 = _Kind("ql", 8, "q", False, "a buffer of int64 (array('q'))")
_FLOAT64 = _Kind("d", 8, "d", False, "a buffer of float64 (array('d'))")
_UINT8 = _Kind("B", 1, "B", False, "a buffer of uint8 (array('B'))")
_FLOAT64_OUT = _Kind("d", 8, "d", True, "a writable buffer of float64 (array('d'))")
_UINT8_OUT = _Kind("B", 1, "B", True, "a writable buffer of uint8 (array('B'))")


def _seed_value(seed: object) -> int:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    if not 0 <= seed < _SEED_SPAN:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def _block_len_arg(block_len: object) -> int:
    if isinstance(block_len, bool) or not isinstance(block_len, int):
        raise TypeError(f"block_len must be an int, not {type(block_len).__name__}")
    if block_len <= 0:
        raise ValueError(f"block_len must be positive, got {block_len}")
    return block_len


def block_chain(data: str | Buffer, block_len: int, seed: int = 0) -> array[int]:
    """Keys of the whole `block_len`-byte blocks of `data` (str as UTF-8), as array('Q'):
    key[0] = xxh3_64(block 0, seed), key[i] = xxh3_64(block i, key[i-1]). A trailing partial
    block has no key. Two inputs share their first k keys exactly when they share k whole blocks,
    which is what a paged prefix cache keys its blocks by."""
    h = _seed_value(seed)
    block_len = _block_len_arg(block_len)
    if isinstance(data, str):
        data = data.encode("utf-8")
    try:
        view = memoryview(data)
        if not view.c_contiguous:
            raise TypeError
    except (TypeError, BufferError):
        raise TypeError(f"data must be str or bytes-like, not {type(data).__name__}") from None
    out = array("Q")
    with view:
        flat = view.cast("B")
        for start in range(0, len(flat) - block_len + 1, block_len):
            h = xxhash.xxh3_64_intdigest(flat[start : start + block_len], h)
            out.append(h)
    return out


def chain_of_parts(
    parts: list[str | Buffer] | tuple[str | Buffer, ...], block_len: int, seed: int, mark: int
) -> tuple[array[int], int, int]:
    """(block_chain of the concatenation of `parts`, its length in bytes, the bytes before part
    number `mark`), the parts being str (as UTF-8, lone surrogates passed through) and bytes-like
    pieces, in a list or tuple; 0 <= mark <= len(parts)."""
    _seed_value(seed)
    _block_len_arg(block_len)
    if not isinstance(parts, (list, tuple)):
        raise TypeError(f"parts must be a list or tuple of str and bytes-like pieces, not {type(parts).__name__}")
    items = tuple(parts)
    if isinstance(mark, bool) or not isinstance(mark, int):
        raise TypeError(f"mark must be an int, not {type(mark).__name__}")
    if not 0 <= mark <= len(items):
        raise ValueError(f"mark must be in [0, {len(items)}], got {mark}")
    pieces: list[bytes | memoryview] = []
    total = head = 0
    for i, part in enumerate(items):
        if i == mark:
            head = total
        if isinstance(part, str):
            piece: bytes | memoryview = part.encode("utf-8", "surrogatepass")
        else:
            try:
                piece = memoryview(part)
                if not piece.c_contiguous:
                    raise TypeError
            except (TypeError, BufferError):
                raise TypeError(f"parts[{i}] must be str or bytes-like, not {type(part).__name__}") from None
        pieces.append(piece)
        total += piece.nbytes if isinstance(piece, memoryview) else len(piece)
    if mark == len(items):
        head = total
    return block_chain(b"".join(pieces), block_len, seed), total, head


def _capacity_arg(capacity: object) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"capacity must be an int, not {type(capacity).__name__}")
    if not 0 <= capacity < _CAPACITY_SPAN:
        raise ValueError(f"capacity must be in [0, 2**63), got {capacity}")
    return capacity


def _count_arg(name: str, value: object, clamp: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")
    return min(value, clamp)


def _float_arg(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, not {type(value).__name__}")
    return float(value)


def _format_is(fmt: str, itemsize: int, codes: str, size: int) -> bool:
    if fmt[:1] in _NATIVE_ORDER:
        fmt = fmt[1:]
    return itemsize == size and len(fmt) == 1 and fmt in codes


def _buffer(obj: object, name: str, kind: _Kind) -> memoryview[Any]:
    """`obj` as a 1-D memoryview of the native items `kind` names (writable where it says so)."""
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except (TypeError, BufferError):
        raise TypeError(f"{name} must be {kind.text}, not {type(obj).__name__}") from None
    if not _format_is(view.format, view.itemsize, kind.codes, kind.size):
        raise TypeError(f"{name} must be {kind.text}, not one of format {view.format!r}")
    if view.ndim != 1 or not view.c_contiguous:
        raise TypeError(f"{name} must be a one-dimensional contiguous buffer")
    if kind.writable and view.readonly:
        raise TypeError(f"{name} must be {kind.text}, not a read-only one")
    if len(view) > _MAX_CHAIN:
        raise ValueError(f"{name} is longer than 2**31 - 1 entries")
    items: memoryview[Any] = view.cast("B").cast(kind.cast)
    return items


def _fleet_buffer(obj: object, name: str, kind: _Kind, n: int) -> memoryview[Any]:
    """A per-position buffer of price: at least as long as `holders`."""
    view = _buffer(obj, name, kind)
    if len(view) < n:
        raise ValueError(f"{name} has {len(view)} entries, fewer than holders ({n})")
    return view


def _match(held: OrderedDict[int, int | None], chain: memoryview) -> int:
    # The compiled core's probe order exactly (router._gallop).
    return gallop(held, chain, len(chain)) if held else 0


class PrefixIndex:
    """Per holder (replica), an LRU set of block keys of at most `capacity` blocks.

    Holders are numbered from 0; add_holder takes the lowest free number."""

    __slots__ = ("_capacity", "_lru", "_names")

    def __init__(self) -> None:
        self._lru: list[OrderedDict[int, int | None] | None] = []  # key -> its alias; None: a free number
        self._capacity: list[int] = []
        self._names: list[dict[int, int]] = []  # per holder, alias -> key

    def __repr__(self) -> str:
        return f"PrefixIndex({len(self._lru)} holders, {self.total()} blocks)"

    def _held(self, holder: object) -> OrderedDict[int, int | None]:
        if isinstance(holder, bool) or not isinstance(holder, int):
            raise TypeError(f"holder must be an int, not {type(holder).__name__}")
        held = self._lru[holder] if 0 <= holder < len(self._lru) else None
        if held is None:
            raise ValueError(f"holder {holder} is not in use")
        return held

    # -- holders --------------------------------------------------------------------------------

    @property
    def n_holders(self) -> int:
        """1 + the highest holder number ever in use: the length `match_all` fills."""
        return len(self._lru)

    def add_holder(self, capacity: int) -> int:
        """A new holder of `capacity` blocks; its number is the lowest free one."""
        cap = _capacity_arg(capacity)
        holder = next((h for h, held in enumerate(self._lru) if held is None), len(self._lru))
        if holder == len(self._lru):
            self._lru.append(None)
            self._capacity.append(0)
            self._names.append({})
        self._lru[holder] = OrderedDict()
        self._capacity[holder] = cap
        self._names[holder] = {}
        return holder

    def remove_holder(self, holder: int) -> None:
        """Drops the holder's blocks; its number becomes free for add_holder."""
        self._held(holder)
        self._lru[holder] = None
        self._names[holder] = {}

    def capacity(self, holder: int) -> int:
        """Blocks the holder may keep."""
        self._held(holder)
        return self._capacity[holder]

    def set_capacity(self, holder: int, capacity: int) -> int:
        """Sets the holder's capacity, evicting its least-recent blocks down to it; how many it evicted."""
        held = self._held(holder)
        self._capacity[holder] = _capacity_arg(capacity)
        return self._evict(holder, held, len(held) - self._capacity[holder])

    def size(self, holder: int) -> int:
        """Blocks the holder keeps now."""
        return len(self._held(holder))

    def clear(self, holder: int) -> int:
        """Drops every block of the holder (its engine restarted); how many it dropped."""
        held = self._held(holder)
        dropped = len(held)
        held.clear()
        self._names[holder].clear()
        return dropped

    def total(self) -> int:
        """Blocks held, all holders together."""
        return sum(len(held) for held in self._lru if held is not None)

    def memory_bytes(self) -> int:
        """A rough estimate, not a measurement: the holder lists' own size (sys.getsizeof of each
        OrderedDict, which counts its table and order nodes) plus a 36-byte int object per held
        key. Keys shared between holders may be one object; they count once per holder."""
        estimate = sys.getsizeof(self._lru) + sys.getsizeof(self._capacity) + sys.getsizeof(self._names)
        for held, names in zip(self._lru, self._names, strict=True):
            if held is not None:
                estimate += sys.getsizeof(held) + 36 * len(held) + sys.getsizeof(names) + 36 * len(names)
        return estimate

    # -- blocks ---------------------------------------------------------------------------------

    def insert(self, holder: int, chain: Buffer, n: int = -1, aliases: Buffer | None = None) -> int:
        """Records that `holder` now caches chain[:n] (all of it for n = -1): touches chain[n-1]
        down to chain[0], each becoming the most recent, then evicts least-recent blocks down
        to the capacity. Returns how many of those blocks it did not hold before (some may
        have been evicted again when n exceeds the capacity).

        With `aliases` (uint64, as long as `chain`), block chain[i] is also named aliases[i]:
        its engine's hash of it, by which `forget` drops it and `key_of` finds it. A block has
        one name (a new one replaces it), a name one block of a holder (another block named
        alike loses it); a block that leaves the holder takes its name along."""
        held = self._held(holder)
        keys = _buffer(chain, "chain", _CHAIN)
        named = None if aliases is None else _buffer(aliases, "aliases", _CHAIN)
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, not {type(n).__name__}")
        if n != -1 and not 0 <= n <= len(keys):
            raise ValueError(f"n must be -1 or in [0, {len(keys)}], got {n}")
        if named is not None and len(named) != len(keys):
            raise ValueError(f"aliases has {len(named)} entries, not one per block of the chain ({len(keys)})")
        count = len(keys) if n == -1 else n
        names = None if named is None else named[:count].tolist()
        added = 0
        for i, key in reversed(list(enumerate(keys[:count].tolist()))):
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
                added += 1
            if names is not None:
                self._name(holder, held, key, names[i])
        self._evict(holder, held, len(held) - self._capacity[holder])
        return added

    def _name(self, holder: int, held: OrderedDict[int, int | None], key: int, alias: int) -> None:
        old = held[key]
        if old == alias:
            return
        names = self._names[holder]
        if old is not None:
            del names[old]
        other = names.get(alias)
        if other is not None:  # the name moves to this block
            held[other] = None
        names[alias] = key
        held[key] = alias

    def forget(self, holder: int, aliases: Buffer) -> int:
        """Drops the holder's blocks its engine names `aliases` (uint64): the engine removed
        them. How many of them it held; a name it does not know is passed over."""
        held = self._held(holder)
        names = self._names[holder]
        dropped = 0
        for alias in _buffer(aliases, "aliases", _CHAIN).tolist():
            key = names.pop(alias, None)
            if key is not None:
                del held[key]
                dropped += 1
        return dropped

    def key_of(self, holder: int, alias: int) -> int | None:
        """The key of the holder's block its engine names `alias`, or None: it holds none."""
        self._held(holder)
        if isinstance(alias, bool) or not isinstance(alias, int):
            raise TypeError(f"alias must be an int, not {type(alias).__name__}")
        if not 0 <= alias < _SEED_SPAN:
            raise ValueError(f"alias must be in [0, 2**64), got {alias}")
        return self._names[holder].get(alias)

    def match(self, holder: int, chain: Buffer) -> int:
        """How many leading blocks of `chain` the holder keeps."""
        held = self._held(holder)
        return _match(held, _buffer(chain, "chain", _CHAIN))

    def match_after(self, holder: int, chain: Buffer, evicted: int) -> int:
        """How many leading blocks of `chain` the holder would keep once its `evicted` least-recent
        blocks were gone: match() as it would be after evict(holder, evicted), nothing dropped."""
        held = self._held(holder)
        keys = _buffer(chain, "chain", _CHAIN)
        count = _count_arg("evicted", evicted, len(held))
        matched = _match(held, keys)
        if matched == 0 or count == 0:
            return matched
        position = {key: i for i, key in reversed(list(enumerate(keys[:matched].tolist())))}
        kept = matched
        for key in itertools.islice(held, count):
            i = position.get(key)
            if i is not None and i < kept:
                kept = i
        return kept

    def match_after_many(self, holder: int, chains: Iterable[Buffer], evicted: Iterable[int]) -> list[int]:
        """[match_after(holder, c, k) for c in chains for k in evicted], in one walk of the holder's
        LRU tail (its max(evicted) least-recent blocks) rather than one for each chain and count:
        what each of a replica's returning conversations would keep were its oldest blocks gone."""
        held = self._held(holder)
        counts = [_count_arg("evicted", k, len(held)) for k in evicted]
        keys = [_buffer(chain, "chain", _CHAIN) for chain in chains]
        matched = [_match(held, chain) for chain in keys]
        out = [m for m in matched for _ in counts]
        if not counts:
            return []
        places: dict[int, list[tuple[int, int]]] = {}  # key -> (chain, position) of each matched block
        for i, chain in enumerate(keys):
            for at, key in enumerate(chain[: matched[i]].tolist()):
                places.setdefault(key, []).append((i, at))
        for walked, key in enumerate(itertools.islice(held, max(counts))):
            for i, at in places.get(key, ()):
                for j, count in enumerate(counts):
                    if walked < count and at < out[i * len(counts) + j]:
                        out[i * len(counts) + j] = at
        return out

    def match_all(self, chain: Buffer, out: Buffer) -> None:
        """out[h] = match(h, chain) for every holder number h < n_holders (0 for free numbers)."""
        keys = _buffer(chain, "chain", _CHAIN)
        counts = _buffer(out, "out", _MATCHED)
        if len(counts) < len(self._lru):
            raise ValueError(f"out has {len(counts)} entries, fewer than n_holders ({len(self._lru)})")
        for h, held in enumerate(self._lru):
            counts[h] = 0 if held is None else _match(held, keys)

    def price(
        self,
        chain: Buffer,
        holders: Buffer,
        busy_until: Buffer,
        seconds_per_token: Buffer,
        loads: Buffer,
        waiting: Buffer,
        caps: Buffer,
        excluded: Buffer,
        now: float,
        decode_s: float,
        mean_uncached: float,
        block_tokens: float,
        total_tokens: float,
        last: int,
        history_blocks: int,
        tie_s: float,
        tie_share: float,
        cached_out: Buffer,
        wait_out: Buffer,
        cost_out: Buffer,
        flags_out: Buffer,
        recent: Buffer | None = None,
        recent_scale: float = 1.0,
        spread_tokens: float = 0.0,
        spread_out: Buffer | None = None,
        interference: float = 0.0,
        history_from_all: bool = False,
        home_share: float = -1.0,
        known: Buffer | None = None,
        spread_whole: bool = False,
        evicts: Buffer | None = None,
    ) -> tuple[int, int, int]:
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
        keys = _buffer(chain, "chain", _CHAIN)
        hs = _buffer(holders, "holders", _INT32)
        n = len(hs)
        busy = _fleet_buffer(busy_until, "busy_until", _FLOAT64, n)
        speeds = _fleet_buffer(seconds_per_token, "seconds_per_token", _FLOAT64, n)
        flights = _fleet_buffer(loads, "loads", _INT64, n)
        queues = _fleet_buffer(waiting, "waiting", _FLOAT64, n)
        limits = _fleet_buffer(caps, "caps", _INT64, n)
        skip = _fleet_buffer(excluded, "excluded", _UINT8, n)
        now = _float_arg("now", now)
        decode_s = _float_arg("decode_s", decode_s)
        mean_uncached = _float_arg("mean_uncached", mean_uncached)
        block_tokens = _float_arg("block_tokens", block_tokens)
        total_tokens = _float_arg("total_tokens", total_tokens)
        if isinstance(last, bool) or not isinstance(last, int):
            raise TypeError(f"last must be an int, not {type(last).__name__}")
        if not -1 <= last < n:
            raise ValueError(f"last must be -1 or in [0, {n}), got {last}")
        history_blocks = _count_arg("history_blocks", history_blocks, _MAX_SSIZE)
        # a new conversation's messages before its last: the prefix others may have sent (a system or tool prompt)
        opening_history = float(history_blocks) * block_tokens
        tie_s = _float_arg("tie_s", tie_s)
        tie_share = _float_arg("tie_share", tie_share)
        cached_row = _fleet_buffer(cached_out, "cached_out", _FLOAT64_OUT, n)
        wait_row = _fleet_buffer(wait_out, "wait_out", _FLOAT64_OUT, n)
        cost_row = _fleet_buffer(cost_out, "cost_out", _FLOAT64_OUT, n)
        flags_row = _fleet_buffer(flags_out, "flags_out", _UINT8_OUT, n)
        sent = None if recent is None else _fleet_buffer(recent, "recent", _FLOAT64, n)
        recent_scale = _float_arg("recent_scale", recent_scale)
        spread_tokens = _float_arg("spread_tokens", spread_tokens)
        if not isinstance(spread_whole, bool):
            raise TypeError(f"spread_whole must be a bool, not {type(spread_whole).__name__}")
        spread_row = None if spread_out is None else _fleet_buffer(spread_out, "spread_out", _FLOAT64_OUT, n)
        interference = _float_arg("interference", interference)
        if not isinstance(history_from_all, bool):
            raise TypeError(f"history_from_all must be a bool, not {type(history_from_all).__name__}")
        home_share = _float_arg("home_share", home_share)
        told = None if known is None else _fleet_buffer(known, "known", _FLOAT64, n)
        pushed = None if evicts is None else _fleet_buffer(evicts, "evicts", _FLOAT64, n)
        lru = self._lru
        for i in range(n):
            h = hs[i]
            if not skip[i] and h != -1 and not (0 <= h < len(lru) and lru[h] is not None):
                raise ValueError(f"holders[{i}] is {h}, not -1 or a holder in use")

        # The compiled loop's float operations in its order; min and max written out as it
        # writes them (the first value unless the second is strictly past it, as Python's).
        best, best_cost = -1, 0.0
        if history_from_all and last >= 0:
            # a keyed session's replica holds whatever of this prompt any replica holds
            for i in range(n):
                h = hs[i]
                if 0 <= h < len(lru) and lru[h] is not None:
                    history_blocks = max(history_blocks, _match(lru[h], keys))
        shares = sent if spread_tokens > 0.0 else None  # None: no spread term
        mean = 0.0
        if shares is not None:
            # the candidates' mean of recent requests, gated ones included, in position order
            recent_sum, n_candidates = 0.0, 0
            for i in range(n):
                if not skip[i]:
                    recent_sum = recent_sum + shares[i] * recent_scale
                    n_candidates += 1
            if n_candidates > 0:
                mean = recent_sum / float(n_candidates)
        for i in range(n):
            if skip[i]:
                continue
            h = hs[i]
            if told is not None and told[i] >= 0.0:
                cached = told[i]  # what its engine says it holds: no model, no history credit
            else:
                held = lru[h] if h >= 0 else None
                blocks = 0 if held is None else _match(held, keys)
                if i == last and history_blocks > blocks:
                    blocks = history_blocks
                cached = float(blocks) * block_tokens
            if total_tokens < cached:
                cached = total_tokens
            uncached = total_tokens - cached
            spt = speeds[i]
            load = float(flights[i])
            if interference != 0.0:
                spt = spt * (1.0 + interference * load)
            queued = busy[i] - now
            wait = (queued if queued > 0.0 else 0.0) + load * decode_s
            if queues[i] >= 0.0 and queues[i] > load:  # queued there by someone else
                wait = wait + (queues[i] - load) * mean_uncached * spt
            cost = wait + uncached * spt
            spread = 0.0
            if shares is not None and i != last and total_tokens > 0.0:
                sent_now = shares[i] * recent_scale
                if sent_now > mean:
                    # spread_tokens of prefill per unit of excess, times the share of the prompt it computes
                    smooth = mean + SPREAD_SMOOTH
                    # sent_now > mean: a positive numerator, and C's x / +0.0 is +inf
                    excess = (sent_now - mean) / smooth if smooth != 0.0 else math.inf
                    if spread_whole:
                        # a new conversation: charged whole, and at least what the shared prefix there saves it
                        shared = opening_history if opening_history < cached else cached
                        base = shared if shared > spread_tokens else spread_tokens
                        spread = (((base * spt) * excess) * total_tokens) / total_tokens
                    else:
                        spread = (((spread_tokens * spt) * excess) * uncached) / total_tokens
                    cost = cost + spread
            if pushed is not None and pushed[i] != 0.0:
                cost = cost + pushed[i]  # what it pushes out of conversations likely back soon
            flags = PRICE_CANDIDATE
            if flights[i] >= limits[i]:
                flags |= PRICE_GATED
            elif best < 0 or cost < best_cost:
                best, best_cost = i, cost
            cached_row[i] = cached
            wait_row[i] = wait
            cost_row[i] = cost
            flags_row[i] = flags
            if spread_row is not None:
                spread_row[i] = spread
        near = 0
        if best >= 0:
            slack = tie_s
            if best_cost * tie_share > slack:
                slack = best_cost * tie_share
            limit = best_cost + slack
            for i in range(n):
                if not skip[i] and not flags_row[i] & PRICE_GATED and cost_row[i] <= limit:
                    flags_row[i] |= PRICE_NEAR
                    near += 1
        home = -1
        if home_share >= 0.0:
            most = home_share * total_tokens
            for i in range(n):
                if not skip[i] and cached_row[i] >= most and cached_row[i] > 0.0:
                    home, most = i, cached_row[i]
        return best, near, home

    def truncate(self, holder: int, chain: Buffer, keep: int) -> int:
        """The holder's engine keeps only `keep` blocks of `chain`: drops chain[keep:] from the
        holder; how many of them it held."""
        held = self._held(holder)
        keys = _buffer(chain, "chain", _CHAIN)
        start = _count_arg("keep", keep, len(keys))
        names = self._names[holder]
        dropped = 0
        for key in keys[start:].tolist():
            if key in held:
                alias = held.pop(key)
                if alias is not None:
                    del names[alias]
                dropped += 1
        return dropped

    def evict(self, holder: int, count: int) -> int:
        """Drops the holder's `count` least-recent blocks; how many it dropped."""
        held = self._held(holder)
        return self._evict(holder, held, _count_arg("count", count, len(held)))

    def _evict(self, holder: int, held: OrderedDict[int, int | None], count: int) -> int:
        names = self._names[holder]
        for _ in range(count):
            alias = held.popitem(last=False)[1]
            if alias is not None:
                del names[alias]
        return max(count, 0)
