"""What `meshd status` shows of one node: the MeshStatus it assembles from its components.

Apart from the node (:mod:`meshd.node`, the composition root that builds the components and
owns their lifetimes) because the status only reads them: the peers and links membership
knows, the agreement, the requests in flight, the data plane's plan transitions and
tensor-parallel runners, the memory counters.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from meshd.mesh.membership import PROTOCOL_VERSION
from meshd.wire import pb

if TYPE_CHECKING:
    from meshd.node import Node


def mesh_status(node: Node) -> pb.MeshStatus:
    """The node's view of the mesh: itself and its peers, the links they measured, the
    agreement, the requests in flight, plan transitions, tensor parallelism, memory."""
    now = time.monotonic()
    me = node.membership
    nodes = [
        pb.PeerStatus(
            profile=me.profile,
            address=f"{node.config.peer_host}:{node.peer_port}",
            alive=True,
            last_seen_s=0.0,
            joined_at=node.identity.started_at,
            source="self",
            instance_id=node.identity.instance_id,
        )
    ]
    links = list(me.own_state.links)
    corrections = [me.speed_correction] if me.speed_correction is not None else []
    downloads = list(node.hub_downloads.board.snapshot())
    for rec in sorted(me.peers.values(), key=lambda r: r.node_id):
        profile = rec.state.profile if rec.state else pb.NodeProfile(node_id=rec.node_id)
        nodes.append(
            pb.PeerStatus(
                profile=profile,
                address=rec.address,
                alive=rec.alive,
                last_seen_s=now - rec.last_beat,
                joined_at=rec.joined_at,
                source=rec.source,
                instance_id=rec.instance_id,
                clock_offset_s=rec.clock_offset_s,
            )
        )
        if rec.alive and rec.state is not None:
            links.extend(m for m in rec.state.links if m.src == rec.node_id)
            downloads.extend(rec.state.downloads)
            if rec.state.HasField("speed_correction"):
                corrections.append(rec.state.speed_correction)
    return pb.MeshStatus(
        node_id=node.identity.node_id,
        mesh_name=node.secret.mesh_name,
        mesh_fingerprint=node.fingerprint,
        protocol_version=PROTOCOL_VERSION,
        peer_address=f"{node.config.peer_host}:{node.peer_port}",
        lane_address=f"{node.config.peer_host}:{node.lane_port}" if node.lane_port else "",
        loop_crossings=node.bridge.crossings(),
        prefix_cache=_prefix_cache(node),
        prediction_check=_prediction_check(node),
        speed_corrections=corrections,
        nodes=nodes,
        links=links,
        events=node.events.lines(),
        blas=me.profile.blas,
        agreement=node.agreement.status_message(),
        memory=_runtime_memory(node),
        generated_at=time.time(),
        http_url=node.http_url,
        requests=[
            pb.RequestStatus(
                request_id=info.request_id,
                plan_id=info.plan_id,
                prompt_tokens=info.prompt_tokens,
                max_tokens=info.max_tokens,
                started_at=info.started_at,
            )
            for info in node.router.in_flight
        ],
        tensor_parallel_groups=_tensor_parallel_groups(node),
        tensor_parallel_runners=_tensor_parallel_runners(node),
        transitions=_transitions(node),
        downloads=downloads,
    )


def _prediction_check(node: Node) -> pb.PredictionCheck | None:
    """The active plan's predictions next to what this node's requests measured on it."""
    from meshd.inference.prediction_check import Figure, compare

    active = node.agreement.core.active
    router = getattr(node, "router", None)  # created once the asyncio thread runs
    plan = node.agreement.plan_for(active.proposal) if active else None
    if plan is None or router is None:
        return None
    found = compare(plan, router.finished)

    def figure(value: Figure | None) -> pb.PredictedMeasured | None:
        if value is None:
            return None
        return pb.PredictedMeasured(
            predicted=value.predicted,
            measured=value.measured,
            requests=value.requests,
            ratio=value.ratio,
        )

    return pb.PredictionCheck(
        plan_id=found.plan_id,
        concurrency=found.concurrency,
        prompt_len=found.prompt_len,
        decode_alone=figure(found.decode_alone),
        decode_concurrent=figure(found.decode_concurrent),
        prefill=figure(found.prefill),
        ttft=figure(found.ttft),
        requests=found.requests,
    )


def _prefix_cache(node: Node) -> list[pb.PrefixCacheStatus]:
    """This node's stages' kept prompt prefixes (the data plane's published snapshot)."""
    plane = getattr(node, "plane", None)  # created once the asyncio thread runs
    if plane is None:
        return []
    return [
        pb.PrefixCacheStatus(
            plan_id=view.plan_id,
            stage_index=view.stage_index,
            slots=view.slots,
            tokens=view.tokens,
            budget_tokens=view.budget_tokens,
            lookups=view.lookups,
            hits=view.hits,
            reused_tokens=view.reused_tokens,
            evicted=view.evicted,
        )
        for view in plane.stage.prefix_view
    ]


def _transitions(node: Node) -> pb.PlanTransitions:
    """What this node loaded, kept and is loading now, and the requests it moved."""
    plane = getattr(node, "plane", None)  # created once the asyncio thread runs
    out = pb.PlanTransitions(
        moving=node.plans.moving if plane is not None else "",
        leaving=node.membership.leaving,
        active_plan_loaded=_active_plan_loaded(node),
    )
    if plane is not None:
        loads = plane.loads
        out.stage_loads = loads.stage_loads
        out.layers_loaded = loads.layers_loaded
        out.layers_kept = loads.layers_kept
        out.bytes_loaded = loads.bytes_loaded
        out.last_install = node.plans.last_install
        out.requests_resumed = plane.origin.requests_resumed
        out.requests_moved_in_background = plane.origin.requests_moved_in_background
        out.last_pause_s = plane.origin.last_pause_s
    return out


def _active_plan_loaded(node: Node) -> bool:
    """Whether this node's stages of the active plan are loaded, so that it serves the plan.

    A plan is committed before its stages are read from disk; the status app says "serving"
    only from here on. A node that holds no stage of the plan has nothing to load.
    """
    active = node.agreement.core.active
    if active is None:
        return False
    if active.plan_id in node.membership.loaded_plans:
        return True
    plan = node.agreement.plan_for(active.proposal)
    node_id = node.identity.node_id
    return plan is not None and not any(node_id in stage.nodes for stage in plan.stages)


def _tensor_parallel_groups(node: Node) -> list[pb.TensorParallelGroup]:
    """The active plan's tensor-parallel stages: members by rank, backend, link."""
    from meshd.inference.tensor_parallel.groups import describe_groups

    active = node.agreement.core.active
    plan = node.agreement.plan_for(active.proposal) if active else None
    if plan is None:
        return []
    return describe_groups(plan, node.agreement.states_of(active.proposal))


def _tensor_parallel_runners(node: Node) -> list[pb.TensorParallelRunner]:
    """This node's runner processes, as the data plane last published them."""
    plane = getattr(node, "plane", None)  # created once the asyncio thread runs
    return [
        pb.TensorParallelRunner(
            plan_id=runner["plan_id"],
            stage=runner["stage"],
            rank=runner["rank"],
            size=runner["size"],
            backend=runner["backend"],
            link=runner["link"],
            state=runner["state"],
            pid=runner["pid"] or 0,
            error=runner["error"] or "",
            held_bytes=int(runner.get("held_bytes") or 0),
            members=[member["node_id"] for member in runner["members"]],
        )
        for runner in (plane.runner_status if plane is not None else ())
    ]


def _runtime_memory(node: Node) -> pb.RuntimeMemory:
    """MLX allocator counters and RSS, next to the budget, the plan's prediction and the
    process overhead planned out of the budget (and what the process holds beside MLX now)."""
    import resource

    import mlx.core as mx
    import psutil

    active = node.agreement.core.active
    plan = node.agreement.plan_for(active.proposal) if active else None
    planned = plan.memory_of(node.identity.node_id) if plan else None
    rss = psutil.Process().memory_info().rss
    mlx_held = mx.get_active_memory() + mx.get_cache_memory()
    return pb.RuntimeMemory(
        mlx_active=mx.get_active_memory(),
        mlx_peak=mx.get_peak_memory(),
        rss=rss,
        peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        budget=node.membership.profile.memory_budget,
        planned=planned.total_bytes if planned else 0,
        overhead=node.overhead.planned,
        overhead_now=max(0, rss - mlx_held),
    )
