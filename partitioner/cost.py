"""The cost model: predicted memory and time of a pipeline stage, a hop and a whole plan.

A plan is only as good as the model it optimises, so here it is in full.

Memory of one node in a stage holding layers [a, b) (all sizes exact integers):
- weights: the bytes of those layers as stored in the weight files (quantized sizes are the
  real ones), + the embedding table on the first stage, + final norm and lm_head on the last
  stage; with tied embeddings the last stage also holds the embedding table (once, when the
  same node is first and last).
- KV cache: kv_bytes_per_token_per_layer x (b - a) x context_length x concurrency, reserved
  up front for the whole context (out-of-memory half way through a long chat is the failure
  users report most).
- activations, a stated bound: prefill_chunk x (4 x hidden + 3 x intermediate) x
  activation_bytes (hidden state, residual, q/k/v and attention output; gate, up and their
  product), + on the last stage the logits of a prefill chunk: prefill_chunk x vocab x
  activation_bytes (mlx-lm computes logits for every position of a chunk). Attention scores
  are not counted: MLX's fused scaled_dot_product_attention does not materialise them.
- overhead: 5 % of the above + 64 MiB (allocator slack, buffers for messages in flight).
A node's usable budget is its memory_budget minus PlanOptions.reserve_bytes. A tensor-parallel
group member holds 1/g of each layer's weights and KV cache, and a full copy of the
embedding / head and of the activations.

Decode time of a stage per token (one sequence): max(weight bytes read / memory bandwidth,
FLOPs / compute), with FLOPs = 2 x logical weights of the layers (+ 2 x vocab x hidden for the
head on the last stage, which also reads the head matrix). The KV cache read is not counted: it
grows with the position in the context, and the prediction is for a short context (at position
p each stage also reads p x kv_bytes_per_token_per_layer x its layers). Mixture-of-experts
layers are counted with all experts (an upper bound). A tensor-parallel group of g nodes runs
at the speed of its slowest member on 1/g of the work, plus two all-reduces per layer
(ring: 2(g-1) x (latency + hidden bytes / (g x bandwidth)) over its slowest link) and one
broadcast of the stage's input.

Hops: stage i sends one token's hidden state to stage i+1: latency + hidden x activation_bytes
/ bandwidth along its route (see partitioner.mesh). The last stage samples and sends the token
id (TOKEN_BYTES) back to the first stage: that ring hop is counted too.

Per-token decode time of one sequence alone = sum of stage times + all hops (a pipeline runs its
stages one after the other for one sequence). With `concurrency` = C sequences in flight and no
batching across them, a stage serves C tokens per round, so the time between two tokens of one
sequence is max(decode time, C x slowest stage); aggregate tokens/s = C / that. The `speed`
strategy minimises this time per token (for C = 1 simply the decode time).

Time to first token for a prompt of P tokens = sum over stages of max(weight bytes / bandwidth,
P x FLOPs / compute) + hops carrying P hidden states (the quadratic attention term is left out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

from partitioner.model import ModelSpec
from partitioner.options import PlanOptions

MIB = 1024 * 1024
OVERHEAD_PERCENT = 5
OVERHEAD_FIXED_BYTES = 64 * MIB
TOKEN_BYTES = 8
HIDDEN_BUFFERS = 4
INTERMEDIATE_BUFFERS = 3


@dataclass(frozen=True)
class Unit:
    """What one pipeline stage runs on: one node, or a tensor-parallel group of nodes.

    usable_bytes: the smallest usable budget among the members (each holds the same share).
    flops / mem_bandwidth: those of the slowest member (a group waits for it).
    link_latency_s / link_bandwidth: the group's worst internal link (unused for one node).
    """

    nodes: tuple[str, ...]
    usable_bytes: int
    flops: float
    mem_bandwidth: float
    link_latency_s: float = 0.0
    link_bandwidth: float = math.inf

    @property
    def leader(self) -> str:
        """The member that receives and sends the stage's activations."""
        return self.nodes[0]

    @property
    def degree(self) -> int:
        return len(self.nodes)


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
        self.prompt_len = options.prompt_len
        self._prefix_bytes = (0, *accumulate(model.layer_bytes))
        self._prefix_flops = (0, *accumulate(2 * p for p in model.layer_params))
        self.kv_bytes_per_layer = (
            model.kv_bytes_per_token_per_layer * self.context_length * self.concurrency
        )
        chunk = min(options.prefill_chunk, max(self.context_length, 1))
        self.activation_bytes = (
            chunk
            * model.activation_bytes
            * (HIDDEN_BUFFERS * model.hidden_size + INTERMEDIATE_BUFFERS * model.intermediate_size)
        )
        self.logits_bytes = chunk * model.vocab_size * model.activation_bytes
        self.head_flops = 2 * model.vocab_size * model.hidden_size
        self.hidden_bytes = model.hidden_state_bytes
        self._tied_head_bytes = model.head_bytes + (
            model.embedding_bytes if model.tie_word_embeddings else 0
        )

    # ---- memory -------------------------------------------------------------------------

    def layer_bytes(self, start: int, end: int) -> int:
        return self._prefix_bytes[end] - self._prefix_bytes[start]

    def stage_flops(self, start: int, end: int) -> int:
        """FLOPs per token of layers [start, end) (2 x their logical weights)."""
        return self._prefix_flops[end] - self._prefix_flops[start]

    def memory(
        self, start: int, end: int, *, first: bool, last: bool, degree: int = 1
    ) -> MemoryBreakdown:
        """Peak memory of one member of a stage holding layers [start, end)."""
        layers = end - start
        weights = _ceil_div(self.layer_bytes(start, end), degree)
        if first:
            weights += self.model.embedding_bytes
        if last:
            weights += self.model.head_bytes
            if self.model.tie_word_embeddings and not first:
                weights += self.model.embedding_bytes
        kv_cache = _ceil_div(self.kv_bytes_per_layer * layers, degree)
        activations = self.activation_bytes + (self.logits_bytes if last else 0)
        base = weights + kv_cache + activations
        overhead = base * OVERHEAD_PERCENT // 100 + OVERHEAD_FIXED_BYTES
        return MemoryBreakdown(weights, kv_cache, activations, overhead)

    def need(self, unit: Unit, start: int, end: int, *, first: bool, last: bool) -> int:
        """memory(...).total for one member of `unit`, without building the breakdown (the
        planner's inner loops call this hundreds of thousands of times)."""
        degree = len(unit.nodes)
        prefix = self._prefix_bytes
        weights = -(-(prefix[end] - prefix[start]) // degree)
        activations = self.activation_bytes
        if first:
            weights += self.model.embedding_bytes
        if last:
            weights += self._tied_head_bytes if not first else self.model.head_bytes
            activations += self.logits_bytes
        base = weights + -(-(self.kv_bytes_per_layer * (end - start)) // degree) + activations
        return base + base * OVERHEAD_PERCENT // 100 + OVERHEAD_FIXED_BYTES

    def fits(self, unit: Unit, start: int, end: int, *, first: bool, last: bool) -> bool:
        return self.need(unit, start, end, first=first, last=last) <= unit.usable_bytes

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

    def stage_decode_s(self, unit: Unit, start: int, end: int, *, last: bool) -> float:
        """Seconds for one stage to process one decode token (see module docstring)."""
        return self._stage_s(unit, start, end, last=last, tokens=1)

    def stage_prefill_s(self, unit: Unit, start: int, end: int, *, last: bool) -> float:
        """Seconds for one stage to process the prompt of `prompt_len` tokens."""
        return self._stage_s(unit, start, end, last=last, tokens=self.prompt_len)

    def _stage_s(self, unit: Unit, start: int, end: int, *, last: bool, tokens: int) -> float:
        degree = unit.degree
        read = (self._prefix_bytes[end] - self._prefix_bytes[start]) / degree
        flops = (self._prefix_flops[end] - self._prefix_flops[start]) / degree
        if last:
            read += self.model.head_matrix_bytes
            flops += self.head_flops
        seconds = max(read / unit.mem_bandwidth, tokens * flops / unit.flops)
        if degree > 1:
            payload = tokens * self.hidden_bytes
            all_reduce = (
                2 * (degree - 1) * (unit.link_latency_s + payload / (degree * unit.link_bandwidth))
            )
            broadcast = unit.link_latency_s + payload / unit.link_bandwidth
            seconds += 2 * (end - start) * all_reduce + broadcast
        return seconds

    def per_layer_decode_s(self, unit: Unit) -> float:
        """Average decode seconds per layer on this unit: its speed rank in the planner."""
        return self.stage_decode_s(unit, 0, self.num_layers, last=False) / self.num_layers


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)
