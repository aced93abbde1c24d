"""What a hop costs at the least on this machine, without a daemon: the floor under meshd's.

The goal for a hop (one stage's result reaching the next stage's compute) is 0.5 ms. Real
daemons in network namespaces measure 0.5-0.8 ms over lanes on a 2-core x86_64 VM
(``bench_batching.py --scaling --hop-trace``; docs/performance.md has the runs). This
benchmark strips the daemon away to show what each
data-plane design would cost here: two processes, each in its own network namespace (tests/netns.py:
a bridge in its own namespace, nothing touches the machine's interfaces) and each pinned to
one core, pass one greedy SmolLM2-135M decode back and forth over the product's own lanes
(:mod:`meshd.inference.transport.lanes`: mutual TLS 1.3 with mesh certificates, length-prefixed
``dataplane.Frame`` messages). A computes layers 0-15 and sends the hidden states; B computes
layers 15-30, the norm and the head, and sends the greedy token back. No stage core, no
fencing, no gRPC, no other thread of a daemon. A hop is timed from the sender's compute done
to the receiver's next compute start; both processes read one clock (one kernel).

Modes, each a design the data plane could have:

* ``thread``: the lane's loop hands each step to one compute thread and gets the result back
  (what the daemon does: ``StageRuntime`` on the asyncio loop, MLX on the compute thread).
* ``inline``: the step runs on the loop that owns the lane, so no thread is crossed (the
  "data-plane thread" redesign, at its cheapest). ``inline-settle``: the same, but right
  after each send the thread asks glibc for one 4 KiB block and frees it
  (:func:`settle_allocator`), so glibc sorts the blocks the forward pass freed while the
  thread waits, not when the next frame's bytes are allocated (see "The allocator").
* ``idle``: no compute at all, the same frames ping-ponged: what the same code costs when
  the core's caches were not just flushed by tens of milliseconds of matrix work.
* ``thread-poll``: ``thread``, but the lane's loop never sleeps: for the whole run it polls
  its sockets (``epoll_wait`` with no timeout), as busy-polling data planes (DPDK, RDMA verbs)
  do. It costs a core's worth of CPU, and while its own compute thread works it contends
  with it for the GIL (that lengthens the compute, which the hop does not count).
* ``idle-gap``, ``thread-gap``, ``raw-gap``, ``direct-gap``: ``idle``, ``thread``, ``raw`` and
  ``direct`` with no compute either, but each stage sleeps ``--gap-ms`` (40: about a SmolLM2
  stage's step here) where it would compute, so its peer waits idle as long as it does
  between a daemon's hops. They tell what makes a hop cold: the forward pass that evicts the
  caches, or only the time the core waits (see "Idle, not the forward pass").
* ``raw``: the least any design can pay here: the same compute, then the bytes (a 4-byte
  length, no TLS, no protobuf, no event loop) on a plain blocking TCP socket; the receiver
  waits in ``recv``. ``raw-poll``: the receiver spins on a non-blocking ``recv`` instead.
* ``direct``: what a data-plane thread would cost: ``raw``'s shape (the thread that computes
  writes the frame and waits in ``recv`` for the next one, no event loop, no hand-over), but
  with everything the product keeps: mutual TLS 1.3 with the mesh certificates and
  length-prefixed ``dataplane.Frame`` messages. ``direct-poll``: its receiver spins.
  ``direct-select``: its socket is non-blocking and the thread waits in ``select`` on it and
  on a wake-up socket, as a data-plane thread serving several lanes and the loop's requests
  would.

Each mode prints the median per hop and where it goes, per direction (A -> B carries 2.3 KB
of hidden states, B -> A a token) and over both: compute done -> send, serialize,
``SSLSocket.send`` (on a veth pair the sender's kernel also runs the receiver's TCP path),
send -> the receiver's callback (wire, wake-up, decrypt, parse), and callback -> compute.

Idle, not the forward pass (a 2-core Firecracker VM, ``--runs 2 --malloc default``): with no
compute anywhere, the lanes' hop grows with the time both sides wait before it: ``idle``
0.06-0.10 ms, and with a gap of 0.2, 1, 5, 20 and 40 ms 0.12, 0.10, 0.25, 0.48 and 0.48-0.54
ms. ``thread-gap`` (no forward pass, 40 ms asleep) took 0.64-0.68 ms against ``thread``'s
0.60-0.65 with SmolLM2 computing; plain TCP 0.24 ms either way (``raw``, ``raw-gap``),
``direct`` 0.39 against ``direct-gap`` 0.42. So what a hop pays here on top of its warm cost
comes with the wait itself: after tens of milliseconds idle, the hop's code runs as on a cold
core whether or not the stage computed meanwhile. Keeping the vCPUs from halting does not keep
it warm: a lower-priority process spinning on both cores (``chrt --idle 0``) moved ``idle-gap``
only from 0.52 to 0.46 ms. Nor does touching the path shortly before the frame comes: a probe
daemon that sent its peer a small frame ~0.7-2 ms before each step's end (the peer ran its
fence check and woke its compute thread) left the traced hop at 0.51-0.58 ms against 0.51-0.60
without (4 interleaved rounds), so it was not kept.

The allocator: each mode runs with glibc's default malloc and again with its fastbins off
(``GLIBC_TUNABLES=glibc.malloc.mxfast=0``; ``--malloc`` picks one). Why: a forward pass frees
thousands of small blocks into the computing thread's fastbins, and the next request of that
thread for a large block (OpenSSL's ~17 KB record buffer, which CPython's ``ssl`` allocates
per write and frees again: ``SSL_MODE_RELEASE_BUFFERS``) first coalesces them all
(``malloc_consolidate``): 0.6-0.7 ms, seen with ``perf record`` between a send's last
syscall and its ``write``. It lands on the hop wherever the thread that computed also sends
(``inline``, ``direct``); the daemon's loop thread sends from its own arena. The receive
side has the same cost where the thread that computed parses the next frame: its first large
``bytes`` after the pass (the frame's data, 2.3 KB) sorts everything the pass freed, 0.5-0.8
ms of ``inline``'s hop (0.82-0.93 ms against 0.46-0.48 for ``inline-settle``).
``direct`` does not pay it on the hop because its ``recv`` of 64 KB allocates before it
blocks. Both contexts here keep their record buffers
(:func:`meshd.runtime.tls_buffers.keep_record_buffers`), as the daemon's lanes do, so a
send no longer makes that allocation; a frame's own bytes still do.

    sudo .venv/bin/python benchmarks/bench_hop_floor.py [--tokens 64] [--runs 2]
        [--modes thread inline inline-settle idle thread-poll raw raw-poll direct direct-poll
                 direct-select idle-gap thread-gap raw-gap direct-gap]
        [--malloc both|default|no-fastbins] [--gap-ms 40]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ctypes
import functools
import itertools
import os
import selectors
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PORT = 7401
MODES = [
    "thread", "inline", "inline-settle", "idle", "thread-poll", "raw", "raw-poll", "direct",
    "direct-poll", "direct-select", "idle-gap", "thread-gap", "raw-gap", "direct-gap",
]  # fmt: skip
ALLOCATORS = ("default", "no-fastbins")
RAW_HEADER = struct.Struct(">I")  # the raw modes' length prefix, and their token id
MARK_NAMES = ("computed", "serialized", "sent", "received", "computing")
Marks = dict[str, list[float]]  # what one side noted: name -> times (time.perf_counter)


def stage_process(
    role: str, my_ip: str, peer_ip: str, mode: str, tokens: int, root: Path, gap_s: float
) -> None:
    """One side, in its namespace: A dials B's lane and starts each token; B answers. A
    ``-gap`` mode runs its design without compute, sleeping ``gap_s`` instead."""
    label, gap = mode, mode.endswith("-gap")
    mode = mode.removesuffix("-gap")
    from meshd.runtime.blas import enable_fast_blas

    enable_fast_blas()  # before mlx.core, as the daemon does
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from meshd.inference.transport import lanes
    from meshd.mesh import security
    from meshd.models.store import ModelStore
    from meshd.runtime import tls_buffers
    from meshd.wire import dataplane_pb2 as dp

    secret = security.load_secret(root / "mesh")
    credentials = security.load_or_create_node_credentials(root / role, secret, role)
    server_context, client_context = security.ssl_contexts(credentials)
    for context in (server_context, client_context):  # as the daemon's lanes do
        tls_buffers.keep_record_buffers(context)
    model, _ = load_model(ModelStore(root / "store").ensure_default().path)
    mx.eval(model.parameters())
    inner = model.model
    start, end = (0, 15) if role == "a" else (15, len(inner.layers))
    layers = inner.layers[start:end]
    cache = make_prompt_cache(model)[start:end]
    marks: list[tuple[str, float]] = []
    idle_hidden = bytes(4 * inner.embed_tokens.weight.shape[1])  # what A sends in idle mode

    def compute(payload: int | bytes) -> int | bytes:
        """A: a token id in, hidden states out; B: hidden states in, the greedy token out."""
        marks.append(("computing", time.perf_counter()))
        if mode == "idle" or gap:
            if gap:
                time.sleep(gap_s)  # the peer waits idle meanwhile, as while a stage computes
            result: int | bytes = 0 if role == "b" else idle_hidden
        else:
            if isinstance(payload, int):
                hidden = inner.embed_tokens(mx.array([[payload]]))
            else:
                hidden = mx.array(np.frombuffer(payload, dtype=np.float32).reshape(1, 1, -1))
            mask = create_attention_mask(hidden, cache[0])
            for layer, layer_cache in zip(layers, cache, strict=True):
                hidden = layer(hidden, mask, layer_cache)
            if role == "a":
                mx.eval(hidden)
                result = bytes(memoryview(hidden))
            else:
                logits = inner.embed_tokens.as_linear(inner.norm(hidden))
                result = int(mx.argmax(logits[0, -1]).item())
        marks.append(("computed", time.perf_counter()))
        return result

    def frame_for(result: int | bytes) -> dp.Frame:
        frame = dp.Frame(plan_id="plan", request_id="request")
        if isinstance(result, bytes):
            frame.activation.step = 1
            frame.activation.dtype = "float32"
            frame.activation.shape.extend([1, 1, len(result) // 4])
            frame.activation.data = result
        else:
            frame.token.token_id = result  # only B sends tokens
            frame.token.index = 1
        return frame

    async def run() -> None:
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        finished: asyncio.Future[None] = loop.create_future()
        lane_box: list[lanes.Lane] = []
        done_tokens = [0]

        def send(result: int | bytes) -> None:
            lane = lane_box[0]
            payload = frame_for(result).SerializeToString()
            data = lanes.HEADER.pack(len(payload)) + payload
            marks.append(("serialized", time.perf_counter()))
            # The lane's socket itself, so that serializing and sending are timed apart (a
            # frame of 2.3 KB is one TLS record the socket takes at once).
            lane._sock.sendall(data)
            marks.append(("sent", time.perf_counter()))
            if mode == "inline-settle":
                settle_allocator()  # off the hop: the next frame comes a pass later

        def step(payload: int | bytes) -> None:
            if mode.startswith("thread"):
                job = pool.submit(compute, payload)
                job.add_done_callback(lambda done: loop.call_soon_threadsafe(send, done.result()))
            else:  # inline, idle: on this loop, on its next turn (never re-entrantly)
                loop.call_soon(lambda: send(compute(payload)))

        def on_frame(peer: str, frame: dp.Frame) -> None:
            marks.append(("received", time.perf_counter()))
            if frame.HasField("end"):
                finished.set_result(None)
            elif frame.HasField("hello"):
                step(1)  # B is ready: A starts
            elif role == "b":
                step(frame.activation.data)
            else:
                done_tokens[0] += 1
                if done_tokens[0] >= tokens:
                    lane_box[0].send(dp.Frame(end=dp.End()))
                    loop.call_later(0.2, finished.set_result, None)
                else:
                    step(frame.token.token_id)

        def lost(*_: object) -> None:
            if not finished.done():
                finished.set_result(None)

        if role == "b":
            listener = lanes.LaneListener(server_context, on_frame, lambda peer: None, lost)
            await listener.start(my_ip, PORT)
            while "a" not in listener.lanes:
                await asyncio.sleep(0.01)
            lane_box.append(listener.lanes["a"])
            lane_box[0].send(dp.Frame(hello=dp.Hello(node_id="b")))
        else:
            for _ in range(100):
                try:
                    lane = await lanes.dial(
                        f"{peer_ip}:0", PORT, client_context, "b", on_frame, lost, 5.0
                    )
                except lanes.LaneClosed:
                    await asyncio.sleep(0.1)
                    continue
                lane_box.append(lane)
                break
        if mode == "thread-poll":
            poller = asyncio.ensure_future(poll_until(finished))
        await asyncio.wait_for(finished, 600)
        if mode == "thread-poll":
            await poller
        pool.shutdown()

    def run_raw(wait: str, tls: bool) -> None:
        """The raw and direct modes: A dials B, each token's result goes out as soon as it is
        computed, by the thread that computed it, and a zero length ends the run. ``wait``:
        how the receiver waits (``block`` in ``recv``, ``poll``, or ``select``)."""
        if role == "b":
            with socket.create_server((my_ip, PORT)) as listener:
                sock, _ = listener.accept()
            if tls:
                sock = server_context.wrap_socket(sock, server_side=True)
        else:
            sock = dial_raw(peer_ip)
            if tls:
                sock = client_context.wrap_socket(sock, server_hostname=security.TLS_SERVER_NAME)
        waker, woken = socket.socketpair()  # what the loop would write to; nobody does here
        with sock, waker, woken, selectors.DefaultSelector() as selector:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(wait == "block")
            selector.register(sock, selectors.EVENT_READ)
            selector.register(woken, selectors.EVENT_READ)
            if role == "a":
                send_raw(sock, compute(1), tls)
            done, reader = 0, RawReader(sock, selector if wait == "select" else None)
            while (data := reader.message()) is not None:
                marks.append(("received", time.perf_counter()))
                payload = parse_raw(data, tls)
                if role == "b":
                    send_raw(sock, compute(payload), tls)
                    continue
                done += 1
                if done >= tokens:
                    sock.sendall(RAW_HEADER.pack(0))
                    break
                send_raw(sock, compute(payload), tls)

    def parse_raw(data: bytes, tls: bool) -> int | bytes:
        """What a received message carries: hidden states (for B) or a token id (for A)."""
        if not tls:
            return data if role == "b" else RAW_HEADER.unpack(data)[0]
        frame = dp.Frame.FromString(data)
        return frame.activation.data if role == "b" else frame.token.token_id

    def send_raw(sock: socket.socket, result: int | bytes, tls: bool) -> None:
        if tls:
            body = frame_for(result).SerializeToString()
        else:
            body = RAW_HEADER.pack(result) if isinstance(result, int) else result
        data = RAW_HEADER.pack(len(body)) + body
        marks.append(("serialized", time.perf_counter()))
        sock.sendall(data)  # a few KB: the socket's buffer takes them at once
        marks.append(("sent", time.perf_counter()))

    if mode.startswith(("raw", "direct")):
        wait = mode.partition("-")[2] or "block"
        run_raw(wait, tls=mode.startswith("direct"))
    else:
        asyncio.run(run())
    with open(root / f"marks-{role}-{label}.txt", "w") as out:
        out.writelines(f"{name} {at:.7f}\n" for name, at in marks)


def allocator_environment(allocator: str) -> dict[str, str]:
    """The stage processes' environment: this one's, with glibc's fastbins off if asked."""
    env = dict(os.environ)
    if allocator == "no-fastbins":
        tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
        env["GLIBC_TUNABLES"] = ":".join([*tunables, "glibc.malloc.mxfast=0"])
    return env


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)  # the process's own symbols: glibc's malloc here
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def settle_allocator() -> None:
    """Have glibc sort the blocks this thread freed, now: one large request (4 KiB, over
    glibc's 1 KiB small-request limit) and its free, through ctypes (without the GIL)."""
    libc = _libc()
    libc.free(libc.malloc(4096))


