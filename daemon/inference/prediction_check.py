"""A plan's predicted speed against what its requests measured: pure, no I/O, no clock.

The planner predicts, for the plan's `concurrency` and `prompt_len` (partitioner.Prediction):
decode tokens/s of one sequence alone, the time between two tokens of one sequence when
`concurrency` decode together, and the time to the first token. The origin measures each
request it asks (its TTFT, its decode tokens/s, its prompt and cached tokens). This module
puts the two side by side over a window of recent requests of one plan, by these rules:

* **Window:** the last ``WINDOW`` finished requests of the plan; every figure is a median.
* **Decode alone:** a request counts when, on average over its decode (first token to last),
  fewer than 1.5 requests decoded (itself included): overlap with other requests is summed
  over their decode intervals. Compared with ``tokens_per_s`` (one sequence alone).
* **Decode at the plan's concurrency** (plans for C > 1 only): a request counts when on
  average between 0.75 x C and 1.25 x C requests decoded with it. Compared per request with
  1 / ``time_per_token_s``; the aggregate is C times that. Requests at other concurrencies
  are not compared (the prediction is for C, not for them).
* **Prefill and time to first token:** only requests with no prefix-cache hit
  (``cached_tokens`` == 0) whose prompt was computed alone (no other request of the plan ran,
  prompt or decode, between its start and its first token): a prompt that waits behind other
  requests' steps measures the queue, not the prefill. Prefill tokens/s = prompt tokens /
  TTFT. The prediction is scaled to each request's own prompt length
  (:func:`predicted_ttft_s`), so prompts of any length can be compared.
* **Ratio:** measured / predicted, for every figure (> 1: faster than predicted for
  tokens/s, slower for TTFT).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.plan import Plan

WINDOW = 32
ALONE_BELOW = 1.5  # mean requests decoding together (itself included) to count as alone
CONCURRENT_TOLERANCE = 0.25  # within this share of the plan's concurrency counts as at it


@dataclass(frozen=True)
class FinishedRequest:
    """One request the origin finished, on one clock (seconds; any monotonic origin)."""

    plan_id: str
    started_at: float
    first_token_at: float
    ended_at: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_at - self.started_at

    @property
    def decode_s(self) -> float:
        return self.ended_at - self.first_token_at

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Figure:
    """One predicted figure and the median of what requests measured (0: none yet)."""

    predicted: float
    measured: float = 0.0
    requests: int = 0

    @property
    def ratio(self) -> float:
        """measured / predicted; 0 when either is unknown."""
        if self.predicted <= 0 or self.measured <= 0:
            return 0.0
        return self.measured / self.predicted


@dataclass(frozen=True)
class PredictionComparison:
    """The active plan's predictions next to its requests' medians (module docstring)."""

    plan_id: str
    concurrency: int
    prompt_len: int
    decode_alone: Figure  # tokens/s
    decode_concurrent: Figure | None  # tokens/s per request at `concurrency` (C > 1 only)
    prefill: Figure  # computed prompt tokens/s
    ttft: Figure  # seconds
    requests: int  # finished requests of the plan in the window


def predicted_ttft_s(plan: Plan, prompt_tokens: int) -> float:
    """The plan's predicted time to first token, scaled to a prompt of ``prompt_tokens``.

    The cost model prices each stage's prefill as max(weights read / bandwidth, P x FLOPs /
    compute): its prediction at `prompt_len` gives the compute part per token, and the
    stage's one-token decode time the weights-read floor; hops carry P hidden states, no
    less than one token's.
    """
    prediction = plan.prediction
    scale = prompt_tokens / max(1, prediction.prompt_len)
    stages = sum(
        max(decode, prefill * scale)
        for decode, prefill in zip(
            prediction.stage_decode_s, prediction.stage_prefill_s, strict=False
        )
    )
    hops = sum(max(hop.decode_s, hop.prompt_s * scale) for hop in plan.hops if hop.prompt_s)
    return stages + hops


def compare(plan: Plan, finished: Sequence[FinishedRequest]) -> PredictionComparison:
    """The plan's predictions and the medians of its last ``WINDOW`` finished requests."""
    prediction = plan.prediction
    mine = [request for request in finished if request.plan_id == plan.plan_id][-WINDOW:]
    concurrency = max(1, plan.concurrency)
    alone_rates: list[float] = []
    concurrent_rates: list[float] = []
    for request in mine:
        rate = request.decode_tokens_per_s
        if rate <= 0:
            continue
        together = decoding_together(request, mine)
        if together < ALONE_BELOW:
            alone_rates.append(rate)
        elif concurrency > 1 and abs(together - concurrency) <= CONCURRENT_TOLERANCE * concurrency:
            concurrent_rates.append(rate)
    ttfts: list[float] = []
    predicted_ttfts: list[float] = []
    prefill_rates: list[float] = []
    predicted_prefill: list[float] = []
    for request in mine:
        if request.cached_tokens or request.ttft_s <= 0 or not prefilled_alone(request, mine):
            continue
        expected = predicted_ttft_s(plan, request.prompt_tokens)
        ttfts.append(request.ttft_s)
        predicted_ttfts.append(expected)
        prefill_rates.append(request.prompt_tokens / request.ttft_s)
        predicted_prefill.append(request.prompt_tokens / expected if expected > 0 else 0.0)
    ttft_default = predicted_ttft_s(plan, prediction.prompt_len)
    per_sequence = 1.0 / prediction.time_per_token_s if prediction.time_per_token_s > 0 else 0.0
    return PredictionComparison(
        plan_id=plan.plan_id,
        concurrency=concurrency,
        prompt_len=prediction.prompt_len,
        decode_alone=_figure(prediction.tokens_per_s, alone_rates),
        decode_concurrent=_figure(per_sequence, concurrent_rates) if concurrency > 1 else None,
        prefill=_figure(
            _median(predicted_prefill) or _rate(prediction.prompt_len, ttft_default),
            prefill_rates,
        ),
        ttft=_figure(_median(predicted_ttfts) or ttft_default, ttfts),
        requests=len(mine),
    )


def decoding_together(request: FinishedRequest, others: Sequence[FinishedRequest]) -> float:
    """Requests decoding on average during ``request``'s decode, itself included: 1 + the
    others' decode time inside its decode interval / its decode time."""
    length = request.decode_s
    if length <= 0:
        return 1.0
    overlap = sum(
        _overlap(request.first_token_at, request.ended_at, other.first_token_at, other.ended_at)
        for other in others
        if other is not request
    )
    return 1.0 + overlap / length


def prefilled_alone(request: FinishedRequest, others: Sequence[FinishedRequest]) -> bool:
    """Whether no other request ran (prompt or decode) between ``request``'s start and its
    first token."""
    return not any(
        _overlap(request.started_at, request.first_token_at, other.started_at, other.ended_at) > 0
        for other in others
        if other is not request
    )


def _overlap(start: float, end: float, other_start: float, other_end: float) -> float:
    return max(0.0, min(end, other_end) - max(start, other_start))


def _figure(predicted: float, measured: list[float]) -> Figure:
    return Figure(predicted, _median(measured), len(measured))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0
