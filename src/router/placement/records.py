"""What placement keeps per replica and per request: the records its pricing and learning share."""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

SPEED_WINDOW = 16  # a replica's prefill speed is the median of its last this many samples


@dataclass(slots=True)
class Held:
    """The router's view of one replica's cache and prefill queue."""

    holder: int  # its number in the index
    engine_blocks: int  # what its engine can hold, in blocks
    blocks: int  # what its LRU may hold now (shrunk by over-predictions)
    seconds_per_token: float  # prefill speed, learnt (until then: its peers' median, Learnt.prior)
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
class Answer:
    """What an answer showed of its request: its usage (tokens, cached tokens, the reply's tokens)
    and, where it streamed whole, its time to first token, the seconds from its first token to its
    last, and when its first token came (on the routing clock). Told to the policy that chose its
    replica, which teaches placement."""

    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None = None  # a prefill's time where the replica served it alone
    completion_tokens: int = 0
    reply_s: float | None = None
    first_token_at: float | None = None


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

    def plus(self, other: Accuracy) -> Accuracy:
        """Both together."""
        return Accuracy(*(getattr(self, f) + getattr(other, f) for f in Accuracy.__dataclass_fields__))


def accuracy_figures(a: Accuracy) -> dict[str, float | int | None]:
    return {
        "predicted_hit_rate": a.predicted_tokens / a.prompt_tokens if a.prompt_tokens else None,
        "reported_hit_rate": a.reported_tokens / a.prompt_tokens if a.prompt_tokens else None,
        "prediction_error": (a.over_tokens + a.under_tokens) / a.prompt_tokens if a.prompt_tokens else None,
        "exact_share": a.exact / a.answers if a.answers else None,
        "answers": a.answers,
    }


__all__ = ["SPEED_WINDOW", "Accuracy", "Held", "Placed", "Prediction", "accuracy_figures"]
