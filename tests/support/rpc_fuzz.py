"""Fuzz every Peer, DataPlane and Local RPC of a real daemon through its real servers.

The fuzzer holds a certificate of the daemon's mesh (valid credentials: it gets past mutual
TLS like a member) and sends, per example, one RPC with a body that is either a random valid
message of the method's type (every field drawn from its type's range, extremes included,
nested messages too), such a message with bytes flipped, inserted or cut, or random bytes.
Streaming methods get a few such messages; the data plane's Link starts with the fuzzer's
own Hello or a fuzzed one, and its frames often name the daemon's committed plan, so they
reach the stage core, not only the fencing.

Every answer must be a status in words: a body that does not parse as its type must be
INVALID_ARGUMENT; any answer must be one of :data:`ANSWERED` (UNKNOWN, INTERNAL or a dead
daemon are failures). Afterwards the daemon's log must hold no traceback and no ERROR line.

    .venv/bin/python -m tests.support.rpc_fuzz --examples 5000     # the larger run
    tests/test_rpc_fuzz.py                                           # a bounded run in CI
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.mesh import channels, security
from meshd.wire import dataplane_pb2 as dp
from meshd.wire import pb

FUZZER_ID = "fuzzer-00000001"
CALL_TIMEOUT_S = 10.0  # generous: a loaded machine must not read as a wedged daemon
STREAM_READ_S = 0.3
# Statuses that answer in words. DEADLINE_EXCEEDED and CANCELLED are the fuzzer's own
# (it ends streams that would go on: WatchStatus, Heartbeat, a Link).
ANSWERED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}
# Well-formed calls not made (their requests have no fields; they still get undecodable
# bodies): Remeasure re-measures the machine for seconds, Leave stops the daemon.
NO_WELL_FORMED = {"/meshd.v1.Local/Remeasure", "/meshd.v1.Local/Leave"}


@dataclass(frozen=True)
class Method:
    path: str
    request_type: Any
    client_streaming: bool
    server_streaming: bool
    local: bool  # on the local API (Unix socket), else on the peer port


def methods() -> list[Method]:
    found = []
    for module, service, local in (
        (pb, "Peer", False),
        (dp, "DataPlane", False),
        (pb, "Local", True),
    ):
        descriptor = module.DESCRIPTOR.services_by_name[service]
        for method in descriptor.methods:
            found.append(
                Method(
                    f"/{descriptor.full_name}/{method.name}",
                    message_factory.GetMessageClass(method.input_type),
                    method.client_streaming,
                    method.server_streaming,
                    local,
                )
            )
    return found


# --- Messages ---------------------------------------------------------------------------------


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 8), st.sampled_from([low, high]), st.integers(low, high))


_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    F.TYPE_DOUBLE: st.floats(),
    F.TYPE_FLOAT: st.floats(width=32),
    F.TYPE_INT64: _ints(-(2**63), 2**63 - 1),
    F.TYPE_SINT64: _ints(-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: _ints(-(2**63), 2**63 - 1),
    F.TYPE_UINT64: _ints(0, 2**64 - 1),
    F.TYPE_FIXED64: _ints(0, 2**64 - 1),
    F.TYPE_INT32: _ints(-(2**31), 2**31 - 1),
    F.TYPE_SINT32: _ints(-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: _ints(-(2**31), 2**31 - 1),
    F.TYPE_UINT32: _ints(0, 2**32 - 1),
    F.TYPE_FIXED32: _ints(0, 2**32 - 1),
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: st.text(max_size=24),
    F.TYPE_BYTES: st.binary(max_size=48),
}


@st.composite
def message_of(draw: st.DrawFn, cls: Any, depth: int = 0, plan_ids: tuple[str, ...] = ()) -> Any:
    """A message of class ``cls`` with random fields (nested up to depth 3)."""
    message = cls()
    for fd in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        if fd.type == F.TYPE_MESSAGE:
            if depth >= 3:
                continue
            sub = message_factory.GetMessageClass(fd.message_type)
            if fd.message_type.GetOptions().map_entry:
                key, value = (
                    fd.message_type.fields_by_name["key"],
                    fd.message_type.fields_by_name["value"],
                )
                for _ in range(draw(st.integers(0, 2))):
                    getattr(message, fd.name)[draw(_value(key, plan_ids))] = draw(
                        _value(value, plan_ids)
                    )
            elif fd.is_repeated:
                for _ in range(draw(st.integers(0, 2))):
                    getattr(message, fd.name).add().CopyFrom(
                        draw(message_of(sub, depth + 1, plan_ids))
                    )
            else:
                getattr(message, fd.name).CopyFrom(draw(message_of(sub, depth + 1, plan_ids)))
            continue
        if fd.is_repeated:
            values = draw(st.lists(_value(fd, plan_ids), max_size=6))
            getattr(message, fd.name).extend(values)
        else:
            setattr(message, fd.name, draw(_value(fd, plan_ids)))
    return message


def _value(fd: Any, plan_ids: tuple[str, ...]) -> st.SearchStrategy[Any]:
    if fd.type == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in fd.enum_type.values]), _ints(0, 99))
    if fd.name in ("plan_id",) and plan_ids:
        return st.one_of(st.sampled_from(plan_ids), _SCALARS[F.TYPE_STRING])
    if fd.name in ("origin_node_id", "node_id", "sender") and fd.type == F.TYPE_STRING:
        return st.one_of(st.just(FUZZER_ID), _SCALARS[F.TYPE_STRING])
    return _SCALARS[fd.type]


@st.composite
def body_of(draw: st.DrawFn, cls: Any, plan_ids: tuple[str, ...]) -> bytes:
    """A serialized message, a mutated one, or random bytes."""
    kind = draw(st.sampled_from(["message", "mutated", "random"]))
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=64))
    data = bytearray(draw(message_of(cls, 0, plan_ids)).SerializeToString())
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 4))):
            action = draw(st.sampled_from(["flip", "insert", "cut"]))
            at = draw(st.integers(0, len(data)))
            if action == "flip" and data:
                data[min(at, len(data) - 1)] ^= draw(st.integers(1, 255))
            elif action == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=4))
            elif data:
                del data[at : at + draw(st.integers(1, 4))]
    return bytes(data)


def parses(cls: Any, body: bytes) -> bool:
    try:
        cls.FromString(body)
    except DecodeError:
        return False
    return True


# --- Calls ------------------------------------------------------------------------------------


@dataclass
class Tally:
    examples: int = 0
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    per_method: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    # what the daemon sent back on Links: frames by kind (tokens mean a Start was computed)
    link_replies: collections.Counter[str] = field(default_factory=collections.Counter)

    def record(self, method: Method, bodies: list[bytes], code: grpc.StatusCode, details: str):
        self.examples += 1
        self.codes[code.name] += 1
        self.per_method[(method.path.rpartition("/")[2], code.name)] += 1
        bad = [body for body in bodies if not parses(method.request_type, body)]
        if code not in ANSWERED:
            self.failures.append(f"{method.path}: {code.name} {details[:200]} for {bodies!r:.200}")
        # A stream's earlier, well-formed messages may end the call first (a Link that does
        # not start with a Hello): only a first body is sure to be read.
        elif (
            bad
            and code != grpc.StatusCode.INVALID_ARGUMENT
            and (not method.client_streaming or bad[0] == bodies[0])
        ):
            self.failures.append(
                f"{method.path}: an undecodable body got {code.name}, not INVALID_ARGUMENT"
            )


class Fuzzer:
    """Channels to one daemon (asyncio side): its peer port as a member, its local API."""

    def __init__(self, peer_address: str, api: str, token: str, folder: Path) -> None:
        secret = security.decode_join_token(token)
        creds = security.load_or_create_node_credentials(folder, secret, FUZZER_ID)
        self.peer = channels.peer_channel(peer_address, security.channel_credentials(creds))
        self.local = grpc.aio.insecure_channel(api)
        self.tally = Tally()

    async def close(self) -> None:
        await self.peer.close()
        await self.local.close()

    async def call(self, method: Method, bodies: list[bytes]) -> None:
        channel = self.local if method.local else self.peer
        bodies = _up_to_the_end(method, bodies)
        # An undecodable body must be refused: wait for the answer as long as any call takes.
        read_s = STREAM_READ_S if all(parses(method.request_type, b) for b in bodies) else None
        try:
            if not method.client_streaming and not method.server_streaming:
                await channel.unary_unary(method.path)(bodies[0], timeout=CALL_TIMEOUT_S)
                ended = True
            elif not method.client_streaming:
                call = channel.unary_stream(method.path)(bodies[0], timeout=CALL_TIMEOUT_S)
                ended = await self._drain(call, read_s)
            elif not method.server_streaming:
                await channel.stream_unary(method.path)(iter(bodies), timeout=CALL_TIMEOUT_S)
                ended = True
            else:
                link = method.path.endswith("/Link")
                call = channel.stream_stream(method.path)(
                    _written_then_held(bodies, STREAM_READ_S), timeout=CALL_TIMEOUT_S
                )
                ended = await self._drain(call, read_s, link=link)
            code, details = grpc.StatusCode.OK, ""
            if not ended:  # the stream went on until the fuzzer ended it
                code, details = grpc.StatusCode.CANCELLED, "ended by the fuzzer"
        except grpc.aio.AioRpcError as error:
            code, details = error.code(), error.details() or ""
            if code == grpc.StatusCode.INTERNAL:
                details += f" ({error.debug_error_string()})"
        self.tally.record(method, bodies, code, details)

    async def _drain(self, call: Any, read_s: float | None, *, link: bool = False) -> bool:
        """Read replies for ``read_s`` (None: until the call's deadline), then end the call
        (streams may go on forever). True when the daemon ended it first."""
        try:
            async with asyncio.timeout(read_s):
                async for reply in call:
                    if link:  # raw bytes: no deserializer on a generic call
                        with contextlib.suppress(DecodeError):
                            frame = dp.Frame.FromString(reply)
                            inner = frame.bundle.frames if frame.HasField("bundle") else [frame]
                            for one in inner:  # frames sent together arrive as one Bundle
                                self.tally.link_replies[one.WhichOneof("body") or "empty"] += 1
            return True
        except TimeoutError:
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call.code()
            return False


async def _written_then_held(bodies: list[bytes], hold_s: float) -> AsyncIterator[bytes]:
    """The bodies of a stream, then a pause before the fuzzer's half-close: a Link stays
    open long enough for the daemon to compute and answer what it was sent."""
    for body in bodies:
        yield body
    await asyncio.sleep(hold_s)


def _up_to_the_end(method: Method, bodies: list[bytes]) -> list[bytes]:
    """The bodies up to the one the daemon must end the call at: the first undecodable one,
    or a Link's first frame when it is not the fuzzer's Hello. (Writing on after the daemon
    ended a call fails in the grpc client as INTERNAL, hiding the daemon's answer.)"""
    for index, body in enumerate(bodies):
        ends_link = index == 0 and method.path.endswith("/Link") and body != hello()
        if not parses(method.request_type, body) or ends_link:
            return bodies[: index + 1]
    return bodies


def hello() -> bytes:
    return dp.Frame(hello=dp.Hello(node_id=FUZZER_ID)).SerializeToString()


@st.composite
def valid_sampling(draw: st.DrawFn) -> dp.Sampling:
    """Sampling settings a stage accepts (the data plane carries them resolved)."""
    return dp.Sampling(
        temperature=draw(st.sampled_from([0.0, 0.7, 1.5])),
        top_p=draw(st.sampled_from([1.0, 0.9])),
        top_k=draw(st.sampled_from([0, 5])),
        min_p=draw(st.sampled_from([0.0, 0.05])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3])),
        seed=draw(_ints(0, 2**64 - 1)),
        max_tokens=draw(st.integers(1, 8)),
    )


