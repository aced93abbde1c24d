"""Files written whole or not at all (meshd.runtime.files): the profile cache, node id, process
overhead, Hub manifests, transformers' import tables and kept tokenizers are written this way;
cache folders keep their newest files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshd.runtime.files import remove_oldest, replace_bytes, replace_text

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


def test_bytes_are_written_as_given(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    replace_bytes(path, b"\x00\xffmeshd")
    assert path.read_bytes() == b"\x00\xffmeshd"


def test_only_the_newest_files_of_the_pattern_are_kept(tmp_path: Path) -> None:
    for age, name in enumerate(["c.json", "a.json", "d.json", "b.json"]):
        path = tmp_path / name
        path.write_text(name)
        os.utime(path, ns=(age * 10**9, age * 10**9))  # c oldest ... b newest
    (tmp_path / "other.txt").write_text("not matched")
    remove_oldest(tmp_path, "*.json", kept=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "d.json", "other.txt"]
    remove_oldest(tmp_path, "*.json", kept=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.txt"]
    remove_oldest(tmp_path / "missing", "*.json", kept=1)  # no folder: nothing to do
