"""A model's tokenizer kept between processes, so that the next daemon to load it reads it.

Why: mlx-lm's ``load_tokenizer`` spends ~0.5 s of CPU on SmolLM2's tokenizer (measured on a
2-core x86 VM): it parses the 3.5 MB ``tokenizer.json`` in Python twice and once in Rust,
lists the 49,152-token vocabulary three times and maps every id to its text. Every daemon
that serves a model does this once, and the result is the same for the same files. The
finished wrapper, pickled, loads in ~0.13 s.

Reading a pickle is running code, so a kept tokenizer is read only where:

* it carries a valid HMAC-SHA256 of its bytes under this user's key (``key`` in the same
  folder, made at random on first use, readable by this user only): bytes that anyone else
  wrote, copied or linked there do not verify, and are never unpickled;
* the file is a regular file of this user with one link, that no one else may write, opened
  without following links;
* it names only the tokenizer parts mlx-lm's wrapper is made of (:class:`_TokenizerUnpickler`):
  exact (module, name) pairs, the name defined in that module (no dotted path, no re-export).

Anything else (no file, a file of another version, one that fails those checks or does not
load) costs only the time: the tokenizer is loaded as mlx-lm does and kept again. A file's
name is a digest of the model folder, its files but the weights (every file below it: names,
sizes and, up to 16 MiB, contents), the EOS ids asked for, and the versions of Python, mlx-lm,
transformers and tokenizers.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import pickle
import secrets
import stat
import sys
from pathlib import Path
from typing import Any

from meshd.runtime.files import remove_oldest, replace_bytes

log = logging.getLogger("meshd.models.tokenizers")

TOKENIZERS_FOLDER = "tokenizers"  # in the model store
KEY_FILE = "key"  # this user's HMAC key, in that folder
KEPT = 16  # files; past that the oldest go (tokenizers of models or versions since replaced)
HASHED_UP_TO = 16 * 1024 * 1024  # bytes: larger non-weight files enter the key by size and time
WEIGHT_SUFFIXES = {".safetensors", ".gguf", ".bin", ".pt", ".pth", ".npz"}
MAC_BYTES = 32
LARGEST_KEPT = 256 * 1024 * 1024  # bytes: a kept tokenizer larger than this is not ours

# How many tokenizers this process read from files, and how many it loaded as mlx-lm does.
counts = {"read": 0, "loaded": 0}

# What mlx-lm's TokenizerWrapper of a Hugging Face tokenizer is made of: (module, name) pairs,
# and the modules whose functions mlx-lm keeps on it (tool-call parsers, chat templates).
_CLASSES = {
    ("mlx_lm.tokenizer_utils", "TokenizerWrapper"),
    ("mlx_lm.tokenizer_utils", "NaiveStreamingDetokenizer"),
    ("mlx_lm.tokenizer_utils", "SPMStreamingDetokenizer"),
    ("mlx_lm.tokenizer_utils", "BPEStreamingDetokenizer"),
    ("tokenizers", "Tokenizer"),
    ("tokenizers", "AddedToken"),
    ("tokenizers.models", "Model"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("collections", "OrderedDict"),
    ("functools", "partial"),  # mlx-lm's SPM detokenizer without its leading space
}
_FUNCTIONS = {
    "mlx_lm.tool_parsers": "parse_tool_call",
    "mlx_lm.chat_templates": "apply_chat_template",
}


class RefusedPickle(pickle.UnpicklingError):
    """A kept tokenizer names something that is not a tokenizer part."""


class NotPrivate(OSError):
    """A key or kept tokenizer that is not this user's private file, or not of its size."""


class _TokenizerUnpickler(pickle.Unpickler):
    """An unpickler that resolves the parts of mlx-lm's tokenizer wrapper only (see the module
    docstring): checked by name before any module is imported, then by what was found."""

    def find_class(self, module: str, name: str) -> Any:
        package = module.rpartition(".")[0]
        if "." in name or not (
            (module, name) in _CLASSES
            or _FUNCTIONS.get(package) == name
            or (_is_transformers_tokenization(module) and name[:1].isupper())
        ):
            raise RefusedPickle(f"names {module}.{name}")
        found = super().find_class(module, name)
        defined_here = (
            getattr(found, "__module__", None) == module
            and getattr(found, "__qualname__", None) == name
        )
        if not defined_here:
            raise RefusedPickle(f"names {module}.{name}, which is not defined there")
        if _is_transformers_tokenization(module) and not _is_tokenizer_class(found):
            raise RefusedPickle(f"names {module}.{name}, which is not a tokenizer class")
        return found


def _is_transformers_tokenization(module: str) -> bool:
    return module.startswith("transformers.") and "tokenization" in module.rsplit(".", 1)[-1]


def _is_tokenizer_class(found: Any) -> bool:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    return isinstance(found, type) and issubclass(found, PreTrainedTokenizerBase)