@st.composite
def plausible_frame(draw: st.DrawFn, plan_ids: tuple[str, ...]) -> bytes:
    """A frame that gets past the fencing to the stage core: a Start of the committed plan
    from the fuzzer (as origin), with random prompt, chunking and sampling (valid half the
    time, so that the stage computes); or an End of a request it may have started."""
    request_id = f"r{draw(st.integers(0, 2**32))}" if draw(st.booleans()) else "r1"
    plan_id = draw(st.sampled_from(plan_ids)) if plan_ids else "none"
    if draw(st.integers(0, 4)) == 0:
        return dp.Frame(plan_id=plan_id, request_id=request_id, end=dp.End()).SerializeToString()
    if draw(st.booleans()):  # one the stage runs: it computes and sends tokens back
        prompt = draw(st.lists(st.integers(0, 400), min_size=1, max_size=40))
        start = dp.Start(
            origin_node_id=FUZZER_ID,
            prompt_tokens=prompt,
            prompt_length=len(prompt),
            sampling=draw(valid_sampling()),
            eos_token_ids=draw(st.lists(st.integers(0, 400), max_size=3)),
            prefill_chunk=draw(st.integers(1, 64)),
            return_logits=draw(st.booleans()),
            generated_tokens=draw(st.lists(st.integers(0, 400), max_size=4)),
        )
    else:  # any values: lengths that disagree, context overflows, sampling out of range
        prompt = draw(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=90))
        start = dp.Start(
            origin_node_id=draw(st.sampled_from([FUZZER_ID, "", "someone-else"])),
            prompt_tokens=prompt,
            prompt_length=draw(st.one_of(st.just(len(prompt)), _ints(0, 2**32 - 1))),
            sampling=draw(st.one_of(valid_sampling(), message_of(dp.Sampling, 2))),
            eos_token_ids=draw(st.lists(_ints(0, 2**32 - 1), max_size=3)),
            prefill_chunk=draw(st.one_of(st.integers(0, 300), _ints(0, 2**32 - 1))),
            return_logits=draw(st.booleans()),
            generated_tokens=draw(st.lists(_ints(0, 2**32 - 1), max_size=4)),
        )
    frame = dp.Frame(plan_id=plan_id, request_id=request_id, start=start)
    return frame.SerializeToString()


