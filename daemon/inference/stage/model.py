"""One pipeline stage as it runs: its layers, its caches per request, and how its layers attend.

A :class:`StageModel` is a contiguous layer range of a model (plus the embedding on the first
stage and the final norm and head on the last), made of mlx-lm's own decoder layers and run
exactly as the model's own ``__call__`` runs them: one mask per layer kind, built by mlx-lm's
functions from the cache of the stage's first layer of that kind. A layer's kind is read from
the cache the model's ``make_cache()`` gives it: ``KVCache`` -> full causal attention,
``RotatingKVCache`` -> sliding window of its size, ``ArraysCache`` -> recurrent (linear
attention) state with an "ssm" mask. Models index those caches by position in the whole model
(``cache[self.fa_idx]``); a stage finds its own first layer of each kind instead, which is what
mlx-lm's ``pipeline()`` does for the models that have one. Chained stages therefore compute
the same floating-point operations as one mlx-lm process: logits are bit-identical
(tests/test_architectures.py).

Chunked prefill: the prompt is cut into chunks (:func:`prefill_chunks`); each stage advances
its own per-request caches by each chunk, in order. Only the last stage applies
:meth:`StageModel.head`. :meth:`StageModel.run` is exactly one stage's part of a chunk.
How a stage is loaded is :mod:`meshd.inference.stage.shard`'s business.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from meshd.runtime.lazy_imports import import_model_runtime

# Any thread may import this module first: mlx-lm's own import web runs once, under one
# lock (concurrent first imports fail with "deadlock detected by _ModuleLock").
import_model_runtime()
from mlx_lm.models.base import create_attention_mask, create_ssm_mask  # noqa: E402
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache  # noqa: E402

MAX_OPEN_REQUESTS = 64

Cache = list[Any]


class UnsupportedModel(ValueError):
    """The model's family or a feature of its config cannot be run as pipeline stages."""


class StageLoadError(ValueError):
    """The model directory lacks what a stage needs (files, tensors, a valid layer range)."""


class TooManyRequests(RuntimeError):
    """A stage was asked to hold more concurrent request caches than its limit."""


@dataclass(frozen=True)
class StageRecipe:
    """What a stage needs to know about an architecture beyond what mlx-lm's objects say.

    ``full_mask_as_array``: the model builds its full-attention mask with ``return_array=True``
    (DeepSeek's multi-head latent attention adds the mask to its scores, so it needs an array
    where other models pass the string "causal").
    ``batched``: several requests' decode steps may run in one forward pass on mlx-lm's batch
    caches (per-row positions); False decodes each request alone (tests/test_batching.py
    checks every architecture either way).
    """

    full_mask_as_array: bool = False
    batched: bool = True


@dataclass(frozen=True)
class _LayerKind:
    """How one layer attends, read from the cache mlx-lm gives it (see the module docstring)."""

    kind: Literal["full", "window", "ssm"]
    window: int | None = None

    @staticmethod
    def of(cache: Any, index: int) -> _LayerKind:
        if isinstance(cache, ArraysCache):
            return _LayerKind("ssm")
        if type(cache) is RotatingKVCache:
            return _LayerKind("window", cache.max_size)
        if type(cache) is KVCache:
            return _LayerKind("full")
        raise UnsupportedModel(
            f"Layer {index} keeps a {type(cache).__name__} cache; stages know the masks of "
            "KVCache (full attention), RotatingKVCache (sliding window) and ArraysCache "
            "(linear attention) layers only."
        )

    def mask(self, hidden: mx.array, cache: Any, recipe: StageRecipe) -> Any:
        """The mask mlx-lm's inner model builds for layers of this kind."""
        if self.kind == "ssm":
            return create_ssm_mask(hidden, cache)
        if self.kind == "window":
            return create_attention_mask(hidden, cache, window_size=self.window)
        return create_attention_mask(hidden, cache, return_array=recipe.full_mask_as_array)


