"""Micro-batch cohorts: the first stage keeps the rows of each micro-batch together.

Why: a first stage of several cuts its decoding requests into one micro-batch per stage
(:func:`partitioner.cost.micro_batches`), so each stage computes one while the others
compute theirs. A decode step of a few rows is memory-bound: it reads every weight of the
stage once, whatever its rows, so the rows of a round should go in as few steps as there are
micro-batches. Left to themselves they do not: requests start at different moments (their
prompts run alone, between decode steps) and each group of rows whose tokens came back
together was computed together from then on. Two pinned stages serving 16 requests ran ~3
groups a round where 2 would do, and every stage paid the extra step (208 steps for 142).

So each decoding request of a first stage belongs to a cohort (``StageRequest.cohort``,
``0 <= cohort < micro_batches``), the one with the fewest members when it first decodes or
when its cohort holds more than its share of the open requests or the plan cuts fewer
micro-batches than before. Its decode step waits until every
other member of its cohort is back (its token here, nothing of it computing): the cohort then
runs as one step (the runtime batches a step's rows by cohort, ``Work.cohort``). A request
joining a cohort in flight waits for it at most one round; a cohort waits at most
``COHORT_WAIT_S`` for a member, so a member whose token is late (a lane reset) holds the
others up no longer than that (the runtime asks the core again when that wait ends,
``StageCore.cohort_wait_ends``, whether a frame came or not).

Only plain decode steps of a plan whose stage batches them wait (``StagePlan.batches``);
prompt chunks, speculative steps and a request catching up run as before. Pure: the core
calls it with its own clock.
"""

from __future__ import annotations

from collections import Counter

from meshd.inference.stage.state import StagePlan, StageRequest
from partitioner.cost import micro_batches

COHORT_WAIT_S = 1.0


def groups_cohorts(plan: StagePlan) -> bool:
    """Whether ``plan``'s stage here keeps cohorts: the first of several, batching."""
    return plan.batches and plan.is_first and not plan.is_last


def is_plain_decode(request: StageRequest) -> bool:
    """Whether the request's next step is a generated token's step alone (no drafts, no
    rollback, not a prompt chunk) of a request not catching up."""
    if request.start.catch_up or not request.inputs:
        return False
    item = request.inputs[0]
    return (
        item.step > request.chunk_steps
        and item.tokens is not None
        and len(item.tokens) == 1
        and not item.drafts
        and not item.rollback
    )


def is_out(request: StageRequest) -> bool:
    """A cohort member not back yet: computing here, or its token not arrived."""
    return request.in_flight > 0 or not request.inputs


def members(plan: StagePlan) -> list[StageRequest]:
    """The requests of ``plan`` in a cohort, still decoding."""
    return [
        r
        for r in plan.requests.values()
        if r.cohort is not None and not r.ended and not r.decoded_all
    ]


def cohorts_out(plan: StagePlan) -> set[int]:
    """The cohorts of ``plan`` with a member not back yet (taken before the core hands out
    this call's steps, so the members ready together all go)."""
    return {r.cohort for r in members(plan) if r.cohort is not None and is_out(r)}


def join(plan: StagePlan, request: StageRequest) -> None:
    """Put ``request`` in a cohort: the one with the fewest members if it is in none, in one
    the plan no longer cuts, or in one with more than its share of the open requests (members
    joined while fewer requests were open, or the others ended)."""
    open_requests = len(plan.requests)
    parts = micro_batches(len(plan.assignment.stages), open_requests)
    share = -(-open_requests // parts)
    sizes = Counter(r.cohort for r in members(plan) if r is not request)
    if request.cohort is not None and request.cohort < parts and sizes[request.cohort] < share:
        return
    request.cohort = min(range(parts), key=lambda cohort: (sizes[cohort], cohort))
    request.waiting_since = None


def waits(plan: StagePlan, request: StageRequest, out: set[int], now: float) -> bool:
    """Whether ``request``'s ready step waits for its cohort (see the module); the caller
    asks only for a plain decode step (:func:`is_plain_decode`) of a plan that keeps cohorts
    (:func:`groups_cohorts`), with ``out`` from :func:`cohorts_out`."""
    join(plan, request)
    if request.cohort not in out:
        request.waiting_since = None
        return False
    if request.waiting_since is None:
        request.waiting_since = now
    if now - request.waiting_since < COHORT_WAIT_S:
        return True
    request.waiting_since = None  # waited long enough: it runs now, with whoever is back
    return False


def wait_ends(waiting: list[StageRequest]) -> float | None:
    """When the first of the ``waiting`` steps stops waiting for its cohort (None: none)."""
    started = [r.waiting_since for r in waiting if r.waiting_since is not None]
    return min(started) + COHORT_WAIT_S if started else None
