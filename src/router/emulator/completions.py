"""The emulator's OpenAI chat and text completions (`/v1/chat/completions`, `/v1/completions`).

A chat renders its messages with the emulator's chat template (router.kvevents.emulator_tokens); a
text completion's prompt is a single string. `cache_salt` (vLLM's extension: a non-empty string)
keeps the request's KV blocks apart from those of requests without it or with another salt.
Streams send `data: {chunk}` lines (a chat's first chunk carries the assistant role and no text),
a usage chunk when `stream_options.include_usage` is set, then `data: [DONE]`.

A chat that offers `tools` and requires one (`tool_choice` `required`, or a function named) is,
on a replica started with vLLM's `--tool-call-parser` and `--enable-auto-tool-choice`, answered
with a call of it (the first tool offered, or the one named), its generated text as the
call's arguments (`{"text": ...}`), streamed as argument deltas; its finish reason is what vLLM 0.32
gives, as OpenAI does: `tool_calls` when required, `stop` when named. Other tool choices are
answered in text (the emulator's model never chooses a tool itself). Without both flags any tool
choice but `none` gets vLLM 0.32's 400 (its parser is loaded only with both, checked here).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from router.emulator.api import Api, ApiError, Job, Served, finish_reason, openai_error
from router.emulator.engine import Sequence
from router.kvevents.emulator_tokens import PromptError, render_chat


class Completions(Api):
    """One chat (`chat=True`) or text completion request."""

    def __init__(self, served: Served, chat: bool) -> None:
        self.served = served
        self.chat = chat
        self.prompt_field = "messages" if chat else "prompt"
        self.include_usage = False
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.tool: str | None = None  # the function a chat must call (`tool_choice`)
        self.tool_finish = "tool_calls"  # ... and its finish reason (named: `stop`)
        self.called = False  # a stream sent the call's opening (its id and name)

    def parse(self, body: dict[str, Any]) -> Job:
        self.served.check(body.get("model"))
        n = body.get("n", 1)
        if n != 1:
            raise ApiError("only n=1 is supported", "n")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = self.served.default_max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ApiError("max_tokens must be a positive integer", "max_tokens")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError("stream must be true or false", "stream")
        options = body.get("stream_options")
        if options is not None and not stream:
            raise ApiError("stream_options can only be set when stream is true", "stream_options")
        if not isinstance(options or {}, dict):
            raise ApiError("stream_options must be an object", "stream_options")
        self.include_usage = flag(options or {}, "include_usage", False, "stream_options")
        cache_salt = body.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ApiError("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
        add_generation_prompt = flag(body, "add_generation_prompt", True)
        continue_final_message = flag(body, "continue_final_message", False)
        if continue_final_message and add_generation_prompt:
            raise ApiError("continue_final_message needs add_generation_prompt set to false", "continue_final_message")
        try:
            if self.chat:
                text = render_chat(
                    body.get("messages"),  # type: ignore[arg-type]
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                )
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                if not isinstance(prompt, str):
                    raise PromptError("'prompt' must be a string (token-id and batched prompts are not supported)")
                text = prompt
        except PromptError as exc:
            raise ApiError(str(exc), self.prompt_field) from None
        if self.chat:
            self.tool, self.tool_finish = required_tool(body, self.served.tools)
        prompt_bytes = text.encode("utf-8", "surrogatepass")
        return Job(prompt_bytes, max_tokens, stream, self.served.adapter(body.get("model")), cache_salt)

    def error(self, exc: ApiError) -> bytes:
        return openai_error(exc)

    def reply(self, seq: Sequence, text: str) -> dict[str, Any]:
        finish = finish_reason(seq)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tool is not None:
                arguments = '{"text": ' + orjson.dumps(text).decode() + "}"  # (as a stream's deltas add up)
                message = {"role": "assistant", "content": None, "tool_calls": [self._call(arguments)]}
                finish = self.tool_finish
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.served.model,
            "choices": [choice],
            "usage": usage(seq),
        }

    def opening(self, seq: Sequence) -> list[bytes]:
        if not self.chat:
            return []
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        return [self._data([role])]

    def chunk(self, text: str, finish: str | None) -> list[bytes]:
        if self.tool is not None:
            piece = orjson.dumps(text).decode()[1:-1] + ('"}' if finish is not None else "")
            events = []
            if not self.called:  # as vLLM streams it: the call's opening (its id and name), then its arguments
                self.called = True
                opening = {"index": 0, **self._call(None)}
                events.append(self._data([{"index": 0, "delta": {"content": None, "tool_calls": [opening]}}]))
                piece = '{"text": "' + piece
            call = {"index": 0, "function": {"arguments": piece}}
            done = self.tool_finish if finish is not None else None
            delta = {"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": done, "logprobs": None}
            return [*events, self._data([delta])]
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return [self._data([choice])]

    def closing(self, seq: Sequence, text: str) -> list[bytes]:
        return [self._data([], usage=usage(seq))] if self.include_usage else []

    def end(self) -> bytes:
        return b"data: [DONE]\n\n"

    def _call(self, arguments: str | None) -> dict[str, Any]:
        """A call of the chat's tool: whole (its `arguments`), or a stream's opening (None: its name only)."""
        assert self.tool is not None
        function = {"name": self.tool} if arguments is None else {"name": self.tool, "arguments": arguments}
        return {"id": "chatcmpl-tool-" + self.id[-16:], "type": "function", "function": function}

    def _data(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {"id": self.id, "object": self.object, "created": self.created, "model": self.served.model}
        return b"data: " + orjson.dumps({**chunk, "choices": choices, **extra}) + b"\n\n"


def required_tool(body: dict[str, Any], parser: bool) -> tuple[str | None, str]:
    """The function a chat must call, and the finish reason of the answer that calls it: the first
    of `tools` for `tool_choice` `required` (`tool_calls`), the one named (`stop`); else None.
    Without a tool parser (`parser`), any tool choice but `none` is refused in vLLM 0.32's words."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not isinstance(tools, list) or not tools:
        if choice is not None and choice not in ("none", "auto"):
            raise ApiError("tool_choice needs tools", "tool_choice")
        return None, "tool_calls"
    names = [t["function"].get("name") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if len(names) != len(tools) or not all(isinstance(n, str) and n for n in names):
        raise ApiError("each tool must be {'type': 'function', 'function': {'name': ...}}", "tools")
    if choice not in (None, "none", "auto", "required") and not isinstance(choice, dict):
        raise ApiError("tool_choice must be none, auto, required or a named function", "tool_choice")
    named = None
    if isinstance(choice, dict):
        function = choice.get("function")
        named = function.get("name") if isinstance(function, dict) else None
        if named not in names:
            raise ApiError(f"tool_choice names a function not in tools: {named!r}", "tool_choice")
    if not parser and choice not in (None, "none"):
        if choice == "auto":
            raise ApiError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        wanted = f'function "{named}"' if named is not None else f'"{choice}"'
        raise ApiError(f"tool_choice={wanted} requires --tool-call-parser to be set")
    if choice == "required":
        return names[0], "tool_calls"
    if named is not None:
        return named, "stop"
    return None, "tool_calls"


def flag(obj: dict[str, Any], name: str, default: bool, where: str | None = None) -> bool:
    value = obj.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false", where or name)
    return value


def usage(seq: Sequence) -> dict[str, Any]:
    return {
        "prompt_tokens": seq.prompt_tokens,
        "completion_tokens": seq.output_tokens,
        "total_tokens": seq.prompt_tokens + seq.output_tokens,
        # vLLM 0.32's details: what was read from cache, and what this request wrote to it in full blocks
        "prompt_tokens_details": {"cached_tokens": seq.cached_tokens, "created_cache_tokens": seq.created_cache_tokens},
    }
