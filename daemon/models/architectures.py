"""Which mlx-lm architectures meshd runs as pipeline and tensor-parallel stages, and why not.

The answer is measured, not listed by hand: ``tests/support/arch_verify.py`` builds a tiny
random instance of every architecture module of the installed mlx-lm, runs it as one mlx-lm
process and as 2 and 3 pipeline stages (and, where mlx-lm can shard it, as tensor-parallel
stages over a 2-rank group), and writes the outcomes to :mod:`meshd.models.architecture_table`
(``python -m tests.support.arch_verify --write`` regenerates it and docs/architectures.md;
tests/test_architecture_coverage.py fails when the installed mlx-lm's outcomes differ).

Every place that refuses a model for its architecture asks here, so `meshd plan`, `meshd load`
and the daemon's stage loader refuse the same models with the same words. Below the data plane
and the planner's inputs (models), so that both may import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshd.models.architecture_table import ARCHITECTURES, MLX_LM_VERSION

VERIFIED = "verified"
REFUSED = "refused"
NOT_APPLICABLE = "not applicable"


def pipeline_architectures() -> list[str]:
    """mlx-lm modules verified to run as pipeline stages, sorted."""
    return sorted(name for name, row in ARCHITECTURES.items() if row["pipeline"] == VERIFIED)


def tensor_parallel_architectures() -> list[str]:
    """mlx-lm modules verified to run as tensor-parallel stages, sorted."""
    return sorted(name for name, row in ARCHITECTURES.items() if row["tensor_parallel"] == VERIFIED)


def architecture_of(config: Mapping[str, Any]) -> str:
    """mlx-lm's model module for a ``config.json`` (its ``model_type`` aliases resolved as
    mlx-lm's loader resolves them, by ``architectures`` first)."""
    from meshd.runtime.lazy_imports import import_model_runtime

    import_model_runtime()
    import mlx_lm.utils
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = str(config.get("model_type"))
    remapped = getattr(mlx_lm.utils, "MODEL_ARCHITECTURE_REMAPPING", {})
    names = config.get("architectures") or ()
    for name in (names,) if isinstance(names, str) else names:
        if (model_type, name) in remapped:
            return str(remapped[(model_type, name)])
    return MODEL_REMAPPING.get(model_type, model_type)


def pipeline_refusal(architecture: str) -> str | None:
    """Why mlx-lm's ``architecture`` cannot run as pipeline stages, or None when it can."""
    row = ARCHITECTURES.get(architecture)
    if row is None:
        return (
            f"mlx-lm's {architecture} was not among the architectures of mlx-lm "
            f"{MLX_LM_VERSION} that meshd verified"
        )
    if row["pipeline"] == VERIFIED:
        return None
    return str(row["pipeline_reason"])


def tensor_parallel_refusal(architecture: str) -> str | None:
    """Why mlx-lm's ``architecture`` cannot run as tensor-parallel stages, or None."""
    row = ARCHITECTURES.get(architecture)
    if row is None:
        return pipeline_refusal(architecture)
    if row["tensor_parallel"] == VERIFIED:
        return None
    return str(row["tensor_parallel_reason"])


def unsupported_model_message(model_type: str, architecture: str, reason: str) -> str:
    """The refusal every caller prints: the architecture, the reason, what to do instead."""
    named = model_type if model_type == architecture else f"{model_type} (mlx-lm's {architecture})"
    return (
        f"Model type {named} cannot run as pipeline stages: {reason}. Use a model of a "
        f"verified architecture: {', '.join(pipeline_architectures())} (docs/architectures.md)."
    )


def model_refusal(config: Mapping[str, Any]) -> str | None:
    """The refusal message for a model's ``config.json``, or None when its architecture runs
    as pipeline stages."""
    architecture = architecture_of(config)
    reason = pipeline_refusal(architecture)
    if reason is None:
        return None
    return unsupported_model_message(str(config.get("model_type")), architecture, reason)
