"""The emulator's OpenAI Responses API (`POST /v1/responses`), as vLLM serves it.

A response is stored (unless `store` is false) in the replica's memory, as vLLM's in-memory store
keeps it: the conversation so far, for a later request to continue with `previous_response_id`.
Only this replica has it. A request naming an id it never stored (or has evicted: the store keeps
the latest `STORED` responses) gets vLLM's 404, `Response with id '...' not found.`

The conversation is rendered as a chat (router.kvevents.emulator_tokens.render_chat): `instructions` as
the system message (for this request only, as the API says), then the stored history, then the
new `input` (a string, or a list of messages whose content is a string or parts with `text`). So
each turn's prompt starts with the previous turn's prompt and reply: its KV cache is reused here.

Streamed, it sends `event: response.created`, one `response.output_text.delta` per chunk, then
`response.completed` carrying the whole response and its `usage` (`input_tokens`,
`input_tokens_details.cached_tokens`, `output_tokens`); no `[DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any

from router.emulator.api import Api, ApiError, Job, Served, openai_error, sse_event
from router.emulator.engine import Sequence
from router.kvevents.emulator_tokens import PromptError, render_chat

STORED = 1000  # responses kept, newest first (vLLM's store is unbounded unless told; a test needs a bound)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise ApiError(f"{where}[{i}] must be a part with `text`", "input")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(f"{where} must be a string or a list of parts", "input")


def input_messages(value: Any) -> list[dict[str, str]]:
    """The request's `input` as chat messages."""
    if isinstance(value, str):
        if not value:
            raise ApiError("'input' must not be empty", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError("'input' must be a string or a non-empty list of messages", "input")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise ApiError(f"input[{i}] must be a message with a role", "input")
        out.append({"role": item["role"], "content": _text(item.get("content"), f"input[{i}].content")})
    return out


class ResponseStore:
    """Stored conversations by response id, the newest `STORED` of them."""

    def __init__(self, size: int = STORED) -> None:
        self.size = size
        self._items: OrderedDict[str, list[dict[str, str]]] = OrderedDict()

    def history(self, response_id: str) -> list[dict[str, str]]:
        found = self._items.get(response_id)
        if found is None:
            raise ApiError(f"Response with id '{response_id}' not found.", "previous_response_id", 404)
        self._items.move_to_end(response_id)
        return found

    def forget(self, response_id: str) -> None:
        self._items.pop(response_id, None)

    def put(self, response_id: str, conversation: list[dict[str, str]]) -> None:
        self._items[response_id] = conversation
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


class Turn:
    """One request to /v1/responses: its conversation, and the response object it builds."""

    def __init__(self, body: dict[str, Any], store: ResponseStore, model: str) -> None:
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise ApiError("previous_response_id must be a string", "previous_response_id")
        self.previous = previous or None
        history = list(store.history(self.previous)) if self.previous else []
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ApiError("instructions must be a string", "instructions")
        self.new = history + input_messages(body.get("input"))
        self.messages = ([{"role": "system", "content": instructions}] if instructions else []) + self.new
        keep = body.get("store", True)
        if not isinstance(keep, bool):
            raise ApiError("store must be true or false", "store")
        self.store = store if keep else None
        self.model = model
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())

    def prompt(self) -> bytes:
        try:
            return render_chat(self.messages).encode("utf-8", "surrogatepass")
        except PromptError as exc:
            raise ApiError(str(exc), "input") from None

    def response(self, text: str, usage: dict[str, Any] | None, status: str = "completed") -> dict[str, Any]:
        output = []
        if status == "completed":
            output = [
                {
                    "type": "message",
                    "id": "msg_" + self.id[5:],
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ]
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "previous_response_id": self.previous,
            "store": self.store is not None,
            "usage": usage,
        }

    def finished(self, text: str) -> None:
        """The reply is whole: store the conversation with it, for a later turn to continue."""
        if self.store is not None:
            self.store.put(self.id, [*self.new, {"role": "assistant", "content": text}])


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def event(kind: str, sequence: int, **fields: Any) -> bytes:
    """One SSE event of a Responses stream: `event:` names it, `data:` repeats the name as `type`."""
    return sse_event(kind, {"type": kind, "sequence_number": sequence, **fields})


class Responses(Api):
    """One request to POST /v1/responses: a `Turn`, served on the replica's request path."""

    prompt_field = "input"
    max_tokens_field = "max_output_tokens"

    def __init__(self, served: Served, store: ResponseStore) -> None:
        self.served = served
        self.store = store
        self.events = 0  # sequence_number of the next event

    def parse(self, body: dict[str, Any]) -> Job:
        model = body.get("model")
        self.served.check(model)
        max_tokens = body.get("max_output_tokens", self.served.default_max_tokens)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ApiError("max_output_tokens must be a positive integer", "max_output_tokens")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError("stream must be true or false", "stream")
        self.turn = Turn(body, self.store, model if isinstance(model, str) else self.served.model)
        return Job(self.turn.prompt(), max_tokens, stream, self.served.adapter(model))

    def error(self, exc: ApiError) -> bytes:
        return openai_error(exc)

    def reply(self, seq: Sequence, text: str) -> dict[str, Any]:
        self.turn.finished(text)
        return self.turn.response(text, usage(seq.prompt_tokens, seq.cached_tokens, seq.output_tokens))

    def opening(self, seq: Sequence) -> list[bytes]:
        return [self._event("response.created", response=self.turn.response("", None, "in_progress"))]

    def chunk(self, text: str, finish: str | None) -> list[bytes]:
        item = "msg_" + self.turn.id[5:]
        return [self._event("response.output_text.delta", item_id=item, output_index=0, delta=text)]

    def closing(self, seq: Sequence, text: str) -> list[bytes]:
        return [self._event("response.completed", response=self.reply(seq, text))]

    def _event(self, kind: str, **fields: Any) -> bytes:
        self.events += 1
        return event(kind, self.events - 1, **fields)
