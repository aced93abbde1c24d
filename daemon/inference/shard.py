"""One pipeline stage of a model: a contiguous layer range run with mlx-lm's own classes.

Why this shape: every node holds only its share of the weights, and mlx-lm knows how to load
every architecture it has (sanitizing checkpoint names, stacking experts, quantization with
per-module overrides, ``quantization_config`` formats, nvfp4 global scales). :func:`load_stage`
therefore loads through ``mlx_lm.utils.load_model`` itself (lazy and non-strict, as mlx-lm's own
``sharded_load`` does), feeding it only the stage's tensors: the safetensors index names the
files that hold them, only those files are opened, and ``mx.load`` is lazy, so nothing but the
stage's own tensors is ever read. The model is then pruned to the stage's layers (plus the
embedding on the first stage and the final norm/head on the last), checked against the
checkpoint as strictly as ``load_weights(strict=True)`` would, and only then evaluated.

The layers are mlx-lm's own decoder layers, called as the model's inner ``__call__`` calls them,
with one mask per layer kind built by mlx-lm's own functions from the cache of the stage's first
layer of that kind. A layer's kind is read from the cache the model's own ``make_cache()`` gives
it: ``KVCache`` -> full causal attention, ``RotatingKVCache`` -> sliding window of its size,
``ArraysCache`` -> recurrent (linear attention) state with an "ssm" mask. Models index those
caches by position in the whole model (``cache[self.fa_idx]``); a stage finds its own first layer
of each kind instead, which is what mlx-lm's ``pipeline()`` does for the models that have one.
Chained stages therefore compute the same floating-point operations as one mlx-lm process:
logits are bit-identical (tests/test_architectures.py). :data:`ARCHITECTURES` lists the
architectures verified this way; anything else is refused with the reason.

Chunked prefill and the data plane (see :func:`prefill_chunks`): the prompt is cut into chunks;
stage 1 embeds chunk *i* and runs its layers; the resulting hidden states ``(1, n_i, hidden)``
go to stage 2, and so on, every stage advancing its own per-request caches by ``n_i``. Chunks
must reach each stage in order. Only the last stage applies :meth:`StageModel.head`, and only to
the last position of the last chunk (the other positions' logits are never needed). Decode steps
are chunks of one token. :meth:`StageModel.run` is exactly one stage's part of a chunk, and
:class:`LocalPipeline` chains stages in one process (the reference for the networked version).
"""

from __future__ import annotations

import copy
import json
import re
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import MODEL_REMAPPING, load_model

from meshd.inference.sampling import SamplingParams, TokenSampler
from meshd.models.info import INDEX_FILE, ModelInfoError, read_safetensors_header

