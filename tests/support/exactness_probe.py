"""The mesh's exactness check in a process of its own, for one BLAS kernel choice.

``python -m tests.support.exactness_probe MODEL_DIR STATE_DIR`` (from the repository root):
two data-plane nodes in this process (real gRPC, mutual TLS) split the model in ``MODEL_DIR``
in two, generate greedily with the last stage's logits, once with the default prefill chunk
(the 20-token prompt in one chunk: 19 tokens, then 1) and once in chunks of 7 (7 + 7 + 5,
then 1), and compare with mlx-lm's own ``generate_step`` with the same ``prefill_step_size``
in the same process. Prints one JSON line: the BLAS in use, whether the tokens are equal,
and the largest logit difference (0.0 when bit-identical).

Which OpenBLAS kernels run is decided once per process, when OpenBLAS loads (see
:mod:`meshd.runtime.blas`: ``MESHD_BLAS_CORETYPE`` picks them, ``LD_PRELOAD`` without a core
type leaves the choice to OpenBLAS's own CPU detection), hence a fresh interpreter per choice.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

BLAS = enable_fast_blas()  # before mlx.core

import json
import os
import sys
from pathlib import Path

import numpy as np

from meshd.inference.origin.runtime import DEFAULT_PREFILL_CHUNK
from meshd.inference.sampling import SamplingParams
from tests.support.dataplane_mesh import LoopThread, Mesh, mlx_lm_reference

PROMPT = [(index * 37 + 11) % 300 for index in range(20)]
PREFILL_CHUNKS = (DEFAULT_PREFILL_CHUNK, 7)
STEPS = 6


def probe(model_dir: Path, state_dir: Path) -> dict[str, object]:
    params = SamplingParams(max_tokens=STEPS, prefix_cache=False)  # cold, as mlx-lm runs it
    loop = LoopThread()
    mesh = Mesh(loop, state_dir)
    tokens_equal, diffs, outcomes = True, [], []
    try:
        for node in ("a", "b"):
            mesh.add_node(node)
        plan = mesh.assignment_for(model_dir, [("a", (0, 3)), ("b", (3, 6))])
        mesh.install(plan)
        for chunk in PREFILL_CHUNKS:
            ref_tokens, ref_logits = mlx_lm_reference(
                model_dir, PROMPT, params, prefill_chunk=chunk
            )
            events, outcome = mesh.generate(
                "a", plan.plan_id, PROMPT, params, return_logits=True, prefill_chunk=chunk
            )
            outcomes.append(repr(outcome))
            tokens_equal &= [event.token_id for event in events] == ref_tokens
            diffs += [
                float(np.max(np.abs(event.logits - ref)))
                for event, ref in zip(events, ref_logits, strict=False)
                if event.logits is not None
            ]
    finally:
        mesh.close()
        loop.close()
    return {
        "blas": BLAS.name,
        "outcomes": outcomes,
        "tokens_equal": tokens_equal,
        "steps_compared": len(diffs),
        "max_abs_diff": max(diffs, default=float("nan")),
    }


def main() -> None:
    """Print the result, then leave without the interpreter's teardown (``os._exit``).

    Why: once in several clean-clone suites this process printed its result and then aborted
    in C++ teardown ("terminate called without an active exception", SIGABRT), after the
    mesh and its threads had closed: MLX's per-thread streams, whose release at thread end
    was tried and reverted (c6fa722), and the abort has not been reproduced alone since. The
    result is what this probe is for; its teardown is not."""
    print(json.dumps(probe(Path(sys.argv[1]), Path(sys.argv[2]))), flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
