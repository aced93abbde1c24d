"""Tensor-parallel stages of every verified architecture compute what one mlx-lm process does.

For each architecture in ``TENSOR_PARALLEL_ARCHITECTURES`` (dense: llama, mistral, a llama with
sliding-window layers, qwen2, qwen3; mixture-of-experts: qwen3_moe, deepseek_v3 with multi-head
latent attention and shared experts, gpt_oss with attention sinks and expert biases, glm4_moe), a
random float32 model runs over a 2-rank ``mx.distributed`` ring on loopback
(``tests/support/tp_probe.py``, one pair of processes for all of them) as:

* ``whole``: one TP=2 stage holding every layer, mlx-lm's even split (each rank a slice of every
  head, MLP column and expert);
* ``split``: two pipeline stages (layers 0-3 with the embedding, 3-6 with the head), each TP=2,
  and for MoE models the experts placed unevenly (rank 0 one expert, rank 1 the rest; one job
  with rank 0 holding none): expert parallelism as the planner places it;

and is compared with mlx-lm's own model: the prompt's logits at every position (40 tokens, longer
than the sliding window), then 12 greedy decode steps. Greedy tokens must be identical.

Bound: max |logit difference| <= 1e-4 x max |reference logit|. Tensor parallelism changes the
order of floating-point sums: each all-reduce adds the ranks' partial dot products (or expert
outputs) instead of one accumulation, so float32 rounding differs by a few units in the last
place per sum; through 6 layers that stays ~1e-6 of the logits' scale (measured on an AMD EPYC
with OpenBLAS: 8e-7 to 1.3e-6 for the dense models, 1.2e-6 to 1.8e-6 for the MoE ones). 1e-4
leaves room for other CPUs' kernels while a real mistake shows up far above it (experts placed
with their output bias halved: 0.57).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from meshd.inference.tensor_parallel.spec import TENSOR_PARALLEL_ARCHITECTURES
from tests.support.ports import free_ports
from tests.support.random_model import make_random_model_dir

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
RELATIVE_BOUND = 1e-4
PROMPT = [(index * 37 + 11) % 300 for index in range(40)]
STEPS = 12
PROBE_TIMEOUT_S = 240

# name -> (model source, uneven expert placement for the split job, or None for dense models)
MODELS: dict[str, tuple[str, tuple[tuple[int, int], ...] | None]] = {
    "llama": ("dense:llama", None),
    "qwen2": ("dense:qwen2", None),
    "qwen3": ("dense:qwen3", None),
    "mistral": ("tiny:mistral", None),
    "llama-sliding": ("tiny:llama-sliding", None),
    "qwen3_moe": ("tiny:qwen3_moe", ((0, 1), (1, 4))),
    "deepseek_v3": ("tiny:deepseek_v3", ((0, 3), (3, 8))),
    "gpt_oss": ("tiny:gpt_oss", ((0, 1), (1, 4))),
    "glm4_moe": ("tiny:glm4_moe", ((0, 1), (1, 4))),
}
JOBS = [f"{name}-whole" for name in MODELS] + [f"{name}-split" for name in MODELS]
JOBS.append("qwen3_moe-none-on-rank0")


def test_every_probed_architecture_is_verified_by_the_table() -> None:
    """What this file probes more deeply (expert placements, 6 layers) is in the measured
    table (meshd.models.architecture_table, tests/test_architecture_coverage.py)."""
    probed = {"mistral": "llama", "llama-sliding": "llama"}
    assert {probed.get(name, name) for name in MODELS} <= set(TENSOR_PARALLEL_ARCHITECTURES)


@pytest.fixture(scope="module")
def model_dirs(
    tmp_path_factory: pytest.TempPathFactory, architecture_dir: Callable[[str], Path]
) -> dict[str, Path]:
    dirs = {}
    for name, (source, _) in MODELS.items():
        kind, arch = source.split(":")
        if kind == "tiny":
            dirs[name] = architecture_dir(arch)
        else:
            dirs[name] = make_random_model_dir(
                tmp_path_factory.mktemp(arch) / arch,
                arch,  # type: ignore[arg-type]
                layers=6,
                hidden=64,
                heads=4,
                kv_heads=2,
                vocab=320,
                intermediate=128,
                tie_embeddings=arch != "qwen2",
                max_shard_bytes=100_000,
            )
    return dirs


@pytest.fixture(scope="module")
def probe_outputs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run every job over one 2-rank ring; the folder of rank 0's npz files."""
    folder = tmp_path_factory.mktemp("tp-probe")
    jobs = []
    for name, (_, experts) in MODELS.items():
        base = {"model_dir": str(model_dirs[name]), "prompt": PROMPT, "steps": STEPS}
        jobs.append({**base, "name": f"{name}-whole", "stages": [[0, 6]]})
        split = {**base, "name": f"{name}-split", "stages": [[0, 3], [3, 6]]}
        if experts:
            split["expert_ranges"] = [list(pair) for pair in experts]
        jobs.append(split)
    jobs.append(
        {
            "model_dir": str(model_dirs["qwen3_moe"]),
            "prompt": PROMPT,
            "steps": STEPS,
            "name": "qwen3_moe-none-on-rank0",
            "stages": [[0, 6]],
            "expert_ranges": [[0, 0], [0, 4]],
        }
    )
    (folder / "jobs.json").write_text(json.dumps(jobs))
    ports = free_ports(2)
    (folder / "hosts.json").write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.tp_probe", str(folder / "jobs.json"), folder],
            cwd=ROOT,
            env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(folder / "hosts.json")},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [process.communicate(timeout=PROBE_TIMEOUT_S)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()
    codes = [process.returncode for process in processes]
    assert codes == [0, 0], f"probe ranks exited {codes}:\n" + "\n---\n".join(outputs)
    return folder


def reference(model_dir: Path, tokens: list[int]) -> dict[str, np.ndarray]:
    """mlx-lm's own model: the prompt at once, then ``tokens[:-1]`` one at a time (teacher-forced
    with the probe's tokens, which the test first checks are mlx-lm's greedy choices)."""
    model, _ = load_model(model_dir)
    cache = make_prompt_cache(model)
    out = {"prefill": np.array(model(mx.array([PROMPT]), cache=cache))}
    for index, token in enumerate(tokens[:STEPS]):
        out[f"step{index}"] = np.array(model(mx.array([[token]]), cache=cache)[:, -1:, :])
    return out


@pytest.mark.parametrize("job", JOBS)
def test_tensor_parallel_matches_one_mlx_lm_process(
    job: str, probe_outputs: Path, model_dirs: dict[str, Path]
) -> None:
    name = job.split("-whole")[0].split("-split")[0].split("-none")[0]
    result = np.load(probe_outputs / f"{job}.npz")
    tokens = [int(t) for t in result["tokens"]]
    ref = reference(model_dirs[name], tokens)
    scale = float(np.abs(ref["prefill"]).max())
    assert scale > 0.5  # the random model's logits are not degenerate
    worst = 0.0
    for key, expected in ref.items():
        got = result[key]
        assert got.shape == expected.shape, key
        worst = max(worst, float(np.abs(got - expected).max()))
        assert int(np.argmax(got[0, -1])) == int(np.argmax(expected[0, -1])), f"{job} {key}"
    ref_tokens = [int(np.argmax(ref["prefill"][0, -1]))] + [
        int(np.argmax(ref[f"step{i}"][0, -1])) for i in range(STEPS)
    ]
    assert tokens == ref_tokens
    assert worst <= RELATIVE_BOUND * scale, f"{job}: max diff {worst:.3g}, scale {scale:.3g}"
    # Logits vary across positions (the comparison is not of a constant).
    assert float(np.abs(np.diff(ref["prefill"][0], axis=0)).max()) > 0.1
