"""What the engines' KV-cache events say of a prompt on each candidate: its tokens held, on a second tier, evicted."""

from __future__ import annotations

import math
from array import array
from typing import TYPE_CHECKING

from router._compat import NO_EXTENSIONS
from router.fleet import Fleet, ReplicaState
from router.health.states import ReplicaHealth
from router.kvevents.holdings import Holdings, Tier
from router.kvevents.roster import Followed
from router.kvevents.tokens import EngineTokens
from router.kvevents.truth import Truth
from router.kvevents.wire import MEDIUM_GPU
from router.prefix import PRICE_CANDIDATE, PRICE_GATED
from router.prompt import Prompt

if TYPE_CHECKING or NO_EXTENSIONS:
    from router._held_py import read_plain, under
else:
    from _held import read_plain, under


class Evicting:
    """What a request would evict on each position that holds conversations likely back
    (router.kvevents.truth.Truth.evicts), in seconds of its prefill there: asked only where it
    can change the decision (`bound`), since on a fleet of full caches each one walks the tail of
    that replica's LRU (at 100 replicas, pricing them all was most of a decision's time). Which
    positions hold such conversations is asked lazily too (`ask`): at 1,000 replicas, building
    the asks of every one was a tenth of a decision's time."""

    __slots__ = (
        "asked",
        "gpus",
        "ids",
        "known",
        "mean_output",
        "now",
        "seconds",
        "sized",
        "sizes",
        "spt",
        "tokens",
        "truth",
    )

    def __init__(
        self,
        truth: Truth,
        now: float,
        tokens: EngineTokens,
        mean_output: float,
        spt: array[float],
        ids: list[str],
        sizes: array[int],
        known: array[float],
        gpus: dict[int, tuple[int, int]],
    ) -> None:
        self.truth = truth
        self.now = now
        self.tokens = tokens  # the request's, in its engine's tokens
        self.mean_output = mean_output  # its reply's tokens, as the router expects them
        self.spt = spt  # by position: a token's seconds of prefill there
        self.ids = ids  # by position: its replica
        # by position: what `events_rows` read there: in the pass (`sizes`: its block size, `known`:
        # tokens held), or one by one (`gpus`: its GPU tokens and block size)
        self.sizes, self.known, self.gpus = sizes, known, gpus
        self.asked = bytearray(len(spt))
        self.seconds = array("d", bytes(8 * len(spt)))
        # by block size: the prompt's chain and the blocks it allocates besides those held (its reply's)
        self.sized: dict[int, tuple[array[int], int]] = {}

    def ask(self, i: int) -> tuple[str, int, int] | None:
        """What position i is asked: its replica, the tokens of the prompt its GPU holds, and its
        block size; None where it holds no conversation likely back, or its events were not read."""
        replica_id = self.ids[i]
        if not self.truth.returning.get(replica_id):
            return None
        b = self.sizes[i]
        if b:
            return replica_id, int(self.known[i]), b
        found = self.gpus.get(i)
        if found is None or not found[1]:
            return None
        return replica_id, found[0], found[1]

    def at(self, i: int) -> float:
        """Position i's (0.0 where it holds none likely back), asked once."""
        if not self.asked[i]:
            self.asked[i] = 1
            ask = self.ask(i)
            if ask is not None:
                replica_id, held, b = ask
                at_size = self.sized.get(b)
                if at_size is None:
                    chain = self.tokens.chain(b)
                    at_size = self.sized[b] = (chain, len(chain) + math.ceil(self.mean_output / b))
                # it allocates its prompt's blocks not held there, and its reply's
                lost = self.truth.evicts(replica_id, at_size[0], at_size[1] - held // b, self.now)
                self.seconds[i] = lost * (b * self.spt[i])  # (a block's seconds of prefill there)
        return self.seconds[i]

    def bound(
        self, cost: array[float], flags: array[int], best: int, also: tuple[int, ...], tie_s: float, tie_share: float
    ) -> array[float] | None:
        """The seconds per position, asked wherever the decision could read them, from a price
        without them (`cost`, `flags`, its `best`): the candidates under the gate, cheapest first,
        until one costs more, without, than the cheapest total found so far plus the tie margin
        (what is added is never negative, so it can be neither the best nor a near-tie); every
        candidate when all are past the gate (the least full of them is chosen by cost); and the
        positions in `also` (a session's replica, the conversation's home: their rows are compared
        with the best). The rest read 0.0. None where nothing asked evicts anything."""
        if best == -1:
            return self.every()
        if best >= 0:
            least = cost[best] + self.at(best)  # the cheapest total found so far
            limit = least + max(tie_s, least * tie_share)  # (it only falls: none past it is asked)
            order = sorted(
                (cost[i], i) for i in under(cost, flags, limit, PRICE_CANDIDATE, PRICE_GATED) if self.ask(i) is not None
            )
            for base, i in order:
                if base > least + max(tie_s, least * tie_share):
                    break
                least = min(least, base + self.at(i))
        for i in also:
            if i >= 0:
                self.at(i)
        return self.seconds if any(self.seconds) else None

    def every(self) -> array[float] | None:
        """The seconds on every position (for a price every row of which is read: /admin/route)."""
        for i in range(len(self.ids)):
            self.at(i)
        return self.seconds if any(self.seconds) else None


class Layout:
    """How `events_rows` reads the fleet: the positions whose replica's events come from one rank,
    with its GPU its only medium (most of a fleet), each with that rank and its holder in the
    index, read in one pass; and the others (several ranks, a second tier), asked one by one.
    Laid out again when the fleet's membership or the ranks the events follow change.

    Of the pass, the verdicts are laid out too (`_judge`): which positions read their holder's
    match at a block size (`fast`: three flat arrays, which a request reads at C speed without
    touching a replica's objects), which are asked one by one (`slow`: not believed, a second tier
    since, removed), and which are judged on every request: a rank followed from another process
    (`followed`: a worker's, whose believed, block size and tiers change there), by three words of
    its roster row; a rank suspected here, or of a block size only its metrics said (`dynamic`),
    attribute by attribute. Judged again when any rank's believed, block size or tiers change as
    this process keeps them (`Truth.changes`), or any replica's health state does
    (`ReplicaHealth.changes`)."""

    __slots__ = (
        "at",
        "dynamic",
        "fast",
        "followed",
        "followed_entries",
        "ids",
        "key",
        "others",
        "plain",
        "rows",
        "slow",
        "verdicts_key",
    )
    # the words of a roster row the pass reads of a worker's rank (router.kvevents.roster.Followed)
    row_words = (Followed.SURE, Followed.BLOCK, Followed.SECOND_TIER)

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.plain: list[tuple[int, ReplicaState, Holdings | Followed, dict[str, Tier], int]] = []
        self.others: list[int] = []
        self.at: dict[str, int] = {}  # replica -> its position
        self.ids: list[str] = []  # position -> its replica
        self.verdicts_key: tuple[tuple[int, int] | None, int, int] | None = None
        # (positions, holders, block sizes) read in the pass
        self.fast: tuple[array[int], array[int], array[int]] = (array("i"), array("i"), array("i"))
        # (positions, holders, roster words) read in the pass where their rows say so, each request
        self.followed: tuple[array[int], array[int], array[int]] = (array("i"), array("i"), array("i"))
        self.followed_entries: list[tuple[int, ReplicaState, Holdings | Followed, dict[str, Tier], int]] = []
        self.rows: memoryview | array[int] = array("Q")  # the roster's words (a worker's)
        self.dynamic: list[tuple[int, ReplicaState, Holdings | Followed, dict[str, Tier], int]] = []
        self.slow: list[int] = []

    def of(self, fleet: Fleet, truth: Truth) -> Layout:
        key = (fleet.version, truth.members)
        if key != self.key:
            self.plain, self.others, self.at = [], [], {}
            self.ids = [r.id for r in fleet.replicas]
            for i, r in enumerate(fleet.replicas):
                self.at[r.id] = i
                ranks = truth.replicas.get(r.id)
                if not ranks:
                    continue
                if len(ranks) == 1:
                    (h,) = ranks.values()
                    gpu = h.tiers.get(MEDIUM_GPU)
                    if gpu is not None and len(h.tiers) == 1:
                        self.plain.append((i, r, h, h.tiers, gpu.holder))
                        continue
                self.others.append(i)
            self.key = key
        stamp = (self.key, truth.changes[0], ReplicaHealth.changes)
        if stamp != self.verdicts_key:
            self._judge()
            self.verdicts_key = stamp
        return self

    def _judge(self) -> None:
        fast: tuple[array[int], array[int], array[int]] = (array("i"), array("i"), array("i"))
        followed: tuple[array[int], array[int], array[int]] = (array("i"), array("i"), array("i"))
        self.dynamic, self.slow, self.followed_entries = [], [], []
        for entry in self.plain:
            i, r, h, tiers, holder = entry
            if len(tiers) != 1 or r.health.state == "removed":
                self.slow.append(i)  # (a second tier since it was laid out; removed)
            elif isinstance(h, Followed):
                if h.suspect_seq is not None:
                    self.dynamic.append(entry)  # (suspected here: believed again once a message comes)
                else:  # (what the writer says of it changes there: its row is read on each request)
                    followed[0].append(i)
                    followed[1].append(holder)
                    followed[2].append(h.at)
                    self.followed_entries.append(entry)
                    self.rows = h.rows
            elif not h.block_size:
                self.dynamic.append(entry)  # (a block size only its metrics said, if any)
            elif not h.sure:
                self.slow.append(i)
            else:
                fast[0].append(i)
                fast[1].append(holder)
                fast[2].append(h.block_size)
        self.fast, self.followed = fast, followed


def events_rows(
    fleet: Fleet,
    truth: Truth,
    prompt: Prompt,
    excluded: array[int],
    spt: array[float],
    zeros: array[float],
    mean_output: float,
    now: float,
    layout: Layout | None = None,
) -> tuple[array[float], array[float], Evicting | None] | None:
    """Per position, the cached tokens its engine's events say it holds (a second tier's
    credited at its speed `spt`), -1 where they say nothing or are not believed; and of those, the
    tokens its engine holds on a second tier; and what the blocks it would allocate there (its
    prompt's not held, and a reply of `mean_output` tokens) would evict of the conversations likely
    to come back, to be asked where it matters (`Evicting`; None where no replica holds any). None
    when no candidate's events say anything. `prompt` carries its engine tokens.

    Every replica is read on every request, so most are read in one pass (`layout`: one sure rank
    on its GPU, of a known block size, no request sent there whose blocks have not shown): its
    blocks held are the index's match for it (the loops compiled: `_held`). The rest, and those
    with requests in flight whose blocks have not shown (what they evict first), are asked one by
    one (`Truth.row`)."""
    tokens = prompt.tokens
    assert tokens is not None
    n = len(excluded)
    known = array("d", [-1.0]) * n
    tier = zeros[:]
    matches: dict[int, array[int]] = {}  # by block size: what every holder keeps of its chain
    plan = (layout or Layout()).of(fleet, truth)
    sizes = array("i", bytes(4 * n))  # by position read in the pass: its block size (0: not read)
    slow = list(plan.others)
    read_plain(plan, excluded, known, sizes, slow, truth, tokens, matches)
    gpus: dict[int, tuple[int, int]] = {}  # by position asked one by one: its GPU tokens and block size
    for i in sorted(set(slow)):
        r = fleet.replicas[i]
        ranks = truth.replicas.get(r.id)
        if excluded[i] or not ranks:
            continue
        if r.health.state == "removed":
            truth.suspect(r.id)  # its health went down: the next message says whether it restarted
            continue
        said = r.engine.block_size  # (its metrics' block size, where its events have not said one)
        found = truth.row(ranks, r.id, tokens, matches, int(said) if said else None)
        if found is None:
            continue
        gpu, on_tier, b = found
        known[i] = truth.credit_tokens(gpu, on_tier, spt[i]) if on_tier else gpu
        if on_tier:
            tier[i] = on_tier
        gpus[i] = (gpu, b)
    if not gpus and not any(sizes):
        return None
    # what it would evict where conversations likely back are held: asked later, where it matters
    evicting: Evicting | None = None
    if truth.returning:
        evicting = Evicting(truth, now, tokens, mean_output, spt, plan.ids, sizes, known, gpus)
    return known, tier, evicting


__all__ = ["Evicting", "Layout", "events_rows"]
