"""`router-bench tokens` at tiny sizes without vLLM: the tokenizer and the decision on a model trained here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.bench.cli import main

TINY = ["tokens", "--tokens", "64,400", "--replicas", "2,5", "--repeat", "5", "--max-seconds", "0.02", "--no-render"]


def small_model(folder: Path) -> Path:
    """A model folder as the engines read it: a byte-level BPE trained here, and a chat template."""
    from tokenizers import Tokenizer as HfTokenizer  # noqa: PLC0415
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["the cache of the replica and the router is a prefix of the session " * 20], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}\n"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    return folder


def test_every_figure_of_both_turns_and_both_fleets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--model-dir", str(small_model(tmp_path)), "--json", "--block-size", "16"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == "tokens" and result["replicas"] == [2, 5] and result["block_size"] == 16
    rows = result["rows"]
    assert [(r["tokens"], r["turn"]) for r in rows] == [(n, t) for n in (64, 400) for t in ("first", "follow-up")]
    for first, follow_up in (rows[:2], rows[2:]):
        assert abs(first["prompt_tokens"] - first["tokens"]) <= max(1, first["tokens"] // 100)  # sized to the token
        assert follow_up["prompt_tokens"] > first["prompt_tokens"] + 200  # a reply and a question more
    for row in rows:
        assert "render" not in row  # --no-render
        for timing in (row["tokenizer"], row["chain"], *(t for d in row["decision"].values() for t in d.values())):
            assert timing["calls"] == 5 and 0 < timing["p50_us"] <= timing["p99_us"]  # --repeat 5
        assert set(row["decision"]) == {"2", "5"}


def test_the_tables_and_a_missing_model_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--tokens", "64", "--replicas", "3", "--model-dir", str(small_model(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "| prompt (tokens) | turn | tokenizer, in the router | render, vLLM round trip |" in out
    assert "| decision, events, 3 replicas | decision, model, 3 replicas |" in out and "| first |" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*TINY, "--model-dir", str(empty)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("router-bench tokens: ") and "tokenizer.json" in err[0]
