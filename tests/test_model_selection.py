"""The mesh's model: a loaded model outlives the node that loaded it, and a node that starts
never switches a running mesh back to its own configured model.

The register's rule (`winning_selection`) is pure and checked first; then three daemons in
network namespaces: `meshd load` of a directory on one (the others fetch their parts from
it), a restart of another (its `--model` is the old model), `kill -9` of the loader and its
return, then of every node at once. The mesh runs the loaded model throughout: the survivors
keep the selection (and say why no node can send the parts a new plan needs), serve it again
once the loader is back, and after all restart (each kept it in its state directory).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from meshd.agreement.service import winning_selection
from meshd.api import client
from meshd.api.launcher import DaemonProcess
from meshd.wire import pb

pytestmark = pytest.mark.netns

PLAN_TIMEOUT_S = 60.0
MAX_TOKENS = 6


def selection(name: str, set_at: float, set_by: str, *, default: bool = False):
    return pb.ModelSelection(
        name=name, digest=name, set_at=set_at, set_by=set_by, startup_default=default
    )


def test_a_loaded_model_beats_every_startup_default_and_the_newest_load_wins() -> None:
    loaded = selection("moe", 100.0, "a")
    newer_default = selection("llama", 200.0, "c", default=True)
    assert winning_selection([newer_default, loaded]) == loaded
    newer_load = selection("qwen", 150.0, "b")
    assert winning_selection([loaded, newer_default, newer_load]) == newer_load
    tie = selection("phi", 150.0, "c")  # same instant: the larger node id, on every node
    assert winning_selection([newer_load, tie]) == tie
    assert winning_selection([]) is None and winning_selection([pb.ModelSelection()]) is None


def test_without_a_loaded_model_the_oldest_default_wins() -> None:
    """A node that starts (or restarts) later does not replace the model a mesh runs."""
    first = selection("llama", 100.0, "b", default=True)
    joined = selection("phi", 300.0, "a", default=True)
    assert winning_selection([joined, first]) == first
    assert winning_selection([joined]) == joined  # alone, its own default


def test_a_load_wins_even_where_this_nodes_clock_is_behind(two_models) -> None:
    """`meshd load` on a node whose clock is an hour behind the node that loaded the running
    model still replaces it: the new record is stamped after the one the mesh runs."""
    import partitioner
    from meshd.agreement.service import model_selection
    from meshd.models.info import read_model_spec

    _, loaded = two_models
    running = selection("llama", time.time() + 3600, "z")
    spec = read_model_spec(loaded)
    mine = model_selection(spec, partitioner.PlanOptions(), "a", after=running)
    assert mine.set_at > running.set_at and mine.digest == spec.digest()
    assert winning_selection([running, mine]) == mine


def test_the_kept_selection_reads_back_exactly_and_a_damaged_file_is_ignored(tmp_path) -> None:
    from meshd.agreement.remembered import (
        SELECTION_FILE,
        RememberedSelection,
        read_remembered,
        write_remembered,
    )

    assert read_remembered(tmp_path) is None  # nothing kept yet
    loaded = selection("moe", 1764680000.123456789, "a")
    loaded.spec_json, loaded.path = '{"num_layers": 4}', "/models/moe"
    write_remembered(tmp_path, RememberedSelection(loaded, "mesh-fingerprint"))
    again = read_remembered(tmp_path)
    assert again == RememberedSelection(loaded, "mesh-fingerprint")  # the stamp to the last bit
    for damaged in ("{not json", '{"selection": {"name": 7}}', '{"selection": {}}', "[]"):
        (tmp_path / SELECTION_FILE).write_text(damaged)
        assert read_remembered(tmp_path) is None
    newer = '{"mesh": "m", "selection": {"name": "moe", "setBy": "a", "addedLater": 1}}'
    (tmp_path / SELECTION_FILE).write_text(newer)  # written by a newer meshd: still read
    kept = read_remembered(tmp_path)
    assert kept is not None and kept.selection.name == "moe" and kept.mesh == "m"
    default = selection("llama", 1.0, "a", default=True)  # defaults come from the config
    write_remembered(tmp_path, RememberedSelection(default, "m"))
    assert read_remembered(tmp_path) is None


def test_a_loaded_model_is_kept_across_restarts_until_the_next_load(
    daemons, mesh_token, two_models, tmp_path
) -> None:
    """One node: `meshd load`, stop, start with another configured model: it runs the loaded
    model again (a configured model is a default, also across restarts) and says how to
    switch; `meshd load` switches. The state directory then joins another mesh: that mesh's
    node starts from its configured model, not from what the old mesh ran."""
    from meshd.mesh import security

    configured, loaded = two_models
    loopback = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
    args = [*loopback, "--context-length", "256"]
    state = tmp_path / "node"
    node = daemons([*args, "--join", mesh_token, "--model", str(configured)], state_dir=state)
    node.wait_for(serves(configured.name, 1), PLAN_TIMEOUT_S, "a plan of the configured model")
    client.load_model(node.api, pb.LoadModelRequest(model=str(loaded)))
    node.wait_for(serves(loaded.name, 1), PLAN_TIMEOUT_S, "a plan of the loaded model")
    assert node.terminate() == 0

    edited = shutil.copytree(configured, tmp_path / "llama-edited")
    node = daemons([*args, "--join", mesh_token, "--model", str(edited)], state_dir=state)
    node.wait_for(serves(loaded.name, 1), PLAN_TIMEOUT_S, "the loaded model after a restart")
    assert generated_model(node) == loaded.name
    events = node.status().events
    assert any("offering it again" in line for line in events), events
    assert any(f"meshd load {edited} switches" in line for line in events), events
    client.load_model(node.api, pb.LoadModelRequest(model=str(edited)))
    node.wait_for(serves(edited.name, 1), PLAN_TIMEOUT_S, "the model loaded after the restart")
    assert node.terminate() == 0

    other_mesh = security.encode_join_token(security.create_mesh_secret("another"))
    node = daemons([*args, "--join", other_mesh, "--model", str(configured)], state_dir=state)
    node.wait_for(serves(configured.name, 1), PLAN_TIMEOUT_S, "the configured model, new mesh")
    events = node.status().events
    assert any("kept from another mesh" in line for line in events), events


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The configured model and the one `meshd load` switches to (another name, other sizes)."""
    from tests.support.random_model import make_random_model_dir

    root = tmp_path_factory.mktemp("selection")
    shape = {"heads": 4, "kv_heads": 2, "vocab": 320, "max_shard_bytes": 200_000}
    configured = make_random_model_dir(root / "llama", "llama", layers=4, hidden=64, **shape)
    loaded = make_random_model_dir(
        root / "llama-loaded", "llama", layers=6, hidden=96, seed=3, **shape
    )
    return configured, loaded


