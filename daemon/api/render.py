"""Human-readable and JSON renderings of the mesh status for the CLI."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.json_format import MessageToDict

from meshd.wire import pb
from partitioner.humanize import (
    format_bytes,
    format_flops,
    format_rate,
    format_seconds,
    format_token_rate,
    format_wait,
)


def _seen(peer: pb.PeerStatus) -> str:
    if peer.source == "self":
        return "self"
    if not peer.alive:
        return "lost"
    return f"{peer.last_seen_s:.1f} s ago"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def nodes_table(status: pb.MeshStatus) -> str:
    rows = []
    for peer in status.nodes:
        p = peer.profile
        measured = p.flops > 0
        rows.append(
            [
                p.node_id + (" *" if peer.source == "self" else ""),
                p.name or "-",
                peer.address,
                f"{format_bytes(p.memory_budget)} / {format_bytes(p.total_memory)}"
                if p.total_memory
                else "measuring",
                _measured(format_flops(p.flops), p.flops_spread) if measured else "-",
                _measured(format_rate(p.mem_bandwidth), p.mem_bandwidth_spread)
                if measured
                else "-",
                _profile_note(p) if measured else "measuring",
                _device_cell(p),
                peer.source,
                _seen(peer),
            ]
        )
    table = _table(
        [
            "NODE",
            "NAME",
            "ADDRESS",
            "BUDGET / MEMORY",
            "COMPUTE",
            "MEMORY BW",
            "PROFILE",
            "DEVICE",
            "VIA",
            "SEEN",
        ],
        rows,
    )
    overheads = [
        f"{n.profile.node_id} {format_bytes(n.profile.process_overhead)}"
        for n in status.nodes
        if n.profile.process_overhead
    ]
    if overheads:
        table += "\nprocess overhead planned out of each budget: " + ", ".join(overheads)
    return table


def _measured(value: str, spread: float) -> str:
    """'175 GFLOP/s ±4%': the number and half its samples' p10-p90 spread."""
    return f"{value} ±{50 * spread:.0f}%" if spread > 0 else value


def _profile_note(profile: pb.NodeProfile) -> str:
    """How the profile was measured: quiet, or under another process's load."""
    if profile.loaded:
        return f"loaded ({profile.other_busy_cores:.1f} cores busy elsewhere)"
    return "quiet" if profile.flops_spread > 0 else "-"


def memory_text(memory: pb.RuntimeMemory) -> str:
    """This process's memory against its budget: RSS, MLX's part, the plan and the overhead."""
    if not memory.budget:
        return "memory: budget not measured yet"
    share = memory.rss / memory.budget
    over = "  OVER BUDGET" if memory.rss > memory.budget else ""
    planned = f", plan {format_bytes(memory.planned)}" if memory.planned else ", no plan here"
    return (
        f"memory: RSS {format_bytes(memory.rss)} of budget {format_bytes(memory.budget)} "
        f"({share:.0%}){over}; MLX {format_bytes(memory.mlx_active)} "
        f"(peak {format_bytes(memory.mlx_peak)}){planned}; process overhead planned "
        f"{format_bytes(memory.overhead)}, beside MLX now {format_bytes(memory.overhead_now)}"
    )


def _device_cell(profile: pb.NodeProfile) -> str:
    if profile.mlx_device == "gpu":
        return f"gpu ({profile.device_name or profile.device_backend or '?'})"
    return profile.mlx_device or "-"


def links_table(status: pb.MeshStatus) -> str:
    """Every measured link, and whether its measurer lets it carry tensor-parallel traffic;
    the reasons a link is refused follow the table (a group needs both directions)."""
    ordered = sorted(status.links, key=lambda m: (m.src, m.dst))
    rows = [
        [
            f"{m.src} -> {m.dst}",
            f"{m.tcp_rtt_s * 1e3:.3f} ms",
            f"{m.grpc_rtt_s * 1e3:.3f} ms",
            format_rate(m.bandwidth, bits=True),
            format_bytes(m.probe_bytes),
            "trusted" if m.trusted else ("no" if m.trust_reason else "-"),
        ]
        for m in ordered
    ]
    if not rows:
        return "no links measured yet"
    table = _table(
        ["LINK", "RTT (TCP)", "RTT (gRPC)", "BANDWIDTH", "PROBE", "TENSOR-PARALLEL"], rows
    )
    refused = {m.trust_reason for m in ordered if not m.trusted and m.trust_reason}
    notes = [f"tensor-parallel refused on {_links_with(ordered, r)}: {r}" for r in sorted(refused)]
    return "\n".join([table, *notes])


def _links_with(links: list[pb.LinkMeasurement], reason: str) -> str:
    named = [f"{m.src}->{m.dst}" for m in links if not m.trusted and m.trust_reason == reason]
    return ", ".join(named) if len(named) <= 3 else f"{len(named)} links"


