"""Models named by Hugging Face repository (``ORG/NAME[@REVISION]``), in the standard HF cache.

Why this shape: users already have models where mlx-lm, LM Studio and ``hf download`` put
them (``HF_HUB_CACHE`` / ``HF_HOME``), so a repository already there is used in place, and
what meshd downloads lands there too, where those tools find it. huggingface_hub does what
speaks to the Hub: the repository's file list and hashes (``HfApi.model_info`` with
``files_metadata``), safetensors headers by range request, the download URL, the session,
the token (``HF_TOKEN`` or the saved one), ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE``.

What meshd adds, and why it does not call ``hf_hub_download`` for weights: a download must
resume after a restart from where it stopped (huggingface_hub 2.x deletes a partial file),
peers must be able to read a file while it arrives (to pass it on once per mesh), and every
file is checked against the Hub's hash before use. So a file is written to
``blobs/<etag>.meshd-partial`` in the repository's cache folder (resumed with a Range request,
or from a peer at the same offset), verified (sha256 for LFS files, the git blob sha1 for the
others), renamed to ``blobs/<etag>`` and linked from ``snapshots/<commit>/<path>``: exactly
the layout huggingface_hub writes, so its own tools and ``scan_cache_dir`` read it.

The repository's manifest (commit, files, sizes, hashes) is kept beside the cache under
``<store>/hub/`` so that a node that cannot reach the Hub learns it from a peer, and so that
``meshd models`` can tell a complete copy from a partial one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshd.models.share import NON_WEIGHT_FILES
from meshd.runtime.files import replace_text

HUB_PATH_PREFIX = "hf:"
MANIFESTS_DIR = "hub"
PARTIAL_SUFFIX = ".meshd-partial"
CHUNK_BYTES = 1024 * 1024
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
# What a node needs besides weights: the files a model part carries (config, generation
# settings, tokenizer, chat template), less meshd's own record, plus the Hub's index.
METADATA_FILES = (
    *(name for name in NON_WEIGHT_FILES if name != "meshd-model.json"),
    "added_tokens.json",
    INDEX_FILE,
)
# Quantizations of PyTorch checkpoints that MLX cannot load (mlx-lm reads its own
# `quantization` section, mxfp4 and fp8; these need their own kernels).
UNLOADABLE_QUANTIZATIONS = frozenset(
    {"gptq", "awq", "bitsandbytes", "aqlm", "exl2", "hqq", "eetq", "quanto", "vptq", "spqr"}
)
_REPO_REF = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})"
    r"(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]{0,199}))?$"
)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")

Progress = Callable[[int], None]  # bytes just written


class HubError(RuntimeError):
    """A repository could not be used; the message says what was wrong and what to do."""


@dataclass(frozen=True)
class RepoRef:
    """A repository and the revision asked for (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_repo_ref(text: str) -> RepoRef | None:
    """``ORG/NAME[@REVISION]`` as a reference, or None: not of that form, or an existing
    local path (a folder named ``org/name`` beside the user wins over the Hub)."""
    match = _REPO_REF.match(text.strip())
    if match is None or Path(text).expanduser().exists():
        return None
    return RepoRef(match["repo"], match["revision"])


def parse_hub_path(path: str) -> RepoRef | None:
    """The reference of a selection's path ``hf:ORG/NAME@COMMIT``, or None for other paths."""
    if not path.startswith(HUB_PATH_PREFIX):
        return None
    return parse_repo_ref(path.removeprefix(HUB_PATH_PREFIX))


def hub_path(repo_id: str, commit: str) -> str:
    """What a selection carries so that every node resolves the same files."""
    return f"{HUB_PATH_PREFIX}{repo_id}@{commit}"


# ---------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class HubFile:
    """One file of a repository at a commit, as the Hub describes it."""

    path: str
    size: int
    blob_id: str  # the git blob sha1 (of the LFS pointer, for LFS files)
    sha256: str = ""  # LFS files only: the content's sha256

    @property
    def etag(self) -> str:
        """The blob's name in the HF cache (huggingface_hub's choice: sha256 for LFS)."""
        return self.sha256 or self.blob_id


@dataclass(frozen=True)
class Manifest:
    """A repository at one commit: its files with sizes and hashes."""

    repo_id: str
    commit: str
    files: dict[str, HubFile]

    def to_json(self) -> str:
        files = [asdict(entry) for entry in sorted(self.files.values(), key=lambda f: f.path)]
        return json.dumps({"repo_id": self.repo_id, "commit": self.commit, "files": files})

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        record = json.loads(text)
        files = {entry["path"]: HubFile(**entry) for entry in record["files"]}
        return cls(str(record["repo_id"]), str(record["commit"]), files)

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def weight_files(self) -> list[str]:
        return sorted(path for path in self.files if path.endswith(".safetensors"))

    def metadata_files(self) -> list[str]:
        return [name for name in METADATA_FILES if name in self.files]


def hub_api() -> Any:
    """huggingface_hub's client (imported here: the daemon does not need it to start)."""
    from huggingface_hub import HfApi

    return HfApi()


def fetch_manifest(ref: RepoRef) -> Manifest:
    """The repository's files at the revision (resolved to a commit), with clear errors.

    The revision is resolved first (``model_info``), then the files are listed at that
    commit with their sizes and hashes (the tree API, which also lists LFS hashes)."""
    api = hub_api()
    try:
        info = api.model_info(ref.repo_id, revision=ref.revision or "main")
        entries = api.list_repo_tree(ref.repo_id, revision=info.sha, recursive=True)
        files = {}
        for entry in entries:
            if not hasattr(entry, "blob_id"):  # a folder
                continue
            lfs = getattr(entry, "lfs", None)
            files[entry.path] = HubFile(
                path=entry.path,
                size=int(lfs.size if lfs is not None else (entry.size or 0)),
                blob_id=str(entry.blob_id or ""),
                sha256=str(lfs.sha256) if lfs is not None else "",
            )
    except HubError:
        raise
    except Exception as error:
        note_hub_result(error)
        raise _hub_error(ref, error) from error
    note_hub_result(None)
    manifest = Manifest(ref.repo_id, str(info.sha), files)
    check_loadable_files(manifest, ref)
    return manifest


def check_loadable_files(manifest: Manifest, ref: RepoRef) -> None:
    """Refuse at once a repository without config.json or safetensors weights."""
    if CONFIG_FILE not in manifest.files:
        raise HubError(
            f"{ref} has no config.json: it is not a transformers/MLX model repository "
            "(a GGUF-only repository: download the .gguf and run `meshd load FILE.gguf`)"
        )
    if not manifest.weight_files():
        raise HubError(
            f"{ref} has no .safetensors weights (only {', '.join(sorted(manifest.files)[:8])}"
            "...): meshd loads safetensors; pick the repository's MLX or safetensors variant"
        )


def check_quantization(config: dict[str, Any], ref: RepoRef) -> None:
    """Refuse a checkpoint quantized in a way MLX cannot load."""
    method = str((config.get("quantization_config") or {}).get("quant_method", "")).lower()
    if method in UNLOADABLE_QUANTIZATIONS:
        raise HubError(
            f"{ref} is quantized with {method}, which MLX cannot load; use an MLX build of the "
            "model (e.g. from mlx-community) or the unquantized weights"
        )


def _hub_error(ref: RepoRef, error: Exception) -> HubError:
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, GatedRepoError):
        return HubError(
            f"{ref.repo_id} is gated: accept its terms on the Hub, then give meshd a token "
            "(`hf auth login`, or HF_TOKEN in the daemon's environment)"
        )
    if isinstance(error, RevisionNotFoundError):
        return HubError(f"{ref.repo_id} has no revision {ref.revision!r} (a branch, tag or commit)")
    if isinstance(error, RepositoryNotFoundError):
        return HubError(
            f"no repository {ref.repo_id} on the Hub (or it is private: log in with "
            "`hf auth login` or set HF_TOKEN)"
        )
    if isinstance(error, (OfflineModeIsEnabled, LocalEntryNotFoundError)):
        return HubError(f"cannot reach the Hub for {ref} (HF_HUB_OFFLINE is set or no network)")
    return HubError(f"cannot read {ref} from the Hub ({endpoint()}): {error}")


