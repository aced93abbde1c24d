"""What one tensor-parallel stage is: a frozen spec every member derives from the committed plan.

A tensor-parallel (TP) stage is a pipeline stage whose layers are split over a group of nodes
with mlx-lm's own ``shard(group)``: attention heads and MLP columns are divided between the
ranks, and two all-reduces per layer put the pieces back together. The group is an
``mx.distributed`` group, which cannot be re-initialised in one process, so each member runs its
rank in a runner process of its own (:mod:`.runner`, owned by :mod:`.member`).

Nothing here is hand-written per cluster: :func:`build_group_spec` derives everything from the
plan (plan id, stage index, the stage's ordered nodes, layer range, expert placement), the
addresses the members reach each other on, the mesh secret and the link verdict
(:mod:`meshd.mesh.link_trust`). Every member computes the same spec from the same inputs;
rank = index in the stage's node order. The backend's configuration (MLX's ring hostfile,
JACCL's or NCCL's environment) follows from the spec (:func:`backend_files_and_env`).

Ports are derived too (:func:`group_ports`): ``base_port + PORT_STRIDE * slot + rank`` for the
collective backend and ``... + PORT_STRIDE - 1`` for the runners' control channel, with ``slot``
taken from the plan id plus the stage index, so the stages of one plan never share ports and
two plans rarely do (the supervisor refuses a port still held by a live runner).

Pure: no MLX, no I/O except :func:`check_tensor_parallel`, which reads ``config.json``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Which architectures may run tensor-parallel is a fact about models, which the model
# description (meshd.models.info) carries to the planner; re-exported here for the runner side.
from meshd.models.tensor_parallel_support import (
    TENSOR_PARALLEL_ARCHITECTURES as TENSOR_PARALLEL_ARCHITECTURES,
)
from meshd.models.tensor_parallel_support import architecture_of as architecture_of
from meshd.models.tensor_parallel_support import (
    supports_tensor_parallel as supports_tensor_parallel,
)
from meshd.models.tensor_parallel_support import (
    tensor_parallel_refusal as tensor_parallel_refusal,
)

BACKENDS = ("ring", "jaccl", "nccl")
# Below every system's ephemeral ports (Linux 32768-60999, macOS and Windows 49152-65535) and
# Kubernetes' NodePorts (30000-32767): a runner binds its port minutes or months after the
# daemon started, and a port that an outgoing connection happens to hold then cannot be bound.
DEFAULT_BASE_PORT = 28400
PORT_STRIDE = 16  # ports per slot: one per rank, the last one for the control channel
PORT_SLOTS = 64
MAX_GROUP_SIZE = PORT_STRIDE - 1
DEFAULT_STEP_TIMEOUT_S = 120.0
SPEC_VERSION = 1


class TensorParallelUnsupported(ValueError):
    """This model, group or configuration cannot run as a tensor-parallel stage; says why."""


@dataclass(frozen=True)
class GroupMember:
    """One rank: the node, and the address its runner's collective backend listens on."""

    node_id: str
    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class TensorParallelSpec:
    """One TP stage of one plan, identical on every member (rank = index in ``members``).

    expert_ranges: per rank, the routed experts ``[start, end)`` it holds in every MoE layer of
        the stage (expert parallelism: a token's expert runs where the expert is); empty =
        mlx-lm's even split (every rank holds a slice of every expert).
    link: which link the group runs over and why that is allowed (for status;
        :mod:`meshd.mesh.link_trust`).
    token: hex key that authenticates the runners' control channel (never shown in status).
    step_timeout_s: a runner that spends longer on one step exits (a hung collective's backstop).
    """

    plan_id: str
    stage_index: int
    model_dir: str
    layer_start: int
    layer_end: int
    has_embedding: bool
    has_head: bool
    members: tuple[GroupMember, ...]
    control_port: int
    backend: str = "ring"
    expert_ranges: tuple[tuple[int, int], ...] = ()
    link: str = ""
    token: str = field(default="", repr=False)
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    rdma_devices: tuple[tuple[str | None, ...], ...] = ()

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def layer_range(self) -> tuple[int, int]:
        return (self.layer_start, self.layer_end)

    @property
    def control_address(self) -> tuple[str, int]:
        """Where rank 0's runner accepts the other ranks' control connections."""
        return (self.members[0].host, self.control_port)

    @property
    def name(self) -> str:
        """Short label for logs and status: ``<plan>/stage<i>``."""
        return f"{self.plan_id[:12]}/stage{self.stage_index}"

    def rank_of(self, node_id: str) -> int:
        for rank, member in enumerate(self.members):
            if member.node_id == node_id:
                return rank
        raise KeyError(f"node {node_id} is not a member of tensor-parallel stage {self.name}")

    def hostfile(self) -> list[list[str]]:
        """MLX's ring hostfile: per rank, the addresses its runner listens on."""
        return [[member.address] for member in self.members]

    def public_dict(self) -> dict[str, Any]:
        """Everything but the token: for status and logs."""
        data = self.to_dict()
        data.pop("token")
        return data

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["version"] = SPEC_VERSION
        data["members"] = [asdict(member) for member in self.members]
        data["expert_ranges"] = [list(pair) for pair in self.expert_ranges]
        data["rdma_devices"] = [list(row) for row in self.rdma_devices]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorParallelSpec:
        """Strict: unknown keys, a different version or wrong types are refused."""
        if not isinstance(data, Mapping):
            raise TensorParallelUnsupported("a tensor-parallel spec must be a JSON object")
        values = dict(data)
        version = values.pop("version", None)
        if version != SPEC_VERSION:
            raise TensorParallelUnsupported(
                f"tensor-parallel spec version {version!r} is not {SPEC_VERSION}: the daemon "
                "and its runner come from different meshd versions; reinstall meshd"
            )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise TensorParallelUnsupported(f"unknown tensor-parallel spec fields {unknown}")
        try:
            values["members"] = tuple(GroupMember(**item) for item in values["members"])
            values["expert_ranges"] = tuple(
                (int(a), int(b)) for a, b in values.get("expert_ranges", ())
            )
            values["rdma_devices"] = tuple(tuple(row) for row in values.get("rdma_devices", ()))
            return cls(**values)
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, TensorParallelUnsupported):
                raise
            raise TensorParallelUnsupported(f"malformed tensor-parallel spec: {error}") from error

    @classmethod
    def from_json(cls, text: str) -> TensorParallelSpec:
        try:
            data = json.loads(text)
        except ValueError as error:
            raise TensorParallelUnsupported(f"tensor-parallel spec is not JSON: {error}") from None
        return cls.from_dict(data)


