"""Free loopback ports for tensor-parallel runners started by tests and benchmarks."""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path

from meshd.inference.tensor_parallel.spec import PORT_SLOTS, PORT_STRIDE, group_ports

LOWEST_BASE = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_base_port(plan_id: str, stage_indexes: Sequence[int], size: int) -> int:
    """A base port whose derived ports (every stage of the plan) are all free on loopback,
    and below the system's ephemeral ports where it can be: a port free now but in that range
    can be taken by any outgoing connection (a gRPC client of another test) before the
    runner binds it, which failed a suite once ("[ring] Couldn't bind socket (error: 98)")."""
    top = _top_below_ephemeral(PORT_STRIDE * PORT_SLOTS)
    for _ in range(200):
        base = random.randrange(LOWEST_BASE, top)
        ports = []
        for stage in stage_indexes:
            ranks, control = group_ports(plan_id, stage, size, base)
            ports += [*ranks, control]
        if all(_bindable(port) for port in ports):
            return base
    raise RuntimeError("no free port range on loopback")


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports, free now and below the system's ephemeral ports
    (see :func:`free_base_port`), for processes that bind them a moment later."""
    top = _top_below_ephemeral(count)
    for _ in range(200):
        ports = random.sample(range(LOWEST_BASE, top), count)
        if all(_bindable(port) for port in ports):
            return ports
    raise RuntimeError("no free ports on loopback")


def _top_below_ephemeral(span: int) -> int:
    """Where a draw of ``span`` ports from LOWEST_BASE up must stop to stay below the system's
    ephemeral ports; 40000 for an unusual range that leaves no room (free now is the best
    there is then)."""
    top = min(40000, _first_ephemeral_port()) - span
    return top if top > LOWEST_BASE else 40000


def _first_ephemeral_port() -> int:
    """The lowest port the system hands to outgoing connections (Linux; else IANA's 49152)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