def peers_table(status: pb.MeshStatus) -> str:
    return nodes_table(status) + "\n\n" + links_table(status)


def agreement_text(agreement: pb.AgreementStatus) -> str:
    """The committed plan, who confirmed it, and why not (yet) while converging."""
    if not agreement.model:
        return "plan: no model selected (start a daemon with --model, or `meshd load`)"
    lines = [f"model {agreement.model}"]
    if agreement.active_plan_id:
        lines.append(
            f"committed plan {agreement.active_plan_id[:12]} over {', '.join(agreement.members)}"
            f" (confirmed by {len(agreement.confirmed_by)}/{len(agreement.members)})"
        )
        if agreement.plan_json:
            import json

            plan = json.loads(agreement.plan_json)
            if plan.get("layout"):
                lines.append(f"layout: {plan['layout']}")
            if plan.get("note"):
                lines.append(f"note: {plan['note']}")
            rows = [
                [
                    str(i),
                    "+".join(stage["nodes"]),
                    f"{stage['layer_start']}-{stage['layer_end'] - 1}",
                    f"tensor-parallel x{len(stage['nodes'])}" if len(stage["nodes"]) > 1 else "",
                ]
                for i, stage in enumerate(plan["stages"])
            ]
            lines.append(_table(["STAGE", "NODE", "LAYERS", ""], rows))
    else:
        lines.append("no committed plan")
    if agreement.refusal:
        lines.append(f"refused: {agreement.refusal}")
    if agreement.reason:
        lines.append(f"converging: {agreement.reason}")
    if agreement.draining:
        lines.append("draining: " + ", ".join(p[:12] for p in agreement.draining))
    return "\n".join(lines)


def tensor_parallel_text(status: pb.MeshStatus) -> str:
    """The active plan's tensor-parallel groups (ranks, backend, link) and this node's
    runners; empty when there are none."""
    lines = []
    for group in status.tensor_parallel_groups:
        ranks = ", ".join(
            f"{rank} {node}" + (f" at {group.addresses[rank]}" if group.addresses else "")
            for rank, node in enumerate(group.members)
        )
        lines.append(
            f"tensor-parallel stage {group.stage} (layers {group.layer_start}-"
            f"{group.layer_end - 1}): ranks {ranks}; backend {group.backend}; link: {group.link}"
        )
    for runner in status.tensor_parallel_runners:
        state = runner.state + (f" ({runner.error})" if runner.error else "")
        lines.append(
            f"runner here: plan {runner.plan_id[:12]} stage {runner.stage} rank {runner.rank}/"
            f"{runner.size} of {'+'.join(runner.members)}, {runner.backend}, pid "
            f"{runner.pid or '-'}, {format_bytes(runner.held_bytes)}: {state}"
        )
    return "\n".join(lines)


def device_line(profile: pb.NodeProfile) -> str:
    """Where a node computes, and why: "gpu 0 of 2 (cuda, NVIDIA H200): GPU reported by MLX"."""
    if not profile.mlx_device:
        return "not measured yet"
    if profile.mlx_device == "gpu":
        backend = profile.device_backend or "gpu"
        where = f"gpu 0 of {profile.gpu_count or 1} ({backend}, {profile.device_name or '?'})"
    else:
        where = "cpu"
    return f"{where}: {profile.device_reason}" if profile.device_reason else where


def device_text(status: pb.MeshStatus) -> str:
    """This node's device, then each peer's that computes elsewhere than on a CPU."""
    own = next((n.profile for n in status.nodes if n.source == "self"), None)
    lines = [f"device: {device_line(own) if own is not None else 'not measured yet'}"]
    lines += [
        f"  {n.profile.node_id}: {device_line(n.profile)}"
        for n in status.nodes
        if n.source != "self" and n.profile.mlx_device == "gpu"
    ]
    return "\n".join(lines)


def status_text(status: pb.MeshStatus) -> str:
    alive = sum(1 for n in status.nodes if n.alive)
    head = (
        f"mesh {status.mesh_name!r} (fingerprint {status.mesh_fingerprint}), "
        f"this node {status.node_id}, {alive} node(s) alive\n"
        f"BLAS: {status.blas or 'unknown'}\n"
        f"{device_text(status)}\n"
        f"dashboard and HTTP APIs: {status.http_url + '/' if status.http_url else 'off'}"
    )
    recent = "\n".join("  " + line for line in status.events[-8:])
    plan = agreement_text(status.agreement)
    groups = tensor_parallel_text(status)
    if groups:
        plan += "\n" + groups
    plan += "\n" + transitions_text(status.transitions)
    if status.prefix_cache:
        plan += "\n" + prefix_cache_text(status.prefix_cache)
    prediction = prediction_text(status)
    if prediction:
        plan += "\n" + prediction
    downloads = downloads_text(status)
    if downloads:
        plan += "\n" + downloads
    requests = requests_text(status)
    head += "\n" + memory_text(status.memory)
    return f"{head}\n\n{peers_table(status)}\n\n{plan}\n\n{requests}\n\nrecent events:\n{recent}"


