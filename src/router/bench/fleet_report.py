"""The results of `router-bench fleet`: each contender's figures summed up over its rounds, the
Markdown tables and the PNG plots."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.bench.fleet_counters import PREDICTION_SOURCES
from router.bench.fleet_workloads import size_workload


def _goodput(r: dict[str, Any]) -> float:
    """Answers within the latency target a second, over the run's engine seconds."""
    if r.get("slo_met") is None or not r.get("wall_s"):
        return math.nan
    return float(r["slo_met"] / (r["wall_s"] * r["time_scale"]))


FIGURES: tuple[tuple[str, Callable[[dict[str, Any]], float]], ...] = (  # (figure, how to get it from a run)
    ("kv_hit_rate", lambda r: r["kv_hit_rate"]),
    ("multi_turn_mean_s", lambda r: r["e2e_later_turns_s"].get("mean", math.nan)),
    ("multi_turn_p99_s", lambda r: r["e2e_later_turns_s"].get("p99", math.nan)),
    ("ttft_p99_s", lambda r: r["ttft_s"].get("p99", math.nan)),
    ("ttft_later_p99_s", lambda r: r.get("ttft_later_turns_s", {}).get("p99", math.nan)),
    ("ttft_later_p50_s", lambda r: r.get("ttft_later_turns_s", {}).get("p50", math.nan)),
    ("ttft_p50_s", lambda r: r["ttft_s"].get("p50", math.nan)),
    ("tpot_p50_s", lambda r: r.get("tpot_s", {}).get("p50", math.nan)),
    ("tpot_p99_s", lambda r: r.get("tpot_s", {}).get("p99", math.nan)),
    ("goodput_rps", _goodput),
    ("split_share", lambda r: r.get("split_share", math.nan)),  # router-serve with prefill replicas
    ("slo_share", lambda r: r["slo_met"] / r["ok"] if r.get("slo_met") is not None and r["ok"] else math.nan),
    ("engine_kv_hit_rate", lambda r: r.get("engine_kv_hit_rate", math.nan)),  # vLLM's own counters
    ("preemptions", lambda r: r.get("preemptions", math.nan)),
    ("load_cv", lambda r: r["load_cv"]),
    ("inflight_cv", lambda r: r["inflight_cv"]),
    ("jump_rate", lambda r: r["jump_rate"]),
    ("gpu_busy", lambda r: r["gpu_busy"]),
    ("requests", lambda r: r["requests"]),
    ("client_cpu_share", lambda r: r["client_cpu_share"]),
    ("emulator_cpu_share", lambda r: r["emulator_cpu_share"]),
    ("router_cpu_share", lambda r: r["router_cpu_share"] if r["router_cpu_share"] is not None else math.nan),
    # router-serve only: the share of its answers whose cached tokens it predicted to the token, by source
    ("exact_predicted_events", lambda r: r.get("exact_predicted_events", math.nan)),
    ("exact_predicted_model", lambda r: r.get("exact_predicted_model", math.nan)),
    ("predicted_answers_events", lambda r: r.get("predicted_answers_events", math.nan)),
    ("predicted_answers_model", lambda r: r.get("predicted_answers_model", math.nan)),
    # router-serve only: its sessions' follow-ups sent to another replica because its price chose to
    ("cost_move_share", lambda r: r.get("cost_move_share", math.nan)),
    # the run's limit (router.bench.bound, emulated fleets): the hit rate of one fleet-wide cache with
    # Belady's eviction over the run's requests, the contender's share of it, and the TTFT floor
    ("bound_hit_rate", lambda r: r.get("bound", {}).get("bound_hit_rate", math.nan)),
    ("hit_share_of_bound", lambda r: r.get("hit_share_of_bound", math.nan)),
    ("ttft_floor_p99_s", lambda r: r.get("bound", {}).get("ttft_floor_s", {}).get("p99", math.nan)),
    ("ttft_floor_later_p50_s", lambda r: r.get("bound", {}).get("ttft_floor_later_s", {}).get("p50", math.nan)),
    ("ttft_floor_later_p99_s", lambda r: r.get("bound", {}).get("ttft_floor_later_s", {}).get("p99", math.nan)),
)


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over a contender's rounds; failed requests summed over them. A
    contender that could not run at all is {"error": why}."""
    done = [r for r in runs if "error" not in r]
    if not done:
        return {"error": runs[0]["error"] if runs else "not run", "rounds": 0}
    out: dict[str, Any] = {}
    for key, get in FIGURES:
        values = [float(get(r)) for r in done]
        values = [v for v in values if not math.isnan(v)]
        out[key] = statistics.median(values) if values else math.nan
    out["failed"] = sum(r["requests"] - r["ok"] for r in done)
    # of them, the 429s a router's overload hold turned away (a decision, where the others are faults)
    out["refused"] = sum(r.get("errors", {}).get("http 429", 0) for r in done)
    out["sessions_cut"] = sum(r.get("sessions_cut", 0) for r in done)
    # turns never sent because an earlier turn of their conversation failed (a refusal among them)
    out["turns_dropped"] = sum(r.get("turns_dropped", 0) for r in done)
    out["rounds"] = len(done)
    if len(done) < len(runs):
        out["error"] = next(r["error"] for r in runs if "error" in r)
    return out


def make_tables(result: dict[str, Any]) -> None:
    result["tables"] = {
        w: {name: summarize_runs(rs) for name, rs in by.items() if rs} for w, by in result["runs"].items()
    }


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1%}"


def _num(x: float, digits: int = 3) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def exact_cell(f: dict[str, Any]) -> str:
    """router-serve's answers predicted to the token, by source: `99.4% of 160 / none`; n/a for the others."""
    cells = []
    for source in PREDICTION_SOURCES:
        answers = f.get(f"predicted_answers_{source}", math.nan)
        if math.isnan(answers):
            return "n/a"
        cells.append(f"{_pct(f[f'exact_predicted_{source}'])} of {answers:,.0f}" if answers else "none")
    return " / ".join(cells)


