"""Verify every mlx-lm architecture as meshd's pipeline and tensor-parallel stages.

For each architecture module of the installed mlx-lm (:func:`text_architectures`), a tiny
random float32 instance (:func:`tiny_config`) runs as one mlx-lm process (``load_model`` +
``make_prompt_cache`` + the model's ``__call__``: the prompt's logits at every position, then
greedy decode steps) and as 2 and 3 pipeline stages with :class:`LocalPipeline` (the networked
data plane runs exactly these stages). Pipeline outcome: "verified" when the logits are
exactly equal (bound 0.0: every stage runs the same operations on the same shapes as the
reference, see tests/test_architectures.py) and the greedy tokens the same; else "refused" with
the reason (the instance cannot be built, the stage loader refuses it, or the logits differ).

Tensor parallel, for the architectures whose mlx-lm model has ``shard(group)`` and whose
pipeline stages are verified: one pair of rank processes over an ``mx.distributed`` ring on
loopback (tests/support/tp_probe.py) loads every such model as one tensor-parallel stage and as
two (the second with experts placed unevenly, as the planner places them), and the logits are
compared with the same reference: within 1e-4 of the logits' scale, greedy tokens identical
(the bound of tests/test_tensor_parallel_architectures.py, which says why).

``python -m tests.support.arch_verify --write`` regenerates meshd.models.architecture_table and
docs/architectures.md; tests/test_architecture_coverage.py re-runs this and compares.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from meshd.inference.stage.local_pipeline import LocalPipeline
from meshd.inference.stage.model import UnsupportedModel, _TextModel, even_layer_ranges
from meshd.inference.tensor_parallel.spec import num_routed_experts
from meshd.models.architectures import NOT_APPLICABLE, REFUSED, VERIFIED
from tests.support.ports import free_ports
from tests.support.random_model import build_model, write_model_dir
from tests.support.tiny_architectures import text_architectures, tiny_config

ROOT = Path(__file__).resolve().parents[2]
TABLE_PATH = ROOT / "daemon" / "models" / "architecture_table.py"
DOCS_PATH = ROOT / "docs" / "architectures.md"
PROMPT = [(index * 37 + 11) % 300 for index in range(12)]  # longer than the sliding window
DECODE_STEPS = 3
STAGE_COUNTS = (2, 3)
TP_RANKS = 2
TP_RELATIVE_BOUND = 1e-4
TP_STALL_S = 20.0  # no job finished for this long: the ring is stuck
REASON_CHARS = 300
MAX_PARAMETERS = 4_000_000
WORKER_TIMEOUT_S = 600
RESULT_PREFIX = "ARCH-RESULT "


@dataclass(frozen=True)
class Outcome:
    """One architecture's row of the table."""

    pipeline: str
    pipeline_reason: str = ""
    tensor_parallel: str = NOT_APPLICABLE
    tensor_parallel_reason: str = ""

    def row(self) -> dict[str, str]:
        return {
            "pipeline": self.pipeline,
            "pipeline_reason": self.pipeline_reason,
            "tensor_parallel": self.tensor_parallel,
            "tensor_parallel_reason": self.tensor_parallel_reason,
        }


@dataclass(frozen=True)
class Reference:
    """What one mlx-lm process computes: logits of every prompt position, then of each
    greedy decode step, and the greedy tokens (the one after the prompt, then one per step)."""

    prefill: np.ndarray
    steps: list[np.ndarray]
    tokens: list[int]


class Refused(Exception):
    """An architecture fails a check; the message is the table's reason."""


def verify_all(
    folder: Path,
    architectures: list[str] | None = None,
    *,
    tensor_parallel: bool = True,
    workers: int = 2,
) -> dict[str, Outcome]:
    """Outcomes of every architecture (or those named), models written under ``folder``.

    The pipeline checks run in ``workers`` processes, each taking every ``workers``-th
    architecture: a tiny instance of some architectures corrupts the process's memory (native
    code sized for real dimensions), which must cost that architecture, not the run.
    """
    names = architectures or text_architectures()
    pipeline: dict[str, tuple[str, str]] = {}
    chunks = [names[index::workers] for index in range(workers)]
    with ThreadPoolExecutor(workers) as pool:
        for result in pool.map(lambda chunk: _pipeline_in_processes(chunk, folder), chunks):
            pipeline.update(result)
    references = {
        name: _load_reference(folder / name) for name in names if pipeline[name][0] == VERIFIED
    }
    model_dirs = {name: folder / name for name in names}
    tp = _tensor_parallel_outcomes(names, pipeline, references, model_dirs, folder, tensor_parallel)
    return {name: Outcome(*pipeline[name], *tp[name]) for name in names}


