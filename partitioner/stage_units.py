"""What a stage can run on: single nodes, and tensor-parallel groups of nodes.

Tensor-parallel groups: g nodes split every layer of their stage (mlx-lm's `shard(group)`),
which pays two all-reduces per layer per token; the cost model decides whether a group beats
the same nodes as pipeline stages, alone or not at all. A group is offered only when
- the architecture can shard itself (ModelSpec.supports_tensor_parallel),
- g divides both the attention and the KV head counts (mlx-lm divides the heads by g),
- every pair of members is joined by links marked trusted in both directions: the collectives
  travel in clear, so only point-to-point links (Thunderbolt, a direct cable) or links the user
  marked trusted may carry them (partitioner.mesh).
Groups are formed inside each connected set of trusted links, for every allowed degree: every
set of mutually linked nodes when there are at most ALL_GROUPS_LIMIT candidates (small meshes:
a 2 + 1 mesh must be able to pair the two slower nodes), else greedily: members ordered by
speed then id, each joining the first group it has trusted links to every member of. A group's
routed experts are split in proportion to its members' usable memory (an even split for equal
members); partitioner.experts refines the placement in the final plan.
"""

from __future__ import annotations

import math
from itertools import combinations

import networkx as nx

from partitioner.cost import DEFAULT_COLLECTIVE_OVERHEAD_S, CostModel, Unit
from partitioner.mesh import MeshView
from partitioner.model import ModelSpec
from partitioner.split import largest_remainder

TP_MAX_DEGREE = 8
MAX_GROUPS = 64
ALL_GROUPS_LIMIT = 28


def usable_bytes(view: MeshView, node: str, reserve_bytes: int) -> int:
    return max(0, view.nodes[node].memory_budget - reserve_bytes)


def single_units(view: MeshView, reserve_bytes: int) -> list[Unit]:
    """One unit per node with some usable memory, sorted by node id."""
    units = []
    for node_id, node in view.nodes.items():
        usable = usable_bytes(view, node_id, reserve_bytes)
        if usable > 0:
            units.append(
                Unit(
                    (node_id,),
                    usable,
                    node.flops,
                    node.mem_bandwidth,
                    layer_overhead_s=node.layer_overhead_s,
                    row_flops=node.row_flops,
                )
            )
    return units


def tensor_parallel_degrees(model: ModelSpec) -> list[int]:
    """Group sizes the model's heads allow (empty when the architecture cannot shard)."""
    if not model.supports_tensor_parallel:
        return []
    return [
        g
        for g in range(2, TP_MAX_DEGREE + 1)
        if model.num_attention_heads % g == 0 and model.num_key_value_heads % g == 0
    ]


def tensor_parallel_units(
    view: MeshView, model: ModelSpec, cost: CostModel, singles: list[Unit]
) -> list[Unit]:
    """Candidate tensor-parallel groups (see module docstring), deterministic order."""
    degrees = tensor_parallel_degrees(model)
    if not degrees:
        return []
    by_node = {unit.leader: unit for unit in singles}
    trusted = trusted_link_graph(view, sorted(by_node))
    groups: list[Unit] = []
    for component in sorted(nx.connected_components(trusted), key=min):
        if len(component) < 2:
            continue
        members = sorted(component, key=lambda n: (cost.per_layer_decode_s(by_node[n]), n))
        for degree in degrees:
            for group in _cliques(trusted, members, degree):
                groups.append(group_unit(view, [by_node[n] for n in group], model.num_experts))
                if len(groups) >= MAX_GROUPS:
                    return groups
    return groups


def trusted_link_graph(view: MeshView, nodes: list[str]) -> nx.Graph:
    """Undirected graph of the node pairs joined by trusted links in both directions."""
    graph = nx.Graph()
    graph.add_nodes_from(nodes)
    present = set(nodes)
    for (src, dst), link in view.links.items():
        if src >= dst or src not in present or dst not in present:
            continue
        back = view.links.get((dst, src))
        if back is not None and link.trusted and back.trusted:
            graph.add_edge(src, dst)
    return graph


def _cliques(graph: nx.Graph, members: list[str], degree: int) -> list[tuple[str, ...]]:
    """Groups of `degree` mutually linked members (module docstring), faster members first."""
    if degree > len(members):
        return []
    if math.comb(len(members), degree) > ALL_GROUPS_LIMIT:
        return _greedy_cliques(graph, members, degree)
    return [
        tuple(sorted(combo))
        for combo in combinations(members, degree)
        if all(graph.has_edge(a, b) for a, b in combinations(combo, 2))
    ]


def _greedy_cliques(graph: nx.Graph, members: list[str], degree: int) -> list[tuple[str, ...]]:
    """Disjoint groups of `degree` mutually linked members, faster members first."""
    groups: list[list[str]] = []
    for node in members:
        for group in groups:
            if len(group) < degree and all(graph.has_edge(node, other) for other in group):
                group.append(node)
                break
        else:
            groups.append([node])
    return [tuple(sorted(group)) for group in groups if len(group) == degree]


def group_unit(view: MeshView, members: list[Unit], num_experts: int) -> Unit:
    """A group of these one-node units, members in id order, experts split by usable memory."""
    ordered = sorted(members, key=lambda unit: unit.leader)
    nodes = tuple(unit.leader for unit in ordered)
    links = [view.links[(a, b)] for a in nodes for b in nodes if a != b]
    overheads = [view.nodes[n].collective_overhead_s for n in nodes]
    usable = tuple(unit.usable_bytes for unit in ordered)
    return Unit(
        nodes=nodes,
        usable_bytes=sum(usable),
        flops=min(unit.flops for unit in ordered),
        mem_bandwidth=min(unit.mem_bandwidth for unit in ordered),
        link_latency_s=max((link.latency_s for link in links), default=0.0),
        link_bandwidth=min((link.bandwidth for link in links), default=math.inf),
        member_usable=usable,
        member_flops=tuple(unit.flops for unit in ordered),
        member_bandwidth=tuple(unit.mem_bandwidth for unit in ordered),
        expert_counts=tuple(largest_remainder(num_experts, list(usable))),
        collective_overhead_s=max(
            DEFAULT_COLLECTIVE_OVERHEAD_S if value is None else value for value in overheads
        ),
        layer_overhead_s=max(unit.layer_overhead_s for unit in ordered),
    )
