"""What an inference engine says about its load, read by name from one table per engine.

Each engine exports its figures under names of its own. `ENGINES` below says, for each engine the
router knows, which Prometheus metric (or sum of metrics, or `/slots` field) means each figure the
router uses: requests waiting, requests running, KV-cache usage (0..1), fragmentation of held KV,
prefix-cache queries and hits (tokens), capacity (requests it runs at once) and the KV cache's
size in tokens (vLLM: labels of `vllm:cache_config_info`; SGLang: `max_total_num_tokens`). An engine is
recognised by its metrics' prefix. A figure the engine does not export stays None: missing, never
invented. Several series of one metric (one per engine core or model label) add up, except usage
and fragmentation ratios, which take the worst.

Where a figure has several sources, the first one the engine exports wins (vLLM's current name,
then its older one). Worked example, llama.cpp's `llama-server --metrics`:

    llamacpp:requests_deferred 3            -> waiting 3
    llamacpp:requests_processing 4          -> running 4
    llamacpp:prompt_tokens_total 900        -> prefix queries 900 + 300 = 1200 (it counts uncached
    llamacpp:prompt_tokens_cached_total 300    tokens only), prefix hits 300
    GET /slots: four slot objects           -> capacity 4

No KV usage: llama-server exports no such gauge (older builds had `kv_cache_usage_ratio`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

SUM, MAX = "sum", "max"


@dataclass(frozen=True)
class Metrics:
    """One source of a figure: these metrics added up, the series of each added up (`MAX`: its
    worst series instead); with `label`, only the series whose label of that name has that value
    (vLLM's `vllm:num_requests_waiting_by_reason{reason="capacity"}`)."""

    names: tuple[str, ...]
    combine: str = SUM
    label: tuple[str, str] | None = None


@dataclass(frozen=True)
class Slots:
    """A figure from llama-server's `GET /slots` (a list of slot objects): how many slots there
    are (`count`), or how many have `is_processing` set (`processing`)."""

    what: str


@dataclass(frozen=True)
class LabelProduct:
    """A figure an engine exports as labels of an info gauge: the product of these labels' numeric
    values on the metric's first series (vLLM's `vllm:cache_config_info{block_size="16",
    num_gpu_blocks="2048"} 1` -> 32768 tokens of KV)."""

    name: str
    labels: tuple[str, ...]


Source = Metrics | Slots | LabelProduct


@dataclass(frozen=True)
class Engine:
    kind: str  # how /admin/replicas names it
    prefix: str  # recognised by metrics named so
    figures: Mapping[str, tuple[Source, ...]]  # EngineStats field -> its sources, first exported wins
    slots: bool = False  # also read GET /slots
    # it refuses (404) a request naming a model it does not list in /v1/models, so the router may
    # route by that list; SGLang and llama-server answer whatever model is named
    checks_model: bool = False


def _m(*names: str, combine: str = SUM, label: tuple[str, str] | None = None) -> Metrics:
    return Metrics(names, combine, label)


WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
_VLLM: dict[str, tuple[Source, ...]] = {
    # the requests waiting for room in the batch: vLLM 0.32 tells them from those `deferred` (for a
    # LoRA slot, a KV transfer), which wait whatever room there is; older vLLM counts them all, and
    # v0 also counted requests swapped out to CPU memory apart: they wait to run again too
    "waiting": (
        _m(WAITING_BY_REASON, label=("reason", "capacity")),
        _m("vllm:num_requests_waiting", "vllm:num_requests_swapped"),
    ),
    "deferred": (_m(WAITING_BY_REASON, label=("reason", "deferred")),),
    "running": (_m("vllm:num_requests_running"),),
    "kv_usage": (_m("vllm:kv_cache_usage_perc", combine=MAX), _m("vllm:gpu_cache_usage_perc", combine=MAX)),
    "prefix_queries": (_m("vllm:prefix_cache_queries_total"),),
    "prefix_hits": (_m("vllm:prefix_cache_hits_total"),),
    "kv_tokens": (LabelProduct("vllm:cache_config_info", ("block_size", "num_gpu_blocks")),),
    "block_size": (LabelProduct("vllm:cache_config_info", ("block_size",)),),
    # a decode replica's reads of KV blocks prefilled elsewhere (NixlConnector): how many, their
    # time in all, and those that failed (the replica then answers an error, or recomputes)
    "transfers": (_m("vllm:nixl_xfer_time_seconds_count"),),
    "transfer_s": (_m("vllm:nixl_xfer_time_seconds_sum"),),
    "failed_transfers": (_m("vllm:nixl_num_failed_transfers_total"),),
    # vLLM exports no concurrency limit (max_num_seqs): the `replica_capacity` setting gives it
}

ENGINES: tuple[Engine, ...] = (
    # first: it also exports vLLM's names
    Engine(
        "emulator",
        "emulator:",
        {
            **_VLLM,
            "fragmentation": (_m("emulator:kv_fragmentation", combine=MAX),),
            "capacity": (_m("emulator:max_num_seqs"),),
        },
        checks_model=True,
    ),
    Engine("vllm", "vllm:", _VLLM, checks_model=True),
    Engine(
        "sglang",
        "sglang:",
        {
            "waiting": (_m("sglang:num_queue_reqs"),),
            "running": (_m("sglang:num_running_reqs"),),
            "kv_usage": (_m("sglang:token_usage", combine=MAX),),
            "kv_tokens": (_m("sglang:max_total_num_tokens"),),
        },
    ),
    Engine(
        "llama.cpp",
        "llamacpp:",
        {
            "waiting": (_m("llamacpp:requests_deferred"),),
            "running": (_m("llamacpp:requests_processing"), Slots("processing")),
            "kv_usage": (_m("llamacpp:kv_cache_usage_ratio", combine=MAX),),
            # prompt_tokens_total counts the tokens it computed, not those it found cached
            "prefix_queries": (_m("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),),
            "prefix_hits": (_m("llamacpp:prompt_tokens_cached_total"),),
            "capacity": (Slots("count"),),
        },
        slots=True,
    ),
)
BY_KIND = {e.kind: e for e in ENGINES}
LLAMA_CPP = BY_KIND["llama.cpp"]


@dataclass(frozen=True)
class EngineStats:
    waiting: float | None = None  # for room in the batch
    deferred: float | None = None  # waiting for something else (vLLM: a LoRA slot, a KV transfer)
    running: float | None = None
    kv_usage: float | None = None  # 0..1
    fragmentation: float | None = None  # 0..1
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    capacity: float | None = None  # requests the engine runs at once (slots, max_num_seqs)
    kv_tokens: float | None = None  # tokens its KV cache holds (vLLM: blocks x block size)
    block_size: float | None = None  # tokens per KV block (what its prefix cache hits come in)
    transfers: float | None = None  # KV transfers read from prefill replicas, since the engine started
    transfer_s: float | None = None  # ... their time in all
    failed_transfers: float | None = None
    kind: str | None = None  # which engine it is (ENGINES), None when not recognised


# every metric name some table reads: only these lines' values are parsed (an engine's /metrics
# is mostly histogram buckets the router does not read)
KNOWN = frozenset(
    n for e in ENGINES for sources in e.figures.values() for s in sources if isinstance(s, Metrics) for n in s.names
)
# metrics some table reads by one label: their values are also kept under `name{label="value"}`
BY_LABEL = {
    n: s.label[0]
    for e in ENGINES
    for sources in e.figures.values()
    for s in sources
    if isinstance(s, Metrics) and s.label is not None
    for n in s.names
}
LABELLED = frozenset(
    s.name for e in ENGINES for sources in e.figures.values() for s in sources if isinstance(s, LabelProduct)
)


def samples(
    text: str, names: frozenset[str] | None = None, labelled: dict[str, str] | None = None
) -> tuple[dict[str, list[float]], set[str]]:
    """The values of the series of each metric in `names` (every one when None) whose value is a
    finite number, and the name prefixes (up to `:`) of every sample line; a malformed line never
    raises. Metrics in LABELLED have the label text of their first series put in `labelled`."""
    values: dict[str, list[float]] = {}
    prefixes: set[str] = set()
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end <= 0:
            continue
        name = line[:name_end]
        wanted = names is None or name in names
        if _read(name, line[name_end:], values, labelled, wanted) or not wanted:
            prefix, colon, _ = name.partition(":")
            if colon:
                prefixes.add(prefix + ":")
    return values, prefixes


def _read(name: str, rest: str, values: dict[str, list[float]], labelled: dict[str, str] | None, value: bool) -> bool:
    """One sample line, its metric's `name` and what follows it (`rest`: its labels, if any, then
    its value): a LABELLED metric's first label text into `labelled`; where `value`, its value
    into `values` (and under `name{label="..."}` where BY_LABEL names one). Whether a finite
    value was read."""
    braced = rest[:1] == "{"
    close = rest.rfind("}") if braced else -1
    if labelled is not None and braced and close > 0 and name in LABELLED and name not in labelled:
        labelled[name] = rest[1:close]
    if not value:
        return False
    fields = rest[close + 1 :].split()
    try:
        number = float(fields[0])
    except (IndexError, ValueError):
        return False
    if not math.isfinite(number):
        return False
    values.setdefault(name, []).append(number)
    label = BY_LABEL.get(name)
    if label is not None and braced:
        found = _labels(rest[1:close]) or {}
        if label in found:
            values.setdefault(_series(name, (label, found[label])), []).append(number)
    return True


def recognise(prefixes: set[str]) -> Engine | None:
    """The engine whose metrics these are: the first in ENGINES whose prefix is among `prefixes`."""
    return next((e for e in ENGINES if e.prefix in prefixes), None)


# a sample line of a metric some table reads (its name, then its labels or its value): found in
# one pass of a regex over the text, without visiting the lines of every other metric (vLLM's
# /metrics is 51 KB, mostly histogram buckets: 70 us against 426 for `samples`). Longer names
# first, and the name must end where its labels or value begin, so that none matches another's start.
_READ = re.compile(
    "\n(" + "|".join(re.escape(n) for n in sorted(KNOWN | LABELLED, key=len, reverse=True)) + ")([{ ][^\n]*)"
)


def known_samples(text: str) -> tuple[dict[str, list[float]], dict[str, str], Engine | None]:
    """`samples(text, KNOWN, labelled)` and the engine `recognise` finds among its lines (the first
    in ENGINES with a sample line named with its prefix), read without visiting other lines:
    what the health probe reads of every replica's /metrics every round."""
    text = "\n" + text
    values: dict[str, list[float]] = {}
    labelled: dict[str, str] = {}
    for match in _READ.finditer(text):
        name = match.group(1)
        _read(name, match.group(2), values, labelled, name in KNOWN)
    return values, labelled, _recognised(text, values)


def _recognised(text: str, values: Mapping[str, list[float]]) -> Engine | None:
    """`recognise` of the text's sample lines (`text` starting with a line end): an engine whose
    prefix names a sample read with a finite value, or a line of any other metric."""
    for engine in ENGINES:
        prefix = engine.prefix
        if "\n" + prefix not in text:
            continue
        if any(name.startswith(prefix) for name in values):
            return engine
        for match in re.finditer("\n(" + re.escape(prefix) + "[^{ \n]*)[{ ]", text):
            if match.group(1) not in KNOWN:
                return engine
    return None


def parse_engine_metrics(text: str, engine: Engine | None = None) -> EngineStats:
    """The known figures out of Prometheus text exposition, by the table of the engine that
    exported it (recognised from the text unless given). A source's metrics add up; the series of
    one metric add up, or take the largest (`MAX`)."""
    values, labelled, recognised = known_samples(text)
    engine = engine or recognised
    if engine is None:
        return EngineStats()
    found: dict[str, Any] = {"kind": engine.kind}
    for figure, sources in engine.figures.items():
        for source in sources:
            if isinstance(source, LabelProduct):
                product = _label_product(labelled.get(source.name), source.labels)
                if product is not None:
                    found[figure] = product
                    break
            elif isinstance(source, Metrics):
                combine = sum if source.combine == SUM else max
                keys = [_series(n, source.label) for n in source.names] if source.label else source.names
                present = [combine(values[k]) for k in keys if k in values]
                if present:
                    found[figure] = sum(present)
                    break
    return EngineStats(**found)


def _series(name: str, label: tuple[str, str]) -> str:
    return f'{name}{{{label[0]}="{label[1]}"}}'


def _label_product(text: str | None, names: tuple[str, ...]) -> float | None:
    """The product of the named labels' values in `a="1",b="2"` label text; None if one is missing,
    not a positive finite number, or the text is malformed."""
    if not text:
        return None
    found: dict[str, str] = {}
    for part in text.split(","):
        label, eq, value = part.partition("=")
        if eq:
            found[label.strip()] = value.strip().strip('"')
    product = 1.0
    for name in names:
        try:
            number = float(found[name])
        except (KeyError, ValueError):
            return None
        if not (math.isfinite(number) and number > 0):
            return None
        product *= number
    return product


LORA_INFO = "vllm:lora_requests_info"
_LORA_LINE = re.compile("\\n" + re.escape(LORA_INFO) + "\\{([^\\n]*)")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')


def _labels(text: str) -> dict[str, str] | None:
    """`a="1",b="x,y"` as a dict (values unescaped); None if the text is malformed."""
    found: dict[str, str] = {}
    at = 0
    while at < len(text):
        match = _LABEL.match(text, at)
        if match is None or match.end() == at:
            return None
        found[match[1]] = match[2].replace('\\"', '"').replace("\\\\", "\\")
        at = match.end()
    return found


def lora_state(text: str) -> tuple[frozenset[str] | None, int | None]:
    """The LoRA adapters a vLLM engine has loaded, as far as its `vllm:lora_requests_info` says,
    and its `max_lora`. That gauge has one series per state the engine has been in (the adapters
    it ran and queued, as comma-separated label values), its value the time that state was last
    current, and vLLM never drops one: the newest series is now's. Its adapters are loaded (or
    loading, for those queued); so are the others most recently run, up to `max_lora` in all,
    since the engine keeps that many in its GPU slots and evicts the least recently used first.
    (None, None) where the engine exports no such metric (no adapters enabled, not vLLM)."""
    if LORA_INFO not in text:
        return None, None
    series: list[tuple[float, dict[str, str]]] = []
    for match in _LORA_LINE.finditer("\n" + text):  # (its lines alone, not every line of the text)
        line = match.group(1)
        end = line.rfind("}")
        labels = _labels(line[:end]) if end > 0 else None
        try:
            value = float(line[end + 1 :].split()[0])
        except (IndexError, ValueError):
            continue
        if labels is not None and math.isfinite(value):
            series.append((value, labels))
    if not series:
        return None, None
    series.sort(key=lambda s: s[0], reverse=True)

    def names(labels: dict[str, str], *keys: str) -> list[str]:
        return [n.strip() for key in keys for n in labels.get(key, "").split(",") if n.strip()]

    newest = series[0][1]
    loaded = set(names(newest, "running_lora_adapters", "waiting_lora_adapters"))
    try:
        max_lora: int | None = int(newest["max_lora"])
    except (KeyError, ValueError):
        max_lora = None
    if max_lora is not None:
        for _, labels in series[1:]:  # the adapters run lately, newest first, while slots remain
            if len(loaded) >= max_lora:
                break
            for name in names(labels, "running_lora_adapters"):
                if len(loaded) < max_lora:
                    loaded.add(name)
    return frozenset(loaded), max_lora


def read_slots(slots: Any, engine: Engine = LLAMA_CPP) -> dict[str, float]:
    """The figures `engine` reads from a `GET /slots` answer; {} for anything but a list of objects."""
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        return {}
    counts = {"count": float(len(slots)), "processing": float(sum(1 for s in slots if s.get("is_processing") is True))}
    return {
        figure: counts[source.what]
        for figure, sources in engine.figures.items()
        for source in sources
        if isinstance(source, Slots)
    }


def with_slots(stats: EngineStats, slots: Mapping[str, float], engine: Engine = LLAMA_CPP) -> EngineStats:
    """`stats` with the figures read from /slots filled in where the metrics did not give them (a
    figure whose metric source comes first in the table keeps the metric's value)."""
    fill = {k: v for k, v in slots.items() if getattr(stats, k) is None}
    return replace(stats, kind=stats.kind or engine.kind, **fill)