def _pipeline_in_processes(names: list[str], folder: Path) -> dict[str, tuple[str, str]]:
    """Run :func:`verify_pipeline` for ``names`` in a worker process, one after another; a
    worker that dies takes the architecture it was on with it, and a new one goes on."""
    done: dict[str, tuple[str, str]] = {}
    while len(done) < len(names):
        rest = [name for name in names if name not in done]
        process = subprocess.run(
            [sys.executable, "-m", "tests.support.arch_verify", "--worker", str(folder), *rest],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=WORKER_TIMEOUT_S,
        )
        for line in process.stdout.splitlines():
            if line.startswith(RESULT_PREFIX):
                name, status, reason = json.loads(line[len(RESULT_PREFIX) :])
                done[name] = (status, reason)
        unreported = [name for name in rest if name not in done]
        if process.returncode != 0 and unreported:
            crashed = unreported[0]
            done[crashed] = (REFUSED, f"a tiny instance crashes the process ({_exit(process)})")
    return done


def _exit(process: subprocess.CompletedProcess[str]) -> str:
    code = process.returncode
    return f"signal {-code}" if code < 0 else f"exit status {code}"


def _worker(folder: Path, names: list[str]) -> None:
    """The worker process: one result line per architecture, the reference kept on disk."""
    for name in names:
        model_dir = folder / name
        started = time.monotonic()
        try:
            reference = verify_pipeline(name, model_dir)
            np.savez(
                model_dir / "reference.npz",
                prefill=reference.prefill,
                tokens=np.array(reference.tokens),
                **{f"step{index}": step for index, step in enumerate(reference.steps)},
            )
            result = (name, VERIFIED, "")
        except Refused as refusal:
            result = (name, REFUSED, _clean(str(refusal), model_dir))
        print(f"  {name}: {result[1]} in {time.monotonic() - started:.2f} s", file=sys.stderr)
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def _load_reference(model_dir: Path) -> Reference:
    saved = np.load(model_dir / "reference.npz")
    steps = [saved[f"step{index}"] for index in range(DECODE_STEPS)]
    return Reference(saved["prefill"], steps, [int(token) for token in saved["tokens"]])


def verify_pipeline(architecture: str, model_dir: Path) -> Reference:
    """Build, run and compare one architecture as 2 and 3 stages; raises :class:`Refused`."""
    try:
        config = tiny_config(architecture)
        skeleton = build_model(config)
        size = sum(value.size for _, value in tree_flatten(skeleton.parameters()))
        if size > MAX_PARAMETERS:
            raise Refused(
                f"cannot build a tiny instance: {size:,} parameters (a field the tiny rules do "
                "not name keeps a large default; add it to tiny_architectures.TINY_FIELDS)"
            )
    except Refused:
        raise
    except Exception as error:
        raise Refused(f"cannot build a tiny instance: {_error(error)}") from error
    try:  # what stages need where they need it, before anything runs
        _TextModel.of(skeleton, architecture)
    except UnsupportedModel as error:
        raise Refused(_error(error)) from error
    try:
        write_model_dir(model_dir, config, seed=7)
    except Exception as error:
        raise Refused(f"cannot build a tiny instance: {_error(error)}") from error
    try:
        reference, num_layers = run_reference(model_dir)
    except Exception as error:
        raise Refused(f"mlx-lm's own model fails on a tiny instance: {_error(error)}") from error
    if not np.isfinite(reference.prefill).all() or len(np.unique(reference.prefill)) < 10:
        raise Refused("a tiny instance's logits are not finite and varied, nothing to compare")
    for count in STAGE_COUNTS:
        try:
            pipeline = LocalPipeline.load(
                model_dir, even_layer_ranges(num_layers, count), refuse_unverified=False
            )
            _compare_stages(pipeline, reference, count)
        except Refused:
            raise
        except Exception as error:
            raise Refused(_error(error)) from error
    return reference


def run_reference(model_dir: Path) -> tuple[Reference, int]:
    """One mlx-lm process: its model, its caches, its ``__call__``; and its layer count."""
    model, _ = load_model(model_dir)
    cache = make_prompt_cache(model)
    prefill = model(mx.array([PROMPT]), cache=cache)
    mx.eval(prefill)
    tokens = [int(mx.argmax(prefill[0, -1]).item())]
    steps = []
    for _ in range(DECODE_STEPS):
        logits = model(mx.array([[tokens[-1]]]), cache=cache)
        mx.eval(logits)
        steps.append(np.array(logits.astype(mx.float32)))
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    layers = model.layers if hasattr(model, "layers") else cache
    return Reference(np.array(prefill.astype(mx.float32)), steps, tokens), len(layers)


