"""Hop tracing: time marks along the data plane's path, to see where a hop's time goes.

A hop (one stage's finished step reaching the next stage's compute) costs ~1 ms here, and
the product benchmark's end-to-end numbers move by more than a change worth 0.05 ms does.
So the path carries named marks (``step_done`` on the compute thread, ``result_on_loop``,
``frame_send``/``frame_sent`` around a lane's write, ``lane_readable`` and ``frame_parsed`` on
the receiver, ``step_submitted`` and ``step_start``), and ``benchmarks/hop_trace.py`` pairs
them across daemons on one machine (one monotonic clock) into a median per segment.

Off unless a daemon starts with ``MESHD_HOP_TRACE`` naming a directory: then every mark is
appended (a C-level ``deque.append``, safe from any thread) and a flusher thread, owned by
:func:`start` and ended by :func:`stop`, writes them once a second to
``<directory>/hops-<pid>.txt`` as ``name nanoseconds`` lines, off the hot path. When off, a
call site costs one module attribute read (``if hoptrace.enabled:``). It is for a
measurement, not for a node left running: a traced hop writes ~300 bytes, ~10 MB an hour at
ten tokens a second.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from meshd.runtime.thread_names import name_this_thread

log = logging.getLogger("meshd.hoptrace")

ENV = "MESHD_HOP_TRACE"
FLUSH_INTERVAL_S = 1.0

enabled = False  # read at every call site; set only by start() and stop()
_marks: collections.deque[tuple[str, int]] = collections.deque()
_path: Path | None = None
_stopping = threading.Event()
_flusher: threading.Thread | None = None


def mark(name: str) -> None:
    """Note that the data plane reached ``name`` now (call only ``if hoptrace.enabled``)."""
    _marks.append((name, time.perf_counter_ns()))


def process_name(pid: int) -> str:
    """The name a traced process's marks go by: its file's stem, and the process in a Hop."""
    return f"hops-{pid}"


def start_from_env() -> bool:
    """Start tracing if ``MESHD_HOP_TRACE`` names a directory; whether it started. A directory
    that cannot be made or written is named in a warning and the daemon runs untraced (a
    diagnostic must not keep a node from serving)."""
    directory = os.environ.get(ENV, "").strip()
    if not directory:
        return False
    try:
        start(Path(directory))
    except OSError as error:
        log.warning(
            "%s=%s: hop tracing stays off (%s); name a writable directory", ENV, directory, error
        )
        return False
    return True


def start(directory: Path) -> Path:
    """Trace into ``directory`` (created if missing); the file this process writes."""
    global enabled, _path, _flusher
    if _flusher is not None:
        raise RuntimeError("hop tracing is already on in this process")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{process_name(os.getpid())}.txt"
    path.touch()  # OSError now, not in the flusher, if the directory is not writable
    _path = path
    _stopping.clear()
    _flusher = threading.Thread(target=_flush_every_second, name="meshd-hoptrace", daemon=True)
    _flusher.start()
    enabled = True
    log.warning("hop tracing is on: marks go to %s (it costs a little on every hop)", _path)
    return _path


def stop() -> None:
    """Stop tracing and write what is left."""
    global enabled, _flusher
    enabled = False
    if _flusher is None:
        return
    _stopping.set()
    _flusher.join(5)
    _flusher = None
    flush()


def flush() -> None:
    """Append the marks taken so far to this process's file."""
    if _path is None or not _marks:
        return
    lines = []
    while _marks:
        name, when = _marks.popleft()
        lines.append(f"{name} {when}\n")
    try:
        with _path.open("a") as out:
            out.writelines(lines)
    except OSError as error:  # a full disk must not stop the daemon
        log.warning("hop trace: could not write %s: %s", _path, error)


def _flush_every_second() -> None:
    name_this_thread("meshd-hoptrace")
    while not _stopping.wait(FLUSH_INTERVAL_S):
        flush()


# ---------------------------------------------------------------- reading a trace

# The path of a hop over a lane, in order; the first two and the last three are the sender's
# and the receiver's own (sender: S, receiver: R).
SEGMENTS: tuple[tuple[str, str], ...] = (
    ("S", "step_done"),
    ("S", "result_on_loop"),
    ("S", "frame_send"),
    ("S", "frame_sent"),
    ("R", "lane_readable"),
    ("R", "frame_parsed"),
    ("R", "step_submitted"),
    ("R", "step_start"),
)
# A decode step's frames sent by the compute thread itself (:mod:`meshd.inference.stage.runtime`):
# the sender's loop is not on the hop's path (it does its part after the frame left).
EARLY_SEGMENTS: tuple[tuple[str, str], ...] = tuple(
    point for point in SEGMENTS if point != ("S", "result_on_loop")
)
PATHS: dict[str, tuple[tuple[str, str], ...]] = {
    "sent by the loop": SEGMENTS,
    "sent by the compute thread": EARLY_SEGMENTS,
}
HOP_WINDOW_NS = 50_000_000  # a hop that takes longer is not one step's hand-over


