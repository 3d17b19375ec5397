"""The engines' tokens found with nothing configured, checked off the path, learnt where none can be had.

A stand-in engine (aiohttp on loopback) answers as vLLM 0.32 started as its docs start it: its
/v1/models names the model's `root`, `/v1/*/render` answers 403 (no `--enable-scale-out`),
`/tokenize` answers with what a tokenizer of the test's choosing makes of the request, and every
call is counted. The tokenizer is a small BPE trained here, in a model folder the test writes
(`tokenizer.json`, a chat template in `tokenizer_config.json`), or the same files in a Hugging Face
hub cache under a temporary HF_HOME. tests/integration/test_vllm_events.py pins the same against real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web

from router.apis import CHAT, COMPLETION
from router.config import ReplicaSpec
from router.engines.tokens import CHECKING, LEARNING, EngineTokenizers, conversation_hashes, local_turn
from router.fleet import Fleet
from router.keys import RoutingKey
from router.kvevents.tokens import Tokenizer, TokenizerError
from router.metrics import RouterMetrics
from router.prompt import prompt_of

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SYSTEM = {"role": "system", "content": "You answer questions about rivers. " * 8}


def write_model(folder: Path, template: str = TEMPLATE, merges: int = 300) -> Path:
    from tokenizers import Tokenizer as HfTokenizer  # noqa: PLC0415
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    folder.mkdir(parents=True, exist_ok=True)
    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=256 + len(special) + merges,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["You answer questions about rivers and the sea.", "How deep is it? " * 5], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": template}))
    return folder


class Engine:
    """A stand-in vLLM without --enable-scale-out: models, a refused render, /tokenize."""

    def __init__(self, root: str, tokenizer: Tokenizer, owned_by: str = "vllm") -> None:
        self.root = root
        self.tokenizer = tokenizer
        self.owned_by = owned_by
        self.calls: Counter[str] = Counter()
        self.tokenize_delay = 0.0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions/render", self.render)
        app.router.add_post("/v1/completions/render", self.render)
        app.router.add_post("/tokenize", self.tokenize)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        self.calls["models"] += 1
        entry = {"id": "m", "object": "model", "owned_by": self.owned_by, "root": self.root, "parent": None}
        adapter = {"id": "m-lora", "object": "model", "owned_by": self.owned_by, "root": "/nowhere", "parent": "m"}
        return web.json_response({"object": "list", "data": [entry, adapter]})

    async def render(self, request: web.Request) -> web.Response:
        self.calls["render"] += 1
        body = {"error": {"message": "Scale-out endpoints are disabled.", "type": "PermissionDeniedError", "code": 403}}
        return web.json_response(body, status=403)

    async def tokenize(self, request: web.Request) -> web.Response:
        self.calls["tokenize"] += 1
        body = await request.json()
        await asyncio.sleep(self.tokenize_delay)
        if "messages" in body:
            generation = body.get("add_generation_prompt", True)
            kwargs = body.get("chat_template_kwargs") or {}
            try:
                text = self.tokenizer.render(body["messages"], generation, **kwargs)
            except TokenizerError as exc:  # vLLM answers a template's refusal with a 400
                return web.json_response({"error": {"message": str(exc), "code": 400}}, status=400)
            ids = self.tokenizer.encode(text)
            self.calls["tokenize-history" if not generation else "tokenize-whole"] += 1
        else:
            ids = list(self.tokenizer.prompt(body["prompt"]))
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None})


@pytest.fixture
async def engine_of(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    started: list[Engine] = []

    async def start(root: str, tokenizer: Tokenizer, owned_by: str = "vllm") -> Engine:
        engine = Engine(root, tokenizer, owned_by)
        await engine.start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        await engine.stop()


class Setup:
    def __init__(self, engine: Engine, configured: dict[str, str] | None = None, check_share: float = 0.0) -> None:
        self.fleet = Fleet([ReplicaSpec("e0", engine.url)])
        self.metrics = RouterMetrics()
        self.session = ClientSession()
        self.tokens = EngineTokenizers(
            self.fleet, configured or {}, check_share, lambda: self.session, self.metrics, lambda: 4.0
        )

    def key(self, body: dict[str, Any], api: Any = CHAT) -> RoutingKey:
        prompt = prompt_of(body, 64)
        key = RoutingKey(b"k", "session", "header", prompt, body.get("model"))
        return self.tokens.tokenized(key, api, body, self.fleet.replicas)

    async def found(self, model: str = "m", timeout: float = 10.0) -> str:
        """The model's tokenizer's source, once the search for it has ended."""
        self.tokens.of(model, self.fleet.replicas)
        deadline = time.monotonic() + timeout
        while (self.tokens.models[model].finding is not None) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.tokens.models[model].source

    def checks(self, result: str) -> float:
        labels = {"model": "m", "result": result}
        return self.metrics.registry.get_sample_value("router_token_checks_total", labels) or 0

    async def close(self) -> None:
        await self.tokens.close()
        await self.session.close()


def chat_body(*turns: str, model: str = "m") -> dict[str, Any]:
    messages: list[dict[str, str]] = [SYSTEM]
    for i, turn in enumerate(turns):
        if i:
            messages.append({"role": "assistant", "content": f"Answer {i}: it is deep. " * 3})
        messages.append({"role": "user", "content": turn})
    return {"model": model, "messages": messages, "max_tokens": 4}


async def test_a_model_folder_named_by_the_engine_is_found_checked_once_and_used_on_the_path(
    tmp_path: Path, engine_of: Callable[..., Any]
) -> None:
    folder = write_model(tmp_path / "model")
    engine = await engine_of(str(folder), Tokenizer(folder))
    setup = Setup(engine, check_share=1.0)
    try:
        body = chat_body("How deep is the river?")
        assert setup.key(body).prompt.tokens is None  # type: ignore[union-attr]  # the search has just begun
        assert await setup.found() == "path"
        # checked against the engine off the path: render refused (403, remembered), /tokenize agreed on
        # the sample chat and prompt; the first request, priced by the model, had its history learnt
        assert setup.checks("match") == 1 and engine.calls["render"] == 1 and engine.calls["tokenize"] == 3
        assert engine.calls["tokenize-history"] == 1
        for turn in range(1, 6):
            tokens = setup.key(chat_body(*[f"Question {i}?" for i in range(turn)])).prompt.tokens  # type: ignore[union-attr]
            assert tokens is not None and tokens.source == "tokenizer" and tokens.whole
        completion = setup.key({"model": "m", "prompt": "How deep is it? " * 8}, COMPLETION).prompt.tokens  # type: ignore[union-attr]
        assert completion is not None and completion.ids == Tokenizer(folder).prompt("How deep is it? " * 8)
        # every request sampled (check_share 1) is checked in the background, CHECKING at once at most
        # (the six above were keyed together: the rest were not checked), render never asked again
        deadline = time.monotonic() + 5
        while (setup.checks("match") < 1 + CHECKING or setup.tokens.checking) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert setup.checks("match") == 1 + CHECKING and setup.checks("mismatch") == 0
        setup.key(chat_body("One more?"))  # the checks ended: the next one is checked
        while setup.checks("match") < 2 + CHECKING and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert setup.checks("match") == 2 + CHECKING
        assert engine.calls["render"] == 1 and engine.calls["models"] == 1
        sample = setup.metrics.registry.get_sample_value
        assert sample("router_tokenizer", {"model": "m", "source": "path"}) == 1
        assert sample("router_tokenizer", {"model": "m", "source": "learnt"}) == 0
    finally:
        await setup.close()


async def test_a_hub_name_is_loaded_from_the_hub_cache(
    tmp_path: Path, engine_of: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM started with a hub name lists it as the root: the router loads the tokenizer files
    through huggingface_hub, here from its cache with the hub out of reach (HF_HUB_OFFLINE)."""
    home = tmp_path / "hf"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = write_model(home / "hub" / "models--kvar--tiny-chat" / "snapshots" / revision)
    (home / "hub" / "models--kvar--tiny-chat" / "refs").mkdir()
    (home / "hub" / "models--kvar--tiny-chat" / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    engine = await engine_of("kvar/tiny-chat", Tokenizer(snapshot))
    setup = Setup(engine)
    try:
        assert await setup.found() == "hub"
        assert setup.checks("match") == 1
        tokens = setup.key(chat_body("How deep?")).prompt.tokens  # type: ignore[union-attr]
        assert tokens is not None and tokens.ids == Tokenizer(snapshot).chat(chat_body("How deep?")["messages"])
        # a LoRA adapter is tokenized as its parent, by the same tokenizer (loaded once, its turns shared)
        assert await setup.found("m-lora") == "hub"
        assert setup.tokens.models["m-lora"].tokenizer is setup.tokens.models["m"].tokenizer
    finally:
        await setup.close()


async def test_a_tokenizer_the_engine_contradicts_is_not_used(tmp_path: Path, engine_of: Callable[..., Any]) -> None:
    mine = write_model(tmp_path / "mine", template=TEMPLATE.replace("<|end|>", "</s>"))
    engine = await engine_of(str(write_model(tmp_path / "served")), Tokenizer(write_model(tmp_path / "served")))
    setup = Setup(engine, configured={"*": str(mine)})  # tokenizer_dirs naming the wrong folder
    try:
        assert await setup.found() == "learnt"
        assert setup.checks("mismatch") == 1 and setup.tokens.models["m"].tokenizer is None
        tokens = setup.key(chat_body("How deep?")).prompt.tokens  # type: ignore[union-attr]
        assert tokens is None  # priced by the model, its history being learnt
    finally:
        await setup.close()


async def test_without_a_tokenizer_a_conversation_is_learnt_off_the_path(
    tmp_path: Path, engine_of: Callable[..., Any]
) -> None:
    """The engine's model lives where this host cannot read it: the first turn is priced by the
    model and tokenized by the engine in the background; the next turn knows its history's tokens."""
    served = Tokenizer(write_model(tmp_path / "engine-side"))
    engine = await engine_of("/models/on/the/engine/host", served)
    setup = Setup(engine)
    try:
        assert await setup.found() == "learnt"
        first = chat_body("How deep is the river at the old mill?")
        assert setup.key(first).prompt.tokens is None  # type: ignore[union-attr]
        deadline = time.monotonic() + 5
        while engine.calls["tokenize-history"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        second = chat_body("How deep is the river at the old mill?", "And at the bridge?")
        tokens = setup.key(second).prompt.tokens  # type: ignore[union-attr]
        history = served.encode(served.render(first["messages"], False))
        assert tokens is not None and tokens.source == "learnt" and not tokens.whole
        assert tokens.ids == tuple(history) and tokens.count > len(history)
        # the same conversation is not learnt twice; the second turn's own history is learnt next
        deadline = time.monotonic() + 5
        while engine.calls["tokenize-history"] < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.calls["tokenize-history"] == 2 and engine.calls["render"] == 0
    finally:
        await setup.close()


async def test_a_slow_engine_never_holds_a_request_and_learning_is_bounded(
    tmp_path: Path, engine_of: Callable[..., Any]
) -> None:
    engine = await engine_of("/elsewhere", Tokenizer(write_model(tmp_path / "m")))
    engine.tokenize_delay = 2.0
    setup = Setup(engine)
    try:
        assert await setup.found() == "learnt"
        for n in range(40):
            assert setup.key(chat_body(f"Conversation {n}: how deep?")).prompt.tokens is None  # type: ignore[union-attr]
        # all 40 were keyed while the engine was still tokenizing (nothing learnt yet): none waited for it
        assert len(setup.tokens.learnt) == 0 and len(setup.tokens.learning) == LEARNING
        await asyncio.sleep(0.2)
        assert engine.calls["tokenize"] == LEARNING == len(setup.tokens.learning)
    finally:
        await setup.close()


async def test_the_emulators_tokenizer_is_built_in(engine_of: Callable[..., Any], tmp_path: Path) -> None:
    from router.kvevents.tokens import EmulatorTokenizer  # noqa: PLC0415

    class Emulated(Tokenizer):
        def __init__(self) -> None:
            self.inner = EmulatorTokenizer()

        def encode(self, text: str) -> list[int]:
            return list(self.inner.prompt(text))

        def render(self, messages: Any, generation: bool = True, **extra: Any) -> str:
            from router.kvevents.emulator_tokens import render_chat  # noqa: PLC0415

            return render_chat(messages, add_generation_prompt=generation)

        def prompt(self, text: str) -> tuple[int, ...]:
            return self.inner.prompt(text)

    engine = await engine_of("emulated-llm", Emulated(), owned_by="router-emulator")
    setup = Setup(engine)
    try:
        assert await setup.found() == "builtin" and setup.checks("match") == 1
    finally:
        await setup.close()


def test_conversation_hashes_key_every_prefix_and_the_model() -> None:
    body = chat_body("a", "b")
    hashes = conversation_hashes("m", CHAT, body)
    assert len(hashes) == len(body["messages"]) == 4
    shorter = conversation_hashes("m", CHAT, chat_body("a"))
    assert shorter == hashes[:2]
    assert conversation_hashes("other", CHAT, chat_body("a")) != shorter
    reordered = {"model": "m", "messages": [{k: m[k] for k in reversed(list(m))} for m in body["messages"]]}
    assert [list(m) for m in reordered["messages"]] != [list(m) for m in body["messages"]]
    assert conversation_hashes("m", CHAT, reordered) == hashes  # a message's keys in any order
    # what the template gets besides the messages keys them too
    thinking = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    assert conversation_hashes("m", CHAT, thinking) != hashes


async def test_a_requests_template_kwargs_reach_the_template_and_a_system_refusing_one_is_checked(
    tmp_path: Path, engine_of: Callable[..., Any]
) -> None:
    # a template with a switch of its own (as Qwen3's enable_thinking), that refuses a system message
    # (as Gemma's and older Mistral's do)
    template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        + TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|>{% if think %}<s>{% endif %}{% endif %}")
    )
    folder = write_model(tmp_path / "model", template)
    tokenizer = Tokenizer(folder)
    body = {"model": "m", "messages": [{"role": "user", "content": "How deep?"}]}
    plain = local_turn(tokenizer, CHAT, body)
    thinking = local_turn(tokenizer, CHAT, {**body, "chat_template_kwargs": {"think": True, "messages": []}})
    assert plain is not None and thinking is not None
    assert thinking.ids == (*plain.ids, tokenizer.tokenizer.token_to_id("<s>"))  # the kwarg, not its messages
    # the sample check's system message is refused by the template: the user's alone is checked
    engine = await engine_of(str(folder), Tokenizer(folder))
    setup = Setup(engine)
    try:
        assert await setup.found() == "path" and setup.checks("match") == 1
    finally:
        await setup.close()


async def test_a_background_task_that_fails_is_said_in_the_log(
    tmp_path: Path, engine_of: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    engine = await engine_of("/elsewhere", Tokenizer(write_model(tmp_path / "m")))
    setup = Setup(engine)

    async def broken() -> None:
        raise RuntimeError("the session closed")

    try:
        task = setup.tokens._spawn(broken(), "learn tokens")
        with contextlib.suppress(RuntimeError):
            await task
        await asyncio.sleep(0)  # its done callback
        assert "learn tokens failed" in caplog.text and "the session closed" in caplog.text
        assert task not in setup.tokens.tasks
    finally:
        await setup.close()
