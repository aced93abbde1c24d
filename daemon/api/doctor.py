"""`meshd doctor`: check what usually breaks a mesh on this machine, and say how to fix each.

Each check reports a line (ok, warn, fail or skip), what it found and, when it is not ok, the
command that fixes it. The checks read the same configuration `meshd run` would (flags, the
environment, `<state-dir>/meshd.toml`), and ask the local daemon when one runs: its ports are
then held by itself, not by a stranger, and its peers can be compared.

Nothing here sends a packet: the network checks read the kernel's interfaces, routes and
sockets (:mod:`meshd.mesh.host_network`). Exit status: 0 when nothing failed (warnings are
printed, not counted), 1 when a check failed, 2 on a configuration error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from meshd.config import Config, add_setting_flags, flags_given, load_config
from meshd.mesh import host_network as net
from meshd.wire import pb

Status = Literal["ok", "warn", "fail", "skip"]

DAEMON_TIMEOUT_S = 2.0
CLOCK_SKEW_WARN_S = 1.0  # certificates are back-dated and beats carry wall clock: ~1 s matters
LOW_DISK_BYTES = 5 * 2**30  # a model store with less free space holds few models
MIN_FREE_BYTES = 100 * 2**20  # below this even a fetched model part or an import fails
WRITE_PROBE_BYTES = 64 * 2**10
MEMORY_HEADROOM = 1.1  # weights need room for the KV cache and activations beside them

SETTINGS_READ = (
    "state_dir",
    "api",
    "model_store",
    "mdns",
    "peers",
    "interfaces",
    "skip_interfaces",
    "peer_host",
    "peer_port",
    "lanes",
    "lane_port",
    "http",
    "model",
    "memory_budget",
    "mesh_name",
    "device",
)


@dataclass(frozen=True)
class Finding:
    """One line of the report: a check's name, its verdict, what it found, and the fix."""

    check: str
    status: Status
    detail: str
    fix: str = ""


@dataclass
class Context:
    """What the checks share: the configuration and what the running daemon says."""

    config: Config
    status: pb.MeshStatus | None = None
    models: pb.ModelList | None = None
    daemon_error: str = ""  # why no daemon status, when there is none
    interfaces: dict[str, net.InterfaceState] = field(default_factory=dict)
    mdns_addresses: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- daemon


def check_daemon(ctx: Context) -> list[Finding]:
    if ctx.status is None:
        return [
            Finding(
                "daemon",
                "warn",
                f"no daemon answers at {ctx.config.api_address} ({ctx.daemon_error}); the "
                "checks below read the configuration only",
                "start it: `meshd run` (foreground) or `meshd service start`",
            )
        ]
    alive = [n for n in ctx.status.nodes if n.alive and n.source != "self"]
    return [
        Finding(
            "daemon",
            "ok",
            f"node {ctx.status.node_id} in mesh {ctx.status.mesh_name!r}, "
            f"{len(alive)} peer{'s' if len(alive) != 1 else ''} alive",
        )
    ]


# ---------------------------------------------------------------- interfaces and multicast


def check_interfaces(ctx: Context) -> list[Finding]:
    from meshd.mesh.interfaces import InterfaceSelectionError, resolve_interfaces

    config = ctx.config
    shown = _describe_interfaces(ctx.interfaces)
    if not config.mdns:
        peers = ", ".join(config.peers) or "none"
        status: Status = "ok" if config.peers else "fail"
        fix = "" if config.peers else "name peers with --peer HOST:PORT, or turn mDNS on (--mdns)"
        return [Finding("interfaces", status, f"mDNS is off; static peers: {peers}", fix)]
    try:
        ctx.mdns_addresses = resolve_interfaces(config.interfaces or None, config.skip_interfaces)
    except InterfaceSelectionError as error:
        return [Finding("interfaces", "fail", str(error), _interface_fix(ctx.interfaces))]
    if not ctx.mdns_addresses:
        return [
            Finding(
                "interfaces",
                "fail",
                f"mDNS has no interface to use (none is up with an IPv4 address outside "
                f"loopback and container bridges); this machine has: {shown}",
                _interface_fix(ctx.interfaces),
            )
        ]
    used = ", ".join(
        f"{net.interface_of(ip, ctx.interfaces) or '?'} ({ip})" for ip in ctx.mdns_addresses
    )
    how = "as configured" if config.interfaces else "chosen automatically"
    return [Finding("interfaces", "ok", f"mDNS uses {used}, {how}; this machine has: {shown}")]