def _failed(f: dict[str, Any]) -> str:
    """Failed requests, and how many of them a router's overload hold refused: `3 (2 refused)`."""
    return f"{f['failed']:,.0f}" + (f" ({f['refused']:,.0f} refused)" if f.get("refused") else "")


Column = tuple[str, Callable[[dict[str, Any]], str]]  # (title, the cell of a contender's figures)
COLUMNS: tuple[Column, ...] = (
    ("requests", lambda f: f"{f['requests']:,.0f}"),
    ("failed", _failed),
    ("KV hit", lambda f: _pct(f["kv_hit_rate"])),
    ("of the bound", lambda f: _pct(f.get("hit_share_of_bound", math.nan))),
    ("multi-turn mean (s)", lambda f: _num(f["multi_turn_mean_s"])),
    ("multi-turn P99 (s)", lambda f: _num(f["multi_turn_p99_s"])),
    ("TTFT P99 (s)", lambda f: _num(f["ttft_p99_s"])),
    ("later-turn TTFT P99 (s)", lambda f: _num(f["ttft_later_p99_s"])),
    ("load CV", lambda f: _num(f["load_cv"])),
    ("in-flight CV", lambda f: _num(f["inflight_cv"])),
    ("jump rate", lambda f: _pct(f["jump_rate"])),
    ("moved for cost", lambda f: _pct(f.get("cost_move_share", math.nan))),
    ("GPU busy", lambda f: _pct(f["gpu_busy"])),
    ("exact predicted (events / model)", exact_cell),
)
# with prefill/decode contenders: the figures disaggregation is about (the decode side's TPOT,
# free of prefills, against TTFT, which pays a transfer) and goodput within both targets
DISAGG_COLUMNS: tuple[Column, ...] = (
    ("requests", lambda f: f"{f['requests']:,.0f}"),
    ("failed", _failed),
    ("KV hit", lambda f: _pct(f["kv_hit_rate"])),
    ("TTFT P50 (s)", lambda f: _num(f.get("ttft_p50_s", math.nan))),
    ("TTFT P99 (s)", lambda f: _num(f["ttft_p99_s"])),
    ("TPOT P50 (ms)", lambda f: _num(1000 * f.get("tpot_p50_s", math.nan), 1)),
    ("TPOT P99 (ms)", lambda f: _num(1000 * f.get("tpot_p99_s", math.nan), 1)),
    ("goodput (/s)", lambda f: _num(f.get("goodput_rps", math.nan), 2)),
    ("within target", lambda f: _pct(f.get("slo_share", math.nan))),
    ("split", lambda f: _pct(f.get("split_share", math.nan))),
    ("multi-turn P99 (s)", lambda f: _num(f["multi_turn_p99_s"])),
    ("GPU busy", lambda f: _pct(f["gpu_busy"])),
)
VLLM_COLUMNS: tuple[Column, ...] = (
    ("requests", lambda f: f"{f['requests']:,.0f}"),
    ("failed", _failed),
    ("KV hit (engine)", lambda f: _pct(f.get("engine_kv_hit_rate", math.nan))),
    ("KV hit (client)", lambda f: _pct(f["kv_hit_rate"])),
    ("later-turn TTFT P50 (s)", lambda f: _num(f.get("ttft_later_p50_s", math.nan))),
    ("later-turn TTFT P99 (s)", lambda f: _num(f["ttft_later_p99_s"])),
    ("TTFT P99 (s)", lambda f: _num(f["ttft_p99_s"])),
    ("multi-turn mean (s)", lambda f: _num(f["multi_turn_mean_s"])),
    ("multi-turn P99 (s)", lambda f: _num(f["multi_turn_p99_s"])),
    ("load CV", lambda f: _num(f["load_cv"])),
    ("jump rate", lambda f: _pct(f["jump_rate"])),
    ("preempted", lambda f: _num(f.get("preemptions", math.nan), 0)),
    ("busy", lambda f: _pct(f["gpu_busy"])),
    ("exact predicted (events / model)", exact_cell),
)


