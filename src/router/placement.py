"""What each replica should hold and how soon it could answer: the prefix index and the TTFT model.

The `ttft` policy asks two things of every routable replica, and this module answers both.

**How much of this prompt does it hold?** One `PrefixIndex` (router.prefix, compiled) keeps per
replica an LRU of the blocks (router.prompt) the router sent there, as many as the replica's KV
cache holds: the engine's own figure (vLLM `vllm:cache_config_info` block_size x num_gpu_blocks,
SGLang `max_total_num_tokens`), else `kv_capacity_tokens`, else `DEFAULT_KV_TOKENS`. Tokens become
blocks at the bytes-per-token ratio the replicas' `usage.prompt_tokens` shows (learnt, 4 at
first). After every answer the engine's `cached_tokens` says how right the guess was:
- it held less than predicted: the blocks past what it held are dropped, and the replica's LRU
  shrinks by the share it over-predicted (its KV also holds what others sent, or decode blocks);
- it held next to nothing of a long predicted prefix twice running: it restarted or cleared its
  cache, and its LRU is emptied;
- it held all it was said to: the LRU grows back towards the engine's capacity.

**When would its first token come?** A replica prefills what it is given in order, so the router
keeps, per replica, the time its prefill queue drains (`busy_until`): a request of u uncached
tokens sent at t starts at max(t, busy_until) and moves it to that + u x seconds per token. The
seconds per token are learnt from every streamed answer that had the replica to itself (with
others there its first token also waited for their decode steps and for room in its KV cache):
its measured TTFT, less the decode share, over the tokens it waited for and computed (at least
SPEED_MIN_TOKENS: below that a step's fixed cost dominates), starting at `prefill_tokens_per_s`.
A replica's speed is the median of its last SPEED_WINDOW samples, weighed against its peers'
median (the median of the medians of the replicas serving the same models, else the whole
fleet's) as if that were SPEED_PRIOR samples more: replicas of one model prefill alike, and a few
odd samples must not make one look slow (it would get a fraction of the traffic for as long as it
kept them: at 5x the Mooncake traces, identical emulated replicas were learnt at 5,700 to 17,100
tokens/s, and got 11 to 89 requests each), while another model's replicas may be several times
slower or faster. A replica not yet measured takes its peers' median (else the first one measured
fast would look like the only fast one, and draw everything). So

    cost(replica) = max(0, busy_until - now, kv_wait)             wait for what was sent there (or
                                                                  for room in its KV cache)
                  + other_waiting x mean uncached x s_per_token   queued by others (probed)
                  + running x ttft_decode_s                       its decode steps slow prefill
                  + (prompt tokens - cached tokens) x s_per_token x (1 + ttft_interference x running)
                                                                  this request's own prefill, and
                                                                  the delay it causes the running
                  + ttft_spread_tokens x s_per_token x excess x uncached / prompt   what new context commits
                  + evicted x block tokens x s_per_token          what it pushes out of the conversations
                                                                  likely back soon (events only)

kv_wait: an engine admits a request only once its blocks fit. The router counts the tokens it has
in flight on each replica (prompts, and the mean reply length); past its KV capacity C, a request
of r tokens waits (in flight + r - C) / C x the fleet's mean reply time (a cache's worth of
requests finishes every reply). Without it a replica with an empty prefill queue but a full
cache looked free, and an overloaded fleet's first tokens waited where the model saw no queue.

busy_until is the router's model of what it sent; the engines' first tokens correct it. A request
remembers when its first token was due (`Placed.due`); a streamed answer whose first token came
`lag` seconds later (less the corrections that replica's queue had since: `Held.shift`) moves
that replica's busy_until by `ttft_queue_gain` x lag while others are still in flight there
(`_lagged`), and an early one back (never before now).

The last term is not this request's time to first token but the turns a conversation placed there
will bring: excess = (recent - mean recent)+ / (mean recent + 4), from the requests
sent to each replica, decaying over SPREAD_WINDOW_S, and scaled by the share of the prompt the
replica would compute (a replica that holds nearly all of it is continuing a conversation, not
taking a new one). Without it an idle fleet sends every new conversation to the replica holding
their shared system prompt: right for one first token, wrong for the load (and the cache room)
of every turn after it. A chat with no assistant turn yet (`Prompt.opening`) is a new conversation
however much of it a replica holds (a coding agent's 12k-token tool prompt is most of its first
turn, and its own context grows past it within a few tool calls): its spread is charged whole,
not by the share computed, and in at least the tokens of its messages before the last that the
replica holds (its shared system or tool prompt), so what that prefix saves it there draws it no
further than the replica's excess allows. Nor is such a holder its home (router.policy.ttft: a
new conversation's home holds some of its last message; the stay margin had kept the agents'
sessions there). On the agents workload the holders of the two shared tool prompts had drawn
every session (load CV 1.53; 1.20 with the spread charged whole; 0.86-1.02 with no home).
A document in its last message is its own work, not a shared prefix: it is not counted (counting
it cost long-document QA a point of hit rate). A keyed session's own replica never pays it.

The eviction term, where the replica's engine publishes KV-cache events: a request allocating
more blocks there than are empty evicts its oldest free blocks, and those may be a conversation
that ended a turn there seconds ago and is about to come back (router.kvevents.truth.Truth.evicts:
its blocks evicted, weighed by how likely it comes back before the replica's other traffic would
have evicted them anyway). They would be computed again on its return, at that replica's speed.
So a long new context goes where it destroys least (empty blocks, or blocks nobody is coming back
for), and it is no part of the predicted time to first token (`Candidate.ttft_s`).

`price` hands all of it to the compiled core (`PrefixIndex.price`: one loop over raw arrays kept
here by fleet position), which also applies the gate and finds the cheapest and its near-ties;
router.policy.ttft breaks ties and applies the stay margin.

Worked example, 2 s of work queued on replica A holding a 10,000-token document, replica B empty,
both at 20,000 tokens/s, nothing in flight, a 10,400-token question on that document: A costs
2 + 400 / 20,000 = 2.02 s, B 10,400 / 20,000 = 0.52 s, under half of A's (the stay margin): B
wins, and now holds the document too (a hot prefix gained a second holder because its first was
the bottleneck). With 0.2 s queued on A instead, A costs 0.22 s and keeps it.

It is past 450 lines as one room for now: the prices and what is learnt from answers (prefill
speeds, the index's corrections, the KV tiers) read and write the same per-replica records
(`Held`) inside one pricing frame. Splitting the learning from the pricing is the next step once
the records have a module of their own.
"""

