"""Which tray backend and which icons `meshd app` picks, on this machine's real GObject
repository, gsettings and settings files (no display needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshd.app import tray_backend
from meshd.app.desktop_theme import desktop_theme

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(sys.platform != "linux", reason="the Linux tray backends"),
]


def _no_appindicator() -> bool:
    return not any(tray_backend.has_typelib(*ns) for ns in tray_backend.APPINDICATOR_NAMESPACES)


@pytest.mark.skipif(not _no_appindicator(), reason="this machine has an AppIndicator typelib")
@pytest.mark.skipif(not tray_backend.has_typelib("Gtk", "3.0"), reason="needs GTK 3's typelib")
def test_without_appindicator_it_picks_gtk_and_respects_a_users_choice() -> None:
    choice = tray_backend.choose_backend({"DISPLAY": ":9"})
    assert choice.name == "gtk", choice
    assert tray_backend.choose_backend({"DISPLAY": ":9", "PYSTRAY_BACKEND": "xorg"}).name == "xorg"
    with pytest.raises(tray_backend.NoTrayBackend, match="not a pystray backend"):
        tray_backend.choose_backend({"PYSTRAY_BACKEND": "qt"})
    with pytest.raises(tray_backend.NoTrayBackend, match="Wayland session"):
        tray_backend.choose_backend({"WAYLAND_DISPLAY": "wayland-0"})  # no X11 for XEmbed


def test_with_nothing_installed_meshd_app_names_the_packages(tmp_path: Path) -> None:
    """PyGObject and python-xlib hidden from the interpreter: exit 2 with what to install."""
    script = (
        "import sys; sys.modules['gi'] = None; sys.modules['Xlib'] = None\n"
        "from meshd.api.cli import main\n"
        f"sys.exit(main(['app', '--api', 'unix:{tmp_path}/none.sock']))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DISPLAY": ":9"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done
    assert "sudo apt-get install gir1.2-ayatanaappindicator3-0.1 gir1.2-gtk-3.0" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_desktop_theme_from_the_settings_a_desktop_keeps(tmp_path: Path) -> None:
    config = tmp_path / "config"
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(config)}
    base["GSETTINGS_BACKEND"] = "memory"  # gsettings runs, with its defaults: says nothing
    assert desktop_theme(base) is None
    assert desktop_theme({**base, "GTK_THEME": "Adwaita:dark"}) == "dark"
    assert desktop_theme({**base, "XDG_CURRENT_DESKTOP": "ubuntu:GNOME"}) == "dark"

    (config / "gtk-3.0").mkdir(parents=True)
    settings = config / "gtk-3.0" / "settings.ini"
    settings.write_text("[Settings]\ngtk-theme-name=Arc\n")
    assert desktop_theme(base) == "light"
    settings.write_text("[Settings]\ngtk-theme-name=Arc\ngtk-application-prefer-dark-theme=1\n")
    assert desktop_theme(base) == "dark"
    settings.write_text("[Settings]\ngtk-theme-name=Adwaita\n")
    assert desktop_theme(base) is None

    kde = {**base, "XDG_CURRENT_DESKTOP": "KDE"}
    (config / "kdeglobals").write_text("[General]\nColorScheme=BreezeDark\n")
    assert desktop_theme(kde) == "dark"
    (config / "kdeglobals").write_text("[General]\nColorScheme=BreezeLight\n")
    assert desktop_theme(kde) == "light"