@dataclass(frozen=True)
class _TextModel:
    """Where a model keeps its text parts: the inner model (embed_tokens, layers, norm) and the
    module that owns the head (``lm_head``, absent when the embedding is tied) and the args."""

    inner: nn.Module
    head_owner: nn.Module

    @staticmethod
    def locate(model: nn.Module) -> _TextModel:
        """The text parts of a model already checked by :meth:`of` (pruned ones too)."""
        # Vision-language wrappers (qwen3_5) keep the text model under language_model.
        head_owner = model.get("language_model", model)
        return _TextModel(head_owner.model, head_owner)

    @staticmethod
    def of(model: nn.Module, architecture: str) -> _TextModel:
        """The text parts of a whole model, which must have them where stages expect them."""
        head_owner = model.get("language_model", model)
        inner = getattr(head_owner, "model", None)
        missing = [
            name
            for name in ("embed_tokens", "layers", "norm")
            if inner is None or name not in inner
        ]
        if missing or not hasattr(head_owner, "args"):
            raise UnsupportedModel(
                f"mlx-lm's {architecture} model has no {', '.join(missing) or 'args'} where a "
                "stage expects it (model.model.embed_tokens/layers/norm, model.args)."
            )
        return _TextModel(inner, head_owner)

    @property
    def lm_head(self) -> nn.Module | None:
        return self.head_owner.get("lm_head")

    @property
    def args(self) -> Any:
        return self.head_owner.args


