"""The service files, rendered from the installation that runs this code.

Nothing here is a template with placeholders: the interpreter and the `meshd` script are
the ones actually running, the state directory is resolved once, and every path is absolute,
so the service starts the same daemon that `meshd run` starts in a terminal. Rendering is
pure (no file is written here); `manager` writes and loads the files.
"""

from __future__ import annotations

import math
import os
import plistlib
import stat
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshd.service.notify import STOP_MARGIN_S  # the daemon asks systemd for the same

DAEMON_LABEL = "org.meshd.daemon"  # launchd label of the daemon's LaunchAgent
UNIT_NAME = "meshd.service"
SYSTEM_STATE_DIR = Path("/var/lib/meshd")  # systemd's StateDirectory=meshd
DUPLICATE_NODE_EXIT = 3  # `meshd run`: duplicate node id / state directory in use
RESTART_DELAY_S = 5  # systemd RestartSec and launchd ThrottleInterval
STOP_TIMEOUT_S = 20  # SIGTERM, then SIGKILL after this long, at the least
WATCHDOG_S = 60  # systemd restarts a daemon whose loops did not ping for this long
DOCUMENTATION = "https://pypi.org/project/meshd/"
# A daemon waiting for work should block, not spin (idle OpenMP threads would steal a
# core); Python's output reaches the journal or the log file line by line.
SERVICE_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}


class ServiceError(RuntimeError):
    """A service cannot be rendered, installed or driven; the message says what to do."""


@dataclass(frozen=True)
class DaemonCommand:
    """The command line that runs the daemon: interpreter, meshd, `run`, options."""

    interpreter: str
    entry: tuple[str, ...]  # the meshd script, or ("-m", "meshd") without one
    state_dir: Path
    run_args: tuple[str, ...] = ()
    leave_grace_s: float = 10.0  # the daemon's `leave_grace_s` as this command configures it

    @property
    def stop_timeout_s(self) -> int:
        """How long the service manager waits after SIGTERM: the leave grace (requests move
        or finish) and a margin, so that a graceful leave is never killed half-way."""
        return max(STOP_TIMEOUT_S, math.ceil(self.leave_grace_s + STOP_MARGIN_S))

    @property
    def argv(self) -> list[str]:
        return [
            self.interpreter,
            *self.entry,
            "run",
            "--state-dir",
            str(self.state_dir),
            *self.run_args,
        ]


def this_installation(
    state_dir: Path, run_args: Sequence[str] = (), leave_grace_s: float = 10.0
) -> DaemonCommand:
    """The daemon command of the meshd that is running now.

    The interpreter is kept as invoked (a virtual environment's `bin/python` is a symlink
    whose target would lose the environment); the `meshd` console script next to it is used
    when it exists, else `-m meshd` (a source checkout without an install).
    """
    interpreter = os.path.abspath(sys.executable)
    script = Path(interpreter).with_name("meshd")
    entry: tuple[str, ...] = (str(script),) if script.is_file() else ("-m", "meshd")
    state = state_dir.expanduser().absolute()
    return DaemonCommand(interpreter, entry, state, tuple(run_args), leave_grace_s)


# ---------------------------------------------------------------- systemd


@dataclass(frozen=True)
class SystemdUnit:
    """What differs between the per-user unit and the system-wide one."""

    command: DaemonCommand
    system: bool = False
    run_as: str | None = None  # system unit: an existing account; None = a dynamic user
    extra_environment: dict[str, str] = field(default_factory=dict)