_last_hub_result: list[bool] = []  # this process's last Hub request: reached it or not


def note_hub_result(error: Exception | None) -> None:
    """Remember whether the last Hub request reached the Hub: it did when it succeeded or
    the Hub answered with an HTTP error (a missing file, a gated repository), it did not
    when the connection failed or HF_HUB_OFFLINE refused it."""
    reached = error is None or getattr(error, "response", None) is not None
    _last_hub_result[:] = [reached]


def hub_reachable() -> bool | None:
    """Whether this process's last Hub request reached the Hub; None before the first
    (False at once with HF_HUB_OFFLINE: this node never asks the Hub)."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:
        return False  # read as huggingface_hub reads it, without importing it every second
    return _last_hub_result[0] if _last_hub_result else None


def probe_hub(repo_id: str, commit: str, timeout_s: float = 10.0) -> bool:
    """Ask the Hub for the repository's description (one small API request): whether
    this node can download from it. Blocking: a worker thread."""
    if hub_offline():
        return False
    try:
        hub_api().model_info(repo_id, revision=commit, timeout=timeout_s)
    except Exception as error:
        note_hub_result(error)
        return bool(hub_reachable())
    note_hub_result(None)
    return True


def endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE: this node must not (or cannot) reach the Hub."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


# ---------------------------------------------------------------------------- the HF cache


def cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_cache_dir(repo_id: str) -> Path:
    """The repository's folder in the HF cache (``models--org--name``)."""
    return cache_root() / ("models--" + repo_id.replace("/", "--"))


