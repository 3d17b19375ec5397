"""Writes prefix_golden.json: block keys of fixed inputs and of prompts in parts, and a scripted index history.

The block keys come from the xxhash package directly (the oracle), and the pure-Python twin
must agree with them before anything is written; the history's answers come from the twin.
A prompt in parts is keyed as the UTF-8 of its parts joined (lone surrogates passed through);
each part is written as {"text": ...} or {"hex": ...}.
Both implementations, and anything else that keys or tracks KV blocks for this router, check
themselves against the file. It must never change: a different key here means replicas'
cached blocks no longer match what the router predicts.

    python tests/data/make_prefix_golden.py > tests/data/prefix_golden.json
"""

import json
import random
import sys
from array import array
from typing import Any

import xxhash

from router._prefix_py import PrefixIndex, block_chain, chain_of_parts

TEXT = "System: you are a helpful assistant. Ünïcödé and emoji 🚀 count as UTF-8 bytes.\n" * 12
BLOCK_LENS = (4, 16, 64, 240, 241, 256)
SEEDS = (0, 1, 0xC0FFEE, (1 << 64) - 1)


def oracle_chain(data: bytes, block_len: int, seed: int) -> list[int]:
    keys, h = [], seed
    for start in range(0, len(data) - block_len + 1, block_len):
        h = xxhash.xxh3_64_intdigest(data[start : start + block_len], h)
        keys.append(h)
    return keys


def chain_vectors() -> list[dict[str, Any]]:
    rng = random.Random(20240611)
    inputs: list[tuple[str, str | bytes]] = [("text", TEXT), ("hex", rng.randbytes(1000)), ("hex", b"")]
    out = []
    for kind, data in inputs:
        raw = data.encode("utf-8") if isinstance(data, str) else data
        for block_len in BLOCK_LENS:
            for seed in SEEDS[: 2 if block_len < 64 else 4]:
                keys = oracle_chain(raw, block_len, seed)
                if list(block_chain(data, block_len, seed)) != keys:
                    raise SystemExit(f"twin disagrees with xxhash for block_len={block_len} seed={seed}")
                value = data if isinstance(data, str) else data.hex()
                out.append({kind: value, "block_len": block_len, "seed": seed, "keys": keys})
    return out


def parts_vectors() -> list[dict[str, Any]]:
    """Chat renderings in parts (role markers, texts, raw bytes), blocks that straddle parts."""
    cases: list[tuple[list[str | bytes], int, int, int]] = [
        (["<|system|>", TEXT[:300], "<|end|>", "<|user|>", "Ünïcödé 🚀 question?" * 9, "<|end|>"], 64, 0xC0FFEE, 3),
        (["<|user|>", "", "a", "bc", "", "defghijklmnopq", "r" * 47, "<|end|>"], 16, 1, 5),
        ([b"raw \x00\xff bytes ", "then text ", b"", "x" * 500, "é" * 121], 240, (1 << 64) - 1, 2),
        (["a lone \ud800 surrogate, ", "passed through \udfff as UTF-8 would", " if it could"], 16, 42, 3),
        ([], 16, 0, 0),
    ]
    out = []
    for parts, block_len, seed, mark in cases:
        raw = [p.encode("utf-8", "surrogatepass") if isinstance(p, str) else p for p in parts]
        keys = oracle_chain(b"".join(raw), block_len, seed)
        expected = (keys, sum(map(len, raw)), sum(map(len, raw[:mark])))
        chain, total, head = chain_of_parts(parts, block_len, seed, mark)
        if (list(chain), total, head) != expected:
            raise SystemExit(f"twin disagrees with xxhash for parts of block_len={block_len} seed={seed}")
        encoded = [{"text": p} if isinstance(p, str) else {"hex": p.hex()} for p in parts]
        out.append(
            {"parts": encoded, "block_len": block_len, "seed": seed, "mark": mark, "keys": keys}
            | {"total": expected[1], "head": expected[2]}
        )
    return out


def scripted_history() -> dict[str, Any]:
    """Prompts that share prefixes (a system prompt, then conversations), sent to four holders
    with small capacities, with every kind of change; each step's answer is recorded."""
    rng = random.Random(7)
    system = TEXT[:256]
    convs = [system + f"user {i}: " + "question " * (4 + 3 * i) for i in range(5)]
    prompts = convs + [c + "assistant: answer. user: and then? " * 3 for c in convs[:3]] + ["unrelated " * 30]
    chains = [list(block_chain(p, 16, 42)) for p in prompts]
    index = PrefixIndex()
    steps: list[list[Any]] = []

    def step(op: list[Any], result: Any) -> None:
        steps.append([*op, result])

    for cap in (40, 25, 60, 10):
        step(["add_holder", cap], index.add_holder(cap))
    for i in range(160):
        if i == 80:  # a replica leaves and another takes its number
            index.remove_holder(1)
            step(["remove_holder", 1], None)
            step(["add_holder", 30], index.add_holder(30))
        h = rng.randrange(index.n_holders)
        c = rng.randrange(len(chains))
        chain = array("Q", chains[c])
        kind = rng.choices(
            ["insert", "insert_n", "match", "match_all", "truncate", "evict", "set_capacity", "clear"],
            [30, 8, 20, 20, 6, 5, 4, 2],
        )[0]
        if kind == "insert":
            step(["insert", h, c, -1], index.insert(h, chain))
        elif kind == "insert_n":
            n = rng.randrange(len(chain) + 1)
            step(["insert", h, c, n], index.insert(h, chain, n))
        elif kind == "match":
            step(["match", h, c], index.match(h, chain))
        elif kind == "match_all":
            out = array("i", [0] * index.n_holders)
            index.match_all(chain, out)
            step(["match_all", c], list(out))
        elif kind == "truncate":
            keep = rng.randrange(len(chain) + 1)
            step(["truncate", h, c, keep], index.truncate(h, chain, keep))
        elif kind == "evict":
            count = rng.randrange(8)
            step(["evict", h, count], index.evict(h, count))
        elif kind == "set_capacity":
            cap = rng.randrange(5, 70)
            step(["set_capacity", h, cap], index.set_capacity(h, cap))
        else:
            step(["clear", h], index.clear(h))
        step(["size", h], index.size(h))
    step(["total"], index.total())
    return {"block_len": 16, "seed": 42, "prompts": prompts, "chains": chains, "steps": steps}


def main() -> None:
    golden = {"chains": chain_vectors(), "history": scripted_history(), "parts": parts_vectors()}
    json.dump(golden, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
