"""Servicers behind a guard: a request body that is not the message it should be is answered
INVALID_ARGUMENT with one warning line, never UNKNOWN with a traceback.

Why: grpc.aio deserializes a request before the handler runs; when protobuf cannot parse
the body (a bug in a peer, a client in another language built from an older proto, a
fuzzer), grpc answers ``UNKNOWN: Unexpected <class 'DecodeError'>`` and logs an ERROR with
a traceback for every call. Both are wrong: the caller sent bad input (INVALID_ARGUMENT), and
tracebacks are for this daemon's bugs.

How: :func:`add_guarded_servicer` registers a servicer through the generated
``add_XServicer_to_server`` function, but with every method's deserializer made tolerant (a
body that does not parse becomes a :class:`Malformed` value instead of an exception) and its
handler wrapped: a malformed unary request is refused before the servicer sees it; for a
streaming request, the request iterator and ``context.read()`` refuse at the malformed
message. Well-formed messages reach the servicer unchanged; what their contents mean is the
servicer's business.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger("meshd.rpc")


@dataclass(frozen=True)
class Malformed:
    """A request body that did not parse as its message type."""

    reason: str


def add_guarded_servicer(
    add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server
) -> None:
    """``add_to_server(servicer, server)`` (a generated ``add_XServicer_to_server``), with
    every method behind the guard described in the module docstring."""
    capture = _CapturingServer()
    add_to_server(servicer, capture)
    if not capture.services:
        raise RuntimeError(f"{add_to_server.__name__} registered no method handlers")
    for service, handlers in capture.services:
        guarded = {name: _guard(f"{service}/{name}", h) for name, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, guarded),))
        server.add_registered_method_handlers(service, guarded)


class _CapturingServer:
    """Stands in for the server while generated code registers its method handlers."""

    def __init__(self) -> None:
        self.services: list[tuple[str, dict[str, grpc.RpcMethodHandler]]] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        pass  # the same handlers arrive, by name, through add_registered_method_handlers

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.services.append((service, dict(handlers)))


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def read(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except Exception as error:  # protobuf's DecodeError, or anything a parser raises
            return Malformed(f"{type(error).__name__}: {error}" if str(error) else repr(error))

    return read


async def _refuse(method: str, context: grpc.aio.ServicerContext, bad: Malformed) -> None:
    log.warning("refused a malformed %s request from %s: %s", method, context.peer(), bad.reason)
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request is not a valid {method.rpartition('/')[2]} message: {bad.reason}",
    )


class _GuardedContext:
    """The handler's context, whose ``read()`` refuses a malformed message."""

    def __init__(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self._method = method
        self._context = context

    async def read(self) -> Any:
        message = await self._context.read()
        if isinstance(message, Malformed):
            await _refuse(self._method, self._context, message)
        return message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


async def _guarded_requests(
    method: str, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    async for message in requests:
        if isinstance(message, Malformed):
            await _refuse(method, context, message)
        yield message


def _guard(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    deserializer = _tolerant(handler.request_deserializer)
    serializer = handler.response_serializer
    if not handler.request_streaming and not handler.response_streaming:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await _refuse(method, context, request)
            return await inner_uu(request, _GuardedContext(method, context))

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, serializer)
    if not handler.request_streaming:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await _refuse(method, context, request)
            async for reply in _responses(inner_us(request, _GuardedContext(method, context))):
                yield reply

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, serializer)
    if not handler.response_streaming:
        inner_su = handler.stream_unary

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            guarded = _guarded_requests(method, requests, context)
            return await inner_su(guarded, _GuardedContext(method, context))

        return grpc.stream_unary_rpc_method_handler(stream_unary, deserializer, serializer)
    inner_ss = handler.stream_stream

    async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        guarded = _guarded_requests(method, requests, context)
        async for reply in _responses(inner_ss(guarded, _GuardedContext(method, context))):
            yield reply

    return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, serializer)


async def _responses(result: Any) -> AsyncIterator[Any]:
    """The replies of a streaming handler: an async generator's items, or none from a
    coroutine that writes with ``context.write``."""
    if hasattr(result, "__aiter__"):
        async for reply in result:
            yield reply
    elif result is not None:
        await result
