"""What a client gets from a request it asks the mesh (:mod:`meshd.inference.origin.runtime`).

Its own module because every side that speaks to clients reads these and nothing else of the
origin: the router, the local gRPC service and the HTTP backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

FinishReason = Literal["stop", "length", "eos", "cancelled"]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it made visible (stop strings are never in it)."""

    token_id: int
    index: int
    text: str
    logits: np.ndarray | None = None  # the last stage's float32 logits (return_logits only)


@dataclass(frozen=True)
class Usage:
    """Counts and timing of one request, measured at the origin."""

    prompt_tokens: int
    completion_tokens: int
    ttft_s: float  # request sent -> first token received
    decode_s: float  # first token -> last token
    total_s: float
    decode_compute_s: float  # compute on all stages for tokens after the first
    seed: int
    resumes: int = 0  # times the request moved to another plan and went on where it was
    paused_s: float = 0.0  # what those moves added: interruption -> the next token, in total
    plan_id: str = ""  # the plan that gave the last token
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    @property
    def transport_s_per_token(self) -> float:
        """Decode time per token not spent computing: hops, queues, serialization."""
        steps = self.completion_tokens - 1
        return (self.decode_s - self.decode_compute_s) / steps if steps > 0 else 0.0


@dataclass(frozen=True)
class FinalEvent:
    """The last event of a request that ended without an error. ``text`` is held-back text
    flushed at the end (append it to the tokens' text)."""

    finish_reason: FinishReason
    usage: Usage
    text: str = ""


GenerationEvent = TokenEvent | FinalEvent


# --- What the APIs show a client: one stream for the local gRPC API and every HTTP API ------


@dataclass(frozen=True)
class Routed:
    """The plan (epoch) and model that serve the request; again when a request moved to a
    newer plan before its first token."""

    plan_id: str
    model: str
    prompt_tokens: int = 0


@dataclass(frozen=True)
class Piece:
    """Generated text, in order (concatenated, the pieces are the whole answer), and the
    token it came with (its logits, when asked for); the text held back to the end comes
    as a piece of its own, without a token."""

    text: str
    token: TokenEvent | None = None


@dataclass(frozen=True)
class Finished:
    """The request's end: why, its usage, and the plan and model that served it."""

    finish_reason: FinishReason
    usage: Usage
    plan_id: str
    model: str

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens

    @property
    def ttft_s(self) -> float:
        return self.usage.ttft_s

    @property
    def total_s(self) -> float:
        return self.usage.total_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.usage.decode_tokens_per_s

    @property
    def seed(self) -> int:
        return self.usage.seed


ClientEvent = Routed | Piece | Finished
