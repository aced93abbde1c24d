"""Plans price a model at its compute dtype: a GPU node's half-precision and 4-bit rates, a CPU
node's slow half precision, the float32 `flops` where a node measured nothing else.

The scenario is examples/meshes/gpu-server-two-studios.json: an H200 server (60 TFLOP/s in
float32, ~900 in half precision and 4-bit) and two Mac Studios. Also: the live path (node
states -> graph -> digest), and the tensor-parallel backend of a group on one CUDA host.
"""

from __future__ import annotations

import argparse
import copy
import io
from pathlib import Path

import pytest

from meshd.agreement.service import state_digest
from meshd.api.plan_cli import EXIT_OK, add_plan_arguments, load_mesh_json, load_model_spec_json
from meshd.api.plan_cli import run_plan as run_plan_cli
from meshd.inference.tensor_parallel.groups import group_backend
from meshd.mesh.graph import mesh_graph
from meshd.wire import pb
from partitioner import ModelSpec, PlanOptions, plan_model
from partitioner.mesh import MeshView
from partitioner.quantize import bucket_index

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "meshes"
GPU_MESH = EXAMPLES / "gpu-server-two-studios.json"
LLAMA_70B_8BIT = EXAMPLES / "model-llama-3.1-70b-8bit.json"


def _float32_only(mesh):
    """The same mesh as if nodes had measured float32 alone (what profiles carried before)."""
    stripped = copy.deepcopy(mesh)
    for node in stripped.nodes:
        stripped.nodes[node].pop("dtype_flops", None)
        stripped.nodes[node].pop("dtype_bandwidth", None)
    return stripped


def _layers_on(plan, node: str) -> int:
    return len(plan.node_layers(node))


def test_compute_keys_name_the_dtype_and_the_quantization() -> None:
    dense = ModelSpec.uniform("m", 2, 1000, dtype="bfloat16")
    assert dense.compute_key == "bfloat16"
    assert load_model_spec_json(LLAMA_70B_8BIT).compute_key == "q8/float16"


def test_a_node_is_priced_at_the_models_key_else_a_neighbour_else_flops() -> None:
    mesh = load_mesh_json(GPU_MESH)
    for key, flops, priced_as in (
        ("bfloat16", 900e12, "bfloat16"),
        ("float32", 60e12, "float32"),
        ("q4/float16", 900e12, "q4/float16"),
        ("q8/bfloat16", 900e12, "q4/bfloat16"),  # same dtype, measured at another width
        ("q8/float32", 60e12, "flops"),  # no quantized float32 figure: the float32 flops
    ):
        node = MeshView.from_graph(mesh, compute_key=key).nodes["gpu-server"]
        assert node.flops_bucket == bucket_index(flops), key
        assert node.priced_as == priced_as
    studio = MeshView.from_graph(mesh, compute_key="bfloat16").nodes["studio-1"]
    assert (studio.flops_bucket, studio.priced_as) == (bucket_index(28e12), "flops")


def test_half_precision_is_priced_at_the_gpus_half_precision_rate() -> None:
    """Llama 3.1 70B 8-bit (float16 scales), 16 sequences at once: decode steps of 8 rows are
    compute-bound at the GPU's 60 TFLOP/s float32 figure; at its half-precision rate they are
    not, so the plan priced by dtype predicts far more throughput for the same placement (the
    GPU alone: its per-layer overhead makes a split over the Macs slower either way)."""
    model = load_model_spec_json(LLAMA_70B_8BIT)
    mesh = load_mesh_json(GPU_MESH)
    options = PlanOptions(concurrency=16, context_length=8192)
    by_dtype = plan_model(mesh, model, options)
    by_float32 = plan_model(_float32_only(mesh), model, options)
    assert _layers_on(by_dtype, "gpu-server") == _layers_on(by_float32, "gpu-server")
    faster = (
        by_dtype.prediction.aggregate_tokens_per_s / by_float32.prediction.aggregate_tokens_per_s
    )
    assert faster > 1.3, faster
    assert by_dtype.layout == "solo" and by_dtype.nodes == ("gpu-server",)
    assert by_dtype.prediction.aggregate_tokens_per_s > by_float32.prediction.aggregate_tokens_per_s
    # The plan says what it priced each node at.
    assert by_dtype.compute_key == "q8/float16"
    assert [(p.node, p.source) for p in by_dtype.priced] == [("gpu-server", "q4/float16")]
    assert {p.source for p in by_float32.priced} == {"flops (no q8/float16 figure)"}