@dataclass(frozen=True)
class Hop:
    """One hand-over: ``sender``'s step done to ``receiver``'s next step started. ``path`` (a
    key of PATHS) says which of the sender's threads sent the frame, read from the sender's
    own marks (None: no lane marks, a frame over gRPC); ``segments`` holds the time between
    consecutive marks of that path (ns) where all were seen in order, else None.

    Why a hop can have a path and no segments: a thread may lose its core between a write and
    its ``frame_sent`` mark, and the receiver then reads (and marks) first. On a busy host
    that happens to a good part of the hops; which thread sent is still known (see
    :func:`_sending_thread`), where the time went between the two processes is not."""

    sender: str
    receiver: str
    total_ns: int
    segments: tuple[int, ...] | None
    path: str | None = None


def read_marks(directory: Path, since_ns: int = 0) -> dict[str, list[tuple[str, int]]]:
    """Every traced process's marks from ``since_ns`` on (a ``time.perf_counter_ns()`` of any
    process on this machine: one monotonic clock), by file name (one per process), in time
    order."""
    marks: dict[str, list[tuple[str, int]]] = {}
    for path in sorted(directory.glob("hops-*.txt")):
        rows = []
        for line in path.read_text().splitlines():
            name, _, when = line.partition(" ")
            if when.isdigit() and int(when) >= since_ns:
                rows.append((name, int(when)))
        marks[path.stem] = sorted(rows, key=lambda row: row[1])
    return marks


def pair_hops(marks: dict[str, list[tuple[str, int]]]) -> list[Hop]:
    """The hops in a trace of one request at a time: each ``step_done`` of one process, and
    the next ``step_start`` of another within HOP_WINDOW_NS (with several requests in flight
    the pairs mean nothing). Every process of the mesh must be traced, or a hop through an
    untraced one is taken for a longer hop between traced ones."""
    timeline = sorted(
        (when, process, name) for process, rows in marks.items() for name, when in rows
    )
    hops: list[Hop] = []
    for index, (start, sender, name) in enumerate(timeline):
        if name != "step_done":
            continue
        seen: dict[tuple[str, str], int] = {}  # (process, mark) -> its first time in the hop
        for when, process, later in timeline[index + 1 :]:
            if when - start > HOP_WINDOW_NS:
                break
            if later == "step_start" and process != sender:
                points = {("S" if p == sender else "R", m): t for (p, m), t in seen.items()
                          if p in (sender, process)}  # fmt: skip
                path, segments = _segments(points, start, when)
                hops.append(Hop(sender, process, when - start, segments, path))
                break
            seen.setdefault((process, later), when)
    return hops


def _segments(
    seen: dict[tuple[str, str], int], start: int, end: int
) -> tuple[str | None, tuple[int, ...] | None]:
    """The hop's path (:func:`_sending_thread`), and the hop cut at that path's marks;
    segments None where a mark is missing or out of order."""
    path = _sending_thread(seen)
    if path is None:
        return None, None
    times = [start, *(seen.get(point) for point in PATHS[path][1:-1]), end]
    ordered = [when for when in times if when is not None]
    if len(ordered) != len(times) or ordered != sorted(ordered):
        return path, None
    return path, tuple(b - a for a, b in itertools.pairwise(ordered))


def _sending_thread(seen: dict[tuple[str, str], int]) -> str | None:
    """Which thread of the sender sent the hop's frame over a lane, from the sender's own
    marks (each thread's marks are in its own order, whatever the other process did
    meanwhile): the loop sends after the step's result reached it (``result_on_loop`` before
    ``frame_send``); the compute thread sends before it hands the result back. None: the hop
    went without lane marks at both ends (over gRPC; a lane frame the sender wrote meanwhile
    to another node, such as a token to an origin, is not this hop's)."""
    send = seen.get(("S", "frame_send"))
    readable = seen.get(("R", "lane_readable"))
    if send is None or readable is None or readable < send:
        return None
    on_loop = seen.get(("S", "result_on_loop"))
    if on_loop is not None and on_loop < send:
        return "sent by the loop"
    return "sent by the compute thread"


def summary(hops: list[Hop], names: dict[str, str] | None = None) -> str:
    """A table: per direction, the hops' count and median total, how many went over a lane
    and how many of those were cut into segments, and the median of each segment over the cut
    hops of each path; ``names`` renames the processes (file stems)."""
    names = names or {}
    lines = []
    directions = sorted({(hop.sender, hop.receiver) for hop in hops})
    for sender, receiver in directions:
        these = [hop for hop in hops if (hop.sender, hop.receiver) == (sender, receiver)]
        laned = [hop for hop in these if hop.path is not None]
        cut = [hop for hop in laned if hop.segments is not None]
        total = statistics.median(hop.total_ns for hop in these) / 1e6
        lines.append(
            f"{names.get(sender, sender)} -> {names.get(receiver, receiver)}: {len(these)} hops,"
            f" median {total:.3f} ms ({len(laned)} over a lane, {len(cut)} cut)"
        )
        for path, points in PATHS.items():
            rows = [hop.segments for hop in cut if hop.path == path and hop.segments]
            if not rows:
                continue
            median = statistics.median(sum(row) for row in rows) / 1e6
            lines.append(f"  {len(rows)} {path}, median {median:.3f} ms:")
            for position, ((a_side, a), (b_side, b)) in enumerate(itertools.pairwise(points)):
                median = statistics.median(row[position] for row in rows) / 1e6
                lines.append(f"    {a_side}:{a:<15} -> {b_side}:{b:<15} {median:7.3f} ms")
    return "\n".join(lines)
