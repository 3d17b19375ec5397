"""router-bench simulate --explain-jumps: why `ttft`'s follow-up turns leave their session's replica.

For each follow-up turn the policy sends away from its session's replica, the two rows its price
compared (the session's replica and the one chosen: cached tokens, predicted wait, cost, what it
would evict) and what the modelled engine itself held of that conversation at its replica when
the decision was made. And each turn's hit by what it was: a conversation's first turn, a turn
that stayed (its session never moved), a turn that moved, a turn that stayed after its session
had moved. The run's decisions are the same as without it: it only reads them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Protocol

from router.keys import RoutingKey
from router.measures import percentile
from router.placement.priced import Candidate, Priced
from router.policy import Decision
from router.policy.ttft import Ttft
from router.prompt import Prompt


class Cache(Protocol):
    """A modelled replica (router.bench.simulate.Model): its cache, session -> context tokens."""

    @property
    def cache(self) -> Mapping[int, int]: ...


class Simulated(Protocol):
    """What is read of the simulation (router.bench.simulate.Simulation)."""

    @property
    def policy(self) -> object: ...

    @property
    def models(self) -> Mapping[str, Cache]: ...


class SimTurn(Protocol):
    """A turn served (router.bench.simulate.Turn)."""

    session: int
    number: int
    context: int  # tokens before its message
    message: int
    cached: int  # of its prompt, computed from cache


KINDS = ("first", "stayed", "moved", "stayed after a move")
FIELDS = ("cached_tokens", "wait_s", "cost_s", "evicts_s")


class JumpWatch:
    """Watches the policy's decisions of one simulated run (`decide` wrapped on its instance)."""

    def __init__(self, sim: Simulated) -> None:
        policy = sim.policy
        if not isinstance(policy, Ttft):
            raise ValueError("--explain-jumps needs --policy ttft (the policy that prices each replica)")
        self.sim = sim
        self.policy = policy
        self._decide = policy.decide
        policy.decide = self.decide  # type: ignore[method-assign]  # (this run's policy object only)
        # by session: the rows of its latest decision that left its replica, and what the modelled
        # engine held of its conversation there then
        self.pending: dict[int, tuple[Candidate, Candidate, int]] = {}
        self.rows: dict[str, list[float]] = {f"{side}_{f}": [] for side in ("home", "chosen") for f in FIELDS}
        self.held_there: list[int] = []
        self.moved: set[int] = set()  # sessions that have moved
        self.turns = {kind: [0, 0, 0] for kind in KINDS}  # turns, prompt tokens, cached tokens

    def decide(
        self, key: RoutingKey, prompt: Prompt, last: str | None, exclude: Collection[int], every_row: bool = False
    ) -> tuple[Decision | None, Priced]:
        decision, priced = self._decide(key, prompt, last, exclude, every_row)
        policy = self.policy
        if decision is None or last is None or not key.key.startswith(b"session-"):
            return decision, priced
        home = policy.session_replica(policy.evidence(key, last), policy.avoiding(key, exclude))
        if home is not None and home != decision.index and priced.best >= -1:
            session = int(key.key[len(b"session-") :])
            held = self.sim.models[policy.fleet.replicas[home].id].cache.get(session, 0)
            self.pending[session] = (priced.row(home), priced.row(decision.index), held)
        return decision, priced

    def finished(self, turn: SimTurn, jumped: bool) -> None:
        """A turn was served (`jumped`: it counted as a jump)."""
        pending = self.pending.pop(turn.session, None)
        if turn.number == 0:
            kind = "first"
        elif jumped:
            kind = "moved"
            self.moved.add(turn.session)
            if pending is not None:
                home, chosen, held = pending
                for f in FIELDS:
                    self.rows[f"home_{f}"].append(getattr(home, f))
                    self.rows[f"chosen_{f}"].append(getattr(chosen, f))
                self.held_there.append(held)
        else:
            kind = "stayed after a move" if turn.session in self.moved else "stayed"
        counts = self.turns[kind]
        counts[0] += 1
        counts[1] += turn.context + turn.message
        counts[2] += turn.cached

    def ended(self, session: int) -> None:
        self.moved.discard(session)
        self.pending.pop(session, None)

    def report(self) -> dict[str, Any]:
        explained = len(self.held_there)
        return {
            "moves_explained": explained,
            # the share of those moves whose conversation the modelled engine held none of, at its
            # replica, when the decision was made (the move lost nothing cached then)
            "engine_held_none_there": round(sum(1 for h in self.held_there if not h) / explained, 4)
            if explained
            else None,
            "rows_p50": {k: round(percentile(v, 50), 4) for k, v in self.rows.items() if v},
            "rows_mean": {k: round(sum(v) / len(v), 4) for k, v in self.rows.items() if v},
            "turns": {
                kind: {"turns": n, "kv_hit_rate": round(cached / prompt, 4) if prompt else None}
                for kind, (n, prompt, cached) in self.turns.items()
            },
        }


def print_report(out: dict[str, Any]) -> None:
    """--explain-jumps's lines of router-bench simulate's table."""
    if out["moves_explained"]:
        p50, mean = out["rows_p50"], out["rows_mean"]
        print(
            f"  moves: {out['moves_explained']:,}; the modelled engine held none of the conversation at its replica "
            f"for {out['engine_held_none_there']:.1%}"
        )
        print("    median (mean) of the rows compared, its replica against the one chosen:")
        for f in FIELDS:
            home, chosen = f"home_{f}", f"chosen_{f}"
            print(f"      {f} {p50[home]:.4g} ({mean[home]:.4g}) against {p50[chosen]:.4g} ({mean[chosen]:.4g})")
    print(
        "  KV hit by turn: "
        + ", ".join(
            f"{kind} {t['kv_hit_rate']:.1%} ({t['turns']:,})"
            for kind, t in out["turns"].items()
            if t["kv_hit_rate"] is not None
        )
    )


__all__ = ["JumpWatch", "print_report"]
