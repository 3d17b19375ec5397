"""`router-bench replay`: drive OpenAI-compatible endpoints with a workload; measure from the client.

Everything is measured on the client side, so every target (this router, a peer router, the
replicas directly) is judged the same way: KV hit rate from the responses' usage
(`prompt_tokens_details.cached_tokens`), latency and time to first token from the stream,
per-replica counts and the jump rate from the `X-Replica-Id` response header.

Session keys: each request carries its session id in `X-Session-ID` (and in any other header a
target reads it from, such as `X-SMG-Routing-Key`) and, in chat workloads, its user in the body's
`user` field. With `--no-session-keys` it carries neither, so a router knows where a
conversation's context is only from the prompt.

Arrivals are open-loop: sessions (or trace requests) start on their schedule whether or not
earlier ones have finished; within a session each turn waits for the previous reply plus a
think time. Times given on the command line and reported are engine seconds: wall seconds times
`--time-scale`, which must match the emulator's (router overhead is scaled along with them).

`--duration` is the whole run: what is still in flight when it ends is cut off. Requests cut
off are counted as such, not as errors, and are left out of latencies and hit rates (they have
no end; the output says how many). With `--drain`, sessions that started within `--duration`
play all their turns instead, for at most 3 x `--duration` in all (DRAIN_FACTOR; printed up front).
SIGINT and SIGTERM cut the run off the same way: the results so far are printed, marked
partial, and the exit status is 130 or 143.
"""

# It is past 450 lines as one benchmark: the replayer, its summary and its command line share the
# record of each request, and the docstring above is `router-bench replay --help`.

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import resource
import socket
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import uvloop

from router.bench.bound import BoundTrace
from router.bench.live import TICK_S, Progress, Stop, Stopped, partial_headline, run_until
from router.bench.workloads import (
    LongDocSpec,
    SessionPlan,
    SessionsSpec,
    TraceError,
    TraceRequest,
    generate_longdoc,
    generate_sessions,
    load_trace,
    trace_prompt,
)
from router.measures import coefficient_of_variation, jump_rate, kv_hit_rate, latency_summary
from router.ring import xxh3_64

WORKLOADS = ("sessions", "longdoc", "mooncake-conversation", "mooncake-synthetic")
CHATS = ("sessions", "longdoc")  # generated multi-turn chats; the others are traces
DRAIN_FACTOR = 3.0  # --drain, and library callers: started sessions may run on until 3 x --duration
REPLICA_HEADERS = ("X-Replica-Id", "X-Router-Replica")


@dataclass
class Record:
    session: str
    turn: int
    target: str
    replica: str | None = None
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None  # engine seconds
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    cut: bool = False  # still in flight when the run was cut off: neither ok nor an error
    call: dict[str, Any] | None = None  # the tool call the answer made (`tool_loop`), as the next turn sends it back


@dataclass(frozen=True)
class ReplayOptions:
    targets: tuple[str, ...]
    workload: str
    trace: str | None = None
    spread: str = "round-robin"
    duration_s: float | None = None  # engine seconds of arrivals (with cut_off: of the whole run)
    cut_off: bool = False  # True: at duration_s, what is in flight is cut off; False: it drains
    requests: int | None = None
    speedup: float = 1.0  # trace time compression
    time_scale: float = 1.0
    timeout_s: float = 600.0  # engine seconds per request
    model: str | None = "emulated-llm"
    max_inflight: int = 4096
    concurrency: int | None = None  # trace replays: at most this many requests at once, in trace order
    output_tokens: int | None = None  # cap on every request's max_tokens
    seed: int = 1
    spec: SessionsSpec | None = None
    longdoc: LongDocSpec | None = None
    key_headers: tuple[str, ...] = ("X-Session-ID",)  # headers that carry the session id
    session_keys: bool = True  # False: no key header and no `user` field at all (keyless workloads)
    # fields every request body gets besides the workload's (`router-bench fleet --engine vllm`:
    # ignore_eos, so that a random model's replies are max_tokens long for every target)
    body_fields: tuple[tuple[str, Any], ...] = ()
    # a latency target, engine seconds: (time to first token, time per output token after it); the
    # requests answered within both are counted (`slo_met`), for goodput
    slo: tuple[float, float] | None = None
    # router-emulator's KV block size: every request sent is kept, cut into its blocks, for the run's
    # bound (router.bench.bound); None: not kept
    bound_block_size: int | None = None
    # the agents' tool loops: every turn but a session's last must call a tool (`tool_choice`
    # `required`; router-emulator answers with a call), and the next turn sends the call back with
    # the tool's result (the turn's text) as a `tool` message, as a coding agent does
    tool_loop: bool = False