def snapshot_dir(repo_id: str, commit: str) -> Path:
    return repo_cache_dir(repo_id) / "snapshots" / commit


def blob_path(repo_id: str, entry: HubFile) -> Path:
    return repo_cache_dir(repo_id) / "blobs" / entry.etag


def partial_path(repo_id: str, entry: HubFile) -> Path:
    return repo_cache_dir(repo_id) / "blobs" / (entry.etag + PARTIAL_SUFFIX)


def cached_commit(ref: RepoRef) -> str | None:
    """The commit the local cache has for the reference (a commit, or a branch/tag the cache
    recorded in ``refs/``), or None."""
    revision = ref.revision or "main"
    if _COMMIT.match(revision):
        return revision if snapshot_dir(ref.repo_id, revision).is_dir() else None
    ref_file = repo_cache_dir(ref.repo_id) / "refs" / revision
    if not ref_file.is_file():
        return None
    commit = ref_file.read_text().strip()
    return commit if snapshot_dir(ref.repo_id, commit).is_dir() else None


def write_ref(repo_id: str, revision: str | None, commit: str) -> None:
    """Record that ``revision`` is ``commit`` (as huggingface_hub does), for offline use."""
    name = revision or "main"
    if _COMMIT.match(name):
        return
    path = repo_cache_dir(repo_id) / "refs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(commit)


def present(manifest: Manifest, path: str) -> bool:
    """Whether the snapshot has the file complete (its blob exists with the right size)."""
    entry = manifest.files[path]
    blob = blob_path(manifest.repo_id, entry)
    linked = snapshot_dir(manifest.repo_id, manifest.commit) / path
    try:
        return linked.exists() and blob.stat().st_size == entry.size
    except OSError:
        return False


def missing(manifest: Manifest, paths: Iterable[str]) -> list[str]:
    return [path for path in paths if not present(manifest, path)]