@st.composite
def plausible_generate(draw: st.DrawFn) -> bytes:
    """A Generate that runs: a short prompt and random sampling settings."""
    request = pb.GenerateRequest(
        prompt=draw(st.text(min_size=1, max_size=40)),
        sampling=draw(message_of(pb.Sampling, 2)),
        chat_template=draw(st.booleans()),
    )
    return request.SerializeToString()


def example_strategy(all_methods: list[Method], plan_ids: tuple[str, ...]) -> Any:
    @st.composite
    def example(draw: st.DrawFn) -> tuple[Method, list[bytes]]:
        method = draw(st.sampled_from(all_methods))
        count = draw(st.integers(1, 3)) if method.client_streaming else 1
        bodies = [draw(body_of(method.request_type, plan_ids)) for _ in range(count)]
        if method.path.endswith("/Link") and draw(st.booleans()):
            frames = [draw(plausible_frame(plan_ids)) for _ in range(draw(st.integers(1, 4)))]
            bodies = [hello(), *frames]
        elif method.path.endswith("/Link") and draw(st.booleans()):
            bodies.insert(0, hello())
        if method.path.endswith("/Generate") and draw(st.booleans()):
            bodies = [draw(plausible_generate())]
        if method.path in NO_WELL_FORMED:
            bodies = [b"\xff\xff\xff"]
        return method, bodies

    return example()


