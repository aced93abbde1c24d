"""Scratch directories of processes that are gone are removed; nothing else is touched.

A stage load works in a temporary directory; a daemon or runner killed while it loads leaves
it behind. Each carries its creator's PID, and a starting daemon removes those whose creator
is gone (`meshd.runtime.scratch`), as does the launcher that killed it (`meshd demo`, the
benchmarks and the tests).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from meshd.runtime.scratch import SCRATCH_PREFIX, remove_orphaned_scratch, scratch_directory

pytestmark = pytest.mark.integration


def dead_pid() -> int:
    """The PID of a process that has exited (and was reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_only_the_scratch_of_processes_that_are_gone_is_removed(tmp_path: Path) -> None:
    orphan = tmp_path / f"{SCRATCH_PREFIX}{dead_pid()}-stage-abc"
    (orphan / "inner").mkdir(parents=True)
    (orphan / "inner" / "config.json").write_text("{}")
    own = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-stage-def"  # a live process's
    own.mkdir()
    others = [
        tmp_path / "meshd-stage-xyz",  # no PID: not ours to judge
        tmp_path / f"{SCRATCH_PREFIX}notapid-stage",
        tmp_path / "unrelated",
    ]
    for folder in others:
        folder.mkdir()
    a_file = tmp_path / f"{SCRATCH_PREFIX}{dead_pid()}-stage-file"
    a_file.write_text("not a directory")

    assert remove_orphaned_scratch(tmp_path) == 1
    assert not orphan.exists()
    assert own.exists() and a_file.exists() and all(f.exists() for f in others)
    assert remove_orphaned_scratch(tmp_path / "missing") == 0


def test_a_scratch_directory_names_its_process_and_goes_with_its_block() -> None:
    with scratch_directory("stage") as folder:
        assert folder.is_dir()
        assert folder.name.startswith(f"{SCRATCH_PREFIX}{os.getpid()}-stage-")
    assert not folder.exists()


def test_a_daemon_killed_by_its_launcher_leaves_no_scratch(daemons) -> None:
    daemon = daemons(["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"])
    daemon.wait_ready()
    # What a load the kill cut short leaves: a folder named by the daemon's PID.
    left = Path(tempfile.gettempdir()) / f"{SCRATCH_PREFIX}{daemon.pid}-stage-cut"
    (left / "inner").mkdir(parents=True)
    try:
        daemon.kill()
        assert not left.exists()
    finally:
        shutil.rmtree(left, ignore_errors=True)
