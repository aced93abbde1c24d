"""This node's files of a Hub repository for a committed plan, each downloaded once per mesh.

The trio side of :mod:`meshd.models.hub_share`: the manifest (kept, from the Hub, or from a
peer when this node cannot reach the Hub), config and tokenizer (from the node that
selected the model), then the weight files: those the rendezvous assignment gives this node
from the Hub (also those it does not need: it serves them), the others from the peer that
downloads them, while they arrive. Every file falls back, attempt by attempt, to the Hub
(where this node can reach it) and to any other live peer, resuming from the bytes already
written; a damaged file starts over.
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

from meshd.mesh.membership import EventLog, Membership
from meshd.models import hub
from meshd.models.hub_share import (
    SOURCE_HUB,
    HubDownloads,
    assign_fetchers,
    file_request,
    receive_file,
    repo_label,
)
from meshd.models.share import FETCH_TIMEOUT_S
from meshd.runtime.bridge import AsyncioThread
from meshd.wire import pb

log = logging.getLogger("meshd.inference")

HUB_ACCESS_WAIT_S = 10.0  # how long to wait for every member to say whether it reaches the Hub
ATTEMPTS = 8  # tries per file over its sources, resuming each time
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 8.0
PARALLEL_FILES = 4
FUTURE_POLL_S = 0.1


class HubFetch:
    """Gets this node's files of a Hub repository for a plan (trio thread)."""

    def __init__(
        self,
        membership: Membership,
        bridge: AsyncioThread,
        events: EventLog,
        downloads: HubDownloads,
        store_root: Path,
    ) -> None:
        self._membership = membership
        self._bridge = bridge
        self._events = events
        self._downloads = downloads
        self._store_root = store_root
        self._limit = trio.CapacityLimiter(PARALLEL_FILES)
        self.sources: dict[str, str] = {}  # file -> where it came from, for the events

    @property
    def _me(self) -> str:
        return self._membership.identity.node_id

    async def fetch(self, selection: pb.ModelSelection, plan: Any) -> Path:
        """The snapshot holding this node's files of the plan (and the files it downloads
        for others); raises naming the file and every source tried when one cannot come."""
        ref = hub.parse_hub_path(selection.path)
        if ref is None:
            raise hub.HubError(f"{selection.path!r} names no Hugging Face repository")
        manifest = await self._manifest(ref, selection.set_by)
        snapshot = hub.snapshot_dir(manifest.repo_id, manifest.commit)
        metadata = manifest.metadata_files()
        await self._get_all(manifest, metadata, {path: selection.set_by for path in metadata})
        needs = await trio.to_thread.run_sync(_needs_by_node, manifest, snapshot, plan)
        hub_nodes = await self._hub_nodes(plan.nodes)
        fetchers = assign_fetchers(needs, hub_nodes)
        mine = set(needs.get(self._me, ())) | {p for p, n in fetchers.items() if n == self._me}
        await trio.to_thread.run_sync(hub.verify_present, manifest, sorted(mine))
        todo = await trio.to_thread.run_sync(hub.missing, manifest, sorted(mine))
        await trio.to_thread.run_sync(hub.check_free_space, manifest, todo, self._me)
        started = time.monotonic()
        await self._get_all(manifest, todo, fetchers)
        if todo:
            from_hub = sum(1 for path in todo if self.sources.get(path) == SOURCE_HUB)
            self._events.add(
                "have %d files of %s (%.1f MB) in %.1f s: %d from the Hub, %d from peers",
                len(todo),
                selection.name,
                sum(manifest.files[path].size for path in todo) / 1e6,
                time.monotonic() - started,
                from_hub,
                len(todo) - from_hub,
            )
        return snapshot

    # ------------------------------------------------------------ the manifest

    async def _manifest(self, ref: hub.RepoRef, selector: str) -> hub.Manifest:
        """Kept here, else from the Hub, else from a peer (a node without Hub access)."""
        assert ref.revision is not None  # a selection pins a commit
        kept = await trio.to_thread.run_sync(
            hub.load_manifest, self._store_root, ref.repo_id, ref.revision
        )
        failure = ""
        manifest = kept
        if manifest is None and not hub.hub_offline():
            try:
                resolve = hub.resolve_manifest
                manifest = await trio.to_thread.run_sync(resolve, self._store_root, ref)
            except hub.HubError as error:
                failure = str(error)
        reachable = hub.hub_reachable()
        if reachable is None:
            reachable = await trio.to_thread.run_sync(hub.probe_hub, ref.repo_id, ref.revision)
        self._membership.set_hub_access(bool(reachable))
        if manifest is None:
            manifest = await self._manifest_from_peers(ref, selector, failure)
        return manifest

    async def _manifest_from_peers(
        self, ref: hub.RepoRef, selector: str, failure: str
    ) -> hub.Manifest:
        request = pb.HubFileRequest(repo_id=ref.repo_id, commit=ref.revision, manifest=True)
        failures = [f"the Hub: {failure or 'HF_HUB_OFFLINE is set'}"]
        for record in self._peers(first=selector):
            try:
                data = await self._bridge.run(_read_manifest, record.stub, request)
                manifest = hub.Manifest.from_json(data.decode())
            except Exception as error:
                failures.append(f"{record.node_id}: {_short(error)}")
                continue
            if (manifest.repo_id, manifest.commit) != (ref.repo_id, ref.revision):
                failures.append(f"{record.node_id}: sent the manifest of another commit")
                continue
            await trio.to_thread.run_sync(hub.save_manifest, self._store_root, manifest)
            return manifest
        raise hub.HubError(f"no file list of {ref} from " + "; ".join(failures))

    # ------------------------------------------------------------ who reaches the Hub

    async def _hub_nodes(self, members: tuple[str, ...]) -> set[str]:
        """The live nodes that reach the Hub, once every live member of the plan said
        whether it does (or HUB_ACCESS_WAIT_S passed: the silent ones count as without)."""
        deadline = trio.current_time() + HUB_ACCESS_WAIT_S
        while True:
            reports = self._hub_reports()
            silent = [node for node in members if node not in reports and self._alive(node)]
            if not silent or trio.current_time() > deadline:
                return {node for node, reachable in reports.items() if reachable}
            await trio.sleep(0.2)

    def _hub_reports(self) -> dict[str, bool]:
        reports = {}
        if self._membership.hub_access is not None:
            reports[self._me] = self._membership.hub_access
        for record in self._membership.alive_peers():
            if record.state is not None and record.state.HasField("hub_access"):
                reports[record.node_id] = record.state.hub_access
        return reports

    def _alive(self, node: str) -> bool:
        return node == self._me or any(r.node_id == node for r in self._membership.alive_peers())

    def _peers(self, first: str | None = None) -> list[Any]:
        """Live peers with a channel, ``first`` first."""
        records = [r for r in self._membership.alive_peers() if r.stub is not None]
        return sorted(records, key=lambda r: (r.node_id != first, r.node_id))

    # ------------------------------------------------------------ files

    async def _get_all(
        self, manifest: hub.Manifest, paths: list[str], fetchers: dict[str, str | None]
    ) -> None:
        await trio.to_thread.run_sync(hub.verify_present, manifest, paths)
        todo = await trio.to_thread.run_sync(hub.missing, manifest, paths)
        async with trio.open_nursery() as nursery:
            for path in todo:
                nursery.start_soon(self._get, manifest, path, fetchers.get(path))

    async def _get(self, manifest: hub.Manifest, path: str, fetcher: str | None) -> None:
        """One file, from its fetcher first, then the Hub or any peer; bounded attempts."""
        async with self._limit:
            failures: list[str] = []
            wait_s = RETRY_FIRST_S
            for attempt in range(ATTEMPTS):
                sources = self._sources(fetcher)
                source = sources[attempt % len(sources)] if sources else None
                if source is None:
                    failures.append("no live peer and no Hub access")
                else:
                    try:
                        await self._get_from(manifest, path, source)
                        self.sources[path] = source
                        return
                    except Exception as error:
                        failures.append(f"{source}: {_short(error)}")
                        log.info("%s of %s from %s: %s", path, manifest.repo_id, source, error)
                if hub.present(manifest, path):
                    return
                await trio.sleep(wait_s)
                wait_s = min(wait_s * 2, RETRY_MAX_S)
            raise hub.HubError(
                f"could not get {manifest.repo_id}/{path} after {ATTEMPTS} tries: "
                + "; ".join(failures[-4:])
            )

    def _sources(self, fetcher: str | None) -> list[str]:
        """Where to try: the fetcher (``hub`` when it is this node), then the Hub where this
        node reaches it, then the other live peers."""
        hub_ok = bool(self._membership.hub_access)
        ordered: list[str] = []
        if fetcher == self._me and hub_ok:
            ordered.append(SOURCE_HUB)
        elif fetcher is not None and self._alive(fetcher) and fetcher != self._me:
            ordered.append(fetcher)
        if hub_ok and SOURCE_HUB not in ordered:
            ordered.append(SOURCE_HUB)
        ordered += [r.node_id for r in self._peers() if r.node_id not in ordered]
        return ordered

    async def _get_from(self, manifest: hub.Manifest, path: str, source: str) -> None:
        if source == SOURCE_HUB:
            future = self._downloads.ensure(manifest, path)
            while not future.done():
                await trio.sleep(FUTURE_POLL_S)
            future.result()
            return
        record = next((r for r in self._peers() if r.node_id == source), None)
        if record is None:
            raise ConnectionError(f"{source} is not a live peer")
        key = (manifest.repo_id, manifest.files[path].etag)
        if self._downloads.running(manifest, path) or key in self._downloads.writing:
            raise RuntimeError("this file is being written here already")
        request = await trio.to_thread.run_sync(file_request, manifest, path)
        board = self._downloads.board
        entry = board.start(
            repo_label(manifest),
            path,
            manifest.files[path].size,
            f"peer {source}",
            int(request.offset),
        )
        self._downloads.writing.add(key)
        try:
            progress = partial(board.update, entry)
            await self._bridge.run(_pull_file, record.stub, request, manifest, path, progress)
        finally:
            self._downloads.writing.discard(key)
            board.finish(entry)