from __future__ import annotations

import math
import statistics
import time
from array import array
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import orjson

from router.config import RouterConfig, kv_capacities
from router.fleet import Fleet, ReplicaState
from router.kvevents.truth import Truth
from router.prefix import PRICE_GATED, PRICE_NEAR, PrefixIndex
from router.prompt import BYTES_PER_TOKEN, Prompt, prompt_of

DEFAULT_KV_TOKENS = 262_144  # a replica that says nothing of its KV cache: a mid-sized GPU's worth
RATIO_ALPHA = 0.05  # EWMA weight of one answer's bytes-per-token
SPEED_WINDOW = 16  # a replica's prefill speed is the median of its last this many samples ...
SPEED_PRIOR = 8  # ... weighed against the fleet's median as if that were this many samples more
SPEED_MIN_TOKENS = 512  # a sample computed at least this many tokens (else a step's fixed cost dominates)
SHRINK_FLOOR = 0.05  # an LRU never shrinks below this share of the engine's capacity
GROW = 1.02  # an exact prediction grows the LRU back by 2 %
RESET_AFTER = 2  # answers in a row that found nothing of a long predicted prefix: the cache was lost
RESET_MIN_BLOCKS = 8  # ... a prediction this long at least
SPREAD_WINDOW_S = 30.0  # recent traffic decays with this time constant
RECENT_RENORMALISE_S = 600.0  # recent traffic is kept in a frame that is moved this often
WAITING_REFRESH_S = 0.05  # the engines' probed queues are re-read at most this often
KV_NEAR = 0.9  # a replica whose requests in flight and one more fill this share of its KV cache is checked
REPLY_ALPHA = 0.05  # EWMA weight of one answer's reply length and reply time
FLEET_SPEED_EVERY = 32  # the fleet's median speed is taken again every this many answers (and at a first one)


@dataclass(slots=True)
class Held:
    """The router's view of one replica's cache and prefill queue."""

    holder: int  # its number in the index
    engine_blocks: int  # what its engine can hold, in blocks
    blocks: int  # what its LRU may hold now (shrunk by over-predictions)
    seconds_per_token: float  # prefill speed, learnt (until then: the fleet median, Placement.fleet_spt)
    samples: int = 0  # answers it was learnt from
    measured: deque[float] = field(default_factory=lambda: deque(maxlen=SPEED_WINDOW))  # their seconds per token
    own: float = 0.0  # the median of `measured`
    busy_until: float = 0.0  # when what was sent there is prefilled (monotonic seconds)
    recent: float = 0.0  # requests sent there, decaying with SPREAD_WINDOW_S (in Placement's frame)
    pos: int = 0  # its fleet position in the row arrays
    kv_tokens: float = 0.0  # tokens of the requests in flight there: their prompts and expected replies
    shift: float = 0.0  # seconds its queue was moved by first tokens that came later (or sooner) than modelled
    misses: int = 0  # answers in a row that found nothing of a long predicted prefix
    resets: int = 0
    models: frozenset[str] | None = None  # what it serves (None: unknown): its speed's prior is its peers'


@dataclass(slots=True)
class Candidate:
    """One replica's side of a decision, for the pick and for /admin/route."""

    index: int
    cached_tokens: float
    uncached_tokens: float
    wait_s: float
    cost_s: float
    spread_s: float = 0.0  # the part of the cost that is its recent traffic past the fleet's mean
    gated: bool = False
    evicts_s: float = 0.0  # ... and what it would evict there of conversations likely back soon
    source: str = "model"  # where its cached tokens come from: "events" (its engine's) or "model" (the router's)
    tier_tokens: float = 0.0  # ... of which its engine holds on a second tier (events only)

    @property
    def ttft_s(self) -> float:
        """Its predicted time to first token: the cost less what it charges for the turns after."""
        return self.cost_s - self.spread_s - self.evicts_s


