"""`router-bench prefix` runs at a tiny size and reports every figure, on both implementations."""

from __future__ import annotations

import json

import pytest

from router.bench.cli import main
from router.prefix import IMPLEMENTATION

TINY = ["prefix", "--json", "--replicas", "3", "--fill", "3000", "--tokens", "64,512", "--repeat", "3"]


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_prefix_bench_reports_every_figure(impl: str, capsys: pytest.CaptureFixture[str]) -> None:
    if impl == "compiled" and IMPLEMENTATION != "compiled":
        pytest.skip("ROUTER_NO_EXTENSIONS=1: the compiled index is not selected")
    assert main([*TINY, "--impl", impl, "--max-seconds", "0.05", "--block-bytes", "32"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == "prefix" and result["implementation"] == impl
    assert result["replicas"] == 3 and result["capacity"] == 1000 and result["block_bytes"] == 32
    assert result["blocks_held"] >= 3000
    assert result["memory_bytes"] > 0 and result["memory_bytes_per_block"] > 0
    assert result["memory_bytes_per_block_churned"] > 0
    assert result["memory_is_estimate"] == (impl == "python")
    assert [p["tokens"] for p in result["prompts"]] == [64, 512]
    for row, blocks in zip(result["prompts"], (8, 64), strict=True):
        assert row["blocks"] == blocks and row["bytes"] == blocks * 32
        assert row["matched"] == [blocks, blocks // 2, 0]
        for field in ("block_chain_us", "chain_of_parts_us", "match_all_us", "price_us", "insert_us", "insert_held_us"):
            assert row[field] > 0
        assert 1 <= row["price_near"] <= 3


def test_prefix_bench_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY[:1], *TINY[2:], "--impl", "python", "--max-seconds", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "| prompt (tokens) |" in out and "| 512 |" in out and "bytes a block" in out
    assert "| chain_of_parts (µs) |" in out and "| price (µs) |" in out
