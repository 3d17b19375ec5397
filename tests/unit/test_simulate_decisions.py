"""`router-bench simulate` routes with the router's own decision code: the same events, the same picks.

A fixed sequence of turns — sessions that start together (so loads build and bounded load spills),
follow-ups, a replica that refuses connections — is fed once to the simulator (each turn through the
proxy's journey, on its virtual clock), and once to the routing core of a router node built from the
same settings, driven the way the journey drives it. Every pick, every jump cause and the session
table must agree.
"""

from __future__ import annotations

import argparse
import asyncio

from router.bench.simulate import Simulation, Turn, add_parser
from router.bench.virtual_time import LightLoop, Strand
from router.config import load
from router.keys import RoutingKey
from router.node import Node
from router.routing import Served

REPLICAS = 4
DEAD = "r1"  # refuses connections from the second round on


def sim_args(policy: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    # turns that would take 50,000 s: none ends by itself, the script ends each
    flags = ["--replicas", str(REPLICAS), "--sessions", "100", "--policy", policy, "--tpot-s", "1000"]
    return parser.parse_args(["simulate", *flags])


def settle(loop: LightLoop) -> None:
    """Run what is ready on the simulator's loop without moving its clock."""
    loop.run_until(loop.time())


def script() -> list[tuple[str, int]]:
    """("start" | "done", session): 24 sessions start together, finish, and come back twice;
    the second and third rounds interleave starts and ends."""
    events = [("start", s) for s in range(24)] + [("done", s) for s in range(24)]
    for _ in range(2):
        for s in range(24):
            events.append(("start", s))
            if s % 3 == 2:
                events += [("done", s - 2), ("done", s - 1), ("done", s)]
    return events


def key(session: int) -> RoutingKey:
    return RoutingKey(f"session-{session}".encode(), "header", "sim")


def run_simulator(policy: str) -> tuple[list[str], dict[str, str | None]]:
    sim = Simulation(sim_args(policy))
    picks: list[str] = []
    running: dict[int, Turn] = {}
    rounds: dict[int, int] = {}
    served: list[Strand[bool]] = []
    for step, (op, session) in enumerate(script()):
        sim.now = float(step)
        if op == "start":
            number = rounds.get(session, 0)
            rounds[session] = number + 1
            if number == 1:
                sim.models[DEAD].dead = True
            sim.keys[session] = key(session)
            sim.shape[session] = [(100, 50, 1.0)] * 3
            sim.system[session] = 0
            turn = Turn(session, number, 3, 400 + number * 150, 100, 50, started=sim.now)
            served.append(sim.loop.spawn(sim.serve(turn)))  # the proxy's journey, to its attempt
            settle(sim.loop)
            assert turn.replica is not None
            picks.append(turn.replica.id)
            running[session] = turn
        else:
            turn = running.pop(session)
            model = sim.models[turn.replica.id]  # type: ignore[union-attr]
            if turn in model.queue:  # it never started: start it now, as its slot would have freed
                model.queue.remove(turn)
                sim._start(turn, model)
            sim._done(turn)
            settle(sim.loop)  # the journey ends the turn
    assert all(task.done and task.result() for task in served)
    sim.loop.close()
    return picks, {f"session-{s}": sim.sessions.get(key(s).key) for s in range(24)}


async def run_router(policy: str) -> tuple[list[str], dict[str, str | None]]:
    urls = [f"r{i}=http://sim/{i}" for i in range(REPLICAS)]
    node = Node(load(None, {}, {"replicas": urls, "policy": policy, "state": "none", "health_checks": "false"}))
    routing = node.routing
    picks: list[str] = []
    running = {}
    rounds: dict[int, int] = {}
    for step, (op, session) in enumerate(script()):
        now = float(step)
        if op == "start":
            number = rounds.get(session, 0)
            rounds[session] = number + 1
            route = await routing.route(key(session), now, now + 600)
            replica = route.next(now)
            while replica is not None and replica.id == DEAD and number >= 1:  # connection refused
                route.release(replica)
                route.failed(replica, "connect")
                replica = route.next(now)
            assert replica is not None
            picks.append(replica.id)
            running[session] = (route, replica)
        else:
            route, replica = running.pop(session)
            route.release(replica)
            route.served(replica, Served(200, 0.1, 500, 0, 50, streamed=True), "/v1/chat/completions")
    return picks, {f"session-{s}": node.sessions.get(key(s).key) for s in range(24)}


def test_the_simulator_and_the_router_make_the_same_decisions() -> None:
    for policy in ("affinity", "consistent_hash", "least_load"):
        sim_picks, sim_sessions = run_simulator(policy)  # on its own loop, with its virtual clock
        router_picks, router_sessions = asyncio.run(run_router(policy))
        assert sim_picks == router_picks, policy
        assert sim_sessions == router_sessions, policy
        assert DEAD not in sim_picks[48:] and len(set(sim_picks)) > 1  # the failover and the spread happened
