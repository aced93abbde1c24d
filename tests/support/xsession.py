"""A throwaway graphical session for GUI tests: Xvfb, a D-Bus session bus and a tray host.

Everything runs on a display and a bus of its own (Xvfb picks a free display number, the
bus listens on a socket in the test's folder); every process started here is stopped by
its PID when the session closes, also when the test failed. Screenshots come from Pillow's
ImageGrab (XCB), window geometry from python-xlib, clicks and keys from xdotool, the
clipboard from xclip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageGrab

TOOLS = ("Xvfb", "trayer", "dbus-daemon", "xdotool", "xclip")
SCREEN = (800, 600)
TRAY_HEIGHT = 32
TRAY_WIDTH = 200
DESKTOP = (58, 74, 92)  # the root window's colour (24-bit TrueColor: the pixel is RGB)
START_TIMEOUT_S = 10.0


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


@dataclass(frozen=True)
class Geometry:
    x: int
    y: int
    width: int
    height: int

    @property
    def centre(self) -> tuple[int, int]:
        return self.x + self.width // 2, self.y + self.height // 2

    @property
    def box(self) -> tuple[int, int, int, int]:
        return self.x, self.y, self.x + self.width, self.y + self.height


class XSession:
    """Xvfb + dbus-daemon + trayer; `env` is what a program needs to show up in it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.processes: list[subprocess.Popen[bytes]] = []
        self.display = ""
        self.env: dict[str, str] = {}

    # ------------------------------------------------------------ lifetime

    def start(self) -> XSession:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._start_xvfb()
        bus = self._start_bus()
        self.env = {
            **os.environ,
            "DISPLAY": self.display,
            "DBUS_SESSION_BUS_ADDRESS": bus,
            "XDG_RUNTIME_DIR": str(self._runtime_dir()),
            "NO_AT_BRIDGE": "1",  # GTK: no accessibility bus to look for
        }
        self.env.pop("WAYLAND_DISPLAY", None)
        self._paint_desktop()
        self.spawn(
            [
                "trayer", "--edge", "top", "--align", "right", "--SetDockType", "true",
                "--widthtype", "pixel", "--width", str(TRAY_WIDTH),
                "--heighttype", "pixel", "--height", str(TRAY_HEIGHT),
                "--transparent", "false", "--tint", "0xffffff", "--iconspacing", "2",
            ],
            "trayer.log",
        )  # fmt: skip
        self.wait_for(lambda: self.tray_owner() is not None, "the tray host to take the tray")
        return self

    def close(self) -> None:
        """Stop every process started here, newest first, by PID."""
        for proc in reversed(self.processes):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)

    def __enter__(self) -> XSession:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def spawn(self, argv: list[str], log_name: str, **kwargs) -> subprocess.Popen[bytes]:
        """Start a program in this session (its own process group, output to a log file)."""
        with (self.folder / log_name).open("ab") as log:
            proc = subprocess.Popen(
                argv,
                env=kwargs.pop("env", self.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **kwargs,
            )
        self.processes.append(proc)
        return proc

    def _runtime_dir(self) -> Path:
        runtime = self.folder / "runtime"
        runtime.mkdir(mode=0o700, exist_ok=True)
        return runtime

    def _start_xvfb(self) -> None:
        read_end, write_end = os.pipe()
        with (self.folder / "xvfb.log").open("ab") as log:
            proc = subprocess.Popen(
                [
                    "Xvfb", "-displayfd", str(write_end), "-screen", "0",
                    f"{SCREEN[0]}x{SCREEN[1]}x24", "-nolisten", "tcp", "-noreset",
                ],
                pass_fds=(write_end,), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.processes.append(proc)
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            number = pipe.readline().strip()  # Xvfb writes its display number when ready
        if not number:
            raise RuntimeError(f"Xvfb did not start: {(self.folder / 'xvfb.log').read_text()}")
        self.display = f":{number}"

    def _start_bus(self) -> str:
        address = f"unix:path={self.folder / 'bus'}"
        proc = self.spawn(
            ["dbus-daemon", "--session", "--nofork", "--nopidfile", f"--address={address}"],
            "dbus.log",
            env=os.environ,
        )
        self.wait_for(lambda: (self.folder / "bus").exists() or proc.poll() is not None, "D-Bus")
        if proc.poll() is not None:
            raise RuntimeError(f"dbus-daemon exited: {(self.folder / 'dbus.log').read_text()}")
        return address

    # ------------------------------------------------------------ looking and clicking

    def wait_for(self, check: Callable[[], object], what: str, timeout_s: float = START_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"no {what} within {timeout_s} s")

    def _xlib(self):
        from Xlib import display

        return display.Display(self.display)

    def _paint_desktop(self) -> None:
        """A desktop colour instead of Xvfb's black root window (screenshots read better)."""
        with contextlib.closing(self._xlib()) as d:
            root = d.screen().root
            red, green, blue = DESKTOP
            root.change_attributes(background_pixel=(red << 16) | (green << 8) | blue)
            root.clear_area()
            d.sync()

    def tray_owner(self) -> int | None:
        with contextlib.closing(self._xlib()) as d:
            owner = d.get_selection_owner(d.intern_atom("_NET_SYSTEM_TRAY_S0"))
            return owner.id if owner else None

    def windows_of(self, wm_class: str, *, top_level: bool) -> list[Geometry]:
        """Viewable windows of a program (by WM_CLASS); top-level ones are the root's children
        (menus and dialogs), the others are embedded (a tray icon lives inside the tray)."""
        from Xlib import X

        found: list[Geometry] = []
        with contextlib.closing(self._xlib()) as d:
            root = d.screen().root

            def visit(window, depth: int) -> None:
                for child in window.query_tree().children:
                    try:
                        attributes = child.get_attributes()
                        names = child.get_wm_class() or ()
                    except Exception:  # a window that vanished meanwhile
                        continue
                    viewable = attributes.map_state == X.IsViewable
                    if viewable and wm_class in names and (depth == 0) == top_level:
                        geometry = child.get_geometry()
                        origin = child.translate_coords(root, 0, 0)
                        found.append(
                            Geometry(-origin.x, -origin.y, geometry.width, geometry.height)
                        )
                    if viewable:
                        visit(child, depth + 1)

            visit(root, 0)
        return found

    def screenshot(self, box: tuple[int, int, int, int] | None = None) -> Image.Image:
        return ImageGrab.grab(bbox=box, xdisplay=self.display).convert("RGB")

    def xdotool(self, *args: str) -> None:
        subprocess.run(["xdotool", *args], env=self.env, check=True, timeout=10)

    def clipboard(self) -> str:
        done = subprocess.run(
            ["xclip", "-o", "-selection", "clipboard"],
            env=self.env, capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        return done.stdout if done.returncode == 0 else ""


@contextlib.contextmanager
def x_session(folder: Path) -> Iterator[XSession]:
    session = XSession(folder)
    try:
        yield session.start()
    finally:
        session.close()
