"""What each API a replica serves plugs into its one request path, and the errors they answer with.

A generating request goes the same way whatever its API (OpenAI chat and text completions, the
Responses API, Anthropic's Messages API): the body is parsed into a `Job` (a prompt, a token
budget, streamed or not), the engine runs it as a `Sequence`, and the reply goes out whole or as
a stream, with the replica's faults applied alike (router.emulator.server). An `Api` object, one
per request, knows only the wire format: how to read the body, and which bytes say what.

A stream is `opening`, one `chunk` per piece of text, `closing` (every event of these counts as
one chunk for the stall and drop faults), then `end`, the API's end-of-stream marker (`[DONE]`),
which does not count.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import orjson

from router.emulator.engine import Sequence

# The `type` of an OpenAI-shaped error body by status, where the error does not name its own.
OPENAI_KINDS = {404: "NotFoundError", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """A request answered with an error; each API puts it in its own envelope."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind


class SchemaError(ApiError):
    """The body does not fit the API's schema (what vLLM's request models refuse before its
    handler runs): vLLM answers these in its OpenAI envelope on every path."""


@dataclass(frozen=True)
class Served:
    """The names a replica answers to: its model, more names for it, its LoRA adapters."""

    model: str
    aliases: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()
    default_max_tokens: int = 256
    tools: bool = False  # it has a tool parser (vLLM's --tool-call-parser, --enable-auto-tool-choice)

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys((self.model, *self.aliases)))

    def serves(self, model: Any) -> bool:
        return model is None or model == self.model or model in self.aliases + self.adapters

    def check(self, model: Any) -> None:
        """A request naming a model this replica does not serve gets vLLM's 404."""
        if not self.serves(model):
            raise ApiError(f"The model `{model}` does not exist.", "model", 404)

    def adapter(self, model: Any) -> str | None:
        """The LoRA adapter a request names, if it names one of this replica's."""
        return model if isinstance(model, str) and model in self.adapters else None


@dataclass(frozen=True)
class Job:
    """What a parsed request asks of the engine."""

    prompt: bytes
    max_tokens: int
    stream: bool
    adapter: str | None = None
    cache_salt: str | None = None  # vLLM's `cache_salt`: the request's blocks are its own


class Api(abc.ABC):
    """One request to a generating endpoint, in its API's wire format."""

    id: str  # its response's id, set by each API (a traced request's gen_ai.request.id)
    prompt_field = "messages"  # what an empty or too long prompt is blamed on
    max_tokens_field = "max_tokens"  # and a reply that does not fit

    @abc.abstractmethod
    def parse(self, body: dict[str, Any]) -> Job:
        """Read the request; raises ApiError."""

    @abc.abstractmethod
    def error(self, exc: ApiError) -> bytes:
        """The JSON body of an error answer (its status is `exc.status`)."""

    @abc.abstractmethod
    def reply(self, seq: Sequence, text: str) -> dict[str, Any]:
        """The whole answer of a request that was not streamed."""

    def opening(self, seq: Sequence) -> list[bytes]:
        """A stream's events before the first token."""
        return []

    @abc.abstractmethod
    def chunk(self, text: str, finish: str | None) -> list[bytes]:
        """The events carrying the next piece of the reply; `finish` is set on the last."""

    def closing(self, seq: Sequence, text: str) -> list[bytes]:
        """A stream's events after the last token; `text` is the whole reply."""
        return []

    def end(self) -> bytes:
        """The end-of-stream marker, sent whatever the faults."""
        return b""


def finish_reason(seq: Sequence) -> str:
    """Why a finished sequence stopped, in OpenAI's words: `length` at its token budget, `stop`
    when the model ended it (replies here always run to the budget)."""
    return "length" if seq.output_tokens >= seq.max_tokens else "stop"


def engine_error(
    message: str, status: int = 400, kind: str = "invalid_request_error", param: str | None = None
) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}` as vLLM's OpenAI server answers: its `code`
    is the HTTP status, a number (the router's own errors carry a string there, as OpenAI's do)."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


def openai_error(exc: ApiError, kind: str | None = None) -> bytes:
    """An ApiError as vLLM's OpenAI server answers it."""
    kind = kind or exc.kind or OPENAI_KINDS.get(exc.status, "invalid_request_error")
    return engine_error(str(exc), exc.status, kind, exc.param)


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One named server-sent event: `event: NAME`, then its JSON."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
