"""The runner: one rank of one tensor-parallel stage, in a process of its own.

``python -m meshd.inference.tensor_parallel.runner --spec FILE --rank R --ipc-fd FD
--parent-pid PID``, started by the daemon's :class:`~.member.TensorParallelMember`, which owns
it: MLX's ``mx.distributed`` group cannot be re-initialised in one process, so every group of
every plan gets fresh runners, stopped with the plan and killed by PID on any failure.

Start: (1) control channel: rank 0 listens on the spec's control port, the other ranks connect
and prove they know the group's token (HMAC of a fresh challenge); (2) ``mx.distributed.init``
with the backend configuration the daemon wrote (``MLX_RANK``, ``MLX_HOSTFILE``); (3) the rank's
shard of the stage's layers (:mod:`.sharding`); (4) a barrier over the control channel, so a
rank that loads faster waits in the kernel rather than in a collective (MLX's ring backend polls
its sockets while a collective is pending: it would spin a core); (5) one all-reduce to prove the
backend works; (6) ``ready`` to the daemon.

Serving: rank 0 reads the daemon's frames (``run``, ``release``, ``stats``, ``stop``) from the
inherited socket, forwards ``run``/``release``/``stop`` to the other ranks over the control
channel in the order it executes them (so every rank enters the same collectives in the same
order: that is why rank 0 relays, rather than the previous stage sending to every member),
computes its part, and answers with the stage's output. The other ranks execute what rank 0
forwards and drop their output. Requests that would fail are refused by rank 0 before anything is
forwarded; a failure after that (a lost peer) is fatal for the whole group.

Watchdog (MLX's collectives hang when a peer vanishes without closing its sockets, MLX #3910):
a thread checks every ``WATCHDOG_INTERVAL_S`` that the parent daemon lives and, while a step
runs, that it has not run longer than ``spec.step_timeout_s`` and that neither the daemon nor a
peer has closed its connection; any of those ends the process at once (``os._exit``: a thread
stuck in a collective never returns). Between steps every rank waits in ``select`` on all its
connections (no spinning), so a member that dies or is stopped ends the group at once: a rank
stopped by its own daemon tells rank 0 it is leaving, and rank 0 stops the others. On Linux
the kernel also kills the runner when the thread that started it dies (``PR_SET_PDEATHSIG``).
``mx.eval`` releases the GIL while it waits, so the watchdog runs during collectives.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas
from meshd.runtime.import_tables import keep_transformers_import_table

enable_fast_blas()  # before mlx.core
keep_transformers_import_table()  # the daemon's folder, from the environment it gave us

import argparse
import contextlib
import ctypes
import errno
import hashlib
import hmac
import logging
import os
import secrets
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from meshd.inference.stage.model import RequestCaches, StageModel, TooManyRequests
from meshd.inference.tensor_parallel.sharding import load_rank_stage
from meshd.inference.tensor_parallel.spec import TensorParallelSpec
from meshd.inference.tensor_parallel.wire import (
    FrameError,
    array_fields,
    check_array,
    from_mx,
    recv_frame,
    send_frame,
    to_mx,
)
from meshd.runtime.device import DeviceUnavailable, apply_from_env

log = logging.getLogger("meshd.tp.runner")

EXIT_STOPPED = 0
EXIT_START_FAILED = 3
EXIT_GROUP_LOST = 4
EXIT_STEP_TIMEOUT = 5
EXIT_PARENT_GONE = 6
WATCHDOG_INTERVAL_S = 0.05
CONTROL_CONNECT_RETRY_S = 0.05
MAX_REQUEST_ID = 256
LOGITS_MODES = ("last", "all", "none")
_PR_SET_PDEATHSIG = 1


class GroupLost(RuntimeError):
    """A peer or the daemon went away: the group cannot continue."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshd.inference.tensor_parallel.runner")
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--ipc-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    ipc = socket.socket(fileno=args.ipc_fd)
    ipc.setblocking(True)
    try:
        spec = TensorParallelSpec.from_json(args.spec.read_text())
    except Exception as error:
        _report_failure(ipc, f"cannot read the spec {args.spec}: {error}")
        return EXIT_START_FAILED
    logging.basicConfig(
        level=logging.INFO,
        format=f"meshd-tp[{spec.name} rank {args.rank}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        apply_from_env()  # compute where the daemon does (meshd.runtime.device)
    except DeviceUnavailable as error:
        _report_failure(ipc, str(error))
        return EXIT_START_FAILED
    runner = Runner(spec, args.rank, ipc, args.parent_pid)
    return runner.run(args.startup_timeout)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL when the daemon's thread that started us exits; everywhere: exit if the
    daemon is already gone (the watchdog keeps checking)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(EXIT_PARENT_GONE)


def _report_failure(ipc: socket.socket, message: str) -> None:
    with contextlib.suppress(OSError):
        send_frame(ipc, {"type": "failed", "message": message})


def _report_lost(ipc: socket.socket, message: str) -> None:
    """Tell the daemon why the group ended (which member left), before exiting: the daemon's
    error for the request in flight, and its status, name the lost member."""
    with contextlib.suppress(OSError):
        send_frame(ipc, {"type": "lost", "message": message})


class Watchdog:
    """Ends the process when the daemon dies, or a step overruns or loses a connection, or a
    member closes its connection while the group forms.

    Before it ends the process it tells the daemon why (a ``lost`` frame): it does so only
    while a step runs or the group forms, when the main thread is blocked in the step's
    evaluation or in the backend's start-up and does not write to the daemon itself.
    """

    def __init__(self, parent_pid: int, step_timeout_s: float, ipc: socket.socket) -> None:
        self._parent_pid = parent_pid
        self._step_timeout_s = step_timeout_s
        self._ipc = ipc
        self._step_started: float | None = None
        self._forming = False  # inside startup(): watch the connections, no time bound
        self._report_lock = threading.Lock()  # who writes to the daemon: main thread or this
        self._watched: list[tuple[socket.socket, str]] = []
        self._thread = threading.Thread(target=self._loop, name="tp-watchdog", daemon=True)

    def start(self, watched: list[tuple[socket.socket, str]]) -> None:
        """Watch ``(connection, who is at its other end)`` pairs."""
        self._watched = list(watched)
        self._thread.start()

    def watch(self, watched: list[tuple[socket.socket, str]]) -> None:
        self._watched = list(watched)

    @contextlib.contextmanager
    def step(self):
        self._step_started = time.monotonic()
        try:
            yield
        finally:
            self._step_started = None

    @contextlib.contextmanager
    def startup(self):
        """While the group forms (the backend connects, the stage loads, the barrier): a
        member that closes its control connection ends this rank, so that a peer that failed
        while loading its stage fails this rank too and both daemons try the plan again. Not
        inside ``mx.distributed.init``: the ring's connection attempts hold the GIL (about
        30 s), which is why ranks check their port before they join (``_check_port_free``).
        No time bound: loading a large stage takes minutes; the start-up deadline bounds it."""
        with self._report_lock:
            self._forming = True
        try:
            yield
        finally:
            with self._report_lock:
                self._forming = False

    def _loop(self) -> None:
        while True:
            time.sleep(WATCHDOG_INTERVAL_S)
            if os.getppid() != self._parent_pid:
                self._die(EXIT_PARENT_GONE, "the daemon that owns this runner is gone")
            started = self._step_started
            if started is None and not self._forming:
                continue  # between steps the main thread watches the connections itself
            if started is not None and time.monotonic() - started > self._step_timeout_s:
                self._die(
                    EXIT_STEP_TIMEOUT,
                    f"a step ran longer than {self._step_timeout_s:g} s (a peer hangs?)",
                )
            when = "during a step" if started is not None else "while the group formed"
            for sock, who in self._watched:
                if _closed(sock):
                    self._die(EXIT_GROUP_LOST, f"{who} closed its connection {when}")

    def _die(self, code: int, reason: str) -> None:
        self._report_lock.acquire()  # held until the exit: the main thread writes no more
        if self._step_started is not None or self._forming:
            _report_lost(self._ipc, reason)
        with contextlib.suppress(Exception):
            sys.stderr.write(f"meshd-tp runner {os.getpid()}: {reason}; exiting\n")
            sys.stderr.flush()
        os._exit(code)


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` or it failed (data waiting to be read is left there)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class Runner:
    """One rank: start-up (module docstring), then serve until stopped or the group is lost."""

    def __init__(
        self, spec: TensorParallelSpec, rank: int, ipc: socket.socket, parent_pid: int
    ) -> None:
        if not 0 <= rank < spec.size:
            raise ValueError(f"rank {rank} is outside a group of {spec.size}")
        self.spec = spec
        self.rank = rank
        self.ipc = ipc
        self.peers: list[socket.socket] = []  # rank 0: ranks 1.. in order; others: rank 0
        self.watchdog = Watchdog(parent_pid, spec.step_timeout_s, ipc)
        self.stage: StageModel | None = None
        self.caches: RequestCaches | None = None
        self.group: Any = None
        self.steps = 0
        self.relay_s = 0.0  # rank 0: time spent sending steps to the other ranks
        self.compute_s = 0.0  # time in the stage's evaluation, collectives included

    # ------------------------------------------------------------------ start-up

    def member(self, rank: int) -> str:
        """Rank ``rank`` in words, with its node: what messages about a lost member say."""
        return f"member {self.spec.members[rank].node_id} (rank {rank})"

    def _peer_names(self) -> list[str]:
        """Who is at the other end of each connection in ``self.peers``."""
        if self.rank == 0:
            return [self.member(rank) for rank in range(1, self.spec.size)]
        return [self.member(0)]

    def run(self, startup_timeout_s: float) -> int:
        self.watchdog.start([(self.ipc, "the daemon")])
        deadline = time.monotonic() + startup_timeout_s
        started = time.monotonic()
        try:
            _check_port_free(self.spec, self.rank)
            self._connect_control(deadline)
            named = list(zip(self.peers, self._peer_names(), strict=True))
            self.watchdog.watch([(self.ipc, "the daemon"), *named])
            with self.watchdog.startup():
                self._form_group(deadline)
        except Exception as error:
            log.error("start-up failed: %s", error)
            _report_failure(self.ipc, f"rank {self.rank}: {type(error).__name__}: {error}")
            return EXIT_START_FAILED
        send_frame(
            self.ipc,
            {
                "type": "ready",
                "rank": self.rank,
                "pid": os.getpid(),
                "held_bytes": self.stage.nbytes,
                "peak_bytes": int(mx.get_peak_memory()),
                "load_s": round(time.monotonic() - started, 3),
            },
        )
        log.info("ready: %d bytes of weights", self.stage.nbytes)
        try:
            if self.rank == 0:
                return self._serve_leader()
            return self._serve_follower()
        except (GroupLost, FrameError, OSError) as error:
            log.error("group lost: %s", error)
            _report_lost(self.ipc, str(error))
            return EXIT_GROUP_LOST

    def _form_group(self, deadline: float) -> None:
        """The backend's group, this rank's stage, and a check that every rank is there."""
        if self.spec.size > 1:
            self.group = mx.distributed.init(backend=self.spec.backend, strict=True)
            if (self.group.size(), self.group.rank()) != (self.spec.size, self.rank):
                raise GroupLost(
                    f"the {self.spec.backend} backend formed rank {self.group.rank()} of "
                    f"{self.group.size()}, the spec says rank {self.rank} of {self.spec.size}"
                )
        mx.reset_peak_memory()
        self.stage = load_rank_stage(self.spec, self.rank, self.group)
        self.caches = RequestCaches(self.stage)
        self._barrier(deadline)
        if self.group is not None:
            with self.watchdog.step():
                total = mx.distributed.all_sum(mx.ones(1), group=self.group)
                mx.eval(total)
            if int(total.item()) != self.spec.size:
                raise GroupLost(f"the check all-reduce gave {total.item()}, not the size")

    def _connect_control(self, deadline: float) -> None:
        if self.spec.size == 1:
            return
        if self.rank == 0:
            self.peers = _accept_members(self.spec, deadline)
        else:
            self.peers = [_join_leader(self.spec, self.rank, deadline)]
        for peer in self.peers:
            _tune(peer)

    def _barrier(self, deadline: float) -> None:
        """Every rank has loaded: ranks > 0 say so, rank 0 answers when all have."""
        if self.spec.size == 1:
            return
        if self.rank == 0:
            for peer in self.peers:
                peer.settimeout(max(0.1, deadline - time.monotonic()))
                frame = recv_frame(peer)
                if frame is None or frame[0]["type"] != "loaded":
                    raise GroupLost("a member closed its control connection while loading")
                peer.settimeout(None)
            for peer in self.peers:
                send_frame(peer, {"type": "go"})
        else:
            (leader,) = self.peers
            send_frame(leader, {"type": "loaded"})
            leader.settimeout(max(0.1, deadline - time.monotonic()))
            frame = recv_frame(leader)
            if frame is None or frame[0]["type"] != "go":
                raise GroupLost("rank 0 closed the control connection while loading")
            leader.settimeout(None)

    # ------------------------------------------------------------------ serving

    def _serve_leader(self) -> int:
        """Rank 0: the daemon's frames in order; between them, the members' connections are
        watched too, so a member that leaves or dies ends the group without waiting for a step."""
        selector = selectors.DefaultSelector()
        selector.register(self.ipc, selectors.EVENT_READ, None)
        for rank, peer in enumerate(self.peers, start=1):
            selector.register(peer, selectors.EVENT_READ, rank)
        while True:
            for key, _ in selector.select():
                if key.data is not None:  # a member: it only ever says it is leaving
                    frame = recv_frame(key.fileobj)  # type: ignore[arg-type]
                    self._forward({"type": "stop"})
                    if frame is not None and frame[0]["type"] == "leaving":
                        log.info("rank %d was stopped by its daemon; the group ends", key.data)
                        return EXIT_STOPPED
                    raise GroupLost(f"{self.member(key.data)} closed its control connection")
                if self._serve_leader_frame() is not None:
                    return EXIT_STOPPED

    def _serve_leader_frame(self) -> int | None:
        """One frame from the daemon; EXIT_STOPPED when the runner must stop."""
        frame = recv_frame(self.ipc)
        if frame is None:
            self._forward({"type": "stop"})
            return EXIT_STOPPED
        header, payload = frame
        kind = header["type"]
        if kind == "stop":
            self._forward(header)
            return EXIT_STOPPED
        if kind == "stats":
            send_frame(self.ipc, {"type": "stats", "id": header.get("id"), **self._stats()})
            return None
        if kind not in ("run", "release"):
            send_frame(self.ipc, _error(header, f"unknown frame type {kind!r}", fatal=False))
            return None
        refusal = self._refusal(header, payload)
        if refusal is not None:
            send_frame(self.ipc, _error(header, refusal, fatal=False))
            return None
        self._forward(header, payload)
        try:
            reply, data = self._execute(header, payload)
        except Exception as error:  # a collective failed: the group is broken
            send_frame(self.ipc, _error(header, f"{type(error).__name__}: {error}", True))
            raise GroupLost(str(error)) from error
        send_frame(self.ipc, reply, data)
        return None

    def _serve_follower(self) -> int:
        """Ranks > 0: rank 0's frames; the own daemon only asks for stats or a stop, and a stop
        is announced to rank 0 so it ends the group in order."""
        (leader,) = self.peers
        selector = selectors.DefaultSelector()
        selector.register(self.ipc, selectors.EVENT_READ, "daemon")
        selector.register(leader, selectors.EVENT_READ, "leader")
        while True:
            for key, _ in selector.select():
                source = key.fileobj
                frame = recv_frame(source)  # type: ignore[arg-type]
                if key.data == "daemon":
                    if frame is None or frame[0]["type"] == "stop":
                        with contextlib.suppress(OSError):
                            send_frame(leader, {"type": "leaving", "rank": self.rank})
                        return EXIT_STOPPED
                    if frame[0]["type"] == "stats":
                        reply = {"type": "stats", "id": frame[0].get("id"), **self._stats()}
                        send_frame(self.ipc, reply)
                    continue
                if frame is None:
                    raise GroupLost(f"{self.member(0)} closed the control connection")
                header, payload = frame
                if header["type"] == "stop":
                    return EXIT_STOPPED
                self._execute(header, payload)

    def _forward(self, header: dict[str, Any], payload: bytes = b"") -> None:
        started = time.perf_counter()
        for peer in self.peers:
            try:
                send_frame(peer, header, payload)
            except OSError as error:
                if header["type"] == "stop":
                    continue
                raise GroupLost(f"cannot reach a member: {error}") from error
        self.relay_s += time.perf_counter() - started

    def _refusal(self, header: dict[str, Any], payload: bytes) -> str | None:
        """Why rank 0 refuses this frame before any rank acts on it (None: accepted)."""
        assert self.stage is not None and self.caches is not None
        request = header.get("request")
        if not isinstance(request, str) or not 0 < len(request) <= MAX_REQUEST_ID:
            return f"request id must be a string of 1-{MAX_REQUEST_ID} characters"
        if header["type"] == "release":
            return None
        if header.get("logits") not in LOGITS_MODES:
            return f"logits must be one of {', '.join(LOGITS_MODES)}"
        try:
            dtype, shape = check_array(header, payload)
        except FrameError as error:
            return str(error)
        if self.stage.has_embedding:
            if dtype not in ("int32", "uint32") or len(shape) != 2 or shape[0] != 1:
                return f"the first stage takes token ids as int32 (1, n), got {dtype} {shape}"
            tokens = np.frombuffer(payload, dtype=np.dtype(dtype))
            if tokens.size and not 0 <= int(tokens.min()) <= int(tokens.max()) < (
                self.stage.vocab_size
            ):
                return f"a token id is outside the vocabulary of {self.stage.vocab_size}"
        elif (
            dtype not in ("float32", "float16", "bfloat16")
            or len(shape) != 3
            or (shape[0] != 1 or shape[2] != self.stage.hidden_size)
        ):
            return (
                f"stage {self.spec.layer_range} takes hidden states (1, n, "
                f"{self.stage.hidden_size}), got {dtype} {shape}"
            )
        if shape[1] < 1:
            return "a step needs at least one position"
        try:
            self.caches.get(request)  # every rank opens it, in this order, when it executes
        except TooManyRequests as error:
            return str(error)
        return None

    def _execute(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        assert self.stage is not None and self.caches is not None
        request = header["request"]
        if header["type"] == "release":
            self.caches.release(request)
            return {"type": "released", "id": header.get("id")}, b""
        dtype, shape = check_array(header, payload)
        inputs = to_mx(dtype, shape, payload)
        logits = header["logits"] if self.rank == 0 else "none"
        started = time.perf_counter()
        with self.watchdog.step():
            output = self.stage.run(inputs, self.caches.get(request), logits=logits)
            mx.eval(output)
        self.compute_s += time.perf_counter() - started
        self.steps += 1
        if self.rank != 0:
            return {}, b""
        out_dtype, out_shape, data = from_mx(output)
        reply = {"type": "result", "id": header.get("id"), **array_fields(out_dtype, out_shape)}
        return reply, data

    def _stats(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "steps": self.steps,
            "relay_s": round(self.relay_s, 6),
            "compute_s": round(self.compute_s, 6),
            "requests": len(self.caches or ()),
            "held_bytes": self.stage.nbytes if self.stage else 0,
            "active_bytes": int(mx.get_active_memory()),
            "peak_bytes": int(mx.get_peak_memory()),
        }


def _error(header: dict[str, Any], message: str, fatal: bool) -> dict[str, Any]:
    return {"type": "error", "id": header.get("id"), "message": message, "fatal": fatal}


# --- The control channel -----------------------------------------------------------------------


def _proof(spec: TensorParallelSpec, nonce: str, rank: int) -> str:
    message = f"{nonce}|{spec.plan_id}|{spec.stage_index}|{rank}".encode()
    return hmac.new(bytes.fromhex(spec.token), message, hashlib.sha256).hexdigest()


def _accept_members(spec: TensorParallelSpec, deadline: float) -> list[socket.socket]:
    """Rank 0: one authenticated control connection per other rank, in rank order."""
    host, port = spec.control_address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    peers: dict[int, socket.socket] = {}
    try:
        listener.bind((host, port))
        listener.listen(spec.size * 2)
        while len(peers) < spec.size - 1:
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                missing = sorted(set(range(1, spec.size)) - set(peers))
                raise GroupLost(f"ranks {missing} did not join within the start-up time") from None
            rank = _authenticate(conn, spec, deadline)
            if rank is None or rank in peers:
                conn.close()
                continue
            peers[rank] = conn
    except BaseException:
        for conn in peers.values():
            conn.close()
        raise
    finally:
        listener.close()
    return [peers[rank] for rank in range(1, spec.size)]


def _authenticate(conn: socket.socket, spec: TensorParallelSpec, deadline: float) -> int | None:
    """The rank a connecting runner proves it is (None: it does not know the token)."""
    conn.settimeout(min(5.0, max(0.01, deadline - time.monotonic())))
    nonce = secrets.token_hex(16)
    try:
        send_frame(conn, {"type": "challenge", "nonce": nonce})
        frame = recv_frame(conn)
    except (OSError, FrameError):
        return None
    if frame is None or frame[0].get("type") != "hello":
        return None
    rank = frame[0].get("rank")
    proof = frame[0].get("proof")
    if not isinstance(rank, int) or not 0 < rank < spec.size or not isinstance(proof, str):
        return None
    if not hmac.compare_digest(proof, _proof(spec, nonce, rank)):
        log.warning("refused a control connection that does not know the group's token")
        return None
    send_frame(conn, {"type": "welcome"})
    conn.settimeout(None)
    return rank


def _check_port_free(spec: TensorParallelSpec, rank: int) -> None:
    """Fail now, alone, when this rank's ring port cannot be bound.

    The ring binds it only once every rank has joined, and a rank that fails there leaves
    the others in the backend's connection attempts, which hold the GIL for about 30 s. A
    rank that fails before it joins costs the others nothing: they keep waiting for it
    within the start-up deadline, and its daemon tries the plan again a moment later. Bound
    as MLX's ring binds it (SO_REUSEADDR, SO_REUSEPORT), so only a port the ring could not
    bind either fails here (a listener, or an outgoing connection that holds it)."""
    if spec.backend != "ring" or spec.size < 2:
        return
    member = spec.members[rank]
    family = socket.AF_INET6 if ":" in member.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind((member.host, member.port))
        except OSError as error:
            raise GroupLost(
                f"this rank's ring port {member.address} is in use ({error.strerror}): another "
                "program or an outgoing connection holds it; the daemon tries the plan again "
                "(tensor_parallel_port moves the range)"
            ) from error


def _join_leader(spec: TensorParallelSpec, rank: int, deadline: float) -> socket.socket:
    """Ranks > 0: connect to rank 0 (retrying until the deadline) and prove the token."""
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection(spec.control_address, timeout=2.0)
        except OSError as error:
            last_error = error
            time.sleep(CONTROL_CONNECT_RETRY_S)
            continue
        try:
            frame = recv_frame(conn)
            if frame is None or frame[0].get("type") != "challenge":
                raise GroupLost("rank 0 did not send a challenge")
            nonce = str(frame[0].get("nonce"))
            send_frame(conn, {"type": "hello", "rank": rank, "proof": _proof(spec, nonce, rank)})
            frame = recv_frame(conn)
            if frame is None or frame[0].get("type") != "welcome":
                raise GroupLost("rank 0 refused this runner (a different plan or mesh?)")
            conn.settimeout(None)
            return conn
        except (OSError, FrameError) as error:
            conn.close()
            last_error = error
            time.sleep(CONTROL_CONNECT_RETRY_S)
    raise GroupLost(
        f"could not join rank 0's control channel at {spec.control_address}: {last_error}"
    )


def _tune(sock: socket.socket) -> None:
    """No Nagle delay; keepalive so a silently cut link is noticed within seconds."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if user_timeout is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, user_timeout, 5000)


if __name__ == "__main__":
    with contextlib.suppress(OSError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon stops us, not the terminal
    try:
        sys.exit(main())
    except OSError as error:
        if error.errno == errno.EPIPE:
            sys.exit(EXIT_GROUP_LOST)
        raise
