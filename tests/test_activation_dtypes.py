"""Hidden states cross the wire bit for bit in every dtype a stage computes in.

A mesh may mix a CUDA GPU, a Mac and CPU boxes; each stage computes in the model's dtype and
the next stage must receive exactly the bits the previous one produced, whatever device made
them. The Activation frame carries the dtype's name, the shape and the raw elements; bfloat16,
which numpy lacks, travels as its uint16 bits and is reinterpreted on arrival. These tests run
an array through the same path a frame takes (encode, the protobuf's bytes, decode), for one
request and for a batch's row, and compare the bits, including infinities, NaN, negative zero
and subnormal numbers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from meshd.inference.stage.engine import _host_rows, _row_states, decode_hidden, encode_hidden
from meshd.wire import dataplane_pb2 as dp

pytestmark = pytest.mark.unit

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _bits(array: mx.array) -> np.ndarray:
    """The array's raw bits as unsigned integers of its width (NaN compares equal this way)."""
    width = {4: mx.uint32, 2: mx.uint16}[array.dtype.size]
    return np.array(array.view(width))


def _hidden(dtype: mx.Dtype, tokens: int = 3, hidden: int = 64) -> mx.array:
    values = mx.linspace(-70000.0, 70000.0, tokens * hidden).reshape(1, tokens, hidden)
    special = mx.array([np.inf, -np.inf, np.nan, -0.0, 1e-40, 6e-8, 3.0e38, -1.5])
    first = mx.broadcast_to(special.reshape(1, 1, -1), (1, tokens, 8))
    values = mx.concatenate([first, values[:, :, 8:]], axis=2)
    array = values.astype(dtype)
    mx.eval(array)
    return array


def _over_the_wire(dtype: str, shape: tuple[int, ...], data: bytes) -> dp.Activation:
    """The Activation frame a stage sends, serialised and parsed as the receiver does."""
    frame = dp.Frame(plan_id="p", request_id="r")
    frame.activation.dtype = dtype
    frame.activation.shape.extend(shape)
    frame.activation.data = data
    return dp.Frame.FromString(frame.SerializeToString()).activation


@pytest.mark.parametrize("name", list(DTYPES))
def test_one_requests_hidden_states_arrive_bit_for_bit(name: str) -> None:
    sent = _hidden(DTYPES[name])
    wire = encode_hidden(sent)
    assert wire.dtype == name and wire.shape == (1, 3, 64)
    assert len(wire.data) == sent.nbytes
    received = _over_the_wire(wire.dtype, wire.shape, wire.data)
    arrived = decode_hidden(received.dtype, tuple(received.shape), received.data)
    assert arrived.dtype == DTYPES[name]
    assert np.array_equal(_bits(arrived), _bits(sent))


@pytest.mark.parametrize("name", list(DTYPES))
def test_a_batch_row_is_sent_as_one_request_would_be(name: str) -> None:
    """The batched step sends each row from host memory (bfloat16 as uint16): same bytes."""
    rows = mx.concatenate([_hidden(DTYPES[name], tokens=1) * k for k in (1, 2, 3)], axis=0)
    mx.eval(rows)
    host = _host_rows(rows)
    for row in range(3):
        wire = _row_states(host, row, rows.dtype)
        alone = encode_hidden(rows[row : row + 1])
        assert wire == alone
        arrived = decode_hidden(wire.dtype, wire.shape, wire.data)
        assert np.array_equal(_bits(arrived), _bits(rows[row : row + 1]))


def test_a_frame_that_disagrees_with_its_dtype_is_refused() -> None:
    wire = encode_hidden(_hidden(mx.bfloat16))
    with pytest.raises(ValueError, match="sender and receiver disagree"):
        decode_hidden("float32", wire.shape, wire.data)  # half the bytes a float32 needs
    with pytest.raises(ValueError, match="unknown activation dtype"):
        decode_hidden("float8", wire.shape, wire.data)
