"""The mesh secret, join tokens and the mutual-TLS credentials every peer channel uses.

A LAN is not a trust boundary, so a mesh is defined by a 32-byte random secret. Everything a
member needs to talk to other members is derived from it, with no certificate authority server:

* a **CA key** (HKDF-SHA256 -> EC P-256 scalar) and a **CA certificate** built deterministically
  (same subject, key, serial and validity on every member), so a node certificate issued by one
  member validates under the CA certificate any other member builds on its own;
* a per-node **certificate** for a random per-node key, with CN = node id and SAN "meshd";
* a public **fingerprint** that mDNS may announce so daemons skip meshes they cannot join.

Every peer gRPC channel, and every data-plane lane (a plain TLS socket, see
`meshd.inference.transport.lanes`), is mutual TLS under that CA: a daemon without the secret cannot
join, call a peer RPC, send a frame or read traffic. The mesh name is a label carried with the
secret; the keys and the fingerprint depend only on the secret bytes, so renaming a mesh does
not split it.

Where a refusal is logged: the TLS handshake fails inside gRPC core, below anything grpc.aio
exposes (no interceptor or handler runs, no event reaches Python). The caller gets UNAVAILABLE
with BoringSSL's reason in the details; `describe_refusal` turns it into a log line. The server
side has only gRPC core's own INFO line ("Handshake failed ... PEER_DID_NOT_RETURN_A_CERTIFICATE"
or "Socket closed"), shown with GRPC_VERBOSITY=INFO and without the peer's address. A daemon's
own log line about a foreign daemon comes from discovery instead: the mDNS TXT fingerprint of a
daemon in another mesh differs from ours.

Files in the state directory (created 0700): `mesh.secret` holds the join token text (so its
checksum also detects a damaged file) and `node.key` holds the node's private key; both are
written 0600 and refused, like ssh refuses keys, when group or world can read them.
`node.crt` is public and re-issued whenever the secret, node id or key changed.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import os
import re
import secrets
import ssl
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SECRET_BYTES = 32
TOKEN_PREFIX = "meshd1"
TLS_SERVER_NAME = "meshd"
SECRET_FILE_NAME = "mesh.secret"
NODE_KEY_FILE_NAME = "node.key"
NODE_CERT_FILE_NAME = "node.crt"
FINGERPRINT_HEX_CHARS = 16

CHANNEL_OPTIONS: list[tuple[str, str | int]] = [
    # Peers are dialled by IP address; every node certificate carries SAN DNS "meshd", so the
    # hostname check passes for any member while the CA check decides who is a member.
    ("grpc.ssl_target_name_override", TLS_SERVER_NAME),
]

_MESH_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_DNS_LABEL_PATTERN = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_TOKEN_VERSION_PATTERN = re.compile(r"meshd[0-9]+")
_CHECKSUM_CHARS = 4
_HKDF_SALT = b"meshd v1"
_CA_NOT_BEFORE = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
_CA_NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC)
_NODE_CERT_BACKDATE = datetime.timedelta(days=1)
_NODE_CERT_LIFETIME = datetime.timedelta(days=3650)
_NODE_CERT_RENEW_BEFORE = datetime.timedelta(days=365)
_X509_COMMON_NAME_MAX = 64
# P-256 group order n (SEC 2, section 2.4.2).
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


class InvalidJoinToken(ValueError):
    """A join token (or a mesh.secret file) that cannot be decoded; the message says why."""


class InsecureSecretFile(PermissionError):
    """A secret or key file that group or world can read: refused until its mode is fixed."""


@dataclass(frozen=True, repr=False)
class MeshSecret:
    """The shared secret that defines a mesh; `mesh_name` is a human label carried with it."""

    mesh_name: str
    secret: bytes

    def __post_init__(self) -> None:
        _check_mesh_name(self.mesh_name)
        if len(self.secret) != SECRET_BYTES:
            raise ValueError(
                f"a mesh secret is {SECRET_BYTES} bytes, got {len(self.secret)}: "
                "make one with create_mesh_secret()"
            )

    def __repr__(self) -> str:
        # Never print the secret bytes: reprs end up in logs and tracebacks.
        return f"MeshSecret(mesh_name={self.mesh_name!r}, fingerprint={mesh_fingerprint(self)!r})"


@dataclass(frozen=True)
class NodeCredentials:
    """What one node needs for mutual TLS: its key and certificate, and the mesh CA certificate."""

    node_id: str
    private_key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate
    ca_certificate: x509.Certificate

    @property
    def private_key_pem(self) -> bytes:
        return _private_key_pem(self.private_key)

    @property
    def certificate_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def ca_certificate_pem(self) -> bytes:
        return self.ca_certificate.public_bytes(serialization.Encoding.PEM)


# --- The secret and join tokens -------------------------------------------------------------


def create_mesh_secret(mesh_name: str) -> MeshSecret:
    """Make the secret of a new mesh (the first daemon of a mesh calls this once)."""
    return MeshSecret(mesh_name=mesh_name, secret=secrets.token_bytes(SECRET_BYTES))


def encode_join_token(secret: MeshSecret) -> str:
    """Return `meshd1:<mesh name>:<base64url secret>:<checksum>`, safe to copy and paste."""
    body = f"{TOKEN_PREFIX}:{secret.mesh_name}:{_b64url_encode(secret.secret)}"
    return f"{body}:{_token_checksum(body)}"


def decode_join_token(text: str) -> MeshSecret:
    """Parse a join token; raise InvalidJoinToken saying what is wrong and what to do."""
    token = "".join(text.split())  # terminals and mail clients wrap or indent long lines
    fields = token.split(":")
    if fields[0] != TOKEN_PREFIX and _TOKEN_VERSION_PATTERN.fullmatch(fields[0]):
        raise InvalidJoinToken(
            f"this join token has version {fields[0]!r}, this meshd reads only {TOKEN_PREFIX!r}: "
            "print a token with `meshd token` on a member running the same meshd version"
        )
    if len(fields) != 4 or fields[0] != TOKEN_PREFIX:
        raise InvalidJoinToken(
            f"this is not a meshd join token (expected '{TOKEN_PREFIX}:<mesh>:<secret>:<check>'):"
            " copy it again from `meshd token` on a member"
        )
    _, mesh_name, secret_text, checksum = fields
    if checksum != _token_checksum(f"{TOKEN_PREFIX}:{mesh_name}:{secret_text}"):
        raise InvalidJoinToken(
            "this join token is damaged (checksum mismatch): "
            "copy it again from `meshd token` on a member"
        )
    return _secret_from_checked_fields(mesh_name, secret_text)


def mesh_fingerprint(secret: MeshSecret) -> str:
    """A short public id of the mesh for mDNS TXT records; one-way, it reveals nothing usable."""
    return _derive(secret, b"meshd fingerprint", FINGERPRINT_HEX_CHARS // 2).hex()


def _secret_from_checked_fields(mesh_name: str, secret_text: str) -> MeshSecret:
    try:
        secret_bytes = _b64url_decode(secret_text)
        return MeshSecret(mesh_name=mesh_name, secret=secret_bytes)
    except ValueError as error:
        raise InvalidJoinToken(
            f"this join token has a valid checksum but bad content ({error}): "
            "it was not made by `meshd token`; print a new one on a member"
        ) from error


def _token_checksum(body: str) -> str:
    digest = hashlib.sha256(body.encode()).digest()
    return _b64url_encode(digest)[:_CHECKSUM_CHARS]


def _b64url_encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes:
    if not re.fullmatch(r"[A-Za-z0-9_-]*", text):
        raise ValueError("the secret is not base64url text")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _check_mesh_name(mesh_name: str) -> None:
    if not _MESH_NAME_PATTERN.fullmatch(mesh_name):
        raise ValueError(
            f"invalid mesh name {mesh_name!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


def _derive(secret: MeshSecret, info: bytes, length: int) -> bytes:
    """Independent keys from one secret: HKDF-SHA256 with a distinct `info` for each use."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=_HKDF_SALT, info=info).derive(
        secret.secret
    )


