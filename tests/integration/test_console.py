"""The console: its routes, and the page itself in real headless Chromium against router-serve --demo.

The browser test drives Debian's chromium through chromedriver (Selenium from PyPI); `.ci/run`
installs both. It skips, saying so, only where they are not installed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from waiting import until
from yarl import URL

from router.bench.common import free_port

TOKEN = "console-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


async def test_console_routes_page_assets_and_data(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    named = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    _, url = await start_router(named, admin_token=TOKEN, console_interval_s="0.1", health_checks="false")
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/console") as r:
            page = await r.text()
            assert r.status == 200 and r.content_type == "text/html"
            assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        assert "/console/assets/console.js" in page and "http" not in page.replace("http://www.w3.org", "")
        for name in ("console.js", "console.css"):
            async with http.get(url + "/console/assets/" + name) as r:
                assert r.status == 200 and len(await r.read()) > 1000
        for name in ("history.py", "%2e%2e%2fhistory.py", "..%2F..%2Fconfig.py"):  # only the page's own files
            async with http.get(URL(url + "/console/assets/" + name, encoded=True)) as r:
                assert r.status == 404, name
        # the data needs the token; the page can ask whether without an error
        async with http.get(url + "/console/api/state") as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        async with http.get(url + "/console/api/auth") as r:
            assert await r.json() == {"required": True, "accepted": False}
        async with http.get(url + "/console/api/auth", headers=AUTH) as r:
            assert await r.json() == {"required": True, "accepted": True}
        for i in range(10):
            body = {"messages": [{"role": "user", "content": "hello there " * 50}], "max_tokens": 3}
            async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": f"s{i % 3}"}) as r:
                assert r.status == 200
        deadline = time.monotonic() + 10
        while True:  # the sampler (every 0.1 s) has seen the traffic
            async with http.get(url + "/console/api/state", headers=AUTH) as r:
                state = await r.json()
            if any(p["hit"] for p in state["points"]) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert {row["id"] for row in state["replicas"]} == {"emu-0", "emu-1"}
        assert all("url" not in row for row in state["replicas"])  # internal addresses stay inside
        assert all(row["state"] == "healthy" and row["ring_share"] > 0 for row in state["replicas"])
        assert state["points"] and sum(p["qps"] for p in state["points"]) > 0
        assert any(p["hit"] for p in state["points"])  # the repeated prompt was cached
        last = state["points"][-1]["t"]
        async with http.get(url + "/console/api/state", params={"since": str(last)}, headers=AUTH) as r:
            assert all(p["t"] > last for p in (await r.json())["points"])
        async with http.get(url + "/console/api/state", params={"since": "soon"}, headers=AUTH) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "since"
        async with http.get(url + "/console/api/route", params={"key": "s1"}, headers=AUTH) as r:
            route = await r.json()
        assert route["replica"] in ("emu-0", "emu-1") and route["sticky"] == route["replica"]


async def test_console_without_a_token_is_open_and_can_be_turned_off(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    named = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    _, open_url = await start_router(named, health_checks="false")
    _, off_url = await start_router(named, health_checks="false", console="false")
    async with aiohttp.ClientSession() as http:
        async with http.get(open_url + "/console/api/auth") as r:
            assert await r.json() == {"required": False, "accepted": True}
        async with http.get(open_url + "/console/api/state") as r:
            assert r.status == 200
        async with http.get(off_url + "/console") as r:
            assert r.status == 404


# -- the page in a real browser ----------------------------------------------------------------


def _browser() -> Any:
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    # selenium is optional (the test extra): imported only after importorskip found it
    from selenium.webdriver.chrome.options import Options  # noqa: PLC0415
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    options = Options()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def _enter_token(driver: Any) -> None:
    """Type the admin token into the page's form once it shows (the page shows it when its first
    request is refused for want of one: on a busy machine, a while after the page loaded)."""
    from selenium.webdriver.common.by import By  # noqa: PLC0415 -- optional, as in _browser

    deadline = time.monotonic() + 15
    form = driver.find_element(By.ID, "token-form")
    while not form.is_displayed():
        assert time.monotonic() < deadline, "the console never asked for its token"
        time.sleep(0.05)
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    driver.find_element(By.CSS_SELECTOR, "#token-form button").click()


@pytest.fixture
async def demo() -> AsyncIterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.proxy.cli",
            "--demo",
            "3",
            "--port",
            str(port),
            "--state",
            "none",
            "--admin-token",
            TOKEN,
            "--console-interval-s",
            "0.5",
            "--console-history-s",
            "60",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    url = f"http://127.0.0.1:{port}"
    lines = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the banner names the console's address
        line = await asyncio.to_thread(proc.stdout.readline)
        lines.append(line)
        if "console:" in line:
            assert f"{url}/console (asks for the admin token)" in line
            break
    else:
        proc.kill()
        raise AssertionError(f"no console line in the banner: {lines}")
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # our own child, by its PID
        await asyncio.to_thread(proc.wait, 30)


async def _traffic(url: str, stop: asyncio.Event) -> int:
    """Multi-turn sessions with a growing history (so the hit rate is real), until stopped."""
    sent = 0
    async with aiohttp.ClientSession() as http:

        async def user(i: int) -> None:
            nonlocal sent
            messages: list[dict[str, str]] = [{"role": "system", "content": "You are helpful. " * 40}]
            turn = 0
            while not stop.is_set() and turn < 200:
                messages.append({"role": "user", "content": f"question {turn} of user {i}"})
                body = {"messages": messages, "max_tokens": 8, "stream": True}
                async with http.post(
                    url + "/v1/chat/completions", data=orjson.dumps(body), headers={"X-Session-ID": f"user-{i}"}
                ) as r:
                    await r.read()
                    assert r.status == 200
                sent += 1
                messages.append({"role": "assistant", "content": "an answer"})
                turn += 1
                await asyncio.sleep(0.05)

        await asyncio.gather(*(user(i) for i in range(8)))
    return sent


async def _until(check: Any, timeout: float, what: str) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException  # noqa: PLC0415 -- optional, as above

    deadline = time.monotonic() + timeout
    while True:
        try:
            value = await asyncio.to_thread(check)
        except StaleElementReferenceException:
            value = None  # the page redrew the element between finding and reading it: look again
        if value:
            return value
        assert time.monotonic() < deadline, f"not in {timeout} s: {what}"
        await asyncio.sleep(0.2)


async def test_the_console_in_headless_chromium(demo: str) -> None:
    from selenium.webdriver.common.by import By  # noqa: PLC0415 -- optional (test extra); _browser skips without it

    driver = await asyncio.to_thread(_browser)
    stop = asyncio.Event()
    traffic = asyncio.create_task(_traffic(demo, stop))
    try:
        await asyncio.to_thread(driver.get, demo + "/console")
        # the page asks for the token (it is never in the URL), then shows the data
        await asyncio.to_thread(_enter_token, driver)
        assert TOKEN not in driver.current_url

        def drawn() -> bool:
            heat = driver.find_element(By.ID, "heatmap")
            curve = driver.find_element(By.ID, "hitcurve")
            return (
                int(heat.get_attribute("data-rows") or 0) == 3
                and int(heat.get_attribute("data-cells") or 0) >= 6
                and int(curve.get_attribute("data-points") or 0) >= 2
            )

        await _until(drawn, 20, "the heatmap and the hit-rate curve drawn with data")
        hit = driver.find_element(By.ID, "hit-now").text
        assert hit.startswith("hit ") and hit != "hit 0.0%", hit

        # every chart says what it shows: values with their unit beside it, time under it
        def text(element_id: str) -> list[str]:
            return (driver.find_element(By.ID, element_id).text or "").split("\n")

        assert text("hit-y") == ["KV hit, % of prompt tokens", "0%", "25%", "50%", "75%", "100%"]
        jump_y = text("jump-y")
        assert jump_y[:2] == ["% of follow-up requests", "0%"] and len(jump_y) == 4 and jump_y[-1].endswith("%")
        for axis in ("heat-axis", "hit-x", "jump-x"):  # --console-history-s 60
            assert text(axis) == ["60 s ago", "40 s ago", "20 s ago", "now"], axis
        assert text("heat-max")[0].endswith("in flight")
        legend = driver.find_element(By.ID, "jump-legend").text
        for words in ("moved by the router", "no session id", "failed over", "drained or removed"):
            assert words in legend
        await _until(lambda: "of follow-up requests" in text("jump-now")[0], 10, "the jump rate")

        # a window without requests is a gap in the line, and so are samples missing: never a
        # diagonal across, never a drop to 0
        at = [{"t": t, "v": v} for t, v in [(0, 0.5), (1, 0.6), (2, None), (3, 0.7), (4, 0.7), (20, 0.8)]]
        stretches = driver.execute_script("return consoleChart.runs(arguments[0], (p) => p.v, 1)", at)
        assert stretches == [[[0, 0.5], [1, 0.6]], [[3, 0.7], [4, 0.7]], [[20, 0.8]]]
        path = driver.execute_script("return consoleChart.pathData(arguments[0], 0, 20, 1)", stretches)
        # one subpath a stretch, 50 % half way up the 200-unit plot, the lone point a dot
        assert path == "M0.0,100.0 L50.0,80.4 M150.0,60.8 L200.0,60.8 M1000.0,41.2 h0.5"
        fleet = driver.find_element(By.CSS_SELECTOR, "#hitcurve path.fleet")
        assert fleet.get_attribute("d").startswith("M") and int(fleet.get_attribute("data-runs") or 0) >= 1

        def table() -> list[tuple[str, str]] | None:
            """The replica table's rows, (replica, text), read at once (the page redraws it every poll)."""
            rows = driver.find_elements(By.CSS_SELECTOR, "#replicas tbody tr")
            return [(row.get_attribute("data-replica") or "", row.text) for row in rows] or None

        rows = await _until(table, 5, "the replica table")
        assert len(rows) == 3 and all("healthy" in text for _, text in rows)

        def models_shown() -> bool:  # the models each serves, once a probe has read its /v1/models
            rows = table()
            return rows is not None and all("emulated-llm" in text for _, text in rows)

        await _until(models_shown, 10, "the models each replica serves")

        # a replica removed through the admin API shows as removed within a few seconds: one that holds
        # a session (ttft may keep every session where their shared system prompt is cached, and a
        # replica with none would leave no jump to show)
        async with aiohttp.ClientSession() as http:
            body = {"messages": [{"role": "user", "content": "question 0 of user 0"}]}
            async with http.post(
                f"{demo}/admin/route", data=orjson.dumps(body), headers=AUTH | {"X-Session-ID": "user-0"}
            ) as r:
                victim = (await r.json())["sticky"]
            assert victim in {replica for replica, _ in rows}
            async with http.delete(f"{demo}/admin/replicas/{victim}", headers=AUTH) as r:
                assert r.status == 200
        removed_at = time.monotonic()

        def shown_removed() -> bool:
            row = driver.find_element(By.CSS_SELECTOR, f'#replicas tbody tr[data-replica="{victim}"]')
            return "removed" in row.text

        await _until(shown_removed, 5, f"{victim} shown as removed")
        assert time.monotonic() - removed_at < 5
        await _until(lambda: "left the fleet" in driver.find_element(By.ID, "events").text, 5, "a removal event")
        # its sessions' next turns went elsewhere: said as what they are, not as the router's own moves
        said: list[str] = []

        def removal_jumps() -> bool:
            said[:] = [driver.find_element(By.ID, "jump-why").text]
            return "drained or removed: its replica" in said[0]

        try:
            await _until(removal_jumps, 10, "the removed replica's sessions counted as jumps for its removal")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the panel said: {said}") from None

        # the key lookup box answers
        driver.find_element(By.ID, "key").send_keys("user-3")
        driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
        answer = await _until(
            lambda: driver.find_element(By.ID, "key-answer").text or None, 5, "an answer from the key lookup"
        )
        assert answer.startswith("→ emu-") and "last served by" in answer and victim not in answer.split("(")[0]

        # an aggregated fleet has no roles: their columns and the split requests' line stay hidden
        assert not driver.find_element(By.CSS_SELECTOR, '#replicas th[data-key="role"]').is_displayed()
        assert not driver.find_element(By.ID, "legs").is_displayed()

        # sorting by a column, and the heatmap's other colouring, keep working
        driver.find_element(By.CSS_SELECTOR, '#replicas th[data-key="qps"]').click()
        driver.find_element(By.CSS_SELECTOR, 'input[name="metric"][value="qps"]').click()
        assert "req/s" in driver.find_element(By.ID, "heat-max").text

        errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert errors == []
    finally:
        stop.set()
        await traffic
        await asyncio.to_thread(driver.quit)


