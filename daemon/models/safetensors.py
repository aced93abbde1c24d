"""Safetensors model files: headers, the index, and exactly the tensors a stage needs.

One place reads and writes the weight files of a model directory: the model description
(:mod:`meshd.models.info`) reads headers only, stages and model parts read exactly the tensors
of their layer range from only the files that hold them (``mx.load`` is lazy, so nothing else
is read), and imports write sharded files with an index so that later stages open few files.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # MLX loads only when tensors are read or written, not for headers
    import mlx.core as mx

MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ModelInfoError(ValueError):
    """The directory does not hold a model we can describe (missing or malformed files)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its safetensors header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensors listed in one safetensors file's header (the tensor data is never read)."""
    try:
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise ModelInfoError(f"{path}: too short to be a safetensors file")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or length > path.stat().st_size - 8:
                raise ModelInfoError(
                    f"{path}: header length {length} is not plausible; the file is not "
                    "safetensors or is truncated"
                )
            header = json.loads(handle.read(length))
    except OSError as error:
        raise ModelInfoError(f"cannot read {path}: {error}") from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelInfoError(f"{path}: the safetensors header is not valid JSON") from error
    if not isinstance(header, dict):
        raise ModelInfoError(f"{path}: the safetensors header is not a JSON object")
    return {
        name: _tensor_info(path, name, entry)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _tensor_info(path: Path, name: str, entry: Any) -> TensorInfo:
    try:
        start, end = entry["data_offsets"]
        return TensorInfo(name, str(entry["dtype"]), tuple(entry["shape"]), int(end) - int(start))
    except (KeyError, TypeError, ValueError) as error:
        raise ModelInfoError(f"{path}: tensor {name!r} has a malformed header entry") from error


def load_stage_tensors(
    model_dir: Path, start: int, end: int, *, keep_embedding: bool, keep_head: bool
) -> dict[str, mx.array]:
    """Lazy arrays for exactly the stage's tensors, opening only the files that hold them."""
    weight_map = read_weight_map(model_dir)
    needed = {
        name: file_name
        for name, file_name in weight_map.items()
        if stage_needs_tensor(name, start, end, keep_embedding=keep_embedding, keep_head=keep_head)
    }
    import mlx.core as mx

    weights: dict[str, mx.array] = {}
    for file_name in sorted(set(needed.values())):
        file_tensors = mx.load(str(model_dir / file_name))  # lazy: nothing is read yet
        for name in (n for n, f in needed.items() if f == file_name):
            if name not in file_tensors:
                raise ModelInfoError(
                    f"{model_dir / INDEX_FILE} says {name} is in {file_name}, but it is not; "
                    "the index is stale: re-import the model."
                )
            weights[name] = file_tensors[name]
    return weights


def stage_needs_tensor(
    name: str, start: int, end: int, *, keep_embedding: bool, keep_head: bool
) -> bool:
    """Whether tensor ``name`` belongs to the stage: its layers, embedding or norm/head."""
    match = _LAYER_NAME.search(name)
    if match is not None:
        return start <= int(match.group(1)) < end
    if "embed_tokens" in name:
        return keep_embedding
    return keep_head


def read_weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or, failing that, the files' headers."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        return dict(json.loads(index_path.read_text())["weight_map"])
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise ModelInfoError(f"{model_dir} has no model*.safetensors files.")
    return {name: path.name for path in files for name in safetensors_tensor_names(path)}


def safetensors_tensor_names(path: Path) -> list[str]:
    """Names of the tensors in a safetensors file, read from its header alone."""
    return list(read_safetensors_header(path))


def write_sharded_safetensors(
    path: Path,
    weights: dict[str, mx.array],
    *,
    max_shard_bytes: int,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Save ``weights`` as ``model-XXXXX-of-YYYYY.safetensors`` plus ``INDEX_FILE``.

    Consumes ``weights`` (entries are removed as they are written) so lazy arrays, e.g. a
    dequantization, are computed one file at a time and freed after it: peak memory stays near
    one file. Tensors go in natural name order, so a layer's tensors share a file and a stage
    opens few files. ``progress(tensors_written)`` is called after each file.
    """
    names = sorted(weights, key=_natural_key)
    groups = _group_by_size([(name, weights[name].nbytes) for name in names], max_shard_bytes)
    file_names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    total_size = 0
    written = 0
    for file_name, group in zip(file_names, groups, strict=True):
        shard = {name: weights.pop(name) for name in group}
        _save(path / file_name, shard)
        total_size += sum(value.nbytes for value in shard.values())
        weight_map.update(dict.fromkeys(group, file_name))
        written += len(group)
        del shard
        if progress is not None:
            progress(written)
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    temp = path / f".{INDEX_FILE}.tmp"
    temp.write_text(json.dumps(index, indent=2))
    temp.replace(path / INDEX_FILE)
    return file_names


def _group_by_size(sized_names: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor gets a group of its own)."""
    groups: list[list[str]] = []
    group_bytes = 0
    for name, size in sized_names:
        if not groups or (groups[-1] and group_bytes + size > max_bytes):
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += size
    return groups


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort ``layers.10`` after ``layers.9`` so files hold consecutive layers."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in name.split("."))


def _save(path: Path, tensors: dict[str, mx.array]) -> None:
    import mlx.core as mx

    mx.save_safetensors(str(path), tensors, metadata={"format": "mlx"})
