"""Agreement between routers that follow the same engines' KV events (`router-bench events --routers`).

Routers agree by construction only while each has applied every event: a decision taken while a
message is in flight to one of them and not yet to another, or by a router that joined late and
has not replayed everything, may differ. This measures how often it does, on keyless traffic, where
the event-fed index is what decides: a request goes to the replica whose events say it holds the
most of its prompt (no replica holding any: every router falls back alike, to load).

`Recorder` keeps, from one router's applied batches, the token ids of each replica's latest
chains (a request's prompt as its engine stored it, block by block). Every `SAMPLE_S` the sampler
draws prompts from them (a random leading part of a random recent chain, the newest included, so
that events still in flight to another router count) and asks every router which replica it would
send each to (`decision`): one compiled match over the router's whole index, then the replica
whose GPU tier holds the most leading blocks, among those the router believes (a replica it does
not believe yet is priced by its model in a real router: here it counts as holding nothing).
"""

from __future__ import annotations

import asyncio
import math
import random
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.kvevents.tokens import root_of, token_chain
from router.kvevents.truth import Truth
from router.kvevents.wire import MEDIUM_GPU, Batch, Stored

SAMPLE_S = 0.05  # prompts are drawn this often
SAMPLES = 16  # ... this many each time
CHAINS_KEPT = 4  # a replica's latest chains a prompt is drawn from


