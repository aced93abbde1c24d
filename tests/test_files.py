"""Files written whole or not at all (meshd.runtime.files): the profile cache, node id, process
overhead, Hub manifests and transformers' import tables are written this way."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshd.runtime.files import replace_text

pytestmark = pytest.mark.unit


def test_a_file_is_replaced_whole_and_its_folder_made(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "doc.json"
    replace_text(path, "first\n")
    replace_text(path, "second\n")
    assert path.read_text() == "second\n"
    assert [p.name for p in path.parent.iterdir()] == ["doc.json"]


def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()  # a folder where the file should go: the rename fails
    (taken / "inside").write_text("kept")
    with pytest.raises(OSError):
        replace_text(taken, "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert (taken / "inside").read_text() == "kept"
