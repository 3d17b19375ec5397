"""The event-fed index bounded by `kv_events_max_mib`: replicas whose KV capacity would take it past
the budget are not followed (priced by the router's model, and said so), and are followed once
others leave room; one whose capacity grew past it is let go, the last followed first.

Emulated replicas publish vLLM's events and report their KV capacity in their metrics, as vLLM
does; a budget of 1 MiB is 15,420 blocks at 68 bytes (router.engines.kvfeed.INDEX_BYTES_PER_BLOCK;
4,369 at the pure-Python twin's 240), so two replicas of two fifths of it fit and a third does not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from router import prefix
from router.config import ConfigError, ReplicaSpec, RouterConfig, load
from router.emulator.engine import EngineConfig
from router.emulator.kvevents import KvEventsOptions
from router.engines import kvfeed
from router.engines.kvfeed import Feed, IndexBudget, index_budget_blocks
from router.health.states import Hysteresis
from router.kvevents.holdings import Holdings
from router.kvevents.mapped import SharedFileError
from router.metrics import RouterMetrics
from router.node import Node
from router.placement import Placement
from router.pools import replica_fleet

TOKEN = "an-admin-token-for-the-budget"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


async def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)


def unfollowed_gauge(text: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith("router_kv_events_unfollowed "))
    return float(line.split()[1])


async def test_replicas_past_the_budget_are_priced_by_the_model_until_others_leave_room(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    assert index_budget_blocks(1) == (1 << 20) // kvfeed.INDEX_BYTES_PER_BLOCK
    blocks = index_budget_blocks(1) * 2 // 5  # 6,168 (compiled), 1,747 (the twin)
    config = EngineConfig(num_blocks=blocks, block_size=16)
    fleet = await start_fleet(3, config, kv_events=KvEventsOptions(port=0, replay_port=0))
    router, url = await start_router(
        [r.url for r in fleet.replicas], probe_interval_s=0.2, kv_events_max_mib=1, admin_token=TOKEN
    )
    truth = router.placement.truth  # type: ignore[union-attr]
    ids = [r.id for r in router.fleet.replicas]

    def sure() -> list[str]:
        return [rid for rid in ids if truth.sure(rid)]

    await until(lambda: len(sure()) == 2 and len(truth.unfollowed) == 1, 20, "two believed, one not followed")
    (left_out,) = truth.unfollowed
    assert left_out not in sure() and truth.unfollowed[left_out] == blocks
    assert sum(h.capacity for rid in truth.replicas for h in truth.of(rid)) == 2 * blocks
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        assert unfollowed_gauge(text) == 1.0 and f'router_kv_events_believed{{replica="{left_out}"}} 0.0' in text
        async with http.get(url + "/admin/replicas", headers=ADMIN) as r:
            rows = {row["id"]: row for row in await r.json()}
        assert rows[left_out]["kv_events"] == {"followed": False, "why": "kv_events_max_mib", "capacity_blocks": blocks}
        followed = next(rid for rid in sure() if rid != left_out)
        assert rows[followed]["kv_events"]["followed"] is True
        # one followed replica leaves the fleet: the one left out is followed, and believed
        async with http.delete(f"{url}/admin/replicas/{followed}", headers=ADMIN) as r:
            assert r.status == 200, await r.text()
        await until(lambda: truth.sure(left_out) and not truth.unfollowed, 20, "the one left out followed")
        async with http.get(url + "/metrics") as r:
            assert unfollowed_gauge(await r.text()) == 0.0
    assert followed not in truth.replicas


def make_feed(n: int, max_mib: int, budget: IndexBudget | None = None) -> Feed:
    specs = tuple(ReplicaSpec(f"r{i}", f"http://127.0.0.1:9/r{i}") for i in range(n))
    config = RouterConfig(replicas=specs, health_checks=False, kv_events_max_mib=max_mib)
    fleet = replica_fleet(config, config.replicas, Hysteresis())
    placement = Placement(fleet, config.placement, config.bounded_load_floor)
    http: Any = lambda: None  # noqa: E731 -- (nothing is asked over HTTP here)
    return Feed(fleet, placement, config.placement, http, RouterMetrics(), budget=budget)


async def test_the_feeds_of_one_process_share_its_budget() -> None:
    """A disaggregated router follows its prefill replicas in a feed of their own: what one counts,
    the other may not."""
    budget = IndexBudget(1_024)
    serve, prefill = make_feed(2, 1, budget), make_feed(2, 1, budget)
    for feed, blocks in ((serve, 600), (prefill, 500)):  # as its engine's metrics say
        replica = feed.fleet.replicas[0]
        replica.engine = replace(replica.engine, kv_tokens=16 * blocks, block_size=16)
        feed.truth.holdings("r0", 0, blocks)
    waiting = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(2)]
    serve.tasks[("r0", 0)], prefill.tasks[("r0", 0)] = waiting
    try:
        await serve.find()  # (r1 shows no engine: not asked; r0 is counted)
        assert budget.left(prefill) == 424 and budget.left(serve) == 1_024
        await prefill.find()  # its 500 blocks do not fit in what is left: let go
        assert prefill.unfollowed == {"r0": 500} and not prefill.truth.replicas and not serve.unfollowed
        await serve.close()
        assert budget.left(prefill) == 1_024
    finally:
        for task in waiting:
            task.cancel()
        await prefill.close()


async def test_a_replica_whose_capacity_grew_past_the_budget_lets_go_of_the_last_followed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvfeed, "INDEX_BYTES_PER_BLOCK", 1 << 10)  # 1 MiB: 1,024 blocks
    feed = make_feed(3, 1)
    assert feed.budget.blocks == 1_024
    present = {r.id: r for r in feed.fleet.replicas}
    waiting: list[asyncio.Task[None]] = []
    for rid in ("r0", "r1", "r2"):  # followed in this order, 300 blocks each
        feed.truth.holdings(rid, 0, 300)
        feed.tasks[(rid, 0)] = task = asyncio.create_task(asyncio.sleep(3600))
        waiting.append(task)
    try:
        assert feed._within_budget(present, feed.budget.left(feed)) == 900 and not feed.unfollowed
        h0 = feed.truth.of("r0")[0]
        assert isinstance(h0, Holdings)
        h0.set_capacity(500)  # its engine said more
        assert feed._within_budget(present, feed.budget.left(feed)) == 1_100 - 300
        assert feed.unfollowed == {"r2": 300} and set(feed.truth.replicas) == {"r0", "r1"}
        assert ("r2", 0) not in feed.tasks
        await asyncio.sleep(0)
        assert waiting[2].cancelled() and not waiting[0].done() and not waiting[1].done()
        h0.tier("cpu")  # it began offloading: its second tier counts as much again
        assert feed._within_budget(present, feed.budget.left(feed)) == 500 * 2
        assert feed.unfollowed == {"r1": 300, "r2": 300} and set(feed.truth.replicas) == {"r0"}
    finally:
        for task in waiting:
            task.cancel()
        await feed.close()


def test_the_budget_is_a_setting_in_mib_or_a_quarter_of_the_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    per_block = kvfeed.INDEX_BYTES_PER_BLOCK
    assert per_block == (68 if prefix.IMPLEMENTATION == "compiled" else 240)
    assert index_budget_blocks(64) == (64 << 20) // per_block
    monkeypatch.setattr(kvfeed, "memory_limit_bytes", lambda: per_block << 22)
    assert index_budget_blocks(0) == 1 << 20
    # a router's workers share the default (each follows the engines only where its host's shared
    # index could not be laid out); a budget set is each process's
    assert index_budget_blocks(0, 4) == 1 << 18 and index_budget_blocks(64, 4) == index_budget_blocks(64)


def test_the_budget_is_never_negative() -> None:
    with pytest.raises(ConfigError, match="kv_events_max_mib"):
        load(None, {}, {"replicas": ["http://127.0.0.1:9"], "kv_events_max_mib": -1})


async def test_replicas_larger_than_the_budget_are_not_followed_and_said_so_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Their capacity from kv_capacity_tokens (no probes), in vLLM's 16-token blocks until their
    events say otherwise: 65,536 blocks each, past 1 MiB's 15,420 (or the twin's 4,369). Asked where they publish once,
    then not again while they cannot fit."""
    ids = [f"r{i}" for i in range(7)]
    config = RouterConfig(
        replicas=tuple(ReplicaSpec(rid, f"http://127.0.0.1:9/{rid}") for rid in ids),
        health_checks=False,
        kv_events_max_mib=1,
        kv_event_endpoints=tuple(f"{rid}=tcp://127.0.0.1:9" for rid in ids),
        kv_capacity_tokens=("*=1048576",),
    )
    node = Node(config)
    assert node.feed is not None
    with caplog.at_level("WARNING", logger="router.engines.kvfeed"):
        await node.feed.find()
        await node.feed.find()  # (said once)
    assert node.feed.unfollowed == dict.fromkeys(ids, 65_536) and not node.feed.tasks
    assert set(node.feed.asked) == set(ids)
    node.feed.asked.clear()
    await node.feed.find()  # (they still do not fit: not asked again)
    assert not node.feed.asked
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("7 replicas' KV events not followed") and said.endswith("r4 (65536 blocks) and 2 more")
    await node.feed.close()


