"""Command line of `router-serve`: load and validate config, start the router (and a demo fleet)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib.metadata
import logging
import socket
import sys
from typing import Any, NoReturn

from aiohttp import web

from router._runtime import raise_open_files, run, settle, until_stopped
from router.config import FIELDS, ConfigError, ReplicaSpec, RouterConfig, from_environment
from router.config.meanings import GROUPS, HELP
from router.emulator.server import Fleet as EmulatorFleet
from router.emulator.server import Replica, ReplicaOptions
from router.node import Node
from router.proxy.app import admin_app, build_app
from router.proxy.workers import (
    HANDOVER_S,
    CannotListen,
    Shutdown,
    WorkerFailed,
    listen,
    runner_for,
    serve_workers,
    stop_serving,
)
from router.ring import IMPLEMENTATION as RING_IMPLEMENTATION
from router.shm.table import SegmentError, SlotTable
from router.state.file import StateError, state_file
from router.tenancy.clients import ClientKeys, ClientKeysError
from router.tracing import TracingConfigError, exporters_from_environment


class Parser(argparse.ArgumentParser):
    """Names the closest flags when one is misspelled."""

    def error(self, message: str) -> NoReturn:
        unknown = [word for word in message.split() if word.startswith("--")]
        if message.startswith("unrecognized arguments") and unknown:
            flags = [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]
            hints = []
            for word in unknown:
                close = difflib.get_close_matches(word.partition("=")[0], flags, n=2, cutoff=0.7)
                if close:
                    hints.append(f"{word}: did you mean {' or '.join(close)}?")
            if hints:
                message += " (" + "; ".join(hints) + ")"
        super().error(message)


def _version() -> str:
    try:
        return importlib.metadata.version("kv-affinity-router")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="router-serve",
        usage="router-serve [--demo N | --replica [NAME=]URL ... | --discovery SOURCE] [--config FILE] "
        "[--check-config] [OPTIONS]",
        description=(
            "KV-cache-affinity router for OpenAI-compatible inference replicas. Every setting comes from "
            "defaults < --config TOML < ROUTER_<SETTING> environment variables < these flags. "
            "Try it without GPUs: router-serve --demo 4"
        ),
        epilog="Guide and reference: docs/router.md. The settings' names in TOML are the flags' with underscores.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    first = p.add_argument_group("start here", "where to listen, what to route to, and how")
    first.add_argument("--demo", metavar="N", help=HELP["demo"])
    first.add_argument(
        "--replica",
        dest="replicas",
        action="append",
        metavar="[NAME=]URL",
        help="a replica's base URL, e.g. http://10.0.0.5:8000; repeatable",
    )
    first.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file of settings: the names below with underscores, at the top or in their group's [table]",
    )
    first.add_argument(
        "--check-config",
        action="store_true",
        help="validate the settings (file, environment and flags together), print what they amount to and where "
        "state is kept, and exit: 0 when valid, 2 with the problem otherwise",
    )
    for section, title, about, names in GROUPS:
        group = first if not section else p.add_argument_group(f"{title} [{section}]", about or None)
        for name in names:
            flag = "--" + name.replace("_", "-")
            if FIELDS[name].type == "bool":
                group.add_argument(
                    flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=HELP[name]
                )
            elif name in ("prefill", "decode"):  # repeatable, as --replica
                group.add_argument(flag, dest=name, action="append", metavar="[NAME=]URL", help=HELP[name])
            else:  # a string: the config loader converts and validates it, naming the setting on error
                group.add_argument(flag, dest=name, metavar=name.upper(), help=HELP[name])
    return p


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in FIELDS}


def summary(config: RouterConfig) -> str:
    """One line of what a configuration amounts to (for --check-config)."""
    replicas = [f"{len(config.replicas)} replica{'' if len(config.replicas) == 1 else 's'}"]
    if config.prefill:
        replicas.append(f"{len(config.prefill)} prefill replica{'' if len(config.prefill) == 1 else 's'}")
    if config.discovery:
        replicas.append(f"discovered through {config.discovery}")
    if config.demo:
        replicas.append(f"{config.demo} emulated")
    parts = [
        f"listens on {config.host}:{config.port}",
        "compiled core" if RING_IMPLEMENTATION == "compiled" else "pure-Python core (ROUTER_NO_EXTENSIONS=1)",
        f"policy {config.policy}",
        " + ".join(replicas),
        f"{config.workers} worker process{'es' if config.workers > 1 else ''}",
        f"admin on {config.admin_host}:{config.admin_port}" if config.admin_port else "admin on the proxy's port",
        "admin API " + ("on (token set)" if config.admin_token else "off (no token)"),
    ]
    file = state_file(config.state, config.host, config.port)
    if file is not None:
        parts.append(f"routing state saved to {file.path}")
    elif config.state == "none":
        parts.append("routing state not saved" + (" (a demo's default; --state file saves it)" if config.demo else ""))
    else:
        parts.append(f"routing state shared through {config.state} (namespace {config.state_namespace})")
    return ", ".join(parts)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


async def serve(config: RouterConfig) -> None:
    demo_fleet = None
    if config.demo:
        ports = _free_ports(config.demo)
        demo_fleet = EmulatorFleet([Replica(ReplicaOptions(replica_id=f"emu-{p}", port=p)) for p in ports])
        await demo_fleet.start()
        specs = tuple(ReplicaSpec(f"emu-{p}", f"http://127.0.0.1:{p}") for p in ports)
        config = dataclasses.replace(config, replicas=config.replicas + specs)
    base = f"http://{config.host}:{config.port}"
    admin = f"http://{config.admin_host}:{config.admin_port}" if config.admin_port else base
    banner = f"router-serve listening on {base} ({config.policy}, {len(config.replicas)} replicas)"
    if config.admin_port:
        banner += f"\nadmin API, console and metrics on {admin}"
    console = f"{admin}/console" + (" (asks for the admin token)" if config.admin_token else "")
    if demo_fleet is not None:
        banner += f"""
