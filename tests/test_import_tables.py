"""transformers' import table kept on disk (meshd.runtime.import_tables): the installed
transformers' tables come back from their files as they were built, a second process reads what
the first built and still finds every name, and a damaged file is built again."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from meshd.runtime.import_tables import (
    IMPORT_CACHE_ENV,
    decode_table,
    encode_table,
    table_key,
)

pytestmark = pytest.mark.integration

IMPORTS = """
import json
from meshd.runtime.import_tables import counts, keep_transformers_import_table
assert keep_transformers_import_table()
from transformers import AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast
import mlx_lm.models.base
assert LlamaConfig.model_type == "llama" and AutoTokenizer.__name__ == "AutoTokenizer"
import transformers.utils.import_utils as utils
print(json.dumps({**counts, "wrapped_by": utils.define_import_structure.__module__}))
"""


def imports_in_a_process(folder: Path) -> dict[str, Any]:
    env = {**os.environ, IMPORT_CACHE_ENV: str(folder)}
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_installed_transformers_tables_come_back_from_json_as_built() -> None:
    import transformers
    from transformers.utils import import_utils

    build = getattr(import_utils.define_import_structure, "__wrapped__", None)
    assert build is not None, "transformers' table function is no longer lru-cached"
    models = Path(transformers.__file__).parent / "models"
    for path, prefix in ((models, "models"), (models / "__init__.py", None)):
        table = build(path, prefix)
        assert len(table) > 1 and sum(len(modules) for modules in table.values()) > 500
        rows = encode_table(table)
        assert rows is not None, "a table shape this meshd does not know"
        assert decode_table(json.loads(json.dumps(rows))) == table


def test_a_second_process_reads_the_tables_the_first_built(tmp_path: Path) -> None:
    folder = tmp_path / "tables"
    first = imports_in_a_process(folder)
    assert first["built"] >= 2 and first["read"] == 0
    assert first["wrapped_by"] == "meshd.runtime.import_tables"
    files = sorted(folder.glob("imports-*.json"))
    assert len(files) == first["built"]
    second = imports_in_a_process(folder)
    assert (second["read"], second["built"]) == (first["built"], 0)
    # A damaged file (a crash, a full disk) is built and written again; the others are read.
    largest = max(files, key=lambda file: file.stat().st_size)
    largest.write_text(largest.read_text()[:1000])
    third = imports_in_a_process(folder)
    assert (third["read"], third["built"]) == (first["built"] - 1, 1)
    assert json.loads(largest.read_text())


def test_the_key_follows_the_folders_an_install_rewrites(tmp_path: Path) -> None:
    (tmp_path / "llama").mkdir()
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__init__.py").write_text("")
    before = table_key(tmp_path, "models")
    assert table_key(tmp_path / "__init__.py", "models") == before  # a file names its folder
    assert table_key(tmp_path, None) != before
    os.utime(tmp_path / "__pycache__", ns=(2, 2))  # as Python writes a .pyc: no change
    assert table_key(tmp_path, "models") == before
    os.utime(tmp_path / "llama", ns=(1, 1))  # as an upgrade rewrites a model's package
    assert table_key(tmp_path, "models") != before


def test_only_the_newest_tables_are_kept(tmp_path: Path) -> None:
    from meshd.runtime.import_tables import remove_oldest_tables, write_table

    for number in range(5):
        table = {frozenset(): {f"module{number}": {"Name"}}}
        write_table(tmp_path / f"imports-{number}.json", table)
        os.utime(tmp_path / f"imports-{number}.json", ns=(number, number))
    remove_oldest_tables(tmp_path, kept=2)
    assert sorted(file.name for file in tmp_path.iterdir()) == ["imports-3.json", "imports-4.json"]


def test_the_finder_answers_for_transformers_utilities_once(tmp_path: Path) -> None:
    """It finds nothing else, and the module only once: a reload is transformers' own."""
    from meshd.runtime.import_tables import TABLE_MODULE, _TableFinder, _WrapAfterRun

    package = importlib.util.find_spec("transformers")  # found, not run
    assert package is not None and package.submodule_search_locations
    utils = [str(Path(package.submodule_search_locations[0]) / "utils")]  # as the import gives
    finder = _TableFinder(tmp_path)
    assert finder.find_spec("json", None) is None
    spec = finder.find_spec(TABLE_MODULE, utils)
    assert spec is not None and isinstance(spec.loader, _WrapAfterRun)
    assert spec.origin and spec.origin.endswith("import_utils.py")
    assert finder.find_spec(TABLE_MODULE, utils) is None