# --- Persistence ----------------------------------------------------------------------------


def save_secret(state_dir: Path, secret: MeshSecret) -> Path:
    """Write `state_dir/mesh.secret` (mode 0600, atomically) and return its path."""
    path = Path(state_dir) / SECRET_FILE_NAME
    write_private_file(path, (encode_join_token(secret) + "\n").encode("ascii"))
    return path


def load_secret(state_dir: Path) -> MeshSecret | None:
    """Read the mesh secret, or None when this node has none yet (not created, not joined).

    Raises InsecureSecretFile when group or world can read the file, InvalidJoinToken when it
    is damaged.
    """
    path = Path(state_dir) / SECRET_FILE_NAME
    try:
        data = _read_private_file(path)
    except FileNotFoundError:
        return None
    try:
        return decode_join_token(data.decode("ascii", errors="replace"))
    except InvalidJoinToken as error:
        raise InvalidJoinToken(
            f"{path} is damaged ({error}); restore it, or replace it with `meshd join TOKEN`"
        ) from error


def load_or_create_secret(state_dir: Path, mesh_name: str) -> MeshSecret:
    """Load this node's mesh secret, or create and save a new mesh named `mesh_name`."""
    existing = load_secret(state_dir)
    if existing is not None:
        return existing
    secret = create_mesh_secret(mesh_name)
    save_secret(state_dir, secret)
    return secret


