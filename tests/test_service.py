"""`meshd service`: the launchd plist and the systemd units it renders, checked by plistlib and
`systemd-analyze verify`; the unit's ExecStart run directly serves and sends sd_notify's
READY=1 once its API answers; a system-wide install into a redirected root; the command
sequences of install / stop / start / uninstall. HOME and the XDG folders point into tmp.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshd.api import cli, client
from meshd.service import notify, units
from meshd.service.manager import Launchd, Systemd
from meshd.service.units import ServiceError

pytestmark = pytest.mark.integration

LOOPBACK_RUN_ARGS = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
READY_TIMEOUT_S = 30.0
needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is missing: packaging/install.sh installs Debian's systemd",
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home of its own: nothing is written to the real user's folders."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_DATA_HOME", "MESHD_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    return home


def _meshd(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the meshd command line in this process; (exit status, stdout, stderr)."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _verify(unit_file: Path, tmp_path: Path, *, user: bool) -> subprocess.CompletedProcess[str]:
    """systemd-analyze verify, with no systemd running as PID 1 (a runtime dir of its own)."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_LOG_COLOR": "0"}
    command = ["systemd-analyze", *(["--user"] if user else []), "verify", str(unit_file)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def _exec_start(unit_text: str) -> list[str]:
    """The ExecStart command line as systemd splits it (the unit quotes only what needs it)."""
    (line,) = [line for line in unit_text.splitlines() if line.startswith("ExecStart=")]
    words = shlex.split(line.removeprefix("ExecStart="))
    return [word.replace("%%", "%").replace("$$", "$") for word in words]


def _keys(unit_text: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in unit_text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            values.setdefault(key, []).append(value)
    return values


# ---------------------------------------------------------------- launchd


def test_launchd_plist_field_by_field(home: Path, tmp_path: Path, capsys) -> None:
    state = tmp_path / "state with space"
    code, out, err = _meshd(
        capsys, "service", "install", "--platform", "launchd", "--dry-run",
        "--state-dir", str(state), "--", "--memory-budget", "2GB",
    )  # fmt: skip
    assert code == 0, err
    assert f"{home}/Library/LaunchAgents/org.meshd.daemon.plist" in err
    plist = plistlib.loads(out.encode())
    assert plist["Label"] == "org.meshd.daemon"
    program = plist["ProgramArguments"]
    interpreter, script = Path(program[0]), Path(program[1])
    assert interpreter.is_absolute() and os.access(interpreter, os.X_OK), program
    assert script.is_absolute() and script.name == "meshd" and script.is_file(), program
    assert program[2:] == ["run", "--state-dir", str(state), "--memory-budget", "2GB"]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restart after a crash, not a stop
    assert plist["ThrottleInterval"] >= 1
    log = home / "Library" / "Logs" / "meshd" / "meshd.log"
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == str(log)
    assert plist["EnvironmentVariables"]["PYTHONUNBUFFERED"] == "1"
    assert not (home / "Library").exists()  # a dry run writes nothing


def test_launchd_default_state_dir_and_system_refused(home: Path, capsys) -> None:
    code, out, _ = _meshd(capsys, "service", "install", "--platform", "launchd", "--dry-run")
    assert code == 0
    program = plistlib.loads(out.encode())["ProgramArguments"]
    assert program[program.index("--state-dir") + 1] == str(
        home / "Library" / "Application Support" / "meshd"
    )
    code, _, err = _meshd(
        capsys, "service", "install", "--platform", "launchd", "--system", "--dry-run"
    )
    assert code == 2 and "per-user LaunchAgent" in err


# ---------------------------------------------------------------- systemd, per user


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    yield sock
    sock.close()


@needs_systemd_analyze
def test_user_unit_verifies_and_its_exec_start_serves_after_ready(
    home: Path, tmp_path: Path, capsys, profile_template: Path, notify_socket: socket.socket
) -> None:
    state = tmp_path / "state"
    code, unit_text, err = _meshd(
        capsys, "service", "install", "--dry-run", "--state-dir", str(state),
        "--", *LOOPBACK_RUN_ARGS,
    )  # fmt: skip
    assert code == 0, err
    assert f"{home}/.config/systemd/user/meshd.service" in err
    keys = _keys(unit_text)
    assert keys["Type"] == ["notify"] and keys["Restart"] == ["on-failure"]
    assert keys["RestartPreventExitStatus"] == ["3"]
    assert keys["WantedBy"] == ["default.target"]
    unit_file = tmp_path / "meshd.service"
    unit_file.write_text(unit_text)
    verified = _verify(unit_file, tmp_path, user=True)
    assert (verified.returncode, verified.stdout + verified.stderr) == (0, ""), verified

    argv = _exec_start(unit_text)
    assert argv[0] == units.this_installation(state).interpreter
    assert argv[2:] == ["run", "--state-dir", str(state), *LOOPBACK_RUN_ARGS]
    state.mkdir()
    shutil.copyfile(profile_template, state / "profile.json")  # no profiling run in a test
    # As systemd passes WatchdogSec=2 (WATCHDOG_PID is set by the test: it names the child).
    env = {**os.environ, "NOTIFY_SOCKET": notify_socket.getsockname(), "WATCHDOG_USEC": "2000000"}
    with (tmp_path / "daemon.log").open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        notify_socket.settimeout(READY_TIMEOUT_S)
        message = notify_socket.recv(4096).decode()
        # Ready means serving: the API answers at once, without a retry.
        status = client.fetch_status(f"unix:{state / 'api.sock'}", timeout_s=2.0)
        fields = dict(line.split("=", 1) for line in message.splitlines())
        assert fields["READY"] == "1" and fields["MAINPID"] == str(proc.pid), message
        assert "api.sock" in fields["STATUS"]
        shown = subprocess.run(
            [sys.executable, "-m", "meshd", "status", "--state-dir", str(state)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert shown.returncode == 0 and status.node_id in shown.stdout, shown
        later = _notifications(notify_socket, seconds=3.0)
        assert "READY=1" not in later, "READY is sent once"
        assert "STATUS=no model: load one with `meshd load MODEL`" in later, later
        assert later.count("WATCHDOG=1") >= 2, f"a ping every second: {later}"
        proc.send_signal(signal.SIGTERM)
        stopping = _notifications(notify_socket, seconds=1.0)
        assert "STOPPING=1" in stopping, stopping
        # A leave of the default 10 s grace, and a margin, whatever TimeoutStopSec says.
        assert f"EXTEND_TIMEOUT_USEC={int((10 + notify.STOP_MARGIN_S) * 1e6)}" in stopping
        assert proc.wait(20) == 0  # a stop is a clean exit: systemd does not restart it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _notifications(sock: socket.socket, seconds: float) -> list[str]:
    """Every line the daemon sent within ``seconds``."""
    lines: list[str] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            lines += sock.recv(4096).decode().splitlines()
        except TimeoutError:
            break
    return lines


def test_units_outlast_the_leave_grace_and_rotate_the_launchd_log(home: Path, capsys) -> None:
    """The stop timeout covers the configured leave grace (a 60 s grace was killed at 20 s),
    from the run options or the state directory's meshd.toml; launchd's log is rotated."""
    state = home / "state"
    code, unit_text, err = _meshd(
        capsys, "service", "install", "--dry-run", "--platform", "systemd",
        "--state-dir", str(state), "--", "--leave-grace", "60",
    )  # fmt: skip
    assert code == 0, err
    keys = _keys(unit_text)
    assert keys["TimeoutStopSec"] == ["75"] and keys["WatchdogSec"] == [str(units.WATCHDOG_S)]
    state.mkdir()
    (state / "meshd.toml").write_text("leave_grace_s = 40\n")
    code, out, err = _meshd(
        capsys, "service", "install", "--dry-run", "--platform", "launchd",
        "--state-dir", str(state),
    )  # fmt: skip
    assert code == 0, err
    plist = plistlib.loads(out.encode())
    assert plist["ExitTimeOut"] == 55
    assert plist["EnvironmentVariables"]["MESHD_LOG_ROTATE"] == plist["StandardOutPath"]
    code, unit_text, err = _meshd(
        capsys, "service", "install", "--dry-run", "--platform", "systemd",
        "--state-dir", str(home / "fresh"),
    )  # fmt: skip
    assert _keys(unit_text)["TimeoutStopSec"] == ["25"]  # the default 10 s grace + 15 s


def test_the_log_is_rotated_by_copy_and_truncate_while_its_writer_appends(
    tmp_path: Path,
) -> None:
    """As launchd writes it: one appending file descriptor that is never reopened."""
    from meshd.service.logrotate import rotate_if_large

    log = tmp_path / "meshd.log"
    with log.open("ab", buffering=0) as writer:
        for round_ in range(5):
            writer.write(f"round {round_} ".encode() + b"x" * 1000 + b"\n")
            assert rotate_if_large(log, max_bytes=500, keep=3)
        writer.write(b"after\n")
    assert log.read_bytes() == b"after\n", "the writer goes on at the start of the new file"
    rotated = [log.with_name(f"meshd.log.{i}").read_bytes() for i in (1, 2, 3)]
    assert [r.split(b" ")[0:2] for r in rotated] == [[b"round", str(i).encode()] for i in (4, 3, 2)]
    assert not log.with_name("meshd.log.4").exists(), "only three are kept"
    assert not rotate_if_large(log, max_bytes=500)
    assert not rotate_if_large(tmp_path / "missing.log")


def test_service_state_lines_say_what_systemctl_status_shows() -> None:
    from meshd.service.supervision import service_state_line
    from meshd.wire import pb

    assert service_state_line(pb.AgreementStatus(), "") == (
        "no model: load one with `meshd load MODEL`"
    )
    pending = pb.AgreementStatus(model="m", reason="waiting for confirmation from b")
    assert service_state_line(pending, "") == ("re-planning m: waiting for confirmation from b")
    refused = pb.AgreementStatus(model="m", refusal="not enough memory")
    assert service_state_line(refused, "") == "refused: not enough memory"
    active = pb.AgreementStatus(
        model="m", active_plan_id="0123456789abcdef", members=["a", "b"], converged=True
    )
    assert service_state_line(active, "loading plan 0123: layers 0-9") == (
        "loading m: loading plan 0123: layers 0-9"
    )
    assert service_state_line(active, "") == "serving m on 2 nodes, plan 0123456789ab"


def test_notify_is_silent_without_systemd_and_reaches_abstract_sockets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.notify_ready("unix:/x") is False
    name = f"meshd-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.notify_ready("unix:/x") is True
        assert sock.recv(4096).decode().startswith("READY=1\n")
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/notify.sock")
    assert notify.notify_ready("unix:/x") is False  # logged, never raised


def test_run_options_are_checked_at_install_time(home: Path, capsys) -> None:
    code, _, err = _meshd(capsys, "service", "install", "--dry-run", "--", "--memroy-budget", "1")
    assert code == 2 and "not options of `meshd run`: --memroy-budget 1" in err
    code, _, err = _meshd(capsys, "service", "install", "--dry-run", "--", "--state-dir", "/x")
    assert code == 2 and "meshd service install --state-dir DIR" in err


def test_exec_start_quotes_what_systemd_would_expand() -> None:
    command = units.DaemonCommand("/opt/py thon/bin/python", ("-m", "meshd"), Path("/s/100%"))
    text = units.render_systemd_unit(units.SystemdUnit(command, extra_environment={"A": "$B"}))
    assert 'ExecStart="/opt/py thon/bin/python" -m meshd run --state-dir /s/100%%' in text
    assert _exec_start(text) == command.argv
    assert "Environment=A=$$B" in text


# ---------------------------------------------------------------- systemd, system-wide


@needs_systemd_analyze
@pytest.mark.skipif(os.geteuid() != 0, reason="a system-wide install is done as root")
def test_system_install_into_a_root_is_verified_enabled_and_idempotent(
    home: Path, tmp_path: Path, capsys
) -> None:
    root = tmp_path / "root"
    try:
        units.check_dynamic_user_can_run(units.this_installation(units.SYSTEM_STATE_DIR))
        run_as: list[str] = []  # readable by every account: a dynamic user
    except ServiceError as exc:
        assert "--run-as" in str(exc)
        run_as = ["--run-as", "root"]  # e.g. an interpreter under /root (mode 0700)
    code, out, err = _meshd(capsys, "service", "install", "--system", "--root", str(root), *run_as)
    assert code == 0, err
    unit_file = root / "etc" / "systemd" / "system" / "meshd.service"
    wanted = root / "etc" / "systemd" / "system" / "multi-user.target.wants" / "meshd.service"
    assert f"wrote {unit_file}" in out and "systemctl --root=" in out
    assert wanted.is_symlink()
    text = unit_file.read_text()
    keys = _keys(text)
    assert keys["Type"] == ["notify"] and keys["RestartPreventExitStatus"] == ["3"]
    assert keys["StateDirectory"] == ["meshd"] and keys["ProtectSystem"] == ["strict"]
    assert keys["WantedBy"] == ["multi-user.target"]
    assert (keys.get("User") == ["root"]) if run_as else (keys["DynamicUser"] == ["yes"])
    assert _exec_start(text)[2:] == ["run", "--state-dir", "/var/lib/meshd"]
    verified = _verify(unit_file, tmp_path, user=False)
    assert (verified.returncode, verified.stdout + verified.stderr) == (0, ""), verified

    code, out, _ = _meshd(capsys, "service", "install", "--system", "--root", str(root), *run_as)
    assert code == 0 and f"{unit_file} is up to date" in out
    code, out, _ = _meshd(capsys, "service", "uninstall", "--system", "--root", str(root))
    assert code == 0 and f"removed {unit_file}" in out
    assert not unit_file.exists() and not wanted.is_symlink()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every account can reach (pytest's own tmp folders are private: mode 0700)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="meshd-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_dynamic_user_needs_an_installation_others_can_read(open_dir: Path) -> None:
    private = open_dir / "private"
    (private / "bin").mkdir(parents=True)
    python = private / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    private.chmod(0o700)
    problems = units.unreadable_for_others([], [str(python)])
    assert problems == [f"{private} is not searchable by other users (mode 0700)"]
    private.chmod(0o755)
    python.chmod(0o750)
    assert units.unreadable_for_others([], [str(python)]) == [
        f"{python} is not executable by other users (mode 0750)"
    ]
    python.chmod(0o755)
    assert units.unreadable_for_others([str(private / "bin")], [str(python)]) == []


def test_system_unit_keeps_its_state_in_var_lib(home: Path, capsys) -> None:
    code, _, err = _meshd(
        capsys, "service", "install", "--system", "--dry-run", "--run-as", "root",
        "--state-dir", "/srv/meshd",
    )  # fmt: skip
    assert code == 2 and "/var/lib/meshd" in err


# ---------------------------------------------------------------- the managers' commands

FAKE_TOOL = """#!/bin/sh
# Stands in for {name}, which needs a running service manager: records its arguments and
# answers `show` / `print` from files the test writes.
echo "{name} $*" >> "{log}"
case "$*" in
  *" show "*|show*) cat "{dir}/show.txt" 2>/dev/null ;;
  print*) [ -f "{dir}/loaded" ] || exit 113; cat "{dir}/print.txt" 2>/dev/null ;;
  bootstrap*) touch "{dir}/loaded" ;;
  bootout*) rm -f "{dir}/loaded" ;;
esac
exit 0
"""


@pytest.fixture
def fake_tools(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """systemctl, launchctl and loginctl that only record what they were asked to do."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for name in ("systemctl", "launchctl", "loginctl"):
        tool = bin_dir / name
        tool.write_text(FAKE_TOOL.format(name=name, log=log, dir=tmp_path))
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path / "home"), "USER": "alice"}
    return log, env


def _calls(log: Path) -> list[str]:
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def test_systemd_user_install_is_idempotent_and_restarts_only_on_change(
    tmp_path: Path, fake_tools
) -> None:
    log, env = fake_tools
    said: list[str] = []
    manager = Systemd(env=env, say=said.append, check_booted=False)
    unit_path = tmp_path / "home" / ".config" / "systemd" / "user" / "meshd.service"
    assert manager.unit_path == unit_path

    manager.install("[Service]\nExecStart=/bin/true\n")
    assert _calls(log) == [
        "systemctl --user daemon-reload",
        "systemctl --user show meshd.service --property=ActiveState,SubState,MainPID,"
        "UnitFileState,Result,ExecMainStatus",
        "systemctl --user enable --now meshd.service",
        "loginctl show-user alice --property=Linger --value",
    ]
    assert said[0] == f"wrote {unit_path}"
    assert any("loginctl enable-linger alice" in line for line in said)

    (tmp_path / "show.txt").write_text("ActiveState=active\nSubState=running\nMainPID=42\n")
    manager.install("[Service]\nExecStart=/bin/true\n")  # the same text: nothing restarts
    assert "systemctl --user restart meshd.service" not in _calls(log)
    manager.install("[Service]\nExecStart=/bin/false\n")  # a changed unit restarts the daemon
    assert "systemctl --user restart meshd.service" in _calls(log)
    state = manager.state()
    assert (state.running, state.pid) == (True, 42)
    _calls(log)

    manager.stop()
    manager.start()
    manager.restart()
    assert _calls(log) == [
        f"systemctl --user {verb} meshd.service" for verb in ("stop", "start", "restart")
    ]
    manager.uninstall()
    assert _calls(log) == [
        "systemctl --user disable --now meshd.service",
        "systemctl --user daemon-reload",
    ]
    assert not unit_path.exists()
    with pytest.raises(ServiceError, match="meshd service install"):
        manager.start()


def test_launchd_agent_bootstrap_kill_kickstart_bootout(tmp_path: Path, fake_tools) -> None:
    log, env = fake_tools
    said: list[str] = []
    manager = Launchd(env=env, uid=501, say=said.append)
    command = units.this_installation(tmp_path / "state")
    agent = units.daemon_agent(command, home=Path(env["HOME"]))
    plist = units.render_launchd_plist(agent)

    manager.install(agent, plist)
    target = "gui/501/org.meshd.daemon"
    assert _calls(log) == [
        f"launchctl print {target}",
        f"launchctl enable {target}",
        f"launchctl bootstrap gui/501 {manager.plist_path}",
    ]
    assert agent.log_dir.is_dir()  # launchd does not create the log's folder
    manager.install(agent, plist)
    assert _calls(log) == [f"launchctl print {target}"] and said[-1].endswith("already loaded")

    (tmp_path / "print.txt").write_text("\tstate = running\n\tpid = 777\n\tlast exit code = 0\n")
    state = manager.state()
    assert (state.running, state.pid) == (True, 777)
    _calls(log)
    manager.stop()
    manager.restart()
    assert _calls(log) == [
        f"launchctl kill SIGTERM {target}",
        f"launchctl print {target}",
        f"launchctl kickstart -k {target}",
    ]
    manager.uninstall()
    assert _calls(log) == [f"launchctl print {target}", f"launchctl bootout {target}"]
    assert not manager.plist_path.exists()


def test_install_refuses_where_systemd_does_not_run(home: Path, capsys) -> None:
    if Path("/run/systemd/system").is_dir():
        pytest.skip("this machine runs systemd")
    code, _, err = _meshd(capsys, "service", "install")
    assert code == 2 and "systemd is not running" in err and "--dry-run" in err
    assert not (home / ".config").exists()


def test_service_status_shows_the_service_and_the_daemon(
    home: Path, tmp_path: Path, capsys, daemons, mesh_token
) -> None:
    daemon = daemons([*LOOPBACK_RUN_ARGS, "--join", mesh_token])
    node_id = daemon.wait_ready().node_id
    code, unit_text, _ = _meshd(
        capsys, "service", "install", "--dry-run", "--state-dir", str(daemon.state_dir)
    )
    unit_path = home / ".config" / "systemd" / "user" / "meshd.service"
    unit_path.parent.mkdir(parents=True)
    unit_path.write_text(unit_text)
    code, out, _ = _meshd(capsys, "service", "status")
    assert code == 0, out
    assert out.startswith(f"service: systemd per-user unit meshd.service ({unit_path})")
    assert "daemon:" in out and node_id in out
    daemon.terminate()
    code, out, _ = _meshd(capsys, "service", "status")
    assert code == 3 and "no meshd daemon answers" in out
