"""The tray front end (Linux, Windows) on pystray: an icon per state and the app's menu.

On Linux pystray shows the icon through AppIndicator or GTK's XEmbed status icon (both need
PyGObject and GTK, and a D-Bus session bus) and, without them, through plain Xlib with no menu;
meshd.app.tray_backend picks the one this desktop has before pystray is imported
(`PYSTRAY_BACKEND=appindicator|gtk|xorg` overrides it). pystray runs its loop on the main
thread and its setters may be called from any thread, which is how the controller's threads
redraw (on xorg through meshd.app.xorg_icon, since pystray's own hand-over there can hang).
This module only translates: what the menu holds is decided in menu_model.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import signal
import threading
from typing import Any

from meshd.app.controller import AppController
from meshd.app.icons import icon_image
from meshd.app.menu_model import Action, Entry
from meshd.app.status_model import MeshState
from meshd.app.tray_backend import NoTrayBackend, apply_backend, choose_backend
from meshd.service.manager import Manager

log = logging.getLogger("meshd.app")

PROGRAM_NAME = "meshd"  # the X window class of the icon (how a tray, or a test, finds it)
ICON_SIZE = 64


class AppError(RuntimeError):
    """The app cannot start here; the message says what is missing."""


def _name_the_program() -> None:
    """Name the process for GTK before pystray initialises it (window class, tray tooltips)."""
    try:
        from gi.repository import GLib
    except ImportError:
        return
    GLib.set_prgname(PROGRAM_NAME)
    GLib.set_application_name(PROGRAM_NAME)


def load_pystray() -> Any:
    """pystray, with the backend this desktop has (see meshd.app.tray_backend)."""
    try:
        choice = choose_backend(os.environ)
    except NoTrayBackend as exc:
        raise AppError(str(exc)) from exc
    apply_backend(choice)
    log.info("tray backend: %s (%s)", choice.name, choice.reason)
    if choice.name in ("appindicator", "gtk"):
        _name_the_program()
    try:
        import pystray
    except ImportError as exc:
        raise AppError(
            "the tray app needs pystray and Pillow: pip install 'meshd[app]' "
            f"({exc}); `meshd app --terminal` works without them"
        ) from exc
    except Exception as exc:  # a backend that fails to initialise (no display, no GTK)
        raise AppError(f"no tray is available here: {exc}") from exc
    return pystray


class Tray:
    """The pystray icon, redrawn from the controller's snapshot."""

    def __init__(
        self, pystray: Any, api_address: str, *, theme: str, service: Manager | None
    ) -> None:
        self.pystray = pystray
        self.theme = theme
        self.icon = _icon_class(pystray)(
            PROGRAM_NAME, icon_image(MeshState.UNREACHABLE, theme, ICON_SIZE), "meshd"
        )
        self.controller = AppController(api_address, self.redraw, service=service)
        self._lock = threading.Lock()
        self._drawn_state: MeshState | None = None
        self._quitting = False
        if not self.icon.HAS_MENU:
            log.warning(
                "this tray backend has no menus (install PyGObject and GTK for them); "
                "a click on the icon shows the status"
            )

    def run(self) -> int:
        """Show the icon until Quit; returns the exit status."""

        def setup(icon: Any) -> None:
            icon.visible = True
            self.controller.start()
            self.redraw()

        try:
            self.icon.run(setup)
        except Exception as exc:
            if not self._quitting:
                raise AppError(
                    f"the tray could not start: {exc}; the GTK tray needs a graphical session "
                    "with a D-Bus session bus (DBUS_SESSION_BUS_ADDRESS)"
                ) from exc
            # pystray's GTK backend hides its notification on the way out and fails where
            # no notification service runs; the app has ended all the same.
            log.debug("the tray ended with: %s", exc)
        finally:
            self.controller.close()
        return 0

    def quit(self) -> None:
        self._quitting = True
        self.controller.close(timeout_s=2.0)
        self.icon.stop()

    # ------------------------------------------------------------ drawing

    def redraw(self) -> None:
        with self._lock:
            menu, entries = self.controller.snapshot()
            changed = menu.state is not self._drawn_state
            if changed:
                self.icon.icon = icon_image(menu.state, self.theme, ICON_SIZE)
                self._drawn_state = menu.state
            self.icon.title = self._title(menu.title)
            self.icon.menu = self.pystray.Menu(*(self._item(entry) for entry in entries))
            if changed:
                log.info("the tray shows: %s", menu.state.value)

    def _title(self, title: str) -> str:
        """The tooltip; for the xorg backend in Latin-1, the only text Xlib's WM_NAME takes."""
        if os.environ.get("PYSTRAY_BACKEND") != "xorg":
            return title
        return latin1_text(title)

    def _item(self, entry: Entry) -> Any:
        pystray = self.pystray
        if entry.is_separator:
            return pystray.Menu.SEPARATOR
        if entry.children:
            submenu = pystray.Menu(*(self._item(child) for child in entry.children))
            return pystray.MenuItem(entry.label, submenu, enabled=entry.enabled)
        action = None if entry.action is None else functools.partial(self._clicked, entry)
        checked = None if entry.checked is None else functools.partial(_fixed, entry.checked)
        return pystray.MenuItem(
            entry.label, action, enabled=entry.enabled, checked=checked, default=entry.default
        )

    def _clicked(self, entry: Entry, _icon: Any, _item: Any) -> None:
        """pystray's thread: hand the action over, never run it here."""
        if entry.action is Action.QUIT:
            self.quit()
        else:
            self.controller.perform(entry)


def latin1_text(text: str) -> str:
    """`text` without the characters Latin-1 lacks (the state marks), spaces collapsed."""
    kept = text.encode("latin-1", "ignore").decode("latin-1")
    return " ".join(kept.split()) or "meshd"


def _fixed(value: bool, _item: Any) -> bool:
    return value


def _icon_class(pystray: Any) -> Any:
    """pystray's Icon; for the xorg backend, one whose setters are safe from other threads
    (see meshd.app.xorg_icon): the controller's threads redraw."""
    if pystray.Icon.__module__ != "pystray._xorg":
        return pystray.Icon
    from meshd.app.xorg_icon import ThreadSafeXorgIcon

    return ThreadSafeXorgIcon


def _dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` writes every thread's stack to stderr: how a hung tray is diagnosed
    (the app runs unattended, often with no terminal to interrupt it in)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def run_tray(api_address: str, *, theme: str, service: Manager | None) -> int:
    _dump_stacks_on_sigusr1()
    return Tray(load_pystray(), api_address, theme=theme, service=service).run()
