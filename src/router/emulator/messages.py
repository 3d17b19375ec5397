"""The emulator's Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`), as vLLM 0.32 serves it.

vLLM turns a Messages request into a chat, and so does the emulator: `system` (a string, or the
`text` of its blocks joined) becomes the first message, then each message with the `text` of its
content; a user's `tool_result` blocks become `tool` messages before it, a user message left with
no text is dropped, and other blocks (images, tool calls, thinking) do not count here. A system
block (or inline system message) that starts with `x-anthropic-billing-header`, Claude Code's
line with a per-request hash, is dropped, as vLLM drops it to keep prefixes cacheable (a system
string loses that line when rendered, as any chat's does). The chat is rendered as the chat path
renders it (router.kvevents.emulator_tokens.render_chat), so a conversation's turns share their KV
prefixes, and a Messages request and the equivalent chat request share their cache blocks.

Usage: `cache_read_input_tokens` is the prompt's cached tokens, `cache_creation_input_tokens` the
ones it computed into full KV blocks, `input_tokens` the rest (the prompt is the sum of the three);
the stream's `message_start` is the exception, its `input_tokens` the whole prompt. `stop_reason`
is `max_tokens` at the request's budget, `end_turn` when the model stops. The reply names the
served model (the first name), whichever alias the request used, or the LoRA adapter it named.

Streamed: `event: NAME` / `data: JSON` events, `message_start`, `content_block_start` with the
first text, a `content_block_delta` per chunk, `content_block_stop`, `message_delta` (the stop
reason and the usage), `message_stop`; no `[DONE]`.

Errors: a body the request model refuses (`max_tokens` is required here) gets vLLM's OpenAI
envelope, `{"error": {"message": "1 validation error:\\n  {...}", "type": "Bad Request", "param":
"body.max_tokens", "code": 400}}`, as vLLM's validation handler answers on every path, with
pydantic's coercions (`"4"` is a fine `max_tokens`, `"yes"` a fine `stream`); any other error
comes in Anthropic's envelope, `{"type": "error", "error": {"type", "message"}}`, as vLLM's
Messages handler translates its errors.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from router.emulator.api import Api, ApiError, Job, SchemaError, Served, finish_reason, openai_error, sse_event
from router.emulator.engine import Sequence
from router.kvevents.emulator_tokens import BILLING_HEADER, PromptError, count_tokens, render_chat

ROLES = ("user", "assistant", "system")
BLOCKS = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}  # vLLM's map from OpenAI's finish reasons
# The error `type` of the handler's own errors by status, as vLLM names them.
KINDS = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
EMPTY = "Cannot apply chat template to an empty conversation. Provide at least one message."


class Messages(Api):
    """One request to POST /v1/messages (or, through `count`, to /v1/messages/count_tokens)."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.id = "chatcmpl-" + uuid.uuid4().hex[:16]
        self.model = served.model
        self.started = False  # the text block has been opened

    def parse(self, body: dict[str, Any]) -> Job:
        max_tokens, stream = validate(body, generating=True)
        prompt = self._prompt(body)
        return Job(prompt, max_tokens, stream, self.served.adapter(body["model"]))

    def count(self, body: dict[str, Any]) -> int:
        """The prompt's tokens, generation prompt included: what count_tokens answers."""
        validate(body, generating=False)
        return count_tokens(self._prompt(body))

    def _prompt(self, body: dict[str, Any]) -> bytes:
        model = body["model"]
        if not self.served.serves(model):
            names = ", ".join(self.served.names)
            raise ApiError(f"The model `{model}` does not exist. Valid aliases: {names}.", "model", 404)
        self.model = self.served.adapter(model) or self.served.model
        chat = conversation(body)
        if not chat:
            raise ApiError(EMPTY, "messages")
        try:
            return render_chat(chat).encode("utf-8", "surrogatepass")
        except PromptError as exc:
            raise ApiError(str(exc), "messages") from None

    def error(self, exc: ApiError) -> bytes:
        if isinstance(exc, SchemaError):
            return openai_error(exc, "Bad Request")
        kind = exc.kind or KINDS.get(exc.status, "BadRequestError")
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": str(exc)}})

    def reply(self, seq: Sequence, text: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "model": self.model,
            "stop_reason": STOP_REASONS[finish_reason(seq)],
            "usage": usage(seq),
        }

    def opening(self, seq: Sequence) -> list[bytes]:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": seq.prompt_tokens, "output_tokens": 0},
        }
        return [sse_event("message_start", {"type": "message_start", "message": message})]

    def chunk(self, text: str, finish: str | None) -> list[bytes]:
        delta = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": text}, "index": 0}
        if self.started:
            return [sse_event("content_block_delta", delta)]
        self.started = True
        block = {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}
        return [sse_event("content_block_start", block), sse_event("content_block_delta", delta)]

    def closing(self, seq: Sequence, text: str) -> list[bytes]:
        stop = {"stop_reason": STOP_REASONS[finish_reason(seq)], "stop_sequence": None}
        return [
            sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse_event("message_delta", {"type": "message_delta", "delta": stop, "usage": usage(seq)}),
        ]

    def end(self) -> bytes:
        return sse_event("message_stop", {"type": "message_stop"})


