"""Figure definitions, the session and long-document generators, keyless requests, and trace loading."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from router.bench.replay import Replayer, ReplayOptions
from router.bench.workloads import (
    LongDocSpec,
    SessionsSpec,
    TraceError,
    best_case_prefix_reuse,
    block_text,
    generate_longdoc,
    generate_sessions,
    load_trace,
    longdoc_documents,
    trace_prompt,
)
from router.measures import coefficient_of_variation, jump_rate, kv_hit_rate, percentile


def test_percentile_interpolates_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(7.6)  # numpy.percentile(xs, 90)
    assert percentile(xs, 99) == pytest.approx(9.76)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_cv_jump_rate_and_hit_rate() -> None:
    assert coefficient_of_variation([10, 10, 10]) == 0
    assert coefficient_of_variation([0, 20]) == pytest.approx(1.0)
    assert coefficient_of_variation([0, 0]) == 0
    assert jump_rate({"a": ["r1", "r1", "r2"], "b": ["r3"], "c": ["r1", "r2", "r1"]}) == pytest.approx(3 / 4)
    assert jump_rate({}) == 0
    assert kv_hit_rate(30, 120) == 0.25 and kv_hit_rate(0, 0) == 0


def test_sessions_are_deterministic_skewed_and_well_formed() -> None:
    spec = SessionsSpec(rate=5, turns_min=2, turns_max=4, users=50, seed=7)
    gen = generate_sessions(spec)
    plans = [next(gen) for _ in range(400)]
    again = generate_sessions(spec)
    assert [p.session_id for p in plans[:20]] == [next(again).session_id for _ in range(20)]
    starts = [p.start_s for p in plans]
    assert starts == sorted(starts)
    assert 400 / starts[-1] == pytest.approx(5, rel=0.2)  # Poisson at the asked rate
    assert all(2 <= len(p.turns) <= 4 and p.turns[0].think_s == 0 for p in plans)
    assert len({p.session_id for p in plans}) == 400
    per_user = Counter(p.user for p in plans).most_common()
    assert per_user[0][1] > 8 * per_user[len(per_user) // 2][1]  # a few users are far busier
    assert len({p.system for p in plans}) == spec.system_prompts
    first = plans[0].turns[0]
    assert spec.first_tokens[0] * 4 <= len(first.user_text) <= spec.first_tokens[1] * 4 and first.user_text.isascii()


def test_longdoc_sessions_share_documents_deterministically() -> None:
    spec = LongDocSpec(rate=2, documents=10, doc_tokens=(500, 900), turns_min=2, turns_max=4, seed=3)
    docs = longdoc_documents(spec)
    assert len(docs) == 10 and len(set(docs)) == 10
    assert all(len(d) % 4 == 0 and 500 <= len(d) // 4 <= 900 and d.isascii() for d in docs)  # 4 bytes a token
    assert longdoc_documents(replace(spec, rate=9, turns_max=6)) == docs  # the same documents at any rate
    assert longdoc_documents(replace(spec, seed=4)) != docs
    gen = generate_longdoc(spec)
    plans = [next(gen) for _ in range(400)]
    again = generate_longdoc(spec)
    assert [(p.session_id, p.document, p.turns) for p in plans[:30]] == [
        (q.session_id, q.document, q.turns) for q in (next(again) for _ in range(30))
    ]
    starts = [p.start_s for p in plans]
    assert starts == sorted(starts) and 400 / starts[-1] == pytest.approx(2, rel=0.2)  # Poisson at the rate
    assert len({p.session_id for p in plans}) == 400 and len({p.system for p in plans}) == 1
    # several sessions share each popular document; popularity is skewed
    readers = Counter(p.document for p in plans).most_common()
    assert len(readers) == 10 and readers[0][1] > 3 * readers[-1][1] and readers[-1][1] >= 2
    for p in plans:
        assert p.document is not None and 2 <= len(p.turns) <= 4
        first, *later = p.turns
        doc, sep, question = first.user_text.partition("\n\nQuestion: ")
        assert doc == docs[p.document] and sep and 15 <= len(question) // 4 <= 60
        assert first.think_s == 0 and all(t.think_s >= 0 and 15 <= len(t.user_text) // 4 <= 60 for t in later)
        assert all(50 <= t.max_tokens <= 200 for t in p.turns)
    with pytest.raises(ValueError):
        LongDocSpec(doc_tokens=(900, 100))
    with pytest.raises(ValueError):
        LongDocSpec(rate=0)


def test_keyless_requests_carry_no_session_key() -> None:
    keyed = Replayer(ReplayOptions(targets=("http://127.0.0.1:1",), workload="longdoc"))
    assert keyed._key_headers("longdoc-s1") == {"Content-Type": "application/json", "X-Session-ID": "longdoc-s1"}
    keyless = Replayer(
        ReplayOptions(
            targets=("http://127.0.0.1:1",),
            workload="sessions",
            session_keys=False,
            key_headers=("X-Session-ID", "X-SMG-Routing-Key"),
        )
    )
    assert keyless._key_headers("user-0001-s1") == {"Content-Type": "application/json"}


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_loading_sessions_and_prompts(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 7]},
        {"timestamp": 9, "input_length": 2100, "output_length": 5, "hash_ids": [0, 1, 2, 3, 4]},
    ] + [{"timestamp": 10 + i, "input_length": 512, "output_length": 1, "hash_ids": [0]} for i in range(60)]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    assert [r.session for r in trace[:3]] == ["trace-1", "trace-7", "trace-1"]  # block 0 is shared by all
    assert [r.turn for r in trace[:3]] == [1, 1, 2]
    assert trace[1].timestamp_s == 0.005
    prompt = trace_prompt(trace[0])
    assert len(prompt) == 1500 * 4 and prompt.isascii()
    assert prompt.startswith(block_text(0) + block_text(1)) and len(block_text(5)) == 2048
    assert trace_prompt(trace[2]).startswith(prompt[: 1024 * 4])
    assert len(load_trace(tmp_path / "t.jsonl", limit=2)) == 2


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "needs 2 hash_ids"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "not a trace record"),
        ("not json", "not a trace record"),
    ],
)
def test_bad_traces_name_the_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=f"bad.jsonl:2: .*{match}"):
        load_trace(path)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_best_case_reuse_counts_leading_seen_chains(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]},  # nothing seen
        {"timestamp": 1, "input_length": 1300, "output_length": 1, "hash_ids": [0, 1, 3]},  # 0, 1 seen: 1024
        {"timestamp": 2, "input_length": 700, "output_length": 1, "hash_ids": [9, 1]},  # 1 alone is not a prefix
        {"timestamp": 3, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]},  # all: 512+512+76
    ]
    got = best_case_prefix_reuse(write_trace(tmp_path / "t.jsonl", rows))
    assert got["reusable_tokens"] == 1024 + 1100 and got["prompt_tokens"] == 4200
    assert got["best_case_hit_rate"] == pytest.approx(2124 / 4200)