def link_into_snapshot(manifest: Manifest, path: str) -> Path:
    """``snapshots/<commit>/<path>`` -> ``../../blobs/<etag>`` (huggingface_hub's relative
    symlink; a copy where the file system has no symlinks)."""
    entry = manifest.files[path]
    blob = blob_path(manifest.repo_id, entry)
    target = snapshot_dir(manifest.repo_id, manifest.commit) / path
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.exists():
        target.unlink()
    try:
        os.symlink(os.path.relpath(blob, target.parent), target)
    except OSError:
        shutil.copyfile(blob, target)
    return target


# ---------------------------------------------------------------------------- verification


def file_digest_matches(path: Path, entry: HubFile) -> bool:
    """The file is what the Hub says: its size, and its sha256 (LFS) or git blob sha1."""
    try:
        if path.stat().st_size != entry.size:
            return False
        digest = hashlib.sha256() if entry.sha256 else hashlib.sha1()
        if not entry.sha256:
            digest.update(b"blob %d\0" % entry.size)
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                digest.update(chunk)
    except OSError:
        return False
    expected = entry.sha256 or entry.blob_id
    return not expected or digest.hexdigest() == expected


def verify_present(manifest: Manifest, paths: Iterable[str]) -> list[str]:
    """Check each complete file against its hash; a damaged one is deleted (fetched again).

    Returns the paths that were damaged. Blocking: run it in a worker thread.
    """
    damaged = []
    for path in paths:
        if not present(manifest, path):
            continue
        entry = manifest.files[path]
        blob = blob_path(manifest.repo_id, entry)
        if _verified_stamp_ok(blob) or file_digest_matches(blob, entry):
            _stamp_verified(blob)
            continue
        damaged.append(path)
        blob.unlink(missing_ok=True)
        (snapshot_dir(manifest.repo_id, manifest.commit) / path).unlink(missing_ok=True)
    return damaged


def _stamp_file(blob: Path) -> Path:
    return blob.with_name(blob.name + ".meshd-verified")


def _verified_stamp_ok(blob: Path) -> bool:
    """A blob checked before and unchanged since (same size and modification time)."""
    try:
        stat = blob.stat()
        return _stamp_file(blob).read_text() == f"{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        return False


def _stamp_verified(blob: Path) -> None:
    stat = blob.stat()
    _stamp_file(blob).write_text(f"{stat.st_size}:{stat.st_mtime_ns}")


def finish_partial(manifest: Manifest, path: str) -> Path:
    """Verify a fully written partial file, rename it into place and link it.

    A partial file that does not match the Hub's hash is deleted (HubError says so): the
    caller fetches it again from the start.
    """
    entry = manifest.files[path]
    partial = partial_path(manifest.repo_id, entry)
    if not file_digest_matches(partial, entry):
        partial.unlink(missing_ok=True)
        raise HubError(f"{manifest.repo_id}/{path} arrived damaged (hash mismatch); refetching")
    blob = blob_path(manifest.repo_id, entry)
    os.replace(partial, blob)
    _stamp_verified(blob)
    return link_into_snapshot(manifest, path)


# ---------------------------------------------------------------------------- downloads


def download_from_hub(manifest: Manifest, path: str, progress: Progress | None = None) -> Path:
    """Download one file into the cache, resuming a partial file; verify; link. Blocking."""
    from huggingface_hub import get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    if present(manifest, path):
        return snapshot_dir(manifest.repo_id, manifest.commit) / path
    entry = manifest.files[path]
    partial = partial_path(manifest.repo_id, entry)
    partial.parent.mkdir(parents=True, exist_ok=True)
    offset = partial.stat().st_size if partial.exists() else 0
    if offset > entry.size:
        partial.unlink()
        offset = 0
    if offset < entry.size:
        url = hf_hub_url(manifest.repo_id, path, revision=manifest.commit, endpoint=endpoint())
        headers = build_hf_headers()
        if offset:
            headers["Range"] = f"bytes={offset}-"
        ref = RepoRef(manifest.repo_id, manifest.commit)
        try:
            with get_session().stream("GET", url, headers=headers, follow_redirects=True) as reply:
                hf_raise_for_status(reply)
                if offset and reply.status_code != 206:  # the server ignored the range
                    offset = 0
                with partial.open("r+b" if offset else "wb") as handle:
                    handle.seek(offset)
                    handle.truncate()
                    for chunk in reply.iter_bytes(CHUNK_BYTES):
                        handle.write(chunk)
                        handle.flush()
                        if progress is not None:
                            progress(len(chunk))
        except HubError:
            raise
        except Exception as error:
            note_hub_result(error)
            raise _hub_error(ref, error) from error
        note_hub_result(None)
    return finish_partial(manifest, path)


