"""The compute side of the data plane: the MLX work of one node's stages.

Everything here runs on the node's one compute thread (:class:`meshd.runtime.compute.
ComputeExecutor`), never on the trio thread nor on the asyncio thread that moves frames, so
that heartbeats and other requests' frames never wait behind a matrix multiplication.

* :class:`StageEngine`: this node's layers of one plan (mlx-lm's own model classes, see
  :mod:`meshd.inference.stage.shard`), the KV caches of its open requests and, on the last stage,
  each request's seeded sampler. Its methods are the interface :func:`run_step` and the stage
  runtime drive; :class:`meshd.inference.tensor_parallel.engine.TensorParallelEngine`
  implements it for a stage split over a group (its rank 0 runs the step in runner processes).
* :func:`run_step`: one step of one request as the stage core handed it out
  (:class:`meshd.inference.stage.core.Work`): embed or decode the input, run the layers,
  and return the hidden states for the next stage, or sample the next token on the last.
* The activation codec (:func:`encode_hidden`/:func:`decode_hidden`): raw little-endian
  bytes plus dtype and shape; no pickle ever crosses the wire.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import mlx.core as mx
import numpy as np

from meshd.inference.grammar import GrammarMask, grammar_tokenizer
from meshd.inference.sampling import TokenSampler
from meshd.inference.stage.drafting import DraftIndex
from meshd.inference.stage_events import (
    Advanced,
    ComputeFailed,
    FailureKind,
    Hidden,
    Sampled,
    SamplerSetup,
    Skipped,
    SlotUse,
    StepResult,
    Verified,
    Work,
)
from meshd.runtime.blas import default_blas_threads, set_blas_threads
from meshd.runtime.compute import computing

if (
    TYPE_CHECKING
):  # meshd.inference.stage.shard imports mlx_lm (and transformers): loaded on first use
    from meshd.inference.stage.model import RequestCaches, StageModel

# dtype name on the wire -> (MLX dtype, numpy dtype used for the bytes). bfloat16 has no numpy
# dtype: its bytes travel as uint16 and are reinterpreted on arrival.
_WIRE_DTYPES: dict[str, tuple[mx.Dtype, type[np.generic]]] = {
    "float32": (mx.float32, np.float32),
    "float16": (mx.float16, np.float16),
    "bfloat16": (mx.bfloat16, np.uint16),
}
_WIRE_NAMES: dict[mx.Dtype, str] = {mx_dtype: name for name, (mx_dtype, _) in _WIRE_DTYPES.items()}


# --- Activations on the wire ------------------------------------------------------------


class HiddenStates(NamedTuple):
    """Hidden states as they travel: dtype name, shape ``(1, tokens, hidden)``, raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def encode_hidden(hidden: mx.array) -> HiddenStates:
    """The wire form of an evaluated array, for an Activation frame."""
    name = _WIRE_NAMES.get(hidden.dtype)
    if name is None:
        raise ValueError(
            f"hidden states of dtype {hidden.dtype} cannot be sent; supported: "
            f"{', '.join(_WIRE_DTYPES)}"
        )
    raw = hidden.view(mx.uint16) if hidden.dtype == mx.bfloat16 else hidden
    return HiddenStates(name, tuple(hidden.shape), bytes(memoryview(raw)))


def decode_hidden(dtype: str, shape: Sequence[int], data: bytes) -> mx.array:
    """The array :func:`encode_hidden` encoded; ValueError when the frame is inconsistent."""
    if dtype not in _WIRE_DTYPES:
        raise ValueError(
            f"unknown activation dtype {dtype!r}; expected one of {list(_WIRE_DTYPES)}"
        )
    mx_dtype, np_dtype = _WIRE_DTYPES[dtype]
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
    if len(shape) != 3 or len(data) != expected:
        raise ValueError(
            f"activation of shape {list(shape)} and dtype {dtype} needs {expected} bytes in 3 "
            f"dimensions, got {len(data)} bytes: sender and receiver disagree on the model"
        )
    array = mx.array(np.frombuffer(data, dtype=np_dtype).reshape(tuple(shape)))
    return array.view(mx_dtype) if dtype == "bfloat16" else array


