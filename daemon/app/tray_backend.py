"""Which pystray backend shows the tray icon here, chosen before pystray is imported.

pystray picks its Linux backend at import time and tries AppIndicator first; where the
AppIndicator typelib is missing, `gi.require_version` raises ValueError, which pystray does
not catch, so a desktop without AppIndicator got no tray at all. This module asks GObject's
repository which typelibs exist (without loading any) and picks, in order:

- appindicator: Ayatana's or the original AppIndicator (StatusNotifierItem over D-Bus: GNOME
  with its AppIndicator extension, KDE Plasma, and Wayland sessions);
- gtk: GTK 3's XEmbed status icon (a system tray on X11: XFCE, MATE, LXDE, trayer, ...);
- xorg: plain Xlib (an X11 system tray, no menu: a click shows the status).

A PYSTRAY_BACKEND the user set is respected as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

APPINDICATOR_NAMESPACES = (("AyatanaAppIndicator3", "0.1"), ("AppIndicator3", "0.1"))
GTK_NAMESPACE = ("Gtk", "3.0")
KNOWN_BACKENDS = ("appindicator", "gtk", "xorg", "win32", "darwin", "dummy")
DEBIAN_PACKAGES = "gir1.2-ayatanaappindicator3-0.1 gir1.2-gtk-3.0 libgirepository1.0-dev"


class NoTrayBackend(RuntimeError):
    """No pystray backend can work here; the message says what to install."""


@dataclass(frozen=True)
class BackendChoice:
    name: str  # a PYSTRAY_BACKEND value
    reason: str  # why, in words, for the log


def has_typelib(namespace: str, version: str) -> bool:
    """Whether GObject introspection can load `namespace` `version` (nothing is loaded)."""
    try:
        import gi
    except ImportError:
        return False
    try:
        return version in gi.Repository.get_default().enumerate_versions(namespace)
    except Exception:  # an older or broken PyGObject: ask require_version's way instead
        try:
            gi.require_version(namespace, version)
        except (ValueError, AttributeError):
            return False
        return True


def _has_xlib() -> bool:
    try:
        import Xlib  # noqa: F401  # pystray's dependency on Linux
    except ImportError:
        return False
    return True


def choose_backend(env: Mapping[str, str]) -> BackendChoice:
    """The backend for this desktop, or NoTrayBackend naming the packages to install."""
    requested = env.get("PYSTRAY_BACKEND", "").strip()
    if requested:
        if requested not in KNOWN_BACKENDS:
            raise NoTrayBackend(
                f"PYSTRAY_BACKEND={requested} is not a pystray backend; use one of "
                f"{', '.join(KNOWN_BACKENDS)}, or unset it to let meshd choose"
            )
        return BackendChoice(requested, "PYSTRAY_BACKEND is set")
    if sys.platform == "win32":
        return BackendChoice("win32", "Windows")
    x11 = bool(env.get("DISPLAY"))
    for namespace, version in APPINDICATOR_NAMESPACES:
        if has_typelib(namespace, version) and has_typelib(*GTK_NAMESPACE):
            return BackendChoice("appindicator", f"the {namespace} typelib is installed")
    if x11 and has_typelib(*GTK_NAMESPACE):
        return BackendChoice("gtk", "GTK 3 is installed, AppIndicator is not")
    if x11 and _has_xlib():
        return BackendChoice("xorg", "neither GTK 3 nor AppIndicator is installed (no menu)")
    if not x11:
        raise NoTrayBackend(
            "this Wayland session has no X11 display for a system tray, and AppIndicator is "
            f"not installed: sudo apt-get install {DEBIAN_PACKAGES} (GNOME also needs its "
            "AppIndicator extension: gnome-shell-extension-appindicator); "
            "`meshd app --terminal` works without a tray"
        )
    raise NoTrayBackend(
        "no tray backend works here: neither AppIndicator nor GTK 3 (PyGObject) nor "
        f"python-xlib is installed: sudo apt-get install {DEBIAN_PACKAGES} and "
        "pip install 'meshd[app]'; `meshd app --terminal` works without a tray"
    )


def apply_backend(choice: BackendChoice, env: MutableMapping[str, str] | None = None) -> None:
    """Make pystray use `choice` (it reads PYSTRAY_BACKEND when first imported).

    GTK's XEmbed status icon is an X11 protocol: in a Wayland session with XWayland, GTK
    must talk to the X server or the icon never shows.
    """
    env = os.environ if env is None else env
    env["PYSTRAY_BACKEND"] = choice.name
    if choice.name in ("gtk", "xorg") and env.get("WAYLAND_DISPLAY") and env.get("DISPLAY"):
        env.setdefault("GDK_BACKEND", "x11")
