"""Terminal front end of the status app: redraws the mesh menu on every update.

    meshd app --terminal [--state-dir DIR | --api ADDRESS] [--exit-after SECONDS]

Works on Linux, macOS and over ssh. On a terminal the screen is cleared before each redraw;
when the output is a pipe or a file, each update is appended below a rule instead. Ctrl-C
(or SIGTERM) quits.

Why a flag and not KeyboardInterrupt: Python raises KeyboardInterrupt at whatever bytecode the
main thread is running, which can be inside ``queue.Queue``'s own locking; the feed's thread
then blocks forever on that queue's lock and the app never exits (seen once in a full test
run). The handler only sets a flag, which the draw loop reads at least every POLL_S.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from meshd.api.client import api_address_for
from meshd.app.status_model import SEPARATOR, Menu, StatusFeed

CLEAR_SCREEN = "\x1b[H\x1b[2J"
RULE = "-" * 60
POLL_S = 0.5  # how often the main thread wakes to notice Ctrl-C or --exit-after


def render(menu: Menu, updated_at: float) -> str:
    """The menu as terminal text: title, items (a blank line per separator), a footer."""
    lines = [menu.title, ""]
    lines += ["" if item == SEPARATOR else f"  {item}" for item in menu.items]
    lines += ["", f"updated {time.strftime('%H:%M:%S', time.localtime(updated_at))} · Ctrl-C quits"]
    return "\n".join(lines)


def draw(menu: Menu, out: TextIO) -> None:
    prefix = CLEAR_SCREEN if out.isatty() else RULE + "\n"
    out.write(prefix + render(menu, time.time()) + "\n")
    out.flush()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Show the meshd mesh status, redrawn live.")
    parser.add_argument(
        "--state-dir", type=Path, help="the daemon's state directory (default: the per-user one)"
    )
    parser.add_argument("--api", help="the daemon's API address (overrides --state-dir)")
    parser.add_argument(
        "--exit-after",
        type=float,
        metavar="SECONDS",
        help="quit by itself after this long (for scripts; default: run until Ctrl-C)",
    )
    return parser.parse_args(argv)


@contextlib.contextmanager
def stop_requested() -> Iterator[Callable[[], bool]]:
    """While open, SIGINT and SIGTERM only set a flag; yields a function that reads it. Off the
    main thread (where Python cannot take signals) the flag never sets."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    signals: list[int] = []

    def note(signum: int, _frame: object) -> None:
        signals.append(signum)

    previous = {number: signal.signal(number, note) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: bool(signals)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def run(api_address: str, exit_after_s: float | None, out: TextIO) -> None:
    """Draw every Menu the feed delivers until Ctrl-C, SIGTERM or exit_after_s."""
    updates: queue.Queue[Menu] = queue.Queue()
    deadline = None if exit_after_s is None else time.monotonic() + exit_after_s
    with stop_requested() as stopped, StatusFeed(api_address, updates.put):
        while not stopped() and (deadline is None or time.monotonic() < deadline):
            try:
                menu = updates.get(timeout=POLL_S)
            except queue.Empty:
                continue
            draw(menu, out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(api_address_for(args.state_dir, args.api), args.exit_after, sys.stdout)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