def _describe_interfaces(states: dict[str, net.InterfaceState]) -> str:
    parts = []
    for state in states.values():
        addresses = ", ".join(state.ipv4) or "no IPv4"
        parts.append(f"{state.name} ({addresses}{'' if state.up else ', down'})")
    return "; ".join(parts) or "no interfaces"


def _interface_fix(states: dict[str, net.InterfaceState]) -> str:
    candidates = [s.name for s in states.values() if s.ipv4 and not s.loopback]
    example = candidates[0] if candidates else "IFACE"
    return (
        f"name the interface the peers share: `meshd run --interface {example}` (or "
        f'interfaces = ["{example}"] in meshd.toml); bring it up first if it is down'
    )


def check_multicast(ctx: Context) -> list[Finding]:
    """The interfaces mDNS uses must be up; multicast's default route should leave by one.

    meshd's mDNS names its interface on every socket, and for 224.0.0.251 (a link-local
    group) Linux then needs no route at all, so a missing route is a warning there: it breaks
    other mDNS software on the machine and anything that sends multicast without choosing an
    interface. macOS refuses to send without one, so there it fails."""
    if not ctx.config.mdns or not ctx.mdns_addresses:
        return [Finding("multicast", "skip", "mDNS is off or has no interface (see interfaces)")]
    route = net.multicast_route()
    return [_multicast_finding(ip, ctx.interfaces, route) for ip in ctx.mdns_addresses]


def _multicast_finding(
    ip: str, states: dict[str, net.InterfaceState], route: net.MulticastRoute
) -> Finding:
    name = net.interface_of(ip, states)
    state = states.get(name or "")
    if state is None:
        return Finding("multicast", "fail", f"no interface holds {ip} any more", "")
    if state.loopback:
        return Finding("multicast", "ok", f"{name} ({ip}) is loopback: only this machine's daemons")
    if not state.up:
        return Finding(
            "multicast",
            "fail",
            f"{name} ({ip}) is down or has no carrier: mDNS sends and hears nothing there",
            f"bring it up: `sudo ip link set {name} up` (and check its cable or Wi-Fi)",
        )
    if route.device is None:
        status: Status = "fail" if platform.system() == "Darwin" else "warn"
        return Finding(
            "multicast",
            status,
            f"no route for {net.MDNS_GROUP} ({route.error}); mDNS on {name} ({ip}) names its "
            "interface, but other mDNS software and multicast without a chosen interface fail",
            net.multicast_route_fix(name or "IFACE"),
        )
    if not state.multicast:
        return Finding(
            "multicast",
            "warn",
            f"{name} ({ip}) lacks the MULTICAST flag: some drivers then drop mDNS",
            f"sudo ip link set {name} multicast on",
        )
    where = (
        "" if route.device == name else f" (the default multicast route leaves by {route.device})"
    )
    return Finding("multicast", "ok", f"{name} ({ip}) is up with MULTICAST{where}")


# ---------------------------------------------------------------- ports and firewall


@dataclass(frozen=True)
class _Port:
    name: str
    host: str
    port: int
    setting: str  # the flag that moves it
    live: bool  # the running daemon listens on it


def _ports(ctx: Context) -> list[_Port]:
    """The daemon's TCP ports: what the running daemon uses, else what the config says."""
    from meshd.http.address import OFF, split_host_port

    config, status = ctx.config, ctx.status
    ports = []
    peer = _address_port(status.peer_address) if status else None
    ports.append(
        _Port("peer port", config.peer_host, peer or config.peer_port, "--peer-port", bool(peer))
    )
    if config.lanes:
        lane = _address_port(status.lane_address) if status else None
        ports.append(
            _Port(
                "lane port", config.peer_host, lane or config.lane_port, "--lane-port", bool(lane)
            )
        )
    if config.http != OFF:
        host, port = split_host_port(config.http)
        live = _address_port(status.http_url) if status and status.http_url else None
        ports.append(_Port("http port", host, live or port, "--http", bool(live)))
    return ports


def _address_port(address: str) -> int | None:
    tail = address.rstrip("/").rpartition(":")[2]
    return int(tail) if tail.isdigit() and int(tail) else None


