"""What a stage remembers of the plans it holds and their requests
(:mod:`meshd.inference.stage.core`): a request's inputs and the step it expects, the steps
it has handed out; a plan's position in the pipeline, its requests and its queue.

Pure records, as the core that keeps them: no I/O, no clock, no MLX, asyncio or gRPC. The
steps of a request follow the schedule the core's docstring describes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from meshd.inference.assignment import Assignment
from meshd.inference.sampling import SamplingParams
from meshd.inference.stage.admission import StartQueue
from meshd.inference.stage.drafting import DraftIndex
from meshd.inference.stage.prefix import PrefixIndex
from meshd.inference.stage_events import RequestStart, SamplerSetup, SlotUse, TokenRoute, Work


@dataclass(slots=True)
class StepInput:
    """The input of one step of a request, as it arrived (tokens, or the previous stage's
    hidden states)."""

    step: int
    tokens: tuple[int, ...] | None = None
    payload: object = None
    upstream_s: float = 0.0
    follows: bool = False  # a single stage's next step: its input is the token sampled before
    rollback: int = 0  # positions of the step before to drop first (rejected drafts)
    drafts: tuple[int, ...] = ()  # drafted tokens the step runs after its first (speculative)
    positions: tuple[int, ...] = ()  # the token ids of the positions the step adds


@dataclass(eq=False, slots=True)
class StageRequest:
    """One request open on this stage: where its steps stand and what waits to run."""

    plan_id: str
    request_id: str
    origin: str
    start: RequestStart
    sampling: SamplingParams  # the Start's, validated
    chunk_steps: int  # C: prompt chunks before the step that samples
    last_activity: float
    opened_at: float = 0.0  # when this stage opened it (a loss told later may predate it)
    next_step: int = 0  # the step whose input this stage expects next
    next_index: int = 0  # the index of the next generated token (sampled here / expected)
    inputs: deque[StepInput] = field(default_factory=deque)
    sampler_opened: bool = False
    heads_out: int = 0  # steps handed out that sample a token
    in_flight: int = 0  # steps on the compute thread (2 only for a following step)
    queued: bool = False
    ended: bool = False
    reserved: int = 0  # KV tokens reserved at admission (first stage of a bounded plan)
    # First stage of a plan that drafts: the prompt and the tokens generated so far (what the
    # drafts are looked up in), the drafts of the step in flight and how many came back
    # accepted (the tokens that equal them, in order, arrive before the next input).
    history: DraftIndex | None = None
    drafts: tuple[int, ...] = ()
    accepted: int = 0
    # The prefix cache: the token ids of the positions this stage's caches hold for the
    # request once its handed-out steps ran (None: not known, so they are not kept when it
    # ends), and the kept prefix its first step starts from.
    cached: list[int] | None = None
    slot_use: SlotUse | None = None
    # The first stage of several: positions every stage has computed (a token from the last
    # stage proves the step before it ran everywhere). It keeps no more of a request that
    # ends early, so that every later stage holds at least what it keeps.
    confirmed: int = 0
    # The first stage of several: the micro-batch cohort its decode steps run in, since when
    # its ready step waits for the cohort, and whether its last token came (no step follows).
    cohort: int | None = None
    waiting_since: float | None = None
    decoded_all: bool = False

    def can_run(self) -> bool:
        """A request's next step may start: its input is here, and its step before has
        finished, or is the one whose token this step follows (a single stage)."""
        if self.ended or not self.inputs:
            return False
        return self.in_flight == 0 or (self.in_flight == 1 and self.inputs[0].follows)

    def work(self, plan: StagePlan, item: StepInput) -> Work:
        """Hand out the step of ``item`` to the compute thread (on ``plan``'s stage here)."""
        head = plan.is_last and item.step >= self.chunk_steps
        if head and plan.is_first:
            # A single stage samples the next step's input itself: the step that follows is
            # ready now and waits right behind this one on the compute thread (as mlx-lm's
            # generate_step computes one token ahead), unless this one gives the last token.
            index = len(self.start.generated) + self.heads_out
            if index + 1 < self.sampling.max_tokens:
                self.inputs.append(StepInput(item.step + 1, follows=True))
        self.heads_out += head
        # A single stage drafts on its compute thread, where the token its step follows is.
        drafting = plan.draft_tokens > 0 and plan.is_last and self.drafts_allowed()
        sampler = None
        if head and not self.sampler_opened:
            self.sampler_opened = True
            start = self.start
            sampler = SamplerSetup(
                sampling=self.sampling,
                context=start.prompt + start.generated,
                draws=0 if self.sampling.greedy else len(start.generated),
                return_logits=start.return_logits,
                draft=drafting,
                generated=len(start.generated),
                eos_ids=start.eos_ids,
            )
        slot_use, self.slot_use = self.slot_use, None
        return Work(
            plan.plan_id,
            self.request_id,
            item.step,
            item.tokens,
            item.payload,
            head,
            sampler,
            item.upstream_s,
            item.follows,
            self.start.eos_ids if item.follows else frozenset(),
            item.rollback,
            item.drafts,
            plan.draft_tokens if drafting and item.follows and plan.one_request_alone else 0,
            self.forward_to(plan, item),
            self.token_to(plan, item, head),
            slot_use,
            item.positions or (item.tokens or ()),
        )

    def forward_to(self, plan: StagePlan, item: StepInput) -> str | None:
        """The node a decode step's hidden states go to (``Work.forward_to``): the next
        stage, for a stage before the last. Prompt chunks go through the loop (step 0 carries
        the Start on, and a chunk must not overtake the one before it), and so do speculative
        steps (the stage runtime keeps a request's frames in order, see ``StageRuntime.
        _lanes_for``)."""
        if plan.is_last or item.step < self.chunk_steps or item.drafts or item.rollback:
            return None
        if item.step == 0:
            return None  # it carries the Start on (a context of one step: a kept prefix)
        assert plan.index is not None
        return plan.node(plan.index + 1)

    def token_to(self, plan: StagePlan, item: StepInput, head: bool) -> TokenRoute | None:
        """Where a last stage's decode step sends its token from the compute thread
        (``Work.token_to``): to the first stage, when that is another node, for a step that
        samples one token (not a speculative one) of a request that asked for no logits. The
        step's token is the request's next: a last stage of several has one step of a
        request out at a time."""
        if not head or plan.is_first or item.drafts or item.rollback or self.start.return_logits:
            return None
        first = self.next_index == len(self.start.generated)
        return TokenRoute(
            plan.node(0),
            self.next_index,
            self.sampling.max_tokens,
            self.start.eos_ids,
            self.start.reuse if first else 0,
        )

    def drafts_allowed(self) -> bool:
        """Whether the first stage may draft for this request: greedy sampling without a
        repetition penalty (a draft is accepted when it is the token greedy decoding gives), no
        logits asked for, not a request catching up with an older attempt of itself, and
        not one held to a grammar (a draft would have to be checked against its mask)."""
        sampling, start = self.sampling, self.start
        return (
            sampling.greedy
            and sampling.constraint is None
            and sampling.repetition_penalty == 1.0
            and not start.return_logits
            and not start.catch_up
        )

    def forward_start(self) -> RequestStart:
        """What the next stage gets of the Start: the tokens only where the last stage's
        repetition penalty needs them (the kept prefix travels as its length and digest)."""
        start = self.start
        if self.sampling.repetition_penalty != 1.0:
            return start
        return RequestStart(
            origin=start.origin,
            prompt=(),
            prompt_length=start.prompt_length,
            sampling=start.sampling,
            eos_ids=start.eos_ids,
            prefill_chunk=start.prefill_chunk,
            return_logits=start.return_logits,
            generated=start.generated,
            prefix_cache=start.prefix_cache,
            reuse=start.reuse,
            reuse_digest=start.reuse_digest,
        )

    def track(self, work: Work) -> None:
        """A step of the request is handed out: its positions will be in the caches (what a
        slot of this request holds; the compute thread frees or keeps the caches after its
        queued steps). A single stage's following step runs on the token its step before
        samples: that one is added when it is sampled. A speculative step's positions are
        not followed: such a request is not kept."""
        if self.cached is None:
            return
        if work.rollback or work.drafts or work.draft_limit:
            self.cached = None
        elif not work.follows:
            self.cached.extend(work.positions)


@dataclass(eq=False, slots=True)
class StagePlan:
    """This node's stage of one installed plan (``index`` None: the plan holds none here)."""

    assignment: Assignment
    index: int | None
    queue: StartQueue  # the Starts not admitted yet and the KV tokens reserved (first stage)
    ready: bool = False
    requests: dict[str, StageRequest] = field(default_factory=dict)
    vocab_size: int = 0  # the model's token ids are 0 <= id < vocab_size (0: unknown)
    draft_tokens: int = 0  # first stage: tokens it may draft per step (0: no speculation)
    prefix: PrefixIndex | None = None  # the kept prefixes of this stage's layers (None: off)
    prefix_key: tuple[object, ...] = ()  # what identifies those layers (plans share its slots)
    batches: bool = False  # the stage runs several requests' decode steps in one pass

    @property
    def kv_tokens(self) -> int | None:
        """KV tokens the plan reserves on this stage, for running requests and kept
        prefixes together (None: no bound)."""
        assignment = self.assignment
        if not assignment.kv_budget_tokens:
            return None
        return assignment.kv_budget_tokens + assignment.context_length * assignment.cache_sequences

    @property
    def plan_id(self) -> str:
        return self.assignment.plan_id

    @property
    def one_request_alone(self) -> bool:
        """One request open and none waiting: only then do its steps get drafts (several
        requests decode batched, which fills the pipeline better)."""
        return len(self.requests) == 1 and not self.queue.waiting

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == len(self.assignment.stages) - 1

    def node(self, index: int) -> str:
        return self.assignment.stages[index].node_id
