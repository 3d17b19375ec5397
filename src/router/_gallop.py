"""The prefix indexes' probe order, for the pure-Python twins (router/_prefix_py.py, _kvshare_py.py).

How many leading blocks of a chain a holder keeps, found as the compiled cores find it: gallop
over the first 1, 2, 4, ... blocks (by the prefix property, the last of them held means all are),
then bisect between the last hit and the first miss. The twins must probe in exactly this order
to give the compiled answers where a chain has a gap.
"""

from __future__ import annotations

from collections.abc import Container, Sequence


def gallop(held: Container[int], chain: Sequence[int], n: int) -> int:
    """Leading blocks of chain[:n] in `held` (n at most 2**31 - 1, as the compiled cores count)."""
    n = min(n, 0x7FFFFFFF)
    if n == 0:
        return 0
    lo, k = 0, 1
    while True:
        k = min(k, n)
        if chain[k - 1] not in held:
            break
        lo = k
        if k == n:
            return n
        k *= 2
    while k - lo > 1:
        mid = lo + (k - lo) // 2
        if chain[mid - 1] in held:
            lo = mid
        else:
            k = mid
    return lo


__all__ = ["gallop"]
