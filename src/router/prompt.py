"""A request's prompt as the prefix index sees it: its text in order, cut into chained blocks.

Chat messages render as `<|role|>content<|end|>` one after another (a completion's prompt, or an
embedding's input, as it is; an Anthropic Messages request's `system` field as a first system
message, as the engine's chat template gets it; a system text's Claude Code attribution line, new
in every request, left out as vLLM leaves it out), so the rendering of a history is a prefix of the rendering of any
longer history: every turn of a conversation shares its earlier turns' blocks. The bytes are cut
into `block_bytes`-byte blocks; block i's key is XXH3-64 of its bytes seeded with block i-1's key,
block 0's seeded with XXH3-64 of the model name (so two models never share a block). Two prompts
share their first k keys exactly when they share their first k blocks of bytes. A trailing partial
block has no key: it is at most `block_bytes - 1` bytes the index cannot vouch for.

The rendering is not the engine's chat template, and does not need to be: the index only asks
"which replica was sent this prefix", and a prefix of the rendering is a prefix of the template's
output (templates wrap each message the same way whatever follows). Bytes become tokens at the
ratio the replicas' `usage` reports (router.placement).

Worked example, block_bytes 16, model "m": messages [system "You are terse.", user "Hi"] render
to `<|system|>You are terse.<|end|><|user|>Hi<|end|>` (45 bytes): two blocks, keys
h0 = xxh3_64(bytes[0:16], xxh3_64("m")), h1 = xxh3_64(bytes[16:32], h0); `history` is the
rendering of every message but the last (34 bytes, 2 whole blocks): what the replica that served
the previous turn holds for sure, its reply included.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from router.kvevents.tokens import EngineTokens
from router.prefix import chain_of_parts
from router.ring import xxh3_64

if TYPE_CHECKING:
    from typing_extensions import Buffer

BYTES_PER_TOKEN = 4.0  # a prompt's tokens estimated from its bytes (English text), where nothing says better
MAX_MESSAGES = 4096  # messages rendered at most: bounded work whatever the body holds
MAX_PARTS = 256  # content parts of one message


@dataclass(frozen=True, slots=True)
class Prompt:
    chain: array[int]  # the blocks' keys (typecode 'Q')
    nbytes: int  # bytes rendered (the partial block included)
    history_blocks: int  # blocks covered by every message but the last (0 for a prompt)
    # the engine's own tokens, where replicas publish KV events (router.engines.kvfeed)
    tokens: EngineTokens | None = None
    # a chat with no assistant turn yet: a new conversation, whatever shared prefix it opens with
    # (a system or tool prompt others sent too), not one continuing where it was served
    opening: bool = False


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content[:MAX_PARTS] if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


BILLING_HEADER = "x-anthropic-billing-header"


def _unbilled(text: str) -> str:
    """A system text without Claude Code's attribution line, which carries a new hash in every
    request: vLLM drops it before the chat template (so its prefix cache still hits), and so must
    the index, or no two requests of a Claude Code session would share a block."""
    return text.partition("\n")[2] if text.startswith(BILLING_HEADER) else text


def parts_of(body: Mapping[str, Any]) -> tuple[list[str], int]:
    """The prompt as pieces whose concatenation is its rendering, and the number of pieces before
    the last message (its history); ([], 0) when the body holds no prompt the index can use. The
    pieces are the body's own strings: nothing is copied until the chain is hashed."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        mark = 0
        system = body.get("system")  # Anthropic's: a string, or text blocks
        if isinstance(system, str | list):
            messages = [{"role": "system", "content": system}, *messages[: MAX_MESSAGES - 1]]
        for m in messages[:MAX_MESSAGES]:
            if isinstance(m, Mapping):
                mark = len(parts)
                role = m.get("role")
                content = m.get("content")
                parts += ("<|", role if isinstance(role, str) else "", "|>")
                is_system = role == "system"
                if isinstance(content, str):
                    parts.append(_unbilled(content) if is_system else content)
                elif isinstance(content, list):
                    texts = (
                        p["text"]
                        for p in content[:MAX_PARTS]
                        if isinstance(p, Mapping) and isinstance(p.get("text"), str)
                    )
                    parts += (_unbilled(t) for t in texts) if is_system else texts
                parts.append("<|end|>")
        return parts, mark
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, str):
            return [value], 0
    return [], 0


def render(body: Mapping[str, Any]) -> tuple[bytes, int]:
    """(the prompt's bytes, the length of the part before the last message); (b"", 0) when the
    body holds no prompt the index can use."""
    parts, mark = parts_of(body)
    head = "".join(parts[:mark]).encode("utf-8", "surrogatepass")
    return head + "".join(parts[mark:]).encode("utf-8", "surrogatepass"), len(head)


@functools.lru_cache(maxsize=1024)
def _seed_of(model: str) -> int:
    return xxh3_64(model)


def model_seed(model: Any) -> int:
    """The chain's seed: XXH3-64 of the model name (an absent or odd model counts as "")."""
    if not isinstance(model, str):
        return _seed_of("")
    return _seed_of(model) if len(model) <= 256 else xxh3_64(model)  # the cache keeps short names only


def prompt_of(body: Mapping[str, Any], block_bytes: int) -> Prompt | None:
    """The request's prompt cut into blocks; None when it has no whole block."""
    parts, mark = parts_of(body)
    if not parts:
        return None
    seed = model_seed(body.get("model"))
    chain, total, head = chain_of_parts(cast("list[str | Buffer]", parts), block_bytes, seed, mark)
    if not chain:
        return None
    return Prompt(chain, total, head // block_bytes, None, _opening(body))


def _opening(body: Mapping[str, Any]) -> bool:
    messages = body.get("messages")
    return isinstance(messages, list) and not any(
        isinstance(m, Mapping) and m.get("role") == "assistant" for m in messages[:MAX_MESSAGES]
    )
