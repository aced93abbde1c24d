"""The tray app for real: `meshd app` under Xvfb with a tray host (trayer) and a D-Bus session,
against a running daemon. The icon is found in the tray, and its pixels are compared with
every state's icon; the menu is opened with a right click and walked with the keyboard.

One session, started as a login would start it (the autostart entry's command, with no
PYSTRAY_BACKEND: the app picks GTK where AppIndicator is missing): no model -> Load model
(menu) -> serving -> Copy join token (menu, checked on the clipboard) -> the daemon stops
(daemon down) -> it starts again (no model) -> Quit (menu). And the xorg backend, whose
tooltip must be Latin-1. Screenshots are saved as artefacts (MESHD_TEST_ARTIFACTS, else the
pytest run's base temporary folder).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from meshd.api import client
from meshd.app.icons import icon_image
from meshd.app.menu_model import Action, AppContext, action_entries, enabled_actions
from meshd.app.status_model import Menu, MeshState
from tests.support.xsession import Geometry, XSession, missing_tools, x_session

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
THEME = "any"  # an X session with no desktop settings: icons that read on any bar
# What would tell the app the desktop's theme or choose its backend: none of it in the session.
DESKTOP_VARIABLES = ("PYSTRAY_BACKEND", "GTK_THEME", "XDG_CURRENT_DESKTOP", "GDK_BACKEND")
STATE_TIMEOUT_S = 20.0
MIN_ICON = 12  # the smallest size a tray would scale the icon to

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(bool(missing_tools()), reason=f"needs {', '.join(missing_tools())}"),
    pytest.mark.skipif(
        importlib.util.find_spec("pystray") is None or importlib.util.find_spec("gi") is None,
        reason="needs pystray and PyGObject (pip install 'meshd[app]')",
    ),
]


@pytest.fixture
def artefacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(os.environ.get("MESHD_TEST_ARTIFACTS") or tmp_path_factory.getbasetemp())
    folder = folder / "tray-app"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# ---------------------------------------------------------------- reading the icon


Placement = tuple[int, int, int]  # icon size, x and y offset in the tray's slot


def _scores(
    crop: Image.Image, placements: list[Placement]
) -> tuple[dict[MeshState, float], Placement]:
    """How far the tray's pixels are from each state's icon (mean absolute difference, 0-255),
    and where the best-matching icon sits.

    The tray scales the icon to its own size and centres it in its slot (a slot smaller than
    the icon clips it), so each icon is tried at each placement, on the slot's own background.
    """
    pixels = np.asarray(crop, dtype=np.float32)
    background = crop.getpixel((0, 0))
    scores: dict[MeshState, float] = {}
    best_placement = placements[0]
    best_overall = float("inf")
    for state in MeshState:
        best = float("inf")
        for size, dx, dy in placements:
            icon = icon_image(state, THEME, size)
            canvas = Image.new("RGB", crop.size, background)
            canvas.paste(icon, (dx, dy), mask=icon)
            difference = float(np.abs(np.asarray(canvas, dtype=np.float32) - pixels).mean())
            best = min(best, difference)
            if difference < best_overall:
                best_overall, best_placement = difference, (size, dx, dy)
        scores[state] = best
    return scores, best_placement


def _all_placements(width: int, height: int) -> list[Placement]:
    """Every size and offset a tray might use: inside the slot, or centred over it (± 1)."""

    def offsets(slot: int, size: int) -> range:
        if size <= slot:
            return range(0, slot - size + 1)
        centred = (slot - size) // 2
        return range(centred - 1, centred + 2)

    return [
        (size, dx, dy)
        for size in range(MIN_ICON, max(width, height) + 3)
        for dy in offsets(height, size)
        for dx in offsets(width, size)
    ]


def _near(placement: Placement) -> list[Placement]:
    size, x, y = placement
    return [
        (size + ds, x + dx, y + dy)
        for ds in (-1, 0, 1)
        for dx in (-1, 0, 1)
        for dy in (-1, 0, 1)
        if size + ds >= MIN_ICON
    ]


class TrayApp:
    """The app's process, its icon in the tray, and its menu."""

    def __init__(self, x: XSession, artefacts: Path) -> None:
        self.x = x
        self.artefacts = artefacts
        self.icon: Geometry | None = None
        self.placement: Placement | None = None  # where the tray draws the icon, once found

    def find_icon(self) -> Geometry:
        """The icon's window in the tray, once the tray has given it its size."""

        def docked() -> list[Geometry]:
            icons = self.x.windows_of("meshd", top_level=False)
            return [icon for icon in icons if min(icon.width, icon.height) >= MIN_ICON]

        icons = self.x.wait_for(docked, "icon docked in the tray")
        assert len(icons) == 1, icons
        self.icon = icons[0]
        return self.icon

    def wait_state(self, expected: MeshState, name: str) -> dict[MeshState, float]:
        """Wait until the icon's pixels match `expected` best; save the tray's picture."""
        assert self.icon is not None
        deadline = time.monotonic() + STATE_TIMEOUT_S
        while True:
            crop = self.x.screenshot(self.find_icon().box)
            if self.placement is None:
                placements = _all_placements(*crop.size)
            else:
                placements = _near(self.placement)
            scores, placement = _scores(crop, placements)
            best = min(scores, key=scores.__getitem__)
            if best is expected or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        crop.resize((crop.width * 4, crop.height * 4), Image.Resampling.NEAREST).save(
            self.artefacts / f"{name}-icon.png"
        )
        ranked = sorted(scores.items(), key=lambda item: item[1])
        assert best is expected, f"the icon looks {best.name}, not {expected.name}: {ranked}"
        assert scores[expected] < 6.0, ranked  # close to the drawn icon, not merely nearest
        self.placement = placement
        return scores

    def open_menu(self) -> Geometry:
        assert self.icon is not None
        x, y = self.icon.centre
        self.x.xdotool("mousemove", str(x), str(y), "click", "3")
        menus = self.x.wait_for(lambda: self.x.windows_of("meshd", top_level=True), "open menu")
        time.sleep(0.3)  # let GTK finish drawing it
        return menus[0]

    def choose(self, *keys: str) -> None:
        """Open the menu and walk it with the keyboard (disabled lines are skipped)."""
        self.open_menu()
        self.x.xdotool("key", "--delay", "80", *keys)
        self.x.wait_for(lambda: not self.x.windows_of("meshd", top_level=True), "the menu to close")

    def screenshot_menu(self, name: str) -> Path:
        menu = self.open_menu()
        assert self.icon is not None
        top = min(menu.y, self.icon.y)
        left = min(menu.x, self.icon.x)
        right = max(menu.x + menu.width, self.icon.x + self.icon.width)
        path = self.artefacts / f"{name}.png"
        self.x.screenshot((left, top, right, menu.y + menu.height)).save(path)
        self.x.xdotool("key", "Escape")
        self.x.wait_for(lambda: not self.x.windows_of("meshd", top_level=True), "menu closed")
        return path


