"""A host whose /dev/shm has too little room for what the router keeps there (a container's is 64
MiB unless it is given more; our Kubernetes base gives 256 MiB).

`router-serve --workers 2` runs in a mount namespace of its own whose /dev/shm is a small tmpfs.
A page of a memory-backed file is taken when first written, and a write that finds no room kills
the writer with SIGBUS: before, the control process died so at its first write past the room
(at startup, in the replica table; or once enough replicas' KV events had come in, in the shared
index), and the workers with it, without a line said. Now the table that does not fit is one
line and exit 1, and the shared index lets go of the replicas whose blocks find no room (priced
by the router's model, said in one log line, in `router_kv_events_unfollowed` and the admin row)
while the router serves on.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import WORKERS_TOKEN

from router.emulator.engine import EngineConfig
from router.emulator.kvevents import KvEventsOptions

ADMIN = {"Authorization": f"Bearer {WORKERS_TOKEN}"}


async def chat(http: aiohttp.ClientSession, url: str, n: int, turn: int) -> None:
    """Turn `turn` of conversation `n`, in its session: answered 200."""
    messages = [{"role": "system", "content": "You answer questions about rivers. " * 10}]
    for t in range(turn):
        messages.append({"role": "user", "content": f"Conversation {n}, question {t}: " + "how deep? " * 20})
        messages.append({"role": "assistant", "content": f"answer {t} of {n} " * 8})
    body = {"model": "emulated-llm", "messages": messages[:-1], "max_tokens": 4}
    async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": f"room-{n}"}) as r:
        assert r.status == 200, await r.text()


def small_shm(kib: int) -> tuple[str, ...]:
    """A command that runs its arguments in a mount namespace of their own whose /dev/shm is a
    tmpfs of `kib` KiB (as root, or as an unprivileged user through a user namespace)."""
    user = () if os.geteuid() == 0 else ("-r",)
    mount = f'mount -t tmpfs -o size={kib}k tmpfs /dev/shm && exec "$@"'
    return ("unshare", "-m", "--propagation", "private", *user, "sh", "-c", mount, "sh")


def _namespaces() -> str | None:
    """Why a small /dev/shm of our own cannot be had here (None: it can)."""
    try:
        done = subprocess.run([*small_shm(64), "true"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else done.stderr.strip() or f"exit {done.returncode}"


WHY_NOT = _namespaces()
if WHY_NOT is not None and os.environ.get("KVAR_CI"):
    raise RuntimeError(f"unshare cannot give a process a /dev/shm of its own here: {WHY_NOT}")
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no mount namespace of our own: {WHY_NOT}")


def test_a_replica_table_without_room_is_one_line_not_a_signal() -> None:
    # the default table (1,024 slots, 2 workers, 200,000 sessions) is 13.7 MiB: it does not fit in 4
    args = [sys.executable, "-m", "router.proxy.cli", "--workers", "2", "--port", "9", "--state", "none"]
    done = subprocess.run(
        [*small_shm(4096), *args, "--replica", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])  # (it was -7, SIGBUS, and nothing said)
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("router-serve: cannot lay out the replica table in /dev/shm (13.7 MiB")
    assert "No space left on device" in line and "--shm-size" in line


async def test_replicas_whose_blocks_find_no_room_are_let_go_and_the_router_serves_on(
    start_fleet: Callable[..., Any], serve_workers: Callable[..., Any]
) -> None:
    """Room for the table (16 slots, 1,024 sessions: 106 KiB), the index's directory and roster
    (64 KiB each at first) and two replicas' first regions (192 KiB each), not four. (A budget is
    set: by default the room in /dev/shm bounds it, and the replicas would be left out by it.)"""
    config = EngineConfig(num_blocks=20_000, block_size=16)
    fleet = await start_fleet(4, config, kv_events=KvEventsOptions(port=0, replay_port=0))
    flags = ("--shm-slots", "16", "--sticky-max-sessions", "1024", "--probe-interval-s", "0.2")
    flags += ("--kv-events-max-mib", "64")
    served = await serve_workers([r.url for r in fleet.replicas], *flags, wrap=small_shm(700), errors=True)
    said = await asyncio.to_thread(served.said, r"(\d+) replicas' KV events not followed for 30 s", 30)
    assert said[1] == "2" and "No space left on device" in said.string and "--shm-size" in said.string
    async with aiohttp.ClientSession() as http:

        async def figures() -> tuple[str, dict[str, Any]]:
            async with http.get(served.url + "/metrics") as r:
                text = await r.text()
            async with http.get(served.url + "/admin/replicas", headers=ADMIN) as r:
                assert r.status == 200, await r.text()
                rows = {row["id"]: row["kv_events"] for row in await r.json()}
            return text, rows

        text, rows = await figures()
        believed = re.findall(r'router_kv_events_believed\{replica="([^"]+)"\} 1\.0', text)
        assert "router_kv_events_unfollowed 2.0" in text and len(set(believed)) == 2
        let_go = sorted(rid for rid, row in rows.items() if row and not row["followed"])
        assert len(let_go) == 2 and not set(let_go) & set(believed)
        for rid in let_go:
            assert rows[rid]["why"] == "shared memory full" and "No space left on device" in rows[rid]["error"]
        # the router serves on, every replica routable; what it follows stays believed
        for turn in range(1, 4):
            for n in range(8):
                await chat(http, served.url, n, turn)
        text, _ = await figures()
        assert set(re.findall(r'router_kv_events_believed\{replica="([^"]+)"\} 1\.0', text)) == set(believed)
    assert served.proc.poll() is None
    served.proc.terminate()
    assert await asyncio.to_thread(served.proc.wait, 20) == 0


async def test_by_default_the_replicas_followed_fit_the_room_in_dev_shm(
    start_fleet: Callable[..., Any], serve_workers: Callable[..., Any]
) -> None:
    """kv_events_max_mib 0 in the control process: no more than the room in /dev/shm holds at 68
    bytes a block (1,000 KiB less the table's 106 and the directory's and roster's 128: about
    11,500 blocks), so two replicas of 5,000 blocks are followed whole and two are left out by the
    budget, none of them found without room."""
    config = EngineConfig(num_blocks=5_000, block_size=16)
    fleet = await start_fleet(4, config, kv_events=KvEventsOptions(port=0, replay_port=0))
    flags = ("--shm-slots", "16", "--sticky-max-sessions", "1024", "--probe-interval-s", "0.2")
    served = await serve_workers([r.url for r in fleet.replicas], *flags, wrap=small_shm(1000), errors=True)
    said = await asyncio.to_thread(served.said, r"(\d+) replicas' KV events not followed", 30)
    assert said[1] == "2" and "kv_events_max_mib 0: the room in /dev/shm" in said.string, said.string
    async with aiohttp.ClientSession() as http:
        for turn in range(1, 3):
            for n in range(8):
                await chat(http, served.url, n, turn)
        async with http.get(served.url + "/admin/replicas", headers=ADMIN) as r:
            rows = {row["id"]: row["kv_events"] for row in await r.json()}
    assert sorted(bool(row and row["followed"]) for row in rows.values()) == [False, False, True, True]
    assert all(row["why"] == "kv_events_max_mib" for row in rows.values() if row and not row["followed"])
    served.proc.terminate()
    assert await asyncio.to_thread(served.proc.wait, 20) == 0
    assert not any("No space left" in line or "no room" in line for line in served.history)


def test_a_region_that_cannot_grow_evicts_its_oldest_and_tries_again_later(tmp_path: Path) -> None:
    """The shared index in a /dev/shm of 800 KiB: its directory and roster take 64 KiB each at
    first, and three holders' first regions 192 KiB each; a fourth is refused (SharedFileError,
    not SIGBUS). A full one that cannot move to a region twice as large (384 KiB) keeps its newest
    blocks and says so once; it grows once two holders leave and its retry time has passed."""
    script = textwrap.dedent(
        """
        import logging
        from array import array
        from router.kvevents import shared
        from router.kvevents.mapped import SharedFileError

        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        index = shared.SharedIndex("room")
        a, b, c = (index.add_holder(1 << 16) for _ in range(3))
        try:
            index.add_holder(1 << 16)
        except SharedFileError as exc:
            print("fourth refused:", exc)
        for n in range(3):  # past its first region's 4,096 entries
            index.insert(a, array("Q", range(1 + 4_000 * n, 1 + 4_000 * (n + 1))))
        print("held", index.size(a), "newest", index.match(a, array("Q", [11_999, 12_000])))
        index.remove_holder(b)
        index.remove_holder(c)  # room: it grows at its next insert, once its retry time has passed
        index._stuck_until.clear()  # (as GROW_RETRY_S later)
        index.insert(a, array("Q", range(20_000, 24_000)))
        print("held after room", index.size(a))
        index.close()
        """
    )
    done = subprocess.run(
        [*small_shm(800), sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]  # (it was -7: SIGBUS)
    out = done.stdout
    assert "fourth refused: cannot lay out a region of the shared index" in out and "No space left" in out
    held = int(re.search(r"held (\d+)", out)[1])  # type: ignore[index]
    assert held <= 4_096 and "newest 2" in out
    assert done.stderr.count("evicted oldest first") == 1
    assert int(re.search(r"held after room (\d+)", out)[1]) > held  # type: ignore[index]