demo: {config.demo} emulated replicas at {", ".join(r.url for r in demo_fleet.replicas)}
  send a request:  curl -s {base}/v1/chat/completions -H 'X-Session-ID: demo-1' \\
                     -d '{{"model": "emulated-llm", "max_tokens": 32,
                          "messages": [{{"role": "user", "content": "Hello!"}}]}}'
  metrics:         {admin}/metrics        health: {base}/health
  console:         {console if config.console else "off (--console turns it on)"}
  measure it:      router-bench replay --target {base} --duration 60   (a minute; Ctrl-C keeps what it measured)
  stop:            Ctrl-C"""
    elif config.console:
        banner += f"\nconsole: {console}"
    if config.placement.kv_event_followers > 1 and config.workers <= 1:
        banner += "\nkv_event_followers: one process follows the KV events (followers run under --workers 2 or more)"
    try:
        if config.workers > 1:
            await serve_workers(config, banner)
        else:
            await _serve_alone(config, banner)
    finally:
        if demo_fleet is not None:
            await demo_fleet.stop()


async def _serve_alone(config: RouterConfig, banner: str) -> None:
    table = SlotTable.create(config.shm_name, config.shm_slots) if config.shm_name else None
    shutdown: Shutdown | None = None
    try:
        node = Node(config, table=table)
        node.publish()
        runner = runner_for(build_app(node), config)
        await runner.setup()
        admin: web.AppRunner | None = None
        try:
            context = node.tls.context if node.tls is not None else None
            await listen(runner, config.host, config.port, ssl_context=context)
            if config.admin_port:
                admin = runner_for(admin_app(node), config)
                await admin.setup()
                await listen(admin, config.admin_host, config.admin_port, ssl_context=context)
            settle()
            print(banner, flush=True)
            print(node.state_line(), flush=True)
            if table is not None:
                print(f"shared memory: {table.name} (router-agent --shm {table.name})", flush=True)
            shutdown = Shutdown(await until_stopped(), node)
        finally:
            try:
                if admin is not None:
                    await admin.cleanup()
            finally:
                drain = None
                try:
                    drain = await stop_serving(runner, min(HANDOVER_S, config.drain_timeout_s))
                finally:
                    if shutdown is not None:
                        await shutdown.ended(drain)
    finally:
        if table is not None:
            table.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = from_environment(args.config, cli_values(args))
    except ConfigError as exc:
        for line in str(exc).splitlines():  # each mistake on a line of its own
            print(f"router-serve: {line}", file=sys.stderr)
        return 2
    if config.client_keys_file:
        try:
            keys = ClientKeys(config.client_keys_file)  # read at once: a router with keys on needs them
        except ClientKeysError as exc:
            print(f"router-serve: {exc}", file=sys.stderr)
            return 2
        if args.check_config:
            n, tenants = len(keys.clients), len({c.tenant for c in keys.clients.values()})
            print(
                f"router-serve: client keys: {n} key{'' if n == 1 else 's'} of {tenants} "
                f"tenant{'' if tenants == 1 else 's'} in {config.client_keys_file}"
            )
    try:
        exporters = exporters_from_environment()  # OTEL_*: traces (router.tracing), checked before anything starts
    except TracingConfigError as exc:
        print(f"router-serve: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        if exporters:
            print(f"router-serve: traces: sent by {', '.join(exporters)} (OTEL_* environment)")
        print(f"router-serve: the configuration is valid: {summary(config)}")
        return 0
    if config.log_requests:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    raise_open_files()
    try:
        run(serve(config))
    except (WorkerFailed, CannotListen, SegmentError) as exc:  # each says what failed, and where
        print(f"router-serve: {exc}", file=sys.stderr)
        return 1
    except StateError as exc:
        print(
            f"router-serve: cannot use the saved routing state: {exc} (--state none starts without it)", file=sys.stderr
        )
        return 2
    except FileExistsError:
        print(f"router-serve: shared memory {config.shm_name!r} already exists (another router?)", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"router-serve: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