def _compare_stages(pipeline: LocalPipeline, reference: Reference, count: int) -> None:
    """Exactly the reference's logits and tokens, or :class:`Refused` saying where not."""
    caches = pipeline.make_caches()
    logits = pipeline.logits(mx.array([PROMPT]), caches, last_only=False)
    _same(np.array(logits.astype(mx.float32)), reference.prefill, count, "the prompt")
    tokens = [int(mx.argmax(logits[0, -1]).item())]
    for step, expected in enumerate(reference.steps):
        logits = pipeline.logits(mx.array([[tokens[-1]]]), caches)
        _same(np.array(logits.astype(mx.float32)), expected, count, f"decode step {step + 1}")
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    if tokens != reference.tokens:
        raise Refused(f"{count} stages choose other greedy tokens than one mlx-lm process")


def _same(got: np.ndarray, expected: np.ndarray, count: int, where: str) -> None:
    if got.shape != expected.shape:
        raise Refused(
            f"{count} stages give logits of shape {got.shape} for {where}, one mlx-lm process "
            f"{expected.shape}"
        )
    if not np.array_equal(got, expected):
        # The size of the difference is printed, not stored: it depends on the CPU.
        print(f"  {count} stages, {where}: max |diff| {np.abs(got - expected).max():.3g}")
        raise Refused(
            f"the logits of {count} stages differ from one mlx-lm process's at {where} (same "
            "shapes, so the stages compute something else: the model's inner loop does more "
            "than embed, layers with their masks, norm and head)"
        )


# ---- tensor parallel ------------------------------------------------------------------------


def _tensor_parallel_outcomes(
    names: list[str],
    pipeline: dict[str, tuple[str, str]],
    references: dict[str, Reference],
    model_dirs: dict[str, Path],
    folder: Path,
    run: bool,
) -> dict[str, tuple[str, str]]:
    outcomes: dict[str, tuple[str, str]] = {}
    candidates = []
    for name in names:
        if not _has_shard(name):
            outcomes[name] = (NOT_APPLICABLE, f"mlx-lm's {name} model has no shard(group)")
        elif pipeline[name][0] != VERIFIED:
            outcomes[name] = (REFUSED, "its pipeline stages are refused (see pipeline)")
        else:
            candidates.append(name)
    if not candidates:
        return outcomes
    if not run:
        return outcomes | {name: ("not verified", "not run here") for name in candidates}
    results = run_tensor_parallel(candidates, model_dirs, folder / "tp")
    for name in candidates:
        outcomes[name] = _tp_verdict(name, results[name], references[name], model_dirs[name])
    return outcomes


def _has_shard(architecture: str) -> bool:
    import importlib

    try:
        module = importlib.import_module(f"mlx_lm.models.{architecture}")
    except BaseException:  # a module that exits on import (SystemExit) has no shard
        return False
    return hasattr(module.Model, "shard")


