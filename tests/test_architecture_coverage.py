"""The committed architecture table is what the installed mlx-lm does, architecture by architecture.

meshd.models.architecture_table (and docs/architectures.md) say which of mlx-lm's architectures
run as pipeline and tensor-parallel stages; the daemon, `meshd load` and `meshd plan` refuse the
rest from it. This re-runs the verification (tests/support/arch_verify.py: a tiny random
instance of every architecture module, one mlx-lm process against 2 and 3 stages, and
tensor-parallel rings) and fails with what changed: after an mlx-lm upgrade, new architectures
and architectures whose outcome changed. Regenerate with
``python -m tests.support.arch_verify --write``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshd.models import architecture_table
from meshd.models.architectures import model_refusal, pipeline_architectures
from tests.support import arch_verify


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, arch_verify.Outcome]:
    return arch_verify.verify_all(tmp_path_factory.mktemp("architectures"))


def test_the_committed_table_is_what_the_installed_mlx_lm_does(
    measured: dict[str, arch_verify.Outcome],
) -> None:
    changes = arch_verify.differences(architecture_table.ARCHITECTURES, measured)
    version = arch_verify.mlx_lm_version()
    assert not changes, (
        f"mlx-lm {version} (table made with {architecture_table.MLX_LM_VERSION}) differs:\n"
        + "\n".join(changes)
        + "\nRegenerate: python -m tests.support.arch_verify --write"
    )


def test_the_docs_are_the_committed_table() -> None:
    outcomes = {
        name: arch_verify.Outcome(**row) for name, row in architecture_table.ARCHITECTURES.items()
    }
    expected = arch_verify.docs_text(outcomes, architecture_table.MLX_LM_VERSION)
    assert Path(arch_verify.DOCS_PATH).read_text() == expected


def test_a_refusal_names_the_architecture_the_reason_and_what_to_use() -> None:
    refused = next(
        name
        for name, row in architecture_table.ARCHITECTURES.items()
        if row["pipeline"] != "verified"
    )
    message = model_refusal({"model_type": refused})
    assert message is not None and refused in message
    assert architecture_table.ARCHITECTURES[refused]["pipeline_reason"] in message
    assert (
        "Use a model of a verified architecture: " + ", ".join(pipeline_architectures()) in message
    )
    assert model_refusal({"model_type": "kimi_k2"}) is None  # mlx-lm's alias of deepseek_v3
    assert "not among the architectures" in str(model_refusal({"model_type": "no_such_model"}))
