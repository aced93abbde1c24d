"""Rank 0's stage engine: the stage runtime's engine interface over a tensor-parallel group.

The stage runtime (:mod:`meshd.inference.stage.runtime`) drives one engine per plan through
:func:`meshd.inference.stage.engine.run_step` on the compute thread: ``run`` (a step's layers),
``open_sampler``/``sample``/``last_token`` (the last stage's sampling), ``release`` and
``unload``. :class:`TensorParallelEngine` implements the same interface for a stage whose
layers are split over a group: ``run`` hands the step to this node's rank-0 runner
(:meth:`TensorParallelMember.run`, on the data plane's asyncio loop, where the runner's channel
lives) and waits for its output on the compute thread; sampling stays here, with the same
seeded samplers as a local stage, so a request samples the same tokens either way.

One step at a time: the runner executes the steps of all requests in the order they arrive
(so every rank enters the same collectives in the same order); a batch of several requests'
steps would run request by request.

Failures: a group that broke (a member lost, a step overran, the runner died) raises
:class:`meshd.inference.stage.engine.StageUnavailable`, so the request ends as UNAVAILABLE, the
kind its origin may retry on the mesh's next plan; a step the runner refused (the request was
not acceptable) is an ordinary compute failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from meshd.inference.stage.engine import StageEngine, StageUnavailable
from meshd.inference.tensor_parallel.member import (
    RUN_DEADLINE_MARGIN_S,
    STOP_TIMEOUT_S,
    RunnerState,
    TensorParallelError,
    TensorParallelMember,
)
from meshd.inference.tensor_parallel.wire import from_mx, to_mx
from meshd.runtime.compute import computing

log = logging.getLogger("meshd.tp")

# How much longer than the member's own step deadline the compute thread waits for its answer:
# the member's deadline fails the step first; this bound only covers a loop that stopped.
OUTER_MARGIN_S = 5.0


@dataclass
class TensorParallelEngine(StageEngine):
    """This node's rank 0 of a tensor-parallel stage, as the stage runtime's engine.

    ``loop``: the asyncio loop the member's runner channel belongs to. ``member`` is attached
    once the group formed (:meth:`attach`); the plan is marked loaded only after that, so no
    step reaches an engine without one.
    """

    loop: asyncio.AbstractEventLoop | None = None
    member: TensorParallelMember | None = None

    def attach(self, member: TensorParallelMember) -> None:
        """The group is ready: its rank 0 runs this stage (asyncio thread)."""
        self.member = member
        self.weight_bytes = int(member.ready_info.get("held_bytes") or 0)

    @property
    def batchable(self) -> bool:
        """False: the runners keep one cache per request, so the stage runtime runs a
        tensor-parallel stage's decode steps request by request (never batched)."""
        return False

    def load(self, shared: Any = None) -> None:
        """Nothing to load here: the runners hold the weights (started by the data plane)."""

    def run(
        self, request_id: str, inputs: mx.array, *, head: bool, every_position: bool = False
    ) -> mx.array:
        """Compute thread: one step of the request through the group's runners. A group does
        not run speculative steps (a plan with one never drafts: ``every_position`` is an
        error)."""
        if every_position:
            raise RuntimeError("a tensor-parallel stage does not run speculative steps")
        member = self._member()
        dtype, shape, data = from_mx(inputs)
        logits = "last" if head else "none"
        step = member.run(request_id, dtype, shape, data, logits=logits)
        output = self._wait(step, member.spec.step_timeout_s + RUN_DEADLINE_MARGIN_S)
        return to_mx(output.dtype, output.shape, output.data)

    def release(
        self, request_id: str, keep_as: int | None = None, positions: int = 0, keep: int = 0
    ) -> None:
        """Compute thread: drop the request's sampler here and its caches on every rank (a
        group keeps no prefixes: its stage core never asks it to, ``keep_as`` is None)."""
        self._samplers.pop(request_id, None)
        member = self.member
        if member is None or member.state is not RunnerState.READY:
            return  # a group that is gone holds no caches
        try:
            self._wait(member.release(request_id), STOP_TIMEOUT_S)
        except (StageUnavailable, RuntimeError) as error:
            log.info("freeing %s on %s: %s", request_id, member.spec.name, error)

    def unload(self) -> None:
        """Forget the samplers; the data plane stops the runners with the plan."""
        self._samplers.clear()

    def _member(self) -> TensorParallelMember:
        if self.member is None:
            raise StageUnavailable("this node's tensor-parallel group has not formed")
        return self.member

    def _wait(self, step: Any, deadline_s: float) -> Any:
        """Run ``step`` (a coroutine of the member) on its loop; wait here, bounded."""
        assert self.loop is not None
        member = self._member()
        future = asyncio.run_coroutine_threadsafe(step, self.loop)
        computing()  # the loop sends it to the runners first, then may stream a token
        try:
            return future.result(timeout=deadline_s + OUTER_MARGIN_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise StageUnavailable(
                f"tensor-parallel stage {member.spec.name} did not answer within "
                f"{deadline_s + OUTER_MARGIN_S:g} s"
            ) from None
        except concurrent.futures.CancelledError:
            raise StageUnavailable(
                f"tensor-parallel stage {member.spec.name} stopped (the plan was uninstalled)"
            ) from None
        except TensorParallelError as error:
            if not error.fatal:
                raise RuntimeError(str(error)) from error
            members = "+".join(m.node_id for m in member.spec.members)
            raise StageUnavailable(
                f"tensor-parallel group {members} of stage {member.spec.stage_index} is gone "
                f"({error}); the mesh re-plans without a lost member"
            ) from error
