"""Operator mistakes a daemon must survive: a taken peer port, a second daemon on one state
directory, a model imported twice. Real daemon processes on loopback (no mDNS)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from meshd.api import client

pytestmark = pytest.mark.integration

LOOPBACK = ["--no-mdns", "--peer-host", "127.0.0.1"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_second_daemon_on_a_taken_peer_port_fails_to_start(daemons) -> None:
    port = free_port()
    first = daemons([*LOOPBACK, "--peer-port", str(port)])
    first.wait_ready()
    second = daemons([*LOOPBACK, "--peer-port", str(port)])
    assert second.proc is not None
    code = second.proc.wait(30)
    assert code == 2, second.log_tail()
    log = second.log_tail()
    assert f"cannot listen for peers on 127.0.0.1:{port}: the port is in use" in log, log
    assert "Traceback" not in log, log
    status = first.status()
    assert status.peer_address.endswith(f":{port}")  # the first one is untouched
    lane_port = int(status.lane_address.rpartition(":")[2])  # its lanes listen elsewhere
    assert status.lane_address.startswith("127.0.0.1:") and lane_port not in (0, port)


def test_a_taken_lane_port_stops_the_daemon_with_the_fix(daemons) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = daemons([*LOOPBACK, "--peer-port", "0", "--lane-port", str(port)])
        assert daemon.proc is not None
        code = daemon.proc.wait(30)
    log = daemon.log_tail()
    assert code == 2, log
    assert f"cannot listen for lanes on 127.0.0.1:{port}" in log, log
    assert "give this daemon another --lane-port" in log and "Traceback" not in log, log


def test_second_daemon_on_one_state_dir_leaves_the_running_one_alone(daemons, tmp_path) -> None:
    state = tmp_path / "shared-state"
    first = daemons([*LOOPBACK, "--peer-port", "0"], state_dir=state)
    node_id = first.wait_ready().node_id
    socket_path = state / "api.sock"
    inode = socket_path.stat().st_ino
    second = daemons([*LOOPBACK, "--peer-port", "0"], state_dir=state, start=False)
    second.log_path = tmp_path / "second.log"
    second.start()
    assert second.proc is not None
    assert second.proc.wait(30) == 3
    log = second.log_tail()
    assert "another meshd (pid" in log and str(state) in log, log
    assert "Traceback" not in log, log
    time.sleep(0.2)
    assert socket_path.stat().st_ino == inode, "the running daemon's API socket was replaced"
    assert client.fetch_status(first.api, 3.0).node_id == node_id


def test_daemons_of_one_user_share_one_model_store(daemons, tiny_llama, model_store) -> None:
    """A model in the user's store is loaded by name by any of the user's daemons (no copy in
    a state directory), and a daemon's state directory holds only per-node files."""
    from meshd.models.store import ModelStore
    from meshd.models.tokenizer_cache import TOKENIZERS_FOLDER, tokenizer_key
    from meshd.runtime.import_tables import IMPORT_TABLES_FOLDER
    from meshd.wire import pb

    entry = ModelStore(model_store).import_mlx_dir(tiny_llama, name="shared-tiny")
    nodes = [daemons([*LOOPBACK, "--peer-port", "0"]) for _ in range(2)]
    for node in nodes:
        node.wait_ready()
        reply = client.load_model(node.api, pb.LoadModelRequest(model="shared-tiny"))
        assert reply.model == "shared-tiny"
        listed = client.list_models(node.api)
        # The store is the session's, shared with other tests' daemons: other models may be in it.
        shared = [m for m in listed.models if m.name == "shared-tiny"]
        assert [m.path for m in shared] == [str(entry.path)]
        assert not (node.state_dir / "models").exists(), "a model store in the state directory"
    # A daemon that loaded a model keeps transformers' import table in the store, for the
    # user's next daemon and its runners (meshd.runtime.import_tables), and a daemon that
    # served it keeps its tokenizer there (meshd.models.tokenizer_cache).
    assert list((model_store / IMPORT_TABLES_FOLDER).glob("imports-*.json"))
    request = pb.GenerateRequest(prompt="Hello", sampling=pb.Sampling(max_tokens=2))
    assert list(client.stream_generation(nodes[0].api, request, timeout_s=60))[-1].done
    eos = json.loads((entry.path / "config.json").read_text()).get("eos_token_id")
    kept = model_store / TOKENIZERS_FOLDER / f"tokenizer-{tokenizer_key(entry.path, eos)}.pickle"
    assert kept.is_file()
