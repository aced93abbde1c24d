"""`meshd app --install`: start the app at login.

macOS: a LaunchAgent of its own (org.meshd.app, only in graphical Aqua sessions, restarted
if it crashes, not after Quit). Linux and other XDG desktops: an autostart entry,
`$XDG_CONFIG_HOME/autostart/meshd-app.desktop` (Desktop Entry Specification), with the
app's icon beside the user's other icons.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from meshd.app.icons import icon_image
from meshd.app.status_model import MeshState
from meshd.service import units
from meshd.service.manager import Launchd, Say, home_of, write_if_changed

APP_LABEL = "org.meshd.app"
DESKTOP_FILE = "meshd-app.desktop"
ICON_NAME = "meshd"
ICON_SIZE = 64


def app_command(state_dir: Path | None, api: str | None) -> list[str]:
    """`meshd app` of this installation, with the daemon it should follow."""
    command = units.this_installation(Path("."))
    argv = [command.interpreter, *command.entry, "app"]
    if api:
        argv += ["--api", api]
    elif state_dir:
        argv += ["--state-dir", str(state_dir.expanduser().absolute())]
    return argv


# ---------------------------------------------------------------- XDG autostart


def _desktop_exec_word(arg: str) -> str:
    """One word of a desktop entry's Exec key (quoted per the specification when needed)."""
    arg = arg.replace("%", "%%")
    if arg and not any(ch.isspace() or ch in "\"'\\><~|&;$*?#()`" for ch in arg):
        return arg
    escaped = "".join("\\" + ch if ch in '"`$\\' else ch for ch in arg)
    # The whole value is a string, whose own escape for a backslash is a second backslash.
    return '"' + escaped.replace("\\", "\\\\") + '"'


def render_desktop_entry(argv: Sequence[str], icon_path: Path) -> str:
    return (
        "\n".join(
            [
                "[Desktop Entry]",
                "Type=Application",
                "Name=meshd",
                "GenericName=LLM mesh status",
                "Comment=Shows the meshd mesh in the tray: state, nodes, plan, actions",
                "Exec=" + " ".join(_desktop_exec_word(arg) for arg in argv),
                f"Icon={icon_path}",
                "Terminal=false",
                "Categories=Network;",
                "StartupNotify=false",
                "X-GNOME-Autostart-enabled=true",
            ]
        )
        + "\n"
    )


def xdg_paths(env: Mapping[str, str]) -> tuple[Path, Path]:
    """(the autostart entry, the icon file) for this user."""
    home = home_of(env)
    config = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
    data = Path(env.get("XDG_DATA_HOME") or home / ".local" / "share")
    icon = data / "icons" / "hicolor" / f"{ICON_SIZE}x{ICON_SIZE}" / "apps" / f"{ICON_NAME}.png"
    return config / "autostart" / DESKTOP_FILE, icon


def install_xdg(argv: Sequence[str], env: Mapping[str, str], say: Say) -> Path:
    entry, icon = xdg_paths(env)
    icon.parent.mkdir(parents=True, exist_ok=True)
    icon_image(MeshState.READY, "any", ICON_SIZE).save(icon)  # menus of any colour
    write_if_changed(entry, render_desktop_entry(argv, icon).encode(), say)
    say("the app starts at your next login; start it now with: meshd app &")
    return entry


def uninstall_xdg(env: Mapping[str, str], say: Say) -> None:
    entry, icon = xdg_paths(env)
    for path in (entry, icon):
        if path.exists():
            path.unlink()
            say(f"removed {path}")
    if not entry.exists():
        say("the app no longer starts at login")


# ---------------------------------------------------------------- macOS


def app_agent(argv: Sequence[str], env: Mapping[str, str]) -> units.LaunchAgent:
    return units.LaunchAgent(
        APP_LABEL,
        tuple(argv),
        units.macos_log_dir(home_of(env)),
        "app.log",
        gui_only=True,
    )


def app_launchd(env: Mapping[str, str], say: Say) -> Launchd:
    agent = app_agent([], env)
    return Launchd(label=APP_LABEL, log_path=agent.log_path, env=env, say=say)


def install_launchd(argv: Sequence[str], env: Mapping[str, str], say: Say) -> Path:
    agent = app_agent(argv, env)
    manager = app_launchd(env, say)
    manager.install(agent, units.render_launchd_plist(agent))
    return manager.plist_path


def render_app_plist(argv: Sequence[str], env: Mapping[str, str]) -> bytes:
    return units.render_launchd_plist(app_agent(argv, env))
