"""Predicted time per token of the `speed` strategy vs the `memory` baseline on example meshes.

Each example mesh in examples/meshes/ is planned with the model it was written for; the
TB5 pair (whose cable is trusted) is planned as a pipeline and with `parallelism` auto, which
may choose a tensor-parallel group. Predictions come from the cost model in
partitioner/cost.py (not from measurements).

Run: .venv/bin/python benchmarks/partitioner_compare.py [--concurrency N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshd.api.plan_cli import load_mesh_json, load_model_spec_json
from partitioner import Plan, PlanOptions, plan_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "meshes"
CASES = (  # mesh file, model spec file, parallelism
    ("exo-16-8-8.json", "model-llama-3.1-8b-8bit.json", "auto"),
    ("two-studios-laptop.json", "model-llama-3.1-405b-4bit.json", "auto"),
    ("weak-device.json", "model-llama-3.1-70b-4bit.json", "auto"),
    ("tb5-pair-ethernet.json", "model-llama-3.1-70b-8bit.json", "pipeline"),
    ("tb5-pair-ethernet.json", "model-llama-3.1-70b-8bit.json", "auto"),
)


def describe(plan: Plan) -> str:
    return " | ".join(f"{'+'.join(stage.nodes)}:{stage.num_layers}" for stage in plan.stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=1, help="sequences decoded at once")
    args = parser.parse_args()
    header = (
        f"{'mesh':<24} {'model':<30} {'kind':<8} {'memory ms':>10} {'speed ms':>9} "
        f"{'gain':>6}  speed plan (node:layers)"
    )
    print(header)
    print("-" * len(header))
    for mesh_file, model_file, parallelism in CASES:
        mesh = load_mesh_json(EXAMPLES / mesh_file)
        model = load_model_spec_json(EXAMPLES / model_file)
        options = PlanOptions(concurrency=args.concurrency, parallelism=parallelism)
        speed = plan_model(mesh, model, options)
        memory = plan_model(
            mesh, model, PlanOptions(strategy="memory", concurrency=args.concurrency)
        )
        memory_ms = memory.prediction.time_per_token_s * 1e3
        speed_ms = speed.prediction.time_per_token_s * 1e3
        print(
            f"{mesh_file.removesuffix('.json'):<24} {model.name:<30} "
            f"{parallelism:<8} {memory_ms:>10.1f} {speed_ms:>9.1f} "
            f"{memory_ms / speed_ms:>5.2f}x  {describe(speed)}"
        )


if __name__ == "__main__":
    main()
