"""Configuration precedence: defaults < TOML file < environment < flags."""

from pathlib import Path

import pytest

from meshd.config import (
    Config,
    ConfigError,
    env_name,
    flag_name,
    flags_given,
    load_config,
    settings,
)

pytestmark = pytest.mark.unit


def test_precedence(tmp_path: Path) -> None:
    (tmp_path / "meshd.toml").write_text(
        'peer_port = 1111\nname = "from-file"\nmemory_budget = "2GB"\npeers = ["10.0.0.1:1"]\n'
    )
    env = {"MESHD_STATE_DIR": str(tmp_path), "MESHD_PEER_PORT": "2222", "MESHD_PEERS": "a:1, b:2"}
    config = load_config({"peer_port": 3333}, env=env)
    assert config.state_dir == tmp_path
    assert config.peer_port == 3333  # flag beats env beats file
    assert config.name == "from-file"  # only the file sets it
    assert config.memory_budget == 2_000_000_000
    assert config.peers == ["a:1", "b:2"]  # env beats file
    config = load_config({}, env={"MESHD_STATE_DIR": str(tmp_path)})
    assert config.peer_port == 1111
    assert config.api_address == f"unix:{tmp_path / 'api.sock'}"


def test_meshd_table_and_explicit_file(tmp_path: Path) -> None:
    path = tmp_path / "other.toml"
    path.write_text('[meshd]\nmesh_name = "lab"\nmdns = false\n')
    config = load_config({"state_dir": tmp_path}, env={}, config_path=path)
    assert config.mesh_name == "lab" and config.mdns is False


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("peer_port = 70000", "not a TCP port"),
        ("colour = 'blue'", "unknown setting 'colour'"),
        ("memory_budget = 'lots'", "memory_budget"),
        ("peer_timeout_s = -1", "must be positive"),
        ("peer_port = ", "not valid TOML"),
        ("tensor_parallel_trusted_networks = ['10.0.0.0/33']", "tensor_parallel_trusted_networks"),
        ("tensor_parallel_port = 65000", "the runners use the 1024 ports"),
        ("parallelism = 'both'", "auto or pipeline or tensor or hybrid"),
        ("draft_tokens = 17", "between 0 .off. and 16"),
        ("draft_tokens = -1", "between 0 .off. and 16"),
        ("heartbeat_interval_s = 2", r"heartbeat_interval_s \(2 s\) must be shorter than peer_"),
        ("cors_origins = ['localhost:3000']", "'localhost:3000' is not a web origin"),
        ("cors_origins = ['http://x.test/app']", "SCHEME://HOST"),
    ],
)
def test_bad_settings_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "meshd.toml").write_text(text + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config({"state_dir": tmp_path}, env={})


def test_missing_explicit_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config({"state_dir": tmp_path}, env={}, config_path=tmp_path / "nope.toml")


def _run_parser():
    from meshd.api.cli import build_parser

    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command")
    return parser, subcommands.choices["run"]


def test_every_setting_is_one_declaration_read_alike_from_each_source(tmp_path: Path) -> None:
    """A value given as a flag, in the environment or in the file reads the same."""
    parser, run = _run_parser()
    help_text = run.format_help()
    samples = {
        "peer_port": "7000",
        "memory_budget": "1.5GiB",
        "peers": "a:1,b:2",
        "mdns": "false",
        "peer_timeout_s": "2.5",
        "strategy": "memory",
        "log_level": "debug",
        "parallelism": "hybrid",
        "tensor_parallel_trusted_networks": "10.0.7.0/24,fd00::/64",
        "tensor_parallel_port": "40000",
        "cors_origins": "http://localhost:*,app://*",
    }
    for name, how in settings().items():
        assert flag_name(name, how) in help_text and env_name(name) in help_text, name
    for name, raw in samples.items():
        how = settings()[name]
        flag = flag_name(name, how)
        if name == "mdns":  # a boolean: --mdns / --no-mdns
            argv = [f"--no-{flag.removeprefix('--')}"]
        elif how.many:
            argv = [arg for item in raw.split(",") for arg in (flag, item)]
        else:
            argv = [flag, raw]
        args = parser.parse_args(["run", "--state-dir", str(tmp_path), *argv])
        from_flag = getattr(load_config(flags_given(args), env={}), name)
        from_env = getattr(load_config({"state_dir": tmp_path}, env={env_name(name): raw}), name)
        toml = tmp_path / f"{name}.toml"
        toml.write_text(f"{name} = {raw.split(',') if how.many else repr(raw)}\n".replace("'", '"'))
        from_file = getattr(load_config({"state_dir": tmp_path}, env={}, config_path=toml), name)
        assert from_flag == from_env == from_file != getattr(Config(), name), name


def test_a_bad_value_names_the_setting_and_where_it_came_from(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"'strategy'.*'fastest'.*MESHD_STRATEGY.*speed or memory"
    ):
        load_config({"state_dir": tmp_path}, env={"MESHD_STRATEGY": "fastest"})
