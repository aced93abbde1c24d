"""The model a mesh was running, kept in each node's state directory across restarts.

A model loaded on purpose (`meshd load`) is a register every node re-publishes as its own
(`meshd.agreement.service.winning_selection`). Held only in memory, it was lost when every
node restarted at once (a power cut, an upgrade, a reboot of the Mac Studios): the mesh went
back to the configured models, and a user's `meshd load` of last week was silently undone.
So each node writes the winning loaded selection here whenever it changes, and offers it
again when it starts, with its original stamp: among loaded models the newest still wins, so
a node that missed a later `meshd load` while it was away does not bring an older one back.

The rule stays the one of a running mesh: a configured model (`--model`) is only a default,
and `meshd load` is what changes the mesh's model, across restarts too. A record written in
another mesh (the state directory joined a new one) is not offered. Startup defaults are
never written (they come from the configuration each time).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from meshd.mesh.security import write_private_file
from meshd.wire import pb

SELECTION_FILE = "model_selection.json"

log = logging.getLogger("meshd.planning")


@dataclass(frozen=True)
class RememberedSelection:
    """What the state directory says the mesh ran, and which mesh (its fingerprint)."""

    selection: pb.ModelSelection
    mesh: str


def read_remembered(state_dir: Path) -> RememberedSelection | None:
    """The kept selection, or None when there is none or the file cannot be read (it is then
    ignored with a warning: a damaged file must not keep a daemon from starting). Fields a
    newer meshd added are skipped, so a downgrade keeps the record."""
    path = state_dir / SELECTION_FILE
    try:
        record = json.loads(path.read_text())
        selection = json_format.ParseDict(
            record["selection"], pb.ModelSelection(), ignore_unknown_fields=True
        )
        mesh = str(record.get("mesh", ""))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, json_format.ParseError) as error:
        log.warning("ignoring %s, which cannot be read (%s)", path, error)
        return None
    if not selection.name or selection.startup_default:
        log.warning("ignoring %s: it names no loaded model", path)
        return None
    return RememberedSelection(selection, mesh)


def write_remembered(state_dir: Path, remembered: RememberedSelection) -> None:
    """Replace the kept selection atomically and durably (the power cut it is kept for must
    not leave an empty file behind the rename)."""
    record = {
        "mesh": remembered.mesh,
        "selection": json_format.MessageToDict(remembered.selection),
    }
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    write_private_file(state_dir / SELECTION_FILE, text.encode())
