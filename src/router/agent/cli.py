"""Command line of `router-agent`: read the GPUs and the local engine, serve /stats (and write shared memory)."""

from __future__ import annotations

import argparse
import math
import sys

from aiohttp import web

from router._runtime import run, until_stopped
from router.agent.agent import Agent
from router.agent.nvml import NvmlReader
from router.shm.table import SlotTable


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="router-agent",
        description=(
            "Runs beside an inference engine: reads GPU memory, utilisation, temperature, throttle "
            "reasons and ECC errors through NVML, and the engine's queue and KV figures from its "
            "/metrics; serves them as JSON on GET /stats, and with --shm writes them into the "
            "router host's shared-memory segment (the agent slot of --replica-id). Figures it "
            "cannot read are reported missing."
        ),
    )
    p.add_argument("--engine", metavar="URL", help="the local engine's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--replica-id", default=None, help="the replica's id in the router (default: the engine URL)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9100, help="port of /stats (default 9100)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between readings (default 1)")
    p.add_argument("--shm", metavar="NAME", help="shared-memory replica table to write (colocated with the router)")
    return p


async def serve(agent: Agent, host: str, port: int) -> None:
    runner = web.AppRunner(agent.app(), handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    print(f"router-agent for {agent.replica_id} on http://{host}:{port}/stats", flush=True)
    try:
        await until_stopped()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (math.isfinite(args.interval) and args.interval > 0):
        print("router-agent: --interval must be a positive number of seconds", file=sys.stderr)
        return 2
    if not 0 < args.port <= 65535:
        print("router-agent: --port must be in 1..65535", file=sys.stderr)
        return 2
    if args.engine is not None and not args.engine.startswith(("http://", "https://")):
        print(f"router-agent: --engine must be an http(s) URL, got {args.engine!r}", file=sys.stderr)
        return 2
    table = None
    if args.shm:
        try:
            table = SlotTable.attach(args.shm)
        except (FileNotFoundError, ValueError) as exc:
            print(f"router-agent: cannot use shared memory {args.shm!r}: {exc}", file=sys.stderr)
            return 2
    agent = Agent(args.replica_id or args.engine or "local", args.engine, NvmlReader(), args.interval, table)
    try:
        run(serve(agent, args.host, args.port))
    except OSError as exc:
        print(f"router-agent: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        if table is not None:
            table.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
