"""Loading a model over HTTP: Ollama's /api/pull through the official `ollama` client, and the
dashboard's picker endpoints (/meshd/models, /meshd/load), against a real loopback daemon
that starts without a model and shares the test session's store (the embedded SmolLM2).
A Hub repository is pulled from a real Hub-compatible server on loopback (olah, see
tests/support/local_hub.py) into a daemon of its own.

A pull answers only once the mesh serves the model (the next generate runs on it); a name the
node cannot resolve is a 404 in each API's error shape, with the name and the reason in words;
a load from another site, or not sent as JSON, is refused like every other write.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import httpx2
import ollama
import openai
import pytest

from meshd.api.launcher import DaemonProcess
from meshd.models.store import ModelEntry
from meshd.wire import pb
from tests.support.local_hub import LocalHub, make_repo, olah_available
from tests.test_dashboard_browser import browser, wait_until  # noqa: F401

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
UNKNOWN = "no-such-model-in-this-store"
REPO = "test-org/pulled-llama"


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, profile_template: Path, model_store: Path
) -> Iterator[DaemonProcess]:
    """One daemon, no model selected, the session's store (where the default model is)."""
    state = tmp_path_factory.mktemp("http-load")
    shutil.copyfile(profile_template, state / profile_template.name)
    process = DaemonProcess(state, [*LOOPBACK], env={"MESHD_MODEL_STORE": str(model_store)})
    process.start()
    try:
        process.wait_for(lambda s: bool(s.http_url), 60, "the HTTP server")
        yield process
    finally:
        process.kill()


@pytest.fixture(scope="module")
def model_name(default_model_entry: ModelEntry) -> str:
    return default_model_entry.name


def url_of(daemon: DaemonProcess) -> str:
    url = daemon.status().http_url
    assert url.startswith("http://127.0.0.1:"), url
    return url


def serves(name: str):
    def check(status: pb.MeshStatus) -> bool:
        return status.agreement.model == name and bool(status.agreement.active_plan_id)

    return check


def pull_all(client: ollama.Client, name: str, *, stream: bool) -> list:
    result = client.pull(name, stream=stream)
    return list(result) if stream else [result]  # type: ignore[arg-type]


def test_without_a_model_the_sdks_are_told_to_load_one_at_once(daemon) -> None:
    """No model selected is not transient: no API answers with a status its SDKs retry
    (each would ask three times, seconds apart); each says how to load one. First in this
    module: the next test loads a model."""
    url = url_of(daemon)
    assert daemon.status().agreement.model == ""
    sent: list[str] = []

    def note(request) -> None:  # type: ignore[no-untyped-def]
        sent.append(request.url.path)

    hello = [{"role": "user", "content": "hi"}]
    started = time.monotonic()
    hooks = {"request": [note]}
    oai = openai.OpenAI(
        base_url=url + "/v1", api_key="x", http_client=httpx.Client(event_hooks=hooks)
    )
    with pytest.raises(openai.NotFoundError, match="meshd load MODEL") as refused:
        oai.chat.completions.create(model="", messages=hello)  # type: ignore[arg-type]
    assert refused.value.code == "model_not_found"
    claude = anthropic.Anthropic(
        base_url=url, api_key="x", http_client=httpx2.Client(event_hooks=hooks)
    )
    with pytest.raises(anthropic.NotFoundError, match="meshd load MODEL"):
        claude.messages.create(model="any", max_tokens=4, messages=hello)  # type: ignore[arg-type]
    with pytest.raises(ollama.ResponseError, match="meshd load MODEL") as missing:
        ollama.Client(host=url).chat(model="any", messages=hello)
    assert missing.value.status_code == 404
    assert sent == ["/v1/chat/completions", "/v1/messages"], sent  # once each: no retries
    assert time.monotonic() - started < 5


def test_ollama_pull_loads_the_model_and_answers_once_it_is_served(daemon, model_name) -> None:
    client = ollama.Client(host=url_of(daemon))
    assert daemon.status().agreement.model == ""
    progress = list(client.pull(model_name, stream=True))
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    # Served now: a generate runs at once, on the pulled model.
    reply = client.generate(model=model_name, prompt="Hello", options={"num_predict": 4})
    assert reply.done and reply.eval_count > 0
    # Pulling the served model again (Ollama's tag included) does not re-plan: at once.
    plan = daemon.status().agreement.active_plan_id
    assert client.pull(model_name + ":latest").status == "success"
    assert daemon.status().agreement.active_plan_id == plan


def test_ollama_pull_of_an_unknown_model_is_a_404_in_ollamas_shape(daemon) -> None:
    client = ollama.Client(host=url_of(daemon))
    for stream in (True, False):
        with pytest.raises(ollama.ResponseError) as refused:
            pull_all(client, UNKNOWN, stream=stream)
        assert refused.value.status_code == 404
        assert UNKNOWN in refused.value.error and "cannot load" in refused.value.error
    reply = httpx.post(url_of(daemon) + "/api/pull", json={"model": UNKNOWN, "stream": False})
    assert reply.status_code == 404 and set(reply.json()) == {"error"}