def serves(model: str, members: int):
    """Predicate: the node runs a committed plan of `model` over `members` nodes."""

    def check(status: pb.MeshStatus) -> bool:
        view = status.agreement
        plan = json.loads(view.plan_json) if view.plan_json else {}
        return view.model == model and len(view.members) == members and bool(plan.get("stages"))

    return check


def generated_model(node: DaemonProcess, within_s: float = 30.0) -> str:
    """Generate a few greedy tokens from `node`; the model the final event names.

    A plan just committed may still be loading, or be tried again on a node whose first load
    failed (a peer that had not yet adopted the selection could not send a part): such a
    request ends at once saying so, and is asked again, within `within_s`."""
    request = pb.GenerateRequest(prompt="hello", sampling=pb.Sampling(max_tokens=MAX_TOKENS))
    deadline = time.monotonic() + within_s
    while True:
        try:
            events = list(client.stream_generation(node.api, request, timeout_s=60))
        except client.GenerationFailed as error:
            if "cannot serve plan" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            continue
        done = events[-1].done
        assert done.completion_tokens == MAX_TOKENS, events[-1]
        return done.model


def wait_until_loaded_or_explained(nodes: list[DaemonProcess]) -> None:
    """Each node loaded its part of the active plan, or one says why no node can send it."""
    deadline = time.monotonic() + PLAN_TIMEOUT_S
    while time.monotonic() < deadline:
        statuses = [node.status() for node in nodes]
        if any("which is gone" in line for s in statuses for line in s.events):
            return
        ready = [f"plan {s.agreement.active_plan_id[:12]} ready here" for s in statuses]
        if all(any(r in line for line in s.events) for r, s in zip(ready, statuses, strict=True)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"neither loaded nor explained: {[s.events[-4:] for s in statuses]}")


def test_a_loaded_model_survives_a_restart_and_the_loss_of_its_loader(
    daemons, netns_mesh, mesh_token, two_models
) -> None:
    configured, loaded = two_models
    mesh = netns_mesh(3)
    args = ["--interface", "eth0", "--join", mesh_token, "--model", str(configured)]
    args += ["--parallelism", "pipeline", "--context-length", "256"]
    nodes = [
        daemons([*args, "--name", f"host{i}"], netns=node.ns) for i, node in enumerate(mesh.nodes)
    ]
    for node in nodes:
        node.wait_for(serves(configured.name, 3), PLAN_TIMEOUT_S, "a plan of the configured model")

    # The loaded model is in the loader's directory only: the others fetch their parts.
    loader, restarted, witness = nodes
    client.load_model(loader.api, pb.LoadModelRequest(model=str(loaded)))
    for node in nodes:
        node.wait_for(serves(loaded.name, 3), PLAN_TIMEOUT_S, "a plan of the loaded model")

    # A restart offers the node's --model again, as a startup default: the mesh keeps its model.
    restarted.terminate()
    witness.wait_for(serves(loaded.name, 2), PLAN_TIMEOUT_S, "a plan without the restarted node")
    restarted.start()
    for node in nodes:
        node.wait_for(serves(loaded.name, 3), PLAN_TIMEOUT_S, "the loaded model after a restart")
    assert generated_model(witness) == loaded.name

    # The loader dies with the only full copy: the others keep its selection (they do not fall
    # back to their --model), and say why a plan that needs other parts cannot load.
    loader.kill()
    survivors = [restarted, witness]
    for node in survivors:
        node.wait_for(serves(loaded.name, 2), PLAN_TIMEOUT_S, "the loaded model kept")
    wait_until_loaded_or_explained(survivors)

    # The loader comes back with its copy: the mesh serves the loaded model on all three again.
    loader.start()
    for node in nodes:
        node.wait_for(serves(loaded.name, 3), PLAN_TIMEOUT_S, "the loaded model, loader back")
    assert generated_model(witness) == loaded.name

    # A power cut: every node stops, then all start again. Each kept the loaded model in its
    # state directory, so the mesh does not go back to the configured one.
    for node in nodes:
        node.kill()
    for node in nodes:
        node.start()
    for node in nodes:
        node.wait_for(serves(loaded.name, 3), PLAN_TIMEOUT_S, "the loaded model after a cut")
    assert generated_model(witness) == loaded.name
