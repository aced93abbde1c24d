"""The local client API (gRPC `Local` service) for the CLI and the status app.

It listens on a Unix socket in the state directory by default, or on a loopback
TCP address; it is not exposed to the network unless the user configures a
non-loopback address on purpose. Handlers run on the asyncio thread and ask the
trio side for fresh answers through the bridge.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import grpc
import trio

from meshd.runtime.bridge import AsyncioThread
from meshd.runtime.rpc_guard import add_guarded_servicer
from meshd.wire import pb, rpc

log = logging.getLogger("meshd.api")

WATCH_KEEPALIVE_S = 5.0
# Each message either way (proto/meshd.proto, service Local): gRPC's own default, stated so
# that the contract holds whatever a grpc release defaults to.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class StatusSource(Protocol):
    """What the API needs from the daemon (implemented by `meshd.node.Node`)."""

    def status(self) -> pb.MeshStatus: ...

    def token(self) -> pb.TokenReply: ...

    async def wait_changed(self) -> None: ...

    async def remeasure(self) -> None: ...

    router: Any  # meshd.inference.router.RequestRouter

    async def select_model(self, model: str, **options: Any) -> pb.ModelSelection: ...

    def list_models(self) -> pb.ModelList: ...


class LocalService(rpc.LocalServicer):
    def __init__(self, node: StatusSource, bridge: AsyncioThread) -> None:
        self._node = node
        self._bridge = bridge

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext):
        return await self._bridge.call_in_trio(self._node.status)

    async def WatchStatus(
        self, request: pb.WatchStatusRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.MeshStatus]:
        min_interval = max(0.05, request.min_interval_s or 0.5)
        while True:
            yield await self._bridge.call_in_trio(self._node.status)
            await asyncio.sleep(min_interval)
            await self._wait_change_or_keepalive()

    async def _wait_change_or_keepalive(self) -> None:
        """Until the mesh changes, or WATCH_KEEPALIVE_S pass (the trio side times out)."""
        await self._bridge.run_in_trio(self._wait_changed_at_most, WATCH_KEEPALIVE_S)

    async def _wait_changed_at_most(self, seconds: float) -> None:  # trio side
        with trio.move_on_after(seconds):
            await self._node.wait_changed()

    async def GetToken(self, request: pb.TokenRequest, context: grpc.aio.ServicerContext):
        return await self._bridge.call_in_trio(self._node.token)

    async def Remeasure(self, request: pb.RemeasureRequest, context: grpc.aio.ServicerContext):
        await self._bridge.run_in_trio(self._node.remeasure)
        return await self._bridge.call_in_trio(self._node.status)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        async for reply in self._stream(
            context,
            request.sampling,
            request.no_prefix_cache,
            prompt=request.prompt,
            messages=None,
            model=request.model,
            plan_id=request.plan_id,
            chat_template=request.chat_template,
            return_logits=request.return_logits,
        ):
            yield reply

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext):
        async for reply in self._stream(
            context,
            request.sampling,
            request.no_prefix_cache,
            prompt=None,
            messages=[{"role": m.role, "content": m.content} for m in request.messages],
            model=request.model,
            plan_id=request.plan_id,
            chat_template=True,
        ):
            yield reply

    async def _stream(
        self,
        context: grpc.aio.ServicerContext,
        sampling: pb.Sampling,
        no_prefix_cache: bool,
        **request: Any,
    ) -> AsyncIterator[pb.GenerateEvent]:
        """The router's client stream as GenerateEvents; failures become gRPC statuses. The
        wire's sampling message becomes meshd's settings here, at the edge."""
        from meshd.inference.errors import InferenceError
        from meshd.inference.generation_events import Finished, Piece
        from meshd.inference.sampling import sampling_from_message

        try:
            params = replace(sampling_from_message(sampling), prefix_cache=not no_prefix_cache)
        except (TypeError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            async for event in self._node.router.stream(sampling=params, **request):
                if isinstance(event, Piece):
                    token = event.token
                    if token is not None and token.logits is not None:
                        logits = token.logits.astype("<f4").tobytes()
                        message = pb.TokenLogits(
                            token_id=token.token_id, index=token.index, logits=logits
                        )
                        yield pb.GenerateEvent(token=message)
                    if event.text:
                        yield pb.GenerateEvent(text=event.text)
                elif isinstance(event, Finished):
                    yield pb.GenerateEvent(done=_done(event))
        except InferenceError as exc:
            await context.abort(grpc.StatusCode[exc.kind.grpc_status], str(exc))

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        return await self._bridge.call_in_trio(self._node.list_models)

    async def LoadModel(self, request: pb.LoadModelRequest, context: grpc.aio.ServicerContext):
        if not request.model.strip():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name a model to load")
        options = {
            "strategy": request.strategy or None,
            "context_length": request.context_length or None,
            "concurrency": request.concurrency or None,
            "parallelism": request.parallelism or None,
        }
        if options["strategy"] not in (None, "speed", "memory"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"strategy {request.strategy!r} is not speed or memory",
            )
        if options["parallelism"] not in (None, "auto", "pipeline", "tensor", "hybrid"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"parallelism {request.parallelism!r} is not auto, pipeline, tensor or hybrid",
            )
        try:
            selection = await self._bridge.run_in_trio(
                lambda: self._node.select_model(request.model, **options)
            )
        except Exception as exc:
            code = (
                grpc.StatusCode.NOT_FOUND
                if isinstance(exc, LookupError | FileNotFoundError)  # e.g. the store's UnknownModel
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, f"cannot load {request.model!r}: {exc}")
        return pb.LoadModelReply(
            model=selection.name,
            digest=selection.digest,
            message=f"the mesh is re-planning for {selection.name}",
        )


def check_api_address(address: str) -> None:
    """Refuse to expose the API beyond this machine by accident."""
    if address.startswith("unix:"):
        return
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError as exc:
        raise ValueError(f"API address {address!r} is neither unix:/path nor ip:port") from exc
    if not loopback:
        log.warning(
            "the local API listens on %s, which is reachable from the network without "
            "authentication; prefer a unix socket or 127.0.0.1",
            address,
        )


async def start_api_server(
    node: StatusSource, bridge: AsyncioThread, address: str
) -> grpc.aio.Server:
    """Create and start the Local server (call on the asyncio thread via bridge.run)."""
    check_api_address(address)
    if address.startswith("unix:"):
        path = Path(address.removeprefix("unix:"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a stale socket of a previous run
    # No SO_REUSEPORT: a second daemon on the same TCP address must fail, not share it.
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    add_guarded_servicer(rpc.add_LocalServicer_to_server, LocalService(node, bridge), server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpc raises when it cannot bind (older versions return 0)
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on the local API address {address}: is it in use?")
    await server.start()
    return server


def _done(finished: Any) -> pb.GenerationDone:
    usage = finished.usage
    return pb.GenerationDone(
        finish_reason=finished.finish_reason,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        ttft_s=usage.ttft_s,
        decode_tokens_per_s=usage.decode_tokens_per_s,
        total_s=usage.total_s,
        plan_id=finished.plan_id,
        model=finished.model,
        seed=usage.seed,
        resumes=usage.resumes,
        paused_s=usage.paused_s,
        transport_s_per_token=usage.transport_s_per_token,
        cached_tokens=usage.cached_tokens,
    )
