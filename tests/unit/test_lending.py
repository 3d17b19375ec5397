"""Whether a request is prefilled on another replica than its own (router.routing.lend_worth):
seconds of waiting, the request's own and the streams' it would stall, on either side."""

from __future__ import annotations

from router.placement import Candidate
from router.policy import Decision
from router.routing import lend_worth


def priced(index: int, wait_s: float, prefill_s: float) -> Decision:
    """A decision whose row predicts `wait_s` of queue, then `prefill_s` of prefill."""
    return Decision(index, "cost", Candidate(index, 0.0, 8000.0, wait_s, wait_s + prefill_s))


def test_a_replica_decoding_for_others_lends_the_prefill_to_an_idle_one() -> None:
    home, other = priced(0, 0.0, 2.0), priced(1, 0.0, 2.0)
    # as soon either way: whole on its replica stalls its three streams 2 s each; the other has none
    assert lend_worth(home, 3, other, 0, transfer_s=0.05)
    # nothing in flight on its own replica: the transfer is pure cost
    assert not lend_worth(home, 0, other, 0, transfer_s=0.05)
    # the other is as busy: no gain, and the transfer to pay
    assert not lend_worth(home, 3, other, 3, transfer_s=0.05)


def test_a_queue_elsewhere_outweighs_the_streams_spared() -> None:
    home = priced(0, 0.0, 1.0)
    assert lend_worth(home, 2, priced(1, 1.5, 1.0), 0, 0.0)  # 2.5 s against 1 + 2 x 1 s
    assert not lend_worth(home, 2, priced(1, 2.5, 1.0), 0, 0.0)  # 3.5 s against 3 s


def test_a_replica_that_holds_the_prompt_prefills_it_for_less() -> None:
    home = priced(0, 0.0, 2.0)
    holder = Decision(1, "cost", Candidate(1, 7000.0, 1000.0, 0.0, 0.25))  # most of it cached there
    assert lend_worth(home, 1, holder, 1, 0.05)  # 0.55 s against 4 s


def test_without_both_prices_nothing_is_lent() -> None:
    assert not lend_worth(Decision(0, "ring"), 5, priced(1, 0.0, 0.1), 0, 0.0)
    assert not lend_worth(priced(0, 0.0, 5.0), 5, Decision(1, "ring"), 0, 0.0)