class Priced:
    """One prompt priced on the fleet (`Placement.price`): every candidate's row, the cheapest under
    the gate, its near-ties and the conversation's home. A value: a later price makes another and
    leaves this one as it was, so a decision reads its own rows however many prices came since."""

    __slots__ = (
        "best", "cached", "candidates", "cost", "evicts", "flags", "holding", "known", "spread", "tier", "ties",
        "total", "wait",
    )  # fmt: skip

    def __init__(
        self,
        best: int,
        ties: int,
        holding: int,
        total: float,
        candidates: array[int],
        rows: tuple[array[float], array[float], array[float], array[float], array[int]],
        known: tuple[array[float], array[float]] | None = None,
        evicts: array[float] | None = None,
    ) -> None:
        self.best = best  # the cheapest position under the gate; -1: every candidate is past it; -2: none
        self.ties = ties  # how many candidates are within the tie margin of it
        self.holding = holding  # the candidate holding at least the home share of the prompt, else -1
        self.total = total  # the prompt's tokens, as priced
        self.candidates = candidates  # per position, 0 where it was priced
        self.cached, self.wait, self.cost, self.spread, self.flags = rows
        # by the engines' events: per position, the cached tokens they say (-1: nothing), and of those on a second tier
        self.known: array[float] | None = None if known is None else known[0]
        self.tier: array[float] | None = None if known is None else known[1]
        self.evicts = evicts  # per position, what it would evict there (None: nothing anywhere)

    def row(self, pos: int) -> Candidate:
        """The row of position `pos` (a candidate)."""
        cached = self.cached[pos]
        events = self.known is not None and self.known[pos] >= 0
        return Candidate(
            pos,
            cached,
            self.total - cached,
            self.wait[pos],
            self.cost[pos],
            self.spread[pos],
            bool(self.flags[pos] & PRICE_GATED),
            self.evicts[pos] if self.evicts is not None else 0.0,
            "events" if events else "model",
            self.tier[pos] if events and self.tier is not None else 0.0,
        )

    def rows(self) -> list[Candidate]:
        """Every candidate's row."""
        return [self.row(i) for i, x in enumerate(self.candidates) if not x]

    def near(self) -> list[int]:
        """The candidates within the tie margin of the cheapest."""
        flags = self.flags
        return [i for i, x in enumerate(self.candidates) if not x and flags[i] & PRICE_NEAR]

    def stays(self, home: int, best: int, share: float) -> bool:
        """`home` keeps the request from `best`: it is not past the gate, and `best` costs at least
        1 / (1 + share) of what it does."""
        return not self.flags[home] & PRICE_GATED and self.cost[home] <= self.cost[best] * (1 + share)

    def source(self, pos: int) -> str:
        """Where the cached tokens at `pos` came from: "events" or "model"."""
        return "events" if self.known is not None and pos < len(self.known) and self.known[pos] >= 0 else "model"


_NO_ROWS = (array("d"), array("d"), array("d"), array("d"), array("B"))  # a price with no candidate