class Recorder:
    """The token ids of each replica's latest chains, from the batches one router applied."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # replica id -> its chains' token ids, by the engine's name of each chain's last block
        self.chains: dict[str, OrderedDict[int, array[int]]] = {}

    def heard(self, rid: str, batch: Batch) -> None:
        for e in batch.events:
            if not isinstance(e, Stored) or e.block_size != self.block_size or not len(e.hashes):
                continue
            kept = self.chains.get(rid)
            if e.parent is None:
                tokens = array("Q", e.token_ids)
            else:
                before = kept.pop(e.parent, None) if kept is not None else None
                if before is None:
                    continue  # its chain began before this router joined
                tokens = before
                tokens.extend(e.token_ids)
            if kept is None:
                kept = self.chains[rid] = OrderedDict()  # (a replica is listed once it has a chain)
            kept[e.hashes[-1]] = tokens
            while len(kept) > CHAINS_KEPT:
                kept.popitem(last=False)

    def draw(self, rng: random.Random) -> array[int] | None:
        """A prompt's chain of keys: a random leading part of a random recent chain (None: none yet)."""
        if not self.chains:
            return None
        kept = self.chains[rng.choice(list(self.chains))]
        tokens = rng.choice(list(kept.values()))
        blocks = rng.randint(1, len(tokens) // self.block_size)
        return token_chain(tokens[: blocks * self.block_size], self.block_size, root_of(None, None))


def decision(truth: Truth, ids: Sequence[str], chain: array[int]) -> int:
    """The position of the replica whose events say it holds the most leading blocks of `chain` on
    its GPU (the first among equals), of those believed; -1 when none holds any."""
    index = truth.index
    matched = array("i", bytes(4 * index.n_holders))
    index.match_all(chain, matched)
    return best_of(matched, gpu_holders(truth, ids))


def gpu_holders(truth: Truth, ids: Sequence[str]) -> list[list[int]]:
    """Per position, the index's holders of the replica's GPU tiers (one a rank); none for a
    replica not believed."""
    out: list[list[int]] = []
    for rid in ids:
        tiers = [h.tiers.get(MEDIUM_GPU) for h in truth.of(rid)] if truth.sure(rid) else []
        out.append([t.holder for t in tiers if t is not None])
    return out


def best_of(matched: array[int], holders: Sequence[Sequence[int]]) -> int:
    """`decision` from one match over the index (`matched[holder]`) and `gpu_holders`."""
    best, most = -1, 0
    for pos, numbers in enumerate(holders):
        for holder in numbers:
            if holder < len(matched) and matched[holder] > most:
                best, most = pos, matched[holder]
    return best


@dataclass
class Agreement:
    """Decisions compared: among the routers that joined together, and a late one against the first."""

    samples: int = 0
    identical: int = 0  # every router that joined together decided alike
    held: int = 0  # ... of which some replica held some of the prompt (the index decided, not load)
    late_samples: int = 0  # once the late router believed every replica
    late_identical: int = 0

    @property
    def share(self) -> float:
        return self.identical / self.samples if self.samples else float("nan")

    @property
    def late_share(self) -> float:
        return self.late_identical / self.late_samples if self.late_samples else float("nan")


async def sample(
    recorder: Recorder,
    together: Sequence[Truth],
    late: Callable[[], Truth | None],
    ids: Sequence[str],
    agreement: Agreement,
    until: float,
    clock: Callable[[], float],
    seed: int = 7,
    remote: Callable[[list[array[int]]], Awaitable[list[list[int]]]] | None = None,
) -> None:
    """Draws prompts every SAMPLE_S until `until` (on `clock`) and counts identical decisions.
    `late()` is the late router once it believes every replica (None before, or without one);
    `remote(chains)`: the decisions of routers in other processes (router.bench.event_remote), each
    a list in the order of `chains`, asked just after this process's routers decided."""
    rng = random.Random(seed)
    while clock() < until:
        joined = late()
        chains = []
        for _ in range(SAMPLES):
            chain = recorder.draw(rng)
            if chain is None:
                break
            chains.append(chain)
        # this process's routers decide at one instant (no await between them)
        firsts = [decision(together[0], ids, chain) for chain in chains]
        pairs = list(zip(chains, firsts, strict=True))
        same = [all(decision(t, ids, chain) == first for t in together[1:]) for chain, first in pairs]
        if joined is not None:
            agreement.late_samples += len(chains)
            agreement.late_identical += sum(decision(joined, ids, c) == f for c, f in pairs)
        if remote is not None and chains:
            for theirs in await remote(chains):
                same = [s and t == f for s, t, f in zip(same, theirs, firsts, strict=True)]
        agreement.samples += len(chains)
        agreement.identical += sum(same)
        agreement.held += sum(f >= 0 for f in firsts)
        await asyncio.sleep(SAMPLE_S)


def render_agreement(rows: list[dict[str, Any]]) -> list[str]:
    """The agreement table's lines, for the rows that compared routers (none: no lines)."""
    compared = [r for r in rows if r["routers"] > 1 or r["late_router"]]
    if not compared:
        return []
    lines = [
        "",
        "Agreement on keyless traffic, in the steady window: prompts drawn from the replicas' latest chains "
        "(the newest blocks included), each router sending each to the replica its events say holds the most "
        "of it. Late: a router that joined halfway through, against the first, once it believed every replica.",
        "",
        "| publishers | routers together | decisions compared | by the index | identical "
        "| late router: believed (s) | compared | identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in compared:
        late = (
            f"{figure(r['late_believe_s'], '.2f')} ({r['late_believed']:,} believed) | {r['late_compared']:,} "
            f"| {figure(r['late_agreement'], '.3%')}"
            if r["late_router"]
            else "— | — | —"
        )
        identical = figure(r["agreement"], ".3%") if r["routers"] > 1 else "— (one router)"
        procs = r.get("router_procs", 0)
        own = "reading the first's index in shared memory" if r.get("shared_index") else "in processes of their own"
        together = f"{r['routers']}" + (f" ({procs} {own})" if procs else "")
        lines.append(
            f"| {r['publishers']:,} | {together} | {r['decisions_compared']:,} | {r['decisions_by_index']:,} "
            f"| {identical} | {late} |"
        )
    for r in compared:
        if r.get("router_procs"):
            lines.append(
                f"\n{r['publishers']:,} publishers: each other router process used "
                f"{figure(r.get('router_procs_cpu_s', math.nan), '.2f')} s of CPU and ended with "
                f"{figure(r.get('router_procs_rss_mib', math.nan), ',.0f')} MiB resident, "
                f"{figure(r.get('router_procs_private_mib', math.nan), ',.0f')} MiB of it its own."
            )
    return lines


def figure(value: float, spec: str) -> str:
    """`value` formatted by `spec`, or — where it is NaN (not measured)."""
    return "—" if math.isnan(value) else format(value, spec)


__all__ = ["Agreement", "Recorder", "best_of", "decision", "figure", "gpu_holders", "render_agreement", "sample"]
