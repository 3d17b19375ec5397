"""router-bench simulate --events: modelled engines publish KV-cache events that the router's own
event-fed index follows (router.bench.simulate_events)."""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from router.bench.cli import build_parser
from router.bench.simulate import SYSTEM_TOKENS, Simulation
from router.fleet import Fleet
from router.kvevents.truth import Truth
from router.placement import pricing
from router.placement.events import Evicting, Layout
from router.placement.priced import Priced
from router.placement.pricing import Placement

# a small fleet whose caches evict: about 30 conversations' context a replica
FLEET = ["--replicas", "6", "--sessions", "300", "--policy", "ttft", "--kv-tokens", "12000"]
CHANGES = ["--scale-out-at", "10", "--fail-at", "15", "--scale-in-at", "20"]


def run(*flags: str) -> tuple[Simulation, dict[str, Any]]:
    sim = Simulation(build_parser().parse_args(["simulate", *FLEET, *flags]))
    return sim, sim.run()


def test_the_routers_index_follows_each_modelled_engine_block_for_block_through_losses_and_changes() -> None:
    sim, out = run("--events", "--event-loss", "0.1", *CHANGES)
    events = out["events"]
    assert events["lost"] > 0 and events["gaps"] > 0 and events["replayed"] > 0  # losses, filled by replay
    assert events["unsure_episodes"] == 0 and events["orphans"] == 0
    assert events["believed_at_end"] == events["followed_at_end"] == 5  # one joined; one died, one left
    assert out["failed_requests"] == 0 and out["failed_attempts"] > 0
    assert out["priced"]["by_events"] > 0.95
    assert sim.events is not None
    block = sim.args.block_tokens
    system_blocks = SYSTEM_TOKENS // block
    followed = 0
    for rid, model in sim.models.items():
        holdings = sim.events.holdings.get(rid)
        if holdings is None:
            assert model.gone is not None  # only the replicas that died or left are not followed
            continue
        followed += 1
        # what the engine's cache keeps, in whole blocks: each conversation's own, each system prompt's once
        kept = sum(max(0, t // block - system_blocks) for t in model.cache.values()) + system_blocks * len(
            model.systems
        )
        assert kept > 0 and holdings.blocks() == kept
        assert holdings.sure
    assert followed == 5


def test_events_tell_the_decision_what_the_routers_own_model_guesses_wrong() -> None:
    _, modelled = run("--prompts")
    _, evented = run("--events")
    assert modelled["priced"]["by_events"] == 0.0 and evented["priced"]["by_events"] == 1.0
    assert modelled["requests"] == evented["requests"] == modelled["priced"]["decisions"]
    # the caches evict: the router's model of them (what it sent, least recently first) is far
    # off; the engines' events are off by whole blocks and what evicts between decision and run
    assert evented["priced"]["off_per_prompt_token"] < 0.5 * modelled["priced"]["off_per_prompt_token"]
    assert modelled["events"] is None and evented["events"]["applied"] == evented["events"]["published"]


def test_a_loss_past_the_replay_buffer_leaves_its_replica_priced_by_the_model_until_it_turns_over() -> None:
    _, out = run("--events", "--event-loss", "0.2", "--replay-keep", "0")
    events = out["events"]
    assert events["replayed"] == 0 and events["unsure_episodes"] > 0
    assert 0.0 < out["priced"]["by_events"] < 1.0


def test_a_run_with_events_and_failures_is_the_same_run_to_run() -> None:
    """Everything the run reads is its virtual clock and its seeded draws: no wall clock. (The
    failover order a set of turns once left to their addresses showed at a larger size than this;
    here the second run's objects are only moved, which need not reorder a set.)"""
    first = run("--events", "--event-loss", "0.05", *CHANGES)[1]
    ballast = [object() for _ in range(10_007)]  # the second run's objects at other addresses
    second = run("--events", "--event-loss", "0.05", *CHANGES)[1]
    del ballast
    first.pop("wall_s"), second.pop("wall_s"), first.pop("peak_rss_mib"), second.pop("peak_rss_mib")
    assert first == second


def test_what_a_request_would_evict_priced_only_where_it_can_matter_decides_as_priced_everywhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A price asks what a request would evict (Truth.evicts) only of the candidates that could
    still be the cheapest or tie with it, the session's replica and the conversation's home. At
    every decision of a run whose caches evict, priced both ways on the same state, the cheapest,
    its ties and the home are the same, and so is every row the decision reads. Run against each
    other, the two make the same run: a replica's eviction rate is measured over windows fixed on
    the clock, so asking it of fewer replicas (or of every one, as /admin/route does) changes
    nothing later."""
    real = Placement.price
    seen = {"decisions": 0, "skipped": 0, "evicting": 0}

    def both(self: Placement, *args: Any, **kwargs: Any) -> Priced:
        asked, calls = Evicting.at, {True: 0, False: 0}

        def counted(ev: Evicting, i: int) -> float:
            calls[every] += not ev.asked[i] and ev.ask(i) is not None
            return asked(ev, i)

        monkeypatch.setattr(Evicting, "at", counted)
        every = True
        everywhere = real(self, *args, **{**kwargs, "every_row": True})
        every = False
        bounded = real(self, *args, **{**kwargs, "every_row": False})
        monkeypatch.setattr(Evicting, "at", asked)
        seen["decisions"] += 1
        seen["evicting"] += everywhere.evicts is not None
        seen["skipped"] += calls[False] < calls[True]
        assert (bounded.best, bounded.ties, bounded.holding) == (everywhere.best, everywhere.ties, everywhere.holding)
        read = {bounded.best, bounded.holding, *bounded.near()} - {-1, -2}
        for i in read:
            assert bounded.row(i) == everywhere.row(i)
        return bounded

    monkeypatch.setattr(Placement, "price", both)
    _, lazily = run("--events", *CHANGES)
    assert seen["decisions"] > 1000 and seen["evicting"] > 100
    assert seen["skipped"] > seen["evicting"] / 2  # most prices that evict skipped some candidate

    def every(self: Placement, *args: Any, **kwargs: Any) -> Priced:
        return real(self, *args, **{**kwargs, "every_row": True})

    monkeypatch.setattr(Placement, "price", every)
    _, everywhere = run("--events", *CHANGES)
    for out in (lazily, everywhere):
        out.pop("wall_s"), out.pop("peak_rss_mib")
    assert lazily == everywhere


class OneByOne(Layout):
    """A layout that reads no replica in the pass: every one asked one by one (`Truth.row`)."""

    def of(self, fleet: Fleet, truth: Truth) -> Layout:
        Layout.of(self, fleet, truth)
        self.others = sorted(self.others + [i for i, *_ in self.plain])
        self.plain, self.key, self.verdicts_key = [], None, None
        self.fast, self.dynamic, self.slow = (array("i"), array("i"), array("i")), [], []
        return self


def test_the_replicas_read_in_one_pass_are_priced_as_asked_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """`events_rows` reads most replicas in one pass (one sure rank on its GPU, nothing in flight)
    and asks the rest one by one. Through losses past the replay buffer (replicas not believed), a
    replica joining, one dying and one removed, every price's rows, second-tier tokens and what it
    would ask of evictions are those of asking every replica one by one."""
    real = pricing.events_rows
    seen = {"prices": 0, "evicting": 0, "mixed": 0}

    def both(fleet: Fleet, truth: Truth, *args: Any) -> Any:
        *rest, layout = args
        ours = real(fleet, truth, *rest, layout)
        theirs = real(fleet, truth, *rest, OneByOne())
        assert (ours is None) == (theirs is None)
        if ours is not None and theirs is not None:
            seen["prices"] += 1
            assert ours[0] == theirs[0] and ours[1] == theirs[1]
            asks = [None if e is None else [e.ask(i) for i in range(len(e.ids))] for e in (ours[2], theirs[2])]
            assert asks[0] == asks[1]
            seen["evicting"] += asks[0] is not None and any(asks[0])
            plain = sum(1 for i, *_ in layout.plain if ours[0][i] >= 0)
            seen["mixed"] += 0 < plain < len(fleet.replicas)
        return ours

    monkeypatch.setattr(pricing, "events_rows", both)
    _, out = run("--events", "--event-loss", "0.05", "--replay-keep", "0", *CHANGES)
    assert out["events"]["unsure_episodes"] > 0 and out["failed_attempts"] > 0
    assert seen["prices"] > 1000 and seen["evicting"] > 100 and seen["mixed"] > 100


def test_explain_jumps_reads_the_decisions_without_changing_them() -> None:
    """--explain-jumps: the rows each move compared, and each kind of turn's hit; the run is the
    same without it."""
    _, plain = run("--events", "--kv-tokens", "4000")
    _, out = run("--events", "--kv-tokens", "4000", "--explain-jumps")
    why = out.pop("jumps_explained")
    assert plain.pop("jumps_explained") is None
    for o in (plain, out):
        o.pop("wall_s"), o.pop("peak_rss_mib")
    assert out == plain
    turns = why["turns"]
    assert sum(t["turns"] for t in turns.values()) == out["requests"]
    assert turns["first"]["turns"] == out["sessions"]
    followups = out["requests"] - out["sessions"]
    assert turns["moved"]["turns"] == round(out["jump_rate"] * followups) > 0
    assert 0 < why["moves_explained"] <= turns["moved"]["turns"]
    p50 = why["rows_p50"]
    assert p50["chosen_cost_s"] < p50["home_cost_s"]  # a move goes where the price is lower
    assert 0.0 <= why["engine_held_none_there"] <= 1.0


def test_bad_event_arguments_are_one_line() -> None:
    for flags, message in (
        (["--events"], "need --policy ttft"),
        (["--prompts", "--policy", "affinity"], "need --policy ttft"),
        (["--events", "--policy", "ttft", "--block-tokens", "0"], "--block-tokens"),
        (["--events", "--policy", "ttft", "--event-loss", "1"], "--event-loss"),
        (["--events", "--policy", "ttft", "--replay-keep", "-1"], "--replay-keep"),
        (["--explain-jumps"], "--explain-jumps needs --policy ttft"),
    ):
        with pytest.raises(ValueError, match=message):
            Simulation(build_parser().parse_args(["simulate", *flags]))