def check_ports(ctx: Context) -> list[Finding]:
    return [_port_finding(port) for port in _ports(ctx)]


def _port_finding(port: _Port) -> Finding:
    where = f"{port.host}:{port.port}/tcp"
    if port.live:
        return Finding(port.name, "ok", f"{where}: the running daemon listens there")
    if port.port == 0:
        hint = "a firewall rule cannot name it" if port.name != "http port" else "shown by status"
        return Finding(port.name, "ok", f"{port.host}:0: a free port is picked at start ({hint})")
    state = net.tcp_port_state(port.host, port.port)
    if state.bindable:
        return Finding(port.name, "ok", f"{where} is free")
    holder = f" by {state.holder}" if state.holder else ""
    flag = port.setting
    move = (
        f"{flag} {port.host}:{port.port + 10}" if flag == "--http" else f"{flag} {port.port + 10}"
    )
    return Finding(
        port.name,
        "fail",
        f"{where} cannot be bound: {state.reason}{holder}",
        f"stop what holds it, or give meshd another port: `meshd run {move}` (the same in "
        "meshd.toml), and let the new port through the firewall",
    )


def _openings(ctx: Context) -> list[net.Opening]:
    from meshd.http.address import is_loopback

    openings = [net.Opening(net.MDNS_PORT, "udp", "mDNS")] if ctx.config.mdns else []
    for port in _ports(ctx):
        if port.port == 0 or (port.name == "http port" and is_loopback(port.host)):
            continue
        openings.append(net.Opening(port.port, "tcp", port.name))
    return openings


def check_firewall(ctx: Context) -> list[Finding]:
    openings = _openings(ctx)
    needed = ", ".join(f"{o.spec} ({o.why})" for o in openings)
    every = "; or ".join(
        [" && ".join(net.ufw_commands(openings)), " && ".join(net.firewalld_commands(openings))]
    )
    state = net.firewall_state(openings)
    if not state.name:
        return [
            Finding(
                "firewall",
                "ok",
                f"no active ufw or firewalld here; a firewall elsewhere must let through {needed}",
            )
        ]
    if not state.missing:
        return [Finding("firewall", "ok", f"{state.name} lets through {needed}")]
    missing = list(state.missing)
    commands = net.ufw_commands(missing) if state.name == "ufw" else net.firewalld_commands(missing)
    note = f" ({state.note})" if state.note else ""
    return [
        Finding(
            "firewall",
            "warn",
            f"{state.name} is active and has no rule for "
            f"{', '.join(f'{o.spec} ({o.why})' for o in missing)}{note}",
            " && ".join(commands) if commands else every,
        )
    ]


# ---------------------------------------------------------------- clocks


def check_clock(ctx: Context) -> list[Finding]:
    if ctx.status is None:
        return [Finding("clock skew", "skip", "no running daemon to ask for its peers' clocks")]
    peers = [n for n in ctx.status.nodes if n.alive and n.source != "self"]
    if not peers:
        return [Finding("clock skew", "skip", "no peer alive to compare clocks with")]
    worst = max(peers, key=lambda n: abs(n.clock_offset_s))
    offsets = ", ".join(f"{n.profile.node_id} {n.clock_offset_s:+.2f} s" for n in peers)
    if abs(worst.clock_offset_s) <= CLOCK_SKEW_WARN_S:
        return [Finding("clock skew", "ok", f"peers' clocks against this one: {offsets}")]
    return [
        Finding(
            "clock skew",
            "warn",
            f"peers' clocks against this one: {offsets} (over {CLOCK_SKEW_WARN_S:g} s: "
            "certificates and time stamps disagree)",
            "sync the clocks with NTP on every member: `sudo timedatectl set-ntp true` "
            "(macOS: System Settings > General > Date & Time > Set automatically)",
        )
    ]


# ---------------------------------------------------------------- compute


def check_blas(ctx: Context) -> list[Finding]:
    from meshd.runtime.blas import blas_info

    info = blas_info()
    speed = _matmul_speed()
    if info.kind != "reference":
        return [Finding("blas", "ok", f"{info.name}{speed}")]
    return [
        Finding(
            "blas",
            "fail",
            f"MLX's bundled reference BLAS ({info.reason}){speed}: matmuls run ~50x slower",
            "install OpenBLAS: `sudo apt install libopenblas0-pthread` (Debian/Ubuntu; Fedora: "
            "`sudo dnf install openblas-threads`), then restart the daemon; MESHD_BLAS=PATH "
            "names a library elsewhere",
        )
    ]


