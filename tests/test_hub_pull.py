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

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not olah_available(),
        reason="olah is not installed (packaging/install.sh --dev installs it)",
    ),
]
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


def _in_process(hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """meshd.models.hub in this process, pointed at the server and a temp HF cache."""
    from huggingface_hub import constants

    from meshd.models import hub as hub_module

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # read at import: as HF_ENDPOINT does
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        hub.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("NO_PROXY", "*")
    return hub_module


def test_a_stage_downloads_only_its_files_after_a_header_only_spec(
    hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshd.models.info import read_model_spec

    h = _in_process(hub, tmp_path, monkeypatch)
    ref = h.RepoRef(REPO)
    manifest, spec_dir = h.prepare_selection(tmp_path / "store", tmp_path / "specs", ref)
    assert manifest.commit == hub.commit
    assert read_model_spec(spec_dir).layer_bytes == read_model_spec(hub.model).layer_bytes
    snapshot = h.snapshot_dir(REPO, hub.commit)
    assert not any(snapshot.glob("*.safetensors"))  # the spec needed no weights

    before = hub.file_requests()
    stage = h.StageRange(layer_start=2, layer_end=3)
    h.fetch_stage_files(tmp_path / "store", h.hub_path(REPO, hub.commit), stage, "n1")
    index = json.loads((hub.model / "model.safetensors.index.json").read_text())
    wanted = {f for name, f in index["weight_map"].items() if ".layers.2." in name}
    assert {p.name for p in snapshot.glob("*.safetensors")} == wanted
    assert set(hub.file_requests() - before) == wanted
    for name in wanted:
        assert (snapshot / name).read_bytes() == (hub.model / name).read_bytes()


def test_a_stage_that_does_not_fit_the_disk_is_refused_before_downloading(
    hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil as shutil_module

    h = _in_process(hub, tmp_path, monkeypatch)
    h.prepare_selection(tmp_path / "store", tmp_path / "specs", h.RepoRef(REPO))
    real = shutil_module.disk_usage
    monkeypatch.setattr(
        h.shutil, "disk_usage", lambda path: real(path)._replace(free=1000)
    )  # a full disk, as the file system reports it
    before = hub.file_requests()
    with pytest.raises(h.HubError, match=r"node n1 needs .* GB more .* only 0\.00 GB are free"):
        h.fetch_stage_files(
            tmp_path / "store", h.hub_path(REPO, hub.commit), h.StageRange(0, 4, True, True), "n1"
        )
    assert hub.file_requests() == before
