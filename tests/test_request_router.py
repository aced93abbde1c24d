"""The request router on real data planes: a request that meets a plan switch or a stage still
loading before its first token is started again; after that, or on a plan the client named,
the failure reaches the client.

Two in-process nodes (real gRPC, mutual TLS, a tiny random llama split in two, see
``tests/support/dataplane_mesh.py``); the router reads a serving snapshot the test controls,
as the daemon's plan installer would publish it.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshd.inference.errors import ErrorKind, InferenceError
from meshd.inference.generation_events import FinalEvent, Finished, Piece, TokenEvent
from meshd.inference.install.installer import InstallProgress, ServingSnapshot
from meshd.inference.router import RequestRouter, Routed, fit_context
from meshd.inference.sampling import SamplingParams
from tests.support.dataplane_mesh import LoopThread, Mesh
from tests.support.random_model import make_random_model_dir

pytestmark = pytest.mark.integration

LAYOUT = [("n1", (0, 3)), ("n2", (3, 6))]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    loop = LoopThread()
    built = Mesh(loop, tmp_path_factory.mktemp("mesh"))
    try:
        for node in ("n1", "n2"):
            built.add_node(node)
        yield built
    finally:
        built.close()
        loop.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("model")
    return make_random_model_dir(
        root / "llama", "llama", layers=6, hidden=64, heads=4, kv_heads=2, vocab=320, seed=5
    )


class Snapshots:
    """What the installer would publish: ``views`` in turn, one per plan pick, the last
    one for good (this node learns of a new plan a moment after a stage did)."""

    def __init__(self, *views: ServingSnapshot) -> None:
        self._views = list(views)
        self.reads = 0

    def __call__(self) -> ServingSnapshot:
        self.reads += 1
        return self._views.pop(0) if len(self._views) > 1 else self._views[0]


def serving(active: str, *others: str) -> ServingSnapshot:
    return ServingSnapshot(frozenset({active, *others}), active, "llama")


async def routed_events(router: RequestRouter, plan_id: str = "") -> list[Any]:
    """Every event of one request through the router, ending with its error if it fails."""
    events: list[Any] = []
    try:
        async for event in router.generate(
            prompt="hello mesh",
            messages=None,
            sampling=SamplingParams(max_tokens=5),
            model="",
            plan_id=plan_id,
            chat_template=False,
        ):
            events.append(event)
    except InferenceError as error:
        events.append(error)
    return events


def route(mesh: Mesh, router: RequestRouter, plan_id: str = "") -> list[Any]:
    return mesh.loop.run(routed_events(router, plan_id), timeout=30)


def loaded_here(mesh: Mesh, *plan_ids: str) -> InstallProgress:
    progress = InstallProgress()
    for plan_id in plan_ids:
        mesh.loop.run(progress.mark_loaded(plan_id))
    return progress


def test_a_request_that_meets_a_newer_plan_moves_to_it(mesh: Mesh, model_dir: Path) -> None:
    old, new = mesh.assignment_for(model_dir, LAYOUT), mesh.assignment_for(model_dir, LAYOUT)
    mesh.install(old)
    mesh.install(new)
    mesh.nodes["n2"].committed.discard(old.plan_id)  # n2 has moved on; n1 does not know yet
    try:
        snapshots = Snapshots(serving(old.plan_id, new.plan_id), serving(new.plan_id))
        router = RequestRouter(
            mesh.nodes["n1"].plane, snapshots, loaded_here(mesh, old.plan_id, new.plan_id)
        )
        events = route(mesh, router)
        assert [(e.plan_id, e.model) for e in events if isinstance(e, Routed)] == [
            (old.plan_id, "llama"),
            (new.plan_id, "llama"),
        ]
        assert isinstance(events[-1], FinalEvent), events[-1]
        assert sum(isinstance(e, TokenEvent) for e in events) >= 1

        # A plan the client named is not swapped for another: the stage's refusal reaches it.
        snapshots = Snapshots(serving(old.plan_id, new.plan_id))
        router = RequestRouter(
            mesh.nodes["n1"].plane, snapshots, loaded_here(mesh, old.plan_id, new.plan_id)
        )
        (routed, error) = route(mesh, router, plan_id=old.plan_id)
        assert (routed.plan_id, routed.model) == (old.plan_id, "llama")
        assert isinstance(error, InferenceError) and error.kind is ErrorKind.NO_PLAN
        assert f"plan {old.plan_id} is not committed on node n2" in str(error)
    finally:
        mesh.uninstall(old.plan_id)
        mesh.uninstall(new.plan_id)


def test_a_request_waits_for_a_stage_that_is_still_loading(mesh: Mesh, model_dir: Path) -> None:
    plan = mesh.assignment_for(model_dir, LAYOUT)
    mesh.install(plan, nodes=["n1"])
    mesh.nodes["n2"].committed.add(plan.plan_id)  # committed there, not loaded yet
    try:
        router = RequestRouter(
            mesh.nodes["n1"].plane,
            Snapshots(serving(plan.plan_id)),
            loaded_here(mesh, plan.plan_id),
        )

        async def load_later() -> None:
            await asyncio.sleep(0.6)  # a few refused attempts first
            await mesh.nodes["n2"].plane.install(plan)

        async def both() -> list[Any]:
            events, _ = await asyncio.gather(routed_events(router), load_later())
            return events

        events = mesh.loop.run(both(), timeout=30)
        routes = [e for e in events if isinstance(e, Routed)]
        assert len(routes) >= 2, "the first attempts are refused while n2 loads"
        assert {(r.plan_id, r.model) for r in routes} == {(plan.plan_id, "llama")}
        assert isinstance(events[-1], FinalEvent), events[-1]
    finally:
        mesh.uninstall(plan.plan_id)


def test_a_request_that_arrives_before_the_plan_commits_here_waits_for_it(
    mesh: Mesh, model_dir: Path
) -> None:
    """The plan commits on each member a moment apart, and a node that just started may not
    yet know the mesh's model: a request that reaches it then waits for the plan instead of
    failing with "no model is selected" (`meshd demo` asked the last node to commit, and
    failed so about one run in seven)."""
    plan = mesh.assignment_for(model_dir, LAYOUT)
    mesh.install(plan)
    try:
        not_yet = ServingSnapshot()  # started a moment ago: no selection, no plan heard of
        selected = ServingSnapshot(model="llama")  # the model is known, the plan not yet
        snapshots = Snapshots(not_yet, not_yet, selected, selected, serving(plan.plan_id))
        router = RequestRouter(mesh.nodes["n1"].plane, snapshots, loaded_here(mesh, plan.plan_id))
        events = route(mesh, router)
        assert snapshots.reads >= 5, "it asked again until the plan was committed"
        assert [(e.plan_id, e.model) for e in events if isinstance(e, Routed)] == [
            (plan.plan_id, "llama")
        ]
        assert isinstance(events[-1], FinalEvent), events[-1]
    finally:
        mesh.uninstall(plan.plan_id)


def test_a_node_still_checking_its_own_model_keeps_the_request_waiting(
    mesh: Mesh, model_dir: Path
) -> None:
    """A node started with `--model` selects it once its profile is measured, which on a
    busy machine outlasts the time given to hear the peers: a request waits for that model,
    not "no model is selected" (the demo's second node failed so under load)."""
    plan = mesh.assignment_for(model_dir, LAYOUT)
    mesh.install(plan)
    try:
        nothing = ServingSnapshot()
        snapshots = Snapshots(nothing, nothing, nothing, serving(plan.plan_id))
        checking = iter(["llama", "llama", "llama"])
        router = RequestRouter(
            mesh.nodes["n1"].plane,
            snapshots,
            loaded_here(mesh, plan.plan_id),
            hearing_s=0.0,
            selecting=lambda: next(checking, ""),
        )
        events = route(mesh, router)
        assert [(e.plan_id, e.model) for e in events if isinstance(e, Routed)] == [
            (plan.plan_id, "llama")
        ]
        assert isinstance(events[-1], FinalEvent), events[-1]
    finally:
        mesh.uninstall(plan.plan_id)


def test_with_no_model_selected_after_the_start_a_request_fails_at_once(mesh: Mesh) -> None:
    """Once this node has had time to hear its peers, no selection is an answer: no wait."""
    router = RequestRouter(
        mesh.nodes["n1"].plane, Snapshots(ServingSnapshot()), InstallProgress(), hearing_s=0.0
    )
    (error,) = route(mesh, router)
    assert isinstance(error, InferenceError) and error.kind is ErrorKind.NO_MODEL
    assert not error.kind.retryable  # HTTP clients must not ask again: someone must load one
    assert "no model is selected in this mesh; load one with `meshd load MODEL`" in str(error)


def test_a_refusal_is_answered_at_once(mesh: Mesh) -> None:
    refused = ServingSnapshot(model="llama", refusal="not enough memory in this mesh")
    router = RequestRouter(mesh.nodes["n1"].plane, Snapshots(refused), InstallProgress())
    (error,) = route(mesh, router)
    assert isinstance(error, InferenceError) and error.kind is ErrorKind.NO_PLAN
    assert "not enough memory in this mesh" in str(error)


def test_the_client_stream_is_routed_then_pieces_then_finished(mesh: Mesh, model_dir: Path) -> None:
    """What every API renders: the route, a piece per token with text (the token with it),
    the text held back as a last piece, and the end with its usage and serving plan."""
    plan = mesh.assignment_for(model_dir, LAYOUT)
    mesh.install(plan)
    router = RequestRouter(
        mesh.nodes["n1"].plane, Snapshots(serving(plan.plan_id)), loaded_here(mesh, plan.plan_id)
    )

    async def stream() -> list[Any]:
        request = {"prompt": "hello mesh", "messages": None, "model": "", "plan_id": ""}
        sampling = SamplingParams(max_tokens=6)
        events = router.stream(sampling=sampling, chat_template=False, **request)
        return [event async for event in events]

    try:
        events = mesh.loop.run(stream(), timeout=30)
    finally:
        mesh.uninstall(plan.plan_id)
    assert isinstance(events[0], Routed) and events[0].plan_id == plan.plan_id
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.plan_id == plan.plan_id
    assert finished.model == "llama" and finished.completion_tokens == 6
    pieces = [event for event in events[1:-1] if isinstance(event, Piece)]
    assert len(pieces) == len(events) - 2 and all(piece.text for piece in pieces)
    assert all(piece.token is not None for piece in pieces[:-1])


def test_an_unset_max_tokens_is_lowered_to_the_context_and_a_given_one_is_kept() -> None:
    unset = SamplingParams(max_tokens_given=False)  # the default, 256
    assert fit_context(unset, prompt=100, context=200).max_tokens == 100
    given = SamplingParams(max_tokens=256)
    assert fit_context(given, prompt=100, context=200) is given  # the origin refuses it
    assert fit_context(unset, prompt=10, context=0) is unset  # no limit
