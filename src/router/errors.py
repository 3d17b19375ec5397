"""OpenAI-shaped errors: the one JSON body every client-facing failure uses."""

from __future__ import annotations

import orjson
from aiohttp import web


def error_body(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


def error_response(
    message: str,
    status: int = 400,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status, body=error_body(message, status, kind, param), content_type="application/json", headers=headers
    )


def sse_error_event(message: str, status: int = 502, kind: str = "upstream_error") -> bytes:
    """What a stream that broke after its first byte ends with: an error event, then [DONE]."""
    return b"data: " + error_body(message, status, kind) + b"\n\ndata: [DONE]\n\n"


def responses_error_event(message: str, sequence_number: int, status: int = 502, kind: str = "upstream_error") -> bytes:
    """What a Responses API stream (`event: response.*`, no `[DONE]`) that broke after its first
    byte ends with: the API's own `error` event, numbered after the last event the client got; its
    `error` object is the router's usual one, for clients that look for that."""
    event = {
        "type": "error",
        "code": kind,
        "message": message,
        "param": None,
        "sequence_number": sequence_number,
        "error": {"message": message, "type": kind, "param": None, "code": status},
    }
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