async def poll_until(finished: asyncio.Future[None]) -> None:
    """Keep the loop polling its sockets without sleeping until ``finished`` (thread-poll)."""
    while not finished.done():
        await asyncio.sleep(0)


def dial_raw(peer_ip: str) -> socket.socket:
    """A plain TCP connection to B, retried while B is still starting (10 s at most)."""
    for _ in range(100):
        try:
            return socket.create_connection((peer_ip, PORT), timeout=5)
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"B at {peer_ip}:{PORT} did not answer in 10 s")


class RawReader:
    """Length-prefixed messages off a TCP or TLS socket, read in large chunks as a lane reads
    (a read of exactly the bytes still missing would wait for each TCP segment on its own)."""

    def __init__(self, sock: socket.socket, selector: selectors.BaseSelector | None) -> None:
        self.sock = sock
        self.selector = selector
        self.buffer = bytearray()

    def message(self) -> bytes | None:
        """The next message (``None`` for the zero length that ends a run); waits on a
        blocking socket, and on a non-blocking one in ``select`` if given one, else spins."""
        (length,) = RAW_HEADER.unpack(self.take(RAW_HEADER.size))
        return self.take(length) if length else None

    def take(self, size: int) -> bytes:
        while len(self.buffer) < size:
            try:
                chunk = self.sock.recv(1 << 16)
            except (BlockingIOError, ssl.SSLWantReadError):
                if self.selector is not None:
                    self.selector.select()
                continue
            if not chunk:
                raise ConnectionError("the other side closed the connection mid-run")
            self.buffer += chunk
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data