def render_markdown(result: dict[str, Any]) -> str:
    labels = result["contenders"]
    sizes = result.get("replicas_needed") or {}
    engine = result.get("engine", "emulator")
    settings = result.get("engine_settings") or {}
    if engine == "llama-server":
        what = f"llama-server replicas ({settings['slots']} slots each, real time)"
        notes = " Load CV: of generated tokens per replica; GPU busy: share of slot time busy."
    elif engine == "vllm":
        what = (
            f"vLLM replicas ({settings['max_num_seqs']} sequences and KV for "
            f"{settings['kv_blocks'] * settings['block_size']:,} tokens each, real time)"
        )
        notes = (
            " KV hit (engine): the replicas' own prefix-cache hits ÷ queries, in tokens, over the run;"
            " (client): `cached_tokens` ÷ prompt tokens in the answers. Load CV: of requests each replica"
            " finished; preempted: requests vLLM preempted for KV room; busy: share of sampled time a"
            " replica ran a request."
        )
    else:
        what, notes = f"emulated replicas, time scale {result['time_scale']:g}", ""
    notes += (
        " Of the bound: KV hit ÷ the hit rate of one cache of the whole fleet's KV with Belady's eviction"
        " over the same requests in the order they were sent (router.bench.bound; emulated fleets only);"
        " the limit row shows that rate and the TTFT floor (each request's uncached prefill alone on an"
        " idle engine)."
        " Moved for cost: router-serve's follow-ups its price sent off their session's replica"
        ' (`router_session_jumps_total{reason="cost"}` ÷ follow-ups; the jump rate counts every move).'
        " Exact predicted: router-serve's answers whose cached tokens it predicted to the token, of those"
        " it priced by the engine's KV events / by its own model (`router_prefix_prediction_error_tokens`)."
    )
    lines = [
        f"{result['replicas']} {what}, "
        f"median of {result['rounds']} round(s) (failed requests: summed, the 429s of a router's overload hold "
        "among them as refused); latencies in "
        + ("engine seconds." if engine == "emulator" else "seconds.")
        + notes
        + ("" if result.get("complete", True) else " **Interrupted: only the runs that finished.**"),
        "",
    ]
    columns = DISAGG_COLUMNS if result.get("disagg") else VLLM_COLUMNS if engine == "vllm" else COLUMNS
    if result.get("disagg"):
        slo = result["slo"]
        lines[0] += (
            f" Prefill/decode contenders: half the replicas prefill, half decode, unless the label gives"
            f" another share; prefill anywhere: no roles, any replica prefilling for another. TPOT: time"
            f" per output token after the first; goodput: answers with TTFT ≤ {slo['ttft_s']:g} s and TPOT"
            f" ≤ {1000 * slo['tpot_s']:g} ms a second of the run, and their share of the answers; split:"
            " router-serve's requests prefilled on another replica than the one that decoded them (the rest"
            " served whole, `router_disagg_requests_total`)."
        )
    for workload, table in result["tables"].items():
        lines += [f"**{workload}**", ""]
        shape = result.get("engine_shapes", {}).get(workload)
        if shape:
            lines += [_shape_line(shape, result["replicas"]), ""]
        head = "| contender | " + " | ".join(title for title, _ in columns) + " |"
        rule = "|---|" + "---:|" * len(columns)
        searched = workload == sizes.get("workload")
        if searched:
            head += f" replicas for P99 ≤ {sizes['target_p99_s']:.2f} s |"
            rule += "---:|"
        lines += [head, rule]
        ran = {name: f for name, f in table.items() if "requests" in f}
        for name, f in table.items():
            if name not in ran:
                lines.append(f"| {labels[name]} | did not run: {f['error']} |")
                continue
            row = f"| {labels[name]} | " + " | ".join(cell(f) for _, cell in columns) + " |"
            if searched:
                row += f" {_needed(sizes['contenders'].get(name), result['replicas'])} |"
            lines.append(row)
        limit = _limit_row(ran, columns)
        if limit:
            lines.append(limit)
        lines.append("")
        if not ran:
            continue
        cut = [f"{labels[n]} {f['sessions_cut']:,.0f}" for n, f in ran.items() if f.get("sessions_cut")]
        if cut:
            lines += [
                "Sessions cut at the drain cap (3 × `--duration`), their later turns never sent: "
                + ", ".join(cut)
                + ". Those rows count fewer requests than the others, and miss their slowest turns.",
                "",
            ]
        dropped = [f"{labels[n]} {f['turns_dropped']:,.0f}" for n, f in ran.items() if f.get("turns_dropped")]
        if dropped:
            lines += [
                "Turns never sent because an earlier turn of their conversation failed (a refusal among "
                "them): " + ", ".join(dropped) + ". Those rows count fewer requests than the others.",
                "",
            ]
        cpu = [
            f"{labels[n]} {f['router_cpu_share']:.0%}" for n, f in ran.items() if not math.isnan(f["router_cpu_share"])
        ]
        fleet = {"llama-server": "llama-servers ", "vllm": "vLLM fleet (every process) "}.get(engine, "emulated fleet ")
        lines.append(
            "CPU, share of one core: client "
            + f"{max(f['client_cpu_share'] for f in ran.values()):.0%} at most, "
            + fleet
            + f"{max(f['emulator_cpu_share'] for f in ran.values()):.0%} at most; routers: "
            + (", ".join(cpu) or "none")
            + "."
        )
        lines.append("")
        lines += _goals(ran, labels, vllm=engine == "vllm")
    return "\n".join(lines)


