"""Prefill/decode hand-off protocols: what the router asks of a prefill replica, what it reads from
its answer, and what it then sends the decode replica. Pure functions of request bodies, no HTTP.

vLLM's (`VLLM`), spoken by its KV connectors (NixlConnector and the others): the request goes to the
prefill replica as it came, but not streamed, for one token, and with `kv_transfer_params` asking
for a remote decode; the prefill replica computes the prompt, keeps its KV blocks for a lease
(`kv_lease_duration` in its `kv_connector_extra_config`, 30 s by default, which the decode side's
heartbeats extend while it reads them), and answers with a top-level `kv_transfer_params` naming
them (`do_remote_prefill: true`, `remote_engine_id`, `remote_block_ids`, `remote_host`,
`remote_port`, `remote_request_id`, ...: tests/data/engines/vllm-0.32-nixl-prefill-answer.json).
The decode replica gets the client's request unchanged but for those params: it reads the blocks
from the prefill replica and decodes from there. Chat, completions and the Responses API carry
them alike (the Responses API's token cap is `max_output_tokens`).

A second protocol (SGLang's bootstrap host, port and room, sent to both sides at once) fits the
same three questions: `prefill_body`, `params`, `decode_body`.
"""

from __future__ import annotations

from typing import Any, Protocol

from router.apis import CHAT, COMPLETION, RESPONSES, Api

# the APIs whose requests can be split: the engines' connectors see their prompts
SPLITTABLE = frozenset({CHAT.name, COMPLETION.name, RESPONSES.name})

# what vLLM asks of a prefill request: decode elsewhere, nothing to read from elsewhere
_ASK_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class Handoff(Protocol):
    name: str

    def prefill_body(self, api: Api, body: dict[str, Any]) -> dict[str, Any]:
        """The body sent to the prefill replica (never streamed: the params come in its answer)."""
        ...

    def params(self, answer: Any) -> dict[str, Any] | None:
        """What the decode replica needs from the prefill replica's answer; None where the answer
        carries none (the prefill replica does not speak the protocol, or kept nothing)."""
        ...

    def decode_body(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """The client's body as the decode replica gets it."""
        ...


class VllmKvTransfer:
    name = "vllm"

    def prefill_body(self, api: Api, body: dict[str, Any]) -> dict[str, Any]:
        sent = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "kv_transfer_params")}
        sent["stream"] = False
        if api is RESPONSES:
            sent["max_output_tokens"] = 1
            sent["store"] = False  # the decode side's answer is the one a later turn names
        else:
            sent["max_tokens"] = 1
            sent.pop("max_completion_tokens", None)
            sent.pop("n", None)  # one prefill serves every choice the decode side draws
        sent["kv_transfer_params"] = dict(_ASK_REMOTE_DECODE)
        return sent

    def params(self, answer: Any) -> dict[str, Any] | None:
        if not isinstance(answer, dict):
            return None
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            return None
        if not params.get("remote_block_ids"):
            return None  # nothing kept (a prompt shorter than a block): decoding alone recomputes it
        return params

    def decode_body(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        return body | {"kv_transfer_params": params}


VLLM = VllmKvTransfer()
PROTOCOLS: dict[str, Handoff] = {VLLM.name: VLLM}
