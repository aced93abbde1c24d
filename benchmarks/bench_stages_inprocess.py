"""Stages chained in one process vs ``mlx_lm.stream_generate``: TTFT and decode speed.

Why: before any network is involved, splitting a model into stages must cost (almost)
nothing; this measures that on SmolLM2-135M float32 (the embedded default) and on a random
~100M-parameter llama, prompt 128 tokens / generate 64 (greedy, EOS suppressed so every run
generates the same number of tokens).

Run: ``.venv/bin/python benchmarks/bench_stages_inprocess.py [--store DIR] [--json OUT]``
(about 2 minutes on 2 cores with the default 3 repeats; ``--store`` reuses an existing model
store for SmolLM2).
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core

# isort: split
import mlx.core as mx
import mlx_lm

from meshd.inference.stage.local_pipeline import LocalPipeline
from meshd.inference.stage.model import even_layer_ranges
from meshd.models.store import DEFAULT_MODEL, ModelStore
from tests.support.random_model import make_random_model_dir

PREFILL_CHUNK = 2048  # mlx-lm's default prefill step, so both sides prefill in one chunk


@dataclass
class Result:
    model: str
    runner: str
    ttft_s: float
    prompt_tps: float
    decode_tps: float
    generated: int


def prompt_ids(vocab: int, length: int) -> list[int]:
    """A fixed, varied prompt of ``length`` ordinary token ids."""
    return [100 + (index * 7919) % min(vocab - 100, 20000) for index in range(length)]


def suppress_ids(ids: set[int]):
    """A logits processor that makes ``ids`` (EOS) impossible, so runs have equal length."""
    blocked = mx.array(sorted(ids)) if ids else None

    def processor(_tokens: mx.array, logits: mx.array) -> mx.array:
        if blocked is not None:
            logits[:, blocked] = -float("inf")
        return logits

    return processor


def bench_mlx_lm(name: str, model_dir: Path, prompt: list[int], generate: int) -> Result:
    model, tokenizer = mlx_lm.load(str(model_dir))
    processor = suppress_ids(set(tokenizer.eos_token_ids))
    start = time.perf_counter()
    first_at = None
    count = 0
    last = None
    for response in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=generate, logits_processors=[processor]
    ):
        if first_at is None:
            first_at = time.perf_counter()
        count += 1
        last = response
    end = time.perf_counter()
    assert first_at is not None and last is not None
    return Result(
        name, "mlx_lm.stream_generate", first_at - start, last.prompt_tps,
        (count - 1) / (end - first_at), count,
    )  # fmt: skip


def bench_stages(
    name: str, model_dir: Path, prompt: list[int], generate: int, num_stages: int, eos: set[int]
) -> Result:
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    pipeline = LocalPipeline.load(model_dir, even_layer_ranges(layers, num_stages))
    blocked = mx.array(sorted(eos)) if eos else None
    caches = pipeline.make_caches()
    start = time.perf_counter()
    logits = pipeline.prefill(mx.array(prompt), caches, PREFILL_CHUNK)
    prefill_done = time.perf_counter()
    tokens = []
    first_at = 0.0
    for index in range(generate):
        if blocked is not None:
            logits[:, blocked] = -float("inf")
        token = int(mx.argmax(logits, axis=-1).item())
        tokens.append(token)
        if index == 0:
            first_at = time.perf_counter()
        if index + 1 < generate:
            logits = pipeline.logits(mx.array([[token]]), caches)[:, -1, :]
    end = time.perf_counter()
    return Result(
        name, f"stages x{num_stages}", first_at - start, len(prompt) / (prefill_done - start),
        (len(tokens) - 1) / (end - first_at), len(tokens),
    )  # fmt: skip


def bench_model(
    name: str, model_dir: Path, prompt_len: int, generate: int, repeats: int
) -> list[Result]:
    """Each runner ``repeats`` times, interleaved (so load from elsewhere hits all alike);
    per runner, the run with the median decode speed."""
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    prompt = prompt_ids(config["vocab_size"], prompt_len)
    # Warm-up: first calls compile kernels and page in the weights.
    bench_stages(name, model_dir, prompt[:16], 4, 1, eos_ids)
    runs: dict[str, list[Result]] = {}
    for _ in range(repeats):
        batch = [bench_mlx_lm(name, model_dir, prompt, generate)]
        for num_stages in (1, 2, 3):
            gc.collect()
            batch.append(bench_stages(name, model_dir, prompt, generate, num_stages, eos_ids))
        for result in batch:
            runs.setdefault(result.runner, []).append(result)
        gc.collect()
    return [
        sorted(results, key=lambda result: result.decode_tps)[len(results) // 2]
        for results in runs.values()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, help="model store root to (re)use for SmolLM2")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--generate", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per runner (median kept)")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="meshd-bench-") as scratch:
        store = ModelStore(args.store or Path(scratch) / "store")
        started = time.perf_counter()
        smollm = store.ensure_default()
        print(f"SmolLM2 ready in {time.perf_counter() - started:.1f} s at {smollm.path}")
        results += bench_model(
            DEFAULT_MODEL, smollm.path, args.prompt_tokens, args.generate, args.repeats
        )
        random_dir = make_random_model_dir(
            Path(scratch) / "llama-100m", "llama", layers=12, hidden=768, heads=12, kv_heads=4,
            vocab=32000, intermediate=2048, seed=0,
        )  # fmt: skip
        results += bench_model(
            "random-llama-100m", random_dir, args.prompt_tokens, args.generate, args.repeats
        )

    print(
        f"\nprompt {args.prompt_tokens} / generate {args.generate}, float32, one process, "
        f"median of {args.repeats}"
    )
    print(f"{'model':<22} {'runner':<24} {'TTFT s':>7} {'prompt tok/s':>13} {'decode tok/s':>13}")
    for result in results:
        print(
            f"{result.model:<22} {result.runner:<24} {result.ttft_s:>7.3f} "
            f"{result.prompt_tps:>13.1f} {result.decode_tps:>13.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(result) for result in results], indent=2))


if __name__ == "__main__":
    main()
