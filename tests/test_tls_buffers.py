"""A lane's TLS contexts keep their record buffers (meshd.runtime.tls_buffers): the mode is
really off in OpenSSL, and connections made that way still talk mutual TLS 1.3."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from meshd.mesh import security
from meshd.runtime import tls_buffers

pytestmark = pytest.mark.integration

PAYLOAD = bytes(range(256)) * 400  # ~100 KB: several TLS records each way


def node_contexts(state: Path, secret: security.MeshSecret, node_id: str):
    credentials = security.load_or_create_node_credentials(state / node_id, secret, node_id)
    return security.ssl_contexts(credentials)


def test_keeping_clears_cpythons_release_mode_once_and_for_all(tmp_path: Path) -> None:
    server, client = node_contexts(tmp_path, security.create_mesh_secret("t"), "a")
    assert tls_buffers.releases_record_buffers(server) is True  # CPython's default
    assert tls_buffers.keep_record_buffers(server) is True
    assert tls_buffers.releases_record_buffers(server) is False
    assert tls_buffers.keep_record_buffers(server) is True  # again: still kept
    assert tls_buffers.releases_record_buffers(client) is True  # each context on its own


def _read_exactly(sock, size: int) -> bytes:  # type: ignore[no-untyped-def]
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 16))
        assert chunk, "the peer closed early"
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def test_connections_that_keep_their_buffers_carry_mutual_tls_both_ways(tmp_path: Path) -> None:
    secret = security.create_mesh_secret("t")
    server_context, _ = node_contexts(tmp_path, secret, "a")
    _, client_context = node_contexts(tmp_path, secret, "b")
    for context in (server_context, client_context):
        assert tls_buffers.keep_record_buffers(context)
    left, right = socket.socketpair()
    left.settimeout(20)
    right.settimeout(20)
    echoed: list[bytes] = []
    peers: list[str | None] = []

    def serve() -> None:
        with server_context.wrap_socket(left, server_side=True) as tls:
            peers.append(security.ssl_peer_node_id(tls))
            for _ in range(3):  # a record buffer reused across messages
                data = _read_exactly(tls, len(PAYLOAD))
                tls.sendall(data[::-1])
            echoed.append(b"done")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with client_context.wrap_socket(right) as tls:
        assert tls.version() == "TLSv1.3"
        assert security.ssl_peer_node_id(tls) == "a"
        for _ in range(3):
            tls.sendall(PAYLOAD)
            assert _read_exactly(tls, len(PAYLOAD)) == PAYLOAD[::-1]
    thread.join(20)
    assert peers == ["b"] and echoed == [b"done"]
