"""Which model architectures may run as tensor-parallel stages, and why the others may not.

A fact about models and the installed mlx-lm, needed on both sides: the model description
(:func:`meshd.models.info.read_model_spec` sets ``ModelSpec.supports_tensor_parallel``, so the
pure planner offers tensor-parallel groups only where they can run) and the execution side
(:mod:`meshd.inference.tensor_parallel`, which refuses the rest with the reason). It lives
here, below both, so that the model store does not import the data plane.
"""

from __future__ import annotations

from meshd.models.architectures import tensor_parallel_architectures
from meshd.models.architectures import (
    tensor_parallel_refusal as architecture_tensor_parallel_refusal,
)

# mlx-lm model modules whose ``shard(group)`` runs on a pipeline stage's layers and whose
# tensor-parallel stages equal one mlx-lm process: measured (meshd.models.architectures).
TENSOR_PARALLEL_ARCHITECTURES: frozenset[str] = frozenset(tensor_parallel_architectures())
# The attribute of an MoE layer's block that holds its routed experts (a SwitchGLU), for
# expert placement, where it is not mlx-lm's usual ``switch_mlp``.
EXPERTS_ATTRIBUTES: dict[str, str] = {"gpt_oss": "experts"}
DEFAULT_EXPERTS_ATTRIBUTE = "switch_mlp"


def architecture_of(model_type: str) -> str:
    """mlx-lm's model module for a config's ``model_type`` (its aliases resolved)."""
    from meshd.runtime.lazy_imports import import_model_runtime

    import_model_runtime()
    from mlx_lm.utils import MODEL_REMAPPING

    return MODEL_REMAPPING.get(model_type, model_type)


def tensor_parallel_refusal(model_type: str) -> str | None:
    """Why ``model_type`` cannot run as a tensor-parallel stage, or None when it can."""
    architecture = architecture_of(model_type)
    reason = architecture_tensor_parallel_refusal(architecture)
    if reason is None:
        return None
    return (
        f"mlx-lm's {architecture}: {reason}; tensor-parallel stages are verified for "
        f"{', '.join(sorted(TENSOR_PARALLEL_ARCHITECTURES))} (docs/architectures.md)"
    )


def supports_tensor_parallel(model_type: str) -> bool:
    """Whether the planner may offer tensor-parallel groups for this ``model_type``.

    True only for architectures whose mlx-lm ``shard(group)`` runs on a pipeline stage's layers
    and is verified exact here; head counts and group sizes are checked by
    :func:`check_tensor_parallel`.
    """
    return tensor_parallel_refusal(model_type) is None
