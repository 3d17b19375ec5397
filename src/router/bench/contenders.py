"""The contenders of the fleet benchmarks (`router-bench fleet`, and faults, overload, adapters):
what each is (a client-side spread, router-serve with its settings, a peer router), whether it is
installed, and how one is started in front of a run's replicas."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import sys
import time
from dataclasses import dataclass

import aiohttp

from router.bench.common import free_port
from router.bench.proxy_bench import PEERS, first_answer, peer_command, peer_installed, role_flags
from router.bench.replicas import Child
from router.bench.vllm import NotBuilt as VllmNotBuilt
from router.bench.vllm import find_vllm

ENGINES = ("emulator", "llama-server", "vllm")
PD_ENGINES = ("emulator", "vllm")  # those that speak vLLM's kv_transfer_params hand-off (llama-server does not)


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    kind: str  # direct | router | a peer router of router.bench.proxy_bench.PEERS: sglang | smg | vllm
    args: tuple[str, ...] = ()
    spread: str = "round-robin"  # direct contenders only
    key_headers: tuple[str, ...] = ("X-Session-ID",)
    engines: tuple[str, ...] = ENGINES  # the --engine values it runs in front of
    tokenizer: bool = False  # router-serve tokenizes requests itself, with the vLLM model's files (tokenizer_dirs)
    # prefill/decode: the first half of the replicas prefill, the others decode (router-serve's
    # --prefill/--decode, a peer's PD mode); the replicas then speak vLLM's kv_transfer_params
    roles: bool = False
    prefill_share: float = 0.5  # ... of which this share prefill (rounded, at least one of each)
    # every replica may prefill for another, chosen per request (router-serve's --prefill-anywhere;
    # vLLM's kv_both on every replica): no fixed roles, the replicas speak kv_transfer_params
    lends: bool = False

    @property
    def splits(self) -> bool:
        """Whether it splits requests between replicas (its replicas speak vLLM's hand-off)."""
        return self.roles or self.lends


def split_roles(urls: list[str], share: float = 0.5) -> tuple[list[str], list[str]]:
    """A fleet's replicas as a disaggregated contender runs them: (prefill, decode), the first
    `share` of them prefilling (rounded; at least one each)."""
    n = min(max(1, round(len(urls) * share)), len(urls) - 1) if len(urls) > 1 else 1
    return urls[:n], urls[n:]


PLAIN = ("--no-rebalance", "--no-warmup")  # least_load and consistent_hash run as plain policies
SHIPPED = ("--rebalance", "--warmup")

CONTENDERS = {
    c.name: c
    for c in (
        Contender("round-robin", "round-robin (client, no router)", "direct"),
        Contender("least_load", "router-serve least_load", "router", ("--policy", "least_load", *PLAIN)),
        Contender("consistent_hash", "router-serve consistent_hash", "router", ("--policy", "consistent_hash", *PLAIN)),
        Contender("full", "router-serve as shipped", "router", SHIPPED),  # its default policy
        # LMetric (OSDI '26): new prefill tokens x batch size, from the paper's formula (router.policy.lmetric)
        Contender("lmetric", "LMetric's score (paper's formula)", "router", ("--policy", "lmetric", *PLAIN)),
        # as shipped, but priced by the router's own model of what it sent, not by the engines' KV events
        Contender("full-model", "router-serve, KV events off", "router", (*SHIPPED, "--no-kv-events")),
        Contender(
            "full-tokenizer", "router-serve, own tokenizer", "router", SHIPPED, engines=("vllm",), tokenizer=True
        ),
        Contender("affinity", "router-serve affinity", "router", ("--policy", "affinity", *SHIPPED)),
        Contender("full-no-kv-wait", "router-serve, no KV-bound wait", "router", (*SHIPPED, "--no-ttft-kv-wait")),
        Contender(
            "full-no-queue-lag", "router-serve, queues not moved by lag", "router", (*SHIPPED, "--ttft-queue-gain", "0")
        ),
        Contender(
            "full-capacity-blind",
            "router-serve affinity, capacity-blind",
            "router",
            ("--policy", "affinity", *SHIPPED, "--no-capacity-caps"),
        ),
        Contender("sglang-cache-aware", "sglang-router cache_aware", "sglang", ("--policy", "cache_aware")),
        Contender(
            "sglang-header",
            "sglang-router manual (session header)",
            "sglang",
            ("--policy", "manual"),
            key_headers=("X-Session-ID", "X-SMG-Routing-Key"),
        ),
        Contender("smg-cache-aware", "smg cache_aware", "smg", ("--policy", "cache_aware")),
        Contender(
            "smg-header",
            "smg consistent_hashing (session header)",
            "smg",
            ("--policy", "consistent_hashing", "--routing-key-headers", "x-session-id"),
        ),
        Contender("vllm-consistent-hash", "vllm-router consistent_hash", "vllm", ("--policy", "consistent_hash")),
        # it asks every replica to render every request (/v1/chat/completions/render, else /tokenize):
        # only vLLM serves them, so on the others it would not be cache-aware at all
        Contender(
            "vllm-cache-aware", "vllm-router cache_aware", "vllm", ("--policy", "cache_aware"), engines=("vllm",)
        ),
        Contender("oracle", "sticky oracle (client pins sessions)", "direct", spread="session"),
        # prefill/decode disaggregation (half the replicas prefill, half decode, by default): router-serve as
        # shipped, which splits a request only when what its decode replica would prefill is long
        # (disagg_min_prompt_tokens), every request split, and vllm-router's PD mode
        Contender(
            "disagg", "router-serve prefill/decode (conditional)", "router", SHIPPED, engines=PD_ENGINES, roles=True
        ),
        Contender(
            "disagg-always",
            "router-serve prefill/decode (every request split)",
            "router",
            (*SHIPPED, "--disagg-min-prompt-tokens", "0"),
            engines=PD_ENGINES,
            roles=True,
        ),
        # the split searched: a quarter or three quarters of the replicas prefill, not half
        Contender(
            "disagg-p25",
            "router-serve prefill/decode, 1/4 prefill (conditional)",
            "router",
            SHIPPED,
            engines=PD_ENGINES,
            roles=True,
            prefill_share=0.25,
        ),
        Contender(
            "disagg-p75",
            "router-serve prefill/decode, 3/4 prefill (conditional)",
            "router",
            SHIPPED,
            engines=PD_ENGINES,
            roles=True,
            prefill_share=0.75,
        ),
        # roles that follow the load: every replica serves, and prefills for another where that
        # costs the fleet less waiting (router.routing.lend_worth)
        Contender(
            "anywhere",
            "router-serve, prefill anywhere (kv_both)",
            "router",
            (*SHIPPED, "--prefill-anywhere"),
            engines=PD_ENGINES,
            lends=True,
        ),
        Contender(
            "vllm-pd",
            "vllm-router PD (--vllm-pd-disaggregation)",
            "vllm",
            ("--vllm-pd-disaggregation", "--policy", "consistent_hash"),
            engines=PD_ENGINES,
            roles=True,
        ),
    )
}


def available(name: str) -> bool:
    kind = CONTENDERS[name].kind
    return peer_installed(kind) if kind in PEERS else True


def peer_versions(names: list[str]) -> dict[str, str]:
    """The installed version of each peer router among the contenders `names`."""
    out = {}
    for kind in dict.fromkeys(CONTENDERS[n].kind for n in names if CONTENDERS[n].kind in PEERS):
        package = PEERS[kind].package
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[package] = importlib.metadata.version(package)
    return out


def router_command(c: Contender, port: int, urls: list[str]) -> list[str]:
    """router-serve's command line as contender `c`, on `port`, in front of `urls`."""
    cmd = [sys.executable, "-m", "router.proxy.cli", "--port", str(port), "--state", "none", *c.args]
    if not c.roles:
        return cmd + [a for url in urls for a in ("--replica", url)]
    return cmd + role_flags(*split_roles(urls, c.prefill_share))


async def pairs_met(url: str, pairs: int, timeout: float) -> None:
    """Until router-serve at `url` says (its /metrics) that `pairs` prefill/decode pairs have met."""
    name = 'router_disagg_pair_meetings_total{outcome="met"} '
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    met = [float(line[len(name) :]) for line in (await r.text()).splitlines() if line.startswith(name)]
                    if met and met[0] >= pairs:
                        return
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{url}'s {pairs} prefill/decode pairs did not meet within {timeout:g} s")


async def start_contender(c: Contender, urls: list[str], settings: dict[str, str]) -> tuple[Child | None, list[str]]:
    """The contender's process (None for the client-side ones) and the targets to send to."""
    if c.kind == "direct":
        return None, urls
    port = free_port()
    env: dict[str, str] | None = None
    if c.kind == "router":
        cmd = router_command(c, port, urls)
        if c.tokenizer:  # the model's own tokenizer and chat template, not the replicas' render endpoints
            try:
                cmd += ["--tokenizer-dirs", f"*={find_vllm() / 'model'}"]
            except VllmNotBuilt as exc:
                raise RuntimeError(str(exc)) from None
        env = {"ROUTER_" + k.upper(): v for k, v in settings.items()}
    else:
        cmd, env = peer_command(c.kind, port, urls, c.args, split_roles(urls, c.prefill_share) if c.roles else None)
    child = Child.spawn(cmd, c.label, env)
    url = f"http://127.0.0.1:{port}"
    try:
        await child.wait_up(url, "/health", timeout=60)
        # a peer may answer /health before its workers are registered: wait for one real answer
        # (before the replay and its counters); a split one may wait for a prefill replica's NIXL
        # hand-off on a busy machine: given a minute a try, not cut short and sent again
        if c.splits:
            await first_answer(url, timeout=180, each_s=60)
            if c.kind == "router":  # and its pairs introduced (router.pools.Pairs): none of the replay is cold
                prefill, decode = split_roles(urls, c.prefill_share) if c.roles else (urls, urls)
                pairs = len(prefill) * len(decode) - (len(urls) if c.lends else 0)
                await pairs_met(url, pairs, timeout=180 + 2 * pairs)
        else:
            await first_answer(url)
    except BaseException:
        child.stop()
        raise
    return child, [url]
