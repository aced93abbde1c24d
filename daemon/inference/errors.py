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
    """What kind of failure, with the gRPC status name and the HTTP status of its answer."""

    BAD_INPUT = ("INVALID_ARGUMENT", 400)  # the client's request is malformed or out of range
    UNKNOWN_MODEL = ("NOT_FOUND", 404)  # the request names a model the mesh does not run
    NO_PLAN = ("FAILED_PRECONDITION", 503)  # no committed plan (here, or the one asked for)
    UNAVAILABLE = ("UNAVAILABLE", 503)  # a stage was lost, moved to another plan or timed out
    LOADING = ("UNAVAILABLE", 503)  # a stage is still loading its layers: retry shortly
    OVERLOADED = ("RESOURCE_EXHAUSTED", 429)  # a stage holds as many requests as it may
    INTERNAL = ("INTERNAL", 500)  # a stage failed to compute: a bug, the message says where

    def __init__(self, grpc_status: str, http_status: int) -> None:
        self.grpc_status = grpc_status  # a grpc.StatusCode name
        self.http_status = http_status

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed if sent again a little later."""
        return self.http_status in (429, 503)


class InferenceError(Exception):
    """A request that cannot be (or could not be) served; ``str(error)`` says why in words."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __repr__(self) -> str:
        return f"InferenceError({self.kind.name}, {self.message!r})"