def _jobs(name: str, model_dir: Path) -> list[dict[str, Any]]:
    """One TP stage with every layer; two TP stages, experts placed unevenly when it has any."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or config
    layers = int(
        text.get("num_hidden_layers")
        or text.get("num_layers")
        or text.get("n_layer")
        or text.get("n_layers")
    )
    base = {
        "model_dir": str(model_dir),
        "prompt": PROMPT,
        "steps": DECODE_STEPS,
        "unverified": True,
        "keep_going": True,
    }
    half = layers // 2
    split: dict[str, Any] = {**base, "name": f"{name}-split", "stages": [[0, half], [half, layers]]}
    experts = num_routed_experts(text)
    if experts:
        split["expert_ranges"] = [[0, 1], [1, experts]]
    return [{**base, "name": f"{name}-whole", "stages": [[0, layers]]}, split]


def run_tensor_parallel(
    names: list[str], model_dirs: dict[str, Path], folder: Path
) -> dict[str, dict[str, Any]]:
    """Every architecture's jobs over rings of :data:`TP_RANKS` rank processes; per name, job
    name -> rank 0's arrays, or the error text.

    The jobs share rings, since starting a ring (two processes importing mlx-lm) costs more
    than most jobs. A result is taken only from a ring whose jobs all succeeded before it:
    after a job fails on one rank the ranks may be out of step, so the jobs after it go to a
    new ring. A ring stalls when a job leaves the ranks out of step inside a collective; a job
    that stalls the ring it starts on is refused, one that stalls later goes first on a new
    ring (the job before it may have put it out of step)."""
    jobs = [job for name in names for job in _jobs(name, model_dirs[name])]
    results: dict[str, dict[str, Any]] = {name: {} for name in names}
    remaining = list(jobs)
    for ring in range(len(jobs) + 1):  # each ring settles at least one job
        if not remaining:
            break
        ring_folder = folder / f"ring{ring}"
        ring_folder.mkdir(parents=True, exist_ok=True)
        _run_ring(remaining, ring_folder)
        settled = _settle(remaining, ring_folder)
        for job, result in settled:
            results[job["name"].rsplit("-", 1)[0]][job["name"]] = result
        remaining = remaining[len(settled) :]
    return results


def _settle(jobs: list[dict[str, Any]], folder: Path) -> list[tuple[dict[str, Any], Any]]:
    """The leading jobs of a ring whose results hold, in order, each with its arrays or its
    error text: every success up to and including the first failure (or a stall at the
    ring's first job)."""
    settled: list[tuple[dict[str, Any], Any]] = []
    for job in jobs:
        error, arrays = folder / f"{job['name']}.error", folder / f"{job['name']}.npz"
        if arrays.exists():
            settled.append((job, dict(np.load(arrays))))
            continue
        if error.exists():
            settled.append((job, error.read_text()))
        elif not settled:
            settled.append((job, "the ranks fall out of step (a collective stalls)"))
        break
    return settled


def _run_ring(jobs: list[dict[str, Any]], folder: Path) -> None:
    """Run ``jobs`` on one ring until they are done, one fails (what follows it is not taken
    from this ring) or no job finishes for TP_STALL_S."""
    (folder / "jobs.json").write_text(json.dumps(jobs))
    hosts = [[f"127.0.0.1:{port}"] for port in free_ports(TP_RANKS)]
    (folder / "hosts.json").write_text(json.dumps(hosts))
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.tp_probe", str(folder / "jobs.json"), folder],
            cwd=ROOT,
            env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(folder / "hosts.json")},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in range(TP_RANKS)
    ]
    try:
        finished, last_change = -1, time.monotonic()
        while any(process.poll() is None for process in processes):
            count = sum(
                (folder / f"{job['name']}.{suffix}").exists()
                for job in jobs
                for suffix in ("npz", "error")
            )
            if count != finished:
                finished, last_change = count, time.monotonic()
            if time.monotonic() - last_change > TP_STALL_S:
                break
            if any(folder.glob("*.error")):
                break
            time.sleep(0.1)
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _tp_verdict(
    name: str, results: dict[str, Any], reference: Reference, model_dir: Path
) -> tuple[str, str]:
    scale = float(np.abs(reference.prefill).max())
    for job, result in results.items():
        kind = "one stage" if job.endswith("-whole") else "two stages, experts placed unevenly"
        if isinstance(result, str):
            return REFUSED, _clean(f"{kind} of {TP_RANKS} ranks fail: {result}", model_dir)
        if [int(token) for token in result["tokens"]] != reference.tokens:
            return REFUSED, f"{kind} of {TP_RANKS} ranks choose other greedy tokens"
        expected = {"prefill": reference.prefill}
        expected |= {f"step{i}": step for i, step in enumerate(reference.steps)}
        worst = max(float(np.abs(result[key] - value).max()) for key, value in expected.items())
        if not worst <= TP_RELATIVE_BOUND * scale:
            print(f"  {job}: max |diff| {worst:.3g}, logits' scale {scale:.3g}")
            return REFUSED, (
                f"the logits of {kind} of {TP_RANKS} ranks differ from one mlx-lm process's by "
                f"more than {TP_RELATIVE_BOUND:g} of their scale"
            )
    return VERIFIED, ""


# ---- reasons, the table, the docs -----------------------------------------------------------


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _clean(reason: str, model_dir: Path) -> str:
    """A reason that does not depend on where the model was written, on one line, short."""
    text = " ".join(reason.replace(str(model_dir), "<model>").split())
    text = text.rstrip(".")
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def mlx_lm_version() -> str:
    import mlx_lm

    return str(mlx_lm.__version__)


