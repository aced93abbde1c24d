"""The macOS menu-bar front end (rumps): the same controller and menu model as the tray.

AppKit must only be touched on the main thread, so the controller's threads only mark the
menu as changed and a main-thread timer redraws it. rumps shows an icon from a file: the
icons are written once per state and theme into the user's cache folder. This module cannot
run on Linux; everything it draws comes from menu_model and controller, which are tested.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any

from meshd.app.controller import AppController
from meshd.app.icons import icon_image
from meshd.app.menu_model import Action, Entry
from meshd.app.status_model import MeshState
from meshd.app.tray import AppError
from meshd.service.manager import Manager

REDRAW_S = 0.5  # how often the main thread looks for a changed menu
ICON_POINTS = 18  # menu-bar icons are 18 pt; written at 2x for Retina screens


def macos_theme() -> str:
    """'dark' when the menu bar is dark (Dark appearance), else 'light'."""
    done = subprocess.run(
        ["defaults", "read", "-g", "AppleInterfaceStyle"], capture_output=True, text=True
    )
    return "dark" if done.stdout.strip() == "Dark" else "light"


def _icon_file(state: MeshState, theme: str) -> str:
    folder = Path.home() / "Library" / "Caches" / "meshd" / "icons"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{state.name.lower()}-{theme}.png"
    if not path.exists():
        icon_image(state, theme, ICON_POINTS * 2).save(path)
    return str(path)


def run_menu_bar(api_address: str, *, theme: str, service: Manager | None) -> int:
    try:
        import rumps
    except ImportError as exc:
        raise AppError(
            "the menu-bar app needs rumps: pip install 'meshd[app]'; "
            "`meshd app --terminal` works without it"
        ) from exc

    class MeshMenuBar(rumps.App):  # defined here: rumps exists only on macOS
        def __init__(self) -> None:
            super().__init__("meshd", quit_button=None)
            self.theme = theme
            self._dirty = threading.Event()
            self.controller = AppController(api_address, self._dirty.set, service=service)
            self._timer = rumps.Timer(self._redraw, REDRAW_S)

        def start(self) -> None:
            self.controller.start()
            self._dirty.set()
            self._timer.start()
            self.run()

        def _redraw(self, _timer: object) -> None:
            if not self._dirty.is_set():
                return
            self._dirty.clear()
            menu, entries = self.controller.snapshot()
            self.icon = _icon_file(
                menu.state, macos_theme() if self.theme == "auto" else self.theme
            )
            self.title = None
            self.menu.clear()
            self.menu.update(_rumps_items(entries, self._clicked, rumps))

        def _clicked(self, entry: Entry) -> None:
            if entry.action is Action.QUIT:
                self.controller.close(timeout_s=2.0)
                rumps.quit_application()
            else:
                self.controller.perform(entry)

    MeshMenuBar().start()
    return 0


def _rumps_items(entries: tuple[Entry, ...], clicked: Any, rumps: Any) -> list[Any]:
    """rumps items; rumps keys items by their text, so a repeated line is dropped."""
    items: list[Any] = []
    seen: set[str] = set()
    for entry in entries:
        if entry.is_separator:
            items.append(None)
            continue
        if entry.label in seen:
            continue
        seen.add(entry.label)
        callback = None
        if entry.action is not None and entry.enabled and not entry.children:
            callback = lambda _sender, e=entry: clicked(e)  # noqa: E731
        item = rumps.MenuItem(entry.label, callback=callback)  # no callback: greyed out
        if entry.checked:
            item.state = 1
        if entry.children:
            items.append([item, _rumps_items(entry.children, clicked, rumps)])
        else:
            items.append(item)
    return items