def write_private_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write a file (by default only its owner can read it) so no reader sees a partial file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(descriptor, mode)
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _read_private_file(path: Path) -> bytes:
    with path.open("rb") as file:
        mode = os.fstat(file.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InsecureSecretFile(
                f"{path} has mode {stat.S_IMODE(mode):04o}: group or others can access it, so "
                f"the mesh's secrets may have leaked; run `chmod 600 {path}` (and think about "
                "making a new mesh if others could read it)"
            )
        return file.read()


# --- The mesh CA ----------------------------------------------------------------------------


def mesh_ca_private_key(secret: MeshSecret) -> ec.EllipticCurvePrivateKey:
    """The CA key every member derives from the secret (FIPS 186-4 B.4.1 extra-bits method)."""
    material = _derive(secret, b"meshd ca key", 40)  # 64 bits more than the order: no bias
    scalar = int.from_bytes(material, "big") % (_P256_ORDER - 1) + 1
    return ec.derive_private_key(scalar, ec.SECP256R1())


def mesh_ca_certificate(secret: MeshSecret) -> x509.Certificate:
    """The self-signed CA certificate; identical on every member in all that chain checks use."""
    key = mesh_ca_private_key(secret)
    public_key = key.public_key()
    serial = int.from_bytes(_derive(secret, b"meshd ca serial", 16), "big") >> 1 or 1
    builder = (
        x509.CertificateBuilder()
        .subject_name(_ca_name(secret))
        .issuer_name(_ca_name(secret))
        .public_key(public_key)
        .serial_number(serial)
        .not_valid_before(_CA_NOT_BEFORE)
        .not_valid_after(_CA_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )
    return _sign_deterministically(builder, key)


def _sign_deterministically(
    builder: x509.CertificateBuilder, key: ec.EllipticCurvePrivateKey
) -> x509.Certificate:
    """RFC 6979 signing makes every member's CA certificate byte-identical (easier to compare).

    Chain validation does not need it (a trust anchor's own signature is never checked), so
    older `cryptography` releases without deterministic ECDSA fall back to a random nonce.
    """
    try:
        return builder.sign(key, hashes.SHA256(), ecdsa_deterministic=True)
    except TypeError:
        return builder.sign(key, hashes.SHA256())


def _ca_name(secret: MeshSecret) -> x509.Name:
    # The fingerprint in the name makes a foreign mesh's certificate fail as "unknown issuer"
    # rather than as a bad signature under a same-named CA, which is clearer in gRPC's errors.
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshd"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"meshd mesh CA {mesh_fingerprint(secret)}"),
        ]
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


# --- Node credentials -----------------------------------------------------------------------


def issue_node_certificate(
    secret: MeshSecret, node_id: str, node_public_key: ec.EllipticCurvePublicKey
) -> x509.Certificate:
    """Sign a certificate for `node_id`'s key with the mesh CA, valid ten years from yesterday."""
    _check_node_id(node_id)
    ca_key = mesh_ca_private_key(secret)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(_ca_name(secret))
        .public_key(node_public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _NODE_CERT_BACKDATE)  # clocks on a LAN are not in sync
        .not_valid_after(now + _NODE_CERT_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(_node_dns_names(node_id)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    return builder.sign(ca_key, hashes.SHA256())


def load_or_create_node_credentials(
    state_dir: Path, secret: MeshSecret, node_id: str
) -> NodeCredentials:
    """Load this node's key and certificate, creating the key or re-issuing the cert as needed.

    The certificate is re-issued when it was signed under another mesh secret, names another
    node id, does not match the key, or expires within a year.
    """
    _check_node_id(node_id)
    state_dir = Path(state_dir)
    key = _load_or_create_node_key(state_dir / NODE_KEY_FILE_NAME)
    ca_certificate = mesh_ca_certificate(secret)
    certificate = _load_certificate(state_dir / NODE_CERT_FILE_NAME)
    if certificate is None or not _certificate_is_current(
        certificate, ca_certificate, node_id, key
    ):
        certificate = issue_node_certificate(secret, node_id, key.public_key())
        certificate_pem = certificate.public_bytes(serialization.Encoding.PEM)
        write_private_file(state_dir / NODE_CERT_FILE_NAME, certificate_pem, mode=0o644)
    return NodeCredentials(node_id, key, certificate, ca_certificate)


def _check_node_id(node_id: str) -> None:
    if not node_id or len(node_id) > _X509_COMMON_NAME_MAX or not node_id.isprintable():
        raise ValueError(
            f"invalid node id {node_id!r}: it goes in a certificate's common name, so use 1-"
            f"{_X509_COMMON_NAME_MAX} printable characters"
        )


def _node_dns_names(node_id: str) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(TLS_SERVER_NAME)]
    if node_id != TLS_SERVER_NAME and _is_dns_name(node_id):
        names.append(x509.DNSName(node_id))
    return names


def _is_dns_name(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return False  # an IP address is not a DNS name, and would confuse hostname checks
    except ValueError:
        pass
    labels = text.split(".")
    return len(text) <= 253 and all(_DNS_LABEL_PATTERN.fullmatch(label) for label in labels)


def _load_or_create_node_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        data = _read_private_file(path)
    except FileNotFoundError:
        key = ec.generate_private_key(ec.SECP256R1())
        write_private_file(path, _private_key_pem(key))
        return key
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except ValueError as error:
        raise ValueError(
            f"{path} is not a readable private key ({error}); delete it and restart to "
            "generate a new node key"
        ) from error
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise ValueError(f"{path} is not an EC P-256 key; delete it and restart to make one")
    return key


def _load_certificate(path: Path) -> x509.Certificate | None:
    """The stored node certificate, or None when missing or unreadable (it is then re-issued)."""
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None


def _certificate_is_current(
    certificate: x509.Certificate,
    ca_certificate: x509.Certificate,
    node_id: str,
    key: ec.EllipticCurvePrivateKey,
) -> bool:
    renew_after = datetime.datetime.now(datetime.UTC) + _NODE_CERT_RENEW_BEFORE
    return (
        _common_name(certificate) == node_id
        and certificate.public_key() == key.public_key()
        and certificate.not_valid_after_utc > renew_after
        and _is_signed_by(certificate, ca_certificate)
    )


def _is_signed_by(certificate: x509.Certificate, ca_certificate: x509.Certificate) -> bool:
    try:
        certificate.verify_directly_issued_by(ca_certificate)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _common_name(certificate: x509.Certificate) -> str | None:
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else None


def _private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


# --- gRPC -----------------------------------------------------------------------------------


def server_credentials(creds: NodeCredentials) -> grpc.ServerCredentials:
    """TLS for a peer port: clients must present a certificate issued under the mesh CA."""
    return grpc.ssl_server_credentials(
        [(creds.private_key_pem, creds.certificate_pem)],
        root_certificates=creds.ca_certificate_pem,
        require_client_auth=True,
    )


def channel_credentials(creds: NodeCredentials) -> grpc.ChannelCredentials:
    """TLS for a channel to a peer: trust only the mesh CA and present this node's certificate.

    Use with CHANNEL_OPTIONS, which make the hostname check expect "meshd" instead of the IP.
    """
    return grpc.ssl_channel_credentials(
        root_certificates=creds.ca_certificate_pem,
        private_key=creds.private_key_pem,
        certificate_chain=creds.certificate_pem,
    )


def peer_node_id(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> str | None:
    """The node id (certificate CN) of the peer calling this RPC, or None on a non-TLS server.

    The CA vouches for the CN, so a server can detect a peer that claims another node's id.
    """
    common_names = context.auth_context().get("x509_common_name") or []
    return common_names[0].decode("utf-8", errors="replace") if common_names else None


# --- Plain TLS sockets (the data plane's lanes) ---------------------------------------------


def ssl_contexts(creds: NodeCredentials) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The (server, client) contexts of a plain TLS socket between members: TLS 1.3, this
    node's certificate, only the mesh CA trusted, a certificate required both ways. The node
    id is checked from the certificate after the handshake (:func:`ssl_peer_node_id`), not
    as a host name."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    ca = creds.ca_certificate_pem.decode("ascii")
    with tempfile.TemporaryDirectory(prefix="meshd-tls-") as folder:
        # ssl loads a key pair only from files: a private folder, gone after loading.
        key, cert = Path(folder) / NODE_KEY_FILE_NAME, Path(folder) / NODE_CERT_FILE_NAME
        write_private_file(key, creds.private_key_pem)
        cert.write_bytes(creds.certificate_pem)
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cadata=ca)
            context.load_cert_chain(cert, key)
    return server, client


def ssl_peer_node_id(sock: ssl.SSLSocket) -> str | None:
    """The node id (certificate CN) of the other end of a TLS socket whose handshake passed
    under :func:`ssl_contexts` (so the CA vouches for it), or None without a certificate."""
    der = sock.getpeercert(binary_form=True)
    return _common_name(x509.load_der_x509_certificate(der)) if der else None


def describe_refusal(error: grpc.RpcError) -> str | None:
    """A log line for an RPC that failed because mutual TLS refused the peer, else None.

    gRPC reports a refused handshake only as UNAVAILABLE with BoringSSL's words in the details;
    this names the likely cause and the fix. The refusing side logs nothing of its own (gRPC
    core handles the handshake below grpc.aio), so the caller's line is the only one.
    """
    # Sync errors are grpc.Call, grpc.aio.AioRpcError is not: both have code() and details().
    code, details_of = getattr(error, "code", None), getattr(error, "details", None)
    if code is None or details_of is None or code() != grpc.StatusCode.UNAVAILABLE:
        return None
    details = details_of() or ""
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (
            "its certificate is not signed by this mesh's key (it belongs to another mesh, or "
            "has an old secret): to make it a member, run `meshd token` here and "
            "`meshd join TOKEN` there"
        )
    if "handshake" in details.lower():
        return (
            "it refused this node's certificate during the TLS handshake (it belongs to another "
            "mesh: see `meshd token` / `meshd join`), or it is not a meshd peer port"
        )
    return None
