"""The errors the router answers itself, in the client's own API shape: OpenAI's, or Anthropic's on the
Messages API (router.apis)."""

from __future__ import annotations

import orjson
from aiohttp import web

from router.apis import anthropic

# Anthropic's error types by status (its docs' table): other 4xx are invalid requests, other 5xx
# the API's own failures
ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None) -> bytes:
    """OpenAI's error: `{"error": {"message", "type", "param", "code"}}`."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


def anthropic_error_body(message: str, status: int) -> bytes:
    """Anthropic's error: `{"type": "error", "error": {"type", "message"}}`, its type from the status."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def error_body_for(
    path: str, message: str, status: int, kind: str = "invalid_request_error", param: str | None = None
) -> bytes:
    """The error a client of the API at `path` reads: Anthropic's on the Messages API, else OpenAI's."""
    if anthropic(path):
        return anthropic_error_body(message, status)
    return error_body(message, status, kind, param)


def error_response(
    message: str,
    status: int = 400,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> web.Response:
    """An error answer, in the shape of the API at `path` (OpenAI's unless it is Anthropic's)."""
    return web.Response(
        status=status,
        body=error_body_for(path, message, status, kind, param),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(message: str, status: int = 502, kind: str = "upstream_error") -> bytes:
    """What a stream that broke after its first byte ends with: an error event, then [DONE]."""
    return b"data: " + error_body(message, status, kind) + b"\n\ndata: [DONE]\n\n"


def messages_error_event(message: str, status: int = 502) -> bytes:
    """What an Anthropic Messages stream (`event: message_*`, no `[DONE]`) that broke after its
    first byte ends with: the API's own `error` event, as Anthropic sends one mid-stream."""
    return b"event: error\ndata: " + anthropic_error_body(message, status) + b"\n\n"


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
