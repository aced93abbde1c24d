"""The planner's canonical, quantized view of a mesh graph.

Input contract (networkx.DiGraph):
- node key: node id (str); attributes `memory_budget` (int bytes the daemon may use for a
  model), `flops` (float32 matmul FLOP/s), `mem_bandwidth` (bytes/s), optional `name`,
  optional `collective_overhead_s` (seconds the node adds to each collective of a
  tensor-parallel group: device synchronisation; partitioner.cost has the default),
  optional `row_flops` (FLOP/s of each row a batched decode step adds, measured by the node from
  its own steps; partitioner.cost: absent, a row adds only its share of the roofline),
  optional `layer_overhead_s` (fixed seconds per layer and decode step: kernel launches and
  synchronisation that do not shrink with the bytes read; 0 when not given).
  Optional `dtype_flops` / `dtype_bandwidth`: {compute key: rate} measured per compute dtype
  ("float32", "float16", "bfloat16", "q4/bfloat16", ...: ModelSpec.compute_key). A GPU runs
  half precision many times faster than float32, a CPU often many times slower, so a model is
  priced at its own key: the node's rate for that key, else (a quantized model) the node's
  rate for the same dtype at another bit width, else `flops` / `mem_bandwidth`.
- edge u->v: `latency_s` (one-way seconds) and `bandwidth` (bytes/s); links may be asymmetric.
  Optional `trusted` (bool, default False): the link is point-to-point (a Thunderbolt bridge,
  a direct cable) or the user marked it trusted. Tensor-parallel collectives travel in clear
  (MLX's ring backend is plain TCP), so groups form only over links trusted in both directions.

What the view does with it, and why:
- Numbers are bucketed (see `partitioner.quantize`) so that noise does not change the plan.
- Everything is stored sorted by node id, so that any insertion order gives the same plan.
- Excluded nodes are removed entirely: they hold no layers and relay nothing.
- An edge whose bandwidth is 0, negative or not finite counts as no link (a dead measurement).
- Hops: a measured direct link is used when there is one. Without one, the payload is relayed
  along the fastest route for one token's hidden state (Dijkstra over latency + payload /
  bandwidth per link, store and forward; ties broken by node id); other payloads (the token id,
  the prompt) take the same route. The plan records the route. Nodes with no route between
  them cannot be neighbours in a pipeline (networkx finds the strongly connected parts).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import networkx as nx

from partitioner.errors import MeshError
from partitioner.quantize import bucket_index, bucket_value, latency_bucket_index

PATHS_BEFORE_TREE = 4


@dataclass(frozen=True)
class NodeProfile:
    """One node's planning inputs after quantization."""

    node_id: str
    name: str
    memory_budget: int
    flops_bucket: int
    mem_bandwidth_bucket: int
    collective_overhead_bucket: int | None = None
    layer_overhead_bucket: int | None = None

    @property
    def layer_overhead_s(self) -> float:
        """Fixed seconds per layer and step (0 when the node does not report one)."""
        if self.layer_overhead_bucket is None:
            return 0.0
        return bucket_value(self.layer_overhead_bucket)

    row_flops_bucket: int | None = None

    @property
    def row_flops(self) -> float:
        """FLOP/s of each row a batched decode step adds; inf when not reported."""
        if self.row_flops_bucket is None:
            return math.inf
        return bucket_value(self.row_flops_bucket)

    priced_as: str = field(default="flops", compare=False)  # which measurement (module doc)

    @property
    def flops(self) -> float:
        return bucket_value(self.flops_bucket)

    @property
    def collective_overhead_s(self) -> float | None:
        """The node's own cost of one collective, None when it does not report one."""
        if self.collective_overhead_bucket is None:
            return None
        return bucket_value(self.collective_overhead_bucket)

    @property
    def mem_bandwidth(self) -> float:
        return bucket_value(self.mem_bandwidth_bucket)


@dataclass(frozen=True)
class LinkProfile:
    """One directed link's planning inputs after quantization (values kept for speed)."""

    latency_bucket: int
    bandwidth_bucket: int
    trusted: bool = False
    latency_s: float = field(init=False, compare=False)
    bandwidth: float = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_s", bucket_value(self.latency_bucket))
        object.__setattr__(self, "bandwidth", bucket_value(self.bandwidth_bucket))

    def transfer_s(self, payload_bytes: float) -> float:
        return self.latency_s + payload_bytes / self.bandwidth


@dataclass(frozen=True)
class Route:
    """How a payload goes from one node to another: the path and its predicted time."""

    path: tuple[str, ...]
    seconds: float


