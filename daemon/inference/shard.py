"""One pipeline stage of a model: a contiguous layer range run with mlx-lm's own classes.

Why this shape: every node holds only its share of the weights. :func:`load_stage` builds the
mlx-lm ``Model`` from ``config.json`` (construction is lazy in MLX, so the random initial weights
of layers we drop are never computed), prunes it to the stage's layers (plus the embedding on the
first stage and the final norm/head on the last), and loads only the tensors those modules need,
lazily, from only the safetensors files that hold them. Nothing else is ever materialized.

The layers themselves are mlx-lm's ``TransformerBlock`` objects, called exactly as the model's
own ``__call__`` calls them, with the attention mask built by the same function from the cache of
the stage's first layer of each attention kind. Chained stages therefore compute the same
floating-point operations as one mlx-lm process: logits are bit-identical (tested).

Chunked prefill and the data plane (see :func:`prefill_chunks`): the prompt is cut into chunks;
stage 1 embeds chunk *i* and runs its layers; the resulting hidden states ``(1, n_i, hidden)``
go to stage 2, and so on, every stage advancing its own per-request KV cache by ``n_i``. Chunks
must reach each stage in order. Only the last stage applies :meth:`StageModel.head`, and only to
the last position of the last chunk (the other positions' logits are never needed). Decode steps
are chunks of one token. :meth:`StageModel.run` is exactly one stage's part of a chunk, and
:class:`LocalPipeline` chains stages in one process (the reference for the networked version).
"""

from __future__ import annotations

import json
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes, infer_quant_config, load_config

from meshd.inference.sampling import SamplingParams, TokenSampler
from meshd.models.info import INDEX_FILE

# Families whose inner model is "embed_tokens -> layers(h, mask, cache) -> norm" with nothing
# else in between, which is what StageModel reproduces. Others need checking before adding.
SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
MAX_OPEN_REQUESTS = 64

Cache = list[Any]


class UnsupportedModel(ValueError):
    """The model's family or a feature of its config cannot be run as pipeline stages."""


class StageLoadError(ValueError):
    """The model directory lacks what a stage needs (files, tensors, a valid layer range)."""


class TooManyRequests(RuntimeError):
    """A stage was asked to hold more concurrent request caches than its limit."""


@dataclass(frozen=True)
class _LayerKind:
    """How one layer attends: full causal attention or a sliding window of ``window`` tokens."""

    sliding: bool
    window: int | None


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
        cache_factories: list[Callable[[], Any]],
    ) -> None:
        self._model = model
        self._inner = model.model
        self._config = config
        self._layer_range = layer_range
        self._has_embedding = has_embedding
        self._has_head = has_head
        self._tied = bool(getattr(model.args, "tie_word_embeddings", False))
        self._layers = list(self._inner.layers[layer_range[0] : layer_range[1]])
        self._kinds = [self._layer_kind(layer) for layer in self._layers]
        self._cache_factories = cache_factories

    def _layer_kind(self, layer: nn.Module) -> _LayerKind:
        """Sliding-window layers (llama's ``layer_types``) get their own mask, as in mlx-lm."""
        if getattr(layer, "use_sliding", False):
            return _LayerKind(sliding=True, window=getattr(self._inner, "sliding_window", None))
        return _LayerKind(sliding=False, window=None)

    @property
    def layer_range(self) -> tuple[int, int]:
        """``(start, end)``: this stage runs layers ``start <= i < end`` of the full model."""
        return self._layer_range

    @property
    def num_model_layers(self) -> int:
        """Number of layers of the whole model (not just this stage)."""
        return int(self._config["num_hidden_layers"])

    @property
    def has_embedding(self) -> bool:
        return self._has_embedding

    @property
    def has_head(self) -> bool:
        return self._has_head

    @property
    def hidden_size(self) -> int:
        return int(self._config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self._config["vocab_size"])

    @property
    def dtype(self) -> mx.Dtype:
        """Dtype of the hidden states: that of the stage's first floating-point parameter."""
        for _, value in tree_flatten(self._model.parameters()):
            if mx.issubdtype(value.dtype, mx.floating):
                return value.dtype
        raise StageLoadError("The stage holds no floating-point parameters.")

    @property
    def nbytes(self) -> int:
        """Bytes of parameters this stage actually holds."""
        return sum(value.nbytes for _, value in tree_flatten(self._model.parameters()))

    @property
    def config(self) -> dict[str, Any]:
        return dict(self._config)

    def make_cache(self) -> Cache:
        """Fresh KV caches for this stage's layers only (same cache types mlx-lm would make)."""
        return [factory() for factory in self._cache_factories]

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
        """One mask per attention kind, from the cache of the stage's first layer of that kind.

        This is what the mlx-lm model does with ``cache[fa_idx]`` / ``cache[0]``; all layers of
        one kind share the same offset, so the first one in the stage stands for all of them.
        """
        masks: dict[_LayerKind, Any] = {}
        for kind, layer_cache in zip(self._kinds, cache, strict=True):
            if kind not in masks:
                masks[kind] = create_attention_mask(hidden, layer_cache, window_size=kind.window)
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
        if self._tied:
            return self._inner.embed_tokens.as_linear(normed)
        return self._model.lm_head(normed)


