"""Files written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (making its folder) through a partial file beside it, named
    by this process and renamed over ``path``: a reader, or a daemon killed mid-write, sees the
    old file or the new one, never half of one. The partial file goes where the write fails.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
