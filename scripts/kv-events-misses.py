"""Where router-serve's event-fed predictions miss on real vLLM, and why: one request at a time.

    python scripts/kv-events-misses.py --blocks 128 --replicas 2 --rate 0.3 --duration 60 --out misses

Starts `--replicas` vLLM replicas (router.bench.vllm: scripts/build-vllm.sh) of `--blocks` KV blocks
of 32 tokens, each publishing its KV-cache events, started as vLLM's docs start it (no `--enable-
scale-out`: its render endpoints answer 403), and router-serve as shipped in front (events found
through /kv_event_sources, the model's tokenizer found from /v1/models). It sends `router-bench
fleet --engine vllm`'s sessions chats (their text at a quarter of the emulator's length, replies of
50-250 tokens with ignore_eos) and, for every request:

- asks the router where it would go and what it predicts there (`POST /admin/route`, just before
  sending it: the same decision, nothing counted in flight), then sends it through the router and
  reads the engine's `cached_tokens`;
- follows every replica's events itself, on a socket of its own, into the same index the router
  keeps (router.kvevents.holdings), each message timestamped on arrival; afterwards each request's
  tokens (the replica's /tokenize of its messages) give what that replica held of it when the router decided, and
  the least and the most it held from then until the request's first token.

A request whose cached tokens were not predicted exactly is then "evicted while waiting" (the
engine reported less, and held no more than that at some point before the request ran, or evicted
a block of its prompt at or before what it reported: in the step that scheduled it, whose message
may come after the first token, its removals and the request's own blocks arrive together),
"stored meanwhile" (it reported more, and had stored that much before the request ran), "model"
(priced by the router's model), or "not split" (neither). `records.json` in `--out` has every
request; the summary is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from array import array
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import zmq
import zmq.asyncio

from router.bench.common import free_port
from router.bench.vllm import VllmServer, find_vllm, start_all
from router.bench.workloads import SessionPlan, SessionsSpec, generate_sessions
from router.kvevents.holdings import Holdings
from router.kvevents.tokens import request_chain, root_of
from router.kvevents.wire import Batch, Removed, frames_of
from router.prefix import PrefixIndex

MODEL = "tiny"
TOKEN = "misses-token-0123"
BLOCK = 32
GRACE_S = 1.0  # the events of a request's own first step, published after its first token streamed


async def believed(http: aiohttp.ClientSession, url: str, replicas: int, timeout: float = 60.0) -> None:
    """Until the router believes every replica's events."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with http.get(url + "/metrics") as r:
                lines = [ln for ln in (await r.text()).splitlines() if ln.startswith("router_kv_events_believed{")]
            if len(lines) == replicas and all(ln.endswith(" 1.0") for ln in lines):
                return
        await asyncio.sleep(0.5)
    raise RuntimeError("the router did not believe every replica's events")


async def converse(
    http: aiohttp.ClientSession, url: str, plan: SessionPlan, t0: float, records: list[dict[str, Any]]
) -> None:
    """One session, turn after turn: explain, send, record."""
    await asyncio.sleep(max(0.0, plan.start_s - (time.monotonic() - t0)))
    messages: list[dict[str, str]] = [{"role": "system", "content": plan.system}]
    for k, turn in enumerate(plan.turns):
        await asyncio.sleep(turn.think_s)
        messages.append({"role": "user", "content": turn.user_text})
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": turn.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        session = {"X-Session-ID": plan.session_id}
        explain_headers = session | {"Authorization": f"Bearer {TOKEN}"}
        async with http.post(url + "/admin/route", data=orjson.dumps(body), headers=explain_headers) as r:
            explained = await r.json()
        decided = time.monotonic()
        reply: list[str] = []
        usage: dict[str, Any] = {}
        first = None
        async with http.post(url + "/v1/chat/completions", json=body, headers=session) as r:
            replica = r.headers.get("X-Router-Replica", "")
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        first = first or time.monotonic()
                        reply.append(text)
        candidate = {c["replica"]: c for c in explained.get("candidates", [])}.get(replica, {})
        records.append(
            {
                "session": plan.session_id,
                "turn": k,
                "replica": replica,
                "predicted": candidate.get("cached_tokens"),
                "from": candidate.get("cached_from"),
                "reported": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                "prompt_tokens": usage.get("prompt_tokens"),
                "t_decided": decided,
                "t_first": first or time.monotonic(),
                "messages": list(messages),
            }
        )
        messages.append({"role": "assistant", "content": "".join(reply)})


