"""The admin API, console and /metrics on an address of their own, with one process or workers."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from router.bench.common import free_port
from router.config import ConfigError, load

WORKERS_TOKEN = "workers-test-token"  # the admin token the serve_workers fixture gives its routers

CHAT = {"model": "emulated-llm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def status_of(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, Any]:
    async with http.request(method, url, **kw) as r:
        body = await r.json(content_type=None) if r.content_type == "application/json" else await r.text()
        return r.status, body


async def check_split(proxy: str, admin: str, token: str) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http:
        # the proxy's port proxies and answers health, and knows nothing of admin, console or metrics
        status, body = await status_of(http, "POST", proxy + "/v1/chat/completions", json=CHAT)
        assert status == 200 and body["choices"]
        assert (await status_of(http, "GET", proxy + "/health"))[0] == 200
        for path in ("/admin/replicas", "/console", "/metrics"):
            status, body = await status_of(http, "GET", proxy + path, headers=auth)
            assert status == 404 and body["error"]["code"] == "not_found", path
        # the admin address: the token is asked for, compared whole
        status, body = await status_of(http, "GET", admin + "/admin/replicas")
        assert status == 401 and body["error"]["type"] == "authentication_error"
        for wrong in (token[:-1], token + "x", token[:-1] + chr(ord(token[-1]) ^ 1)):
            bad = {"Authorization": f"Bearer {wrong}"}
            assert (await status_of(http, "GET", admin + "/admin/replicas", headers=bad))[0] == 401
        status, body = await status_of(http, "GET", admin + "/admin/replicas", headers=auth)
        assert status == 200 and len(body) == 2
        status, text = await status_of(http, "GET", admin + "/metrics")
        assert status == 200 and "router_requests_total" in text
        assert (await status_of(http, "GET", admin + "/console"))[0] == 200
        status, body = await status_of(http, "POST", admin + "/v1/chat/completions", json=CHAT)
        assert status == 404 and body["error"]["code"] == "not_found"  # requests are not proxied here


async def wait_up(url: str, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            assert proc.poll() is None, "router-serve exited"
            try:
                async with http.get(url + "/health") as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            assert asyncio.get_running_loop().time() < deadline, "router-serve did not come up"
            await asyncio.sleep(0.1)


async def test_one_process_serves_admin_apart(start_fleet) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    port, admin_port = free_port(), free_port()
    args = [sys.executable, "-m", "router.proxy.cli", "--port", str(port), "--admin-port", str(admin_port)]
    args += ["--state", "none", "--admin-token", "s3cret-admin-token"]
    for r in fleet.replicas:
        args += ["--replica", f"{r.options.replica_id}={r.url}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        await wait_up(f"http://127.0.0.1:{port}", proc)
        await wait_up(f"http://127.0.0.1:{admin_port}", proc)
        await check_split(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", "s3cret-admin-token")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=20)
    assert f"admin API, console and metrics on http://127.0.0.1:{admin_port}" in out
    assert f"http://127.0.0.1:{admin_port}/console" in out


async def test_workers_serve_admin_apart(start_fleet, serve_workers) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    admin_port = free_port()
    served = await serve_workers(
        [f"{r.options.replica_id}={r.url}" for r in fleet.replicas], "--admin-port", str(admin_port)
    )
    await check_split(served.url, f"http://127.0.0.1:{admin_port}", WORKERS_TOKEN)


def test_defaults_bind_loopback_and_bad_admin_addresses_are_refused() -> None:
    cfg = load(None, {}, {"replicas": ["http://127.0.0.1:9"]})
    assert cfg.host == "127.0.0.1" and cfg.admin_host == "127.0.0.1" and cfg.admin_port == 0
    for host in ("127.0.0.1", "localhost", "0.0.0.0"):  # the same port is refused whatever the host
        with pytest.raises(ConfigError, match="admin_port"):
            load(
                None, {}, {"replicas": ["http://127.0.0.1:9"], "port": "8080", "admin_port": "8080", "admin_host": host}
            )
    with pytest.raises(ConfigError, match="admin_host"):
        load(None, {}, {"replicas": ["http://127.0.0.1:9"], "admin_host": " ", "admin_port": "8081"})
    with pytest.raises(ConfigError, match="admin_port"):
        load(None, {}, {"replicas": ["http://127.0.0.1:9"], "admin_port": "70000"})
    load(None, {}, {"replicas": ["http://127.0.0.1:9"], "admin_host": "127.0.0.2", "admin_port": "8081"})


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_taken_admin_port_is_one_line_naming_it(workers: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "router.proxy.cli", "--replica", "http://127.0.0.1:9", "--state", "none"]
        proc = subprocess.run(
            [*cmd, "--port", str(free_port()), "--admin-port", str(port), "--workers", workers],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [f"router-serve: cannot listen on 127.0.0.1:{port}: Address already in use"], proc.stderr
