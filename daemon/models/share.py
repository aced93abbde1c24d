"""Model distribution: a node fetches only its own layers from a peer that has the model.

exo's users complain that every node downloads the whole model. Here a node that holds a
stage of the committed plan but has no copy of the model asks a member that has it for
exactly its part: the tensors of its layer range (plus the embedding on the first stage and
norm/head on the last), the config and the tokenizer files. The part is a small, valid
model directory whose index lists only those tensors, so `meshd.inference.stage.shard.load_stage`
loads it like any other. A node that holds no stage fetches only the config and tokenizer (it
may still be the origin of requests).

The transfer runs over the peer's mutual-TLS channel (`Peer.FetchModelPart`), so only mesh
members can fetch. The model is named by its digest (the hash of its description that the
agreement already compares), so a peer never serves a different model under the same name.
Parts are written to a temporary folder and renamed into place once complete. Both ends run
on the asyncio thread that also carries heartbeats, so exporting, reading, writing and
hashing run in worker threads (`PartExporter`, `receive_part`).

A daemon runs for months and its stage changes with the mesh, so fetched parts are pruned:
after each install, parts that no installed plan uses are deleted, except the most recently
used spare (a mesh that flips back does not fetch again), and so are staging folders that a
killed daemon left behind (`prune_parts`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from meshd.runtime.lazy_imports import import_model_runtime
from meshd.wire import pb

log = logging.getLogger("meshd.models")

CHUNK_BYTES = 1024 * 1024
FETCH_TIMEOUT_S = 600.0
SPARE_PARTS = 1
STALE_STAGING_S = 2 * FETCH_TIMEOUT_S  # older staging folders belong to no running fetch
# Everything in a model directory that is not weights: config, tokenizer, chat template.
NON_WEIGHT_FILES = (
    "config.json",
    "generation_config.json",
    "hf_quant_config.json",  # mlx-lm reads it for ModelOpt (nvfp4) checkpoints
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "meshd-model.json",
)


class ModelShareError(RuntimeError):
    """A part could not be exported or fetched; the message says which and why."""


@dataclass(frozen=True)
class PartSpec:
    """Which part of which model: a layer range and whether it embeds or holds the head."""

    name: str
    digest: str
    layer_start: int
    layer_end: int
    has_embedding: bool
    has_head: bool

    @property
    def folder_name(self) -> str:
        flags = ("e" if self.has_embedding else "") + ("h" if self.has_head else "")
        return f"{self.name}@{self.digest}-{self.layer_start}-{self.layer_end}{flags}"

    def to_request(self) -> pb.ModelPartRequest:
        return pb.ModelPartRequest(
            model_name=self.name,
            model_digest=self.digest,
            layer_start=self.layer_start,
            layer_end=self.layer_end,
            has_embedding=self.has_embedding,
            has_head=self.has_head,
        )

    @classmethod
    def from_request(cls, request: pb.ModelPartRequest) -> PartSpec:
        return cls(
            request.model_name,
            request.model_digest,
            request.layer_start,
            request.layer_end,
            request.has_embedding,
            request.has_head,
        )


def export_part(model_dir: Path, part: PartSpec, out_dir: Path) -> list[Path]:
    """Write `part` of the model in `model_dir` as a model directory in `out_dir`.

    Blocking (reads and writes weights): run it off the event loop.
    """
    import_model_runtime()
    from meshd.models.safetensors import INDEX_FILE, load_stage_tensors, write_sharded_safetensors

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in NON_WEIGHT_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out_dir / name)
    if part.layer_end > part.layer_start or part.has_embedding or part.has_head:
        config = json.loads((model_dir / "config.json").read_text())
        # A tied head multiplies by the embedding matrix, so the last stage needs it too
        # (when the config does not say, send it: an unused tensor beats a failed load).
        tied = bool(config.get("tie_word_embeddings", True))
        weights = load_stage_tensors(
            model_dir,
            part.layer_start,
            part.layer_end,
            keep_embedding=part.has_embedding or (part.has_head and tied),
            keep_head=part.has_head,
        )
        write_sharded_safetensors(out_dir, weights, max_shard_bytes=256 * 1024 * 1024)
    else:
        index = {"metadata": {"total_size": 0}, "weight_map": {}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index))
    return sorted(path for path in out_dir.iterdir() if path.is_file())


class PartExporter:
    """Serves parts of this node's copy of a model to members (`Peer.FetchModelPart`).

    Runs on the asyncio thread that also carries heartbeats, so every blocking step (the
    export, reading and hashing 1 MiB chunks, deleting the exported copy) runs in a worker
    thread. `locate(name, digest)` returns this node's directory of that model, or None.
    """

    def __init__(self, locate: Callable[[str, str], Awaitable[Path | None]]) -> None:
        self._locate = locate

    async def stream_part(
        self, request: pb.ModelPartRequest, caller: str | None
    ) -> AsyncIterator[pb.FileChunk]:
        """The part's files as chunks; FileNotFoundError when this node lacks the model."""
        part = PartSpec.from_request(request)
        source = await self._locate(part.name, part.digest)
        if source is None:
            raise FileNotFoundError(f"this node has no copy of model {part.name} ({part.digest})")
        root = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="meshd-part-"))
        try:
            paths = await asyncio.to_thread(export_part, source, part, root)
            log.info("sending %s of %s to %s", describe_part(part), part.name, caller or "a peer")
            async for chunk in read_chunks(paths, root):
                yield chunk
        finally:
            await asyncio.to_thread(shutil.rmtree, root, True)