class StageModel:
    """Layers ``[start, end)`` of a model, plus embedding and/or head when the stage owns them.

    Built by :func:`load_stage`; the caller keeps one cache (``make_cache()``) per request.
    """

    def __init__(
        self,
        model: nn.Module,
        config: dict[str, Any],
        layer_range: tuple[int, int],
        *,
        has_embedding: bool,
        has_head: bool,
        empty_caches: list[Any],
        num_model_layers: int,
        architecture: str = "llama",
        recipe: StageRecipe | None = None,
    ) -> None:
        self._model = model
        self._text = _TextModel.locate(model)
        self._inner = self._text.inner
        self._config = config
        self._layer_range = layer_range
        self._has_embedding = has_embedding
        self._has_head = has_head
        self._num_model_layers = num_model_layers
        self._architecture = architecture
        self._recipe = recipe or StageRecipe()
        self._layers = list(self._inner.layers[layer_range[0] : layer_range[1]])
        if len(empty_caches) != len(self._layers):
            raise ValueError(
                f"{len(empty_caches)} caches given for the {len(self._layers)} layers of "
                f"stage {layer_range}."
            )
        self._empty_caches = empty_caches
        # What load_stage took over from an earlier stage instead of reading it (see there).
        self.adopted_layers = 0
        self.adopted_bytes = 0
        self._kinds = [
            _LayerKind.of(cache, layer_range[0] + offset)
            for offset, cache in enumerate(empty_caches)
        ]
        # The prefix cache's kept prefixes of these layers, by slot id (the stage core's
        # :class:`meshd.inference.stage.prefix.PrefixIndex` says which): plans that share
        # these weights share them too.
        self.slots: dict[int, Cache] = {}
        # Asked for every step the stage runtime schedules: decided once, here.
        self._batchable = self._recipe.batched and all(
            hasattr(type(cache), "merge") for cache in empty_caches
        )

    @property
    def layer_start(self) -> int:
        return self._layer_range[0]

    @property
    def layer_end(self) -> int:
        return self._layer_range[1]

    @property
    def layer_range(self) -> tuple[int, int]:
        """``(start, end)``: this stage runs layers ``start <= i < end`` of the full model."""
        return self._layer_range

    @property
    def num_model_layers(self) -> int:
        """Number of layers of the whole model (not just this stage)."""
        return self._num_model_layers

    @property
    def architecture(self) -> str:
        """The mlx-lm model module this stage runs (``mlx_lm.models.<architecture>``)."""
        return self._architecture

    @property
    def layer_kinds(self) -> list[str]:
        """Per layer of the stage: "full", "window" or "ssm" (see the module docstring)."""
        return [kind.kind for kind in self._kinds]

    @property
    def has_embedding(self) -> bool:
        return self._has_embedding

    @property
    def prefix_trimmable(self) -> bool:
        """Whether a kept prefix can be cut at any position: every layer a plain KV cache
        (sliding-window and recurrent caches cannot drop positions)."""
        return all(type(cache) is KVCache for cache in self._empty_caches)

    @property
    def batchable(self) -> bool:
        """Whether requests may decode together here (:meth:`RequestCaches.batch`): the
        architecture's recipe allows it and every layer's cache has a batch variant."""
        return self._batchable

    @property
    def has_head(self) -> bool:
        return self._has_head

    @property
    def hidden_size(self) -> int:
        return int(self._text.args.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self._text.args.vocab_size)

    @property
    def dtype(self) -> mx.Dtype:
        """Dtype of the hidden states: that of the stage's first floating-point parameter."""
        for _, value in tree_flatten(self._model.parameters()):
            if mx.issubdtype(value.dtype, mx.floating):
                return value.dtype
        raise StageLoadError("The stage holds no floating-point parameters.")

    def layer_module(self, index: int) -> nn.Module:
        """Layer ``index`` of the full model (within this stage's range): a newer stage of the
        same model that also runs it adopts the module instead of reading it again."""
        if not self.layer_start <= index < self.layer_end:
            raise IndexError(f"layer {index} is not in stage {self._layer_range}")
        return self._layers[index - self.layer_start]

    @property
    def embedding(self) -> nn.Module | None:
        """The token embedding, when this stage holds it (first stage, or a tied head)."""
        return self._inner.get("embed_tokens")

    @property
    def nbytes(self) -> int:
        """Bytes of parameters this stage actually holds."""
        return sum(value.nbytes for _, value in tree_flatten(self._model.parameters()))

    @property
    def config(self) -> dict[str, Any]:
        return dict(self._config)

    def make_cache(self) -> Cache:
        """Fresh caches for this stage's layers only: copies of the empty caches the model's
        own ``make_cache()`` gave these layers (KV, rotating or recurrent)."""
        return [copy.deepcopy(cache) for cache in self._empty_caches]

    def embed(self, tokens: mx.array) -> mx.array:
        """Token ids ``(T,)`` or ``(1, T)`` -> hidden states ``(1, T, hidden)`` (first stage)."""
        if not self._has_embedding:
            raise RuntimeError(
                f"Stage {self._layer_range} has no embedding; only the first stage embeds tokens."
            )
        if tokens.ndim == 1:
            tokens = tokens[None]
        return self._inner.embed_tokens(tokens)

    def forward(self, hidden: mx.array, cache: Cache | None) -> mx.array:
        """Run this stage's layers on ``hidden`` ``(1, n, hidden)``, advancing ``cache`` by ``n``.

        The result is lazy; evaluate it (``mx.eval``) before sending it to the next stage.
        """
        if cache is None:
            cache = [None] * len(self._layers)
        if len(cache) != len(self._layers):
            raise ValueError(
                f"Cache has {len(cache)} entries but stage {self._layer_range} has "
                f"{len(self._layers)} layers; use this stage's make_cache()."
            )
        masks = self._masks(hidden, cache)
        for layer, layer_cache, kind in zip(self._layers, cache, self._kinds, strict=True):
            hidden = layer(hidden, masks[kind], cache=layer_cache)
        return hidden

    def _masks(self, hidden: mx.array, cache: Cache) -> dict[_LayerKind, Any]:
        """One mask per layer kind, from the cache of the stage's first layer of that kind.

        This is what the mlx-lm model does with ``cache[fa_idx]`` / ``cache[ssm_idx]`` /
        ``cache[0]``; all layers of one kind have seen the same tokens, so the first one in the
        stage stands for all of them.
        """
        masks: dict[_LayerKind, Any] = {}
        for kind, layer_cache in zip(self._kinds, cache, strict=True):
            if kind not in masks:
                masks[kind] = kind.mask(hidden, layer_cache, self._recipe)
        return masks

    def run(self, inputs: mx.array, cache: Cache | None, *, logits: str = "last") -> mx.array:
        """What this stage does with one chunk, as one lazy graph: embed the token ids if it is
        the first stage, run its layers, and, if it is the last, apply the head to the ``"last"``
        position, to ``"all"`` positions, or (``"none"``, for prompt chunks before the last one)
        not at all. Returns hidden states or logits."""
        if logits not in ("last", "all", "none"):
            raise ValueError(f"logits must be 'last', 'all' or 'none', got {logits!r}.")
        hidden = self.embed(inputs) if self._has_embedding else inputs
        hidden = self.forward(hidden, cache)
        if not self._has_head or logits == "none":
            return hidden
        return self.head(hidden[:, -1:, :] if logits == "last" else hidden)

    def head(self, hidden: mx.array) -> mx.array:
        """Final norm and LM head (or the tied embedding) -> logits; last stage only."""
        if not self._has_head:
            raise RuntimeError(
                f"Stage {self._layer_range} has no head; only the last stage computes logits."
            )
        normed = self._inner.norm(hidden)
        lm_head = self._text.lm_head
        if lm_head is None:
            return self._inner.embed_tokens.as_linear(normed)
        return lm_head(normed)


