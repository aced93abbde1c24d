"""`meshd plan`: show which node would hold which layers, and how fast it would run.

The mesh comes from the running daemon (its live view) or from a JSON file (`--mesh`), so a
cluster can be planned before it exists. The model comes from a model directory (`--model`:
true sizes from the safetensors headers, or, for a directory with only config.json, from
mlx-lm's own model class and the config's quantization, see meshd.models.info) or from a
ModelSpec JSON file (`--model-spec`). `--parallelism` forces the kind of layout;
`--strategy both` shows the fastest layout of every kind (one node, pipeline, tensor
parallel, hybrid) side by side with the memory-proportional baseline.

Mesh file format (human units accepted everywhere a size, rate or time is expected):

    {
      "description": "optional text",
      "nodes": [
        {"id": "studio-a", "name": "Mac Studio A", "memory_budget": "180GiB",
         "flops": "25TFLOPS", "mem_bandwidth": "800GB/s", "collective_overhead": "60us"}
      ],
      "links": [
        {"src": "studio-a", "dst": "studio-b", "latency": "5us", "bandwidth": "75Gbit/s",
         "trusted": true}
      ],
      "default_link": {"latency_ms": 1.0, "bandwidth": "1Gbit/s"}
    }

- sizes: a number of bytes, or "16GB" (10^9), "16GiB" (2^30), also K/M/T variants;
- memory bandwidth / link bandwidth: bytes/s as a number, or "800GB/s", "10Gbit/s", "10Gbps"
  ("B" is bytes, "b"/"bit" is bits), or "bandwidth_mbps": megabits/s;
- flops: FLOP/s as a number, or "25TFLOPS" / "25 TFLOP/s";
- latency: "latency_ms" (number), "latency_s" (number) or "latency": "300us" / "0.3ms";
  (all read by partitioner.humanize, as flags and the config file are);
- dtype_flops / dtype_bandwidth (optional, per node): rates per compute dtype, keyed as
  ModelSpec.compute_key ("float32", "float16", "bfloat16", "q4/bfloat16"): a model is priced at
  its own dtype's rate, else at flops / mem_bandwidth ({"bfloat16": "700TFLOPS"});
- collective_overhead (optional, per node): what the node adds to each collective of a
  tensor-parallel group ("60us"; partitioner.cost has the default);
- layer_overhead (optional, per node): fixed time per layer and decode step that does not
  shrink with the bytes read (kernel launches, synchronisation; "80us" on a GPU; default 0);
- trusted (optional, per link, default false): the link is point-to-point or trusted, so
  tensor-parallel traffic (unencrypted) may cross it;
- a link is used in both directions unless it says "both_ways": false (then add the reverse
  link separately, e.g. for asymmetric links); "default_link" fills every pair not listed.
Exit codes: 0 plan printed, 1 the model does not fit or the forced layout cannot run (the
reason printed), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO, TypeVar

import networkx as nx

from meshd.models.info import ModelInfoError, architecture_refusal, read_model_spec
from partitioner import (
    DEFAULT_MIN_GAIN,
    PARALLELISMS,
    InsufficientMemory,
    MeshError,
    ModelSpec,
    ModelSpecError,
    ParallelismUnavailable,
    Plan,
    PlanOptions,
    PlanOptionsError,
    describe_refusal,
    plan_alternatives,
    plan_model,
)
from partitioner.humanize import (
    format_bytes,
    format_flops,
    format_rate,
    format_seconds,
    parse_duration,
    parse_flops,
    parse_fraction,
    parse_rate,
    parse_size,
)

LIVE_TIMEOUT_S = 5.0
EXIT_OK, EXIT_REFUSED, EXIT_BAD_INPUT = 0, 1, 2

T = TypeVar("T")
_NODE_KEYS = {
    "id",
    "name",
    "memory_budget",
    "flops",
    "mem_bandwidth",
    "collective_overhead",
    "layer_overhead",
    "dtype_flops",
    "dtype_bandwidth",
}
_LINK_KEYS = {
    "src",
    "dst",
    "latency_ms",
    "latency_s",
    "latency",
    "bandwidth",
    "bandwidth_mbps",
    "both_ways",
    "trusted",
}


class PlanInputError(ValueError):
    """A mesh file, model file or flag value that cannot be used; the text says how to fix it."""


# ---- units (the one parser: partitioner.humanize) -----------------------------------------


def _quantity(parse: Callable[[Any], T], value: Any, what: str) -> T:
    """`parse(value)`, with a refusal that names the field it came from."""
    try:
        return parse(value)
    except ValueError as error:
        raise PlanInputError(f"{what}: {error}") from error


def parse_latency_s(entry: dict[str, Any], what: str = "link") -> float:
    """Seconds from latency_ms, latency_s or latency ('300us', '0.3ms', '1s')."""
    if "latency_ms" in entry:
        return _quantity(parse_duration, entry["latency_ms"], f"{what}: latency_ms") / 1e3
    if "latency_s" in entry:
        return _quantity(parse_duration, entry["latency_s"], f"{what}: latency_s")
    if "latency" in entry:
        return _quantity(parse_duration, entry["latency"], f"{what}: latency")
    raise PlanInputError(f"{what}: give latency_ms (or latency_s, or latency like '300us')")


# ---- mesh file ------------------------------------------------------------------------------


def load_mesh_json(path: Path | str) -> nx.DiGraph:
    """A mesh graph (the partitioner's input contract) from a mesh JSON file (module docs)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise PlanInputError(f"cannot read mesh file {path}: {error}") from error
    except json.JSONDecodeError as error:
        raise PlanInputError(f"mesh file {path} is not valid JSON: {error}") from error
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise PlanInputError(f"mesh file {path}: expected an object with a 'nodes' list")
    graph = nx.DiGraph()
    for index, entry in enumerate(data["nodes"]):
        node_id, attributes = _node_entry(entry, f"{path}: nodes[{index}]")
        if node_id in graph:
            raise PlanInputError(f"{path}: node id {node_id!r} appears twice")
        graph.add_node(node_id, **attributes)
    for index, entry in enumerate(data.get("links", [])):
        _add_link(graph, entry, f"{path}: links[{index}]")
    if "default_link" in data:
        _add_default_links(graph, data["default_link"], f"{path}: default_link")
    return graph


def _node_entry(entry: Any, where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(entry, dict) or "id" not in entry:
        raise PlanInputError(f"{where}: each node needs at least an 'id'")
    unknown = sorted(set(entry) - _NODE_KEYS)
    if unknown:
        raise PlanInputError(f"{where}: unknown key(s) {unknown}; use {sorted(_NODE_KEYS)}")
    missing = sorted({"memory_budget", "flops", "mem_bandwidth"} - set(entry))
    if missing:
        raise PlanInputError(f"{where} ({entry['id']}): missing {missing}")
    attributes = {
        "name": str(entry.get("name", entry["id"])),
        "memory_budget": _quantity(parse_size, entry["memory_budget"], f"{where}: memory_budget"),
        "flops": _quantity(parse_flops, entry["flops"], f"{where}: flops"),
        "mem_bandwidth": _quantity(parse_rate, entry["mem_bandwidth"], f"{where}: mem_bandwidth"),
    }
    for key, parse in (("dtype_flops", parse_flops), ("dtype_bandwidth", parse_rate)):
        if key in entry:
            attributes[key] = _rates(entry[key], parse, f"{where}: {key}")
    if "collective_overhead" in entry:
        attributes["collective_overhead_s"] = _quantity(
            parse_duration, entry["collective_overhead"], f"{where}: collective_overhead"
        )
    if "layer_overhead" in entry:
        attributes["layer_overhead_s"] = _quantity(
            parse_duration, entry["layer_overhead"], f"{where}: layer_overhead"
        )
    return str(entry["id"]), attributes


def _rates(value: Any, parse: Callable[[Any], float], where: str) -> dict[str, float]:
    """{compute key: rate} ("bfloat16": "700TFLOPS"); the keys are ModelSpec.compute_key's."""
    if not isinstance(value, dict) or not value:
        raise PlanInputError(f"{where}: expected an object like {{'bfloat16': '700TFLOPS'}}")
    return {str(key): _quantity(parse, rate, f"{where}.{key}") for key, rate in value.items()}


def _link_attributes(entry: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(entry) - _LINK_KEYS)
    if unknown:
        raise PlanInputError(f"{where}: unknown key(s) {unknown}; use {sorted(_LINK_KEYS)}")
    if "bandwidth_mbps" in entry:
        megabits = _quantity(parse_rate, entry["bandwidth_mbps"], f"{where}: bandwidth_mbps")
        bandwidth = megabits * 1e6 / 8
    elif "bandwidth" in entry:
        bandwidth = _quantity(parse_rate, entry["bandwidth"], f"{where}: bandwidth")
    else:
        raise PlanInputError(f"{where}: give bandwidth (e.g. '10Gbit/s') or bandwidth_mbps")
    trusted = entry.get("trusted", False)
    if not isinstance(trusted, bool):
        raise PlanInputError(f"{where}: trusted must be true or false, got {trusted!r}")
    return {"latency_s": parse_latency_s(entry, where), "bandwidth": bandwidth, "trusted": trusted}


def _add_link(graph: nx.DiGraph, entry: Any, where: str) -> None:
    if not isinstance(entry, dict) or "src" not in entry or "dst" not in entry:
        raise PlanInputError(f"{where}: each link needs 'src' and 'dst'")
    src, dst = str(entry["src"]), str(entry["dst"])
    for node in (src, dst):
        if node not in graph:
            raise PlanInputError(f"{where}: link names node {node!r}, which is not in 'nodes'")
    attributes = _link_attributes(entry, where)
    graph.add_edge(src, dst, **attributes)
    if entry.get("both_ways", True):
        graph.add_edge(dst, src, **attributes)


def _add_default_links(graph: nx.DiGraph, entry: Any, where: str) -> None:
    if not isinstance(entry, dict):
        raise PlanInputError(f"{where}: expected an object like {{'latency_ms': 1, ...}}")
    attributes = _link_attributes(entry, where)
    for src in graph.nodes:
        for dst in graph.nodes:
            if src != dst and not graph.has_edge(src, dst):
                graph.add_edge(src, dst, **attributes)


# ---- model ----------------------------------------------------------------------------------


def load_model_spec_json(path: Path | str) -> ModelSpec:
    """A ModelSpec from JSON (ModelSpec.to_dict format; byte fields may use units like '1GB')."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise PlanInputError(f"cannot read model spec {path}: {error}") from error
    except json.JSONDecodeError as error:
        raise PlanInputError(f"model spec {path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise PlanInputError(f"model spec {path}: expected a JSON object")
    for key in ("embedding_bytes", "head_bytes"):
        if isinstance(data.get(key), str):
            data[key] = _quantity(parse_size, data[key], f"{path}: {key}")
    layers = data.get("layer_bytes")
    if isinstance(layers, str):
        data["layer_bytes"] = _quantity(parse_size, layers, f"{path}: layer_bytes")
    elif isinstance(layers, list):
        data["layer_bytes"] = [
            _quantity(parse_size, v, f"{path}: layer_bytes") if isinstance(v, str) else v
            for v in layers
        ]
    return ModelSpec.from_dict(data)


# ---- the command ----------------------------------------------------------------------------


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `meshd plan` flags to `parser` (the caller adds --api for the live view)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help="model directory (weights, or config.json alone: sized from mlx-lm's model class)",
    )
    source.add_argument("--model-spec", type=Path, metavar="FILE.json", help="a ModelSpec as JSON")
    parser.add_argument(
        "--mesh",
        type=Path,
        metavar="FILE.json",
        help="plan for the mesh described in this file instead of the live mesh",
    )
    parser.add_argument(
        "--strategy",
        choices=("speed", "memory", "both"),
        default="speed",
        help="speed (default), memory (the proportional baseline), or both: every kind of "
        "layout and the baseline side by side",
    )
    parser.add_argument(
        "--parallelism",
        choices=PARALLELISMS,
        default="auto",
        help="kind of layout: auto (default, the fastest predicted), pipeline, tensor "
        "(one tensor-parallel group) or hybrid (pipeline stages of groups)",
    )
    parser.add_argument(
        "--min-gain",
        default=str(DEFAULT_MIN_GAIN),
        metavar="FRACTION",
        help="what a node must add to join the layout: the fewest nodes within this much of "
        "the fastest predicted layout are used ('10%%' or 0.1, the default; 0: the fastest)",
    )
    parser.add_argument("--context", type=int, metavar="N", help="tokens of KV cache to reserve")
    parser.add_argument(
        "--concurrency", type=int, default=1, metavar="N", help="sequences decoded at once"
    )
    parser.add_argument(
        "--reserve", default="0", metavar="SIZE", help="memory kept free on every node (1GiB)"
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="NODE",
        help="node id that must not be used (repeatable)",
    )
    parser.add_argument(
        "--prompt-len", type=int, default=512, metavar="N", help="prompt length for the TTFT"
    )
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


Outcome = Plan | InsufficientMemory | ParallelismUnavailable


def run_plan(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run `meshd plan` with parsed arguments; returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        mesh = load_mesh_json(args.mesh) if args.mesh else _live_mesh(args)
        # The daemon refuses a model of an unverified architecture with these words; so does
        # plan, before it sizes a model no stage could run.
        refusal = architecture_refusal(args.model) if args.model is not None else None
        if refusal is not None:
            print(f"meshd plan: {refusal}", file=err)
            return EXIT_REFUSED
        model = _load_model(args)
        options = _options(args)
    except (PlanInputError, ModelInfoError, ModelSpecError, PlanOptionsError, MeshError) as error:
        print(f"meshd plan: {error}", file=err)
        return EXIT_BAD_INPUT
    try:
        if args.strategy == "both":
            outcomes = _both(mesh, model, options)
        else:
            outcomes = {args.strategy: plan_model(mesh, model, options)}
    except (InsufficientMemory, ParallelismUnavailable) as refusal:
        if args.json:
            print(json.dumps(refusal.to_dict(), indent=2), file=out)
        print(_describe(refusal), file=err)
        return EXIT_REFUSED
    except MeshError as error:
        print(f"meshd plan: {error}", file=err)
        return EXIT_BAD_INPUT
    _print_outcomes(outcomes, mesh, args.json, out)
    return EXIT_OK


def _both(mesh: nx.DiGraph, model: ModelSpec, options: PlanOptions) -> dict[str, Outcome]:
    """The speed plan, the memory baseline and the fastest plan of every kind of layout."""
    outcomes: dict[str, Outcome] = {}
    for name, chosen in (
        ("speed", options),
        ("memory", replace(options, strategy="memory", parallelism="auto")),
    ):
        try:
            outcomes[name] = plan_model(mesh, model, chosen)
        except (InsufficientMemory, ParallelismUnavailable) as refusal:
            outcomes[name] = refusal
    alternatives = plan_alternatives(mesh, model, replace(options, strategy="speed"))
    outcomes.update({f"layout:{kind}": outcome for kind, outcome in alternatives.items()})
    if not any(isinstance(outcome, Plan) for outcome in outcomes.values()):
        raise outcomes["speed"]  # type: ignore[misc]
    return outcomes


def _describe(refusal: InsufficientMemory | ParallelismUnavailable) -> str:
    """The refusal in the words the daemon reports it with (AgreementStatus.refusal)."""
    if isinstance(refusal, InsufficientMemory):
        return describe_refusal(refusal)
    return refusal.message


def _live_mesh(args: argparse.Namespace) -> nx.DiGraph:
    api = getattr(args, "api", None)
    if not api:
        raise PlanInputError(
            "no --mesh file and no daemon API address to read the live mesh from; "
            "pass --mesh FILE.json or start the daemon"
        )
    try:
        from meshd.api.client import fetch_mesh_graph  # lazy: the live view only
    except ImportError as error:
        raise PlanInputError(
            f"the live mesh view is not available ({error}); pass --mesh FILE.json"
        ) from error
    try:
        return fetch_mesh_graph(api, LIVE_TIMEOUT_S)
    except Exception as error:  # the client's failures are many (network, protocol)
        raise PlanInputError(
            f"could not read the live mesh from the daemon at {api}: {error} "
            "(to plan without a daemon, pass --mesh FILE.json)"
        ) from error


def _load_model(args: argparse.Namespace) -> ModelSpec:
    if args.model is not None:
        return read_model_spec(args.model, context_length=args.context)
    return load_model_spec_json(args.model_spec)


def _options(args: argparse.Namespace) -> PlanOptions:
    strategy = "speed" if args.strategy == "both" else args.strategy
    return PlanOptions(
        strategy=strategy,
        reserve_bytes=_quantity(parse_size, args.reserve, "--reserve"),
        exclude=frozenset(args.exclude),
        context_length=args.context,
        concurrency=args.concurrency,
        prompt_len=args.prompt_len,
        parallelism=args.parallelism,
        min_gain=_quantity(parse_fraction, args.min_gain, "--min-gain"),
    )


def _print_outcomes(
    outcomes: dict[str, Outcome], mesh: nx.DiGraph, as_json: bool, out: TextIO
) -> None:
    if as_json:
        payload: Any = (
            {name: outcome.to_dict() for name, outcome in outcomes.items()}
            if len(outcomes) > 1
            else next(iter(outcomes.values())).to_dict()
        )
        print(json.dumps(payload, indent=2), file=out)
        return
    plans = [outcome for name, outcome in outcomes.items() if name in ("speed", "memory")]
    blocks = [render_plan_table(plan, mesh) for plan in plans if isinstance(plan, Plan)]
    if len(outcomes) > 1:
        blocks.append(render_comparison(outcomes))
    print("\n\n".join(blocks), file=out)


# ---- rendering ------------------------------------------------------------------------------


def render_plan_table(plan: Plan, mesh: nx.DiGraph) -> str:
    """A readable table: stage, node, layers, memory used/usable, ms per token, and totals;
    then the layout, the predicted speed, relayed hops, expert placement, nodes left out."""
    names = {str(node): str(data.get("name") or node) for node, data in mesh.nodes(data=True)}
    rows = [("stage", "node", "layers", "memory used / usable", "ms/token")]
    memory = {entry.node: entry for entry in plan.memory}
    for index, stage in enumerate(plan.stages):
        seconds = plan.prediction.stage_decode_s[index]
        for position, node in enumerate(stage.nodes):
            entry = memory[node]
            rows.append(
                (
                    str(index) if position == 0 else "",
                    _node_label(node, names) + (" [TP]" if stage.tensor_parallel else ""),
                    _layer_label(stage) if position == 0 else "",
                    f"{format_bytes(entry.total_bytes)} / {format_bytes(entry.usable_bytes)} "
                    f"({100 * entry.total_bytes / max(entry.usable_bytes, 1):.0f}%)",
                    f"{seconds * 1e3:.2f}" if position == 0 else "",
                )
            )
    if plan.hops:
        hop_ms = f"{plan.prediction.hops_decode_s * 1e3:.2f}"
        rows.append(("hops", f"{len(plan.hops)} transfers (incl. token back)", "", "", hop_ms))
    used = sum(entry.total_bytes for entry in plan.memory)
    usable = sum(entry.usable_bytes for entry in plan.memory)
    total_ms = f"{plan.prediction.decode_s_per_token * 1e3:.2f}"
    rows.append(("total", "", f"{plan.num_layers} layers", _usage(used, usable), total_ms))
    lines = [_plan_header(plan)]
    if plan.note:
        lines.append(f"note: {plan.note}")
    lines.extend([*_format_rows(rows), _layout_line(plan), _speed_line(plan)])
    lines.extend(_priced_lines(plan, names))
    lines.extend(_route_lines(plan, names))
    lines.extend(_expert_lines(plan, names))
    lines.extend(
        f"left out: {_node_label(entry.node, names)}: {entry.reason}" for entry in plan.left_out
    )
    return "\n".join(lines)


def _priced_lines(plan: Plan, names: dict[str, str]) -> list[str]:
    """Which compute rate each node was priced at for the model's dtype, and from what."""
    if not plan.priced:
        return []
    parts = [
        f"{_node_label(entry.node, names)} {format_flops(entry.flops)}, "
        f"{format_rate(entry.mem_bandwidth)} ({entry.source})"
        for entry in plan.priced
    ]
    return [f"priced at {plan.compute_key or 'flops'}: " + "; ".join(parts)]


def render_comparison(outcomes: dict[str, Outcome] | list[Plan]) -> str:
    """Side by side: each plan's layout and predicted speed, or why it cannot run."""
    if isinstance(outcomes, list):
        outcomes = {plan.strategy: plan for plan in outcomes}
    rows = [("plan", "layout", "stages", "nodes", "ms/token", "tokens/s", "TTFT", "plan id")]
    reasons = []
    for name, outcome in outcomes.items():
        label = name.removeprefix("layout:")
        if not isinstance(outcome, Plan):
            rows.append((label, "-", "-", "-", "-", "-", "-", "cannot run"))
            reasons.append(f"  {label}: {_short_reason(outcome)}")
            continue
        prediction = outcome.prediction
        rows.append(
            (
                label,
                outcome.layout,
                str(len(outcome.stages)),
                str(len(outcome.nodes)),
                f"{prediction.decode_s_per_token * 1e3:.2f}",
                f"{prediction.tokens_per_s:.1f}",
                format_seconds(prediction.ttft_s),
                outcome.short_id,
            )
        )
    lines = ["comparison (single-request decode, predicted):", *_format_rows(rows)]
    if reasons:
        lines.append("cannot run:")
        lines.extend(reasons)
    speed, memory = outcomes.get("speed"), outcomes.get("memory")
    if isinstance(speed, Plan) and isinstance(memory, Plan):
        ratio = memory.prediction.decode_s_per_token / speed.prediction.decode_s_per_token
        lines.append(f"speed is predicted {ratio:.2f}x as fast as memory per token")
    return "\n".join(lines)


def _short_reason(refusal: InsufficientMemory | ParallelismUnavailable) -> str:
    return refusal.reason if isinstance(refusal, ParallelismUnavailable) else refusal.message


def _layout_line(plan: Plan) -> str:
    groups = sum(1 for stage in plan.stages if stage.tensor_parallel)
    return (
        f"layout: {plan.layout} ({len(plan.stages)} stage(s), {len(plan.nodes)} node(s), "
        f"{groups} tensor-parallel group(s)); fits: every node within its usable memory"
    )


def _expert_lines(plan: Plan, names: dict[str, str]) -> list[str]:
    lines = []
    for index, stage in enumerate(plan.stages):
        if not stage.experts:
            continue
        shares = ", ".join(
            f"{_node_label(shard.node, names)} {shard.expert_start}-{shard.expert_end - 1}"
            f" ({shard.count})"
            for shard in stage.experts
        )
        lines.append(
            f"experts of stage {index} (each of its {len(stage.moe_layers)} MoE layers): {shares}"
        )
    return lines


def _plan_header(plan: Plan) -> str:
    return (
        f"plan {plan.short_id}  strategy {plan.strategy}  layout {plan.layout}  "
        f"model {plan.model_name}  "
        f"context {plan.context_length} x {plan.concurrency} sequence(s)"
    )


def _speed_line(plan: Plan) -> str:
    prediction = plan.prediction
    text = (
        f"predicted: {prediction.decode_s_per_token * 1e3:.2f} ms/token = "
        f"{prediction.tokens_per_s:.1f} tokens/s; time to first token "
        f"{format_seconds(prediction.ttft_s)} for {prediction.prompt_len} prompt tokens"
    )
    if plan.concurrency > 1:
        text += (
            f"; with {plan.concurrency} sequences {prediction.aggregate_tokens_per_s:.1f} "
            "tokens/s in all"
        )
    return text


def _route_lines(plan: Plan, names: dict[str, str]) -> list[str]:
    return [
        f"hop {hop.src_stage}->{hop.dst_stage} ({hop.carries}): "
        f"{' > '.join(hop.path)}  {hop.decode_s * 1e3:.3f} ms"
        for hop in plan.hops
        if len(hop.path) > 2
    ]


def _node_label(node: str, names: dict[str, str]) -> str:
    name = names.get(node, node)
    return node if name == node else f"{node} ({name})"


def _layer_label(stage: Any) -> str:
    return f"{stage.layer_start}-{stage.layer_end - 1} ({stage.num_layers})"


def _usage(used: int, usable: int) -> str:
    return f"{format_bytes(used)} / {format_bytes(usable)}"


def _format_rows(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
