"""Keep-alive connections llama-server closes: 500 streamed requests through the router, counted.

Four clients send 500 short streamed chat requests (20 sessions) through router-serve's
application, in process, in front of two real llama-servers (4 slots each), and print the router's
own counts: answered, failovers, retries, session jumps, requests resent on a new connection. The
router under test is the `router` package first on the path, so the same script measures another
checkout; the llama-server harness is always this checkout's (src/router/bench/llama_server.py,
loaded by file). Needs scripts/build-llama-server.sh to have run.

    python scripts/llama_keepalive.py                                  # this checkout
    PYTHONPATH=/path/to/other/checkout/src python scripts/llama_keepalive.py
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
import tempfile
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

import router
from router.config import load

try:  # the router as it is built since issue 17: a node, and its application
    from router.node import Node
    from router.proxy.app import build_app

    def router_app(config: object) -> web.Application:
        return build_app(Node(config))  # type: ignore[arg-type]

except ImportError:  # an older checkout (run against one with PYTHONPATH): its Router class
    from router.proxy.app import Router  # type: ignore[attr-defined,no-redef]

    def router_app(config: object) -> web.Application:
        return Router(config).app()  # type: ignore[no-any-return]


HARNESS = Path(__file__).resolve().parents[1] / "src" / "router" / "bench" / "llama_server.py"
COUNTED = (
    "router_requests_total",
    "router_failovers_total",
    "router_retries_total",
    "router_session_jumps_total",
    "router_upstream_reconnects_total",
)


def harness() -> object:
    spec = importlib.util.spec_from_file_location("kvar_llama_harness", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main() -> None:
    llama: object = harness()
    print("router under test:", router.__file__)
    model = llama.model_for(Path(tempfile.mkdtemp()))  # type: ignore[attr-defined]
    servers = [llama.LlamaServer(model, free_port(), slots=4, name=f"llama-{i}") for i in range(2)]  # type: ignore[attr-defined]
    await asyncio.gather(*(s.start() for s in servers))
    try:
        specs = [f"{s.name}={s.url}" for s in servers]
        config = load(None, {}, {"replicas": specs, "state": "none", "health_checks": False})
        runner = web.AppRunner(router_app(config), handle_signals=False, access_log=None, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
        statuses: list[int] = []

        async def client(c: int) -> None:
            async with aiohttp.ClientSession() as http:  # its own keep-alive connection to the router
                for i in range(125):
                    async with http.post(url, data=body, headers={"X-Session-ID": f"s-{c}-{i % 5}"}) as resp:
                        await resp.read()
                        statuses.append(resp.status)

        await asyncio.gather(*(client(c) for c in range(4)))
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            text = await resp.text()
        await runner.cleanup()
    finally:
        for s in servers:
            s.stop()
    print(f"answered {len(statuses)}, of which not 200: {sum(1 for x in statuses if x != 200)}")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTED:
                labels = ",".join(f"{k}={v}" for k, v in sample.labels.items() if k in ("cause", "reason", "status"))
                print(f"  {sample.name}{{{labels}}} {sample.value:g}")


if __name__ == "__main__":
    asyncio.run(main())
