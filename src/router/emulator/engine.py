"""Continuous-batching inference engine model, driven by whatever clock its caller keeps.

The engine knows nothing of HTTP or wall time: `add` queues a request at time `now`,
`schedule(now)` picks the next step's batch and says how long the step takes, and
`finish(step, now)` applies the step's results at its end. The HTTP server sleeps through the
step (scaled by its time scale); an offline simulator just adds the duration to a virtual clock.

Each step, like vLLM's scheduler with chunked prefill:
1. admits waiting requests in arrival order while fewer than `max_num_seqs` run and the KV cache
   can reserve their blocks (a request that does not fit blocks those behind it);
2. gives each decoding request one token, and spends the rest of the `max_num_batched_tokens`
   budget on the uncached prompt tokens of prefilling requests, oldest first;
3. takes step_base_s + decode_per_seq_s * decoding + attention_per_token_s * (their context)
   + prefill tokens / prefill_tokens_per_s, times the `slowdown` factor.
A request whose prefill completes in a step gets its first token at the step's end.

Full KV blocks join the prefix cache as they are computed, as in vLLM: a prompt's as each prefill
chunk completes, a reply's as decoding fills them (all but the last sampled token, whose KV is
never computed). With `kv_events`, the engine writes down what vLLM publishes as KV-cache events
(router.emulator.kvcache): one `BlockStored` per request per step that cached blocks of it, one
`BlockRemoved` per eviction, `AllBlocksCleared` on a prefix-cache reset; whoever drives the
engine takes them after each step (`take_kv_events`).

Default figures resemble one H100-class GPU serving an ~8B model in bf16 (see docs/emulator.md):
16-token blocks; 30,000 blocks (480k tokens: 80 GB at 0.9 utilisation less 16 GB of weights, at
128 KiB of KV per token); prefill at 15,000 tokens/s; a decode step of 10 ms (reading the weights
once at 3.35 TB/s takes ~5 ms) plus 38 ns per context token (128 KiB of KV at 3.35 TB/s).

It is past 450 lines as one room: the scheduler, its KV cache accounting and a step's events are one
continuous-batching loop whose invariants cross all three.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from router.emulator.kvcache import Allocation, BlockStored, CacheEvent, PrefixCache
from router.kvevents.emulator_tokens import (
    BYTES_PER_TOKEN,
    block_hashes,
    cache_seed,
    count_tokens,
    generated_text,
    token_ids,
)
from router.ring import xxh3_64


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 30_000
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131_072
    prefill_tokens_per_s: float = 15_000.0
    step_base_s: float = 0.010
    decode_per_seq_s: float = 0.0001
    attention_per_token_s: float = 38e-9
    # LoRA adapters (vLLM's --max-loras): at most this many distinct adapters in one batch, each
    # held in one of as many GPU slots (least recently used out); loading one into a slot takes
    # `lora_load_s` of the step that first runs it
    max_loras: int = 4
    lora_load_s: float = 0.0
    # a prefill replica's KV read by a decode replica (vLLM's NixlConnector): a fixed cost per
    # transfer and a rate (on this machine's CPU build with UCX over TCP: 2 to 14 ms for 367 tokens
    # of the tiny model)
    kv_transfer_base_s: float = 0.005
    kv_transfer_tokens_per_s: float = 1_000_000.0
    # a decode replica's first read of a given prefill engine waits for NIXL's handshake with it
    # (later reads do not): 10 to 30 s on vLLM 0.32's CPU build here (the prefill engine answers it
    # late while it holds a lease); 0 by default, as the router introduces pairs before they serve
    kv_handshake_s: float = 0.0
    # a decode replica's read of a remote prefill's KV begins this long after the request arrives:
    # on vLLM 0.32's CPU build here its worker started the read 0.2 to 60 s after the engine
    # scheduled the request (by vLLM's debug log), often after the prefill's lease ran out; 0 by default
    kv_read_delay_s: float = 0.0

    def __post_init__(self) -> None:
        positive = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_loras")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("prefill_tokens_per_s", "kv_transfer_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "step_base_s",
            "decode_per_seq_s",
            "attention_per_token_s",
            "lora_load_s",
            "kv_transfer_base_s",
            "kv_handshake_s",
            "kv_read_delay_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")


class RequestTooLarge(ValueError):
    """A request that can never run on this engine (context or KV capacity)."""


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    prompt: bytes
    max_tokens: int
    arrival: float
    prompt_tokens: int = 0
    hashes: list[int] = field(default_factory=list)
    id: int = field(default_factory=lambda: next(_ids))
    alloc: Allocation | None = None
    cached_tokens: int = 0
    created_cache_tokens: int = 0  # prompt tokens it computes into full KV blocks (vLLM's name)
    computed: int = 0  # prompt tokens in KV (cached + prefilled)
    output_tokens: int = 0
    scheduled_at: float | None = None  # when a step first admitted it (its wait in the queue ends)
    first_token_at: float | None = None
    finished_at: float | None = None
    aborted: bool = False
    owner: Any = None  # whoever waits for this sequence's tokens (the HTTP handler)
    adapter: str | None = None  # the LoRA adapter it runs with, if any
    cache_salt: str | None = None  # the request's cache_salt: its blocks are its own
    seed: int = 0  # the seed of its block hash chain (tokenizer.cache_seed of adapter and salt)
    # prompt tokens whose KV a remote prefill computed and this replica read (vLLM's external
    # tokens): not computed here, not counted as cached (vLLM's usage says 0 for them)
    external_tokens: int = 0

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_tokens

    @property
    def done(self) -> bool:
        return self.finished_at is not None or self.aborted

    @property
    def context_tokens(self) -> int:
        return self.computed + self.output_tokens


@dataclass
class Step:
    """What one step does: the batch, its prefill chunks and its length in engine seconds."""

    started: float
    duration: float
    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]
    admitted: list[Sequence]


@dataclass
class StepEvents:
    """Sequences that got tokens in a step (first token included) and those that finished."""

    tokens: list[Sequence]
    finished: list[Sequence]


class Engine:
    def __init__(self, config: EngineConfig | None = None, kv_events: bool = False) -> None:
        self.config = config or EngineConfig()
        # what the cache did since the last take_kv_events (None: nobody listens, nothing is written)
        self.kv_events: list[CacheEvent] | None = [] if kv_events else None
        self.cache = PrefixCache(self.config.num_blocks, self.config.block_size, self.kv_events)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.adapters: OrderedDict[str, None] = OrderedDict()  # in GPU slots, least recently used first
        self.slowdown = 1.0
        # counters (engine seconds and tokens), read by the metrics exporter
        self.busy_seconds = 0.0
        self.steps = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total = 0
        self.aborted_total = 0
        self.adapter_loads_total = 0  # LoRA adapters put into a GPU slot (each costs lora_load_s)

    # -- requests -------------------------------------------------------------------------------

    def new_sequence(
        self,
        prompt: bytes,
        max_tokens: int,
        now: float,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ) -> Sequence:
        """Validate and tokenize a request; raises RequestTooLarge when it can never run. Its
        blocks are keyed by its LoRA adapter and cache salt too (tokenizer.cache_seed)."""
        cfg = self.config
        prompt_tokens = count_tokens(prompt)
        if prompt_tokens == 0:
            raise RequestTooLarge("the prompt is empty")
        if max_tokens < 1:
            raise RequestTooLarge("max_tokens must be at least 1")
        if prompt_tokens + max_tokens > cfg.max_model_len:
            raise RequestTooLarge(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        if -(-(prompt_tokens + max_tokens) // cfg.block_size) > cfg.num_blocks:
            raise RequestTooLarge(
                f"the request needs {prompt_tokens + max_tokens} tokens of KV cache; this replica holds "
                f"{cfg.num_blocks * cfg.block_size}"
            )
        seed = cache_seed(adapter, cache_salt)
        return Sequence(
            prompt=prompt,
            max_tokens=max_tokens,
            arrival=now,
            prompt_tokens=prompt_tokens,
            hashes=block_hashes(prompt, cfg.block_size, seed),
            adapter=adapter,
            cache_salt=cache_salt,
            seed=seed,
        )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """The client went away: stop the sequence and free its blocks."""
        if seq.done:
            return
        seq.aborted = True
        self.aborted_total += 1
        if seq.alloc is not None:
            self.cache.release(seq.alloc)
            seq.alloc = None
        if seq in self.running:
            self.running.remove(seq)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def reset(self) -> None:
        """Forget everything (a crashed replica comes back cold), KV events not yet taken too."""
        for seq in list(self.running) + list(self.waiting):
            self.abort(seq)
        if self.kv_events is not None:
            self.kv_events.clear()
        self.cache = PrefixCache(self.config.num_blocks, self.config.block_size, self.kv_events)
        self.adapters.clear()
        self.busy_seconds = 0.0
        self.steps = self.prompt_tokens_total = self.cached_tokens_total = 0
        self.generation_tokens_total = self.finished_total = self.aborted_total = self.adapter_loads_total = 0

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, as vLLM's `POST /reset_prefix_cache`: refused (False) while a
        request holds blocks; the AllBlocksCleared event goes out with the next step's events."""
        return self.cache.reset()

    def take_kv_events(self) -> list[CacheEvent]:
        """The KV-cache events written down since the last call, oldest first."""
        if not self.kv_events:
            return []
        events = list(self.kv_events)
        self.kv_events.clear()
        return events

    # -- steps ----------------------------------------------------------------------------------

    def schedule(self, now: float) -> Step | None:
        """Pick the next step's batch; None when there is nothing to run."""
        cfg = self.config
        admitted: list[Sequence] = []
        loads = 0  # adapters loaded into a GPU slot for this step
        held_back: list[Sequence] = []  # their adapter finds no slot in this batch: they keep their place
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.arrival > now:
                break  # it arrived after this step began: it joins the next one
            if seq.adapter is not None and not self._adapter_fits(seq.adapter):
                held_back.append(self.waiting.popleft())  # vLLM skips it and schedules the rest
                continue
            alloc = self.cache.allocate(seq.hashes, seq.prompt_tokens, seq.prompt_tokens + seq.max_tokens)
            if alloc is None:
                break  # first come, first served: wait for blocks to free up
            self.waiting.popleft()
            if seq.adapter is not None:
                loads += self._use_adapter(seq.adapter)
            seq.alloc = alloc
            seq.scheduled_at = now
            seq.cached_tokens = alloc.hit_blocks * cfg.block_size
            # the last prompt token is always computed here, as vLLM schedules a remote prefill's
            # request with one token left
            seq.computed = max(seq.cached_tokens, min(seq.external_tokens, seq.prompt_tokens - 1))
            full = seq.prompt_tokens // cfg.block_size * cfg.block_size
            seq.created_cache_tokens = max(full - seq.computed // cfg.block_size * cfg.block_size, 0)
            self.prompt_tokens_total += seq.prompt_tokens
            self.cached_tokens_total += seq.cached_tokens
            self.running.append(seq)
            admitted.append(seq)
        self.waiting.extendleft(reversed(held_back))
        if not self.running:
            return None
        decode = [s for s in self.running if not s.prefilling]
        budget = cfg.max_num_batched_tokens - len(decode)
        prefill: list[tuple[Sequence, int]] = []
        prefill_tokens = 0
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling:
                chunk = min(seq.prompt_tokens - seq.computed, budget)
                prefill.append((seq, chunk))
                budget -= chunk
                prefill_tokens += chunk
        context = sum(s.context_tokens for s in decode)
        duration = (
            cfg.step_base_s
            + cfg.decode_per_seq_s * len(decode)
            + cfg.attention_per_token_s * context
            + prefill_tokens / cfg.prefill_tokens_per_s
            + loads * cfg.lora_load_s
        ) * self.slowdown
        return Step(started=now, duration=duration, decode=decode, prefill=prefill, admitted=admitted)

    def deferred(self) -> int:
        """Waiting requests held back for a LoRA slot, not for room in the batch (vLLM's `deferred`
        reason): their adapter fits no slot free of running adapters."""
        return sum(1 for s in self.waiting if s.adapter is not None and not self._adapter_fits(s.adapter))

    def _adapter_fits(self, adapter: str) -> bool:
        """The batch may take a request for `adapter`: it runs already, or a slot is free of
        running adapters."""
        running = {s.adapter for s in self.running if s.adapter is not None}
        return adapter in running or len(running) < self.config.max_loras

    def _use_adapter(self, adapter: str) -> int:
        """Put `adapter` in a GPU slot (1: it had to be loaded), evicting the least recently used
        adapter no running request needs."""
        if adapter in self.adapters:
            self.adapters.move_to_end(adapter)
            return 0
        if len(self.adapters) >= self.config.max_loras:
            running = {s.adapter for s in self.running}
            idle = next((a for a in self.adapters if a not in running), None)
            if idle is not None:
                del self.adapters[idle]
        self.adapters[adapter] = None
        self.adapter_loads_total += 1
        return 1

    def running_adapters(self) -> list[str]:
        return sorted({s.adapter for s in self.running if s.adapter is not None})

    def waiting_adapters(self) -> list[str]:
        return sorted({s.adapter for s in self.waiting if s.adapter is not None})

    def finish(self, step: Step, now: float) -> StepEvents:
        """Apply a step's results at its end (`now`): tokens, cached blocks, finished requests."""
        self.steps += 1
        self.busy_seconds += step.duration
        tokens: list[Sequence] = []
        finished: list[Sequence] = []
        for seq in step.decode:
            if seq.done:
                continue
            seq.output_tokens += 1
            tokens.append(seq)
            self._cache_full_blocks(seq)  # the KV of the token sampled last step was computed in this one
        for seq, chunk in step.prefill:
            if seq.done:
                continue
            seq.computed += chunk
            # full prompt blocks computed so far are in KV: later requests can hit them right away
            self._cache_full_blocks(seq)
            if not seq.prefilling:
                seq.output_tokens = 1
                seq.first_token_at = now
                tokens.append(seq)
        for seq in tokens:
            if seq.output_tokens >= seq.max_tokens:
                finished.append(seq)
        self.generation_tokens_total += len(tokens)
        for seq in finished:
            self._complete(seq, now)
        return StepEvents(tokens=tokens, finished=finished)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Give the sequence's newly computed full blocks their cached identity: prompt blocks as
        its prefill computes them, then blocks of prompt and reply as decoding fills them, so the
        next turn hits prompt and reply. The text is bytes (the prompt, then 4-byte reply tokens),
        cut into blocks of 4 * block_size bytes, as the next turn's prompt will be cut."""
        alloc = seq.alloc
        assert alloc is not None
        bs = self.config.block_size
        block_bytes = bs * BYTES_PER_TOKEN
        # the last sampled token never had its KV computed, so it is not counted (as in vLLM); a
        # block is whole once its bytes are there (a short last prompt token waits for the reply's)
        kv_tokens = seq.computed + max(seq.output_tokens - 1, 0)
        text_bytes = min(len(seq.prompt), seq.computed * BYTES_PER_TOKEN) + seq.output_tokens * BYTES_PER_TOKEN
        start, full = len(alloc.pinned), min(kv_tokens // bs, text_bytes // block_bytes)
        if full <= start:
            return
        new = seq.hashes[start:full]
        parent = alloc.pinned[-1] if alloc.pinned else None
        h = new[-1] if new else parent if parent is not None else seq.seed
        for k in range(start + len(new), full):  # blocks past the prompt's: chained on from it
            h = xxh3_64(self._text(seq, k * block_bytes, (k + 1) * block_bytes), h)
            new.append(h)
        self.cache.store(alloc, new)
        if self.kv_events is not None:
            keys = [seq.adapter] if seq.adapter is not None else []
            salted = [*keys, seq.cache_salt] if seq.cache_salt is not None else keys
            self.kv_events.append(
                BlockStored(
                    block_hashes=new,
                    parent_block_hash=parent,
                    token_ids=token_ids(self._text(seq, start * block_bytes, full * block_bytes)),
                    lora_name=seq.adapter,
                    extra_keys=[(salted if k == 0 else keys) or None for k in range(start, full)],
                )
            )

    def _text(self, seq: Sequence, start: int, end: int) -> bytes:
        """Bytes `start .. end - 1` of the sequence's text: its prompt, then its reply."""
        p = len(seq.prompt)
        head = seq.prompt[start:end]
        if end <= p:
            return head
        # the reply tokens that cover the rest: t0 .. t1 - 1
        r0, r1 = max(start - p, 0), end - p
        t0, t1 = r0 // BYTES_PER_TOKEN, -(-r1 // BYTES_PER_TOKEN)
        reply = generated_text(self.reply_seed(seq), t0, t1 - t0).encode()
        return head + reply[r0 - t0 * BYTES_PER_TOKEN : r1 - t0 * BYTES_PER_TOKEN]

    def _complete(self, seq: Sequence, now: float) -> None:
        assert seq.alloc is not None
        self.cache.release(seq.alloc)
        seq.alloc = None
        seq.finished_at = now
        self.finished_total += 1
        self.running.remove(seq)

    @staticmethod
    def reply_seed(seq: Sequence) -> int:
        """Seed of the reply text: the same prompt always gets the same reply."""
        return seq.hashes[-1] if seq.hashes else len(seq.prompt)

    # -- gauges -----------------------------------------------------------------------------

    def fragmentation(self) -> float:
        """Internal fragmentation: the unwritten slots of running requests' partly written last
        blocks / all slots held. Blocks reserved for the rest of a reply are not counted: vLLM
        would allocate them only as it decodes, so reserving them is this model's shortcut, not
        waste a real engine shows (a replica busy with long replies is not fragmented)."""
        bs = self.config.block_size
        held = self.cache.used_blocks * bs
        if held == 0:
            return 0.0
        unused = 0
        for seq in self.running:
            if seq.alloc is None:
                continue
            written = seq.context_tokens
            unused += -written % bs  # slack in the last, partly written block
        return min(max(unused / held, 0.0), 1.0)

    def stats(self) -> dict[str, Any]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_usage": self.cache.usage,
            "kv_fragmentation": self.fragmentation(),
            "cached_blocks": self.cache.cached_blocks,
            "evictions": self.cache.evictions,
            "busy_seconds": self.busy_seconds,
            "steps": self.steps,
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "finished_total": self.finished_total,
            "aborted_total": self.aborted_total,
            "adapter_loads_total": self.adapter_loads_total,
        }
