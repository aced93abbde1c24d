"""Free loopback ports for tensor-parallel runners started by tests and benchmarks."""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence

from meshd.inference.tensor_parallel.spec import group_ports


def free_base_port(plan_id: str, stage_indexes: Sequence[int], size: int) -> int:
    """A base port whose derived ports (every stage of the plan) are all free on loopback."""
    for _ in range(200):
        base = random.randrange(20000, 40000)
        ports = []
        for stage in stage_indexes:
            ranks, control = group_ports(plan_id, stage, size, base)
            ports += [*ranks, control]
        if all(_bindable(port) for port in ports):
            return base
    raise RuntimeError("no free port range on loopback")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
