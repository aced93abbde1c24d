"""Which model architectures may run as tensor-parallel stages, and why the others may not.

A fact about models and the installed mlx-lm, needed on both sides: the model description
(:func:`meshd.models.info.read_model_spec` sets ``ModelSpec.supports_tensor_parallel``, so the
pure planner offers tensor-parallel groups only where they can run) and the execution side
(:mod:`meshd.inference.tensor_parallel`, which refuses the rest with the reason). It lives
here, below both, so that the model store does not import the data plane.
"""

from __future__ import annotations

# mlx-lm model modules whose ``shard(group)`` runs on a pipeline stage's layers (see
# meshd.inference.shard.ARCHITECTURES) and whose tensor-parallel stages are verified against one
# mlx-lm process by tests/test_tensor_parallel_architectures.py. Values: the attribute of an MoE
# layer's block that holds its routed experts (a SwitchGLU), for expert placement; None for
# dense-only families.
TENSOR_PARALLEL_ARCHITECTURES: dict[str, str | None] = {
    "llama": None,  # also mistral and the other families mlx-lm maps to llama
    "qwen2": None,
    "qwen3": None,
    "qwen3_moe": "switch_mlp",
    "deepseek_v3": "switch_mlp",  # also kimi_k2
    "glm4_moe": "switch_mlp",
    "gpt_oss": "experts",
}
# Architectures stages run whose tensor parallelism is refused, and why.
NOT_TENSOR_PARALLEL: dict[str, str] = {
    "mixtral": "mlx-lm's mixtral model has no shard(group)",
    "qwen3_next": "mlx-lm's qwen3_next model has no shard(group)",
    "qwen3_5": (
        "mlx-lm's qwen3_5 shard(group) also splits the LM head over the vocabulary and gathers "
        "the logits inside the model's own call, which a pipeline stage's head does not make"
    ),
    "qwen3_5_moe": (
        "mlx-lm's qwen3_5_moe shard(group) also splits the LM head over the vocabulary and "
        "gathers the logits inside the model's own call, which a pipeline stage's head does not "
        "make"
    ),
}


def architecture_of(model_type: str) -> str:
    """mlx-lm's model module for a config's ``model_type`` (its aliases resolved)."""
    from meshd.runtime.lazy_imports import import_model_runtime

    import_model_runtime()
    from mlx_lm.utils import MODEL_REMAPPING

    return MODEL_REMAPPING.get(model_type, model_type)


def tensor_parallel_refusal(model_type: str) -> str | None:
    """Why ``model_type`` cannot run as a tensor-parallel stage, or None when it can."""
    architecture = architecture_of(model_type)
    if architecture in TENSOR_PARALLEL_ARCHITECTURES:
        return None
    reason = NOT_TENSOR_PARALLEL.get(architecture)
    if reason is not None:
        return reason
    return (
        f"mlx-lm's {architecture} has not been verified to run as a tensor-parallel stage; "
        f"verified: {', '.join(sorted(TENSOR_PARALLEL_ARCHITECTURES))}"
    )


def supports_tensor_parallel(model_type: str) -> bool:
    """Whether the planner may offer tensor-parallel groups for this ``model_type``.

    True only for architectures whose mlx-lm ``shard(group)`` runs on a pipeline stage's layers
    and is verified exact here; head counts and group sizes are checked by
    :func:`check_tensor_parallel`.
    """
    return tensor_parallel_refusal(model_type) is None