def classify(records: list[dict[str, Any]], timeline: list[tuple[float, int, Batch]], blocks: int, n: int) -> None:
    """Replays the events in arrival order: what each request's replica held of it when the router
    decided, and the least and most it held until its first token; then each request's kind."""
    holds = [Holdings(PrefixIndex(), blocks) for _ in range(n)]
    for h in holds:
        h.caught_up()  # subscribed before the engine's first message
    chains = [request_chain(r["ids"], BLOCK, root_of(None, None)) for r in records]

    def held(h: Holdings, chain: array[int]) -> int:
        return h.match(chain) * BLOCK

    positions = [{k: j for j, k in enumerate(chain)} for chain in chains]
    for t, i, batch in sorted(timeline, key=lambda x: x[0]):
        gpu, index = holds[i].tiers["GPU"].holder, holds[i].index
        named = (index.key_of(gpu, h) for e in batch.events if isinstance(e, Removed) for h in e.hashes)
        removed = [k for k in named if k is not None]
        holds[i].accept(batch)
        for r, chain, at in zip(records, chains, positions, strict=True):
            if r["index"] != i:
                continue
            if t <= r["t_decided"]:
                r["held_at_decision"] = held(holds[i], chain)
                continue
            # the step that scheduled a request may publish after its first token has streamed
            if t <= r["t_first"] + GRACE_S:
                gone = [at[k] for k in removed if k in at]
                if gone:  # the first block of this prompt the engine evicted since the decision
                    r["first_evicted"] = min(min(gone) * BLOCK, r.get("first_evicted", 1 << 30))
            if t <= r["t_first"]:
                now, base = held(holds[i], chain), r.get("held_at_decision", 0)
                r["held_min"] = min(now, r.get("held_min", base))
                r["held_max"] = max(now, r.get("held_max", base))
    for r in records:
        p, got = r["predicted"], r["reported"]
        if p is None or got is None:
            kind = "no prediction"
        elif p == got:
            kind = "exact"
        elif r["from"] != "events":
            kind = "model"
        elif got < p and min(r.get("held_min", p), r.get("first_evicted", p)) <= got:
            kind = "evicted while waiting"
        elif got > p and r.get("held_max", p) >= got:
            kind = "stored meanwhile"
        else:
            kind = "not split"
        r["kind"] = kind


async def run(args: argparse.Namespace) -> None:
    root = find_vllm()
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = [
        VllmServer(
            root,
            free_port(),
            max_num_seqs=8,
            kv_blocks=args.blocks,
            max_model_len=min(8192, (args.blocks - 1) * BLOCK),
            events_port=free_port(),
            replay_port=free_port(),
            env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
            name=f"v{i}",
            log=logs / f"v{i}.log",
        )
        for i in range(args.replicas)
    ]
    await start_all(servers)
    timeline: list[tuple[float, int, Batch]] = []
    ctx = zmq.asyncio.Context.instance()

    async def follow(i: int, server: VllmServer) -> None:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{server.events_port}")
        try:
            while True:
                frames = await sub.recv_multipart()
                timeline.append((time.monotonic(), i, frames_of(frames)))
        finally:
            sub.close(linger=0)

    followers = [asyncio.create_task(follow(i, s)) for i, s in enumerate(servers)]
    await asyncio.sleep(1.0)  # subscribed before the first message (no request has run yet)
    port = free_port()
    cmd = [sys.executable, "-m", "router.proxy.cli", "--port", str(port), "--state", "none"]
    cmd += ["--rebalance", "--warmup", "--admin-token", TOKEN]
    for s in servers:
        cmd += ["--replica", s.url]
    with open(logs / "router.log", "wb") as log:
        router = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=log, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    records: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession() as http:
            await believed(http, url, len(servers))
            spec = SessionsSpec(
                rate=args.rate, system_tokens=150, first_tokens=(50, 300), user_tokens=(5, 50), seed=args.seed
            )
            plans = []
            for plan in generate_sessions(spec):
                if plan.start_s > args.duration:
                    break
                plans.append(plan)
            t0 = time.monotonic()
            await asyncio.gather(*(converse(http, url, p, t0, records) for p in plans))
            by_port = {s.url.rsplit(":", 1)[1]: i for i, s in enumerate(servers)}
            for r in records:  # the engine's tokens of each request, from its replica's /tokenize
                r["index"] = by_port.get(r["replica"].rsplit(":", 1)[-1], 0)
                body = {"model": MODEL, "messages": r.pop("messages"), "add_generation_prompt": True}
                async with http.post(servers[r["index"]].url + "/tokenize", json=body) as resp:
                    r["ids"] = (await resp.json())["tokens"]
    finally:
        router.terminate()
        await router.wait()
        for task in followers:
            task.cancel()
        for s in servers:
            s.stop()
    classify(records, timeline, args.blocks, len(servers))
    kinds: dict[str, int] = {}
    for r in records:
        del r["ids"]
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    (out / "records.json").write_text(json.dumps(records, indent=1))
    print(json.dumps({"blocks": args.blocks, "replicas": args.replicas, "requests": len(records), "kinds": kinds}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=128, help="KV blocks of 32 tokens per replica (default 128)")
    p.add_argument("--replicas", type=int, default=2, help="vLLM replicas (default 2)")
    p.add_argument("--rate", type=float, default=0.3, help="new sessions a second (default 0.3)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (default 60)")
    p.add_argument("--seed", type=int, default=3, help="workload seed (default 3)")
    p.add_argument("--out", default="kv-events-misses", help="where records.json and the logs go")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
