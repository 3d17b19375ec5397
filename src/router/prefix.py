"""Selects the prefix index: the compiled `_prefix`, or its Python twin under ROUTER_NO_EXTENSIONS=1.

A missing compiled module is an error, not a silent slowdown: only the explicit opt-out selects
the twin. Application code imports the prefix index from here, never from either implementation.
"""

from typing import TYPE_CHECKING

from router._compat import NO_EXTENSIONS

if TYPE_CHECKING or NO_EXTENSIONS:
    from router._prefix_py import (
        PRICE_CANDIDATE,
        PRICE_GATED,
        PRICE_NEAR,
        PrefixIndex,
        block_chain,
        chain_of_parts,
    )
else:
    from _prefix import PRICE_CANDIDATE, PRICE_GATED, PRICE_NEAR, PrefixIndex, block_chain, chain_of_parts

IMPLEMENTATION: str = "python" if NO_EXTENSIONS else "compiled"

__all__ = [
    "IMPLEMENTATION",
    "PRICE_CANDIDATE",
    "PRICE_GATED",
    "PRICE_NEAR",
    "PrefixIndex",
    "block_chain",
    "chain_of_parts",
]
