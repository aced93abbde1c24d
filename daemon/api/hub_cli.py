"""`meshd pull ORG/NAME[@REVISION]` and `meshd models rm NAME`: work without a running daemon.

Why apart from cli.py: both touch this machine's files only (the HF cache, the model store),
so they run with or without a daemon, like `meshd profile`; the daemon is not asked.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from meshd.config import load_config


def register(sub: Any) -> None:
    """Add `meshd pull` to the command line."""
    pull = sub.add_parser(
        "pull",
        help="download a Hugging Face model repository into the HF cache (resumable)",
    )
    pull.add_argument("repo", help="ORG/NAME or ORG/NAME@REVISION (branch, tag or commit)")
    pull.set_defaults(handler=cmd_pull)


def _store_root() -> Path:
    return load_config({}).model_store


def cmd_pull(args: argparse.Namespace) -> int:
    """Download the whole repository, or finish a download that stopped."""
    from meshd.models import hub

    ref = hub.parse_repo_ref(args.repo)
    if ref is None:
        print(f"meshd: {args.repo!r} is not ORG/NAME[@REVISION] (or it is a local path)")
        return 2
    try:
        manifest = hub.resolve_manifest(_store_root(), ref)
        todo = hub.missing(manifest, manifest.files)
        damaged = hub.verify_present(manifest, manifest.files)
        todo = sorted(set(todo) | set(damaged))
        total = sum(manifest.files[path].size for path in todo)
        with _progress_bar(total, f"{ref.repo_id}@{manifest.commit[:8]}") as bar:
            for path in todo:
                already = _partial_bytes(manifest, path)
                bar.update(already)
                hub.download_from_hub(manifest, path, progress=bar.update)
        hub.write_ref(ref.repo_id, ref.revision, manifest.commit)
    except hub.HubError as error:
        print(f"meshd: {error}", file=sys.stderr)
        return 2
    folder = hub.snapshot_dir(ref.repo_id, manifest.commit)
    print(f"{ref.repo_id} at {manifest.commit}: {len(manifest.files)} files in {folder}")
    return 0


def _partial_bytes(manifest: Any, path: str) -> int:
    from meshd.models import hub

    partial = hub.partial_path(manifest.repo_id, manifest.files[path])
    return partial.stat().st_size if partial.exists() else 0


def _progress_bar(total: int, label: str) -> Any:
    """Bytes, rate and time left on one line (tqdm, which huggingface_hub brings)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label)


def cmd_models_rm(name: str) -> int:
    """Delete a store model, or a repository (all its revisions, or ORG/NAME@REV's) from the
    HF cache."""
    from meshd.models import hub
    from meshd.models.store import ModelStore, UnknownModel

    root = _store_root()
    ref = hub.parse_repo_ref(name)
    try:
        if ref is not None:
            freed = hub.remove_cached(root, ref)
            print(f"removed {ref} from the HF cache ({freed / 1e9:.2f} GB freed)")
            return 0
        ModelStore(root).remove(name)
    except (hub.HubError, UnknownModel) as error:
        print(f"meshd: {error}", file=sys.stderr)
        return 2
    print(f"removed {name} from the model store")
    return 0


LOAD_FOLLOW_S = 3600.0  # how long `meshd load ORG/NAME` shows the mesh's downloads at most
LOAD_POLL_S = 0.5
BAR_WIDTH = 24


def names_repository(model: str) -> bool:
    """Whether `meshd load MODEL` names a Hugging Face repository (not a local path)."""
    from meshd.models.hub import parse_repo_ref

    return parse_repo_ref(model) is not None


def follow_hub_load(api: str, model: str, out: Any = None) -> int:
    """After `meshd load ORG/NAME`: a progress bar per node while the mesh downloads the
    repository, until the mesh serves it (0), the plan is refused (1), or Ctrl-C (the load
    goes on in the daemons; `meshd status` shows it).

    On a terminal the bars are redrawn in place; elsewhere one line per node every 5 s.
    """
    from meshd.api import client
    from meshd.api.render import downloads_by_node

    out = out or sys.stderr
    tty = bool(getattr(out, "isatty", lambda: False)())
    reader = client.StatusReader(api)
    drawn, last_print = 0, 0.0
    deadline = time.monotonic() + LOAD_FOLLOW_S
    try:
        while time.monotonic() < deadline:
            status = reader.status()
            agreement = status.agreement
            if agreement.model == model and agreement.refusal:
                print(f"the mesh cannot run {model}: {agreement.refusal}", file=out)
                return 1
            if _serving(status, model):
                if tty and drawn:
                    out.write(f"\x1b[{drawn}F\x1b[J")
                print(f"the mesh serves {model}", file=out)
                return 0
            lines = [_bar(node) for node in downloads_by_node(status.downloads)]
            if tty:
                clear = f"\x1b[{drawn}F\x1b[J" if drawn else ""
                out.write(clear + "".join(f"{line}\n" for line in lines))
                out.flush()
                drawn = len(lines)
            elif lines and time.monotonic() - last_print > 5.0:
                print("\n".join(lines), file=out, flush=True)
                last_print = time.monotonic()
            time.sleep(LOAD_POLL_S)
    except KeyboardInterrupt:
        print("\nthe mesh goes on loading; `meshd status` shows it", file=out)
        return 0
    print(f"{model} is not served after {LOAD_FOLLOW_S:.0f} s; see `meshd status`", file=out)
    return 1


def _serving(status: Any, model: str) -> bool:
    agreement = status.agreement
    loaded = status.transitions.HasField("active_plan_loaded")
    ready = status.transitions.active_plan_loaded if loaded else True
    planned = agreement.model == model and bool(agreement.active_plan_id)
    return planned and ready and not status.downloads


def _bar(node: Any) -> str:
    filled = round(node.fraction * BAR_WIDTH)
    return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {node.line()}"
