"""The engines' tokens for every request: found with nothing to configure, never waited for.

The event-fed index (router.kvevents) knows what an engine holds by its token ids, so a request is
cut into the engine's own tokens before it is priced. `EngineTokenizers.tokenized` does that with
no round trip on the request's path:

- **The model's tokenizer, found from what the engine serves.** For each model that a replica
  fed by events serves, a background task reads one replica's `GET /v1/models`: the model's
  `root` (vLLM: what `--model` named; a LoRA adapter's `parent`'s) is a folder holding
  `tokenizer.json` and the chat template (a model volume the router shares), else a Hugging Face
  hub name, loaded through `huggingface_hub` from its cache (`HF_HOME`), the hub or a mirror
  (`HF_ENDPOINT`; `HF_HUB_OFFLINE=1` keeps it to the cache); an engine that says `owned_by:
  router-emulator` tokenizes as the emulator does, which the router knows built in. A folder
  named by `tokenizer_dirs` wins over all of them.
- **Checked against the engine off the path, before it is used.** The tokenizer's ids for a
  sample chat and a sample prompt must be the engine's: its `/v1/*/render` endpoints where it
  serves them (vLLM only with `--enable-scale-out`), else vLLM's `/tokenize` (on by default). One
  the engine contradicts is not used (`router_token_checks{result="mismatch"}`, an error in the
  log); where neither endpoint answers, it is used unchecked (`result="unchecked"`). Then
  `token_check_share` of the requests tokenized here are checked again, in the background.
- **Learnt where no tokenizer can be had.** Until one is found, or where none can be, a request
  is priced by the router's own model, and its conversation so far (its messages, without the
  generation prompt; or a completion's prompt) is tokenized by an engine in the background, at
  most LEARNING at once; the tokens are kept by the hash of those messages. The conversation's
  next turn finds its history there and is priced by the events for that history
  (`EngineTokens.whole` False), by the model for what follows.
- **An endpoint that refuses is not asked again**: render (all its paths together) or tokenize
  answering 401, 403, 404, 405 or 501 is left alone on that replica for REFUSED_S.

- **A chat's answer is tokenized after it has gone**, while the client reads it: the conversation
  with its reply is kept by the tokenizer (`replied`), so its next turn tokenizes only the
  client's new message on the path (the reply's tokens were 84 of a 1k-token follow-up's 103 µs).

`router_tokenizer{model,source}` is 1 for the tokenizer each model is tokenized with (configured,
path, hub, builtin) or `learnt`; `router_tokenize_seconds{source}` times what each way costs
(`engine`: a background round trip; `reply`: an answer kept, after it has gone).

Worked example: vLLM started as `vllm serve Qwen/Qwen3-8B --kv-events-config ...` lists `root:
"Qwen/Qwen3-8B"`; the router loads its tokenizer from the hub cache, asks render (403, remembered),
then `/tokenize`, which agrees; from then on every request of that model is tokenized in the
router, a conversation's earlier turns found in the tokenizer's history cache.

It is past 450 lines as one room: finding a model's tokenizer, checking it against the engine,
learning histories in the background and timing each are one state per model (`ModelTokens`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from router.apis import CHAT, COMPLETION, MESSAGES, Api
from router.fleet import Fleet, ReplicaState
from router.keys import RoutingKey
from router.kvevents.tokens import (
    HISTORY_LOOKBACK,
    ChatTokenizer,
    EmulatorTokenizer,
    EngineTokens,
    Tokenizer,
    TokenizerError,
    TokenStore,
    Turn,
    message_keys,
)
from router.metrics import RouterMetrics
from router.ring import xxh3_64

log = logging.getLogger("router.engines.tokens")

REFUSED_S = 600.0  # an endpoint that refused is not asked again on that replica for this long
RETRY_S = 30.0  # a model whose tokenizer could not be found or checked is tried again after this
MISMATCH_RETRY_S = 600.0  # ... one whose tokenizer the engine contradicted
ASK_TIMEOUT_S = 5.0  # one request to an engine (its models, render, tokenize)
LOAD_TIMEOUT_S = 120.0  # loading a tokenizer (a hub download included)
LEARNING = 4  # background tokenizations in flight at once; a request beyond them is not learnt
CHECKING = 4  # sampled checks against an engine in flight at once; a request beyond them is not checked
MAX_TOKENIZERS = 64  # models whose tokenizers are kept
REFUSING = frozenset({401, 403, 404, 405, 501})
TOKENIZE_PATH = "/tokenize"
RENDER_PATHS = {
    CHAT.path: "/v1/chat/completions/render",
    MESSAGES.path: "/v1/messages/render",
    COMPLETION.path: "/v1/completions/render",
}
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"]
EMULATOR_OWNER = "router-emulator"
TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt"})  # what a request's template kwargs cannot set
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?")
# what a found tokenizer must tokenize as the engine does before it is used
SAMPLE_CHAT = (
    {"role": "system", "content": "You are a careful assistant. Answer in one short paragraph."},
    {"role": "user", "content": "How far is it from the river to the old mill? It's 12.5 km, isn't it?"},
)
SAMPLE_PROMPT = 'The quick brown fox jumps over the lazy dog, 1234 times: "why?"'


@dataclass
class ModelTokens:
    """What a model's requests are tokenized with, and whether it is being found."""

    tokenizer: ChatTokenizer | None = None
    source: str = "learnt"  # configured, path, hub, builtin; learnt while there is none
    finding: asyncio.Task[None] | None = None
    retry_at: float = 0.0  # when to look again for a tokenizer (none, or not the engine's)