# the tools a coding agent's tool loop offers (`tool_loop`): what its calls name
AGENT_TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("read_file", "edit_file", "run_command")
]


class Replayer:
    def __init__(self, opts: ReplayOptions, progress: Callable[[str], None] | None = None) -> None:
        if not opts.targets:
            raise ValueError("at least one --target is needed")
        self.opts = opts
        self.records: list[Record] = []
        self.bound = BoundTrace(opts.bound_block_size) if opts.bound_block_size else None  # as records
        self._rr = itertools.cycle(opts.targets)
        self._progress = progress
        self._issued = 0
        self._inflight = 0
        self._errors = 0
        self._ok = 0
        self._cached = 0
        self._prompt = 0
        self._cut_sessions = 0
        self._turns_dropped = 0  # turns never sent: an earlier turn of their conversation failed
        self._tasks: list[asyncio.Future[Any]] = []
        self._deadline: float | None = None  # perf_counter when the run is cut off or the drain capped
        self._slots = asyncio.Semaphore(opts.max_inflight)
        self._session: aiohttp.ClientSession | None = None
        self._started: float | None = None
        self._span_s = 0.0  # engine seconds the arrivals span, for the progress bar

    # -- targets ---------------------------------------------------------------------------------

    def pick_target(self, session: str) -> str:
        if len(self.opts.targets) == 1:
            return self.opts.targets[0]
        if self.opts.spread == "session":
            return self.opts.targets[xxh3_64(session) % len(self.opts.targets)]
        return next(self._rr)

    def _budget_left(self) -> bool:
        return self.opts.requests is None or self._issued < self.opts.requests

    # -- one request -----------------------------------------------------------------------------

    async def send(self, session: str, turn: int, path: str, body: dict[str, Any], headers: dict[str, str]) -> Record:
        target = self.pick_target(session)
        rec = Record(session=session, turn=turn, target=target)
        self.records.append(rec)
        number = self.bound.add(path, body) if self.bound is not None else 0
        self._issued += 1
        scale = self.opts.time_scale
        assert self._session is not None
        async with self._slots:
            self._inflight += 1
            t0 = time.perf_counter()
            try:
                timeout = aiohttp.ClientTimeout(total=self.opts.timeout_s / scale)
                async with self._session.post(
                    target.rstrip("/") + path, data=orjson.dumps(body), headers=headers, timeout=timeout
                ) as resp:
                    rec.replica = next((resp.headers[h] for h in REPLICA_HEADERS if h in resp.headers), None)
                    if resp.status != 200:
                        rec.error = f"http {resp.status}"
                        await resp.read()
                        return rec
                    await self._read_stream(resp, rec, t0)
            except asyncio.CancelledError:
                rec.cut = True  # the run ended (its duration, or a signal) with this one in flight
                raise
            except TimeoutError:
                rec.error = "timeout"
            except aiohttp.ClientPayloadError:
                rec.error = "stream cut"
            except (aiohttp.ClientError, OSError) as exc:
                rec.error = f"connection: {type(exc).__name__}"
            finally:
                self._inflight -= 1
                if self.bound is not None:
                    self.bound.ended(number, rec.text if rec.ok else None)
                if rec.error:
                    self._errors += 1
                elif rec.ok:
                    self._ok += 1
                    self._cached += rec.cached_tokens
                    self._prompt += rec.prompt_tokens
                self._report_progress()
        return rec

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: Record, t0: float) -> None:
        scale = self.opts.time_scale
        parts: list[str] = []
        call: dict[str, Any] | None = None  # the answer's tool call, its arguments' deltas joined
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                event = orjson.loads(data)
                if "error" in event:
                    rec.error = "stream error"
                    return
                for choice in event.get("choices") or ():
                    piece = choice.get("text")
                    if piece is None:
                        delta = choice.get("delta") or {}
                        piece = delta.get("content")
                        for part in delta.get("tool_calls") or ():
                            if call is None:  # its opening: the id and name (vLLM's carries no arguments)
                                call = {"id": part["id"], "type": "function", "function": {"arguments": ""}}
                                call["function"]["name"] = part["function"]["name"]
                            more = part["function"].get("arguments") or ""
                            call["function"]["arguments"] += more
                            piece = more or piece
                    if piece:
                        if rec.ttft_s is None:
                            rec.ttft_s = (time.perf_counter() - t0) * scale
                        parts.append(str(piece))
                usage = event.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
                    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
                rec.error = "bad event"  # a target that breaks the protocol fails its request, not the replay
                return
        if not done:
            rec.error = "stream cut"
            return
        rec.e2e_s = (time.perf_counter() - t0) * scale
        if rec.ttft_s is None:
            rec.ttft_s = rec.e2e_s
        rec.text = "".join(parts)
        if call is not None:  # what the engine generated (and caches) is the call's text
            rec.call = call
            try:
                rec.text = str(orjson.loads(call["function"]["arguments"]).get("text", ""))
            except (orjson.JSONDecodeError, AttributeError):
                rec.text = ""
        rec.ok = True

    def describe(self) -> str:
        """Where the run stands: a bar, requests answered, in flight, failed, hit rate, time left."""
        now = time.perf_counter()
        done = self._issued / self.opts.requests if self.opts.requests else 0.0
        if self._started is not None and self._span_s:
            done = max(done, (now - self._started) * self.opts.time_scale / self._span_s)
        done = min(done, 1.0)
        bar = "#" * int(done * 24)
        hit = f"{kv_hit_rate(self._cached, self._prompt):.1%}" if self._prompt else "n/a"
        left = ""
        if self._deadline is not None:
            left = f"  {max(self._deadline - now, 0.0):.0f} s left" + ("" if self.opts.cut_off else " at most")
        return (
            f"[{bar:<24}] {done:4.0%}  done {self._ok + self._errors}  in flight {self._inflight}  "
            f"errors {self._errors}  KV hit {hit}{left}"
        )

    def _report_progress(self) -> None:
        if self._progress is not None:
            self._progress(self.describe())

    async def _tick(self) -> None:
        while True:  # a run that answers nothing for a while still says where it stands
            await asyncio.sleep(TICK_S)
            self._report_progress()

    # -- workloads -------------------------------------------------------------------------------

    def _body(self, extra: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
        if self.opts.model:
            body["model"] = self.opts.model
        body.update(extra)
        body.update(self.opts.body_fields)
        if self.opts.output_tokens is not None:
            body["max_tokens"] = min(body.get("max_tokens", self.opts.output_tokens), self.opts.output_tokens)
        return body

    def _key_headers(self, session: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        return headers | dict.fromkeys(self.opts.key_headers, session) if self.opts.session_keys else headers

    async def _session_run(self, plan: SessionPlan, deadline: float) -> None:
        scale = self.opts.time_scale
        messages: list[dict[str, Any]] = [{"role": "system", "content": plan.system}]
        for k, turn in enumerate(plan.turns, 1):
            if k > 1:
                await asyncio.sleep(turn.think_s / scale)
            if not self._budget_left():
                return
            if time.perf_counter() > deadline:
                self._cut_sessions += 1  # past the drain cap: counted, so a slow target is visible
                return
            called = messages[-1].get("tool_calls") if k > 1 else None
            if called:  # the tool's result answers the call
                messages.append({"role": "tool", "tool_call_id": called[0]["id"], "content": turn.user_text})
            else:
                messages.append({"role": "user", "content": turn.user_text})
            body: dict[str, Any] = {"messages": list(messages), "max_tokens": turn.max_tokens}
            if self.opts.tool_loop and k < len(plan.turns):
                body["tools"], body["tool_choice"] = AGENT_TOOLS, "required"
            if self.opts.session_keys:
                body["user"] = plan.user
            rec = await self.send(
                plan.session_id, k, "/v1/chat/completions", self._body(body), self._key_headers(plan.session_id)
            )
            if not rec.ok:
                if not rec.cut:
                    self._turns_dropped += len(plan.turns) - k
                return  # a failed turn ends the conversation
            if rec.call is not None:
                messages.append({"role": "assistant", "content": None, "tool_calls": [rec.call]})
            else:
                messages.append({"role": "assistant", "content": rec.text})
            rec.text, rec.call = "", None

    async def _session_counted(self, plan: SessionPlan, deadline: float) -> None:
        try:
            await self._session_run(plan, deadline)
        except asyncio.CancelledError:
            self._cut_sessions += 1  # cut off with turns to go (in flight or still to come)
            raise

    def _plans(self) -> Iterator[SessionPlan]:
        if self.opts.workload == "longdoc":
            return generate_longdoc(self.opts.longdoc or LongDocSpec())
        return generate_sessions(self.opts.spec or SessionsSpec())

    async def _run_sessions(self, start: float) -> None:
        scale = self.opts.time_scale
        duration = self.opts.duration_s if self.opts.duration_s is not None else 60.0
        self._span_s = duration
        # without cut_off, sessions that started within `duration` play all their turns, so every target is
        # compared on the same conversations; DRAIN_FACTOR bounds the run if a target is very slow
        deadline = start + DRAIN_FACTOR * duration / scale
        for plan in self._plans():
            if plan.start_s > duration or not self._budget_left():
                break
            await _sleep_until(start + plan.start_s / scale)
            self._tasks.append(asyncio.ensure_future(self._session_counted(plan, deadline)))
        await asyncio.gather(*self._tasks)

    async def _run_trace(self, rows: list[TraceRequest], start: float) -> None:
        scale = self.opts.time_scale
        gate = asyncio.Semaphore(self.opts.concurrency) if self.opts.concurrency else None
        tasks = self._tasks
        t_first = rows[0].timestamp_s
        self._span_s = (rows[-1].timestamp_s - t_first) / self.opts.speedup
        if self.opts.duration_s is not None:
            self._span_s = min(self._span_s, self.opts.duration_s)
        for row in rows:
            at = (row.timestamp_s - t_first) / self.opts.speedup
            if self.opts.duration_s is not None and at > self.opts.duration_s:
                break
            if not self._budget_left():
                break
            await _sleep_until(start + at / scale)
            body = self._body({"prompt": trace_prompt(row), "max_tokens": max(1, row.output_length)})
            request = self.send(row.session, row.turn, "/v1/completions", body, self._key_headers(row.session))
            if gate is not None:
                await gate.acquire()
                tasks.append(asyncio.ensure_future(_release_after(request, gate)))
            else:
                tasks.append(asyncio.ensure_future(request))
        await asyncio.gather(*tasks)

    def plan_line(self) -> str | None:
        """When the run will end, said up front (None when only the workload's end says)."""
        scale, d = self.opts.time_scale, self.opts.duration_s
        if self.opts.workload in CHATS:
            d = d if d is not None else 60.0
            if not self.opts.cut_off:
                return (
                    f"sessions start for {d / scale:.0f} s and play all their turns: "
                    f"the run ends within {DRAIN_FACTOR * d / scale:.0f} s (sessions still going then are cut)"
                )
        if d is None:
            return None
        if self.opts.cut_off:
            return f"the run ends after {d / scale:.0f} s; requests in flight then are cut off (not errors)"
        return f"requests start for {d / scale:.0f} s; those in flight then run to their end"

    async def run(self, stop: asyncio.Event | None = None) -> dict[str, Any]:
        """The workload's results; when `stop` is set, or with cut_off when duration_s ends, what is in
        flight is cut off (counted as cut, not as errors) and the results so far come back."""
        rows: list[TraceRequest] | None = None
        if self.opts.workload not in CHATS:
            if not self.opts.trace:
                raise TraceError(f"--workload {self.opts.workload} needs --trace PATH (a Mooncake-format JSONL file)")
            rows = load_trace(self.opts.trace, self.opts.requests)
        connector = aiohttp.TCPConnector(limit=self.opts.max_inflight, force_close=False)
        cpu0 = _cpu_seconds()
        t0 = time.perf_counter()
        async with aiohttp.ClientSession(connector=connector) as session:
            self._session = session
            start = self._started = time.perf_counter()
            scale = self.opts.time_scale
            duration = self.opts.duration_s if self.opts.duration_s is not None or rows else 60.0
            if self.opts.cut_off and duration is not None:
                self._deadline = start + duration / scale
            elif rows is None and duration is not None:
                self._deadline = start + DRAIN_FACTOR * duration / scale
            work = self._run_sessions(start) if rows is None else self._run_trace(rows, start)
            ticker = asyncio.ensure_future(self._tick()) if self._progress is not None else None
            try:
                cut_at = self._deadline if self.opts.cut_off else None
                finished = await run_until(work, stop or asyncio.Event(), _monotonic_at(cut_at))
                if not finished:  # the arrivals stopped: now what they started
                    for task in self._tasks:
                        task.cancel()
                    if self._tasks:
                        await asyncio.wait(self._tasks)
            finally:
                if ticker is not None:
                    ticker.cancel()
                    await asyncio.wait([ticker])
        wall = time.perf_counter() - t0
        return summarize(self.records, self.opts, wall, _cpu_seconds() - cpu0, self._cut_sessions, self._turns_dropped)


def _monotonic_at(t: float | None) -> float | None:
    """A perf_counter time as the monotonic clock's (run_until's deadline)."""
    return None if t is None else time.monotonic() + (t - time.perf_counter())


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _release_after(request: Awaitable[Record], gate: asyncio.Semaphore) -> Record:
    try:
        return await request
    finally:
        gate.release()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def tpot(r: Record) -> float | None:
    """Time per output token after the first (engine seconds); None for an answer of one token or
    without its times."""
    if r.ttft_s is None or r.e2e_s is None or r.completion_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)


def meets(r: Record, slo: tuple[float, float]) -> bool:
    """Whether an answer met a (TTFT, TPOT) target."""
    per_token = tpot(r)
    return r.ttft_s is not None and r.ttft_s <= slo[0] and (per_token is None or per_token <= slo[1])


def summarize(
    records: list[Record],
    opts: ReplayOptions,
    wall_s: float,
    cpu_s: float,
    cut_sessions: int = 0,
    turns_dropped: int = 0,
) -> dict[str, Any]:
    # requests cut off at the run's end are neither ok nor errors; having no end, they are in no latency
    ok = [r for r in records if r.ok]
    later = [r for r in ok if r.turn > 1]
    # every replica that answered anything counts, with 0 if none of its answers succeeded; with several
    # targets, a target that never answered at all counts as a replica with 0 too
    seen_as: dict[str, str] = {}
    for r in records:
        if r.replica:
            seen_as.setdefault(r.target, r.replica)
    per_replica: Counter[str] = Counter({r.replica: 0 for r in records if r.replica})
    if len(opts.targets) > 1:
        per_replica.update({t: 0 for t in opts.targets if t not in seen_as})
    for r in ok:
        per_replica[r.replica or seen_as.get(r.target, r.target)] += 1
    by_session: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for r in ok:
        by_session[r.session].append((r.turn, r.replica or r.target))
    paths = {s: [rep for _, rep in sorted(turns)] for s, turns in by_session.items()}
    errors = Counter(r.error for r in records if r.error)
    return {
        "workload": opts.workload,
        "targets": list(opts.targets),
        "spread": opts.spread if len(opts.targets) > 1 else "single",
        "time_scale": opts.time_scale,
        "session_keys": opts.session_keys,
        "duration_s": opts.duration_s,
        "cut_off_at_duration": opts.cut_off,
        "requests": len(records),
        "ok": len(ok),
        "errors": dict(errors),
        "cut_off": sum(r.cut for r in records),
        "sessions": len(paths),
        "sessions_cut": cut_sessions,
        "turns_dropped": turns_dropped,
        "later_turns": len(later),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "completion_tokens": sum(r.completion_tokens for r in ok),
        "kv_hit_rate": kv_hit_rate(sum(r.cached_tokens for r in ok), sum(r.prompt_tokens for r in ok)),
        "kv_hit_rate_later_turns": kv_hit_rate(
            sum(r.cached_tokens for r in later), sum(r.prompt_tokens for r in later)
        ),
        "e2e_s": latency_summary([r.e2e_s for r in ok if r.e2e_s is not None]),
        "e2e_later_turns_s": latency_summary([r.e2e_s for r in later if r.e2e_s is not None]),
        "ttft_s": latency_summary([r.ttft_s for r in ok if r.ttft_s is not None]),
        "ttft_later_turns_s": latency_summary([r.ttft_s for r in later if r.ttft_s is not None]),
        "tpot_s": latency_summary([t for r in ok if (t := tpot(r)) is not None]),
        "slo": list(opts.slo) if opts.slo is not None else None,
        "slo_met": sum(meets(r, opts.slo) for r in ok) if opts.slo is not None else None,
        "per_replica": dict(sorted(per_replica.items())),
        "load_cv": coefficient_of_variation(per_replica.values()),
        "jump_rate": jump_rate(paths),
        "wall_s": wall_s,
        "client_cpu_s": cpu_s,
        "client_cpu_share": cpu_s / wall_s if wall_s > 0 else 0.0,
    }


# -- command line ---------------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="drive OpenAI-compatible endpoints with a workload and report hit rate, latency, balance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="URL",
        help="base URL of a router or replica; repeat to spread requests over several",
    )
    p.add_argument("--workload", choices=WORKLOADS, default="sessions", help="what to send (default sessions)")
    p.add_argument("--trace", metavar="PATH", help="the Mooncake-format JSONL file for trace workloads")
    p.add_argument(
        "--spread",
        choices=("round-robin", "session"),
        default="round-robin",
        help="how several targets share requests: in turn, or each session pinned to one",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="the whole run, engine seconds: what is in flight at its end is cut off, counted apart from "
        "errors (sessions, longdoc: default 60; traces: the whole trace)",
    )
    p.add_argument(
        "--drain",
        action="store_true",
        help="let sessions started within --duration play all their turns (the run then takes up to "
        f"{DRAIN_FACTOR:g} x --duration; printed up front); trace requests run to their end",
    )
    p.add_argument("--requests", type=int, default=None, metavar="N", help="send at most N requests")
    p.add_argument(
        "--rate", type=float, default=None, help="sessions, longdoc: new sessions per engine second (2, 0.5)"
    )
    p.add_argument("--turns", default=None, metavar="MIN-MAX", help="sessions, longdoc: turns per session (3-8, 3-6)")
    p.add_argument("--think", type=float, default=None, metavar="S", help="sessions, longdoc: mean think time (8)")
    p.add_argument("--users", type=int, default=None, help="sessions workload: number of users (200)")
    p.add_argument(
        "--no-session-keys",
        action="store_true",
        help="send no session key: no X-Session-ID header, no user field (the prompt is all a router sees)",
    )
    p.add_argument("--speedup", type=float, default=1.0, help="trace workloads: compress the trace's clock by this")
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="trace workloads: at most this many requests in flight, sent in trace order",
    )
    p.add_argument("--output-tokens", type=int, default=None, metavar="N", help="cap every request's max_tokens")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the emulator's --time-scale: engine seconds per wall second (default 1)",
    )
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request timeout, engine seconds")
    p.add_argument("--model", default="emulated-llm", help="model name to send (default emulated-llm; '' omits it)")
    p.add_argument("--max-inflight", type=int, default=4096, help="client cap on concurrent requests (default 4096)")
    p.add_argument("--seed", type=int, default=1, help="workload random seed (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_cli)


def options_from_args(args: argparse.Namespace) -> ReplayOptions:
    def positive(name: str, value: float | None) -> None:
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")

    for name in (
        "duration",
        "requests",
        "rate",
        "speedup",
        "time_scale",
        "timeout",
        "concurrency",
        "output_tokens",
        "max_inflight",
        "think",
        "users",
    ):
        positive("--" + name.replace("_", "-"), getattr(args, name))
    chat_changes: dict[str, Any] = {"seed": args.seed}  # what sessions and longdoc share
    if args.turns is not None:
        lo, sep, hi = args.turns.partition("-")
        try:
            chat_changes["turns_min"], chat_changes["turns_max"] = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"--turns must look like 3-8 or 5, got {args.turns!r}") from None
    if args.think is not None:
        chat_changes["think_s"] = args.think
    if args.rate is not None:
        chat_changes["rate"] = args.rate
    spec_changes = dict(chat_changes)
    if args.users is not None:
        spec_changes["users"] = args.users
    for url in args.target:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--target must be an http(s) URL, got {url!r}")
    return ReplayOptions(
        targets=tuple(args.target),
        workload=args.workload,
        trace=args.trace,
        spread=args.spread,
        duration_s=args.duration,
        requests=args.requests,
        speedup=args.speedup,
        time_scale=args.time_scale,
        timeout_s=args.timeout,
        model=args.model or None,
        max_inflight=args.max_inflight,
        concurrency=args.concurrency,
        output_tokens=args.output_tokens,
        seed=args.seed,
        cut_off=not args.drain,
        spec=SessionsSpec(**spec_changes),
        longdoc=LongDocSpec(**chat_changes),
        session_keys=not args.no_session_keys,
    )