def test_a_cpu_nodes_slow_half_precision_sends_a_float16_model_to_the_gpu() -> None:
    """A CPU box whose float16 runs 20x slower than its float32 (as on the test machines)."""
    model = ModelSpec.uniform(
        "half", 32, 200_000_000, hidden_size=4096, dtype="float16", context_length=4096
    )
    mesh = load_mesh_json(GPU_MESH)
    for node in ("studio-1", "studio-2"):
        mesh.nodes[node]["dtype_flops"] = {"float32": 28e12, "float16": 1.4e12}
    options = PlanOptions(concurrency=16, context_length=4096, exclude=frozenset({"studio-2"}))
    mesh.nodes["gpu-server"]["memory_budget"] = 5 * 10**9  # holds part of the model only
    by_dtype = plan_model(mesh, model, options)
    by_float32 = plan_model(_float32_only(mesh), model, options)
    assert _layers_on(by_float32, "gpu-server") == 0  # the Mac alone, at float32 numbers
    assert _layers_on(by_dtype, "gpu-server") > 0
    sources = {p.node: p.source for p in by_dtype.priced}
    assert sources == {"studio-1": "float16", "gpu-server": "float16"}


def test_meshd_plan_explains_the_rates_it_priced(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args(
        ["--mesh", str(GPU_MESH), "--model-spec", str(LLAMA_70B_8BIT), "--concurrency", "16"]
    )
    out, err = io.StringIO(), io.StringIO()
    assert run_plan_cli(args, out=out, err=err) == EXIT_OK, err.getvalue()
    text = out.getvalue()
    assert "priced at q8/float16: gpu-server" in text
    assert "TFLOP/s, 3.57 TB/s (q4/float16)" in text  # bucketed rates, and their source


def _state(node: str, flops: float, dtype_flops: dict[str, float], **profile) -> pb.NodeState:
    message = pb.NodeProfile(
        node_id=node,
        name=node,
        memory_budget=16 * 2**30,
        flops=flops,
        mem_bandwidth=100e9,
        **profile,
    )
    message.dtype_flops.update(dtype_flops)
    message.dtype_bandwidth.update({key: 100e9 for key in dtype_flops})
    return pb.NodeState(profile=message)


def test_the_live_graph_carries_bucketed_rates_and_the_digest_follows_them() -> None:
    state = _state("gpu", 60e12, {"float32": 60e12, "bfloat16": 901e12})
    graph = mesh_graph([state])
    rates = graph.nodes["gpu"]["dtype_flops"]
    assert set(rates) == {"float32", "bfloat16"}
    assert rates["bfloat16"] == pytest.approx(901e12, rel=0.1)
    noise = _state("gpu", 60e12, {"float32": 60e12, "bfloat16": 902e12})
    assert state_digest(noise) == state_digest(state)  # within a bucket: same plan inputs
    faster = _state("gpu", 60e12, {"float32": 60e12, "bfloat16": 1800e12})
    assert state_digest(faster) != state_digest(state)
    older = _state("cpu", 60e12, {})
    assert "dtype_flops" not in mesh_graph([older]).nodes["cpu"]


def test_nccl_only_for_cuda_members_on_one_host() -> None:
    def member(node: str, fingerprint: str, device: str, backend: str) -> pb.NodeState:
        return _state(
            node, 1e12, {}, fingerprint=fingerprint, mlx_device=device, device_backend=backend
        )

    one_host = {
        "a": member("a", "host1", "gpu", "cuda"),
        "b": member("b", "host1", "gpu", "cuda"),
    }
    assert group_backend(["a", "b"], one_host) == "nccl"
    two_hosts = {**one_host, "b": member("b", "host2", "gpu", "cuda")}
    assert group_backend(["a", "b"], two_hosts) == "ring"
    with_a_cpu = {**one_host, "b": member("b", "host1", "cpu", "cpu")}
    assert group_backend(["a", "b"], with_a_cpu) == "ring"
    macs = {
        "a": member("a", "host1", "gpu", "metal"),
        "b": member("b", "host1", "gpu", "metal"),
    }
    assert group_backend(["a", "b"], macs) == "ring"
    assert group_backend(["a", "b"], {"a": one_host["a"]}) == "ring"  # a state not known yet
