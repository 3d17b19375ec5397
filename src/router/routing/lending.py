"""Whether a request is worth prefilling on another replica than the one routed to: with every
replica able to prefill for another (`prefill_anywhere`, vLLM's kv_both), a pure function of the
route's decision and the cheapest other replica's (router.proxy.disagg asks it)."""

from __future__ import annotations

from router.policy import Decision


def lend_worth(home: Decision, home_streams: int, other: Decision, other_streams: int, transfer_s: float) -> bool:
    """Whether prefilling on `other` and decoding on `home` costs the fleet less waiting than
    serving whole on `home`, in seconds of waiting: each side's predicted time to first token (its
    queue and its prefill of what it does not hold; `other`'s plus the transfer), plus its prefill
    time once for every stream in flight there besides the request (a prefill's chunks share the
    engine's steps with those streams' decodes, which wait for them). Without both prices
    (`ttft`'s rows), no."""
    here, there = home.cost, other.cost
    if here is None or there is None:
        return False
    whole = here.ttft_s + max(home_streams, 0) * max(here.ttft_s - here.wait_s, 0.0)
    split = there.ttft_s + transfer_s + max(other_streams, 0) * max(there.ttft_s - there.wait_s, 0.0)
    return split < whole
