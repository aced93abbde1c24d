"""benchmarks/gpu_check.py works before GPU time is spent on it: its --cpu-smoke run of the
device and exactness sections on this CPU (tiny random models built with mlx-lm's classes:
a bfloat16 llama and a mixture of experts, split over two in-process data-plane nodes) writes
its JSON, chooses the CPU with the reason, and matches mlx-lm's tokens and logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def test_the_cpu_smoke_run_chooses_the_cpu_and_matches_mlx_lm(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--sections", "device,exactness",
         "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["mode"] == "cpu-smoke" and results["all_ran"]
    device = results["sections"]["device"]
    assert device["device"] == "cpu" and device["choice"] == "cpu: no GPU reported by MLX"
    assert set(device["tflops"]) >= {"float32", "float16", "bfloat16", "q4/bfloat16"}
    models = results["sections"]["exactness"]["models"]
    assert {m["model"] for m in models} == {"llama-tiny", "qwen3-moe"}
    for model in models:
        assert model["tokens_equal"] and model["steps_compared"] == model["tokens"] > 0
        assert model["max_abs_logit_diff"] <= model["tolerance"], model
