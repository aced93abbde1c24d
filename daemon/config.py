"""Daemon configuration: defaults < config file (TOML) < environment < flags.

Each setting is declared once, as a field of `Config` made with `setting(...)`: its default,
its help text, how a raw value is read, and (only where the derived one does not fit) its
flag. Everything else derives from that declaration: the TOML key (`peer_port`), the
environment variable (`MESHD_PEER_PORT`), the flag (`--peer-port`), `meshd run --help`,
and the error that names a bad value and where it came from. Adding a setting is adding one
field.

Lists (`peers`, `interfaces`, `skip_interfaces`) are comma-separated in the environment,
arrays in TOML and repeatable flags. The config file is `<state_dir>/meshd.toml` unless
`--config` / `MESHD_CONFIG` names another; settings may sit at its top level or under a
`[meshd]` table.

Several daemons can run on one machine (tests, demos) by giving each its own state
directory: node id, mesh secret, certificates, profile cache, fetched model parts and the
local API socket all live there. Models live in one store per user (`model_store`), which
the user's daemons share.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partitioner.humanize import parse_fraction, parse_size
from partitioner.options import DEFAULT_MIN_GAIN

DEFAULT_PEER_PORT = 52300
DEFAULT_MESH_NAME = "home"
ENV_PREFIX = "MESHD_"
DEFAULT_HTTP = "127.0.0.1:52380"
DEFAULT_TENSOR_PARALLEL_PORT = 28400  # = meshd.inference.tensor_parallel.spec.DEFAULT_BASE_PORT
TENSOR_PARALLEL_PORT_MAX = 65535 - 1024
MAX_DRAFT_TOKENS = 16  # drafts per speculative step: beyond, a step costs more than guesses save


class ConfigError(ValueError):
    """A setting is malformed; the message names it and says what is expected."""


def default_state_dir() -> Path:
    """Per-user state directory (XDG on Linux, Application Support on macOS)."""
    if platform.system() == "Darwin":
        return Path.home() / "Library" / "Application Support" / "meshd"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "meshd"


def default_model_store() -> Path:
    """Per-user model store, shared by every daemon of the user (one copy of each model).

    systemd's `CacheDirectory=` (the system unit) wins, then XDG on Linux, Caches on macOS.
    """
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0])
    if platform.system() == "Darwin":
        return Path.home() / "Library" / "Caches" / "meshd"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshd"


# ---------------------------------------------------------------- how raw values are read


def _text(value: Any) -> str:
    return str(value)


def _optional_text(value: Any) -> str | None:
    return str(value) or None


def _path(value: Any) -> Path:
    return Path(str(value)).expanduser()


def _http_address(value: Any) -> str:
    from meshd.http.address import parse_http_setting  # the HTTP package owns its address rules

    return parse_http_setting(str(value))


def _origin_pattern(value: Any) -> str:
    from meshd.http.cors import parse_origin_pattern  # the HTTP package owns its origin rules

    return parse_origin_pattern(str(value))


def _port(value: Any) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise ValueError(f"{port} is not a TCP port")
    return port


def _network(value: Any) -> str:
    """A CIDR network ("192.168.7.0/24", "fd00::/64", "127.0.0.0/8"), normalised."""
    import ipaddress

    return str(ipaddress.ip_network(str(value).strip(), strict=False))


def _runner_port(value: Any) -> int:
    """The first port of the tensor-parallel runners' range (meshd.inference.tensor_parallel.
    spec: 64 slots of 16 ports each above it)."""
    port = int(value)
    if not 1024 <= port <= TENSOR_PARALLEL_PORT_MAX:
        raise ValueError(
            f"use 1024-{TENSOR_PARALLEL_PORT_MAX}: the runners use the 1024 ports from it"
        )
    return port


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("use true or false")


def _size(value: Any) -> int:
    return parse_size(value if isinstance(value, int) else str(value))


def _seconds(*, zero_ok: bool = False) -> Callable[[Any], float]:
    def read(value: Any) -> float:
        seconds = float(value)
        if not seconds >= 0 or (seconds == 0 and not zero_ok):
            raise ValueError("must be positive" if not zero_ok else "must be >= 0")
        return seconds

    return read


def _count(value: Any) -> int:
    count = int(value)
    if count < 1:
        raise ValueError("must be at least 1")
    return count


def _count_or_zero(value: Any) -> int:
    count = int(value)
    if count < 0:
        raise ValueError("must be 0 or more")
    return count


def _draft_count(value: Any) -> int:
    count = int(value)
    if not 0 <= count <= MAX_DRAFT_TOKENS:
        raise ValueError(f"must be between 0 (off) and {MAX_DRAFT_TOKENS}")
    return count


def _level(value: Any) -> str:
    level = str(value).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("use DEBUG, INFO, WARNING or ERROR")
    return level


# ---------------------------------------------------------------- the declaration


@dataclass(frozen=True)
class Setting:
    """How one `Config` field is read, documented and offered as a flag."""

    help: str
    read: Callable[[Any], Any] = _text
    flag: str = ""  # default: --name-with-dashes, without a trailing "_s" (seconds)
    metavar: str | None = None
    many: bool = False  # a list: repeatable flag, comma-separated env, TOML array
    choices: tuple[str, ...] = ()


def setting(default: Any, help: str, **how: Any) -> Any:
    """A `Config` field with its `Setting` (see the module docstring)."""
    meta = {"setting": Setting(help, **how)}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Config:
    """All settings of one daemon; each field is the one declaration of a setting."""

    state_dir: Path = setting(
        default_state_dir,
        "directory for node id, mesh secret, certificates, caches and the API socket",
        read=_path,
        metavar="DIR",
    )
    model_store: Path = setting(
        default_model_store,
        "directory of the model store, shared by this user's daemons (each model once per "
        "user; the state directory keeps only what belongs to one node)",
        read=_path,
        metavar="DIR",
    )
    name: str = setting(
        lambda: platform.node() or "meshd",
        "human label of this machine in the mesh (default: hostname)",
        metavar="NAME",
    )
    mesh_name: str = setting(
        DEFAULT_MESH_NAME,
        "name of the mesh to create when this daemon has no secret yet",
        metavar="NAME",
    )
    join_token: str | None = setting(
        None,
        "join token from `meshd token` on a member (joins that mesh)",
        read=_optional_text,
        flag="--join",
        metavar="TOKEN",
    )
    peer_host: str = setting(
        "0.0.0.0", "address the peer (mutual TLS) server binds to", metavar="HOST"
    )
    peer_port: int = setting(
        DEFAULT_PEER_PORT,
        "port of the peer server (0 picks a free one)",
        read=_port,
        metavar="PORT",
    )
    peer_handshake_timeout_s: float = setting(
        10.0,
        "a new connection to the peer port that has not completed its TLS handshake after this "
        "many seconds is closed",
        read=_seconds(),
        metavar="SECONDS",
    )
    lanes: bool = setting(
        True,
        "carry a plan's frames over lanes, direct mutual-TLS connections to the peers that are "
        "cheaper per frame than the peer port's gRPC streams (--no-lanes: only the peer port)",
        read=_flag,
    )
    lane_port: int = setting(
        None,  # resolved in __post_init__: the peer port + 1, so a firewall rule can name it
        "port the lanes listen on (default: the peer port + 1, or a free one when the peer "
        "port is 0; 0 picks a free one; peers learn it over the peer port); a peer that "
        "cannot reach it sends its frames over the peer port instead",
        read=_port,
        metavar="PORT",
    )
    api: str = setting(
        "",
        "local client API address: unix:/path or 127.0.0.1:PORT (default: socket in state dir)",
        metavar="ADDRESS",
    )
    http: str = setting(
        DEFAULT_HTTP,
        "HOST:PORT of the HTTP APIs (OpenAI, Anthropic, Ollama) and the dashboard, or off; any "
        "address but loopback needs an API key (`meshd api-key create`); port 0 picks one",
        read=_http_address,
        metavar="HOST:PORT",
    )
    cors_origins: list[str] = setting(
        list,
        "web origin whose pages may call the HTTP APIs from a browser (CORS), as "
        "SCHEME://HOST[:PORT] where * matches anything: http://localhost:*, app://*; * alone "
        "allows every site (repeatable; default: none, pages of other sites are refused)",
        read=_origin_pattern,
        flag="--cors-origin",
        metavar="ORIGIN",
        many=True,
    )
    interfaces: list[str] = setting(
        list,
        "interface name or IPv4 address to announce and browse on (repeatable; default: all "
        "non-loopback, non-container interfaces)",
        flag="--interface",
        metavar="IF",
        many=True,
    )
    skip_interfaces: list[str] = setting(
        list,
        "interface name or address never to announce on (repeatable)",
        flag="--skip-interface",
        metavar="IF",
        many=True,
    )
    mdns: bool = setting(
        True, "announce and browse with mDNS (--no-mdns: use --peer instead)", read=_flag
    )
    peers: list[str] = setting(
        list,
        "static peer to dial where multicast does not pass (repeatable)",
        flag="--peer",
        metavar="HOST:PORT",
        many=True,
    )
    device: str = setting(
        "auto",
        "device MLX computes on: auto (the GPU when MLX reports one: Apple silicon, or an "
        "NVIDIA GPU with meshd[cuda12]/[cuda13]; else the CPU), cpu, or gpu (refuses to start "
        "without one); on a host with several GPUs MLX uses GPU 0 of those CUDA_VISIBLE_DEVICES "
        "shows",
        choices=("auto", "cpu", "gpu"),
        metavar="DEVICE",
    )
    memory_budget: int | None = setting(
        None,
        "bytes this node's daemon may use in all (its process and a model), e.g. 300MB or 12GiB",
        read=_size,
        metavar="SIZE",
    )
    process_overhead: int | None = setting(
        None,
        "bytes of the budget the process itself holds beside the model; measured when not "
        "given (0: the whole budget is the model's, to simulate a small machine)",
        read=_size,
        metavar="SIZE",
    )
    heartbeat_interval_s: float = setting(
        0.2,
        "seconds between liveness beats while nothing changes (a change is sent at once)",
        read=_seconds(),
        metavar="SECONDS",
    )
    peer_timeout_s: float = setting(
        1.5,
        "a peer with no beat for this many seconds is lost",
        read=_seconds(),
        metavar="SECONDS",
    )
    link_probe_interval_s: float = setting(
        30.0,
        "seconds between re-measurements of each link",
        read=_seconds(),
        metavar="SECONDS",
    )
    join_stability_s: float = setting(
        0.5,
        "a new peer joins the plan after it has been alive this many seconds",
        read=_seconds(zero_ok=True),
        metavar="SECONDS",
    )
    startup_grace_s: float = setting(
        1.5,
        "a starting daemon listens this many seconds before proposing a plan",
        read=_seconds(zero_ok=True),
        metavar="SECONDS",
    )
    model: str | None = setting(
        None,
        "model to run: a model directory, a .gguf file, or a name in the model store",
        read=_optional_text,
        metavar="MODEL",
    )
    strategy: str = setting(
        "speed", "partition strategy", choices=("speed", "memory"), metavar="STRATEGY"
    )
    context_length: int | None = setting(
        None,
        "tokens of KV cache every node reserves per sequence",
        read=_count,
        metavar="N",
    )
    concurrency: int = setting(
        1,
        "sequences decoded at once (KV cache is reserved for each)",
        read=_count,
        metavar="N",
    )
    queue_limit: int = setting(
        64,
        "requests that may wait, in order, for KV memory on a plan's first stage when the "
        "plan's reserved KV (context length x concurrency) is taken; beyond: refused "
        "(HTTP 429, gRPC RESOURCE_EXHAUSTED)",
        read=_count,
        metavar="N",
    )
    draft_tokens: int = setting(
        0,
        "speculative decoding: tokens the first stage of a pipeline guesses per step for a "
        "greedy request decoding alone, from the prompt and the answer so far; the stages "
        "verify them in one pass and keep those greedy decoding gives (0: off)",
        read=_draft_count,
        metavar="N",
    )
    prefix_cache: bool = setting(
        True,
        "keep the KV of recent requests' prompts on every stage, so that a request that "
        "begins as an earlier one did (an agent's conversation so far) computes only the rest; "
        "it lives in the KV memory the plan reserves (--no-prefix-cache: off)",
        read=_flag,
    )
    speed_correction: bool = setting(
        True,
        "compare this node's decode steps with what its profile predicts and publish the "
        "ratio, so that plans use the speed it shows rather than the one it measured "
        "(--no-speed-correction: plan from the profile alone)",
        read=_flag,
    )
    prefix_cache_sequences: int = setting(
        0,
        "sequences of KV cache a plan this node selects reserves beyond --concurrency for the "
        "prefix cache: the conversations kept warm at once besides the running ones (the "
        "memory plan counts them)",
        read=_count_or_zero,
        metavar="N",
    )
    leave_grace_s: float = setting(
        10.0,
        "on SIGTERM or `meshd leave`: how long this node lets the mesh plan without it and "
        "its requests in flight move or finish before it exits (the one place this is set)",
        read=_seconds(zero_ok=True),
        metavar="SECONDS",
    )
    resume_timeout_s: float = setting(
        60.0,
        "how long a request whose plan lost a stage waits for the next plan to go on on "
        "(a refusal to run the model ends it at once)",
        read=_seconds(),
        metavar="SECONDS",
    )
    parallelism: str = setting(
        "auto",
        "kind of layout: auto takes the fastest predicted of one node, a pipeline, a "
        "tensor-parallel group or a hybrid; the others force that kind (where it cannot run, "
        "the best plan of another kind serves, and the plan's note says what is missing)",
        choices=("auto", "pipeline", "tensor", "hybrid"),
        metavar="KIND",
    )
    min_gain: float = setting(
        DEFAULT_MIN_GAIN,
        "what a node must add to join the plan: the fewest nodes whose predicted speed is "
        "within this fraction of the fastest layout are used (0.1 is 10%%; 0: the fastest); "
        "a node the model needs for memory is always used",
        read=parse_fraction,
        metavar="FRACTION",
    )
    tensor_parallel_trusted_networks: list[str] = setting(
        list,
        "network (CIDR) whose links may carry tensor-parallel traffic, which travels "
        "unencrypted: only a network nobody else uses, e.g. a lab switch (repeatable; "
        "point-to-point links such as a Thunderbolt bridge need no entry)",
        read=_network,
        flag="--tensor-parallel-trusted-network",
        metavar="CIDR",
        many=True,
    )
    tensor_parallel_port: int = setting(
        DEFAULT_TENSOR_PARALLEL_PORT,
        "first of the 1024 ports this node's tensor-parallel runners listen on for the "
        "groups it leads; keep them below the system's ephemeral ports (Linux 32768, macOS "
        "49152), which outgoing connections may hold when a runner starts",
        read=_runner_port,
        metavar="PORT",
    )
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR", read=_level, metavar="LEVEL")

    def __post_init__(self) -> None:
        if self.lane_port is None:
            self.lane_port = default_lane_port(self.peer_port)
        if self.heartbeat_interval_s >= self.peer_timeout_s:
            raise ConfigError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s:g} s) must be shorter than "
                f"peer_timeout_s ({self.peer_timeout_s:g} s), or every peer is taken for lost "
                "between two beats; lower the interval or raise the timeout"
            )

    @property
    def api_address(self) -> str:
        return self.api or f"unix:{self.state_dir / 'api.sock'}"


def default_lane_port(peer_port: int) -> int:
    """The lanes' port when none is set: next to the peer port, fixed so that a firewall rule
    can name it; a free one (0) when the peer port is chosen freely too, so that daemons
    started with --peer-port 0 on one machine do not compete for one lane port."""
    return peer_port + 1 if 0 < peer_port < 65535 else 0


def settings() -> dict[str, Setting]:
    """Every setting by name, in declaration order."""
    return {f.name: f.metadata["setting"] for f in dataclasses.fields(Config)}


def env_name(name: str) -> str:
    return f"{ENV_PREFIX}{name.upper()}"


def flag_name(name: str, how: Setting) -> str:
    return how.flag or "--" + name.removesuffix("_s").replace("_", "-")


# ---------------------------------------------------------------- flags for argparse


def add_setting_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """One flag per setting (all, or `names`), with help that names its env variable."""
    declared = settings()
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    for name in declared if names is None else names:
        how = declared[name]
        text = f"{how.help}: {', '.join(how.choices)}" if how.choices else how.help
        default = defaults[name]
        shown = "" if default in (None, "", dataclasses.MISSING) else f"default {default}, "
        text += f" [{shown}env {env_name(name)}]"
        options: dict[str, Any] = {"dest": name, "help": text, "default": None}
        if how.read is _flag:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["metavar"] = how.metavar or name.removesuffix("_s").upper()
            if how.many:
                options["action"] = "append"
            if how.choices:
                options["choices"] = how.choices
        parser.add_argument(flag_name(name, how), **options)


def flags_given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the user gave as flags (what `add_setting_flags` parsed), by name."""
    names = settings()
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


