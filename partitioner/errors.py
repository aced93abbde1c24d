"""Errors the planner raises: a refusal when the model cannot fit, and bad mesh input."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partitioner.humanize import format_bytes


class MeshError(ValueError):
    """The mesh graph is missing a measurement or holds an impossible value."""


class InsufficientMemory(Exception):
    """No plan fits the model into the mesh's memory; says how much is missing and where.

    needed_bytes: the least memory the model needs (all weights, KV cache for the reserved
        context and concurrency, activations and overhead, as if on one node; every additional
        stage needs a little more).
    available_bytes: usable memory of all eligible nodes (budget minus reserve).
    per_node_shortfall: node id -> bytes over its usable budget in a memory-proportional split
        over all eligible nodes (where the memory is missing).
    detail: one sentence on why no placement exists.
    """

    def __init__(
        self,
        *,
        model_name: str,
        needed_bytes: int,
        available_bytes: int,
        per_node_shortfall: Mapping[str, int],
        detail: str,
    ) -> None:
        self.model_name = model_name
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.per_node_shortfall = dict(sorted(per_node_shortfall.items()))
        self.detail = detail
        super().__init__(self.message)

    @property
    def missing_bytes(self) -> int:
        """How much more memory the mesh needs in total (0 when only the packing fails)."""
        return max(0, self.needed_bytes - self.available_bytes)

    @property
    def message(self) -> str:
        text = (
            f"not enough memory in this mesh for {self.model_name}: need "
            f"{format_bytes(self.needed_bytes)}, have {format_bytes(self.available_bytes)}"
        )
        if self.missing_bytes:
            text += f" (missing {format_bytes(self.missing_bytes)})"
        return f"{text}; {self.detail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": "insufficient_memory",
            "model": self.model_name,
            "needed_bytes": self.needed_bytes,
            "available_bytes": self.available_bytes,
            "missing_bytes": self.missing_bytes,
            "per_node_shortfall": dict(self.per_node_shortfall),
            "detail": self.detail,
            "message": self.message,
        }


def describe_refusal(error: InsufficientMemory) -> str:
    """A few readable lines: the one-line message, then each node's shortfall."""
    lines = [error.message]
    if error.per_node_shortfall:
        lines.append("over budget in a memory-proportional split over all eligible nodes:")
        width = max(len(node) for node in error.per_node_shortfall)
        for node, short in sorted(error.per_node_shortfall.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {node:<{width}}  needs {format_bytes(short)} more")
    lines.append(
        "options: add a node or memory, lower --context or --concurrency, reduce --reserve, "
        "or use a more strongly quantized model"
    )
    return "\n".join(lines)


class ParallelismUnavailable(ValueError):
    """A forced kind of layout (PlanOptions.parallelism) cannot run on this mesh and model.

    kind: the layout asked for ("solo", "pipeline", "tensor" or "hybrid"); missing: what the
    mesh or model lacks for it, naming the numbers (nodes left, group sizes, heads, memory);
    remedy: what to do about it; reason: both in one sentence.
    """

    def __init__(self, kind: str, model_name: str, missing: str, remedy: str = "") -> None:
        self.kind = kind
        self.model_name = model_name
        self.missing = missing
        self.remedy = remedy
        super().__init__(self.message)

    @property
    def reason(self) -> str:
        return f"{self.missing}; {self.remedy}" if self.remedy else self.missing

    @property
    def message(self) -> str:
        return f"no {self.kind} layout of {self.model_name} can run on this mesh: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": "parallelism_unavailable",
            "parallelism": self.kind,
            "model": self.model_name,
            "missing": self.missing,
            "remedy": self.remedy,
            "reason": self.reason,
            "message": self.message,
        }
