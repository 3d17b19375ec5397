"""An OTLP/HTTP trace receiver for tests (imported as `otlp_receiver`, as `twins` is): it keeps the
spans exported to it, and waits, bounded, for the ones a test expects.

It listens on a free loopback port and takes `POST /v1/traces`, protobuf (`application/x-protobuf`,
what the SDK's OTLP/HTTP exporter sends) or JSON (`application/json`, OTLP's JSON mapping: ids in
hex), and answers 200 with an empty ExportTraceServiceResponse in the request's encoding. It runs
either on the test's own event loop (`async with OtlpReceiver() as receiver`; wait with `await
receiver.wait_for(...)`) or on a thread of its own (`with OtlpReceiver().threaded() as receiver`;
wait with `receiver.wait_for_blocking(...)`), where a test blocks its loop, or flushes a tracer
provider synchronously while the receiver must answer.

Point an OTel SDK at `receiver.endpoint` (OTEL_EXPORTER_OTLP_ENDPOINT, the exporter adds
/v1/traces) or `receiver.traces_url` (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, used as it is). vLLM
exports over gRPC unless told otherwise: start it with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf
and --otlp-traces-endpoint set to `receiver.traces_url`.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUSES = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as received: ids in hex (`parent_span_id` "" for a root), `kind` and `status` by
    name (SERVER, CLIENT...; UNSET, OK, ERROR), attributes as plain values, times in ns."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: str
    attributes: dict[str, Any]
    status: str
    status_message: str
    start_ns: int
    end_ns: int
    service: str  # its resource's service.name
    resource: dict[str, Any] = field(repr=False)


def _value(value: dict[str, Any]) -> Any:
    """An OTLP AnyValue, in the JSON mapping, as a plain value."""
    for kind, found in value.items():
        if kind == "intValue":
            return int(found)
        if kind == "doubleValue":
            return float(found)
        if kind == "arrayValue":
            return [_value(item) for item in found.get("values", [])]
        if kind == "kvlistValue":
            return _attributes(found.get("values", []))
        if kind == "bytesValue":
            return base64.b64decode(found)
        return found  # stringValue, boolValue
    return None


def _enum(value: int | str, names: dict[int, str], prefix: str) -> str:
    """An enum's name, from its number (OTLP/JSON) or its protobuf name (`SPAN_KIND_SERVER`)."""
    return names.get(value, str(value)) if isinstance(value, int) else value.removeprefix(prefix)


def _attributes(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    return {pair["key"]: _value(pair.get("value", {})) for pair in pairs}


def spans_of(request: dict[str, Any], ids: Callable[[str], str]) -> list[ReceivedSpan]:
    """The spans of an ExportTraceServiceRequest in the JSON mapping; `ids` turns its ids to hex
    (OTLP/JSON carries them in hex, protobuf's own JSON mapping in base64)."""
    found = []
    for resource_spans in request.get("resourceSpans", []):
        resource = _attributes(resource_spans.get("resource", {}).get("attributes", []))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                status = span.get("status", {})
                found.append(
                    ReceivedSpan(
                        name=span["name"],
                        trace_id=ids(span.get("traceId", "")),
                        span_id=ids(span.get("spanId", "")),
                        parent_span_id=ids(span.get("parentSpanId", "")),
                        kind=_enum(span.get("kind", 0), KINDS, "SPAN_KIND_"),
                        attributes=_attributes(span.get("attributes", [])),
                        status=_enum(status.get("code", 0), STATUSES, "STATUS_CODE_"),
                        status_message=status.get("message", ""),
                        start_ns=int(span.get("startTimeUnixNano", 0)),
                        end_ns=int(span.get("endTimeUnixNano", 0)),
                        service=str(resource.get("service.name", "")),
                        resource=resource,
                    )
                )
    return found


def _hex_of_base64(value: str) -> str:
    return base64.b64decode(value).hex()


def _hex(value: str) -> str:
    return value.lower()


class OtlpReceiver:
    """Receives OTLP/HTTP traces on 127.0.0.1 (`port` 0: a free one) and keeps their `spans`."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.spans: list[ReceivedSpan] = []
        self.requests = 0  # export requests taken
        self._changed = threading.Condition()
        self._runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> str:
        """The base URL (OTEL_EXPORTER_OTLP_ENDPOINT)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def traces_url(self) -> str:
        """The traces URL (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, vLLM's --otlp-traces-endpoint)."""
        return f"{self.endpoint}/v1/traces"

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        # (a gzip body, OTEL_EXPORTER_OTLP_COMPRESSION=gzip, aiohttp has decompressed)
        if request.content_type == "application/json":
            spans = spans_of(orjson.loads(body), _hex)
            answer, content_type = b"{}", "application/json"
        else:
            message = ExportTraceServiceRequest.FromString(body)
            spans = spans_of(MessageToDict(message, use_integers_for_enums=True), _hex_of_base64)
            answer, content_type = ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf"
        with self._changed:
            self.spans.extend(spans)
            self.requests += 1
            self._changed.notify_all()
        return web.Response(body=answer, content_type=content_type)

    async def start(self) -> OtlpReceiver:
        """Listen, on the running loop."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> OtlpReceiver:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @contextmanager
    def threaded(self, timeout: float = 5.0) -> Iterator[OtlpReceiver]:
        """Run the receiver on an event loop in a thread of its own while the block runs."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="otlp-receiver", daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.start(), loop).result(timeout)
            yield self
        finally:
            try:
                asyncio.run_coroutine_threadsafe(self.stop(), loop).result(timeout)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join(timeout)
                loop.close()

    def named(self, name: str) -> list[ReceivedSpan]:
        """The spans received so far called `name`."""
        with self._changed:
            return [span for span in self.spans if span.name == name]

    def _check(self, predicate: Callable[[list[ReceivedSpan]], Any]) -> Any:
        with self._changed:
            return predicate(list(self.spans))

    def _late(self, timeout: float, value: Any) -> AssertionError:
        names = [span.name for span in self._check(list)]
        return AssertionError(f"not within {timeout} s: the spans awaited (last: {value!r}; received: {names})")

    async def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], Any], timeout: float = 5.0, every: float = 0.02
    ) -> Any:
        """Ask `predicate` the spans received so far, every `every` seconds, until it answers
        something true, and return that (a receiver on this loop keeps receiving meanwhile).
        Past `timeout` seconds: AssertionError, with the names of the spans received."""
        deadline = time.monotonic() + timeout
        while True:
            value = self._check(predicate)
            if value:
                return value
            if time.monotonic() >= deadline:
                raise self._late(timeout, value)
            await asyncio.sleep(every)

    def wait_for_blocking(self, predicate: Callable[[list[ReceivedSpan]], Any], timeout: float = 5.0) -> Any:
        """`wait_for`, blocking the calling thread: for a receiver on its own thread (`threaded`)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                value = predicate(list(self.spans))
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
        raise self._late(timeout, value)
