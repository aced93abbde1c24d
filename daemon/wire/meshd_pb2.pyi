from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Refusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_NONE: _ClassVar[Refusal]
    REFUSAL_DUPLICATE_NODE_ID: _ClassVar[Refusal]
    REFUSAL_OTHER_MESH: _ClassVar[Refusal]
    REFUSAL_PROTOCOL_VERSION: _ClassVar[Refusal]
    REFUSAL_IDENTITY_MISMATCH: _ClassVar[Refusal]
REFUSAL_NONE: Refusal
REFUSAL_DUPLICATE_NODE_ID: Refusal
REFUSAL_OTHER_MESH: Refusal
REFUSAL_PROTOCOL_VERSION: Refusal
REFUSAL_IDENTITY_MISMATCH: Refusal

class NodeProfile(_message.Message):
    __slots__ = ("node_id", "name", "total_memory", "available_memory", "memory_budget", "flops", "mem_bandwidth", "dtype", "platform", "chip", "mlx_device", "blas", "cores", "measured_at", "versions", "fingerprint", "flops_spread", "mem_bandwidth_spread", "loaded", "other_busy_cores", "process_overhead", "dtype_flops", "dtype_bandwidth", "device_backend", "device_name", "device_reason", "gpu_count")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class DtypeFlopsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class DtypeBandwidthEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    MEM_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    CHIP_FIELD_NUMBER: _ClassVar[int]
    MLX_DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLAS_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FLOPS_SPREAD_FIELD_NUMBER: _ClassVar[int]
    MEM_BANDWIDTH_SPREAD_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    OTHER_BUSY_CORES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FLOPS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_REASON_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name: str
    total_memory: int
    available_memory: int
    memory_budget: int
    flops: float
    mem_bandwidth: float
    dtype: str
    platform: str
    chip: str
    mlx_device: str
    blas: str
    cores: int
    measured_at: float
    versions: _containers.ScalarMap[str, str]
    fingerprint: str
    flops_spread: float
    mem_bandwidth_spread: float
    loaded: bool
    other_busy_cores: float
    process_overhead: int
    dtype_flops: _containers.ScalarMap[str, float]
    dtype_bandwidth: _containers.ScalarMap[str, float]
    device_backend: str
    device_name: str
    device_reason: str
    gpu_count: int
    def __init__(self, node_id: _Optional[str] = ..., name: _Optional[str] = ..., total_memory: _Optional[int] = ..., available_memory: _Optional[int] = ..., memory_budget: _Optional[int] = ..., flops: _Optional[float] = ..., mem_bandwidth: _Optional[float] = ..., dtype: _Optional[str] = ..., platform: _Optional[str] = ..., chip: _Optional[str] = ..., mlx_device: _Optional[str] = ..., blas: _Optional[str] = ..., cores: _Optional[int] = ..., measured_at: _Optional[float] = ..., versions: _Optional[_Mapping[str, str]] = ..., fingerprint: _Optional[str] = ..., flops_spread: _Optional[float] = ..., mem_bandwidth_spread: _Optional[float] = ..., loaded: _Optional[bool] = ..., other_busy_cores: _Optional[float] = ..., process_overhead: _Optional[int] = ..., dtype_flops: _Optional[_Mapping[str, float]] = ..., dtype_bandwidth: _Optional[_Mapping[str, float]] = ..., device_backend: _Optional[str] = ..., device_name: _Optional[str] = ..., device_reason: _Optional[str] = ..., gpu_count: _Optional[int] = ...) -> None: ...

