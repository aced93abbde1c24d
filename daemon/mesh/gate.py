"""The peer port's door: bounded handshakes, a bound on strangers per address, refusals in words.

Why: the peer port is open to the network and gRPC core owns it entirely: it accepts, runs the
TLS handshake (mutual, under the mesh CA) and hands Python only the calls of peers that
passed. Left alone, gRPC holds an idle connection for 120 s waiting for its handshake, takes
any number of them from one address, and a refused daemon of another mesh is only a
`Handshake failed` line of gRPC core's, without the peer's address, on the dialling side;
the refusing side says nothing at all (the dialler hangs up first, so it never even sees a
certificate error).

What this does:

* **Handshake time**: ``grpc.server_handshake_timeout_ms`` closes a connection that has not
  completed its handshake in ``handshake_timeout_s``.
* **Per address**: gRPC calls a *socket mutator* (``grpc.socket_mutator``, a C vtable built
  here with ctypes) for every accepted connection, before its handshake. The gate counts,
  per source address, the connections that may still be unauthenticated (accepted within the
  handshake timeout and not yet seen as an authenticated connection); one beyond
  ``max_pending_per_source`` is shut down at once.
* **Members are not bounded**: an address that holds an authenticated connection (as of the
  last check) is a member's. Its link probes connect and close without a handshake, several
  a round and for each peer, and counted as pending they filled the bound within seconds at
  fast probe intervals, after which the gate shut the member's real connections too (a
  data-plane link that then never opened). Its connections still must pass the handshake in
  time; strangers, the ones the bound is for, are counted as before.
* **In words, once per address**: :meth:`ConnectionGate.check` (every second, on the trio
  side) asks gRPC's channelz registry which connections completed the handshake; an address
  whose connections all timed out or failed, and which holds no authenticated connection, is
  reported once (again after ``REPORT_AGAIN_S``) as "not a member of mesh X", with the fix.
  Members' TCP round-trip probes (a connect and a close, no TLS) come from addresses that
  hold authenticated connections, so they are never reported.

The ctypes vtable follows gRPC core's ``grpc_socket_mutator`` (``mutate_fd``, ``compare``,
``destroy``, ``mutate_fd_2``, then a refcount), unchanged since gRPC 1.30; the callback
never raises (an error there would make gRPC close its listener). A gRPC that never calls it
(checked when the server starts: the listener goes through the mutator too) leaves the
per-address bound off and says so; the handshake timeout holds regardless.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("meshd.mesh.gate")

HANDSHAKE_TIMEOUT_S = 10.0
MAX_PENDING_PER_SOURCE = 32
REPORT_AGAIN_S = 600.0
_LISTENER_USAGE = 1  # grpc_fd_usage: GRPC_FD_SERVER_LISTENER_USAGE
_CONNECTION_USAGE = 2  # GRPC_FD_SERVER_CONNECTION_USAGE

Report = Callable[[str], None]


# --- gRPC core's socket mutator, as a ctypes structure -------------------------------------


class _MutateInfo(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("usage", ctypes.c_int), ("args", ctypes.c_void_p)]


class _Mutator(ctypes.Structure):
    pass


_MUTATE_FD = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_int, ctypes.POINTER(_Mutator))
_COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Mutator), ctypes.POINTER(_Mutator))
_DESTROY = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Mutator))
_MUTATE_FD_2 = ctypes.CFUNCTYPE(
    ctypes.c_bool, ctypes.POINTER(_MutateInfo), ctypes.POINTER(_Mutator)
)


class _VTable(ctypes.Structure):
    _fields_ = [
        ("mutate_fd", _MUTATE_FD),
        ("compare", _COMPARE),
        ("destroy", _DESTROY),
        ("mutate_fd_2", _MUTATE_FD_2),
    ]


_Mutator._fields_ = [("vtable", ctypes.POINTER(_VTable)), ("refcount", ctypes.c_ssize_t)]


class _PointerArg:
    """A channel-arg value gRPC's Python layer passes to core as a pointer (via __int__)."""

    def __init__(self, address: int) -> None:
        self._address = address

    def __int__(self) -> int:
        return self._address


