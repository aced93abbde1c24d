"""The one adapter between the HTTP APIs and the daemon: requests, models, status.

Every HTTP API (OpenAI, Anthropic, Ollama, the dashboard) calls the node only through
`MeshBackend`, so that a change of the node's request path touches this module alone. A
request goes through exactly the path of the gRPC `Chat`/`Generate` (`node.router.generate`:
validation, plan choice, sampling, limits); this module only turns its events into
`Started`, `Piece` and `Finished`, and its one failure type (`InferenceError`, whose kind
carries the HTTP status) into a `BackendError` whose `kind` each API maps onto its HTTP
status and error shape.

Everything here runs on the daemon's asyncio thread (where the HTTP server, grpc.aio and the
data plane live); questions for the trio side go through the bridge, like the gRPC API's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from meshd.inference.errors import NO_MODEL_MESSAGE
from meshd.inference.generation_events import Finished, Piece, Routed
from meshd.inference.sampling import SamplingParams
from meshd.runtime.bridge import AsyncioThread
from meshd.wire import pb

ErrorKind = Literal[
    "bad_request", "not_found", "too_large", "unavailable", "queue_full", "internal"
]

# The HTTP status of the request path's error kind -> what went wrong, for HTTP.
KIND_OF_HTTP_STATUS: dict[int, ErrorKind] = {
    400: "bad_request",
    404: "not_found",
    429: "queue_full",
    503: "unavailable",
    500: "internal",
}
WATCH_KEEPALIVE_S = 5.0
LOAD_POLL_S = 0.5
# A refusal must last this long to end a load: the agreement may still hold the previous
# model's refusal, or re-plan, just after a selection.
LOAD_REFUSAL_GRACE_S = 3.0
ACTIVITY_WINDOW_S = 3.0
DEFAULT_TAG = ":latest"  # Ollama clients name models NAME:TAG


class BackendError(Exception):
    """A request the mesh refused or could not finish; `kind` decides the HTTP status."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# What a request yields, the router's client stream (one adapter for every API).
Event = Routed | Piece | Finished


@dataclass(frozen=True)
class ToolFormat:
    """How the model writes tool calls: between two markers, parsed by mlx-lm's parser."""

    start: str
    end: str
    parse: Any  # mlx-lm's parse_tool_call(text, tools) -> {"name", "arguments"}


@dataclass(frozen=True)
class Activity:
    """This node's requests now: as origin (its clients) and as a stage, and tokens/s."""

    requests: int
    stage_requests: int
    queued_requests: int  # waiting on this node (a first stage) for the plan's KV memory
    tokens_per_s: float
    tokens_total: int
    drafted_tokens: int = 0  # speculative drafts this node (a last stage) verified
    accepted_tokens: int = 0  # ...and accepted
    # The prefix cache of this node's stages: requests that looked for a kept prompt prefix,
    # those that started from one, the tokens they did not compute again, and what is kept.
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_reused_tokens: int = 0
    prefix_kept_tokens: int = 0


@dataclass(frozen=True)
class ModelCard:
    """The mesh's model as the model-listing endpoints describe it."""

    name: str
    architecture: str
    layers: int
    size_bytes: int
    parameters: int
    dtype: str
    config: Mapping[str, Any]
    chat_template: str
    modified_at: float


def canonical_model(name: str) -> str:
    """A client's model name as the mesh knows it ("x:latest" is "x"; "" means any)."""
    name = name.strip()
    return name.removesuffix(DEFAULT_TAG)