def read_marks(path: Path) -> Marks:
    marks: Marks = {name: [] for name in MARK_NAMES}
    for line in path.read_text().splitlines():
        name, at = line.split()
        marks[name].append(float(at))
    return marks


def hops(sender: Marks, receiver: Marks) -> dict[str, list[float]]:
    """Each hop's parts in ms: the sender's compute done -> serialized -> sent, then the
    receiver's callback for that frame and its compute start (one clock: same kernel)."""
    parts: dict[str, list[float]] = {}
    for index, sent in enumerate(sender["sent"][2:], start=2):  # the first two warm up
        received = next((at for at in receiver["received"] if at > sent), None)
        computing = next((at for at in receiver["computing"] if received and at > received), None)
        if received is None or computing is None:
            break
        computed, serialized = sender["computed"][index], sender["serialized"][index]
        for name, value in (
            ("compute done -> send", serialized - computed),
            ("SSLSocket.send", sent - serialized),
            ("send -> receiver's callback", received - sent),
            ("callback -> compute", computing - received),
            ("hop", computing - computed),
        ):
            parts.setdefault(name, []).append(value * 1e3)
    return parts


def measure(
    mode: str, tokens: int, root: Path, spawn: Callable[..., subprocess.Popen]
) -> dict[str, dict[str, float]]:
    """One run of ``mode``: the median of each part of a hop, per direction (A -> B carries
    hidden states, B -> A a token) and over both together. Each direction is kept apart
    because their parts can differ a lot, and medians of two mixed shapes do not add up."""
    b = spawn("b", mode, "1")
    a = spawn("a", mode, "0")
    for process in (a, b):
        if process.wait(600) != 0:
            raise RuntimeError(f"the {mode} run failed: {process.stderr.read()[-2000:]}")
    first = read_marks(root / f"marks-a-{mode}.txt")
    second = read_marks(root / f"marks-b-{mode}.txt")
    directions = {"a->b": hops(first, second), "b->a": hops(second, first)}
    both: dict[str, list[float]] = {}
    for parts in directions.values():
        for name, values in parts.items():
            both.setdefault(name, []).extend(values)
    directions["both"] = both
    return {
        direction: {name: statistics.median(values) for name, values in parts.items()}
        for direction, parts in directions.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--malloc", choices=["both", *ALLOCATORS], default="both")
    parser.add_argument(
        "--gap-ms", type=float, default=40.0,
        help="what each stage sleeps instead of computing in the -gap modes",
    )  # fmt: skip
    args = parser.parse_args()
    allocators = list(ALLOCATORS) if args.malloc == "both" else [args.malloc]
    from meshd.mesh import security
    from meshd.models.store import ModelStore
    from tests.netns import Mesh, cleanup_stale, require_root_and_netns

    require_root_and_netns()
    cleanup_stale()
    with tempfile.TemporaryDirectory(prefix="meshd-hop-floor-") as temp, Mesh(2) as mesh:
        root = Path(temp)
        (root / "mesh").mkdir()
        security.save_secret(root / "mesh", security.create_mesh_secret("hop-floor"))
        ModelStore(root / "store").ensure_default()
        nodes = {"a": mesh.nodes[0], "b": mesh.nodes[1]}
        peers = {"a": nodes["b"].ip, "b": nodes["a"].ip}

        def spawner(allocator: str) -> Callable[..., subprocess.Popen]:
            def spawn(role: str, mode: str, cpu: str) -> subprocess.Popen:
                command = ["taskset", "-c", cpu, sys.executable, __file__, "--stage", role]
                command += [nodes[role].ip, peers[role], mode, str(args.tokens), str(root)]
                command.append(str(args.gap_ms / 1e3))
                env = allocator_environment(allocator)
                return nodes[role].popen(command, stderr=subprocess.PIPE, text=True, env=env)

            return spawn

        print(f"load average {os.getloadavg()[0]:.2f}; medians over {args.tokens} tokens")
        for run, mode, allocator in itertools.product(range(args.runs), args.modes, allocators):
            for direction, parts in measure(mode, args.tokens, root, spawner(allocator)).items():
                detail = ", ".join(f"{k} {v:.3f}" for k, v in parts.items() if k != "hop")
                print(
                    f"run {run + 1} {mode:11s} {allocator:11s} {direction:4s} "
                    f"hop {parts['hop']:.3f} ms ({detail})",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--stage":
        role, my_ip, peer_ip, mode, tokens, root, gap_s = sys.argv[2:9]
        stage_process(role, my_ip, peer_ip, mode, int(tokens), Path(root), float(gap_s))
        sys.exit(0)
    sys.exit(main())