class LinkMeasurement(_message.Message):
    __slots__ = ("src", "dst", "tcp_rtt_s", "grpc_rtt_s", "latency_s", "bandwidth", "probe_bytes", "measured_at", "latency_bucket", "bandwidth_bucket", "trusted", "trust_reason", "src_address", "dst_address")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    TCP_RTT_S_FIELD_NUMBER: _ClassVar[int]
    GRPC_RTT_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_BUCKET_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BUCKET_FIELD_NUMBER: _ClassVar[int]
    TRUSTED_FIELD_NUMBER: _ClassVar[int]
    TRUST_REASON_FIELD_NUMBER: _ClassVar[int]
    SRC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    tcp_rtt_s: float
    grpc_rtt_s: float
    latency_s: float
    bandwidth: float
    probe_bytes: int
    measured_at: float
    latency_bucket: int
    bandwidth_bucket: int
    trusted: bool
    trust_reason: str
    src_address: str
    dst_address: str
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., tcp_rtt_s: _Optional[float] = ..., grpc_rtt_s: _Optional[float] = ..., latency_s: _Optional[float] = ..., bandwidth: _Optional[float] = ..., probe_bytes: _Optional[int] = ..., measured_at: _Optional[float] = ..., latency_bucket: _Optional[int] = ..., bandwidth_bucket: _Optional[int] = ..., trusted: _Optional[bool] = ..., trust_reason: _Optional[str] = ..., src_address: _Optional[str] = ..., dst_address: _Optional[str] = ...) -> None: ...

class NodeState(_message.Message):
    __slots__ = ("profile", "links", "version", "instance_id", "alive_peers", "model", "leaving", "tensor_parallel_port", "loaded_plans", "hub_access", "downloads", "speed_correction")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_PEERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_PORT_FIELD_NUMBER: _ClassVar[int]
    LOADED_PLANS_FIELD_NUMBER: _ClassVar[int]
    HUB_ACCESS_FIELD_NUMBER: _ClassVar[int]
    DOWNLOADS_FIELD_NUMBER: _ClassVar[int]
    SPEED_CORRECTION_FIELD_NUMBER: _ClassVar[int]
    profile: NodeProfile
    links: _containers.RepeatedCompositeFieldContainer[LinkMeasurement]
    version: int
    instance_id: str
    alive_peers: _containers.RepeatedScalarFieldContainer[str]
    model: ModelSelection
    leaving: bool
    tensor_parallel_port: int
    loaded_plans: _containers.RepeatedScalarFieldContainer[str]
    hub_access: bool
    downloads: _containers.RepeatedCompositeFieldContainer[Download]
    speed_correction: SpeedCorrection
    def __init__(self, profile: _Optional[_Union[NodeProfile, _Mapping]] = ..., links: _Optional[_Iterable[_Union[LinkMeasurement, _Mapping]]] = ..., version: _Optional[int] = ..., instance_id: _Optional[str] = ..., alive_peers: _Optional[_Iterable[str]] = ..., model: _Optional[_Union[ModelSelection, _Mapping]] = ..., leaving: _Optional[bool] = ..., tensor_parallel_port: _Optional[int] = ..., loaded_plans: _Optional[_Iterable[str]] = ..., hub_access: _Optional[bool] = ..., downloads: _Optional[_Iterable[_Union[Download, _Mapping]]] = ..., speed_correction: _Optional[_Union[SpeedCorrection, _Mapping]] = ...) -> None: ...

