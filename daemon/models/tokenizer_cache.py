"""A model's tokenizer kept between processes, so that the next daemon to load it reads it.

Why: mlx-lm's ``load_tokenizer`` spends ~0.5 s of CPU on SmolLM2's tokenizer (measured on a
2-core x86 VM): it parses the 3.5 MB ``tokenizer.json`` in Python twice and once in Rust,
lists the 49,152-token vocabulary three times and maps every id to its text. Every daemon
that serves a model does this once, and the result is the same for the same files. The
finished wrapper, pickled, loads in ~0.13 s.

Reading a pickle is running code, so a kept tokenizer is read only where:

* the file is this user's and no one else may write it (checked on the opened file);
* it names nothing but tokenizer parts (:class:`_TokenizerUnpickler`): classes of the
  ``tokenizers`` package, of transformers' tokenization modules and of mlx-lm's tokenizer
  module, mlx-lm's tool-call parsers and chat templates, ``functools.partial``, sets. A module
  outside that list is refused before it is imported.

Anything else (no file, a file of another version, one that fails those checks or does not
load) costs only the time: the tokenizer is loaded as mlx-lm does and kept again. A file's
name is a digest of the model folder, its files but the weights (name, size, modification
time), the EOS ids asked for, and the versions of Python, mlx-lm, transformers and tokenizers.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import stat
import sys
from pathlib import Path
from typing import Any

from meshd.runtime.files import remove_oldest, replace_bytes

log = logging.getLogger("meshd.models.tokenizers")

TOKENIZERS_FOLDER = "tokenizers"  # in the model store
KEPT = 16  # files; past that the oldest go (tokenizers of models or versions since replaced)

# How many tokenizers this process read from files, and how many it loaded as mlx-lm does.
counts = {"read": 0, "loaded": 0}

# Modules a kept tokenizer may name: exact names, and prefixes of packages.
_MODULES = {"tokenizers", "mlx_lm.tokenizer_utils", "functools", "builtins", "collections"}
_CLASS_PACKAGES = ("tokenizers.",)
_FUNCTION_PACKAGES = ("mlx_lm.tool_parsers.", "mlx_lm.chat_templates.")  # parsers, templates
_NAMES = {
    "functools": {"partial"},
    "builtins": {"set", "frozenset"},
    "collections": {"OrderedDict"},
}


class RefusedPickle(pickle.UnpicklingError):
    """A kept tokenizer names something that is not a tokenizer part."""


class _TokenizerUnpickler(pickle.Unpickler):
    """An unpickler that resolves tokenizer parts only (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        transformers_tokenization = module.startswith("transformers.") and (
            "tokenization" in module.rsplit(".", 1)[-1]
        )
        if not (
            module in _MODULES
            or module.startswith(_CLASS_PACKAGES + _FUNCTION_PACKAGES)
            or transformers_tokenization
        ):
            raise RefusedPickle(f"names {module}.{name}")
        if module in _NAMES and name not in _NAMES[module]:
            raise RefusedPickle(f"names {module}.{name}")
        found = super().find_class(module, name)
        if module in _NAMES or module.startswith(_FUNCTION_PACKAGES):
            return found  # the listed builtins, mlx-lm's parsers and templates
        if not isinstance(found, type):
            raise RefusedPickle(f"names {module}.{name}, which is not a class")
        return found


def load_tokenizer(model_dir: Path, eos_token_ids: Any, folder: Path | None) -> Any:
    """mlx-lm's tokenizer wrapper of ``model_dir`` (with ``eos_token_ids``, as
    ``mlx_lm.utils.load_tokenizer`` takes them): kept in ``folder`` when it is there, else
    loaded and kept there; without a folder, loaded."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    if folder is None:
        return mlx_lm_load_tokenizer(model_dir, eos_token_ids=eos_token_ids)
    try:
        file = folder / f"tokenizer-{tokenizer_key(model_dir, eos_token_ids)}.pickle"
    except OSError as error:  # the folder went or cannot be listed: mlx-lm will say
        log.debug("no key for the tokenizer of %s: %s", model_dir, error)
        return mlx_lm_load_tokenizer(model_dir, eos_token_ids=eos_token_ids)
    kept = read_tokenizer(file)
    if kept is not None:
        counts["read"] += 1
        return kept
    tokenizer = mlx_lm_load_tokenizer(model_dir, eos_token_ids=eos_token_ids)
    counts["loaded"] += 1
    write_tokenizer(file, tokenizer)
    return tokenizer


def tokenizer_files(model_dir: Path) -> list[tuple[str, int, int]]:
    """Name, size and modification time of every file of ``model_dir`` but the weights: what
    a tokenizer is loaded from (a folder rewritten with another model's files differs)."""
    files = []
    for path in sorted(Path(model_dir).iterdir()):
        if path.suffix == ".safetensors" or not path.is_file():
            continue
        status = path.stat()
        files.append((path.name, status.st_size, status.st_mtime_ns))
    return files


def tokenizer_key(model_dir: Path, eos_token_ids: Any) -> str:
    """The digest naming a kept tokenizer (see the module docstring); OSError where the folder
    cannot be read."""
    import mlx_lm
    import tokenizers
    import transformers

    versions = [sys.version, mlx_lm.__version__, transformers.__version__, tokenizers.__version__]
    what = [str(Path(model_dir).resolve()), tokenizer_files(model_dir), eos_token_ids, versions]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:24]


def read_tokenizer(file: Path) -> Any | None:
    """The tokenizer kept in ``file``; None where there is none or it may not or cannot be
    read (then it is loaded and written again)."""
    try:
        with open(file, "rb") as opened:
            status = os.fstat(opened.fileno())
            if status.st_uid != os.getuid() or status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                log.warning(
                    "ignoring the kept tokenizer %s: it is another user's or others may write "
                    "it (remove it; meshd writes its own)",
                    file,
                )
                return None
            data = opened.read()
    except FileNotFoundError:
        return None
    except OSError as error:
        log.debug("kept tokenizer %s is unreadable (%s): loading it", file, error)
        return None
    try:
        return _TokenizerUnpickler(io.BytesIO(data)).load()
    except RefusedPickle as refusal:
        log.warning("ignoring the kept tokenizer %s: it %s (loading the tokenizer)", file, refusal)
    except Exception as error:  # a file of another version: load instead
        log.debug("kept tokenizer %s does not load (%r): loading it", file, error)
    return None


def write_tokenizer(file: Path, tokenizer: Any) -> None:
    """Keep ``tokenizer`` in ``file`` (readable by this user only), where it pickles and reads
    back through :class:`_TokenizerUnpickler`; nothing where it cannot be."""
    try:
        data = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        _TokenizerUnpickler(io.BytesIO(data)).load()
    except Exception as error:  # a tokenizer with parts we do not keep
        log.debug("the tokenizer for %s is not kept: %r", file, error)
        return
    try:
        replace_bytes(file, data, mode=0o600)
    except OSError as error:
        log.debug("could not keep the tokenizer in %s: %s", file, error)
        return
    remove_oldest(file.parent, "tokenizer-*.pickle", KEPT)
