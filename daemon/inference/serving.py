"""Model execution in the daemon: install committed plans on the data plane, serve requests.

The agreement (meshd.agreement.service) says which plan is committed; this component turns that
into running stages and answers the local API's Generate and Chat:

* **Plan changes** arrive on the trio thread and are applied one at a time, in order, by
  one task: a committed plan is installed (this node loads only its own layers, on the
  data plane's compute thread), a withdrawn one is uninstalled (its running requests end
  with the agreement's reason), a draining one is released as soon as no request runs on
  it here.
* **Requests** run on the asyncio thread (where grpc.aio and the data plane live). They go
  to the active plan, or to the plan the client names (fencing: a plan this node has not
  committed is refused). A request that arrives while the committed plan is still loading
  waits for it, bounded; bad input is refused before anything is sent.

Fencing reads `serving`, an immutable set the trio side replaces after every agreement
step, so the asyncio thread never looks into trio-owned state mid-change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from meshd.agreement.service import PlanAgreement, PlanChange
from meshd.inference.dataplane import Assignment, DataPlane, DataPlaneError, FinalEvent, TokenEvent
from meshd.inference.sampling import SamplingParams
from meshd.mesh.membership import EventLog, Membership
from meshd.models.share import (
    FETCH_TIMEOUT_S,
    PartSpec,
    mark_used,
    prune_parts,
    receive_part,
)
from meshd.runtime.bridge import AsyncioThread
from meshd.wire import pb

log = logging.getLogger("meshd.inference")

INSTALL_WAIT_S = 120.0
STAGE_LOADING_RETRY_S = 0.25
PLAN_PICK_ATTEMPTS = 3
ROLES = ("system", "user", "assistant", "tool")


class RequestError(Exception):
    """A request that cannot be served; `code` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Routed:
    """First event of a request: the plan (epoch) and model that serve it."""

    plan_id: str
    model: str
    prompt_tokens: int = 0


@dataclass(frozen=True)
class ServingSnapshot:
    """What the asyncio side may read: serving plan ids and the active one."""

    serving: frozenset[str] = frozenset()
    active: str = ""
    model: str = ""


