"""Selects the ring implementation: the compiled `_ring`, or its Python twin under ROUTER_NO_EXTENSIONS=1.

A missing compiled module is an error, not a silent slowdown: only the explicit opt-out selects
the twin. Application code imports the ring from here, never from either implementation.
"""

from typing import TYPE_CHECKING

from router._compat import NO_EXTENSIONS

if TYPE_CHECKING or NO_EXTENSIONS:
    from router._ring_py import MovedRange, Ring, RingSnapshot, active_vnodes, xxh3_64
else:
    from _ring import MovedRange, Ring, RingSnapshot, active_vnodes, xxh3_64

IMPLEMENTATION: str = "python" if NO_EXTENSIONS else "compiled"

__all__ = ["IMPLEMENTATION", "MovedRange", "Ring", "RingSnapshot", "active_vnodes", "xxh3_64"]