def _validate(spec: TensorParallelSpec) -> None:
    def refuse(message: str) -> None:
        raise TensorParallelUnsupported(f"tensor-parallel stage {spec.plan_id[:12]}: {message}")

    if not isinstance(spec.plan_id, str) or not spec.plan_id:
        refuse("plan_id must be a non-empty string")
    if not _is_int(spec.stage_index) or spec.stage_index < 0:
        refuse(f"stage_index must be an integer >= 0, got {spec.stage_index!r}")
    if not _is_int(spec.layer_start) or not _is_int(spec.layer_end):
        refuse("layer_start and layer_end must be integers")
    if not 0 <= spec.layer_start < spec.layer_end:
        refuse(f"layer range [{spec.layer_start}, {spec.layer_end}) is empty or negative")
    if not 1 <= len(spec.members) <= MAX_GROUP_SIZE:
        refuse(f"a group has 1 to {MAX_GROUP_SIZE} members, got {len(spec.members)}")
    if len({member.node_id for member in spec.members}) != len(spec.members):
        refuse("a node appears twice among the members")
    if len({member.address for member in spec.members}) != len(spec.members):
        refuse("two members listen on the same address")
    for member in spec.members:
        if not member.node_id or not member.host:
            refuse("every member needs a node id and a host")
        if not _is_int(member.port) or not 1 <= member.port <= 65535:
            refuse(f"member {member.node_id} has port {member.port!r}, not 1-65535")
    if not _is_int(spec.control_port) or not 1 <= spec.control_port <= 65535:
        refuse(f"control_port {spec.control_port!r} is not 1-65535")
    if (spec.members[0].host, spec.control_port) in {(m.host, m.port) for m in spec.members}:
        refuse("the control port is also a member's collective port")
    if spec.backend not in BACKENDS:
        refuse(f"backend {spec.backend!r} is not one of {', '.join(BACKENDS)}")
    if spec.expert_ranges:
        if len(spec.expert_ranges) != len(spec.members):
            refuse(
                f"{len(spec.expert_ranges)} expert ranges for {len(spec.members)} members; "
                "give one [start, end) per rank"
            )
        expected = 0
        for start, end in spec.expert_ranges:
            if start != expected or end < start:
                refuse(
                    "expert ranges must be contiguous, in rank order, starting at 0: "
                    f"{list(spec.expert_ranges)}"
                )
            expected = end
    if not isinstance(spec.step_timeout_s, int | float) or not spec.step_timeout_s > 0:
        refuse(f"step_timeout_s must be > 0, got {spec.step_timeout_s!r}")
    if spec.backend == "jaccl" and len(spec.rdma_devices) != len(spec.members):
        refuse("the jaccl backend needs one row of RDMA device names per member")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- Derivation from a committed plan ----------------------------------------------------------


