"""Rank 0's engine: the stage runtime's step function over a real TP=2 group of runners.

The data plane drives every stage through :func:`meshd.inference.stage.engine.run_step` on its
compute thread; for a tensor-parallel stage the engine is a
:class:`TensorParallelEngine` whose steps run in the group's runner processes (on loopback
here, real ``mx.distributed`` ring groups). Checked: prefill and greedy decode sample what one
mlx-lm process samples (logits within the bound of tests/test_tensor_parallel_runner.py), and a
member whose runner dies makes the next step fail as UNREACHABLE, the kind the origin maps to
UNAVAILABLE (retryable), with a message that names the lost member, at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from meshd.inference.sampling import SamplingParams
from meshd.inference.stage.engine import StageKey, run_step
from meshd.inference.stage_events import (
    ComputeFailed,
    FailureKind,
    Sampled,
    SamplerSetup,
    Work,
)
from meshd.inference.tensor_parallel.engine import TensorParallelEngine
from meshd.runtime.compute import ComputeExecutor
from tests.test_tensor_parallel_runner import (
    PROMPT,
    RELATIVE_BOUND,
    TEARDOWN_BOUND_S,
    Reference,
    close_all,
    llama_dir,  # noqa: F401 (the module-scoped model fixture)
    loopback_spec,
    start_group,
    wait_gone,
)

pytestmark = pytest.mark.integration


def step(plan: str, request: str, index: int, tokens: list[int], *, first: bool) -> Work:
    sampler = SamplerSetup(SamplingParams(), (), 0, True) if first else None
    return Work(plan, request, index, tuple(tokens), None, True, sampler, 0.0)


def test_engine_runs_steps_on_the_group_and_a_lost_member_is_unreachable(
    llama_dir: Path,  # noqa: F811
) -> None:
    spec = loopback_spec(llama_dir)
    key = StageKey(llama_dir, 0, 4, True, True)

    async def body() -> None:
        supervisors = await start_group(spec)
        compute = ComputeExecutor("test-compute")
        try:
            leader = supervisors["a"].member(spec.plan_id, 0)
            follower = supervisors["b"].member(spec.plan_id, 0)
            engine = TensorParallelEngine(key, 8, loop=asyncio.get_running_loop())
            engine.attach(leader)
            assert engine.weight_bytes == leader.ready_info["held_bytes"] > 0
            reference = Reference(llama_dir)

            # The data plane's schedule: all but the last prompt token, then one at a time.
            # (The prefill chunk is run as a head-less step on the last stage.)
            prefill = Work(spec.plan_id, "r", 0, tuple(PROMPT[:-1]), None, False, None, 0.0)
            await compute.run(run_step, engine, prefill, 1)
            reference.step(PROMPT[:-1])
            tokens = [PROMPT[-1]]
            for index in range(1, 7):
                result = await compute.run(
                    run_step,
                    engine,
                    step(spec.plan_id, "r", index, tokens[-1:], first=index == 1),
                    1,
                )
                assert isinstance(result, Sampled), result
                expected = reference.step(tokens[-1:])[0, -1]
                got = np.frombuffer(result.logits, dtype=np.float32)
                scale = float(np.abs(expected).max())
                assert float(np.abs(got - expected).max()) <= RELATIVE_BOUND * scale
                assert result.token_id == int(np.argmax(expected)), index
                tokens.append(result.token_id)

            os.kill(follower.pid, signal.SIGKILL)
            started = time.monotonic()
            failed = await compute.run(
                run_step, engine, step(spec.plan_id, "r", 7, tokens[-1:], first=False), 1
            )
            assert isinstance(failed, ComputeFailed), failed
            assert failed.kind is FailureKind.UNREACHABLE, failed
            # Whichever rank 0 sees first: its runner's watch of member b, or the ring's own
            # error on the dead connection (it cannot tell which peer that was); both name the
            # group, and the mesh's membership names the lost node.
            assert "a+b" in failed.reason, failed
            assert (
                "member b (rank 1)" in failed.reason
                or "connection to a peer was lost" in failed.reason
            ), failed
            assert time.monotonic() - started < TEARDOWN_BOUND_S
            await wait_gone([leader.pid], TEARDOWN_BOUND_S)
            # Freeing the request's caches on a group that is gone is not an error.
            await compute.run(engine.release, "r")
        finally:
            await compute.close()
            await close_all(supervisors)

    asyncio.run(body())
