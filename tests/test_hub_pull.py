"""`meshd pull` and `meshd models rm` against a real Hub-compatible server (olah) on loopback.

The server serves a git repository of a small random multi-file model, offline; the CLI runs
as the user runs it, with HF_ENDPOINT pointed at the server and HF_HUB_CACHE in a temp folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.local_hub import LocalHub, make_repo, olah_available
from tests.support.ports import free_ports
from tests.support.random_model import make_random_model_dir

pytestmark = pytest.mark.skipif(
    not olah_available(), reason="olah is not installed (packaging/install.sh --dev installs it)"
)
REPO = "test-org/tiny-llama"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hub")
    model = make_random_model_dir(
        root / "model", "llama", layers=4, hidden=64, heads=4, kv_heads=2, max_shard_bytes=200_000
    )
    commit = make_repo(root / "mirrors", REPO, model)
    (port,) = free_ports(1)
    with LocalHub(root / "mirrors", root / "olah", "127.0.0.1", port) as server:
        server.commit = commit  # type: ignore[attr-defined]
        server.model = model  # type: ignore[attr-defined]
        yield server


def _meshd(args: list[str], home: Path, hub: LocalHub) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HUB_CACHE": str(home / "hf"),
        "HF_TOKEN": "",
        "MESHD_MODEL_STORE": str(home / "store"),
        "MESHD_STATE_DIR": str(home / "state"),
        "NO_PROXY": "*",
    }
    command = [sys.executable, "-m", "meshd.api.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_pull_fetches_the_repo_into_the_hf_cache_once(hub: LocalHub, tmp_path: Path) -> None:
    before = hub.file_requests()
    pulled = _meshd(["pull", REPO], tmp_path, hub)
    assert pulled.returncode == 0, pulled.stderr
    snapshot = tmp_path / "hf" / "models--test-org--tiny-llama" / "snapshots" / hub.commit
    for item in hub.model.iterdir():
        assert (snapshot / item.name).read_bytes() == item.read_bytes(), item.name
    assert (tmp_path / "hf" / "models--test-org--tiny-llama" / "refs" / "main").read_text() == (
        hub.commit
    )
    assert "B/s" in pulled.stderr  # the progress bar: bytes, rate, time left
    got = hub.file_requests() - before
    assert set(got.values()) == {1} and len(got) == len(list(hub.model.iterdir()))

    again = _meshd(["pull", REPO], tmp_path, hub)  # complete: nothing is downloaded again
    assert again.returncode == 0, again.stderr
    assert hub.file_requests() - before == got

    import huggingface_hub

    info = huggingface_hub.scan_cache_dir(tmp_path / "hf")  # the HF tools read what we wrote
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.size_on_disk > 0

    removed = _meshd(["models", "rm", REPO], tmp_path, hub)
    assert removed.returncode == 0, removed.stderr
    assert not snapshot.exists()


def test_pull_resumes_a_partial_file_and_refetches_a_damaged_one(
    hub: LocalHub, tmp_path: Path
) -> None:
    assert _meshd(["pull", REPO], tmp_path, hub).returncode == 0
    snapshot = tmp_path / "hf" / "models--test-org--tiny-llama" / "snapshots" / hub.commit
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    blob = (snapshot / first).resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte
    blob.write_bytes(bytes(data))
    (blob.parent / (blob.name + ".meshd-verified")).unlink(missing_ok=True)
    before = hub.file_requests()
    again = _meshd(["pull", REPO], tmp_path, hub)
    assert again.returncode == 0, again.stderr
    assert (snapshot / first).read_bytes() == (hub.model / first).read_bytes()
    assert (hub.file_requests() - before) == {first: 1}


def test_pull_names_a_missing_repository(hub: LocalHub, tmp_path: Path) -> None:
    result = _meshd(["pull", "test-org/no-such-model"], tmp_path, hub)
    assert result.returncode == 2
    assert "no repository test-org/no-such-model" in result.stderr
