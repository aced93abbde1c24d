"""Driving launchd and systemd through their own tools (launchctl, systemctl, journalctl).

Each manager writes its file only when the text changed, prints every command it runs
before running it, and turns a failing command into a `ServiceError` that carries the
tool's own message. Environment (HOME, XDG_CONFIG_HOME) and the tools' search path come
from an `env` mapping, so tests run every step in a temporary home.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from meshd.service.units import (
    DAEMON_LABEL,
    UNIT_NAME,
    LaunchAgent,
    ServiceError,
)

Say = Callable[[str], None]
TOOL_TIMEOUT_S = 60.0  # a service manager that does not answer within this is broken


@dataclass(frozen=True)
class ServiceState:
    """The service manager's view, in words and the few facts scripts need."""

    installed: bool
    running: bool
    pid: int | None
    summary: str  # one line, e.g. "active (running), pid 1234, enabled"
    file: Path


def write_if_changed(path: Path, content: bytes, say: Say) -> bool:
    """Write atomically (a temporary file renamed over the old one); True if it changed."""
    try:
        if path.read_bytes() == content:
            say(f"{path} is up to date")
            return False
    except FileNotFoundError:
        pass
    existed = path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(content)
    tmp.chmod(0o644)
    tmp.replace(path)
    say(f"{'updated' if existed else 'wrote'} {path}")
    return True


