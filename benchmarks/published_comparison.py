"""The cost model's predictions for published multi-Mac setups, next to the published numbers.

Each row plans a real model configuration (examples/models) over a mesh describing the
hardware (examples/meshes) with the layout the publication used, and prints the predicted
single-request decode speed beside the published one. Two constants per kind of machine are
calibrated, each on one published row, and documented in the mesh files: the decode memory
bandwidth an M3 Ultra (exo, Qwen3-235B, 1 node) and an M5 Max (exo #2070, gpt-oss-120b,
1 machine) achieve, and the per-all-reduce overhead of MLX on Apple silicon (exo, Qwen3-235B,
2 and 4 nodes). Everything else is a prediction. docs/models.md discusses the rows that differ.

Sources of the published figures: exo's README benchmark charts (Jeff Geerling, "15 TB VRAM on
Mac Studio - RDMA over Thunderbolt 5"; exo Tensor/RDMA vs llama.cpp RPC/TCP on 1, 2 and 4
M3 Ultra 512 GB) and exo #2070 (two M5 Max 128 GB, Thunderbolt 5).

Run: .venv/bin/python benchmarks/published_comparison.py
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

# isort: split
from meshd.api.plan_cli import load_mesh_json
from meshd.models.info import read_model_spec
from partitioner import PlanOptions, plan_alternatives, plan_model

ROOT = Path(__file__).resolve().parents[1]
MODELS, MESHES = ROOT / "examples" / "models", ROOT / "examples" / "meshes"
CONTEXT = 8192  # decode speed does not depend on it; it only sizes the reserved KV cache


@dataclass(frozen=True)
class Row:
    setup: str
    model: str
    mesh: str
    layout: str  # solo | tensor | memory (llama.cpp's proportional pipeline) | pipeline
    published: float
    note: str = ""


ROWS = (
    Row(
        "exo, 1 M3 Ultra",
        "qwen3-235b-a22b-instruct-2507-8bit",
        "m3-ultra-x2-tb5-rdma",
        "solo",
        19.5,
        "calibration",
    ),
    Row(
        "exo TP, 2 x RDMA",
        "qwen3-235b-a22b-instruct-2507-8bit",
        "m3-ultra-x2-tb5-rdma",
        "tensor",
        26.2,
        "calibration",
    ),
    Row(
        "exo TP, 4 x RDMA",
        "qwen3-235b-a22b-instruct-2507-8bit",
        "m3-ultra-x4-tb5-rdma",
        "tensor",
        31.9,
        "calibration",
    ),
    Row(
        "llama.cpp, 1 M3 Ultra",
        "qwen3-235b-a22b-instruct-2507-8bit",
        "m3-ultra-x2-tb5-tcp",
        "solo",
        20.4,
    ),
    Row(
        "llama.cpp RPC, 2 x TCP",
        "qwen3-235b-a22b-instruct-2507-8bit",
        "m3-ultra-x2-tb5-tcp",
        "memory",
        17.2,
    ),
    Row(
        "llama.cpp RPC, 4 x TCP",
        "qwen3-235b-a22b-instruct-2507-8bit",
        "m3-ultra-x4-tb5-tcp",
        "memory",
        15.2,
    ),
    Row(
        "exo, 1 M3 Ultra",
        "deepseek-v3-4bit",
        "m3-ultra-x2-tb5-rdma",
        "solo",
        21.1,
        "4-bit: 8-bit is 713 GB",
    ),
    Row("exo TP, 2 x RDMA", "deepseek-v3-4bit", "m3-ultra-x2-tb5-rdma", "tensor", 27.8),
    Row("exo TP, 4 x RDMA", "deepseek-v3-4bit", "m3-ultra-x4-tb5-rdma", "tensor", 32.5),
    Row("exo TP, 2 x RDMA", "deepseek-v3-8bit", "m3-ultra-x2-tb5-rdma", "tensor", 27.8, "if 8-bit"),
    Row("exo TP, 4 x RDMA", "deepseek-v3-8bit", "m3-ultra-x4-tb5-rdma", "tensor", 32.5, "if 8-bit"),
    Row("llama.cpp, 1 M3 Ultra", "deepseek-v3-4bit", "m3-ultra-x2-tb5-tcp", "solo", 14.8),
    Row("llama.cpp RPC, 2 x TCP", "deepseek-v3-4bit", "m3-ultra-x2-tb5-tcp", "memory", 16.0),
    Row("llama.cpp RPC, 4 x TCP", "deepseek-v3-4bit", "m3-ultra-x4-tb5-tcp", "memory", 14.6),
    Row(
        "exo, 1 M5 Max", "gpt-oss-120b-mxfp4-q8", "m5-max-x2-tb5-rdma", "solo", 89.0, "calibration"
    ),
    Row("exo pipeline, 2 x TCP", "gpt-oss-120b-mxfp4-q8", "m5-max-x2-tb5-tcp", "pipeline", 68.0),
    Row(
        "exo TP, 2 x RDMA", "gpt-oss-120b-mxfp4-q8", "m5-max-x2-tb5-rdma", "tensor", 48.0, "exo bug"
    ),
    Row("MLX TP, 2 x RDMA", "gpt-oss-120b-mxfp4-q8", "m5-max-x2-tb5-rdma", "tensor", 98.0),
)


def predict(row: Row) -> tuple[float, str]:
    """Predicted tokens/s of the row's layout and what `--parallelism auto` would choose."""
    model = read_model_spec(MODELS / row.model, context_length=CONTEXT)
    mesh = load_mesh_json(MESHES / f"{row.mesh}.json")
    options = PlanOptions(context_length=CONTEXT)
    auto = plan_model(mesh, model, options)
    if row.layout == "memory":
        plan = plan_model(mesh, model, PlanOptions(strategy="memory", context_length=CONTEXT))
    else:
        plan = plan_alternatives(mesh, model, options)[row.layout]  # type: ignore[assignment]
    chosen = f"{auto.layout} {auto.prediction.tokens_per_s:.1f}"
    return plan.prediction.tokens_per_s, chosen


def main() -> None:
    print(
        "| setup | model | published tok/s | predicted tok/s | predicted / published | auto picks |"
    )
    print("|---|---|---:|---:|---:|---|")
    for row in ROWS:
        predicted, chosen = predict(row)
        ratio = predicted / row.published
        note = f" ({row.note})" if row.note else ""
        print(
            f"| {row.setup}{note} | {row.model} | {row.published:.1f} | {predicted:.1f} | "
            f"{ratio:.2f} | {chosen} |"
        )


if __name__ == "__main__":
    main()