def _downs_to(action: Action) -> list[str]:
    """Down presses that select `action` in a reachable daemon's menu without a service."""
    menu = Menu("", (), MeshState.NO_MODEL)
    clickable = enabled_actions(action_entries(menu, AppContext(models=("m",))))
    return ["Down"] * ([entry.action for entry in clickable].index(action) + 1)


def _desktop_env(x: XSession, home: Path) -> dict[str, str]:
    """The X session's environment as a fresh login has it: a home of its own, no settings."""
    env = {**x.env, "HOME": str(home), "GSETTINGS_BACKEND": "memory"}
    for name in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", *DESKTOP_VARIABLES):
        env.pop(name, None)
    return env


def _autostart_command(env: dict[str, str], state_dir: Path) -> list[str]:
    """`meshd app --install`'s login entry, and the command its Exec line runs."""
    command = [sys.executable, "-m", "meshd", "app", "--state-dir", str(state_dir), "--install"]
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=60)
    entry = Path(env["HOME"]) / ".config" / "autostart" / "meshd-app.desktop"
    exec_line = next(line for line in entry.read_text().splitlines() if line.startswith("Exec="))
    assert "PYSTRAY_BACKEND" not in entry.read_text()
    return shlex.split(exec_line.removeprefix("Exec="))  # no %-codes or backslashes in it here


