"""The emulator's tokenizer and chat template: deterministic, cheap, and exact about prefixes.

The router knows it as a built-in (router.engines.tokens finds it for an engine whose /v1/models
says `owned_by: router-emulator`), as it finds a real model's tokenizer from its files: both the
emulator and the router import it from here.

One token is 4 bytes of UTF-8 text (about one short English word), so a prompt of n bytes is
ceil(n / 4) tokens, and a KV block of `block_size` tokens is `4 * block_size` bytes. Block
identities are chained XXH3 hashes of those bytes (`block_chain`, the prefix index's keys): two
prompts share their first k blocks exactly when they share their first `k * 4 * block_size`
bytes, which is how vLLM's prefix cache keys blocks by token ids. Generated text is made of
4-byte tokens too, so a reply appended to the history re-tokenizes to the same tokens the
replica produced.

A token's id is its 4 bytes read as a little-endian unsigned integer, a short last token padded
with zero bytes (`token_ids`): `"Hello, w"` is the ids 1819043144 (`Hell`) and 1998597231 (`o, w`),
and `"!"` is 33. Ids are what the render endpoints answer and what KV-cache events carry; block N
of a prompt holds token ids N * block_size .. (N + 1) * block_size - 1.

A request for a LoRA adapter, or with a `cache_salt`, chains its block hashes from a seed of its
own (`cache_seed`), as vLLM puts the adapter's name and the salt in its block hashes' extra keys:
its blocks are never another adapter's or another salt's, and a plain request's seed is 0.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from router.errors import RouterError
from router.prefix import block_chain
from router.ring import xxh3_64

BYTES_PER_TOKEN = 4
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's attribution line in a system prompt

# Four-byte tokens for generated text: lower-case syllables and a space, all ASCII.
_VOCAB = tuple(f"{a}{b}{c} " for a in "bcdfglmnprstvz" for b in "aeiou" for c in "lnrst")


def count_tokens(data: bytes) -> int:
    return -(-len(data) // BYTES_PER_TOKEN)


def token_ids(data: bytes) -> list[int]:
    """The ids of the tokens of `data`: each 4 bytes read as a little-endian unsigned integer,
    the last token padded with zero bytes."""
    n = count_tokens(data)
    return list(struct.unpack(f"<{n}I", data.ljust(n * BYTES_PER_TOKEN, b"\0")))


def cache_seed(adapter: str | None, cache_salt: str | None) -> int:
    """The seed of a request's block hash chain: 0 for the base model without a salt, else a hash
    of the LoRA adapter's name and the salt (neither can pass for the other)."""
    if adapter is None and cache_salt is None:
        return 0
    return xxh3_64(repr((adapter, cache_salt)))


def block_hashes(data: bytes, block_size: int, seed: int = 0) -> list[int]:
    """Chained hashes of the full KV blocks of `data` (a trailing partial block has none)."""
    return list(block_chain(data, block_size * BYTES_PER_TOKEN, seed))


def generated_text(prompt_seed: int, start: int, count: int) -> str:
    """Tokens `start .. start + count - 1` of the reply to a prompt; greedy-like: the same
    prompt always gets the same reply."""
    return "".join(_VOCAB[xxh3_64(b"%d" % (start + i), prompt_seed) % len(_VOCAB)] for i in range(count))


class PromptError(RouterError, ValueError):
    """A request whose prompt cannot be rendered; the message is meant for the API client (the
    emulator's), or a chat the router's built-in tokenizer cannot tokenize (router.engines.tokens)."""


def _content_text(content: Any, where: str, system: bool = False) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise PromptError(f"{where}: only text content parts are supported")
            parts.append(part["text"])
    else:
        raise PromptError(f"{where}: content must be a string or a list of text parts")
    if system:  # vLLM drops Claude Code's attribution line: its per-request hash would defeat prefix caching
        parts = [p.partition("\n")[2] if p.startswith(BILLING_HEADER) else p for p in parts]
    return "".join(parts)


def _calls_text(calls: Any, where: str) -> str:
    """An assistant message's tool calls, as its prompt holds them: `<|call|>name arguments` each."""
    if not isinstance(calls, list):
        raise PromptError(f"{where} must be a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise PromptError(f"{where}: each call must be {{'function': {{'name': ..., 'arguments': ...}}}}")
        arguments = function.get("arguments")
        out.append(f"<|call|>{function['name']} {arguments if isinstance(arguments, str) else ''}")
    return "".join(out)


def render_chat(
    messages: Sequence[Any], *, add_generation_prompt: bool = True, continue_final_message: bool = False
) -> str:
    """The prompt text of a chat: `<|role|>content<|end|>` per message (an assistant's tool calls
    after its content, `<|call|>name arguments` each), then `<|assistant|>`.

    The rendering of a history is a prefix of the rendering of any longer history, so every turn
    of a conversation shares the previous turn's prompt (and reply) as its cached prefix. As
    vLLM 0.32's renderer does, a system text (or text part) that starts with Claude Code's
    `x-anthropic-billing-header` line loses that line.
    `continue_final_message` (vLLM's extension) leaves the last assistant message open, so the
    model continues it instead of starting a new one.
    """
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise PromptError(f"messages[{i}].role must be a non-empty string")
        text = _content_text(message.get("content"), f"messages[{i}].content", system=role == "system")
        calls = message.get("tool_calls")
        if calls:
            text += _calls_text(calls, f"messages[{i}].tool_calls")
        last = i == len(messages) - 1
        if last and continue_final_message:
            if role != "assistant":
                raise PromptError("continue_final_message needs the last message to be from the assistant")
            out.append(f"<|{role}|>{text}")
        else:
            out.append(f"<|{role}|>{text}<|end|>")
    if add_generation_prompt and not continue_final_message:
        out.append("<|assistant|>")
    return "".join(out)
