"""The launchd log file, kept to a bounded size by the daemon that writes it.

launchd points the daemon's stdout and stderr at ~/Library/Logs/meshd/meshd.log
(`StandardOutPath`) and never rotates it, and newsyslog needs root to be told about it. So
the plist names the file in `MESHD_LOG_ROTATE`, and the daemon rotates it itself by copy and
truncate: launchd opened the file for appending, so after the truncation its next write
lands at the new end, and nothing it writes is lost between the copy and the truncation
except what arrives in that instant. Tracebacks and native crashes still reach the file,
which a log handler of the daemon's own would not catch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LOG_ROTATE_ENV = "MESHD_LOG_ROTATE"
MAX_LOG_BYTES = 10 * 1024 * 1024  # rotate beyond this
KEEP_ROTATED = 3  # meshd.log.1 (newest) .. meshd.log.3 (oldest)
ROTATE_CHECK_S = 60


def log_to_rotate() -> Path | None:
    """The log file this daemon rotates, when its service asked for it."""
    value = os.environ.get(LOG_ROTATE_ENV, "")
    return Path(value) if value else None


def rotate_if_large(path: Path, max_bytes: int = MAX_LOG_BYTES, keep: int = KEEP_ROTATED) -> bool:
    """Copy ``path`` to ``path.1`` (shifting older copies up to ``keep``) and truncate it,
    when it is larger than ``max_bytes``. True when it rotated; a missing file is no error."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    for index in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{index}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{index + 1}"))
    shutil.copyfile(path, path.with_name(f"{path.name}.1"))
    os.truncate(path, 0)
    return True