@dataclass(slots=True)
class Placed:
    """What the router expected of a request it sent: kept on its route until the answer."""

    held: Held
    blocks: int  # blocks predicted cached there
    wait_tokens: float  # tokens of prefill it waited for (queue) at the time it was sent
    decode_s: float  # the decode share of its predicted wait
    tokens: float = 0.0  # its part of the replica's kv_tokens, until it is released
    due: float = 0.0  # when the model expected its first token (monotonic seconds)
    shift: float = 0.0  # the replica's queue corrections so far, when it was sent (Held.shift)
    predicted: float = 0.0  # the cached tokens the decision counted on there
    tier_tokens: float = 0.0  # ... of which its engine holds on a second tier (loaded back, not computed)
    source: str = "model"  # where that came from: "events" (its engine's) or "model" (the router's)
    coming: tuple[str, array[int]] | None = None  # (replica, its blocks) the events' truth expects there


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a decision counted on at the replica that answered, to check against its usage."""

    tokens: float  # cached tokens predicted
    source: str  # "events" or "model"


@dataclass(slots=True)
class Accuracy:
    """Predicted against reported cached tokens, over the answers that reported usage."""

    prompt_tokens: int = 0
    predicted_tokens: float = 0.0
    reported_tokens: int = 0
    over_tokens: float = 0.0
    under_tokens: float = 0.0
    answers: int = 0
    exact: int = 0  # answers whose cached tokens were predicted to the token


class Placement:
    def __init__(self, fleet: Fleet, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet = fleet
        self.clock = clock
        self.block_bytes = config.prefix_block_bytes
        self.decode_s = config.ttft_decode_s
        self.interference = config.ttft_interference
        self.spread_tokens = config.ttft_spread_tokens
        self.default_spt = 1.0 / config.prefill_tokens_per_s
        self.configured = kv_capacities(config)
        self.index = PrefixIndex()
        self.held: dict[str, Held] = {}
        # what the replicas that publish KV-cache events hold, as they say (router.kvfeed feeds it)
        self.truth = Truth(config.kv_tier_tokens_per_s)
        self.bytes_per_token = BYTES_PER_TOKEN  # before any usage says otherwise
        self.mean_uncached = 0.0  # tokens a request computes, on average (for queues of unknown requests)
        self.accuracy = Accuracy()  # of the decisions that read the model
        self.events_accuracy = Accuracy()  # ... and of those that read a replica's engine's events
        self.fleet_spt = self.default_spt  # the median of the learnt speeds: a replica's until it has its own
        # ... and of those serving the same models (a 70B's replicas prefill slower than an 8B's)
        self.model_spt: dict[frozenset[str] | None, float] = {}
        self._speed_answers = 0
        self._peers_changed = False  # some replica's models changed since the priors were taken
        # told of every prompt that added blocks to the index (routers on one Redis share them)
        self.share: Callable[[str, array[int]], None] | None = None
        self.gate_c = config.ttft_gate_c
        self.floor = config.bounded_load_floor
        self.tie_s = config.ttft_tie_s
        self.tie_share = config.ttft_tie_share
        self.adapter_load_s = config.adapter_load_s
        self.kv_wait = config.ttft_kv_wait
        self.queue_gain = config.ttft_queue_gain
        self.mean_prompt = 0.0  # tokens a prompt has, on average
        self.mean_output = 0.0  # ... and a reply (what a request will add to a KV cache)
        self.reply_s: float | None = None  # seconds from a reply's first token to its last, on average
        # replicas whose requests in flight (nearly) fill their KV cache, by holder (`_kv_mark`)
        self._kv_full: dict[int, Held] = {}
        # the row arrays of a decision, by fleet position (`_layout`), and what they are for
        self._layout_for = -1
        self._helds: list[Held] = []
        self._holders = array("i")
        self._busy = self._spt = self._recent = self._waiting = array("d")
        self._routable = array("B")
        self._zeros = array("d")  # n zeros: the rows a price fills start as copies of it
        self._caps = array("q")
        self._uniform_cap: tuple[int, int] | None = None
        self._routable_for: object = None
        self._waiting_at = -math.inf
        # recent traffic x exp((ref - now) / SPREAD_WINDOW_S) is what it is now (`_frame`)
        self._recent_ref: float | None = None

    # -- the replicas' state ----------------------------------------------------------------------

    def engine_blocks(self, replica: ReplicaState) -> int:
        tokens = replica.engine.kv_tokens
        if tokens is None:
            tokens = self.configured.get(replica.id, self.configured.get("*", DEFAULT_KV_TOKENS))
        return max(1, int(tokens * self.bytes_per_token) // self.block_bytes)

    def of(self, replica: ReplicaState) -> Held:
        """Its state, made on first use (and kept in step with what its engine says it holds)."""
        held = self.held.get(replica.id)
        engine = self.engine_blocks(replica)
        if held is None:
            self._forget_gone()
            spt = self.model_spt.get(replica.models, self.fleet_spt)
            held = Held(self.index.add_holder(engine), engine, engine, spt, models=replica.models)
            self.held[replica.id] = held
            self._layout_for = -1  # the row arrays lack it
        elif abs(engine - held.engine_blocks) > held.engine_blocks // 100:  # another size (or token ratio)
            held.blocks = max(1, round(held.blocks * engine / held.engine_blocks))
            held.engine_blocks = engine
            self.index.set_capacity(held.holder, held.blocks)
        return held

    def _forget_gone(self) -> None:
        present = {r.id for r in self.fleet.replicas}
        for rid in [rid for rid in self.held if rid not in present]:
            self.index.remove_holder(self.held.pop(rid).holder)
            self.truth.forget(rid)

    def forget(self, replica_id: str) -> None:
        held = self.held.pop(replica_id, None)
        if held is not None:
            self.index.remove_holder(held.holder)
        self.truth.forget(replica_id)

    # -- a decision ------------------------------------------------------------------------------

    def _layout(self) -> None:
        """The row arrays, by fleet position, rebuilt when the fleet's membership changed."""
        fleet = self.fleet
        if self._layout_for == fleet.version and len(self._holders) == len(fleet.replicas):
            return
        replicas = fleet.replicas
        helds = [self.held.get(r.id) or self.of(r) for r in replicas]
        n = len(replicas)
        for pos, held in enumerate(helds):
            held.pos = pos
        self._holders = array("i", [h.holder for h in helds])
        self._busy = array("d", [h.busy_until for h in helds])
        self._spt = array("d", [h.seconds_per_token for h in helds])
        self._recent = array("d", [h.recent for h in helds])
        self._waiting = array("d", [-1.0] * n)
        self._waiting_at = -math.inf
        self._zeros = array("d", [0.0]) * n
        self._routable_for = None
        self._helds = helds
        self._layout_for = fleet.version

    def set_busy(self, held: Held, value: float) -> None:
        """When what was sent to `held` is prefilled (kept in its row too)."""
        held.busy_until = value
        if held.pos < len(self._busy) and self._helds[held.pos] is held:
            self._busy[held.pos] = value

    def set_spt(self, held: Held, value: float) -> None:
        """Its prefill speed, in seconds per token (kept in its row too)."""
        held.seconds_per_token = value
        if held.pos < len(self._spt) and self._helds[held.pos] is held:
            self._spt[held.pos] = value

    def price(
        self,
        prompt: Prompt,
        exclude: Collection[int],
        last: int | None,
        now: float,
        home_share: float = -1.0,
        cold: frozenset[int] = frozenset(),
    ) -> Priced:
        """Price `prompt` on every routable position not in `exclude` (and on `last`, the position of
        the keyed session's replica, even while it drains), in the compiled core (router.prefix):
        every candidate's row, the cheapest under the gate (`best`: -1 when every candidate is past
        it, -2 when there is no candidate), how many are within the tie margin of it, and with
        `home_share` >= 0 the candidate holding the most of the prompt if that is at least that
        share of it (`holding`, else -1). `cold`: positions that must load the request's LoRA
        adapter first (router.fleet.Fleet.adapter_cold): their prefill starts `adapter_load_s`
        later, except on `last`, which holds the session whatever the engine says."""
        self._layout()
        fleet = self.fleet
        n = len(self._holders)
        if now - self._waiting_at > WAITING_REFRESH_S:  # probes come every few seconds
            for i, r in enumerate(fleet.replicas):
                w = r.engine.waiting
                self._waiting[i] = -1.0 if w is None else w
            self._waiting_at = now
        snapshot = fleet.ring.current
        if self._routable_for is not snapshot:
            self._routable = array("B", [0 if fleet.routable(i) else 1 for i in range(n)])
            self._routable_for = snapshot
        excluded = self._routable
        if exclude or (last is not None and excluded[last]):
            excluded = array("B", excluded)
            for i in exclude:
                excluded[i] = 1
            if last is not None:
                excluded[last] = 0
        if not excluded.count(0):
            return Priced(-2, 0, -1, 0.0, excluded, _NO_ROWS)
        limit = fleet.load_limit(self.gate(), self.floor)
        if isinstance(limit, int):
            if self._uniform_cap != (limit, n):
                self._caps = array("q", [limit]) * n
                self._uniform_cap = (limit, n)
        else:
            self._caps = array("q", [limit.of(i) for i in range(n)])
            self._uniform_cap = None
        ref = self._frame(now)
        ratio = self.bytes_per_token
        total = prompt.nbytes / ratio
        truth = self._known_of(prompt, excluded, now) if prompt.tokens is not None and self.truth else None
        known = evicts = None
        if truth is not None:
            known, _, evicts = truth
            total = float(prompt.tokens.count)  # type: ignore[union-attr]
        # the kernel counts a prefill's interference (it delays every request running there) and,
        # for a keyed session's replica, credits it with whatever of this prompt any replica holds
        busy = self._busy
        if self._kv_full and self.kv_wait:
            busy = self._kv_bound(busy, now, total + self.mean_output)
        if cold and self.adapter_load_s > 0:
            busy = array("d", busy)
            for i in cold:
                if i != last and i < n:
                    busy[i] = max(busy[i], now) + self.adapter_load_s
        zeros = self._zeros
        rows = (array("d", zeros), array("d", zeros), array("d", zeros), array("d", zeros), array("B", bytes(n)))
        cached, wait, cost, spread, flags = rows
        best, ties, holding = self.index.price(
            prompt.chain,
            self._holders,
            busy,
            self._spt,
            fleet.loads,
            self._waiting,
            self._caps,
            excluded,
            now,
            self.decode_s,
            self.mean_uncached,
            self.block_bytes / ratio,
            total,
            -1 if last is None else last,
            prompt.history_blocks,
            self.tie_s,
            self.tie_share,
            cached,
            wait,
            cost,
            flags,
            recent=self._recent,
            recent_scale=math.exp((ref - now) / SPREAD_WINDOW_S),
            spread_tokens=self.spread_tokens,
            spread_out=spread,
            interference=self.interference,
            history_from_all=last is not None,
            home_share=home_share,
            known=known,
            spread_whole=prompt.opening,
            evicts=evicts,
        )
        return Priced(best, ties, holding, total, excluded, rows, None if truth is None else truth[:2], evicts)

    def _known_of(
        self, prompt: Prompt, excluded: array[int], now: float
    ) -> tuple[array[float], array[float], array[float] | None] | None:
        """Per position, the cached tokens its engine's events say it holds (a second tier's
        credited at its speed), -1 where they say nothing or are not believed; and of those, the
        tokens its engine holds on a second tier; and what the blocks it would allocate there evict
        of the conversations likely to come back costs them (router.kvevents.truth.Truth.evicts) at
        its prefill speed (None where it evicts nothing anywhere). None when no candidate's events
        say anything."""
        tokens = prompt.tokens
        assert tokens is not None
        truth = self.truth
        n = len(excluded)
        known = array("d", [-1.0]) * n
        tier, evicts = array("d", self._zeros), array("d", self._zeros)
        matches: dict[int, array[int]] = {}  # by block size: what every holder keeps of its chain
        # by block size: the prompt's chain and the blocks it allocates besides those held (its reply's)
        sized: dict[int, tuple[array[int], int]] = {}
        used = evicting = False
        returning = truth.returning
        for i, r in enumerate(self.fleet.replicas):
            if excluded[i] or r.id not in truth.replicas:
                continue
            if r.state == "removed":
                truth.suspect(r.id)  # its health went down: the next message says whether it restarted
                continue
            size = r.engine.block_size
            found = truth.held(r.id, tokens, matches, int(size) if size else None)
            if found is not None:
                known[i] = truth.credit(found, self._spt[i])
                tier[i] = found.tier_tokens
                used = True
                b = found.block_size
                if b and r.id in returning:
                    at_size = sized.get(b)
                    if at_size is None:
                        chain = tokens.chain(b)
                        at_size = sized[b] = (chain, len(chain) + math.ceil(self.mean_output / b))
                    # it allocates its prompt's blocks not held there, and its reply's
                    lost = truth.evicts(r.id, at_size[0], at_size[1] - found.gpu_tokens // b, now)
                    if lost > 0:
                        evicts[i] = lost * b * self._spt[i]
                        evicting = True
        if not used:
            return None
        return known, tier, evicts if evicting else None

    def history_tokens(self, prompt: Prompt) -> float:
        """The tokens of `prompt`'s messages before its last (as the price counts them)."""
        return prompt.history_blocks * self.block_bytes / self.bytes_per_token

    def gate(self) -> int:
        """The gate's in-flight cap (before any replica's capacity caps it): ttft_gate_c times the
        fleet's mean, and never within bounded_load_floor of the mean. The slack is absolute: when a
        surge loads every replica, a relative margin alone would spill sessions off their caches
        over a difference of a few requests, and each spill recomputes a whole history on a fleet
        that has no time to spare."""
        ring, loads = self.fleet.ring, self.fleet.loads
        return max(ring.load_cap(loads, self.gate_c), ring.load_cap(loads, 1.0) + self.floor)

    def candidates(self, prompt: Prompt, indices: Collection[int], last: int | None, now: float) -> list[Candidate]:
        """The rows of pricing `prompt` on the positions `indices` alone."""
        keep = set(indices)
        priced = self.price(prompt, [i for i in range(len(self.fleet)) if i not in keep], last, now)
        return [c for c in priced.rows() if c.index in keep]

    def sent(self, replica: ReplicaState, prompt: Prompt, candidate: Candidate, now: float) -> Placed:
        """`prompt` goes to `replica` (its `candidate` row): its prefill joins the queue there, and
        the index holds its blocks there from now on. A request close behind it (the next turn of a
        conversation sent before this one is answered, another reader of the same document) finds
        them there, not wherever it would go if the first one's answer had to come first: under
        load that answer is seconds away."""
        held = self.of(replica)
        held.recent += math.exp((now - self._frame(now)) / SPREAD_WINDOW_S)  # one request, now
        if held.pos < len(self._recent) and self._helds[held.pos] is held:
            self._recent[held.pos] = held.recent
        start = max(now, held.busy_until)
        wait_tokens = (start - now) / held.seconds_per_token
        done = start + candidate.uncached_tokens * held.seconds_per_token
        self.set_busy(held, done)
        blocks = round(candidate.cached_tokens * self.bytes_per_token / self.block_bytes)
        if self.index.insert(held.holder, prompt.chain) and self.share is not None:
            self.share(replica.id, prompt.chain)
        tokens = prompt.nbytes / self.bytes_per_token + self.mean_output
        held.kv_tokens += tokens
        self._kv_mark(held)
        decode_s = candidate.wait_s - (start - now)
        coming = None
        if prompt.tokens is not None and replica.id in self.truth.replicas:
            size = self.truth.block_size(replica.id) or replica.engine.block_size
            if size:
                size = int(size)
                coming = (replica.id, prompt.tokens.chain(size))
                # it allocates its prompt's blocks not held there, and its reply's
                allocates = len(coming[1]) - int(candidate.cached_tokens) // size + math.ceil(self.mean_output / size)
                self.truth.expect(*coming, allocates)
        return Placed(
            held,
            blocks,
            wait_tokens,
            decode_s,
            tokens,
            done + max(decode_s, 0.0),
            held.shift,
            predicted=candidate.cached_tokens,
            tier_tokens=candidate.tier_tokens,
            source=candidate.source,
            coming=coming,
        )

    def failed(self, replica: ReplicaState, prompt: Prompt, placed: Placed) -> None:
        """The attempt `placed` on `replica` failed before its first byte: it computed nothing of
        the prompt past what it held already, and holds none of it in flight."""
        self._arrived(placed)
        if self.held.get(replica.id) is placed.held:
            self.index.truncate(placed.held.holder, prompt.chain, placed.blocks)
            self._unload(placed)

    def released(self, replica: ReplicaState, now: float, placed: Placed | None = None) -> None:
        """An attempt there ended (`placed`: what it expected there, if it was priced): its tokens
        leave the replica's KV cache; with nothing left in flight, nothing is queued either."""
        if placed is not None:
            if placed.coming is not None:  # its conversation may come back for what it left there
                self.truth.ended(*placed.coming, now)
            self._arrived(placed)
        held = self.held.get(replica.id)
        if held is None:
            return
        if placed is not None and placed.held is held:
            self._unload(placed)
        if replica.inflight <= 0:
            if held.kv_tokens:
                held.kv_tokens = 0.0
                self._kv_mark(held)
            if held.busy_until > now:
                self.set_busy(held, now)

    def _unload(self, placed: Placed) -> None:
        held = placed.held
        held.kv_tokens = max(0.0, held.kv_tokens - placed.tokens)
        placed.tokens = 0.0
        self._kv_mark(held)

    def _arrived(self, placed: Placed) -> None:
        """Its attempt ended: what its engine holds of it is what the events say from now on."""
        if placed.coming is not None:
            self.truth.unexpect(*placed.coming)
            placed.coming = None

    # -- KV-bound queues ---------------------------------------------------------------------------

    def kv_capacity(self, held: Held) -> float:
        """Tokens its KV cache holds (its engine's figure, else the configured one: `of`)."""
        return held.engine_blocks * self.block_bytes / self.bytes_per_token

    def _kv_mark(self, held: Held) -> None:
        """Keep `held` among the replicas `_kv_bound` looks at while its requests in flight and one
        more of the usual size would not fit its KV cache."""
        if held.kv_tokens + self.mean_request_tokens() > self.kv_capacity(held) * KV_NEAR:
            self._kv_full[held.holder] = held
        else:
            self._kv_full.pop(held.holder, None)

    def mean_request_tokens(self) -> float:
        return self.mean_prompt + self.mean_output

    def kv_wait_s(self, held: Held, request_tokens: float) -> float:
        """How long a request of `request_tokens` (prompt and reply) waits at `held` for room in
        its KV cache: an engine admits a request only once its blocks fit, so past the capacity C
        the queue drains as running requests finish, C tokens every reply time (the fleet's mean
        time from a reply's first token to its last). 0 while they fit, or before any reply was timed."""
        if not self.kv_wait or self.reply_s is None:
            return 0.0
        capacity = self.kv_capacity(held)
        over = held.kv_tokens + request_tokens - capacity
        return over / capacity * self.reply_s if over > 0 else 0.0

    def _kv_bound(self, busy: array[float], now: float, request_tokens: float) -> array[float]:
        """`busy` with each KV-bound replica's prefill queue drained no sooner than its KV wait."""
        out = busy
        helds = self._helds
        for held in self._kv_full.values():
            pos = held.pos
            if pos >= len(helds) or helds[pos] is not held:
                continue
            wait = self.kv_wait_s(held, request_tokens)
            if wait > 0 and now + wait > out[pos]:
                if out is busy:
                    out = array("d", busy)
                out[pos] = now + wait
        return out

    # -- an answer -------------------------------------------------------------------------------

    def answered(
        self,
        replica: ReplicaState,
        prompt: Prompt,
        placed: Placed | None,
        prompt_tokens: int,
        cached_tokens: int,
        ttft_s: float | None,
        completion_tokens: int = 0,
        reply_s: float | None = None,
        first_token_at: float | None = None,
    ) -> Prediction | None:
        """`replica` answered `prompt`: it holds the prompt's blocks now; what it reported (tokens,
        cached tokens, time to first token when streamed; the reply's tokens and the seconds from
        its first to its last; when its first token came, on the placement's clock) corrects the
        model. Returns the cached tokens the decision counted on, and whence, when the answer
        reported usage to check them against."""
        held = self.of(replica)
        if self.index.insert(held.holder, prompt.chain) and self.share is not None:
            self.share(replica.id, prompt.chain)
        if completion_tokens > 0:  # (the first answer sets it: it is a length, no prior fits every fleet)
            self.mean_output += (REPLY_ALPHA if self.mean_output else 1.0) * (completion_tokens - self.mean_output)
        if reply_s is not None and math.isfinite(reply_s) and reply_s > 0:
            self.reply_s = reply_s if self.reply_s is None else self.reply_s + REPLY_ALPHA * (reply_s - self.reply_s)
        if first_token_at is not None and placed is not None and placed.held is held and placed.due:
            self._lagged(replica, held, first_token_at - placed.due - (held.shift - placed.shift))
        if prompt_tokens <= 0:
            return None
        self.mean_prompt += (REPLY_ALPHA if self.mean_prompt else 1.0) * (prompt_tokens - self.mean_prompt)
        ratio = prompt.nbytes / prompt_tokens
        if 0.5 <= ratio <= 64:  # a tokenizer's plausible range; anything else is someone's odd count
            self.bytes_per_token += RATIO_ALPHA * (ratio - self.bytes_per_token)
        uncached = max(prompt_tokens - cached_tokens, 0)
        self.mean_uncached += 0.1 * (uncached - self.mean_uncached)
        computed = (placed.wait_tokens if placed is not None else 0.0) + uncached
        if held.models != replica.models:  # its models were read (or changed) since: its peers are others
            held.models = replica.models
            self._peers_changed = True  # the priors are taken again at the next sample
        if ttft_s is not None and placed is not None and computed >= SPEED_MIN_TOKENS:
            sample = max(ttft_s - max(placed.decode_s, 0.0), 0.0) / computed
            if math.isfinite(sample) and sample > 0:
                held.measured.append(sample)
                held.own = statistics.median(held.measured)
                held.samples += 1
                self._speed_answers += 1
                if held.samples == 1 or self._peers_changed or self._speed_answers % FLEET_SPEED_EVERY == 0:
                    self._fleet_speed()
                else:
                    self.set_spt(held, self._speed_of(held))
        if placed is None:
            return None
        if placed.tier_tokens > 0 and ttft_s is not None and cached_tokens > 0:
            # it loaded tier_tokens back from a second tier: what its first token took past the
            # prefill of what it computed is that transfer
            computed_s = max(prompt_tokens - cached_tokens, 0) * held.seconds_per_token
            spent = ttft_s - max(placed.decode_s, 0.0) - computed_s - placed.wait_tokens * held.seconds_per_token
            self.truth.learn_tier(spent / placed.tier_tokens)
        modelled = min(placed.blocks * self.block_bytes / self.bytes_per_token, prompt_tokens)
        self._correct(held, prompt, placed.blocks, modelled, prompt_tokens, cached_tokens)  # the model learns always
        if placed.source == "events":
            predicted = min(placed.predicted, prompt_tokens)
            self._account(self.events_accuracy, predicted, prompt_tokens, cached_tokens)
            return Prediction(predicted, "events")
        self._account(self.accuracy, modelled, prompt_tokens, cached_tokens)
        return Prediction(modelled, "model")

    @staticmethod
    def _account(a: Accuracy, predicted: float, prompt_tokens: int, cached: int) -> None:
        a.answers += 1
        a.prompt_tokens += prompt_tokens
        a.predicted_tokens += predicted
        a.reported_tokens += cached
        error = predicted - cached
        if error > 0:
            a.over_tokens += error
        else:
            a.under_tokens -= error
        if abs(error) < 0.5:
            a.exact += 1

    def _lagged(self, replica: ReplicaState, held: Held, lag: float) -> None:
        """A first token came `lag` seconds after the model said (less what the queue there was
        moved by since it was sent): the queue is that much longer than modelled, or shorter if
        negative, and the requests still in flight there wait with it. Its drain time moves by
        `ttft_queue_gain` of that. Unlike a prefill speed learnt under load, this moves only the queue
        there now: it drains away with it, and cannot keep a replica looking slow."""
        gain = self.queue_gain
        if not gain or not math.isfinite(lag) or lag == 0:
            return
        now = self.clock()
        if lag > 0:
            if replica.inflight <= 0:
                return  # nothing is behind it
            moved = max(held.busy_until, now) + gain * lag
        elif held.busy_until > now:
            moved = max(now, held.busy_until + gain * lag)
        else:
            return
        held.shift += gain * lag
        self.set_busy(held, moved)

    def _speed_of(self, held: Held) -> float:
        """Its seconds per token for routing: its own median, weighed against its peers' median
        (the replicas serving the same models; the fleet's where none of those is measured yet) as
        if that were SPEED_PRIOR samples more. Replicas of one model on one kind of GPU prefill
        alike, and a few samples (a step's fixed cost, a neighbour's chunk in the batch, a loaded
        host) must not make one look fast or slow for long: a replica that is, says so in every
        sample, and its own median outweighs the prior twice over once its window is full."""
        prior = self.model_spt.get(held.models, self.fleet_spt)
        n = len(held.measured)
        if not n:
            return prior
        return (n * held.own + SPEED_PRIOR * prior) / (n + SPEED_PRIOR)

    def _fleet_speed(self) -> None:
        measured = [h for h in self.held.values() if h.measured]
        learnt = sorted(h.own for h in measured)
        self.fleet_spt = learnt[len(learnt) // 2]
        peers: dict[frozenset[str] | None, list[float]] = {}
        for h in measured:
            peers.setdefault(h.models, []).append(h.own)
        self.model_spt = {models: sorted(own)[len(own) // 2] for models, own in peers.items()}
        self._peers_changed = False
        for h in self.held.values():  # those not measured yet: as fast as their peers' median, not the prior
            self.set_spt(h, self._speed_of(h))

    def _frame(self, now: float) -> float:
        """The time recent traffic is kept relative to, moved to `now` every RECENT_RENORMALISE_S
        (so its numbers stay finite)."""
        ref = self._recent_ref
        if ref is not None and abs(now - ref) <= RECENT_RENORMALISE_S:
            return ref
        factor = 0.0 if ref is None else math.exp((ref - now) / SPREAD_WINDOW_S)
        for h in self.held.values():
            h.recent *= factor
        for i in range(len(self._recent)):
            self._recent[i] *= factor
        self._recent_ref = now
        return now

    def _correct(
        self, held: Held, prompt: Prompt, predicted_blocks: int, predicted: float, prompt_tokens: int, cached: int
    ) -> None:
        block_tokens = self.block_bytes / self.bytes_per_token
        error = predicted - cached
        held_blocks = int(cached / block_tokens)
        if error <= block_tokens:  # right within a block (or it held more: a reply, another router)
            held.misses = 0
            if held.blocks < held.engine_blocks:
                held.blocks = min(held.engine_blocks, math.ceil(held.blocks * GROW))
                self.index.set_capacity(held.holder, held.blocks)
            return
        if predicted_blocks >= RESET_MIN_BLOCKS and cached < block_tokens:
            held.misses += 1
            if held.misses >= RESET_AFTER:  # it restarted, or its cache was cleared
                self.index.clear(held.holder)
                held.blocks = held.engine_blocks
                self.index.set_capacity(held.holder, held.blocks)
                held.misses = 0
                held.resets += 1
                return
        else:
            held.misses = 0
        self.index.truncate(held.holder, prompt.chain, held_blocks)
        share = error / max(predicted, 1.0)  # how far off, as a share of the prediction
        floor = max(1, int(held.engine_blocks * SHRINK_FLOOR))
        held.blocks = max(floor, int(held.blocks * (1 - share / 4)))
        self.index.set_capacity(held.holder, held.blocks)

    def learned(self, replica_id: str, chain: array[int]) -> None:
        """Another router placed this prompt on `replica_id` (router.redis_state.RedisPlacements)."""
        replica = self.fleet.find(replica_id)
        if replica is not None and replica.index is not None:
            self.index.insert(self.of(replica).holder, chain)

    def warmed(self, replica: ReplicaState, body: bytes) -> None:
        """A warm-up computed this request body on `replica` (before sessions move there)."""
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if isinstance(parsed, dict) and (prompt := prompt_of(parsed, self.block_bytes)) is not None:
            self.index.insert(self.of(replica).holder, prompt.chain)

    # -- figures ---------------------------------------------------------------------------------

    def blocks_held(self, replica_id: str) -> int:
        held = self.held.get(replica_id)
        return 0 if held is None else self.index.size(held.holder)

    def figures(self) -> dict[str, object]:
        """The index's size and how right its predictions were: over every answer, and by source."""
        model, events = self.accuracy, self.events_accuracy
        both = Accuracy(
            model.prompt_tokens + events.prompt_tokens,
            model.predicted_tokens + events.predicted_tokens,
            model.reported_tokens + events.reported_tokens,
            model.over_tokens + events.over_tokens,
            model.under_tokens + events.under_tokens,
            model.answers + events.answers,
            model.exact + events.exact,
        )
        return {
            "index_blocks": self.index.total(),
            "index_bytes": self.index.memory_bytes(),
            "events_blocks": self.truth.index.total(),
            "events_bytes": self.truth.index.memory_bytes(),
            "bytes_per_token": round(self.bytes_per_token, 3),
            **_accuracy_figures(both),
            "by_source": {"model": _accuracy_figures(model), "events": _accuracy_figures(events)},
        }


def _accuracy_figures(a: Accuracy) -> dict[str, float | int | None]:
    return {
        "predicted_hit_rate": a.predicted_tokens / a.prompt_tokens if a.prompt_tokens else None,
        "reported_hit_rate": a.reported_tokens / a.prompt_tokens if a.prompt_tokens else None,
        "prediction_error": (a.over_tokens + a.under_tokens) / a.prompt_tokens if a.prompt_tokens else None,
        "exact_share": a.exact / a.answers if a.answers else None,
        "answers": a.answers,
    }


__all__ = ["Accuracy", "Candidate", "Held", "Placed", "Placement", "Prediction", "Priced"]
