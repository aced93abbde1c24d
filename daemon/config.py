"""Daemon configuration: defaults < config file (TOML) < environment < flags.

Every setting has one name used in all three places: `peer_port` in the TOML
file, `MESHD_PEER_PORT` in the environment, `--peer-port` on the command line.
Lists (`peers`, `interfaces`, `skip_interfaces`) are comma-separated in the
environment and repeatable on the command line. The config file is
`<state_dir>/meshd.toml` unless `--config` / `MESHD_CONFIG` names another.

Several daemons can run on one machine (tests, demos) by giving each its own
state directory: node id, mesh secret, certificates, profile cache and the
local API socket all live there.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PEER_PORT = 52300
DEFAULT_MESH_NAME = "home"
DEFAULT_HTTP = "127.0.0.1:52380"


class ConfigError(ValueError):
    """A setting is malformed; the message names it and says what is expected."""


def default_state_dir() -> Path:
    """Per-user state directory (XDG on Linux, Application Support on macOS)."""
    if platform.system() == "Darwin":
        return Path.home() / "Library" / "Application Support" / "meshd"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "meshd"


@dataclass
class Config:
    """All settings of one daemon. Field docs double as `meshd run --help` text."""

    state_dir: Path = field(default_factory=default_state_dir)
    name: str = field(default_factory=lambda: platform.node() or "meshd")
    mesh_name: str = DEFAULT_MESH_NAME
    join_token: str | None = None
    peer_host: str = "0.0.0.0"
    peer_port: int = DEFAULT_PEER_PORT
    api: str = ""  # "" means unix:<state_dir>/api.sock
    http: str = DEFAULT_HTTP  # "off" disables the HTTP APIs and the dashboard
    interfaces: list[str] = field(default_factory=list)
    skip_interfaces: list[str] = field(default_factory=list)
    mdns: bool = True
    peers: list[str] = field(default_factory=list)
    memory_budget: int | None = None
    heartbeat_interval_s: float = 0.2
    peer_timeout_s: float = 1.5
    link_probe_interval_s: float = 30.0
    join_stability_s: float = 0.5
    startup_grace_s: float = 1.5
    model: str | None = None
    strategy: str = "speed"
    context_length: int | None = None
    concurrency: int = 1
    log_level: str = "INFO"

    @property
    def api_address(self) -> str:
        return self.api or f"unix:{self.state_dir / 'api.sock'}"


FIELD_HELP: dict[str, str] = {
    "state_dir": "directory for node id, mesh secret, certificates, caches and the API socket",
    "name": "human label of this machine in the mesh (default: hostname)",
    "mesh_name": "name of the mesh to create when this daemon has no secret yet",
    "join_token": "join token from `meshd token` on a member (joins that mesh)",
    "peer_host": "address the peer (mutual TLS) server binds to",
    "peer_port": "port of the peer server (0 picks a free one)",
    "api": "local client API address: unix:/path or 127.0.0.1:PORT (default: socket in state dir)",
    "http": "HOST:PORT of the HTTP APIs (OpenAI, Anthropic, Ollama) and the dashboard, or off; "
    "any address but loopback needs an API key (`meshd api-key create`); port 0 picks one",
    "interfaces": "interface names or IPv4 addresses to announce and browse on (default: all "
    "non-loopback, non-container interfaces)",
    "skip_interfaces": "interface names or addresses never to announce on",
    "mdns": "announce and browse with mDNS (disable with --no-mdns and use --peer)",
    "peers": "static peer host:port to dial (networks where multicast does not pass)",
    "memory_budget": "bytes this node may use for a model, e.g. 300MB or 12GiB",
    "heartbeat_interval_s": "seconds between liveness beats",
    "peer_timeout_s": "a peer with no beat for this long is lost",
    "link_probe_interval_s": "seconds between re-measurements of each link",
    "join_stability_s": "a new peer joins the plan after it has been alive this long",
    "startup_grace_s": "a starting daemon listens this long before proposing a plan",
    "model": "model to run: a model directory, or a name in the model store",
    "strategy": "partition strategy: speed (default) or memory",
    "context_length": "tokens of KV cache every node reserves per sequence",
    "concurrency": "sequences decoded at once (KV cache is reserved for each)",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
}

LIST_FIELDS = ("interfaces", "skip_interfaces", "peers")


def _coerce(name: str, value: Any) -> Any:
    """Convert a raw setting (TOML value, env string, flag) to the field's type."""
    from meshd.units import parse_size

    if value is None:
        return None
    try:
        if name == "state_dir":
            return Path(value).expanduser()
        if name in LIST_FIELDS:
            if isinstance(value, str):
                return [part.strip() for part in value.split(",") if part.strip()]
            return [str(item) for item in value]
        if name == "memory_budget":
            return parse_size(str(value)) if isinstance(value, str) else int(value)
        if name == "peer_port":
            port = int(value)
            if not 0 <= port <= 65535:
                raise ValueError(f"{port} is not a TCP port")
            return port
        if name == "http":
            from meshd.http.address import parse_http_setting

            return parse_http_setting(str(value))
        if name == "mdns":
            if isinstance(value, bool):
                return value
            return str(value).strip().lower() in ("1", "true", "yes", "on")
        if name.endswith("_s"):
            seconds = float(value)
            if seconds < 0 or (
                seconds == 0 and name not in ("join_stability_s", "startup_grace_s")
            ):
                raise ValueError("must be positive")
            return seconds
        if name in ("context_length", "concurrency"):
            count = int(value)
            if count < 1:
                raise ValueError("must be at least 1")
            return count
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"setting {name!r} has a bad value {value!r}: {exc}") from exc


def _from_mapping(source: Mapping[str, Any], origin: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(Config)}
    values: dict[str, Any] = {}
    for key, raw in source.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(
                f"unknown setting {key!r} in {origin}; known settings: {', '.join(sorted(known))}"
            )
        values[name] = _coerce(name, raw)
    return values


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Config):
        raw = env.get(f"MESHD_{f.name.upper()}")
        if raw is not None and raw != "":
            values[f.name] = _coerce(f.name, raw)
    return values


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    # Settings may sit at the top level or under a [meshd] table.
    if isinstance(data.get("meshd"), dict):
        data = {**{k: v for k, v in data.items() if k != "meshd"}, **data["meshd"]}
    return _from_mapping(data, str(path))


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_path: Path | None = None,
) -> Config:
    """Merge defaults, the config file, the environment and flags (in that order).

    `flags` holds only options the user actually gave (None values are ignored).
    The state directory is resolved first, since the config file lives in it.
    """
    env = os.environ if env is None else env
    flag_values = _from_mapping({k: v for k, v in (flags or {}).items() if v is not None}, "flags")
    env_values = _from_env(env)
    state_dir = flag_values.get("state_dir") or env_values.get("state_dir") or default_state_dir()
    path = config_path or (Path(env["MESHD_CONFIG"]) if env.get("MESHD_CONFIG") else None)
    if path is None:
        path = Path(state_dir) / "meshd.toml"
        file_values = _read_toml(path) if path.exists() else {}
    elif not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    else:
        file_values = _read_toml(path)
    merged = {**file_values, **env_values, **flag_values}
    return Config(**merged)
