"""The cost model: predicted memory and time of a stage, a hop and a whole plan.

A plan is only as good as the model it optimises, so here it is in full.

Memory of one node in a stage holding layers [a, b) (all sizes exact integers):
- weights: the bytes of those layers as stored in the weight files (quantized sizes are the
  real ones; a mixture-of-experts layer holds every expert), + the embedding table on the first
  stage, + final norm and lm_head on the last stage; with tied embeddings the last stage also
  holds the embedding table (once, when the same node is first and last).
- KV cache and state, per layer kind (partitioner.model): full attention reserves
  kv bytes/token x context, sliding-window attention at most its window, linear attention a
  constant recurrent state, MLA one compressed latent per token; times `concurrency`, reserved
  up front for the whole context (out-of-memory half way through a long chat is the failure
  users report most).
- activations, a stated bound: prefill_chunk x (4 x hidden + 3 x intermediate) x
  activation_bytes (hidden state, residual, q/k/v and attention output; gate, up and their
  product), + on the last stage the logits of a prefill chunk: prefill_chunk x vocab x
  activation_bytes (mlx-lm computes logits for every position of a chunk). Attention scores
  are not counted: MLX's fused scaled_dot_product_attention does not materialise them.
- overhead: 5 % of the above + 64 MiB (allocator slack, buffers for messages in flight).
A node's usable budget is its memory_budget minus PlanOptions.reserve_bytes.

A tensor-parallel group of g members (mlx-lm's `shard(group)`): each member holds 1/g of the
attention and dense weights, all of the replicated parts (routers, norms, MLA down-projections),
and its share of the routed experts: `Unit.expert_counts` experts of `num_experts`, by default
in proportion to the members' usable memory (equal members: an even split, which is what
mlx-lm's in-place expert sharding gives); the final plan re-places them by speed within
memory (partitioner.experts). KV cache is split by heads, except MLA's latent, which every
member keeps whole. Embedding, head and activations are held whole by every member.

Decode time of a stage per token (one sequence): max(bytes read / memory bandwidth,
FLOPs / compute), + layers x the node's `layer_overhead_s` (fixed time per layer and step that
does not shrink with the bytes: kernel launches and synchronisation; 0 unless the node reports
it: on Apple silicon it is absorbed in the calibrated bandwidth, on a GPU it is what bounds a
small-active-parameter MoE, whose roofline alone would predict over 1,000 tokens/s).
Bytes read are what a token touches: shared weights plus the active experts
(`layer_active_bytes`: num_experts_per_tok of num_experts routed experts, plus shared experts),
+ the head matrix on the last stage; FLOPs = 2 x the active logical weights (+ 2 x vocab x
hidden for the head). The KV cache read is not counted: it grows with the position in the
context, and the prediction is for a short context (at position p each full-attention layer
also reads p x its kv bytes per token). A tensor-parallel member reads its share: replicated
parts whole, dense parts / g, active experts x its expert share (the expected value when the
router spreads tokens evenly); the group runs at its slowest member, plus per layer two
all-reduces of one token's hidden state (after attention and after the MLP / MoE), each
costing one collective overhead (the slowest member's `collective_overhead_s`: the device
synchronisation around a collective, DEFAULT_COLLECTIVE_OVERHEAD_S when not measured) plus a
ring of 2(g-1) steps over the group's slowest link (latency + hidden bytes / (g x bandwidth)),
and one broadcast of the stage's input. On decode these are latency-bound: 94 layers x 2
all-reduces over TCP (~300 us a step) cost more than the weights they save reading.

Hops: stage i sends one token's hidden state to stage i+1: latency + hidden x activation_bytes
/ bandwidth along its route (see partitioner.mesh). The last stage samples and sends the token
id (TOKEN_BYTES) back to the first stage: that ring hop is counted too.

Per-token decode time of one sequence alone = sum of stage times + all hops (a pipeline runs its
stages one after the other for one sequence).

With `concurrency` = C sequences in flight, the stages batch their decode steps the way the
daemon's engine does: the first stage cuts the C rows into m = micro_batches(S, C) micro-batches
(one per stage, S stages, but none of fewer than MIN_MICRO_BATCH_ROWS rows; below that one
batch), each of r = ceil(C / m) rows. A stage's step of r rows costs max(bytes read / bandwidth,
r x FLOPs / compute): its weights are read once for all rows, so on memory-bound decode a batch
costs little more than one row. A tensor-parallel group does not batch (its runners keep one
cache per request, so the daemon steps them request by request): its step of r rows costs r
steps of one. A mixture-of-experts layer reads the routed experts its r tokens
touch together: of E experts with k per token, E x (1 - (1 - k/E)^r) on average. Hops carry r
hidden states (and r token ids back). A micro-batch goes round the ring in sum of step times +
hops, and m of them take turns at the slowest stage, so the time between two tokens of one
sequence is max(round, m x slowest step); aggregate tokens/s = C / that. The `speed` strategy
minimises this time per token (for C = 1 simply the decode time).

Rows a node measured: on a CPU a decode step of r rows costs far more than the roofline says
(SmolLM2 float32 on one core: 16 rows ~2.3x one row where max(bytes / bandwidth, r x FLOPs /
compute) with the profile's large-matrix FLOP/s gives 1.0x): small-row matrix products,
attention over each row's cache and per-row work do not overlap the weight reads. A node that
measured this from its own steps reports `row_flops` (meshd.mesh.speed_correction); its step
of r rows then costs the roofline plus (r - 1) x FLOPs / row_flops. Nodes that do not report
it (and prefill) keep the roofline alone.

Time to first token for a prompt of P tokens = sum over stages of max(weight bytes / bandwidth,
P x FLOPs / compute) + hops carrying P hidden states (the quadratic attention term is left out);
the head's FLOPs count once, for the last position (the stages compute no other logits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from partitioner.model import ModelSpec
from partitioner.options import PlanOptions

MIB = 1024 * 1024
OVERHEAD_PERCENT = 5
OVERHEAD_FIXED_BYTES = 64 * MIB
TOKEN_BYTES = 8
# The first stage cuts a decode batch into one micro-batch per stage only where each gets at
# least this many rows (the daemon's engine follows micro_batches() below): a decode step of a
# few rows is memory-bound, so cutting a small batch reads every weight once per micro-batch
# and multiplies the frames per step without making a step shorter.
MIN_MICRO_BATCH_ROWS = 8
HIDDEN_BUFFERS = 4
INTERMEDIATE_BUFFERS = 3
ALL_REDUCES_PER_LAYER = 2
# Device synchronisation around one collective when a node does not report its own: MLX must
# finish the queued kernels before an all_sum and resume after it. 60 us is what exo's published
# 4 x M3 Ultra runs imply for MLX + JACCL (docs/models.md, "Predictions against published figures").
DEFAULT_COLLECTIVE_OVERHEAD_S = 60e-6


def micro_batches(stages: int, rows: int) -> int:
    """How many micro-batches the first stage cuts a decode batch of ``rows`` into: one per
    stage, so each stage has one to compute while the others compute theirs, but none of fewer
    than MIN_MICRO_BATCH_ROWS rows. Measured with two pinned daemons (SmolLM2 float32 on CPU,
    19/11 layers): 4 requests ran 2.8x one request's throughput as one batch and 2.4x as two
    micro-batches of 2. Since the first stage keeps each micro-batch a cohort
    (meshd.inference.stage.cohorts), 16 requests run 8.4-10.1x one request's throughput as two
    micro-batches of 8 (docs/performance.md, "Micro-batch cohorts")."""
    return max(1, min(stages, rows // MIN_MICRO_BATCH_ROWS))


@dataclass(frozen=True)
class Unit:
    """What one pipeline stage runs on: one node, or a tensor-parallel group of nodes.

    usable_bytes: the node's usable budget; for a group the sum of its members'.
    flops / mem_bandwidth: the node's; for a group those of its slowest member (for ranking).
    link_latency_s / link_bandwidth: the group's worst internal link (unused for one node).
    member_usable / member_flops / member_bandwidth: per member, in `nodes` order (filled in
        for one node).
    expert_counts: routed experts each member holds (they sum to the model's num_experts;
        empty for one node, which holds them all).
    collective_overhead_s: the slowest member's cost of one collective (groups only).
    layer_overhead_s: fixed seconds per layer and step (the slowest member's for a group).
    row_flops: FLOP/s of each row a batched decode step adds beyond the first (one node only;
        inf when the node does not report it: see CostModel.stage_step_s).
    """

    nodes: tuple[str, ...]
    usable_bytes: int
    flops: float
    mem_bandwidth: float
    link_latency_s: float = 0.0
    link_bandwidth: float = math.inf
    member_usable: tuple[int, ...] = ()
    member_flops: tuple[float, ...] = ()
    member_bandwidth: tuple[float, ...] = ()
    expert_counts: tuple[int, ...] = ()
    collective_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    row_flops: float = math.inf
    degree: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "degree", len(self.nodes))  # read in every inner loop
        if not self.member_usable:
            if len(self.nodes) != 1:
                raise ValueError("a group unit needs its members' usable memory and speeds")
            object.__setattr__(self, "member_usable", (self.usable_bytes,))
            object.__setattr__(self, "member_flops", (self.flops,))
            object.__setattr__(self, "member_bandwidth", (self.mem_bandwidth,))

    @property
    def leader(self) -> str:
        """The member that receives and sends the stage's activations."""
        return self.nodes[0]

    @property
    def total_bandwidth(self) -> float:
        return sum(self.member_bandwidth)

    @property
    def total_flops(self) -> float:
        return sum(self.member_flops)

    def with_experts(self, counts: Sequence[int]) -> Unit:
        """The same group with another expert placement."""
        return Unit(
            self.nodes,
            self.usable_bytes,
            self.flops,
            self.mem_bandwidth,
            self.link_latency_s,
            self.link_bandwidth,
            self.member_usable,
            self.member_flops,
            self.member_bandwidth,
            tuple(counts),
            self.collective_overhead_s,
            self.layer_overhead_s,
        )


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted peak memory of one node, in bytes."""

    weights: int
    kv_cache: int
    activations: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.overhead


class CostModel:
    """Memory and time of stages for one model under one set of options (prefix sums inside)."""

    def __init__(self, model: ModelSpec, options: PlanOptions) -> None:
        self.model = model
        self.num_layers = model.num_layers
        self.context_length = options.context_length or model.context_length
        self.concurrency = options.concurrency
        self.cache_sequences = options.cache_sequences
        self.prompt_len = options.prompt_len
        self.num_experts = model.num_experts
        self._expert_fraction = (
            model.num_experts_per_tok / model.num_experts
            if model.num_experts and model.num_experts_per_tok
            else 0.0
        )
        layers = range(model.num_layers)
        shared = [model.layer_bytes[i] - model.layer_expert_bytes[i] for i in layers]
        active_experts = [max(0, model.layer_active_bytes[i] - shared[i]) for i in layers]
        reserved = self.concurrency + self.cache_sequences  # running, and kept prefixes
        cache = [model.layer_cache_bytes(i, self.context_length) * reserved for i in layers]
        whole = [model.layer_kv_kinds[i] == "mla" for i in layers]
        self._prefix_bytes = _prefix(model.layer_bytes)
        self._prefix_expert = _prefix(model.layer_expert_bytes)
        self._prefix_replicated = _prefix(model.layer_replicated_bytes)
        self._prefix_active = _prefix(model.layer_active_bytes)
        self._prefix_active_expert = _prefix(active_experts)
        self._prefix_flops = _prefix([2 * p for p in model.layer_active_params])
        self._prefix_kv_split = _prefix([0 if whole[i] else cache[i] for i in layers])
        self._prefix_kv_whole = _prefix([cache[i] if whole[i] else 0 for i in layers])
        self._prefix_kv = _prefix(cache)
        self.kv_layer_bytes = tuple(cache)
        chunk = min(options.prefill_chunk, max(self.context_length, 1))
        self.activation_bytes = (
            chunk
            * model.activation_bytes
            * (HIDDEN_BUFFERS * model.hidden_size + INTERMEDIATE_BUFFERS * model.intermediate_size)
        )
        self.logits_bytes = chunk * model.vocab_size * model.activation_bytes
        self.head_flops = 2 * model.vocab_size * model.hidden_size
        self._head_matrix_bytes = model.head_matrix_bytes
        self.hidden_bytes = model.hidden_state_bytes
        self._embedding_bytes = model.embedding_bytes
        self._head_bytes = model.head_bytes
        self._tied_head_bytes = model.head_bytes + (
            model.embedding_bytes if model.tie_word_embeddings else 0
        )

    # ---- memory -------------------------------------------------------------------------

    def layer_bytes(self, start: int, end: int) -> int:
        return self._prefix_bytes[end] - self._prefix_bytes[start]

    def active_bytes(self, start: int, end: int) -> int:
        """Bytes one decode token reads in layers [start, end) on one node."""
        return self._prefix_active[end] - self._prefix_active[start]

    def expert_bytes(self, start: int, end: int) -> int:
        """Bytes of the routed experts of layers [start, end)."""
        return self._prefix_expert[end] - self._prefix_expert[start]

    def kv_bytes(self, start: int, end: int) -> int:
        """KV cache and state of layers [start, end) for all sequences, on one node."""
        split = self._prefix_kv_split[end] - self._prefix_kv_split[start]
        return split + self._prefix_kv_whole[end] - self._prefix_kv_whole[start]

    def stage_flops(self, start: int, end: int) -> int:
        """FLOPs per token of layers [start, end) (2 x their active logical weights)."""
        return self._prefix_flops[end] - self._prefix_flops[start]

    def memory(
        self,
        start: int,
        end: int,
        *,
        first: bool,
        last: bool,
        degree: int = 1,
        unit: Unit | None = None,
        member: int = 0,
    ) -> MemoryBreakdown:
        """Peak memory of one member of a stage holding layers [start, end).

        A group member's share comes from `unit` (its expert_counts), or, for a model without
        experts, from `degree` alone.
        """
        if unit is not None:
            degree = unit.degree
        weights = self._member_weights(start, end, degree, unit, member)
        if first:
            weights += self.model.embedding_bytes
        if last:
            weights += self.model.head_bytes
            if self.model.tie_word_embeddings and not first:
                weights += self.model.embedding_bytes
        kv_cache = self._member_kv(start, end, degree)
        activations = self.activation_bytes + (self.logits_bytes if last else 0)
        base = weights + kv_cache + activations
        overhead = base * OVERHEAD_PERCENT // 100 + OVERHEAD_FIXED_BYTES
        return MemoryBreakdown(weights, kv_cache, activations, overhead)

    def _member_weights(
        self, start: int, end: int, degree: int, unit: Unit | None, member: int
    ) -> int:
        total = self._prefix_bytes[end] - self._prefix_bytes[start]
        if degree == 1:
            return total
        experts = self._prefix_expert[end] - self._prefix_expert[start]
        replicated = self._prefix_replicated[end] - self._prefix_replicated[start]
        dense = -(-(total - experts - replicated) // degree)
        if experts == 0:
            return replicated + dense
        if unit is None or not unit.expert_counts or not self.num_experts:
            return replicated + dense + -(-experts // degree)
        share = -(-experts * unit.expert_counts[member] // self.num_experts)
        return replicated + dense + share

    def _member_kv(self, start: int, end: int, degree: int) -> int:
        split = self._prefix_kv_split[end] - self._prefix_kv_split[start]
        whole = self._prefix_kv_whole[end] - self._prefix_kv_whole[start]
        return -(-split // degree) + whole

    def need(self, unit: Unit, start: int, end: int, *, first: bool, last: bool) -> int:
        """memory(...).total of a one-node unit without building the breakdown (the planner's
        inner loops call this hundreds of thousands of times); for a group, the largest
        member's need."""
        if unit.degree == 1:
            weights = self._prefix_bytes[end] - self._prefix_bytes[start]
            activations = self.activation_bytes
            if first:
                weights += self._embedding_bytes
            if last:
                weights += self._tied_head_bytes if not first else self._head_bytes
                activations += self.logits_bytes
            base = weights + self._prefix_kv[end] - self._prefix_kv[start] + activations
            return base + base * OVERHEAD_PERCENT // 100 + OVERHEAD_FIXED_BYTES
        return max(
            self._member_need(unit, m, start, end, first=first, last=last)
            for m in range(unit.degree)
        )

    def _member_need(
        self, unit: Unit, member: int, start: int, end: int, *, first: bool, last: bool
    ) -> int:
        """memory(..., unit=unit, member=member).total without the breakdown object."""
        degree = unit.degree
        total = self._prefix_bytes[end] - self._prefix_bytes[start]
        experts = self._prefix_expert[end] - self._prefix_expert[start]
        replicated = self._prefix_replicated[end] - self._prefix_replicated[start]
        weights = replicated + -(-(total - experts - replicated) // degree)
        if experts:
            if unit.expert_counts and self.num_experts:
                weights += -(-experts * unit.expert_counts[member] // self.num_experts)
            else:
                weights += -(-experts // degree)
        activations = self.activation_bytes
        if first:
            weights += self._embedding_bytes
        if last:
            weights += self._tied_head_bytes if not first else self._head_bytes
            activations += self.logits_bytes
        split = self._prefix_kv_split[end] - self._prefix_kv_split[start]
        kv = -(-split // degree) + self._prefix_kv_whole[end] - self._prefix_kv_whole[start]
        base = weights + kv + activations
        return base + base * OVERHEAD_PERCENT // 100 + OVERHEAD_FIXED_BYTES

    def fill(self, unit: Unit, start: int, end: int, *, first: bool, last: bool) -> float:
        """Largest share of a member's usable memory the stage uses; inf when it does not fit."""
        if unit.degree == 1:
            need = self.need(unit, start, end, first=first, last=last)
            return need / unit.usable_bytes if need <= unit.usable_bytes else math.inf
        worst = 0.0
        for m, usable in enumerate(unit.member_usable):
            need = self._member_need(unit, m, start, end, first=first, last=last)
            if need > usable:
                return math.inf
            worst = max(worst, need / usable)
        return worst

    def fits(self, unit: Unit, start: int, end: int, *, first: bool, last: bool) -> bool:
        if unit.degree == 1:
            return self.need(unit, start, end, first=first, last=last) <= unit.usable_bytes
        for m, usable in enumerate(unit.member_usable):
            if self._member_need(unit, m, start, end, first=first, last=last) > usable:
                return False
        return True

    def max_end(self, unit: Unit, start: int, *, first: bool, last: bool, limit: int) -> int:
        """Largest end <= limit with [start, end) fitting on unit; `start` if not even one layer."""
        low, high = start, limit
        while low < high:
            middle = (low + high + 1) // 2
            if self.fits(unit, start, middle, first=first, last=last):
                low = middle
            else:
                high = middle - 1
        return low

    def min_start(self, unit: Unit, end: int, *, first: bool, last: bool, floor: int) -> int:
        """Smallest start >= floor with [start, end) fitting on unit; `end` if not one layer."""
        low, high = floor, end
        while low < high:
            middle = (low + high) // 2
            if self.fits(unit, middle, end, first=first, last=last):
                high = middle
            else:
                low = middle + 1
        return low

    def whole_model_memory(self) -> int:
        """Memory of the whole model on one node: the least any plan can need in total."""
        return self.memory(0, self.num_layers, first=True, last=True).total

    # ---- time ---------------------------------------------------------------------------

    def micro_batches(self, stages: int) -> int:
        """Micro-batches the `concurrency` sequences decode in on a plan of ``stages``."""
        return micro_batches(stages, self.concurrency)

    def step_rows(self, stages: int) -> int:
        """Rows of one micro-batch's decode step on a plan of ``stages`` stages."""
        return _ceil_div(self.concurrency, self.micro_batches(stages))

    def expert_touch(self, tokens: int) -> float:
        """Routed expert bytes ``tokens`` tokens read together, as a multiple of what one token
        reads: E x (1 - (1 - k/E)^tokens) of E experts against k (1 for a dense model)."""
        fraction = self._expert_fraction
        if tokens <= 1 or fraction <= 0.0 or fraction >= 1.0:
            return 1.0
        return (1.0 - (1.0 - fraction) ** tokens) / fraction

    def active_read(self, start: int, end: int, tokens: int = 1) -> float:
        """Bytes ``tokens`` tokens read together in layers [start, end) on one node: the shared
        weights once, the routed experts they touch (at most all of them)."""
        if tokens <= 1 or self._expert_fraction <= 0.0:
            return self._prefix_active[end] - self._prefix_active[start]
        return self._touched_read(start, end, self.expert_touch(tokens))

    def _touched_read(self, start: int, end: int, touch: float) -> float:
        """active_read for tokens whose expert_touch is ``touch`` (the planner's inner loops
        compute it once per step size)."""
        read = self._prefix_active[end] - self._prefix_active[start]
        routed = self._prefix_active_expert[end] - self._prefix_active_expert[start]
        touched = min(routed * touch, self.expert_bytes(start, end))
        return read - routed + max(touched, routed)

    def stage_decode_s(self, unit: Unit, start: int, end: int, *, last: bool) -> float:
        """Seconds for one stage to process one decode token (see module docstring)."""
        return self._stage_s(unit, start, end, last=last, tokens=1)

    def stage_step_s(self, unit: Unit, start: int, end: int, *, last: bool, rows: int) -> float:
        """Seconds for one stage's decode step of ``rows`` sequences batched together: the
        roofline of the module docstring, plus, where the node reports its `row_flops`, each
        row beyond the first at that rate (module docstring, "Rows a node measured"). A
        tensor-parallel group does not batch: ``rows`` steps of one row each."""
        if unit.degree > 1:
            # A group's runners keep one cache per request, so the daemon runs the group's
            # decode steps request by request: r rows cost r steps of one.
            return rows * self._stage_s(unit, start, end, last=last, tokens=1)
        seconds = self._stage_s(unit, start, end, last=last, tokens=rows)
        if rows > 1 and unit.row_flops < math.inf:
            flops = self._prefix_flops[end] - self._prefix_flops[start]
            if last:
                flops += self.head_flops
            seconds += (rows - 1) * flops / unit.row_flops
        return seconds

    def stage_prefill_s(self, unit: Unit, start: int, end: int, *, last: bool) -> float:
        """Seconds for one stage to process the prompt of `prompt_len` tokens (the head, on
        the last stage, for the last position only: the stages compute no other logits)."""
        return self.stage_chunk_s(unit, start, end, last=last, tokens=self.prompt_len)

    def stage_chunk_s(self, unit: Unit, start: int, end: int, *, last: bool, tokens: int) -> float:
        """Seconds for one stage to process ``tokens`` prompt positions in one pass."""
        return self._stage_s(unit, start, end, last=last, tokens=tokens, head_tokens=1)

    def _stage_s(
        self,
        unit: Unit,
        start: int,
        end: int,
        *,
        last: bool,
        tokens: int,
        head_tokens: int | None = None,
    ) -> float:
        """``head_tokens``: positions whose logits the last stage computes (default: all)."""
        if head_tokens is None:
            head_tokens = tokens
        read = self._prefix_active[end] - self._prefix_active[start]
        touch = self.expert_touch(tokens) if self._expert_fraction else 1.0
        flops = self._prefix_flops[end] - self._prefix_flops[start]
        degree = unit.degree
        if degree == 1:
            if touch > 1.0:
                read = self._touched_read(start, end, touch)
            work = tokens * flops
            if last:
                read += self._head_matrix_bytes
                work += head_tokens * self.head_flops
            memory_s = read / unit.mem_bandwidth
            compute_s = work / unit.flops
            fixed_s = (end - start) * unit.layer_overhead_s
            return fixed_s + (memory_s if memory_s > compute_s else compute_s)
        seconds = max(
            self._member_s(
                unit,
                m,
                start,
                end,
                read,
                flops,
                last=last,
                tokens=tokens,
                touch=touch,
                head_tokens=head_tokens,
            )
            for m in range(degree)
        )
        fixed_s = (end - start) * unit.layer_overhead_s
        return fixed_s + seconds + self._collectives_s(unit, end - start, tokens)

    def _member_s(
        self,
        unit: Unit,
        member: int,
        start: int,
        end: int,
        read: int,
        flops: int,
        *,
        last: bool,
        tokens: int,
        touch: float = 1.0,
        head_tokens: int | None = None,
    ) -> float:
        replicated = self._prefix_replicated[end] - self._prefix_replicated[start]
        experts = self._prefix_active_expert[end] - self._prefix_active_expert[start]
        dense = max(0, read - experts - replicated)
        if unit.expert_counts and self.num_experts:
            expert_share = experts * unit.expert_counts[member] / self.num_experts
        else:
            expert_share = experts / unit.degree
        member_read = replicated + dense / unit.degree + expert_share
        member_flops = flops * member_read / read if read else flops / unit.degree
        if touch > 1.0:  # several tokens touch more of the member's experts (FLOPs do not grow)
            held = self.expert_bytes(start, end) * (expert_share / experts if experts else 0.0)
            member_read += min(expert_share * (touch - 1.0), max(0.0, held - expert_share))
        work = tokens * member_flops
        if last:
            member_read += self.model.head_matrix_bytes
            work += (tokens if head_tokens is None else head_tokens) * self.head_flops
        return max(
            member_read / unit.member_bandwidth[member],
            work / unit.member_flops[member],
        )

    def _collectives_s(self, unit: Unit, layers: int, tokens: int) -> float:
        """Two all-reduces per layer and one broadcast of the stage's input (module docs)."""
        degree = unit.degree
        payload = tokens * self.hidden_bytes
        step = unit.link_latency_s + payload / (degree * unit.link_bandwidth)
        all_reduce = unit.collective_overhead_s + 2 * (degree - 1) * step
        broadcast = unit.collective_overhead_s + unit.link_latency_s + payload / unit.link_bandwidth
        return ALL_REDUCES_PER_LAYER * layers * all_reduce + broadcast

    def per_layer_decode_s(self, unit: Unit) -> float:
        """Average decode seconds per layer on this unit: its speed rank in the planner."""
        return self.stage_decode_s(unit, 0, self.num_layers, last=False) / self.num_layers


def _prefix(values: Sequence[int]) -> tuple[int, ...]:
    return (0, *accumulate(values))


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)
