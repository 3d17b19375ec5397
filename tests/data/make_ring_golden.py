"""Writes ring_golden.json: fleets, weights, seeds and key -> owner answers that pin placement.

Other proxies that embed or re-implement the ring check themselves against this file. It is
generated from the pure-Python twin (hashing by the xxhash package) and must never change:
a different answer here means every session of every fleet would move.

    python tests/data/make_ring_golden.py > tests/data/ring_golden.json
"""

import json
import random
import sys
import uuid

from router._ring_py import Ring

SCENARIOS = [
    {
        "name": "20x128 default seed",
        "replicas": [f"replica-{i}" for i in range(20)],
        "vnodes": 128,
        "seed": 0,
    },
    {
        "name": "12x160 seeded, weighted, one down, one override",
        "replicas": [f"http://10.1.0.{i}:8000" for i in range(12)],
        "vnodes": 160,
        "seed": 0xC0FFEE,
        "weights": {"3": 0.5, "7": 0.0, "9": 0.33},
        "unavailable": [5],
        "overrides": [[0, 17, 4]],
    },
    {"name": "3x1 tiny", "replicas": ["a", "b", "c"], "vnodes": 1, "seed": 1},
]


def main() -> None:
    rng = random.Random(1129)
    keys = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(150)]
    keys += ["", "a", "session-ü", "x" * 241, "conversation:" + "y" * 100]
    out = []
    for sc in SCENARIOS:
        ring = Ring(sc["replicas"], sc["vnodes"], sc["seed"])
        for i, w in sc.get("weights", {}).items():
            ring.set_weight(int(i), w)
        for i in sc.get("unavailable", []):
            ring.set_available(i, False)
        for origin, vnode, owner in sc.get("overrides", []):
            ring.reassign_vnode(origin, vnode, owner)
        out.append(
            sc
            | {
                "keys": keys,
                "hashes": [ring.key_hash(k) for k in keys],
                "owners": [ring.lookup(k) for k in keys],
            }
        )
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
