"""The router's exception hierarchy: every exception it defines is a RouterError and keeps its builtin base."""

from __future__ import annotations

import ast
import errno
import importlib
import os
from pathlib import Path

import pytest

import router
from router.config.loading import ConfigError, UnknownSettings
from router.engines.discovery import DiscoveryError
from router.engines.upstream import ConnectError, StaleConnection, UpstreamError
from router.errors import RouterError
from router.kvevents.tokens import TokenizerError
from router.kvevents.wire import WireError
from router.membership import Clash, NoRoom
from router.proxy.workers import CannotListen, WorkerFailed
from router.sessions import LinkDown
from router.shm.table import TornRead
from router.state.file import StateError
from router.tenancy.admission import Shed
from router.tenancy.clients import ClientKeysError

PACKAGE = Path(router.__file__).parent
APART = ("bench", "emulator")  # router-bench and router-emulator: tools beside the router, not the router


def defined_exceptions() -> dict[str, type[BaseException]]:
    """Every class a module of the router defines (at its top or inside a class) that is an Exception,
    by `module:qualname`; the source's own class statements say what to look for."""
    found: dict[str, type[BaseException]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[1] in APART:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(name)
        pending = [(module, node) for node in ast.parse(path.read_text(encoding="utf-8")).body]
        while pending:
            owner, node = pending.pop()
            if not isinstance(node, ast.ClassDef):
                continue
            cls = getattr(owner, node.name)
            if issubclass(cls, Exception):
                found[f"{name}:{cls.__qualname__}"] = cls
            pending += [(cls, inner) for inner in node.body]
    return found


def test_every_exception_the_router_defines_is_a_router_error() -> None:
    found = defined_exceptions()
    assert "router.engines.upstream:StaleConnection" in found  # the walk reached the modules
    outside = [where for where, cls in found.items() if not (issubclass(cls, RouterError) or cls.__name__[0] == "_")]
    assert not outside, f"derive these from router.errors.RouterError as well: {outside}"


@pytest.mark.parametrize(
    ("exception", "builtin"),
    [
        (ConfigError, ValueError),
        (ClientKeysError, ValueError),
        (UnknownSettings, ConfigError),
        (StateError, ValueError),
        (DiscoveryError, RuntimeError),
        (TokenizerError, ValueError),
        (CannotListen, OSError),
        (UpstreamError, ConnectionError),
        (ConnectError, UpstreamError),
        (StaleConnection, UpstreamError),
        (WireError, ValueError),
        (WorkerFailed, RuntimeError),
        (LinkDown, RuntimeError),
        (TornRead, RuntimeError),
        (Shed, RouterError),
        (NoRoom, RuntimeError),
        (Clash, ValueError),
    ],
)
def test_each_keeps_the_base_its_callers_catch(exception: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(exception, RouterError)
    assert issubclass(exception, builtin)


def test_their_constructors_still_reach_the_builtin_base() -> None:
    taken = OSError(errno.EADDRINUSE, "in use")
    assert str(CannotListen("127.0.0.1", 1, taken)) == f"cannot listen on 127.0.0.1:1: {os.strerror(errno.EADDRINUSE)}"
    assert str(UnknownSettings(["a", "b"])) == "a\nb"
    assert str(ConfigError("port", "the CLI", "must be in 1..65535")) == (
        "invalid setting 'port' (from the CLI): must be in 1..65535"
    )
