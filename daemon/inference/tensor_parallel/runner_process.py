"""The process of one tensor-parallel rank's runner, as the daemon owns it: spawned with its
spec and backend files in a private folder, reached over a socket pair whose child end it
inherits, killed by PID and reaped without blocking the loop.

Only the process: what goes over the channel and when the rank counts as failed is the
member's (:mod:`.member`). The runner itself is :mod:`.runner`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from meshd.inference.tensor_parallel.spec import TensorParallelSpec, backend_files_and_env

RUNNER_MODULE = "meshd.inference.tensor_parallel.runner"
REAP_WAIT_S = 0.05
EXIT_CODE_WAIT_S = 1.0  # after its channel closed, how long a runner may take to be reaped


class RunnerProcess:
    """The runner process of rank ``rank`` of ``spec`` (asyncio loop of the data plane)."""

    def __init__(
        self,
        spec: TensorParallelSpec,
        rank: int,
        launcher: Sequence[str],
        env: Mapping[str, str],
        startup_timeout_s: float,
    ) -> None:
        """``launcher``: the command that runs Python (the interpreter, after a prefix such
        as ``ip netns exec NAME`` where one is given); ``env``: added to the daemon's own."""
        self.spec = spec
        self.rank = rank
        self._launcher = list(launcher)
        self._env = dict(env)
        self._startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._folder: Path | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    async def spawn(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Start the runner; the daemon's ends of its channel."""
        self._folder = Path(tempfile.mkdtemp(prefix="meshd-tp-"))
        os.chmod(self._folder, 0o700)
        spec_path = self._folder / "spec.json"
        write_private(spec_path, self.spec.to_json())
        files, env = backend_files_and_env(self.spec, self.rank)
        for name, content in files.items():
            path = self._folder / f"{name.lower()}.json"
            write_private(path, content)
            env[name] = str(path)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [
            *self._launcher,
            "-m",
            RUNNER_MODULE,
            "--spec",
            str(spec_path),
            "--rank",
            str(self.rank),
            "--ipc-fd",
            str(theirs.fileno()),
            "--parent-pid",
            str(os.getpid()),
            "--startup-timeout",
            str(self._startup_timeout_s),
        ]
        try:
            self._process = subprocess.Popen(
                command,
                pass_fds=(theirs.fileno(),),
                env={**os.environ, **self._env, **env},
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C is the daemon's to handle
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return await asyncio.open_unix_connection(sock=ours)

    def kill(self) -> None:
        """SIGKILL by PID, then reap it without blocking the loop for more than a moment."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=REAP_WAIT_S)
        except subprocess.TimeoutExpired:
            threading.Thread(target=process.wait, name="tp-reaper", daemon=True).start()

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit code, waiting at most ``timeout_s`` (None: still running)."""
        if self._process is None:
            return None
        try:
            return self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    async def exit_code_soon(self) -> int | None:
        """The runner's exit code once its channel closed: the process may need a moment
        after closing its end to be reaped (bounded; None when it is still running)."""
        process = self._process
        if process is None:
            return None
        try:
            return await asyncio.to_thread(process.wait, EXIT_CODE_WAIT_S)
        except subprocess.TimeoutExpired:
            return None

    def cleanup(self) -> None:
        """Remove the private folder (the spec, with its token, and the backend files)."""
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def write_private(path: Path, text: str) -> None:
    """A new file only this user can read (it may hold the group's token)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
