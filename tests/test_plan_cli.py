"""`meshd plan` end to end: mesh files, model directories and model spec files, output formats."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.nn as nn
import pytest
from mlx_lm.utils import save_model

from meshd.api.plan_cli import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_REFUSED,
    PlanInputError,
    add_plan_arguments,
    load_mesh_json,
    load_model_spec_json,
    parse_latency_s,
    render_plan_table,
    run_plan,
)
from partitioner import LAYOUTS, Plan, PlanOptions, plan_model
from tests.support.random_model import build_model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "meshes"
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
EXAMPLE_MODELS = {
    "two-studios-laptop.json": "model-llama-3.1-405b-4bit.json",
    "exo-16-8-8.json": "model-llama-3.1-8b-8bit.json",
    "weak-device.json": "model-llama-3.1-70b-4bit.json",
    "tb5-pair-ethernet.json": "model-llama-3.1-70b-8bit.json",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    model: nn.Module = build_model(CONFIG)
    save_model(path, model)
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def write_mesh(path: Path, budgets: dict[str, str]) -> Path:
    nodes = [
        {"id": node, "memory_budget": size, "flops": "1TFLOPS", "mem_bandwidth": "100GB/s"}
        for node, size in budgets.items()
    ]
    mesh = {"nodes": nodes, "default_link": {"latency_ms": 0.5, "bandwidth": "1Gbit/s"}}
    path.write_text(json.dumps(mesh))
    return path


def run(*argv: str, **extra: Any) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args(list(argv))
    for key, value in extra.items():
        setattr(args, key, value)
    out, err = io.StringIO(), io.StringIO()
    code = run_plan(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_plan_from_a_mesh_file_and_a_model_directory(tmp_path: Path, model_dir: Path) -> None:
    mesh = write_mesh(tmp_path / "mesh.json", {"big": "200MiB", "small": "100MiB"})
    code, out, err = run("--mesh", str(mesh), "--model", str(model_dir))
    assert (code, err) == (EXIT_OK, "")
    lines = out.splitlines()
    assert lines[0].startswith("plan ") and "strategy speed" in lines[0]
    assert lines[1].split() == [
        "stage",
        "node",
        "layers",
        "memory",
        "used",
        "/",
        "usable",
        "ms/token",
    ]
    assert lines[2].split()[:3] == ["0", "big", "0-3"]
    assert any(line.startswith("total") and "4 layers" in line for line in lines)
    assert "tokens/s" in out and "left out: small" in out


def test_both_strategies_side_by_side(tmp_path: Path, model_dir: Path) -> None:
    mesh = write_mesh(tmp_path / "mesh.json", {"a": "100MiB", "b": "100MiB"})
    code, out, _ = run("--mesh", str(mesh), "--model", str(model_dir), "--strategy", "both")
    assert code == EXIT_OK
    assert "strategy speed" in out and "strategy memory" in out
    assert "comparison (single-request decode, predicted):" in out
    assert "as fast as memory per token" in out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line[:1].isalpha()}
    assert rows["solo"] == "solo" and rows["pipeline"] == "pipeline"
    assert rows["tensor"] == "-" and "tensor: architecture" not in out  # llama can shard
    assert (
        "  tensor: tensor parallelism needs a group of 2 nodes joined by links marked "
        "trusted in both directions (tensor-parallel traffic is unencrypted); none of the 2 "
        "nodes with usable memory are; join them by a point-to-point link"
    ) in out


def test_json_output_is_a_plan(tmp_path: Path, model_dir: Path) -> None:
    mesh = write_mesh(tmp_path / "mesh.json", {"a": "90MiB", "b": "90MiB", "c": "90MiB"})
    argv = ["--mesh", str(mesh), "--model", str(model_dir), "--json", "--strategy", "memory"]
    code, out, _ = run(*argv, "--context", "128", "--exclude", "c")
    assert code == EXIT_OK
    plan = Plan.from_dict(json.loads(out))
    assert [stage.nodes for stage in plan.stages] == [("a",), ("b",)]
    assert plan.context_length == 128
    assert [entry.node for entry in plan.left_out] == ["c"]
    code, out, _ = run(
        "--mesh", str(mesh), "--model", str(model_dir), "--json", "--strategy", "both"
    )
    outcomes = json.loads(out)
    assert set(outcomes) == {"speed", "memory"} | {f"layout:{k}" for k in LAYOUTS}
    assert outcomes["layout:tensor"]["error"] == "parallelism_unavailable"
    assert Plan.from_dict(outcomes["layout:pipeline"]).layout == "pipeline"


def test_refusal_exits_1_and_explains(tmp_path: Path, model_dir: Path) -> None:
    mesh = write_mesh(tmp_path / "mesh.json", {"a": "50MiB"})
    code, out, err = run("--mesh", str(mesh), "--model", str(model_dir))
    assert code == EXIT_REFUSED and out == ""
    assert err.startswith("not enough memory in this mesh for")
    code, out, _ = run("--mesh", str(mesh), "--model", str(model_dir), "--json")
    assert code == EXIT_REFUSED and json.loads(out)["error"] == "insufficient_memory"


def test_bad_inputs_exit_2_with_a_reason(tmp_path: Path, model_dir: Path) -> None:
    code, _, err = run("--mesh", str(tmp_path / "none.json"), "--model", str(model_dir))
    assert code == EXIT_BAD_INPUT and "cannot read mesh file" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nodes": [{"id": "a", "memory": "1GB"}]}))
    code, _, err = run("--mesh", str(bad), "--model", str(model_dir))
    assert code == EXIT_BAD_INPUT and "unknown key(s) ['memory']" in err
    code, _, err = run("--mesh", str(bad), "--model", str(tmp_path))
    assert code == EXIT_BAD_INPUT


def test_live_view_without_a_daemon_is_a_clear_error(model_dir: Path) -> None:
    code, _, err = run("--model", str(model_dir))
    assert code == EXIT_BAD_INPUT and "--mesh FILE.json" in err
    code, _, err = run("--model", str(model_dir), api="127.0.0.1:9")
    assert code == EXIT_BAD_INPUT and "--mesh FILE.json" in err


def test_mesh_files_read_human_units_and_name_the_bad_field(tmp_path: Path) -> None:
    """Mesh files use the one quantity parser of flags and config (partitioner.humanize)."""
    mesh = load_mesh_json(write_mesh(tmp_path / "mesh.json", {"a": "16G", "b": "16 GiB"}))
    assert mesh.nodes["a"]["memory_budget"] == 16 * 10**9
    assert mesh.nodes["b"]["memory_budget"] == 16 * 2**30
    assert mesh.nodes["a"]["flops"] == 1e12 and mesh.nodes["a"]["mem_bandwidth"] == 100e9
    assert parse_latency_s({"latency": "300us"}) == pytest.approx(300e-6)
    assert parse_latency_s({"latency_ms": 2}) == pytest.approx(2e-3)
    with pytest.raises(PlanInputError, match=r"nodes\[0\]: memory_budget: cannot read '16XB'"):
        load_mesh_json(write_mesh(tmp_path / "bad.json", {"a": "16XB"}))
    with pytest.raises(PlanInputError, match="link: latency: cannot read '3 parsecs'"):
        parse_latency_s({"latency": "3 parsecs"})


@pytest.mark.parametrize("mesh_file", sorted(EXAMPLE_MODELS))
def test_example_meshes_plan_and_speed_beats_memory(mesh_file: str) -> None:
    mesh = load_mesh_json(EXAMPLES / mesh_file)
    model = load_model_spec_json(EXAMPLES / EXAMPLE_MODELS[mesh_file])
    speed = plan_model(mesh, model)
    memory = plan_model(mesh, model, PlanOptions(strategy="memory"))
    assert speed.prediction.decode_s_per_token <= memory.prediction.decode_s_per_token
    assert "total" in render_plan_table(speed, mesh)


def test_example_cases_show_what_they_promise() -> None:
    exo = load_mesh_json(EXAMPLES / "exo-16-8-8.json")
    small = load_model_spec_json(EXAMPLES / "model-llama-3.1-8b-8bit.json")
    memory = plan_model(exo, small, PlanOptions(strategy="memory"))
    assert [stage.num_layers for stage in memory.stages] == [16, 8, 8]
    weak = load_mesh_json(EXAMPLES / "weak-device.json")
    model = load_model_spec_json(EXAMPLES / "model-llama-3.1-70b-4bit.json")
    assert {"pi", "old-laptop"} <= {entry.node for entry in plan_model(weak, model).left_out}
    tb5 = load_mesh_json(EXAMPLES / "tb5-pair-ethernet.json")
    big = load_model_spec_json(EXAMPLES / "model-llama-3.1-70b-8bit.json")
    grouped = plan_model(tb5, big)
    assert grouped.stages[0].nodes == ("max-a", "max-b") and grouped.layout == "tensor"
    piped = plan_model(tb5, big, PlanOptions(parallelism="pipeline"))
    assert grouped.prediction.tokens_per_s > piped.prediction.tokens_per_s


def test_run_plan_in_a_fresh_process(tmp_path: Path, model_dir: Path) -> None:
    mesh = write_mesh(tmp_path / "mesh.json", {"a": "100MiB", "b": "100MiB"})
    script = (
        "import argparse, sys\n"
        "from meshd.api.plan_cli import add_plan_arguments, run_plan\n"
        "parser = argparse.ArgumentParser()\n"
        "add_plan_arguments(parser)\n"
        "sys.exit(run_plan(parser.parse_args(sys.argv[1:])))\n"
    )
    argv = ["--mesh", str(mesh), "--model", str(model_dir), "--json"]
    done = subprocess.run(
        [sys.executable, "-c", script, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["num_layers"] == 4


def test_config_only_moe_directory_plans_with_its_experts_placed() -> None:
    models, meshes = ROOT / "examples" / "models", ROOT / "examples" / "meshes"
    argv = ["--mesh", str(meshes / "m3-ultra-x4-tb5-rdma.json"), "--context", "8192"]
    code, out, err = run(*argv, "--model", str(models / "qwen3-235b-a22b-instruct-2507-8bit"))
    assert (code, err) == (EXIT_OK, "")
    assert "layout tensor" in out and "[TP]" in out
    assert "experts of stage 0 (each of its 94 MoE layers): studio-1" in out and "(32)" in out
    code, out, err = run(
        *argv,
        "--model",
        str(models / "qwen3-next-80b-a3b-instruct-8bit"),
        "--parallelism",
        "tensor",
    )
    assert (code, err) == (EXIT_OK, "")  # what serves instead, and why
    assert (
        "layout solo" in out
        and (
            "note: tensor parallelism is not available for architecture qwen3_next, whose mlx-lm "
            "shard(group) meshd has not verified on pipeline stages (docs/architectures.md lists "
            "the architectures it has): serving one node alone instead; use --parallelism "
            "pipeline or auto"
        )
        in out
    )
    code, out, _ = run(
        *argv, "--model", str(models / "deepseek-v3-8bit"), "--parallelism", "hybrid", "--json"
    )
    assert code == EXIT_OK and Plan.from_dict(json.loads(out)).layout == "hybrid"


def test_mesh_file_trusted_links_and_collective_overhead(tmp_path: Path) -> None:
    mesh = {
        "nodes": [
            {
                "id": "a",
                "memory_budget": "1GB",
                "flops": "1TFLOPS",
                "mem_bandwidth": "100GB/s",
                "collective_overhead": "40us",
            },
            {"id": "b", "memory_budget": "1GB", "flops": "1TFLOPS", "mem_bandwidth": "100GB/s"},
        ],
        "links": [
            {"src": "a", "dst": "b", "latency": "5us", "bandwidth": "75Gbit/s", "trusted": True}
        ],
    }
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps(mesh))
    graph = load_mesh_json(path)
    assert graph.edges["a", "b"]["trusted"] and graph.edges["b", "a"]["trusted"]
    assert graph.nodes["a"]["collective_overhead_s"] == pytest.approx(40e-6)
    mesh["links"][0]["trusted"] = "yes"
    path.write_text(json.dumps(mesh))
    with pytest.raises(PlanInputError, match="trusted must be true or false"):
        load_mesh_json(path)


def test_a_forced_layout_that_cannot_run_prints_the_plan_that_serves_and_why(
    tmp_path: Path, model_dir: Path
) -> None:
    """One node left of a tensor-parallel pair: the plan serves on it alone and says what is
    missing, in the text and in the JSON the daemon reports too (its plan_json)."""
    mesh = write_mesh(tmp_path / "mesh.json", {"a": "200MiB"})
    argv = ["--mesh", str(mesh), "--model", str(model_dir), "--parallelism", "tensor"]
    code, out, err = run(*argv)
    assert (code, err) == (EXIT_OK, "")
    lines = out.splitlines()
    assert "layout solo" in lines[0]
    assert lines[1] == (
        "note: tensor parallelism needs 2 nodes with a trusted link; 1 left: serving one node "
        "alone instead; add a node joined to it by a trusted link, such as a Thunderbolt or "
        "direct cable, or use --parallelism auto"
    )
    code, out, _ = run(*argv, "--json")
    assert code == EXIT_OK and Plan.from_dict(json.loads(out)).note == lines[1][len("note: ") :]


def test_min_gain_flag(tmp_path: Path, model_dir: Path) -> None:
    """Two equal nodes that each hold the model: one serves unless the margin is 0 and the
    pair is predicted faster; a bad value is refused with what to type."""
    mesh = write_mesh(tmp_path / "mesh.json", {"a": "200MiB", "b": "200MiB"})
    code, out, _ = run("--mesh", str(mesh), "--model", str(model_dir), "--json")
    assert code == EXIT_OK and len(Plan.from_dict(json.loads(out)).nodes) == 1
    code, out, err = run("--mesh", str(mesh), "--model", str(model_dir), "--min-gain", "150%")
    assert code == EXIT_BAD_INPUT and "--min-gain" in err and "from 0 to 1" in err
    code, _, err = run("--mesh", str(mesh), "--model", str(model_dir), "--min-gain", "5%")
    assert (code, err) == (EXIT_OK, "")
