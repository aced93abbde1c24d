"""The dashboard at `/`: the mesh as a picture, the plan, live requests, the log, a chat box.

The page and its assets are files in `meshd/http/static` (vendored libraries with their
licences; no CDN: it works offline). Its data: `/meshd/status` once, then `/meshd/stream`,
server-sent events fed by the same source as the gRPC `WatchStatus` (a new status whenever
the mesh changes) plus this node's activity (requests in flight, tokens/s) every second.
The chat box talks to `/v1/chat/completions` like any OpenAI client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sse_starlette.event import ServerSentEvent
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from meshd.http.backend import Activity, BackendError, MeshBackend
from meshd.http.common import NO_BUFFERING, field, read_json, stream_response
from meshd.http.keys import ApiKeyStore
from meshd.wire import pb

STATIC_DIR = Path(__file__).resolve().parent / "static"
KEY_COOKIE = "meshd_api_key"
ACTIVITY_EVERY_S = 1.0


def status_json(status: pb.MeshStatus) -> dict[str, Any]:
    """The status as the page reads it: the proto's fields, and the plan as an object."""
    from meshd.api.render import status_to_json

    data = status_to_json(status)
    plan_json = status.agreement.plan_json
    data["plan"] = json.loads(plan_json) if plan_json else None
    return data


def metrics_text(activity: Activity, prefixes: tuple[Any, ...]) -> str:
    """Prometheus text: node gauges and counters, then one series per plan stage."""
    lines = [
        "# TYPE meshd_requests_in_flight gauge",
        f"meshd_requests_in_flight {activity.requests}",
        "# TYPE meshd_tokens_delivered_total counter",
        f"meshd_tokens_delivered_total {activity.tokens_total}",
    ]
    series = (
        ("prefix_cache_kept_tokens", "gauge", "tokens"),
        ("prefix_cache_kept_prompts", "gauge", "slots"),
        ("prefix_cache_budget_tokens", "gauge", "budget_tokens"),
        ("prefix_cache_lookups_total", "counter", "lookups"),
        ("prefix_cache_hits_total", "counter", "hits"),
        ("prefix_cache_reused_tokens_total", "counter", "reused_tokens"),
        ("prefix_cache_evicted_total", "counter", "evicted"),
    )
    for name, kind, attribute in series:
        lines.append(f"# TYPE meshd_{name} {kind}")
        for view in prefixes:
            labels = f'plan="{view.plan_id}",stage="{view.stage_index}"'
            lines.append(f"meshd_{name}{{{labels}}} {getattr(view, attribute)}")
    return "\n".join(lines) + "\n"


def _sse(event: str, data: Any) -> bytes:
    return ServerSentEvent(data=json.dumps(data), event=event, sep="\n").encode()


class Dashboard:
    def __init__(
        self, backend: MeshBackend, keys: ApiKeyStore | None, closing: asyncio.Event
    ) -> None:
        self.backend = backend
        self.keys = keys
        self.closing = closing

    def routes(self) -> list[Route | Mount]:
        return [
            Route("/", self.index, methods=["GET", "HEAD"]),
            Route("/meshd/status", self.status, methods=["GET"]),
            Route("/meshd/stream", self.stream, methods=["GET"]),
            Route("/meshd/session", self.session, methods=["POST"]),
            Route("/meshd/models", self.models, methods=["GET"]),
            Route("/meshd/load", self.load, methods=["POST"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ]

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def status(self, request: Request) -> Response:
        status = await self.backend.status()
        return JSONResponse(
            {"status": status_json(status), "activity": asdict(self.backend.activity())},
            headers=NO_BUFFERING,
        )

    async def metrics(self, request: Request) -> Response:
        """Counters in Prometheus' text format (what a scraper or `curl` reads): this node's
        requests and tokens, and each of its stages' prefix cache."""
        return Response(
            metrics_text(self.backend.activity(), self.backend.prefix_caches()),
            media_type="text/plain; version=0.0.4",
        )

    async def session(self, request: Request) -> Response:
        """Remember a key in an HttpOnly cookie, so the page's EventSource can use it."""
        if self.keys is None:
            return JSONResponse({"key_required": False})
        key = field(await read_json(request), "key", str, "")
        if not key or self.keys.verify(key) is None:
            raise BackendError("unauthorized", "the API key is not valid")
        response = JSONResponse({"key_required": True, "ok": True})
        response.set_cookie(KEY_COOKIE, key, httponly=True, samesite="strict", path="/")
        return response

    async def models(self, request: Request) -> Response:
        """The models this node has (the picker's suggestions) and the one the mesh runs."""
        listing = await self.backend.list_models()
        models = [
            {"name": m.name, "source": m.source, "size_bytes": m.size_bytes, "partial": m.partial}
            for m in listing.models
        ]
        return JSONResponse({"models": models, "selected": listing.selected})

    async def load(self, request: Request) -> Response:
        """Switch the whole mesh to a model, as `meshd load` does. Behind the Guard like every
        API write (keys off loopback, other sites refused); a JSON body only, so a plain HTML
        form of another page cannot send it either."""
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise BackendError("bad_request", 'send the model as a JSON body: {"model": NAME}')
        model = field(await read_json(request), "model", str, "")
        selection = await self.backend.select_model(model)
        return JSONResponse(
            {
                "model": selection.name,
                "digest": selection.digest,
                "message": f"the mesh is re-planning for {selection.name}",
            }
        )

    async def stream(self, request: Request) -> Response:
        return stream_response(self._events(), "text/event-stream")

    async def _events(self) -> AsyncIterator[bytes]:
        """`status` events on every change, `activity` events every second, until closing."""
        watch = self.backend.watch()
        next_status = asyncio.ensure_future(anext(watch))
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            while not self.closing.is_set():
                done, _ = await asyncio.wait(
                    {next_status, closing},
                    timeout=ACTIVITY_EVERY_S,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if next_status in done:
                    yield _sse("status", status_json(next_status.result()))
                    next_status = asyncio.ensure_future(anext(watch))
                yield _sse("activity", asdict(self.backend.activity()))
        finally:
            for task in (next_status, closing):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await watch.aclose()