class MeshView:
    """Quantized nodes and links, sorted by id, with cached routing."""

    def __init__(
        self,
        nodes: dict[str, NodeProfile],
        links: dict[tuple[str, str], LinkProfile],
        route_payload_bytes: float = 0.0,
    ) -> None:
        self.nodes = {key: nodes[key] for key in sorted(nodes)}
        self.links = {key: links[key] for key in sorted(links)}
        self.node_ids = tuple(self.nodes)
        self.route_payload_bytes = route_payload_bytes
        self._neighbours: dict[str, list[tuple[str, float, float]]] | None = None
        self._paths: dict[tuple[str, str], tuple[str, ...] | None] = {}
        self._trees: dict[str, dict[str, str]] = {}
        self._queries: dict[str, int] = {}
        self._components: list[tuple[str, ...]] | None = None

    @classmethod
    def from_graph(
        cls,
        graph: nx.DiGraph,
        exclude: frozenset[str] = frozenset(),
        route_payload_bytes: float = 0.0,
        compute_key: str = "",
    ) -> MeshView:
        """The view of `graph` without the `exclude`d nodes; relayed routes are chosen for a
        payload of `route_payload_bytes` (one token's hidden state); nodes are priced at
        `compute_key` (the model's, see the module docstring; "" for `flops` alone)."""
        if not isinstance(graph, nx.DiGraph):
            raise MeshError(f"the mesh must be a networkx.DiGraph, got {type(graph).__name__}")
        nodes = {
            str(node): _node_profile(str(node), data, compute_key)
            for node, data in graph.nodes(data=True)
            if str(node) not in exclude
        }
        links: dict[tuple[str, str], LinkProfile] = {}
        for src, dst, data in graph.edges(data=True):
            key = (str(src), str(dst))
            if key[0] == key[1] or key[0] not in nodes or key[1] not in nodes:
                continue
            link = _link_profile(key, data)
            if link is not None:
                links[key] = link
        return cls(nodes, links, route_payload_bytes)

    def canonical(self) -> dict[str, Any]:
        """Exactly the quantized inputs the planner reads, as ints in sorted order (for hashing)."""
        return {
            "nodes": [
                [
                    n.node_id,
                    n.memory_budget,
                    n.flops_bucket,
                    n.mem_bandwidth_bucket,
                    n.collective_overhead_bucket,
                    # only when given, and named: the hashes of meshes without them stay
                    # what they were, and one cannot pass for the other
                    *(
                        [["layer_overhead", n.layer_overhead_bucket]]
                        if n.layer_overhead_bucket is not None
                        else []
                    ),
                    *(
                        [["row_flops", n.row_flops_bucket]]
                        if n.row_flops_bucket is not None
                        else []
                    ),
                ]
                for n in self.nodes.values()
            ],
            "links": [
                [src, dst, link.latency_bucket, link.bandwidth_bucket, int(link.trusted)]
                for (src, dst), link in self.links.items()
            ],
        }

    def route(self, src: str, dst: str, payload_bytes: float) -> Route | None:
        """Direct link if measured, else the fastest relayed route; None if unreachable."""
        if src == dst:
            return Route((src,), 0.0)
        link = self.links.get((src, dst))
        if link is not None:
            return Route((src, dst), link.transfer_s(payload_bytes))
        path = self._relayed_path(src, dst)
        if path is None:
            return None
        seconds = sum(self.links[hop].transfer_s(payload_bytes) for hop in pairwise(path))
        return Route(path, seconds)

    def components(self) -> list[tuple[str, ...]]:
        """Strongly connected parts (nodes that can all reach each other), largest total memory
        first, then by node ids."""
        if self._components is None:
            graph = nx.DiGraph()
            graph.add_nodes_from(self.node_ids)
            graph.add_edges_from(self.links)
            parts = [tuple(sorted(part)) for part in nx.strongly_connected_components(graph)]
            self._components = sorted(
                parts, key=lambda part: (-sum(self.nodes[n].memory_budget for n in part), part)
            )
        return self._components

    def neighbours(self, node: str) -> list[str]:
        """Nodes `node` has a measured direct link to, sorted by id."""
        return [neighbour for neighbour, _, _ in self._adjacency()[node]]

    def _relayed_path(self, src: str, dst: str) -> tuple[str, ...] | None:
        """Cached fastest path; a source asked for many targets gets its whole shortest-path
        tree computed once (cheaper than one search per target)."""
        tree = self._trees.get(src)
        if tree is None and (src, dst) not in self._paths:
            self._queries[src] = self._queries.get(src, 0) + 1
            if self._queries[src] > PATHS_BEFORE_TREE:
                tree = self._trees[src] = self._dijkstra(src, None)
            else:
                self._paths[(src, dst)] = _path_to(self._dijkstra(src, dst), src, dst)
        if tree is not None:
            return _path_to(tree, src, dst)
        return self._paths[(src, dst)]

    def _dijkstra(self, src: str, dst: str | None) -> dict[str, str]:
        """Predecessors on the fastest paths for route_payload_bytes from src (until dst is
        settled, or over the whole mesh for dst None); equal times prefer lower node ids."""
        adjacency = self._adjacency()
        payload = self.route_payload_bytes
        best = {src: 0.0}
        previous: dict[str, str] = {}
        heap = [(0.0, src)]
        settled: set[str] = set()
        while heap:
            distance, node = heapq.heappop(heap)
            if node == dst:
                break
            if node in settled:
                continue
            settled.add(node)
            for neighbour, latency, bandwidth in adjacency[node]:
                candidate = distance + latency + payload / bandwidth
                if candidate < best.get(neighbour, math.inf):
                    best[neighbour] = candidate
                    previous[neighbour] = node
                    heapq.heappush(heap, (candidate, neighbour))
        return previous

    def _adjacency(self) -> dict[str, list[tuple[str, float, float]]]:
        if self._neighbours is None:
            neighbours: dict[str, list[tuple[str, float, float]]] = {n: [] for n in self.node_ids}
            for (src, dst), link in self.links.items():
                neighbours[src].append((dst, link.latency_s, link.bandwidth))
            self._neighbours = neighbours
        return self._neighbours


