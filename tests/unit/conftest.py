"""The unit tests run as a new contributor's machine has them: no engine built and none named.

Every unit test sees no `KVAR_LLAMA_SERVER` or `KVAR_VLLM` and an empty build cache (`KVAR_CACHE`),
whatever the machine has (CI builds both engines for the integration tests, and exports their
paths): a unit test that quietly needed a real engine fails here, on every machine, rather than
in a pass of its own. A test that wants an engine named sets it itself (monkeypatch).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def _no_engine_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("no-engines")


@pytest.fixture(autouse=True)
def _no_engines(monkeypatch: pytest.MonkeyPatch, _no_engine_cache: Path) -> None:
    monkeypatch.delenv("KVAR_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("KVAR_VLLM", raising=False)
    monkeypatch.setenv("KVAR_CACHE", str(_no_engine_cache))