class RequestCaches:
    """The KV caches one stage keeps per request, freed when the request ends.

    Bounded: opening more than ``max_requests`` raises instead of silently evicting a live one.

    Continuous batching (:meth:`batch`): requests that decode together keep their caches
    merged in a *group* (mlx-lm's batch caches: ``BatchKVCache``, ``BatchRotatingKVCache``,
    ``ArraysCache``, left-padded to a common length), as mlx-lm's ``BatchGenerator`` does: a
    request is prefilled alone on its own cache, merged into a group when it first decodes
    with others, and filtered out when it leaves. A group is reused as long as the same
    requests step together; only a change of company copies caches (merge, extend, filter).
    A request that runs alone (:meth:`get`) always runs on its own plain cache, so a request
    alone computes exactly what one mlx-lm process computes.
    """

    def __init__(self, stage: StageModel, max_requests: int = MAX_OPEN_REQUESTS) -> None:
        self._stage = stage
        self._max_requests = max_requests
        self._caches: OrderedDict[str, Cache] = OrderedDict()  # requests not in a group
        self._groups: dict[str, _Group] = {}  # request id -> the group it decodes in

    def get(self, request_id: str) -> Cache:
        """The plain cache of ``request_id`` (taken out of its group if it is in one), created
        empty on first use."""
        cache = self._caches.get(request_id)
        if cache is not None:
            return cache
        if request_id in self._groups:
            self._take_out(self._groups[request_id], [request_id])
            return self._caches[request_id]
        if len(self) >= self._max_requests:
            raise TooManyRequests(
                f"This stage already holds {len(self)} request caches (limit "
                f"{self._max_requests}); release finished requests first."
            )
        cache = self._stage.make_cache()
        self._caches[request_id] = cache
        return cache

    def batch(self, request_ids: Sequence[str]) -> tuple[Cache, list[str]]:
        """Batched caches whose rows are exactly ``request_ids`` (each already holding a cache:
        its prefill ran alone), and the request of each row, in row order (the group's order,
        which may differ from the order asked)."""
        wanted = set(request_ids)
        if len(wanted) != len(request_ids) or len(wanted) < 2:
            raise ValueError("a batch has two rows or more, one per request")
        missing = [rid for rid in request_ids if rid not in self]
        if missing:
            raise RuntimeError(f"no cache for {missing[0]}: its prefill has not run here")
        groups = {id(group): group for rid in request_ids if (group := self._groups.get(rid))}
        for group in groups.values():
            if set(group.ids) == wanted:
                return group.cache, list(group.ids)
        pieces: list[_Group] = []
        for group in groups.values():
            outside = [rid for rid in group.ids if rid not in wanted]
            if outside:
                self._take_out(group, [rid for rid in group.ids if rid in wanted])
            else:
                self._forget(group)
                pieces.append(group)
        alone = [rid for rid in request_ids if rid in self._caches]
        if alone:
            caches = [self._caches.pop(rid) for rid in alone]
            merged = [_merge_layer(list(layer)) for layer in zip(*caches, strict=True)]
            pieces.append(_Group(alone, merged))
        group = pieces[0]
        for piece in pieces[1:]:
            for mine, theirs in zip(group.cache, piece.cache, strict=True):
                mine.extend(theirs)
            group.ids.extend(piece.ids)
        for rid in group.ids:
            self._groups[rid] = group
        return group.cache, list(group.ids)

    def adopt(self, request_id: str, cache: Cache) -> None:
        """``request_id`` starts on ``cache`` (a kept prefix's) instead of empty caches."""
        if request_id not in self and len(self) >= self._max_requests:
            raise TooManyRequests(
                f"This stage already holds {len(self)} request caches (limit "
                f"{self._max_requests}); release finished requests first."
            )
        self.release(request_id)
        self._caches[request_id] = cache

    def take(self, request_id: str) -> Cache | None:
        """The plain cache of ``request_id``, no longer held here (None if it has none)."""
        if request_id not in self:
            return None
        cache = self.get(request_id)
        del self._caches[request_id]
        return cache

    def release(self, request_id: str) -> None:
        """Drop the cache of ``request_id`` (no error if it has none)."""
        if self._caches.pop(request_id, None) is not None:
            return
        group = self._groups.get(request_id)
        if group is not None:
            self._take_out(group, [request_id])
            self._caches.pop(request_id, None)

    @property
    def groups(self) -> int:
        """Groups of requests whose caches are merged (decoding together)."""
        return len({id(group) for group in self._groups.values()})

    def _take_out(self, group: _Group, leaving: list[str]) -> None:
        """Move ``leaving`` rows of ``group`` to plain caches of their own; a group left with
        one row is dissolved (its request runs alone on a plain cache again)."""
        staying = [rid for rid in group.ids if rid not in leaving]
        if len(staying) < 2:
            leaving, staying = list(group.ids), []
        for rid in leaving:
            row = group.ids.index(rid)
            self._caches[rid] = [layer.extract(row) for layer in group.cache]
            del self._groups[rid]
        if staying:
            rows = mx.array([group.ids.index(rid) for rid in staying])
            for layer in group.cache:
                layer.filter(rows)
            group.ids[:] = staying

    def _forget(self, group: _Group) -> None:
        for rid in group.ids:
            del self._groups[rid]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._caches or request_id in self._groups

    def __len__(self) -> int:
        return len(self._caches) + len(self._groups)


