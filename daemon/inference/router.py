"""The request router: a client's request, from the local gRPC or HTTP APIs to the data plane.

It runs on the asyncio thread, where the API handlers and the data plane live. For each
request it validates the input (nothing is sent for bad input), picks the plan (the one the
client names, or the active one; fencing: a plan this node has not committed is refused),
waits (bounded) while this node is still loading it, tokenizes (with the chat template for a
chat), and streams the data plane's events, first announcing the plan that serves the
request (:class:`Routed`). A request started on a plan finishes on it even when a newer plan
is committed meanwhile (the old one drains). A request whose plan cannot carry it on (a stage
lost or leaving, the plan withdrawn) moves to the next plan and goes on exactly where it was
(the origin does this, see :mod:`meshd.inference.origin.core`), unless the client named
the plan. Before its first token, a request that meets a stage still loading its layers, or
one that has moved to a newer plan, is also started again here (a few times at most).

A request that reaches this node while no plan is committed here, but one is on its way (a
model is selected and the mesh is agreeing, or this node started moments ago and has not yet
heard which model its peers run), waits for the plan (bounded by ``PLAN_WAIT_S``) instead of
failing: the plan commits on each member a moment apart, and a client that asks the node
that commits last must not be told that no model is selected.

Every failure is an :class:`meshd.inference.errors.InferenceError`, raised before the first
event or from the event stream; the API maps its kind to a status in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from meshd.inference.errors import NO_MODEL_MESSAGE, ErrorKind, InferenceError
from meshd.inference.generation_events import (
    ClientEvent,
    FinalEvent,
    Finished,
    Piece,
    Routed,
    TokenEvent,
)
from meshd.inference.install.installer import InstallProgress, ServingSnapshot
from meshd.inference.prediction_check import FinishedRequest
from meshd.inference.sampling import SamplingParams
from meshd.inference.serving.dataplane import DataPlane

log = logging.getLogger("meshd.requests")

INSTALL_WAIT_S = 120.0
STAGE_LOADING_RETRY_S = 0.25
PLAN_PICK_ATTEMPTS = 3
PLAN_MOVES = 3  # restarts of a request whose stage moved to a newer plan before its first token
PLAN_WAIT_S = 60.0  # the longest a new request waits for the mesh to commit a plan
# How long after this node starts it may still learn the mesh's model from its peers (their
# gossiped states reach it within a heartbeat or two of joining; the agreement's startup
# grace is 3 s): until then "no model selected" is not an answer yet.
STARTUP_HEARING_S = 15.0
ROLES = ("system", "user", "assistant", "tool")
FINISHED_KEPT = 128  # finished requests kept for the prediction check (a window per plan)


@dataclass(frozen=True)
class RequestInfo:
    """A request in flight on this node (its origin), as `meshd status` shows it."""

    request_id: str
    plan_id: str
    prompt_tokens: int
    max_tokens: int
    started_at: float  # unix seconds


Messages = Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]] | None


class RequestRouter:
    """Routes this node's clients' requests to a committed plan on the data plane."""

    def __init__(
        self,
        plane: DataPlane,
        serving: Callable[[], ServingSnapshot],
        progress: InstallProgress,
        *,
        hearing_s: float = STARTUP_HEARING_S,
        selecting: Callable[[], str] = str,
    ) -> None:
        self._plane = plane
        self._serving = serving
        self._progress = progress
        self._hearing_until = time.monotonic() + hearing_s
        # The model this node is selecting for the mesh now ("" when none): its `--model`,
        # checked once its profile is measured, which on a busy machine outlasts hearing_s.
        self._selecting = selecting
        self._open: dict[str, RequestInfo] = {}
        self._refusing = ""  # why this node takes no new requests ("" while it does)
        # Published whole on every change (the trio side's status reads it, see
        # docs/architecture.md "published immutable values").
        self.in_flight: tuple[RequestInfo, ...] = ()
        # The requests this node finished last, newest last, for the comparison of each plan's
        # predictions with what its requests measured (meshd.inference.prediction_check):
        # replaced, never changed, when a request finishes.
        self.finished: tuple[FinishedRequest, ...] = ()

    async def stop_taking_requests(self, reason: str) -> None:
        """From now on every new request is refused with ``reason`` (UNAVAILABLE: a client or
        load balancer tries another node); requests already running go on."""
        self._refusing = reason

    def _track(self, info: RequestInfo | None, request_id: str) -> None:
        if info is None:
            self._open.pop(request_id, None)
        else:
            self._open[request_id] = info
        self.in_flight = tuple(self._open.values())

    async def generate(
        self,
        *,
        prompt: str | None,
        messages: Messages | None,
        sampling: SamplingParams,
        model: str,
        plan_id: str,
        chat_template: bool,
        tools: Tools = None,
        return_logits: bool = False,
    ) -> AsyncIterator[Routed | TokenEvent | FinalEvent]:
        """Validate, pick the plan, tokenize and stream events (asyncio thread).

        Before its first token, a request is started again (bounded) when a stage is still
        loading, or, unless the client named the plan, when a stage has moved to a newer
        plan: then it goes to the plan this node serves by then, and a second
        :class:`Routed` names it.
        """
        if self._refusing:
            raise InferenceError(ErrorKind.UNAVAILABLE, self._refusing)
        client_id = secrets.token_hex(8)
        outcome = "cancelled (the client went away)"
        info: RequestInfo | None = None
        try:
            async for event in self._generate(
                client_id,
                prompt,
                messages,
                sampling,
                model,
                plan_id,
                chat_template,
                tools,
                return_logits,
            ):
                if isinstance(event, RequestInfo):  # again after a retry: tracked, not logged
                    first, info = info is None, event
                    self._track(info, client_id)
                    if first:
                        log.info(
                            "request %s started: plan %s, %d prompt tokens, max_tokens %d",
                            client_id,
                            info.plan_id[:12],
                            info.prompt_tokens,
                            info.max_tokens,
                        )
                    continue
                if isinstance(event, FinalEvent):
                    outcome = _outcome(event)
                    self._finished(event)
                yield event
        except InferenceError as error:
            outcome = f"failed ({error.kind.grpc_status}): {error}"
            raise
        finally:
            self._track(None, client_id)
            if info is not None:
                log.info("request %s %s", client_id, outcome)
            else:
                log.info("request %s refused before it started: %s", client_id, outcome)

    def _finished(self, final: FinalEvent) -> None:
        """Keep a finished request's timing (the last FINISHED_KEPT) for the prediction check."""
        usage = final.usage
        if not usage.plan_id or usage.resumes:  # a request that moved measured two plans
            return
        ended = time.monotonic()
        started = ended - usage.total_s
        request = FinishedRequest(
            plan_id=usage.plan_id,
            started_at=started,
            first_token_at=started + usage.ttft_s,
            ended_at=started + usage.ttft_s + usage.decode_s,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
        )
        self.finished = (*self.finished[-(FINISHED_KEPT - 1) :], request)

    async def stream(self, **request: Any) -> AsyncIterator[ClientEvent]:
        """:meth:`generate` (same arguments) as every API shows it to a client: Routed (again
        after a move before the first token), a Piece per token that brings text or logits,
        the text held back to the end as a last Piece, then Finished. The one place the
        router's events become a client's; each API only renders these."""
        routed = Routed("", "")
        events = self.generate(**request)
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, Routed):
                    routed = event
                    yield event
                elif isinstance(event, FinalEvent):
                    if event.text:
                        yield Piece(event.text)
                    plan_id = event.usage.plan_id or routed.plan_id
                    yield Finished(event.finish_reason, event.usage, plan_id, routed.model)
                    return
                elif event.text or event.logits is not None:
                    yield Piece(event.text, event)

    async def _generate(
        self,
        client_id: str,
        prompt: str | None,
        messages: Messages | None,
        params: SamplingParams,
        model: str,
        plan_id: str,
        chat_template: bool,
        tools: Tools,
        return_logits: bool,
    ) -> AsyncIterator[RequestInfo | Routed | TokenEvent | FinalEvent]:
        if messages is None:
            if not prompt or not prompt.strip():
                raise InferenceError(ErrorKind.BAD_INPUT, "the prompt is empty; give some text")
        else:
            check_messages(messages)
        deadline = time.monotonic() + INSTALL_WAIT_S
        moves = 0
        while True:
            snapshot, chosen, tokens = await self._route(
                model, plan_id, prompt, messages, chat_template, tools
            )
            fitted = fit_context(params, len(tokens), self._plane.context_length(chosen))
            too_long = self._plane.context_error(chosen, len(tokens), fitted.max_tokens)
            if too_long is not None:
                raise InferenceError(ErrorKind.BAD_INPUT, too_long)
            yield RequestInfo(client_id, chosen, len(tokens), fitted.max_tokens, time.time())
            yield Routed(chosen, snapshot.model, len(tokens))
            started = False
            try:
                request_id = secrets.token_hex(8)
                events_of = self._plane.generate(
                    chosen,
                    tokens,
                    fitted,
                    request_id=request_id,
                    resume=not plan_id,
                    return_logits=return_logits,
                )
                async with contextlib.aclosing(events_of) as events:
                    async for event in events:
                        started = True
                        yield event
                return
            except InferenceError as exc:
                if started or time.monotonic() >= deadline:
                    raise
                moved = exc.kind is ErrorKind.NO_PLAN and not plan_id and moves < PLAN_MOVES
                if exc.kind is not ErrorKind.LOADING and not moved:
                    raise
                moves += moved
            await asyncio.sleep(STAGE_LOADING_RETRY_S)

    async def _route(
        self,
        model: str,
        plan_id: str,
        prompt: str | None,
        messages: Messages | None,
        chat_template: bool,
        tools: Tools,
    ) -> tuple[ServingSnapshot, str, list[int]]:
        """The plan a request runs on, once loaded here, and the prompt's tokens for it."""
        for attempt in range(PLAN_PICK_ATTEMPTS):
            snapshot, chosen = await self._pick_plan_when_committed(model, plan_id)
            try:
                await self._wait_loaded(chosen)
                tokens = self._encode(chosen, prompt, messages, chat_template, tools)
                return snapshot, chosen, tokens
            except InferenceError as exc:
                # The plan was replaced and released between picking and tokenizing: pick the
                # new active plan, unless the client asked for this one.
                last = attempt == PLAN_PICK_ATTEMPTS - 1
                if exc.kind is not ErrorKind.NO_PLAN or plan_id or last:
                    raise
        raise AssertionError("unreachable: the last attempt raises")

    async def _pick_plan_when_committed(
        self, model: str, plan_id: str
    ) -> tuple[ServingSnapshot, str]:
        """`_pick_plan`, after waiting (bounded by PLAN_WAIT_S) while a plan is on its way."""
        deadline = time.monotonic() + PLAN_WAIT_S
        while True:
            try:
                return self._pick_plan(model, plan_id)
            except _PlanPending as pending:
                if time.monotonic() >= deadline:
                    raise InferenceError(
                        ErrorKind.NO_PLAN,
                        f"no committed plan after {PLAN_WAIT_S:.0f} s: {pending}",
                    ) from None
            await asyncio.sleep(STAGE_LOADING_RETRY_S)

    def _pick_plan(self, model: str, plan_id: str) -> tuple[ServingSnapshot, str]:
        """The plan a new request runs on (the one asked for, or the active one), or why none."""
        snapshot = self._serving()
        if model and snapshot.model and model != snapshot.model:
            raise InferenceError(
                ErrorKind.UNKNOWN_MODEL,
                f"model {model!r} is not loaded in this mesh (it runs {snapshot.model!r}); "
                "select it first with `meshd load`",
            )
        chosen = plan_id or snapshot.active
        if not chosen:
            if snapshot.refusal:
                raise InferenceError(ErrorKind.NO_PLAN, f"no committed plan: {snapshot.refusal}")
            if snapshot.model:
                raise _PlanPending("the mesh has not agreed on a plan yet")
            if selecting := self._selecting():
                raise _PlanPending(f"this node is still checking its model {selecting}")
            if time.monotonic() < self._hearing_until:
                raise _PlanPending("this node has not yet heard which model the mesh runs")
            raise InferenceError(ErrorKind.NO_MODEL, NO_MODEL_MESSAGE)
        if chosen not in snapshot.serving:
            raise InferenceError(
                ErrorKind.NO_PLAN,
                f"plan {chosen[:12]} is not committed on this node; the active plan is "
                f"{snapshot.active[:12] or 'none'}",
            )
        return snapshot, chosen

    def _encode(
        self,
        plan_id: str,
        prompt: str | None,
        messages: Messages | None,
        chat_template: bool,
        tools: Tools = None,
    ) -> list[int]:
        if tools and not self._plane.tokenizer(plan_id).has_tool_calling:
            raise InferenceError(
                ErrorKind.BAD_INPUT,
                f"the chat template of {self._serving().model} does not support tools; "
                "send the request without tools",
            )
        if (messages is not None or chat_template) and not getattr(
            self._plane.tokenizer(plan_id), "has_chat_template", True
        ):
            raise InferenceError(
                ErrorKind.BAD_INPUT,
                f"{self._serving().model} has no chat template (a base model): send the text "
                "as a plain prompt (Generate with chat_template false, or a completion)",
            )
        if messages is not None:
            return self._plane.encode_chat(plan_id, messages, tools)
        if chat_template:
            return self._plane.encode_chat(plan_id, [{"role": "user", "content": prompt or ""}])
        return list(self._plane.tokenizer(plan_id).encode(prompt or ""))

    async def _wait_loaded(self, plan_id: str) -> None:
        """Until this node has loaded ``plan_id`` (bounded); NO_PLAN if it stops serving it."""
        loaded = self._progress.loaded(plan_id)
        deadline = time.monotonic() + INSTALL_WAIT_S
        while not loaded.is_set():
            failure = self._progress.failure(plan_id)
            if failure is not None:
                raise InferenceError(ErrorKind.UNAVAILABLE, failure)
            if plan_id not in self._serving().serving:
                raise InferenceError(
                    ErrorKind.NO_PLAN, f"plan {plan_id[:12]} was withdrawn before it was loaded"
                )
            if time.monotonic() >= deadline:
                raise InferenceError(
                    ErrorKind.UNAVAILABLE,
                    f"plan {plan_id[:12]} is still loading its model; retry shortly",
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(loaded.wait(), STAGE_LOADING_RETRY_S)


class _PlanPending(Exception):
    """No plan is committed here yet, but one is on its way (the text says why)."""


def _outcome(final: FinalEvent) -> str:
    usage = final.usage
    return (
        f"finished ({final.finish_reason}): {usage.completion_tokens} tokens, "
        f"{usage.decode_tokens_per_s:.1f} tokens/s ({usage.transport_s_per_token * 1e3:.2f} ms "
        f"of each not computing), first token {usage.ttft_s * 1e3:.0f} ms, "
        f"{usage.total_s:.2f} s in all"
    )


def fit_context(params: SamplingParams, prompt: int, context: int) -> SamplingParams:
    """The request's settings within the plan's context (``context`` tokens per sequence, 0:
    no limit). An unset max_tokens (the default) is lowered to what fits after the prompt;
    a max_tokens the client asked for is kept, and the origin refuses the request when it
    does not fit (INVALID_ARGUMENT with the numbers)."""
    room = context - prompt
    if not context or params.max_tokens_given or params.max_tokens <= room:
        return params
    if room < 1:
        raise InferenceError(
            ErrorKind.BAD_INPUT,
            f"the prompt ({prompt} tokens) leaves no room to generate in the {context} tokens "
            "of context the plan reserves per sequence; shorten the prompt",
        )
    return replace(params, max_tokens=room)


def check_messages(messages: Messages) -> None:
    def bad(message: str) -> InferenceError:
        return InferenceError(ErrorKind.BAD_INPUT, message)

    if not messages:
        raise bad("a chat needs at least one message")
    for i, message in enumerate(messages):
        role = message.get("role", "")
        if role not in ROLES:
            raise bad(f"message {i} has role {role!r}; use one of {', '.join(ROLES)}")
        if not (message.get("content") or "").strip() and not message.get("tool_calls"):
            raise bad(f"message {i} ({role}) has no content")
    if messages[-1]["role"] == "assistant":
        raise bad("the last message is from the assistant; end with a user message")
