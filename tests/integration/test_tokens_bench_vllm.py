"""`router-bench tokens` with its render part: a real vLLM replica's /v1/chat/completions/render gives
the tokenizer's own ids and is timed beside it (scripts/build-vllm.sh; skipped elsewhere with that
message, failing under CI)."""

from __future__ import annotations

import json

import pytest
from engine_streams import vllm_or_why

from router.bench.cli import main

ROOT, WHY = vllm_or_why()
pytestmark = [pytest.mark.real_engine, pytest.mark.skipif(ROOT is None, reason=WHY)]


def test_the_render_round_trip_beside_the_tokenizer(capsys: pytest.CaptureFixture[str]) -> None:
    # the bench refuses to report unless vLLM's render of each turn is the tokenizer's ids
    args = ["tokens", "--tokens", "64,300", "--replicas", "2", "--repeat", "5", "--max-seconds", "0.05", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert ROOT is not None and result["model_dir"] == str(ROOT / "model")  # the tiny model vLLM serves
    turns = [(n, t) for n in (64, 300) for t in ("first", "follow-up")]
    assert [(r["tokens"], r["turn"]) for r in result["rows"]] == turns
    for row in result["rows"]:
        render = row["render"]
        assert render["calls"] == 5 and 0 < render["p50_us"] <= render["p99_us"]
