"""`meshd doctor` as a user runs it: the real command in a network namespace of its own (or on
a tiny tmpfs), real listeners on its ports, a real daemon, and its --json read back."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshd.api.launcher import alive_ids
from meshd.config import load_config
from tests.netns import Mesh, Node, require_root_and_netns
from tests.support.ports import free_ports

pytestmark = pytest.mark.netns

MESHD = str(Path(sys.executable).parent / "meshd")
DOCTOR_TIMEOUT_S = 60.0

# Holds a TCP port on an address until killed; says "ready" once it listens.
HOLDER = """
import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
time.sleep(60)
"""


def doctor(
    tmp_path: Path, *args: str, node: Node | None = None
) -> tuple[int, list[dict[str, Any]]]:
    """Run `meshd doctor --json` (inside `node`'s namespace when given); exit status, findings.

    HOME is a fresh folder, so the user's own service files and config stay out of it."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    command = [MESHD, "doctor", "--json", *args]
    if node is not None:
        command = node.command(command)
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=DOCTOR_TIMEOUT_S, check=False
    )
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def only(findings: list[dict[str, Any]], check: str) -> list[dict[str, Any]]:
    found = [f for f in findings if f["check"] == check]
    assert found, f"no {check!r} in {findings}"
    return found


def state_args(tmp_path: Path) -> list[str]:
    return ["--state-dir", str(tmp_path / "state"), "--model-store", str(tmp_path / "store")]


@pytest.fixture
def host(netns_mesh) -> Node:
    """One namespace whose eth0 has an address on a bridge and no route for multicast."""
    mesh: Mesh = netns_mesh(1)
    return mesh.nodes[0]


def ip(node: Node, *args: str) -> None:
    subprocess.run(["ip", "-n", node.ns, *args], check=True, timeout=10)


def test_a_healthy_namespace_passes_and_a_missing_multicast_route_is_named(
    host: Node, tmp_path: Path
) -> None:
    checks = ["--check", "interfaces", "--check", "multicast", "--check", "ports"]
    args = [*state_args(tmp_path), *checks]

    code, findings = doctor(tmp_path, *args, node=host)
    (multicast,) = only(findings, "multicast")
    assert multicast["status"] == "warn", multicast
    assert "no route for 224.0.0.251" in multicast["detail"]
    assert multicast["fix"] == "sudo ip route add 224.0.0.0/4 dev eth0"
    assert code == 0  # a warning is printed, not counted

    ip(host, "route", "add", "224.0.0.0/4", "dev", "eth0")
    code, findings = doctor(tmp_path, *args, node=host)
    assert code == 0 and all(f["status"] == "ok" for f in findings), findings
    (interfaces,) = only(findings, "interfaces")
    assert "mDNS uses eth0 (10.77.0.1)" in interfaces["detail"]
    assert only(findings, "multicast")[0]["detail"] == "eth0 (10.77.0.1) is up with MULTICAST"
    ports = {f["check"]: f["detail"] for f in findings if f["check"].endswith(" port")}
    assert ports["peer port"] == "0.0.0.0:52300/tcp is free"
    assert ports["lane port"] == "0.0.0.0:52301/tcp is free"  # fixed: a firewall can name it


def test_the_interface_mdns_uses_being_down_fails_with_the_fix(host: Node, tmp_path: Path) -> None:
    ip(host, "link", "set", "eth0", "down")
    code, findings = doctor(
        tmp_path, *state_args(tmp_path), "--interface", "eth0", "--check", "multicast", node=host
    )
    (multicast,) = only(findings, "multicast")
    assert code == 1
    assert multicast["status"] == "fail" and "eth0 (10.77.0.1) is down" in multicast["detail"]
    assert "sudo ip link set eth0 up" in multicast["fix"]