def usage(seq: Sequence) -> dict[str, int]:
    return {
        "input_tokens": seq.prompt_tokens - seq.cached_tokens - seq.created_cache_tokens,
        "output_tokens": seq.output_tokens,
        "cache_creation_input_tokens": seq.created_cache_tokens,
        "cache_read_input_tokens": seq.cached_tokens,
    }


# -- the chat of a request -------------------------------------------------------------------


def conversation(body: dict[str, Any]) -> list[dict[str, str]]:
    """The chat vLLM makes of a (valid) Messages request."""
    chat: list[dict[str, str]] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(_texts(system, system=True))
    if system:
        chat.append({"role": "system", "content": system})
    for message in body["messages"]:
        role, content = message["role"], message["content"]
        if role == "system":  # kept in place (the emulator's template takes system messages anywhere)
            texts = [content] if isinstance(content, str) else _texts(content)
            text = "".join(t for t in texts if not t.startswith(BILLING_HEADER))
            if text:
                chat.append({"role": "system", "content": text})
        elif isinstance(content, str):
            chat.append({"role": role, "content": content})
        else:
            if role == "user":
                chat += [{"role": "tool", "content": _tool_result(b)} for b in content if b["type"] == "tool_result"]
            text = "".join(_texts(content))
            if text or role != "user":
                chat.append({"role": role, "content": text})
    return chat


def _texts(blocks: list[dict[str, Any]], system: bool = False) -> list[str]:
    texts = [b["text"] for b in blocks if b["type"] == "text" and b.get("text")]
    return [t for t in texts if not t.startswith(BILLING_HEADER)] if system else texts


def _tool_result(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(i.get("text", "")) for i in content if isinstance(i, dict) and i.get("type") == "text")
    return ""


# -- the request model's checks, as pydantic reports them ---------------------------------------

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


class _Problems:
    """pydantic's errors as vLLM's validation handler words them: `N validation error(s):`, then
    each error's dict, its `loc` dotted, its `input` summarised; the first one's field is `param`."""

    def __init__(self) -> None:
        self.errors: list[dict[str, Any]] = []

    def add(
        self, loc: tuple[str | int, ...], kind: str, msg: str, value: Any, ctx: dict[str, Any] | None = None
    ) -> None:
        error = {"type": kind, "loc": ".".join(map(str, ("body", *loc))), "msg": msg, "input": _summary(value)}
        self.errors.append(error | ({"ctx": ctx} if ctx else {}))

    def raise_any(self) -> None:
        if not self.errors:
            return
        n = len(self.errors)
        label = "error" if n == 1 else "errors"
        lines = [_cut(str(error), 1000) for error in self.errors[:10]]
        if n > 10:
            lines.append(f"...and {n - 10} more {label}")
        listed = "".join(f"\n  {line}" for line in lines)
        raise SchemaError(f"{n} validation {label}:{listed}", self.errors[0]["loc"])

    def literal(self, loc: tuple[str | int, ...], value: Any, allowed: tuple[str, ...]) -> None:
        expected = " or ".join((", ".join(map(repr, allowed[:-1])), repr(allowed[-1])))
        self.add(loc, "literal_error", f"Input should be {expected}", value, {"expected": expected})

    def model(self, loc: tuple[str | int, ...], value: Any, name: str) -> None:
        msg = f"Input should be a valid dictionary or instance of {name}"
        self.add(loc, "model_type", msg, value, {"class_name": name})

    def content(self, loc: tuple[str | int, ...], value: Any) -> None:
        """`str | list[AnthropicContentBlock]`: a list that fails fails the string branch too."""
        if isinstance(value, str):
            return
        if not isinstance(value, list):
            self.add(loc, "string_type", "Input should be a valid string", value)
            self.add(loc, "list_type", "Input should be a valid list", value)
            return
        blocks = _Problems()
        for j, block in enumerate(value):
            if not isinstance(block, dict):
                blocks.model((*loc, j), block, "AnthropicContentBlock")
            elif "type" not in block:
                blocks.add((*loc, j, "type"), "missing", "Field required", block)
            elif block["type"] not in BLOCKS:
                blocks.literal((*loc, j, "type"), block["type"], BLOCKS)
            elif block.get("text") is not None and not isinstance(block["text"], str):
                blocks.add((*loc, j, "text"), "string_type", "Input should be a valid string", block["text"])
        if blocks.errors:
            self.add(loc, "string_type", "Input should be a valid string", value)
            self.errors += blocks.errors


