"""Screenshots of the console under load, for docs/: `python scripts/console_screenshot.py OUT_DIR`.

Starts `router-serve --demo 6` and `router-bench replay` against it (multi-turn sessions), drains
one replica with removal half way, and has headless Chromium (Debian's, through Selenium) take
the page once the run has gone on for a while. Needs the test extra (selenium) and Debian's
chromium and chromium-driver. Every process started here is stopped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

TOKEN = "screenshot-token-0"


def main(out: str) -> None:
    port = 18980
    base = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [
            *(sys.executable, "-m", "router.proxy.cli", "--demo", "6", "--port", str(port), "--state", "none"),
            *("--admin-token", TOKEN, "--console-interval-s", "1", "--console-history-s", "150"),
        ],
        stdout=subprocess.DEVNULL,
    )
    load = None
    driver = None
    try:
        time.sleep(4)
        load = subprocess.Popen(
            [
                *(sys.executable, "-m", "router.bench.cli", "replay", "--target", base, "--workload", "sessions"),
                *("--duration", "150", "--users", "40", "--think", "2", "--time-scale", "1"),
            ],
            stdout=subprocess.DEVNULL,
        )
        options = Options()
        options.binary_location = "/usr/bin/chromium"
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"):
            options.add_argument(flag)
        for flag in ("--disable-background-networking", "--disable-component-update", "--disable-sync"):
            options.add_argument(flag)
        options.add_argument("--window-size=1400,1400")
        driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
        driver.get(base + "/console")
        driver.find_element(By.ID, "token").send_keys(TOKEN)
        driver.find_element(By.CSS_SELECTOR, "#token-form button").click()
        time.sleep(60)
        request = urllib.request.Request(base + "/admin/replicas", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request) as answer:
            victim = json.load(answer)[2]["id"]
        drain = urllib.request.Request(
            f"{base}/admin/replicas/{victim}/drain?remove=true",
            method="POST",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        urllib.request.urlopen(drain).close()
        time.sleep(40)
        driver.find_element(By.CSS_SELECTOR, "#replicas tbody tr").click()  # a replica's own curve too
        driver.find_element(By.ID, "key").send_keys("session-7")
        driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
        time.sleep(2)
        os.makedirs(out, exist_ok=True)
        driver.save_screenshot(os.path.join(out, "console.png"))
    finally:
        if driver is not None:
            driver.quit()
        for proc in (load, serve):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/images")
