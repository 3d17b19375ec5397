"""Workloads that `router-bench replay` sends: synthetic multi-turn chats, long-document question
answering, and Mooncake traces.

`sessions`: chat sessions arrive as a Poisson process. Each belongs to a user drawn from a Zipf
law (a few users start most sessions), opens with one of a few shared system prompts and a
longer first message, then alternates replies and new user messages; every turn resends the
whole history, so a replica that served the previous turn holds most of the prompt in its KV
cache. Think time between turns is exponential.

`longdoc`: question answering over a few dozen long documents (by default 24 of 6,000–12,000
tokens). Sessions arrive as a Poisson process; each picks a document by a Zipf law of popularity,
so several sessions share one (the popular ones, most). A session opens with [the shared system
prompt, user: the document and a first question] and goes on for 3–6 turns in all: questions of
15–60 tokens, replies of 50–200, the whole history resent each turn. So the reuse
that matters crosses sessions: the system prompt and the document are the same prefix for every
session about it, and only the prompt says which document that is. With the defaults the
documents hold about 215,000 tokens: more than one long-context replica's KV cache, less than a
fleet's. Example: a session asks about a document of 8,211 tokens; its first prompt is about
8,570 tokens, of which the 8,500 or so of system prompt and document are cached on any replica
that served a session about the same document before (and still holds it); its third turn
resends those plus two questions and two replies.

Traces (`mooncake-conversation`, `mooncake-synthetic`): one JSON object per line with
`timestamp` (ms), `input_length`, `output_length` and `hash_ids`, the prompt's 512-token blocks
(equal ids, equal content; see the traces' README). Each id becomes a fixed 2,048-byte text,
exactly 512 emulator tokens, so an emulated prefix cache sees the trace's sharing exactly. Session
keys come from the first block of each chain that fewer than max(50, 1% of the requests) share
(the conversation trace opens every request with one common system-prompt block).
"""

from __future__ import annotations

import base64
import json
import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

TRACE_BLOCK_TOKENS = 512
TRACE_BLOCK_BYTES = TRACE_BLOCK_TOKENS * 4


# -- synthetic sessions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionsSpec:
    rate: float = 2.0  # new sessions per engine second
    turns_min: int = 3
    turns_max: int = 8
    think_s: float = 8.0  # mean think time between turns, engine seconds
    system_prompts: int = 4
    system_tokens: int = 600
    first_tokens: tuple[int, int] = (200, 1200)  # the opening message (a document, code, a question)
    user_tokens: tuple[int, int] = (20, 200)
    reply_tokens: tuple[int, int] = (50, 250)  # max_tokens of each turn
    users: int = 200
    zipf_s: float = 1.2
    seed: int = 1

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError("session rate must be positive")
        if not 1 <= self.turns_min <= self.turns_max:
            raise ValueError("turns must satisfy 1 <= min <= max")
        if self.think_s < 0 or self.users < 1 or self.system_prompts < 1:
            raise ValueError("think time must be >= 0, users and system prompts >= 1")


@dataclass(frozen=True)
class LongDocSpec:
    rate: float = 0.5  # new sessions per engine second
    documents: int = 24
    doc_tokens: tuple[int, int] = (6000, 12000)
    turns_min: int = 3  # the opening question included
    turns_max: int = 6
    think_s: float = 8.0  # mean think time between turns, engine seconds
    system_tokens: int = 300
    question_tokens: tuple[int, int] = (15, 60)
    reply_tokens: tuple[int, int] = (50, 200)  # max_tokens of each turn
    zipf_s: float = 1.0  # document popularity
    seed: int = 1

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError("session rate must be positive")
        if not 1 <= self.turns_min <= self.turns_max:
            raise ValueError("turns must satisfy 1 <= min <= max")
        if self.documents < 1 or not 1 <= self.doc_tokens[0] <= self.doc_tokens[1]:
            raise ValueError("need at least one document and document tokens 1 <= min <= max")
        if self.think_s < 0:
            raise ValueError("think time must be >= 0")