async def test_the_console_shows_roles_and_the_legs_of_split_requests(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By  # noqa: PLC0415 -- optional, as above

    prefill, decode = await start_fleet(1), await start_fleet(2)
    node, url = await start_router(
        [],
        prefill=[f"p0={prefill.replicas[0].url}"],
        decode=[f"d{i}={r.url}" for i, r in enumerate(decode.replicas)],
        admin_token=TOKEN,
        console_interval_s="0.2",
        probe_interval_s="0.2",
    )
    await until(lambda: node.pairs is not None and len(node.pairs.met) == 2, "p0 to meet both decode replicas", 10.0)
    async with aiohttp.ClientSession() as http:
        for i in range(3):  # long prompts: each is split between p0 and a decode replica
            body = {"messages": [{"role": "user", "content": f"{i} " + "a long document " * 300}], "max_tokens": 8}
            async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": f"s{i}"}) as r:
                assert r.status == 200
    driver = await asyncio.to_thread(_browser)
    try:
        await asyncio.to_thread(driver.get, url + "/console")
        await asyncio.to_thread(_enter_token, driver)

        def rows() -> dict[str, str] | None:
            found = driver.find_elements(By.CSS_SELECTOR, "#replicas tbody tr")
            shown = {row.get_attribute("data-replica") or "": row.text for row in found}
            return shown if len(shown) == 3 else None

        table = await _until(rows, 10, "the three replicas")
        assert driver.find_element(By.CSS_SELECTOR, '#replicas th[data-key="role"]').is_displayed()
        assert " prefill " in f" {table['p0']} " and all(" decode " in f" {table[d]} " for d in ("d0", "d1"))
        legs = await _until(
            lambda: (t := driver.find_element(By.ID, "legs").text).startswith("split requests: prefill") and t,
            10,
            "the split requests' legs",
        )
        assert "transfer" in legs and "decode" in legs and "100.0% of requests split" in legs, legs
        errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert errors == []
    finally:
        await asyncio.to_thread(driver.quit)


def test_the_browser_is_there_in_ci() -> None:
    """.ci/run installs the browser (and says so with KVAR_CI=1): a skip there would hide the test."""
    if os.environ.get("KVAR_CI") != "1":
        pytest.skip("checked only under .ci/run (KVAR_CI=1)")
    assert shutil.which("chromium") and shutil.which("chromedriver")
    pytest.importorskip("selenium")