def group_ports(
    plan_id: str, stage_index: int, size: int, base_port: int = DEFAULT_BASE_PORT
) -> tuple[tuple[int, ...], int]:
    """(collective port per rank, control port) of stage ``stage_index`` of ``plan_id``."""
    if not 1 <= size <= MAX_GROUP_SIZE:
        raise TensorParallelUnsupported(f"a group has 1 to {MAX_GROUP_SIZE} members, not {size}")
    if not 1 <= base_port <= 65535 - PORT_STRIDE * PORT_SLOTS:
        raise TensorParallelUnsupported(
            f"base port {base_port} leaves no room for {PORT_STRIDE * PORT_SLOTS} ports below "
            "65536; choose a lower tensor-parallel base port"
        )
    digest = hashlib.sha256(plan_id.encode()).digest()
    slot = (int.from_bytes(digest[:4], "big") + stage_index) % PORT_SLOTS
    first = base_port + PORT_STRIDE * slot
    return tuple(first + rank for rank in range(size)), first + PORT_STRIDE - 1


def group_token(mesh_secret: bytes, plan_id: str, stage_index: int) -> str:
    """The key that authenticates one group's control channel: every member derives the same
    one from the mesh secret; nobody outside the mesh can."""
    message = f"meshd tensor-parallel v1|{plan_id}|{stage_index}".encode()
    return hmac.new(mesh_secret, message, hashlib.sha256).hexdigest()


def build_group_spec(
    *,
    plan_id: str,
    stage_index: int,
    stage_nodes: Sequence[str],
    layer_start: int,
    layer_end: int,
    has_embedding: bool,
    has_head: bool,
    model_dir: str | Path,
    addresses: Mapping[str, str],
    link: str,
    mesh_secret: bytes,
    expert_shards: Sequence[tuple[str, int, int]] = (),
    backend: str = "ring",
    base_port: int = DEFAULT_BASE_PORT,
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
) -> TensorParallelSpec:
    """The spec of a plan's TP stage, derived only from what every member knows alike.

    stage_nodes: the stage's nodes in plan order (rank = index).
    addresses: node id -> the IP its runner is reached on over the group's link (the link
        :func:`meshd.mesh.link_trust.group_link_verdict` allowed).
    link: the verdict's description (why this link may carry the collectives in clear).
    expert_shards: ``(node, first expert, end)`` per member, in member order (the planner's
        expert placement); empty = mlx-lm's even split.
    """
    missing = [node for node in stage_nodes if node not in addresses]
    if missing:
        raise TensorParallelUnsupported(
            f"no address on the group's link is known for {', '.join(missing)}"
        )
    ports, control_port = group_ports(plan_id, stage_index, len(stage_nodes), base_port)
    members = tuple(
        GroupMember(node, addresses[node], port)
        for node, port in zip(stage_nodes, ports, strict=True)
    )
    ranges: tuple[tuple[int, int], ...] = ()
    if expert_shards:
        order = [node for node, _, _ in expert_shards]
        if order != list(stage_nodes):
            raise TensorParallelUnsupported(
                f"expert placement lists {order}, the stage's members are {list(stage_nodes)}"
            )
        ranges = tuple((int(start), int(end)) for _, start, end in expert_shards)
    return TensorParallelSpec(
        plan_id=plan_id,
        stage_index=stage_index,
        model_dir=str(model_dir),
        layer_start=layer_start,
        layer_end=layer_end,
        has_embedding=has_embedding,
        has_head=has_head,
        members=members,
        control_port=control_port,
        backend=backend,
        expert_ranges=ranges,
        link=link,
        token=group_token(mesh_secret, plan_id, stage_index),
        step_timeout_s=step_timeout_s,
    )


