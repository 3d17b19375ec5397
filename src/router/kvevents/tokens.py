"""A request in the engine's own tokens, cut into the engine's blocks and keyed by the router's chained hash.

An engine's KV-cache events name token blocks, so the index they feed is matched with token
blocks: block i of a prompt is its token ids [i x block_size, (i + 1) x block_size), and its key
is XXH3-64 of those ids (8 bytes each, little-endian) seeded with block i-1's key; block 0 is
seeded with `root_of(lora_name, cache_salt)`, because an engine keeps the blocks of two adapters,
or of two salts, apart. The engine's own hash (vLLM: SHA-256 or its builtin hash, with a seed)
is not ours to copy; the router keys the same token ids its own way, on both sides: the events
(router.kvevents.holdings) and the requests (here).

Only whole blocks are keyed, and never the prompt's last token: an engine always computes that
one (a prompt held whole still recomputes its last block's worth in vLLM: 318 tokens in blocks
of 32 hit at most 288), so a chain of n tokens has (n - 1) // block_size keys.

Worked example, block_size 2: token ids [5, 6, 7, 8, 9] -> 2 keys, k0 = xxh3(u64le(5, 6), root),
k1 = xxh3(u64le(7, 8), k0); token 9 is the one the engine computes anyway.

Where the token ids come from: the model's own tokenizer and chat template, read from its files
(`Tokenizer`: `tokenizer.json` with the `tokenizers` package, the template from
`chat_template.jinja` or `tokenizer_config.json`, rendered with Jinja as the engine renders it),
or, for router-emulator's replicas, the emulator's own (`EmulatorTokenizer`); router.engines.tokens
finds which from what each engine says it serves. A conversation's earlier messages are not
tokenized again, and its template is rendered once a turn: each prompt's ids are kept (bounded
LRU) by a hash of its messages, and the next turn tokenizes only what follows when its text starts
with the kept one (it does for every template that wraps each message alike and opens a reply with
its generation prompt; a hash of the text checks it, else the turn is tokenized whole). The
chains made of a turn's ids are kept beside them, so the next turn's chain hashes only the
blocks that follow its history's (`Turn`, `extend_chain`).
Where no tokenizer can be had, the engine tokenizes a conversation off the request's path and
its next turn knows the tokens of its history only (`EngineTokens.whole` False).
"""

from __future__ import annotations

import json
import os
import sys
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

from router.errors import RouterError
from router.kvevents.emulator_tokens import render_chat, token_ids
from router.prefix import block_chain
from router.ring import xxh3_64

KEPT_TOKENS = 2_000_000  # token ids a store of conversations keeps at most
KEPT_ENTRIES = 100_000  # ... and prompts (short ones hold few ids but cost their entry)
HISTORY_LOOKBACK = 4  # messages back a new turn looks for a kept conversation
_ROOT_TAG = b"kvar-token-root\x00"
_LITTLE = sys.byteorder == "little"


def root_of(lora_name: str | None, salt: str | None) -> int:
    """Block 0's seed: the adapter and the cache salt a chain was computed under (None: neither)."""
    data = _ROOT_TAG + (lora_name or "").encode("utf-8", "surrogatepass") + b"\x00"
    return xxh3_64(data + (salt or "").encode("utf-8", "surrogatepass"))


_ROOT = root_of(None, None)


def _ids_bytes(ids: Sequence[int]) -> bytes:
    a = ids if isinstance(ids, array) and ids.typecode == "Q" else array("Q", ids)
    if not _LITTLE:
        a = array("Q", a)  # (never the caller's own)
        a.byteswap()
    return a.tobytes()


def token_chain(ids: Sequence[int], block_size: int, seed: int) -> array[int]:
    """The keys of the whole blocks of `ids` (all of them: an event's blocks are whole)."""
    n = len(ids) // block_size
    if n <= 0:
        return array("Q")
    return block_chain(_ids_bytes(ids[: n * block_size]), 8 * block_size, seed)


def request_chain(ids: Sequence[int], block_size: int, seed: int) -> array[int]:
    """The keys of the blocks an engine may hold of a prompt of `ids`: all but its last token."""
    return token_chain(ids[: max(0, len(ids) - 1)], block_size, seed)


Chains = dict[tuple[int, int], "array[int]"]  # a prompt's chains by (block size, seed), made as asked


