"""Routing policies, one per module, chosen by name. They read the fleet; they never change it.

`pick(key, last, exclude)` returns `(replica index, reason)` or None when no replica can serve:
`key` is the request's routing key, `last` the replica id that served this session last (if
known), `exclude` the indices already tried for this request (a retry never goes back to them).
"""

from __future__ import annotations

from router.config import POLICIES, RouterConfig
from router.fleet import Fleet
from router.placement import Answer
from router.policy.affinity import Affinity
from router.policy.base import Decision, Explained, Hearing, Policy
from router.policy.consistent_hash import ConsistentHash
from router.policy.least_load import LeastLoad
from router.policy.lmetric import Lmetric
from router.policy.round_robin import RoundRobin
from router.policy.ttft import Ttft

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Ttft, Affinity, ConsistentHash, RoundRobin, LeastLoad, Lmetric)
}
# config validates `policy` against its own list of names (config sits below the policies)
assert tuple(REGISTRY) == POLICIES, "config.POLICIES must name the policies of REGISTRY, in order"


def make_policy(name: str, fleet: Fleet, config: RouterConfig) -> Policy:
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(REGISTRY)}") from None
    return cls.from_config(fleet, config)


__all__ = ["REGISTRY", "Answer", "Decision", "Explained", "Hearing", "Policy", "make_policy"]
