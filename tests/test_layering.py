"""The layering contract (pyproject.toml [tool.importlinter], docs/architecture.md) holds.

import-linter reads the real import graph of `meshd` and `partitioner`; a broken rule fails
here with its name and the import chain that breaks it, so `.ci/run` enforces the layout.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

LINT = (
    "import sys\n"
    "from importlinter.cli import lint_imports\n"
    "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))\n"
)


def lint(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LINT, str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def broken_rules(output: str) -> list[str]:
    return [line.removesuffix("BROKEN").strip() for line in output.splitlines() if "BROKEN" in line]


def test_the_layering_contract_holds() -> None:
    result = lint(ROOT / "pyproject.toml")
    broken = broken_rules(result.stdout)
    assert result.returncode == 0 and not broken, (
        f"layering rule(s) broken: {'; '.join(broken) or '(see output)'}\n"
        "Fix the import, or change the rule in pyproject.toml [tool.importlinter] and "
        f"docs/architecture.md together.\n{result.stdout}{result.stderr}"
    )
    assert "Contracts: 0 kept" not in result.stdout


def test_a_broken_rule_is_reported_by_name(tmp_path: Path) -> None:
    """The check sees the real graph: the node (the composition root) imports the mesh."""
    config = tmp_path / "contract.toml"
    config.write_text(
        "[tool.importlinter]\n"
        'root_packages = ["meshd", "partitioner"]\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "the node does without the mesh"\n'
        'type = "forbidden"\n'
        'source_modules = ["meshd.node"]\n'
        'forbidden_modules = ["meshd.mesh"]\n'
    )
    result = lint(config)
    assert result.returncode != 0
    assert broken_rules(result.stdout) == ["the node does without the mesh"], result.stdout
    assert "meshd.node -> meshd.mesh" in result.stdout