LIMIT_CELLS: dict[str, Callable[[list[dict[str, Any]]], float]] = {  # a column's cell in the limit row
    "KV hit": lambda fs: max(f["bound_hit_rate"] for f in fs),
    "TTFT P99 (s)": lambda fs: min(f["ttft_floor_p99_s"] for f in fs),
    "later-turn TTFT P99 (s)": lambda fs: min(f["ttft_floor_later_p99_s"] for f in fs),
    "later-turn TTFT P50 (s)": lambda fs: min(f["ttft_floor_later_p50_s"] for f in fs),
}


def _limit_row(ran: dict[str, dict[str, Any]], columns: tuple[Column, ...]) -> str | None:
    """The row of the limit no router reaches (router.bench.bound): the highest bound of the runs'
    request sequences (each contender's share is of its own run's) and the lowest TTFT floors."""
    bounded = [f for f in ran.values() if not math.isnan(f.get("bound_hit_rate", math.nan))]
    if not bounded:
        return None
    cells = []
    for title, _ in columns:
        if title == "of the bound":
            cells.append("100%")
        elif title in LIMIT_CELLS:
            value = LIMIT_CELLS[title](bounded)
            cells.append(_pct(value) if title == "KV hit" else _num(value))
        else:
            cells.append("—")
    label = "**the limit** (the fleet's KV as one cache, Belady's eviction; TTFT: no queue)"
    return f"| {label} | " + " | ".join(cells) + " |"


