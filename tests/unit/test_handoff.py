"""The prefill/decode hand-off as vLLM's connectors speak it (router.engines.handoff)."""

from __future__ import annotations

import json
from pathlib import Path

from router.apis import CHAT, COMPLETION, RESPONSES
from router.engines.handoff import SPLITTABLE, VLLM

# a prefill replica's answer as vLLM 0.32 with NixlConnector gave it here
RECORDED = json.loads((Path(__file__).parents[1] / "data/engines/vllm-0.32-nixl-prefill-answer.json").read_text())
PARAMS = RECORDED["kv_transfer_params"]


def test_a_prefill_request_is_one_token_not_streamed_and_asks_for_a_remote_decode() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 300,
        "n": 2,
    }
    sent = VLLM.prefill_body(CHAT, body)
    assert sent["stream"] is False and sent["max_tokens"] == 1
    assert "stream_options" not in sent and "max_completion_tokens" not in sent and "n" not in sent
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert sent["kv_transfer_params"]["do_remote_prefill"] is False
    assert sent["messages"] == body["messages"]
    assert body["stream"] is True and "kv_transfer_params" not in body  # the client's body is left as it was
    completion = VLLM.prefill_body(COMPLETION, {"model": "m", "prompt": "x", "max_tokens": 50})
    assert completion["max_tokens"] == 1 and completion["prompt"] == "x"
    responses = VLLM.prefill_body(RESPONSES, {"model": "m", "input": "x", "max_output_tokens": 50})
    assert responses["max_output_tokens"] == 1 and responses["store"] is False and "max_tokens" not in responses
    assert {CHAT.name, COMPLETION.name, RESPONSES.name} == SPLITTABLE


def test_the_decode_request_is_the_clients_with_the_prefills_params() -> None:
    body = {"model": "m", "messages": [], "stream": True, "max_tokens": 300}
    assert VLLM.params({"id": "x", "usage": RECORDED["usage"], "kv_transfer_params": PARAMS}) == PARAMS
    decode = VLLM.decode_body(body, PARAMS)
    assert decode == body | {"kv_transfer_params": PARAMS} and "kv_transfer_params" not in body


def test_an_answer_without_usable_params_says_decode_alone() -> None:
    assert VLLM.params({"id": "x"}) is None  # a replica without a connector ignores the ask
    assert VLLM.params({"kv_transfer_params": None}) is None
    assert VLLM.params({"kv_transfer_params": PARAMS | {"do_remote_prefill": False}}) is None
    assert VLLM.params({"kv_transfer_params": PARAMS | {"remote_block_ids": []}}) is None
    assert VLLM.params([1, 2]) is None and VLLM.params(None) is None