def test_tray_icon_follows_the_daemon_and_its_menu_acts(
    tmp_path: Path, daemons, mesh_token, artefacts: Path
) -> None:
    run_args = [*LOOPBACK, "--join", mesh_token]
    daemon = daemons(run_args)
    daemon.wait_ready()
    home = tmp_path / "home"
    home.mkdir()
    with x_session(tmp_path / "x") as x:
        env = _desktop_env(x, home)
        proc = x.spawn(_autostart_command(env, daemon.state_dir), "app.log", env=env)
        app = TrayApp(x, artefacts)
        try:
            app.find_icon()
            log = (tmp_path / "x" / "app.log").read_text(errors="replace")
            assert "tray backend: gtk" in log and "icons for any bars" in log, log
            app.wait_state(MeshState.NO_MODEL, "1-no-model")

            # Load model -> the embedded default: the mesh plans it and serves.
            app.choose(*_downs_to(Action.LOAD_MODEL), "Right", "Home", "Return")
            app.wait_state(MeshState.READY, "2-serving")
            app.screenshot_menu("tray-app-serving")

            token = client.fetch_token(daemon.api).token
            app.choose(*_downs_to(Action.COPY_TOKEN), "Return")
            x.wait_for(lambda: x.clipboard() == token, "the join token on the clipboard")

            daemon.terminate()
            app.wait_state(MeshState.UNREACHABLE, "3-daemon-down")
            app.screenshot_menu("tray-app-daemon-down")
            daemons(run_args, state_dir=daemon.state_dir).wait_ready()
            app.wait_state(MeshState.READY, "4-back")  # it kept the model it was told to load

            app.choose("End", "Return")  # Quit is the last line
            assert proc.wait(15) == 0
        finally:
            x.screenshot().save(artefacts / "screen-at-end.png")
            log = (tmp_path / "x" / "app.log").read_text(errors="replace")
            (artefacts / "app.log").write_text(log)
        assert "Traceback" not in log, log


def test_xorg_backend_sets_a_non_latin1_title_without_errors(tmp_path: Path, artefacts: Path):
    """python-xlib sets WM_NAME as Latin-1: the state marks (here "✕ meshd") must not reach it."""
    home = tmp_path / "home"
    home.mkdir()
    log_path = tmp_path / "x" / "app-xorg.log"
    with x_session(tmp_path / "x") as x:
        env = {**_desktop_env(x, home), "PYSTRAY_BACKEND": "xorg"}
        no_daemon = f"unix:{tmp_path / 'no-daemon.sock'}"
        command = [sys.executable, "-m", "meshd", "app", "--api", no_daemon, "--theme", THEME]
        proc = x.spawn(command, "app-xorg.log", env=env)
        app = TrayApp(x, artefacts)
        try:
            app.find_icon()  # docked in the tray (xorg scales it its own way: no pixel match)
            # Logged once a redraw has set the icon, the title and the menu.
            shown = "the tray shows: unreachable"
            try:
                x.wait_for(
                    lambda: shown in log_path.read_text(errors="replace"), "a whole redraw", 30.0
                )
            except TimeoutError as timeout:
                _dump_stacks(proc)
                log = log_path.read_text(errors="replace")
                raise AssertionError(f"{timeout}; the app's log and stacks:\n{log}") from None
            assert proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(15)
            log = log_path.read_text(errors="replace")
            (artefacts / "app-xorg.log").write_text(log)
        assert "tray backend: xorg (PYSTRAY_BACKEND is set)" in log, log
        assert "Traceback" not in log and "UnicodeEncodeError" not in log, log


def test_the_xorg_icon_takes_updates_from_several_threads_while_its_loop_redraws(tmp_path: Path):
    """pystray's own xorg icon hangs here every time: two threads on one X connection lose a
    reply (meshd.app.xorg_icon). 3 threads x 200 icon and title updates, with the window
    exposed every 2 ms, must all run."""
    with x_session(tmp_path / "x") as x:
        done = subprocess.run(
            [sys.executable, "-m", "tests.support.xorg_hammer", "200"],
            env={**x.env, "PYSTRAY_BACKEND": "xorg"},
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert done.returncode == 0 and "updates: 600" in done.stdout, done.stdout + done.stderr


def _dump_stacks(proc) -> None:
    """Have a hung app write every thread's stack into its log (meshd app handles SIGUSR1)."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
