"""Frames between a daemon and its runner, and between the runners of one group.

One frame = ``!IQ`` (header length, payload length) + a JSON object + raw payload bytes. The
header is small and parsed as JSON (never pickle: a runner's peer may be another machine); the
payload is an array's bytes, described by the header's ``dtype`` and ``shape`` and checked
against them before use. Sizes are bounded so a corrupt or hostile length cannot make anyone
allocate without limit.

Blocking helpers are for the runner (one thread, blocking sockets: an idle runner sleeps in the
kernel rather than spinning); :func:`read_frame_async` is for the daemon's asyncio loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import struct
from collections.abc import Sequence
from typing import Any

PREFIX = struct.Struct("!IQ")
MAX_HEADER_BYTES = 64 << 10
MAX_PAYLOAD_BYTES = 4 << 30
# dtype name on the wire -> bytes per element. bfloat16 has no numpy type: it travels as bytes.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
}
MAX_DIMS = 4


class FrameError(ValueError):
    """A frame was truncated, too large, or not what the protocol allows."""


def encode_frame(header: dict[str, Any], payload: bytes | memoryview = b"") -> bytes:
    """One frame as bytes (header JSON, then payload)."""
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    size = memoryview(payload).nbytes
    if size > MAX_PAYLOAD_BYTES:
        raise FrameError(f"frame payload of {size} bytes exceeds {MAX_PAYLOAD_BYTES}")
    return b"".join((PREFIX.pack(len(body), size), body, payload))


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b""):
    sock.sendall(encode_frame(header, payload))


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None when the peer closed the connection between frames."""
    prefix = _recv_exactly(sock, PREFIX.size, allow_eof=True)
    if prefix is None:
        return None
    header_size, payload_size = _check_sizes(*PREFIX.unpack(prefix))
    header = _parse_header(_recv_exactly(sock, header_size))
    payload = _recv_exactly(sock, payload_size) if payload_size else b""
    return header, payload


def _recv_exactly(sock: socket.socket, size: int, *, allow_eof: bool = False) -> bytes | None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:], size - received)
        if count == 0:
            if allow_eof and received == 0:
                return None
            raise FrameError(f"connection closed inside a frame ({received} of {size} bytes)")
        received += count
    return bytes(buffer)


async def read_frame_async(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes] | None:
    """:func:`recv_frame` for an asyncio stream."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as error:
        if not error.partial:
            return None
        raise FrameError("connection closed inside a frame prefix") from None
    header_size, payload_size = _check_sizes(*PREFIX.unpack(prefix))
    try:
        header = _parse_header(await reader.readexactly(header_size))
        payload = await reader.readexactly(payload_size) if payload_size else b""
    except asyncio.IncompleteReadError:
        raise FrameError("connection closed inside a frame") from None
    return header, payload


def _check_sizes(header_size: int, payload_size: int) -> tuple[int, int]:
    if not 0 < header_size <= MAX_HEADER_BYTES:
        raise FrameError(f"frame header size {header_size} is not 1-{MAX_HEADER_BYTES}")
    if payload_size > MAX_PAYLOAD_BYTES:
        raise FrameError(f"frame payload size {payload_size} exceeds {MAX_PAYLOAD_BYTES}")
    return header_size, payload_size


def _parse_header(raw: bytes | None) -> dict[str, Any]:
    try:
        header = json.loads(raw or b"")
    except ValueError as error:
        raise FrameError(f"frame header is not JSON: {error}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise FrameError("frame header must be a JSON object with a string 'type'")
    return header


# --- Arrays ------------------------------------------------------------------------------------


def check_array(header: dict[str, Any], payload: bytes | memoryview) -> tuple[str, tuple[int, ...]]:
    """The (dtype, shape) a frame declares, checked against its payload's size."""
    dtype, shape = header.get("dtype"), header.get("shape")
    if dtype not in DTYPE_SIZES:
        raise FrameError(f"array dtype {dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise FrameError(f"array shape {shape!r} is not a list of 1-{MAX_DIMS} sizes >= 0")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    size = memoryview(payload).nbytes
    if expected != size:
        raise FrameError(
            f"a {dtype} array of shape {shape} has {expected} bytes, the frame carries {size}"
        )
    return dtype, tuple(shape)


def array_fields(dtype: str, shape: Sequence[int]) -> dict[str, Any]:
    return {"dtype": dtype, "shape": [int(d) for d in shape]}


def to_mx(dtype: str, shape: Sequence[int], payload: bytes) -> Any:
    """An ``mx.array`` of the given dtype and shape over a copy of ``payload``."""
    import mlx.core as mx
    import numpy as np

    raw = mx.array(np.frombuffer(payload, dtype=np.uint8))
    return raw.view(getattr(mx, dtype)).reshape(tuple(shape))


def from_mx(array: Any) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype name, shape, bytes) of an evaluated ``mx.array`` (C order)."""
    import mlx.core as mx

    name = str(array.dtype).rsplit(".", 1)[-1]
    if name not in DTYPE_SIZES:
        raise FrameError(f"arrays of dtype {name} do not travel to runners")
    contiguous = mx.contiguous(array)
    mx.eval(contiguous)
    return name, tuple(array.shape), bytes(memoryview(contiguous))
