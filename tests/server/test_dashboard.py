"""``/dashboard`` in a real headless browser (Debian's chromium and chromium-driver, driven by
selenium): the page loads, shows the running requests of a live load, and once the server is
idle its numbers are those of ``/metrics``."""

from __future__ import annotations

import json
import re
import shutil
import threading

import httpx
import pytest

from tests.server.server_testing import metric, wait_idle
from tests.shapes import SERVER_SHAPE

selenium = pytest.importorskip("selenium")
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")
WAIT_S = 60


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


class Load:
    """Streaming completions, one after another on a few threads, until stopped; keeps their ids."""

    def __init__(self, url: str, threads: int = 4):
        self.url, self.ids, self.stop = url, set(), threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self.stop.is_set():
                body = {"prompt": [40 + i, 41, 42], "max_tokens": 200, "ignore_eos": True, "stream": True}
                with client.stream("POST", "/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            self.ids.add(json.loads(line[len("data: "):])["id"])

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(WAIT_S)


def test_dashboard_shows_live_requests_and_agrees_with_metrics(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{server.base}/dashboard?interval=200")
    assert browser.title == "jaxserve dashboard"
    load = Load(server.url)
    try:
        def running_rows(driver):
            rows = driver.find_elements(By.CSS_SELECTOR, "#requests tbody tr")
            shown = {r.get_attribute("data-request-id") for r in rows}
            return shown if shown and int(driver.find_element(By.ID, "running-count").text or 0) > 0 else False

        shown = WebDriverWait(browser, WAIT_S, poll_frequency=0.05).until(running_rows)
        assert browser.find_elements(By.CSS_SELECTOR, "#steps rect"), "the step timeline is drawn"
        assert browser.find_elements(By.CSS_SELECTOR, "#kv-map span.used")
    finally:
        load.finish()
    assert shown <= load.ids, (shown, load.ids)  # the rows are the load's own requests

    running, usage = wait_idle(server.base)
    assert running == 0 and usage == 0
    expected = {
        "running-count": metric(server.base, "jaxserve:num_requests_running"),
        "generation-tokens": metric(server.base, "jaxserve:generation_tokens_total"),
        "finished-requests": metric(server.base, "jaxserve:request_success_total"),
        "preemptions": metric(server.base, "jaxserve:num_preemptions_total"),
        "ttft-count": metric(server.base, "jaxserve:time_to_first_token_seconds_count"),
        "itl-count": metric(server.base, "jaxserve:inter_token_latency_seconds_count"),
    }

    def shows_metrics(driver):
        shown = {k: float(driver.find_element(By.ID, k).text or "nan") for k in expected}
        return shown if shown == expected else False

    WebDriverWait(browser, WAIT_S, poll_frequency=0.1).until(shows_metrics)
    assert browser.find_element(By.ID, "error").text == ""
    assert browser.find_element(By.ID, "kv-usage").text == "0.0%"
    assert not browser.find_elements(By.CSS_SELECTOR, "#requests tbody tr")
    # The last step ran after the last request freed its blocks (it told the runner so).
    blocks = re.fullmatch(r"used 0, cached free (\d+), free (\d+) of (\d+)",
                          browser.find_element(By.ID, "kv-blocks").text)
    assert blocks and blocks[2] == blocks[3] == str(SERVER_SHAPE["num_gpu_blocks_override"] - 1), blocks
