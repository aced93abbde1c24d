"""One rank of a tensor-parallel exactness probe: many models through one ``mx.distributed`` group.

``python -m tests.support.tp_probe JOBS.json OUT_DIR`` with ``MLX_RANK`` and ``MLX_HOSTFILE`` set
(the test starts one process per rank). An ``mx.distributed`` group can be formed once per
process, so this loads every job's stages over the same group, which makes verifying many
architectures cost one pair of processes instead of one group each. Each rank loads its shard of
each stage with the runner's own loader (:func:`load_rank_stage`) and runs the job's prompt, then
greedy decode steps; rank 0 writes the logits and tokens to ``OUT_DIR/<job name>.npz``.

A job: ``{"name", "model_dir", "stages": [[start, end], ...], "expert_ranges": [[s, e], ...]
(optional, per rank), "prompt": [ids], "steps": n}``. Stages are chained in the job's order, the
first with the embedding and the last with the head: a pipeline of tensor-parallel stages.
``"unverified": true`` loads architectures the table does not list as tensor-parallel yet, and
``"keep_going": true`` writes ``OUT_DIR/<job name>.error`` for a job that fails to load or run
instead of stopping (tests/support/arch_verify.py verifies every architecture this way).
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from meshd.inference.tensor_parallel.sharding import load_rank_stage
from meshd.inference.tensor_parallel.spec import GroupMember, TensorParallelSpec


def main(jobs_path: str, out_dir: str) -> int:
    group = mx.distributed.init(backend="ring", strict=True)
    rank, size = group.rank(), group.size()
    for job in json.loads(Path(jobs_path).read_text()):
        try:
            stages = _load(job, rank, size, group)
            tokens, logits = _generate(stages, job, group)
        except Exception as error:
            if not job.get("keep_going"):
                raise
            # Loading fails alike on every rank (the same config, the same code), so the ranks
            # stay in step and go on to the next job.
            if rank == 0:
                text = f"{type(error).__name__}: {error}"
                (Path(out_dir) / f"{job['name']}.error").write_text(text)
            continue
        if rank == 0:
            np.savez(Path(out_dir) / f"{job['name']}.npz", tokens=np.array(tokens), **logits)
        del stages
    return 0


def _load(job: dict, rank: int, size: int, group) -> list:
    members = tuple(GroupMember(f"n{r}", "127.0.0.1", 1000 + r) for r in range(size))
    last = len(job["stages"]) - 1
    return [
        load_rank_stage(
            TensorParallelSpec(
                plan_id=job["name"],
                stage_index=index,
                model_dir=job["model_dir"],
                layer_start=start,
                layer_end=end,
                has_embedding=index == 0,
                has_head=index == last,
                members=members,
                control_port=2000,
                expert_ranges=tuple(tuple(pair) for pair in job.get("expert_ranges", ())),
            ),
            rank,
            group,
            refuse_unverified=not job.get("unverified", False),
        )
        for index, (start, end) in enumerate(job["stages"])
    ]


def _generate(stages: list, job: dict, group) -> tuple[list[int], dict[str, np.ndarray]]:
    """Greedy decoding; rank 0 (the only rank with the head) picks each token and every rank
    feeds that token, as the runner's rank 0 forwards its input to the others."""
    caches = [stage.make_cache() for stage in stages]

    def greedy(logits: np.ndarray) -> int:
        mine = int(np.argmax(logits[0, -1])) if group.rank() == 0 else 0
        return int(mx.distributed.all_sum(mx.array([mine]), group=group).item())

    def step(tokens: list[int], logits: str) -> mx.array:
        payload = mx.array([tokens], dtype=mx.int32)
        for stage, cache in zip(stages, caches, strict=True):
            payload = stage.run(payload, cache, logits=logits)
            mx.eval(payload)
        return payload

    out = {"prefill": np.array(step(job["prompt"], "all"))}
    tokens = [greedy(out["prefill"])]
    for index in range(job["steps"]):
        logits = np.array(step(tokens[-1:], "last"))
        out[f"step{index}"] = logits
        tokens.append(greedy(logits))
    return tokens, out


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
