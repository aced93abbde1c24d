"""Options that change a plan: strategy, layout kind, reserve, exclusions, context and load."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("speed", "memory")
# A node joins a layout only where it makes it at least this much faster (PlanOptions.min_gain).
DEFAULT_MIN_GAIN = 0.10
PARALLELISMS = ("auto", "pipeline", "tensor", "hybrid")


class PlanOptionsError(ValueError):
    """An option value the planner cannot use."""


@dataclass(frozen=True)
class PlanOptions:
    """How to plan.

    strategy: "speed" minimises predicted time per token; "memory" is the baseline that splits
        layers in proportion to memory budgets (then corrects so that every node fits).
    reserve_bytes: memory kept free on every node (subtracted from its budget).
    exclude: node ids that must not hold layers nor relay traffic.
    context_length: tokens of KV cache to reserve per sequence; None = the model's default.
    concurrency: sequences decoded at the same time (KV cache is reserved for each).
    cache_sequences: sequences of KV cache reserved beyond `concurrency` for the stages'
        prefix caches (the prompts of recent requests kept, so that a conversation's next turn
        computes only its new tokens); they also use what running sequences leave free.
    prompt_len: prompt length used for the predicted time to first token.
    parallelism: the kind of layout. "auto" (default) compares one node alone, a pipeline,
        one tensor-parallel group and hybrids (pipeline stages that are tensor-parallel groups)
        and takes the fastest predicted; "pipeline" forces two or more stages of one node each,
        "tensor" one stage that is a tensor-parallel group, "hybrid" two or more stages of which
        at least one is a group. A forced kind that cannot run is refused with the reason
        (partitioner.errors.ParallelismUnavailable). Tensor-parallel groups form only over
        links marked trusted (partitioner.mesh) and for architectures that can shard.
    prefill_chunk: tokens processed per prefill step (bounds activation memory; mlx-lm: 2048).
    min_gain: what a node must add to join a layout (strategy speed): the planner takes the
        layout with the fewest nodes whose predicted time per token (at `concurrency`) is
        within this fraction of the fastest layout's, so a node joins only where it makes the
        layout at least this much faster or holds memory the model needs (fewer machines, fewer
        to fail). 0 takes the fastest layout (ties to fewer nodes). Default DEFAULT_MIN_GAIN.
    """

    strategy: str = "speed"
    reserve_bytes: int = 0
    exclude: frozenset[str] = field(default_factory=frozenset)
    context_length: int | None = None
    concurrency: int = 1
    cache_sequences: int = 0
    prompt_len: int = 512
    parallelism: str = "auto"
    prefill_chunk: int = 2048
    min_gain: float = DEFAULT_MIN_GAIN

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude", _as_id_set(self.exclude))
        if self.strategy not in STRATEGIES:
            raise PlanOptionsError(
                f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}"
            )
        if self.parallelism not in PARALLELISMS:
            raise PlanOptionsError(
                f"unknown parallelism {self.parallelism!r}; choose one of {', '.join(PARALLELISMS)}"
            )
        if self.strategy == "memory" and self.parallelism in ("tensor", "hybrid"):
            raise PlanOptionsError(
                "strategy memory is the proportional pipeline baseline; tensor and hybrid "
                "layouts are planned by strategy speed"
            )
        _require_int("reserve_bytes", self.reserve_bytes, minimum=0)
        _require_int("concurrency", self.concurrency, minimum=1)
        _require_int("cache_sequences", self.cache_sequences, minimum=0)
        _require_int("prompt_len", self.prompt_len, minimum=1)
        _require_int("prefill_chunk", self.prefill_chunk, minimum=1)
        if self.context_length is not None:
            _require_int("context_length", self.context_length, minimum=1)
        _require_fraction("min_gain", self.min_gain)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (exclude as a sorted list)."""
        return {
            "strategy": self.strategy,
            "reserve_bytes": self.reserve_bytes,
            "exclude": sorted(self.exclude),
            "context_length": self.context_length,
            "concurrency": self.concurrency,
            "cache_sequences": self.cache_sequences,
            "prompt_len": self.prompt_len,
            "parallelism": self.parallelism,
            "prefill_chunk": self.prefill_chunk,
            "min_gain": self.min_gain,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanOptions:
        """From `to_dict()` output. The key `allow_tensor_parallel` of earlier versions is
        accepted and dropped: tensor parallelism is now chosen by `parallelism` and trusted
        links."""
        values = {k: v for k, v in data.items() if k != "allow_tensor_parallel"}
        return cls(**{**values, "exclude": frozenset(values.get("exclude", ()))})


def _as_id_set(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, str):
        raise PlanOptionsError(
            f"exclude must be a collection of node ids, not the string {value!r}"
        )
    return frozenset(str(item) for item in value)


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PlanOptionsError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _require_fraction(name: str, value: object) -> None:
    """A number from 0 to 1 (10 % is 0.1)."""
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not 0.0 <= float(value) <= 1.0
    ):
        raise PlanOptionsError(f"{name} must be a fraction from 0 to 1 (0.1 is 10%), got {value!r}")
