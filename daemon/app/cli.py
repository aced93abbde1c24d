"""`meshd app`: the status app (tray on Linux and Windows, menu bar on macOS, or a terminal).

    meshd app [--state-dir DIR | --api ADDRESS] [--theme auto|light|dark|any]
    meshd app --terminal [--exit-after SECONDS]
    meshd app --install | --uninstall [--dry-run]     start it at login (or not)

It follows the daemon of the state directory (the per-user one by default, like every
meshd command) and the service that runs it (`meshd service ...`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import sys
from pathlib import Path

from meshd.service.manager import Launchd, Manager, Systemd
from meshd.service.units import ServiceError

THEMES = ("auto", "light", "dark", "any")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `meshd app` to the meshd command line."""
    app = subparsers.add_parser(
        "app",
        help="the status app: tray / menu-bar icon with the mesh's state and actions",
        description=__doc__.split("\n\n")[0],
    )
    app.add_argument("--state-dir", type=Path, help="the daemon's state directory")
    app.add_argument("--api", help="the daemon's API address (overrides --state-dir)")
    app.add_argument(
        "--theme",
        choices=THEMES,
        default="auto",
        help=(
            "icons for a light or a dark bar, or for any bar (auto: macOS's appearance, the "
            "Linux desktop's theme where it tells, else any)"
        ),
    )
    app.add_argument("--terminal", action="store_true", help="draw the status in this terminal")
    app.add_argument(
        "--exit-after", type=float, metavar="SECONDS", help="--terminal: stop after this long"
    )
    login = app.add_mutually_exclusive_group()
    login.add_argument("--install", action="store_true", help="start the app at login")
    login.add_argument("--uninstall", action="store_true", help="stop starting it at login")
    app.add_argument(
        "--dry-run", action="store_true", help="with --install: print the login entry only"
    )
    app.set_defaults(handler=run_app_command)


def run_app_command(args: argparse.Namespace) -> int:
    from meshd.app.tray import AppError

    try:
        if args.install or args.uninstall:
            return _login_item(args)
        return _run(args)
    except (AppError, ServiceError) as exc:
        print(f"meshd: {exc}", file=sys.stderr)
        return 2


def _api_address(args: argparse.Namespace) -> str:
    from meshd.api.client import api_address_for
    from meshd.config import load_config

    if args.api:
        return args.api
    state_dir = args.state_dir or load_config({}).state_dir
    return api_address_for(state_dir, None)


def app_service() -> Manager | None:
    """The service that runs this machine's daemon: launchd's agent on macOS; on Linux the
    per-user unit, else the system-wide one if only that is installed; None elsewhere."""
    system = platform.system()
    if system == "Darwin":
        return Launchd(say=_log)
    if system != "Linux":
        return None
    user = Systemd(system=False, say=_log)
    if not user.unit_path.exists() and Systemd(system=True).unit_path.exists():
        return Systemd(system=True, say=_log)
    return user


def _log(line: str) -> None:
    logging.getLogger("meshd.app").info("%s", line)


def _run(args: argparse.Namespace) -> int:
    api = _api_address(args)
    if args.terminal:
        from meshd.app.terminal import run

        with contextlib.suppress(KeyboardInterrupt):
            run(api, args.exit_after, sys.stdout)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if platform.system() == "Darwin":
        from meshd.app.macos import run_menu_bar

        return run_menu_bar(api, theme=args.theme, service=app_service())
    from meshd.app.tray import AppError, run_tray

    if platform.system() == "Linux" and not (
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    ):
        raise AppError(
            "no graphical session here (neither DISPLAY nor WAYLAND_DISPLAY is set); "
            "`meshd app --terminal` shows the status in this terminal"
        )
    return run_tray(api, theme=_tray_theme(args.theme), service=app_service())


def _tray_theme(requested: str) -> str:
    """The icons' theme: as asked, else the desktop's, else icons that read on any bar."""
    if requested != "auto":
        return requested
    from meshd.app.desktop_theme import desktop_theme

    theme = desktop_theme(os.environ) or "any"
    logging.getLogger("meshd.app").info("icons for %s bars (--theme to choose)", theme)
    return theme


def _login_item(args: argparse.Namespace) -> int:
    from meshd.app import autostart

    env = dict(os.environ)
    argv = autostart.app_command(args.state_dir, args.api)
    if args.theme != "auto":
        argv += ["--theme", args.theme]
    if platform.system() == "Darwin":
        if args.uninstall:
            autostart.app_launchd(env, print).uninstall()
        elif args.dry_run:
            sys.stdout.write(autostart.render_app_plist(argv, env).decode())
        else:
            autostart.install_launchd(argv, env, print)
        return 0
    if args.uninstall:
        autostart.uninstall_xdg(env, print)
    elif args.dry_run:
        entry, icon = autostart.xdg_paths(env)
        print(f"# would be written to {entry}", file=sys.stderr)
        sys.stdout.write(autostart.render_desktop_entry(argv, icon))
    else:
        autostart.install_xdg(argv, env, print)
    return 0
