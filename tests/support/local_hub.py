"""A Hugging Face Hub-compatible server on loopback: olah serving local git repositories.

Why: the Hub client (huggingface_hub) must be tested against a real server speaking the
Hub's API, never a fake of it, and without any traffic beyond loopback. olah (PyPI `olah`,
a self-hosted Hub mirror) serves "mirrors": git repositories laid out as
``<mirrors>/models/<org>/<name>``, with large files as git-LFS pointers whose objects sit in
``.git/lfs/objects``, exactly what ``git lfs`` makes. With ``offline = true`` it never asks
the real Hub. It runs in its own virtual environment (``OLAH_PYTHON``, default
``.venv-olah/bin/python``; packaging/install.sh --dev makes it), because its pinned web
stack differs from the daemon's.

:func:`make_repo` turns a model directory into such a repository (files over
``LFS_THRESHOLD`` become LFS objects, as on the Hub), :class:`LocalHub` starts the server,
optionally inside a network namespace, and counts the requests for each file from its
access log.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OLAH_PYTHON = Path(os.environ.get("OLAH_PYTHON", ROOT / ".venv-olah" / "bin" / "python"))
LFS_THRESHOLD = 1024  # bytes: larger files are stored as LFS objects
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}
_RESOLVE = re.compile(r'"(?P<method>GET|HEAD) /[^/]+/[^/]+/resolve/[^/]+/(?P<path>[^ ?]+)')


def olah_available() -> bool:
    return OLAH_PYTHON.is_file()


def make_repo(mirrors: Path, repo_id: str, model_dir: Path) -> str:
    """A git repository of ``model_dir``'s files under ``mirrors``; returns its commit."""
    repo = mirrors / "models" / repo_id
    repo.mkdir(parents=True)
    env = {**os.environ, **_GIT_ENV}
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True, env=env)
    for item in sorted(Path(model_dir).iterdir()):
        if not item.is_file():
            continue
        data = item.read_bytes()
        if len(data) > LFS_THRESHOLD:
            oid = hashlib.sha256(data).hexdigest()
            store = repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
            store.parent.mkdir(parents=True, exist_ok=True)
            store.write_bytes(data)
            pointer = (
                f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(data)}\n"
            )
            (repo / item.name).write_text(pointer)
        else:
            (repo / item.name).write_bytes(data)
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", "model"], check=True, env=env)
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, env=env, capture_output=True
    )
    return head.stdout.decode().strip()


class LocalHub:
    """olah on ``host:port`` serving the repositories under ``mirrors``, offline.

    ``prefix``: a command prefix to run it elsewhere (``ip netns exec NAME``). Stop it with
    :meth:`stop` (also on failure: use it as a context manager).
    """

    def __init__(self, mirrors: Path, workdir: Path, host: str, port: int, prefix=()) -> None:
        self.mirrors = mirrors
        self.workdir = workdir
        self.host, self.port = host, port
        self.prefix = list(prefix)
        self.log_path = workdir / "olah.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> LocalHub:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "olah.toml"
        config.write_text(
            "[basic]\n"
            f'host = "{self.host}"\nport = {self.port}\n'
            f'repos-path = "{self.workdir / "repos"}"\n'
            f'mirrors-path = ["{self.mirrors}"]\n'
            f'mirror-netloc = "{self.host}:{self.port}"\n'
            f'mirror-lfs-netloc = "{self.host}:{self.port}"\n'
            "[accessibility]\noffline = true\n"
        )
        command = [*self.prefix, str(OLAH_PYTHON), "-m", "olah.server", "-c", str(config)]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"olah exited: {self.log_path.read_text()[-2000:]}")
            if "Uvicorn running" in self.log_path.read_text(errors="replace"):
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"olah did not start in {timeout_s} s: {self.log_path.read_text()}")

    def file_requests(self) -> Counter[str]:
        """How many times each file was asked for (GET of its resolve URL: a download, or a
        range request for a safetensors header; uvicorn's access log does not tell them
        apart)."""
        text = self.log_path.read_text(errors="replace")
        return Counter(m["path"] for m in _RESOLVE.finditer(text) if m["method"] == "GET")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.workdir / "repos", ignore_errors=True)
