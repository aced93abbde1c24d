"""Tests for meshd.mesh.security: join tokens, secret files, the derived CA and mutual TLS
over gRPC.

The gRPC tests run a real grpc.aio server on 127.0.0.1 with an ephemeral port and the standard
health service, and check who gets an answer.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import os
import stat
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from meshd.mesh import security
from meshd.mesh.security import (
    CHANNEL_OPTIONS,
    InsecureSecretFile,
    InvalidJoinToken,
    MeshSecret,
    NodeCredentials,
)

pytestmark = pytest.mark.integration

FIXED_SECRET = MeshSecret(mesh_name="home", secret=bytes(range(32)))
REFUSAL_DEADLINE_S = 2.0


def common_name(certificate: x509.Certificate) -> str:
    return str(certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


# --- Join tokens ----------------------------------------------------------------------------


def test_token_round_trip_gives_the_same_secret() -> None:
    secret = security.create_mesh_secret("home-lab.1")
    token = security.encode_join_token(secret)

    assert token.startswith("meshd1:home-lab.1:")
    assert security.decode_join_token(token) == secret


def test_token_survives_line_wrapping_and_surrounding_spaces() -> None:
    token = security.encode_join_token(FIXED_SECRET)
    wrapped = f"  {token[:20]}\n    {token[20:]}\n"

    assert security.decode_join_token(wrapped) == FIXED_SECRET


def test_every_single_character_typo_is_detected() -> None:
    token = security.encode_join_token(FIXED_SECRET)
    for position, original in enumerate(token):
        for replacement in "aZ0-_:":
            if replacement == original:
                continue
            damaged = token[:position] + replacement + token[position + 1 :]
            with pytest.raises(InvalidJoinToken):
                security.decode_join_token(damaged)


def test_swapped_neighbours_in_the_secret_give_a_checksum_error() -> None:
    token = security.encode_join_token(FIXED_SECRET)
    position = len("meshd1:home:") + 5
    swapped = token[:position] + token[position + 1] + token[position] + token[position + 2 :]
    assert swapped != token

    with pytest.raises(InvalidJoinToken, match=r"damaged \(checksum mismatch\).*meshd token"):
        security.decode_join_token(swapped)


def test_token_of_another_version_says_so() -> None:
    token = security.encode_join_token(FIXED_SECRET).replace("meshd1:", "meshd2:", 1)

    with pytest.raises(InvalidJoinToken, match="version 'meshd2'"):
        security.decode_join_token(token)


@pytest.mark.parametrize("text", ["", "hello", "meshd1:home:abc", "ssh-ed25519 AAAA user@host"])
def test_text_that_is_no_token_is_refused(text: str) -> None:
    with pytest.raises(InvalidJoinToken, match="not a meshd join token"):
        security.decode_join_token(text)


def test_token_with_valid_checksum_but_short_secret_is_refused() -> None:
    body = "meshd1:home:AAAA"  # 3 bytes of secret, checksummed as the format prescribes
    digest = hashlib.sha256(body.encode()).digest()
    checksum = base64.urlsafe_b64encode(digest).decode()[:4]

    with pytest.raises(InvalidJoinToken, match="bad content"):
        security.decode_join_token(f"{body}:{checksum}")


@pytest.mark.parametrize("name", ["", "has space", "colon:name", "-leading", "x" * 64, "naïve"])
def test_invalid_mesh_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="invalid mesh name"):
        security.create_mesh_secret(name)


def test_repr_does_not_reveal_the_secret() -> None:
    text = repr(FIXED_SECRET)

    assert "home" in text
    assert security.mesh_fingerprint(FIXED_SECRET) in text
    assert FIXED_SECRET.secret.hex() not in text
    assert base64.urlsafe_b64encode(FIXED_SECRET.secret).decode().rstrip("=") not in text
    assert "secret=" not in text


# --- Fingerprint ----------------------------------------------------------------------------


def test_fingerprint_is_stable_short_hex_and_independent_of_the_label() -> None:
    copy = security.decode_join_token(security.encode_join_token(FIXED_SECRET))
    renamed = MeshSecret(mesh_name="other-name", secret=FIXED_SECRET.secret)
    fingerprint = security.mesh_fingerprint(FIXED_SECRET)

    assert len(fingerprint) == 16
    assert int(fingerprint, 16) >= 0
    assert security.mesh_fingerprint(copy) == fingerprint
    assert security.mesh_fingerprint(renamed) == fingerprint


def test_fingerprint_differs_between_secrets_and_reveals_no_secret_bytes() -> None:
    other = security.create_mesh_secret("home")
    fingerprint = security.mesh_fingerprint(FIXED_SECRET)

    assert security.mesh_fingerprint(other) != fingerprint
    assert fingerprint not in FIXED_SECRET.secret.hex()
    assert fingerprint not in security.encode_join_token(FIXED_SECRET)


# --- Files ----------------------------------------------------------------------------------


def test_secret_file_round_trip_is_private_and_atomic(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    assert security.load_secret(state_dir) is None

    path = security.save_secret(state_dir, FIXED_SECRET)

    assert path == state_dir / "mesh.secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    assert sorted(p.name for p in state_dir.iterdir()) == ["mesh.secret"]  # no temp file left
    assert security.load_secret(state_dir) == FIXED_SECRET


def test_saving_replaces_the_previous_secret(tmp_path: Path) -> None:
    security.save_secret(tmp_path, FIXED_SECRET)
    joined = security.create_mesh_secret("their-mesh")

    security.save_secret(tmp_path, joined)

    assert security.load_secret(tmp_path) == joined


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_secret_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = security.save_secret(tmp_path, FIXED_SECRET)
    path.chmod(mode)

    with pytest.raises(InsecureSecretFile, match=f"mode {mode:04o}.*chmod 600"):
        security.load_secret(tmp_path)


def test_damaged_secret_file_names_the_file(tmp_path: Path) -> None:
    path = security.save_secret(tmp_path, FIXED_SECRET)
    text = path.read_text()
    path.write_text(text[:20] + ("A" if text[20] != "A" else "B") + text[21:])

    with pytest.raises(InvalidJoinToken, match=f"{path} is damaged.*meshd join"):
        security.load_secret(tmp_path)


def test_load_or_create_secret_creates_once(tmp_path: Path) -> None:
    first = security.load_or_create_secret(tmp_path, "home")
    second = security.load_or_create_secret(tmp_path, "ignored-name")

    assert second == first
    assert first.mesh_name == "home"


# --- CA and node certificates ---------------------------------------------------------------


def test_every_member_builds_the_same_ca_certificate() -> None:
    copy = security.decode_join_token(security.encode_join_token(FIXED_SECRET))
    mine = security.mesh_ca_certificate(FIXED_SECRET)
    theirs = security.mesh_ca_certificate(copy)

    assert theirs.subject == mine.subject == mine.issuer
    assert theirs.public_key() == mine.public_key()
    assert theirs.serial_number == mine.serial_number
    assert theirs.not_valid_before_utc == mine.not_valid_before_utc
    assert theirs.not_valid_after_utc == mine.not_valid_after_utc
    assert theirs.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_another_secret_gives_another_ca() -> None:
    other = MeshSecret(mesh_name="home", secret=bytes(range(1, 33)))
    mine = security.mesh_ca_certificate(FIXED_SECRET)
    theirs = security.mesh_ca_certificate(other)

    assert theirs.public_key() != mine.public_key()
    assert theirs.subject != mine.subject


def test_node_certificate_names_the_node_and_allows_clock_skew(tmp_path: Path) -> None:
    creds = security.load_or_create_node_credentials(tmp_path, FIXED_SECRET, "node-a")
    certificate = creds.certificate
    now = datetime.datetime.now(datetime.UTC)
    dns_names = certificate.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)

    assert common_name(certificate) == "node-a"
    assert dns_names == ["meshd", "node-a"]
    assert certificate.not_valid_before_utc < now - datetime.timedelta(hours=23)
    assert certificate.not_valid_after_utc > now + datetime.timedelta(days=9 * 365)
    certificate.verify_directly_issued_by(creds.ca_certificate)
    assert stat.S_IMODE((tmp_path / "node.key").stat().st_mode) == 0o600


@pytest.mark.parametrize("node_id", ["10.0.0.7", "Node A (kitchen)", "under_score"])
def test_node_ids_that_are_no_dns_names_stay_out_of_the_san(tmp_path: Path, node_id: str) -> None:
    creds = security.load_or_create_node_credentials(tmp_path, FIXED_SECRET, node_id)
    san = creds.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)

    assert san.value.get_values_for_type(x509.DNSName) == ["meshd"]
    assert common_name(creds.certificate) == node_id


@pytest.mark.parametrize("node_id", ["", "x" * 65, "tab\there"])
def test_invalid_node_ids_are_refused(tmp_path: Path, node_id: str) -> None:
    with pytest.raises(ValueError, match="invalid node id"):
        security.load_or_create_node_credentials(tmp_path, FIXED_SECRET, node_id)


def test_credentials_are_reused_while_nothing_changed(tmp_path: Path) -> None:
    first = security.load_or_create_node_credentials(tmp_path, FIXED_SECRET, "node-a")
    second = security.load_or_create_node_credentials(tmp_path, FIXED_SECRET, "node-a")

    assert second.certificate_pem == first.certificate_pem
    assert second.private_key_pem == first.private_key_pem


def test_certificate_is_reissued_for_a_new_node_id_with_the_same_key(tmp_path: Path) -> None:
    first = security.load_or_create_node_credentials(tmp_path, FIXED_SECRET, "node-a")
    renamed = security.load_or_create_node_credentials(tmp_path, FIXED_SECRET, "node-b")

    assert common_name(renamed.certificate) == "node-b"
    assert renamed.private_key_pem == first.private_key_pem
    assert x509.load_pem_x509_certificate((tmp_path / "node.crt").read_bytes()) == (
        renamed.certificate
    )


def test_certificate_is_reissued_after_joining_another_mesh(tmp_path: Path) -> None:
    security.load_or_create_node_credentials(tmp_path, FIXED_SECRET, "node-a")
    other = security.create_mesh_secret("their-mesh")

    joined = security.load_or_create_node_credentials(tmp_path, other, "node-a")

    joined.certificate.verify_directly_issued_by(security.mesh_ca_certificate(other))
    assert joined.ca_certificate.subject != security.mesh_ca_certificate(FIXED_SECRET).subject


def test_unreadable_node_key_is_refused_with_advice(tmp_path: Path) -> None:
    key_path = tmp_path / "node.key"
    key_path.write_bytes(b"not a key")
    key_path.chmod(0o600)

    with pytest.raises(ValueError, match="delete it"):
        security.load_or_create_node_credentials(tmp_path, FIXED_SECRET, "node-a")


def test_node_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    security.load_or_create_node_credentials(tmp_path, FIXED_SECRET, "node-a")
    os.chmod(tmp_path / "node.key", 0o644)

    with pytest.raises(InsecureSecretFile, match="chmod 600"):
        security.load_or_create_node_credentials(tmp_path, FIXED_SECRET, "node-a")


# --- Mutual TLS over real gRPC --------------------------------------------------------------


class RecordingHealthServicer(health_aio.HealthServicer):
    """The standard health service, recording which node id each Check call came from."""

    def __init__(self) -> None:
        super().__init__()
        self.callers: list[str | None] = []

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        self.callers.append(security.peer_node_id(context))
        return await super().Check(request, context)


@dataclass
class RunningServer:
    servicer: RecordingHealthServicer
    tls_address: str
    plain_address: str


@asynccontextmanager
async def serving(creds: NodeCredentials) -> AsyncIterator[RunningServer]:
    """A health server with a mutual-TLS port and, to compare, a plain port."""
    server = grpc.aio.server()
    servicer = RecordingHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    tls_port = server.add_secure_port("127.0.0.1:0", security.server_credentials(creds))
    plain_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield RunningServer(servicer, f"127.0.0.1:{tls_port}", f"127.0.0.1:{plain_port}")
    finally:
        await server.stop(None)


async def check_health(channel: grpc.aio.Channel) -> health_pb2.HealthCheckResponse:
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return await stub.Check(health_pb2.HealthCheckRequest(), timeout=REFUSAL_DEADLINE_S)


def mesh_channel(address: str, creds: NodeCredentials) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(
        address, security.channel_credentials(creds), options=CHANNEL_OPTIONS
    )


async def refused_call(channel: grpc.aio.Channel) -> tuple[grpc.aio.AioRpcError, float]:
    """Make a call that must fail; return its error and how long the refusal took."""
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await check_health(channel)
    return caught.value, time.monotonic() - started


@pytest.fixture
def member_a(tmp_path: Path) -> NodeCredentials:
    return security.load_or_create_node_credentials(tmp_path / "a", FIXED_SECRET, "node-a")


@pytest.fixture
def member_b(tmp_path: Path) -> NodeCredentials:
    """Another member: its own state dir, its secret decoded from a token, its own CA object."""
    joined = security.decode_join_token(security.encode_join_token(FIXED_SECRET))
    return security.load_or_create_node_credentials(tmp_path / "b", joined, "node-b")


@pytest.fixture
def outsider(tmp_path: Path) -> NodeCredentials:
    """A node of another mesh that happens to have the same mesh name."""
    same_name = security.create_mesh_secret(FIXED_SECRET.mesh_name)
    return security.load_or_create_node_credentials(tmp_path / "x", same_name, "node-x")


def test_members_talk_and_the_server_knows_who_calls(
    member_a: NodeCredentials, member_b: NodeCredentials
) -> None:
    async def scenario() -> None:
        async with serving(member_a) as server:
            reply = await check_health(mesh_channel(server.tls_address, member_b))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await check_health(grpc.aio.insecure_channel(server.plain_address))
            assert server.servicer.callers == ["node-b", None]

    asyncio.run(scenario())


def test_a_node_with_another_secret_is_refused_both_ways(
    member_a: NodeCredentials, outsider: NodeCredentials
) -> None:
    async def scenario() -> None:
        async with serving(member_a) as member_server, serving(outsider) as outsider_server:
            inbound, inbound_s = await refused_call(
                mesh_channel(member_server.tls_address, outsider)
            )
            outbound, outbound_s = await refused_call(
                mesh_channel(outsider_server.tls_address, member_a)
            )
            for error, seconds in ((inbound, inbound_s), (outbound, outbound_s)):
                assert error.code() == grpc.StatusCode.UNAVAILABLE
                assert seconds < REFUSAL_DEADLINE_S
                assert "another mesh" in (security.describe_refusal(error) or "")
            assert member_server.servicer.callers == []
            assert outsider_server.servicer.callers == []

    asyncio.run(scenario())


def test_a_plain_grpc_client_gets_no_answer(member_a: NodeCredentials) -> None:
    async def scenario() -> None:
        async with serving(member_a) as server:
            error, seconds = await refused_call(grpc.aio.insecure_channel(server.tls_address))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert seconds < REFUSAL_DEADLINE_S
            assert server.servicer.callers == []

    asyncio.run(scenario())


def test_a_tls_client_without_a_certificate_is_refused(member_a: NodeCredentials) -> None:
    """Knowing the CA certificate (it is public) is not enough: the client must prove a key."""

    async def scenario() -> None:
        async with serving(member_a) as server:
            trusting_only = grpc.ssl_channel_credentials(member_a.ca_certificate_pem)
            channel = grpc.aio.secure_channel(server.tls_address, trusting_only, CHANNEL_OPTIONS)
            error, seconds = await refused_call(channel)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert seconds < REFUSAL_DEADLINE_S
            assert server.servicer.callers == []

    asyncio.run(scenario())


def test_a_certificate_for_a_foreign_key_is_useless_without_that_key(
    member_a: NodeCredentials, member_b: NodeCredentials, outsider: NodeCredentials
) -> None:
    """A stolen certificate (public) with the thief's own key does not pass the handshake."""

    async def scenario() -> None:
        async with serving(member_a) as server:
            thief_key = outsider.private_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            stolen = grpc.ssl_channel_credentials(
                member_a.ca_certificate_pem, thief_key, member_b.certificate_pem
            )
            channel = grpc.aio.secure_channel(server.tls_address, stolen, CHANNEL_OPTIONS)
            error, _ = await refused_call(channel)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert server.servicer.callers == []

    asyncio.run(scenario())


def test_describe_refusal_ignores_other_errors() -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                request = health_pb2.HealthCheckRequest(service="no-such-service")
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Check(request, timeout=REFUSAL_DEADLINE_S)
        finally:
            await server.stop(None)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert security.describe_refusal(caught.value) is None

    asyncio.run(scenario())
