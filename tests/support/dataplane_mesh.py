"""Data-plane nodes in one process, and mlx-lm's own generation as their reference.

Each node is a real grpc.aio server on 127.0.0.1 with mutual TLS under a temporary mesh secret
and its own DataPlane (its own compute thread), all on one asyncio loop that runs in a
background thread; callers submit coroutines to it with a bound on every wait.

:func:`mlx_lm_reference` is the exactness reference: mlx-lm's real ``generate_step``, with the
sampler and the ``prefill_step_size`` the mesh uses, and the logits it sampled each token from.
Import this module after ``meshd.runtime.blas.enable_fast_blas()``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from meshd.inference.assignment import Assignment, StageSpec
from meshd.inference.errors import InferenceError
from meshd.inference.fencing import CommittedPlans
from meshd.inference.generation_events import FinalEvent, TokenEvent
from meshd.inference.origin.runtime import DEFAULT_PREFILL_CHUNK
from meshd.inference.sampling import SamplingParams, TokenSampler
from meshd.inference.serving.dataplane import DataPlane
from meshd.inference.stage_events import prefill_steps
from meshd.inference.transport.links import start_server
from meshd.mesh import security
from meshd.mesh.channels import peer_channel_factory

T = TypeVar("T")

WAIT_S = 60.0  # the longest a caller waits for the loop thread

Outcome = FinalEvent | InferenceError


class LoopThread:
    """An asyncio loop on a daemon thread (like the daemon's grpc thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-grpc")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = WAIT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class Node:
    node_id: str
    plane: DataPlane
    server: grpc.aio.Server
    address: str
    committed: CommittedPlans


class Mesh:
    """In-process nodes; plans are installed (and committed) per test."""

    def __init__(self, loop: LoopThread, state_dir: Path) -> None:
        self.loop = loop
        self.state_dir = state_dir
        self.secret = security.create_mesh_secret("dataplane-test")
        self.nodes: dict[str, Node] = {}
        self._plan_ids = itertools.count()

    def add_node(
        self, node_id: str, *, follow: bool = False, lanes: bool = True, **plane_options: Any
    ) -> Node:
        """A node; with ``follow`` its origin follows the committed plans (``active`` of
        :meth:`install`) and moves its requests to the next one, as a daemon's does. With
        ``lanes`` (as a daemon) it offers and dials lanes; without, its links carry frames
        over their gRPC streams only."""
        credentials = security.load_or_create_node_credentials(
            self.state_dir / node_id, self.secret, node_id
        )
        committed = CommittedPlans(node_id)
        if follow:
            plane_options["served"] = committed.view

        async def start() -> Node:
            plane = DataPlane(
                node_id, peer_channel_factory(credentials), committed.check, **plane_options
            )
            server, port = await start_server(plane.servicer(), credentials)
            if lanes:
                await plane.transport.open_lanes("127.0.0.1", credentials)
            return Node(node_id, plane, server, f"127.0.0.1:{port}", committed)

        node = self.loop.run(start())
        self.nodes[node_id] = node
        return node

    def assignment_for(
        self, model_dir: Path, layout: Sequence[tuple[str, tuple[int, int]]]
    ) -> Assignment:
        last = len(layout) - 1
        stages = tuple(
            StageSpec(node, self.nodes[node].address, start, end, index == 0, index == last)
            for index, (node, (start, end)) in enumerate(layout)
        )
        return Assignment(f"plan-{next(self._plan_ids)}", model_dir, stages)

    def install(
        self, assignment: Assignment, nodes: Sequence[str] | None = None, *, active: bool = True
    ) -> None:
        """Commit and install ``assignment`` on ``nodes`` (default: every node), as the
        active plan unless ``active`` is False."""
        self.loop.run(self.install_async(assignment, nodes, active=active))

    async def install_async(
        self, assignment: Assignment, nodes: Sequence[str] | None = None, *, active: bool = True
    ) -> None:
        """:meth:`install` from the loop thread (e.g. while a request streams)."""
        targets = [self.nodes[n] for n in (nodes or self.nodes)]
        for node in targets:
            node.committed.add(assignment.plan_id, active=active)
        await asyncio.gather(*(node.plane.install(assignment) for node in targets))

    async def uninstall_async(self, plan_id: str, reason: str = "test over") -> None:
        """:meth:`uninstall` from the loop thread."""
        for node in self.nodes.values():
            node.committed.discard(plan_id)
            await node.plane.uninstall(plan_id, reason)

    def uninstall(self, plan_id: str) -> None:
        async def uninstall_all() -> None:
            for node in self.nodes.values():
                node.committed.discard(plan_id)
                await node.plane.uninstall(plan_id, "test over")

        self.loop.run(uninstall_all())

    def generate(
        self,
        origin: str,
        plan_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        **options: Any,
    ) -> tuple[list[TokenEvent], Outcome]:
        """One request from ``origin``: its token events, and its final event or its error."""
        plane = self.nodes[origin].plane
        request_id = options.pop("request_id", f"{origin}-{time.monotonic_ns()}")

        async def run() -> tuple[list[TokenEvent], Outcome]:
            stream = plane.generate(plan_id, prompt, params, request_id=request_id, **options)
            return await collect(stream)

        return self.loop.run(run())

    def open_requests(self, plan_id: str) -> dict[str, tuple[int, int]]:
        """Per node: (KV caches held, request records) for ``plan_id``."""

        async def read() -> dict[str, tuple[int, int]]:
            result = {}
            for node in self.nodes.values():
                caches = sum(
                    p.open_requests for p in node.plane.stats().plans if p.plan_id == plan_id
                )
                result[node.node_id] = (caches, node.plane.active_requests(plan_id))
            return result

        return self.loop.run(read())

    def wait_all_freed(self, plan_id: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (left := self.open_requests(plan_id)) and any(any(v) for v in left.values()):
            assert time.monotonic() < deadline, f"requests still open: {left}"
            time.sleep(0.02)

    def close(self) -> None:
        async def close_all() -> None:
            for node in self.nodes.values():
                await node.plane.close()
                await node.server.stop(0)

        self.loop.run(close_all())


async def collect(stream: AsyncIterator[Any]) -> tuple[list[TokenEvent], Outcome]:
    """Every token event of a request, and how it ended: its FinalEvent or its error."""
    tokens: list[TokenEvent] = []
    try:
        async for event in stream:
            if isinstance(event, FinalEvent):
                return tokens, event
            tokens.append(event)
    except InferenceError as error:
        return tokens, error
    raise AssertionError("the stream ended without a FinalEvent")


# --- The reference ------------------------------------------------------------------------------


class _LogitsRecorder:
    """Wraps an mlx-lm model: records the last-position logits of every call after the
    prompt's chunks, i.e. the logits each generated token is sampled from."""

    def __init__(self, model: Any, prompt_chunks: int) -> None:
        self._model = model
        self._skip = prompt_chunks
        self._calls = 0
        self.rows: list[mx.array] = []

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        output = self._model(inputs, cache=cache, **kwargs)
        if self._calls >= self._skip:
            self.rows.append(output[:, -1, :])
        self._calls += 1
        return output


def mlx_lm_reference(
    model_dir: Path,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    eos_ids: frozenset[int] = frozenset(),
    model: Any = None,
) -> tuple[list[int], list[np.ndarray]]:
    """What one mlx-lm process generates: ``generate_step`` with ``prefill_step_size`` equal
    to the mesh's prefill chunk and the mesh's per-request sampler, until EOS (not included)
    or ``params.max_tokens``; the tokens and the logits each was sampled from. ``model``: the
    model of ``model_dir`` already loaded by ``load_model`` (several references, one load)."""
    if model is None:
        model, _ = load_model(model_dir)
    chunks = len(prefill_steps(len(prompt), prefill_chunk)) - 1
    recorder = _LogitsRecorder(model, chunks)
    sampler = TokenSampler(params)
    steps = generate_step(
        mx.array(list(prompt)),
        recorder,  # type: ignore[arg-type]
        max_tokens=params.max_tokens,
        sampler=sampler,
        logits_processors=sampler.logits_processors,
        prompt_cache=make_prompt_cache(model),
        prefill_step_size=prefill_chunk,
    )
    tokens: list[int] = []
    for token, _ in steps:
        if token in eos_ids:
            break
        tokens.append(int(token))
    # numpy has no bfloat16: such logits are compared as float32 (which holds them exactly).
    rows = recorder.rows[: len(tokens)]
    wide = [row[0].astype(mx.float32) if row[0].dtype == mx.bfloat16 else row[0] for row in rows]
    return tokens, [np.array(row) for row in wide]