_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
MAX_OPEN_REQUESTS = 64
# Files next to config.json that mlx-lm's load_model reads besides the weights.
_CONFIG_FILES = ("config.json", "generation_config.json", "hf_quant_config.json")

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
    """

    full_mask_as_array: bool = False


# mlx-lm model modules (``mlx_lm.models.<name>``) whose inner loop is "embed_tokens -> layers
# (hidden, mask, cache) with the mask of the layer's kind -> norm" and whose head is lm_head or
# the tied embedding: verified by tests/test_architectures.py and tests/test_shard_exactness.py.
ARCHITECTURES: dict[str, StageRecipe] = {
    "llama": StageRecipe(),  # also mistral and others mlx-lm maps to llama
    "qwen2": StageRecipe(),
    "qwen3": StageRecipe(),
    "mixtral": StageRecipe(),
    "qwen3_moe": StageRecipe(),
    "qwen3_next": StageRecipe(),
    "qwen3_5": StageRecipe(),
    "qwen3_5_moe": StageRecipe(),
    "deepseek_v3": StageRecipe(full_mask_as_array=True),  # also kimi_k2
    "gpt_oss": StageRecipe(),
    "glm4_moe": StageRecipe(),
}
# config.json model types accepted: the modules above and mlx-lm's aliases for them.
SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset(ARCHITECTURES) | frozenset(
    alias for alias, target in MODEL_REMAPPING.items() if target in ARCHITECTURES
)
# Architectures whose inner loop does more than a stage replays, and what exactly.
NOT_SLICEABLE: dict[str, str] = {
    "gemma3_text": (
        "its inner model multiplies the embeddings by sqrt(hidden_size) after embed_tokens, "
        "which a first stage's embedding does not do"
    ),
    "gemma3n": (
        "its layers take per-layer inputs computed from the token ids, some layers reuse other "
        "layers' KV caches, and AltUp carries several hidden streams: what passes between "
        "stages would be more than one (1, n, hidden) tensor"
    ),
    "deepseek_v32": (
        "each layer keeps a CacheList (the attention cache and the sparse-attention indexer's "
        "keys), a cache kind whose mask a stage does not know how to build"
    ),
}


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
        self._recipe = ARCHITECTURES.get(architecture, StageRecipe())
        self._layers = list(self._inner.layers[layer_range[0] : layer_range[1]])
        if len(empty_caches) != len(self._layers):
            raise ValueError(
                f"{len(empty_caches)} caches given for the {len(self._layers)} layers of "
                f"stage {layer_range}."
            )
        self._empty_caches = empty_caches
        self._kinds = [
            _LayerKind.of(cache, layer_range[0] + offset)
            for offset, cache in enumerate(empty_caches)
        ]

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
    prepare: Callable[[nn.Module, list[nn.Module]], None] | None = None,
) -> StageModel:
    """Load layers ``[layer_start, layer_end)`` of the model in ``model_dir`` as one stage.

    mlx-lm's ``load_model`` (lazy, non-strict) builds the model and loads the checkpoint, fed
    with the stage's tensors only: those of its layers, plus the embedding if
    ``has_embedding`` and the final norm and LM head (or the tied embedding) if ``has_head``,
    read from only the files the index names for them. The model is then pruned to the stage,
    its parameters checked against the checkpoint, and evaluated: only the stage's tensors are
    ever read from disk or held in memory.

    ``prepare(model, stage_layers)``, when given, runs on the pruned model while its weights are
    still lazy, just before they are evaluated: a tensor-parallel stage shards its layers there
    (``meshd.inference.tensor_parallel``), so each rank only ever holds its part of them.
    """
    model_dir = Path(model_dir)
    check_model_type(model_dir)
    with _config_only_view(model_dir) as view:
        skeleton = _build(view, model_dir)
        architecture = _architecture_of(skeleton, model_dir)
        text = _TextModel.of(skeleton, architecture)
        num_layers = len(text.inner.layers)
        _check_range(layer_start, layer_end, num_layers)
        # A tied head multiplies by the embedding matrix, so the last stage keeps it too.
        keep_embedding = has_embedding or (has_head and text.lm_head is None)
        checkpoint = _StageCheckpoint(
            model_dir,
            _load_needed_weights(
                model_dir, layer_start, layer_end, keep_embedding=keep_embedding, keep_head=has_head
            ),
        )
        model, config = _build(view, model_dir, checkpoint.model_classes(skeleton))
    del skeleton
    empty_caches = make_prompt_cache(model)[layer_start:layer_end]
    _prune(
        _TextModel.locate(model),
        layer_start,
        layer_end,
        keep_embedding=keep_embedding,
        keep_head=has_head,
    )
    checkpoint.check_stage(model, (layer_start, layer_end))
    checkpoint.release()
    if prepare is not None:
        prepare(model, list(_TextModel.locate(model).inner.layers[layer_start:layer_end]))
    mx.eval(model.parameters())
    return StageModel(
        model,
        config,
        (layer_start, layer_end),
        has_embedding=has_embedding,
        has_head=has_head,
        empty_caches=empty_caches,
        num_model_layers=num_layers,
        architecture=architecture,
    )


@contextmanager
def only_stage_layers(model: nn.Module, layer_range: tuple[int, int]) -> Iterator[list[nn.Module]]:
    """Within the block, the (pruned) model's layer list is exactly the stage's layers.

    mlx-lm's whole-model methods, e.g. ``shard(group)``, walk ``model.model.layers``; a pruned
    stage keeps ``None`` in place of the layers before it (so parameter names keep their layer
    numbers), which those methods cannot walk. The list is restored on exit.
    """
    inner = _TextModel.locate(model).inner
    saved = inner.layers
    stage = list(saved[layer_range[0] : layer_range[1]])
    if any(layer is None for layer in stage):
        raise ValueError(f"Layers {layer_range} are not all loaded in this stage.")
    inner.layers = stage
    try:
        yield stage
    finally:
        inner.layers = saved


def check_model_type(model_dir: Path) -> None:
    """Refuse, with the reason, a model whose config names a type stages cannot run.

    Reads only ``config.json``: cheap enough to call before a model is proposed to the mesh.
    Raises :class:`UnsupportedModel` or :class:`StageLoadError`.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise StageLoadError(
            f"{model_dir} has no config.json; it is not an MLX model directory "
            "(import the model into the model store first)."
        )
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as error:
        raise StageLoadError(f"{config_path} is not a readable JSON object: {error}") from error
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(_unsupported_message(str(model_type), str(model_type), model_dir))