def run_examples(fuzzer: Fuzzer, runner: asyncio.Runner, plan_ids: tuple[str, ...], n: int):
    """Run ``n`` hypothesis examples against the daemon; returns the tally."""
    all_methods = methods()

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(example_strategy(all_methods, plan_ids))
    def one(example: tuple[Method, list[bytes]]) -> None:
        method, bodies = example
        runner.run(fuzzer.call(method, bodies))

    one()
    return fuzzer.tally


def log_problems(log_text: str) -> list[str]:
    """Tracebacks and ERROR lines in a daemon log."""
    return [
        line
        for line in log_text.splitlines()
        if "Traceback" in line or " ERROR " in line or line.startswith("E1")
    ]


@dataclass
class Report:
    tally: Tally
    seconds: float
    alive: bool
    problems: list[str]  # tracebacks and ERROR lines in the daemon's log

    @property
    def clean(self) -> bool:
        return self.alive and not self.tally.failures and not self.problems

    def summary(self) -> str:
        lines = [
            f"{self.tally.examples} examples in {self.seconds:.0f} s; answers: "
            f"{dict(self.tally.codes)}; failures: {len(self.tally.failures)}; daemon alive: "
            f"{self.alive}; tracebacks/ERROR lines in its log: {len(self.problems)}",
            f"  per method: {dict(sorted(self.tally.per_method.items()))}",
            f"  frames the daemon sent back on Links: {dict(self.tally.link_replies)}",
        ]
        lines += ["  " + line for line in self.tally.failures[:20] + self.problems[:20]]
        return "\n".join(lines)


