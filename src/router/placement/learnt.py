"""What the engines' answers teach placement: token size, the mean request, prefill speeds, the index's corrections.

Every answer that reports usage corrects the model that priced it (router.placement has the
whole model; this is its learning half):

- **bytes per token**, an EWMA of the prompts' bytes over their `prompt_tokens` (4 at first);
- **the mean request**: its prompt's tokens, its reply's (what a request adds to a KV cache), the
  seconds from a reply's first token to its last, and the tokens a request computes;
- **prefill speeds**: a streamed answer that waited for and computed at least SPEED_MIN_TOKENS is a
  sample of seconds per token (its TTFT less the decode share, over those tokens); a replica's
  speed is the median of its last SPEED_WINDOW, weighed against its peers' median as if that were
  SPEED_PRIOR samples more (`speed_of`);
- **the queue**: a first token later (or sooner) than modelled moves that replica's drain time by
  `ttft_queue_gain` of the lag (`lagged`);
- **the index** (`correct`): a replica that held less than predicted loses the blocks past what it
  held and its LRU shrinks by a quarter of the share over-predicted; one that held nothing of a
  long prediction twice running is emptied; an exact one grows back 2 % towards its engine's size;
- **accuracy**: predicted against reported cached tokens, by where the prediction came from.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from router.fleet import ReplicaState
from router.kvevents.truth import Truth
from router.placement.records import Accuracy, Answer, Held, Placed, Prediction
from router.placement.rows import Rows
from router.prefix import PrefixIndex
from router.prompt import BYTES_PER_TOKEN, Prompt

RATIO_ALPHA = 0.05  # EWMA weight of one answer's bytes-per-token
SPEED_PRIOR = 8  # a replica's speed is weighed against the fleet's median as if that were this many samples more
SPEED_MIN_TOKENS = 512  # a sample computed at least this many tokens (else a step's fixed cost dominates)
SHRINK_FLOOR = 0.05  # an LRU never shrinks below this share of the engine's capacity
GROW = 1.02  # an exact prediction grows the LRU back by 2 %
RESET_AFTER = 2  # answers in a row that found nothing of a long predicted prefix: the cache was lost
RESET_MIN_BLOCKS = 8  # ... a prediction this long at least
REPLY_ALPHA = 0.05  # EWMA weight of one answer's reply length and reply time
FLEET_SPEED_EVERY = 32  # the fleet's median speed is taken again every this many answers (and at a first one)


class Learnt:
    """What placement learnt from answers, and the learning. It writes the replicas' records
    (`Held`) and their rows, and corrects the index; the pricing reads what it learnt."""

    def __init__(
        self,
        held: dict[str, Held],
        rows: Rows,
        index: PrefixIndex,
        truth: Truth,
        block_bytes: int,
        default_spt: float,
        queue_gain: float,
    ) -> None:
        self.held = held  # the placement's records, by replica id
        self.rows = rows
        self.index = index
        self.truth = truth
        self.block_bytes = block_bytes
        self.queue_gain = queue_gain
        self.bytes_per_token = BYTES_PER_TOKEN  # before any usage says otherwise
        self.mean_uncached = 0.0  # tokens a request computes, on average (for queues of unknown requests)
        self.mean_prompt = 0.0  # tokens a prompt has, on average
        self.mean_output = 0.0  # ... and a reply (what a request will add to a KV cache)
        self.reply_s: float | None = None  # seconds from a reply's first token to its last, on average
        self.accuracy = Accuracy()  # of the decisions that read the model
        self.events_accuracy = Accuracy()  # ... and of those that read a replica's engine's events
        self.fleet_spt = default_spt  # the median of the learnt speeds: a replica's until it has its own
        # ... and of those serving the same models (a 70B's replicas prefill slower than an 8B's)
        self.model_spt: dict[frozenset[str] | None, float] = {}
        self._speed_answers = 0
        self._peers_changed = False  # some replica's models changed since the priors were taken

    def prior(self, models: frozenset[str] | None) -> float:
        """The seconds per token of a replica serving `models` that was not measured yet."""
        return self.model_spt.get(models, self.fleet_spt)

    def answered(
        self,
        replica: ReplicaState,
        held: Held,
        prompt: Prompt,
        placed: Placed | None,
        answer: Answer,
        clock: Callable[[], float],
    ) -> Prediction | None:
        """What `replica` (its record `held`) reported of `prompt` (router.placement.Placement.answered)."""
        prompt_tokens, cached_tokens, ttft_s = answer.prompt_tokens, answer.cached_tokens, answer.ttft_s
        completion_tokens, reply_s, first_token_at = answer.completion_tokens, answer.reply_s, answer.first_token_at
        if completion_tokens > 0:  # (the first answer sets it: it is a length, no prior fits every fleet)
            self.mean_output += (REPLY_ALPHA if self.mean_output else 1.0) * (completion_tokens - self.mean_output)
        if reply_s is not None and math.isfinite(reply_s) and reply_s > 0:
            self.reply_s = reply_s if self.reply_s is None else self.reply_s + REPLY_ALPHA * (reply_s - self.reply_s)
        if first_token_at is not None and placed is not None and placed.held is held and placed.due:
            self.lagged(replica, held, first_token_at - placed.due - (held.shift - placed.shift), clock)
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
                    self.fleet_speed()
                else:
                    self.rows.set_spt(held, self.speed_of(held))
        if placed is None:
            return None
        if placed.tier_tokens > 0 and ttft_s is not None and cached_tokens > 0:
            # it loaded tier_tokens back from a second tier: what its first token took past the
            # prefill of what it computed is that transfer
            computed_s = max(prompt_tokens - cached_tokens, 0) * held.seconds_per_token
            spent = ttft_s - max(placed.decode_s, 0.0) - computed_s - placed.wait_tokens * held.seconds_per_token
            self.truth.learn_tier(spent / placed.tier_tokens)
        modelled = min(placed.blocks * self.block_bytes / self.bytes_per_token, prompt_tokens)
        self.correct(held, prompt, placed.blocks, modelled, cached_tokens)  # the model learns always
        if placed.source == "events":
            predicted = min(placed.predicted, prompt_tokens)
            _account(self.events_accuracy, predicted, prompt_tokens, cached_tokens)
            return Prediction(predicted, "events")
        _account(self.accuracy, modelled, prompt_tokens, cached_tokens)
        return Prediction(modelled, "model")

    def lagged(self, replica: ReplicaState, held: Held, lag: float, clock: Callable[[], float]) -> None:
        """A first token came `lag` seconds after the model said (less what the queue there was
        moved by since it was sent): the queue is that much longer than modelled, or shorter if
        negative, and the requests still in flight there wait with it. Its drain time moves by
        `ttft_queue_gain` of that. Unlike a prefill speed learnt under load, this moves only the queue
        there now: it drains away with it, and cannot keep a replica looking slow."""
        gain = self.queue_gain
        if not gain or not math.isfinite(lag) or lag == 0:
            return
        now = clock()
        if lag > 0:
            if replica.inflight <= 0:
                return  # nothing is behind it
            moved = max(held.busy_until, now) + gain * lag
        elif held.busy_until > now:
            moved = max(now, held.busy_until + gain * lag)
        else:
            return
        held.shift += gain * lag
        self.rows.set_busy(held, moved)

    def speed_of(self, held: Held) -> float:
        """Its seconds per token for routing: its own median, weighed against its peers' median
        (the replicas serving the same models; the fleet's where none of those is measured yet) as
        if that were SPEED_PRIOR samples more. Replicas of one model on one kind of GPU prefill
        alike, and a few samples (a step's fixed cost, a neighbour's chunk in the batch, a loaded
        host) must not make one look fast or slow for long: a replica that is, says so in every
        sample, and its own median outweighs the prior twice over once its window is full."""
        prior = self.prior(held.models)
        n = len(held.measured)
        if not n:
            return prior
        return (n * held.own + SPEED_PRIOR * prior) / (n + SPEED_PRIOR)

    def fleet_speed(self) -> None:
        """The fleet's and each model's median speed taken again, and every replica's speed with them."""
        measured = [h for h in self.held.values() if h.measured]
        learnt = sorted(h.own for h in measured)
        self.fleet_spt = learnt[len(learnt) // 2]
        peers: dict[frozenset[str] | None, list[float]] = {}
        for h in measured:
            peers.setdefault(h.models, []).append(h.own)
        self.model_spt = {models: sorted(own)[len(own) // 2] for models, own in peers.items()}
        self._peers_changed = False
        for h in self.held.values():  # those not measured yet: as fast as their peers' median, not the prior
            self.rows.set_spt(h, self.speed_of(h))

    def correct(self, held: Held, prompt: Prompt, predicted_blocks: int, predicted: float, cached: int) -> None:
        """The index's view of `held` after it reported `cached` tokens of `prompt` where
        `predicted` (`predicted_blocks` blocks) were counted on."""
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


__all__ = ["Learnt"]
