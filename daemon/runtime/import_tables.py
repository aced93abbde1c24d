"""transformers' table of lazy imports, kept on disk between processes.

Why: mlx-lm's tokenizer code imports transformers, and ``import transformers`` builds a table
of every object its ~450 model packages export by reading each of their ~1,700 source files;
the package ``transformers.models`` then builds the same table again for itself. That is ~0.4 s
of CPU each, ~0.75 s in all, the largest part of what a daemon spends to load its first model
and of each tensor-parallel runner's start (measured on a 2-core x86 VM with transformers
5.25), and the result is the same in every process of one installed transformers.

So before transformers is imported, :func:`keep_transformers_import_table` wraps the function
that builds the table (``transformers.utils.import_utils.define_import_structure``, right after
that module runs and before anything calls it) with one that reads the table from a JSON file
in a folder of ours, else builds it as before and writes it there. A file's name is a digest of
what the table is built from: the folder scanned, the prefix, and the modification times of the
folder and of every package folder in it, which an install or upgrade of transformers changes
(not of ``__pycache__``, which Python rewrites as it compiles). Whatever
goes wrong (transformers renamed the function, a file that cannot be read or written, a table
of a shape this module does not know) falls back to building the table as transformers does.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from meshd.runtime.files import remove_oldest, replace_text

log = logging.getLogger("meshd.imports")

IMPORT_CACHE_ENV = "MESHD_IMPORT_CACHE"  # the folder, for this process and those it starts
IMPORT_TABLES_FOLDER = "import-tables"  # the daemon's, in its model store
TABLES_KEPT = 32  # files; past that the oldest go (tables of transformers installs since replaced)
TABLE_MODULE = "transformers.utils.import_utils"
TABLE_FUNCTION = "define_import_structure"

# How many tables this process read from files, and how many it built (and wrote).
counts = {"read": 0, "built": 0}


def keep_transformers_import_table(folder: Path | None = None) -> bool:
    """Keep transformers' import table in ``folder`` (default: ``$MESHD_IMPORT_CACHE``), for
    this process and (through the environment) the processes it starts. False, and nothing
    changes, when there is no folder or transformers was imported already."""
    if folder is None:
        given = os.environ.get(IMPORT_CACHE_ENV, "")
        if not given:
            return False
        folder = Path(given)
    if "transformers" in sys.modules:
        return False
    os.environ[IMPORT_CACHE_ENV] = str(folder)
    if not any(isinstance(finder, _TableFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TableFinder(folder))
    return True


class _TableFinder(importlib.abc.MetaPathFinder):
    """Finds transformers' import utilities as the path finder does, once, with a loader that
    wraps the table function once the module has run. It stays in ``sys.meta_path`` after
    that, answering None (leaving it while the import system walks the list would make the
    walk skip the finder after it)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.used = False

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != TABLE_MODULE or self.used:
            return None
        self.used = True  # a second import of the module (a reload) is transformers' own
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None  # transformers comes some other way (an editable install): not kept
        spec.loader = _WrapAfterRun(spec.loader, self.folder)
        return spec


class _WrapAfterRun(importlib.abc.Loader):
    """The path finder's loader, which wraps the module's table function after running it."""

    def __init__(self, loader: Any, folder: Path) -> None:
        self._loader = loader
        self._folder = folder

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        original = getattr(module, TABLE_FUNCTION, None)
        if callable(original):
            setattr(module, TABLE_FUNCTION, cached_table(original, self._folder))

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... as the loader's
        return getattr(self._loader, name)


def cached_table(original: Callable[..., Any], folder: Path) -> Callable[..., Any]:
    """``original`` (module path, prefix=None) -> table, read from ``folder`` where a file of
    the same inputs is there, else built by ``original`` and written there."""

    @functools.lru_cache  # as transformers' own: each table once per process
    def define_import_structure(module_path: Any, prefix: str | None = None) -> Any:
        try:
            file = folder / f"imports-{table_key(Path(module_path), prefix)}.json"
        except OSError:
            return original(module_path, prefix)
        table = read_table(file)
        if table is not None:
            counts["read"] += 1
            return table
        table = original(module_path, prefix)
        counts["built"] += 1
        write_table(file, table)
        return table

    return define_import_structure


def table_key(module_path: Path, prefix: str | None) -> str:
    """A digest of what the table of ``module_path`` is built from (see the module docstring);
    OSError where the folder cannot be read."""
    scanned = module_path if module_path.is_dir() else module_path.parent
    stamps = [(".", scanned.stat().st_mtime_ns)]
    with os.scandir(scanned) as entries:
        stamps += sorted(
            (entry.name, entry.stat().st_mtime_ns)
            for entry in entries
            if entry.is_dir() and entry.name != "__pycache__"  # moves as Python writes .pyc
        )
    what = json.dumps([str(scanned.resolve()), prefix, stamps])
    return hashlib.sha256(what.encode()).hexdigest()[:24]


def encode_table(table: dict[Any, Any]) -> list[list[Any]] | None:
    """The table as JSON values: [[backends], {module: [names]}] per backend set; None for a
    table of another shape than {frozenset of str: {str: set of str}}."""
    rows = []
    for backends, modules in table.items():
        if not isinstance(backends, frozenset) or not isinstance(modules, dict):
            return None
        names = {}
        for module, exported in modules.items():
            if not isinstance(module, str) or not isinstance(exported, set | frozenset):
                return None
            if not all(isinstance(name, str) for name in exported):
                return None
            names[module] = sorted(exported)
        rows.append([sorted(backends), names])
    return rows


def decode_table(rows: Any) -> dict[frozenset[str], dict[str, set[str]]]:
    """The table from :func:`encode_table`'s values (ValueError where they are not that)."""
    if not isinstance(rows, list):
        raise ValueError("not a list of rows")
    table: dict[frozenset[str], dict[str, set[str]]] = {}
    for backends, modules in rows:
        table[frozenset(backends)] = {module: set(names) for module, names in modules.items()}
    return table


def read_table(file: Path) -> dict[frozenset[str], dict[str, set[str]]] | None:
    """The table kept in ``file``; None where there is none or it cannot be read."""
    try:
        return decode_table(json.loads(file.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as error:
        log.debug("transformers' import table in %s is unreadable (%s): building it", file, error)
        return None


def write_table(file: Path, table: dict[Any, Any]) -> None:
    """Write ``table`` to ``file`` whole or not at all, so that processes starting together
    never read half of one; nothing where it cannot be."""
    rows = encode_table(table)
    if rows is None:
        log.debug("transformers' import table has a shape this meshd does not know: not kept")
        return
    try:
        replace_text(file, json.dumps(rows))
    except OSError as error:
        log.debug("could not keep transformers' import table in %s: %s", file, error)
        return
    remove_oldest_tables(file.parent)


def remove_oldest_tables(folder: Path, kept: int = TABLES_KEPT) -> None:
    """Keep the ``kept`` newest tables in ``folder``: each upgrade of transformers writes a new
    set, and the newest are the installed one's (a table that is read is never rewritten, so
    age is the time of the install it belongs to, or later)."""
    remove_oldest(folder, "imports-*.json", kept)