def describe_part(part: PartSpec) -> str:
    """'layers 0-9', or 'the config and tokenizer' for a node that holds no stage."""
    if part.layer_end <= part.layer_start:
        return "the config and tokenizer"
    return f"layers {part.layer_start}-{part.layer_end - 1}"


async def read_chunks(paths: list[Path], root: Path) -> AsyncIterator[pb.FileChunk]:
    """The files as chunks, each file's last chunk marked, with a sha256 to check.

    asyncio side: reads and hashing run in a worker thread, one chunk at a time.
    """
    for path in paths:
        handle = await asyncio.to_thread(path.open, "rb")
        try:
            size = os.fstat(handle.fileno()).st_size
            digest = hashlib.sha256()
            offset = 0
            while True:
                data = await asyncio.to_thread(_read_and_hash, handle, digest)
                last = offset + len(data) >= size
                yield pb.FileChunk(
                    path=str(path.relative_to(root)),
                    offset=offset,
                    data=data,
                    size=size,
                    sha256=digest.hexdigest() if last else "",
                )
                offset += len(data)
                if last:
                    break
        finally:
            handle.close()


def _read_and_hash(handle: BinaryIO, digest: Any) -> bytes:
    data = handle.read(CHUNK_BYTES)
    digest.update(data)
    return data


async def receive_part(chunks: AsyncIterator[pb.FileChunk], dest: Path) -> int:
    """Write streamed chunks into `dest` atomically; returns the bytes received.

    asyncio side: writing and hashing run in a worker thread, one chunk at a time.
    """
    if await asyncio.to_thread(dest.exists):
        return 0
    staging = await asyncio.to_thread(_make_staging, dest)
    received = 0
    hashes: dict[str, Any] = {}
    try:
        async for chunk in chunks:
            await asyncio.to_thread(_write_chunk, staging, chunk, hashes)
            received += len(chunk.data)
        await asyncio.to_thread(_install_staging, staging, dest)
    except BaseException:
        await asyncio.shield(asyncio.to_thread(shutil.rmtree, staging, True))
        raise
    return received


def _make_staging(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))


def _write_chunk(staging: Path, chunk: pb.FileChunk, hashes: dict[str, Any]) -> None:
    """Write one chunk into the staging folder and check the file's sha256 at its end."""
    target = (staging / chunk.path).resolve()
    if staging.resolve() not in target.parents:
        raise ModelShareError(f"the peer sent a file outside the part: {chunk.path!r}")
    running = hashes.setdefault(chunk.path, hashlib.sha256())
    running.update(chunk.data)
    with target.open("r+b" if chunk.offset else "wb") as handle:
        handle.seek(chunk.offset)
        handle.write(chunk.data)
    if chunk.sha256 and running.hexdigest() != chunk.sha256:
        raise ModelShareError(f"{chunk.path} arrived damaged (checksum mismatch)")


def _install_staging(staging: Path, dest: Path) -> None:
    if not (staging / "config.json").is_file():
        raise ModelShareError("the part has no config.json; the peer could not export it")
    staging.replace(dest)


def mark_used(part_dir: Path) -> None:
    """Record that `part_dir` serves a plan now (its mtime orders spares in `prune_parts`)."""
    os.utime(part_dir)


def prune_parts(parts_root: Path, in_use: Collection[Path], spare: int = SPARE_PARTS) -> list[Path]:
    """Delete fetched parts no installed plan uses, keeping the `spare` most recently used.

    Also deletes staging folders older than STALE_STAGING_S (a daemon killed mid-fetch).
    Returns what was deleted. Call it only between fetches (the daemon installs and
    withdraws plans one at a time), so no part is being written meanwhile.
    """
    if not parts_root.is_dir():
        return []
    keep = {path.resolve() for path in in_use}
    now = time.time()
    parts, stale = [], []
    for entry in parts_root.iterdir():
        if not entry.is_dir():
            continue
        if entry.name.startswith("."):
            if now - entry.stat().st_mtime > STALE_STAGING_S:
                stale.append(entry)
        elif entry.resolve() not in keep:
            parts.append(entry)
    parts.sort(key=lambda entry: entry.stat().st_mtime, reverse=True)
    doomed = parts[spare:] + stale
    for entry in doomed:
        shutil.rmtree(entry, ignore_errors=True)
    return doomed
