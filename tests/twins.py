"""Each compiled module and its pure-Python twin, for the tests that run every behaviour on both."""

from __future__ import annotations

import importlib
from types import ModuleType

from router._compat import NO_EXTENSIONS


def load_compiled(name: str) -> ModuleType | None:
    """The compiled module `name`, or None where the package was installed without it on purpose."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if NO_EXTENSIONS:
            return None
        raise


def implementations(name: str, twin: ModuleType) -> dict[str, ModuleType]:
    """{"python": the twin, "compiled": the module `name` (where it was built)}."""
    compiled = load_compiled(name)
    return {"python": twin} | ({"compiled": compiled} if compiled is not None else {})