def _unsupported_message(model_type: str, architecture: str, model_dir: Path) -> str:
    reason = NOT_SLICEABLE.get(architecture)
    if reason is not None:
        return f"Model type {model_type!r} in {model_dir} cannot run as pipeline stages: {reason}."
    return (
        f"Model type {model_type!r} in {model_dir} (mlx-lm's {architecture}) has not been "
        "verified to run as pipeline stages; verified: "
        f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}."
    )


@contextmanager
def _config_only_view(model_dir: Path) -> Iterator[Path]:
    """A temporary directory with the model's config files and no weights, for mlx-lm's loader.

    ``load_model`` opens every ``model*.safetensors`` of the directory it is given; handing it
    this view instead, and the stage's tensors through the model's ``sanitize``, keeps the
    files of other stages closed.
    """
    with tempfile.TemporaryDirectory(prefix="meshd-stage-") as folder:
        view = Path(folder)
        for name in _CONFIG_FILES:
            if (model_dir / name).is_file():
                (view / name).symlink_to((model_dir / name).resolve())
        yield view


def _build(
    view: Path,
    model_dir: Path,
    get_model_classes: Callable[..., tuple[Any, Any]] | None = None,
) -> Any:
    """``mlx_lm.utils.load_model(view, lazy=True, strict=False)``, its errors made ours.

    Returns the model alone when no ``get_model_classes`` is given (a lazily initialized
    skeleton: no parameter memory is touched), else ``(model, config)``.
    """
    extra = {} if get_model_classes is None else {"get_model_classes": get_model_classes}
    try:
        model, config = load_model(view, lazy=True, strict=False, **extra)
    except (StageLoadError, UnsupportedModel):
        raise
    except ValueError as error:  # mlx-lm: unknown model type, quantization it cannot load
        raise UnsupportedModel(f"mlx-lm cannot load the model in {model_dir}: {error}") from error
    except (KeyError, TypeError, IndexError) as error:  # config fields or tensors it needs
        raise StageLoadError(
            f"mlx-lm cannot build the model in {model_dir} from its config.json and "
            f"checkpoint: {type(error).__name__}: {error}"
        ) from error
    return model if get_model_classes is None else (model, config)


def _architecture_of(model: nn.Module, model_dir: Path) -> str:
    """The mlx-lm model module of ``model``, which must be one stages are verified for."""
    architecture = type(model).__module__.rsplit(".", 1)[-1]
    if architecture not in ARCHITECTURES:
        model_type = str(getattr(model, "model_type", architecture))
        raise UnsupportedModel(_unsupported_message(model_type, architecture, model_dir))
    return architecture


