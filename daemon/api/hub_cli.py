"""`meshd pull ORG/NAME[@REVISION]` and `meshd models rm NAME`: work without a running daemon.

Why apart from cli.py: both touch this machine's files only (the HF cache, the model store),
so they run with or without a daemon, like `meshd profile`; the daemon is not asked.
"""

from __future__ import annotations

import argparse
import sys
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
