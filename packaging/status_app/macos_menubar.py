"""macOS menu-bar front end of the status app (rumps).

    pip install rumps
    python packaging/status_app/macos_menubar.py [--state-dir DIR | --api ADDRESS]

The title shows the mesh at a glance; the drop-down shows the status lines from
status_model, then the actions. AppKit must only be touched on the main thread, so the
feed's thread just stores the newest Menu and a main-thread timer draws it.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import threading
from pathlib import Path

from status_model import SEPARATOR, Menu, StatusFeed, menu_unreachable

from meshd.api.client import DaemonUnreachable, api_address_for, fetch_token

try:
    import rumps
except ImportError:  # pragma: no cover - only on machines without rumps
    sys.exit(
        "the menu-bar app needs rumps (macOS only): pip install rumps\n"
        "elsewhere, use the terminal front end: python packaging/status_app/terminal.py"
    )

REDRAW_S = 0.5  # how often the main thread checks for a new Menu
OPEN_STATUS = "Open status in Terminal"
COPY_TOKEN = "Copy join token"
QUIT = "Quit"


class MeshMenuBar(rumps.App):
    """The menu-bar item: status lines (disabled items) and three actions."""

    def __init__(self, api_address: str) -> None:
        super().__init__("meshd", title="◌ meshd", quit_button=None)
        self.api_address = api_address
        self._pending: Menu | None = menu_unreachable("connecting to the daemon…")
        self._lock = threading.Lock()
        self._feed = StatusFeed(api_address, self._store)
        self._timer = rumps.Timer(self._redraw, REDRAW_S)
        self._timer.start()
        self._feed.start()

    def _store(self, menu: Menu) -> None:
        """Feed thread: remember the newest Menu for the main thread."""
        with self._lock:
            self._pending = menu

    def _redraw(self, _timer: object) -> None:
        with self._lock:
            menu, self._pending = self._pending, None
        if menu is None:
            return
        self.title = menu.title
        self.menu.clear()
        # rumps keys items by their text: a repeated line would replace the first one.
        lines = [None if item == SEPARATOR else item for item in menu.items]
        self.menu.update([*_unique(lines), None, *self._actions()])

    def _actions(self) -> list[rumps.MenuItem]:
        return [
            rumps.MenuItem(OPEN_STATUS, callback=self.open_status),
            rumps.MenuItem(COPY_TOKEN, callback=self.copy_token),
            rumps.MenuItem(QUIT, callback=self.quit),
        ]

    def open_status(self, _item: object) -> None:
        command = [sys.executable, "-m", "meshd.api.cli", "status", "--api", self.api_address]
        script = f'tell application "Terminal" to do script {_applescript_string(command)}'
        subprocess.run(["osascript", "-e", script, "-e", 'tell application "Terminal" to activate'])

    def copy_token(self, _item: object) -> None:
        try:
            reply = fetch_token(self.api_address)
        except DaemonUnreachable as exc:
            rumps.alert("meshd: no join token", str(exc))
            return
        subprocess.run(["pbcopy"], input=reply.token.encode(), check=True)
        rumps.notification(
            "meshd", f"join token of mesh {reply.mesh_name} copied", "meshd run --join <token>"
        )

    def quit(self, _item: object) -> None:
        self._feed.close(timeout_s=2.0)
        rumps.quit_application()


def _unique(lines: list[str | None]) -> list[str | None]:
    seen: set[str] = set()
    out: list[str | None] = []
    for line in lines:
        if line is not None:
            if line in seen:
                continue
            seen.add(line)
        out.append(line)
    return out


def _applescript_string(command: list[str]) -> str:
    """A shell command line as an AppleScript string literal."""
    text = shlex.join(command)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="meshd status in the macOS menu bar.")
    parser.add_argument("--state-dir", type=Path, help="the daemon's state directory")
    parser.add_argument("--api", help="the daemon's API address (overrides --state-dir)")
    args = parser.parse_args(argv)
    MeshMenuBar(api_address_for(args.state_dir, args.api)).run()


if __name__ == "__main__":
    main()
