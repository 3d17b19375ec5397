"""The placement: the replicas' records and rows, a price for every decision, and a request's life on the model.

router.placement (the package) has the model and its parts.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Collection

import orjson

from router.config import kv_capacities
from router.config.groups import PlacementSettings
from router.fleet import Fleet, ReplicaState
from router.kvevents.truth import Truth
from router.placement.events import Layout, events_rows
from router.placement.kv_room import KvRoom
from router.placement.learnt import Learnt
from router.placement.priced import NO_ROWS, Candidate, Priced
from router.placement.records import Answer, Held, Placed, Prediction, accuracy_figures
from router.placement.rows import Rows
from router.prefix import PrefixIndex
from router.prompt import Prompt, prompt_of

DEFAULT_KV_TOKENS = 262_144  # a replica that says nothing of its KV cache: a mid-sized GPU's worth
SPREAD_WINDOW_S = 30.0  # recent traffic decays with this time constant
RECENT_RENORMALISE_S = 600.0  # recent traffic is kept in a frame that is moved this often


class Placement:
    """One record per replica (`Held`) and its row; `price` prices a prompt on every candidate in
    the compiled core; a request sent (`sent`) joins the queue there and its blocks the index, and
    fails before its first byte (`failed`) or ends (`released`); its answer teaches the model
    (`answered`: router.placement.learnt)."""

    def __init__(
        self,
        fleet: Fleet,
        config: PlacementSettings,
        floor: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`floor`: the ring's bounded-load floor (`bounded_load_floor`), which the gate keeps too."""
        self.fleet = fleet
        self.clock = clock
        self.block_bytes = config.prefix_block_bytes
        self.decode_s = config.ttft_decode_s
        self.interference = config.ttft_interference
        self.spread_tokens = config.ttft_spread_tokens
        self.configured = kv_capacities(config)
        self.index = PrefixIndex()
        self.held: dict[str, Held] = {}
        # what the replicas that publish KV-cache events hold, as they say (router.engines.kvfeed feeds it)
        self.truth = Truth(config.kv_tier_tokens_per_s)
        self.layout = Layout()  # how events_rows reads the fleet (most replicas in one pass)
        self.rows = Rows()
        self.learnt = Learnt(
            self.held,
            self.rows,
            self.index,
            self.truth,
            self.block_bytes,
            1.0 / config.prefill_tokens_per_s,
            config.ttft_queue_gain,
        )
        self.kv = KvRoom(self.learnt, self.rows, self.block_bytes, config.ttft_kv_wait)
        # told of every prompt that added blocks to the index (routers on one Redis share them)
        self.share: Callable[[str, array[int]], None] | None = None
        self.gate_c = config.ttft_gate_c
        self.floor = floor
        self.tie_s = config.ttft_tie_s
        self.tie_share = config.ttft_tie_share
        self.adapter_load_s = config.adapter_load_s
        # recent traffic x exp((ref - now) / SPREAD_WINDOW_S) is what it is now (`_frame`)
        self._recent_ref: float | None = None

    @property
    def bytes_per_token(self) -> float:
        """The prompts' bytes per token, as the answers' usage says (router.placement.learnt)."""
        return self.learnt.bytes_per_token

    # -- the replicas' state ----------------------------------------------------------------------

    def engine_blocks(self, replica: ReplicaState) -> int:
        tokens = replica.engine.kv_tokens
        if tokens is None:
            tokens = self.configured.get(replica.id, self.configured.get("*", DEFAULT_KV_TOKENS))
        return max(1, int(tokens * self.learnt.bytes_per_token) // self.block_bytes)

    def of(self, replica: ReplicaState) -> Held:
        """Its state, made on first use (and kept in step with what its engine says it holds)."""
        held = self.held.get(replica.id)
        engine = self.engine_blocks(replica)
        if held is None:
            self._forget_gone()
            spt = self.learnt.prior(replica.models)
            held = Held(self.index.add_holder(engine), engine, engine, spt, models=replica.models)
            self.held[replica.id] = held
            self.rows.version = -1  # the rows lack it
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

    def set_busy(self, held: Held, value: float) -> None:
        """When what was sent to `held` is prefilled (kept in its row too)."""
        self.rows.set_busy(held, value)

    # -- a decision ------------------------------------------------------------------------------

    def price(
        self,
        prompt: Prompt,
        exclude: Collection[int],
        last: int | None,
        now: float,
        home_share: float = -1.0,
        cold: frozenset[int] = frozenset(),
        every_row: bool = False,
    ) -> Priced:
        """Price `prompt` on every routable position not in `exclude` (and on `last`, the position of
        the keyed session's replica, even while it drains), in the compiled core (router.prefix):
        every candidate's row, the cheapest under the gate (`best`: -1 when every candidate is past
        it, -2 when there is no candidate), how many are within the tie margin of it, and with
        `home_share` >= 0 the candidate holding the most of the prompt if that is at least that
        share of it (`holding`, else -1). `cold`: positions that must load the request's LoRA
        adapter first (router.fleet.Fleet.adapter_cold): their prefill starts `adapter_load_s`
        later, except on `last`, which holds the session whatever the engine says.

        Where the engines' events say what a request would evict of conversations likely back
        (router.placement.events.Evicting), that is priced where the decision may read it: the
        candidates that could be the cheapest or tie with it, `last`, and `holding` (a second
        call of the compiled price with it). Every row gets it with `every_row` (/admin/route);
        the others read 0.0 there, and the decision is the same either way."""
        fleet, rows, learnt = self.fleet, self.rows, self.learnt
        if not rows.current(fleet):
            rows.lay([self.held.get(r.id) or self.of(r) for r in fleet.replicas], fleet.version)
        n = len(rows.holders)
        rows.refresh_waiting(fleet, now)
        excluded = rows.unroutable(fleet)
        if exclude or (last is not None and excluded[last]):
            excluded = array("B", excluded)
            for i in exclude:
                excluded[i] = 1
            if last is not None:
                excluded[last] = 0
        if not excluded.count(0):
            return Priced(-2, 0, -1, 0.0, excluded, NO_ROWS)
        caps = rows.caps(fleet.load_limit(self.gate(), self.floor))
        ref = self._frame(now)
        ratio = learnt.bytes_per_token
        total = prompt.nbytes / ratio
        truth = None
        if prompt.tokens is not None and self.truth:
            truth = events_rows(
                fleet, self.truth, prompt, excluded, rows.spt, rows.zeros, learnt.mean_output, now, self.layout
            )
        known = evicting = None
        if truth is not None:
            known, _, evicting = truth
            total = float(prompt.tokens.count)  # type: ignore[union-attr]
        # the kernel counts a prefill's interference (it delays every request running there) and,
        # for a keyed session's replica, credits it with whatever of this prompt any replica holds
        busy = self.kv.bound(rows.busy, now, total + learnt.mean_output)
        if cold and self.adapter_load_s > 0:
            busy = array("d", busy)
            for i in cold:
                if i != last and i < n:
                    busy[i] = max(busy[i], now) + self.adapter_load_s
        zeros = rows.zeros
        out = (zeros[:], zeros[:], zeros[:], zeros[:], rows.no_flags[:])
        cost, flags = out[2], out[4]
        evicts = None if evicting is None or not every_row else evicting.every()
        best, ties, holding = self._price(
            prompt, busy, caps, excluded, now, total, last, home_share, ref, known, out, evicts
        )
        if evicting is not None and not every_row:
            # what a request would evict there is asked only where it may change the decision
            evicts = evicting.bound(
                cost, flags, best, (-1 if last is None else last, holding), self.tie_s, self.tie_share
            )
            if evicts is not None:
                out[4][:] = rows.no_flags  # (the price marks its candidates afresh)
                best, ties, holding = self._price(
                    prompt, busy, caps, excluded, now, total, last, home_share, ref, known, out, evicts
                )
        return Priced(best, ties, holding, total, excluded, out, None if truth is None else truth[:2], evicts)

    def _price(
        self,
        prompt: Prompt,
        busy: array[float],
        caps: array[int],
        excluded: array[int],
        now: float,
        total: float,
        last: int | None,
        home_share: float,
        ref: float,
        known: array[float] | None,
        out: tuple[array[float], array[float], array[float], array[float], array[int]],
        evicts: array[float] | None,
    ) -> tuple[int, int, int]:
        """One call of the compiled price (`price`'s arguments; the rows into `out`)."""
        rows, learnt = self.rows, self.learnt
        cached, wait, cost, spread, flags = out
        return self.index.price(
            prompt.chain,
            rows.holders,
            busy,
            rows.spt,
            self.fleet.loads,
            rows.waiting,
            caps,
            excluded,
            now,
            self.decode_s,
            learnt.mean_uncached,
            self.block_bytes / learnt.bytes_per_token,
            total,
            -1 if last is None else last,
            prompt.history_blocks,
            self.tie_s,
            self.tie_share,
            cached,
            wait,
            cost,
            flags,
            recent=rows.recent,
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

    def history_tokens(self, prompt: Prompt) -> float:
        """The tokens of `prompt`'s messages before its last (as the price counts them)."""
        return prompt.history_blocks * self.block_bytes / self.learnt.bytes_per_token

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
        priced = self.price(prompt, [i for i in range(len(self.fleet)) if i not in keep], last, now, every_row=True)
        return [c for c in priced.rows() if c.index in keep]

    def _frame(self, now: float) -> float:
        """The time recent traffic is kept relative to, moved to `now` every RECENT_RENORMALISE_S
        (so its numbers stay finite)."""
        ref = self._recent_ref
        if ref is not None and abs(now - ref) <= RECENT_RENORMALISE_S:
            return ref
        factor = 0.0 if ref is None else math.exp((ref - now) / SPREAD_WINDOW_S)
        for h in self.held.values():
            h.recent *= factor
        self.rows.scale_recent(factor)
        self._recent_ref = now
        return now

    # -- a request's life ------------------------------------------------------------------------

    def sent(self, replica: ReplicaState, prompt: Prompt, candidate: Candidate, now: float) -> Placed:
        """`prompt` goes to `replica` (its `candidate` row): its prefill joins the queue there, and
        the index holds its blocks there from now on. A request close behind it (the next turn of a
        conversation sent before this one is answered, another reader of the same document) finds
        them there, not wherever it would go if the first one's answer had to come first: under
        load that answer is seconds away."""
        held, learnt = self.of(replica), self.learnt
        held.recent += math.exp((now - self._frame(now)) / SPREAD_WINDOW_S)  # one request, now
        self.rows.set_recent(held)
        start = max(now, held.busy_until)
        wait_tokens = (start - now) / held.seconds_per_token
        done = start + candidate.uncached_tokens * held.seconds_per_token
        self.rows.set_busy(held, done)
        blocks = round(candidate.cached_tokens * learnt.bytes_per_token / self.block_bytes)
        if self.index.insert(held.holder, prompt.chain) and self.share is not None:
            self.share(replica.id, prompt.chain)
        tokens = prompt.nbytes / learnt.bytes_per_token + learnt.mean_output
        held.kv_tokens += tokens
        self.kv.mark(held)
        decode_s = candidate.wait_s - (start - now)
        coming = None
        if prompt.tokens is not None and replica.id in self.truth.replicas:
            size = self.truth.block_size(replica.id) or replica.engine.block_size
            if size:
                size = int(size)
                coming = (replica.id, prompt.tokens.chain(size))
                # it allocates its prompt's blocks not held there, and its reply's
                allocates = len(coming[1]) - int(candidate.cached_tokens) // size + math.ceil(learnt.mean_output / size)
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
                self.kv.mark(held)
            if held.busy_until > now:
                self.rows.set_busy(held, now)

    def _unload(self, placed: Placed) -> None:
        held = placed.held
        held.kv_tokens = max(0.0, held.kv_tokens - placed.tokens)
        placed.tokens = 0.0
        self.kv.mark(held)

    def _arrived(self, placed: Placed) -> None:
        """Its attempt ended: what its engine holds of it is what the events say from now on."""
        if placed.coming is not None:
            self.truth.unexpect(*placed.coming)
            placed.coming = None

    def answered(
        self, replica: ReplicaState, prompt: Prompt, placed: Placed | None, answer: Answer
    ) -> Prediction | None:
        """`replica` answered `prompt`: it holds the prompt's blocks now; what the answer showed
        (`Answer`: its usage, and its times where it streamed; the first token's on the placement's
        clock) corrects the model. Returns the cached tokens the decision counted on, and whence,
        when the answer reported usage to check them against."""
        held = self.of(replica)
        if self.index.insert(held.holder, prompt.chain) and self.share is not None:
            self.share(replica.id, prompt.chain)
        return self.learnt.answered(replica, held, prompt, placed, answer, self.clock)

    # -- what others say it holds ------------------------------------------------------------------

    def learned(self, replica_id: str, chain: array[int]) -> None:
        """Another router placed this prompt on `replica_id` (router.state.redis.RedisPlacements)."""
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
        model, events = self.learnt.accuracy, self.learnt.events_accuracy
        both = model.plus(events)
        return {
            "index_blocks": self.index.total(),
            "index_bytes": self.index.memory_bytes(),
            "events_blocks": self.truth.index.total(),
            "events_bytes": self.truth.index.memory_bytes(),
            "bytes_per_token": round(self.learnt.bytes_per_token, 3),
            **accuracy_figures(both),
            "by_source": {"model": accuracy_figures(model), "events": accuracy_figures(events)},
        }


__all__ = ["DEFAULT_KV_TOKENS", "Placement"]
