"""Options that change a plan: strategy, per-node reserve, excluded nodes, context and load."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("speed", "memory")


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
    prompt_len: prompt length used for the predicted time to first token.
    allow_tensor_parallel: let nodes joined by fast links form tensor-parallel groups.
    prefill_chunk: tokens processed per prefill step (bounds activation memory; mlx-lm: 2048).
    """

    strategy: str = "speed"
    reserve_bytes: int = 0
    exclude: frozenset[str] = field(default_factory=frozenset)
    context_length: int | None = None
    concurrency: int = 1
    prompt_len: int = 512
    allow_tensor_parallel: bool = False
    prefill_chunk: int = 2048

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude", _as_id_set(self.exclude))
        if self.strategy not in STRATEGIES:
            raise PlanOptionsError(
                f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}"
            )
        _require_int("reserve_bytes", self.reserve_bytes, minimum=0)
        _require_int("concurrency", self.concurrency, minimum=1)
        _require_int("prompt_len", self.prompt_len, minimum=1)
        _require_int("prefill_chunk", self.prefill_chunk, minimum=1)
        if self.context_length is not None:
            _require_int("context_length", self.context_length, minimum=1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (exclude as a sorted list)."""
        return {
            "strategy": self.strategy,
            "reserve_bytes": self.reserve_bytes,
            "exclude": sorted(self.exclude),
            "context_length": self.context_length,
            "concurrency": self.concurrency,
            "prompt_len": self.prompt_len,
            "allow_tensor_parallel": self.allow_tensor_parallel,
            "prefill_chunk": self.prefill_chunk,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanOptions:
        return cls(**{**data, "exclude": frozenset(data.get("exclude", ()))})


def _as_id_set(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, str):
        raise PlanOptionsError(
            f"exclude must be a collection of node ids, not the string {value!r}"
        )
    return frozenset(str(item) for item in value)


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PlanOptionsError(f"{name} must be an integer >= {minimum}, got {value!r}")
