"""The one error type from the data plane to the APIs: :class:`InferenceError`.

Why one type: a request can fail at many places (the router refuses bad input, no plan is
committed, a stage is lost mid-generation, a stage's queue is full) and every API (the gRPC
local API, the HTTP APIs) must answer each failure the same way. Each failure has a
:class:`ErrorKind` that carries the gRPC status and the HTTP status to answer with, and a
message in words that says what was wrong and what to do. Nothing else leaves the inference
package as a request failure: bad arguments raise it at once, and a request that fails
while it streams raises it from its event iterator.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """What kind of failure; :attr:`grpc_status` and :attr:`http_status` say how to answer."""

    BAD_INPUT = "bad_input"  # the client's request is malformed or out of range
    UNKNOWN_MODEL = "unknown_model"  # the request names a model the mesh does not run
    NO_PLAN = "no_plan"  # no committed plan (here, or the one the request names)
    NO_MODEL = "no_model"  # the mesh runs no model: someone must load one (not transient)
    UNAVAILABLE = "unavailable"  # a stage was lost, moved to another plan or timed out
    LOADING = "loading"  # a stage is still loading its layers: retry shortly
    OVERLOADED = "overloaded"  # a stage holds as many requests as it may
    INTERNAL = "internal"  # a stage failed to compute: a bug, the message says where

    @property
    def grpc_status(self) -> str:
        """The name of the ``grpc.StatusCode`` to answer with."""
        return _STATUS[self][0]

    @property
    def http_status(self) -> int:
        return _STATUS[self][1]

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed if sent again a little later."""
        return self.http_status in (429, 503)


_STATUS: dict[ErrorKind, tuple[str, int]] = {
    ErrorKind.BAD_INPUT: ("INVALID_ARGUMENT", 400),
    ErrorKind.UNKNOWN_MODEL: ("NOT_FOUND", 404),
    ErrorKind.NO_PLAN: ("FAILED_PRECONDITION", 503),
    # 404 as a model the mesh does not run: asking again without a load cannot succeed, so
    # no status an HTTP client retries.
    ErrorKind.NO_MODEL: ("FAILED_PRECONDITION", 404),
    ErrorKind.UNAVAILABLE: ("UNAVAILABLE", 503),
    ErrorKind.LOADING: ("UNAVAILABLE", 503),
    ErrorKind.OVERLOADED: ("RESOURCE_EXHAUSTED", 429),
    ErrorKind.INTERNAL: ("INTERNAL", 500),
}


# What a request is told when the mesh runs no model (every API says the same).
NO_MODEL_MESSAGE = (
    "no model is selected in this mesh; load one with `meshd load MODEL` (or an Ollama "
    "client's pull, or the dashboard's model picker); `meshd models` lists this node's models"
)


class InferenceError(Exception):
    """A request that cannot be (or could not be) served; ``str(error)`` says why in words."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __repr__(self) -> str:
        return f"InferenceError({self.kind.name}, {self.message!r})"
