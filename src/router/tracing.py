"""OpenTelemetry traces of proxied requests: one server span per request, its steps as children.

Off unless the standard OTEL_* environment configures an exporter, and then at no cost to the
requests it does not see: `setup()` returns None and every call site is an `if tracing is not None:`
guard (eight of them cost a request about 40 ns where eight calls of empty methods on a stand-in
would cost 600). On when:

    OTEL_SDK_DISABLED=true                        off, whatever else is set
    OTEL_TRACES_EXPORTER=none                     off
    OTEL_TRACES_EXPORTER unset                    on when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
                                                    OTEL_EXPORTER_OTLP_ENDPOINT is set, else off
    OTEL_TRACES_EXPORTER=otlp                     on: OTLP/HTTP (protobuf) to that endpoint, else
                                                    the SDK's default, http://localhost:4318/v1/traces
    OTEL_TRACES_EXPORTER=console                  on: each span as JSON on stdout (for debugging)
    OTEL_TRACES_EXPORTER=otlp,console             both

Unset, the spec's default exporter is otlp to localhost: a router nobody asked to trace would send
spans to a collector that is not there, so an endpoint is what turns it on. Any other exporter, or
an OTLP protocol other than http/protobuf, is a TracingConfigError. The SDK reads the rest itself:
the exporter OTEL_EXPORTER_OTLP_* (endpoint, headers, timeout, compression), the batch processor
OTEL_BSP_* (its schedule delay, 5 s unless set, queue and batch sizes), the sampler OTEL_TRACES_SAMPLER(_ARG), the
resource OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (service.name defaults to `router-serve`).
Spans are exported in batches by the processor's own thread, never on the event loop.

A request's trace, as the proxy draws it (times in `time.monotonic()` seconds, like a request's t0):

    chat llama-3     SERVER  the request, parented by the client's traceparent/tracestate, if any
      intake                 the body read and parsed            (an interval already over)
      route                  the decision: policy, replica, reason, predicted TTFT, cached tokens
      queue                  the overload queue's wait           (an interval already over)
      attempt        CLIENT  each replica tried: its id, URL, number, outcome; a stale-connection
      attempt        CLIENT    resend is an attempt of its own with router.resend=true
      resume         CLIENT  each try at continuing a broken stream on another replica

An attempt's (or resume's) `headers()` are the traceparent/tracestate to send the replica, so an
engine that traces (vLLM with --otlp-traces-endpoint) puts its span under the attempt.

Spans start and end at points the journey names, with explicit times (`start_span`, `end`), never
through the context-variable machinery: nothing is made current, so nothing leaks between the
requests one event loop interleaves. A trace's times are monotonic readings moved onto the wall
clock by one offset read when its request began, so its spans nest even if the clock is stepped.
The provider is this module's own, not the process-wide one (`trace.set_tracer_provider`).

Attribute names follow OpenTelemetry's semantic conventions (GenAI: gen_ai.*; HTTP: http.*, url.*,
error.type), the router's own under `router.`; they are listed once, below. A client's
key never appears: only its key id.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.apis import api_of
from router.errors import RouterError

# The semantic conventions' names (tests/unit/test_tracing.py checks the GenAI ones against the
# opentelemetry-semantic-conventions package, whose gen_ai module is still incubating)
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
URL_PATH = "url.path"
URL_FULL = "url.full"
ERROR_TYPE = "error.type"
# the router's own
ROUTER_TENANT = "router.tenant"
ROUTER_KEY_ID = "router.key_id"  # the id of a client's key, never the key
ROUTER_KEY_KIND = "router.key_kind"
ROUTER_POLICY = "router.policy"
ROUTER_REPLICA = "router.replica"
ROUTER_REASON = "router.reason"
ROUTER_PREDICTED_TTFT_MS = "router.predicted_ttft_ms"
ROUTER_CACHED_TOKENS = "router.cached_tokens"
ROUTER_ATTEMPT = "router.attempt"  # an attempt's number in its request, from 1
ROUTER_OUTCOME = "router.outcome"  # ok | connect | timeout | reset | http_5xx | refused | ...
ROUTER_RESEND = "router.resend"  # the attempt resends on a fresh connection what a stale one lost
ROUTER_BROKE_ON = "router.broke_on"  # a resume's: the replica whose stream broke
ROUTER_BODY_BYTES = "router.body_bytes"  # intake's: the request body's size

# gen_ai.operation.name by the router's API name (router.apis): the conventions' well-known values;
# Anthropic's Messages and OpenAI's Responses are chats; a token count has no value of its own
OPERATIONS = {
    "chat": "chat",
    "completion": "text_completion",
    "embedding": "embeddings",
    "responses": "chat",
    "messages": "chat",
    "count_tokens": "count_tokens",
}

DEFAULT_SERVICE_NAME = "router-serve"

_PROPAGATOR = TraceContextTextMapPropagator()
_NO_PARENT = Context()  # a request without a traceparent: its trace begins here
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})  # W3C trace context: the router's own replaces a client's
_SERVER, _CLIENT, _INTERNAL = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL


class TracingConfigError(RouterError, ValueError):
    """The OTEL_* environment asks for traces this router cannot send (an exporter or protocol it
    does not have)."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"