class _StageCheckpoint:
    """The stage's tensors, handed to mlx-lm's loader, and what its ``sanitize`` made of them.

    ``load_model`` calls ``model.sanitize(weights)`` before it quantizes the model and loads the
    weights; the model class :meth:`model_classes` gives it returns the stage's tensors there,
    sanitized by the real model's own ``sanitize``, so every checkpoint format mlx-lm knows is
    handled by mlx-lm.
    """

    def __init__(self, model_dir: Path, tensors: dict[str, mx.array]) -> None:
        self._model_dir = model_dir
        self._tensors = tensors
        self._sanitized: dict[str, mx.array] | None = None

    def model_classes(self, skeleton: nn.Module) -> Callable[..., tuple[Any, Any]]:
        """A ``get_model_classes`` for ``load_model``: the skeleton's classes, fed by us."""
        base = type(skeleton)
        checkpoint = self

        class StageCheckpointModel(base):  # type: ignore[misc, valid-type]
            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                # ``weights`` is empty: the view load_model was given holds no weight files.
                return checkpoint._sanitize(self, base, weights)

        StageCheckpointModel.__qualname__ = f"{base.__qualname__}[stage]"
        args_class = type(skeleton.args)
        return lambda config: (StageCheckpointModel, args_class)

    def _sanitize(
        self, model: nn.Module, base: type, weights: dict[str, mx.array]
    ) -> dict[str, mx.array]:
        tensors = {**weights, **self._tensors}
        if hasattr(base, "sanitize"):
            tensors = base.sanitize(model, tensors)
        self._check_shapes(model, tensors)
        self._sanitized = tensors
        return tensors

    def _check_shapes(self, model: nn.Module, tensors: dict[str, mx.array]) -> None:
        """Every tensor has the shape the (not yet quantized) model expects; for a quantized
        weight, all but its packed last axis."""
        expected = dict(tree_flatten(model.parameters()))
        wrong = []
        for name, tensor in tensors.items():
            param = expected.get(name)
            if param is None:
                continue  # quantization scales and biases, or extras (see check_stage)
            want, got = param.shape, tensor.shape
            if name.endswith(".weight") and f"{name[: -len('weight')]}scales" in tensors:
                want, got = want[:-1], got[:-1]
            if want != got:
                wrong.append(
                    f"{name}: {tensor.shape} in the checkpoint, {param.shape} in the model"
                )
        if wrong:
            raise StageLoadError(
                f"The weights in {self._model_dir} do not match its config.json: "
                f"{'; '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}."
            )

    def check_stage(self, model: nn.Module, layer_range: tuple[int, int]) -> None:
        """The pruned model's parameters are exactly the stage's sanitized tensors, as
        ``load_weights(strict=True)`` would insist (mlx-lm's non-strict load does not)."""
        if self._sanitized is None:
            raise StageLoadError(
                f"mlx-lm's loader did not call the model's sanitize for {self._model_dir}; "
                "this mlx-lm version loads differently from the one stages were built for."
            )
        params = {name for name, _ in tree_flatten(model.parameters())}
        missing = sorted(params - self._sanitized.keys())
        extra = sorted(self._sanitized.keys() - params)
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"lacks {len(missing)} tensors the stage needs ({_some(missing)})")
            if extra:
                parts.append(f"has {len(extra)} tensors the model does not use ({_some(extra)})")
            raise StageLoadError(
                f"The checkpoint in {self._model_dir}, for layers [{layer_range[0]}, "
                f"{layer_range[1]}), {' and '.join(parts)}. Re-import or re-fetch the model; a "
                "Hugging Face checkpoint mlx-lm cannot sanitize per stage (e.g. per-expert "
                "tensors split over files) must be converted with mlx_lm.convert first."
            )

    def release(self) -> None:
        """Drop the references to the tensors: from here on only the model holds them, so a
        tensor ``prepare`` replaces (a tensor-parallel rank's whole tensor, once its slice is
        evaluated) is freed instead of staying in memory until the stage is loaded."""
        self._tensors = {}
        self._sanitized = {}


def _some(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def _check_range(start: int, end: int, num_layers: int) -> None:
    if not 0 <= start < end <= num_layers:
        raise StageLoadError(
            f"Layer range [{start}, {end}) is not a non-empty range within the model's "
            f"{num_layers} layers."
        )


def _prune(
    text: _TextModel, start: int, end: int, *, keep_embedding: bool, keep_head: bool
) -> None:
    """Drop every module the stage does not run, before any weight is evaluated.

    Layers before ``start`` become ``None`` (as mlx-lm's PipelineMixin does) so that parameter
    names keep the checkpoint's layer numbers; layers from ``end`` on are cut off.
    """
    inner = text.inner
    layers = list(inner.layers[:end])
    layers[:start] = [None] * start
    inner.layers = layers
    if not keep_embedding:
        del inner.embed_tokens
    if not keep_head:
        del inner.norm
        if text.lm_head is not None:
            del text.head_owner.lm_head


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
    try:
        return list(read_safetensors_header(path))
    except ModelInfoError as error:
        raise StageLoadError(str(error)) from error


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
