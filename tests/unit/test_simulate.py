"""router-bench simulate: the router's routing code against modelled replicas on a virtual clock."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from router.bench.cli import build_parser
from router.bench.simulate import Model, Simulation, Turn
from router.keys import RoutingKey


def simulate(*flags: str) -> dict[str, Any]:
    args = build_parser().parse_args(["simulate", "--replicas", "12", "--sessions", "1500", *flags])
    sim = Simulation(args)
    out = sim.run()
    # every request ended once: nothing left in flight, running or queued anywhere
    assert all(load == 0 for load in sim.fleet.loads)
    assert all(r.inflight == 0 for r in sim.fleet.replicas)
    assert all(m.running == 0 and not m.queue for m in sim.models.values())
    return out


def test_affinity_keeps_caches_that_round_robin_scatters() -> None:
    affinity = simulate("--policy", "affinity")
    scattered = simulate("--policy", "round_robin")
    assert affinity["requests"] == scattered["requests"]  # the same sessions, every turn served
    assert affinity["failed_requests"] == scattered["failed_requests"] == 0
    # round robin still hits the shared system prompts; affinity hits the whole conversation
    assert 0.2 < scattered["kv_hit_rate"] < 0.6 and affinity["kv_hit_rate"] > scattered["kv_hit_rate"] + 0.3
    assert 0 < affinity["slot_occupancy"] < scattered["slot_occupancy"] < 1  # recomputing costs slot time
    assert affinity["jump_rate"] < 0.2 < scattered["jump_rate"]
    # each jump counted by its cause (router_session_jumps' labels): they add up to the jump rate
    for out in (affinity, scattered):
        assert sum(out["jumps_by"].values()) == pytest.approx(out["jump_rate"], abs=5e-4)
    assert set(scattered["jumps_by"]) == {"round_robin"}
    assert affinity["failed_attempts"] == scattered["failed_attempts"] == 0


def test_scale_out_moves_about_one_share_and_a_failure_is_failed_over() -> None:
    out = simulate("--scale-out-at", "40", "--fail-at", "50", "--scale-in-at", "60", "--rate", "40")
    moved = out["moved_share"]
    assert out["live_sessions_at"]["scale_out"] > 200
    # about 1/13 when it joins 12 (from before it joined to full weight), a tenth of that at 10% weight
    assert moved["scale_out_at_slow_start"] < 0.5 / 13 < moved["scale_out_full_weight"] < 2 / 13
    assert 0.5 / 13 < moved["failure"] < 2 / 13 and 0.5 / 13 < moved["scale_in"] < 2 / 12
    assert out["failed_attempts"] > 0  # requests on the dead replica were cut, and retried
    baseline = simulate("--rate", "40")
    assert out["requests"] == baseline["requests"] and out["failed_requests"] == 0  # ... so no turn was lost


def test_shared_system_prompts_and_batch_speed_shape_the_figures() -> None:
    one = simulate("--policy", "round_robin", "--system-prompts", "1")
    many = simulate("--policy", "round_robin", "--system-prompts", "5000")
    assert one["kv_hit_rate"] > many["kv_hit_rate"] + 0.1  # a prompt every replica has cached hits everywhere
    alone = simulate("--batch-slowdown", "0", "--rate", "60")
    crowded = simulate("--batch-slowdown", "3", "--rate", "60")
    assert crowded["latency_p50_s"] > 1.2 * alone["latency_p50_s"]  # a fuller batch decodes slower


def test_the_rebalancer_moves_a_hot_replicas_vnode_with_its_sessions() -> None:
    args = build_parser().parse_args(["simulate", "--replicas", "4", "--sessions", "10"])
    sim = Simulation(args)
    ring, fleet = sim.fleet.ring, sim.fleet
    hot = fleet.replicas[0]
    # a live session whose key lands on one of the hot replica's own vnodes, cached there
    session = next(
        n for n in range(10_000) if (loc := ring.locate(f"session-{n}".encode())) is not None and loc[1] == 0
    )
    key = f"session-{session}".encode()
    _, origin, number = ring.locate(key)  # type: ignore[misc]
    sim.live.add(session)
    sim.keys[session] = RoutingKey(key, "header", "sim")
    sim.system[session] = 0
    sim.models[hot.id].keep(session, 900)
    sim.sessions.put(key, hot.id)
    sim._placed(session, hot.id)
    for _ in range(30):  # 30 requests in flight on replica 0, 2 on each other one
        fleet.acquire(hot)
    for other in fleet.replicas[1:]:
        fleet.acquire(other)
        fleet.acquire(other)
    window = sim.config.rebalance_window_s
    others = [v for v in range(1, 40) if v != number][:9]  # traffic spread over ten of its vnodes
    for t in range(int(window) + 3):
        sim.now = float(t)
        sim.traffic.record(ring.replica_ids[origin], number)  # the session's vnode the hottest
        for v in [number, *others]:
            sim.traffic.record(ring.replica_ids[origin], v)
        sim._tick(None)
    assert sim.stats.migrations >= 1
    target = sim.sessions.get(key)
    assert target is not None and target != hot.id  # the session moved with its vnode ...
    assert sim.models[target].cached(session) == 900  # ... warmed on its new replica
    assert ring.lookup(key) == ring.index(target)
    assert session in sim.served_by[target] and session not in sim.served_by[hot.id]
    args = build_parser().parse_args(["simulate", "--replicas", "4", "--sessions", "10", "--no-rebalance"])
    assert not Simulation(args).rebalancing


def test_a_turn_running_while_its_session_moves_does_not_undo_the_move() -> None:
    args = build_parser().parse_args(["simulate", "--replicas", "4", "--sessions", "10"])
    sim = Simulation(args)
    source, target = sim.fleet.replicas[0], sim.fleet.replicas[1]
    key = b"session-0"
    sim.keys[0] = RoutingKey(key, "header", "sim")
    sim.shape[0] = [(10, 10, 1.0), (10, 10, 1.0)]
    sim.system[0] = 0
    sim.live.add(0)
    sim.sessions.put(key, source.id)
    sim._placed(0, source.id)
    sim.now = 5.0
    turn = Turn(0, 1, 2, 500, 10, 10, started=5.0)
    served = sim.loop.spawn(sim.serve(turn))  # through the proxy's journey
    sim.loop.run_until(5.05)  # virtual: it starts, and runs 0.2 s in all
    assert turn.replica is source and turn in sim.models[source.id].active  # back where its cache is
    # while it runs, a migration moves the session to `target`, as the router's view does
    assert sim.sessions.move(key, target.id, "migration")
    sim._placed(0, target.id)
    assert sim.loop.run_until_done(served) is True
    assert sim.now == pytest.approx(5.0 + turn.busy_s)
    assert sim.sessions.get(key) == target.id  # the move stands
    assert sim.stats.followups == 1 and sim.stats.jumps == 0  # a follow-up served where it was; no jump
    assert sim.models[source.id].cached(0) == 520  # the replica that served it did cache its context
    assert sim.fleet.replicas[0].inflight == 0  # the journey released its attempt
    sim.loop.close()


def test_a_replica_that_dies_cuts_its_turns_and_the_journey_fails_them_over() -> None:
    args = build_parser().parse_args(["simulate", "--replicas", "3", "--sessions", "10", "--slots", "1"])
    sim = Simulation(args)
    victim = sim.fleet.replicas[len(sim.fleet.replicas) // 2]
    turns = []
    for session in range(40):  # until two turns are on the victim: one running, one queued
        sim.keys[session] = RoutingKey(f"session-{session}".encode(), "header", "sim")
        sim.system[session] = 0
        sim.live.add(session)
        turn = Turn(session, 0, 1, 400, 100, 100, started=0.0)
        turns.append((turn, sim.loop.spawn(sim.serve(turn))))
        sim.loop.run_until(sim.now)  # what is ready runs; the clock stays
        if sum(t.replica is victim for t, _ in turns) == 2:
            break
    on_victim = [t for t, _ in turns if t.replica is victim]
    assert len(on_victim) == 2 and len(sim.models[victim.id].queue) == 1
    sim._fail(None)  # the victim dies: both attempts are cut ("reset") and go to the next replica
    served = [sim.loop.run_until_done(task) for _, task in turns]
    assert all(served) and sim.stats.failed_attempts == 2 and sim.stats.failed_requests == 0
    assert all(t.replica is not victim for t in on_victim) and sim.stats.requests == len(turns)
    assert all(r.inflight == 0 for r in sim.fleet.replicas)
    sim.loop.close()


def test_the_cache_model_evicts_least_recently_used_sessions() -> None:
    m = Model(kv_tokens=100, slots=1)
    m.keep(1, 40)
    m.keep(2, 40)
    assert m.cached(1) == 40  # 1 is now the most recent
    m.keep(3, 40)  # 120 > 100: the least recently used (2) goes
    assert m.cached(2) == 0 and m.cached(1) == 40 and m.cached(3) == 40 and m.cached_tokens == 80
    m.keep(1, 90)  # a session's context grows: its old entry is replaced, then 3 goes
    assert m.cached(3) == 0 and m.cached_tokens == 90
    m.keep_system(0)  # a shared system prompt (400 tokens) stays for good and takes room
    assert 0 in m.systems and m.cached(1) == 0 and m.cached_tokens == 400


def test_bad_arguments_are_one_line() -> None:
    for flags, message in (
        (["--turns", "5-2"], "--turns"),
        (["--turns", "a-b"], "--turns"),
        (["--probe-s", "0"], "--probe-s"),
        (["--rate", "-1"], "--rate"),
        (["--tpot-s", "0", "--prefill-s-per-token", "0"], "not both 0"),
        (["--batch-slowdown", "-1"], "--batch-slowdown"),
        (["--system-prompts", "0"], "--system-prompts"),
    ):
        with pytest.raises(ValueError, match=message):
            Simulation(build_parser().parse_args(["simulate", *flags]))


def test_an_event_handler_that_raises_stops_the_run_instead_of_ticking_on() -> None:
    args = build_parser().parse_args(["simulate", "--replicas", "4", "--sessions", "50", "--scale-in-at", "1"])
    sim = Simulation(args)

    def broken(_: Any) -> None:
        raise ZeroDivisionError("a bug in a handler")

    sim.handlers["scale_in"] = broken
    with pytest.raises(ZeroDivisionError, match="a bug in a handler"):
        sim.run()


def test_a_run_leaves_no_reference_cycle_behind() -> None:
    """The run turns the collector off (router.bench.simulate.Simulation.run): that holds only while
    a turn, failed over or not, leaves nothing that only the collector would free."""
    args = build_parser().parse_args(
        [
            "simulate",
            "--replicas",
            "6",
            "--sessions",
            "400",
            "--scale-out-at",
            "5",
            "--fail-at",
            "8",
            "--scale-in-at",
            "12",
        ]
    )
    sim = Simulation(args)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        out = sim.run()
        assert gc.isenabled()  # on again after the run
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert out["failed_attempts"] > 0 and out["requests"] > 1000  # failovers, and many turns, ran
    assert left == []