# --- One stage of one plan ----------------------------------------------------------------


class PrefixMissing(RuntimeError):
    """A kept prefix the core chose is not held here (its caches were not kept): the request
    ends as CACHE_MISS, which its origin runs again without the prefix cache."""


class StageUnavailable(RuntimeError):
    """The stage cannot compute any more (a tensor-parallel group lost a member): the step's
    request ends as UNREACHABLE, which its origin may retry on the mesh's next plan."""


@dataclass(frozen=True)
class StageKey:
    """What identifies loaded weights: plans with equal keys on a node share one StageModel."""

    model_dir: Path
    layer_start: int
    layer_end: int
    has_embedding: bool
    has_head: bool


@dataclass
class _SamplerState:
    sampler: TokenSampler
    context: list[int] | None  # prompt + generated, kept only for the repetition penalty
    return_logits: bool
    last_token: int | None = None  # the input of a single stage's following step
    history: DraftIndex | None = None  # a single stage that drafts: prompt + answer so far
    generated: int = 0  # tokens the request has generated (a single stage that drafts)


@dataclass
class StageEngine:
    """This node's layers of one plan and the per-request state they need.

    Every method runs on the compute thread. ``weight_bytes`` is set by :meth:`load`, before
    the load's future resolves, so the asyncio side may read it once the load is awaited.
    """

    key: StageKey
    max_requests: int
    stage: StageModel | None = None
    weight_bytes: int = 0
    _caches: RequestCaches | None = None
    _samplers: dict[str, _SamplerState] = field(default_factory=dict)
    batched_rows: int = 0  # decode steps run batched with other requests' (read in stats)
    batched_steps: int = 0  # forward passes those rows ran in (rows / steps: the mean batch)
    drafted_tokens: int = 0  # last stage: draft tokens it verified (read in stats)
    accepted_tokens: int = 0  # ...and accepted
    # The model's mlx-lm tokenizer (set by the data plane when the plan's tokenizer is
    # loaded, before any request): a last stage builds structured outputs' masks from it.
    tokenizer: Any = None

    def load(
        self, shared: StageModel | None = None, donors: list[StageModel] | None = None
    ) -> None:
        """Load the stage's weights (or adopt ``shared``, identical weights already loaded;
        ``donors``: a stage of the same model whose common layers are taken over, see
        :func:`meshd.inference.stage.shard.load_stage`)."""
        from meshd.inference.stage.model import RequestCaches
        from meshd.inference.stage.shard import load_stage

        self.stage = shared or load_stage(
            self.key.model_dir,
            self.key.layer_start,
            self.key.layer_end,
            has_embedding=self.key.has_embedding,
            has_head=self.key.has_head,
            donors=donors,
        )
        self._caches = RequestCaches(self.stage, self.max_requests)
        self.weight_bytes = self.stage.nbytes

    def open_sampler(self, request_id: str, setup: SamplerSetup) -> None:
        """Set up the seeded sampler of a request (last stage, before its first logits),
        held to the request's grammar if it has one (structured outputs), which first follows
        the tokens a resumed request generated before."""
        sampler = TokenSampler(setup.sampling, self._grammar_mask(setup))
        sampler.advance(setup.draws)
        keep_context = setup.sampling.repetition_penalty != 1.0
        self._samplers[request_id] = _SamplerState(
            sampler=sampler,
            context=list(setup.context) if keep_context else None,
            return_logits=setup.return_logits,
            history=DraftIndex(setup.context) if setup.draft else None,
            generated=setup.generated,
        )

    def _grammar_mask(self, setup: SamplerSetup) -> GrammarMask | None:
        constraint = setup.sampling.constraint
        if constraint is None:
            return None
        if self.tokenizer is None:
            raise RuntimeError("this stage has no tokenizer to hold a request to its grammar")
        return GrammarMask(
            constraint,
            grammar_tokenizer(self.tokenizer),
            stop_ids=setup.eos_ids,
            generated=setup.generated_tokens,
        )

    def run(
        self, request_id: str, inputs: mx.array, *, head: bool, every_position: bool = False
    ) -> mx.array:
        """One step of one request through this stage, evaluated: hidden states, or on the
        last stage with ``head`` the logits of the step's last position ``(1, 1, vocab)`` (of
        every position with ``every_position``: a speculative step's)."""
        if self.stage is None or self._caches is None:
            raise RuntimeError("this node's stage is not loaded")
        cache = self._caches.get(request_id)
        logits = ("all" if every_position else "last") if head else "none"
        output = self.stage.run(inputs, cache, logits=logits)
        _evaluate(output)
        return output

    def roll_back(self, request_id: str, positions: int) -> None:
        """Drop the last ``positions`` positions of the request's caches: the drafts of its
        speculative step before that the last stage rejected."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if positions <= 0:
            return
        if self._caches is None:
            raise RuntimeError("this node's stage is not loaded")
        cache = self._caches.get(request_id)
        if not can_trim_prompt_cache(cache):
            raise RuntimeError(
                "this stage's caches cannot drop positions, so it cannot take back rejected "
                "drafts: speculative decoding needs a model whose every layer keeps a KV cache"
            )
        dropped = trim_prompt_cache(cache, positions)
        if dropped != positions:
            raise RuntimeError(f"the caches held {dropped} positions to drop, not {positions}")

    def verify(self, logits: mx.array, drafts: Sequence[int]) -> tuple[int, ...]:
        """Greedy verification of a speculative step from its logits ``(1, 1 + drafts,
        vocab)``: the token greedy decoding gives at each position, as long as the one before
        equals the draft there; so every draft accepted, then the first token of the model's
        own (a correction, or the one after the last draft)."""
        guesses = mx.argmax(logits[0], axis=-1).tolist()
        tokens: list[int] = []
        for position, token in enumerate(guesses):
            tokens.append(int(token))
            if position >= len(drafts) or token != drafts[position]:
                break
        self.drafted_tokens += len(drafts)
        self.accepted_tokens += len(tokens) - 1
        return tuple(tokens)

    @property
    def can_roll_back(self) -> bool:
        """Whether this stage's caches can drop positions again (every layer a KV cache)."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        return self.stage is not None and can_trim_prompt_cache(self.stage.make_cache())

    @property
    def batchable(self) -> bool:
        """Whether this stage may run several requests' decode steps in one forward pass."""
        return self.stage is not None and self.stage.batchable

    def run_batch(self, inputs: dict[str, mx.array], *, head: bool) -> tuple[list[str], mx.array]:
        """One decode step of several requests in one forward pass on their batched caches
        (:meth:`RequestCaches.batch`), evaluated: the requests in row order, and the hidden
        states ``(rows, 1, hidden)`` or, with ``head``, the logits ``(rows, 1, vocab)``.
        ``inputs`` holds each request's input, ``(1, 1)`` token ids or ``(1, 1, hidden)``."""
        if self.stage is None or self._caches is None:
            raise RuntimeError("this node's stage is not loaded")
        cache, order = self._caches.batch(list(inputs))
        batch = mx.concatenate([inputs[request_id] for request_id in order], axis=0)
        output = self.stage.run(batch, cache, logits="last" if head else "none")
        _evaluate(output)
        self.batched_rows += len(order)
        self.batched_steps += 1
        return order, output

    @property
    def batched_groups(self) -> int:
        """Groups of requests whose caches are merged here (decoding together)."""
        return self._caches.groups if self._caches is not None else 0

    def sample(self, request_id: str, logits: mx.array) -> tuple[int, bytes]:
        """The request's next token from the step's logits ``(1, 1, vocab)``, and the logits
        row as float32 bytes when the request asked for them (else b"")."""
        state = self._samplers.get(request_id)
        if state is None:
            raise RuntimeError(f"request {request_id} has no sampler on this stage")
        row = logits[:, -1, :]  # what mlx-lm's generate_step samples from
        token = state.sampler.sample(row, state.context or [])
        state.last_token = token
        state.generated += 1
        if state.context is not None:
            state.context.append(token)
        if state.history is not None:
            state.history.append(token)
        raw = bytes(memoryview(row.astype(mx.float32).reshape(-1))) if state.return_logits else b""
        return token, raw

    def own_drafts(self, request_id: str, limit: int) -> tuple[int, ...]:
        """A single stage's drafts for the step after its last token (prompt lookup in the
        request's prompt and answer so far), no more than it may still generate after the
        token that step samples; empty when it keeps no history or is done."""
        state = self._samplers.get(request_id)
        if state is None or state.history is None:
            return ()
        room = state.sampler.params.max_tokens - state.generated - 1
        return state.history.drafts(min(limit, room))

    def done(self, request_id: str) -> bool:
        """Whether a single stage that drafts has given the request its max_tokens."""
        state = self._samplers.get(request_id)
        if state is None or state.history is None:
            return False
        return state.generated >= state.sampler.params.max_tokens

    def settle(self, request_id: str, drafts: Sequence[int], tokens: Sequence[int]) -> None:
        """A single stage verified its own drafts: drop the rejected positions from the
        caches and go on from the last token it gives."""
        self.roll_back(request_id, len(drafts) - (len(tokens) - 1))
        state = self._samplers[request_id]
        state.last_token = tokens[-1]
        state.generated += len(tokens)
        if state.history is not None:
            state.history.extend(tokens)

    def last_token(self, request_id: str) -> int:
        """The token the request's last step sampled here (a single stage's next input)."""
        state = self._samplers.get(request_id)
        if state is None or state.last_token is None:
            raise RuntimeError(f"request {request_id} has sampled no token on this stage")
        return state.last_token

    def release(
        self, request_id: str, keep_as: int | None = None, positions: int = 0, keep: int = 0
    ) -> None:
        """Drop the request's KV caches and sampler (no error if it has none); with
        ``keep_as``, keep the caches as that prefix slot, cut to their first ``keep``
        positions, when they hold ``positions`` positions (a step that failed after
        the core decided may have left them otherwise: then they are freed, and a request
        that asks for the slot is told it is missing)."""
        from mlx_lm.models.cache import trim_prompt_cache

        if self._caches is not None:
            if keep_as is not None and self.stage is not None:
                cache = self._caches.take(request_id)
                if cache is not None and _positions_held(cache) in (None, positions):
                    if keep < positions:
                        trim_prompt_cache(cache, positions - keep)
                    self.stage.slots[keep_as] = cache
            else:
                self._caches.release(request_id)
        self._samplers.pop(request_id, None)

    def start_from_slot(self, request_id: str, use: SlotUse) -> None:
        """The request's caches start as kept prefix ``use.slot`` cut to ``use.length``
        positions: the slot's own caches (``take``) or a copy of them."""
        from mlx_lm.models.cache import trim_prompt_cache

        if self.stage is None or self._caches is None:
            raise RuntimeError("this node's stage is not loaded")
        slots = self.stage.slots
        kept = slots.pop(use.slot, None) if use.take else slots.get(use.slot)
        if kept is None:
            raise PrefixMissing(f"this stage no longer holds cached prefix {use.slot}")
        cache = kept if use.take else copy.deepcopy(kept)
        held = _positions_held(cache)
        if held is not None and held > use.length:
            trim_prompt_cache(cache, held - use.length)
        self._caches.adopt(request_id, cache)

    def drop_slots(self, slot_ids: Sequence[int]) -> None:
        """Free kept prefixes (the core evicted them)."""
        if self.stage is not None:
            for slot_id in slot_ids:
                self.stage.slots.pop(slot_id, None)

    def keep_only_slots(self, slot_ids: Sequence[int]) -> None:
        """Free every kept prefix but ``slot_ids`` (the core's index of these layers, when a
        plan is loaded on weights an earlier plan kept prefixes of)."""
        if self.stage is not None:
            wanted = set(slot_ids)
            for slot_id in [s for s in self.stage.slots if s not in wanted]:
                del self.stage.slots[slot_id]

    def unload(self) -> None:
        """Forget the weights and caches (they are freed once no other plan shares them)."""
        self._caches = None
        self._samplers.clear()
        self.stage = None
        mx.clear_cache()