@dataclass(eq=False)
class _Group:
    """Requests whose caches are merged: row ``i`` of every layer cache is ``ids[i]``'s."""

    ids: list[str]
    cache: Cache


def _merge_layer(caches: list[Any]) -> Any:
    """One layer's caches of several requests merged into its batch variant (mlx-lm's)."""
    merge = getattr(type(caches[0]), "merge", None)
    if merge is None:
        raise UnsupportedModel(f"{type(caches[0]).__name__} caches cannot be batched")
    return caches[0].merge(caches)


def prefill_chunks(tokens: mx.array, chunk_size: int) -> list[mx.array]:
    """Cut a prompt ``(T,)`` or ``(1, T)`` into ``(1, <=chunk_size)`` pieces, in order.

    Each piece goes through every stage in turn (see the module docstring); a stage must have
    processed chunk *i* before chunk *i+1*, since each advances its KV cache.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}.")
    if tokens.ndim == 1:
        tokens = tokens[None]
    length = tokens.shape[1]
    if length == 0:
        raise ValueError("Cannot prefill an empty prompt.")
    return [tokens[:, start : start + chunk_size] for start in range(0, length, chunk_size)]


def even_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges covering ``num_layers`` in ``num_stages`` near-equal parts (earlier
    stages take the extra layers). A convenience for tests and benchmarks."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"Need 1 <= num_stages <= {num_layers} layers, got {num_stages}.")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for index in range(num_stages):
        end = start + base + (1 if index < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges
