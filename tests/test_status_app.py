"""The status app's presenter (meshd.app.status_model): menus from hand-built statuses, a feed
that follows real loopback daemons through joins, shutdown and restart, a hung daemon, and
`meshd app --terminal` as a subprocess stopped with Ctrl-C.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from meshd.app import status_model as sm
from meshd.app import terminal
from meshd.wire import pb, rpc

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]


# ---------------------------------------------------------------- hand-built statuses

PLAN_ID = "4684ce85" + "0" * 56


def _peer(node_id: str, *, alive: bool = True, source: str = "mdns", seen: float = 0.2):
    profile = pb.NodeProfile(
        node_id=node_id, name=node_id.split("-")[0], memory_budget=8 * 2**30, flops=155e9
    )
    return pb.PeerStatus(profile=profile, alive=alive, source=source, last_seen_s=seen)


def _status(agreement: pb.AgreementStatus, *, lost_peer: bool = False) -> pb.MeshStatus:
    nodes = [_peer("alpha-00000001", source="self"), _peer("beta-00000002")]
    if lost_peer:
        nodes.append(_peer("gamma-00000003", alive=False, seen=12.4))
    events = [f"10:00:0{i} event {i}" for i in range(5)]
    return pb.MeshStatus(
        node_id="alpha-00000001", mesh_name="home", nodes=nodes, events=events, agreement=agreement
    )


def _plan_json() -> str:
    stages = [
        {"nodes": ["alpha-00000001"], "layer_start": 0, "layer_end": 15},
        {"nodes": ["beta-00000002"], "layer_start": 15, "layer_end": 30},
    ]
    return json.dumps({"plan_id": PLAN_ID, "stages": stages, "prediction": {"tokens_per_s": 12.34}})


def _committed(**overrides: object) -> pb.AgreementStatus:
    fields: dict[str, object] = {
        "model": "SmolLM2-135M-Instruct",
        "active_plan_id": PLAN_ID,
        "members": ["alpha-00000001", "beta-00000002"],
        "confirmed_by": ["alpha-00000001", "beta-00000002"],
        "committed_by": ["alpha-00000001", "beta-00000002"],
        "converged": True,
        "plan_json": _plan_json(),
    }
    return pb.AgreementStatus(**{**fields, **overrides})


REFUSAL = (
    "not enough memory in this mesh for big-70b: need 40.0 GiB, have 16.0 GiB "
    "(missing 24.0 GiB); split by memory\nover budget in a memory-proportional split:\n"
    "  alpha-00000001  needs 12.0 GiB more\noptions: add a node or memory"
)


def test_committed_plan_shows_model_plan_layers_and_a_lost_peer() -> None:
    menu = sm.menu_from_status(_status(_committed(), lost_peer=True))
    assert menu.state is sm.MeshState.READY
    assert menu.title == "◉ 2 · SmolLM2-135M-Inst…"
    assert menu.items[0] == "mesh home · 2 nodes alive · 1 lost"
    assert "plan 4684ce85 · 2 stages · ~12.3 tok/s predicted" in menu.items
    assert (
        "● alpha-00000001 (alpha) · 8 GiB budget · 155 GFLOP/s · layers 0-14 · this node"
        in menu.items
    )
    beta = "● beta-00000002 (beta) · 8 GiB budget · 155 GFLOP/s · layers 15-29 · seen 0.2 s ago"
    assert beta in menu.items
    assert any(i.startswith("○ gamma-00000003") and "lost, last seen 12 s" in i for i in menu.items)
    assert [i for i in menu.items if i.startswith("recent:")] == [
        f"recent: 10:00:0{i} event {i}" for i in (2, 3, 4)
    ]
    assert not any(i.startswith(("converging", "refused")) for i in menu.items)


def test_refused_plan_says_why_in_one_line_without_repeating_it_as_converging() -> None:
    view = pb.AgreementStatus(
        model="big-70b",
        refusal=REFUSAL,
        reason=f"peer beta-00000002 joined 0.1 s ago; {REFUSAL}",
        proposal_plan_id="",
    )
    menu = sm.menu_from_status(_status(view))
    assert menu.state is sm.MeshState.REFUSED
    assert menu.title == "⊘ 2 · refused"
    refused = [i for i in menu.items if i.startswith("refused:")]
    assert refused == [
        "refused: not enough memory in this mesh for big-70b: need 40.0 GiB, have 16.0 GiB "
        "(missing 24.0 GiB…"
    ]
    assert [i for i in menu.items if i.startswith("converging:")] == [
        "converging: peer beta-00000002 joined 0.1 s ago"
    ]
    assert all("\n" not in i and len(i) <= sm.MAX_ITEM_CHARS for i in menu.items)


def test_converging_lists_the_reasons_and_cuts_a_long_list() -> None:
    reasons = [f"waiting for the profile of peer p{i}" for i in range(5)]
    view = pb.AgreementStatus(model="m", reason="; ".join(reasons))
    menu = sm.menu_from_status(_status(view))
    assert menu.state is sm.MeshState.CONVERGING
    assert menu.title == "◌ 2 · converging"
    assert [i for i in menu.items if i.startswith("converging:")] == [
        "converging: waiting for the profile of peer p0",
        "converging: waiting for the profile of peer p1",
        "converging: and 3 more",
    ]
    assert not any(i.startswith("plan ") for i in menu.items)


@pytest.mark.parametrize(
    ("view", "state", "title"),
    [
        (pb.AgreementStatus(reason="no model selected"), "NO_MODEL", "○ 2 · no model"),
        (_committed(converged=False, reason="peer x joined"), "UPDATING", "◐ 2 · re-planning"),
        (_committed(model="tiny"), "READY", "◉ 2 · tiny"),
    ],
)
def test_titles_of_each_state(view: pb.AgreementStatus, state: str, title: str) -> None:
    menu = sm.menu_from_status(_status(view))
    assert (menu.state, menu.title) == (sm.MeshState[state], title)
    assert "converging: no model selected" not in menu.items


def test_unreadable_plan_json_still_gives_a_plan_line() -> None:
    menu = sm.menu_from_status(_status(_committed(plan_json="{not json")))
    assert "plan 4684ce85 · 2 nodes" in menu.items
    assert not any("layers" in i for i in menu.items)


def test_unreachable_menu_and_terminal_rendering() -> None:
    menu = sm.menu_unreachable("UNAVAILABLE: refused\nAPI address: unix:/x")
    assert menu.state is sm.MeshState.UNREACHABLE and menu.title == "✕ meshd"
    assert menu.items[1:3] == ("UNAVAILABLE: refused", "API address: unix:/x")
    text = terminal.render(sm.Menu("◉ 1 · m", ("a", sm.SEPARATOR, "b"), sm.MeshState.READY), 0)
    assert text.splitlines()[:5] == ["◉ 1 · m", "", "  a", "", "  b"]


# ---------------------------------------------------------------- the feed against daemons


class MenuRecorder:
    """Collects the feed's menus (from its thread) and waits for one that matches."""

    def __init__(self) -> None:
        self.menus: list[sm.Menu] = []
        self._changed = threading.Condition()

    def add(self, menu: sm.Menu) -> None:
        with self._changed:
            self.menus.append(menu)
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[sm.Menu], bool], timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not (self.menus and predicate(self.menus[-1])):
                left = deadline - time.monotonic()
                if left <= 0:
                    last = self.menus[-1] if self.menus else None
                    raise AssertionError(f"no menu with {what} within {timeout_s} s; last: {last}")
                self._changed.wait(left)
            return self.menus[-1]


def _mentions(node_id: str) -> Callable[[sm.Menu], bool]:
    return lambda menu: any(node_id in item for item in menu.items)


def test_feed_follows_joins_shutdown_and_restart(daemons, mesh_token) -> None:
    args = [*LOOPBACK, "--join", mesh_token]
    a = daemons(args)
    a_id = a.wait_ready().node_id
    recorder = MenuRecorder()
    feed = sm.StatusFeed(a.api, recorder.add, retry_min_s=0.2, retry_max_s=1.0)
    with feed:
        menu = recorder.wait_for(_mentions(a_id), 5, f"node {a_id}")
        assert (menu.state, menu.title) == (sm.MeshState.NO_MODEL, "○ 1 · no model")

        b = daemons(args)
        b_id = b.wait_ready().node_id
        menu = recorder.wait_for(lambda m: "2 nodes alive" in m.items[0], 10, "2 nodes alive")
        assert _mentions(b_id)(menu) and menu.title == "○ 2 · no model"

        a.terminate()
        b.terminate()
        menu = recorder.wait_for(lambda m: m.state is sm.MeshState.UNREACHABLE, 5, "unreachable")
        assert menu.items[1].startswith(("UNAVAILABLE", "CANCELLED")), menu
        assert menu.items[2].startswith(f"API address: {a.api[:40]}"), menu
        attempts = feed.attempts
        time.sleep(2.0)
        # Backoff 0.2, 0.4, 0.8, 1.0 s: a few attempts, no busy loop, and still trying.
        assert 2 <= feed.attempts - attempts <= 6
        assert feed.running

        daemons(args, state_dir=a.state_dir)  # the same node comes back
        menu = recorder.wait_for(_mentions(a_id), 10, f"node {a_id} after its restart")
        assert menu.state is not sm.MeshState.UNREACHABLE
    assert not feed.running


