"""The router's errors: the exceptions it raises, all under RouterError, and the errors it answers
itself, in the client's own API shape: OpenAI's, or Anthropic's on the Messages API (router.apis).

Every exception the router defines derives from RouterError and keeps its builtin base, so an
`except ValueError` (or OSError, RuntimeError) still catches it. By what went wrong, where raised:

What the router was given cannot be used
  ConfigError (ValueError)          config/loading.py: a bad setting, named with where it came from;
    UnknownSettings                   names that are no setting. router-serve prints each line, exits 2
  StateError (ValueError)           state.py: the saved routing state cannot be read; router-serve exits 2
  DiscoveryError (RuntimeError)     discovery.py: a replica file or DNS lookup failed; nothing changes
  TokenizerError (ValueError)       kvevents/tokens.py: a model folder's tokenizer or chat template;
                                      engine_tokens learns the conversation's tokens from the engine instead
  PromptError (ValueError)          kvevents/emulator_tokens.py: a chat the emulator's template refuses
                                      (the emulator answers a 400; the router's built-in tokenizer skips it)
  CannotListen (OSError)            proxy/workers.py: an address to listen on is taken; router-serve exits 1
  ClientKeysError (ValueError)      clients.py: the client keys file is missing or malformed; at start
                                      router-serve exits 2, later the keys read before stay in force
  TracingConfigError (ValueError)   tracing.py: OTEL_* asks for an exporter or protocol the router
                                      has not; router-serve exits 2
A peer (replica, engine, worker process) failed, or sent what cannot be read
  UpstreamError (ConnectionError)   upstream.py: a replica's connection broke or ended before its answer;
    ConnectError                      none could be made; the request fails over (502 if none is left)
    StaleConnection                   a pooled one the replica had closed: the request is resent once
  WireError (ValueError)            kvevents/wire.py: a KV-event message that is no batch; kvfeed skips it
  WorkerFailed (RuntimeError)       proxy/workers.py: a worker process did not start; router-serve exits 1
  LinkDown (RuntimeError)           sessions.py (balance/link.py raises it): the workers did not answer
  TornRead (RuntimeError)           shm/table.py: a shared-memory slot kept changing under its reader (a
                                      writer died mid-write?); the reading is skipped
The router refuses
  Shed                              admission.py: a request is not forwarded, every replica being full; a 429
  NoRoom (RuntimeError)             membership.py: the shared replica table is full; the admin API's 507
  Clash (ValueError)                membership.py: a new replica's id or URL is another's; a 409 or 400

The groups are prose, not classes: every caller names the exception it handles. A new exception
derives from RouterError as well (tests/unit/test_errors.py fails otherwise); a private one that
never leaves its module, such as proxy/front.py's `_TooBig` (raised in an httptools callback, read
back from the parser's error), need not.
"""

from __future__ import annotations

import orjson

from router.apis import anthropic


class RouterError(Exception):
    """The root of every exception the router raises; each also keeps its builtin base (ValueError,
    RuntimeError, OSError) for the callers that catch that."""


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
# every type Anthropic's errors carry (its docs' list)
ANTHROPIC_KINDS = frozenset(
    (*ANTHROPIC_TYPES.values(), "invalid_request_error", "api_error", "billing_error", "timeout_error")
)
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
    carrying a string `message` (and, on Anthropic's API, `"type": "error"` around it and one of
    Anthropic's own error types: vLLM writes its exception's name, `BadRequestError`)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    error = data.get("error") if isinstance(data, dict) else None
    if not (isinstance(error, dict) and isinstance(error.get("message"), str)):
        return False
    return not anthropic(path) or (data.get("type") == "error" and error.get("type") in ANTHROPIC_KINDS)


def wrapped(path: str, status: int, body: bytes) -> bytes:
    """A replica's error `body` that the API's clients cannot read (plain text, an HTML page, another
    API's JSON), in the API's own shape: the status kept, the replica's words as the message. An
    Anthropic-shaped error of a type Anthropic has not keeps its message, its type from the status."""
    message = ""
    head = body[: 4 * LONGEST_WRAPPED]  # a huge page is cut before it is read, not after
    try:
        data = orjson.loads(body) if len(body) <= 1 << 16 else None
    except orjson.JSONDecodeError:
        data = None
    if anthropic(path) and isinstance(data, dict) and data.get("type") == "error":
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return anthropic_error_body(" ".join(error["message"].split())[:LONGEST_WRAPPED], status)
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
