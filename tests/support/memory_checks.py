"""Memory checks shared by the tests that run a model across daemons under a budget."""

from __future__ import annotations

from typing import Any


def assert_nodes_hold_only_their_share(
    nodes: list[Any], plan: dict[str, Any], budget: int, weights: int
) -> None:
    """Every node stays within its budget and the plan's prediction, and holds only its own
    part of the model (its layers or experts, not the whole model's)."""
    held = 0
    for node in nodes:
        status = node.status()
        memory = status.memory
        share = next(m for m in plan["memory"] if m["node"] == status.node_id)
        assert memory.budget == budget
        assert 0 < memory.mlx_peak <= budget, (status.node_id, memory)
        assert memory.mlx_peak <= memory.planned, (status.node_id, memory, share)
        assert memory.mlx_active < share["weights_bytes"] * 1.15 + 4_000_000, (memory, share)
        held += memory.mlx_active
    assert held < weights * 1.3