@contextlib.contextmanager
def holding(node: Node, address: str, port: int) -> Iterator[subprocess.Popen[str]]:
    holder = node.popen(
        [sys.executable, "-c", HOLDER, address, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        yield holder
    finally:
        holder.kill()
        holder.wait(timeout=5)


@pytest.mark.parametrize("taken", ["peer port", "lane port"])
def test_a_port_someone_else_holds_fails_with_who_and_the_fix(
    host: Node, tmp_path: Path, taken: str
) -> None:
    peer = 41000
    port = peer if taken == "peer port" else peer + 1
    with holding(host, "10.77.0.1", port) as holder:
        code, findings = doctor(
            tmp_path, *state_args(tmp_path), "--peer-port", str(peer), "--check", "ports",
            node=host,
        )  # fmt: skip
    (finding,) = only(findings, taken)
    assert code == 1
    assert finding["status"] == "fail", finding
    assert f"0.0.0.0:{port}/tcp cannot be bound: in use by pid " in finding["detail"]
    assert str(holder.pid) in finding["detail"]
    flag = "--peer-port" if taken == "peer port" else "--lane-port"
    assert f"`meshd run {flag} {port + 10}`" in finding["fix"]
    other = "lane port" if taken == "peer port" else "peer port"
    assert only(findings, other)[0]["status"] == "ok"


def test_ports_the_running_daemon_holds_are_ok(daemons, host: Node, tmp_path: Path) -> None:
    (peer,) = free_ports(1)
    state = tmp_path / "daemon"
    daemon = daemons(
        ["--interface", "eth0", "--peer-port", str(peer)], netns=host.ns, state_dir=state
    )
    status = daemon.wait_ready()
    assert status.lane_address.endswith(f":{peer + 1}")  # the lane port's default
    code, findings = doctor(
        tmp_path, "--state-dir", str(state), "--peer-port", str(peer),
        "--check", "daemon", "--check", "ports", "--check", "clock", "--check", "secret",
        "--check", "identity", node=host,
    )  # fmt: skip
    assert code == 0, findings
    by_check = {f["check"]: f for f in findings}
    assert by_check["daemon"]["status"] == "ok" and status.node_id in by_check["daemon"]["detail"]
    for name in ("peer port", "lane port", "http port"):
        assert by_check[name]["status"] == "ok", by_check[name]
        assert "the running daemon listens there" in by_check[name]["detail"]
    assert by_check["mesh secret"]["status"] == "ok"
    assert by_check["tls identity"]["status"] == "ok", by_check["tls identity"]
    assert by_check["clock skew"]["status"] == "skip"  # no peer alive to compare with


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted afterwards (failures included)."""
    require_root_and_netns()  # root, as mount needs
    mount = tmp_path / "tiny"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=10)


def test_a_full_model_store_fails_with_the_fix(tiny_tmpfs: Path, tmp_path: Path) -> None:
    store = tiny_tmpfs / "store"
    store.mkdir()
    with contextlib.suppress(OSError), (store / "filler").open("wb") as filler:
        for _ in range(64):  # 64 x 64 KiB > 1 MiB: the disk fills before the loop ends
            filler.write(b"\0" * 65536)
            filler.flush()
    code, findings = doctor(
        tmp_path, "--state-dir", str(tmp_path / "state"), "--model-store", str(store),
        "--check", "store",
    )  # fmt: skip
    (finding,) = only(findings, "model store")
    assert code == 1
    assert finding["status"] == "fail", finding
    assert finding["detail"].startswith(f"{store}: 0 B free"), finding
    assert "--model-store DIR" in finding["fix"] and f"df -h {store}" in finding["fix"]


def test_text_output_puts_the_fix_under_the_failing_check(tiny_tmpfs: Path, tmp_path: Path) -> None:
    (tiny_tmpfs / "filler").write_bytes(b"\0" * (2**20 - 4096))
    done = subprocess.run(
        [MESHD, "doctor", "--state-dir", str(tmp_path / "s"), "--model-store", str(tiny_tmpfs),
         "--check", "store", "--check", "secret"],
        capture_output=True, text=True, timeout=DOCTOR_TIMEOUT_S, check=False,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    failing = next(i for i, line in enumerate(lines) if line.startswith("FAIL  model store"))
    assert lines[failing + 1].strip().startswith("fix: free space on that filesystem")
    assert lines[-1] == "1 fail, 1 warn"


def test_the_lane_port_is_fixed_next_to_the_peer_port_unless_either_is_chosen_freely() -> None:
    assert load_config({}, env={}).lane_port == 52301
    assert load_config({"peer_port": 7000}, env={}).lane_port == 7001
    assert load_config({"peer_port": 0}, env={}).lane_port == 0  # several daemons on one host
    assert load_config({"peer_port": 7000, "lane_port": 0}, env={}).lane_port == 0
    assert load_config({}, env={"MESHD_LANE_PORT": "9000"}).lane_port == 9000


def test_the_port_probe_names_the_listener_and_leaves_the_port_free() -> None:
    """The probe binds and closes at once: it never connects or sends, and holds nothing."""
    from meshd.mesh.host_network import tcp_port_state

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        state = tcp_port_state("127.0.0.1", port)
        assert not state.bindable and state.reason == "in use"
        assert f"pid {os.getpid()}" in state.holder
    assert tcp_port_state("127.0.0.1", port).bindable


def test_two_members_clocks_are_compared_from_their_beats(
    daemons, netns_mesh, mesh_token: str, tmp_path: Path
) -> None:
    mesh: Mesh = netns_mesh(2)
    members = [
        daemons(["--interface", "eth0", "--join", mesh_token], netns=node.ns) for node in mesh.nodes
    ]
    other = members[1].wait_ready().node_id
    members[0].wait_for(lambda s: other in alive_ids(s), 30, "the other member alive")
    code, findings = doctor(
        tmp_path, "--state-dir", str(members[0].state_dir), "--check", "clock", node=mesh.nodes[0]
    )
    (clock,) = only(findings, "clock skew")
    assert code == 0 and clock["status"] == "ok", clock
    offset = float(clock["detail"].split(f"{other} ")[1].split(" s")[0])
    assert abs(offset) < 0.5  # one host, one clock: only the beat's one-way delay remains


def test_a_model_larger_than_this_nodes_budget_is_named_and_one_that_fits_passes(
    tiny_llama: Path, tmp_path: Path
) -> None:
    args = [*state_args(tmp_path), "--model", str(tiny_llama), "--check", "memory"]
    code, findings = doctor(tmp_path, *args, "--memory-budget", "50MB")
    (memory,) = only(findings, "memory")
    assert code == 0 and memory["status"] == "warn", memory  # no daemon: peers may add the rest
    assert "too little alone" in memory["detail"]
    assert "this node's budget 47.68 MiB" in memory["detail"] and "--memory-budget" in memory["fix"]
    code, findings = doctor(tmp_path, *args, "--memory-budget", "1GB")
    assert code == 0 and only(findings, "memory")[0]["status"] == "ok", findings


def test_the_reference_blas_fails_with_the_package_to_install(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run(
        [MESHD, "doctor", "--json", *state_args(tmp_path), "--check", "blas"],
        capture_output=True, text=True, timeout=DOCTOR_TIMEOUT_S, check=False,
        env={**os.environ, "MESHD_BLAS": "reference", "HOME": str(home)},
    )  # fmt: skip
    (blas,) = json.loads(done.stdout)
    assert done.returncode == 1 and blas["status"] == "fail", blas
    assert "GFLOP/s" in blas["detail"]
    assert "sudo apt install libopenblas0-pthread" in blas["fix"]


def test_secret_and_key_readable_by_others_fail_with_chmod(tmp_path: Path) -> None:
    from meshd.mesh import security

    state = tmp_path / "state"
    secret = security.create_mesh_secret("doctor-test")
    security.save_secret(state, secret)
    security.load_or_create_node_credentials(state, secret, "node-a")
    args = [*state_args(tmp_path), "--check", "secret", "--check", "identity"]
    code, findings = doctor(tmp_path, *args)
    assert code == 0 and {f["status"] for f in findings} == {"ok"}, findings

    (state / security.SECRET_FILE_NAME).chmod(0o640)
    (state / security.NODE_KEY_FILE_NAME).chmod(0o644)
    code, findings = doctor(tmp_path, *args)
    by_check = {f["check"]: f for f in findings}
    assert code == 1
    assert by_check["mesh secret"]["fix"] == f"chmod 600 {state / security.SECRET_FILE_NAME}"
    assert by_check["tls identity"]["fix"] == f"chmod 600 {state / security.NODE_KEY_FILE_NAME}"
    assert "0644: others can read this node's private key" in by_check["tls identity"]["detail"]