# ---------------------------------------------------------------------------- manifests kept


def manifest_file(store_root: Path, repo_id: str, commit: str) -> Path:
    return Path(store_root) / MANIFESTS_DIR / f"{repo_id.replace('/', '--')}@{commit}.json"


def save_manifest(store_root: Path, manifest: Manifest) -> Path:
    path = manifest_file(store_root, manifest.repo_id, manifest.commit)
    replace_text(path, manifest.to_json())
    return path


def load_manifest(store_root: Path, repo_id: str, commit: str) -> Manifest | None:
    path = manifest_file(store_root, repo_id, commit)
    try:
        return Manifest.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve_manifest(store_root: Path, ref: RepoRef) -> Manifest:
    """The manifest for a reference: kept locally for a cached commit (works offline),
    else asked of the Hub (and kept)."""
    commit = cached_commit(ref)
    if commit is not None:
        kept = load_manifest(store_root, ref.repo_id, commit)
        if kept is not None:
            return kept
    if hub_offline():
        if commit is not None:
            return manifest_from_snapshot(ref.repo_id, commit)
        raise HubError(f"{ref} is not in the local HF cache and HF_HUB_OFFLINE is set")
    manifest = fetch_manifest(ref)
    save_manifest(store_root, manifest)
    write_ref(ref.repo_id, ref.revision, manifest.commit)
    return manifest


def manifest_from_snapshot(repo_id: str, commit: str) -> Manifest:
    """A manifest for a snapshot another tool downloaded (no hashes: sizes from the files)."""
    root = snapshot_dir(repo_id, commit)
    files = {}
    for item in sorted(root.rglob("*")):
        if item.is_file():
            relative = str(item.relative_to(root))
            files[relative] = HubFile(relative, item.stat().st_size, Path(item.resolve()).name)
    return Manifest(repo_id, commit, files)


def complete_snapshot(store_root: Path, ref: RepoRef) -> Path | None:
    """The snapshot folder when the local cache holds every file of the reference (used in
    place, never copied), else None. Needs no network."""
    commit = cached_commit(ref)
    if commit is None:
        return None
    manifest = load_manifest(store_root, ref.repo_id, commit)
    if manifest is None:  # downloaded by another tool: complete as far as HF knows
        folder = snapshot_dir(ref.repo_id, commit)
        has_weights = any(folder.glob("*.safetensors"))
        return folder if (folder / CONFIG_FILE).is_file() and has_weights else None
    return None if missing(manifest, manifest.files) else snapshot_dir(ref.repo_id, commit)


# ---------------------------------------------------------------------------- a stage's files


def weight_map(snapshot: Path, manifest: Manifest) -> dict[str, str]:
    """Tensor name -> file, from the index (a single-file model: every tensor in it)."""
    index = snapshot / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text()).get("weight_map", {}))
    return {"*": manifest.weight_files()[0]}


def files_for_stage(
    weights: dict[str, str],
    metadata: list[str],
    start: int,
    end: int,
    *,
    has_embedding: bool,
    has_head: bool,
    tied: bool,
) -> set[str]:
    """The files a stage needs: config and tokenizer, and the weight files holding its
    layers' tensors (plus the embedding on the first stage, norm/head on the last; a tied
    head needs the embedding too)."""
    from meshd.models.safetensors import stage_needs_tensor

    needed = set(metadata)
    if "*" in weights:  # one file holds everything
        if end > start or has_embedding or has_head:
            needed.add(weights["*"])
        return needed
    keep_embedding = has_embedding or (has_head and tied)
    for name, file in weights.items():
        if stage_needs_tensor(name, start, end, keep_embedding=keep_embedding, keep_head=has_head):
            needed.add(file)
    return needed