def test_dashboard_lists_and_loads_models(daemon, model_name) -> None:
    url = url_of(daemon)
    listing = httpx.get(url + "/meshd/models").json()
    assert model_name in [m["name"] for m in listing["models"]], listing
    reply = httpx.post(url + "/meshd/load", json={"model": model_name})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == model_name
    assert "re-planning" in reply.json()["message"]
    daemon.wait_for(serves(model_name), 60, f"a plan serving {model_name}")
    assert httpx.get(url + "/meshd/models").json()["selected"] == model_name


def test_dashboard_load_errors_are_words_and_writes_stay_guarded(daemon) -> None:
    url = url_of(daemon)
    reply = httpx.post(url + "/meshd/load", json={"model": UNKNOWN})
    assert reply.status_code == 404
    message = reply.json()["error"]["message"]
    assert UNKNOWN in message and "cannot load" in message, message
    reply = httpx.post(url + "/meshd/load", json={"model": " "})
    assert reply.status_code == 400 and "name a model" in reply.json()["error"]["message"]
    # Another site's page, or a plain form post, cannot switch the mesh's model.
    foreign = {"Origin": "http://evil.example"}
    reply = httpx.post(url + "/meshd/load", json={"model": UNKNOWN}, headers=foreign)
    assert reply.status_code == 403
    reply = httpx.post(url + "/api/pull", json={"model": UNKNOWN}, headers=foreign)
    assert reply.status_code == 403
    reply = httpx.post(url + "/meshd/load", data={"model": UNKNOWN})
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]


def test_the_dashboards_picker_loads_and_shows_refusals_in_words(
    browser,  # noqa: F811  (the fixture of tests/test_dashboard_browser.py)
    daemon,
    model_name,
) -> None:
    """In a real browser: the picker suggests the store's models, an unknown name is refused
    in words on the page, a known one starts the mesh's re-plan."""
    browser.get(url_of(daemon) + "/")
    script = browser.execute_script
    options = "return [...document.querySelectorAll('#load-models option')].map(o => o.value)"
    wait_until(lambda: model_name in script(options), 15, f"{model_name} among the suggestions")
    field = browser.find_element("id", "load-input")
    field.send_keys(UNKNOWN)
    browser.find_element("id", "load-send").click()
    error = "return document.getElementById('load-error').textContent"
    shown = wait_until(lambda: script(error), 15, "the refusal")
    assert UNKNOWN in shown and "cannot load" in shown, shown
    field.clear()
    field.send_keys(model_name)
    browser.find_element("id", "load-send").click()
    note = "return document.getElementById('load-note').textContent"
    assert "re-planning for " + model_name in wait_until(lambda: script(note), 15, "the note")
    assert script(error) == ""


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.skipif(not olah_available(), reason="olah is not installed (install.sh --dev)")
def test_ollama_pull_of_a_hub_repository_downloads_and_serves_it(
    tmp_path: Path, profile_template: Path
) -> None:
    from tests.support.random_model import make_random_model_dir

    model = make_random_model_dir(
        tmp_path / "model", "llama", layers=4, hidden=128, heads=4, kv_heads=2
    )
    make_repo(tmp_path / "mirrors", REPO, model)
    hub = LocalHub(tmp_path / "mirrors", tmp_path / "olah", "127.0.0.1", free_loopback_port())
    state = tmp_path / "node"
    state.mkdir()
    shutil.copyfile(profile_template, state / profile_template.name)
    env = {
        "MESHD_MODEL_STORE": str(state / "store"),
        "HF_HUB_CACHE": str(state / "hf"),
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": "",
        "HF_HUB_OFFLINE": "0",
    }
    with hub:
        process = DaemonProcess(state, [*LOOPBACK, "--context-length", "256"], env=env)
        try:
            process.start().wait_for(lambda s: bool(s.http_url), 60, "the HTTP server")
            client = ollama.Client(host=url_of(process))
            progress = list(client.pull(REPO, stream=True))
            statuses = [p.status for p in progress]
            assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
            status = process.status()
            assert status.agreement.model == REPO and status.transitions.active_plan_loaded
            assert hub.file_requests()["config.json"] >= 1  # it came from the server
            with pytest.raises(ollama.ResponseError) as refused:
                client.pull("test-org/not-on-this-hub")
            # As the gRPC LoadModel: a repository the Hub does not have is not runnable (400).
            assert refused.value.status_code == 400, refused.value.error
            assert "no repository test-org/not-on-this-hub" in refused.value.error
        finally:
            process.kill()
