"""Cache warm-up without sockets (router.balance.warmup.warm): a prompt computed on the replica the
sessions move to, or, with a `Source`, prefilled where they were and its KV read there."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from test_disagg_split import Answer  # a replica's whole answer, as router.engines.upstream hands it

from router.balance.warmup import WARMUP_HEADER, Source, warm
from router.engines.handoff import VLLM

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "old"}
CHAT = "/v1/chat/completions"


class Replicas:
    """Two replicas: `old` (the source) answers a prefill with params unless told not to; `new`
    answers 200, or 500 to a request that reads KV when its reads fail."""

    def __init__(self, params: bool = True, reads_fail: bool = False, source_s: float = 0.0) -> None:
        self.params = params
        self.reads_fail = reads_fail
        self.source_s = source_s  # how long the source takes to answer
        self.sent: list[tuple[str, dict[str, Any], dict[str, str]]] = []

    async def post(self, url: str, payload: bytes, headers: dict[str, str], connect_s: float) -> Answer:
        body = orjson.loads(payload)
        self.sent.append((url.split("/")[2], body, headers))
        if url.startswith("http://old"):
            await asyncio.sleep(self.source_s)
            return Answer(200, {"choices": [], "kv_transfer_params": PARAMS if self.params else None})
        if "kv_transfer_params" in body and self.reads_fail:
            return Answer(500, {"error": {"message": "KV transfer failed"}})
        return Answer(200, {"choices": []})


def requests() -> list[tuple[str, bytes]]:
    body = {"model": "m", "messages": [{"role": "user", "content": "a long conversation"}], "stream": True}
    return [(CHAT, orjson.dumps(body))]


async def test_with_a_source_the_prompt_is_prefilled_there_and_its_kv_read_by_the_new_replica() -> None:
    replicas = Replicas()
    source = Source("http://old:1", {"Authorization": "Bearer old-key"}, VLLM)
    result = await warm(replicas.post, "http://new:1", requests(), 2, 5.0, {"Authorization": "Bearer new-key"}, source)
    assert (result.moved, result.ok, result.failed, result.succeeded) == (1, 0, 0, [True])
    (at_old, prefill, old_headers), (at_new, decode, new_headers) = replicas.sent
    assert at_old == "old:1" and prefill["kv_transfer_params"]["do_remote_decode"] and prefill["max_tokens"] == 1
    assert old_headers["Authorization"] == "Bearer old-key" and old_headers[WARMUP_HEADER] == "1"
    source = Source("http://old:1", {}, VLLM)  # a source without a key is sent none (not the new replica's)
    replicas.sent.clear()
    await warm(replicas.post, "http://new:1", requests(), 2, 5.0, {"Authorization": "Bearer new-key"}, source)
    assert "Authorization" not in replicas.sent[0][2]
    assert at_new == "new:1" and decode["kv_transfer_params"] == PARAMS and decode["max_tokens"] == 1
    assert decode["stream"] is False and new_headers["Authorization"] == "Bearer new-key"


async def test_where_the_kv_cannot_travel_the_new_replica_computes_the_prompt() -> None:
    # no params, a failed read, a source slower than half the time: each computed on the new replica
    for replicas in (Replicas(params=False), Replicas(reads_fail=True), Replicas(source_s=30.0)):
        source = Source("http://old:1", {}, VLLM)
        result = await warm(replicas.post, "http://new:1", requests(), 2, 1.0, None, source)
        assert (result.moved, result.ok, result.failed, result.succeeded) == (0, 1, 0, [True])
        at, computed, _ = replicas.sent[-1]
        assert at == "new:1" and "kv_transfer_params" not in computed
    # without a source: computed there, nothing asked of another replica
    replicas = Replicas()
    result = await warm(replicas.post, "http://new:1", requests(), 2, 5.0)
    assert result.ok == 1 and [at for at, _, _ in replicas.sent] == ["new:1"]
