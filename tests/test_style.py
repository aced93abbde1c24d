"""The code stays ruff clean: lint and format are checked with the pinned ruff (dev extra), so
a style slip fails CI like any other defect instead of waiting for someone to run ruff."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ruff", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_finds_nothing_to_fix() -> None:
    checked = ruff("check", "--no-cache", ".")
    assert checked.returncode == 0, f"ruff check . found problems:\n{checked.stdout}"


def test_the_code_is_formatted_as_ruff_formats_it() -> None:
    formatted = ruff("format", "--no-cache", "--check", ".")
    assert formatted.returncode == 0, (
        f"files ruff would reformat (run `ruff format .`):\n{formatted.stdout}"
    )