def _shape_line(shape: dict[str, Any], replicas: int) -> str:
    """Engine: what the replicas of a workload are, and its working set against their KV."""
    argv = " ".join(shape.get("emulator_args") or shape.get("engine_args") or ())
    line = f"Engine: {shape['engine']}" + (f" (`{argv}`)" if argv else "")
    kv = shape.get("kv_tokens_per_replica")
    if kv:
        line += f"; KV for {kv:,} tokens a replica, {kv * replicas:,} in the fleet"
        work = shape.get("working_set_tokens")
        if work is not None:
            held = (
                f"the {shape['documents_asked']} documents asked about hold {work:,} tokens"
                if "documents_asked" in shape
                else f"the {shape['sessions']} conversations of a run end holding about {work:,} tokens "
                "(shared system prompts once)"
            )
            line += f"; {held}, {work / kv:.2f}× one replica's KV and {work / (kv * replicas):.2f}× the fleet's"
    return line + "."


def _needed(found: dict[str, Any] | None, replicas: int) -> str:
    if found is None:
        return ""
    if found.get("error"):
        return "n/a"
    if found["needed"] is None:
        return f"> {replicas}"
    if found["needed"] == found.get("lowest_probed"):
        return f"≤ {found['needed']}"  # the search goes no lower than half the fleet
    return str(found["needed"])


def _goals(table: dict[str, dict[str, Any]], labels: dict[str, str], vllm: bool = False) -> list[str]:
    """`full` (router-serve as shipped) against each other contender: ratios of the medians above
    (on vLLM: of the engines' hit rates, and of later turns' TTFT P50 and P99 too)."""
    full = table.get("full")
    if not full:
        return []
    hit = "engine_kv_hit_rate" if vllm else "kv_hit_rate"

    def ratio(a: float, b: float) -> str:
        return _num(a / b, 2) + "×" if b > 0 else "n/a"

    out = [
        "| as shipped (full) against | KV hit, full ÷ other | multi-turn mean, full vs other "
        "| multi-turn P99, other ÷ full | load CV, full / other |"
        + (" later-turn TTFT P50, other ÷ full | later-turn TTFT P99, other ÷ full |" if vllm else ""),
        "|---|---:|---:|---:|---:|" + ("---:|---:|" if vllm else ""),
    ]
    for name, f in table.items():
        if name == "full":
            continue
        mean = full["multi_turn_mean_s"] / f["multi_turn_mean_s"] - 1 if f["multi_turn_mean_s"] > 0 else math.nan
        row = (
            f"| {labels[name]} | {ratio(full[hit], f[hit])} | {'n/a' if math.isnan(mean) else f'{mean:+.0%}'} "
            f"| {ratio(f['multi_turn_p99_s'], full['multi_turn_p99_s'])} "
            f"| {_num(full['load_cv'])} / {_num(f['load_cv'])} |"
        )
        if vllm:
            row += (
                f" {ratio(f['ttft_later_p50_s'], full['ttft_later_p50_s'])} "
                f"| {ratio(f['ttft_later_p99_s'], full['ttft_later_p99_s'])} |"
            )
        out.append(row)
    return [*out, ""]


