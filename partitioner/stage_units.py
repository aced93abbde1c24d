"""What a stage can run on: single nodes, and tensor-parallel groups of nodes on fast links.

Tensor-parallel groups (only with PlanOptions.allow_tensor_parallel): g nodes split every
layer of their stage, which pays two all-reduces per layer, so only nodes joined by fast,
low-latency links in both directions (latency <= TP_MAX_LATENCY_S, e.g. Thunderbolt 5 with
RDMA at ~5 us) are grouped, and only when g divides both the attention and the KV head counts.
Groups are formed greedily inside each connected set of fast links: members ordered by speed
then id, each joining the first group it has fast links to every member of. The cost model
then decides whether a group beats the same nodes as separate pipeline stages.
"""

from __future__ import annotations

import math

import networkx as nx

from partitioner.cost import CostModel, Unit
from partitioner.mesh import MeshView
from partitioner.model import ModelSpec

TP_MAX_LATENCY_S = 100e-6
TP_MAX_DEGREE = 8
MAX_GROUPS = 64


def usable_bytes(view: MeshView, node: str, reserve_bytes: int) -> int:
    return max(0, view.nodes[node].memory_budget - reserve_bytes)


def single_units(view: MeshView, reserve_bytes: int) -> list[Unit]:
    """One unit per node with some usable memory, sorted by node id."""
    units = []
    for node_id, node in view.nodes.items():
        usable = usable_bytes(view, node_id, reserve_bytes)
        if usable > 0:
            units.append(Unit((node_id,), usable, node.flops, node.mem_bandwidth))
    return units


def tensor_parallel_units(
    view: MeshView, model: ModelSpec, cost: CostModel, singles: list[Unit]
) -> list[Unit]:
    """Candidate tensor-parallel groups (see module docstring), deterministic order."""
    degrees = [
        g
        for g in range(2, TP_MAX_DEGREE + 1)
        if model.num_attention_heads % g == 0 and model.num_key_value_heads % g == 0
    ]
    if not degrees:
        return []
    by_node = {unit.leader: unit for unit in singles}
    fast = _fast_link_graph(view, sorted(by_node))
    groups: list[Unit] = []
    for component in sorted(nx.connected_components(fast), key=min):
        if len(component) < 2:
            continue
        members = sorted(component, key=lambda n: (cost.per_layer_decode_s(by_node[n]), n))
        for degree in degrees:
            for group in _greedy_cliques(fast, members, degree):
                groups.append(_group_unit(view, [by_node[n] for n in group]))
                if len(groups) >= MAX_GROUPS:
                    return groups
    return groups


def _fast_link_graph(view: MeshView, nodes: list[str]) -> nx.Graph:
    graph = nx.Graph()
    graph.add_nodes_from(nodes)
    present = set(nodes)
    for (src, dst), link in view.links.items():
        if src >= dst or src not in present or dst not in present:
            continue
        back = view.links.get((dst, src))
        if back is None:
            continue
        if max(link.latency_s, back.latency_s) <= TP_MAX_LATENCY_S:
            graph.add_edge(src, dst)
    return graph


def _greedy_cliques(graph: nx.Graph, members: list[str], degree: int) -> list[tuple[str, ...]]:
    """Disjoint groups of `degree` mutually fast-linked members, faster members first."""
    groups: list[list[str]] = []
    for node in members:
        for group in groups:
            if len(group) < degree and all(graph.has_edge(node, other) for other in group):
                group.append(node)
                break
        else:
            groups.append([node])
    return [tuple(sorted(group)) for group in groups if len(group) == degree]


def _group_unit(view: MeshView, members: list[Unit]) -> Unit:
    nodes = tuple(sorted(unit.leader for unit in members))
    links = [view.links[(a, b)] for a in nodes for b in nodes if a != b]
    return Unit(
        nodes=nodes,
        usable_bytes=min(unit.usable_bytes for unit in members),
        flops=min(unit.flops for unit in members),
        mem_bandwidth=min(unit.mem_bandwidth for unit in members),
        link_latency_s=max((link.latency_s for link in links), default=0.0),
        link_bandwidth=min((link.bandwidth for link in links), default=math.inf),
    )