class MeshBackend:
    """What the HTTP APIs may ask of one node (see the module docstring)."""

    def __init__(self, node: Any, bridge: AsyncioThread) -> None:
        self._node = node
        self._bridge = bridge
        self._samples: deque[tuple[float, int]] = deque()
        self._model_files: dict[tuple[str, str], tuple[Mapping[str, Any], str]] = {}

    @property
    def _snapshot(self) -> Any:
        """What the node serves now (an immutable snapshot the plan installer publishes)."""
        return self._node.plans.snapshot

    @property
    def _plane(self) -> Any:
        return self._node.plane

    # ---------------------------------------------------------------- requests

    async def generate(
        self,
        *,
        sampling: SamplingParams,
        model: str,
        messages: Sequence[Mapping[str, Any]] | None = None,
        prompt: str | None = None,
        chat_template: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> AsyncIterator[Event]:
        """Run one request on the mesh: Routed, Pieces, then Finished; or BackendError.

        Closing the iterator early (the client went away) cancels the request everywhere.
        """
        from meshd.inference.errors import InferenceError

        events = self._node.router.stream(
            prompt=prompt,
            messages=messages,
            sampling=sampling,
            model=canonical_model(model),
            plan_id="",
            chat_template=chat_template,
            tools=tools or None,
        )
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except InferenceError as exc:
            kind = KIND_OF_HTTP_STATUS.get(exc.kind.http_status, "internal")
            raise BackendError(kind, str(exc)) from exc

    def served_model(self) -> str:
        """The model the mesh runs now ("" when none is selected)."""
        return self._snapshot.model

    def check_model(self, model: str) -> str:
        """The served model's name if `model` names it (or is empty); else not_found."""
        served = self.served_model()
        wanted = canonical_model(model)
        if not served:  # not transient (no status a client retries): someone must load one
            raise BackendError("not_found", NO_MODEL_MESSAGE)
        if wanted and wanted != served:
            raise BackendError(
                "not_found",
                f"model {model!r} is not loaded in this mesh (it runs {served!r}); "
                "select it first with `meshd load`",
            )
        return served

    def tool_format(self) -> ToolFormat | None:
        """The served model's tool-call markers and parser, or None (no tools, or loading)."""
        from meshd.inference.errors import InferenceError

        plan_id = self._snapshot.active
        if not plan_id:
            return None
        try:
            tokenizer = self._plane.tokenizer(plan_id)
        except InferenceError:
            return None
        if not tokenizer.has_tool_calling:
            return None
        return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser)

    async def model_card(self) -> ModelCard | None:
        """The served model's description (the mesh's selection and the loaded plan), or None."""
        from meshd.inference.errors import InferenceError

        selection: pb.ModelSelection | None = await self._in_trio(
            lambda: self._node.agreement.selection
        )
        if selection is None or not selection.name:
            return None
        spec = json.loads(selection.spec_json or "{}")
        # The config and template come from a loaded plan: the active one, else one still
        # draining (the active one may be loading), else what this backend saw last.
        key = (selection.name, selection.digest)
        snapshot = self._snapshot
        for plan_id in [snapshot.active, *sorted(snapshot.serving)]:
            with contextlib.suppress(InferenceError):
                self._model_files[key] = (
                    self._plane.model_config(plan_id),
                    self._plane.tokenizer(plan_id).chat_template or "",
                )
                break
        if key not in self._model_files:  # nothing loaded yet: this node's copy, if it has one
            path = await asyncio.to_thread(_model_dir_or_none, self._node, selection)
            files = await asyncio.to_thread(_read_model_files, path)
            if files[0]:
                self._model_files[key] = files
        config, template = self._model_files.get(key, ({}, ""))
        layer_bytes = spec.get("layer_bytes", [])
        size = sum(layer_bytes) + spec.get("embedding_bytes", 0) + spec.get("head_bytes", 0)
        embedding = spec.get("vocab_size", 0) * spec.get("hidden_size", 0)
        tied = spec.get("tie_word_embeddings", True)
        return ModelCard(
            name=selection.name,
            architecture=str(config.get("model_type", "")),
            layers=len(layer_bytes) or int(config.get("num_hidden_layers", 0)),
            size_bytes=size,
            parameters=sum(spec.get("layer_params", [])) + embedding * (1 if tied else 2),
            dtype=str(spec.get("dtype", "")),
            config=config,
            chat_template=template if isinstance(template, str) else "",
            modified_at=selection.set_at,
        )

    # ---------------------------------------------------------------- models

    async def list_models(self) -> pb.ModelList:
        """The models this node has (its store and the HF cache), as `meshd models` lists."""
        return await self._bridge.call_in_trio(self._node.list_models)

    async def select_model(self, model: str) -> pb.ModelSelection:
        """Propose `model` to the mesh exactly as the gRPC LoadModel does (a store name, a
        directory, a .gguf or ORG/NAME[@REV]); unknown: not_found, not runnable: bad_request.

        Shielded: a client that goes away stops waiting for the answer, not the selection.
        """
        model = model.strip()
        if not model:
            raise BackendError(
                "bad_request", "name a model to load (ORG/NAME, a store name or a path)"
            )
        call = asyncio.ensure_future(
            self._bridge.run_in_trio(lambda: self._node.select_model(model))
        )
        call.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            kind: ErrorKind = (
                "not_found" if isinstance(exc, LookupError | FileNotFoundError) else "bad_request"
            )
            raise BackendError(kind, f"cannot load {model!r}: {exc}") from exc

    async def follow_load(self, name: str, timeout_s: float) -> AsyncIterator[pb.MeshStatus]:
        """The mesh's status every LOAD_POLL_S until this node serves a plan of model `name`
        (then the iterator ends); BackendError if the mesh refuses it, this node cannot load
        its stage, or it takes over `timeout_s`. Ending early stops following, not the load."""
        deadline = time.monotonic() + timeout_s
        refused_since: float | None = None
        while True:
            status = await self.status()
            view = status.agreement
            plan_model = json.loads(view.plan_json).get("model_name") if view.plan_json else ""
            if view.active_plan_id and plan_model == name:
                failure = self._node.plans.progress.failure(view.active_plan_id)
                if failure is not None:
                    raise BackendError("unavailable", f"cannot load {name!r} here: {failure}")
                if self._node.plans.progress.loaded(view.active_plan_id).is_set():
                    return
            now = time.monotonic()
            refused = bool(view.refusal) and view.model == name and plan_model != name
            refused_since = (refused_since or now) if refused else None
            if refused_since is not None and now - refused_since >= LOAD_REFUSAL_GRACE_S:
                raise BackendError("unavailable", f"the mesh cannot run {name!r}: {view.refusal}")
            if now >= deadline:
                raise BackendError(
                    "unavailable",
                    f"{name!r} is not served after {timeout_s:.0f} s (the mesh runs "
                    f"{view.model or 'no model'}; {view.reason or 'still loading'}); "
                    "`meshd status` shows its progress",
                )
            yield status
            await asyncio.sleep(LOAD_POLL_S)

    # ---------------------------------------------------------------- status

    async def status(self) -> pb.MeshStatus:
        return await self._in_trio(self._node.status)

    async def watch(self, min_interval_s: float = 0.25) -> AsyncIterator[pb.MeshStatus]:
        """A new status whenever the mesh changes (the source of gRPC WatchStatus), and
        at least every WATCH_KEEPALIVE_S."""
        while True:
            yield await self.status()
            await asyncio.sleep(min_interval_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._bridge.run_in_trio(self._node.wait_changed), WATCH_KEEPALIVE_S
                )

    def activity(self) -> Activity:
        """Requests in flight here and tokens/s delivered to this node's clients."""
        plane = self._plane
        stats = plane.stats()
        now = time.monotonic()
        total = plane.tokens_delivered
        self._samples.append((now, total))
        while len(self._samples) > 2 and self._samples[1][0] < now - ACTIVITY_WINDOW_S:
            self._samples.popleft()
        first_at, first_total = self._samples[0]
        rate = (total - first_total) / (now - first_at) if now - first_at > 0.2 else 0.0
        prefixes = self.prefix_caches()
        return Activity(
            requests=sum(p.origin_requests for p in stats.plans),
            stage_requests=sum(p.open_requests for p in stats.plans),
            queued_requests=sum(p.queued_requests for p in stats.plans),
            tokens_per_s=rate,
            tokens_total=total,
            drafted_tokens=sum(p.drafted_tokens for p in stats.plans),
            accepted_tokens=sum(p.accepted_tokens for p in stats.plans),
            prefix_lookups=sum(view.lookups for view in prefixes),
            prefix_hits=sum(view.hits for view in prefixes),
            prefix_reused_tokens=sum(view.reused_tokens for view in prefixes),
            prefix_kept_tokens=sum(view.tokens for view in prefixes),
        )

    def prefix_caches(self) -> tuple[Any, ...]:
        """This node's stages' prefix caches (the data plane's published snapshot)."""
        return tuple(self._plane.stage.prefix_view)

    async def _in_trio(self, fn: Any) -> Any:
        async def call() -> Any:
            return fn()

        return await self._bridge.run_in_trio(call)


def _model_dir_or_none(node: Any, selection: pb.ModelSelection) -> Path | None:
    try:
        return node.model_dir_for_selection(selection)
    except Exception:  # not in this node's store: it runs a fetched part
        return None


def _read_model_files(path: Path | None) -> tuple[dict[str, Any], str]:
    """config.json and the chat template of a model directory ({} and "" when unreadable)."""
    config: dict[str, Any] = {}
    template: Any = ""
    if path is None:
        return config, ""
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((path / "config.json").read_text())
    with contextlib.suppress(OSError, ValueError):
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
    return config, template if isinstance(template, str) else ""
