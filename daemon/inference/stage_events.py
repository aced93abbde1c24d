"""The stage core's vocabulary: the events it is given, the actions it answers with.

Plain frozen values (no I/O, no MLX, no protobuf), shared by the pure core
(:mod:`meshd.inference.stage.core`), the runtime that carries its actions out
(:mod:`meshd.inference.stage.runtime`), the compute side (:mod:`meshd.inference.stage.engine`) and
the frame codec (:mod:`meshd.inference.transport.frames`). :func:`prefill_steps` is a request's step
schedule, mlx-lm's ``generate_step`` schedule, and :func:`request_steps` a resumed request's: the
same, then each generated token alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meshd.inference.sampling import SamplingParams


class FailureKind(enum.Enum):
    """Why a stage ends a request (the data plane's ``FailureKind`` on the wire)."""

    FENCED = enum.auto()  # the plan is not committed on this node
    NOT_LOADED = enum.auto()  # the plan is committed but its stage is not loaded yet
    OVERLOADED = enum.auto()  # the stage holds as many requests as it may
    UNREACHABLE = enum.auto()  # a node of the request could not be reached
    INTERNAL = enum.auto()  # the stage failed (to load, to compute, or the request went idle)
    BAD_REQUEST = enum.auto()  # the frame contradicts the plan (sender, order, contents)
    QUEUE_FULL = enum.auto()  # the plan's reserved KV memory is taken and its queue is full
    # A later stage holds no cached prefix the first stage chose to start from: the origin
    # runs the request again without the prefix cache.
    CACHE_MISS = enum.auto()


class Finish(enum.Enum):
    """Whether a sampled token ends its request."""

    NONE = enum.auto()
    EOS = enum.auto()  # the token is an end-of-sequence token
    LENGTH = enum.auto()  # the token is the max_tokens-th


# --- Events -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestStart:
    """What a Start says about a request (and what the first Activation forwards of it)."""

    origin: str
    prompt: tuple[int, ...]  # empty at stages that need neither the tokens nor their penalty
    prompt_length: int
    sampling: SamplingParams | None  # None when the frame's settings are invalid (see invalid)
    eos_ids: frozenset[int]
    prefill_chunk: int
    return_logits: bool = False
    generated: tuple[int, ...] = ()  # a resumed request: tokens generated before, in order
    # A background move: the origin feeds the first stage the tokens an older attempt of the
    # request delivers meanwhile (Tokens from the origin, see StageCore.on_token).
    catch_up: bool = False
    invalid: str | None = None  # why the frame's settings cannot be served
    # The prefix cache (:mod:`meshd.inference.stage.prefix`): whether the request may start
    # from a kept prefix and leave its own (a client may opt out), and, as the first stage
    # forwards the Start, the positions it kept and their digest, which every stage keeps too.
    prefix_cache: bool = True
    reuse: int = 0
    reuse_digest: bytes = b""

    @property
    def context_length(self) -> int:
        return self.prompt_length + len(self.generated)


@dataclass(frozen=True, slots=True)
class StartFrame:
    sender: str
    plan_id: str
    request_id: str
    start: RequestStart


@dataclass(frozen=True, slots=True)
class ActivationFrame:
    sender: str
    plan_id: str
    request_id: str
    step: int
    payload: object  # the hidden states, opaque here (decoded on the compute thread)
    upstream_s: float  # compute time of this step on the stages before
    start: RequestStart | None = None  # on the request's first Activation (step 0) only
    rollback: int = 0  # positions of the step before to drop first (rejected drafts)
    drafts: tuple[int, ...] = ()  # tokens drafted after the step's first (speculative step)
    tokens: tuple[int, ...] = ()  # the token ids of the step's positions (the prefix cache's)


@dataclass(frozen=True, slots=True)
class TokenFrame:
    sender: str
    plan_id: str
    request_id: str
    token_id: int
    index: int
    finish: Finish


@dataclass(frozen=True, slots=True)
class EndFrame:
    sender: str
    plan_id: str
    request_id: str


@dataclass(frozen=True, slots=True)
class SamplerSetup:
    """What the last stage's sampler of a request starts from (its first sampling step)."""

    sampling: SamplingParams
    context: tuple[int, ...]  # prompt + generated: the repetition penalty's window reads it
    draws: int  # random draws the request made before (a resumed request continues its RNG)
    return_logits: bool
    # A single stage that drafts (speculative decoding): it keeps the prompt and the answer
    # so far to look the drafts up in, and counts the tokens against max_tokens.
    draft: bool = False
    generated: int = 0  # tokens the request generated before (a resumed request)
    # The request's end-of-sequence tokens: what a grammar allows once complete (structured
    # outputs), so that the request ends there.
    eos_ids: frozenset[int] = frozenset()

    @property
    def generated_tokens(self) -> tuple[int, ...]:
        """The tokens the request generated before (the end of the context)."""
        return self.context[len(self.context) - self.generated :]


@dataclass(frozen=True, slots=True)
class SlotUse:
    """How a request starts from a kept prefix (:mod:`meshd.inference.stage.prefix`): the
    positions it keeps of slot ``slot``, and whether it takes the slot's caches (``take``:
    the slot leaves the cache) or copies them (the slot stays)."""

    slot: int
    length: int
    take: bool


@dataclass(frozen=True, slots=True)
class Work:
    """One step of one request on this stage: what the compute thread runs."""

    plan_id: str
    request_id: str
    step: int
    tokens: tuple[int, ...] | None  # the first stage's input
    payload: object  # a later stage's input: the previous stage's hidden states
    head: bool  # the last stage applies the head and samples (steps >= C)
    sampler: SamplerSetup | None  # the last stage's first sampling step of the request
    upstream_s: float
    follows: bool = False  # a single stage: the input is the token its step before sampled
    stop_ids: frozenset[int] = frozenset()  # ...and that token ended the request if in here
    rollback: int = 0  # positions of the step before to drop from the caches first
    drafts: tuple[int, ...] = ()  # a speculative step: the drafted tokens it also runs
    draft_limit: int = 0  # a single stage's following step: draft up to this many itself
    # The node the step's hidden states go to, where the core knows it when it hands the
    # step out (a decode step of a stage before the last): the compute thread sends them
    # itself. None: the loop sends what the step gives.
    forward_to: str | None = None
    # A last stage's decode step whose token, unless it ends the request, goes on to the
    # first stage (another node): the compute thread sends it itself. None: the loop does.
    token_to: TokenRoute | None = None
    slot_use: SlotUse | None = None  # a request's first step here: the kept prefix it starts on
    positions: tuple[int, ...] = ()  # the token ids of the positions the step adds
    # A first stage's decode step: the micro-batch cohort it runs in (one pass a cohort,
    # :mod:`meshd.inference.stage.cohorts`). None: batched with the other ready rows.
    cohort: int | None = None


@dataclass(frozen=True, slots=True)
class TokenRoute:
    """Where a last stage's compute thread sends the token a step samples, and when not: the
    token is the request's ``index``-th; one in ``stop_ids`` or the ``max_tokens``-th ends the
    request, and the loop sends that one (with its finish) as it sends every final token."""

    node: str
    index: int
    max_tokens: int
    stop_ids: frozenset[int]
    cached: int = 0  # the attempt's first token: the context positions its stages reused

    def carries(self, token_id: int) -> bool:
        """Whether the compute thread sends ``token_id`` (it does not end the request)."""
        return token_id not in self.stop_ids and self.index + 1 < self.max_tokens


@dataclass(frozen=True, slots=True)
class Hidden:
    """A step's hidden states, for the next stage."""

    payload: object
    compute_s: float  # this step's compute time on this stage and the stages before


@dataclass(frozen=True, slots=True)
class Advanced:
    """The last stage ran a prompt chunk: its caches advanced, nothing to send."""

    compute_s: float


@dataclass(frozen=True, slots=True)
class Sampled:
    token_id: int
    logits: bytes  # float32 row, only when the request asked for it (debug), else b""
    compute_s: float


@dataclass(frozen=True, slots=True)
class Verified:
    """The last stage ran a speculative step: the tokens it gives, in order: the drafts it
    accepted (each the token it would have sampled there), then its own next token."""

    tokens: tuple[int, ...]
    compute_s: float


@dataclass(frozen=True, slots=True)
class Skipped:
    """A following step that did not run: the token before it ended the request."""


@dataclass(frozen=True, slots=True)
class ComputeFailed:
    kind: FailureKind
    reason: str


StepResult = Hidden | Advanced | Sampled | Verified | Skipped | ComputeFailed


# --- Actions ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendActivation:
    to: str
    plan_id: str
    request_id: str
    step: int
    payload: object
    compute_s: float
    start: RequestStart | None  # step 0 only


@dataclass(frozen=True, slots=True)
class SendToken:
    to: tuple[str, ...]  # the origin, then the first stage when it is another node
    plan_id: str
    request_id: str
    token_id: int
    index: int
    finish: Finish
    compute_s: float
    logits: bytes
    cached: int = 0  # an attempt's first token: the context positions its stages reused


@dataclass(frozen=True, slots=True)
class SendFailure:
    to: str  # the request's origin (or the sender of a frame that names no known origin)
    plan_id: str
    request_id: str
    kind: FailureKind
    message: str


@dataclass(frozen=True, slots=True)
class Release:
    """Free the request's KV caches and sampler (on the compute thread, after its steps)."""

    plan_id: str
    request_id: str
    keep_as: int | None = None  # keep the caches as this prefix slot instead of freeing them
    positions: int = 0  # ...which then hold this many positions (else they are not kept)
    keep: int = 0  # ...cut to their first ``keep`` positions (fewer than ``positions``)


@dataclass(frozen=True, slots=True)
class DropSlots:
    """Free kept prefixes of the plan's stage (on the compute thread, after queued steps)."""

    plan_id: str
    slot_ids: tuple[int, ...]


Action = SendActivation | SendToken | SendFailure | Release | DropSlots


def prefill_steps(context_length: int, chunk: int) -> tuple[int, ...]:
    """Tokens per prompt step: ``context[:-1]`` in chunks of ``chunk``, then the last token
    alone (mlx-lm's ``generate_step`` schedule; the last step gives the first token)."""
    if context_length < 1 or chunk < 1:
        raise ValueError(f"need a context and a chunk of at least 1, got {context_length}, {chunk}")
    head = context_length - 1
    return (*(min(chunk, head - start) for start in range(0, head, chunk)), 1)


def request_steps(
    prompt_length: int, generated: int, chunk: int, reuse: int = 0
) -> tuple[int, ...]:
    """Tokens per context step of a request that already generated ``generated`` tokens: the
    prompt as :func:`prefill_steps` cuts it, then each generated token alone, as the request
    computed them the first time. Every cache then holds exactly the bits an uninterrupted
    run computed (a chunked replay would change the matmul shapes, and with them the
    rounding); the last step is the last generated token's, which samples the next one.
    ``reuse``: context positions the stages' caches hold already (a kept prefix): the steps
    cover only the positions after them."""
    if generated < 0:
        raise ValueError(f"a request cannot have generated {generated} tokens")
    context = prompt_length + generated
    if not 0 <= reuse < context:
        raise ValueError(f"a request of {context} context tokens cannot reuse {reuse} of them")
    if reuse < prompt_length:
        return prefill_steps(prompt_length - reuse, chunk) + (1,) * generated
    return (1,) * (context - reuse)
