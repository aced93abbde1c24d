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

The protocol (``StageCore.plan_loaded(draft_tokens=k)``, the first stage of a plan of plain
stages, :mod:`meshd.inference.stage.core`): for a greedy request without a repetition
penalty that decodes alone on the plan, the first stage looks up to k tokens it guesses
follow the token it just received in the request's prompt and answer so far, and runs them
in the same step (1 + k positions). The later stages run the step as it comes, and the last
verifies it: the token greedy decoding gives at each position, as long as the one before
was the draft there (:class:`~meshd.inference.stage_events.Verified`), each sent on as a Token
in order. The first stage counts the Tokens that equal its drafts (their positions are in
every cache already); the first that does not, or the one after the last draft, is the next
step's input, and that step carries how many drafted positions every stage drops from its
caches before it runs (``rollback``). A step of a few positions costs about what one does (the
weights are read once), so each accepted draft saves a round trip through every stage. A
single stage drafts on its compute thread instead, where the token its following step starts
from is (``Work.draft_limit``), and settles its drafts there.

Pure: no MLX, no I/O. The first stage's core asks :func:`drafts_for`; a single stage's engine
keeps a :class:`DraftIndex` of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # stage_state keeps a DraftIndex per request: imported for the types only
    from meshd.inference.stage.state import StagePlan, StageRequest

# Longest and shortest context matched: a longer match is a better guess when there is one.
MAX_NGRAM = 3
MIN_NGRAM = 2


class DraftIndex:
    """A request's prompt and answer so far, indexed for prompt lookup: for every run of
    MIN_NGRAM..MAX_NGRAM tokens that something followed, where its latest occurrence ended.
    Appending a token and looking up the drafts cost the same however long the request is
    (the first stage does both on the asyncio thread, once per step)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        tokens = self.tokens
        end = len(tokens)  # the runs ending here are followed by ``token`` from now on
        for size in range(MIN_NGRAM, MAX_NGRAM + 1):
            if end >= size:
                self._ends[tuple(tokens[end - size : end])] = end
        tokens.append(token)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def drafts(self, count: int) -> tuple[int, ...]:
        """Up to ``count`` tokens that followed the latest earlier occurrence of the last
        MAX_NGRAM tokens (else fewer, down to MIN_NGRAM); empty when none occurred before or
        ``count`` is 0."""
        if count <= 0:
            return ()
        tokens = self.tokens
        for size in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(tokens) < size:
                continue
            end = self._ends.get(tuple(tokens[-size:]))
            if end is not None:
                return tuple(tokens[end : end + count])
        return ()


def drafts_for(plan: StagePlan, request: StageRequest) -> tuple[int, ...]:
    """The tokens the first stage guesses follow the token it just received: only for a
    request that decodes alone on the plan (several decode batched, which fills the pipeline
    better), and no more than the request may still generate after the token the step
    samples."""
    if request.history is None or not plan.one_request_alone:
        return ()
    room = request.sampling.max_tokens - request.next_index - 1
    return request.history.drafts(min(plan.draft_tokens, room))