@dataclass(frozen=True)
class NodeDownloads:
    """What one node is downloading now, summed over its files."""

    node: str
    files: int
    done_bytes: int
    total_bytes: int
    rate_bytes_per_s: float
    seconds_left: float
    sources: tuple[str, ...]

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 0.0

    def line(self) -> str:
        """'node: 41% of 1.2 GB, 3 files, 22.1 MB/s, 32 s left (hub, peer n2)'."""
        left = f", {self.seconds_left:.0f} s left" if self.seconds_left else ""
        return (
            f"{self.node}: {self.fraction:.0%} of {format_bytes(self.total_bytes)}, "
            f"{self.files} file(s), {format_bytes(int(self.rate_bytes_per_s))}/s{left} "
            f"({', '.join(self.sources)})"
        )


def downloads_by_node(downloads: Iterable[pb.Download]) -> list[NodeDownloads]:
    """The files each node is downloading, summed per node (nodes sorted)."""
    grouped: dict[str, list[pb.Download]] = {}
    for item in downloads:
        grouped.setdefault(item.node, []).append(item)
    return [
        NodeDownloads(
            node=node,
            files=len(items),
            done_bytes=sum(item.done_bytes for item in items),
            total_bytes=sum(item.total_bytes for item in items),
            rate_bytes_per_s=sum(item.rate_bytes_per_s for item in items),
            seconds_left=max(item.seconds_left for item in items),
            sources=tuple(sorted({item.source for item in items})),
        )
        for node, items in sorted(grouped.items())
    ]


def downloads_text(status: pb.MeshStatus) -> str:
    """The files the nodes are downloading now, one line per file (empty: none)."""
    if not status.downloads:
        return ""
    lines = ["downloading:"]
    for item in sorted(status.downloads, key=lambda d: (d.node, d.file)):
        left = f", {item.seconds_left:.0f} s left" if item.seconds_left else ""
        lines.append(
            f"  {item.node}  {item.file}  {format_bytes(item.done_bytes)}/"
            f"{format_bytes(item.total_bytes)}, {format_bytes(int(item.rate_bytes_per_s))}/s"
            f"{left}, from {item.source}"
        )
    return "\n".join(lines)


def prediction_text(status: pb.MeshStatus) -> str:
    """The active plan's predicted speed next to what this node's requests measured (medians),
    and each node's speed correction."""
    lines = []
    if status.HasField("prediction_check"):
        check = status.prediction_check
        lines.append(
            f"predicted vs measured (plan {check.plan_id[:12]}, concurrency {check.concurrency}, "
            f"{check.requests} finished request(s) here):"
        )
        rows = [
            ("decode alone", check.decode_alone, format_token_rate),
            (f"decode at {check.concurrency}", check.decode_concurrent, format_token_rate),
            ("prefill", check.prefill, format_token_rate),
            ("first token", check.ttft, format_wait),
        ]
        for label, figure, show in rows:
            if label.startswith("decode at") and not check.HasField("decode_concurrent"):
                continue
            lines.append(f"  {label:<14} {figure_text(figure, show)}")
    lines += [correction_text(correction) for correction in status.speed_corrections]
    return "\n".join(lines)


def correction_text(correction: pb.SpeedCorrection) -> str:
    """'speed correction NODE: 1.32x (decode step 41.2 ms measured, 31.2 ms predicted, median
    of 64; each batched row 46.2 GFLOP/s; prompts 0.20x ...; collectives 9.7 ms each)'."""
    parts = []
    if correction.samples:
        parts.append(
            f"decode step {format_seconds(correction.measured_step_s)} measured, "
            f"{format_seconds(correction.predicted_step_s)} predicted, "
            f"median of {correction.samples}"
        )
    if correction.row_flops:
        parts.append(f"each batched row {format_flops(correction.row_flops)}")
    if correction.compute_factor:
        parts.append(
            f"prompts {correction.compute_factor:.2f}x (median of "
            f"{correction.prompt_samples} chunks)"
        )
    if correction.collective_overhead_s:
        parts.append(f"collectives {format_seconds(correction.collective_overhead_s)} each")
    detail = f" ({'; '.join(parts)})" if parts else ""
    return f"speed correction {correction.node_id}: {correction.factor:.2f}x{detail}"


