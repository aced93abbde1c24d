"""API keys of the HTTP APIs: a daemon on a network address (inside a network namespace)
refuses to start without a key, answers 401 without or with a wrong key, and a key revoked
with the CLI stops working at once; plus the key store and the `http` setting themselves."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.api.launcher import DaemonProcess
from meshd.config import ConfigError, load_config
from meshd.http.address import parse_http_setting
from meshd.http.keys import ApiKeyError, ApiKeyStore

pytestmark = pytest.mark.netns

CLI = [sys.executable, "-m", "meshd.api.cli"]


def meshd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)


def test_a_network_address_needs_keys_and_a_revoked_key_fails_at_once(
    netns_mesh, tmp_path: Path, profile_template: Path
) -> None:
    node = netns_mesh(1).nodes[0]
    state = tmp_path / "node"
    state.mkdir()
    shutil.copyfile(profile_template, state / "profile.json")
    address = f"{node.ip}:52380"
    args = ["--interface", "eth0", "--no-mdns", "--http", address]

    refused = DaemonProcess(state, args, netns=node.ns).start()
    assert refused.proc is not None and refused.proc.wait(60) == 2
    assert "meshd api-key create" in refused.log_tail(), refused.log_tail()

    created = meshd("api-key", "create", "laptop", "--state-dir", str(state))
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("msk_") and key not in (state / "api_keys.json").read_text()
    daemon = DaemonProcess(state, args, netns=node.ns).start()
    try:
        daemon.wait_ready()

        def status_of(path: str, *headers: str) -> str:
            result = node.run(
                ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10",
                 *[part for h in headers for part in ("-H", h)], f"http://{address}{path}"],
                capture_output=True, text=True,
            )  # fmt: skip
            return result.stdout

        assert status_of("/v1/models") == "401"
        assert status_of("/api/tags") == "401"
        assert status_of("/v1/models", "Authorization: Bearer msk_wrong") == "401"
        assert status_of("/v1/models", f"Authorization: Bearer {key}") == "200"
        assert status_of("/v1/models", f"x-api-key: {key}") == "200"
        assert status_of("/") == "200"  # the page itself holds no data; it asks for a key
        assert status_of("/meshd/status") == "401"
        listed = meshd("api-key", "list", "--state-dir", str(state))
        assert "laptop" in listed.stdout and key not in listed.stdout
        revoked = meshd("api-key", "revoke", "laptop", "--state-dir", str(state))
        assert revoked.returncode == 0, revoked.stderr
        assert status_of("/v1/models", f"Authorization: Bearer {key}") == "401"
    finally:
        daemon.kill()


def test_key_store_round_trip(tmp_path: Path) -> None:
    store = ApiKeyStore(tmp_path)
    assert store.keys() == () and store.verify("msk_anything") is None
    entry, key = store.create("editor")
    assert store.verify(key) == entry and store.verify(key + "x") is None
    assert oct((tmp_path / "api_keys.json").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ApiKeyError, match="exists"):
        store.create("editor")
    other = ApiKeyStore(tmp_path)  # another process's view sees the same keys
    assert other.verify(key) == entry
    store.revoke(entry.key_id)
    assert other.verify(key) is None
    with pytest.raises(ApiKeyError, match="no API key"):
        store.revoke("editor")


def test_http_setting(tmp_path: Path) -> None:
    assert load_config({"state_dir": tmp_path}, env={}).http == "127.0.0.1:52380"
    env = {"MESHD_HTTP": "off"}
    assert load_config({"state_dir": tmp_path}, env=env).http == "off"
    assert load_config({"state_dir": tmp_path, "http": "[::1]:0"}, env=env).http == "[::1]:0"
    (tmp_path / "meshd.toml").write_text('http = "0.0.0.0:8080"\n')
    assert load_config({"state_dir": tmp_path}, env={}).http == "0.0.0.0:8080"
    for bad in ("52380", "example.com:80", "127.0.0.1:99999"):
        with pytest.raises(ConfigError, match="http"):
            load_config({"state_dir": tmp_path, "http": bad}, env={})
    assert parse_http_setting(" localhost:1 ") == "localhost:1"