# ---------------------------------------------------------------- reading the sources


def _read(name: str, how: Setting, value: Any, origin: str) -> Any:
    """`value` as the setting's type; a bad one names the setting, the value and its origin."""
    if value is None:
        return None
    try:
        if how.many:
            items = value.split(",") if isinstance(value, str) else list(value)
            return [how.read(item.strip() if isinstance(item, str) else item) for item in items]
        read = how.read(value)
        if how.choices and read not in how.choices:
            raise ValueError(f"use {' or '.join(how.choices)}")
        return read
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"setting {name!r} has a bad value {value!r} (from {origin}): {exc}"
        ) from exc


def _from_mapping(source: Mapping[str, Any], origin: str) -> dict[str, Any]:
    declared = settings()
    values: dict[str, Any] = {}
    for key, raw in source.items():
        name = key.replace("-", "_")
        if name not in declared:
            raise ConfigError(
                f"unknown setting {key!r} in {origin}; known settings: "
                f"{', '.join(sorted(declared))}"
            )
        values[name] = _read(name, declared[name], raw, origin)
    return values


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, how in settings().items():
        raw = env.get(env_name(name))
        if raw:
            values[name] = _read(name, how, raw, f"environment {env_name(name)}")
    return values


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
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
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    flag_values = _from_mapping(given, "flags")
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
    return Config(**{**file_values, **env_values, **flag_values})