def fuzz(daemon: Any, token: str, folder: Path, examples: int) -> Report:
    """Run ``examples`` fuzz examples against a running daemon that has a plan (a
    :class:`meshd.api.launcher.DaemonProcess` of the mesh of ``token``)."""
    status = daemon.status()
    peer_address = status.peer_address.replace("0.0.0.0", "127.0.0.1")
    plan_ids = (status.agreement.active_plan_id,)
    started = time.monotonic()
    with asyncio.Runner() as runner:
        fuzzer = runner.run(_make_fuzzer(peer_address, daemon.api, token, folder))
        try:
            tally = run_examples(fuzzer, runner, plan_ids, examples)
        finally:
            runner.run(fuzzer.close())
    seconds = time.monotonic() - started
    alive = daemon.proc is not None and daemon.proc.poll() is None
    problems = log_problems(daemon.log_path.read_text(errors="replace"))
    return Report(tally, seconds, alive, problems)


async def _make_fuzzer(peer_address: str, api: str, token: str, folder: Path) -> Fuzzer:
    """Made inside the runner's loop: grpc.aio channels belong to the loop they start on."""
    return Fuzzer(peer_address, api, token, folder)


# --- The larger run, as a script --------------------------------------------------------------

FUZZ_DAEMON_ARGS = ["--no-mdns", "--peer-host", "127.0.0.1", "--peer-port", "0"]
FUZZ_CONTEXT = ["--context-length", "64"]  # small: long prompts meet the context limit


@contextlib.contextmanager
def fuzz_daemon(root: Path) -> Iterator[tuple[Any, str]]:
    """A daemon on loopback serving a tiny random model with a 64-token context, and its
    mesh token."""
    from meshd.api.launcher import DaemonProcess
    from tests.support.random_model import make_architecture_dir

    model = make_architecture_dir(root / "model", "mistral", seed=7)
    token = security.encode_join_token(security.create_mesh_secret("fuzz"))
    args = [*FUZZ_DAEMON_ARGS, "--join", token, "--model", str(model), *FUZZ_CONTEXT]
    env = {"MESHD_MODEL_STORE": str(root / "store")}
    daemon = DaemonProcess(root / "state", [*args, "--http", "off"], env=env).start()
    try:
        daemon.wait_for(lambda s: bool(s.agreement.active_plan_id), 120, "a plan")
        yield daemon, token
    finally:
        daemon.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=5000)
    parser.add_argument("--log", type=Path, help="keep a copy of the daemon's log here")
    args = parser.parse_args()
    from meshd.runtime.blas import enable_fast_blas

    enable_fast_blas()
    with tempfile.TemporaryDirectory() as folder, fuzz_daemon(Path(folder)) as (daemon, token):
        report = fuzz(daemon, token, Path(folder) / "fuzzer", args.examples)
        if args.log:
            args.log.write_bytes(daemon.log_path.read_bytes())
    print(report.summary())
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