class SpeedCorrection(_message.Message):
    __slots__ = ("node_id", "factor", "samples", "measured_step_s", "predicted_step_s", "updated_at", "plan_id", "row_flops", "compute_factor", "prompt_samples", "collective_overhead_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_STEP_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_S_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_FLOPS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    factor: float
    samples: int
    measured_step_s: float
    predicted_step_s: float
    updated_at: float
    plan_id: str
    row_flops: float
    compute_factor: float
    prompt_samples: int
    collective_overhead_s: float
    def __init__(self, node_id: _Optional[str] = ..., factor: _Optional[float] = ..., samples: _Optional[int] = ..., measured_step_s: _Optional[float] = ..., predicted_step_s: _Optional[float] = ..., updated_at: _Optional[float] = ..., plan_id: _Optional[str] = ..., row_flops: _Optional[float] = ..., compute_factor: _Optional[float] = ..., prompt_samples: _Optional[int] = ..., collective_overhead_s: _Optional[float] = ...) -> None: ...

class Download(_message.Message):
    __slots__ = ("node", "repo", "file", "done_bytes", "total_bytes", "rate_bytes_per_s", "seconds_left", "source")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REPO_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RATE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    node: str
    repo: str
    file: str
    done_bytes: int
    total_bytes: int
    rate_bytes_per_s: float
    seconds_left: float
    source: str
    def __init__(self, node: _Optional[str] = ..., repo: _Optional[str] = ..., file: _Optional[str] = ..., done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., rate_bytes_per_s: _Optional[float] = ..., seconds_left: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class ModelSelection(_message.Message):
    __slots__ = ("name", "digest", "spec_json", "options_json", "set_at", "set_by", "path", "startup_default")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    SET_AT_FIELD_NUMBER: _ClassVar[int]
    SET_BY_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STARTUP_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    spec_json: str
    options_json: str
    set_at: float
    set_by: str
    path: str
    startup_default: bool
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ..., spec_json: _Optional[str] = ..., options_json: _Optional[str] = ..., set_at: _Optional[float] = ..., set_by: _Optional[str] = ..., path: _Optional[str] = ..., startup_default: _Optional[bool] = ...) -> None: ...

class ModelRef(_message.Message):
    __slots__ = ("name", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class PlanInputs(_message.Message):
    __slots__ = ("members", "digests", "model", "settings", "incumbent")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    INCUMBENT_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedScalarFieldContainer[str]
    digests: _containers.RepeatedScalarFieldContainer[str]
    model: ModelRef
    settings: str
    incumbent: PlanRef
    def __init__(self, members: _Optional[_Iterable[str]] = ..., digests: _Optional[_Iterable[str]] = ..., model: _Optional[_Union[ModelRef, _Mapping]] = ..., settings: _Optional[str] = ..., incumbent: _Optional[_Union[PlanRef, _Mapping]] = ...) -> None: ...

class PlanRef(_message.Message):
    __slots__ = ("plan_id", "stage_members", "layout")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    stage_members: _containers.RepeatedScalarFieldContainer[str]
    layout: str
    def __init__(self, plan_id: _Optional[str] = ..., stage_members: _Optional[_Iterable[str]] = ..., layout: _Optional[str] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("inputs", "plan", "refusal")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    inputs: PlanInputs
    plan: PlanRef
    refusal: str
    def __init__(self, inputs: _Optional[_Union[PlanInputs, _Mapping]] = ..., plan: _Optional[_Union[PlanRef, _Mapping]] = ..., refusal: _Optional[str] = ...) -> None: ...

class ProposalMessage(_message.Message):
    __slots__ = ("sender", "incarnation", "seq", "proposal", "committed", "active")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    sender: str
    incarnation: int
    seq: int
    proposal: Proposal
    committed: bool
    active: PlanRef
    def __init__(self, sender: _Optional[str] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., committed: _Optional[bool] = ..., active: _Optional[_Union[PlanRef, _Mapping]] = ...) -> None: ...

class ProposeAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("node_id", "instance_id", "mesh_name", "protocol_version", "grpc_port", "started_at")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MESH_NAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    GRPC_PORT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    instance_id: str
    mesh_name: str
    protocol_version: int
    grpc_port: int
    started_at: float
    def __init__(self, node_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., mesh_name: _Optional[str] = ..., protocol_version: _Optional[int] = ..., grpc_port: _Optional[int] = ..., started_at: _Optional[float] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("accepted", "reason", "refusal", "node_id", "instance_id", "mesh_name", "protocol_version", "started_at")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MESH_NAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    refusal: Refusal
    node_id: str
    instance_id: str
    mesh_name: str
    protocol_version: int
    started_at: float
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., refusal: _Optional[_Union[Refusal, str]] = ..., node_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., mesh_name: _Optional[str] = ..., protocol_version: _Optional[int] = ..., started_at: _Optional[float] = ...) -> None: ...

class Beat(_message.Message):
    __slots__ = ("node_id", "seq", "state_version", "sent_at")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    seq: int
    state_version: int
    sent_at: float
    def __init__(self, node_id: _Optional[str] = ..., seq: _Optional[int] = ..., state_version: _Optional[int] = ..., sent_at: _Optional[float] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class ProbeChunk(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class ProbeSummary(_message.Message):
    __slots__ = ("bytes", "receive_seconds", "chunks")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    receive_seconds: float
    chunks: int
    def __init__(self, bytes: _Optional[int] = ..., receive_seconds: _Optional[float] = ..., chunks: _Optional[int] = ...) -> None: ...

class HubFileRequest(_message.Message):
    __slots__ = ("repo_id", "commit", "path", "offset", "manifest")
    REPO_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    repo_id: str
    commit: str
    path: str
    offset: int
    manifest: bool
    def __init__(self, repo_id: _Optional[str] = ..., commit: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., manifest: _Optional[bool] = ...) -> None: ...

class ModelPartRequest(_message.Message):
    __slots__ = ("model_name", "model_digest", "layer_start", "layer_end", "has_embedding", "has_head")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    HAS_EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    HAS_HEAD_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_digest: str
    layer_start: int
    layer_end: int
    has_embedding: bool
    has_head: bool
    def __init__(self, model_name: _Optional[str] = ..., model_digest: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., has_embedding: _Optional[bool] = ..., has_head: _Optional[bool] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "offset", "data", "size", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    size: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("profile", "address", "alive", "last_seen_s", "joined_at", "source", "instance_id", "clock_offset_s")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    JOINED_AT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_OFFSET_S_FIELD_NUMBER: _ClassVar[int]
    profile: NodeProfile
    address: str
    alive: bool
    last_seen_s: float
    joined_at: float
    source: str
    instance_id: str
    clock_offset_s: float
    def __init__(self, profile: _Optional[_Union[NodeProfile, _Mapping]] = ..., address: _Optional[str] = ..., alive: _Optional[bool] = ..., last_seen_s: _Optional[float] = ..., joined_at: _Optional[float] = ..., source: _Optional[str] = ..., instance_id: _Optional[str] = ..., clock_offset_s: _Optional[float] = ...) -> None: ...

class MeshStatus(_message.Message):
    __slots__ = ("node_id", "mesh_name", "mesh_fingerprint", "protocol_version", "peer_address", "nodes", "links", "events", "blas", "generated_at", "agreement", "memory", "http_url", "requests", "transitions", "tensor_parallel_groups", "tensor_parallel_runners", "lane_address", "downloads", "loop_crossings", "prefix_cache", "prediction_check", "speed_corrections")
    class LoopCrossingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MESH_NAME_FIELD_NUMBER: _ClassVar[int]
    MESH_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    BLAS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_AT_FIELD_NUMBER: _ClassVar[int]
    AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_RUNNERS_FIELD_NUMBER: _ClassVar[int]
    LANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DOWNLOADS_FIELD_NUMBER: _ClassVar[int]
    LOOP_CROSSINGS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_CHECK_FIELD_NUMBER: _ClassVar[int]
    SPEED_CORRECTIONS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    mesh_name: str
    mesh_fingerprint: str
    protocol_version: int
    peer_address: str
    nodes: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    links: _containers.RepeatedCompositeFieldContainer[LinkMeasurement]
    events: _containers.RepeatedScalarFieldContainer[str]
    blas: str
    generated_at: float
    agreement: AgreementStatus
    memory: RuntimeMemory
    http_url: str
    requests: _containers.RepeatedCompositeFieldContainer[RequestStatus]
    transitions: PlanTransitions
    tensor_parallel_groups: _containers.RepeatedCompositeFieldContainer[TensorParallelGroup]
    tensor_parallel_runners: _containers.RepeatedCompositeFieldContainer[TensorParallelRunner]
    lane_address: str
    downloads: _containers.RepeatedCompositeFieldContainer[Download]
    loop_crossings: _containers.ScalarMap[str, int]
    prefix_cache: _containers.RepeatedCompositeFieldContainer[PrefixCacheStatus]
    prediction_check: PredictionCheck
    speed_corrections: _containers.RepeatedCompositeFieldContainer[SpeedCorrection]
    def __init__(self, node_id: _Optional[str] = ..., mesh_name: _Optional[str] = ..., mesh_fingerprint: _Optional[str] = ..., protocol_version: _Optional[int] = ..., peer_address: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkMeasurement, _Mapping]]] = ..., events: _Optional[_Iterable[str]] = ..., blas: _Optional[str] = ..., generated_at: _Optional[float] = ..., agreement: _Optional[_Union[AgreementStatus, _Mapping]] = ..., memory: _Optional[_Union[RuntimeMemory, _Mapping]] = ..., http_url: _Optional[str] = ..., requests: _Optional[_Iterable[_Union[RequestStatus, _Mapping]]] = ..., transitions: _Optional[_Union[PlanTransitions, _Mapping]] = ..., tensor_parallel_groups: _Optional[_Iterable[_Union[TensorParallelGroup, _Mapping]]] = ..., tensor_parallel_runners: _Optional[_Iterable[_Union[TensorParallelRunner, _Mapping]]] = ..., lane_address: _Optional[str] = ..., downloads: _Optional[_Iterable[_Union[Download, _Mapping]]] = ..., loop_crossings: _Optional[_Mapping[str, int]] = ..., prefix_cache: _Optional[_Iterable[_Union[PrefixCacheStatus, _Mapping]]] = ..., prediction_check: _Optional[_Union[PredictionCheck, _Mapping]] = ..., speed_corrections: _Optional[_Iterable[_Union[SpeedCorrection, _Mapping]]] = ...) -> None: ...

class PredictedMeasured(_message.Message):
    __slots__ = ("predicted", "measured", "requests", "ratio")
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    predicted: float
    measured: float
    requests: int
    ratio: float
    def __init__(self, predicted: _Optional[float] = ..., measured: _Optional[float] = ..., requests: _Optional[int] = ..., ratio: _Optional[float] = ...) -> None: ...

class PredictionCheck(_message.Message):
    __slots__ = ("plan_id", "concurrency", "prompt_len", "decode_alone", "decode_concurrent", "prefill", "ttft", "requests")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_ALONE_FIELD_NUMBER: _ClassVar[int]
    DECODE_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TTFT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    concurrency: int
    prompt_len: int
    decode_alone: PredictedMeasured
    decode_concurrent: PredictedMeasured
    prefill: PredictedMeasured
    ttft: PredictedMeasured
    requests: int
    def __init__(self, plan_id: _Optional[str] = ..., concurrency: _Optional[int] = ..., prompt_len: _Optional[int] = ..., decode_alone: _Optional[_Union[PredictedMeasured, _Mapping]] = ..., decode_concurrent: _Optional[_Union[PredictedMeasured, _Mapping]] = ..., prefill: _Optional[_Union[PredictedMeasured, _Mapping]] = ..., ttft: _Optional[_Union[PredictedMeasured, _Mapping]] = ..., requests: _Optional[int] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("request_id", "plan_id", "prompt_tokens", "max_tokens", "started_at")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    plan_id: str
    prompt_tokens: int
    max_tokens: int
    started_at: float
    def __init__(self, request_id: _Optional[str] = ..., plan_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., started_at: _Optional[float] = ...) -> None: ...

class PlanTransitions(_message.Message):
    __slots__ = ("moving", "stage_loads", "layers_loaded", "layers_kept", "bytes_loaded", "last_install", "requests_resumed", "last_pause_s", "leaving", "requests_moved_in_background", "active_plan_loaded")
    MOVING_FIELD_NUMBER: _ClassVar[int]
    STAGE_LOADS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_LOADED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_KEPT_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    LAST_INSTALL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RESUMED_FIELD_NUMBER: _ClassVar[int]
    LAST_PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MOVED_IN_BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PLAN_LOADED_FIELD_NUMBER: _ClassVar[int]
    moving: str
    stage_loads: int
    layers_loaded: int
    layers_kept: int
    bytes_loaded: int
    last_install: str
    requests_resumed: int
    last_pause_s: float
    leaving: bool
    requests_moved_in_background: int
    active_plan_loaded: bool
    def __init__(self, moving: _Optional[str] = ..., stage_loads: _Optional[int] = ..., layers_loaded: _Optional[int] = ..., layers_kept: _Optional[int] = ..., bytes_loaded: _Optional[int] = ..., last_install: _Optional[str] = ..., requests_resumed: _Optional[int] = ..., last_pause_s: _Optional[float] = ..., leaving: _Optional[bool] = ..., requests_moved_in_background: _Optional[int] = ..., active_plan_loaded: _Optional[bool] = ...) -> None: ...

class TensorParallelGroup(_message.Message):
    __slots__ = ("stage", "members", "addresses", "backend", "link", "layer_start", "layer_end")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    stage: int
    members: _containers.RepeatedScalarFieldContainer[str]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    backend: str
    link: str
    layer_start: int
    layer_end: int
    def __init__(self, stage: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., addresses: _Optional[_Iterable[str]] = ..., backend: _Optional[str] = ..., link: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class TensorParallelRunner(_message.Message):
    __slots__ = ("plan_id", "stage", "rank", "size", "backend", "link", "state", "pid", "error", "held_bytes", "members")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    stage: int
    rank: int
    size: int
    backend: str
    link: str
    state: str
    pid: int
    error: str
    held_bytes: int
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, plan_id: _Optional[str] = ..., stage: _Optional[int] = ..., rank: _Optional[int] = ..., size: _Optional[int] = ..., backend: _Optional[str] = ..., link: _Optional[str] = ..., state: _Optional[str] = ..., pid: _Optional[int] = ..., error: _Optional[str] = ..., held_bytes: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefixCacheStatus(_message.Message):
    __slots__ = ("plan_id", "stage_index", "slots", "tokens", "budget_tokens", "lookups", "hits", "reused_tokens", "evicted")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    stage_index: int
    slots: int
    tokens: int
    budget_tokens: int
    lookups: int
    hits: int
    reused_tokens: int
    evicted: int
    def __init__(self, plan_id: _Optional[str] = ..., stage_index: _Optional[int] = ..., slots: _Optional[int] = ..., tokens: _Optional[int] = ..., budget_tokens: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., evicted: _Optional[int] = ...) -> None: ...

class RuntimeMemory(_message.Message):
    __slots__ = ("mlx_active", "mlx_peak", "rss", "peak_rss", "budget", "planned", "overhead", "overhead_now")
    MLX_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    MLX_PEAK_FIELD_NUMBER: _ClassVar[int]
    RSS_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_NOW_FIELD_NUMBER: _ClassVar[int]
    mlx_active: int
    mlx_peak: int
    rss: int
    peak_rss: int
    budget: int
    planned: int
    overhead: int
    overhead_now: int
    def __init__(self, mlx_active: _Optional[int] = ..., mlx_peak: _Optional[int] = ..., rss: _Optional[int] = ..., peak_rss: _Optional[int] = ..., budget: _Optional[int] = ..., planned: _Optional[int] = ..., overhead: _Optional[int] = ..., overhead_now: _Optional[int] = ...) -> None: ...

class AgreementStatus(_message.Message):
    __slots__ = ("model", "active_plan_id", "members", "confirmed_by", "committed_by", "draining", "proposal_plan_id", "refusal", "reason", "converged", "plan_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_BY_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CONVERGED_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    active_plan_id: str
    members: _containers.RepeatedScalarFieldContainer[str]
    confirmed_by: _containers.RepeatedScalarFieldContainer[str]
    committed_by: _containers.RepeatedScalarFieldContainer[str]
    draining: _containers.RepeatedScalarFieldContainer[str]
    proposal_plan_id: str
    refusal: str
    reason: str
    converged: bool
    plan_json: str
    def __init__(self, model: _Optional[str] = ..., active_plan_id: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., confirmed_by: _Optional[_Iterable[str]] = ..., committed_by: _Optional[_Iterable[str]] = ..., draining: _Optional[_Iterable[str]] = ..., proposal_plan_id: _Optional[str] = ..., refusal: _Optional[str] = ..., reason: _Optional[str] = ..., converged: _Optional[bool] = ..., plan_json: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("min_interval_s",)
    MIN_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    min_interval_s: float
    def __init__(self, min_interval_s: _Optional[float] = ...) -> None: ...

class TokenRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenReply(_message.Message):
    __slots__ = ("token", "mesh_name", "fingerprint")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MESH_NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    token: str
    mesh_name: str
    fingerprint: str
    def __init__(self, token: _Optional[str] = ..., mesh_name: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class RemeasureRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("message", "grace_s")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    message: str
    grace_s: float
    def __init__(self, message: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_tokens", "stop")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "sampling", "model", "plan_id", "chat_template", "return_logits", "no_prefix_cache")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    NO_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    sampling: Sampling
    model: str
    plan_id: str
    chat_template: bool
    return_logits: bool
    no_prefix_cache: bool
    def __init__(self, prompt: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., model: _Optional[str] = ..., plan_id: _Optional[str] = ..., chat_template: _Optional[bool] = ..., return_logits: _Optional[bool] = ..., no_prefix_cache: _Optional[bool] = ...) -> None: ...

class TokenLogits(_message.Message):
    __slots__ = ("token_id", "index", "logits")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    index: int
    logits: bytes
    def __init__(self, token_id: _Optional[int] = ..., index: _Optional[int] = ..., logits: _Optional[bytes] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("messages", "sampling", "model", "plan_id", "no_prefix_cache")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    NO_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: Sampling
    model: str
    plan_id: str
    no_prefix_cache: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., model: _Optional[str] = ..., plan_id: _Optional[str] = ..., no_prefix_cache: _Optional[bool] = ...) -> None: ...

class GenerationDone(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "ttft_s", "decode_tokens_per_s", "total_s", "plan_id", "model", "seed", "resumes", "paused_s", "transport_s_per_token", "cached_tokens")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    PAUSED_S_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    decode_tokens_per_s: float
    total_s: float
    plan_id: str
    model: str
    seed: int
    resumes: int
    paused_s: float
    transport_s_per_token: float
    cached_tokens: int
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., total_s: _Optional[float] = ..., plan_id: _Optional[str] = ..., model: _Optional[str] = ..., seed: _Optional[int] = ..., resumes: _Optional[int] = ..., paused_s: _Optional[float] = ..., transport_s_per_token: _Optional[float] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("text", "done", "token")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    text: str
    done: GenerationDone
    token: TokenLogits
    def __init__(self, text: _Optional[str] = ..., done: _Optional[_Union[GenerationDone, _Mapping]] = ..., token: _Optional[_Union[TokenLogits, _Mapping]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "size_bytes", "layers", "source", "path", "revision", "total_bytes", "partial")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    size_bytes: int
    layers: int
    source: str
    path: str
    revision: str
    total_bytes: int
    partial: bool
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., size_bytes: _Optional[int] = ..., layers: _Optional[int] = ..., source: _Optional[str] = ..., path: _Optional[str] = ..., revision: _Optional[str] = ..., total_bytes: _Optional[int] = ..., partial: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelList(_message.Message):
    __slots__ = ("models", "selected")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    selected: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., selected: _Optional[str] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("model", "strategy", "context_length", "concurrency", "parallelism")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    model: str
    strategy: str
    context_length: int
    concurrency: int
    parallelism: str
    def __init__(self, model: _Optional[str] = ..., strategy: _Optional[str] = ..., context_length: _Optional[int] = ..., concurrency: _Optional[int] = ..., parallelism: _Optional[str] = ...) -> None: ...

class LoadModelReply(_message.Message):
    __slots__ = ("model", "digest", "message")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    digest: str
    message: str
    def __init__(self, model: _Optional[str] = ..., digest: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
