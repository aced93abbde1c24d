"""A committed plan's tensor-parallel group, derived from what every member knows alike.

Nothing about a group is configured by hand: its members and their ranks are the plan's stage
(``Stage.nodes``), and the rest comes from the node states the plan was computed from (the
agreement hands them over with the committed plan, :class:`meshd.agreement.contract.PlanChange`),
which every member holds identically because the plan's inputs name them by digest:

* the address each rank's runner listens on: the peer address its ring predecessor measured
  the link to it on (``LinkMeasurement.dst_address``): the address the member is reached at
  over the very link whose trust was judged (a two-member group: each other's);
* why the group's link may carry the collectives in clear: every directed link between two
  members must be trusted by its measurer (:mod:`meshd.mesh.link_trust`), and the verdicts'
  reasons are what status shows;
* the ports: from rank 0's published ``tensor_parallel_port`` (its configured range), the plan
  id and the stage index (:func:`meshd.inference.tensor_parallel.spec.group_ports`).

The backend (:func:`group_backend`): NCCL where every member computes on an NVIDIA GPU through
MLX's CUDA backend and all are daemons of one host (their profiles' machine fingerprints are
equal: one daemon per GPU, each started with its own ``CUDA_VISIBLE_DEVICES``), so the
collectives stay on the host's NVLink or PCIe; otherwise MLX's ring (TCP), the one every
platform has. JACCL (RDMA over Thunderbolt 5) is supported by the spec and the runner, but the
daemon does not yet detect the devices it needs, so it never chooses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from meshd.inference.assignment import StageSpec
from meshd.inference.tensor_parallel.spec import (
    DEFAULT_BASE_PORT,
    TensorParallelSpec,
    TensorParallelUnsupported,
    build_group_spec,
    group_ports,
)
from meshd.mesh.link_trust import LinkVerdict
from meshd.wire import pb

BACKEND = "ring"  # the default: MLX's ring over TCP, on every platform


def group_backend(members: Sequence[str], states: Mapping[str, pb.NodeState]) -> str:
    """ "nccl" when every member computes on CUDA and all run on one host, else "ring"."""
    profiles = [states[node].profile if node in states else None for node in members]
    if len(members) < 2 or any(profile is None for profile in profiles):
        return BACKEND
    on_cuda = all(p.mlx_device == "gpu" and p.device_backend == "cuda" for p in profiles)
    one_host = len({p.fingerprint for p in profiles}) == 1 and bool(profiles[0].fingerprint)
    return "nccl" if on_cuda and one_host else BACKEND


def _published_links(
    states: Mapping[str, pb.NodeState],
) -> dict[tuple[str, str], pb.LinkMeasurement]:
    return {
        (link.src, link.dst): link
        for node, state in states.items()
        for link in state.links
        if link.src == node
    }


def group_link(members: Sequence[str], states: Mapping[str, pb.NodeState]) -> LinkVerdict:
    """Whether every link between two members may carry collectives, and why (or why not)."""
    links = _published_links(states)
    reasons = []
    for src in members:
        for dst in members:
            if src == dst:
                continue
            link = links.get((src, dst))
            if link is None:
                return LinkVerdict(False, f"refused: the link {src} -> {dst} is not measured")
            if not link.trusted:
                return LinkVerdict(False, f"{src} -> {dst} {link.trust_reason or 'refused'}")
            reasons.append(link.trust_reason)
    return LinkVerdict(True, "; ".join(sorted(set(reasons))))


def group_hosts(members: Sequence[str], states: Mapping[str, pb.NodeState]) -> dict[str, str]:
    """Per member, the IP its runner is reached at: the address its ring predecessor
    measured the link to it on."""
    links = _published_links(states)
    hosts = {}
    for rank, node in enumerate(members):
        before = members[rank - 1]
        link = links.get((before, node))
        if link is None or not link.dst_address:
            raise TensorParallelUnsupported(
                f"no measured link {before} -> {node} says at which address {node} is reached"
            )
        hosts[node] = link.dst_address
    return hosts


def base_port(leader: str, states: Mapping[str, pb.NodeState]) -> int:
    """The port range of the group's rank 0 (its configured ``tensor_parallel_port``)."""
    state = states.get(leader)
    port = int(state.tensor_parallel_port) if state is not None else 0
    return port or DEFAULT_BASE_PORT


def spec_for_stage(
    *,
    plan_id: str,
    stage_index: int,
    stage: StageSpec,
    model_dir: str | Path,
    states: Mapping[str, pb.NodeState],
    mesh_secret: bytes,
) -> TensorParallelSpec:
    """The spec of one of a plan's tensor-parallel stages (identical on every member, but for
    ``model_dir``: where this member keeps the model); TensorParallelUnsupported says why a
    group cannot form."""
    members = stage.members
    verdict = group_link(members, states)
    if not verdict.allowed:
        raise TensorParallelUnsupported(
            f"stage {stage_index}'s group {'+'.join(members)} cannot run over its links: "
            f"{verdict.reason}"
        )
    return build_group_spec(
        plan_id=plan_id,
        stage_index=stage_index,
        stage_nodes=members,
        layer_start=stage.layer_start,
        layer_end=stage.layer_end,
        has_embedding=stage.has_embedding,
        has_head=stage.has_head,
        model_dir=model_dir,
        addresses=group_hosts(members, states),
        link=verdict.reason,
        mesh_secret=mesh_secret,
        expert_shards=stage.experts,
        backend=group_backend(members, states),
        base_port=base_port(members[0], states),
    )


def describe_groups(
    plan: object, states: Mapping[str, pb.NodeState]
) -> list[pb.TensorParallelGroup]:
    """The status of a plan's tensor-parallel stages (``partitioner.Plan``; no secrets)."""
    groups = []
    for index, stage in enumerate(getattr(plan, "stages", ())):
        members = tuple(stage.nodes)
        if len(members) < 2:
            continue
        group = pb.TensorParallelGroup(
            stage=index,
            members=members,
            backend=group_backend(members, states),
            link=group_link(members, states).reason,
            layer_start=stage.layer_start,
            layer_end=stage.layer_end,
        )
        try:
            hosts = group_hosts(members, states)
            base = base_port(members[0], states)
            ports, _ = group_ports(plan.plan_id, index, len(members), base)
        except (TensorParallelUnsupported, ValueError):
            pass
        else:
            group.addresses.extend(
                f"[{hosts[n]}]:{port}" if ":" in hosts[n] else f"{hosts[n]}:{port}"
                for n, port in zip(members, ports, strict=True)
            )
        groups.append(group)
    return groups