def run_cli(args: argparse.Namespace) -> int:
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        print(f"router-bench replay: {exc}", file=sys.stderr)
        return 2
    unreachable = [f"{t} ({why})" for t in opts.targets if (why := _unreachable(t)) is not None]
    if unreachable:  # said at once, not after a whole run of connection errors
        print(f"router-bench replay: cannot reach {', '.join(unreachable)}: is it running?", file=sys.stderr)
        return 2
    progress = Progress()
    replayer = Replayer(opts, progress.show if progress.enabled else None)

    async def main() -> tuple[dict[str, Any], Stopped | None]:
        stop = Stop().install()
        try:
            return await replayer.run(stop.event), stop.stopped
        finally:
            stop.uninstall()

    plan = replayer.plan_line()
    if plan is not None:
        print(f"router-bench replay: {plan}", file=sys.stderr, flush=True)
    try:
        result, stopped = uvloop.run(main())
    except TraceError as exc:
        print(f"router-bench replay: {exc}", file=sys.stderr)
        return 2
    progress.clear()
    if stopped is not None:
        stopped.mark(result)
    print(json.dumps(result, indent=1) if args.json else render(result))
    if stopped is not None:
        return stopped.exit_status
    return 0 if result["ok"] else 1


def _unreachable(target: str, timeout_s: float = 3.0) -> str | None:
    """Why a TCP connection to `target`'s host and port cannot be made, or None when it can."""
    url = urlsplit(target)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "localhost", port), timeout=timeout_s).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def render(r: dict[str, Any]) -> str:
    def lat(d: dict[str, float]) -> str:
        if not d.get("n"):
            return "n/a"
        return f"mean {d['mean']:.3f}  p50 {d['p50']:.3f}  p90 {d['p90']:.3f}  p99 {d['p99']:.3f}"

    errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "none"
    lines = [partial_headline(r)] if "partial" in r else []
    lines += [
        f"{r['workload']} → {len(r['targets'])} target(s), spread {r['spread']}, time scale {r['time_scale']:g}",
        f"requests {r['requests']}  ok {r['ok']}  errors {errors}  cut off at the end {r['cut_off']}  "
        f"sessions {r['sessions']}  later turns {r['later_turns']}"
        + (f"  sessions cut short {r['sessions_cut']}" if r["sessions_cut"] else "")
        + (f"  turns not sent after a failed turn {r['turns_dropped']}" if r.get("turns_dropped") else ""),
        (
            f"KV hit rate        {r['kv_hit_rate']:.1%}  (later turns {r['kv_hit_rate_later_turns']:.1%})"
            if r["ok"]
            else "KV hit rate        n/a (no answers)"
        ),
        f"e2e s, later turns {lat(r['e2e_later_turns_s'])}",
        f"TTFT s, later      {lat(r['ttft_later_turns_s'])}",
        f"e2e s, all         {lat(r['e2e_s'])}",
        (
            f"load CV            {r['load_cv']:.3f} over {len(r['per_replica'])} replicas   "
            f"jump rate {r['jump_rate']:.1%}"
            if r["ok"]
            else "load CV            n/a (no answers)"
        ),
        f"client             {r['wall_s']:.1f} s wall, {r['client_cpu_share']:.0%} of one CPU",
    ]
    if r["cut_off"]:
        lines.append(
            f"  ({r['cut_off']} requests were in flight when the run ended: cut off, not errors, "
            "and in no latency or hit rate above)"
        )
    return "\n".join(lines)
