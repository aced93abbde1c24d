"""The app without a display: the menu model in every state, the icons, the login items
(an XDG autostart entry checked by desktop-file-validate, the macOS LaunchAgent by plistlib),
and the controller's service actions against a real daemon.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from meshd.api import cli
from meshd.app import autostart, icons
from meshd.app.controller import AppController
from meshd.app.menu_model import (
    LABELS,
    NO_SERVICE_HINT,
    Action,
    AppContext,
    Entry,
    ServiceView,
    action_entries,
    app_menu,
    enabled_actions,
)
from meshd.app.status_model import Menu, MeshState, menu_unreachable
from meshd.service.manager import Systemd

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
MODELS = ("smollm2-135m-instruct", "tiny-llama")


def _menu(state: MeshState, *, model: str = "", url: str = "") -> Menu:
    if state is MeshState.UNREACHABLE:
        return menu_unreachable("UNAVAILABLE: connection refused")
    return Menu(f"title {state.name}", ("mesh home · 2 nodes alive",), state, model, url)


SERVICES = {
    "running": ServiceView(installed=True, running=True),
    "stopped": ServiceView(installed=True, running=False),
    "none": ServiceView(),
}


def _by_action(entries: tuple[Entry, ...]) -> dict[Action, Entry]:
    return {entry.action: entry for entry in entries if entry.action is not None}


@pytest.mark.parametrize("service", sorted(SERVICES))
@pytest.mark.parametrize("state", list(MeshState))
def test_menu_actions_for_every_state(state: MeshState, service: str) -> None:
    reachable = state is not MeshState.UNREACHABLE
    model = "smollm2-135m-instruct" if state in (MeshState.READY, MeshState.UPDATING) else ""
    context = AppContext(service=SERVICES[service], models=MODELS)
    entries = action_entries(_menu(state, model=model), context)
    actions = _by_action(entries)
    membership = Action.LEAVE if service == "running" else Action.REJOIN
    assert [entry.action for entry in entries if not entry.is_separator] == [
        Action.SHOW_STATUS, Action.COPY_TOKEN, Action.LOAD_MODEL,
        membership, Action.RESTART, Action.OPEN_LOGS, Action.QUIT,
    ]  # fmt: skip
    assert actions[Action.SHOW_STATUS].enabled and actions[Action.SHOW_STATUS].default
    assert actions[Action.COPY_TOKEN].enabled is reachable
    load = actions[Action.LOAD_MODEL]
    assert load.enabled is reachable
    assert bool(load.children) is reachable
    for child in load.children:  # the running model is checked, and loading it again is off
        assert child.checked is (child.argument == model)
        assert child.enabled is (child.argument != model)
    installed = service != "none"
    for action in (membership, Action.RESTART, Action.OPEN_LOGS):
        assert actions[action].enabled is installed
        assert actions[action].label.endswith(NO_SERVICE_HINT) is not installed
    assert actions[Action.QUIT].enabled


@pytest.mark.parametrize("state", list(MeshState))
def test_dashboard_replaces_status_once_the_daemon_serves_one(state: MeshState) -> None:
    url = "http://127.0.0.1:52380/"
    menu = Menu("t", (), state, "", url) if state is not MeshState.UNREACHABLE else None
    if menu is None:  # an unreachable daemon reports no URL: the status text stays
        entries = action_entries(_menu(state), AppContext())
        assert _by_action(entries)[Action.SHOW_STATUS].enabled
        return
    first = action_entries(menu, AppContext())[0]
    assert (first.action, first.argument, first.enabled, first.default) == (
        Action.OPEN_DASHBOARD, url, True, True,
    )  # fmt: skip


def test_full_menu_has_status_lines_then_the_message_then_actions() -> None:
    menu = Menu("◉ 2 · m", ("mesh home", "", "plan x"), MeshState.READY, "m")
    entries = app_menu(menu, AppContext(models=("m", "n"), message="join token copied"))
    labels = [entry.label for entry in entries]
    assert labels[:4] == ["◉ 2 · m", "mesh home", "", "plan x"]
    assert labels[4:6] == ["", "join token copied"]
    assert all(entry.action is None and not entry.enabled for entry in entries[:6])
    assert [entry.label for entry in enabled_actions(entries)] == [
        LABELS[Action.SHOW_STATUS], LABELS[Action.COPY_TOKEN], LABELS[Action.LOAD_MODEL],
        LABELS[Action.QUIT],
    ]  # fmt: skip


def test_an_empty_store_still_says_why_load_is_off() -> None:
    load = _by_action(action_entries(_menu(MeshState.NO_MODEL), AppContext()))[Action.LOAD_MODEL]
    assert (load.enabled, load.label) == (False, "Load model (the store is empty)")


def test_icons_differ_per_state_and_theme_and_have_transparent_corners() -> None:
    seen = set()
    for theme in icons.THEMES:
        for state in MeshState:
            image = icons.icon_image(state, theme, 32)
            assert image.size == (32, 32) and image.mode == "RGBA"
            assert image.getpixel((0, 31))[3] == 0  # a transparent corner: any bar shows through
            seen.add(image.tobytes())
    assert len(seen) == len(icons.THEMES) * len(MeshState)
    with pytest.raises(ValueError, match="theme"):
        icons.icon_image(MeshState.READY, "blue")


def _luminance(rgb: np.ndarray) -> np.ndarray:
    """WCAG 2 relative luminance of sRGB pixels (0-255, last axis RGB)."""
    c = rgb / 255.0
    linear = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    return linear @ np.array([0.2126, 0.7152, 0.0722])


def _ink_contrast(icon: Image.Image, panel: tuple[int, int, int, int], region=None) -> float:
    """The median WCAG contrast against the panel of the icon's opaque pixels (alpha >= 1/2),
    as the bar shows them (the icon composited over the panel colour)."""
    shown = Image.new("RGBA", icon.size, panel)
    shown.alpha_composite(icon)
    pixels = np.asarray(shown.convert("RGB"), dtype=np.float64)
    ink = np.asarray(icon.getchannel("A")) >= 128
    if region is not None:
        ink &= region
    lit, dark = np.maximum, np.minimum
    panel_l = _luminance(np.array(panel[:3], dtype=np.float64))
    ink_l = _luminance(pixels[ink])
    ratios = (lit(ink_l, panel_l) + 0.05) / (dark(ink_l, panel_l) + 0.05)
    assert ratios.size > 0, "the icon has no opaque pixels here"
    return float(np.median(ratios))


def _badge_region(size: int) -> np.ndarray:
    scale = size / icons.CANVAS
    cx, cy = (c * scale for c in icons.BADGE_CENTRE)
    y, x = np.mgrid[0:size, 0:size] + 0.5
    return (x - cx) ** 2 + (y - cy) ** 2 <= (icons.BADGE_RADIUS * scale) ** 2


@pytest.mark.parametrize("size", [22, 32, 64])
@pytest.mark.parametrize("theme", icons.THEMES)
def test_every_icon_reads_at_3_to_1_on_the_bars_of_its_theme(theme: str, size: int) -> None:
    """The whole icon and its state badge alone, for every state: >= 3:1 (WCAG 2's minimum
    for graphics) against each bar the theme is for; `any` (the default where the desktop
    does not say) against a light and a dark bar."""
    found = {}
    for panel in icons.PANELS[theme]:
        for state in MeshState:
            icon = icons.icon_image(state, theme, size)
            found[(panel, state, "icon")] = _ink_contrast(icon, panel)
            found[(panel, state, "badge")] = _ink_contrast(icon, panel, _badge_region(size))
    low = {key: round(ratio, 2) for key, ratio in found.items() if ratio < 3.0}
    assert not low, low


def test_todays_light_on_light_mistake_is_what_the_contrast_check_catches() -> None:
    """The check is not blind: a dark bar's icons on a light bar are far below 3:1."""
    icon = icons.icon_image(MeshState.NO_MODEL, "dark", 32)
    assert _ink_contrast(icon, icons.LIGHT_PANEL) < 1.5


