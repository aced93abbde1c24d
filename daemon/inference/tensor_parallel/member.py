"""The daemon's side of a tensor-parallel stage: the runner processes it owns, and their API.

Each node in a TP group owns exactly one runner: its rank of the group
(:class:`TensorParallelMember`). Rank 0's daemon is the stage's data-plane endpoint: the data
plane calls :meth:`TensorParallelMember.run` with the stage's input (token ids on the first
stage, hidden states after) and gets the stage's output (hidden states, or logits on the last
stage); rank 0's runner relays the step to the other ranks (:mod:`.runner`). The other members'
daemons only own their runner's lifetime. :class:`RunnerSupervisor` is that ownership for a whole
node: runners start when a plan is installed, stop with it, and are killed by PID when a group
member is lost (the mesh's heartbeat), when a step overruns its deadline, or on any error.

Everything here runs on one asyncio loop (the daemon's data-plane loop), in the thread that
started the runners: on Linux the kernel kills a runner when that thread exits
(``PR_SET_PDEATHSIG``), so never start runners from a short-lived worker thread.

The daemon-runner channel is a socket pair whose child end the runner inherits: nothing to
find on the filesystem, and the runner sees the daemon's death as end-of-file. Frames are
:mod:`.wire` frames (JSON header + raw array bytes; never pickle).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from meshd.inference.tensor_parallel.runner_process import RunnerProcess
from meshd.inference.tensor_parallel.spec import (
    TensorParallelSpec,
    TensorParallelUnsupported,
    check_tensor_parallel,
)
from meshd.inference.tensor_parallel.wire import (
    FrameError,
    array_fields,
    check_array,
    encode_frame,
    read_frame_async,
)

log = logging.getLogger("meshd.tp")

DEFAULT_STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 5.0
RUN_DEADLINE_MARGIN_S = 5.0
STARTUP_MARGIN_S = 10.0


class TensorParallelError(RuntimeError):
    """A TP stage cannot serve: it failed to start, a member was lost, or a step overran.

    ``fatal``: the group is gone (its runners are killed); requests on it must fail over (the
    resume work replays them on the next plan). Not fatal: only this request was refused.
    """

    def __init__(self, message: str, *, fatal: bool = True) -> None:
        super().__init__(message)
        self.fatal = fatal


class RunnerState(Enum):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class StepOutput:
    """A stage's output as it travels: dtype name, shape and C-order bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


