"""Stages chained in one process: the reference the networked data plane must equal.

Used by the exactness tests and the in-process benchmark; each stage's output is evaluated
before the next stage runs, as if it were sent over the network.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import mlx.core as mx

from meshd.inference.assignment import check_stage_chain
from meshd.inference.sampling import SamplingParams, TokenSampler
from meshd.inference.stage.model import Cache, StageModel, prefill_chunks
from meshd.inference.stage.shard import load_stage


class LocalPipeline:
    """Stages chained in one process: the reference for the networked data plane.

    Each stage's output is evaluated before the next stage runs, as if it were sent over the
    network, so this also measures what the stages cost without any transport.
    """

    def __init__(self, stages: Sequence[StageModel]) -> None:
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        check_stage_chain(stages, num_layers=stages[-1].num_model_layers, what="the pipeline")
        self.stages = list(stages)

    @classmethod
    def load(
        cls,
        model_dir: Path,
        ranges: Sequence[tuple[int, int]],
        *,
        refuse_unverified: bool = True,
    ) -> LocalPipeline:
        """Load one stage per range; the first gets the embedding, the last the head.
        (``refuse_unverified``: see :func:`load_stage`.)"""
        last = len(ranges) - 1
        return cls(
            [
                load_stage(
                    model_dir,
                    start,
                    end,
                    has_embedding=index == 0,
                    has_head=index == last,
                    refuse_unverified=refuse_unverified,
                )
                for index, (start, end) in enumerate(ranges)
            ]
        )

    def make_caches(self) -> list[Cache]:
        """One cache per stage for a new request."""
        return [stage.make_cache() for stage in self.stages]

    def run_chunk(self, tokens: mx.array, caches: list[Cache], *, logits: str = "last") -> mx.array:
        """One chunk of ``tokens`` through all stages (see :meth:`StageModel.run` for
        ``logits``), advancing ``caches``. One evaluation per stage, at its boundary, as if its
        output were sent to the next one."""
        payload = tokens if tokens.ndim == 2 else tokens[None]
        for stage, cache in zip(self.stages, caches, strict=True):
            payload = stage.run(payload, cache, logits=logits)
            mx.eval(payload)
        return payload

    def logits(self, tokens: mx.array, caches: list[Cache], *, last_only: bool = True) -> mx.array:
        """Logits ``(1, 1 or n, vocab)`` for one chunk of ``tokens``, advancing ``caches``."""
        return self.run_chunk(tokens, caches, logits="last" if last_only else "all")

    def prefill(self, tokens: mx.array, caches: list[Cache], chunk_size: int = 512) -> mx.array:
        """Prefill the prompt in chunks; logits of its last position ``(1, vocab)``."""
        chunks = prefill_chunks(tokens, chunk_size)
        for chunk in chunks[:-1]:
            self.run_chunk(chunk, caches, logits="none")
        return self.run_chunk(chunks[-1], caches)[:, -1, :]

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        chunk_size: int = 512,
    ) -> Iterator[int]:
        """Yield generated token ids until EOS or ``params.max_tokens`` (stop strings are the
        caller's, see :class:`meshd.inference.sampling.StopChecker`). The request's caches die
        with it."""
        caches = self.make_caches()
        sampler = TokenSampler(params)
        context = list(prompt_ids)
        logits = self.prefill(mx.array(context), caches, chunk_size)
        for _ in range(params.max_tokens):
            token = sampler.sample(logits, context)
            yield token
            if token in eos_token_ids:
                return
            context.append(token)
            logits = self.logits(mx.array([[token]]), caches)[:, -1, :]
