"""The agreement runtime's pure helpers: which nodes are still measuring their links."""

from __future__ import annotations

import pytest

from meshd.agreement import service as planning
from meshd.wire import pb

pytestmark = pytest.mark.unit


def state(node: str, *measured: str) -> pb.NodeState:
    links = [pb.LinkMeasurement(src=node, dst=dst, bandwidth=1e9) for dst in measured]
    return pb.NodeState(profile=pb.NodeProfile(node_id=node), links=links)


def test_nodes_missing_a_link_to_a_recent_joiner_are_settling() -> None:
    alive_since = {"a": 0.0, "b": 0.0, "c": 9.5}
    states = {"a": state("a", "b"), "b": state("b", "a", "c"), "c": state("c", "a")}
    assert planning.settling_nodes(states, alive_since, now=10.0) == {"a", "c"}


def test_a_node_with_no_state_yet_is_settling() -> None:
    alive_since = {"a": 0.0, "b": 9.0}
    assert planning.settling_nodes({"a": state("a", "b")}, alive_since, now=10.0) == {"b"}


def test_a_fully_measured_mesh_is_not_settling() -> None:
    alive_since = {"a": 0.0, "b": 9.9}
    states = {"a": state("a", "b"), "b": state("b", "a")}
    assert planning.settling_nodes(states, alive_since, now=10.0) == set()


def test_a_link_that_cannot_be_measured_stops_holding_after_the_bound() -> None:
    alive_since = {"a": 0.0, "b": 0.0, "c": 5.0}
    states = {"a": state("a", "b"), "b": state("b", "a", "c"), "c": state("c", "a", "b")}
    bound = planning.settle_bound_s(2)
    assert planning.settling_nodes(states, alive_since, now=5.0 + bound - 0.1) == {"a"}
    assert planning.settling_nodes(states, alive_since, now=5.0 + bound) == set()


def test_the_bound_grows_with_the_peers_to_measure() -> None:
    assert planning.settle_bound_s(1) < planning.settle_bound_s(3) < planning.settle_bound_s(15)