def check_device(ctx: Context) -> list[Finding]:
    """Which device MLX would compute on with this configuration, and why; the running
    daemon's own choice when it answers (meshd.runtime.device decides both)."""
    from meshd.runtime.device import DeviceUnavailable, choose_device, probe_mlx

    requested = ctx.config.device
    try:
        choice = choose_device(requested, probe_mlx())
    except DeviceUnavailable:
        return [
            Finding(
                "device",
                "fail",
                f"no GPU reported by MLX, and device = {requested} refuses the CPU",
                f"{_device_fix()}; or use --device auto",
            )
        ]
    except Exception as error:  # MLX missing or broken
        return [Finding("device", "fail", f"MLX cannot be asked for its devices: {error}")]
    detail = choice.summary
    if choice.gpu_memory:
        detail += f"; {_size(choice.gpu_memory)} of GPU memory"
    own = _daemon_profile(ctx)
    if own is not None and own.mlx_device:
        from meshd.api.render import device_line

        detail += f"; the running daemon: {device_line(own)}"
    return [Finding("device", "ok", detail)]


def _device_fix() -> str:
    from meshd.runtime.device import CUDA_INSTALL_HINT, METAL_INSTALL_HINT

    return METAL_INSTALL_HINT if sys.platform == "darwin" else CUDA_INSTALL_HINT


def _daemon_profile(ctx: Context) -> pb.NodeProfile | None:
    if ctx.status is None:
        return None
    return next((n.profile for n in ctx.status.nodes if n.source == "self"), None)


def _matmul_speed() -> str:
    """ ", 412 GFLOP/s float32 matmul" measured now (a fraction of a second), or ""."""
    try:
        from meshd.mesh.profiling import measure_matmul_flops

        return f", {measure_matmul_flops() / 1e9:.0f} GFLOP/s float32 matmul"
    except Exception as error:  # MLX missing or broken: the BLAS verdict still stands
        return f" (matmul not measured: {error})"


def check_memory(ctx: Context) -> list[Finding]:
    model, weights, error = _model_size(ctx)
    if error:
        return [Finding("memory", "fail", error, "check the model: `meshd models` lists the store")]
    if model is None or weights is None:
        return [
            Finding(
                "memory",
                "skip",
                "no model configured or selected: nothing to compare the memory budget with",
            )
        ]
    own, total, members = _budgets(ctx)
    need = int(weights * MEMORY_HEADROOM)
    text = f"{model} needs {_size(weights)} of weights; this node's budget {_size(own)}" + (
        f", the mesh's {_size(total)} over {members} nodes" if members > 1 else ""
    )
    if total >= need:
        return [Finding("memory", "ok", text)]
    # Short on a live mesh: no plan can hold the model. Without a daemon only this machine is
    # known, and members may make up the rest.
    live = ctx.status is not None
    status: Status = "fail" if live and total < weights else "warn"
    short = "too little" if live else "too little alone; the mesh's members must add the rest"
    return [
        Finding(
            "memory",
            status,
            f"{text} ({short} for the weights and their KV cache)",
            "add members (`meshd token` here, `meshd join TOKEN` there), raise this node's "
            "budget (`--memory-budget 12GB`) if the machine has the memory, or choose a "
            "smaller model (`meshd load NAME`)",
        )
    ]


def _budgets(ctx: Context) -> tuple[int, int, int]:
    """This node's memory budget, the mesh's total, and how many nodes make it (a live node's
    budget less the process overhead it plans: what a model may use)."""
    if ctx.status is not None and ctx.status.nodes:
        alive = [n for n in ctx.status.nodes if n.alive or n.source == "self"]
        own = _for_a_model(ctx.status.nodes[0].profile)
        return own, sum(_for_a_model(n.profile) for n in alive), len(alive)
    if ctx.config.memory_budget:
        return ctx.config.memory_budget, ctx.config.memory_budget, 1
    from meshd.mesh.profiling import default_memory_budget, gpu_wired_limit, total_memory
    from meshd.runtime.device import choose_device, device_memory_budget, probe_mlx

    try:  # a CUDA node plans with its GPU's memory, as its profile will say
        choice = choose_device(ctx.config.device, probe_mlx())
        own = device_memory_budget(choice.device == "gpu", choice.backend, choice.gpu_memory)
    except Exception:  # MLX missing, or a forced GPU absent (the device check says which)
        own = 0
    own = own or default_memory_budget(total_memory(), wired_limit=gpu_wired_limit())
    return own, own, 1


