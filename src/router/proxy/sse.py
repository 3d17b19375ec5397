"""What the router reads of a replica's answer: SSE event boundaries, `data:` lines, token usage."""

from __future__ import annotations

import re
from typing import Any, Protocol

# the blank line that ends an SSE event, in any of the spec's line endings
EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
# one whole event: group 1 is the event without its blank line
EVENT = re.compile(rb"(.*?)(?:" + EVENT_END.pattern + rb")", re.DOTALL)
DATA_LINE = re.compile(rb"^data: ?(.*)$", re.MULTILINE)
# an answer that calls tools, in any API's shape: an OpenAI chat choice's non-empty `tool_calls` (or
# its `finish_reason`: vLLM ends a named tool choice with `stop`, so the calls themselves count too),
# an Anthropic `tool_use` block or stop reason, a Responses API `function_call` item. Inside a JSON
# string a quote is escaped, so a reply that merely mentions these names never matches.
_TOOLS = re.compile(rb'"tool_calls": ?\[\{|"finish_reason": ?"tool_calls"|"tool_use"|"type": ?"function_call"')


def calls_tools(data: bytes) -> bool:
    """Whether serialised answer bytes (a whole answer, or some of a stream's events) call tools:
    the conversation comes back within seconds, with the tools' results."""
    return (b"tool" in data or b"function_call" in data) and _TOOLS.search(data) is not None


def usage_of(obj: Any) -> tuple[int, int, int] | None:
    """(prompt, cached, completion) tokens from a response's or a stream chunk's `usage`: OpenAI's
    names, the Responses API's (`input_tokens`, `input_tokens_details`, `output_tokens`), and
    Anthropic's, where `input_tokens` counts only what was computed and the prompt is that plus
    `cache_read_input_tokens` (cached) and `cache_creation_input_tokens`."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    try:
        prompt = int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
        read = usage.get("cache_read_input_tokens")
        if read is not None or usage.get("cache_creation_input_tokens") is not None:  # Anthropic's
            cached = int(read or 0)
            prompt += cached + int(usage.get("cache_creation_input_tokens") or 0)
        prompt = max(prompt, 0)
        completion = max(int(usage.get("completion_tokens") or usage.get("output_tokens") or 0), 0)
        return prompt, min(max(int(cached or 0), 0), prompt), completion  # odd figures never go negative
    except (TypeError, ValueError, OverflowError):
        return None


class StreamFramer(Protocol):
    """Turns a replica's SSE bytes into the client's, whole events at a time, reading usage on the
    way: the forwarding framer (forward.py) and a continuation's splicer (resume.py)."""

    strip_usage: bool  # the router asked for usage on the client's behalf: the usage event is hidden
    usage: tuple[int, int, int] | None  # (prompt, cached, completion) tokens, once the usage event passed
    done: bool  # `[DONE]` has passed: nothing may follow
    events: int  # events forwarded that carry generated tokens: about one token each (router.tenancy.budgets)
    tools: bool  # the answer called tools (`calls_tools`): its conversation comes back within seconds

    def feed(self, chunk: bytes) -> bytes:
        """The events `chunk` completes, as the client gets them."""
        ...

    def release(self) -> bytes:
        """The finish event held back, if any (the stream ended or broke before the next event)."""
        ...

    def pending(self) -> bytes:
        """What is left after the last whole event, once the stream has ended."""
        ...