def is_decode_step(work: Work) -> bool:
    """Whether ``work`` runs one position (a decode step, which may join a batch)."""
    if work.rollback or work.drafts or work.draft_limit or work.slot_use is not None:
        return False  # a speculative step, the one after it, or a first step on a kept prefix
    if work.follows:
        return True
    if work.tokens is not None:
        return len(work.tokens) == 1
    shape = getattr(work.payload, "shape", ())
    return len(shape) == 3 and shape[0] == 1 and shape[1] == 1


def run_steps(engine: StageEngine, works: Sequence[Work], cores_share: int) -> list[StepResult]:
    """Compute thread: one decode step of each request of ``works`` (one plan, all with the
    same ``head``) in one forward pass on their batched caches, each row's result in order.
    Rows whose step is skipped (a single stage's following step after a stop token) drop out;
    a batch left with one row runs that row alone (:func:`run_step`), on its own cache."""
    from meshd.inference.stage.model import TooManyRequests

    set_blas_threads(None if cores_share <= 1 else default_blas_threads() // cores_share)
    started = time.perf_counter()
    results: list[StepResult | None] = [None] * len(works)
    inputs: dict[str, mx.array] = {}
    try:
        for row, work in enumerate(works):
            if work.follows:
                token = engine.last_token(work.request_id)
                if token in work.stop_ids:
                    results[row] = Skipped()
                    continue
                inputs[work.request_id] = mx.array([[token]])
            elif work.tokens is not None:
                inputs[work.request_id] = mx.array([work.tokens])
            else:
                payload: Any = work.payload
                inputs[work.request_id] = decode_hidden(payload.dtype, payload.shape, payload.data)
            if work.sampler is not None:
                engine.open_sampler(work.request_id, work.sampler)
        if len(inputs) < 2:
            return [
                result if result is not None else run_step(engine, work, cores_share)
                for work, result in zip(works, results, strict=True)
            ]
        order, output = engine.run_batch(inputs, head=works[0].head)
        elapsed = time.perf_counter() - started
        rows = {request_id: row for row, request_id in enumerate(order)}
        hidden = None if engine.key.has_head else _host_rows(output)
        for index, work in enumerate(works):
            if results[index] is not None:
                continue
            row = rows[work.request_id]
            if hidden is not None:
                states = _row_states(hidden, row, output.dtype)
                results[index] = Hidden(states, work.upstream_s + elapsed)
            elif not work.head:
                results[index] = Advanced(work.upstream_s + elapsed)
            else:
                token, logits = engine.sample(work.request_id, output[row : row + 1])
                spent = work.upstream_s + time.perf_counter() - started
                results[index] = Sampled(token, logits, spent)
        assert all(result is not None for result in results)
        return results  # type: ignore[return-value]
    except TooManyRequests as error:
        return [ComputeFailed(FailureKind.OVERLOADED, str(error)) for _ in works]
    except StageUnavailable as error:
        return [ComputeFailed(FailureKind.UNREACHABLE, str(error)) for _ in works]
    except Exception as error:
        reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        return [ComputeFailed(FailureKind.INTERNAL, reason) for _ in works]


def _host_rows(hidden: mx.array) -> np.ndarray:
    """A batch's evaluated hidden states as host memory (bfloat16 as its uint16 bits)."""
    return np.array(hidden.view(mx.uint16) if hidden.dtype == mx.bfloat16 else hidden)


def _row_states(hidden: np.ndarray, row: int, dtype: mx.Dtype) -> HiddenStates:
    """Row ``row`` of a batch's hidden states ``(rows, 1, hidden)`` in wire form, as
    :func:`encode_hidden` gives it."""
    name = _WIRE_NAMES.get(dtype)
    if name is None:
        raise ValueError(
            f"hidden states of dtype {dtype} cannot be sent; supported: {', '.join(_WIRE_DTYPES)}"
        )
    one = hidden[row : row + 1]
    return HiddenStates(name, tuple(one.shape), one.tobytes())


def run_step(engine: StageEngine, work: Work, cores_share: int) -> StepResult:
    """Compute thread: one step of one request through ``engine``.

    ``cores_share`` is how many busy stages share this machine's cores right now (1: use
    them all); the stage sets its BLAS threads to its share before computing.
    """
    from meshd.inference.stage.model import TooManyRequests

    share = max(1, cores_share)
    set_blas_threads(None if share == 1 else default_blas_threads() // share)
    started = time.perf_counter()
    try:
        drafts = work.drafts
        if work.follows:
            token = engine.last_token(work.request_id)
            if token in work.stop_ids or (work.draft_limit and engine.done(work.request_id)):
                return Skipped()
            if work.draft_limit:
                drafts = engine.own_drafts(work.request_id, work.draft_limit)
            inputs = mx.array([[token, *drafts]])
        elif work.tokens is not None:
            inputs = mx.array([work.tokens])
        else:
            payload: Any = work.payload
            inputs = decode_hidden(payload.dtype, payload.shape, payload.data)
        if work.slot_use is not None:
            engine.start_from_slot(work.request_id, work.slot_use)
        if work.sampler is not None:
            engine.open_sampler(work.request_id, work.sampler)
        if work.rollback:
            engine.roll_back(work.request_id, work.rollback)
        speculative = bool(drafts)
        output = engine.run(work.request_id, inputs, head=work.head, every_position=speculative)
        compute_s = work.upstream_s + time.perf_counter() - started
        if not engine.key.has_head:
            return Hidden(encode_hidden(output), compute_s)
        if not work.head:
            return Advanced(compute_s)
        if speculative:
            tokens = engine.verify(output, drafts)
            if work.follows:  # a single stage: its own drafts, settled here
                stop = next((i for i, t in enumerate(tokens) if t in work.stop_ids), None)
                tokens = tokens if stop is None else tokens[: stop + 1]
                engine.settle(work.request_id, drafts, tokens)
            return Verified(tokens, work.upstream_s + time.perf_counter() - started)
        token, logits = engine.sample(work.request_id, output)
        return Sampled(token, logits, work.upstream_s + time.perf_counter() - started)
    except TooManyRequests as error:
        return ComputeFailed(FailureKind.OVERLOADED, str(error))
    except StageUnavailable as error:
        return ComputeFailed(FailureKind.UNREACHABLE, str(error))
    except PrefixMissing as error:
        return ComputeFailed(FailureKind.CACHE_MISS, str(error))
    except Exception as error:
        reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        return ComputeFailed(FailureKind.INTERNAL, reason)


def _positions_held(cache: list[Any]) -> int | None:
    """Positions a request's caches hold (None: no layer counts them, e.g. recurrent only)."""
    held = {layer.offset for layer in cache if hasattr(layer, "offset")}
    if len(held) > 1:
        return -1  # layers disagree: a step failed part way; never kept
    return held.pop() if held else None


def _evaluate(output: mx.array) -> None:
    """Compute thread: evaluate a step's graph, and once MLX has it, let the loop's waiting
    work (an origin's client stream) run beside it (:func:`meshd.runtime.compute.computing`)."""
    mx.async_eval(output)
    computing()
    mx.eval(output)