@dataclass
class Turn:
    user_text: str
    max_tokens: int
    think_s: float  # pause after the previous reply, engine seconds (0 for the first turn)


@dataclass
class SessionPlan:
    session_id: str
    user: str
    start_s: float  # engine seconds since the replay began
    system: str
    turns: list[Turn] = field(default_factory=list)
    document: int | None = None  # longdoc: the index of the document the session asks about


def _words(rng: random.Random, tokens: int) -> str:
    """`tokens` emulator tokens of random text (lower-case base32: 8 characters per 5 random bytes)."""
    n = max(1, tokens)
    return base64.b32encode(rng.randbytes(n * 5 // 2 + 5)).decode("ascii").lower()[: n * 4]


def generate_sessions(spec: SessionsSpec) -> Iterator[SessionPlan]:
    """An endless stream of sessions in arrival order; the caller stops it."""
    rng = random.Random(spec.seed)
    systems = [f"System prompt {i}. " + _words(rng, spec.system_tokens) for i in range(spec.system_prompts)]
    weights = [1 / (k**spec.zipf_s) for k in range(1, spec.users + 1)]
    users = [f"user-{k:04d}" for k in range(spec.users)]
    started: Counter[str] = Counter()
    t = 0.0
    while True:
        t += rng.expovariate(spec.rate)
        user = rng.choices(users, weights)[0]
        started[user] += 1
        n_turns = rng.randint(spec.turns_min, spec.turns_max)
        turns = []
        for k in range(n_turns):
            lo, hi = spec.first_tokens if k == 0 else spec.user_tokens
            turns.append(
                Turn(
                    user_text=_words(rng, rng.randint(lo, hi)),
                    max_tokens=rng.randint(*spec.reply_tokens),
                    think_s=0.0 if k == 0 else rng.expovariate(1 / spec.think_s) if spec.think_s > 0 else 0.0,
                )
            )
        yield SessionPlan(
            session_id=f"{user}-s{started[user]}",
            user=user,
            start_s=t,
            system=systems[rng.randrange(len(systems))],
            turns=turns,
        )


def longdoc_documents(spec: LongDocSpec) -> list[str]:
    """The documents of a longdoc workload, the same for every rate (their own random stream):
    each exactly its number of emulator tokens, drawn uniformly from `doc_tokens`."""
    rng = random.Random(f"longdoc-documents-{spec.seed}")
    return [_words(rng, rng.randint(*spec.doc_tokens)) for _ in range(spec.documents)]


def generate_longdoc(spec: LongDocSpec) -> Iterator[SessionPlan]:
    """An endless stream of document question-answering sessions in arrival order; the caller stops it."""
    documents = longdoc_documents(spec)
    rng = random.Random(spec.seed)
    system = "Answer questions about the document the user gives. " + _words(rng, spec.system_tokens)
    weights = [1 / (k**spec.zipf_s) for k in range(1, spec.documents + 1)]
    popularity = list(range(spec.documents))
    rng.shuffle(popularity)  # the most read document is not always the first
    t, n = 0.0, 0
    while True:
        n += 1
        t += rng.expovariate(spec.rate)
        doc = rng.choices(popularity, weights)[0]
        turns = []
        for k in range(rng.randint(spec.turns_min, spec.turns_max)):
            question = _words(rng, rng.randint(*spec.question_tokens))
            turns.append(
                Turn(
                    user_text=documents[doc] + "\n\nQuestion: " + question if k == 0 else question,
                    max_tokens=rng.randint(*spec.reply_tokens),
                    think_s=0.0 if k == 0 else rng.expovariate(1 / spec.think_s) if spec.think_s > 0 else 0.0,
                )
            )
        yield SessionPlan(
            session_id=f"longdoc-s{n}", user=f"reader-{n}", start_s=t, system=system, turns=turns, document=doc
        )


# -- traces ---------------------------------------------------------------------------------------


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str = ""
    turn: int = 1


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake-format trace; session keys and turn numbers are derived (see module doc)."""
    rows: list[TraceRequest] = []
    p = Path(path)
    try:
        handle = p.open("rb")
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror}") from None
    with handle:
        for lineno, line in enumerate(handle, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                row = TraceRequest(
                    timestamp_s=float(obj["timestamp"]) / 1000,
                    input_length=int(obj["input_length"]),
                    output_length=int(obj["output_length"]),
                    hash_ids=tuple(int(h) for h in obj["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{p}:{lineno}: not a trace record ({type(exc).__name__}: {exc})") from None
            blocks = math.ceil(row.input_length / TRACE_BLOCK_TOKENS)
            if row.input_length <= 0 or len(row.hash_ids) != blocks:
                raise TraceError(
                    f"{p}:{lineno}: input_length {row.input_length} needs {blocks} hash_ids, got {len(row.hash_ids)}"
                )
            rows.append(row)
    if not rows:
        raise TraceError(f"{p}: no requests in the trace")
    return assign_sessions(rows)


def assign_sessions(rows: list[TraceRequest]) -> list[TraceRequest]:
    """Session key = the first block of a request's chain that fewer than max(50, 1% of the requests)
    share; the rest of a conversation extends that chain. Turn = order within the key."""
    counts: Counter[int] = Counter()
    for row in rows:
        counts.update(set(row.hash_ids))
    common = max(50, len(rows) // 100)
    turns: Counter[str] = Counter()
    out = []
    for row in rows:
        key_block = next((h for h in row.hash_ids if counts[h] < common), row.hash_ids[-1])
        session = f"trace-{key_block}"
        turns[session] += 1
        out.append(
            TraceRequest(row.timestamp_s, row.input_length, row.output_length, row.hash_ids, session, turns[session])
        )
    return out


@lru_cache(maxsize=32768)
def block_text(hash_id: int) -> str:
    """The fixed text of one trace block: 2,048 ASCII bytes, 512 emulator tokens."""
    raw = random.Random(hash_id).randbytes(TRACE_BLOCK_BYTES * 3 // 4)
    return base64.b64encode(raw).decode("ascii")


def trace_prompt(row: TraceRequest) -> str:
    """The prompt of a trace request: its blocks' texts, the last one cut to the remaining tokens."""
    full = row.input_length // TRACE_BLOCK_TOKENS
    parts = [block_text(h) for h in row.hash_ids[:full]]
    rest = row.input_length - full * TRACE_BLOCK_TOKENS
    if rest:
        parts.append(block_text(row.hash_ids[full])[: rest * 4])
    return "".join(parts)


def best_case_prefix_reuse(path: str | Path, limit: int | None = None) -> dict[str, Any]:
    """Straight from the trace file, independent of the emulator: the share of prompt tokens that a
    single node with an unlimited prefix cache could reuse (leading blocks whose whole chain was
    seen before, counted in tokens; a partial last block counts its own tokens)."""
    children: dict[tuple[int, int], int] = {}  # (prefix node, block id) -> node: a trie of chains
    reused = total = requests = 0
    with Path(path).open("rb") as handle:
        for line in handle:
            if limit is not None and requests >= limit:
                break
            if not line.strip():
                continue
            obj = json.loads(line)
            ids = obj["hash_ids"]
            n = int(obj["input_length"])
            node, k, matching = 0, 0, True
            for h in ids:
                child = children.get((node, h))
                if child is None:
                    child = children[(node, h)] = len(children) + 1
                    matching = False
                elif matching:
                    k += 1
                node = child
            reused += sum(min(TRACE_BLOCK_TOKENS, n - TRACE_BLOCK_TOKENS * i) for i in range(k))
            total += n
            requests += 1
    return {
        "requests": requests,
        "prompt_tokens": total,
        "reusable_tokens": reused,
        "best_case_hit_rate": reused / total if total else 0.0,
    }
