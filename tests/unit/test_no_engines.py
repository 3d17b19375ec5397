"""The unit tests' conftest hides every engine the machine has (CI builds and names both)."""

from __future__ import annotations

import os

import pytest

from router.bench import llama_server, vllm


def test_a_unit_test_finds_no_engine_whatever_the_machine_has() -> None:
    assert "KVAR_LLAMA_SERVER" not in os.environ and "KVAR_VLLM" not in os.environ
    with pytest.raises(llama_server.NotBuilt):
        llama_server.find_binary()
    with pytest.raises(vllm.NotBuilt):
        vllm.find_vllm()