def _path_to(previous: dict[str, str], src: str, dst: str) -> tuple[str, ...] | None:
    if dst not in previous:
        return None
    path = [dst]
    while path[-1] != src:
        path.append(previous[path[-1]])
    return tuple(reversed(path))


def _node_profile(node_id: str, data: dict[str, Any], compute_key: str = "") -> NodeProfile:
    budget = data.get("memory_budget")
    if isinstance(budget, float) and budget.is_integer():
        budget = int(budget)
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise MeshError(
            f"node {node_id!r}: memory_budget must be an integer number of bytes, got {budget!r}"
        )
    flops_key, flops = _priced_rate(node_id, data, "dtype_flops", compute_key)
    bandwidth_key, bandwidth = _priced_rate(node_id, data, "dtype_bandwidth", compute_key)
    return NodeProfile(
        node_id=node_id,
        name=str(data.get("name") or node_id),
        memory_budget=max(0, budget),
        flops_bucket=_positive_bucket(
            node_id,
            "flops" if flops is None else f"dtype_flops[{flops_key}]",
            data.get("flops") if flops is None else flops,
            "FLOP/s",
        ),
        mem_bandwidth_bucket=_positive_bucket(
            node_id,
            "mem_bandwidth" if bandwidth is None else f"dtype_bandwidth[{bandwidth_key}]",
            data.get("mem_bandwidth") if bandwidth is None else bandwidth,
            "bytes/s",
        ),
        collective_overhead_bucket=_overhead_bucket(node_id, data.get("collective_overhead_s")),
        layer_overhead_bucket=_overhead_bucket(
            node_id, data.get("layer_overhead_s"), "layer_overhead_s"
        ),
        priced_as=flops_key if flops is not None else "flops",
        row_flops_bucket=(
            None
            if data.get("row_flops") is None
            else _positive_bucket(node_id, "row_flops", data.get("row_flops"), "FLOP/s")
        ),
    )


def _priced_rate(
    node_id: str, data: dict[str, Any], attribute: str, compute_key: str
) -> tuple[str, Any]:
    """(key, rate) of the node's `attribute` map for `compute_key`, or ("", None) to use the
    float32 figure: the exact key, else for a quantized key the same dtype at another width."""
    rates = data.get(attribute)
    if not compute_key or not rates:
        return "", None
    if not isinstance(rates, dict):
        raise MeshError(
            f"node {node_id!r}: {attribute} must map compute keys to rates, got {rates!r}"
        )
    if compute_key in rates:
        return compute_key, rates[compute_key]
    if compute_key.startswith("q") and "/" in compute_key:
        dtype = compute_key.split("/", 1)[1]
        for key in sorted(rates):
            if key.startswith("q") and key.endswith(f"/{dtype}"):
                return key, rates[key]
    return "", None


def _overhead_bucket(
    node_id: str, value: Any, attribute: str = "collective_overhead_s"
) -> int | None:
    if value is None:
        return None
    if not _is_finite_number(value) or value < 0:
        raise MeshError(
            f"node {node_id!r}: {attribute} must be a number of seconds >= 0, got {value!r}"
        )
    return latency_bucket_index(float(value))


def _positive_bucket(node_id: str, attribute: str, value: Any, unit: str) -> int:
    if not _is_finite_number(value) or value <= 0:
        raise MeshError(
            f"node {node_id!r}: {attribute} must be a positive number of {unit} (the daemon's "
            f"measurement), got {value!r}; measure the node or exclude it"
        )
    return bucket_index(float(value))


def _link_profile(key: tuple[str, str], data: dict[str, Any]) -> LinkProfile | None:
    latency, bandwidth = data.get("latency_s"), data.get("bandwidth")
    if not _is_finite_number(latency) or latency < 0:
        raise MeshError(
            f"link {key[0]!r}->{key[1]!r}: latency_s must be a number of seconds >= 0, "
            f"got {latency!r}"
        )
    if bandwidth is None or isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float):
        raise MeshError(
            f"link {key[0]!r}->{key[1]!r}: bandwidth must be a number of bytes/s, got {bandwidth!r}"
        )
    if not math.isfinite(bandwidth) or bandwidth <= 0:
        return None
    trusted = data.get("trusted", False)
    if not isinstance(trusted, bool):
        raise MeshError(f"link {key[0]!r}->{key[1]!r}: trusted must be true or false")
    return LinkProfile(
        latency_bucket_index(float(latency)), bucket_index(float(bandwidth)), trusted
    )


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
