"""`router-bench tokens`: what it costs to price a request by what the engines hold, against the model.

The event-fed index (router.engines.kvfeed) needs each request in the engine's own tokens before it can
price it. This measures, for a chat of `--tokens` prompt tokens (a system prompt and one long user
message) and for the next turn of the same conversation (a `REPLY_TOKENS` reply and a
`FOLLOW_UP_TOKENS` question more), side by side:

- **tokenizer**: `Tokenizer.chat` (router.kvevents.tokens) with the model's own tokenizer and chat
  template, in the router's process (found from the engines' /v1/models, router.engines.tokens). It
  keeps each conversation's tokens, with its answer once the answer went (`Tokenizer.replied`, timed
  on its own: off the request's path), so the next turn renders the template again but tokenizes
  only the new question;
- **render**: the round trip to one real vLLM replica's `/v1/chat/completions/render` (what the
  router once waited for on every request, and a peer's cache-aware policy does), on a keep-alive
  connection, the JSON answer parsed, the replica otherwise idle. Its token ids must equal the
  tokenizer's, or nothing is reported;
- **decision**: the rest of the routing decision, in process, on fleets of `--replicas`: the
  engine's tokens cut into the engine's blocks (`EngineTokens.chain`, `--block-size`; the follow-up's
  extending the first turn's, as the tokenizer keeps it) and
  `Placement.price` reading the event-fed truth (every replica believed, the conversation held
  whole on one, other conversations of the same length on the others), against today's decision
  from the router's own model (`prompt_of`, then `Placement.price` without engine tokens). Both
  build the prompt's byte blocks (`prompt_of`): the key is made for every request either way.

The model is `--model-dir` (by default the tiny Llama scripts/build-vllm.sh writes beside vLLM:
a byte-level BPE of 1,623 tokens: about 2.2 characters a token of the text here, English words;
a large model's tokenizer takes about four, so its text for the same tokens is longer). The replica
for `render` (router.bench.vllm) gets a context of the longest prompt (vLLM is allowed past the
tiny model's 8,192 positions: `VLLM_ALLOW_LONG_MAX_MODEL_LEN`) and the render endpoints
(`--enable-scale-out`); `--no-render` leaves it out.

Each figure is the median and the 99th percentile of single calls: at most `--repeat` of them and
no more than `--max-seconds` of calls (at least `MIN_CALLS`), after one call not timed.
"""

# It is past 450 lines as one benchmark: its conversations, the decisions it times and the render
# replica it asks feed one table, and the docstring above is `router-bench tokens --help`.

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from array import array
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from router import prefix
from router.bench.common import free_port, positive_int
from router.bench.vllm import MODEL_NAME, NotBuilt, VllmServer, find_vllm
from router.config import RouterConfig, parse_replica
from router.fleet import Fleet
from router.kvevents.tokens import (
    Chains,
    EngineTokens,
    Tokenizer,
    TokenizerError,
    Turn,
    extend_chain,
    request_chain,
    root_of,
)
from router.kvevents.wire import MEDIUM_GPU, Batch, Stored
from router.measures import percentile
from router.placement import Placement
from router.prompt import Prompt, prompt_of

REPLY_TOKENS = 200  # the first turn's reply, in the next turn's prompt
FOLLOW_UP_TOKENS = 100  # ... and the next question
SYSTEM_SHARE = 8  # the system prompt is this share of the first turn's text, the user's message the rest
MIN_CALLS = 5  # a timing makes at least this many calls, whatever --max-seconds says
_WORDS = (
    "the of and to in is that for it as with was on be by at this from are or have an they which one "
    "you were her all she there would their we him been has when who will more no if out so said what "
    "up its about into than them can only other new some could time these two may then do first any "
    "my now such like our over man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being under never "
    "cache replica router engine token prefix block session request conversation document question"
)
WORDS = tuple(_WORDS.split())  # the text's words: English's commonest, and a few of this trade


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "tokens",
        help="the cost of cutting a request into the engine's tokens (in the router, or through vLLM's render) "
        "and of pricing it by the engines' KV events, against the model-only decision",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tokens",
        type=_sizes,
        default=(1024, 8192, 32768),
        help="first turns' prompt tokens (default 1024,8192,32768)",
    )
    p.add_argument("--replicas", type=_sizes, default=(4, 20), help="fleet sizes of the decision (default 4,20)")
    p.add_argument("--block-size", type=positive_int, default=32, help="the engine's KV block, in tokens (default 32)")
    p.add_argument(
        "--model-dir",
        default=None,
        metavar="DIR",
        help="the model's folder (tokenizer.json, chat template); default: the tiny model of scripts/build-vllm.sh",
    )
    p.add_argument(
        "--render",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time a real vLLM replica's /v1/chat/completions/render (default on; needs scripts/build-vllm.sh)",
    )
    p.add_argument("--repeat", type=positive_int, default=200, help="calls per timing at most (default 200)")
    p.add_argument("--max-seconds", type=float, default=3.0, help="time budget of one timing (default 3)")
    p.add_argument("--seed", type=int, default=1, help="random seed of the text (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(run=run)


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(",") if part.strip())


