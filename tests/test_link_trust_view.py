"""Link trust in the mesh view: what each node publishes, what the graph and the agreement
make of it, and the tensor-parallel group every member derives from the same states."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest

import partitioner
from meshd.agreement.service import state_digest
from meshd.inference.assignment import StageSpec
from meshd.inference.tensor_parallel.groups import (
    describe_groups,
    group_hosts,
    group_link,
    spec_for_stage,
)
from meshd.inference.tensor_parallel.spec import TensorParallelUnsupported, group_ports
from meshd.mesh import links
from meshd.mesh.graph import mesh_graph
from meshd.mesh.link_trust import mesh_link_verdict
from meshd.wire import pb

pytestmark = pytest.mark.unit

LAB = "10.9.0.0/24"
MARKED = f"network {LAB} marked trusted in the config"


def test_the_published_verdict_of_one_side_of_a_link() -> None:
    same_machine = mesh_link_verdict("127.0.0.1", "127.0.0.1")
    assert not same_machine.allowed and "share its cores" in same_machine.reason
    assert "127.0.0.0/8" in same_machine.reason  # what to add to allow it
    assert mesh_link_verdict("127.0.0.1", "127.0.0.1", ["127.0.0.0/8"]).allowed
    shared = mesh_link_verdict("10.9.0.1", "10.9.0.2")
    assert not shared.allowed and "shared network" in shared.reason
    marked = mesh_link_verdict("10.9.0.1", "10.9.0.2", [LAB])
    assert marked.allowed and "marked trusted" in marked.reason
    assert not mesh_link_verdict("10.9.0.1", "10.8.0.2", [LAB]).allowed  # the peer is outside
    assert not mesh_link_verdict("not-an-ip", "10.9.0.2", [LAB]).allowed


def measurement(src: str, dst: str, trusted: bool, *, reason: str = "") -> pb.LinkMeasurement:
    octet = {"a": 1, "b": 2, "c": 3}
    return pb.LinkMeasurement(
        src=src,
        dst=dst,
        latency_s=2e-5,
        tcp_rtt_s=4e-5,
        bandwidth=1.25e9,
        latency_bucket=-60,
        bandwidth_bucket=120,
        trusted=trusted,
        trust_reason=reason or (MARKED if trusted else "refused: shared network"),
        src_address=f"10.9.0.{octet[src]}",
        dst_address=f"10.9.0.{octet[dst]}",
    )


def states(trust: dict[tuple[str, str], bool], port: int = 41000) -> dict[str, pb.NodeState]:
    nodes = sorted({node for pair in trust for node in pair})
    out = {}
    for node in nodes:
        profile = pb.NodeProfile(
            node_id=node, memory_budget=8 << 30, flops=1e12, mem_bandwidth=1e11
        )
        own = [measurement(s, d, ok) for (s, d), ok in sorted(trust.items()) if s == node]
        out[node] = pb.NodeState(profile=profile, links=own, tensor_parallel_port=port)
    return out


def test_a_link_is_trusted_in_the_graph_only_when_both_sides_say_so() -> None:
    view = states({("a", "b"): True, ("b", "a"): True, ("a", "c"): True, ("c", "a"): False})
    graph = mesh_graph(view.values())
    assert graph.edges["a", "b"]["trusted"] and graph.edges["b", "a"]["trusted"]
    assert not graph.edges["a", "c"]["trusted"] and not graph.edges["c", "a"]["trusted"]


def test_trust_and_the_group_addresses_are_in_the_digest() -> None:
    base = states({("a", "b"): True, ("b", "a"): True})["a"]
    digest = state_digest(base)
    untrusted = pb.NodeState()
    untrusted.CopyFrom(base)
    untrusted.links[0].trusted = False
    moved = pb.NodeState()
    moved.CopyFrom(base)
    moved.links[0].dst_address = "10.9.0.77"
    other_port = pb.NodeState()
    other_port.CopyFrom(base)
    other_port.tensor_parallel_port = 42000
    assert len({digest, *(state_digest(s) for s in (untrusted, moved, other_port))}) == 4
    reworded = pb.NodeState()
    reworded.CopyFrom(base)
    reworded.links[0].trust_reason = "point-to-point link"  # words only: the same plan
    assert state_digest(reworded) == digest


def test_a_changed_verdict_is_published_and_two_probes_keep_the_newest() -> None:
    first = links.LinkSample(4e-5, 1e-3, 1.25e9, 1 << 20, 1.0, "10.9.0.1", "10.9.0.2", True, "ok")
    later = links.LinkSample(5e-5, 1e-3, 1.20e9, 1 << 20, 2.0, "10.9.0.1", "10.9.0.2", False, "no")
    published = links.with_planning_buckets(first.to_proto("a", "b"), None)
    fresh = links.with_planning_buckets(later.to_proto("a", "b"), published)
    assert links.worth_publishing(fresh, published)  # numbers within 10 %, verdict changed
    combined = links.better_of(first, later)
    assert combined.bandwidth == first.bandwidth and not combined.trusted
    assert combined.trust_reason == "no"


def test_every_member_derives_the_same_group_from_the_same_states(tmp_path: Path) -> None:
    trust = {(s, d): True for s in "abc" for d in "abc" if s != d}
    view = states(trust)
    stage = StageSpec("b", "10.9.0.2:52300", 0, 4, True, True, members=("b", "c"))
    assert group_hosts(stage.members, view) == {"b": "10.9.0.2", "c": "10.9.0.3"}
    assert group_link(stage.members, view).reason == MARKED
    spec = spec_for_stage(
        plan_id="p" * 64,
        stage_index=0,
        stage=stage,
        model_dir=tmp_path,
        states=view,
        mesh_secret=b"s" * 32,
    )
    ports, control = group_ports("p" * 64, 0, 2, 41000)  # rank 0's published range
    assert [(m.node_id, m.host, m.port) for m in spec.members] == [
        ("b", "10.9.0.2", ports[0]),
        ("c", "10.9.0.3", ports[1]),
    ]
    assert spec.control_port == control and spec.link == MARKED and spec.backend == "ring"

    view["c"].links[0].trusted = False  # c -> a: not in the group, no matter
    assert spec_for_stage(
        plan_id="p" * 64, stage_index=0, stage=stage, model_dir=tmp_path, states=view,
        mesh_secret=b"s" * 32,
    ) == spec  # fmt: skip
    view["c"].links[1].trusted = False  # c -> b
    view["c"].links[1].trust_reason = "refused: a shared network"
    with pytest.raises(TensorParallelUnsupported, match="c -> b refused: a shared network"):
        spec_for_stage(
            plan_id="p" * 64, stage_index=0, stage=stage, model_dir=tmp_path, states=view,
            mesh_secret=b"s" * 32,
        )  # fmt: skip


def test_the_status_of_a_planned_group(tmp_path: Path) -> None:
    view = states({("a", "b"): True, ("b", "a"): True})
    graph = mesh_graph(view.values())
    assert isinstance(graph, nx.DiGraph)
    model = partitioner.ModelSpec(
        name="m",
        layer_bytes=(1 << 20,) * 4,
        layer_params=(1 << 18,) * 4,
        embedding_bytes=1 << 20,
        head_bytes=1 << 20,
        tie_word_embeddings=False,
        kv_bytes_per_token_per_layer=1024,
        hidden_size=256,
        intermediate_size=512,
        vocab_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        activation_bytes=4,
        dtype="float32",
        context_length=256,
        supports_tensor_parallel=True,
        architecture="llama",
    )
    plan = partitioner.plan_model(graph, model, partitioner.PlanOptions(parallelism="tensor"))
    (group,) = describe_groups(plan, view)
    assert list(group.members) == list(plan.stages[0].nodes) and group.backend == "ring"
    assert group.link == MARKED and len(group.addresses) == 2
    assert all(address.startswith("10.9.0.") for address in group.addresses)
