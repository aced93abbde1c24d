"""The models on this node: the user's model store as the daemon reads and imports into it.

Apart from the node (:mod:`meshd.node`, the composition root) because none of it needs the
node's components: a store root, the event log for what the user should hear, a path.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from meshd.runtime.events import EventLog
from meshd.runtime.lazy_imports import import_model_runtime
from meshd.wire import pb

if TYPE_CHECKING:  # the store is imported where a model is touched
    from meshd.models.store import ProgressCallback


def model_list(store_root: Path, selected: str) -> pb.ModelList:
    """The models in the store, and the one the mesh runs (``selected``; empty: none)."""
    from meshd.models.store import ModelStore

    models = [
        pb.ModelInfo(
            name=entry.name,
            architecture=entry.architecture,
            size_bytes=entry.size_bytes,
            layers=entry.num_layers or 0,
            source=entry.source,
            path=str(entry.path),
        )
        for entry in ModelStore(store_root).list_models()
    ]
    return pb.ModelList(models=models + hub_cache_models(store_root), selected=selected)


def hub_cache_models(store_root: Path) -> list[pb.ModelInfo]:
    """The repositories in the HF cache, one entry per revision: what this node holds of
    it, its whole size and whether it is complete here (a node of a mesh holds only its
    stage's files: partial). A cache that cannot be read lists nothing (and says why in the
    daemon's log): the store's models are still listed."""
    from meshd.models import hub

    try:
        cached = hub.list_cached(store_root)
    except Exception as error:  # huggingface_hub's scan of a damaged cache folder
        logging.getLogger("meshd").warning("cannot list the HF cache: %s", error)
        return []
    return [
        pb.ModelInfo(
            name=revision.repo_id,
            architecture=_cached_architecture(revision.path),
            size_bytes=revision.size_bytes,
            source="hf-cache",
            path=str(revision.path),
            revision=revision.commit,
            total_bytes=revision.total_bytes,
            partial=not revision.complete,
        )
        for revision in cached
    ]


def _cached_architecture(snapshot: Path) -> str:
    try:
        config = json.loads((snapshot / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(config.get("model_type", "")) if isinstance(config, dict) else ""


def note_old_model_store(state_dir: Path, store_root: Path, events: EventLog) -> None:
    """Models imported by an older meshd into the state directory are no longer used:
    say once where they are, so that the user can move or delete them."""
    old = state_dir / "models" / "models"
    names = sorted(p.parent.name for p in old.glob("*/meshd-model.json"))
    if names and old != store_root / "models":
        events.add(
            "models in %s (%s) are no longer used: models now live in the user's store %s; "
            "move them there (mv %s/* %s/models/) or delete %s",
            old,
            ", ".join(names),
            store_root,
            old,
            store_root,
            old.parent,
            level=logging.WARNING,
        )


def resolve_model_dir(store_root: Path, model: str, events: EventLog) -> Path:
    """A model directory path, a .gguf file to import, or a name in the model store;
    imports say their progress in ``events``."""
    from meshd.models.store import DEFAULT_MODEL, ModelStore

    store = ModelStore(store_root)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf" and path.is_file():
        name = path.stem.lower()
        if name in {entry.name for entry in store.list_models()}:
            return store.model_dir(name)
        return store.import_gguf(path, name=name, progress=_import_progress(events, name)).path
    if model == DEFAULT_MODEL:
        return store.ensure_default(progress=_import_progress(events, model)).path
    return store.model_dir(model)


def _import_progress(events: EventLog, name: str) -> ProgressCallback:
    """Log a model import's progress in quarters (shown by `meshd status`)."""
    reported: dict[str, int] = {}

    def report(phase: str, done: int, total: int) -> None:
        quarter = 4 * done // total if total else 4
        if reported.get(phase, -1) < quarter:
            reported[phase] = quarter
            events.add("importing %s: %s %d%%", name, phase, 25 * quarter)

    return report


def check_model_type(model_dir: Path) -> None:
    """Raise UnsupportedModel/StageLoadError (with the reason) for a model stages cannot run.

    Reads only config.json; the stage code (and mlx-lm) is imported on this first use."""
    import_model_runtime()  # first: a worker thread may be importing mlx-lm at this moment
    from meshd.inference.stage import shard

    shard.check_model_type(model_dir)


HUB_SPECS_DIR = "hub-specs"


def hub_model_spec_dir(store_root: Path, state_dir: Path, model: str) -> tuple[Path, str] | None:
    """For ``ORG/NAME[@REVISION]`` (not a local path): a folder to read the model's
    description from (config, index, tokenizer and the weights' headers, no weights) and the
    selection's path ``hf:ORG/NAME@COMMIT``; None for any other model name."""
    from meshd.models import hub

    ref = hub.parse_repo_ref(model)
    if ref is None:
        return None
    manifest, spec_dir = hub.prepare_selection(store_root, state_dir / HUB_SPECS_DIR, ref)
    return spec_dir, hub.hub_path(manifest.repo_id, manifest.commit)


def hub_snapshot_for(store_root: Path, path: str) -> Path | None:
    """The complete local copy of a selection's ``hf:`` path (used in place), None when the
    path names no repository; FileNotFoundError when the copy here is missing or partial."""
    from meshd.models import hub

    ref = hub.parse_hub_path(path)
    if ref is None:
        return None
    snapshot = hub.complete_snapshot(store_root, ref)
    if snapshot is None:
        raise FileNotFoundError(f"{ref} is not complete in this node's HF cache")
    return snapshot