def differences(committed: dict[str, dict[str, str]], measured: dict[str, Outcome]) -> list[str]:
    """What the installed mlx-lm does differently from the committed table, in words."""
    lines = []
    for name in sorted(measured.keys() - committed.keys()):
        lines.append(f"new architecture {name}: {_describe(measured[name].row())}")
    for name in sorted(committed.keys() - measured.keys()):
        lines.append(f"architecture {name} is gone from mlx-lm")
    for name in sorted(committed.keys() & measured.keys()):
        # A failed rank's words depend on which rank notices first: the verdict is compared.
        stable = ("pipeline", "pipeline_reason", "tensor_parallel")
        if any(committed[name][key] != measured[name].row()[key] for key in stable):
            lines.append(
                f"{name}: was {_describe(committed[name])}; now {_describe(measured[name].row())}"
            )
    return lines


def _describe(row: dict[str, str]) -> str:
    pipeline = row["pipeline"] + (f" ({row['pipeline_reason']})" if row["pipeline_reason"] else "")
    tp = row["tensor_parallel"]
    tp += f" ({row['tensor_parallel_reason']})" if row["tensor_parallel_reason"] else ""
    return f"pipeline {pipeline}, tensor parallel {tp}"


def table_source(outcomes: dict[str, Outcome], version: str) -> str:
    rows = {name: outcomes[name].row() for name in sorted(outcomes)}
    return (
        '"""Which mlx-lm architectures run as meshd stages: measured, not written by hand.\n\n'
        "Generated by ``python -m tests.support.arch_verify --write`` (see\n"
        "meshd.models.architectures); tests/test_architecture_coverage.py checks it against the\n"
        'installed mlx-lm.\n"""\n\n'
        "# ruff: noqa: E501\n\n"
        f"MLX_LM_VERSION = {version!r}\n"
        f"ARCHITECTURES: dict[str, dict[str, str]] = {json.dumps(rows, indent=4)}\n"
    )


def docs_text(outcomes: dict[str, Outcome], version: str) -> str:
    rows = [outcomes[name] for name in sorted(outcomes)]
    pipeline = sum(row.pipeline == VERIFIED for row in rows)
    tp = sum(row.tensor_parallel == VERIFIED for row in rows)
    lines = [
        "# Architectures",
        "",
        "Which of mlx-lm's architectures meshd runs as pipeline stages and as tensor-parallel",
        "stages, measured on tiny random instances of each (`tests/support/arch_verify.py`):",
        "a stage split is verified when 2 and 3 pipeline stages give exactly the logits and",
        "greedy tokens of one mlx-lm process; tensor parallelism when one and two stages over 2",
        "ranks (experts placed unevenly) stay within 1e-4 of the logits' scale with the same",
        "tokens. `meshd plan`, `meshd load` and the daemon refuse the others with the reason",
        "below. Regenerate with `python -m tests.support.arch_verify --write`;",
        "`tests/test_architecture_coverage.py` fails when the installed mlx-lm differs.",
        "",
        f"mlx-lm {version}: {len(rows)} architectures, {pipeline} verified as pipeline stages, "
        f"{tp} as tensor-parallel stages.",
        "",
        "| architecture | pipeline | tensor parallel | reason |",
        "|---|---|---|---|",
    ]
    for name in sorted(outcomes):
        row = outcomes[name]
        reasons = []
        if row.pipeline_reason:
            reasons.append(f"pipeline: {row.pipeline_reason}")
        if row.tensor_parallel_reason and row.pipeline == VERIFIED:
            reasons.append(f"tensor parallel: {row.tensor_parallel_reason}")
        reason = "; ".join(reasons).replace("|", "\\|")
        lines.append(f"| {name} | {row.pipeline} | {row.tensor_parallel} | {reason} |")
    return "\n".join(lines) + "\n"


def write(outcomes: dict[str, Outcome]) -> None:
    version = mlx_lm_version()
    TABLE_PATH.write_text(table_source(outcomes, version))
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", str(TABLE_PATH)], check=True)
    DOCS_PATH.write_text(docs_text(outcomes, version))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table and the docs")
    parser.add_argument("--only", nargs="*", help="these architectures only (no --write)")
    parser.add_argument("--no-tp", action="store_true", help="skip tensor parallelism")
    parser.add_argument("--workers", type=int, default=2, help="processes for the pipelines")
    parser.add_argument("--worker", metavar="FOLDER", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.worker:
        _worker(Path(args.worker), rest)
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.write and args.only:
        parser.error("--write needs every architecture; leave out --only")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meshd-arch-") as folder:
        outcomes = verify_all(
            Path(folder), args.only, tensor_parallel=not args.no_tp, workers=args.workers
        )
    for name, outcome in sorted(outcomes.items()):
        print(f"{name}: {_describe(outcome.row())}")
    print(f"{len(outcomes)} architectures in {time.monotonic() - started:.1f} s")
    if args.write:
        write(outcomes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
