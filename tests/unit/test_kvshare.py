"""The event-fed index in shared memory: regions (`_kvshare`, twin router/_kvshare_py.py) and the
index and reader made of them (router.kvevents.shared).

A region must answer as `PrefixIndex` answers for one holder, whatever the operations; a region
written by one implementation must read alike in the other; a reader in another process must map
the writer's regions as they move and never see a block that was never stored, even while the
writer changes them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twins import implementations

from router import _kvshare_py
from router.config import ReplicaSpec
from router.fleet import Fleet
from router.kvevents.holdings import Holdings
from router.kvevents.mapped import SharedFileError
from router.kvevents.shared import FIRST_POOL, SharedIndex, SharedIndexReader, clear_shard, max_pool
from router.kvevents.tokens import EngineTokens, root_of, token_chain
from router.kvevents.truth import Found, Truth
from router.kvevents.wire import Batch, Removed, Stored
from router.placement.events import Layout, events_rows
from router.prefix import PrefixIndex
from router.prompt import Prompt

IMPLEMENTATIONS = implementations("_kvshare", _kvshare_py)


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return IMPLEMENTATIONS[request.param]


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[str]:
    """A folder for the index's files: under /dev/shm where there is one (as it runs), else tmp."""
    base = Path("/dev/shm")
    if base.is_dir() and os.access(base, os.W_OK):
        folder = base / f"kvar-test-{os.getpid()}-{tmp_path.name}"
        folder.mkdir()
        yield str(folder)
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    else:
        yield str(tmp_path)


def chain_of(base: int, n: int) -> array[int]:
    return array("Q", [base * 1000 + i + 1 for i in range(n)])


def names_of(base: int, n: int, twist: int = 0) -> array[int]:
    return array("Q", [(base * 1000 + i) * 7 + 3 + twist for i in range(n)])


OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "insert", "forget", "evict", "capacity", "after"]),
        st.integers(0, 12),  # which chain
        st.integers(1, 24),  # how long
        st.integers(0, 1),  # a twist of the names (a block renamed)
        st.integers(0, 60),  # a count
    ),
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_a_region_answers_as_a_prefix_index_holder_does(ops: list[tuple[str, int, int, int, int]]) -> None:
    for module in IMPLEMENTATIONS.values():
        regions, index = module.Regions(), PrefixIndex()
        regions.format(0, bytearray(module.region_bytes(64)), 40, 64)
        h = index.add_holder(40)
        for op, base, n, twist, count in ops:
            chain, names = chain_of(base, n), names_of(base, n, twist)
            if op == "insert":
                assert regions.insert(0, chain, -1, names) == index.insert(h, chain, -1, names)
            elif op == "forget":
                assert regions.forget(0, names[:count]) == index.forget(h, names[:count])
            elif op == "evict":
                assert regions.evict(0, count) == index.evict(h, count)
            elif op == "capacity":
                assert regions.set_capacity(0, count) == index.set_capacity(h, count)
            else:
                assert regions.match_after(0, chain, count) == index.match_after(h, chain, count)
                others = [chain, chain_of(base + 1, n), chain_of(base, n // 2)]
                assert regions.match_after_many(0, others, [count, 0, count + 7]) == index.match_after_many(
                    h, others, [count, 0, count + 7]
                )
            assert regions.match(0, chain) == index.match(h, chain)
            assert regions.size(0) == index.size(h)
            assert regions.key_of(0, names[-1]) == index.key_of(h, names[-1])


def test_a_region_written_by_one_implementation_reads_alike_in_the_other() -> None:
    if len(IMPLEMENTATIONS) < 2:
        pytest.skip("the compiled module was not built (ROUTER_NO_EXTENSIONS=1)")
    rng = random.Random(5)
    for writer, reader in (("compiled", "python"), ("python", "compiled")):
        buf = bytearray(IMPLEMENTATIONS[writer].region_bytes(300))
        w = IMPLEMENTATIONS[writer].Regions()
        w.format(0, buf, 250, 300)
        for _ in range(200):
            base, n = rng.randrange(30), rng.randint(1, 30)
            if rng.random() < 0.8:
                w.insert(0, chain_of(base, n), -1, names_of(base, n))
            else:
                w.forget(0, names_of(base, rng.randint(1, n)))
        r = IMPLEMENTATIONS[reader].Regions()
        r.attach(0, memoryview(buf).toreadonly())
        for base in range(30):
            chain = chain_of(base, 30)
            assert r.match(0, chain) == w.match(0, chain)
            assert r.match_after(0, chain, 100) == w.match_after(0, chain, 100)
            assert r.key_of(0, names_of(base, 3)[2]) == w.key_of(0, names_of(base, 3)[2])
        assert (r.size(0), r.capacity(0)) == (w.size(0), w.capacity(0))
        with pytest.raises(ValueError, match="read-only"):
            r.insert(0, chain_of(1, 2))


def test_a_reader_of_a_region_its_writer_left_mid_change_answers_and_counts_it_torn(impl: ModuleType) -> None:
    buf = bytearray(impl.region_bytes(64))
    writer = impl.Regions()
    writer.format(0, buf, 64, 64)
    writer.insert(0, chain_of(1, 8), -1, names_of(1, 8))
    buf[8:16] = (int.from_bytes(buf[8:16], "little") + 1).to_bytes(8, "little")  # seq odd: a change never ended
    reader = impl.Regions()
    reader.attach(0, memoryview(buf).toreadonly())
    assert reader.match(0, chain_of(1, 8)) == 8 and reader.torn == 1  # answered as it read, not hung
    out = array("i", [0])
    reader.match_all(chain_of(1, 4), out)
    assert list(out) == [4] and reader.torn == 2


def test_bad_arguments_are_refused_with_a_clear_error(impl: ModuleType) -> None:
    regions = impl.Regions()
    with pytest.raises(ValueError, match="bad magic"):
        regions.attach(0, bytes(impl.region_bytes(16)))
    with pytest.raises(ValueError, match="needs"):
        regions.format(0, bytearray(100), 10, 16)
    regions.format(0, bytearray(impl.region_bytes(16)), 10, 16)
    with pytest.raises(TypeError, match="unsigned 64-bit"):
        regions.match(0, array("i", [1, 2]))
    with pytest.raises(ValueError, match="not attached"):
        regions.match(3, chain_of(1, 2))
    with pytest.raises(ValueError, match="aliases has"):
        regions.insert(0, chain_of(1, 3), -1, names_of(1, 2))
    with pytest.raises(ValueError, match="out must hold"):
        regions.match_all(chain_of(1, 2), array("q", [0]))
    broken = bytearray(impl.region_bytes(16))
    impl.Regions().format(0, broken, 10, 16)
    broken[32:40] = (1 << 40).to_bytes(8, "little")  # a slot count the buffer cannot hold
    with pytest.raises(ValueError, match="does not fit"):
        impl.Regions().attach(0, bytes(broken))


def test_the_shared_index_answers_as_a_prefix_index_while_its_holders_grow_and_move(shm_dir: str) -> None:
    rng = random.Random(11)
    shared, index = SharedIndex("grow", shm_dir), PrefixIndex()
    try:
        holders = [(shared.add_holder(6000), index.add_holder(6000)) for _ in range(3)]
        reader = SharedIndexReader("grow", shm_dir)
        for step in range(1500):
            s, p = rng.choice(holders)
            base, n = rng.randrange(600), rng.randint(1, 64)
            chain, names = chain_of(base, n), names_of(base, n)
            if rng.random() < 0.8:
                assert shared.insert(s, chain, -1, names) == index.insert(p, chain, -1, names)
            else:
                assert shared.forget(s, names[: n // 2]) == index.forget(p, names[: n // 2])
            assert shared.match(s, chain) == index.match(p, chain) == reader.match(s, chain), step
            evicted = rng.randrange(5000)
            assert reader.match_after(s, chain, evicted) == index.match_after(p, chain, evicted)
            others = [chain, chain_of(base + 1, 64), chain_of((base + 7) % 600, 32)]  # (the rng draws as before)
            assert reader.match_after_many(s, others, [evicted // 2, evicted]) == index.match_after_many(
                p, others, [evicted // 2, evicted]
            )
            ours, theirs = array("i", bytes(12)), array("i", bytes(12))
            reader.match_all(chain, ours)
            index.match_all(chain, theirs)
            assert ours == theirs
        # every holder outgrew its first region, up to its capacity and slack, never past it
        for s, p in holders:
            assert shared.regions.pool(s) == max_pool(6000) > FIRST_POOL
            assert shared.size(s) == index.size(p) == reader.size(s) == 6000
        assert reader.torn == 0
        files = sorted(os.listdir(shm_dir))
        assert len(files) == 5  # the directory, the roster and one region a holder: those moved from are gone
        gone = holders[0][0]
        shared.remove_holder(gone)
        assert reader.size(gone) == 0 and reader.match(gone, chain_of(1, 4)) == 0
        again = shared.add_holder(100)  # the number is taken again, in a fresh region
        assert again == gone and reader.size(again) == 0 and reader.capacity(again) == 100
        assert shared.regions.pool(again) == max_pool(100)  # what its capacity needs, less than a first region
    finally:
        shared.close()
    assert os.listdir(shm_dir) == []


def test_a_reader_needs_a_shared_index_to_read(shm_dir: str) -> None:
    with pytest.raises(SharedFileError, match="cannot read"):
        SharedIndexReader("absent", shm_dir)
    with pytest.raises(SharedFileError, match="name"):
        SharedIndex("a/b", shm_dir)
    Path(shm_dir, "junk.dir").write_bytes(bytes(64))
    with pytest.raises(SharedFileError, match="not a shared index"):
        SharedIndexReader("junk", shm_dir)


def _read_while_written(name: str, folder: str, ready: Any, stop: Any, out: mp.Queue) -> None:
    """A reader process: matches chains the writer stores and removes, and chains it never stores,
    from when it says it is ready until it is told to stop."""
    reader = SharedIndexReader(name, folder)
    rng = random.Random(os.getpid())
    reads = false = 0
    ready.release()
    while not stop.is_set():
        base = rng.randrange(200)
        if reader.n_holders:
            matched = array("i", bytes(4 * reader.n_holders))
            reader.match_all(chain_of(base, 64), matched)
            never = chain_of(100_000 + base, 8)  # stored by nobody
            false += sum(reader.match(h, never) for h in range(reader.n_holders))
            reads += 1
    out.put((reads, false, reader.torn))


def test_readers_in_other_processes_follow_the_writer_and_never_see_a_block_never_stored(shm_dir: str) -> None:
    shared = SharedIndex("live", shm_dir)
    try:
        holders = [shared.add_holder(3000) for _ in range(4)]
        ctx = mp.get_context("spawn")
        out: mp.Queue = ctx.Queue()
        ready, stop = ctx.Semaphore(0), ctx.Event()
        procs = [ctx.Process(target=_read_while_written, args=("live", shm_dir, ready, stop, out)) for _ in range(2)]
        for p in procs:
            p.start()
        for _ in procs:  # (each reads while the writer writes, however long it took to start)
            assert ready.acquire(timeout=60)
        until = time.time() + 3.0
        rng = random.Random(2)
        while time.time() < until:  # stores and removals as engines send them, holders moving as they fill
            h, base, n = rng.choice(holders), rng.randrange(200), rng.randint(8, 64)
            if rng.random() < 0.75:
                shared.insert(h, chain_of(base, n), -1, names_of(base, n))
            else:
                shared.forget(h, names_of(base, n)[n // 2 :])
        stop.set()
        results = [out.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
        assert all(reads > 0 for reads, _, _ in results)
        assert all(false == 0 for _, false, _ in results)
        # once the writer stops, a reader answers as the writer does
        reader = SharedIndexReader("live", shm_dir)
        for base in range(200):
            for h in holders:
                assert reader.match(h, chain_of(base, 64)) == shared.match(h, chain_of(base, 64))
    finally:
        shared.close()


def test_truth_decides_alike_on_a_shared_index(shm_dir: str) -> None:
    """The event-fed index's users (Holdings, Truth) on a SharedIndex: the same answers as on their own."""
    shared = SharedIndex("truth", shm_dir)
    try:
        truths = [Truth(), Truth(index=shared)]
        holdings = [t.holdings("r0", 0, 500) for t in truths]
        seed = root_of(None, None)
        rng = random.Random(9)
        chains: list[tuple[int, ...]] = []
        for seq in range(120):
            tokens = tuple(rng.randrange(50_000) for _ in range(16 * rng.randint(1, 12)))
            hashes = [rng.getrandbits(63) for _ in range(len(tokens) // 16)]
            events: list[Stored | Removed] = [
                Stored(array("Q", hashes), None, array("Q", tokens), 16, "GPU", None, None)
            ]
            if chains and rng.random() < 0.3:
                events.append(Removed(array("Q", chains.pop(0)), "GPU"))
            chains.append(tuple(hashes[len(hashes) // 2 :]))
            for h in holdings:
                assert h.accept(Batch(seq, float(seq), 0, tuple(events))) == "ok"
            keys = token_chain(array("Q", tokens), 16, seed)
            assert holdings[0].match(keys) == holdings[1].match(keys) == len(keys)  # the newest chain, whole
            older = token_chain(array("Q", tokens[: 16 * rng.randint(1, len(keys))]), 16, seed)
            assert holdings[0].match(older) == holdings[1].match(older)
            assert holdings[0].blocks() == holdings[1].blocks()
        assert holdings[1].blocks() == 500  # full: evicting by its capacity, as the other
    finally:
        shared.close()


def test_a_worker_reading_the_shared_index_believes_and_prices_as_the_writer(shm_dir: str) -> None:
    """A worker's Truth on a SharedIndexReader: the replicas the writer follows, believed when
    it believes them, holding what it holds; a replica suspected there is believed again once a
    message comes; one the writer forgets leaves the worker's too. Its eviction rate is the
    writer's, whenever either asks."""
    shared = SharedIndex("follow", shm_dir)
    try:
        clock = [100.0]
        writer, worker = Truth(clock=lambda: clock[0]), Truth()
        writer.share(shared)
        worker.share(SharedIndexReader("follow", shm_dir))
        worker.follow()
        assert not worker.replicas
        rng = random.Random(4)
        prompts = []
        stored: list[array[int]] = []
        for rid in ("a", "b"):
            h = writer.holdings(rid, 0, 1000)
            for seq in range(5):
                tokens = array("Q", [rng.randrange(50_000) for _ in range(16 * 6)])
                hashes = array("Q", [rng.getrandbits(63) for _ in range(6)])
                stored.append(hashes)
                batch = Batch(seq, 1.0 + seq, 0, (Stored(hashes, None, tokens, 16, "GPU", None, None),))
                assert h.accept(batch) == "ok"
                writer.published(h)
                prompts.append(tokens)
        worker.follow()
        assert sorted(worker.replicas) == ["a", "b"] and worker.sure("a") and worker.sure("b")
        for tokens in prompts:
            engine = EngineTokens(len(tokens), tuple(tokens), None, None, "tokenizer")
            for rid in ("a", "b"):
                assert worker.held(rid, engine, {}, 16) == writer.held(rid, engine, {}, 16)
        first = EngineTokens(96, tuple(prompts[0]), None, None, "tokenizer")
        assert [worker.held(rid, first, {}, 16) for rid in "ab"] == [
            Found(80, 0, 16),
            Found(0, 0, 16),
        ]  # (its last block is computed again)
        b = writer.of("b")[0]
        assert isinstance(b, Holdings)
        for seq, (at, gone) in enumerate([(101.0, stored[5]), (104.0, stored[6][:2]), (106.0, stored[6][2:])]):
            clock[0] = at
            assert b.accept(Batch(5 + seq, at, 0, (Removed(gone, "GPU"),))) == "ok"
            writer.published(b)
            (read,) = worker.of("b")
            for now in (at, at + 0.5, 105.0, 109.9, 110.0, 115.0):
                assert read.eviction_rate(now) == b.eviction_rate(now)
        assert b.eviction_rate(110.0) == 4 / 5 and b.eviction_rate(109.0) == 8 / 5  # (the windows 100-105, 105-110)
        worker.suspect("a")
        assert not worker.sure("a") and worker.sure("b")
        h = writer.of("a")[0]
        assert isinstance(h, Holdings)
        tokens = array("Q", range(32))
        assert h.accept(Batch(5, 9.0, 0, (Stored(array("Q", [7, 8]), None, tokens, 16, "GPU", None, None),))) == "ok"
        writer.published(h)
        assert worker.sure("a")  # the next message came: nothing was missed
        assert worker.of("a")[0].figures.stored == h.figures.stored == 32
        writer.forget("b")
        worker.follow()
        assert sorted(worker.replicas) == ["a"]
        long = writer.holdings("r" * 200, 0, 10)  # an id too long for the roster: followed here, not shared
        assert long.row is None and "r" * 200 in writer.replicas
        worker.follow()
        assert sorted(worker.replicas) == ["a"]
        with pytest.raises(TypeError, match="reader"):
            worker.holdings("c", 0, 10)
    finally:
        shared.close()


def test_a_workers_layout_reads_each_rank_as_its_roster_row_says_whatever_changes(shm_dir: str) -> None:
    """A worker's ranks are read in the pass by three words of their roster rows, which the writer
    changes in its own process: a Layout kept across requests reads every row as the worker's
    `Truth.held` says it, through a rank the writer stops believing, one suspected here, a
    second tier begun there and a replica removed."""
    shared = SharedIndex("layout", shm_dir)
    try:
        writer, worker = Truth(), Truth()
        writer.share(shared)
        worker.share(SharedIndexReader("layout", shm_dir))
        rids = "abc"
        fleet = Fleet([ReplicaSpec(rid, f"http://10.0.0.{k}:1") for k, rid in enumerate(rids)])
        tokens = array("Q", range(1000, 1064))  # four blocks of 16
        ranks = {rid: writer.holdings(rid, 0, 100) for rid in rids}
        for h in ranks.values():
            stored = Stored(array("Q", [1, 2]), None, tokens[:32], 16, "GPU", None, None)
            assert h.accept(Batch(0, 1.0, 0, (stored,))) == "ok"
            writer.published(h)
        worker.follow()
        engine = EngineTokens(64, tuple(tokens), None, None, "tokenizer")
        prompt = Prompt(engine.chain(16), 256, 4, engine)
        layout = Layout()

        def rows() -> list[float]:
            got = events_rows(
                fleet,
                worker,
                prompt,
                array("B", [0, 0, 0]),
                array("d", [1e-4] * 3),
                array("d", [0.0] * 3),
                0.0,
                0.0,
                layout,
            )
            assert got is not None
            for i, rid in enumerate(rids):
                held = worker.held(rid, engine, {})
                assert got[0][i] == (-1.0 if held is None else worker.credit(held, 1e-4)), rid
            return list(got[0])

        assert rows() == [32.0, 32.0, 32.0] and len(layout.followed[0]) == 3
        ranks["a"].make_unsure()  # the writer stops believing it
        writer.published(ranks["a"])
        assert rows()[0] == -1.0
        worker.suspect("b")  # its health went down here
        assert rows()[1] == -1.0 and len(layout.dynamic) == 1
        stored = Stored(array("Q", [3]), 2, tokens[32:48], 16, "GPU", None, None)
        assert ranks["b"].accept(Batch(1, 2.0, 0, (stored,))) == "ok"  # the next message: believed again
        writer.published(ranks["b"])
        assert rows()[1] == 48.0  # (judged on that request: the next reads it in the pass again)
        assert rows()[1] == 48.0 and not layout.dynamic
        cpu = Stored(array("Q", [11, 12, 13, 14]), None, tokens, 16, "CPU", None, None)
        assert ranks["c"].accept(Batch(1, 2.0, 0, (cpu,))) == "ok"  # a second tier begun there
        writer.published(ranks["c"])
        assert rows()[2] > 32.0  # (its tier found on that request: the next asks it one by one)
        assert rows()[2] > 32.0 and layout.slow == [2]
        fleet.replicas[1].health.state = "removed"
        assert rows()[1] == -1.0
    finally:
        shared.close()


def test_shards_written_by_several_followers_read_as_one_index(shm_dir: str) -> None:
    """A host following its engines in three processes (shards): each writes its replicas' holders
    and roster rows into the index the first laid out, and a worker reads one index: every
    replica believed and held as its own follower holds it, in one pass of its Layout. A shard
    restarted clears what its writer before left; one closed leaves the others' replicas read."""
    writers = [Truth() for _ in range(3)]
    shards = [SharedIndex("sharded", shm_dir, shard=k, shards=3) for k in range(3)]
    try:
        for truth, index in zip(writers, shards, strict=True):
            truth.share(index)
        worker = Truth()
        worker.share(SharedIndexReader("sharded", shm_dir))
        rids = [f"r{k}" for k in range(7)]
        fleet = Fleet([ReplicaSpec(rid, f"http://10.0.0.{k}:1") for k, rid in enumerate(rids)])
        tokens = array("Q", range(5000, 5000 + 16 * 8))
        for k, rid in enumerate(rids):  # r0 on shard 0, r1 on shard 1, ...; r_k holds k + 1 blocks
            writer = writers[k % 3]
            h = writer.holdings(rid, 0, 100)
            hashes = array("Q", [100 * k + j for j in range(k + 1)])
            stored = Stored(hashes, None, tokens[: 16 * (k + 1)], 16, "GPU", None, None)
            assert h.accept(Batch(0, 1.0, 0, (stored,))) == "ok"
            writer.published(h)
        assert [shards[k].n_holders for k in range(3)] == [7, 5, 6]  # holders 0, 3, 6 / 1, 4 / 2, 5
        worker.follow()
        assert sorted(worker.replicas) == rids and all(worker.sure(rid) for rid in rids)
        engine = EngineTokens(len(tokens), tuple(tokens), None, None, "tokenizer")
        prompt = Prompt(engine.chain(16), 16 * 8, 4, engine)
        for k, rid in enumerate(rids):
            assert worker.held(rid, engine, {}) == writers[k % 3].held(rid, engine, {}) == Found(16 * (k + 1), 0, 16)
        layout = Layout()
        spt, zeros = array("d", [1e-4] * 7), array("d", [0.0] * 7)
        got = events_rows(fleet, worker, prompt, array("B", bytes(7)), spt, zeros, 0.0, 0.0, layout)
        assert got is not None and list(got[0]) == [16.0 * (k + 1) for k in range(7)]
        assert len(layout.followed[0]) == 7  # all of them in the pass: one roster, whoever writes which row
        # shard 1's process dies without closing: the control process clears what it left at
        # once (its replicas are then priced by the model), and its successor does again
        del shards[1]
        stray = Path(shm_dir, "sharded-4-99")  # a region a writer killed while moving it had not named yet
        stray.write_bytes(b"")
        clear_shard("sharded", 1, 3, shm_dir)
        worker.follow()
        assert sorted(worker.replicas) == ["r0", "r2", "r3", "r5", "r6"] and not stray.exists()
        shards.insert(1, SharedIndex("sharded", shm_dir, shard=1, shards=3))
        worker.follow()
        assert sorted(worker.replicas) == ["r0", "r2", "r3", "r5", "r6"]
        assert worker.index.n_holders == 7 and worker.index.size(1) == worker.index.size(4) == 0
        restarted = Truth()
        restarted.share(shards[1])
        h = restarted.holdings("r1", 0, 100)
        assert h.accept(Batch(0, 2.0, 0, (Stored(array("Q", [7]), None, tokens[:16], 16, "GPU", None, None),))) == "ok"
        restarted.published(h)
        worker.follow()
        assert "r1" in worker.replicas and worker.held("r1", engine, {}) == Found(16, 0, 16)
        assert len(list(Path(shm_dir).glob("sharded-*"))) == 6  # one region a holder: the dead writer's removed
        shards.pop(2).close()  # shard 2's process stops: its replicas leave, the others stay
        worker.follow()
        assert sorted(worker.replicas) == ["r0", "r1", "r3", "r6"]
        assert worker.held("r3", engine, {}) == Found(64, 0, 16)
    finally:
        for index in reversed(shards):
            index.close()
    assert not list(Path(shm_dir).iterdir())


def test_a_shard_needs_the_first_to_have_laid_out_the_index(shm_dir: str) -> None:
    with pytest.raises(SharedFileError, match="cannot lay out"):
        SharedIndex("alone", shm_dir, shard=1, shards=2)
    first = SharedIndex("two", shm_dir, shard=0, shards=2)
    try:
        with pytest.raises(SharedFileError, match="written by 2 shards, not 3"):
            SharedIndex("two", shm_dir, shard=2, shards=3)
        for shard, shards in ((2, 2), (-1, 2), (0, 0), (0, 65), (True, 2)):
            with pytest.raises(ValueError, match="shard"):
                SharedIndex("two", shm_dir, shard=shard, shards=shards)
    finally:
        first.close()


def test_a_worker_reads_a_rank_enlisted_again_in_the_same_row_by_its_new_holders(shm_dir: str) -> None:
    """A replica forgotten and followed again may take its old roster row while a tier of it
    takes another holder (another replica's before): a worker that did not look in between
    reads it by its new holders."""
    shared = SharedIndex("again", shm_dir)
    try:
        writer, worker = Truth(), Truth()
        writer.share(shared)
        worker.share(SharedIndexReader("again", shm_dir))
        tokens = {"a": array("Q", range(100, 164)), "b": array("Q", range(900, 964))}

        def store(rid: str, medium: str, blocks: int) -> None:
            h = writer.of(rid)[0]
            assert isinstance(h, Holdings)
            hashes = array("Q", [(1 if rid == "a" else 2) * 100 + j for j in range(blocks)])
            stored = Stored(hashes, None, tokens[rid][: 16 * blocks], 16, medium, None, None)
            assert h.accept(Batch(0 if h.seq is None else h.seq + 1, 1.0, 0, (stored,))) == "ok"
            writer.published(h)

        def cpu_holders(truth: Truth) -> list[int]:
            return [truth.of(rid)[0].tiers["CPU"].holder for rid in "ab"]

        for rid in "ab":
            writer.holdings(rid, 0, 100)
            store(rid, "GPU", 2)
        store("a", "CPU", 4)  # a second tier begun on a
        worker.follow()
        writer.forget("a")
        writer.forget("b")
        for rid in "ab":  # their old rows and GPU holders again
            writer.holdings(rid, 0, 100)
            store(rid, "GPU", 2)
        store("b", "CPU", 3)  # b's second tier takes the holder a's had
        store("a", "CPU", 4)
        worker.follow()
        assert cpu_holders(worker) == cpu_holders(writer) == [3, 2]
        for rid in "ab":
            engine = EngineTokens(64, tuple(tokens[rid]), None, None, "tokenizer")
            assert worker.held(rid, engine, {}) == writer.held(rid, engine, {})
    finally:
        shared.close()


def test_a_readers_match_all_answers_for_the_holders_its_caller_knew(shm_dir: str) -> None:
    """A holder laid out between the caller's sizing of its array and the match (another shard's
    process adds them at any time) is left out, not an error."""
    writer = SharedIndex("sized", shm_dir)
    try:
        reader = SharedIndexReader("sized", shm_dir)
        chain = chain_of(1, 4)
        first = writer.add_holder(100)
        writer.insert(first, chain)
        out = array("i", bytes(4 * reader.n_holders))
        writer.insert(writer.add_holder(100), chain)  # (after the caller sized `out`)
        reader.match_all(chain, out)
        assert list(out) == [4]
        bigger = array("i", bytes(4 * reader.n_holders))
        reader.match_all(chain, bigger)
        assert list(bigger) == [4, 4]
    finally:
        writer.close()