def figure_text(figure: pb.PredictedMeasured, show: Callable[[float], str]) -> str:
    """'predicted 6.5 tokens/s, measured 6.9 tokens/s (1.06x, 12 requests)'."""
    predicted = f"predicted {show(figure.predicted)}" if figure.predicted > 0 else "no prediction"
    if not figure.requests:
        return f"{predicted}, not measured yet"
    return (
        f"{predicted}, measured {show(figure.measured)} "
        f"({figure.ratio:.2f}x, {figure.requests} request(s))"
    )


def prefix_cache_text(caches: Iterable[pb.PrefixCacheStatus]) -> str:
    """This node's stages' prefix caches: what they keep, and what requests reused."""
    lines = []
    for cache in caches:
        budget = f" of {cache.budget_tokens} reserved" if cache.budget_tokens else ""
        hits = f"{cache.hits} of {cache.lookups}" if cache.lookups else "0"
        lines.append(
            f"prefix cache, plan {cache.plan_id[:12]} stage {cache.stage_index}: "
            f"{cache.slots} prompt(s) kept, {cache.tokens} tokens{budget}; "
            f"hits {hits}, {cache.reused_tokens} tokens not computed again, "
            f"{cache.evicted} evicted"
        )
    return "\n".join(lines)


def transitions_text(moves: pb.PlanTransitions) -> str:
    """How this node moved between plans: what it is loading, what it loaded and kept, and
    the requests it moved."""
    lines = []
    if moves.leaving:
        lines.append("leaving the mesh: new requests are refused, running ones move or finish")
    lines.append(f"moving now: {moves.moving}" if moves.moving else "moving now: nothing")
    lines.append(
        f"stages loaded since start: {moves.stage_loads} ({moves.layers_loaded} layers, "
        f"{format_bytes(moves.bytes_loaded)} read), {moves.layers_kept} layers kept across plans"
        + (f"; last: {moves.last_install}" if moves.last_install else "")
    )
    if moves.requests_resumed:
        lines.append(
            f"requests moved to another plan and resumed: {moves.requests_resumed}, "
            f"{moves.requests_moved_in_background} in the background "
            f"(the last paused {moves.last_pause_s:.2f} s)"
        )
    return "\n".join(lines)


def requests_text(status: pb.MeshStatus) -> str:
    """This node's clients' requests in flight, oldest first."""
    if not status.requests:
        return "requests in flight here: none"
    now = status.generated_at or time.time()
    lines = [
        f"  {r.request_id}  plan {r.plan_id[:12]}  {r.prompt_tokens} prompt tokens, "
        f"max {r.max_tokens}, running {max(0.0, now - r.started_at):.1f} s"
        for r in sorted(status.requests, key=lambda r: r.started_at)
    ]
    return f"requests in flight here: {len(lines)}\n" + "\n".join(lines)


def status_to_json(status: pb.MeshStatus) -> dict[str, Any]:
    return MessageToDict(
        status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _model_size(model: pb.ModelInfo) -> str:
    """Its size; for a repository of the HF cache that this node holds in part (its stage's
    files), what it holds of the whole."""
    if model.partial:
        return f"{format_bytes(model.size_bytes)} of {format_bytes(model.total_bytes)} (partial)"
    return format_bytes(model.size_bytes)


def profile_text(profile: Any) -> str:
    """`meshd profile`: every field, and the measurement's quality in words."""
    d = profile.to_dict()
    rates = ("versions", "dtype_flops", "dtype_bandwidth")
    lines = [f"{key:20} {value}" for key, value in d.items() if key not in rates]
    lines.append(
        f"{'versions':20} " + ", ".join(f"{k} {v}" for k, v in d.get("versions", {}).items())
    )
    quality = (
        f"measured under load: other processes used {profile.other_busy_cores:.1f} cores "
        "meanwhile; the daemon measures again later and keeps a quiet measurement"
        if profile.loaded
        else "measured on a quiet machine"
    )
    lines.append(
        f"{'summary':20} {_measured(format_flops(profile.flops), profile.flops_spread)}, "
        f"{_measured(format_rate(profile.mem_bandwidth), profile.mem_bandwidth_spread)}; " + quality
    )
    flops, bandwidth = d.get("dtype_flops", {}), d.get("dtype_bandwidth", {})
    for key in flops:
        lines.append(
            f"{key:20} {format_flops(flops[key])} matmul, "
            f"{format_rate(bandwidth.get(key, 0.0))} matrix-vector"
        )
    return "\n".join(lines)


def models_table(models: pb.ModelList) -> str:
    rows = [
        [
            m.name + (" *" if m.name == models.selected else ""),
            m.architecture,
            str(m.layers) if m.layers else "",
            _model_size(m),
            m.source + (f" @{m.revision[:12]}" if m.revision else ""),
        ]
        for m in models.models
    ]
    table = _table(["MODEL", "ARCH", "LAYERS", "SIZE", "SOURCE"], rows) if rows else "no models"
    return f"{table}\n\nthe mesh runs: {models.selected or 'no model'}"
