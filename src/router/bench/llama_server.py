"""Real llama.cpp `llama-server` replicas for tests and benchmarks: the binary, a model, processes.

`scripts/build-llama-server.sh` builds the binary from the llama.cpp sources in the
llama-cpp-python sdist and caches it with one of llama.cpp's vocab-only model files. `find_binary`
finds it (`KVAR_LLAMA_SERVER`, else that cache). `write_model` writes a small llama-architecture
GGUF with random weights and that file's real tokenizer (the `gguf` package): a few MB that loads
in a fraction of a second and decodes about a thousand tokens a second per core, deterministic
for a given seed, with a chat template of its own. Its text is nonsense; its engine is real:
slots, prompt cache, continuous batching, SSE streaming, metrics, and a process that can be
killed.

`LlamaServer` runs one `llama-server` on a loopback port, `--metrics` on, one CPU thread, and
stops it by its PID alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

VOCAB = "ggml-vocab-llama-spm.gguf"
MODEL_NAME = "random-llama"  # what /v1/models lists
# role tags in plain text (the vocab-only file carries no chat template)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class NotBuilt(RuntimeError):
    """No llama-server binary: scripts/build-llama-server.sh builds one."""


def cache_root() -> Path:
    """Where scripts/build-llama-server.sh caches its builds ($KVAR_CACHE, as it reads it)."""
    if os.environ.get("KVAR_CACHE"):
        return Path(os.environ["KVAR_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kv-affinity-router"


def find_binary() -> Path:
    """The llama-server binary: $KVAR_LLAMA_SERVER, else the newest build in the build script's
    cache that runs on this machine (a native build from another CPU does not)."""
    return _find(os.environ.get("KVAR_LLAMA_SERVER") or "", str(cache_root()))


@functools.cache
def _find(named: str, root: str) -> Path:
    if named:
        path = Path(named)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise NotBuilt(f"KVAR_LLAMA_SERVER={named} is not an executable file")
        return path
    found = sorted(glob.glob(str(Path(root) / "llama-server-*" / "llama-server")), key=os.path.getmtime)
    for candidate in reversed(found):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if subprocess.run([candidate, "--version"], capture_output=True, timeout=30).returncode == 0:
                return Path(candidate)
    raise NotBuilt(f"no llama-server under {root} that runs here: run scripts/build-llama-server.sh")


@dataclass(frozen=True)
class ModelShape:
    layers: int = 2
    embedding: int = 64
    heads: int = 4
    kv_heads: int = 2
    feed_forward: int = 128
    context: int = 8192
    seed: int = 0


def write_model(path: Path, vocab: Path, shape: ModelShape = ModelShape()) -> Path:
    """A llama-architecture GGUF at `path`: random weights (N(0, 0.05), fixed seed) of `shape`, and
    the tokenizer of the vocab-only GGUF `vocab`."""
    import gguf  # noqa: PLC0415 -- optional: the test and bench extras bring it (with numpy)
    import numpy as np  # noqa: PLC0415 -- optional: comes with gguf

    source = gguf.GGUFReader(str(vocab))

    def values(name: str) -> list[Any]:
        f = source.fields[name]
        return [f.parts[i] for i in f.data]

    tokens = [bytes(part).decode("utf-8") for part in values("tokenizer.ggml.tokens")]
    scores = [float(part[0]) for part in values("tokenizer.ggml.scores")]
    types = [int(part[0]) for part in values("tokenizer.ggml.token_type")]
    out = gguf.GGUFWriter(str(path), "llama")
    out.add_name("kvar-random-llama")
    out.add_context_length(shape.context)
    out.add_embedding_length(shape.embedding)
    out.add_block_count(shape.layers)
    out.add_feed_forward_length(shape.feed_forward)
    out.add_head_count(shape.heads)
    out.add_head_count_kv(shape.kv_heads)
    out.add_layer_norm_rms_eps(1e-5)
    out.add_rope_dimension_count(shape.embedding // shape.heads)
    out.add_vocab_size(len(tokens))
    out.add_file_type(gguf.LlamaFileType.ALL_F32)
    out.add_tokenizer_model("llama")
    out.add_tokenizer_pre("default")
    out.add_token_list(tokens)
    out.add_token_scores(scores)
    out.add_token_types(types)
    out.add_bos_token_id(1)
    out.add_eos_token_id(2)
    out.add_unk_token_id(0)
    out.add_add_bos_token(True)
    out.add_add_eos_token(False)
    out.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(shape.seed)

    def weights(name: str, *dims: int) -> None:
        out.add_tensor(name, (rng.standard_normal(dims) * 0.05).astype(np.float32))

    def ones(name: str) -> None:
        out.add_tensor(name, np.ones(shape.embedding, np.float32))

    head = shape.embedding // shape.heads
    weights("token_embd.weight", len(tokens), shape.embedding)
    ones("output_norm.weight")
    weights("output.weight", len(tokens), shape.embedding)
    for i in range(shape.layers):
        ones(f"blk.{i}.attn_norm.weight")
        weights(f"blk.{i}.attn_q.weight", shape.embedding, shape.embedding)
        weights(f"blk.{i}.attn_k.weight", shape.kv_heads * head, shape.embedding)
        weights(f"blk.{i}.attn_v.weight", shape.kv_heads * head, shape.embedding)
        weights(f"blk.{i}.attn_output.weight", shape.embedding, shape.embedding)
        ones(f"blk.{i}.ffn_norm.weight")
        weights(f"blk.{i}.ffn_gate.weight", shape.feed_forward, shape.embedding)
        weights(f"blk.{i}.ffn_up.weight", shape.feed_forward, shape.embedding)
        weights(f"blk.{i}.ffn_down.weight", shape.embedding, shape.feed_forward)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return path


def model_for(directory: Path, binary: Path | None = None, shape: ModelShape = ModelShape()) -> Path:
    """The random model in `directory` (written once), with the vocab cached beside the binary."""
    binary = binary or find_binary()
    path = directory / f"random-llama-{shape.layers}x{shape.embedding}-s{shape.seed}.gguf"
    if not path.exists():
        part = path.with_suffix(".part")
        write_model(part, binary.parent / VOCAB, shape)
        part.rename(path)
    return path


@dataclass
class LlamaServer:
    """One llama-server process on a loopback port."""

    model: Path
    port: int
    slots: int = 2
    context: int = 8192  # all slots together; each slot gets context / slots
    # at llama-server's default (0.1) a new session takes over the slot of another that shares its
    # system prompt, and that session's cache is gone; above it, a new session takes the least
    # recently used slot and the slot's old prompt goes to the server's RAM prompt cache
    slot_similarity: float = 0.8
    binary: Path = field(default_factory=find_binary)
    extra: tuple[str, ...] = ()
    name: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.binary),
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--parallel",
            str(self.slots),
            "--ctx-size",
            str(self.context),
            "--threads",
            "1",
            "--threads-batch",
            "1",
            "--alias",
            MODEL_NAME,
            "--slot-prompt-similarity",
            str(self.slot_similarity),
            "--metrics",
            "--no-ui",
            *self.extra,
        ]

    async def start(self, timeout: float = 60.0) -> None:
        """Start it and wait until /health answers 200 (the model loaded)."""
        out = open(self.log, "wb") if self.log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if self.log is not None:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server on port {self.port} exited with {self.proc.returncode}")
                try:
                    async with http.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"llama-server on port {self.port} did not answer /health in {timeout:g} s")
                await asyncio.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a replica that dies mid-stream."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()