def backend_files_and_env(spec: TensorParallelSpec, rank: int) -> tuple[dict[str, str], dict]:
    """(files to write: env var -> JSON content, plain environment) for rank ``rank``.

    The runner gets ``MLX_RANK`` and, for each file, an environment variable naming the written
    file, as MLX's own launcher (``mlx.launch``) does:
    * ring: ``MLX_HOSTFILE`` = JSON list, per rank, of the ``ip:port`` its runner listens on;
    * jaccl: ``MLX_IBV_DEVICES`` = JSON matrix of RDMA device names (``null`` on the
      diagonal), ``MLX_JACCL_COORDINATOR`` = rank 0's ``ip:port``;
    * nccl: ``NCCL_HOST_IP``/``NCCL_PORT`` = rank 0's address, ``MLX_WORLD_SIZE``.
    Only ring runs on this project's test machines (Linux CPU); jaccl needs macOS 26.2+ with
    RDMA over Thunderbolt 5, nccl a CUDA build of MLX.
    """
    if not 0 <= rank < spec.size:
        raise TensorParallelUnsupported(f"rank {rank} is outside a group of {spec.size}")
    env = {"MLX_RANK": str(rank)}
    if spec.backend == "ring":
        return {"MLX_HOSTFILE": json.dumps(spec.hostfile())}, env
    first = spec.members[0]
    if spec.backend == "jaccl":
        env["MLX_JACCL_COORDINATOR"] = first.address
        return {"MLX_IBV_DEVICES": json.dumps([list(row) for row in spec.rdma_devices])}, env
    env.update(
        {"NCCL_HOST_IP": first.host, "NCCL_PORT": str(first.port), "MLX_WORLD_SIZE": str(spec.size)}
    )
    return {}, env


# --- Which models can run tensor-parallel ------------------------------------------------------


def check_tensor_parallel(
    model_dir: str | Path,
    group_size: int,
    expert_ranges: Sequence[tuple[int, int]] = (),
    *,
    refuse_unverified: bool = True,
) -> None:
    """Refuse, with the reason, a model that cannot be split over ``group_size`` ranks.

    mlx-lm divides the attention and KV heads, the MLP's hidden width and each expert's width
    by the group size, evenly; expert placement must cover every routed expert.
    ``refuse_unverified=False``: the architecture need not be verified yet (only the
    verification that makes meshd.models.architecture_table asks for that).
    """
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise TensorParallelUnsupported(f"cannot read {config_path}: {error}") from error
    if not isinstance(config, dict):
        raise TensorParallelUnsupported(f"{config_path} is not a JSON object")
    model_type = str(config.get("model_type"))
    refusal = tensor_parallel_refusal(model_type) if refuse_unverified else None
    if refusal is not None:
        raise TensorParallelUnsupported(f"model type {model_type!r}: {refusal}")
    text = config.get("text_config") or config
    divided = {
        "num_attention_heads": text.get("num_attention_heads"),
        "num_key_value_heads": text.get("num_key_value_heads", text.get("num_attention_heads")),
        "intermediate_size": text.get("intermediate_size"),
        "moe_intermediate_size": text.get("moe_intermediate_size"),
    }
    wrong = [
        f"{name} = {value}"
        for name, value in divided.items()
        if isinstance(value, int) and value % group_size
    ]
    if wrong:
        raise TensorParallelUnsupported(
            f"a group of {group_size} must divide {', '.join(wrong)} of {model_type} evenly "
            "(mlx-lm splits them equally between the ranks)"
        )
    experts = num_routed_experts(text)
    if expert_ranges:
        if not experts:
            raise TensorParallelUnsupported(
                f"expert placement given, but {model_type} in {model_dir} has no routed experts"
            )
        if expert_ranges[-1][1] != experts:
            raise TensorParallelUnsupported(
                f"expert placement {list(expert_ranges)} does not cover the model's {experts} "
                "routed experts"
            )


def num_routed_experts(text_config: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer under the field names of the verified architectures."""
    for name in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = text_config.get(name)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def even_expert_ranges(num_experts: int, size: int) -> tuple[tuple[int, int], ...]:
    """Contiguous, near-equal expert ranges per rank (earlier ranks take the extra ones)."""
    base, extra = divmod(num_experts, size)
    ranges, start = [], 0
    for rank in range(size):
        end = start + base + (1 if rank < extra else 0)
        ranges.append((start, end))
        start = end
    return tuple(ranges)


def proportional_expert_ranges(
    num_experts: int, weights: Sequence[float]
) -> tuple[tuple[int, int], ...]:
    """Contiguous expert ranges in proportion to ``weights`` (e.g. members' memory), by largest
    remainder; for callers without the planner's placement."""
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    quotas = [num_experts * w / total for w in weights]
    counts = [math.floor(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (counts[i] - quotas[i], i))
    for index in order[: num_experts - sum(counts)]:
        counts[index] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return tuple(ranges)
