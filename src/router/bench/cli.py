"""Command line of `router-bench`: one sub-command per benchmark."""

from __future__ import annotations

import argparse
import signal
import sys

from router.bench import (
    adapters,
    balance_bench,
    event_plane,
    faults,
    fleet,
    health_bench,
    overload,
    prefix_bench,
    proxy_bench,
    redis_bench,
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
    event_plane.add_parser(sub)
    redis_bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The long benchmarks print what they measured when a signal stops them (router.bench.live); the
    quick in-process ones (ring, prefix, simulate, tokens) end here, with a line."""
    parser = build_parser()
    args = parser.parse_args(argv)

    terms: list[int] = []

    def terminated(signum: int, frame: object) -> None:
        terms.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        signum = terms[0] if terms else signal.SIGINT
        print(f"router-bench: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
