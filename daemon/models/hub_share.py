"""A Hub repository's files over the mesh: each file comes over the internet once per mesh.

Why: nodes on one LAN that each download their stage's files from the Hub pay the slow
internet link once per node for every file two stages share (the embedding, a file that
straddles a stage boundary), and a node without internet access could not load at all.

Who downloads what, without a master: every node computes the same answer from the
committed plan (which node needs which weight files: the index's weight map by stage) and
the nodes that report Hub access in their gossiped state. Each file goes to the node with
the highest rendezvous weight (a hash of file and node) among those that need it and can
reach the Hub, or, when none of them can, among all that can: the files spread over the
nodes, and a node that needs a file another downloads takes it from that node
(`Peer.FetchHubFile`) while it arrives, read from the downloader's ``.meshd-partial`` file
as it grows, not once it is complete. A node that downloads a file it does not need keeps
it (it counts toward its disk) and serves it. Config, index and tokenizer come from the
node that selected the model (it read them to plan).

What makes it robust rather than merely agreed: a node asked for a file it neither has nor
downloads, and that can reach the Hub, starts downloading it then (two views of the mesh
that differed for a moment cost no failure); a receiver checks each file against the Hub's
sha256 and fetches a damaged one again; a lost peer or connection resumes from the last
byte written, from the Hub (where this node can reach it) or from another peer; a restarted
node resumes from its partial file.

Both ends run on the asyncio thread that also carries heartbeats, so file reads, writes and
hashes run in worker threads; Hub downloads run in this module's own threads
(:class:`HubDownloads`), one per file, shared by the installer and the peer service.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from meshd.models import hub
from meshd.wire import pb

CHUNK_BYTES = 1024 * 1024
GROW_POLL_S = 0.05  # how often a served partial file is checked for new bytes
STALL_S = 30.0  # a served file that grows no more for this long ends its stream
APPEAR_WAIT_S = 10.0  # how long a request waits for a download to start writing
HUB_WORKERS = 4  # Hub downloads at once, per node
SOURCE_HUB = "hub"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def rendezvous_weight(path: str, node: str) -> int:
    """The weight of ``node`` for ``path``: the same on every node, spread evenly."""
    return int.from_bytes(hashlib.sha256(f"{path}\0{node}".encode()).digest()[:8], "big")


def choose_fetcher(path: str, needers: Collection[str], hub_nodes: Collection[str]) -> str | None:
    """The node that downloads ``path`` from the Hub: the highest weight among the nodes
    that need it and can reach the Hub, else among all that can; None when no node can."""
    candidates = sorted(set(needers) & set(hub_nodes)) or sorted(hub_nodes)
    if not candidates:
        return None
    return max(candidates, key=lambda node: rendezvous_weight(path, node))


def assign_fetchers(
    needs: Mapping[str, Iterable[str]], hub_nodes: Collection[str]
) -> dict[str, str | None]:
    """Each file any node needs -> the node that downloads it (None: no node can)."""
    needers: dict[str, set[str]] = {}
    for node, files in needs.items():
        for path in files:
            needers.setdefault(path, set()).add(node)
    return {path: choose_fetcher(path, nodes, hub_nodes) for path, nodes in sorted(needers.items())}


# ---------------------------------------------------------------------------- progress


@dataclass
class _Arrival:
    repo: str
    file: str
    total: int
    source: str
    done: int = 0
    started_at: float = field(default_factory=time.monotonic)
    started_done: int = 0  # what was there already (a resumed file): not counted in the rate


class DownloadBoard:
    """The files arriving at this node now, for `meshd status` (any thread: a lock)."""

    def __init__(self, node: str) -> None:
        self._node = node
        self._lock = threading.Lock()
        self._arrivals: dict[int, _Arrival] = {}
        self._next = 0

    def start(self, repo: str, file: str, total: int, source: str, done: int = 0) -> int:
        with self._lock:
            self._next += 1
            arrival = _Arrival(repo, file, total, source, done, started_done=done)
            self._arrivals[self._next] = arrival
            return self._next

    def update(self, key: int, done: int) -> None:
        with self._lock:
            if key in self._arrivals:
                self._arrivals[key].done = done

    def finish(self, key: int) -> None:
        with self._lock:
            self._arrivals.pop(key, None)

    def snapshot(self) -> tuple[pb.Download, ...]:
        now = time.monotonic()
        with self._lock:
            arrivals = list(self._arrivals.values())
        listed = []
        for item in sorted(arrivals, key=lambda a: (a.repo, a.file)):
            elapsed = now - item.started_at
            rate = (item.done - item.started_done) / elapsed if elapsed > 0.5 else 0.0
            left = (item.total - item.done) / rate if rate > 0 else 0.0
            listed.append(
                pb.Download(
                    node=self._node,
                    repo=item.repo,
                    file=item.file,
                    done_bytes=item.done,
                    total_bytes=item.total,
                    rate_bytes_per_s=round(rate, -3),
                    seconds_left=round(left, 1),
                    source=item.source,
                )
            )
        return tuple(listed)


def repo_label(manifest: hub.Manifest) -> str:
    return f"{manifest.repo_id}@{manifest.commit[:12]}"


# ---------------------------------------------------------------------------- Hub downloads


class HubDownloads:
    """This node's Hub downloads, one thread each and at most one per file: the installer
    waits for the files it must download, the peer service starts one a peer asks for.

    ``writing`` holds the files a peer is sending here now (their partial file has its
    writer: no Hub download may start beside it).
    """

    def __init__(self, board: DownloadBoard) -> None:
        self.board = board
        self._lock = threading.Lock()
        self._running: dict[tuple[str, str], Future[Path]] = {}
        self._pool = ThreadPoolExecutor(HUB_WORKERS, thread_name_prefix="meshd-hub")
        self.writing: set[tuple[str, str]] = set()

    def ensure(self, manifest: hub.Manifest, path: str) -> Future[Path]:
        """The download of ``path`` (started now unless it runs already)."""
        key = (manifest.repo_id, manifest.files[path].etag)
        with self._lock:
            running = self._running.get(key)
            if running is not None and not running.done():
                return running
            future = self._pool.submit(self._download, manifest, path)
            self._running[key] = future
            return future

    def running(self, manifest: hub.Manifest, path: str) -> bool:
        key = (manifest.repo_id, manifest.files[path].etag)
        with self._lock:
            future = self._running.get(key)
            return future is not None and not future.done()

    def _download(self, manifest: hub.Manifest, path: str) -> Path:
        entry = manifest.files[path]
        partial = hub.partial_path(manifest.repo_id, entry)
        done = partial.stat().st_size if partial.exists() else 0
        key = self.board.start(repo_label(manifest), path, entry.size, SOURCE_HUB, done)

        def arrived(count: int) -> None:
            nonlocal done
            done += count
            self.board.update(key, done)

        try:
            return hub.download_from_hub(manifest, path, progress=arrived)
        finally:
            self.board.finish(key)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------- serving


class HubFileServer:
    """Serves files of Hub repositories to members (`Peer.FetchHubFile`), from the complete
    blob or from the partial file while it grows (asyncio thread; reads in worker threads).

    ``can_download()``: whether this node may start a Hub download a peer asks for.
    """

    def __init__(
        self, store_root: Path, downloads: HubDownloads, can_download: Callable[[], bool]
    ) -> None:
        self._store_root = store_root
        self._downloads = downloads
        self._can_download = can_download

    async def stream_file(
        self, request: pb.HubFileRequest, caller: str | None
    ) -> AsyncIterator[pb.FileChunk]:
        if not request.repo_id or not _COMMIT.match(request.commit):
            raise ValueError(f"a Hub file request needs a repository and a commit: {request}")
        manifest = await asyncio.to_thread(
            hub.load_manifest, self._store_root, request.repo_id, request.commit
        )
        if manifest is None:
            raise FileNotFoundError(f"this node has no manifest of {request.repo_id}")
        if request.manifest:
            data = manifest.to_json().encode()
            yield pb.FileChunk(path="", offset=0, data=data, size=len(data))
            return
        if request.path not in manifest.files:
            raise FileNotFoundError(f"{request.repo_id} has no file {request.path!r}")
        handle = await self._open(manifest, request.path)
        try:
            async for chunk in _follow(handle, request.path, request.offset, manifest):
                yield chunk
        finally:
            handle.close()

    async def _open(self, manifest: hub.Manifest, path: str) -> BinaryIO:
        """The blob or the partial file; a download started for it when this node has
        neither and can reach the Hub (waits up to APPEAR_WAIT_S for its first bytes)."""
        entry = manifest.files[path]
        blob = hub.blob_path(manifest.repo_id, entry)
        partial = hub.partial_path(manifest.repo_id, entry)
        key = (manifest.repo_id, entry.etag)
        busy = self._downloads.running(manifest, path) or key in self._downloads.writing
        if not busy and not await asyncio.to_thread(hub.present, manifest, path):
            if not self._can_download():
                if not await asyncio.to_thread(partial.exists):
                    raise FileNotFoundError(
                        f"this node neither has nor downloads {manifest.repo_id}/{path}"
                    )
            else:
                self._downloads.ensure(manifest, path)
        # A download queued behind this node's others has not started writing yet: wait for it
        # (the caller's deadline bounds the wait), or the peer would fall back to the Hub and
        # the file would come over the internet twice. Without one, APPEAR_WAIT_S at most.
        deadline = time.monotonic() + APPEAR_WAIT_S
        while True:
            for candidate in (blob, partial):
                try:
                    return await asyncio.to_thread(candidate.open, "rb")
                except FileNotFoundError:
                    continue
            pending = self._downloads.running(manifest, path) or key in self._downloads.writing
            if not pending and time.monotonic() > deadline:
                raise TimeoutError(f"{manifest.repo_id}/{path} has not started arriving here")
            await asyncio.sleep(GROW_POLL_S * 4)


async def _follow(
    handle: BinaryIO, path: str, offset: int, manifest: hub.Manifest
) -> AsyncIterator[pb.FileChunk]:
    """The file's bytes from ``offset`` to its end, waiting for more while it grows; gives
    up (TimeoutError) when it grows no more for STALL_S."""
    size = manifest.files[path].size
    if offset > size:
        raise ValueError(f"offset {offset} is past the end of {path} ({size} bytes)")
    last_growth = time.monotonic()
    while offset < size:
        data = await asyncio.to_thread(_read_at, handle, offset)
        if data:
            yield pb.FileChunk(path=path, offset=offset, data=data, size=size)
            offset += len(data)
            last_growth = time.monotonic()
            continue
        if time.monotonic() - last_growth > STALL_S:
            raise TimeoutError(f"{manifest.repo_id}/{path} stopped growing here at {offset} bytes")
        await asyncio.sleep(GROW_POLL_S)


def _read_at(handle: BinaryIO, offset: int) -> bytes:
    handle.seek(offset)
    return handle.read(CHUNK_BYTES)


# ---------------------------------------------------------------------------- receiving


class IncompleteTransfer(RuntimeError):
    """The stream ended before the file did; what arrived is kept (resume from it)."""


async def receive_file(
    chunks: AsyncIterator[pb.FileChunk],
    manifest: hub.Manifest,
    path: str,
    progress: Callable[[int], None],
) -> Path:
    """Append a peer's stream to this node's partial file, then verify it (sha256) and link
    it into the snapshot. A damaged file is deleted (HubError: fetch it again); a stream
    that ends early leaves the partial file for the next attempt (IncompleteTransfer).

    asyncio side: writes and the hash run in worker threads.
    """
    entry = manifest.files[path]
    partial = hub.partial_path(manifest.repo_id, entry)
    handle = await asyncio.to_thread(_open_partial, partial)
    try:
        offset = await asyncio.to_thread(lambda: handle.seek(0, 2))
        async for chunk in chunks:
            if chunk.offset != offset or chunk.path != path:
                raise ValueError(
                    f"the peer sent {chunk.path!r} at {chunk.offset}, not {path!r} at {offset}"
                )
            if offset + len(chunk.data) > entry.size:
                raise ValueError(f"the peer sent more than {entry.size} bytes of {path}")
            await asyncio.to_thread(_append, handle, chunk.data)
            offset += len(chunk.data)
            progress(offset)
    finally:
        await asyncio.to_thread(handle.close)
    if offset < entry.size:
        raise IncompleteTransfer(f"{path}: the peer's stream ended at {offset}/{entry.size} bytes")
    return await asyncio.to_thread(hub.finish_partial, manifest, path)


def _open_partial(partial: Path) -> BinaryIO:
    partial.parent.mkdir(parents=True, exist_ok=True)
    return partial.open("ab")


def _append(handle: BinaryIO, data: bytes) -> None:
    handle.write(data)
    handle.flush()


def partial_size(manifest: hub.Manifest, path: str) -> int:
    partial = hub.partial_path(manifest.repo_id, manifest.files[path])
    try:
        return partial.stat().st_size
    except OSError:
        return 0


def file_request(manifest: hub.Manifest, path: str) -> pb.HubFileRequest:
    return pb.HubFileRequest(
        repo_id=manifest.repo_id,
        commit=manifest.commit,
        path=path,
        offset=partial_size(manifest, path),
    )