# ---------------------------------------------------------------------------- the spec


def write_spec_dir(manifest: Manifest, snapshot: Path, out: Path) -> Path:
    """A folder :func:`meshd.models.info.read_model_spec` reads like the model: config,
    index, and each weight file's safetensors header alone (read from the Hub by range
    request), so the plan has true sizes before any weights are downloaded."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_FILE, INDEX_FILE):
        if (snapshot / name).is_file():
            shutil.copyfile(snapshot / name, out / name)
    for path in manifest.weight_files():
        local = snapshot / path
        fetched = present(manifest, path)
        header = _local_header(local) if fetched else _remote_header(manifest, path)
        stub = out / path
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_bytes(struct.pack("<Q", len(header)) + header)
    return out


def _local_header(path: Path) -> bytes:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return handle.read(length)


def _remote_header(manifest: Manifest, path: str) -> bytes:
    ref = RepoRef(manifest.repo_id, manifest.commit)
    try:
        meta = hub_api().parse_safetensors_file_metadata(
            manifest.repo_id, path, revision=manifest.commit
        )
    except Exception as error:
        raise _hub_error(ref, error) from error
    header: dict[str, Any] = {}
    if meta.metadata:
        header["__metadata__"] = meta.metadata
    for name, tensor in meta.tensors.items():
        header[name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": list(tensor.data_offsets),
        }
    return json.dumps(header).encode()


# ---------------------------------------------------------------------------- listing, removal


@dataclass(frozen=True)
class CachedRevision:
    """One revision of a repository in the HF cache, as `meshd models` lists it."""

    repo_id: str
    commit: str
    refs: tuple[str, ...]
    size_bytes: int  # on this node
    total_bytes: int  # the whole revision (0: unknown)
    complete: bool
    path: Path


def list_cached(store_root: Path) -> list[CachedRevision]:
    """The models in the HF cache (huggingface_hub's scan), each revision with its size here
    and whether it is complete (against the manifest meshd kept, where it has one)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_root())
    except CacheNotFound:
        return []
    listed = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: r.commit_hash):
            manifest = load_manifest(store_root, repo.repo_id, revision.commit_hash)
            complete = manifest is None or not missing(manifest, manifest.files)
            listed.append(
                CachedRevision(
                    repo_id=repo.repo_id,
                    commit=revision.commit_hash,
                    refs=tuple(sorted(revision.refs)),
                    size_bytes=int(revision.size_on_disk),
                    total_bytes=manifest.total_bytes if manifest else int(revision.size_on_disk),
                    complete=complete,
                    path=Path(revision.snapshot_path),
                )
            )
    return listed


def remove_cached(store_root: Path, ref: RepoRef) -> int:
    """Delete the repository's revisions (one, when a revision is given) from the HF cache,
    with huggingface_hub's cache management; returns the bytes freed."""
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cache_root())
    hashes = [
        revision.commit_hash
        for repo in info.repos
        if repo.repo_id == ref.repo_id and repo.repo_type == "model"
        for revision in repo.revisions
        if ref.revision is None
        or revision.commit_hash.startswith(ref.revision)
        or ref.revision in revision.refs
    ]
    if not hashes:
        raise HubError(f"{ref} is not in the HF cache ({cache_root()})")
    strategy = info.delete_revisions(*hashes)
    freed = int(strategy.expected_freed_size)
    strategy.execute()
    for commit in hashes:
        manifest_file(store_root, ref.repo_id, commit).unlink(missing_ok=True)
    _remove_partials(ref.repo_id)
    return freed


def _remove_partials(repo_id: str) -> None:
    blobs = repo_cache_dir(repo_id) / "blobs"
    if blobs.is_dir():
        for item in blobs.glob("*" + PARTIAL_SUFFIX):
            item.unlink(missing_ok=True)


