"""Shared fixtures: every ring behaviour runs against both implementations."""

from __future__ import annotations

import os
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings
from twins import implementations

from router import _ring_py

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "deep",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


IMPLEMENTATIONS = implementations("_ring", _ring_py)
COMPILED = IMPLEMENTATIONS.get("compiled")


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """One ring implementation module: `compiled` (_ring) or `python` (router._ring_py)."""
    return IMPLEMENTATIONS[request.param]


@pytest.fixture
def compiled() -> ModuleType:
    if COMPILED is None:
        pytest.skip("installed with ROUTER_NO_EXTENSIONS=1: no compiled module to test")
    return COMPILED