class EngineTokenizers:
    def __init__(
        self,
        fleet: Fleet,
        configured: dict[str, str],
        check_share: float,
        http: Callable[[], aiohttp.ClientSession],
        metrics: RouterMetrics,
        bytes_per_token: Callable[[], float],
    ) -> None:
        """`configured`: tokenizer_dirs ({model or "*": folder}); `bytes_per_token`: the model's
        ratio, which counts a prompt whose history alone is known in tokens."""
        self.fleet = fleet
        self.configured = configured
        self.check_share = check_share
        self.http = http
        self.metrics = metrics
        self.bytes_per_token = bytes_per_token
        self.models: dict[str, ModelTokens] = {}
        self.loaded: dict[str, Tokenizer] = {}  # by folder or hub name (at most one per model)
        self.refused: dict[tuple[str, str], float] = {}  # (replica id, _family(path)) -> until when not asked
        self.learnt = TokenStore()  # conversations' tokens as engines tokenized them, by their messages' key
        self.learning: set[int] = set()  # conversations being tokenized by an engine now
        self.checking = 0  # sampled requests being checked against an engine now
        self.tasks: set[asyncio.Task[Any]] = set()

    # -- the request's path: nothing here waits ------------------------------------------------------

    def tokenized(self, key: RoutingKey, api: Api, body: Mapping[str, Any], fed: list[ReplicaState]) -> RoutingKey:
        """`key` with its prompt in the engine's tokens (whole, or its history's), as far as they are
        known now; `fed`: the replicas serving its model whose events are believed."""
        prompt = key.prompt
        if prompt is None or not fed or api.path not in RENDER_PATHS:
            return key
        model = key.model or ""
        t0 = time.perf_counter()
        known = self.of(model, fed)
        turn: Turn | None = None
        if known.tokenizer is not None:
            with contextlib.suppress(TokenizerError, ValueError, TypeError):
                turn = local_turn(known.tokenizer, api, body)
        m = self.metrics
        lora = model if model in self.fleet.adapter_names else None
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        if turn is not None:
            m.child(m.tokenize_seconds, "tokenizer").observe(time.perf_counter() - t0)
            if self.checking < CHECKING and random.random() < self.check_share:
                self.checking += 1
                self._spawn(self._check_request(model, fed, api, body, turn.ids), "token check")
            return replace(key, prompt=replace(prompt, tokens=EngineTokens.of_turn(turn, lora, salt)))
        hashes = conversation_hashes(model, api, body)
        if not hashes:
            return key
        head = None
        for h in hashes[: -HISTORY_LOOKBACK - 1 : -1]:
            found = self.learnt.get(h)
            if found is not None:
                head = found[1]
                break
        if hashes[-1] not in self.learnt:
            self._learn(hashes[-1], fed, api, body)
        if head is None:
            return key
        m.child(m.tokenize_seconds, "learnt").observe(time.perf_counter() - t0)
        whole = api is COMPLETION  # a completion's prompt is learnt whole; a chat's, without its generation prompt
        count = len(head) if whole else max(len(head) + 1, round(prompt.nbytes / self.bytes_per_token()))
        tokens = EngineTokens(count, head, lora, salt, "learnt", whole)
        return replace(key, prompt=replace(prompt, tokens=tokens))

    def replied(self, model: str | None, api: Api, body: Mapping[str, Any], reply: Callable[[], str | None]) -> None:
        """After a chat's answer has gone to its client: its conversation with the answer (`reply`
        reads its text) kept by the model's tokenizer (`Tokenizer.replied`), so that the next turn's
        path tokenizes only its new message. A model with no tokenizer that keeps answers (none
        found yet, or the emulator's, whose tokens cost less than keeping them) reads nothing."""
        known = self.models.get(model or "")
        if known is None or not isinstance(known.tokenizer, Tokenizer) or api is not CHAT:
            return
        messages = chat_messages(api, body)
        if not messages:
            return
        t0 = time.perf_counter()
        text = reply()
        if not text:
            return
        with contextlib.suppress(TokenizerError, ValueError, TypeError):
            if known.tokenizer.replied(messages, text, **template_extra(body)):
                m = self.metrics
                m.child(m.tokenize_seconds, "reply").observe(time.perf_counter() - t0)

    def of(self, model: str, fed: list[ReplicaState]) -> ModelTokens:
        """The model's tokens so far, a search for its tokenizer started where none is under way."""
        known = self.models.get(model)
        if known is None:
            if len(self.models) >= MAX_TOKENIZERS:  # clients name any model they like: bounded, and
                # a name that found no tokenizer gives its place up to the next one
                idle = next((n for n, k in self.models.items() if k.tokenizer is None and k.finding is None), None)
                if idle is None:
                    return ModelTokens()
                del self.models[idle]
            known = self.models[model] = ModelTokens()
            self.metrics.child(self.metrics.tokenizer, model, "learnt").set(1)
        if known.tokenizer is None and known.finding is None and time.monotonic() >= known.retry_at:
            known.finding = self._spawn(self._find(model, known, list(fed)), f"tokenizer of {model}")
        return known

    def watch(self, fed_models: Mapping[str, list[ReplicaState]]) -> None:
        """Start finding the tokenizers of the models fed replicas serve, before their first request."""
        for model, fed in fed_models.items():
            self.of(model, fed)

    # -- finding a tokenizer ---------------------------------------------------------------------------

    async def _find(self, model: str, known: ModelTokens, fed: list[ReplicaState]) -> None:
        try:
            await self._search(model, known, fed)
        except Exception:  # a background task: said in the log, tried again later, never lost silently
            log.exception("model %s: finding its tokenizer failed", model)
            known.retry_at = time.monotonic() + RETRY_S
        finally:
            known.finding = None

    async def _search(self, model: str, known: ModelTokens, fed: list[ReplicaState]) -> None:
        found = await self._load(model, fed)
        if found is None:
            known.retry_at = time.monotonic() + RETRY_S
            return
        tokenizer, source = found
        verdict = await self._verify(model, tokenizer, fed)
        self.metrics.child(self.metrics.token_checks, model, verdict).inc()
        if verdict == "mismatch":
            log.error(
                "model %s: its tokenizer (%s) is not the engine's: not used, its conversations are learnt from "
                "the engines (tokenizer_dirs names the model's folder by hand)",
                model,
                source,
            )
            known.retry_at = time.monotonic() + MISMATCH_RETRY_S
            return
        if verdict == "error":
            known.retry_at = time.monotonic() + RETRY_S
            return
        known.tokenizer, known.source = tokenizer, source
        m = self.metrics
        m.child(m.tokenizer, model, "learnt").set(0)
        m.child(m.tokenizer, model, source).set(1)
        log.info("model %s: tokenized in the router (%s tokenizer, %s against the engine)", model, source, verdict)

    async def _load(self, model: str, fed: list[ReplicaState]) -> tuple[ChatTokenizer, str] | None:
        """The model's tokenizer and where it came from; None where it cannot be had (said in the log)."""
        folder = self.configured.get(model, self.configured.get("*"))
        if folder is not None:
            where, source = folder, "configured"
        else:
            served = await self._served(model, fed)
            if served is None:
                return None
            root, owner = served
            if owner == EMULATOR_OWNER:
                return EmulatorTokenizer(), "builtin"
            where, source = root, "path" if Path(root).is_dir() else "hub"
            if source == "hub" and not _HUB_NAME.fullmatch(root):
                log.warning("model %s: its engine serves it from %s, which this host cannot read", model, root)
                return None
        loaded = self.loaded.get(where)  # a LoRA adapter shares its parent's (and its kept turns)
        if loaded is None:
            try:
                loaded = await asyncio.wait_for(asyncio.to_thread(load_tokenizer, where, source), LOAD_TIMEOUT_S)
            except (TokenizerError, TimeoutError) as exc:
                log.warning("model %s: no tokenizer from %s (%s): its requests are priced as learnt", model, where, exc)
                return None
            self.loaded[where] = loaded
        return loaded, source

    async def _served(self, model: str, fed: list[ReplicaState]) -> tuple[str, str] | None:
        """(root, owned_by) of `model` as a replica's /v1/models lists it (a LoRA adapter: its parent's)."""
        for replica in random.sample(fed, min(3, len(fed))):
            try:
                async with self.http().get(
                    replica.url + "/v1/models", headers=replica.auth, timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)
                ) as r:
                    if r.status != 200:
                        continue
                    answer = await r.json(content_type=None, loads=orjson.loads)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            entries = answer.get("data") if isinstance(answer, Mapping) else None
            if not isinstance(entries, list):
                continue
            listed = {e.get("id"): e for e in entries if isinstance(e, Mapping)}
            entry = listed.get(model)
            parent = entry.get("parent") if entry is not None else None
            if isinstance(parent, str) and parent in listed:
                entry = listed[parent]
            if entry is not None and isinstance(entry.get("root"), str) and entry["root"]:
                owner = entry.get("owned_by")
                return entry["root"], owner if isinstance(owner, str) else ""
        return None

    async def _verify(self, model: str, tokenizer: ChatTokenizer, fed: list[ReplicaState]) -> str:
        """match, mismatch, unchecked (no engine lets the router ask) or error (none answered)."""
        samples: list[tuple[Api, dict[str, Any]]] = [
            (CHAT, {"model": model, "messages": list(SAMPLE_CHAT)}),
            (COMPLETION, {"model": model, "prompt": SAMPLE_PROMPT}),
        ]
        verdicts = []
        for api, first in samples:
            tries = [first]
            if api is CHAT:  # a template that refuses a system message (Gemma's, older Mistral's): the user's alone
                tries.append({"model": model, "messages": list(SAMPLE_CHAT[1:])})
            mine, failure, body = None, "no prompt", first
            for body in tries:  # (the body that tokenized is the one the engine is asked)
                try:
                    mine = local_ids(tokenizer, api, body)
                    break
                except (TokenizerError, ValueError, TypeError) as exc:
                    failure = str(exc)
            if mine is None:
                log.error("model %s: its tokenizer fails on a sample %s request: %s", model, api.name, failure)
                return "mismatch"
            verdicts.append(self._compare(model, mine, await self.engine_ids(fed, api, body)))
        for verdict in ("mismatch", "error", "unchecked"):
            if verdict in verdicts:
                return verdict
        return "match"

    async def _check_request(
        self, model: str, fed: list[ReplicaState], api: Api, body: Mapping[str, Any], ids: tuple[int, ...]
    ) -> None:
        try:
            verdict = self._compare(model, ids, await self.engine_ids(fed, api, body))
        finally:
            self.checking -= 1
        self.metrics.child(self.metrics.token_checks, model, verdict).inc()

    def _compare(self, model: str, mine: tuple[int, ...], engine: tuple[int, ...] | str) -> str:
        if isinstance(engine, str):
            return engine
        if engine == mine:
            return "match"
        first = next((i for i, (a, b) in enumerate(zip(engine, mine, strict=False)) if a != b), None)
        log.error(
            "model %s: the router's tokens differ from the engine's (%d against %d tokens, first at %s)",
            model,
            len(mine),
            len(engine),
            min(len(engine), len(mine)) if first is None else first,
        )
        return "mismatch"

    # -- asking an engine --------------------------------------------------------------------------------

    async def engine_ids(
        self, fed: list[ReplicaState], api: Api, body: Mapping[str, Any], generation: bool = True
    ) -> tuple[int, ...] | str:
        """The engine's token ids for a request (`generation`: a chat's with its generation prompt),
        from its render endpoint where a replica serves one, else its /tokenize; "unchecked" where
        every replica refuses both, "error" where none answered."""
        result = "unchecked"
        now = time.monotonic()
        for replica in random.sample(fed, min(2, len(fed))):
            for path, sent in _asks(api, body, generation):
                if self.refused.get((replica.id, _family(path)), 0.0) > now:
                    continue
                answer = await self._ask(replica, path, sent)
                if isinstance(answer, tuple):
                    return answer
                result = "error" if answer == "error" else result
        return result

    async def _ask(self, replica: ReplicaState, path: str, body: Mapping[str, Any]) -> tuple[int, ...] | str:
        try:
            async with self.http().post(
                replica.url + path,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json", **replica.auth},
                timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S),
            ) as r:
                if r.status in REFUSING:
                    now = time.monotonic()  # (rare: the refusals that ran out, or whose replica left, go)
                    self.refused = {k: until for k, until in self.refused.items() if until > now}
                    self.refused[(replica.id, _family(path))] = now + REFUSED_S
                    log.info(
                        "replica %s answers %s with %d: not asked again for %g s", replica.id, path, r.status, REFUSED_S
                    )
                    return "refused"
                if r.status != 200:
                    return "error"
                answer = await r.json(content_type=None, loads=orjson.loads)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return "error"
        ids = token_ids_of(answer)
        return "error" if ids is None else ids

    def _learn(self, h: int, fed: list[ReplicaState], api: Api, body: Mapping[str, Any]) -> None:
        if h in self.learning or len(self.learning) >= LEARNING:
            return
        self.learning.add(h)
        self._spawn(self._learning(h, fed, api, body), "learn tokens")

    async def _learning(self, h: int, fed: list[ReplicaState], api: Api, body: Mapping[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            ids = await self.engine_ids(fed, api, body, generation=False)
        finally:
            self.learning.discard(h)
        if isinstance(ids, tuple):
            m = self.metrics
            m.child(m.tokenize_seconds, "engine").observe(time.perf_counter() - t0)
            self.learnt.put(h, ids)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a background task: said, never lost
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def load_tokenizer(where: str, source: str) -> Tokenizer:
    """A folder's tokenizer, or a hub name's (its tokenizer files only, through huggingface_hub)."""
    if source != "hub":
        return Tokenizer(where)
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 (only a hub name needs it)
    except ImportError:
        raise TokenizerError("the `huggingface_hub` package is not installed") from None
    try:
        folder = snapshot_download(where, allow_patterns=TOKENIZER_FILES)
    except Exception as exc:  # offline and not cached, no such repository, gated, the network: all "none"
        raise TokenizerError(f"huggingface_hub: {type(exc).__name__}: {exc}") from None
    return Tokenizer(folder)


def local_ids(tokenizer: ChatTokenizer, api: Api, body: Mapping[str, Any]) -> tuple[int, ...] | None:
    """A request's prompt in the tokenizer's ids, as its engine would tokenize it; None where the
    body holds no prompt this tokenizes (a list of prompts, non-text content the template refuses)."""
    turn = local_turn(tokenizer, api, body)
    return None if turn is None else turn.ids


def local_turn(tokenizer: ChatTokenizer, api: Api, body: Mapping[str, Any]) -> Turn | None:
    """`local_ids` with what the tokenizer keeps of a chat's earlier turn (router.kvevents.tokens.Turn)."""
    if api is COMPLETION:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]
        return Turn(tokenizer.prompt(prompt)) if isinstance(prompt, str) else None
    messages = chat_messages(api, body)
    if messages is None:
        return None
    return tokenizer.turn(messages, **template_extra(body))


def template_extra(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a chat's template gets besides its messages, as vLLM passes it: the tools, and the
    request's `chat_template_kwargs` (Qwen3's `enable_thinking`, ...)."""
    extra: dict[str, Any] = {}
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping):
        extra.update((k, v) for k, v in kwargs.items() if isinstance(k, str) and k not in TEMPLATE_OWN)
    if isinstance(body.get("tools"), list):
        extra["tools"] = body["tools"]
    return extra


def chat_messages(api: Api, body: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """A chat's messages as the chat template gets them (an Anthropic request's `system` first)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    if api is MESSAGES:
        system = body.get("system")
        if isinstance(system, list):
            system = "".join(p.get("text", "") for p in system if isinstance(p, Mapping))
        if isinstance(system, str) and system:
            messages = [{"role": "system", "content": system}, *messages]
    return messages


