"""What the app asks of the desktop: the clipboard, a browser, a terminal, a file viewer.

Each uses the platform's own tool (pbcopy and open on macOS; wl-copy, xclip or xsel and
xdg-open on Linux; clip on Windows). A missing tool is a `DesktopError` that names the
package to install, shown in the menu; it never stops the app.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import webbrowser
from collections.abc import Mapping, Sequence
from pathlib import Path

CLIPBOARD_TIMEOUT_S = 5.0
# Terminal emulators that take a command after `-e` (or `--` for gnome-terminal), in order.
LINUX_TERMINALS = (
    ("x-terminal-emulator", "-e"),
    ("gnome-terminal", "--"),
    ("konsole", "-e"),
    ("xfce4-terminal", "-x"),
    ("xterm", "-e"),
)


class DesktopError(RuntimeError):
    """The desktop cannot do what was asked; the message says what is missing."""


class Desktop:
    """The platform's clipboard, browser, terminal and file opener."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        self.system = platform.system()

    def _which(self, name: str) -> str | None:
        return shutil.which(name, path=self.env.get("PATH"))

    # ------------------------------------------------------------ clipboard

    def clipboard_command(self) -> list[str]:
        if self.system == "Darwin":
            return ["pbcopy"]
        if self.system == "Windows":
            return ["clip"]
        candidates = [["xclip", "-selection", "clipboard"], ["xsel", "--clipboard", "--input"]]
        if self.env.get("WAYLAND_DISPLAY"):
            candidates.insert(0, ["wl-copy"])
        for command in candidates:
            if self._which(command[0]):
                return command
        raise DesktopError(
            "no clipboard tool: install xclip or xsel (wl-clipboard on Wayland), e.g. "
            "sudo apt-get install xclip"
        )

    def copy(self, text: str) -> None:
        """Put `text` on the clipboard.

        xclip and xsel stay in the background to own the X selection until another program
        takes it, so their output is not captured (a pipe they hold would never close).
        """
        command = self.clipboard_command()
        try:
            done = subprocess.run(
                command,
                input=text.encode(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=self.env,
                timeout=CLIPBOARD_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DesktopError(f"{command[0]} could not set the clipboard: {exc}") from exc
        if done.returncode != 0:
            raise DesktopError(f"{command[0]} could not set the clipboard (exit {done.returncode})")

    # ------------------------------------------------------------ browser, files, terminal

    def open_url(self, url: str) -> None:
        if not webbrowser.open(url):
            raise DesktopError(f"no browser could be started; open {url} yourself")

    def open_file(self, path: Path) -> None:
        if self.system == "Windows":
            os.startfile(path)  # type: ignore[attr-defined]  # only exists on Windows
            return
        opener = "open" if self.system == "Darwin" else "xdg-open"
        if not self._which(opener):
            raise DesktopError(f"{opener} is missing (xdg-utils): open {path} yourself")
        self._spawn([opener, str(path)])

    def terminal_command(self, argv: Sequence[str]) -> list[str] | None:
        """A command that shows `argv` running in a new terminal window, or None."""
        if self.system == "Darwin":
            script = f'tell application "Terminal" to do script {_applescript(shlex.join(argv))}'
            return ["osascript", "-e", script, "-e", 'tell application "Terminal" to activate']
        for name, flag in LINUX_TERMINALS:
            if self._which(name):
                return [name, flag, *argv]
        return None

    def run_in_terminal(self, argv: Sequence[str]) -> bool:
        """Run argv in a terminal window; False when this desktop has no terminal."""
        command = self.terminal_command(argv)
        if command is None:
            return False
        self._spawn(command)
        return True

    def show_text(self, name: str, text: str) -> Path:
        """Write text to a file and open it in the desktop's viewer (no terminal needed)."""
        folder = Path(tempfile.gettempdir()) / f"meshd-app-{os.getuid()}"
        folder.mkdir(mode=0o700, exist_ok=True)
        path = folder / name
        path.write_text(text)
        self.open_file(path)
        return path

    def _spawn(self, command: list[str]) -> None:
        """Start a desktop program that outlives the action (a window the user closes)."""
        try:
            subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        except OSError as exc:
            raise DesktopError(f"could not start {command[0]}: {exc}") from exc


def _applescript(text: str) -> str:
    """A string literal for AppleScript."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
