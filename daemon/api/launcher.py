"""Start and stop daemon processes: used by `meshd demo`, the benchmarks and the tests.

A daemon is a child process (`python -m meshd.api.cli run ...`), optionally inside
a network namespace (`ip netns exec NS ...`). Its local API is a Unix socket in
its own state directory, which works across namespaces because the file system
is shared, so the parent can always ask any daemon for its status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from meshd.api import client
from meshd.runtime.scratch import remove_orphaned_scratch
from meshd.wire import pb

READY_TIMEOUT_S = 30.0


class DaemonProcess:
    """One daemon child process with its own state directory."""

    def __init__(
        self,
        state_dir: Path,
        args: Sequence[str] = (),
        *,
        netns: str | None = None,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.args = list(args)
        self.netns = netns
        self.log_path = log_path or state_dir / "daemon.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.api = f"unix:{state_dir / 'api.sock'}"
        self._status = client.StatusReader(self.api)

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "meshd.api.cli", "run", "--state-dir", str(self.state_dir)]
        if "--http" not in self.args:
            cmd += ["--http", "127.0.0.1:0"]  # several daemons on one machine: a port each
        cmd += self.args
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        return cmd

    def start(self) -> DaemonProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def status(self, timeout_s: float = 3.0) -> pb.MeshStatus:
        return self._status.status(timeout_s)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> pb.MeshStatus:
        """Wait until the daemon answers on its API (and has not exited)."""
        return self.wait_for(lambda s: True, timeout_s, "its local API to answer")

    def wait_for(
        self, predicate: Callable[[pb.MeshStatus], bool], timeout_s: float, what: str
    ) -> pb.MeshStatus:
        deadline = time.monotonic() + timeout_s
        last_error = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"daemon in {self.state_dir} exited with {self.proc.returncode} while "
                    f"waiting for {what}; log:\n{self.log_tail()}"
                )
            try:
                status = self.status(timeout_s=1.0)
            except client.DaemonUnreachable as exc:
                last_error = str(exc)
            else:
                if predicate(status):
                    return status
                last_error = "it answers, but has not got there yet"
            time.sleep(0.05)
        raise TimeoutError(
            f"daemon in {self.state_dir} did not reach: {what} within {timeout_s:.0f} s "
            f"({last_error}); log:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def terminate(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (clean shutdown, mDNS goodbye), then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int | None:
        """SIGKILL the daemon's whole process group (ip netns exec + python), then remove the
        scratch directories it can no longer remove itself (its next start would)."""
        self._status.close()
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        code = self.proc.wait(10)
        remove_orphaned_scratch()
        return code


def alive_ids(status: pb.MeshStatus) -> set[str]:
    return {n.profile.node_id for n in status.nodes if n.alive}


def links_measured(status: pb.MeshStatus) -> set[tuple[str, str]]:
    return {(m.src, m.dst) for m in status.links if m.bandwidth > 0}


def fully_meshed(status: pb.MeshStatus, n_nodes: int, *, with_links: bool = True) -> bool:
    """Every node alive with a measured profile, and (optionally) every link measured."""
    alive = [n for n in status.nodes if n.alive]
    if len(alive) != n_nodes or any(n.profile.flops <= 0 for n in alive):
        return False
    if not with_links:
        return True
    ids = alive_ids(status)
    wanted = {(a, b) for a in ids for b in ids if a != b}
    return wanted <= links_measured(status)
