"""The compiled ring and its Python twin give the same answers, whatever happens to the ring."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router import _ring_py

IDS = [f"r{i}" for i in range(12)] + ["gpu-ü", "a#1", "a"]

key_st = st.one_of(st.text(max_size=40), st.binary(max_size=300))
ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("weight"), st.integers(0, 20), st.floats(0, 1)),
        st.tuples(st.just("available"), st.integers(0, 20), st.booleans()),
        st.tuples(st.just("add"), st.sampled_from(IDS), st.sampled_from([0.0, 0.3, 1.0])),
        st.tuples(st.just("remove"), st.integers(0, 20)),
        st.tuples(st.just("reassign"), st.integers(0, 20), st.integers(0, 15), st.integers(0, 20)),
        st.tuples(st.just("clear"), st.integers(0, 20), st.integers(0, 15)),
    ),
    max_size=12,
)


def apply(ring: Any, op: tuple[Any, ...]) -> Any:
    n = ring.n_replicas
    try:
        match op:
            case ("weight", i, w):
                return ring.set_weight(i % max(n, 1), w) if n else None
            case ("available", i, flag):
                return ring.set_available(i % max(n, 1), flag) if n else None
            case ("add", rid, w):
                return ring.add_replica(rid, w)
            case ("remove", i):
                return ring.remove_replica(i % max(n, 1)) if n else None
            case ("reassign", o, v, w):
                return ring.reassign_vnode(o % max(n, 1), v, w % max(n, 1)) if n else None
            case ("clear", o, v):
                return ring.clear_override(o % max(n, 1), v) if n else None
    except (ValueError, IndexError) as exc:  # duplicate ids: both must refuse alike
        return ("error", type(exc), str(exc))
    raise AssertionError(op)


def assert_same(a: Any, b: Any, sample: list[Any]) -> None:
    assert a.replica_ids == b.replica_ids
    assert a.weights == b.weights and a.available == b.available and a.overrides == b.overrides
    assert a.size == b.size == a.current.size
    assert list(a.lookup_many(sample)) == list(b.lookup_many(sample))
    for x, y in zip(a.shares(), b.shares(), strict=True):
        assert math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-15)
    n = a.n_replicas
    loads = [(7 * i) % 5 for i in range(n)]
    for key in sample:
        assert a.lookup(key) == b.lookup(key)
        assert a.key_hash(key) == b.key_hash(key)
        assert a.locate(key) == b.locate(key)
        assert a.successors(key) == b.successors(key)
        assert a.lookup_bounded(key, loads, 1.1) == b.lookup_bounded(key, loads, 1.1)
        assert a.lookup_excluding(key, range(0, n, 2)) == b.lookup_excluding(key, range(0, n, 2))
    assert a.load_cap(loads, 1.5) == b.load_cap(loads, 1.5)


@given(
    ids=st.lists(st.sampled_from(IDS), unique=True, max_size=8),
    vnodes=st.integers(1, 16),
    seed=st.integers(0, (1 << 64) - 1),
    ops=ops_st,
    sample=st.lists(key_st, min_size=1, max_size=25),
)
def test_compiled_equals_twin_over_any_history(
    compiled: ModuleType,
    ids: list[str],
    vnodes: int,
    seed: int,
    ops: list[tuple[Any, ...]],
    sample: list[Any],
) -> None:
    a = compiled.Ring(ids, vnodes, seed)
    b = _ring_py.Ring(ids, vnodes, seed)
    assert_same(a, b, sample)
    for op in ops:
        moved_a, moved_b = apply(a, op), apply(b, op)
        assert moved_a == moved_b, op
        assert_same(a, b, sample)


@given(h=st.integers(0, (1 << 64) - 1), ids=st.lists(st.sampled_from(IDS), unique=True, min_size=1, max_size=6))
def test_lookup_hash_agrees_everywhere_on_the_ring(compiled: ModuleType, h: int, ids: list[str]) -> None:
    a = compiled.Ring(ids, 4, 3)
    b = _ring_py.Ring(ids, 4, 3)
    assert a.lookup_hash(h) == b.lookup_hash(h)


@pytest.mark.parametrize("vnodes", [1, 128, 160])
def test_large_fleets_agree(compiled: ModuleType, vnodes: int) -> None:
    ids = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(200)]
    a = compiled.Ring(ids, vnodes, 11)
    b = _ring_py.Ring(ids, vnodes, 11)
    sample = [f"session-{i}" for i in range(5000)]
    assert list(a.lookup_many(sample)) == list(b.lookup_many(sample))
    for ring in (a, b):
        ring.set_weight(17, 0.4)
        ring.set_available(3, False)
    assert list(a.lookup_many(sample)) == list(b.lookup_many(sample))
    assert a.add_replica("new") == b.add_replica("new")