class TensorParallelMember:
    """This node's rank of one TP stage: its runner process and the channel to it."""

    _ids = itertools.count(1)

    def __init__(
        self,
        spec: TensorParallelSpec,
        rank: int,
        *,
        python: str = sys.executable,
        command_prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        if not 0 <= rank < spec.size:
            raise TensorParallelUnsupported(f"rank {rank} is outside a group of {spec.size}")
        self._on_change = on_change  # told (on the loop) whenever state or error change
        self.spec = spec
        self.rank = rank
        self._startup_timeout_s = startup_timeout_s
        launcher = [*command_prefix, python]
        self._runner = RunnerProcess(spec, rank, launcher, env or {}, startup_timeout_s)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[tuple[dict[str, Any], bytes]]] = {}
        self.state = RunnerState.NEW
        self.error: str | None = None
        self.ready_info: dict[str, Any] = {}
        self.started_at: float | None = None

    # ------------------------------------------------------------------ lifetime

    @property
    def pid(self) -> int | None:
        return self._runner.pid

    @property
    def alive(self) -> bool:
        return self._runner.alive

    async def start(self) -> None:
        """Start the runner and wait until its rank is loaded and the group formed (bounded by
        the start-up timeout). On any failure the runner is killed and TensorParallelError
        raised with the runner's own reason when it gave one."""
        if self.state is not RunnerState.NEW:
            raise RuntimeError(f"runner of {self.spec.name} rank {self.rank} was started already")
        self.state = RunnerState.STARTING
        self.started_at = time.monotonic()
        self._changed()
        try:
            check_tensor_parallel(self.spec.model_dir, self.spec.size, self.spec.expert_ranges)
            self._reader, self._writer = await self._runner.spawn()
            header = await self._first_frame()
        except TensorParallelUnsupported as error:
            self._fail(str(error))
            raise TensorParallelError(str(error)) from error
        except BaseException as error:
            self._fail(f"start-up failed: {error or type(error).__name__}")
            raise
        if header.get("type") != "ready":
            reason = str(header.get("message") or f"unexpected {header.get('type')!r} frame")
            self._fail(reason)
            raise TensorParallelError(f"{self.spec.name} rank {self.rank}: {reason}")
        self.ready_info = {k: v for k, v in header.items() if k != "type"}
        self.state = RunnerState.READY
        self._changed()
        self._runner.cleanup()  # the spec (with its token) and the hostfile were read at start-up
        self._reader_task = asyncio.get_running_loop().create_task(
            self._read_replies(), name=f"tp-reader-{self.spec.name}-{self.rank}"
        )
        log.info(
            "%s rank %d ready (pid %s, %.1f s, %s bytes)",
            self.spec.name,
            self.rank,
            self.pid,
            time.monotonic() - self.started_at,
            self.ready_info.get("held_bytes"),
        )

    async def _first_frame(self) -> dict[str, Any]:
        assert self._reader is not None
        # The runner gives up at its own start-up deadline and says why; this one is later,
        # for a runner that cannot even say that.
        wait_s = self._startup_timeout_s + STARTUP_MARGIN_S
        try:
            async with asyncio.timeout(wait_s):
                frame = await read_frame_async(self._reader)
        except TimeoutError:
            raise TensorParallelError(
                f"{self.spec.name} rank {self.rank} was not ready within {wait_s:g} s"
            ) from None
        if frame is None:
            code = await asyncio.to_thread(self._runner.wait_exit, STOP_TIMEOUT_S)
            raise TensorParallelError(
                f"{self.spec.name} rank {self.rank}: the runner exited during start-up "
                f"(exit code {code}); see its log lines above"
            )
        return frame[0]

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the runner to stop (rank 0 stops the others too), then make sure it is gone:
        SIGKILL by PID after ``timeout_s``. Pending steps fail."""
        if self.state in (RunnerState.STOPPED, RunnerState.NEW):
            self.state = RunnerState.STOPPED
            self._runner.cleanup()
            return
        if self.state is RunnerState.READY:
            self.state = RunnerState.STOPPED  # the runner's end-of-file is now expected
        if self.alive and self._writer is not None:
            with contextlib.suppress(OSError, RuntimeError):
                self._writer.write(encode_frame({"type": "stop"}))
                await asyncio.wait_for(self._writer.drain(), timeout_s)
        code = await asyncio.to_thread(self._runner.wait_exit, timeout_s)
        if code is None:
            self._runner.kill()
        if self.state is not RunnerState.FAILED:
            self.state = RunnerState.STOPPED
        self._fail_pending(TensorParallelError(f"{self.spec.name} was stopped"))
        await self._close_channel()
        self._runner.cleanup()
        self._changed()

    def abort(self, reason: str) -> None:
        """Kill the runner now (SIGKILL by PID) and fail every pending step with ``reason``.
        Safe to call from the loop at any time, also repeatedly."""
        if self.state in (RunnerState.STOPPED, RunnerState.NEW) and not self.alive:
            return
        log.warning(
            "%s rank %d: aborting runner pid %s: %s", self.spec.name, self.rank, self.pid, reason
        )
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        self.error = self.error or reason
        self.state = RunnerState.FAILED
        self._runner.kill()
        self._fail_pending(TensorParallelError(f"{self.spec.name}: {self.error}"))
        if self._writer is not None:
            self._writer.close()
        self._runner.cleanup()
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:  # a status hook must never break the runner's bookkeeping
                log.exception("the runner status hook failed")

    async def _close_channel(self) -> None:
        if self._reader_task is not None and not self._reader_task.done():
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()

    # ------------------------------------------------------------------ steps

    async def run(
        self,
        request_id: str,
        dtype: str,
        shape: Sequence[int],
        data: bytes | memoryview,
        *,
        logits: str = "last",
        timeout_s: float | None = None,
    ) -> StepOutput:
        """One step of ``request_id`` through the stage (rank 0 only): token ids ``int32 (1, n)``
        on the first stage, hidden states ``(1, n, hidden)`` after it; returns hidden states, or
        on the last stage logits of the ``"last"`` position, ``"all"`` positions or
        (``"none"``) the hidden states. Steps of one request must be awaited in order.

        Deadline: ``timeout_s`` (default: the spec's step timeout plus a margin). A step that
        overruns it, or any failure of the group, kills the runner and raises a fatal
        TensorParallelError; a refused step (bad input, too many requests) raises a non-fatal
        one and leaves the group serving.
        """
        if self.rank != 0:
            raise TensorParallelError(
                f"only rank 0's daemon runs steps of {self.spec.name}", fatal=False
            )
        check_array(array_fields(dtype, shape), data)
        header = {
            "type": "run",
            "request": request_id,
            "logits": logits,
            **array_fields(dtype, shape),
        }
        reply, payload = await self._call(header, data, timeout_s)
        out_dtype, out_shape = check_array(reply, payload)
        return StepOutput(out_dtype, out_shape, payload)

    async def forward(
        self, request_id: str, inputs: Any, *, logits: str = "last", timeout_s: float | None = None
    ) -> Any:
        """:meth:`run` with ``mx.array`` (or token id list) in and out, like
        :meth:`meshd.inference.stage.shard.StageModel.run`."""
        import mlx.core as mx

        from meshd.inference.tensor_parallel.wire import from_mx, to_mx

        if isinstance(inputs, list | tuple):
            inputs = mx.array([list(inputs)], dtype=mx.int32)
        dtype, shape, data = from_mx(inputs)
        output = await self.run(request_id, dtype, shape, data, logits=logits, timeout_s=timeout_s)
        return to_mx(output.dtype, output.shape, output.data)

    async def release(self, request_id: str, *, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Free ``request_id``'s caches on every rank (no error if it has none)."""
        if self.rank != 0:
            return
        await self._call({"type": "release", "request": request_id}, b"", timeout_s)

    async def stats(self, timeout_s: float = STOP_TIMEOUT_S) -> dict[str, Any]:
        """The runner's counters and MLX memory (any rank)."""
        reply, _ = await self._call({"type": "stats"}, b"", timeout_s)
        return {k: v for k, v in reply.items() if k not in ("type", "id")}

    async def _call(
        self, header: dict[str, Any], data: bytes | memoryview, timeout_s: float | None
    ) -> tuple[dict[str, Any], bytes]:
        if self.state is not RunnerState.READY or self._writer is None:
            raise TensorParallelError(
                f"{self.spec.name} rank {self.rank} is {self.state.value}"
                + (f": {self.error}" if self.error else "")
            )
        call_id = next(self._ids)
        future: asyncio.Future[tuple[dict[str, Any], bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[call_id] = future
        deadline = (
            timeout_s
            if timeout_s is not None
            else (self.spec.step_timeout_s + RUN_DEADLINE_MARGIN_S)
        )
        try:
            self._writer.write(encode_frame({**header, "id": call_id}, data))
            async with asyncio.timeout(deadline):
                await self._writer.drain()
                reply, payload = await future
        except TimeoutError:
            self.abort(f"a {header['type']} step took longer than {deadline:g} s")
            raise TensorParallelError(
                f"{self.spec.name}: a step took longer than {deadline:g} s; the group was torn down"
            ) from None
        except (ConnectionError, RuntimeError) as error:
            if isinstance(error, TensorParallelError):
                raise
            self.abort(f"the runner's channel failed: {error}")
            raise TensorParallelError(f"{self.spec.name}: {error}") from error
        finally:
            self._pending.pop(call_id, None)
        if reply.get("type") == "error":
            fatal = bool(reply.get("fatal"))
            message = f"{self.spec.name}: {reply.get('message')}"
            if fatal:
                self.abort(str(reply.get("message")))
            raise TensorParallelError(message, fatal=fatal)
        return reply, payload

    async def _read_replies(self) -> None:
        """Owner of the channel's read side: replies to their callers; end-of-file or a bad
        frame means the runner is gone, which fails the group."""
        assert self._reader is not None
        reason = "the runner exited"
        lost: str | None = None  # the runner's own word on why the group ended
        try:
            while True:
                frame = await read_frame_async(self._reader)
                if frame is None:
                    break
                header, payload = frame
                if header.get("type") == "lost":
                    lost = str(header.get("message") or "the group was lost")
                    continue
                future = self._pending.get(header.get("id"))  # type: ignore[arg-type]
                if future is not None and not future.done():
                    future.set_result((header, payload))
        except FrameError as error:
            reason = f"the runner sent a malformed frame: {error}"
        except (ConnectionError, OSError) as error:
            reason = f"the runner's channel failed: {error}"
        reason = lost or reason
        if self.state is RunnerState.READY:
            code = await self._runner.exit_code_soon()
            detail = f"{reason} (exit code {code})" if code is not None else reason
            self.abort(detail)

    def _fail_pending(self, error: TensorParallelError) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """What ``meshd status`` shows for this rank (no secrets)."""
        return {
            "plan_id": self.spec.plan_id,
            "stage": self.spec.stage_index,
            "layers": list(self.spec.layer_range),
            "rank": self.rank,
            "size": self.spec.size,
            "backend": self.spec.backend,
            "link": self.spec.link,
            "members": [{"node_id": m.node_id, "address": m.address} for m in self.spec.members],
            "experts": [list(pair) for pair in self.spec.expert_ranges],
            "state": self.state.value,
            "pid": self.pid,
            "error": self.error,
            **{k: v for k, v in self.ready_info.items() if k in ("held_bytes", "load_s")},
        }


class RunnerSupervisor:
    """Every TP runner of one node: started per plan, stopped with it, killed on loss.

    The data plane calls :meth:`start` when a plan with a TP stage holding this node is
    installed, :meth:`stop_plan` when it is uninstalled, :meth:`member_lost` when the mesh's
    liveness reports a node lost, and shows :meth:`status`.
    """

    def __init__(
        self,
        node_id: str,
        *,
        python: str = sys.executable,
        command_prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self._python = python
        self._prefix = list(command_prefix)
        self._env = dict(env or {})
        self._startup_timeout_s = startup_timeout_s
        self._on_change = on_change  # told whenever a runner starts, stops or fails
        self._members: dict[tuple[str, int], TensorParallelMember] = {}

    def set_on_change(self, on_change: Callable[[], None] | None) -> None:
        """Call ``on_change()`` (on the loop) whenever a runner starts, stops or fails."""
        self._on_change = on_change

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def member(self, plan_id: str, stage_index: int) -> TensorParallelMember | None:
        return self._members.get((plan_id, stage_index))

    async def start(self, spec: TensorParallelSpec) -> TensorParallelMember:
        """Start this node's rank of ``spec`` and wait until the group is ready."""
        key = (spec.plan_id, spec.stage_index)
        if key in self._members:
            raise TensorParallelError(f"{spec.name} already has a runner on this node", fatal=False)
        rank = spec.rank_of(self.node_id)
        holders = self.plans_holding_ports(spec)
        if holders:
            other = self._members[holders[0]]
            raise TensorParallelError(
                f"{spec.name} would listen on a port {other.spec.name}'s runner still "
                "holds; it can start once that plan's runners stop"
            )
        member = TensorParallelMember(
            spec,
            rank,
            python=self._python,
            command_prefix=self._prefix,
            env=self._env,
            startup_timeout_s=self._startup_timeout_s,
            on_change=self._changed,
        )
        self._members[key] = member
        try:
            await member.start()
        except BaseException:
            self._members.pop(key, None)
            self._changed()
            raise
        return member

    def plans_holding_ports(self, spec: TensorParallelSpec) -> list[tuple[str, int]]:
        """The (plan, stage) of live runners here that hold a port ``spec``'s rank of this
        node would listen on (two plans' slots coincide 1 time in 64)."""
        mine = spec.members[spec.rank_of(self.node_id)]
        wanted = {(mine.host, mine.port), spec.control_address}
        return [
            key
            for key, other in self._members.items()
            if key != (spec.plan_id, spec.stage_index) and other.alive and _ports(other) & wanted
        ]

    async def stop_plan(self, plan_id: str) -> None:
        """Stop every runner of ``plan_id`` on this node (bounded; SIGKILL if needed)."""
        keys = [key for key in self._members if key[0] == plan_id]
        await asyncio.gather(*(self._members.pop(key).stop() for key in keys))
        if keys:
            self._changed()

    def abort_starting(self, plan_id: str, reason: str) -> list[str]:
        """Kill the runners of ``plan_id`` still starting (their group waits for members that
        will not come: the plan was withdrawn); returns the stages' names."""
        aborted = []
        for (plan, _), member in self._members.items():
            if plan == plan_id and member.state is RunnerState.STARTING:
                member.abort(reason)
                aborted.append(member.spec.name)
        return aborted

    def member_lost(self, node_id: str, reason: str = "a group member was lost") -> list[str]:
        """Kill at once every runner whose group includes ``node_id`` (its collectives would
        hang); returns the affected stages' names."""
        affected = []
        for member in self._members.values():
            if any(m.node_id == node_id for m in member.spec.members):
                member.abort(f"{reason}: {node_id}")
                affected.append(member.spec.name)
        return affected

    def status(self) -> list[dict[str, Any]]:
        return [member.status() for member in self._members.values()]

    async def close(self) -> None:
        members = list(self._members.values())
        self._members.clear()
        await asyncio.gather(*(member.stop() for member in members), return_exceptions=True)
        self._changed()


def _ports(member: TensorParallelMember) -> set[tuple[str, int]]:
    mine = member.spec.members[member.rank]
    return {(mine.host, mine.port), member.spec.control_address}