def _needs_by_node(manifest: hub.Manifest, snapshot: Path, plan: Any) -> dict[str, set[str]]:
    """Each plan node -> the weight files its stage needs (config and tokenizer apart)."""
    config = json.loads((snapshot / hub.CONFIG_FILE).read_text())
    weights = hub.weight_map(snapshot, manifest)
    tied = bool(config.get("tie_word_embeddings", True))
    needs: dict[str, set[str]] = {}
    for stage in plan.stages:
        files = hub.files_for_stage(
            weights,
            [],
            stage.layer_start,
            stage.layer_end,
            has_embedding=stage.has_embedding,
            has_head=stage.has_head,
            tied=tied,
        )
        for node in stage.nodes:
            needs.setdefault(node, set()).update(files)
    return needs


def _short(error: BaseException) -> str:
    details = getattr(error, "details", None)
    text = details() if callable(details) else str(error)
    return (text or type(error).__name__).splitlines()[0][:200]


async def _read_manifest(stub: Any, request: pb.HubFileRequest) -> bytes:
    """asyncio side: the peer's manifest of the repository, as JSON bytes."""
    data = b""
    async for chunk in stub.FetchHubFile(request, timeout=30.0):
        data += chunk.data
    return data


async def _pull_file(
    stub: Any, request: pb.HubFileRequest, manifest: hub.Manifest, path: str, progress: Any
) -> Path:
    """asyncio side: the file from the peer into this node's partial file, verified."""
    call = stub.FetchHubFile(request, timeout=FETCH_TIMEOUT_S)
    return await receive_file(call, manifest, path, progress)
