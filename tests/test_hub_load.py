"""`meshd load ORG/NAME` on a mesh: each file comes over the internet once per mesh.

Three daemons in network namespaces, each with its own HF cache, and a real Hub-compatible
server (olah) in a fourth namespace on the same bridge, serving a random multi-file llama.
Two daemons reach the server; the third runs with HF_HUB_OFFLINE=1 and gets every file from
its peers. Checked: every node holds config, tokenizer and the weight files of its own stage,
plus those the rendezvous assignment gave it to download for others; the server sent each
weight file whole exactly once (the selecting node's reads of the safetensors headers, for
planning, are range requests and counted apart); the offline node never spoke to the
server; the mesh's greedy tokens and logits equal mlx-lm's on the whole model. Then the
offline node is killed, one of its files damaged (a flipped byte) and another cut back to a
partial file, and restarted: it fetches the damaged file again and resumes the partial one,
from its peers, and serves again.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from meshd.api import client
from meshd.api.launcher import DaemonProcess
from meshd.models import hub as h
from meshd.models.hub_share import assign_fetchers
from meshd.wire import pb
from tests.conftest import PROFILE_FILE
from tests.support.local_hub import LocalHub, make_repo, olah_available

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(
        not olah_available(),
        reason="olah is not installed (packaging/install.sh --dev installs it)",
    ),
]
REPO = "test-org/split-llama"
PROMPT = "hello mesh"
TOKENS = 8
LAYERS = 6
HUB_PORT = 8090
OFFLINE = 2  # the node without Hub access
# "GET /test-org/split-llama/resolve/<commit>/<file> HTTP/1.1" <status>, from <client ip>
_ACCESS = re.compile(
    r'(?P<ip>\d+\.\d+\.\d+\.\d+):\d+ - "(?P<method>GET|HEAD) /[^ ]*/resolve/[^/]+/(?P<path>[^ ?]+)'
    r'[^"]*" (?P<status>\d{3})'
)


@pytest.fixture
def hub_mesh(tmp_path: Path, netns_mesh):
    """Four namespaces on one bridge: olah in the last, serving the random model."""
    from tests.support.random_model import make_random_model_dir

    model = make_random_model_dir(
        tmp_path / "model",
        "llama",
        layers=LAYERS,
        hidden=128,
        heads=4,
        kv_heads=2,
        max_shard_bytes=300_000,
    )
    make_repo(tmp_path / "mirrors", REPO, model)
    mesh = netns_mesh(4)
    server = mesh.nodes[3]
    prefix = ["ip", "netns", "exec", server.ns]
    with LocalHub(tmp_path / "mirrors", tmp_path / "olah", server.ip, HUB_PORT, prefix) as hub:
        yield mesh, hub, model


def _daemon(tmp_path: Path, index: int, ns: str, hub: LocalHub, token: str, profile: Path):
    state = tmp_path / f"node{index}"
    state.mkdir(exist_ok=True)
    if not (state / PROFILE_FILE).exists():
        shutil.copyfile(profile, state / PROFILE_FILE)
    env = {
        "MESHD_MODEL_STORE": str(state / "store"),
        "HF_HUB_CACHE": str(state / "hf"),
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": "",
        "HF_HUB_OFFLINE": "1" if index == OFFLINE else "0",
    }
    args = ["--interface", "eth0", "--join", token, "--name", f"host{index}"]
    args += ["--strategy", "memory", "--context-length", "256"]
    return DaemonProcess(state, args, netns=ns, env=env).start()


def _serving(status: pb.MeshStatus) -> bool:
    return (
        bool(status.agreement.active_plan_id)
        and len(status.agreement.members) == 3
        and status.agreement.model == REPO
        and status.transitions.active_plan_loaded
    )


def _server_log(hub: LocalHub) -> list[re.Match[str]]:
    return list(_ACCESS.finditer(hub.log_path.read_text(errors="replace")))


def _snapshot(daemon: DaemonProcess) -> Path:
    (snapshot,) = (
        daemon.state_dir / "hf" / "models--test-org--split-llama" / "snapshots"
    ).iterdir()
    return snapshot


def _blob(daemon: DaemonProcess, entry: h.HubFile) -> Path:
    return _snapshot(daemon).parent.parent / "blobs" / entry.etag


def _generate_with_logits(daemon: DaemonProcess) -> tuple[list[int], list[np.ndarray]]:
    request = pb.GenerateRequest(
        prompt=PROMPT,
        sampling=pb.Sampling(max_tokens=TOKENS, temperature=0.0),
        return_logits=True,
    )
    tokens, logits = [], []
    for event in client.stream_generation(daemon.api, request, timeout_s=60):
        if event.HasField("token"):
            tokens.append(event.token.token_id)
            logits.append(np.frombuffer(event.token.logits, dtype="<f4"))
    return tokens, logits


def _mlx_lm_reference(model: Path) -> tuple[list[int], list[np.ndarray]]:
    from mlx_lm.utils import load

    from meshd.inference.sampling import SamplingParams
    from tests.support.dataplane_mesh import mlx_lm_reference

    _, tokenizer = load(str(model))
    prompt = list(tokenizer.encode(PROMPT))
    return mlx_lm_reference(model, prompt, SamplingParams(max_tokens=TOKENS, temperature=0.0))


def _expected_files(status: pb.MeshStatus, model: Path, hub_nodes: set[str]) -> dict[str, set]:
    """Each node -> config and tokenizer, its stage's weight files, and the files the
    rendezvous assignment gives it to download for others."""
    index = json.loads((model / h.INDEX_FILE).read_text())
    plan = json.loads(status.agreement.plan_json)
    needs: dict[str, set[str]] = {}
    for stage in plan["stages"]:
        files = h.files_for_stage(
            index["weight_map"],
            [],
            stage["layer_start"],
            stage["layer_end"],
            has_embedding=stage["layer_start"] == 0,
            has_head=stage["layer_end"] == LAYERS,
            tied=True,
        )
        for node in stage["nodes"]:
            needs[node] = files
    fetchers = assign_fetchers(needs, hub_nodes)
    metadata = {item.name for item in model.iterdir() if item.name in h.METADATA_FILES}
    return {
        node: metadata | files | {path for path, fetcher in fetchers.items() if fetcher == node}
        for node, files in needs.items()
    }


def test_each_file_comes_over_the_internet_once_per_mesh(
    tmp_path: Path, hub_mesh, mesh_token: str, profile_template: Path
) -> None:
    mesh, hub, model = hub_mesh
    daemons = [
        _daemon(tmp_path, i, mesh.nodes[i].ns, hub, mesh_token, profile_template) for i in range(3)
    ]
    try:
        for daemon in daemons:
            daemon.wait_for(lambda s: len(s.nodes) >= 3, 60, "three nodes")
        reply = client.load_model(daemons[0].api, pb.LoadModelRequest(model=REPO))
        assert reply.model == REPO
        # What the selecting node asked before its reply: the file list, config, index and
        # tokenizer, and each weight file's header (olah answers those range reads with 200
        # too, so they are told apart by time: the plan, and every download, comes after).
        planning = len(_server_log(hub))
        for daemon in daemons:
            daemon.wait_for(_serving, 60, "its stage of a 3-node plan of the repository loaded")

        tokens, logits = _generate_with_logits(daemons[1])
        want_tokens, want_logits = _mlx_lm_reference(model)
        assert tokens == want_tokens
        assert all(np.array_equal(a, b) for a, b in zip(logits, want_logits, strict=True))

        statuses = [daemon.status() for daemon in daemons]
        ids = [status.node_id for status in statuses]
        expected = _expected_files(statuses[0], model, hub_nodes={ids[0], ids[1]})
        for daemon, node in zip(daemons, ids, strict=True):
            snapshot = _snapshot(daemon)
            assert {item.name for item in snapshot.iterdir()} == expected[node], node
            assert not list((snapshot.parent.parent / "blobs").glob("*" + h.PARTIAL_SUFFIX))
        weights = set(json.loads((model / h.INDEX_FILE).read_text())["weight_map"].values())
        assert set().union(*expected.values()) >= weights
        needed_offline = expected[ids[OFFLINE]]
        assert needed_offline < set().union(*expected.values())  # it holds only its part

        log = _server_log(hub)
        headers = Counter(m["path"] for m in log[:planning] if m["path"] in weights)
        downloads = Counter(m["path"] for m in log[planning:] if m["method"] == "GET")
        assert downloads == Counter(weights), downloads  # each weight file once per mesh
        assert set(headers) == weights  # read by the selecting node alone, for the plan
        assert {m["ip"] for m in log[:planning]} == {mesh.nodes[0].ip}
        metadata = expected[ids[0]] - weights
        assert Counter(m["path"] for m in log[:planning] if m["path"] in metadata) == Counter(
            metadata
        )
        assert not [m for m in log if m["ip"] == mesh.nodes[OFFLINE].ip]

        listed = [m for m in client.list_models(daemons[OFFLINE].api).models if m.name == REPO]
        assert [(m.source, m.partial, m.revision) for m in listed] == [
            ("hf-cache", True, _snapshot(daemons[OFFLINE]).name)
        ]
        assert 0 < listed[0].size_bytes < listed[0].total_bytes

        # The offline node restarts with one file damaged and another cut short: both come
        # again from its peers (the damaged one whole, the other from where it stopped).
        offline = daemons[OFFLINE]
        offline.kill()
        manifest = h.load_manifest(offline.state_dir / "store", REPO, _snapshot(offline).name)
        assert manifest is not None
        own_weights = sorted(needed_offline & weights)
        damaged, cut = own_weights[0], own_weights[-1]
        blob = _blob(offline, manifest.files[damaged])
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        cut_blob = _blob(offline, manifest.files[cut])
        content = cut_blob.read_bytes()
        cut_blob.unlink()
        (_snapshot(offline) / cut).unlink()
        cut_blob.with_name(cut_blob.name + h.PARTIAL_SUFFIX).write_bytes(
            content[: len(content) // 3]
        )
        restarted = _daemon(
            tmp_path, OFFLINE, mesh.nodes[OFFLINE].ns, hub, mesh_token, profile_template
        )
        daemons[OFFLINE] = restarted
        restarted.wait_for(_serving, 60, "its stage loaded again after the restart")
        for path in (damaged, cut):
            data = (_snapshot(restarted) / path).read_bytes()
            assert hashlib.sha256(data).hexdigest() == manifest.files[path].sha256, path
        assert not [m for m in _server_log(hub) if m["ip"] == mesh.nodes[OFFLINE].ip]
        events = "\n".join(restarted.status().events)
        assert "from peers" in events, events
        assert _generate_with_logits(restarted)[0] == want_tokens
    finally:
        for daemon in daemons:
            daemon.kill()
