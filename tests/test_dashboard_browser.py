"""The dashboard in a real browser (Debian's headless Chromium, driven by Selenium through
Debian's chromedriver; nothing is downloaded) against three loopback daemons: the page shows
the three nodes, their links and the plan, answers a chat, and shows a killed node gone
within 3 s without a reload. Screenshots are kept under the test's tmp path (and copied to
docs/ when MESHD_SCREENSHOTS_TO_DOCS=1, to refresh the README's and docs/clients.md's
pictures)."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from meshd.api.launcher import DaemonProcess
from meshd.wire import pb

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
DOCS = Path(__file__).resolve().parents[1] / "docs"


def committed_over(n: int):
    def check(status: pb.MeshStatus) -> bool:
        view = status.agreement
        return bool(view.active_plan_id and view.plan_json) and len(view.members) == n

    return check


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.fail(
            "the dashboard test needs Debian's chromium and chromium-driver "
            "(apt-get install chromium chromium-driver; packaging/install.sh does it)"
        )
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium must never fetch a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--window-size=1400,900",
    ):
        options.add_argument(arg)  # fmt: skip
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"the page did not show {what} within {timeout_s:g} s")


def shoot(driver, directory: Path, name: str, width: int) -> Path:
    """The whole page (the window is made as tall as the document), saved as `name`."""
    driver.execute_script("window.scrollTo(0, 0)")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, min(int(height) + 20, 3000))
    time.sleep(0.5)
    path = directory / name
    driver.save_screenshot(str(path))
    if os.environ.get("MESHD_SCREENSHOTS_TO_DOCS") == "1":
        shutil.copyfile(path, DOCS / name)
    return path


def test_dashboard_shows_the_mesh_live_and_chats(
    browser, tmp_path: Path, default_model_entry, profile_template: Path, mesh_token: str
) -> None:
    model = default_model_entry.path
    daemons = []
    for i in range(3):
        state = tmp_path / f"n{i}"
        state.mkdir()
        shutil.copyfile(profile_template, state / "profile.json")
        args = [*LOOPBACK, "--join", mesh_token, "--name", f"node-{'abc'[i]}", "--model",
                str(model), "--strategy", "memory"]  # fmt: skip
        daemons.append(DaemonProcess(state, args).start())
    shots = tmp_path / "screenshots"
    shots.mkdir()
    try:
        status = daemons[0].wait_for(committed_over(3), 90, "a committed 3-node plan")
        for daemon in daemons[1:]:
            daemon.wait_for(committed_over(3), 30, "a committed 3-node plan")
        browser.get(status.http_url + "/")
        script = browser.execute_script
        alive = "return document.getElementById('node-count').dataset.alive"
        wait_until(lambda: script(alive) == "3", 15, "3 nodes")
        edges = "return state.graph && state.graph.edges().length"
        wait_until(lambda: script(edges) == 3, 15, "the 3 measured links")
        assert script("return state.graph.nodes().length") == 3
        edge_labels = script("return state.graph.edges().map(e => e.data('label'))")
        assert all("bit/s" in label and " ms" in label for label in edge_labels), edge_labels
        # The page re-renders on every status: read the DOM in one script, not element by
        # element, and wait for a status with the plan (one without shows no bars; the count
        # and the links above can come first on a loaded host).
        bars = "return [...document.querySelectorAll('#plan-bars .stage')].map(e => e.textContent)"
        stages = wait_until(lambda: (shown := script(bars)) and len(shown) == 3 and shown, 15,
                            "the plan's 3 stages")  # fmt: skip
        assert all("–" in text for text in stages), stages
        row_ids = (
            "return [...document.querySelectorAll('#node-table tr.node-row')]"
            ".map(r => r.dataset.nodeId)"
        )
        assert set(script(row_ids)) == {n.profile.node_id for n in status.nodes}
        browser.execute_script("window.__sameDocument = true")

        browser.find_element("id", "chat-input").send_keys("What is the capital of France?")
        browser.find_element("id", "chat-send").click()
        answered = (  # the answer, or the error the page shows in its place
            "const m = document.querySelector('.msg.assistant, .msg.error');"
            "return !document.getElementById('chat-send').disabled && m && "
            "m.className + ': ' + m.textContent"
        )
        answer = wait_until(lambda: script(answered), 90, "an answer")
        assert answer.startswith("msg assistant: ") and "Paris" in answer, answer
        # The plan's prediction next to what requests measured, in units a person reads
        # (seconds to the first token, never a raw count of milliseconds).
        prediction = "return document.getElementById('plan-prediction').textContent"
        shown = wait_until(lambda: script(prediction), 15, "the plan's prediction")
        assert re.search(r"decode alone: predicted [\d.]+ tokens/s", shown), shown
        assert re.search(r"first token: predicted [\d.]+ m?s", shown), shown
        assert not re.search(r"\d{4,} ms", shown), shown
        time.sleep(1.5)  # a tokens/s sample or two in the chart
        shoot(browser, shots, "dashboard.png", 1400)

        victim = daemons[2]
        victim_id = victim.status().node_id
        victim.kill()
        killed_at = time.monotonic()
        wait_until(lambda: script(alive) == "2", 3.0, "the killed node gone")
        gone_after = time.monotonic() - killed_at
        ids = script(row_ids)
        assert victim_id not in ids and len(ids) == 2
        assert script("return window.__sameDocument === true"), "the page was reloaded"
        print(f"killed node gone from the page after {gone_after:.2f} s; screenshots in {shots}")

        shoot(browser, shots, "dashboard-phone.png", 390)  # a phone's width
    finally:
        for daemon in daemons:
            daemon.kill()


def test_dashboard_shows_a_tensor_parallel_group(
    browser, daemons, tiny_llama, mesh_token: str
) -> None:
    """Two loopback daemons whose loopback is marked trusted, TP=2 forced: the plan bar says
    TP x2 over ring, the group lists its ranks with their addresses and the link's reason,
    each runner of this node is listed with its PID, and the link's edge is marked TP."""
    args = [*LOOPBACK, "--join", mesh_token, "--model", str(tiny_llama), "--parallelism", "tensor"]
    args += ["--tensor-parallel-trusted-network", "127.0.0.0/8", "--context-length", "256"]
    first = daemons([*args, "--name", "tp-a"])
    second = daemons([*args, "--name", "tp-b"])

    def serving(status: pb.MeshStatus) -> bool:
        runners = status.tensor_parallel_runners
        return (
            committed_over(2)(status)
            and len(status.tensor_parallel_groups) == 1
            and bool(runners)
            and all(r.state == "ready" for r in runners)
        )

    status = first.wait_for(serving, 90, "a served tensor-parallel plan")
    second.wait_for(serving, 30, "a served tensor-parallel plan")
    (group,) = status.tensor_parallel_groups
    (runner,) = status.tensor_parallel_runners
    browser.get(status.http_url + "/")
    script = browser.execute_script
    shown = (
        "const g = document.querySelector('#plan-groups .tp-group');"
        "const r = document.querySelector('#plan-groups .tp-runner');"
        "const bar = document.querySelector('#plan-bars .stage');"
        "return g && r && bar && [g.textContent, r.textContent, bar.textContent];"
    )
    group_text, runner_text, bar_text = wait_until(lambda: script(shown), 15, "the TP group")
    assert "TP×2, ring" in bar_text, bar_text
    assert "stage 0: tensor-parallel ×2" in group_text and "ring" in group_text, group_text
    for rank, address in enumerate(group.addresses):
        assert f"rank {rank} " in group_text and address in group_text, group_text
    assert "loopback" in group_text, group_text  # the link, and why it may carry the group
    assert f"pid {runner.pid}" in runner_text and f"rank {runner.rank} of 2" in runner_text
    assert "ready" in runner_text, runner_text
    edges = "return state.graph && state.graph.edges().map(e => e.data('label'))"
    labels = wait_until(lambda: script(edges), 15, "the measured link")
    assert labels and all(label.endswith(" · TP") for label in labels), labels
