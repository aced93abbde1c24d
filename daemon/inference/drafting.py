"""Draft tokens for speculative decoding, from the request's own text (prompt lookup).

Why prompt lookup: a pipeline pays a round trip through every stage per token, and a decode
step of a few positions costs little more than one (it reads every weight once). If the first
stage guesses the next tokens, the stages verify them in one pass, and each guess the last
stage accepts is a round trip saved. The guesses must be cheap and often right. Answers copy
their prompt and themselves a lot (names, code, lists, quotes): the tokens that followed the
last earlier occurrence of the current few tokens are often the next ones. Measured on the
embedded SmolLM2's greedy chat answers (``benchmarks/bench_draft_acceptance.py``): a guess
exists at 42 % of positions and is right 67 % of the time there, where the first layers of the
model itself (a draft the first stage could run with no extra weights) agree with the whole
model on only 2-42 % of tokens, too few for any speed-up.

Pure: no MLX, no I/O. The stage core (:mod:`meshd.inference.stage_core`) asks it on the first
stage which requests may draft and what.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshd.inference.stage_state import StagePlan, StageRequest

# Longest and shortest context matched: a longer match is a better guess when there is one.
MAX_NGRAM = 3
MIN_NGRAM = 2
# How far back a match is looked for: the lookup runs on the asyncio thread once per step.
WINDOW = 4096


def prompt_lookup(history: Sequence[int], count: int) -> tuple[int, ...]:
    """Up to ``count`` tokens that followed the most recent earlier occurrence of the last
    MAX_NGRAM (else fewer, down to MIN_NGRAM) tokens of ``history``; empty when none
    occurred before or ``count`` is 0."""
    if count <= 0:
        return ()
    recent = list(history[-WINDOW:])
    for size in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if len(recent) <= size:
            continue
        tail = recent[-size:]
        for start in range(len(recent) - size - 1, -1, -1):
            if recent[start : start + size] == tail:
                follow = recent[start + size : start + size + count]
                if follow:
                    return tuple(follow)
    return ()


def drafts_for(plan: StagePlan, request: StageRequest) -> tuple[int, ...]:
    """The tokens the first stage guesses follow the token it just received: only for a
    request that decodes alone on the plan (several decode batched, which fills the pipeline
    better), and no more than the request may still generate after the token the step
    samples."""
    if request.history is None or len(plan.requests) > 1 or plan.queue.waiting:
        return ()
    room = request.sampling.max_tokens - request.next_index - 1
    return prompt_lookup(request.history, min(plan.draft_tokens, room))
