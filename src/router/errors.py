"""The errors the router answers itself, in the client's own API shape: OpenAI's, or Anthropic's on the
Messages API (router.apis)."""

from __future__ import annotations

import orjson

from router.apis import anthropic

# OpenAI's error types by status: its API answers other 4xx as invalid requests (an unknown model
# or path included, told apart by `code`), other 5xx as its own failures
OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
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
LONGEST_WRAPPED = 2000  # characters of a replica's own error text kept in a wrapped error


def openai_type(status: int) -> str:
    return OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(message: str, status: int, code: str | None = None, param: str | None = None) -> bytes:
    """OpenAI's error: `{"error": {"message", "type", "param", "code"}}`: `type` one of OpenAI's, by
    the status; `code` a string saying more (`model_not_found`, `queue_full`, ...) or null."""
    return orjson.dumps({"error": {"message": message, "type": openai_type(status), "param": param, "code": code}})


def anthropic_error_body(message: str, status: int) -> bytes:
    """Anthropic's error: `{"type": "error", "error": {"type", "message"}}`, its type from the status."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def error_body_for(path: str, message: str, status: int, code: str | None = None, param: str | None = None) -> bytes:
    """The error a client of the API at `path` reads: Anthropic's on the Messages API, else OpenAI's."""
    if anthropic(path):
        return anthropic_error_body(message, status)
    return error_body(message, status, code, param)


def in_shape(path: str, body: bytes) -> bool:
    """`body` is an error the SDKs of the API at `path` read: a JSON object with an `error` object
    carrying a string `message` (and, on Anthropic's API, `"type": "error"` around it)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    error = data.get("error") if isinstance(data, dict) else None
    if not (isinstance(error, dict) and isinstance(error.get("message"), str)):
        return False
    return not anthropic(path) or (data.get("type") == "error" and isinstance(error.get("type"), str))


def wrapped(path: str, status: int, body: bytes) -> bytes:
    """A replica's error `body` that the API's clients cannot read (plain text, an HTML page, another
    API's JSON), in the API's own shape: the status kept, the replica's words as the message."""
    message = ""
    head = body[: 4 * LONGEST_WRAPPED]  # a huge page is cut before it is read, not after
    try:
        data = orjson.loads(body) if len(body) <= 1 << 16 else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):  # another API's shape: its message, where it has one
        error = data.get("error")
        found = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else None
        found = found if isinstance(found, str) else data.get("message", data.get("detail"))
        message = found[: 4 * LONGEST_WRAPPED] if isinstance(found, str) else head.decode("utf-8", "replace")
    else:
        message = head.decode("utf-8", "replace")
    message = " ".join(message.split())[:LONGEST_WRAPPED]  # one line, bounded
    message = f"the replica answered {status}" + (f": {message}" if message else " with no message")
    return error_body_for(path, message, status, "upstream_error")


def sse_error_event(message: str, status: int = 502, code: str = "upstream_error") -> bytes:
    """What a stream that broke after its first byte ends with: an error event, then [DONE]."""
    return b"data: " + error_body(message, status, code) + b"\n\ndata: [DONE]\n\n"


def messages_error_event(message: str, status: int = 502) -> bytes:
    """What an Anthropic Messages stream (`event: message_*`, no `[DONE]`) that broke after its
    first byte ends with: the API's own `error` event, as Anthropic sends one mid-stream."""
    return b"event: error\ndata: " + anthropic_error_body(message, status) + b"\n\n"


def responses_error_event(message: str, sequence_number: int, status: int = 502, code: str = "upstream_error") -> bytes:
    """What a Responses API stream (`event: response.*`, no `[DONE]`) that broke after its first
    byte ends with: the API's own `error` event, numbered after the last event the client got; its
    `error` object is the router's usual one, for clients that look for that."""
    event = {
        "type": "error",
        "code": code,
        "message": message,
        "param": None,
        "sequence_number": sequence_number,
        "error": {"message": message, "type": openai_type(status), "param": None, "code": code},
    }
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