def extend_chain(head: array[int], ids: Sequence[int], block_size: int, seed: int) -> array[int]:
    """`request_chain(ids, block_size, seed)` where `head` is already the chain of a prompt whose
    ids begin `ids`: its keys are kept and only the blocks after them are hashed (chained from its
    last key). A prompt's every whole block but its last token's is one of a longer prompt's."""
    n = max(0, len(ids) - 1) // block_size
    m = len(head)
    if m == 0 or m > n:
        return request_chain(ids, block_size, seed)
    if m == n:
        return array("Q", head)
    rest = token_chain(ids[m * block_size : n * block_size], block_size, int(head[m - 1]))
    return head + rest


@dataclass(frozen=True, slots=True)
class Turn:
    """A prompt's ids as a tokenizer made them, the chains that will be made of them (filled as
    asked, and kept with the ids for the conversation's next turn), and, where its ids extend an
    earlier prompt's (the conversation so far), that prompt's chains: its chain is not hashed
    again, only what follows it."""

    ids: tuple[int, ...]
    chains: Chains = field(default_factory=dict)
    head: Chains | None = None  # the chains of a prompt whose ids begin these


@dataclass(frozen=True, slots=True)
class EngineTokens:
    """A request in the engine's tokens: its prompt's token count and the chain a replica may hold."""

    count: int  # the prompt's tokens (an estimate where `whole` is False)
    ids: tuple[int, ...]  # its token ids, or those of its history only where `whole` is False
    lora_name: str | None
    salt: str | None
    source: str  # "tokenizer" (the model's own, here) or "learnt" (its history, tokenized by the engine)
    # `ids` are the whole prompt's; else its history's, whose last token may tokenize otherwise within
    # the whole (a BPE merges it with what follows), so that neither keys its last token
    whole: bool = True
    # its chains by (block size, seed), shared with the tokenizer's kept turn; an earlier turn's
    chains: Chains = field(default_factory=dict, compare=False, repr=False)
    head: Chains | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of_turn(cls, turn: Turn, lora_name: str | None, salt: str | None) -> EngineTokens:
        return cls(len(turn.ids), turn.ids, lora_name, salt, "tokenizer", True, turn.chains, turn.head)

    def chain(self, block_size: int) -> array[int]:
        """The keys of the blocks an engine of `block_size` may hold of it (made once per size; from
        the conversation's earlier turn's where that was made)."""
        seed = root_of(self.lora_name, self.salt) if self.lora_name or self.salt else _ROOT
        found = self.chains.get((block_size, seed))
        if found is None:
            before = self.head.get((block_size, seed)) if self.head is not None else None
            if before is not None:
                found = extend_chain(before, self.ids, block_size, seed)
            else:
                found = request_chain(self.ids, block_size, seed)
            self.chains[(block_size, seed)] = found
        return found


class TokenizerError(RouterError, ValueError):
    """A model folder whose tokenizer or chat template cannot be read; the message names the file."""


