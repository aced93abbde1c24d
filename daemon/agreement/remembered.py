"""The model a mesh was running, kept in each node's state directory across restarts.

A model loaded on purpose (`meshd load`) is a register every node re-publishes as its own
(`meshd.agreement.service.winning_selection`). Held only in memory, it was lost when every
node restarted at once (a power cut, an upgrade, a reboot of the Mac Studios): the mesh went
back to the configured models, and a user's `meshd load` of last week was silently undone.
So each node writes the winning loaded selection here whenever it changes, and offers it
again when it starts, with its original stamp: among loaded models the newest still wins, so
a node that missed a later `meshd load` while it was away does not bring an older one back.

A node whose configured model changed since the record was written starts from its
configured model instead: editing the configuration is the newer decision. Startup defaults
are never written (they come from the configuration each time).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from meshd.wire import pb

SELECTION_FILE = "model_selection.json"

log = logging.getLogger("meshd.planning")


@dataclass(frozen=True)
class RememberedSelection:
    """What the state directory says the mesh ran, and the configuration it was kept under."""

    selection: pb.ModelSelection
    configured_model: str


def read_remembered(state_dir: Path) -> RememberedSelection | None:
    """The kept selection, or None when there is none or the file cannot be read (it is then
    ignored with a warning: a damaged file must not keep a daemon from starting)."""
    path = state_dir / SELECTION_FILE
    try:
        record = json.loads(path.read_text())
        selection = json_format.ParseDict(record["selection"], pb.ModelSelection())
        configured = str(record.get("configured_model", ""))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, json_format.ParseError) as error:
        log.warning("ignoring %s, which cannot be read (%s); it is written again", path, error)
        return None
    if not selection.name or selection.startup_default:
        log.warning("ignoring %s: it names no loaded model", path)
        return None
    return RememberedSelection(selection, configured)


def write_remembered(state_dir: Path, remembered: RememberedSelection) -> None:
    """Replace the kept selection atomically (a crash mid-write leaves the old file)."""
    path = state_dir / SELECTION_FILE
    record = {
        "configured_model": remembered.configured_model,
        "selection": json_format.MessageToDict(remembered.selection),
    }
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(partial, path)


def same_selection(a: pb.ModelSelection | None, b: pb.ModelSelection | None) -> bool:
    """The same choice: one model, stamped at one instant by one node."""
    if a is None or b is None:
        return a is b
    return (a.name, a.digest, a.set_at, a.set_by) == (b.name, b.digest, b.set_at, b.set_by)