class RequestCaches:
    """The KV caches one stage keeps per request, freed when the request ends.

    Bounded: opening more than ``max_requests`` raises instead of silently evicting a live one.
    """

    def __init__(self, stage: StageModel, max_requests: int = MAX_OPEN_REQUESTS) -> None:
        self._stage = stage
        self._max_requests = max_requests
        self._caches: OrderedDict[str, Cache] = OrderedDict()

    def get(self, request_id: str) -> Cache:
        """The cache of ``request_id``, created empty on first use."""
        cache = self._caches.get(request_id)
        if cache is not None:
            return cache
        if len(self._caches) >= self._max_requests:
            raise TooManyRequests(
                f"This stage already holds {len(self._caches)} request caches (limit "
                f"{self._max_requests}); release finished requests first."
            )
        cache = self._stage.make_cache()
        self._caches[request_id] = cache
        return cache

    def release(self, request_id: str) -> None:
        """Drop the cache of ``request_id`` (no error if it has none)."""
        self._caches.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._caches

    def __len__(self) -> int:
        return len(self._caches)


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


def load_stage(
    model_dir: Path,
    layer_start: int,
    layer_end: int,
    *,
    has_embedding: bool,
    has_head: bool,
) -> StageModel:
    """Load layers ``[layer_start, layer_end)`` of the model in ``model_dir`` as one stage.

    Only the tensors of those layers (plus the embedding if ``has_embedding``, the final norm
    and LM head, or the tied embedding, if ``has_head``) are read, and only from the files the
    index names for them. Quantized models (config ``quantization``) are quantized before
    loading, as mlx-lm does.
    """
    model_dir = Path(model_dir)
    config = _read_config(model_dir)
    num_layers = int(config["num_hidden_layers"])
    _check_range(layer_start, layer_end, num_layers)
    model = _build_model(config)
    cache_factories = _cache_factories(model)[layer_start:layer_end]
    tied = bool(getattr(model.args, "tie_word_embeddings", False))
    keep_embedding = has_embedding or (has_head and tied)  # a tied head is the embedding
    _prune(model, layer_start, layer_end, keep_embedding=keep_embedding, keep_head=has_head)
    weights = _load_needed_weights(
        model_dir, layer_start, layer_end, keep_embedding=keep_embedding, keep_head=has_head
    )
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    _quantize_if_configured(model, config, weights)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as error:
        raise StageLoadError(
            f"The weights in {model_dir} do not match layers [{layer_start}, {layer_end}) of "
            f"its config: {error}"
        ) from error
    mx.eval(model.parameters())
    return StageModel(
        model,
        config,
        (layer_start, layer_end),
        has_embedding=has_embedding,
        has_head=has_head,
        cache_factories=cache_factories,
    )


