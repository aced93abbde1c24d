"""A node without the model fetches only its own layers from a peer and serves them.

Daemon A starts with a model directory; daemon B has no copy. When the mesh commits a
plan that gives B a stage, B asks A for exactly its part over the mutual-TLS channel:
its layers' tensors, the config and the tokenizer - never the rest of the model.
"""

from __future__ import annotations

import json

from daemon import client
from daemon.random_model import make_random_model_dir
from daemon.shard import safetensors_tensor_names
from daemon.wire import pb

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]


def test_a_node_without_the_model_fetches_only_its_layers(daemons, mesh_token, tmp_path) -> None:
    model = make_random_model_dir(
        tmp_path / "share-llama", "llama", layers=6, hidden=128, heads=4, kv_heads=2
    )
    common = [*LOOPBACK, "--join", mesh_token, "--strategy", "memory", "--context-length", "256"]
    holder = daemons([*common, "--model", str(model)])
    fetcher = daemons(common)
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

    parts = list((fetcher.state_dir / "models" / "parts").iterdir())
    assert len(parts) == 1
    names = [n for f in parts[0].glob("*.safetensors") for n in safetensors_tensor_names(f)]
    layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
    assert layers == set(range(stage["layer_start"], stage["layer_end"]))
    assert (parts[0] / "tokenizer.json").is_file() and (parts[0] / "config.json").is_file()
    assert not (fetcher.state_dir / "models" / "share-llama").exists()  # no full copy