def validate(body: dict[str, Any], generating: bool) -> tuple[int, bool]:
    """The request model's checks, field by field in its order (count_tokens' model has no
    `max_tokens` nor `stream`); the budget and the stream flag as pydantic coerces them. Raises
    a SchemaError."""
    problems = _Problems()
    model = body.get("model")
    if "model" not in body:
        problems.add(("model",), "missing", "Field required", body)
    elif not isinstance(model, str):
        problems.add(("model",), "string_type", "Input should be a valid string", model)
    elif not model:
        problems.add(("model",), "value_error", "Value error, Model is required", model, _error("Model is required"))
    messages = body.get("messages")
    if "messages" not in body:
        problems.add(("messages",), "missing", "Field required", body)
    elif not isinstance(messages, list):
        problems.add(("messages",), "list_type", "Input should be a valid list", messages)
    else:
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                problems.model(("messages", i), message, "AnthropicMessage")
                continue
            if "role" not in message:
                problems.add(("messages", i, "role"), "missing", "Field required", message)
            elif message["role"] not in ROLES:
                problems.literal(("messages", i, "role"), message["role"], ROLES)
            if "content" not in message:
                problems.add(("messages", i, "content"), "missing", "Field required", message)
            else:
                problems.content(("messages", i, "content"), message["content"])
    max_tokens, stream = 0, False
    if generating:
        if "max_tokens" not in body:
            problems.add(("max_tokens",), "missing", "Field required", body)
        else:
            max_tokens = _int(body["max_tokens"], problems)
            if max_tokens is not None and max_tokens <= 0:
                positive = "max_tokens must be positive"
                problems.add(("max_tokens",), "value_error", f"Value error, {positive}", max_tokens, _error(positive))
        stream = _bool(body.get("stream"), problems)
    if body.get("system") is not None:
        problems.content(("system",), body["system"])
    problems.raise_any()
    return max_tokens, stream


def _int(value: Any, problems: _Problems) -> Any:
    """pydantic's lax integer: a bool, a whole float, a string of either."""
    loc = ("max_tokens",)
    if isinstance(value, int):
        return int(value)
    number: Any = value
    if isinstance(value, str):
        try:
            number = float(value.strip()) if "." in value or "e" in value.lower() else int(value.strip())
        except ValueError:
            msg = "Input should be a valid integer, unable to parse string as an integer"
            problems.add(loc, "int_parsing", msg, value)
            return None
    if isinstance(number, float):
        if number.is_integer():
            return int(number)
        msg = "Input should be a valid integer, got a number with a fractional part"
        problems.add(loc, "int_from_float", msg, value)
        return None
    if isinstance(number, int):
        return number
    problems.add(loc, "int_type", "Input should be a valid integer", value)
    return None


def _bool(value: Any, problems: _Problems) -> bool:
    """pydantic's lax boolean (`stream: bool | None = False`)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    if isinstance(value, (int, float, str)):
        problems.add(("stream",), "bool_parsing", "Input should be a valid boolean, unable to interpret input", value)
    else:
        problems.add(("stream",), "bool_type", "Input should be a valid boolean", value)
    return False


def _error(message: str) -> dict[str, Any]:
    return {"error": ValueError(message)}


def _summary(value: Any) -> Any:
    """The `input` of an error as vLLM bounds it: containers described, long text cut."""
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return _cut(value if isinstance(value, str) else str(value), 200)


def _cut(text: str, limit: int) -> str:
    return text[:limit] + "...[truncated]" if len(text) > limit else text
