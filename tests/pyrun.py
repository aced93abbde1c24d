"""Run a probe script in a fresh interpreter (what is measured depends on process start-up)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Any


def run_json(code: str, *args: str, env: Mapping[str, str], timeout_s: float = 120) -> Any:
    """Run `code` with `args` in a new Python; return the JSON its last output line holds."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
