from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_NONE: _ClassVar[FinishReason]
    FINISH_EOS: _ClassVar[FinishReason]
    FINISH_LENGTH: _ClassVar[FinishReason]

class FailureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_UNSPECIFIED: _ClassVar[FailureKind]
    FAILURE_FENCED: _ClassVar[FailureKind]
    FAILURE_NOT_LOADED: _ClassVar[FailureKind]
    FAILURE_OVERLOADED: _ClassVar[FailureKind]
    FAILURE_UNREACHABLE: _ClassVar[FailureKind]
    FAILURE_INTERNAL: _ClassVar[FailureKind]
    FAILURE_BAD_REQUEST: _ClassVar[FailureKind]
    FAILURE_QUEUE_FULL: _ClassVar[FailureKind]
    FAILURE_CACHE_MISS: _ClassVar[FailureKind]
FINISH_NONE: FinishReason
FINISH_EOS: FinishReason
FINISH_LENGTH: FinishReason
FAILURE_UNSPECIFIED: FailureKind
FAILURE_FENCED: FailureKind
FAILURE_NOT_LOADED: FailureKind
FAILURE_OVERLOADED: FailureKind
FAILURE_UNREACHABLE: FailureKind
FAILURE_INTERNAL: FailureKind
FAILURE_BAD_REQUEST: FailureKind
FAILURE_QUEUE_FULL: FailureKind
FAILURE_CACHE_MISS: FailureKind

class Frame(_message.Message):
    __slots__ = ("plan_id", "request_id", "hello", "start", "activation", "token", "end", "failure", "bundle")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    request_id: str
    hello: Hello
    start: Start
    activation: Activation
    token: Token
    end: End
    failure: Failure
    bundle: Bundle
    def __init__(self, plan_id: _Optional[str] = ..., request_id: _Optional[str] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., start: _Optional[_Union[Start, _Mapping]] = ..., activation: _Optional[_Union[Activation, _Mapping]] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., end: _Optional[_Union[End, _Mapping]] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ..., bundle: _Optional[_Union[Bundle, _Mapping]] = ...) -> None: ...

class Bundle(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[Frame]
    def __init__(self, frames: _Optional[_Iterable[_Union[Frame, _Mapping]]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node_id", "lane_port", "resume", "frames_received")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_PORT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    FRAMES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lane_port: int
    resume: bool
    frames_received: int
    def __init__(self, node_id: _Optional[str] = ..., lane_port: _Optional[int] = ..., resume: _Optional[bool] = ..., frames_received: _Optional[int] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_tokens", "constraint")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int
    max_tokens: int
    constraint: Constraint
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "grammar")
    KIND_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    kind: str
    grammar: str
    def __init__(self, kind: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class Start(_message.Message):
    __slots__ = ("origin_node_id", "prompt_tokens", "prompt_length", "sampling", "eos_token_ids", "prefill_chunk", "return_logits", "generated_tokens", "catch_up", "no_prefix_cache", "reuse_positions", "reuse_digest")
    ORIGIN_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_FIELD_NUMBER: _ClassVar[int]
    NO_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    REUSE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    REUSE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    origin_node_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    sampling: Sampling
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_chunk: int
    return_logits: bool
    generated_tokens: _containers.RepeatedScalarFieldContainer[int]
    catch_up: bool
    no_prefix_cache: bool
    reuse_positions: int
    reuse_digest: bytes
    def __init__(self, origin_node_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., prefill_chunk: _Optional[int] = ..., return_logits: _Optional[bool] = ..., generated_tokens: _Optional[_Iterable[int]] = ..., catch_up: _Optional[bool] = ..., no_prefix_cache: _Optional[bool] = ..., reuse_positions: _Optional[int] = ..., reuse_digest: _Optional[bytes] = ...) -> None: ...

class Activation(_message.Message):
    __slots__ = ("start", "step", "dtype", "shape", "data", "compute_s", "rollback", "draft_tokens", "tokens")
    START_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    start: Start
    step: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    compute_s: float
    rollback: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[_Union[Start, _Mapping]] = ..., step: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., compute_s: _Optional[float] = ..., rollback: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("token_id", "index", "finish", "compute_s", "logits", "cached_positions")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    CACHED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    index: int
    finish: FinishReason
    compute_s: float
    logits: bytes
    cached_positions: int
    def __init__(self, token_id: _Optional[int] = ..., index: _Optional[int] = ..., finish: _Optional[_Union[FinishReason, str]] = ..., compute_s: _Optional[float] = ..., logits: _Optional[bytes] = ..., cached_positions: _Optional[int] = ...) -> None: ...

class End(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("kind", "node_id", "message")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    kind: FailureKind
    node_id: str
    message: str
    def __init__(self, kind: _Optional[_Union[FailureKind, str]] = ..., node_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlanStats(_message.Message):
    __slots__ = ("plan_id", "stage_index", "layer_start", "layer_end", "weight_bytes", "open_requests", "origin_requests", "batched_rows", "queued_requests", "reserved_tokens", "budget_tokens", "queue_limit", "batched_steps", "drafted_tokens", "accepted_tokens")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPEN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BATCHED_ROWS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    BATCHED_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    stage_index: int
    layer_start: int
    layer_end: int
    weight_bytes: int
    open_requests: int
    origin_requests: int
    batched_rows: int
    queued_requests: int
    reserved_tokens: int
    budget_tokens: int
    queue_limit: int
    batched_steps: int
    drafted_tokens: int
    accepted_tokens: int
    def __init__(self, plan_id: _Optional[str] = ..., stage_index: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., open_requests: _Optional[int] = ..., origin_requests: _Optional[int] = ..., batched_rows: _Optional[int] = ..., queued_requests: _Optional[int] = ..., reserved_tokens: _Optional[int] = ..., budget_tokens: _Optional[int] = ..., queue_limit: _Optional[int] = ..., batched_steps: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("node_id", "plans", "rss_bytes", "peak_rss_bytes", "frames_received", "frames_sent")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_SENT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plans: _containers.RepeatedCompositeFieldContainer[PlanStats]
    rss_bytes: int
    peak_rss_bytes: int
    frames_received: int
    frames_sent: int
    def __init__(self, node_id: _Optional[str] = ..., plans: _Optional[_Iterable[_Union[PlanStats, _Mapping]]] = ..., rss_bytes: _Optional[int] = ..., peak_rss_bytes: _Optional[int] = ..., frames_received: _Optional[int] = ..., frames_sent: _Optional[int] = ...) -> None: ...