def _for_a_model(profile: pb.NodeProfile) -> int:
    return max(0, profile.memory_budget - profile.process_overhead)


def _model_size(ctx: Context) -> tuple[str | None, int | None, str]:
    """(model, weight bytes, error): the daemon's selected model, else the configured one."""
    if ctx.models is not None and ctx.models.selected:
        entry = next((m for m in ctx.models.models if m.name == ctx.models.selected), None)
        if entry is not None:
            return entry.name, entry.size_bytes, ""
    model = ctx.config.model
    if not model:
        return None, None, ""
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return model, path.stat().st_size, ""
    folder = path if path.is_dir() else ctx.config.model_store / "models" / model
    if not folder.is_dir():
        return model, None, f"model {model!r} is neither a directory, a .gguf file nor in the store"
    from meshd.models.info import read_model_spec

    try:
        return model, read_model_spec(folder).total_weight_bytes, ""
    except Exception as error:  # a damaged model directory: say which and why
        return model, None, f"cannot read model {model!r} at {folder}: {error}"


def check_model_store(ctx: Context) -> list[Finding]:
    store = ctx.config.model_store
    existing = next((p for p in (store, *store.parents) if p.exists()), Path("/"))
    if not os.access(existing, os.W_OK | os.X_OK):
        return [
            Finding(
                "model store",
                "fail",
                f"{store}: {existing} is not writable by this user",
                f"give this user the directory (`sudo chown -R $USER {existing}`), or move the "
                "store: `--model-store DIR` (model_store in meshd.toml)",
            )
        ]
    usage = shutil.disk_usage(existing)
    _, weights, _ = _model_size(ctx)
    written = _write_probe(existing) if existing == store else ""
    detail = f"{store}{'' if existing == store else ' (not created yet)'}: {_size(usage.free)} free"
    fix = (
        f"free space on that filesystem (`df -h {existing}`, `du -sh {existing}/*`), or move the "
        "store to a larger disk: `--model-store DIR` (model_store in meshd.toml)"
    )
    if written:
        return [Finding("model store", "fail", f"{detail}; cannot write there: {written}", fix)]
    if usage.free < MIN_FREE_BYTES:
        return [Finding("model store", "fail", f"{detail}: too little for any import", fix)]
    if weights and not _model_in_store(ctx) and usage.free < weights:
        return [Finding("model store", "fail", f"{detail}, the model needs {_size(weights)}", fix)]
    if usage.free < LOW_DISK_BYTES:
        return [Finding("model store", "warn", f"{detail}: room for few models", fix)]
    return [Finding("model store", "ok", detail)]


def _model_in_store(ctx: Context) -> bool:
    model = ctx.config.model or (ctx.models.selected if ctx.models else "")
    return bool(model) and (ctx.config.model_store / "models" / model).is_dir()


