"""Node identity: a stable node id kept in the state directory.

The node id survives restarts (so plans and peers recognise the machine) and is
also the CN of the node's TLS certificate. A copied state directory gives two
daemons the same node id; they are told apart by the per-start `instance_id`,
and the daemon that started later refuses to run (see `meshd.mesh.membership`).
"""

from __future__ import annotations

import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshd.runtime.files import replace_text

NODE_ID_FILE = "node_id"
_VALID_NODE_ID = re.compile(r"^[a-z0-9][a-z0-9-]{2,62}$")


class IdentityError(RuntimeError):
    """The node id file is unusable; the message says how to fix it."""


def _hostname_label() -> str:
    label = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().split(".")[0].lower()).strip("-")
    return label[:20] or "node"


def new_node_id() -> str:
    """A fresh id: short hostname plus 8 random hex digits (a valid DNS label)."""
    return f"{_hostname_label()}-{secrets.token_hex(4)}"


def load_or_create_node_id(state_dir: Path) -> str:
    """Read `<state_dir>/node_id`, creating it on first start."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / NODE_ID_FILE
    if path.exists():
        node_id = path.read_text().strip()
        if not _VALID_NODE_ID.match(node_id):
            raise IdentityError(
                f"{path} holds {node_id!r}, which is not a valid node id (lowercase letters, "
                f"digits and '-', 3-63 characters); delete the file to get a new id"
            )
        return node_id
    node_id = new_node_id()
    replace_text(path, node_id + "\n")
    return node_id


@dataclass(frozen=True)
class Identity:
    """Who this daemon is: persistent node id plus what tells this start apart."""

    node_id: str
    name: str
    instance_id: str = field(default_factory=lambda: secrets.token_hex(6))
    started_at: float = field(default_factory=time.time)
