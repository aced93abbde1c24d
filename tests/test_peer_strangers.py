"""Peers and strangers at the peer port: malformed bodies from members, refused outsiders,
idle connections. Real daemon processes on loopback (no mDNS), real mutual TLS."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from meshd.mesh import channels, security

LOOPBACK = ["--no-mdns", "--peer-host", "127.0.0.1", "--peer-port", "0"]


def member_channel(token: str, folder: Path, port: int, node_id: str = "tester"):
    """A channel to 127.0.0.1:port with a certificate of the token's mesh (asyncio side)."""
    secret = security.decode_join_token(token)
    creds = security.load_or_create_node_credentials(folder, secret, node_id)
    return channels.peer_channel(f"127.0.0.1:{port}", security.channel_credentials(creds))


def peer_port(status) -> int:
    return int(status.peer_address.rpartition(":")[2])


def test_malformed_body_from_a_member_is_invalid_argument_and_one_warning(
    daemons, mesh_token, tmp_path
) -> None:
    daemon = daemons([*LOOPBACK, "--join", mesh_token])
    port = peer_port(daemon.wait_ready())

    async def call() -> list[tuple[grpc.StatusCode, str]]:
        async with member_channel(mesh_token, tmp_path, port) as channel:
            answers = []
            for method in ("/meshd.v1.Peer/Propose", "/meshd.dataplane.v1.DataPlane/Stats"):
                try:
                    await channel.unary_unary(method)(b"\xff\xff\xff", timeout=5)
                except grpc.aio.AioRpcError as error:
                    answers.append((error.code(), error.details() or ""))
            return answers

    answers = asyncio.run(call())
    assert [code for code, _ in answers] == [grpc.StatusCode.INVALID_ARGUMENT] * 2, answers
    assert "not a valid Propose message" in answers[0][1]
    log = daemon.log_tail(400)
    assert log.count("refused a malformed meshd.v1.Peer/Propose request") == 1, log
    assert log.count("refused a malformed meshd.dataplane.v1.DataPlane/Stats request") == 1, log
    assert "Traceback" not in log and "ERROR" not in log, log
