"""A node without the model fetches only its own layers from a peer and serves them.

Daemon A starts with a model directory; daemon B has no copy. When the mesh commits a
plan that gives B a stage, B asks A for exactly its part over the mutual-TLS channel:
its layers' tensors, the config and the tokenizer - never the rest of the model.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from meshd.api import client
from meshd.models.safetensors import safetensors_tensor_names
from meshd.models.share import STALE_STAGING_S, mark_used, prune_parts
from meshd.wire import pb
from tests.support.random_model import make_random_model_dir

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]


def holder_and_fetcher(daemons, mesh_token, model_dir: Path) -> tuple[list[str], Any, Any]:
    """Daemon arguments, a daemon started with a random 6-layer llama, and one without it."""
    make_random_model_dir(model_dir, "llama", layers=6, hidden=128, heads=4, kv_heads=2)
    common = [*LOOPBACK, "--join", mesh_token, "--strategy", "memory", "--context-length", "256"]
    return common, daemons([*common, "--model", str(model_dir)]), daemons(common)


def test_a_node_without_the_model_fetches_only_its_layers(daemons, mesh_token, tmp_path) -> None:
    _, holder, fetcher = holder_and_fetcher(daemons, mesh_token, tmp_path / "share-llama")
    for d in (holder, fetcher):
        d.wait_for(
            lambda s: bool(s.agreement.active_plan_id) and len(s.agreement.members) == 2,
            60,
            "a committed 2-node plan",
        )
    status = fetcher.status()
    plan = json.loads(status.agreement.plan_json)
    stage = next(s for s in plan["stages"] if status.node_id in s["nodes"])
    fetcher.wait_for(
        lambda s: any("fetched layers" in line for line in s.events), 60, "its layers fetched"
    )

    request = pb.GenerateRequest(prompt="hello", sampling=pb.Sampling(max_tokens=8))
    done = [e.done for e in client.stream_generation(fetcher.api, request) if e.HasField("done")]
    assert done and done[0].completion_tokens > 0

    parts = list((fetcher.state_dir / "parts").iterdir())
    assert len(parts) == 1
    names = [n for f in parts[0].glob("*.safetensors") for n in safetensors_tensor_names(f)]
    layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
    assert layers == set(range(stage["layer_start"], stage["layer_end"]))
    assert (parts[0] / "tokenizer.json").is_file() and (parts[0] / "config.json").is_file()
    assert not (fetcher.state_dir / "models" / "share-llama").exists()  # no full copy


def make_part(root, name: str, age_s: float) -> Path:
    part = root / name
    part.mkdir(parents=True)
    (part / "config.json").write_text("{}")
    stamp = time.time() - age_s
    os.utime(part, (stamp, stamp))
    return part


def test_parts_no_plan_uses_are_pruned_but_one_spare_is_kept(tmp_path) -> None:
    root = tmp_path / "parts"
    in_use = make_part(root, "m@d-0-3e", age_s=500)
    newest_spare = make_part(root, "m@d-3-6h", age_s=10)
    older = make_part(root, "m@d-0-2e", age_s=100)
    oldest = make_part(root, "m@d-2-4", age_s=200)
    fresh_staging = make_part(root, ".m@d-4-6h.abc", age_s=5)
    stale_staging = make_part(root, ".m@d-0-6eh.xyz", age_s=STALE_STAGING_S + 60)

    deleted = prune_parts(root, [in_use])

    assert sorted(deleted) == sorted([older, oldest, stale_staging])
    assert in_use.is_dir() and newest_spare.is_dir() and fresh_staging.is_dir()
    assert prune_parts(root, [in_use]) == []  # nothing more to do
    # Once its plan is gone, the part just used becomes the spare; the older spare goes.
    mark_used(in_use)
    assert prune_parts(root, []) == [newest_spare]
    assert prune_parts(root, [], spare=0) == [in_use]
    assert [p.name for p in root.iterdir()] == [fresh_staging.name]


def test_pruning_a_missing_parts_folder_does_nothing(tmp_path) -> None:
    assert prune_parts(tmp_path / "never-fetched", []) == []


def test_a_mesh_that_flips_back_reuses_the_kept_part(daemons, mesh_token, tmp_path) -> None:
    """2 -> 3 -> 2 nodes: the fetcher's first part is kept while unused and reused after."""
    common, holder, fetcher = holder_and_fetcher(daemons, mesh_token, tmp_path / "flip-llama")

    def members(n: int):
        return lambda s: bool(s.agreement.active_plan_id) and len(s.agreement.members) == n

    def serving_active(status) -> bool:
        ready = [e for e in status.events if "ready here" in e]
        return bool(ready) and f"plan {status.agreement.active_plan_id[:12]} ready" in ready[-1]

    for d in (holder, fetcher):
        d.wait_for(members(2), 60, "a committed 2-node plan")
    first = fetcher.wait_for(serving_active, 60, "its part loaded")
    third = daemons(common)
    for d in (holder, fetcher, third):
        d.wait_for(members(3), 60, "a committed 3-node plan")
    fetcher.wait_for(serving_active, 60, "its 3-node part loaded")
    os.killpg(third.pid, signal.SIGKILL)
    last = fetcher.wait_for(
        lambda s: members(2)(s) and serving_active(s), 60, "a 2-node plan serving again"
    )

    fetches = [e for e in last.events if "fetched layers" in e]
    if own_layers(last) == own_layers(first):
        assert len(fetches) == 2, fetches  # the first part, the 3-node part, not the first again
    parts = sorted(p.name for p in (fetcher.state_dir / "parts").iterdir())
    assert len(parts) <= 2, parts  # the one in use and at most one spare


def own_layers(status) -> tuple[int, int]:
    plan = json.loads(status.agreement.plan_json)
    stage = next(s for s in plan["stages"] if status.node_id in s["nodes"])
    return stage["layer_start"], stage["layer_end"]
