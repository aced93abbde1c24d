"""The plan installer: turns the agreement's committed plans into running stages.

The agreement (:mod:`meshd.agreement.service`) says which plan is committed; this component
applies each change, one at a time and in order, on the trio thread: a committed plan is
installed on the data plane (this node fetches its part of the model from a peer if it has
no copy, then loads only its own layers on the compute thread), a withdrawn one is
uninstalled (its running requests end with the agreement's reason), and a draining one is
released as soon as no request runs on it here. An install that failed is tried again while
its plan stays the active one (`_apply_in_order`): a part no live peer could send yet, a
runner's port held for a moment, must not leave a committed plan unserved until a re-plan.

What it shares with the asyncio thread, and how (nothing else crosses):

* :class:`ServingSnapshot` (the plans this node serves, the active one, the model, why there
  is none) is immutable; the installer replaces it after every agreement step, and
  :class:`meshd.inference.fencing.CommittedPlans` (the data plane's fencing) with it.
* :class:`InstallProgress` (which plans are loaded here, which failed and why) lives on the
  asyncio thread; the installer changes it only through the bridge.

Tensor-parallel stages: a member of one derives the group's spec from the plan and the node
states it was computed from (:func:`meshd.inference.tensor_parallel.groups.spec_for_stage`)
and installs it with the plan, which starts its runner; the installer also tells the data
plane at once when membership loses a node (its groups' runners must die now, not when the
agreement withdraws the plan), and stops runners still waiting for a group whose plan was
withdrawn meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from meshd.agreement.contract import PlanChange, PlanSource
from meshd.inference.assignment import Assignment
from meshd.inference.fencing import CommittedPlans
from meshd.inference.install.hub_fetch import HubFetch
from meshd.inference.serving.dataplane import DataPlane
from meshd.inference.tensor_parallel.groups import spec_for_stage
from meshd.inference.tensor_parallel.spec import TensorParallelSpec
from meshd.mesh.membership import EventLog, Membership
from meshd.models.hub import parse_hub_path
from meshd.models.hub_share import HubDownloads
from meshd.models.share import FETCH_TIMEOUT_S, PartSpec, mark_used, prune_parts, receive_part
from meshd.runtime.bridge import AsyncioThread
from meshd.wire import pb

log = logging.getLogger("meshd.inference")

DRAIN_CHECK_S = 0.5
LOADED_PLANS_PUBLISHED = 4  # the newest plans this node says it has loaded
INSTALL_RETRY_FIRST_S = 2.0  # a plan that failed to load here is tried again after this,
INSTALL_RETRY_MAX_S = 60.0  # then at doubling intervals up to this, while it stays active
# How often to look for a tensor-parallel runner of the active plan that ended once ready.
RUNNER_CHECK_S = 2.0


@dataclass(frozen=True)
class ServingSnapshot:
    """What the asyncio side may read of the agreement: the plans served here, the active
    one, the selected model, and why no plan is active (when none is)."""

    serving: frozenset[str] = frozenset()
    active: str = ""
    model: str = ""
    refusal: str = ""


class InstallProgress:
    """Which plans this node has loaded, and which it cannot serve (and why).

    Asyncio thread only: the installer reaches it through the bridge, the request router
    waits on it.
    """

    def __init__(self) -> None:
        self._loaded: dict[str, asyncio.Event] = {}
        self._failures: dict[str, str] = {}

    def loaded(self, plan_id: str) -> asyncio.Event:
        """Set once ``plan_id`` is loaded here."""
        return self._loaded.setdefault(plan_id, asyncio.Event())

    def failure(self, plan_id: str) -> str | None:
        """Why this node cannot serve ``plan_id``, if it cannot."""
        return self._failures.get(plan_id)

    async def mark_loaded(self, plan_id: str) -> None:
        self._failures.pop(plan_id, None)  # a retry loaded it
        self.loaded(plan_id).set()

    async def mark_failed(self, plan_id: str, reason: str) -> None:
        self._failures[plan_id] = reason

    async def forget(self, plan_id: str) -> None:
        self._loaded.pop(plan_id, None)
        self._failures.pop(plan_id, None)


class PlanInstaller:
    """Installs committed plans on this node's data plane and uninstalls withdrawn ones."""

    def __init__(
        self,
        membership: Membership,
        agreement: PlanSource,
        bridge: AsyncioThread,
        events: EventLog,
        plane: DataPlane,
        committed: CommittedPlans,
        resolve_model_dir: Callable[[pb.ModelSelection], Path],
        parts_root: Path,
        mesh_secret: bytes = b"",
        mlx_held: Callable[[], int] | None = None,
        store_root: Path | None = None,
        hub_downloads: HubDownloads | None = None,
    ) -> None:
        self._membership = membership
        self._agreement = agreement
        self._bridge = bridge
        self._events = events
        self._plane = plane
        self._committed = committed
        self._resolve_model_dir = resolve_model_dir
        self._parts_root = parts_root
        self._store_root = store_root or parts_root  # where Hub manifests are kept
        self._hub_fetch = (
            HubFetch(membership, bridge, events, hub_downloads, self._store_root)
            if hub_downloads is not None
            else None
        )
        self._mesh_secret = mesh_secret  # tensor-parallel groups derive their token from it
        self._plan_parts: dict[str, Path] = {}  # plan id -> the fetched part it runs on
        self._mlx_held = mlx_held or _mlx_active_bytes  # bytes MLX holds now (weights, caches)
        self.snapshot = ServingSnapshot()
        self.progress = InstallProgress()
        self.moving = ""  # what is being installed now, in words (`meshd status`)
        self.last_install = ""  # the last plan installed here, in words

    def _refresh_snapshot(self) -> None:
        served = self._agreement.served()
        selection = self._agreement.selection
        self.snapshot = ServingSnapshot(
            served.ids,
            served.active,
            selection.name if selection else "",
            self._agreement.last_refusal or "",
        )
        self._committed.replace(served.ids, served.active, self._agreement.last_refusal or "")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply the agreement's changes in order; start it before the agreement runs, so
        that no change is published before this subscribes."""
        feed = self._agreement.changes
        with feed.subscribe() as changes, feed.subscribe() as fencing_updates:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._release_drained)
                nursery.start_soon(self._follow_fencing, fencing_updates)
                nursery.start_soon(self._follow_liveness)
                self._refresh_snapshot()
                task_status.started()
                await self._apply_in_order(changes)

    async def _apply_in_order(self, changes: trio.MemoryReceiveChannel[PlanChange]) -> None:
        """Apply the agreement's changes in order, and try a failed install again.

        A committed plan that could not load here (no peer could send a part yet, a runner's
        port held for a moment, a member's runner gone while the group formed) would
        otherwise stay unserved until the mesh happens to re-plan, since the plan is still
        the right one. So it is tried again after `INSTALL_RETRY_FIRST_S`, then at doubling
        intervals up to `INSTALL_RETRY_MAX_S`, for as long as it is the active plan. Likewise
        a tensor-parallel runner of the active plan that ended once ready, with its group's
        members all alive, is looked for every `RUNNER_CHECK_S` and its plan loaded again.
        """
        failed: PlanChange | None = None
        committed: PlanChange | None = None  # the newest committed change: what a reload reuses
        wait_s = INSTALL_RETRY_FIRST_S
        while True:
            change = None
            with trio.move_on_after(wait_s if failed is not None else RUNNER_CHECK_S):
                try:
                    change = await changes.receive()
                except trio.EndOfChannel:
                    return
            if change is not None:
                self._refresh_snapshot()
                loaded = await self._apply(change)
                if change.kind == "committed":
                    committed = change
                    failed, wait_s = (None if loaded else change), INSTALL_RETRY_FIRST_S
            elif failed is None:
                lost = self._runner_lost()
                if lost is not None and committed is not None and committed.plan_id == lost[0]:
                    reloaded = await self._reload(committed, lost[1])
                    failed, wait_s = (None if reloaded else committed), INSTALL_RETRY_FIRST_S
            elif self._agreement.served().active == failed.plan_id:
                self._events.add("trying plan %s here again", failed.plan_id[:12])
                if await self._install(failed):
                    failed = None
                wait_s = min(wait_s * 2, INSTALL_RETRY_MAX_S)
            if failed is not None and self._agreement.served().active != failed.plan_id:
                failed = None  # superseded or withdrawn: nothing to retry

    def _runner_lost(self) -> tuple[str, str] | None:
        """(plan id, why) when a tensor-parallel runner of the active plan here ended after it
        was ready (killed, out of memory, a peer's runner gone) while every member of its
        group is alive: nothing re-plans then, so the group must be formed again here."""
        active = self._agreement.served().active
        alive = {record.node_id for record in self._membership.alive_peers()}
        alive.add(self._membership.identity.node_id)
        for runner in self._plane.runner_status:  # replaced whole by the data plane
            members = {member["node_id"] for member in runner.get("members", ())}
            ended = runner.get("plan_id") == active and runner.get("state") == "failed"
            if ended and members <= alive:
                return active, str(runner.get("error") or "its runner ended")
        return None

    async def _reload(self, change: PlanChange, why: str) -> bool:
        """Uninstall the active plan here and install it again (its group forms anew: every
        member does the same, since each one's runner ended with the group)."""
        plan_id = change.plan_id
        self._events.add(
            "tensor-parallel runner of plan %s ended (%s): loading the plan here again",
            plan_id[:12],
            why,
            level=logging.WARNING,
        )
        await self._bridge.run(
            _unload_plan, self._plane, self.progress, plan_id, f"its runner ended: {why}"
        )
        self._publish_loaded(plan_id, loaded=False)
        return await self._install(change)

    async def _follow_fencing(self, updates: trio.MemoryReceiveChannel[PlanChange]) -> None:
        """Fencing follows every change at once, also while an install is still loading
        (a plan withdrawn meanwhile must be refused now, not once the load is done)."""
        async for change in updates:
            self._refresh_snapshot()
            if change.kind == "withdrawn":
                aborted = await self._bridge.run(
                    _abort_starting, self._plane, change.plan_id, f"withdrawn: {change.reason}"
                )
                for name in aborted:
                    self._events.add("stopped forming tensor-parallel stage %s: withdrawn", name)

    async def _follow_liveness(self) -> None:
        """Tell the data plane at once when a node is lost: the runners of its groups here
        are killed now (their collectives would hang), before the agreement re-plans."""
        alive = {record.node_id for record in self._membership.alive_peers()}
        with self._membership.changes.subscribe() as changes:
            async for _ in changes:
                now = {record.node_id for record in self._membership.alive_peers()}
                for node in sorted(alive - now):
                    record = self._membership.peers.get(node)
                    why = record.lost_reason if record is not None else "gone"
                    reason = f"a group member was lost ({why})"  # the runner adds: <node>
                    stages = await self._bridge.run(_member_lost, self._plane, node, reason)
                    for name in stages:
                        self._events.add(
                            "tensor-parallel stage %s stopped: node %s lost (%s)", name, node, why
                        )
                alive = now

    async def _apply(self, change: PlanChange) -> bool:
        """Apply one change; False when a committed plan could not be loaded here."""
        if change.kind == "committed" and change.plan is not None:
            return await self._install(change)
        if change.kind == "withdrawn":
            await self._bridge.run(
                _unload_plan, self._plane, self.progress, change.plan_id, change.reason
            )
            self._plan_parts.pop(change.plan_id, None)
            self._publish_loaded(change.plan_id, loaded=False)
        return True

    def _publish_loaded(self, plan_id: str, *, loaded: bool) -> None:
        """Tell the peers (gossiped NodeState) which plans this node has loaded: a leaving
        peer waits for the stages of the plan without it before it hands requests over."""
        plans = [held for held in self._membership.loaded_plans if held != plan_id]
        if loaded:
            plans.append(plan_id)
        self._membership.set_loaded_plans(tuple(plans[-LOADED_PLANS_PUBLISHED:]))

    async def _install(self, change: PlanChange) -> bool:
        """Load this node's part of a committed plan; False (and why, in the events and for
        the requests that reach it) when it could not."""
        plan = change.plan
        assert plan is not None
        selection = self._agreement.selection
        if selection is None:
            return True  # no model to load: the next selection brings its own plan
        node = self._membership.identity.node_id
        stage = plan.stage_of(node)
        where = "no layers (origin only)"
        if stage is not None:
            held = plan.stages[stage]
            where = f"layers {held.layer_start}-{held.layer_end - 1}"
            if held.tensor_parallel:
                where += (
                    f" as rank {held.nodes.index(node)} of tensor-parallel group "
                    f"{'+'.join(held.nodes)}"
                )
        self.moving = f"loading plan {plan.plan_id[:12]}: {where}"
        try:
            model_dir = await self._model_dir_or_fetch(selection, plan)
            if model_dir.parent == self._parts_root:
                self._plan_parts[plan.plan_id] = model_dir
                await trio.to_thread.run_sync(mark_used, model_dir)
            assignment = Assignment.from_plan(plan, model_dir, self._addresses())
            colocated = self._colocated_stages(plan)
            group = self._group_spec(assignment, change)
        except Exception as exc:
            await self._bridge.run(_load_failed, self._plane, self.progress, plan.plan_id, exc)
            return self._failed(plan.plan_id, exc)
        # One crossing to the asyncio side does the rest of the change: free what is in the
        # way, load, and tell the requests that wait for it (docs/architecture.md counts it).
        budget = self._budget_for(plan)
        loaded = await self._bridge.run(
            _load_plan,
            self._plane,
            self.progress,
            LoadRequest(assignment, colocated, group, budget, self._mlx_held),
        )
        if loaded.freed:
            for plan_id in loaded.freed:
                self._publish_loaded(plan_id, loaded=False)
            assert budget is not None  # nothing is freed without one
            self._events.add(
                "freed the stage of plan %s before loading plan %s (%s): holding both needs "
                "%.0f MB, the budget leaves the model %.0f MB here",
                ", ".join(plan_id[:12] for plan_id in loaded.freed),
                plan.plan_id[:12],
                where,
                loaded.needed / 1e6,
                budget.allowance / 1e6,
            )
        if loaded.error is not None:
            return self._failed(plan.plan_id, loaded.error)
        self._publish_loaded(plan.plan_id, loaded=True)
        self.moving = ""
        self.last_install = f"plan {plan.plan_id[:12]}: {where} of {selection.name}"
        self._events.add("plan %s ready here: %s of %s", plan.plan_id[:12], where, selection.name)
        await self._prune_parts()
        return True

    def _failed(self, plan_id: str, error: BaseException) -> bool:
        self.moving = ""
        self._events.add("%s", _cannot_serve(plan_id, error), level=logging.ERROR)
        return False

    def _budget_for(self, plan: Any) -> LoadBudget | None:
        """What this node's budget allows MLX, and what its stage of ``plan`` needs on top of
        what MLX holds (None: the plan reserved nothing here, nothing is freed first).

        A node whose range moves would otherwise hold the old stage (its plan drains) and the
        new one at once: in MLX terms, what it holds now plus the new plan's weights, KV cache
        and activations, against what its budget leaves MLX (usable memory less the process
        overhead the plan reserves). The freed plans' requests through this node end fenced
        and their origins move them to the new plan (token replay: the same text); the load
        then takes the layers both stages run from the freed stage and reads only the rest.
        """
        node = self._membership.identity.node_id
        share = plan.memory_of(node)
        if share is None:
            return None
        return LoadBudget(
            allowance=share.usable_bytes - share.overhead_bytes,
            stage_bytes=share.weights_bytes + share.kv_cache_bytes + share.activation_bytes,
            reason=(
                f"plan {plan.plan_id[:12]} replaces it on node {node} (its old stage is freed "
                "first, to stay within the memory budget)"
            ),
        )

    def _group_spec(self, assignment: Assignment, change: PlanChange) -> TensorParallelSpec | None:
        """This node's tensor-parallel stage of the plan as its runner needs it, or None."""
        index = assignment.member_stage(self._membership.identity.node_id)
        if index is None or not assignment.stages[index].tensor_parallel:
            return None
        return spec_for_stage(
            plan_id=assignment.plan_id,
            stage_index=index,
            stage=assignment.stages[index],
            model_dir=assignment.model_dir,
            states=change.states,
            mesh_secret=self._mesh_secret,
        )

    async def _model_dir_or_fetch(self, selection: pb.ModelSelection, plan: Any) -> Path:
        """This node's copy of the model, or its part fetched from a peer that has one."""
        from meshd.models.store import UnknownModel

        try:  # a thread: it reads the store's entry from disk
            return await trio.to_thread.run_sync(self._resolve_model_dir, selection)
        except (UnknownModel, FileNotFoundError):
            pass
        if parse_hub_path(selection.path) is not None:
            return await self._fetch_from_hub(selection, plan)
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
        alive = {record.node_id for record in holders}
        hint = ""
        if selection.set_by not in alive and selection.set_by != self._membership.identity.node_id:
            hint = (
                f"; it was loaded on {selection.set_by}, which is gone: this node tries again "
                "while the plan stands, so it loads once a node with the model is back, or "
                "run `meshd load` with a model these nodes have"
            )
        raise RuntimeError(
            f"model {selection.name} is not on this node and no peer could send its part ("
            + ("; ".join(failures) or "no peer is connected")
            + ")"
            + hint
        )

    async def _fetch_from_hub(self, selection: pb.ModelSelection, plan: Any) -> Path:
        """The files this node's stage needs of a Hub repository (`hf:ORG/NAME@COMMIT`), into its HF
        cache, each file downloaded once per mesh (see `meshd.inference.install.hub_fetch`): from
        the Hub, or from the peer that downloads it while it arrives."""
        if self._hub_fetch is None:
            raise RuntimeError("this node was started without Hub downloads")
        label = self.moving
        self.moving = f"{label}: downloading {selection.name}"
        try:
            return await self._hub_fetch.fetch(selection, plan)
        finally:
            self.moving = label

    async def _prune_parts(self) -> None:
        """Delete fetched parts no installed plan uses (see `meshd.models.share`).

        Run after an install, not when a plan is withdrawn: a lost member withdraws the plan
        first and the next plan, which may need that very part, is committed a moment later.
        """
        in_use = list(self._plan_parts.values())
        deleted = await trio.to_thread.run_sync(prune_parts, self._parts_root, in_use)
        for path in deleted:
            self._events.add("deleted model part %s: no plan uses it", path.name)

    def _part_for(self, selection: pb.ModelSelection, plan: Any) -> PartSpec:
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

    def _colocated_stages(self, plan: Any) -> int:
        """Stages of `plan` on this machine (same machine fingerprint), this node included."""
        own = self._membership.profile.fingerprint
        if not own:
            return 1
        fingerprints = {self._membership.identity.node_id: own}
        for record in self._membership.alive_peers():
            if record.state is not None:
                fingerprints[record.node_id] = record.state.profile.fingerprint
        return max(1, sum(1 for node in plan.nodes if fingerprints.get(node) == own))

    def _addresses(self) -> dict[str, str]:
        addresses = {rec.node_id: rec.address for rec in self._membership.alive_peers()}
        own = self._membership.identity.node_id
        addresses[own] = f"127.0.0.1:{self._membership.grpc_port}"
        return addresses

    async def _release_drained(self) -> None:
        """Let the agreement drop a replaced plan once no request runs on it here."""
        while True:
            await trio.sleep(DRAIN_CHECK_S)
            for plan_id in self._agreement.served().draining:
                busy = await self._bridge.run(_count, self._plane, plan_id)
                if busy == 0:
                    self._agreement.release(plan_id)


@dataclass(frozen=True)
class LoadBudget:
    """This node's memory for a plan change: what its budget leaves MLX, what its new stage
    needs beyond what MLX holds now, and what a request on a stage freed first is told."""

    allowance: int
    stage_bytes: int
    reason: str


@dataclass(frozen=True)
class LoadRequest:
    """A committed plan's stage to load here, as the asyncio side needs it."""

    assignment: Assignment
    colocated: int
    group: TensorParallelSpec | None
    budget: LoadBudget | None
    mlx_held: Callable[[], int]


@dataclass(frozen=True)
class LoadOutcome:
    freed: tuple[str, ...] = ()  # plans whose stages were freed first
    needed: int = 0  # bytes holding both would have needed (when it freed)
    error: BaseException | None = None


async def _load_plan(plane: DataPlane, progress: InstallProgress, load: LoadRequest) -> LoadOutcome:
    """asyncio side of a committed plan: free the stages in the way when holding them and
    the new one would exceed the budget, load, and mark the plan loaded (or failed) for the
    requests that wait for it."""
    assignment = load.assignment
    freed: tuple[str, ...] = ()
    needed = 0
    in_the_way = plane.stages_to_free_for(assignment)
    if in_the_way and load.budget is not None:
        needed = load.mlx_held() + load.budget.stage_bytes
        if needed > load.budget.allowance:
            for plan_id in in_the_way:
                await plane.uninstall(plan_id, load.budget.reason)
            freed = tuple(in_the_way)
    try:
        await plane.install(assignment, colocated_stages=load.colocated, tensor_parallel=load.group)
    except Exception as exc:
        await _load_failed(plane, progress, assignment.plan_id, exc)
        return LoadOutcome(freed, needed, exc)
    await progress.mark_loaded(assignment.plan_id)
    return LoadOutcome(freed, needed)


async def _load_failed(
    plane: DataPlane, progress: InstallProgress, plan_id: str, error: BaseException
) -> None:
    """This node cannot serve ``plan_id``: requests waiting for it, and those reaching it,
    fail at once with the reason."""
    await progress.mark_failed(plan_id, _cannot_serve(plan_id, error))
    plane.record_load_failure(plan_id, str(error))


async def _unload_plan(
    plane: DataPlane, progress: InstallProgress, plan_id: str, reason: str
) -> None:
    """asyncio side of a withdrawn plan: its requests end with ``reason``, its stage goes."""
    await plane.uninstall(plan_id, reason)
    await progress.forget(plan_id)


def _cannot_serve(plan_id: str, error: BaseException) -> str:
    return f"cannot serve plan {plan_id[:12]} here: {error}"


def _mlx_active_bytes() -> int:
    import mlx.core as mx

    return int(mx.get_active_memory())


async def _member_lost(plane: DataPlane, node: str, reason: str) -> list[str]:
    return plane.member_lost(node, reason)


async def _abort_starting(plane: DataPlane, plan_id: str, reason: str) -> list[str]:
    return plane.abort_starting_runners(plan_id, reason)


async def _fetch_part(stub: Any, part: PartSpec, dest: Path) -> int:
    """asyncio side: stream the part from the peer into `dest`."""
    call = stub.FetchModelPart(part.to_request(), timeout=FETCH_TIMEOUT_S)
    return await receive_part(call, dest)


def _describe_part(part: PartSpec) -> str:
    if part.layer_end <= part.layer_start:
        return "the config and tokenizer"
    return f"layers {part.layer_start}-{part.layer_end - 1}"


async def _count(plane: DataPlane, plan_id: str) -> int:
    return plane.active_requests(plan_id)


def model_dir_for(selection: pb.ModelSelection, own_model: str | None, store_root: Path) -> Path:
    """Where this node keeps the selected model: its own --model directory, or its store."""
    from meshd.models.store import ModelStore

    if own_model:
        path = Path(own_model).expanduser()
        if path.is_dir() and path.name == selection.name:
            return path
    return ModelStore(store_root).model_dir(selection.name)