class SilentLocal(rpc.LocalServicer):
    """A daemon that accepts WatchStatus and then never answers (hung)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def WatchStatus(self, request: pb.WatchStatusRequest, context: grpc.ServicerContext):
        self.release.wait(10)
        return iter(())


@pytest.fixture
def silent_daemon(tmp_path: Path) -> Iterator[str]:
    servicer = SilentLocal()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rpc.add_LocalServicer_to_server(servicer, server)
    address = f"unix:{tmp_path / 'silent.sock'}"
    server.add_insecure_port(address)
    server.start()
    yield address
    servicer.release.set()
    server.stop(0).wait(5)


def test_feed_gives_up_on_a_silent_stream_and_says_so(silent_daemon: str) -> None:
    recorder = MenuRecorder()
    with sm.StatusFeed(silent_daemon, recorder.add, stall_s=1.0, retry_min_s=5.0) as feed:
        menu = recorder.wait_for(lambda m: m.state is sm.MeshState.UNREACHABLE, 4, "a stall")
        assert menu.items[1] == "the daemon sent no status for 1 s (hung or overloaded?)", menu
        assert feed.attempts == 1
    assert not feed.running


# ---------------------------------------------------------------- the terminal front end


def _read_until(proc: subprocess.Popen[bytes], needle: bytes, timeout_s: float) -> bytes:
    """Read the process's stdout until `needle` appears or time runs out."""
    assert proc.stdout is not None
    out = b""
    deadline = time.monotonic() + timeout_s
    while needle not in out and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
    return out


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_terminal_front_end_draws_the_node_and_stops_on_ctrl_c(daemons, mesh_token, stop) -> None:
    daemon = daemons([*LOOPBACK, "--join", mesh_token])
    node_id = daemon.wait_ready().node_id
    command = [
        sys.executable,
        "-m",
        "meshd",
        "app",
        "--terminal",
        "--state-dir",
        str(daemon.state_dir),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out = _read_until(proc, node_id.encode(), timeout_s=10)
        proc.send_signal(stop)
        rest, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    text = (out + rest).decode()
    assert node_id in text and "○ 1 · no model" in text, text
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err, err.decode()


def test_a_committed_plan_is_loading_until_this_nodes_stages_are_loaded() -> None:
    """A plan is committed seconds before its stages are read: serving means loaded here."""
    status = _status(_committed(model="tiny"))
    status.transitions.moving = "loading plan 4684ce85: layers 0-14"
    status.transitions.active_plan_loaded = False
    menu = sm.menu_from_status(status)
    assert (menu.state, menu.title) == (sm.MeshState.LOADING, "◔ 2 · loading")
    assert "loading plan 4684ce85: layers 0-14" in menu.items
    status.transitions.active_plan_loaded = True
    status.transitions.moving = ""
    menu = sm.menu_from_status(status)
    assert (menu.state, menu.title) == (sm.MeshState.READY, "◉ 2 · tiny")
    assert not any(item.startswith("loading") for item in menu.items)
    status.transitions.ClearField("active_plan_loaded")  # a daemon from before the field
    assert sm.menu_from_status(status).state is sm.MeshState.READY