# --- The gate -------------------------------------------------------------------------------


@dataclass
class _Source:
    pending: deque[tuple[int, float]] = field(default_factory=deque)  # (port, accepted at)
    failed: int = 0  # connections that never completed the handshake, since the last report
    shut: int = 0  # connections shut at once (over the bound), since the last report
    reported_at: float = float("-inf")


class ConnectionGate:
    """Admission to one peer server (see the module docstring)."""

    def __init__(
        self,
        mesh_name: str,
        report: Report,
        *,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_pending_per_source: int = MAX_PENDING_PER_SOURCE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.mesh_name = mesh_name
        self.handshake_timeout_s = handshake_timeout_s
        self.max_pending_per_source = max_pending_per_source
        self._report = report
        self._clock = clock
        self._lock = threading.Lock()  # gRPC's accept threads and the checking task
        self._sources: dict[str, _Source] = {}
        self._members: frozenset[str] = frozenset()  # addresses holding an authenticated one
        self.listener_seen = False
        self.accepted = 0
        self.shut = 0
        # Kept alive as long as the gate: gRPC core holds pointers into these.
        self._callbacks = (
            _MUTATE_FD(lambda fd, mutator: True),
            _COMPARE(lambda a, b: 0),
            _DESTROY(lambda mutator: None),
            _MUTATE_FD_2(self._mutate),
        )
        self._vtable = _VTable(*self._callbacks)
        self._mutator = _Mutator(ctypes.pointer(self._vtable), 1 << 40)  # never freed by gRPC

    def server_options(self) -> list[tuple[str, Any]]:
        """Options for the peer server: the handshake timeout and this gate's mutator."""
        return [
            ("grpc.server_handshake_timeout_ms", int(self.handshake_timeout_s * 1000)),
            ("grpc.socket_mutator", _PointerArg(ctypes.addressof(self._mutator))),
        ]

    def check_installed(self) -> None:
        """After the server started: say so if gRPC never called the mutator."""
        if not self.listener_seen:
            log.warning(
                "this gRPC does not call socket mutators: connections to the peer port are not "
                "bounded per address (the %g s handshake timeout still holds)",
                self.handshake_timeout_s,
            )

    # ------------------------------------------------------------ gRPC's accept thread

    def _mutate(self, info: Any, _mutator: Any) -> bool:
        """gRPC core calls this for its listener and each accepted connection. Never raises:
        a False or an exception here would make gRPC close the listener."""
        try:
            usage, fd = info.contents.usage, info.contents.fd
            if usage == _LISTENER_USAGE:
                self.listener_seen = True
            elif usage == _CONNECTION_USAGE:
                self._admit(fd)
        except Exception:  # a bug here must not stop the listener
            log.exception("the peer port's connection gate failed; the connection is let in")
        return True

    def _admit(self, fd: int) -> None:
        sock = socket.socket(fileno=fd)
        try:
            host, port = _host_port(sock.getpeername())
            now = self._clock()
            with self._lock:
                self.accepted += 1
                if host in self._members:
                    return  # a member: not bounded (module docstring)
                source = self._sources.setdefault(host, _Source())
                self._expire(source, now)
                if len(source.pending) >= self.max_pending_per_source:
                    source.shut += 1
                    self.shut += 1
                    refuse = True
                else:
                    source.pending.append((port, now))
                    refuse = False
            if refuse:  # gRPC's handshake then reads EOF and closes the connection
                sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.detach()  # the descriptor stays gRPC's

    # ------------------------------------------------------------ checks (trio side)

    def check(self, authenticated: set[tuple[str, int]] | None = None) -> None:
        """Sort pending connections into authenticated and failed, and report in words.

        ``authenticated``: (address, port) of connections past the handshake (default:
        read from gRPC's channelz registry).
        """
        if authenticated is None:
            authenticated = authenticated_connections()
        members = {host for host, _ in authenticated}
        now = self._clock()
        reports = []
        with self._lock:
            self._members = frozenset(members)
            for host, source in list(self._sources.items()):
                source.pending = deque(
                    item for item in source.pending if (host, item[0]) not in authenticated
                )
                failed = self._expire(source, now)
                if host not in members:
                    source.failed += failed
                if (source.failed or source.shut) and now - source.reported_at >= REPORT_AGAIN_S:
                    reports.append(self._words(host, source))
                    source.reported_at, source.failed, source.shut = now, 0, 0
                idle = not (source.pending or source.failed or source.shut)
                if idle and now - source.reported_at >= REPORT_AGAIN_S:
                    del self._sources[host]
        for text in reports:
            self._report(text)

    def _expire(self, source: _Source, now: float) -> int:
        """Drop pending connections older than the handshake timeout (gRPC closed them)."""
        expired = 0
        while source.pending and now - source.pending[0][1] > self.handshake_timeout_s:
            source.pending.popleft()
            expired += 1
        return expired

    def _words(self, host: str, source: _Source) -> str:
        parts = []
        if source.failed:
            parts.append(
                f"{host} opened {source.failed} connection(s) to the peer port that did not "
                f"complete the TLS handshake of mesh {self.mesh_name!r} within "
                f"{self.handshake_timeout_s:g} s: it is not a member of this mesh (a daemon of "
                "another mesh, or with an old secret: run `meshd token` here and "
                "`meshd join TOKEN` there), or not a meshd at all"
            )
        if source.shut:
            parts.append(
                f"refused {source.shut} connection(s) from {host}: "
                f"{self.max_pending_per_source} of its connections were already waiting for "
                "their TLS handshake (the limit per address)"
            )
        return "; ".join(parts)


def authenticated_connections() -> set[tuple[str, int]]:
    """(address, port) of every server connection of this process past its handshake, from
    gRPC's channelz registry (empty when this gRPC has none)."""
    try:
        from grpc._cython import cygrpc

        found: set[tuple[str, int]] = set()
        for server_id in _channelz_ids(cygrpc.channelz_get_servers, "server", "serverId"):
            start = 0
            while True:
                page = json.loads(cygrpc.channelz_get_server_sockets(server_id, start, 1000))
                refs = page.get("socketRef", [])
                for ref in refs:
                    remote = _remote_of(ref.get("name", ""))
                    if remote is not None:
                        found.add(remote)
                if page.get("end", True) or not refs:
                    break
                start = int(refs[-1]["socketId"]) + 1
        return found
    except Exception as error:  # no channelz here: nothing counts as authenticated
        log.debug("channelz is not available: %s", error)
        return set()


def _channelz_ids(fetch: Callable[[int], Any], kind: str, key: str) -> list[int]:
    ids: list[int] = []
    start = 0
    while True:
        page = json.loads(fetch(start))
        entries = page.get(kind, [])
        ids.extend(int(entry["ref"][key]) for entry in entries)
        if page.get("end", True) or not entries:
            return ids
        start = ids[-1] + 1


def _remote_of(name: str) -> tuple[str, int] | None:
    """("10.0.0.2", 5555) from a channelz socket name "chttp2 ipv4:10.0.0.2:5555"."""
    uri = name.rpartition(" ")[2]
    kind, _, rest = uri.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        return None
    return _normal(host.strip("[]")), int(port)


def _host_port(peer: Any) -> tuple[str, int]:
    return _normal(str(peer[0])), int(peer[1])


def _normal(host: str) -> str:
    """IPv4-mapped IPv6 addresses as IPv4 (gRPC's dual-stack listener reports those)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)
