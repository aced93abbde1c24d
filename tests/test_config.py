"""Configuration precedence: defaults < TOML file < environment < flags."""

from pathlib import Path

import pytest

from meshd.config import ConfigError, load_config


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
    ],
)
def test_bad_settings_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "meshd.toml").write_text(text + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config({"state_dir": tmp_path}, env={})


def test_missing_explicit_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config({"state_dir": tmp_path}, env={}, config_path=tmp_path / "nope.toml")
