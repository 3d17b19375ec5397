"""router-bench events, reduced to tens of publishers: every block the publishers stored reaches one
router's index once, through a join mid-stream (the replay, and the live copies queued meanwhile),
and the index holds what the engines hold once they evict; routers that follow the same events
decide alike, in one process or each in its own, a late one too once it believes every replica."""

from __future__ import annotations

import json
import math
from array import array
from pathlib import Path

import pytest

from router.bench.cli import build_parser
from router.bench.common import free_port
from router.bench.event_publishers import Shape
from router.bench.event_remote import Remote
from router.config import ReplicaSpec, RouterConfig
from router.engines.kvfeed import index_budget_blocks


def test_twenty_publishers_reach_one_router_s_index_whole(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "events",
            "--publishers",
            "20",
            "--duration",
            "3",
            "--join-after",
            "1",
            "--blocks-per-s",
            "160",
            "--batch-blocks",
            "16",
            "--chain-blocks",
            "48",
            "--capacity-blocks",
            "200",
            "--out",
            str(tmp_path),
        ]
    )
    assert args.run(args) == 0
    result = json.loads((tmp_path / "events.json").read_text())
    (row,) = result["rows"]
    assert row["publishers"] == 20 and row["believed"] == 20 and 0 < row["believe_s"] < 2
    # nothing lost, nothing applied twice: the messages that queued live while the joining router's
    # replay ran were skipped as copies, not taken for engines that restarted
    assert row["applied_stored"] == row["sent_stored"] > 20 * 200
    assert row["duplicates"] > 0 and row["restarts"] == 0
    assert row["gaps"] == 0 and row["orphans"] == 0 and row["bad_messages"] == 0 and row["unsure_episodes"] == 0
    # each engine evicted past its 200 blocks, one BlockRemoved each: the index holds what they hold
    assert row["held_blocks"] == 20 * 200
    assert 0 < row["lag_p50_s"] <= row["lag_p99_s"] and row["messages_per_s"] > 0
    assert "| 20 | " in (tmp_path / "events.md").read_text()


def test_a_router_under_an_index_budget_follows_as_many_publishers_as_fit(tmp_path: Path) -> None:
    # 1 MiB is 15,420 blocks at 68 bytes (4,369 at the pure-Python twin's 240): fifteen engines of a
    # fifteenth of it fit, five do not; each stores less than its capacity in the run, evicting nothing
    capacity = index_budget_blocks(1) // 15
    line = "events --publishers 20 --duration 3 --blocks-per-s 64 --batch-blocks 16 --capacity-blocks"
    args = build_parser().parse_args([*line.split(), str(capacity), "--index-max-mib", "1", "--out", str(tmp_path)])
    assert args.run(args) == 0
    (row,) = json.loads((tmp_path / "events.json").read_text())["rows"]
    assert (row["publishers"], row["followed"], row["believed"]) == (20, 15, 15)
    assert row["budget_mib"] <= 1 and 0 < row["index_mib"] <= row["budget_mib"]
    # what the fifteen followed stored, whole; nothing of the others
    assert 0.7 < row["applied_stored"] / row["sent_stored"] < 0.8 and row["held_blocks"] == row["applied_stored"]
    assert row["gaps"] == 0 and row["orphans"] == 0 and row["bad_messages"] == 0
    assert 0 < row["believe_s"] < 5 and "| 20 | " in (tmp_path / "events.md").read_text()
    assert " (15 followed) |" in (tmp_path / "events.md").read_text()


def test_routers_that_follow_the_same_events_decide_alike(tmp_path: Path) -> None:
    # two routers joining together and a third halfway through, light publishers
    args = build_parser().parse_args(
        [
            "events",
            "--publishers",
            "10",
            "--duration",
            "4",
            "--join-after",
            "0.5",
            "--blocks-per-s",
            "120",
            "--batch-blocks",
            "8",
            "--chain-blocks",
            "24",
            "--capacity-blocks",
            "120",
            "--routers",
            "2",
            "--late-router",
            "--out",
            str(tmp_path),
        ]
    )
    assert args.run(args) == 0
    (row,) = json.loads((tmp_path / "events.json").read_text())["rows"]
    assert row["routers"] == 2 and row["believed"] == 10
    # most prompts are held by some replica (the index decides), and the routers agree on nearly all
    assert row["decisions_compared"] > 200 and row["decisions_by_index"] > row["decisions_compared"] // 2
    assert row["agreement"] >= 0.98
    assert 0 < row["late_believe_s"] < 1.5 and row["late_compared"] > 50 and row["late_agreement"] >= 0.98
    assert "| 10 | 2 | " in (tmp_path / "events.md").read_text()