# ---------------------------------------------------------------- login items


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "MESHD_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None, reason="desktop-file-utils")
@pytest.mark.skipif(os.uname().sysname != "Linux", reason="XDG autostart is the Linux login item")
def test_app_install_writes_a_valid_autostart_entry_and_uninstall_removes_it(
    home: Path, tmp_path: Path, capsys
) -> None:
    state = tmp_path / "my state"
    assert cli.main(["app", "--install", "--state-dir", str(state), "--theme", "light"]) == 0
    entry = home / ".config" / "autostart" / "meshd-app.desktop"
    icon = home / ".local" / "share" / "icons" / "hicolor" / "64x64" / "apps" / "meshd.png"
    assert f"wrote {entry}" in capsys.readouterr().out
    checked = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True, text=True)
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, ""), checked
    values = dict(line.split("=", 1) for line in entry.read_text().splitlines() if "=" in line)
    assert values["Icon"] == str(icon) and icon.is_file()
    assert values["Exec"].endswith(f'app --state-dir "{state}" --theme light')
    assert values["Terminal"] == "false"

    assert cli.main(["app", "--install", "--state-dir", str(state), "--theme", "light"]) == 0
    assert f"{entry} is up to date" in capsys.readouterr().out
    assert cli.main(["app", "--uninstall"]) == 0
    assert not entry.exists() and not icon.exists()


