"""One error type from the data plane to the APIs: every kind maps to a real status."""

from __future__ import annotations

import grpc
import pytest

from meshd.inference.errors import ErrorKind, InferenceError

pytestmark = pytest.mark.unit


def test_every_kind_names_a_grpc_status_and_an_http_status() -> None:
    assert len(ErrorKind) == 8  # distinct kinds, even where they answer with the same status
    assert ErrorKind.LOADING is not ErrorKind.UNAVAILABLE
    for kind in ErrorKind:
        assert kind.grpc_status in grpc.StatusCode.__members__, kind
        assert 400 <= kind.http_status < 600, kind
    expected = {
        ErrorKind.BAD_INPUT: ("INVALID_ARGUMENT", 400),
        ErrorKind.UNKNOWN_MODEL: ("NOT_FOUND", 404),
        ErrorKind.NO_PLAN: ("FAILED_PRECONDITION", 503),
        ErrorKind.NO_MODEL: ("FAILED_PRECONDITION", 404),
        ErrorKind.UNAVAILABLE: ("UNAVAILABLE", 503),
        ErrorKind.LOADING: ("UNAVAILABLE", 503),
        ErrorKind.OVERLOADED: ("RESOURCE_EXHAUSTED", 429),
        ErrorKind.INTERNAL: ("INTERNAL", 500),
    }
    assert {kind: (kind.grpc_status, kind.http_status) for kind in ErrorKind} == expected
    retryable = {kind for kind in ErrorKind if kind.retryable}
    assert retryable == {
        ErrorKind.NO_PLAN, ErrorKind.UNAVAILABLE, ErrorKind.LOADING, ErrorKind.OVERLOADED
    }  # fmt: skip


def test_the_message_is_the_words() -> None:
    error = InferenceError(ErrorKind.BAD_INPUT, "the prompt is empty; give some text")
    assert str(error) == "the prompt is empty; give some text"
    assert error.kind is ErrorKind.BAD_INPUT and "BAD_INPUT" in repr(error)
