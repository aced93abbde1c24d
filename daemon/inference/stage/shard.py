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
logits are bit-identical (tests/test_architectures.py). :mod:`meshd.models.architectures`
says which architectures were verified this way (by running each); anything else is refused
with the reason.

Chunked prefill and the data plane (see :func:`prefill_chunks`): the prompt is cut into chunks;
stage 1 embeds chunk *i* and runs its layers; the resulting hidden states ``(1, n_i, hidden)``
go to stage 2, and so on, every stage advancing its own per-request caches by ``n_i``. Chunks
must reach each stage in order. Only the last stage applies :meth:`StageModel.head`, and only to
the last position of the last chunk (the other positions' logits are never needed). Decode steps
are chunks of one token. :meth:`StageModel.run` is exactly one stage's part of a chunk, and
:class:`LocalPipeline` chains stages in one process (the reference for the networked version).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from meshd.runtime.lazy_imports import import_model_runtime
from meshd.runtime.scratch import scratch_directory

# Any thread may import this module first: mlx-lm's own import web runs once, under one
# lock (concurrent first imports fail with "deadlock detected by _ModuleLock").
import_model_runtime()
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import _get_classes, load_model  # noqa: E402

from meshd.inference.stage.model import (  # noqa: E402
    StageLoadError,
    StageModel,
    StageRecipe,
    UnsupportedModel,
    _TextModel,
)
from meshd.models.architectures import (  # noqa: E402
    model_refusal,
    pipeline_refusal,
    unsupported_model_message,
)
from meshd.models.safetensors import ModelInfoError, load_stage_tensors  # noqa: E402

# Files next to config.json that mlx-lm's load_model reads besides the weights.
_CONFIG_FILES = ("config.json", "generation_config.json", "hf_quant_config.json")


# What a stage must do differently for an architecture, beyond what mlx-lm's objects say (the
# architectures that run at all are measured: meshd.models.architectures).
# full_mask_as_array: the model's own inner loop builds its full-attention mask as an array
# (multi-head latent attention adds it to its scores, or the layer scales or combines it).
STAGE_RECIPES: dict[str, StageRecipe] = {
    name: StageRecipe(full_mask_as_array=True)
    for name in (
        "deepseek_v3",  # also kimi_k2
        "glm4_moe_lite",
        "kimi_k25",
        "kimi_linear",
        "kimi_vl",
    )
}


def load_stage(
    model_dir: Path,
    layer_start: int,
    layer_end: int,
    *,
    has_embedding: bool,
    has_head: bool,
    prepare: Callable[[nn.Module, list[nn.Module]], None] | None = None,
    donors: list[StageModel] | None = None,
    refuse_unverified: bool = True,
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

    ``donors``: at most one loaded stage of the same model (a plan being replaced): the layers
    (and the embedding) both stages run are taken over from it, already evaluated, so only
    the rest is read from disk (an incremental re-plan). The list is emptied before the new
    tensors are read, so what only the donor held can be freed first: a node that moves a
    boundary never holds the old and the new stage whole at once.

    ``refuse_unverified=False`` loads an architecture the table does not list as verified: only
    the verification that makes the table (tests/support/arch_verify.py) asks for that.
    """
    model_dir = Path(model_dir)
    if refuse_unverified:
        check_model_type(model_dir)
    with _config_only_view(model_dir) as view:
        skeleton = _build(view, model_dir)
        architecture = _architecture_of(skeleton, model_dir, refuse_unverified)
        text = _TextModel.of(skeleton, architecture)
        num_layers = len(text.inner.layers)
        _check_range(layer_start, layer_end, num_layers)
        # A tied head multiplies by the embedding matrix, so the last stage keeps it too.
        keep_embedding = has_embedding or (has_head and text.lm_head is None)
        try:
            tensors = load_stage_tensors(
                model_dir, layer_start, layer_end, keep_embedding=keep_embedding, keep_head=has_head
            )
        except ModelInfoError as error:  # missing files, a stale index: this stage cannot load
            raise StageLoadError(str(error)) from error
        checkpoint = _StageCheckpoint(model_dir, tensors)
        del tensors  # the checkpoint owns them now: release() must be able to free them
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
    adopted: tuple[int, int] = (0, 0)
    if donors and prepare is None:
        adopted = _adopt(_TextModel.locate(model).inner, donors.pop(), layer_start, layer_end)
    if prepare is not None:
        prepare(model, list(_TextModel.locate(model).inner.layers[layer_start:layer_end]))
    mx.eval(model.parameters())
    stage = StageModel(
        model,
        config,
        (layer_start, layer_end),
        has_embedding=has_embedding,
        has_head=has_head,
        empty_caches=empty_caches,
        num_model_layers=num_layers,
        architecture=architecture,
        recipe=STAGE_RECIPES.get(architecture, StageRecipe()),
    )
    stage.adopted_layers, stage.adopted_bytes = adopted
    return stage


def _adopt(inner: nn.Module, donor: StageModel, start: int, end: int) -> tuple[int, int]:
    """Put the donor's evaluated modules in place of the lazy, unread ones for the layers (and
    the embedding) both stages hold; returns (layers, bytes) taken over. The lazy arrays they
    replace are dropped unread."""
    taken: list[nn.Module] = []
    for index in range(max(start, donor.layer_start), min(end, donor.layer_end)):
        inner.layers[index] = donor.layer_module(index)
        taken.append(inner.layers[index])
    layers = len(taken)
    embedding = donor.embedding
    if "embed_tokens" in inner and embedding is not None:
        inner.embed_tokens = embedding
        taken.append(embedding)
    return layers, sum(v.nbytes for m in taken for _, v in tree_flatten(m.parameters()))


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
    """Refuse, with the reason, a model whose architecture stages cannot run.

    Reads only ``config.json``: cheap enough to call before a model is proposed to the mesh.
    The verdict is :func:`meshd.models.architectures.model_refusal`'s, the one `meshd plan`
    gives too. Raises :class:`UnsupportedModel` or :class:`StageLoadError`.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise StageLoadError(
            f"{model_dir} has no config.json; it is not an MLX model directory "
            "(import the model into the model store first)."
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise StageLoadError(f"{config_path} is not a readable JSON object: {error}") from error
    if not isinstance(config, dict):
        raise StageLoadError(f"{config_path} is not a readable JSON object")
    refusal = model_refusal(config)
    if refusal is not None:
        raise UnsupportedModel(f"{model_dir}: {refusal}")


@contextmanager
def _config_only_view(model_dir: Path) -> Iterator[Path]:
    """A temporary directory with the model's config files and no weights, for mlx-lm's loader.

    ``load_model`` opens every ``model*.safetensors`` of the directory it is given; handing it
    this view instead, and the stage's tensors through the model's ``sanitize``, keeps the
    files of other stages closed.
    """
    with scratch_directory("stage") as view:
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
    try:
        model, config = load_model(
            view, lazy=True, strict=False, get_model_classes=get_model_classes or skeleton_classes
        )
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


def _architecture_of(model: nn.Module, model_dir: Path, refuse_unverified: bool) -> str:
    """The mlx-lm model module of ``model``, which must be one stages are verified for."""
    architecture = type(model).__module__.rsplit(".", 1)[-1]
    reason = pipeline_refusal(architecture) if refuse_unverified else None
    if reason is not None:
        model_type = str(getattr(model, "model_type", architecture))
        message = unsupported_model_message(model_type, architecture, reason)
        raise UnsupportedModel(f"{model_dir}: {message}")
    return architecture


def skeleton_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's classes for ``config``, the model's ``sanitize`` skipped for no weights.

    ``load_model`` on a directory without weights (a skeleton, to learn the model's layers)
    calls ``sanitize({})``; several wrappers' sanitize cannot take an empty dict (they
    unflatten it, or read a tensor by name), so mlx-lm itself could not build them that way.
    """
    base, args_class = _get_classes(config)
    if not hasattr(base, "sanitize"):
        return base, args_class

    class Skeleton(base):  # type: ignore[misc, valid-type]
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            return weights if not weights else base.sanitize(self, weights)

    Skeleton.__module__ = base.__module__  # the architecture is read from the module
    Skeleton.__qualname__ = f"{base.__qualname__}[skeleton]"
    return Skeleton, args_class


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