class TokenStore:
    """Token ids kept by key, least recently used out, bounded by the ids they hold in all (a
    long conversation holds as much as thousands of short ones). Kept as the tuples they came in:
    a conversation's next turn extends its history's tuple, and so shares its int objects (an
    array would box every id again on each use: 0.5 ms for a 33k-token history). What is kept
    beside them (a tokenizer's text length and hash, the chains made of the ids: 8 bytes a block)
    is not counted: a fraction of the ids it goes with."""

    def __init__(self, max_tokens: int = KEPT_TOKENS, max_entries: int = KEPT_ENTRIES) -> None:
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self.tokens = 0
        self._kept: OrderedDict[int, tuple[Any, tuple[int, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, key: int) -> bool:
        return key in self._kept

    def get(self, key: int) -> tuple[Any, tuple[int, ...]] | None:
        """(what was kept beside the ids, the ids), made the most recently used; None if not kept."""
        found = self._kept.get(key)
        if found is not None:
            self._kept.move_to_end(key)
        return found

    def put(self, key: int, ids: Sequence[int], tag: Any = None) -> None:
        old = self._kept.pop(key, None)
        if old is not None:
            self.tokens -= len(old[1])
        if len(ids) > self.max_tokens:
            return
        kept = ids if isinstance(ids, tuple) else tuple(ids)
        self._kept[key] = (tag, kept)
        self.tokens += len(kept)
        while self.tokens > self.max_tokens or len(self._kept) > self.max_entries:
            _, (_, dropped) = self._kept.popitem(last=False)
            self.tokens -= len(dropped)


class ChatTokenizer(Protocol):
    """What the router asks of a model's tokenizer: a chat's prompt and a completion's, in token ids."""

    def chat(self, messages: list[Mapping[str, Any]], **extra: Any) -> tuple[int, ...]: ...

    def turn(self, messages: list[Mapping[str, Any]], **extra: Any) -> Turn: ...

    def replied(self, messages: list[Mapping[str, Any]], reply: str, **extra: Any) -> int: ...

    def prompt(self, text: str) -> tuple[int, ...]: ...


class EmulatorTokenizer:
    """router-emulator's tokenizer and chat template (router.kvevents.emulator_tokens): 4-byte tokens."""

    def chat(self, messages: list[Mapping[str, Any]], **extra: Any) -> tuple[int, ...]:
        return tuple(token_ids(render_chat(messages).encode("utf-8", "surrogatepass")))

    def turn(self, messages: list[Mapping[str, Any]], **extra: Any) -> Turn:
        return Turn(self.chat(messages, **extra))

    def replied(self, messages: list[Mapping[str, Any]], reply: str, **extra: Any) -> int:
        return 0  # bytes to ids costs less than a lookup: nothing is kept between turns

    def prompt(self, text: str) -> tuple[int, ...]:
        return tuple(token_ids(text.encode("utf-8", "surrogatepass")))


class Tokenizer:
    """A model's tokenizer and chat template, from its files, as vLLM applies them to a request."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        try:
            from tokenizers import Tokenizer as HfTokenizer  # noqa: PLC0415 (an optional dependency)
        except ImportError:
            raise TokenizerError("the `tokenizers` package is not installed (pip install tokenizers)") from None
        # one request at a time, on the event loop: the `tokenizers` thread pool only adds a hand-off
        # (an 84 us encode took 113 with it) and warns in every worker forked after its first use.
        # An operator's own setting wins.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{file}: no such file (a model folder holds tokenizer.json)")
        try:
            self.tokenizer = HfTokenizer.from_file(str(file))
        except Exception as exc:
            raise TokenizerError(f"{file}: {exc}") from None
        config: dict[str, Any] = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{config_file}: {exc}") from None
        template = None
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text()
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        self.special = {
            name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.template = None
        if template is not None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = _raise
                self.template = env.from_string(template)
            except Exception as exc:
                raise TokenizerError(f"{folder}: its chat template does not compile: {exc}") from None
        self.folder = folder
        # without the offsets `encode` also works out: the same ids, a quarter less time (0.20.1+)
        self._encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        # a prompt kept by its messages' key: its ids, and (its text's length, the text's hash)
        self._histories = TokenStore()
        self.tokenized = 0  # characters tokenized (a history found in the cache is not)

    def encode(self, text: str) -> list[int]:
        self.tokenized += len(text)
        ids: list[int] = self._encode([text], add_special_tokens=False)[0].ids
        return ids

    def render(self, messages: list[Mapping[str, Any]], generation: bool = True, **extra: Any) -> str:
        if self.template is None:
            raise TokenizerError(f"{self.folder}: the model has no chat template")
        context = {**self.special, **extra, "messages": messages, "add_generation_prompt": generation}
        return str(self.template.render(context))

    def chat(self, messages: list[Mapping[str, Any]], **extra: Any) -> tuple[int, ...]:
        """The token ids of a chat request's prompt (`turn`'s)."""
        return self.turn(messages, **extra).ids

    def turn(self, messages: list[Mapping[str, Any]], **extra: Any) -> Turn:
        """A chat request's prompt in token ids, its template rendered once. Each prompt is kept
        (its text's length and hash, its ids and the chains made of them) by the hash of its
        messages; the next turn of the conversation (those messages, a reply and more) finds it,
        checks that its own text starts with that text (every template that renders a history and
        its generation prompt as the start of the longer conversation does), and tokenizes only
        what follows, its chains extending the kept ones; else it is tokenized whole. A history
        kept with its reply (`replied`) is found by the messages before that reply, whatever else
        the client's copy of the assistant message carries: its text is what is checked."""
        text = self.render(messages, True, **extra)
        keys = message_keys(messages, _extra_seed(extra))
        head, start, head_chains = self._head(messages, keys, text, len(messages) - 1)
        ids = (*head, *self.encode(text[start:])) if start < len(text) else tuple(head)  # (a tuple: no copy)
        turn = Turn(ids, {}, head_chains)
        if keys:
            self._histories.put(keys[-1], ids, (len(text), _text_key(text), turn.chains))
        return turn

    def replied(self, messages: list[Mapping[str, Any]], reply: str, **extra: Any) -> int:
        """Keep the conversation `messages` with `reply`, its answer, as the assistant's message (no
        generation prompt after it), for its next turn: tokenized after the answer has gone, so
        that the next turn's path tokenizes only the client's new message. Its chains are those its
        own turn made, extended over the reply. Returns the tokens kept (0: none, as for a template
        whose rendering of an answered turn is not its prompt's continuation)."""
        if not messages:
            return 0
        text = self.render([*messages, {"role": "assistant", "content": reply}], False, **extra)
        keys = message_keys(messages, _extra_seed(extra))
        head, start, head_chains = self._head(messages, keys, text, len(messages))
        if not head:
            return 0  # its own turn is gone, or its text is not this one's start: nothing saved
        ids = (*head, *self.encode(text[start:])) if start < len(text) else tuple(head)
        chains: Chains = {}
        for (size, seed), chain in (head_chains or {}).items():
            chains[(size, seed)] = extend_chain(chain, ids, size, seed)
        self._histories.put(_reply_key(keys[-1]), ids, (len(text), _text_key(text), chains))
        return len(ids)

    def _head(
        self, messages: Sequence[Any], keys: list[int], text: str, top: int
    ) -> tuple[Sequence[int], int, Chains | None]:
        """The longest kept prompt whose text starts `text`, among the prefixes of `messages` of
        `top` messages down to HISTORY_LOOKBACK fewer: its ids, its text's length, its chains. A
        prefix ending in an assistant's message is also looked for as the one before it, replied."""
        for cut in range(top, max(0, len(messages) - HISTORY_LOOKBACK) - 1, -1):
            if cut <= 0:
                break
            kept = self._histories.get(keys[cut - 1])
            if _starts(kept, text):
                assert kept is not None
                return kept[1], kept[0][0], kept[0][2]
            if cut >= 2 and _assistant(messages[cut - 1]):
                kept = self._histories.get(_reply_key(keys[cut - 2]))
                if _starts(kept, text):
                    assert kept is not None
                    return kept[1], kept[0][0], kept[0][2]
        return (), 0, None

    def prompt(self, text: str) -> tuple[int, ...]:
        """A completion's prompt, as vLLM tokenizes it (the tokenizer's own special tokens added)."""
        self.tokenized += len(text)
        return tuple(self._encode([text], add_special_tokens=True)[0].ids)


def _text_key(text: str) -> int:
    return xxh3_64(text.encode("utf-8", "surrogatepass"))


def _starts(kept: tuple[Any, tuple[int, ...]] | None, text: str) -> bool:
    """Whether a kept prompt's text (its length and hash) is the start of `text`."""
    return kept is not None and kept[0][0] <= len(text) and _text_key(text[: kept[0][0]]) == kept[0][1]


def _reply_key(key: int) -> int:
    """Where a conversation kept with its reply is found: by its messages before the reply."""
    return xxh3_64(b"replied", key)


def _assistant(message: Any) -> bool:
    return isinstance(message, Mapping) and message.get("role") == "assistant"


def message_keys(messages: Sequence[Any], seed: int) -> list[int]:
    """One key per prefix of a chat's messages (the last: all of them), chained from `seed`, so
    that one pass over the messages keys every prefix; a message's key is its JSON's (keys sorted)."""
    out = []
    h = seed
    for message in messages:
        h = xxh3_64(_json_bytes(message), h)
        out.append(h)
    return out


def _json_bytes(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return repr(value).encode("utf-8", "surrogatepass")


def _extra_seed(extra: Mapping[str, Any]) -> int:
    """What the template gets besides the messages (tools), as the seed of their keys."""
    return xxh3_64(_json_bytes(extra)) if extra else 0


def _token_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def _raise(message: str) -> None:
    raise TokenizerError(f"the chat template refused the request: {message}")


__all__ = [
    "HISTORY_LOOKBACK",
    "Chains",
    "ChatTokenizer",
    "EmulatorTokenizer",
    "EngineTokens",
    "TokenStore",
    "Tokenizer",
    "TokenizerError",
    "Turn",
    "extend_chain",
    "message_keys",
    "request_chain",
    "root_of",
    "token_chain",
]
