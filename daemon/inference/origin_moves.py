"""How the origin (:mod:`meshd.inference.origin`) moves its requests from one plan to another.

Requests move, exactly. The origin holds the prompt and every token generated so far, and
the request's seed. When the plan a request runs on cannot carry it on (a stage was lost or
cut off, a stage left or moved to a newer plan, the plan was withdrawn, a stage is still
loading or full), the origin ends it on that plan's stages and waits, bounded by
``resume_timeout_s``, for the plan this node serves next (:class:`meshd.inference.fencing.
ServedView`), then starts it there again with the tokens it has
(:attr:`meshd.inference.stage_events.RequestStart.generated`): the new stages prefill the
prompt as the first run did and replay each generated token alone, without sampling, and
the last stage's sampler resumes at the same position of the same seed, so the caches hold
the bits an uninterrupted run computed and the text goes on exactly where it was. The client
sees one stream: no error, no token lost or repeated, only a pause (``resumes`` and
``paused_s`` of :class:`meshd.inference.generation_events.Usage`, and one line in the event
log). Each attempt has its own request id on the wire (``<id>~<n>``), so a late frame of an
earlier attempt is never taken for one of this.

Moves in the background ("catch-up"). A replay pauses the client for the whole replay. So
while the plan a request runs on can still serve it (a node leaving gracefully keeps serving;
a plan replaced after a join drains), and the plan this node serves next is loaded here, the
origin starts a second attempt there with the tokens it has and ``catch_up`` set, while the
first one keeps streaming. Each token the old attempt delivers from then on also goes to the
new plan's first stage, which takes it as the input of its next step without waiting for its
own last stage (:mod:`meshd.inference.stage_core`): the new plan computes the same steps as
the old one, sampling each with the request's seeded sampler, and catches up as fast as its
stages compute. Every token the new attempt gives for a position the client already has is
compared with the delivered one (a difference is a defect: said loudly, and the request stays
on the old attempt). The first token the new attempt gives that the client does not have yet
switches the stream over: the old attempt ends on the old stages, and the client saw one
stream with no pause beyond a token interval. Where the stages of both plans share cores (a
machine running several daemons), the new attempt gains on the old one slowly; so it takes
over as soon as its pace says it would close the remaining gap alone within ``CLOSE_GAP_S``,
and the client's pause stays under that. If the new attempt fails, or has not caught up
within ``catch_up_timeout_s``, it ends and the request stays on the old attempt (which moves
by replay when its plan goes); if the old attempt fails first, the new one simply carries
on, already part of the way.

When the mesh reports that it cannot run the model any more (a refusal that holds for
``REFUSAL_HOLD_S``), a moving request ends at once with that reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from meshd.inference.errors import ErrorKind, InferenceError
from meshd.inference.fencing import ServedSource
from meshd.inference.frames import failure_from_proto
from meshd.inference.installed import InstalledPlan
from meshd.inference.origin_request import (
    RETRY_SAME_PLAN,
    Candidate,
    Interrupted,
    OriginRequest,
    RequestOptions,
)
from meshd.inference.sampling import SamplingParams
from meshd.inference.transport import Transport
from meshd.wire import dataplane_pb2 as dp

log = logging.getLogger("meshd.dataplane")

REFUSAL_HOLD_S = 1.0  # a refusal this old is the mesh's answer, not a step of a re-plan
RESUME_POLL_S = 0.01  # how often a moving request looks for its next plan (cheap: a dict lookup)
SAME_PLAN_RETRY_S = 0.2  # a stage still loading or full: ask the same plan again after this
# A background move whose remaining gap it would close alone in this time switches over at
# once: the old attempt ends, which gives the new one every core both shared.
CLOSE_GAP_S = 0.5


class OriginMoves:
    """How the origin moves its requests between plans: by replay when the plan a request
    runs on cannot carry it on, in the background when a newer one is ready here.
    :class:`meshd.inference.origin.Origin` is built on it; what it keeps (the attempts by
    wire id, the timeouts and counts of moves) is the origin's (asyncio thread)."""

    def __init__(
        self,
        node_id: str,
        transport: Transport,
        plans: Mapping[str, InstalledPlan],
        *,
        served: ServedSource | None,
        resume_timeout_s: float,
        catch_up_timeout_s: float,
        report: Callable[[str], None] | None,
    ) -> None:
        self.node_id = node_id
        self._transport = transport
        self._plans = plans
        self._served = served
        self._report = report or (lambda text: log.info("%s", text))
        self.resume_timeout_s = resume_timeout_s
        self.catch_up_timeout_s = catch_up_timeout_s
        self._by_wire: dict[str, OriginRequest] = {}  # by the current attempt's wire id
        self.requests_resumed = 0  # requests that moved to another plan and went on
        self.requests_moved_in_background = 0  # ...of them, moved while the old plan served
        self.catch_ups_abandoned = 0  # background moves that ended without switching over
        self.last_pause_s = 0.0

    # ------------------------------------------------------------ moves by replay

    async def _move(self, request: OriginRequest, interruption: Interrupted) -> None:
        """End the interrupted attempt everywhere and bind the request to the next plan."""
        failed = request.plan
        request.interrupted(str(interruption.error), asyncio.get_running_loop().time())
        self._end_everywhere(failed, request.wire_id, f"moving: {interruption.error}")
        self._by_wire.pop(request.wire_id, None)
        plan = await self._next_plan(request, failed, interruption)
        number, _ = request.new_attempt()
        if plan is not failed:
            request.resumes += 1
            request.report_pending = True
        request.bind(plan, number)
        self._by_wire[request.wire_id] = request
        log.info(
            "request %s moves to plan %s after %d tokens: %s",
            request.request_id,
            plan.plan_id[:12],
            len(request.tokens),
            interruption.error,
        )

    async def _next_plan(
        self, request: OriginRequest, failed: InstalledPlan, interruption: Interrupted
    ) -> InstalledPlan:
        """The plan to go on on: the active one once loaded here; the failed installation again
        only after a failure that a moment can cure (``RETRY_SAME_PLAN``). InferenceError when
        the mesh refuses to run the model, or no token came for ``resume_timeout_s`` since the
        request was first interrupted."""
        assert self._served is not None
        loop = asyncio.get_running_loop()
        assert request.moving_since is not None
        deadline = request.moving_since + self.resume_timeout_s
        refused_since: float | None = None
        if interruption.same_plan:
            await asyncio.sleep(SAME_PLAN_RETRY_S)
        while True:
            view = self._served()
            candidate = self._plans.get(view.active) if view.active else None
            usable = candidate is not None and (candidate is not failed or interruption.same_plan)
            if usable and candidate.ready.done() and candidate.ready.exception() is None:
                return candidate
            now = loop.time()
            if not view.active and view.refusal:
                refused_since = now if refused_since is None else refused_since
                if now - refused_since >= REFUSAL_HOLD_S:
                    raise request.failed(
                        InferenceError(
                            ErrorKind.UNAVAILABLE,
                            f"request stopped after {request.generated} tokens: the mesh can no "
                            f"longer run the model ({view.refusal}); it was interrupted by: "
                            f"{interruption.error}",
                        )
                    )
            else:
                refused_since = None
            if now >= deadline:
                raise request.failed(
                    InferenceError(
                        ErrorKind.UNAVAILABLE,
                        f"request stopped after {request.generated} tokens: no plan to go on "
                        f"on within {self.resume_timeout_s:g} s after: {interruption.error}",
                    )
                )
            await asyncio.sleep(RESUME_POLL_S)

    # ------------------------------------------------------------ background moves

    def _catch_up_step(
        self, request: OriginRequest, params: SamplingParams, seed: int, options: RequestOptions
    ) -> None:
        """Start a background move when the plan this node serves next is ready here and
        the request runs on another; end one that has not caught up in time."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        candidate = request.candidate
        if candidate is not None:
            deadline = request.catch_up_deadlines.get(candidate.plan.plan_id, now)
            if now >= deadline:
                self._drop_candidate(
                    request,
                    f"it did not catch up within {self.catch_up_timeout_s:g} s (it gave "
                    f"{candidate.reached} of the {request.generated} tokens delivered)",
                    give_up=True,
                )
            return
        if self._served is None or self.catch_up_timeout_s <= 0 or request.generated < 1:
            return
        if now < request.catch_up_not_before or request.interrupted_at is not None:
            return
        active = self._served().active
        if not active or active == request.plan_id:
            return
        plan = self._plans.get(active)
        if plan is None or not plan.ready.done():
            return  # not loaded here yet
        deadline = request.catch_up_deadlines.get(active)
        if deadline is not None and now >= deadline:
            return  # given up on this plan
        if plan.ready.exception() is not None:
            request.catch_up_deadlines[active] = now  # it failed to load: no move there
            return
        if plan.assignment.context_error(len(request.prompt), params.max_tokens) is not None:
            request.catch_up_deadlines[active] = now
            return
        connecting = request.connecting
        if connecting is None or connecting[0] is not plan:
            # Open the links without holding up the stream (the request owns the task).
            stages = [(spec.node_id, spec.address) for spec in plan.assignment.stages]
            if connecting is not None:
                connecting[1].cancel()
            request.connecting = (plan, asyncio.create_task(self._transport.connect(stages)))
            return
        if not connecting[1].done():
            return
        request.connecting = None
        error = connecting[1].result()
        if error is None:
            # The time a move may take runs from its first try on this plan.
            request.catch_up_deadlines.setdefault(active, now + self.catch_up_timeout_s)
            number, wire_id = request.new_attempt()
            candidate = Candidate(number, plan, wire_id, now, len(request.tokens))
            request.candidate = candidate
            self._by_wire[wire_id] = request
            start = request.start_frame(self.node_id, params, seed, options, candidate)
            first = plan.stage(0)
            if self._transport.send(first.node_id, first.address, start):
                log.info(
                    "request %s moves to plan %s in the background after %d tokens",
                    request.request_id,
                    plan.plan_id[:12],
                    candidate.from_tokens,
                )
                return
            self._drop_candidate(request, f"stage {first.node_id} at {first.address} is lost")
            return
        request.catch_up_not_before = now + SAME_PLAN_RETRY_S  # a link did not open: again

    def _feed(self, request: OriginRequest, candidate: Candidate, token: dp.Token) -> None:
        """Send the new attempt's first stage a token the client has (its next input)."""
        if len(candidate.plan.assignment.stages) == 1:
            return  # a single stage computes its next input itself, one step ahead
        first = candidate.plan.stage(0)
        frame = dp.Frame(
            plan_id=candidate.plan.plan_id,
            request_id=candidate.wire_id,
            token=dp.Token(token_id=token.token_id, index=token.index),
        )
        if not self._transport.send(first.node_id, first.address, frame, open_new=False):
            self._drop_candidate(request, f"stage {first.node_id} at {first.address} is lost")

    def _candidate_frame(
        self, request: OriginRequest, candidate: Candidate, frame: dp.Frame, arrived_at: float
    ) -> bool:
        """A frame of the new attempt: a token the client has is checked, the first one it
        has not switches the stream over (True: deliver the frame, the request's current
        attempt's now); a failure ends the background move."""
        if frame.WhichOneof("body") == "failure":
            kind = failure_from_proto(frame.failure.kind)
            transient = kind in RETRY_SAME_PLAN
            self._drop_candidate(request, frame.failure.message, give_up=not transient)
            return False
        token = frame.token
        if token.index < request.generated and token.token_id == request.tokens[token.index]:
            # The new plan computed what the client has: it is catching up.
            candidate.reached = token.index + 1
            if candidate.first_token is None:
                candidate.first_token = (arrived_at, token.index)
            to_close = candidate.seconds_to_close(request.generated, arrived_at)
            if to_close is not None and to_close <= CLOSE_GAP_S:
                self._switch_over(
                    request,
                    f"plan {candidate.plan.plan_id[:12]} was {to_close:.2f} s from catching up",
                )
            return False
        if token.index != request.generated:
            delivered = (
                request.tokens[token.index] if token.index < len(request.tokens) else "none yet"
            )
            message = (
                f"DEFECT: plan {candidate.plan.plan_id[:12]} gave token {token.token_id} at "
                f"position {token.index} of request {request.request_id}, where plan "
                f"{request.plan_id[:12]} gave {delivered}; the request stays on plan "
                f"{request.plan_id[:12]} (please report this)"
            )
            log.error("%s", message)
            self._report(message)
            self._drop_candidate(request, "its tokens differ from the delivered ones", give_up=True)
            return False
        self._switch_over(request, f"plan {candidate.plan.plan_id[:12]} caught up")
        return True

    def _switch_over(self, request: OriginRequest, reason: str) -> None:
        """The new attempt becomes the request's: the old one ends on its stages."""
        candidate = request.candidate
        assert candidate is not None
        request.candidate = None
        old_plan, old_wire = request.plan, request.wire_id
        self._by_wire.pop(old_wire, None)
        self._end_everywhere(old_plan, old_wire, f"moved to plan {candidate.plan.plan_id[:12]}")
        if request.interrupted_at is None:  # the pause runs from the last token on
            request.interrupted(reason, asyncio.get_running_loop().time())
        request.interruption = reason
        request.bind(candidate.plan, candidate.number)
        request.awaiting_token = False  # it has computed tokens already
        request.resumes += 1
        request.report_pending = True
        request.moved_in_background = candidate
        log.info(
            "request %s switches to plan %s (%s)",
            request.request_id,
            candidate.plan.plan_id[:12],
            reason,
        )

    def _drop_candidate(
        self, request: OriginRequest, reason: str, *, give_up: bool = True, abandoned: bool = True
    ) -> None:
        """End the background move (the request goes on on its current attempt). With
        ``give_up`` no other is tried on that plan; else one is tried again shortly."""
        candidate = request.candidate
        if candidate is None:
            return
        request.candidate = None
        self._by_wire.pop(candidate.wire_id, None)
        self._end_everywhere(candidate.plan, candidate.wire_id, f"background move ended: {reason}")
        if not abandoned:
            return
        self.catch_ups_abandoned += 1
        loop_now = asyncio.get_running_loop().time()
        if give_up:
            request.catch_up_deadlines[candidate.plan.plan_id] = loop_now
        request.catch_up_not_before = loop_now + SAME_PLAN_RETRY_S
        log.info(
            "request %s: background move to plan %s ended (%s); it stays on plan %s",
            request.request_id,
            candidate.plan.plan_id[:12],
            reason,
            request.plan_id[:12],
        )

    def _resumed(self, request: OriginRequest) -> None:
        """The first token after a move arrived: count it and say so in the event log."""
        self.requests_resumed += 1
        background = request.moved_in_background
        request.moved_in_background = None
        if background is None:
            how = ""
        else:
            self.requests_moved_in_background += 1
            took = asyncio.get_running_loop().time() - background.started_at
            how = (
                f" in the background (it caught up from token {background.from_tokens} in "
                f"{took:.2f} s)"
            )
        self._report(
            f"request {request.request_id} moved to plan {request.plan_id[:12]}{how} and "
            f"resumed after {request.generated - 1} tokens, paused {self.last_pause_s:.2f} s "
            f"({request.interruption})"
        )

    def _end_everywhere(self, plan: InstalledPlan, wire_id: str, reason: str) -> None:
        """Tell every stage the attempt is over (existing links only: no reconnect storms)."""
        frame = dp.Frame(plan_id=plan.plan_id, request_id=wire_id, end=dp.End(reason=reason))
        for spec in plan.assignment.stages:
            self._transport.send(spec.node_id, spec.address, frame, open_new=False)