def wait_until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> bool:
    """Poll ``predicate`` (bounded); for blocking code that waits on another writer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


# ---------------------------------------------------------------------------- a node's files


@dataclass(frozen=True)
class StageRange:
    """The part of the model a node serves (no layers: config and tokenizer only)."""

    layer_start: int = 0
    layer_end: int = 0
    has_embedding: bool = False
    has_head: bool = False


def fetch_stage_files(
    store_root: Path,
    selection_path: str,
    stage: StageRange,
    node: str,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Make the snapshot hold what this node's stage needs, downloading only what is missing
    (config and tokenizer, the weight files holding its tensors); returns the snapshot.

    Each file already here is checked against the Hub's hash first (a damaged one is fetched
    again), and the disk's free space against what is missing before anything is fetched.
    ``progress(done, total)`` is told the bytes as they arrive. Blocking: a worker thread.
    """
    ref = parse_hub_path(selection_path)
    if ref is None:
        raise HubError(f"{selection_path!r} names no Hugging Face repository")
    manifest = resolve_manifest(store_root, ref)
    snapshot = snapshot_dir(manifest.repo_id, manifest.commit)
    metadata = manifest.metadata_files()
    verify_present(manifest, metadata)
    for path in missing(manifest, metadata):
        download_from_hub(manifest, path)
    config = json.loads((snapshot / CONFIG_FILE).read_text())
    needed = files_for_stage(
        weight_map(snapshot, manifest),
        metadata,
        stage.layer_start,
        stage.layer_end,
        has_embedding=stage.has_embedding,
        has_head=stage.has_head,
        tied=bool(config.get("tie_word_embeddings", True)),
    )
    verify_present(manifest, needed)
    todo = missing(manifest, needed)
    check_free_space(manifest, todo, node)
    total = sum(manifest.files[path].size for path in todo)
    done = 0

    def arrived(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done, total)

    for path in todo:
        download_from_hub(manifest, path, progress=arrived)
    return snapshot


def check_free_space(manifest: Manifest, paths: list[str], node: str) -> None:
    """Refuse before downloading when the cache's disk cannot hold what is missing."""
    needed = 0
    for path in paths:
        entry = manifest.files[path]
        partial = partial_path(manifest.repo_id, entry)
        needed += entry.size - (partial.stat().st_size if partial.exists() else 0)
    folder = repo_cache_dir(manifest.repo_id)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise HubError(
            f"node {node} needs {needed / 1e9:.2f} GB more for its part of {manifest.repo_id} "
            f"in {folder}, but only {free / 1e9:.2f} GB are free: free space (meshd models rm "
            "NAME) or point HF_HUB_CACHE to a larger disk"
        )


def prepare_selection(store_root: Path, spec_root: Path, ref: RepoRef) -> tuple[Manifest, Path]:
    """What selecting a repository needs before any weights: its manifest (the revision
    resolved to a commit), config, index and tokenizer, and a folder whose safetensors files
    hold only the headers (read by range request), for the model's description.

    Refuses at once what cannot run: a repository without config or safetensors, a
    quantization MLX cannot load. Blocking: a worker thread.
    """
    manifest = resolve_manifest(store_root, ref)
    for path in missing(manifest, manifest.metadata_files()):
        download_from_hub(manifest, path)
    snapshot = snapshot_dir(manifest.repo_id, manifest.commit)
    check_quantization(json.loads((snapshot / CONFIG_FILE).read_text()), ref)
    spec_dir = spec_root / f"{manifest.repo_id.replace('/', '--')}@{manifest.commit}"
    if not (spec_dir / CONFIG_FILE).is_file():
        temp = spec_dir.with_name(spec_dir.name + f".{os.getpid()}.tmp")
        shutil.rmtree(temp, ignore_errors=True)
        write_spec_dir(manifest, snapshot, temp)
        shutil.rmtree(spec_dir, ignore_errors=True)
        os.replace(temp, spec_dir)
    return manifest, spec_dir