# -- the conversation -------------------------------------------------------------------------------


def _text(rng: random.Random, chars: int) -> str:
    """`chars` characters (at least one) of words drawn from WORDS."""
    chars = max(1, chars)
    out: list[str] = []
    n = 0
    while n < chars:
        word = rng.choice(WORDS)
        out.append(word)
        n += len(word) + 1
    return " ".join(out)[:chars]


class Conversation:
    """A first turn of about `tokens` prompt tokens (within 1 %, the chat template's tokens
    included) and its next turn, sized with the tokenizer."""

    def __init__(self, tokenizer: Tokenizer, tokens: int, seed: int) -> None:
        sample = _text(random.Random(seed), 4000)
        per_token = len(sample) / max(1, len(tokenizer.encode(sample)))  # characters
        for _ in range(4):  # the text's length, corrected by what it came to
            rng = random.Random(seed * 1_000_003 + tokens)
            system = _text(rng, round(tokens // SYSTEM_SHARE * per_token))
            user = _text(rng, round((tokens - tokens // SYSTEM_SHARE) * per_token))
            self.first: list[Mapping[str, Any]] = [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ]
            got = len(tokenizer.encode(tokenizer.render(self.first)))
            if abs(got - tokens) <= tokens // 100:
                break
            per_token *= tokens / max(1, got)
        self.reply = _text(rng, round(REPLY_TOKENS * per_token))
        self.follow_up: list[Mapping[str, Any]] = [
            *self.first,
            {"role": "assistant", "content": self.reply},
            {"role": "user", "content": _text(rng, round(FOLLOW_UP_TOKENS * per_token))},
        ]

    def answered(self, tokenizer: Tokenizer, block_size: int) -> tuple[int, ...]:
        """The first turn as the router serves it: tokenized, priced (its chain made) and answered
        (the answer kept by the tokenizer once it went); its ids."""
        first = tokenizer.turn(self.first)
        EngineTokens.of_turn(first, None, None).chain(block_size)
        if not tokenizer.replied(self.first, self.reply):
            raise RuntimeError("the tokenizer kept no answer of the first turn: refusing to report")
        return first.ids


# -- timing -------------------------------------------------------------------------------------------


def _figures(samples_s: list[float]) -> dict[str, float]:
    return {
        "calls": len(samples_s),
        "p50_us": percentile(samples_s, 50) * 1e6,
        "p99_us": percentile(samples_s, 99) * 1e6,
    }


def time_calls(fn: Callable[[], object], repeat: int, budget_s: float) -> dict[str, float]:
    """Single calls of `fn`, one untimed first: at most `repeat`, within `budget_s` (at least MIN_CALLS)."""
    fn()
    samples: list[float] = []
    gc.collect()
    gc.disable()
    try:
        deadline = time.monotonic() + budget_s
        while len(samples) < repeat and (len(samples) < MIN_CALLS or time.monotonic() < deadline):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return _figures(samples)


async def time_awaits(fn: Callable[[], Awaitable[object]], repeat: int, budget_s: float) -> dict[str, float]:
    """As time_calls, for a coroutine (the event loop runs between calls, as a router's does)."""
    await fn()
    samples: list[float] = []
    deadline = time.monotonic() + budget_s
    while len(samples) < repeat and (len(samples) < MIN_CALLS or time.monotonic() < deadline):
        t0 = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t0)
    return _figures(samples)


# -- the decision ---------------------------------------------------------------------------------------


class Decision:
    """A Placement over `replicas` replicas whose engines' events are believed: the first holds the
    conversation's first turn (its prompt's blocks), every other one a conversation of its own of the
    same length, each of which ended a turn there (it may come back: the price checks what a request
    would evict of it). Today's model holds the same in the router's own index."""

    def __init__(self, replicas: int, block_size: int, first_ids: tuple[int, ...], first_body: dict[str, Any]) -> None:
        specs = tuple(parse_replica(f"r{i}=http://127.0.0.1:{9000 + i}") for i in range(replicas))
        config = RouterConfig(replicas=specs)
        self.fleet = Fleet(specs, config.vnodes, config.hash_seed)
        self.placement = Placement(self.fleet, config.placement, config.bounded_load_floor)
        self.block_bytes = config.prefix_block_bytes
        capacity = 2 * (len(first_ids) // block_size) + 64  # blocks: room for what each holds
        whole = len(first_ids) // block_size * block_size
        for i, r in enumerate(self.fleet.replicas):
            # another conversation: the same length, other tokens (ids shifted past the first's)
            ids = first_ids[:whole] if i == 0 else tuple(t + 7 * i for t in first_ids[:whole])
            hashes = array("Q", range(i << 32, (i << 32) + whole // block_size))
            h = self.placement.truth.holdings(r.id, 0, capacity)
            h.accept(Batch(0, 0.0, 0, (Stored(hashes, None, array("Q", ids), block_size, MEDIUM_GPU, None, None),)))
            ended = EngineTokens(len(ids), ids, None, None, "tokenizer").chain(block_size)
            self.placement.truth.ended(r.id, ended, self.placement.clock())
            if i == 0:
                first = prompt_of(first_body, self.block_bytes)
                assert first is not None
                self.placement.index.insert(self.placement.of(r).holder, first.chain)

    def events(
        self, body: dict[str, Any], ids: tuple[int, ...], head: Chains | None = None
    ) -> Callable[[], tuple[int, Prompt]]:
        """The decision by the engines' events: the key's byte blocks, the engine's tokens, and price
        (which cuts them into the engine's blocks and matches them against every replica's). `head`:
        the chains of the conversation's earlier turn, kept by the tokenizer (a follow-up's)."""
        placement = self.placement

        def decide() -> tuple[int, Prompt]:
            prompt = prompt_of(body, self.block_bytes)
            assert prompt is not None
            prompt = replace(prompt, tokens=EngineTokens.of_turn(Turn(ids, {}, head), None, None))
            best = placement.price(prompt, (), None, placement.clock()).best
            return best, prompt

        return decide

    def model(self, body: dict[str, Any]) -> Callable[[], tuple[int, Prompt]]:
        """Today's decision: the key's byte blocks, priced by the router's own index."""
        placement = self.placement

        def decide() -> tuple[int, Prompt]:
            prompt = prompt_of(body, self.block_bytes)
            assert prompt is not None
            best = placement.price(prompt, (), None, placement.clock()).best
            return best, prompt

        return decide


# -- the run ------------------------------------------------------------------------------------------


async def render_replica(root: Path, max_len: int, logs: Path) -> VllmServer:
    """One vLLM replica with the render endpoints and a context of `max_len` tokens (more than the
    tiny model's positions: it only renders here)."""
    server = VllmServer(
        root,
        free_port(),
        max_num_seqs=1,
        max_model_len=max_len,
        scale_out=True,
        env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
        name="render",
        log=logs / "render.log",
    )
    await server.start()
    return server


async def measure(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    folder = Path(args.model_dir) if args.model_dir else None
    root = None
    if folder is None or args.render:
        try:
            root = find_vllm()
        except NotBuilt as exc:
            raise RuntimeError(f"{exc} (or --model-dir DIR --no-render)") from None
    folder = folder or root / "model"  # type: ignore[operator]
    tokenizer = Tokenizer(folder)
    conversations = {n: Conversation(tokenizer, n, args.seed) for n in args.tokens}
    rows: list[dict[str, Any]] = []
    for n, conv in conversations.items():
        first_ids = conv.answered(tokenizer, args.block_size)
        for turn, messages in (("first", conv.first), ("follow-up", conv.follow_up)):
            ids = tokenizer.chat(messages)
            if list(ids) != tokenizer.encode(tokenizer.render(messages)):
                raise RuntimeError(f"the tokenizer's {turn} turn of {n} tokens is not its whole text's tokens")
            rows.append({"tokens": n, "turn": turn, "prompt_tokens": len(ids), "first_ids": first_ids, "ids": ids})
    for row in rows:
        conv = conversations[row["tokens"]]
        messages = conv.first if row["turn"] == "first" else conv.follow_up
        progress(f"{row['tokens']:,} tokens, {row['turn']} turn: tokenizer")
        seed = root_of(None, None)
        head: Chains | None = None
        if row["turn"] != "first":
            # the first turn priced and answered again (the first row's timing kept it anew, chainless);
            # keeping its answer, after it went, is timed on its own: off the request's path
            conv.answered(tokenizer, args.block_size)
            row["replied"] = time_calls(
                partial(tokenizer.replied, conv.first, conv.reply), args.repeat, args.max_seconds
            )
            # the follow-up's chain extends the chain kept with its first turn's answer
            head = tokenizer.turn(messages).head
            if not head or (args.block_size, seed) not in head:
                raise RuntimeError("the follow-up did not find its first turn's answer kept: refusing to report")
        # a first turn finds no earlier turn kept, however often it is asked; the follow-up finds the
        # first turn with its answer kept, and tokenizes the question alone
        row["tokenizer"] = time_calls(partial(tokenizer.chat, messages), args.repeat, args.max_seconds)
        body = {"model": MODEL_NAME, "messages": messages}
        first_body = {"model": MODEL_NAME, "messages": conv.first}
        row["decision"] = {}
        for replicas in args.replicas:
            progress(f"{row['tokens']:,} tokens, {row['turn']} turn: decision on {replicas} replicas")
            d = Decision(replicas, args.block_size, row["first_ids"], first_body)
            events, model = d.events(body, row["ids"], head), d.model(body)
            best, prompt = events()
            known = d.placement.price(prompt, (), None, d.placement.clock()).row(0).cached_tokens
            # what the first replica holds of this prompt: the whole blocks of the first turn it shares
            # (never the prompt's last token: the engine computes that one anyway)
            first, ids = row["first_ids"], row["ids"][:-1]
            shared = next((i for i, (a, b) in enumerate(zip(first, ids, strict=False)) if a != b), None)
            expected = (min(len(first), len(ids)) if shared is None else shared) // args.block_size * args.block_size
            if best != 0 or known != expected:
                raise RuntimeError(
                    f"the event-fed decision picked {best} with {known:g} tokens held there, not 0 with "
                    f"{expected}: refusing to report"
                )
            if model()[0] != 0:
                raise RuntimeError("the model's decision did not pick the replica holding the conversation")
            assert prompt.tokens is not None
            row["decision"][replicas] = {
                "events": time_calls(events, args.repeat, args.max_seconds),
                "model": time_calls(model, args.repeat, args.max_seconds),
            }
        # the chain alone (EngineTokens keeps a request's chain once made: each call a new one here;
        # a follow-up's extends its first turn's)
        if head is None:
            chain = partial(request_chain, row["ids"], args.block_size, seed)
        else:
            chain = partial(extend_chain, head[(args.block_size, seed)], row["ids"], args.block_size, seed)
        row["chain"] = time_calls(chain, args.repeat, args.max_seconds)
    if args.render:
        assert root is not None
        longest = max(row["prompt_tokens"] for row in rows)
        max_len = (longest // args.block_size + 2) * args.block_size
        progress(f"starting a vLLM replica (a context of {max_len:,} tokens)")
        with tempfile.TemporaryDirectory(prefix="kvar-tokens-") as logs:
            server = await render_replica(root, max_len, Path(logs))
            try:
                async with aiohttp.ClientSession() as http:
                    for row in rows:
                        conv = conversations[row["tokens"]]
                        messages = conv.first if row["turn"] == "first" else conv.follow_up
                        data = orjson.dumps({"model": MODEL_NAME, "messages": messages})

                        async def render(data: bytes = data) -> tuple[int, ...]:
                            async with http.post(
                                server.url + "/v1/chat/completions/render",
                                data=data,
                                headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=30),
                            ) as r:
                                r.raise_for_status()
                                answer = await r.json(content_type=None, loads=orjson.loads)
                            return tuple(answer["token_ids"])

                        progress(f"{row['tokens']:,} tokens, {row['turn']} turn: render")
                        if await render() != row["ids"]:
                            raise RuntimeError(
                                f"vLLM's render of the {row['turn']} turn of {row['tokens']} tokens is not the "
                                "tokenizer's: refusing to report"
                            )
                        row["render"] = await time_awaits(render, args.repeat, args.max_seconds)
            finally:
                server.stop()
    for row in rows:
        del row["first_ids"], row["ids"]
    return {
        "benchmark": "tokens",
        "model_dir": str(folder),
        "block_size": args.block_size,
        "replicas": list(args.replicas),
        "repeat": args.repeat,
        "max_seconds": args.max_seconds,
        "reply_tokens": REPLY_TOKENS,
        "follow_up_tokens": FOLLOW_UP_TOKENS,
        "prefix_implementation": prefix.IMPLEMENTATION,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {_cpus()} CPUs",
        "rows": rows,
    }


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.max_seconds) and args.max_seconds > 0):
        print("router-bench tokens: --max-seconds must be a positive number", file=sys.stderr)
        return 2
    live = not args.json and sys.stderr.isatty()

    def progress(msg: str) -> None:
        if live:
            print(f"\r\x1b[K  {msg} ...", end="", file=sys.stderr, flush=True)

    try:
        result = asyncio.run(measure(args, progress))
    except (RuntimeError, TokenizerError, OSError, aiohttp.ClientError, TimeoutError) as exc:
        if live:
            print("\r\x1b[K", end="", file=sys.stderr)
        print(f"router-bench tokens: {exc}", file=sys.stderr)
        return 1
    if live:
        print("\r\x1b[K", end="", file=sys.stderr)
    print(json.dumps(result, indent=1) if args.json else render_tables(result))
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _time(f: dict[str, float] | None) -> str:
    """`p50 / p99` in ms from 1 ms up, else in µs."""
    if f is None:
        return "—"
    if f["p50_us"] >= 1000:
        return f"{f['p50_us'] / 1000:,.2f} / {f['p99_us'] / 1000:,.2f} ms"
    return f"{f['p50_us']:,.1f} / {f['p99_us']:,.1f} µs"


def render_tables(result: dict[str, Any]) -> str:
    sizes = result["replicas"]
    lines = [
        f"router-bench tokens: {result['model_dir']}, blocks of {result['block_size']} tokens, median / P99 of "
        f"single calls (up to {result['repeat']}), Python {result['python']}, {result['machine']}, "
        f"{result['prefix_implementation']} prefix index",
        "",
        "| prompt (tokens) | turn | tokenizer, in the router | render, vLLM round trip "
        "| engine blocks (chain) | "
        + " | ".join(f"decision, events, {n} replicas | decision, model, {n} replicas" for n in sizes)
        + " | the first turn's answer kept, after it went |",
        "|---:|---|---:|---:|---:|" + "---:|---:|" * len(sizes) + "---:|",
    ]
    for row in result["rows"]:
        cells = [
            f"{row['prompt_tokens']:,}",
            row["turn"],
            _time(row["tokenizer"]),
            _time(row.get("render")),
            _time(row["chain"]),
        ]
        for n in sizes:
            d = row["decision"].get(n) or row["decision"].get(str(n))
            cells += [_time(d["events"]), _time(d["model"])]
        cells.append(_time(row.get("replied")))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"The follow-up turn is the first, its {result['reply_tokens']}-token reply and a "
        f"{result['follow_up_tokens']}-token question; the tokenizer kept the first turn's tokens with its "
        "answer once the answer went (the last column, off the request's path) and tokenizes only the "
        "question, and its engine blocks extend the chain kept with them (hashing the blocks that "
        "follow it). A decision by events: the key's byte blocks, the engine's blocks "
        "and the price over every replica's events; by the model: the key's byte blocks and the price "
        "over the router's own index.",
    ]
    return "\n".join(lines)