def load_tokenizer(model_dir: Path, eos_token_ids: Any, folder: Path | None) -> Any:
    """mlx-lm's tokenizer wrapper of ``model_dir`` (with ``eos_token_ids``, as
    ``mlx_lm.utils.load_tokenizer`` takes them): kept in ``folder`` when it is there, else
    loaded and kept there; without a folder, loaded."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    key, file = None, None
    if folder is not None:
        try:
            key = user_key(folder)
            file = folder / f"tokenizer-{tokenizer_key(model_dir, eos_token_ids)}.pickle"
        except NotPrivate as error:  # a key file that is not private: said, not used
            log.warning("tokenizers are not kept: %s", error)
        except OSError as error:  # no folder of ours (a read-only store): load each time
            log.debug("tokenizers are not kept in %s: %s", folder, error)
    if key is not None and file is not None:
        kept = read_tokenizer(file, key)
        if kept is not None:
            counts["read"] += 1
            return kept
    tokenizer = mlx_lm_load_tokenizer(model_dir, eos_token_ids=eos_token_ids)
    counts["loaded"] += 1
    if key is not None and file is not None:
        write_tokenizer(file, tokenizer, key)
    return tokenizer


def tokenizer_files(model_dir: Path) -> list[tuple[str, int, int]]:
    """Path (below ``model_dir``), size and modification time of every file of ``model_dir``
    but the weights: what a tokenizer is loaded from (a folder rewritten with another model's
    files differs), subfolders such as ``additional_chat_templates`` included."""
    root = Path(model_dir)
    files = []
    for path in sorted(root.rglob("*")):
        if path.suffix in WEIGHT_SUFFIXES or not path.is_file():
            continue
        status = path.stat()
        files.append((str(path.relative_to(root)), status.st_size, status.st_mtime_ns))
    return files


def tokenizer_key(model_dir: Path, eos_token_ids: Any) -> str:
    """The digest naming a kept tokenizer (see the module docstring); OSError where the folder
    cannot be read."""
    import mlx_lm
    import tokenizers
    import transformers

    digest = hashlib.sha256()
    versions = [sys.version, mlx_lm.__version__, transformers.__version__, tokenizers.__version__]
    digest.update(json.dumps([str(Path(model_dir).resolve()), eos_token_ids, versions]).encode())
    for name, size, mtime in tokenizer_files(model_dir):
        digest.update(json.dumps([name, size, mtime]).encode())
        if size <= HASHED_UP_TO:
            digest.update(hashlib.sha256((Path(model_dir) / name).read_bytes()).digest())
    return digest.hexdigest()[:24]


def user_key(folder: Path) -> bytes:
    """This user's HMAC key in ``folder``, made on first use (OSError where there is none of
    this user's own that no one else may read, and none can be made)."""
    file = folder / KEY_FILE
    try:
        return _read_private(file, MAC_BYTES)
    except FileNotFoundError:
        pass
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Written whole under a name of this process, then linked to ``key``: a daemon killed
    # while writing leaves no short key, and of two daemons making one, one link wins.
    partial = folder / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    replace_bytes(partial, secrets.token_bytes(MAC_BYTES), mode=0o600)
    try:
        os.link(partial, file)
    except FileExistsError:
        pass
    finally:
        partial.unlink(missing_ok=True)
    return _read_private(file, MAC_BYTES)


def _read_private(file: Path, size: int | None = None) -> bytes:
    """The bytes of ``file``, a regular file of this user with one link that only this user
    may write (and, for a key, read); opened without following a link or blocking on a pipe.
    :class:`NotPrivate` naming what is wrong otherwise; ``size``: a key's exact size."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    with open(os.open(file, flags), "rb") as opened:
        status = os.fstat(opened.fileno())
        others = stat.S_IRWXG | stat.S_IRWXO if size is not None else stat.S_IWGRP | stat.S_IWOTH
        if (
            not stat.S_ISREG(status.st_mode)
            or status.st_nlink != 1
            or status.st_uid != os.getuid()
            or status.st_mode & others
        ):
            raise NotPrivate(
                f"{file} is not a private file of this user (remove it; meshd writes its own)"
            )
        if status.st_size > (size or LARGEST_KEPT):
            raise NotPrivate(f"{file} is larger than meshd writes it (remove it)")
        data = opened.read()
    if size is not None and len(data) != size:
        raise NotPrivate(f"{file} is not a key of {size} bytes (remove it)")
    return data


def read_tokenizer(file: Path, key: bytes) -> Any | None:
    """The tokenizer kept in ``file`` under ``key``; None where there is none or it may not or
    cannot be read (then it is loaded and written again)."""
    try:
        data = _read_private(file)
    except FileNotFoundError:
        return None
    except OSError as error:
        log.warning("ignoring the kept tokenizer %s: %s", file, error)
        return None
    mac, kept = data[:MAC_BYTES], data[MAC_BYTES:]
    if not hmac.compare_digest(mac, _signature(key, file, kept)):
        log.warning("ignoring the kept tokenizer %s: it was not written by this user's meshd", file)
        return None
    try:
        return _TokenizerUnpickler(io.BytesIO(kept)).load()
    except RefusedPickle as refusal:
        log.warning("ignoring the kept tokenizer %s: it %s (loading the tokenizer)", file, refusal)
    except Exception as error:  # a file of another version: load instead
        log.debug("kept tokenizer %s does not load (%r): loading it", file, error)
    return None


def write_tokenizer(file: Path, tokenizer: Any, key: bytes) -> None:
    """Keep ``tokenizer`` in ``file`` (readable by this user only, with its HMAC under
    ``key``), where it pickles and reads back through :class:`_TokenizerUnpickler`; nothing
    where it cannot be."""
    try:
        data = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        _TokenizerUnpickler(io.BytesIO(data)).load()
    except Exception as error:  # a tokenizer with parts we do not keep
        log.debug("the tokenizer for %s is not kept: %r", file, error)
        return
    try:
        replace_bytes(file, _signature(key, file, data) + data, mode=0o600)
    except OSError as error:
        log.debug("could not keep the tokenizer in %s: %s", file, error)
        return
    remove_oldest(file.parent, "tokenizer-*.pickle", KEPT)


def _signature(key: bytes, file: Path, data: bytes) -> bytes:
    """HMAC-SHA256 of a kept tokenizer's bytes and its file name (which names the model files,
    EOS ids and versions it was loaded for: a file renamed to another key does not verify)."""
    return hmac.new(key, file.name.encode() + b"\0" + data, hashlib.sha256).digest()