def conversation_hashes(model: str, api: Api, body: Mapping[str, Any]) -> list[int]:
    """The keys of a conversation's learnt tokens: one per prefix of its messages (the last: all of
    them), chained, so that one pass over the body keys every prefix; a completion's: its prompt's."""
    seed = xxh3_64(model.encode("utf-8", "surrogatepass"))
    if api is COMPLETION:
        prompt = body.get("prompt")
        return [xxh3_64(prompt.encode("utf-8", "surrogatepass"), seed)] if isinstance(prompt, str) else []
    messages = chat_messages(api, body)
    if not messages:
        return []
    extra = {k: body[k] for k in ("tools", "chat_template_kwargs") if body.get(k) is not None}
    if extra:
        seed = message_keys([extra], seed)[0]
    return message_keys(messages, seed)


def _family(path: str) -> str:
    """What a refusal is remembered by: the render endpoints together (vLLM serves all or none)."""
    return "render" if path.endswith("/render") else path


def _asks(api: Api, body: Mapping[str, Any], generation: bool) -> list[tuple[str, dict[str, Any]]]:
    """(path, body) to ask an engine for a request's tokens, in order: render (the request itself;
    only with the generation prompt, which it always adds), then /tokenize."""
    out: list[tuple[str, dict[str, Any]]] = []
    if generation:
        out.append((RENDER_PATHS[api.path], dict(body)))
    tokenize: dict[str, Any] = {"model": body.get("model")}
    if api is COMPLETION:
        prompt = body.get("prompt")
        tokenize["prompt"] = prompt[0] if isinstance(prompt, list) and prompt else prompt
    else:
        tokenize["messages"] = chat_messages(api, body)
        tokenize["add_generation_prompt"] = generation
        for name in ("tools", "chat_template_kwargs"):
            if name in body:
                tokenize[name] = body[name]
    out.append((TOKENIZE_PATH, tokenize))
    return out


def token_ids_of(answer: Any) -> tuple[int, ...] | None:
    """The ids in a render answer (`token_ids`; /v1/completions/render: a list, one per prompt) or
    a /tokenize answer (`tokens`)."""
    if isinstance(answer, list) and answer:
        answer = answer[0]
    if not isinstance(answer, Mapping):
        return None
    ids = answer.get("token_ids", answer.get("tokens"))
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        return None
    return tuple(ids)


__all__ = ["EngineTokenizers", "conversation_hashes", "load_tokenizer", "local_ids", "local_turn", "token_ids_of"]
