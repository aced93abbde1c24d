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

pytestmark = pytest.mark.integration


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


def test_plan_and_the_daemon_refuse_an_unverified_architecture_with_the_same_words(
    tmp_path: Path,
) -> None:
    """`meshd plan --model DIR` and the check `meshd load` runs (the stage loader's) give one
    message, from meshd.models.architectures."""
    import argparse
    import io
    import json

    from meshd.api.plan_cli import EXIT_REFUSED, add_plan_arguments, run_plan
    from meshd.inference.stage.model import UnsupportedModel
    from meshd.node_models import check_model_type
    from tests.support.random_model import write_model_dir
    from tests.support.tiny_architectures import tiny_config

    model_dir = write_model_dir(tmp_path / "gpt2", tiny_config("gpt2"))
    assert architecture_table.ARCHITECTURES["gpt2"]["pipeline"] == "refused"
    mesh = tmp_path / "mesh.json"
    node = {"id": "a", "memory_budget": "1GiB", "flops": "1TFLOPS", "mem_bandwidth": "100GB/s"}
    mesh.write_text(json.dumps({"nodes": [node]}))
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    err = io.StringIO()
    code = run_plan(
        parser.parse_args(["--mesh", str(mesh), "--model", str(model_dir)]),
        out=io.StringIO(),
        err=err,
    )
    with pytest.raises(UnsupportedModel) as refused:
        check_model_type(model_dir)
    assert code == EXIT_REFUSED
    assert err.getvalue().strip() == f"meshd plan: {refused.value}"
    assert "gpt2" in err.getvalue() and "Use a model of a verified architecture" in err.getvalue()
