"""Whether the desktop's panel is light or dark, from the settings a desktop keeps.

The tray icon is drawn for the bar it sits on. The bar's colour is not something a program
can ask for, so this reads what decides it, in order:

1. GTK_THEME (e.g. `Adwaita:dark`): a theme the user forced on GTK programs;
2. GNOME (and Ubuntu's, Unity, Pantheon): the Shell's top bar is dark in light and dark
   mode alike;
3. KDE Plasma: the colour scheme or look-and-feel package in kdeglobals;
4. GSettings' `org.gnome.desktop.interface`: `color-scheme` (prefer-dark / prefer-light)
   and `gtk-theme` (used by MATE, Cinnamon, Budgie and GTK programs anywhere);
5. GTK 3's settings file (`gtk-application-prefer-dark-theme`, `gtk-theme-name`).

Only a clear answer counts: a theme left at its default (Adwaita, `default`) says nothing
about the panel, and the caller then draws icons that read on either.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

GSETTINGS_TIMEOUT_S = 2.0
DARK_TOP_BAR_DESKTOPS = ("gnome", "unity", "pantheon")
DEFAULT_GTK_THEMES = ("", "adwaita", "default")


def desktop_theme(env: Mapping[str, str]) -> str | None:
    """'light' or 'dark' for this desktop's panel, or None when no setting says."""
    readers: tuple[Callable[[Mapping[str, str]], str | None], ...] = (
        _gtk_theme_variable,
        _dark_top_bar,
        _kde,
        _gsettings,
        _gtk_settings_file,
    )
    for reader in readers:
        theme = reader(env)
        if theme is not None:
            return theme
    return None


def theme_of_name(name: str) -> str | None:
    """'dark' for a theme named dark, 'light' for another chosen theme, None for the default."""
    lowered = name.strip().strip("'\"").lower()
    if "dark" in lowered:
        return "dark"
    return None if lowered in DEFAULT_GTK_THEMES else "light"


def _gtk_theme_variable(env: Mapping[str, str]) -> str | None:
    return theme_of_name(env.get("GTK_THEME", ""))


def _desktops(env: Mapping[str, str]) -> list[str]:
    return [name.lower() for name in env.get("XDG_CURRENT_DESKTOP", "").split(":") if name]


def _dark_top_bar(env: Mapping[str, str]) -> str | None:
    desktops = _desktops(env)
    if any(name in DARK_TOP_BAR_DESKTOPS for name in desktops):
        return "dark"
    return None


def _config_home(env: Mapping[str, str]) -> Path | None:
    if env.get("XDG_CONFIG_HOME"):
        return Path(env["XDG_CONFIG_HOME"])
    return Path(env["HOME"]) / ".config" if env.get("HOME") else None


def _read_ini(path: Path) -> configparser.ConfigParser | None:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read(path, encoding="utf-8")
    except (OSError, configparser.Error, UnicodeDecodeError):
        return None
    return parser


def _kde(env: Mapping[str, str]) -> str | None:
    config = _config_home(env)
    if "kde" not in _desktops(env) or config is None:
        return None
    parser = _read_ini(config / "kdeglobals")
    if parser is None:
        return None
    names = [
        parser.get("General", "ColorScheme", fallback=""),
        parser.get("KDE", "LookAndFeelPackage", fallback=""),
    ]
    if any("dark" in name.lower() for name in names):
        return "dark"
    return "light" if any(names) else None


def _gsettings_value(env: Mapping[str, str], key: str) -> str:
    """One key of org.gnome.desktop.interface, "" where gsettings or the key is missing."""
    gsettings = shutil.which("gsettings", path=env.get("PATH"))
    if gsettings is None:
        return ""
    try:
        done = subprocess.run(
            [gsettings, "get", "org.gnome.desktop.interface", key],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=GSETTINGS_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip().strip("'") if done.returncode == 0 else ""


def _gsettings(env: Mapping[str, str]) -> str | None:
    scheme = _gsettings_value(env, "color-scheme")
    if scheme == "prefer-dark":
        return "dark"
    if scheme == "prefer-light":
        return "light"
    return theme_of_name(_gsettings_value(env, "gtk-theme"))


def _gtk_settings_file(env: Mapping[str, str]) -> str | None:
    config = _config_home(env)
    if config is None:
        return None
    parser = _read_ini(config / "gtk-3.0" / "settings.ini")
    if parser is None or not parser.has_section("Settings"):
        return None
    prefer_dark = parser.get("Settings", "gtk-application-prefer-dark-theme", fallback="")
    if prefer_dark.strip().lower() in ("1", "true", "yes"):
        return "dark"
    return theme_of_name(parser.get("Settings", "gtk-theme-name", fallback=""))