def test_routers_in_processes_of_their_own_decide_alike(tmp_path: Path) -> None:
    # three routers, two of them each in a process of its own, asked over a pipe
    args = build_parser().parse_args(
        [
            *("events", "--publishers", "10", "--duration", "5", "--join-after", "0.5"),
            *("--blocks-per-s", "120", "--batch-blocks", "8", "--chain-blocks", "24", "--capacity-blocks", "120"),
            *("--routers", "3", "--router-procs", "--out", str(tmp_path)),
        ]
    )
    assert args.run(args) == 0
    (row,) = json.loads((tmp_path / "events.json").read_text())["rows"]
    assert row["routers"] == 3 and row["router_procs"] == 2 and row["believed"] == 10
    assert row["router_procs_cpu_s"] > 0  # they followed the events themselves
    assert row["decisions_compared"] > 200 and row["decisions_by_index"] > row["decisions_compared"] // 2
    assert row["agreement"] >= 0.95
    assert "| 10 | 3 (2 in processes of their own) | " in (tmp_path / "events.md").read_text()


async def test_a_router_process_that_died_fails_the_question_with_one_line() -> None:
    config = RouterConfig(
        replicas=(ReplicaSpec("r0", "http://127.0.0.1:9/r0"),),
        health_checks=False,
        kv_event_endpoints=(f"r0=tcp://127.0.0.1:{free_port(2)};tcp://127.0.0.1:{free_port(2) + 1}",),
    )
    remote = Remote(config, Shape())
    try:
        assert await remote.ask(("sure",)) == 0  # it answers before it joins: nothing believed yet
        assert await remote.ask(("decide", [array("Q", [1, 2, 3])])) == [-1]
        remote.proc.kill()
        with pytest.raises(RuntimeError, match=r"a router process ended .* before answering 'sure'"):
            await remote.ask(("sure",))
    finally:
        assert math.isnan(await remote.end())


def test_router_serve_with_workers_as_the_subscriber_is_measured_as_a_host_pays_for_it(tmp_path: Path) -> None:
    """`--serve-workers`: router-serve itself, two workers and its control process, follows the
    publishers; its tree's CPU and memory are counted, its /metrics say when it believes them all.
    With `--followers 2` a process beside the control process follows half of them: the same
    replicas believed, every message applied once, in a tree of one more process."""
    args = build_parser().parse_args(
        [
            "events",
            "--publishers",
            "8",
            "--duration",
            "6",
            "--blocks-per-s",
            "160",
            "--batch-blocks",
            "16",
            "--serve-workers",
            "2",
            "--followers",
            "1,2",
            "--out",
            str(tmp_path),
        ]
    )
    assert args.run(args) == 0
    row, split = json.loads((tmp_path / "events-serve.json").read_text())["serve_rows"]
    assert row["workers"] == 2 and row["processes"] >= 3  # the control process, its two workers (and helpers)
    assert split["followers"] == 2 and split["processes"] == row["processes"] + 1
    assert split["believed"] == 8 and 0 < split["lag_p50_le_s"] <= split["lag_p99_le_s"] <= 2.5
    assert row["believed"] == 8 and 0 < row["believe_s"] < 6
    assert row["host_cpu_cores"] > 0 and row["host_cpu_us_per_block"] > 0
    assert 0 < row["lag_p50_le_s"] <= row["lag_p99_le_s"] <= 2.5
    assert row["held_blocks"] > 8 * 16 and 0 < row["pss_mib"] <= row["rss_mib"]
    # its files in /dev/shm, their pages taken: the replica table (13.7 MiB at the defaults) and the
    # eight replicas' regions (192 KiB each at first), whether a process touched them yet or not
    assert row["shm_mib"] > 13.7 + 8 * 0.18
    table = (tmp_path / "events-serve.md").read_text()
    assert "| 8 | 2 | 1 | " in table and "| 8 | 2 | 2 | " in table