def _write_probe(folder: Path) -> str:
    """Write and remove a small file in `folder`: "" when it worked, else why not."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".meshd-doctor-") as probe:
            probe.write(b"\0" * WRITE_PROBE_BYTES)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        return error.strerror or str(error)
    return ""


# ---------------------------------------------------------------- service


def check_service(ctx: Context) -> list[Finding]:
    from meshd.service.manager import Launchd, ServiceState, Systemd
    from meshd.service.units import ServiceError

    quiet: Callable[[str], None] = lambda _: None  # noqa: E731
    if platform.system() == "Darwin":
        managers: list = [Launchd(say=quiet)]
    elif platform.system() == "Linux":
        managers = [Systemd(system=True, say=quiet), Systemd(system=False, say=quiet)]
    else:
        return [
            Finding("service", "skip", f"no service manager meshd knows on {platform.system()}")
        ]
    findings = []
    for manager in managers:
        try:
            state: ServiceState = manager.state()
        except ServiceError as error:
            findings.append(Finding("service", "warn", f"{manager.describe()}: {error}"))
            continue
        if state.installed:
            findings.append(_service_finding(manager, state))
    if findings:
        return findings
    return [
        Finding(
            "service",
            "ok",
            "not installed as a service (fine with `meshd run`); `meshd service install` starts "
            "meshd at login or boot",
        )
    ]


def _service_finding(manager, state) -> Finding:
    flag = " --system" if manager.system else ""
    text = f"{manager.describe()}: {state.summary}"
    if not state.running:
        return Finding(
            "service", "warn", text, f"meshd service start{flag}; logs: meshd service logs{flag}"
        )
    if "disabled" in state.summary.split(", "):
        scope = "" if manager.system else " --user"
        return Finding(
            "service", "warn", text + " (not started at boot)", f"systemctl{scope} enable meshd"
        )
    return Finding("service", "ok", text)


# ---------------------------------------------------------------- identity and secret


def check_secret(ctx: Context) -> list[Finding]:
    from meshd.mesh import security

    state_dir = ctx.config.state_dir
    path = state_dir / security.SECRET_FILE_NAME
    join = "to join an existing mesh: `meshd token` on a member, then `meshd join TOKEN` here"
    try:
        secret = security.load_secret(state_dir)
    except security.InsecureSecretFile as error:
        return [Finding("mesh secret", "fail", str(error).split("; run")[0], f"chmod 600 {path}")]
    except (security.InvalidJoinToken, OSError) as error:
        return [Finding("mesh secret", "fail", f"{path}: {error}", join)]
    if secret is None:
        return [
            Finding(
                "mesh secret",
                "warn",
                f"no mesh secret in {state_dir}: the first `meshd run` makes a new mesh "
                f"{ctx.config.mesh_name!r}",
                join,
            )
        ]
    text = f"mesh {secret.mesh_name!r} ({security.mesh_fingerprint(secret)}), {path} mode 0600"
    if ctx.status is not None and ctx.status.mesh_fingerprint not in (
        "",
        security.mesh_fingerprint(secret),
    ):
        return [
            Finding(
                "mesh secret",
                "warn",
                f"{text}, but the daemon runs mesh {ctx.status.mesh_name!r}: it was started "
                "with another secret",
                "restart the daemon to use the secret on disk (`meshd service restart`)",
            )
        ]
    return [Finding("mesh secret", "ok", text)]


def check_identity(ctx: Context) -> list[Finding]:
    from meshd.mesh import security

    state_dir = ctx.config.state_dir
    key_path = state_dir / security.NODE_KEY_FILE_NAME
    cert_path = state_dir / security.NODE_CERT_FILE_NAME
    if not key_path.exists() and not cert_path.exists():
        return [
            Finding(
                "tls identity",
                "skip",
                f"no node key or certificate in {state_dir} yet (the first `meshd run` makes them)",
            )
        ]
    problem = _private_file_problem(key_path) or _state_dir_problem(state_dir)
    if problem:
        return [Finding("tls identity", "fail", problem[0], problem[1])]
    return [_certificate_finding(cert_path, state_dir)]


def _private_file_problem(path: Path) -> tuple[str, str] | None:
    try:
        mode = path.stat().st_mode
        path.read_bytes()
    except FileNotFoundError:
        return f"{path} is missing but the certificate is there", "restart the daemon to make a key"
    except OSError as error:
        return f"cannot read {path}: {error.strerror}", f"run meshd as the owner of {path.parent}"
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (
            f"{path} has mode {stat.S_IMODE(mode):04o}: others can read this node's private key",
            f"chmod 600 {path}",
        )
    return None


def _state_dir_problem(state_dir: Path) -> tuple[str, str] | None:
    mode = state_dir.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"{state_dir} has mode {stat.S_IMODE(mode):04o}: others can replace its files",
            f"chmod 700 {state_dir}",
        )
    return None


def _certificate_finding(cert_path: Path, state_dir: Path) -> Finding:
    from cryptography import x509

    from meshd.mesh import security

    restart = "restart the daemon: it issues a new certificate at start"
    try:
        certificate = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError) as error:
        return Finding("tls identity", "warn", f"{cert_path} is unreadable ({error})", restart)
    now = datetime.datetime.now(datetime.UTC)
    expires = certificate.not_valid_after_utc
    text = f"{cert_path}, valid until {expires:%Y-%m-%d}"
    if expires <= now or certificate.not_valid_before_utc > now:
        return Finding("tls identity", "fail", f"{text}: not valid now", restart)
    try:
        secret = security.load_secret(state_dir)
        if secret is not None:
            certificate.verify_directly_issued_by(security.mesh_ca_certificate(secret))
    except security.InsecureSecretFile:
        pass  # the mesh secret check says so
    except Exception:  # signed under another secret: peers of this mesh refuse it
        return Finding(
            "tls identity", "warn", f"{text}, but issued under another mesh secret", restart
        )
    return Finding("tls identity", "ok", text)


# ---------------------------------------------------------------- running the checks


CHECKS: dict[str, Callable[[Context], list[Finding]]] = {
    "daemon": check_daemon,
    "interfaces": check_interfaces,
    "multicast": check_multicast,
    "ports": check_ports,
    "firewall": check_firewall,
    "clock": check_clock,
    "blas": check_blas,
    "device": check_device,
    "memory": check_memory,
    "store": check_model_store,
    "service": check_service,
    "secret": check_secret,
    "identity": check_identity,
}


def run_checks(config: Config, names: Iterable[str] | None = None) -> list[Finding]:
    """Every check (or those named), in order; one that crashes is reported, not raised."""
    ctx = _context(config)
    findings: list[Finding] = []
    wanted = set(names or CHECKS)
    for name, check in CHECKS.items():
        if name not in wanted and name not in ("interfaces",):
            continue
        try:
            found = check(ctx)
        except Exception as error:  # a check's own bug must not hide the others' answers
            found = [Finding(name, "fail", f"the check itself failed: {error!r}")]
        if name in wanted:
            findings.extend(found)
    return findings


def _context(config: Config) -> Context:
    from meshd.api import client

    ctx = Context(config=config, interfaces=net.interface_states())
    try:
        ctx.status = client.fetch_status(config.api_address, timeout_s=DAEMON_TIMEOUT_S)
        ctx.models = client.list_models(config.api_address, timeout_s=DAEMON_TIMEOUT_S)
    except client.DaemonUnreachable:
        ctx.daemon_error = "not running, or not answering"
    return ctx


def _size(n: int) -> str:
    from partitioner.humanize import format_bytes

    return format_bytes(n)


def render_text(findings: list[Finding]) -> str:
    """A line per check, the fix under each that is not ok, and a count at the end."""
    width = max((len(f.check) for f in findings), default=0)
    lines = []
    for finding in findings:
        lines.append(f"{finding.status.upper():<4}  {finding.check:<{width}}  {finding.detail}")
        if finding.fix and finding.status in ("warn", "fail"):
            lines.append(f"{'':<4}  {'':<{width}}  fix: {finding.fix}")
    counts = {s: sum(f.status == s for f in findings) for s in ("fail", "warn", "ok", "skip")}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "\n".join(lines)


def exit_status(findings: list[Finding]) -> int:
    return 1 if any(f.status == "fail" for f in findings) else 0


# ---------------------------------------------------------------- the command line


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `meshd doctor` to the meshd command line."""
    doctor = subparsers.add_parser(
        "doctor",
        help="check what usually breaks a mesh on this machine and say how to fix it",
        description="Check interfaces, multicast, ports, firewall, clocks, BLAS, memory, the "
        "model store, the service and the mesh's secret and certificate, reading the same "
        "settings as `meshd run`. Exit status 1 when a check fails.",
    )
    doctor.add_argument(
        "--config", type=Path, help="TOML config file (default: <state-dir>/meshd.toml)"
    )
    add_setting_flags(doctor, SETTINGS_READ)
    doctor.add_argument(
        "--json", action="store_true", help="a list of {check, status, detail, fix}"
    )
    doctor.add_argument(
        "--check",
        action="append",
        choices=list(CHECKS),
        help="run only this check (repeatable)",
    )
    doctor.set_defaults(handler=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    config = load_config(flags_given(args), config_path=args.config)
    started = time.monotonic()
    findings = run_checks(config, args.check)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        print(f"meshd doctor: state {config.state_dir}, model store {config.model_store}")
        print(render_text(findings))
        print(f"({time.monotonic() - started:.1f} s)", file=sys.stderr)
    return exit_status(findings)