def write_plots(result: dict[str, Any], out: Path) -> list[str] | None:
    """The PNG plots written (none when no run finished); None when matplotlib, from the `bench`
    extra, is not installed."""
    try:
        import matplotlib  # noqa: PLC0415 -- optional (the bench extra): None when it is missing

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 -- optional, and only after the Agg backend is chosen
    except ImportError:
        return None
    labels = result["contenders"]
    written: list[str] = []
    tables = {w: {n: f for n, f in t.items() if "requests" in f} for w, t in result["tables"].items()}
    tables = {w: t for w, t in tables.items() if t}
    if not tables:
        return written
    hit = ("engine_kv_hit_rate", "KV hit rate, engines' counters (%)") if result.get("engine") == "vllm" else None
    fig, axes = plt.subplots(len(tables), 2, figsize=(12, 3.2 * len(tables)), squeeze=False)
    for row, (workload, table) in enumerate(tables.items()):
        names = list(table)
        colours = [
            "#c0392b" if n == "full" else "#7f8c8d" if n in ("round-robin", "oracle") else "#2980b9" for n in names
        ]
        for col, (key, title, scale) in enumerate(
            (
                (*(hit or ("kv_hit_rate", "KV hit rate (%)")), 100.0),
                ("multi_turn_p99_s", "multi-turn P99 (engine s)", 1.0),
            )
        ):
            ax = axes[row][col]
            ax.barh([labels[n] for n in names], [table[n][key] * scale for n in names], color=colours)
            ax.invert_yaxis()
            ax.set_title(f"{workload}: {title}", fontsize=10)
            ax.tick_params(labelsize=8)
            if col == 1:
                ax.set_yticklabels([])
    fig.tight_layout()
    path = out / "fleet-hit-p99.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)

    busiest = size_workload(list(result["runs"]))
    runs = result["runs"][busiest] if busiest else next(iter(result["runs"].values()))
    # the first round that ran, of every contender with a load timeline
    timelines = {
        n: next((r["load_timeline"] for r in rs if r.get("load_timeline", {}).get("queued")), None)
        for n, rs in runs.items()
    }
    shown = {n: tl for n, tl in timelines.items() if tl is not None}
    if not shown:
        return written
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 1.6 * len(shown)), squeeze=False, sharex=True)
    peak = max(max(max(q) for q in tl["queued"]) for tl in shown.values()) or 1
    for ax, (name, tl) in zip((a[0] for a in axes), shown.items(), strict=True):
        grid = list(map(list, zip(*tl["queued"], strict=True)))  # replicas x time
        t = tl["t_s"]
        ax.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap="magma",
            vmin=0,
            vmax=peak,
            extent=(t[0], t[-1], len(grid), 0),
        )
        ax.set_ylabel(labels[name], rotation=0, ha="right", va="center", fontsize=8)
        ax.set_yticks([])
    axes[-1][0].set_xlabel("engine seconds (requests running + waiting per replica, one row each)")
    fig.tight_layout()
    path = out / "fleet-load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)
    return written