class _Tools:
    """Runs the service manager's command-line tools, found on env's PATH."""

    def __init__(self, env: Mapping[str, str], say: Say) -> None:
        self.env = dict(env)
        self.say = say

    def run(self, argv: list[str], *, check: bool = True, quiet: bool = False):
        tool = shutil.which(argv[0], path=self.env.get("PATH"))
        if tool is None:
            raise ServiceError(f"{argv[0]} is not installed (not found on PATH)")
        if not quiet:
            self.say("$ " + " ".join(argv))
        try:
            done = subprocess.run(
                [tool, *argv[1:]],
                capture_output=True,
                text=True,
                env=self.env,
                timeout=TOOL_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as exc:
            raise ServiceError(
                f"{' '.join(argv)} did not finish within {TOOL_TIMEOUT_S:.0f} s"
            ) from exc
        if check and done.returncode != 0:
            message = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
            raise ServiceError(f"{' '.join(argv)} failed: {message}")
        return done

    def path_of(self, name: str) -> str | None:
        return shutil.which(name, path=self.env.get("PATH"))


def home_of(env: Mapping[str, str]) -> Path:
    home = env.get("HOME")
    return Path(home) if home else Path.home()


# ---------------------------------------------------------------- systemd


def systemd_is_running() -> bool:
    """True when this machine was booted with systemd (sd_booted(3)'s test)."""
    return Path("/run/systemd/system").is_dir()


class Systemd:
    """The meshd unit, per-user (`systemctl --user`) or system-wide.

    With `root`, the unit goes into that directory tree instead of the running system and is
    enabled there offline (`systemctl --root`), for images and tests; nothing is started.
    """

    platform = "systemd"

    def __init__(
        self,
        *,
        system: bool = False,
        root: Path | None = None,
        env: Mapping[str, str] | None = None,
        say: Say = print,
        check_booted: bool = True,
    ) -> None:
        if root is not None and not system:
            raise ServiceError("--root is for the system-wide unit: add --system")
        self.system = system
        self.root = root
        self.env = dict(os.environ if env is None else env)
        self.say = say
        self.tools = _Tools(self.env, say)
        self._check_booted = check_booted

    @property
    def unit_path(self) -> Path:
        if self.system:
            return (self.root or Path("/")) / "etc" / "systemd" / "system" / UNIT_NAME
        config = self.env.get("XDG_CONFIG_HOME") or str(home_of(self.env) / ".config")
        return Path(config) / "systemd" / "user" / UNIT_NAME

    @property
    def _flag(self) -> str:
        return " --system" if self.system else ""

    @property
    def scope(self) -> str:
        return "system-wide" if self.system else "per-user"

    def _systemctl(self, *args: str) -> list[str]:
        if self.root is not None:
            return ["systemctl", f"--root={self.root}", *args]
        return ["systemctl", *([] if self.system else ["--user"]), *args]

    def _require_systemd(self, verb: str) -> None:
        if self.root is None and self._check_booted and not systemd_is_running():
            raise ServiceError(
                f"systemd is not running on this machine (no /run/systemd/system): nothing "
                f"can {verb} the service here; `meshd service install --dry-run` shows the "
                "unit, `meshd run` runs the daemon in the foreground"
            )

    # ------------------------------------------------------------ commands

    def install(self, unit_text: str) -> None:
        self._require_systemd("install")
        changed = write_if_changed(self.unit_path, unit_text.encode(), self.say)
        if self.root is not None:
            self.tools.run(self._systemctl("enable", UNIT_NAME))
            self.say(
                f"enabled in {self.root}; a system booted from it starts meshd at boot "
                f"(on a running system: systemctl daemon-reload && systemctl start {UNIT_NAME})"
            )
            return
        self.tools.run(self._systemctl("daemon-reload"))
        if changed and self.state().running:
            self.tools.run(self._systemctl("restart", UNIT_NAME))
        self.tools.run(self._systemctl("enable", "--now", UNIT_NAME))
        if not self.system:
            self._explain_lingering()

    def _explain_lingering(self) -> None:
        user = self.env.get("USER") or self.env.get("LOGNAME") or ""
        linger = (
            self.tools.run(
                ["loginctl", "show-user", user, "--property=Linger", "--value"],
                check=False,
                quiet=True,
            )
            if user and self.tools.path_of("loginctl")
            else None
        )
        if linger is not None and linger.stdout.strip() == "yes":
            self.say(f"lingering is on for {user}: meshd starts at boot and survives logout")
            return
        self.say(
            "as a per-user service meshd runs while you are logged in; to start it at boot and "
            f"keep it after logout: loginctl enable-linger {user or '$USER'}"
        )

    def uninstall(self) -> None:
        if not self.unit_path.exists():
            self.say(f"nothing to remove: {self.unit_path} does not exist")
            return
        if self.root is not None:
            self.tools.run(self._systemctl("disable", UNIT_NAME))
        else:
            self._require_systemd("uninstall")
            self.tools.run(self._systemctl("disable", "--now", UNIT_NAME))
        self.unit_path.unlink()
        self.say(f"removed {self.unit_path}")
        if self.root is None:
            self.tools.run(self._systemctl("daemon-reload"))

    def start(self) -> None:
        self._control("start")

    def stop(self) -> None:
        self._control("stop")

    def restart(self) -> None:
        self._control("restart")

    def _control(self, verb: str) -> None:
        if self.root is not None:
            raise ServiceError(f"cannot {verb} a unit in {self.root}: no systemd runs it")
        self._require_installed()
        self._require_systemd(verb)
        self.tools.run(self._systemctl(verb, UNIT_NAME))

    def _require_installed(self) -> None:
        if not self.unit_path.exists():
            raise ServiceError(
                f"meshd is not installed as a {self.scope} service ({self.unit_path} does not "
                f"exist); install it with `meshd service install{self._flag}`"
            )

    def state(self) -> ServiceState:
        installed = self.unit_path.exists()
        if not installed:
            return ServiceState(False, False, None, "not installed", self.unit_path)
        if self.root is not None or (not systemd_is_running() and self._check_booted):
            return ServiceState(
                True, False, None, "installed (no systemd runs it here)", self.unit_path
            )
        properties = "ActiveState,SubState,MainPID,UnitFileState,Result,ExecMainStatus"
        done = self.tools.run(
            self._systemctl("show", UNIT_NAME, f"--property={properties}"), check=False, quiet=True
        )
        if done.returncode != 0:
            reason = (done.stderr or done.stdout).strip()
            return ServiceState(True, False, None, f"unknown ({reason})", self.unit_path)
        values = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
        pid = int(values.get("MainPID", "0") or 0) or None
        running = values.get("ActiveState") == "active"
        parts = [f"{values.get('ActiveState', '?')} ({values.get('SubState', '?')})"]
        if pid:
            parts.append(f"pid {pid}")
        parts.append(values.get("UnitFileState", "?"))
        if values.get("Result") not in (None, "", "success"):
            parts.append(
                f"last result {values['Result']}, exit status {values.get('ExecMainStatus')}"
            )
        return ServiceState(True, running, pid, ", ".join(parts), self.unit_path)

    def log_command(self, *, follow: bool, lines: int) -> list[str]:
        scope = [] if self.system else ["--user"]
        return [
            "journalctl",
            *scope,
            "-u",
            UNIT_NAME,
            "-n",
            str(lines),
            *(["-f"] if follow else ["--no-pager"]),
        ]

    def describe(self) -> str:
        return f"systemd {self.scope} unit {UNIT_NAME} ({self.unit_path})"


# ---------------------------------------------------------------- launchd


class Launchd:
    """A per-user LaunchAgent in the `gui/<uid>` domain (the daemon's, or the app's)."""

    platform = "launchd"
    system = False

    def __init__(
        self,
        *,
        label: str = DAEMON_LABEL,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        uid: int | None = None,
        say: Say = print,
    ) -> None:
        self.label = label
        self.env = dict(os.environ if env is None else env)
        self.home = home_of(self.env)
        self.uid = os.getuid() if uid is None else uid
        self.say = say
        self.tools = _Tools(self.env, say)
        self.log_path = log_path or self.home / "Library" / "Logs" / "meshd" / "meshd.log"

    @property
    def plist_path(self) -> Path:
        return self.home / "Library" / "LaunchAgents" / f"{self.label}.plist"

    @property
    def domain(self) -> str:
        return f"gui/{self.uid}"

    @property
    def target(self) -> str:
        return f"{self.domain}/{self.label}"

    def loaded(self) -> bool:
        return (
            self.tools.run(["launchctl", "print", self.target], check=False, quiet=True).returncode
            == 0
        )

    def install(self, agent: LaunchAgent, plist: bytes) -> None:
        agent.log_dir.mkdir(parents=True, exist_ok=True)
        changed = write_if_changed(self.plist_path, plist, self.say)
        self.say(f"logs go to {agent.log_path}")
        loaded = self.loaded()
        if loaded and not changed:
            self.say(f"{self.label} is already loaded")
            return
        if loaded:  # launchd reads the plist only when the job is bootstrapped
            self.tools.run(["launchctl", "bootout", self.target])
        self.tools.run(["launchctl", "enable", self.target])
        self.tools.run(["launchctl", "bootstrap", self.domain, str(self.plist_path)])

    def uninstall(self) -> None:
        if self.loaded():
            self.tools.run(["launchctl", "bootout", self.target])
        if self.plist_path.exists():
            self.plist_path.unlink()
            self.say(f"removed {self.plist_path}")
        else:
            self.say(f"nothing to remove: {self.plist_path} does not exist")

    def _require_installed(self) -> None:
        if not self.plist_path.exists():
            raise ServiceError(
                f"{self.label} is not installed ({self.plist_path} does not exist); install it "
                "with `meshd service install`"
            )

    def start(self) -> None:
        self._require_installed()
        if not self.loaded():
            self.tools.run(["launchctl", "bootstrap", self.domain, str(self.plist_path)])
        self.tools.run(["launchctl", "kickstart", self.target])

    def stop(self) -> None:
        self._require_installed()
        # SIGTERM: the daemon exits 0, and KeepAlive (SuccessfulExit=false) leaves it stopped.
        self.tools.run(["launchctl", "kill", "SIGTERM", self.target])

    def restart(self) -> None:
        self._require_installed()
        if not self.loaded():
            self.start()
            return
        self.tools.run(["launchctl", "kickstart", "-k", self.target])

    def state(self) -> ServiceState:
        if not self.plist_path.exists():
            return ServiceState(False, False, None, "not installed", self.plist_path)
        done = self.tools.run(["launchctl", "print", self.target], check=False, quiet=True)
        if done.returncode != 0:
            return ServiceState(True, False, None, "installed, not loaded", self.plist_path)
        values: dict[str, str] = {}
        for line in done.stdout.splitlines():
            key, sep, value = line.strip().partition(" = ")
            if sep and key in ("state", "pid", "last exit code") and key not in values:
                values[key] = value.strip()
        pid = int(values["pid"]) if values.get("pid", "").isdigit() else None
        running = values.get("state") == "running"
        parts = [values.get("state", "loaded")]
        if pid:
            parts.append(f"pid {pid}")
        if "last exit code" in values:
            parts.append(f"last exit code {values['last exit code']}")
        return ServiceState(True, running, pid, ", ".join(parts), self.plist_path)

    def log_command(self, *, follow: bool, lines: int) -> list[str]:
        return ["tail", "-n", str(lines), *(["-F"] if follow else []), str(self.log_path)]

    def describe(self) -> str:
        return f"launchd agent {self.label} ({self.plist_path})"


Manager = Systemd | Launchd
