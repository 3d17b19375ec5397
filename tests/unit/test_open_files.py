"""What a router following a thousand replicas' KV events needs of its process: more open files
than a container's usual soft limit, and more ZMQ sockets than a default context holds."""

from __future__ import annotations

import subprocess
import sys

import zmq

from router._runtime import raise_open_files
from router.engines.kvfeed import _context


def test_router_serve_raises_its_soft_limit_on_open_files_to_the_hard_one() -> None:
    script = (
        "import resource\n"
        "from router._runtime import OPEN_FILES, raise_open_files\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "got = raise_open_files()\n"
        "want = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)\n"
        "assert got == want == resource.getrlimit(resource.RLIMIT_NOFILE)[0], (got, want)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_feed_s_context_holds_the_sockets_of_a_thousand_replicas() -> None:
    raise_open_files()  # as router-serve does at start: each socket holds a descriptor
    ctx = _context()
    sockets = []
    try:
        # a subscriber and a replay dealer for each of 1,000 replicas: past ZMQ's default of 1,023
        for _ in range(1000):
            sockets.append(ctx.socket(zmq.SUB))
            sockets.append(ctx.socket(zmq.DEALER))
        assert len(sockets) == 2000
    finally:
        for s in sockets:
            s.close(linger=0)
        ctx.term()
