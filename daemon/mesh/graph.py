"""The mesh view: live nodes and measured links as a networkx graph.

This is the partitioner's input. It is built only from `NodeState`s exactly as
each node serves them (its own profile and its own outgoing links), so every
node that has fetched the same states builds the same graph, attribute for
attribute. Links to or from nodes that are not alive are left out.

Node attributes: memory_budget (bytes: the node's budget less its process overhead, see
`plannable_budget`), flops (FLOP/s), mem_bandwidth (bytes/s), name, and where the profile
measured them dtype_flops / dtype_bandwidth ({compute key: rate}). FLOP/s and bandwidth (per
dtype too) are the profile's divided by the node's published speed correction
(`meshd.mesh.speed_correction`: how much slower its decode steps ran than predicted; FLOP/s by
its compute factor instead where it measured its prompt chunks). Nodes of one machine (the
same profile fingerprint: daemons beside each other, as `meshd demo` runs them) are planned
with one shared correction, the median of what they published (`machine_corrections`);
row_flops, where the node measured it: FLOP/s of each row a batched decode step adds;
collective_overhead_s, where it led a tensor-parallel group: what each collective cost.
Edge attributes (directed src -> dst): latency_s and bandwidth (bytes/s) as planning uses
them (the measurer's bucket, with hysteresis), measured_latency_s and measured_bandwidth
(the last raw sample), tcp_rtt_s, grpc_rtt_s, measured_at, and trusted: whether the link may
carry tensor-parallel collectives, True only when both its directions' measurers allowed it
(`meshd.mesh.link_trust`; the partitioner forms groups only over trusted links).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence

import networkx as nx

from meshd.wire import pb
from partitioner.quantize import bucket_index, bucket_value


def mesh_graph(states: Iterable[pb.NodeState]) -> nx.DiGraph:
    """Graph of the given node states (each one a live node)."""
    states = sorted(states, key=lambda s: s.profile.node_id)
    corrections = machine_corrections(states)
    graph = nx.DiGraph()
    for state in states:
        if state.profile.node_id in corrections:
            state = _corrected(state, corrections[state.profile.node_id])
        profile = state.profile
        graph.add_node(
            profile.node_id,
            name=profile.name,
            memory_budget=plannable_budget(profile),
            flops=effective_flops(state),
            mem_bandwidth=effective_bandwidth(state),
            **dtype_rates(state),
        )
        if state.speed_correction.row_flops > 0:
            graph.nodes[profile.node_id]["row_flops"] = state.speed_correction.row_flops
        if state.speed_correction.collective_overhead_s > 0:
            overhead = state.speed_correction.collective_overhead_s
            graph.nodes[profile.node_id]["collective_overhead_s"] = overhead
    published = {
        (link.src, link.dst): link
        for state in states
        for link in state.links
        if link.src == state.profile.node_id
    }
    for state in states:
        for link in sorted(state.links, key=lambda m: m.dst):
            if link.src != state.profile.node_id or link.dst not in graph:
                continue
            back = published.get((link.dst, link.src))
            graph.add_edge(
                link.src,
                link.dst,
                latency_s=planning_latency(link),
                bandwidth=planning_bandwidth(link),
                measured_latency_s=link.latency_s,
                measured_bandwidth=link.bandwidth,
                tcp_rtt_s=link.tcp_rtt_s,
                grpc_rtt_s=link.grpc_rtt_s,
                measured_at=link.measured_at,
                trusted=bool(link.trusted and back is not None and back.trusted),
            )
    return graph


def machine_corrections(states: Sequence[pb.NodeState]) -> dict[str, pb.SpeedCorrection]:
    """The speed correction each node of a machine shared by several nodes is planned with,
    by node id: one for all of them, each figure the median of the members that published it.

    Why: nodes on one machine share its cores and memory bus, so each node's decode steps
    measure the machine under the others' load as much as the node itself. Two unpinned
    daemons on one machine with one profile, serving their first 4 requests, re-planned from
    19/11 layers to 21/9 in one run and to 12/18 in another as their first corrections came,
    every request moving by replay.
    With one factor for the machine its nodes stay as fast as each other, a correction moves
    their speed together, and the layout (so the plan id) stays. Each keeps its own collective
    cost (a tensor-parallel leader's). Nodes alone on their machine are not in the result."""
    by_machine: defaultdict[str, list[pb.NodeState]] = defaultdict(list)
    for state in states:
        if state.profile.fingerprint:
            by_machine[state.profile.fingerprint].append(state)
    shared: dict[str, pb.SpeedCorrection] = {}
    for members in by_machine.values():
        published = [m.speed_correction for m in members if m.HasField("speed_correction")]
        if len(members) < 2 or not published:
            continue
        factor, compute, rows = (
            _median_of([getattr(c, name) for c in published])
            for name in ("factor", "compute_factor", "row_flops")
        )
        for member in members:
            correction = pb.SpeedCorrection()
            correction.CopyFrom(member.speed_correction)
            correction.node_id = member.profile.node_id
            correction.factor, correction.compute_factor, correction.row_flops = (
                factor,
                compute,
                rows,
            )
            shared[member.profile.node_id] = correction
    return shared


def _median_of(values: list[float]) -> float:
    """The median of the figures published (> 0); 0 when none was."""
    published = sorted(v for v in values if v > 0)
    return float(statistics.median(published)) if published else 0.0


def _corrected(state: pb.NodeState, correction: pb.SpeedCorrection) -> pb.NodeState:
    """``state`` as planning sees it, with ``correction`` in place of its own."""
    planned = pb.NodeState()
    planned.CopyFrom(state)
    planned.speed_correction.CopyFrom(correction)
    return planned


def plannable_budget(profile: pb.NodeProfile) -> int:
    """What plans may place on a node: its memory budget less the memory its daemon's process
    holds beside the model (`process_overhead`, measured by the node; 0 from older nodes)."""
    return max(0, int(profile.memory_budget) - int(profile.process_overhead))


def dtype_rates(state: pb.NodeState) -> dict[str, dict[str, float]]:
    """The profile's per-dtype rates as the partitioner reads them (partitioner.mesh), corrected
    as `flops` and `mem_bandwidth` are (the correction was measured against whichever rate the
    model was priced at), each at its bucket's value: every node builds the same graph from
    the same states, and noise inside a bucket changes no plan. Empty for older profiles."""
    divisors = {"dtype_flops": _compute_divisor(state), "dtype_bandwidth": speed_factor(state)}
    rates = {}
    for name, divisor in divisors.items():
        measured = getattr(state.profile, name)
        if measured:
            rates[name] = {
                key: bucket_value(bucket_index(rate / divisor))
                for key, rate in sorted(measured.items())
                if rate > 0
            }
    return rates


def speed_factor(state: pb.NodeState) -> float:
    """The node's published speed correction (1 when it published none)."""
    factor = state.speed_correction.factor if state.HasField("speed_correction") else 0.0
    return factor if factor > 0 else 1.0


def _compute_divisor(state: pb.NodeState) -> float:
    compute = state.speed_correction.compute_factor
    return compute if compute > 0 else speed_factor(state)


def effective_flops(state: pb.NodeState) -> float:
    """The FLOP/s planning uses: the profile's, divided by the node's compute factor where it
    measured its prompts, else by its speed correction."""
    return float(state.profile.flops) / _compute_divisor(state)


def effective_bandwidth(state: pb.NodeState) -> float:
    """The memory bandwidth planning uses: the profile's, divided by the speed correction."""
    return float(state.profile.mem_bandwidth) / speed_factor(state)


def planning_bandwidth(link: pb.LinkMeasurement) -> float:
    """The bandwidth planning uses: the measurer's (sticky) bucket, else the raw number."""
    if link.HasField("bandwidth_bucket"):
        return bucket_value(link.bandwidth_bucket)
    return link.bandwidth


def planning_latency(link: pb.LinkMeasurement) -> float:
    if link.HasField("latency_bucket"):
        return bucket_value(link.latency_bucket)
    return link.latency_s


def graph_from_status(status: pb.MeshStatus) -> nx.DiGraph:
    """The live view as the local API reports it (for `meshd plan` and tools)."""
    alive = {n.profile.node_id for n in status.nodes if n.alive}
    corrections = {c.node_id: c for c in status.speed_corrections}
    states = [
        pb.NodeState(
            profile=n.profile,
            links=[m for m in status.links if m.src == n.profile.node_id and m.dst in alive],
            speed_correction=corrections.get(n.profile.node_id),
        )
        for n in status.nodes
        if n.alive
    ]
    return mesh_graph(states)


def graph_digest(graph: nx.DiGraph) -> str:
    """Hash of the graph's structure and attributes (for tests and convergence checks)."""
    payload = {
        "nodes": [[n, sorted(graph.nodes[n].items())] for n in sorted(graph.nodes)],
        "edges": [[u, v, sorted(d.items())] for u, v, d in sorted(graph.edges(data=True))],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