async def test_a_replica_whose_blocks_find_no_room_in_shared_memory_is_let_go_and_tried_again_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under --workers the control process's index is in /dev/shm (tests/integration/test_shm_room.py
    runs it in a small one): a replica whose region finds no room there is let go, each rank's
    subscriber and what it held, priced by the model, and tried again after NO_ROOM_RETRY_S."""
    ids = ["r0", "r1"]
    config = RouterConfig(
        replicas=tuple(ReplicaSpec(rid, f"http://127.0.0.1:9/{rid}") for rid in ids),
        health_checks=False,
        kv_event_endpoints=tuple(f"{rid}=tcp://127.0.0.1:9" for rid in ids),
    )
    node = Node(config)
    feed = node.feed
    assert feed is not None
    truth = feed.truth
    await feed.find()
    assert set(feed.tasks) == {("r0", 0), ("r1", 0)}
    full = SharedFileError("cannot lay out a region of the shared index: [Errno 28] No space left on device")

    def no_room(replica_id: str, rank: int, capacity_blocks: int) -> Holdings:
        raise full

    with monkeypatch.context() as patched:  # r0's subscriber finds no room for its region
        patched.setattr(truth, "holdings", no_room)
        replica = next(r for r in feed.fleet.replicas if r.id == "r0")
        await feed._follow(replica, 0, "tcp://127.0.0.1:9", None)
    assert feed.no_room == {"r0": str(full)}
    truth.holdings("r0", 0, 1_000)  # (as a second rank's subscriber would hold)
    waiting = feed.tasks[("r0", 0)]
    feed.asked.clear()
    await feed.find()  # let go: its subscribers, what it held; not asked again yet
    await asyncio.sleep(0)
    assert waiting.cancelled() and ("r0", 0) not in feed.tasks and "r0" not in truth.replicas
    assert "r0" not in feed.asked and ("r1", 0) in feed.tasks
    assert truth.figures("r0") == {"followed": False, "why": "shared memory full", "error": str(full)}
    assert node.metrics.kv_events_unfollowed._value.get() == 1  # type: ignore[attr-defined]
    feed._no_room_until["r0"] = time.monotonic() - 1  # (its time has passed)
    await feed.find()
    assert ("r0", 0) in feed.tasks and "r0" in feed.asked and not feed.no_room
    assert node.metrics.kv_events_unfollowed._value.get() == 0  # type: ignore[attr-defined]
    await feed.close()