def systemd_quote(arg: str) -> str:
    """One ExecStart word: `%` and `$` escaped, quoted when it has spaces or quotes."""
    text = arg.replace("%", "%%").replace("$", "$$")
    if text and not any(ch.isspace() or ch in "\"'\\;" for ch in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _system_hardening(command: DaemonCommand, run_as: str | None) -> list[str]:
    """Sandboxing for the system-wide unit that still lets the daemon do its work.

    It binds its peer port (above 1024, no capability needed), announces over mDNS (UDP
    sockets; interfaces are listed over netlink), keeps its state in /var/lib/meshd, and
    reads the interpreter and models where they are installed (read-only). Left out on
    purpose: MemoryDenyWriteExecute (ctypes and libffi closures need W+X pages) and a
    SystemCallFilter (MLX and OpenBLAS were never profiled under one).
    """
    homes = ("/home", "/root", "/run/user")
    paths = [command.interpreter, *command.entry, *_installation_paths()]
    under_home = any(
        _is_under(path, homes) or _is_under(str(Path(path).resolve()), homes)
        for path in paths
        if path.startswith("/")
    )
    lines = [
        f"User={run_as}" if run_as else "DynamicUser=yes",
        "StateDirectory=meshd",
        "StateDirectoryMode=0700",
        "CacheDirectory=meshd",  # the model store ($CACHE_DIRECTORY, see Config.model_store)
        "CacheDirectoryMode=0700",
        "UMask=0077",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        # An installation under /home or /root must stay readable to be started.
        f"ProtectHome={'read-only' if under_home else 'yes'}",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "SystemCallArchitectures=native",
    ]
    return lines


def render_systemd_unit(unit: SystemdUnit) -> str:
    """The unit file text: Type=notify, restart on failure but not on exit 3, journal logs."""
    command = unit.command
    scope = "system-wide" if unit.system else "per-user"
    environment = {**SERVICE_ENVIRONMENT, **unit.extra_environment}
    lines = [
        f"# meshd daemon, {scope} systemd unit, written by `meshd service install`.",
        "# Rewritten by the next install; change options there (or in the state directory's",
        "# meshd.toml), not here.",
        "[Unit]",
        "Description=meshd peer-to-peer LLM inference mesh",
        f"Documentation={DOCUMENTATION}",
    ]
    if unit.system:  # the user manager has no network-online.target of its own
        lines += ["Wants=network-online.target", "After=network-online.target"]
    lines += [
        "StartLimitIntervalSec=120",
        "StartLimitBurst=10",
        "",
        "[Service]",
        # READY=1 comes from the daemon once its local API answers (meshd.service.notify).
        "Type=notify",
        "NotifyAccess=main",
        "ExecStart=" + " ".join(systemd_quote(arg) for arg in command.argv),
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}",
        # A duplicate node id (a copied state directory) exits with 3: a restart cannot help.
        f"RestartPreventExitStatus={DUPLICATE_NODE_EXIT}",
        f"TimeoutStopSec={command.stop_timeout_s}",
        # Pinged through both event loops (meshd.service.supervision): a hung daemon restarts.
        f"WatchdogSec={WATCHDOG_S}",
        "KillMode=mixed",
        "SyslogIdentifier=meshd",
        *(f"Environment={systemd_quote(f'{k}={v}')}" for k, v in sorted(environment.items())),
    ]
    if unit.system:
        lines += _system_hardening(command, unit.run_as)
    else:
        lines += ["NoNewPrivileges=yes", "UMask=0077"]
    lines += [
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if unit.system else 'default.target'}",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- launchd


@dataclass(frozen=True)
class LaunchAgent:
    """A per-user LaunchAgent: started at login, restarted when it fails, logging to files."""

    label: str
    program: tuple[str, ...]
    log_dir: Path
    log_name: str
    gui_only: bool = False  # the app: only in a graphical (Aqua) login session
    exit_timeout_s: int = STOP_TIMEOUT_S
    rotate_log: bool = False  # the program keeps its log file bounded (the daemon does)

    @property
    def log_path(self) -> Path:
        return self.log_dir / self.log_name