def exporters_from_environment() -> list[str]:
    """The span exporters the OTEL_* environment asks for (`otlp`, `console`); none: tracing is off.
    Raises TracingConfigError for an exporter or OTLP protocol this router does not have."""
    if _flag("OTEL_SDK_DISABLED"):
        return []
    asked = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if asked:
        names = [name.strip() for name in asked.split(",") if name.strip()]
        if names == ["none"]:
            return []
        unknown = [name for name in names if name not in ("otlp", "console")]
        if unknown:
            raise TracingConfigError(
                f"OTEL_TRACES_EXPORTER={asked!r}: the router sends traces by otlp or console, not {', '.join(unknown)}"
            )
    elif os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        names = ["otlp"]
    else:
        return []
    if "otlp" in names:
        for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = os.environ.get(variable, "").strip()
            if protocol:
                if protocol != "http/protobuf":
                    raise TracingConfigError(f"{variable}={protocol!r}: the router sends OTLP over http/protobuf only")
                break  # the traces' own protocol rules over the general one
    return names


def setup(service_name: str = DEFAULT_SERVICE_NAME) -> Tracing | None:
    """The router's tracing as the OTEL_* environment configures it, or None where it is off (see
    the module's docstring). Call it in each process that serves requests, after any fork."""
    names = exporters_from_environment()
    if not names:
        return None
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "otlp":
            # imported only when on: with `requests` and the OTLP encoders, it adds 35 ms to a process's start
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415

            exporters.append(OTLPSpanExporter())  # reads OTEL_EXPORTER_OTLP_* itself
        else:
            exporters.append(ConsoleSpanExporter())
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES rule over the default name
    resource = Resource.create({"service.name": service_name}).merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)  # its sampler: OTEL_TRACES_SAMPLER's
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))  # reads OTEL_BSP_*
    return Tracing(provider)