class Inference:
    """Owns the data plane of one daemon and the installed plans."""

    def __init__(
        self,
        membership: Membership,
        agreement: PlanAgreement,
        bridge: AsyncioThread,
        events: EventLog,
        plane: DataPlane,
        resolve_model_dir,
        parts_root: Path,
    ) -> None:
        self._membership = membership
        self._agreement = agreement
        self._bridge = bridge
        self._events = events
        self.plane = plane
        self._resolve_model_dir = resolve_model_dir
        self._parts_root = parts_root
        self._plan_parts: dict[str, Path] = {}  # plan id -> the fetched part it runs on
        self.snapshot = ServingSnapshot()
        self._installed: dict[str, asyncio.Event] = {}
        self._install_errors: dict[str, str] = {}
        self._changes_send, self._changes_receive = trio.open_memory_channel[PlanChange](256)
        agreement.listeners.append(self._on_change)

    # ------------------------------------------------------------ trio side

    def check_serving(self, plan_id: str) -> None:
        """Fencing for the data plane (asyncio thread): raise unless the plan is committed."""
        if plan_id not in self.snapshot.serving:
            raise DataPlaneError(
                f"plan {plan_id[:12]} is not committed on node {self._membership.identity.node_id}"
                f" (it serves {', '.join(p[:12] for p in self.snapshot.serving) or 'no plan'})"
            )

    def _on_change(self, change: PlanChange) -> None:
        self._refresh_snapshot()
        self._changes_send.send_nowait(change)

    def _refresh_snapshot(self) -> None:
        core = self._agreement.core
        active = core.active.plan_id if core.active else ""
        serving = frozenset([active] * bool(active) + [served.plan_id for served in core.draining])
        selection = self._agreement.selection
        self.snapshot = ServingSnapshot(serving, active, selection.name if selection else "")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._release_drained)
            task_status.started()
            async for change in self._changes_receive:
                self._refresh_snapshot()
                if change.kind == "committed" and change.plan is not None:
                    await self._install(change)
                elif change.kind == "withdrawn":
                    await self._bridge.run(self.plane.uninstall, change.plan_id, change.reason)
                    self._installed.pop(change.plan_id, None)
                    self._plan_parts.pop(change.plan_id, None)

    async def _install(self, change: PlanChange) -> None:
        plan = change.plan
        assert plan is not None
        selection = self._agreement.selection
        if selection is None:
            return
        try:
            model_dir = await self._model_dir_or_fetch(selection, plan)
            if model_dir.parent == self._parts_root:
                self._plan_parts[plan.plan_id] = model_dir
                await trio.to_thread.run_sync(mark_used, model_dir)
            assignment = Assignment.from_plan(plan, model_dir, self._addresses())
            ready = await self._bridge.run(self._ready_event, plan.plan_id)
            self.plane.colocated_stages = self._colocated_stages(plan)
            await self._bridge.run(self.plane.install, assignment)
        except Exception as exc:
            reason = f"cannot serve plan {plan.plan_id[:12]} here: {exc}"
            self._install_errors[plan.plan_id] = reason
            await self._bridge.run(_record_load_failure, self.plane, plan.plan_id, str(exc))
            self._events.add("%s", reason, level=logging.ERROR)
            return
        self._bridge.loop.call_soon_threadsafe(ready.set)
        stage = plan.stage_of(self._membership.identity.node_id)
        where = (
            f"layers {plan.stages[stage].layer_start}-{plan.stages[stage].layer_end - 1}"
            if stage is not None
            else "no layers (origin only)"
        )
        self._events.add("plan %s ready here: %s of %s", plan.plan_id[:12], where, selection.name)
        await self._prune_parts()

    async def _model_dir_or_fetch(self, selection: pb.ModelSelection, plan) -> Path:
        """This node's copy of the model, or its part fetched from a peer that has one."""
        from meshd.models.store import UnknownModel

        try:
            return self._resolve_model_dir(selection)
        except (UnknownModel, FileNotFoundError):
            pass
        part = self._part_for(selection, plan)
        dest = self._parts_root / part.folder_name
        if dest.is_dir():
            return dest
        holders = sorted(
            (rec for rec in self._membership.alive_peers() if rec.stub is not None),
            key=lambda rec: (rec.node_id != selection.set_by, rec.node_id),
        )
        failures = []
        for record in holders:
            started = time.monotonic()
            try:
                received = await self._bridge.run(_fetch_part, record.stub, part, dest)
            except Exception as exc:
                failures.append(f"{record.node_id}: {exc}")
                continue
            self._events.add(
                "fetched %s of %s from %s: %.1f MB in %.1f s",
                _describe_part(part),
                part.name,
                record.node_id,
                received / 1e6,
                time.monotonic() - started,
            )
            return dest
        raise RuntimeError(
            f"model {selection.name} is not on this node and no peer could send its part ("
            + ("; ".join(failures) or "no peer is connected")
            + ")"
        )

    async def _prune_parts(self) -> None:
        """Delete fetched parts no installed plan uses (see `meshd.models.share`).

        Run after an install, not when a plan is withdrawn: a lost member withdraws the plan
        first and the next plan, which may need that very part, is committed a moment later.
        """
        in_use = list(self._plan_parts.values())
        deleted = await trio.to_thread.run_sync(prune_parts, self._parts_root, in_use)
        for path in deleted:
            self._events.add("deleted model part %s: no plan uses it", path.name)

    def _part_for(self, selection: pb.ModelSelection, plan) -> PartSpec:
        node = self._membership.identity.node_id
        index = plan.stage_of(node)
        if index is None:  # origin only: config and tokenizer
            return PartSpec(selection.name, selection.digest, 0, 0, False, False)
        stage = plan.stages[index]
        return PartSpec(
            selection.name,
            selection.digest,
            stage.layer_start,
            stage.layer_end,
            stage.has_embedding,
            stage.has_head,
        )

    def _colocated_stages(self, plan) -> int:
        """Stages of `plan` on this machine (same machine fingerprint), this node included."""
        own = self._membership.profile.fingerprint
        if not own:
            return 1
        fingerprints = {self._membership.identity.node_id: own}
        for record in self._membership.alive_peers():
            if record.state is not None:
                fingerprints[record.node_id] = record.state.profile.fingerprint
        return max(1, sum(1 for node in plan.nodes if fingerprints.get(node) == own))

    async def _ready_event(self, plan_id: str) -> asyncio.Event:
        return self._installed.setdefault(plan_id, asyncio.Event())

    def _addresses(self) -> dict[str, str]:
        addresses = {rec.node_id: rec.address for rec in self._membership.alive_peers()}
        own = self._membership.identity.node_id
        addresses[own] = f"127.0.0.1:{self._membership.grpc_port}"
        return addresses

    async def _release_drained(self) -> None:
        """Let the agreement drop a replaced plan once no request runs on it here."""
        while True:
            await trio.sleep(0.5)
            core = self._agreement.core
            for served in core.draining:
                busy = await self._bridge.run(_count, self.plane, served.plan_id)
                if busy == 0:
                    self._agreement.release(served.plan_id)

    # ------------------------------------------------------------ asyncio side (API)

    async def generate(
        self,
        *,
        prompt: str | None,
        messages: Sequence[Mapping[str, Any]] | None,
        sampling: pb.Sampling,
        model: str,
        plan_id: str,
        chat_template: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> AsyncIterator[Routed | TokenEvent | FinalEvent]:
        """Validate, pick the plan, tokenize and stream events (asyncio thread).

        The first event names the plan that serves the request: a request started on a plan
        finishes on it even when a newer plan is committed meanwhile (the old one drains).
        """
        params = sampling_params(sampling)
        if messages is None:
            if not prompt or not prompt.strip():
                raise RequestError("INVALID_ARGUMENT", "the prompt is empty; give some text")
        else:
            check_messages(messages)
        for attempt in range(PLAN_PICK_ATTEMPTS):
            snapshot, chosen = self._pick_plan(model, plan_id)
            try:
                await self._wait_installed(chosen)
                tokens = self._encode(chosen, prompt, messages, chat_template, tools)
                break
            except DataPlaneError as exc:
                # The plan was replaced and released between picking and tokenizing: pick the
                # new active plan, unless the client asked for this one.
                if plan_id or attempt == PLAN_PICK_ATTEMPTS - 1:
                    raise RequestError("UNAVAILABLE", f"{exc}; retry") from exc
        yield Routed(chosen, snapshot.model, len(tokens))
        loading_deadline = time.monotonic() + INSTALL_WAIT_S
        while True:
            request_id = secrets.token_hex(8)
            async with contextlib.aclosing(
                self.plane.generate(chosen, tokens, params, request_id=request_id)
            ) as events:
                async for event in events:
                    if (
                        isinstance(event, FinalEvent)
                        and event.stage_loading
                        and time.monotonic() < loading_deadline
                    ):
                        break  # another stage is still loading its layers: start again shortly
                    yield event
                else:
                    return
            await asyncio.sleep(STAGE_LOADING_RETRY_S)

    def _pick_plan(self, model: str, plan_id: str) -> tuple[ServingSnapshot, str]:
        """The plan a new request runs on (the one asked for, or the active one), or why none."""
        snapshot = self.snapshot
        if model and snapshot.model and model != snapshot.model:
            raise RequestError(
                "NOT_FOUND",
                f"model {model!r} is not loaded in this mesh (it runs {snapshot.model!r}); "
                "select it first with `meshd load`",
            )
        chosen = plan_id or snapshot.active
        if not chosen:
            reason = self._agreement.last_refusal or "the mesh has not agreed on a plan yet"
            if not snapshot.model:
                reason = "no model is selected; load one with `meshd load MODEL`"
            raise RequestError("FAILED_PRECONDITION", f"no committed plan: {reason}")
        if chosen not in snapshot.serving:
            raise RequestError(
                "FAILED_PRECONDITION",
                f"plan {chosen[:12]} is not committed on this node; the active plan is "
                f"{snapshot.active[:12] or 'none'}",
            )
        return snapshot, chosen

    def _encode(
        self,
        plan_id: str,
        prompt: str | None,
        messages: Sequence[Mapping[str, Any]] | None,
        chat_template: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        if tools and not self.plane.tokenizer(plan_id).has_tool_calling:
            raise RequestError(
                "INVALID_ARGUMENT",
                f"the chat template of {self.snapshot.model} does not support tools; "
                "send the request without tools",
            )
        if messages is not None:
            return self.plane.encode_chat(plan_id, messages, tools)
        if chat_template:
            return self.plane.encode_chat(plan_id, [{"role": "user", "content": prompt or ""}])
        return list(self.plane.tokenizer(plan_id).encode(prompt or ""))

    async def _wait_installed(self, plan_id: str) -> None:
        """Until this node has loaded `plan_id` (bounded); DataPlaneError if it stops serving it."""
        ready = self._installed.setdefault(plan_id, asyncio.Event())
        deadline = time.monotonic() + INSTALL_WAIT_S
        while not ready.is_set():
            if plan_id in self._install_errors:
                raise RequestError("UNAVAILABLE", self._install_errors[plan_id])
            if plan_id not in self.snapshot.serving:
                raise DataPlaneError(f"plan {plan_id[:12]} was withdrawn before it was loaded")
            if time.monotonic() >= deadline:
                raise RequestError(
                    "UNAVAILABLE", f"plan {plan_id[:12]} is still loading its model; retry shortly"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), STAGE_LOADING_RETRY_S)


async def _fetch_part(stub, part: PartSpec, dest: Path) -> int:
    """asyncio side: stream the part from the peer into `dest`."""
    call = stub.FetchModelPart(part.to_request(), timeout=FETCH_TIMEOUT_S)
    return await receive_part(call, dest)


def _describe_part(part: PartSpec) -> str:
    if part.layer_end <= part.layer_start:
        return "the config and tokenizer"
    return f"layers {part.layer_start}-{part.layer_end - 1}"


async def _record_load_failure(plane: DataPlane, plan_id: str, reason: str) -> None:
    plane.record_load_failure(plan_id, reason)


async def _count(plane: DataPlane, plan_id: str) -> int:
    return plane.active_requests(plan_id)


def sampling_params(sampling: pb.Sampling) -> SamplingParams:
    """The request's sampling settings, validated (bad values -> INVALID_ARGUMENT)."""
    fields = {
        name: getattr(sampling, name)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "seed",
            "max_tokens",
        )
        if sampling.HasField(name)
    }
    try:
        return SamplingParams(**fields, stop=tuple(sampling.stop))
    except (TypeError, ValueError) as exc:
        raise RequestError("INVALID_ARGUMENT", str(exc)) from exc


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise RequestError("INVALID_ARGUMENT", "a chat needs at least one message")
    for i, message in enumerate(messages):
        role = message.get("role", "")
        if role not in ROLES:
            raise RequestError(
                "INVALID_ARGUMENT",
                f"message {i} has role {role!r}; use one of {', '.join(ROLES)}",
            )
        if not (message.get("content") or "").strip() and not message.get("tool_calls"):
            raise RequestError("INVALID_ARGUMENT", f"message {i} ({role}) has no content")
    if messages[-1]["role"] == "assistant":
        raise RequestError(
            "INVALID_ARGUMENT", "the last message is from the assistant; end with a user message"
        )


def model_dir_for(selection: pb.ModelSelection, own_model: str | None, store_root: Path) -> Path:
    """Where this node keeps the selected model: its own --model directory, or its store."""
    from meshd.models.store import ModelStore

    if own_model:
        path = Path(own_model).expanduser()
        if path.is_dir() and path.name == selection.name:
            return path
    return ModelStore(store_root).model_dir(selection.name)