def test_app_launch_agent_for_macos(home: Path) -> None:
    argv = autostart.app_command(Path("/s"), None)
    plist = plistlib.loads(autostart.render_app_plist(argv, {"HOME": str(home)}))
    assert plist["Label"] == "org.meshd.app"
    assert plist["ProgramArguments"][-3:] == ["app", "--state-dir", "/s"]
    assert Path(plist["ProgramArguments"][0]).is_absolute()
    assert plist["LimitLoadToSessionType"] == "Aqua"  # only in a graphical login
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # Quit stays quit
    assert plist["StandardErrorPath"] == str(home / "Library" / "Logs" / "meshd" / "app.log")


def test_desktop_exec_quoting_follows_the_specification() -> None:
    assert autostart._desktop_exec_word("/usr/bin/python3") == "/usr/bin/python3"
    assert autostart._desktop_exec_word("/a b") == '"/a b"'
    assert autostart._desktop_exec_word('say "$x" 100%') == '"say \\\\"\\\\$x\\\\" 100%%"'


# ---------------------------------------------------------------- controller and service

FAKE_SYSTEMCTL = """#!/bin/sh
echo "$*" >> "{log}"
case "$*" in
  *" show "*) [ -f "{dir}/active" ] && echo ActiveState=active || echo ActiveState=inactive ;;
  *" stop "*) rm -f "{dir}/active" ;;
  *" start "*|*" restart "*) touch "{dir}/active" ;;
esac
"""


def test_leave_and_rejoin_stop_and_start_the_service(tmp_path: Path, daemons, mesh_token) -> None:
    """The controller against a real daemon, with systemctl standing in for a running systemd
    (none runs here): Leave stops the unit, the menu then offers Rejoin, which starts it."""
    daemon = daemons([*LOOPBACK, "--join", mesh_token])
    daemon.wait_ready()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "systemctl.log"
    tool = bin_dir / "systemctl"
    tool.write_text(FAKE_SYSTEMCTL.format(log=log, dir=tmp_path))
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "active").touch()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path / "home")}
    service = Systemd(env=env, say=lambda _line: None, check_booted=False)
    service.unit_path.parent.mkdir(parents=True)
    service.unit_path.write_text("[Service]\nExecStart=/bin/true\n")
    controller = AppController(daemon.api, lambda: None, service=service, refresh_s=0.2)
    with_controller = controller.start()
    try:
        _wait(lambda: controller.state is MeshState.NO_MODEL, "the daemon's status")
        entries = controller.snapshot()[1]
        leave = _by_action(entries)[Action.LEAVE]
        message = controller.perform(leave).result(30)
        assert message.startswith("left the mesh: the service is stopped")
        assert "graceful leave comes later" in message
        entries = controller.snapshot()[1]
        assert _by_action(entries)[Action.REJOIN].enabled
        assert (
            controller.perform(_by_action(entries)[Action.REJOIN])
            .result(30)
            .startswith("rejoining")
        )
        assert _by_action(controller.snapshot()[1])[Action.LEAVE].enabled
        assert [line for line in log.read_text().splitlines() if " show " not in f" {line} "] == [
            "--user stop meshd.service",
            "--user start meshd.service",
        ]
    finally:
        with_controller.close()


def _wait(check, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        time.sleep(0.05)


def test_the_command_line_imports_no_gui_toolkit() -> None:
    """`meshd --help` and every app module import without pystray, GTK or rumps (they load
    only when the app starts), so the CLI stays fast and works on headless servers."""
    code = (
        "import sys; from meshd.api.cli import build_parser; build_parser(); "
        "import meshd.app.macos, meshd.app.tray, meshd.app.controller, meshd.app.autostart; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pystray', 'gi', 'rumps', 'mlx', 'Xlib')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


def test_app_without_a_display_says_to_use_the_terminal(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    command = [sys.executable, "-m", "meshd", "app", "--state-dir", str(tmp_path)]
    if os.uname().sysname != "Linux":
        pytest.skip("the display check is Linux's")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "meshd app --terminal" in done.stderr, done.stderr
