"""The emulator speaks vLLM's prefill/decode hand-off (kv_transfer_params, as NixlConnector does):
a prefill replica keeps a lease on the prompt's KV and names it; a decode replica reads it, counts
the transfer, and computes only the last prompt token."""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp
import orjson

from router.apis import CHAT, COMPLETION
from router.engines.handoff import VLLM

PROMPT = "the quick brown fox jumps over the lazy dog " * 40


async def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, data=orjson.dumps(body)) as r:
        return r.status, await r.json()


def transfers(text: str) -> tuple[float, float]:
    """(transfers, failed transfers) in a replica's /metrics."""
    count = failed = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:nixl_xfer_time_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
        if line.startswith("vllm:nixl_num_failed_transfers_total"):
            failed = float(line.rsplit(" ", 1)[1])
    return count, failed


async def metrics(url: str) -> tuple[float, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        return transfers(await r.text())


async def test_a_decode_reads_the_prefills_kv_and_computes_one_token(start_fleet) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    prefill, decode = (r.url for r in fleet.replicas)
    body = {"model": "emulated-llm", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    status, answer = await post(prefill + CHAT.path, VLLM.prefill_body(CHAT, body))
    assert status == 200 and answer["usage"]["completion_tokens"] == 1
    params = VLLM.params(answer)
    assert params is not None and params["remote_num_tokens"] == answer["usage"]["prompt_tokens"]
    assert params["remote_port"] == fleet.replicas[0].port
    status, done = await post(decode + CHAT.path, VLLM.decode_body(body, params))
    assert status == 200 and done["usage"]["completion_tokens"] == 8
    # the prompt's KV came over the wire: not cached, not created there (vLLM's usage says 0 for both)
    details = done["usage"]["prompt_tokens_details"]
    assert details == {"cached_tokens": 0, "created_cache_tokens": 0}
    assert "kv_transfer_params" not in done
    assert await metrics(decode) == (1.0, 0.0) and await metrics(prefill) == (0.0, 0.0)
    # read once: the same params again find no lease, and the decode fails as vLLM's "fail" policy does
    status, failed = await post(decode + CHAT.path, VLLM.decode_body(body, params))
    assert status == 500 and "KV transfer" in failed["error"]["message"]
    assert await metrics(decode) == (1.0, 1.0)
    # a pull that is not JSON gets a 400, not a crash
    async with aiohttp.ClientSession() as http, http.post(prefill + "/emulator/kv/pull", data=b"{") as r:
        assert r.status == 400
    # the transferred blocks are the decode replica's own cache now: the next turn hits them there
    status, again = await post(decode + CHAT.path, body)
    assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_lease_dies_with_the_prefills_engine_and_a_completion_splits_alike(start_fleet) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    prefill, decode = fleet.replicas
    body = {"model": "emulated-llm", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    status, answer = await post(prefill.url + COMPLETION.path, VLLM.prefill_body(COMPLETION, body))
    params = VLLM.params(answer)
    assert status == 200 and params is not None
    prefill.restart_engine()  # its KV is gone: the lease with it
    status, _ = await post(decode.url + COMPLETION.path, VLLM.decode_body(body | {"stream": False}, params))
    assert status == 500
    # a fresh prefill after the restart is read, and the decode streams as any other
    status, answer = await post(prefill.url + COMPLETION.path, VLLM.prefill_body(COMPLETION, body))
    params = VLLM.params(answer)
    assert params is not None
    async with (
        aiohttp.ClientSession() as http,
        http.post(decode.url + COMPLETION.path, data=orjson.dumps(VLLM.decode_body(body, params))) as r,
    ):
        streamed = await r.read()
    assert r.status == 200 and streamed.rstrip().endswith(b"data: [DONE]")
    assert await metrics(decode.url) == (1.0, 1.0)


async def test_a_failed_transfer_in_a_stream_and_under_the_recompute_policy(start_fleet) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    prefill, decode = fleet.replicas
    body = {"model": "emulated-llm", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    gone = VLLM.params(
        {
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "remote_block_ids": [[1]],
                "remote_engine_id": "x",
                "remote_request_id": "y",
                "remote_host": "127.0.0.1",
                "remote_port": prefill.port,
            }
        }
    )
    assert gone is not None
    # streamed under "fail": a 200, the opening event, an error event, the end (as vLLM 0.32 does)
    async with (
        aiohttp.ClientSession() as http,
        http.post(decode.url + CHAT.path, data=orjson.dumps(VLLM.decode_body(body | {"stream": True}, gone))) as r,
    ):
        streamed = await r.read()
    events = [e for e in streamed.split(b"\n\n") if e]
    assert r.status == 200 and b'"role":"assistant"' in events[0]
    assert orjson.loads(events[1][len(b"data: ") :])["error"]["code"] == 500 and events[2] == b"data: [DONE]"
    # under "recompute" the prompt is computed there instead, and the failure still counted
    decode.options = dataclasses.replace(decode.options, kv_load_failure_policy="recompute")
    status, answer = await post(decode.url + CHAT.path, VLLM.decode_body(body, gone))
    assert status == 200 and answer["usage"]["prompt_tokens_details"]["created_cache_tokens"] > 0
    assert await metrics(decode.url) == (0.0, 2.0)