def render_launchd_plist(agent: LaunchAgent) -> bytes:
    """The property list of the agent (XML), as launchd reads it.

    KeepAlive restarts the program when it exits unsuccessfully (a crash or an error exit,
    at most every ThrottleInterval seconds) but not after a clean stop (`meshd service stop`
    sends SIGTERM and the daemon exits 0). launchd has no per-exit-code rule: a daemon that
    exits 3 (duplicate node id) is retried every ThrottleInterval and says why in its log.
    """
    environment = dict(SERVICE_ENVIRONMENT)
    if agent.rotate_log:  # launchd never rotates StandardOutPath: the daemon does
        environment["MESHD_LOG_ROTATE"] = str(agent.log_path)
    plist: dict[str, object] = {
        "Label": agent.label,
        "ProgramArguments": list(agent.program),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_DELAY_S,
        "ProcessType": "Interactive",
        "ExitTimeOut": agent.exit_timeout_s,
        "EnvironmentVariables": environment,
        "StandardOutPath": str(agent.log_path),
        "StandardErrorPath": str(agent.log_path),
    }
    if agent.gui_only:
        plist["LimitLoadToSessionType"] = "Aqua"
    return plistlib.dumps(plist, sort_keys=False)


def macos_log_dir(home: Path | None = None) -> Path:
    return (home or Path.home()) / "Library" / "Logs" / "meshd"


def daemon_agent(command: DaemonCommand, home: Path | None = None) -> LaunchAgent:
    return LaunchAgent(
        DAEMON_LABEL,
        tuple(command.argv),
        macos_log_dir(home),
        "meshd.log",
        exit_timeout_s=command.stop_timeout_s,
        rotate_log=True,
    )


# ---------------------------------------------------------------- can a dynamic user run it?


def _installation_paths() -> list[str]:
    """Where the interpreter's standard library, site-packages and meshd itself live."""
    import meshd

    paths = sysconfig.get_paths()
    return [paths["stdlib"], paths["purelib"], paths["platlib"], str(Path(meshd.__file__).parent)]


def _is_under(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def unreadable_for_others(paths: Iterable[str], executables: Iterable[str] = ()) -> list[str]:
    """Paths (or a directory above one) that an unprivileged account cannot reach.

    Read from the permission bits, not os.access(): the check runs as root, for whom access
    always succeeds, on behalf of the dynamic user the unit will run as. `executables` must
    also be executable by others.
    """
    must_execute = {str(Path(path).resolve()) for path in executables}
    problems: list[str] = []
    for raw in [*paths, *executables]:
        target = Path(raw).resolve()
        for path in [*reversed(target.parents), target]:
            problem = _other_users_problem(
                path, is_target=path == target, execute=str(path) in must_execute
            )
            if problem:
                problems.append(problem)
                break
    return list(dict.fromkeys(problems))


def _other_users_problem(path: Path, *, is_target: bool, execute: bool) -> str | None:
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISDIR(mode):
        needed = stat.S_IXOTH | (stat.S_IROTH if is_target else 0)
        what = "not readable by other users" if is_target else "not searchable by other users"
    else:
        needed = stat.S_IROTH | (stat.S_IXOTH if execute else 0)
        what = "not executable by other users" if execute else "not readable by other users"
    if mode & needed != needed:
        return f"{path} is {what} (mode {stat.S_IMODE(mode):04o})"
    return None


def check_dynamic_user_can_run(command: DaemonCommand) -> None:
    """Refuse a DynamicUser unit that could never start: its account cannot read meshd."""
    scripts = [arg for arg in command.entry if arg.startswith("/")]
    problems = unreadable_for_others(_installation_paths(), [command.interpreter, *scripts])
    if problems:
        raise ServiceError(
            "the system service runs as an unprivileged dynamic user, which cannot read this "
            "installation:\n  "
            + "\n  ".join(problems)
            + "\ninstall meshd where every account can read it (for example a virtual "
            "environment under /opt/meshd), or name the account it runs as with "
            "--run-as USER (--run-as root works, with less isolation)"
        )
