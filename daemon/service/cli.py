"""`meshd service ...`: install meshd as a launchd agent or a systemd unit, and drive it.

    meshd service install [--system] [--dry-run] [--platform launchd|systemd] [-- RUN OPTIONS]
    meshd service uninstall | start | stop | restart [--system]
    meshd service status [--system]     the service manager's view, then the daemon's
    meshd service logs [--system] [-n LINES] [--no-follow]

macOS: a per-user LaunchAgent (macOS grants Local Network access, which mDNS needs, to user
agents more reliably than to system daemons). Linux: a per-user systemd unit by default,
the system-wide one with --system. Options after `--` are passed to `meshd run` (checked
now, so a typo fails here rather than in a restart loop); settings that change often belong
in the state directory's meshd.toml.
"""

from __future__ import annotations

import argparse
import os
import platform
import plistlib
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshd.service import units
from meshd.service.manager import Launchd, Manager, Systemd, home_of
from meshd.service.units import ServiceError

PLATFORMS = ("launchd", "systemd")
DAEMON_ANSWER_TIMEOUT_S = 3.0
NOT_RUNNING_EXIT = 3  # `status`: the daemon does not answer (as `systemctl status` uses 3)


def host_platform() -> str:
    system = platform.system()
    if system == "Darwin":
        return "launchd"
    if system == "Linux":
        return "systemd"
    raise ServiceError(
        f"`meshd service` knows launchd (macOS) and systemd (Linux), not {system}; run "
        "`meshd run` under your own supervisor, or render a file with --platform and --dry-run"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `meshd service ...` to the meshd command line."""
    service = subparsers.add_parser(
        "service", help="run meshd as a background service (launchd on macOS, systemd on Linux)"
    )
    verbs = service.add_subparsers(dest="service_command", required=True)
    texts = {
        "install": "write the service file, enable it and start the daemon (idempotent)",
        "uninstall": "stop the daemon and remove the service file",
        "start": "start the service",
        "stop": "stop the service (until `start`, or the next boot/login)",
        "restart": "restart the service",
        "status": "the service manager's view and the daemon's (`meshd status`)",
        "logs": "show and follow the daemon's log (journal or log file)",
    }
    for verb, text in texts.items():
        parser = verbs.add_parser(verb, help=text, description=text)
        parser.add_argument(
            "--system",
            action="store_true",
            help="Linux: the system-wide unit (/etc/systemd/system) instead of the per-user one",
        )
        if verb in ("install", "uninstall"):
            parser.add_argument(
                "--root",
                type=Path,
                help="with --system: write into this directory tree instead of / and enable "
                "the unit there offline (images, tests); nothing is started",
            )
        if verb == "install":
            _add_install_arguments(parser)
        if verb == "logs":
            parser.add_argument("-n", "--lines", type=int, default=100, help="lines of history")
            parser.add_argument("--no-follow", action="store_true", help="print and exit")
    service.set_defaults(handler=run_service_command)


def _add_install_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dry-run", action="store_true", help="print the file instead of writing it"
    )
    parser.add_argument(
        "--platform",
        choices=PLATFORMS,
        help="render this platform's file (with --dry-run; default: this machine's)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="the daemon's state directory (default: the per-user one; /var/lib/meshd with "
        "--system)",
    )
    parser.add_argument(
        "--run-as",
        metavar="USER",
        help="with --system: run as this existing account instead of a dynamic user",
    )
    parser.add_argument(
        "run_args",
        nargs=argparse.REMAINDER,
        help="after --: options for `meshd run` (for example -- --memory-budget 12GB)",
    )


def run_service_command(args: argparse.Namespace) -> int:
    """Entry point of `meshd service ...`: errors become one message and exit status 2."""
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "install": cmd_install,
        "uninstall": cmd_uninstall,
        "start": cmd_control,
        "stop": cmd_control,
        "restart": cmd_control,
        "status": cmd_status,
        "logs": cmd_logs,
    }
    try:
        return commands[args.service_command](args)
    except ServiceError as exc:
        print(f"meshd: {exc}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------- install


def default_state_dir_for(platform_name: str, system: bool, env=os.environ) -> Path:
    """Where the service's daemon keeps its state when --state-dir is not given."""
    if system:
        return units.SYSTEM_STATE_DIR
    home = home_of(env)
    if platform_name == host_platform_or_none():
        from meshd.config import load_config

        return load_config({}, env=env).state_dir  # the directory `meshd status` looks in
    if platform_name == "launchd":
        return home / "Library" / "Application Support" / "meshd"
    return Path(env.get("XDG_STATE_HOME") or home / ".local" / "state") / "meshd"


def host_platform_or_none() -> str | None:
    try:
        return host_platform()
    except ServiceError:
        return None


def _checked_run_args(run_args: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The options for `meshd run`, checked now, and the settings they give (by name)."""
    if run_args[:1] == ["--"]:
        run_args = run_args[1:]
    if any(arg == "--state-dir" or arg.startswith("--state-dir=") for arg in run_args):
        raise ServiceError("give the state directory as `meshd service install --state-dir DIR`")
    from meshd.api.cli import build_parser
    from meshd.config import flags_given

    parsed, unknown = build_parser().parse_known_args(["run", *run_args])  # a bad value exits
    if unknown:
        raise ServiceError(
            f"not options of `meshd run`: {' '.join(unknown)} (see `meshd run --help`)"
        )
    return run_args, flags_given(parsed)


def _leave_grace_s(state_dir: Path, flags: dict[str, Any]) -> float:
    """The leave grace the service's daemon will use (its options, the state directory's
    meshd.toml, the defaults): the stop timeout must outlast it."""
    from meshd.config import ConfigError, load_config

    try:
        config = load_config({**flags, "state_dir": state_dir}, env={})
    except ConfigError as exc:
        raise ServiceError(f"the daemon's configuration is not valid: {exc}") from exc
    return config.leave_grace_s


def cmd_install(args: argparse.Namespace) -> int:
    platform_name = args.platform or host_platform()
    if platform_name != host_platform_or_none() and not args.dry_run:
        raise ServiceError(
            f"this machine does not run {platform_name}: add --dry-run to print the file"
        )
    if args.system and platform_name == "launchd":
        raise ServiceError(
            "on macOS meshd runs as a per-user LaunchAgent (Local Network access, which mDNS "
            "needs, is granted to user agents): drop --system"
        )
    if args.run_as and not args.system:
        raise ServiceError("--run-as is for the system-wide unit: add --system")
    state_dir = args.state_dir or default_state_dir_for(platform_name, args.system)
    if args.system and state_dir.absolute() != units.SYSTEM_STATE_DIR:
        raise ServiceError(
            f"the system-wide unit keeps its state in {units.SYSTEM_STATE_DIR} (systemd's "
            "StateDirectory); drop --state-dir"
        )
    run_args, flags = _checked_run_args(args.run_args)
    command = units.this_installation(state_dir, run_args, _leave_grace_s(state_dir, flags))
    if platform_name == "launchd":
        return _install_launchd(args, command)
    return _install_systemd(args, command)


def _install_launchd(args: argparse.Namespace, command: units.DaemonCommand) -> int:
    agent = units.daemon_agent(command)
    plist = units.render_launchd_plist(agent)
    manager = Launchd(log_path=agent.log_path)
    if args.dry_run:
        print(f"# would be written to {manager.plist_path}", file=sys.stderr)
        sys.stdout.write(plist.decode())
        return 0
    manager.install(agent, plist)
    _say_next_steps(command)
    return 0


def _install_systemd(args: argparse.Namespace, command: units.DaemonCommand) -> int:
    if args.system and not args.run_as:
        units.check_dynamic_user_can_run(command)
    text = units.render_systemd_unit(
        units.SystemdUnit(command, system=args.system, run_as=args.run_as)
    )
    manager = Systemd(system=args.system, root=args.root)
    if args.dry_run:
        print(f"# would be written to {manager.unit_path}", file=sys.stderr)
        sys.stdout.write(text)
        return 0
    manager.install(text)
    if args.root is None:
        _say_next_steps(command, system=args.system)
    return 0


def _say_next_steps(command: units.DaemonCommand, *, system: bool = False) -> None:
    flag = " --system" if system else ""
    print(f"the daemon keeps its state in {command.state_dir}")
    print(f"check it: meshd service status{flag} · follow its log: meshd service logs{flag}")


# ---------------------------------------------------------------- the other verbs


def manager_for(args: argparse.Namespace) -> Manager:
    """The installed service: launchd on macOS; on Linux --system, else the per-user unit
    if it is installed, else the system-wide one if that is."""
    if host_platform() == "launchd":
        return Launchd()
    root = getattr(args, "root", None)
    if args.system or root is not None:
        return Systemd(system=True, root=root)
    user = Systemd(system=False)
    if not user.unit_path.exists() and Systemd(system=True).unit_path.exists():
        return Systemd(system=True)
    return user


def cmd_uninstall(args: argparse.Namespace) -> int:
    manager_for(args).uninstall()
    return 0


def cmd_control(args: argparse.Namespace) -> int:
    manager = manager_for(args)
    getattr(manager, args.service_command)()
    return 0


def installed_state_dir(manager: Manager) -> Path | None:
    """The --state-dir in the installed file's command line (None when not installed)."""
    argv = installed_command(manager)
    if argv and "--state-dir" in argv[:-1]:
        return Path(argv[argv.index("--state-dir") + 1])
    return None


def installed_command(manager: Manager) -> list[str] | None:
    try:
        if isinstance(manager, Launchd):
            with manager.plist_path.open("rb") as fh:
                return list(plistlib.load(fh)["ProgramArguments"])
        for line in manager.unit_path.read_text().splitlines():
            if line.startswith("ExecStart="):
                words = shlex.split(line.removeprefix("ExecStart="))
                return [word.replace("%%", "%").replace("$$", "$") for word in words]
    except (OSError, KeyError, ValueError, plistlib.InvalidFileException):
        return None
    return None


def cmd_status(args: argparse.Namespace) -> int:
    from meshd.api import client, render

    manager = manager_for(args)
    state = manager.state()
    print(f"service: {manager.describe()}")
    print(f"  {state.summary}")
    state_dir = installed_state_dir(manager) or default_state_dir_for(
        host_platform(), manager.system
    )
    api = client.api_address_for(state_dir, None)
    try:
        status = client.fetch_status(api, timeout_s=DAEMON_ANSWER_TIMEOUT_S)
    except client.DaemonUnreachable as exc:
        print(f"daemon: {exc}")
        return NOT_RUNNING_EXIT
    print("daemon:")
    print(render.status_text(status))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    manager = manager_for(args)
    if not manager.state().installed:
        raise ServiceError(
            f"meshd is not installed as a service ({manager.describe()}): there is no log to "
            "show; `meshd service install` installs it"
        )
    argv = manager.log_command(follow=not args.no_follow, lines=args.lines)
    print("$ " + " ".join(argv), file=sys.stderr)
    try:
        return subprocess.run(argv).returncode
    except FileNotFoundError as exc:
        raise ServiceError(f"{argv[0]} is not installed") from exc
    except KeyboardInterrupt:
        return 0