class Tracing:
    """Traces requests on one tracer provider: `request` begins one's trace."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("router")

    def request(self, method: str, path: str, headers: Mapping[str, str], t0: float) -> RequestTrace:
        """Begin the trace of a request that arrived at `t0` (monotonic seconds) for `method` `path`:
        its server span, child of the client's traceparent where `headers` (a case-insensitive
        mapping, such as aiohttp's, or one with lower-case names) carry one."""
        parent = _PROPAGATOR.extract(headers) if "traceparent" in headers else _NO_PARENT
        return RequestTrace(self.tracer, method, path, parent, t0)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export every span ended so far; blocks (not on the event loop) up to `timeout_s`.
        False: not all of them were exported in time."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export the spans ended so far and stop the exporters' threads (blocks: at exit, or in
        an executor). Spans begun later are dropped."""
        self.provider.shutdown()


class RequestTrace:
    """One request's trace: its server span, the steps of its journey as children, and what
    `finish` names it by. Times are monotonic seconds (`time.monotonic()`, a request's t0).

    A request the sampler leaves out (OTEL_TRACES_SAMPLER, or its client's unsampled traceparent)
    has no spans but its own non-recording one: its steps cost a check each, and its attempts'
    `headers` pass the unsampled context on, so the engine leaves it out too."""

    __slots__ = ("_attributes", "_context", "_offset_ns", "_operation", "_tracer", "sampled", "span")

    def __init__(self, tracer: Tracer, method: str, path: str, parent: Context, t0: float) -> None:
        self._tracer = tracer
        # the wall clock minus the monotonic one, read once: the trace's spans nest whatever the wall clock does
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        api = api_of(path)
        self._operation = OPERATIONS[api.name] if api is not None else None  # None: no API the router proxies
        attributes: dict[str, Any] = {HTTP_REQUEST_METHOD: method, URL_PATH: path}
        if self._operation is not None:
            attributes[GEN_AI_OPERATION_NAME] = self._operation
        self.span: Span = tracer.start_span(
            self._operation or method,
            context=parent,
            kind=_SERVER,
            attributes=attributes,
            start_time=self._ns(t0),
        )
        self.sampled = self.span.is_recording()
        self._context = set_span_in_context(self.span)  # the children's parent
        self._attributes: dict[str, Any] = {}  # the routing decision's, set on the span at its end

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def _now_ns(self) -> int:
        return time.monotonic_ns() + self._offset_ns

    @property
    def trace_id(self) -> str:
        """The trace's id, 32 hex digits, for the access log."""
        return format(self.span.get_span_context().trace_id, "032x")

    def _interval(self, name: str, start: float, end: float, attributes: dict[str, Any] | None = None) -> None:
        if not self.sampled:
            return
        span = self._tracer.start_span(
            name, context=self._context, kind=_INTERNAL, attributes=attributes, start_time=self._ns(start)
        )
        span.end(end_time=self._ns(end))

    def intake(self, start: float, end: float, body_bytes: int | None = None) -> None:
        """The request's body was read and parsed from `start` to `end`."""
        self._interval("intake", start, end, {ROUTER_BODY_BYTES: body_bytes} if body_bytes is not None else None)

    def queued(self, start: float, end: float) -> None:
        """The request waited in the overload queue from `start` to `end`."""
        self._interval("queue", start, end)

    def routed(
        self,
        start: float,
        end: float,
        policy: str,
        replica: str | None,
        reason: str | None,
        key_kind: str | None = None,
        predicted_ttft_ms: float | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        """The request was routed from `start` to `end`: by `policy` to `replica` (None: none was
        offered) for `reason`, its key of `key_kind`, with the policy's predicted time to first
        token and the tokens it expects the replica to hold cached, where it has them. The same
        attributes go on the request's span."""
        if not self.sampled:
            return
        attributes: dict[str, Any] = {ROUTER_POLICY: policy}
        if replica is not None:
            attributes[ROUTER_REPLICA] = replica
        if reason is not None:
            attributes[ROUTER_REASON] = reason
        if key_kind is not None:
            attributes[ROUTER_KEY_KIND] = key_kind
        if predicted_ttft_ms is not None:
            attributes[ROUTER_PREDICTED_TTFT_MS] = predicted_ttft_ms
        if cached_tokens is not None:
            attributes[ROUTER_CACHED_TOKENS] = cached_tokens
        self._attributes.update(attributes)
        self._interval("route", start, end, attributes)

    def attempt(self, replica_id: str, url: str, n: int, resend: bool = False) -> AttemptTrace:
        """An attempt begins now: the request's `n`th (from 1), to `replica_id` at `url` (the full
        URL sent to); `resend`: it resends what a stale pooled connection lost."""
        if not self.sampled:
            return AttemptTrace(self, None)
        attributes: dict[str, Any] = {ROUTER_REPLICA: replica_id, URL_FULL: url, ROUTER_ATTEMPT: n}
        if resend:
            attributes[ROUTER_RESEND] = True
        return AttemptTrace(self, self._client_span("attempt", attributes))

    def resume(self, replica_id: str, url: str, n: int, broke_on: str) -> AttemptTrace:
        """A try at continuing, on `replica_id` at `url`, the stream that broke on `broke_on`
        begins now: the request's `n`th attempt."""
        if not self.sampled:
            return AttemptTrace(self, None)
        attributes = {ROUTER_REPLICA: replica_id, URL_FULL: url, ROUTER_ATTEMPT: n, ROUTER_BROKE_ON: broke_on}
        return AttemptTrace(self, self._client_span("resume", attributes))

    def _client_span(self, name: str, attributes: dict[str, Any]) -> Span:
        return self._tracer.start_span(
            name, context=self._context, kind=_CLIENT, attributes=attributes, start_time=self._now_ns()
        )

    def finish(
        self,
        status: int,
        model: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        max_tokens: int | None = None,
        tenant: str | None = None,
        key_id: str | None = None,
        replica: str | None = None,
        error: str | None = None,
        end: float | None = None,
    ) -> None:
        """End the request's span, now or at `end`: answered with `status` (by `replica`, the one
        that served it, None if none did), for `model`, its token usage and `max_tokens` where
        known, the client's `tenant` and `key_id` with client keys on. `error`: what went wrong (an
        `error.type`: `stream_broken`, `queue_full`...). The span is an error on a 5xx, and on an
        `error` under a 400 (a broken stream's 200); a 4xx is the client's, not the server's."""
        if not self.sampled:
            return
        attributes = self._attributes
        attributes[HTTP_RESPONSE_STATUS_CODE] = status
        if model is not None:
            attributes[GEN_AI_REQUEST_MODEL] = model
            if self._operation is not None:
                self.span.update_name(f"{self._operation} {model}")
        if input_tokens is not None:
            attributes[GEN_AI_USAGE_INPUT_TOKENS] = input_tokens
        if output_tokens is not None:
            attributes[GEN_AI_USAGE_OUTPUT_TOKENS] = output_tokens
        if max_tokens is not None:
            attributes[GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
        if tenant is not None:
            attributes[ROUTER_TENANT] = tenant
        if key_id is not None:
            attributes[ROUTER_KEY_ID] = key_id
        if replica is not None:
            attributes[ROUTER_REPLICA] = replica
        span = self.span
        if status >= 500 or (error is not None and status < 400):
            attributes[ERROR_TYPE] = error or str(status)
            span.set_status(Status(StatusCode.ERROR, error))
        elif error is not None:
            attributes[ERROR_TYPE] = error
        span.set_attributes(attributes)
        span.end(end_time=self._ns(end) if end is not None else self._now_ns())


class AttemptTrace:
    """One attempt's client span (or one resume's), begun when it was made: `headers` carry it to
    the replica, `end` records how it went. `span` None: its request is not sampled."""

    __slots__ = ("_request", "span")

    def __init__(self, request: RequestTrace, span: Span | None) -> None:
        self._request = request
        self.span = span

    def headers(self) -> dict[str, str]:
        """The W3C trace context to send the replica (`traceparent`, and `tracestate` where the
        trace has one), naming this attempt's span as the parent of the engine's (an unsampled
        request's own span, flagged unsampled)."""
        span = self.span if self.span is not None else self._request.span
        # written here rather than by the propagator (its context round trip is most of an
        # unsampled request's cost): W3C trace context, version 00
        context = span.get_span_context()
        if not context.is_valid:
            return {}
        carrier = {"traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"}
        if context.trace_state:
            carrier["tracestate"] = context.trace_state.to_header()
        return carrier

    def end(self, outcome: str, status: int | None = None, resent: bool = False) -> None:
        """The attempt ended, now, with `outcome` (`ok`, or why it failed: connect, timeout, reset,
        http_5xx, refused...) and the replica's HTTP `status` if it answered; `resent`: it was sent
        again on a new connection, the pooled one having been stale. Anything but `ok` is an error
        of the span's."""
        span = self.span
        if span is None:
            return
        attributes: dict[str, Any] = {ROUTER_OUTCOME: outcome}
        if resent:
            attributes[ROUTER_RESEND] = True
        if status is not None:
            attributes[HTTP_RESPONSE_STATUS_CODE] = status
        if outcome != "ok":
            attributes[ERROR_TYPE] = outcome
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.set_attributes(attributes)
        span.end(end_time=self._request._now_ns())