def _read_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` (via mlx-lm, so generation_config's eos is merged) with a clear error."""
    if not (model_dir / "config.json").is_file():
        raise StageLoadError(
            f"{model_dir} has no config.json; it is not an MLX model directory "
            "(import the model into the model store first)."
        )
    config = load_config(model_dir)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"Model type {model_type!r} in {model_dir} cannot run as pipeline stages yet; "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}."
        )
    return config


def _check_range(start: int, end: int, num_layers: int) -> None:
    if not 0 <= start < end <= num_layers:
        raise StageLoadError(
            f"Layer range [{start}, {end}) is not a non-empty range within the model's "
            f"{num_layers} layers."
        )


def _build_model(config: dict[str, Any]) -> nn.Module:
    """The full mlx-lm model, lazily initialized (no parameter memory is touched yet)."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise UnsupportedModel(
            f"mlx-lm's {model_class.__module__}.Model has no model.layers to slice into stages."
        )
    return model


def _cache_factories(model: nn.Module) -> list[Callable[[], Any]]:
    """Per layer, how to make the cache mlx-lm's ``make_prompt_cache`` would give that layer.

    Asked of the full model before pruning, so sliding-window layers get rotating caches.
    """
    factories: list[Callable[[], Any]] = []
    for cache in make_prompt_cache(model):
        if type(cache) is KVCache:
            factories.append(KVCache)
        elif type(cache) is RotatingKVCache:
            factories.append(partial(RotatingKVCache, max_size=cache.max_size, keep=cache.keep))
        else:
            raise UnsupportedModel(
                f"Layer cache type {type(cache).__name__} is not supported for pipeline stages."
            )
    return factories


def _prune(
    model: nn.Module, start: int, end: int, *, keep_embedding: bool, keep_head: bool
) -> None:
    """Drop every module the stage does not run, before any weight is loaded or evaluated.

    Layers before ``start`` become ``None`` (as mlx-lm's PipelineMixin does) so that parameter
    names keep the checkpoint's layer numbers; layers from ``end`` on are cut off.
    """
    inner = model.model
    layers = list(inner.layers[:end])
    layers[:start] = [None] * start
    inner.layers = layers
    if not keep_embedding:
        del inner.embed_tokens
    if not keep_head:
        del inner.norm
        if "lm_head" in model:
            del model.lm_head


def _load_needed_weights(
    model_dir: Path, start: int, end: int, *, keep_embedding: bool, keep_head: bool
) -> dict[str, mx.array]:
    """Lazy arrays for exactly the stage's tensors, opening only the files that hold them."""
    weight_map = read_weight_map(model_dir)
    needed = {
        name: file_name
        for name, file_name in weight_map.items()
        if _is_needed(name, start, end, keep_embedding=keep_embedding, keep_head=keep_head)
    }
    weights: dict[str, mx.array] = {}
    for file_name in sorted(set(needed.values())):
        file_tensors = mx.load(str(model_dir / file_name))  # lazy: nothing is read yet
        for name in (n for n, f in needed.items() if f == file_name):
            if name not in file_tensors:
                raise StageLoadError(
                    f"{model_dir / INDEX_FILE} says {name} is in {file_name}, but it is not; "
                    "the index is stale: re-import the model."
                )
            weights[name] = file_tensors[name]
    return weights


def _is_needed(name: str, start: int, end: int, *, keep_embedding: bool, keep_head: bool) -> bool:
    """Whether tensor ``name`` belongs to the stage: its layers, embedding or norm/head."""
    match = _LAYER_NAME.search(name)
    if match is not None:
        return start <= int(match.group(1)) < end
    if "embed_tokens" in name:
        return keep_embedding
    return keep_head


def read_weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or, failing that, the files' headers."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        return dict(json.loads(index_path.read_text())["weight_map"])
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise StageLoadError(f"{model_dir} has no model*.safetensors files.")
    return {name: path.name for path in files for name in safetensors_tensor_names(path)}


def safetensors_tensor_names(path: Path) -> list[str]:
    """Names of the tensors in a safetensors file, read from its header alone."""
    with open(path, "rb") as handle:
        (header_length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_length))
    return [name for name in header if name != "__metadata__"]


def write_sharded_safetensors(
    path: Path,
    weights: dict[str, mx.array],
    *,
    max_shard_bytes: int,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Save ``weights`` as ``model-XXXXX-of-YYYYY.safetensors`` plus ``INDEX_FILE``.

    Consumes ``weights`` (entries are removed as they are written) so lazy arrays, e.g. a
    dequantization, are computed one file at a time and freed after it: peak memory stays near
    one file. Tensors go in natural name order, so a layer's tensors share a file and a stage
    opens few files. ``progress(tensors_written)`` is called after each file.
    """
    names = sorted(weights, key=_natural_key)
    groups = _group_by_size([(name, weights[name].nbytes) for name in names], max_shard_bytes)
    file_names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    total_size = 0
    written = 0
    for file_name, group in zip(file_names, groups, strict=True):
        shard = {name: weights.pop(name) for name in group}
        mx.save_safetensors(str(path / file_name), shard, metadata={"format": "mlx"})
        total_size += sum(value.nbytes for value in shard.values())
        weight_map.update(dict.fromkeys(group, file_name))
        written += len(group)
        del shard
        if progress is not None:
            progress(written)
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    temp = path / f".{INDEX_FILE}.tmp"
    temp.write_text(json.dumps(index, indent=2))
    temp.replace(path / INDEX_FILE)
    return file_names


def _group_by_size(sized_names: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor gets a group of its own)."""
    groups: list[list[str]] = []
    group_bytes = 0
    for name, size in sized_names:
        if not groups or (groups[-1] and group_bytes + size > max_bytes):
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += size
    return groups


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort ``layers.10`` after ``layers.9`` so files hold consecutive layers."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in name.split("."))


def _quantize_if_configured(
    model: nn.Module, config: dict[str, Any], weights: dict[str, mx.array]
) -> None:
    """Swap in quantized modules where the checkpoint has ``.scales``, as mlx-lm's loader does."""
    quantization = config.get("quantization")
    if quantization is None:
        if config.get("quantization_config"):
            raise UnsupportedModel(
                "This model uses a 'quantization_config' format; convert it with "
                "mlx_lm.convert (which writes 'quantization') before loading it as stages."
            )
        return

    def class_predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=class_predicate,
    )


class LocalPipeline:
    """Stages chained in one process: the reference for the networked data plane.

    Each stage's output is evaluated before the next stage runs, as if it were sent over the
    network, so this also measures what the stages cost without any transport.
    """

    def __init__(self, stages: Sequence[StageModel]) -> None:
        _check_chain(stages)
        self.stages = list(stages)

    @classmethod
    def load(cls, model_dir: Path, ranges: Sequence[tuple[int, int]]) -> LocalPipeline:
        """Load one stage per range; the first gets the embedding, the last the head."""
        last = len(ranges) - 1
        return cls(
            [
                load_stage(model_dir, start, end, has_embedding=index == 0, has_head=index == last)
                for index, (start, end) in enumerate(ranges)
            ]
        )

    def make_caches(self) -> list[Cache]:
        """One cache per stage for a new request."""
        return [stage.make_cache() for stage in self.stages]

    def run_chunk(self, tokens: mx.array, caches: list[Cache], *, logits: str = "last") -> mx.array:
        """One chunk of ``tokens`` through all stages (see :meth:`StageModel.run` for
        ``logits``), advancing ``caches``. One evaluation per stage, at its boundary, as if its
        output were sent to the next one."""
        payload = tokens if tokens.ndim == 2 else tokens[None]
        for stage, cache in zip(self.stages, caches, strict=True):
            payload = stage.run(payload, cache, logits=logits)
            mx.eval(payload)
        return payload

    def logits(self, tokens: mx.array, caches: list[Cache], *, last_only: bool = True) -> mx.array:
        """Logits ``(1, 1 or n, vocab)`` for one chunk of ``tokens``, advancing ``caches``."""
        return self.run_chunk(tokens, caches, logits="last" if last_only else "all")

    def prefill(self, tokens: mx.array, caches: list[Cache], chunk_size: int = 512) -> mx.array:
        """Prefill the prompt in chunks; logits of its last position ``(1, vocab)``."""
        chunks = prefill_chunks(tokens, chunk_size)
        for chunk in chunks[:-1]:
            self.run_chunk(chunk, caches, logits="none")
        return self.run_chunk(chunks[-1], caches)[:, -1, :]

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        chunk_size: int = 512,
    ) -> Iterator[int]:
        """Yield generated token ids until EOS or ``params.max_tokens`` (stop strings are the
        caller's, see :class:`meshd.inference.sampling.StopChecker`). The request's caches die
        with it."""
        caches = self.make_caches()
        sampler = TokenSampler(params)
        context = list(prompt_ids)
        logits = self.prefill(mx.array(context), caches, chunk_size)
        for _ in range(params.max_tokens):
            token = sampler.sample(logits, context)
            yield token
            if token in eos_token_ids:
                return
            context.append(token)
            logits = self.logits(mx.array([[token]]), caches)[:, -1, :]


def _check_chain(stages: Sequence[StageModel]) -> None:
    """Stages must cover the model's layers contiguously, embedding first and head last."""
    if not stages:
        raise ValueError("A pipeline needs at least one stage.")
    if not stages[0].has_embedding or not stages[-1].has_head:
        raise ValueError("The first stage must hold the embedding and the last one the head.")
    expected_start = 0
    for stage in stages:
        start, end = stage.layer_range
        if start != expected_start:
            raise ValueError(
                f"Stage ranges are not contiguous: expected a stage starting at layer "
                f"{expected_start}, got [{start}, {end})."
            )
        expected_start = end
    if expected_start != stages[-1].num_model_layers:
        raise ValueError(
            f"Stages end at layer {expected_start} but the model has "
            f"{stages[-1].num_model_layers} layers."
        )
