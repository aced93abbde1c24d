"""The pure parts of tensor parallelism: the spec derived from a plan, the link rule, frames."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from pathlib import Path

import mlx.core as mx
import pytest

from meshd.inference.tensor_parallel import (
    LinkFacts,
    TensorParallelSpec,
    TensorParallelUnsupported,
    build_group_spec,
    check_tensor_parallel,
    collective_link_verdict,
    describe_local_link,
    group_link_verdict,
    supports_tensor_parallel,
    tensor_parallel_refusal,
)
from meshd.inference.tensor_parallel.spec import (
    PORT_SLOTS,
    PORT_STRIDE,
    backend_files_and_env,
    even_expert_ranges,
    group_ports,
    group_token,
    proportional_expert_ranges,
)
from meshd.inference.tensor_parallel.wire import (
    FrameError,
    check_array,
    encode_frame,
    from_mx,
    read_frame_async,
    recv_frame,
    send_frame,
    to_mx,
)
from meshd.mesh.link_trust import interface_is_point_to_point, thunderbolt_devices

pytestmark = pytest.mark.unit

PLAN = "3f" * 32
SECRET = b"s" * 32


def spec_for(nodes=("m1", "m2"), addresses=None, **overrides) -> TensorParallelSpec:
    values = {
        "plan_id": PLAN,
        "stage_index": 1,
        "stage_nodes": list(nodes),
        "layer_start": 10,
        "layer_end": 20,
        "has_embedding": False,
        "has_head": True,
        "model_dir": "/models/x",
        "addresses": addresses or {"m1": "10.0.0.1", "m2": "10.0.0.2", "m3": "10.0.0.3"},
        "link": "point-to-point link on thunderbolt0 to 10.0.0.2",
        "mesh_secret": SECRET,
    }
    values.update(overrides)
    return build_group_spec(**values)


# --- The spec -----------------------------------------------------------------------------------


def test_every_member_derives_the_same_spec_from_the_plan() -> None:
    """Same plan, same addresses: the same spec, whatever order the addresses came in."""
    one = spec_for()
    other = spec_for(addresses={"m2": "10.0.0.2", "m3": "10.0.0.3", "m1": "10.0.0.1"})
    assert one == other and one.to_json() == other.to_json()
    assert [m.node_id for m in one.members] == ["m1", "m2"]  # rank = plan order
    assert one.rank_of("m2") == 1
    with pytest.raises(KeyError, match="not a member"):
        one.rank_of("m3")
    assert one.hostfile() == [
        [f"10.0.0.1:{one.members[0].port}"],
        [f"10.0.0.2:{one.members[1].port}"],
    ]
    assert TensorParallelSpec.from_json(one.to_json()) == one
    assert "token" not in one.public_dict() and "token" not in repr(one)


def test_ports_are_distinct_per_stage_and_rank_and_derived_from_the_plan() -> None:
    ranks0, control0 = group_ports(PLAN, 0, 4, 50000)
    ranks1, control1 = group_ports(PLAN, 1, 4, 50000)
    assert len({*ranks0, control0, *ranks1, control1}) == 10
    assert all(50000 <= p < 50000 + PORT_STRIDE * PORT_SLOTS for p in (*ranks0, control1))
    assert group_ports(PLAN, 0, 4, 50000) == (ranks0, control0)
    assert group_ports("another plan", 0, 4, 50000) != (ranks0, control0)
    with pytest.raises(TensorParallelUnsupported, match="base port"):
        group_ports(PLAN, 0, 2, 65000)


def test_the_control_token_is_per_group_and_needs_the_mesh_secret() -> None:
    token = group_token(SECRET, PLAN, 1)
    assert token == spec_for().token and len(token) == 64
    assert token != group_token(SECRET, PLAN, 0)
    assert token != group_token(b"t" * 32, PLAN, 1)


def test_expert_placement_follows_the_plan() -> None:
    spec = spec_for(expert_shards=[("m1", 0, 40), ("m2", 40, 128)])
    assert spec.expert_ranges == ((0, 40), (40, 128))
    with pytest.raises(TensorParallelUnsupported, match="expert placement lists"):
        spec_for(expert_shards=[("m2", 0, 40), ("m1", 40, 128)])
    with pytest.raises(TensorParallelUnsupported, match="contiguous"):
        spec_for(expert_shards=[("m1", 0, 40), ("m2", 41, 128)])
    assert even_expert_ranges(128, 3) == ((0, 43), (43, 86), (86, 128))
    assert proportional_expert_ranges(8, [1, 3]) == ((0, 2), (2, 8))
    assert proportional_expert_ranges(128, [512, 192, 192])[-1][1] == 128


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"stage_nodes": ["m1", "m1"]}, "twice"),
        ({"stage_nodes": []}, "1 to 15 members"),
        ({"layer_start": 5, "layer_end": 5}, "empty"),
        ({"backend": "tcp"}, "backend"),
        ({"stage_nodes": ["m1", "m9"]}, "no address"),
        ({"addresses": {"m1": "10.0.0.1", "m2": ""}}, "host"),
        ({"step_timeout_s": 0}, "step_timeout_s"),
    ],
)
def test_malformed_specs_are_refused_with_the_reason(overrides: dict, message: str) -> None:
    with pytest.raises(TensorParallelUnsupported, match=message):
        spec_for(**overrides)


def test_spec_json_is_read_strictly() -> None:
    data = spec_for().to_dict()
    with pytest.raises(TensorParallelUnsupported, match="version"):
        TensorParallelSpec.from_dict({**data, "version": 99})
    with pytest.raises(TensorParallelUnsupported, match="unknown"):
        TensorParallelSpec.from_dict({**data, "evil": 1})
    with pytest.raises(TensorParallelUnsupported, match="malformed"):
        TensorParallelSpec.from_dict({**data, "members": [{"node_id": "x"}]})
    with pytest.raises(TensorParallelUnsupported, match="not JSON"):
        TensorParallelSpec.from_json("{")


def test_backend_configuration_follows_from_the_spec() -> None:
    spec = spec_for()
    files, env = backend_files_and_env(spec, 1)
    assert env == {"MLX_RANK": "1"}
    assert json.loads(files["MLX_HOSTFILE"]) == spec.hostfile()
    nccl = spec_for(backend="nccl")
    _, env = backend_files_and_env(nccl, 0)
    assert env["NCCL_HOST_IP"] == "10.0.0.1" and env["MLX_WORLD_SIZE"] == "2"
    with pytest.raises(TensorParallelUnsupported, match="RDMA"):
        spec_for(backend="jaccl")
    jaccl = TensorParallelSpec.from_dict(
        {
            **spec.to_dict(),
            "backend": "jaccl",
            "rdma_devices": [[None, "rdma_en3"], ["rdma_en3", None]],
        }
    )
    files, env = backend_files_and_env(jaccl, 1)
    assert env["MLX_JACCL_COORDINATOR"] == spec.members[0].address
    assert json.loads(files["MLX_IBV_DEVICES"]) == [[None, "rdma_en3"], ["rdma_en3", None]]
    with pytest.raises(TensorParallelUnsupported, match="outside"):
        backend_files_and_env(spec, 2)


# --- Which models ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("llama", True),
        ("mistral", True),  # mlx-lm maps it to llama
        ("qwen3_moe", True),
        ("deepseek_v3", True),
        ("kimi_k2", True),  # mlx-lm maps it to deepseek_v3
        ("gpt_oss", True),
        ("glm4_moe", True),
        ("mixtral", False),
        ("qwen3_next", False),
        ("qwen3_5_moe", False),
        ("gemma3_text", False),
    ],
)
def test_supports_tensor_parallel(model_type: str, expected: bool) -> None:
    assert supports_tensor_parallel(model_type) is expected
    if not expected:
        assert tensor_parallel_refusal(model_type)


def test_check_tensor_parallel_needs_even_heads_and_full_expert_placement(tmp_path: Path) -> None:
    config = {
        "model_type": "qwen3_moe",
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_experts": 8,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_tensor_parallel(tmp_path, 2, ((0, 3), (3, 8)))
    with pytest.raises(TensorParallelUnsupported, match="num_key_value_heads = 2"):
        check_tensor_parallel(tmp_path, 3)
    with pytest.raises(TensorParallelUnsupported, match="does not cover"):
        check_tensor_parallel(tmp_path, 2, ((0, 3), (3, 7)))
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mixtral"}))
    with pytest.raises(TensorParallelUnsupported, match="no shard"):
        check_tensor_parallel(tmp_path, 2)


# --- Which links --------------------------------------------------------------------------------


def test_the_link_rule() -> None:
    verdict = collective_link_verdict
    assert verdict(LinkFacts("127.0.0.1", "127.0.0.1")).allowed
    assert verdict(LinkFacts("10.0.0.1", "10.0.0.2", "thunderbolt0", True, 24)).allowed
    direct = verdict(LinkFacts("192.168.9.0", "192.168.9.1", "enp5s0", False, 31))
    assert direct.allowed and "point-to-point subnet 192.168.9.0/31" in direct.reason
    shared = verdict(LinkFacts("192.168.1.5", "192.168.1.9", "eth0", False, 24))
    assert not shared.allowed and "tensor_parallel_trusted_networks" in shared.reason
    trusted = verdict(
        LinkFacts("192.168.1.5", "192.168.1.9", "eth0", False, 24), ["192.168.1.0/24"]
    )
    assert trusted.allowed and "marked trusted" in trusted.reason
    # A trusted network must hold both ends; a /30 whose peer is elsewhere is not a cable.
    assert not verdict(
        LinkFacts("192.168.1.5", "10.1.1.1", "eth0", False, 24), ["192.168.1.0/24"]
    ).allowed
    assert not verdict(LinkFacts("10.0.0.1", "10.0.0.9", "eth1", False, 30)).allowed
    assert not verdict(LinkFacts("not an ip", "10.0.0.1")).allowed
    assert not verdict(LinkFacts("10.0.0.1", "10.0.0.2"), ["garbage"]).allowed


def test_a_group_needs_every_link_allowed() -> None:
    good = LinkFacts("10.0.0.1", "10.0.0.2", "thunderbolt0", True)
    bad = LinkFacts("192.168.1.5", "192.168.1.9", "wlan0", False, 24)
    assert group_link_verdict([good]).allowed
    refused = group_link_verdict([good, bad])
    assert not refused.allowed and "wlan0" in refused.reason
    assert not group_link_verdict([]).allowed


def test_local_link_facts() -> None:
    facts = describe_local_link("127.0.0.1", "127.0.0.1")
    assert facts.interface == "lo" and facts.prefix_length == 8
    assert describe_local_link("203.0.113.7", "10.0.0.1").interface == ""


def test_point_to_point_interfaces(tmp_path: Path) -> None:
    (tmp_path / "ppp0").mkdir()
    (tmp_path / "ppp0" / "flags").write_text("0x1091\n")  # IFF_POINTOPOINT | UP | ...
    (tmp_path / "eth0").mkdir()
    (tmp_path / "eth0" / "flags").write_text("0x1003\n")
    driver = tmp_path / "drivers" / "thunderbolt-net"
    driver.mkdir(parents=True)
    (tmp_path / "thunderbolt0" / "device").mkdir(parents=True)
    (tmp_path / "thunderbolt0" / "flags").write_text("0x1003\n")
    (tmp_path / "thunderbolt0" / "device" / "driver").symlink_to(driver)
    assert interface_is_point_to_point("ppp0", tmp_path)
    assert interface_is_point_to_point("thunderbolt0", tmp_path)
    assert not interface_is_point_to_point("eth0", tmp_path)
    ports = (
        "Hardware Port: Ethernet\nDevice: en0\nEthernet Address: aa\n\n"
        "Hardware Port: Thunderbolt Bridge\nDevice: bridge0\nEthernet Address: N/A\n\n"
        "Hardware Port: Thunderbolt 1\nDevice: en2\n"
    )
    assert thunderbolt_devices(ports) == {"bridge0", "en2"}


# --- Frames -------------------------------------------------------------------------------------


def test_frames_round_trip_over_a_socket() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        send_frame(ours, {"type": "run", "n": 1}, b"\x01\x02")
        send_frame(ours, {"type": "stop"})
        assert recv_frame(theirs) == ({"type": "run", "n": 1}, b"\x01\x02")
        assert recv_frame(theirs) == ({"type": "stop"}, b"")
        ours.close()
        assert recv_frame(theirs) is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (struct.pack("!IQ", 0, 0), "header size"),
        (struct.pack("!IQ", 1 << 20, 0), "header size"),
        (struct.pack("!IQ", 2, 1 << 40), "payload size"),
        (struct.pack("!IQ", 2, 0) + b"[]", "JSON object"),
        (struct.pack("!IQ", 5, 0) + b"{oops", "not JSON"),
        (struct.pack("!IQ", 20, 0) + b"{}", "closed inside"),
    ],
)
def test_malformed_frames_are_refused(raw: bytes, message: str) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(raw)
        ours.close()
        with pytest.raises(FrameError, match=message):
            recv_frame(theirs)

    async def read() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        await read_frame_async(reader)

    with pytest.raises(FrameError, match=message):
        asyncio.run(read())


def test_arrays_are_checked_against_their_declared_shape() -> None:
    assert check_array({"dtype": "float32", "shape": [1, 2, 3]}, bytes(24)) == (
        "float32",
        (1, 2, 3),
    )
    for header, message in (
        ({"dtype": "float64", "shape": [1]}, "dtype"),
        ({"dtype": "float32", "shape": [1, -1]}, "shape"),
        ({"dtype": "float32", "shape": [1, 2, 3, 4, 5]}, "shape"),
        ({"dtype": "float32", "shape": [1, 3]}, "12 bytes"),
    ):
        with pytest.raises(FrameError, match=message):
            check_array(header, bytes(24))
    for dtype in (mx.float32, mx.bfloat16, mx.int32):
        array = (mx.arange(12).reshape(1, 3, 4) * 3).astype(dtype)
        name, shape, data = from_mx(array[:, ::-1])  # a non-contiguous view travels in C order
        back = to_mx(name, shape, data)
        assert back.dtype == dtype and mx.array_equal(back, array[:, ::-1]).item()
    with pytest.raises(FrameError, match="exceeds"):
        encode_frame({"type": "x", "pad": "y" * (1 << 17)})
