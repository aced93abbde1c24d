"""`meshd demo`: a small mesh of local daemons on loopback, shown, then shut down.

Everything stays on 127.0.0.1: the daemons announce and browse mDNS only on the
loopback interface and listen for peers on it, so the demo never touches the
machine's real network. The first daemon's secret is handed to the others as a
join token, exactly as `meshd token` / `meshd join` would.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from daemon import render, security
from daemon.launcher import DaemonProcess, fully_meshed

LOOPBACK = "127.0.0.1"


def loopback_args(token: str, name: str) -> list[str]:
    return [
        "--name",
        name,
        "--interface",
        LOOPBACK,
        "--peer-host",
        LOOPBACK,
        "--peer-port",
        "0",
        "--join",
        token,
        "--log-level",
        "WARNING",
    ]


def start_local_mesh(root: Path, nodes: int, mesh_name: str = "demo") -> list[DaemonProcess]:
    token = security.encode_join_token(security.create_mesh_secret(mesh_name))
    daemons = [
        DaemonProcess(root / f"node{i}", loopback_args(token, f"demo-{i}")) for i in range(nodes)
    ]
    for daemon in daemons:
        daemon.start()
    return daemons


def run_demo(nodes: int = 3, keep_state: Path | None = None, timeout_s: float = 60.0) -> int:
    if nodes < 1:
        print("meshd demo: --nodes must be at least 1", file=sys.stderr)
        return 2
    root = keep_state or Path(tempfile.mkdtemp(prefix="meshd-demo-"))
    print(f"starting {nodes} daemons on loopback (state in {root}) ...", flush=True)
    started = time.monotonic()
    daemons = start_local_mesh(root, nodes)
    try:
        for daemon in daemons:
            daemon.wait_ready(timeout_s)
        status = daemons[0].wait_for(
            lambda s: fully_meshed(s, nodes), timeout_s, f"all {nodes} nodes and links measured"
        )
        elapsed = time.monotonic() - started
        print(f"mesh formed in {elapsed:.1f} s: every node sees every other, every link measured\n")
        print(render.status_text(status), flush=True)
        return 0
    except (TimeoutError, RuntimeError) as exc:
        print(f"meshd demo: {exc}", file=sys.stderr)
        return 1
    finally:
        print("\nshutting the daemons down ...", flush=True)
        for daemon in daemons:
            daemon.terminate()
        if keep_state is None:
            shutil.rmtree(root, ignore_errors=True)
