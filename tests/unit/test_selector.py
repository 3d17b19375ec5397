"""The selector loads the compiled core unless ROUTER_NO_EXTENSIONS opts out, and says which."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from router import ring
from router._compat import NO_EXTENSIONS


def selected(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ROUTER_NO_EXTENSIONS"}
    if env_value is not None:
        env["ROUTER_NO_EXTENSIONS"] = env_value
    code = "import router.ring as r; print(r.IMPLEMENTATION, r.Ring.__module__)"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()


def test_this_run_uses_the_implementation_it_asked_for() -> None:
    # Fails when the compiled module silently failed to load in a run that did not opt out.
    if NO_EXTENSIONS:
        assert ring.IMPLEMENTATION == "python"
        assert ring.Ring.__module__ == "router._ring_py"
    else:
        assert ring.IMPLEMENTATION == "compiled"
        assert ring.Ring.__module__ == "_ring"
        import _ring  # noqa: PLC0415 -- exists only where the compiled core was built

        assert _ring.__file__.endswith((".so", ".pyd"))


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, "compiled"), ("0", "compiled"), ("", "compiled"), ("1", "python"), ("yes", "python")],
)
def test_opt_out_flag(value: str | None, expected: str) -> None:
    try:
        import _ring  # noqa: F401, PLC0415 -- may be missing (built without extensions): then skip
    except ImportError:
        pytest.skip("installed without the compiled module (ROUTER_NO_EXTENSIONS at build time)")
    impl, module = selected(value)
    assert impl == expected
    assert module == ("_ring" if expected == "compiled" else "router._ring_py")
