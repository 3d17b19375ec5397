"""Command line of `router-bench`: one sub-command per benchmark."""

from __future__ import annotations

import argparse
import sys

from router.bench import (
    adapters,
    balance_bench,
    faults,
    fleet,
    health_bench,
    overload,
    prefix_bench,
    proxy_bench,
    replay,
    ring_bench,
    simulate,
    tokens_bench,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="router-bench",
        description="Benchmarks for kv-affinity-router. Each prints a table, or one JSON object with --json.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ring_bench.add_parser(sub)
    prefix_bench.add_parser(sub)
    replay.add_parser(sub)
    proxy_bench.add_parser(sub)
    health_bench.add_parser(sub)
    balance_bench.add_parser(sub)
    simulate.add_parser(sub)
    fleet.add_parser(sub)
    faults.add_parser(sub)
    overload.add_parser(sub)
    adapters.add_parser(sub)
    tokens_bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print("router-bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
