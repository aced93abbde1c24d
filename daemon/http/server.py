"""The HTTP server of one daemon: hypercorn on the daemon's asyncio thread, Starlette routes.

Started and stopped by the node exactly like the local gRPC API (through `bridge.run`); it
lives on the asyncio thread that also hosts grpc.aio and the request path, so a request goes
from the HTTP handler to the data plane without crossing a thread.

Who may call: on a loopback address (the default) anyone on this machine, as with Ollama;
the Host header must then name a loopback host (a web page cannot reach the daemon through a
rebound DNS name). On any other address every API request needs a key (`meshd api-key
create`), and the daemon refuses to start without one. Requests a browser sends from another
site (an `Origin` header that is not this server) are refused on every address, unless the
`cors_origins` setting allows that site (`meshd.http.cors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from meshd.config import ConfigError
from meshd.http import anthropic_api, ollama_api, openai_api
from meshd.http.address import OFF, is_loopback, split_host_port, url_for
from meshd.http.backend import BackendError, MeshBackend
from meshd.http.common import STATUS_OF_KIND, ClientGone, NoAnswer, json_error
from meshd.http.cors import OriginPolicy
from meshd.http.dashboard import KEY_COOKIE, Dashboard
from meshd.http.keys import ApiKeyError, ApiKeyStore

log = logging.getLogger("meshd.http")

SHUTDOWN_GRACE_S = 1.0
RETRY_AFTER_S = 1  # seconds a client refused for a full queue is told to wait (see below)
PUBLIC_PATHS = ("/", "/favicon.ico", "/meshd/session")
PUBLIC_PREFIXES = ("/static/",)


class HttpSetupError(ConfigError):
    """The HTTP server cannot start as configured; the message says what to change."""


def error_shape(path: str) -> Callable[[int, str, str], Response]:
    """The error shape of the API a path belongs to."""
    if path.startswith("/v1/messages"):
        return anthropic_api.error_response
    if path.startswith("/v1/"):
        return openai_api.error_response
    if path.startswith("/api/"):
        return ollama_api.error_response
    return json_error


def _error(path: str, status: int, kind: str, message: str) -> Response:
    return error_shape(path)(status, kind, message)


async def _backend_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BackendError)
    status = STATUS_OF_KIND.get(exc.kind, 500)
    response = _error(request.url.path, status, exc.kind, str(exc))
    if status == 429:
        # The first stage admits the head of its queue the moment a running request ends,
        # so a short wait is the honest hint; the SDKs wait this long before they retry.
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    elif status == 413:
        # The rest of the body was not read: this connection cannot carry another request.
        response.headers["Connection"] = "close"
    return response


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals: a path no route serves, or a method a route does not take."""
    assert isinstance(exc, HTTPException)
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        kind = "no_route"
        message = (
            f"Unknown request URL: {method} {path}: this server has no such route (OpenAI's "
            "API is under /v1/, Anthropic's at /v1/messages, Ollama's under /api/)"
        )
    elif exc.status_code == 405:
        kind = "method_not_allowed"
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"{method} {path}: method not allowed" + (f"; use {allowed}" if allowed else "")
    else:
        kind = "bad_request"
        message = f"{method} {path}: {exc.detail}"
    response = _error(path, exc.status_code, kind, message)
    response.headers.update(exc.headers or {})
    return response


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client closed the connection (while sending its body, or before the answer was
    ready); its request has been cancelled, and there is no one to answer."""
    return NoAnswer()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("HTTP %s %s failed", request.method, request.url.path)
    return _error(request.url.path, 500, "internal", f"internal error: {type(exc).__name__}")


class Guard:
    """ASGI middleware: loopback Host check, cross-site refusal, API keys (see module doc)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: ApiKeyStore | None,
        loopback: bool,
        origins: OriginPolicy | None = None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.loopback = loopback
        self.origins = origins or OriginPolicy()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, kind, message = refusal
        response = _error(scope["path"], status, kind, message)
        if status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="meshd"'
        self.origins.let_read(response, Headers(scope=scope).get("origin", ""))
        await response(scope, receive, send)

    def _refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if self.loopback and not is_loopback(_host_name(host)):
            return 403, "forbidden", f"host {host!r} is not this machine's loopback address"
        origin = headers.get("origin")
        same_site = origin in (f"http://{host}", f"https://{host}")
        if origin and not same_site and not self.origins.allows(origin):
            return (
                403,
                "forbidden",
                f"requests from other sites ({origin}) are refused; a site the operator "
                "trusts is allowed with --cors-origin ORIGIN (MESHD_CORS_ORIGINS)",
            )
        path = scope["path"]
        if self.keys is None or path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            return None
        if self.origins.is_preflight(scope["method"], headers):
            return None  # browsers send no key with a preflight; it reveals nothing
        presented = _presented_key(headers)
        if not presented:
            return (
                401,
                "unauthorized",
                (
                    "this address needs an API key: send `Authorization: Bearer KEY` or "
                    "`x-api-key: KEY` (create one with `meshd api-key create NAME` on the node)"
                ),
            )
        try:
            valid = self.keys.verify(presented) is not None
        except ApiKeyError as exc:
            return 500, "internal", str(exc)
        if not valid:
            return 401, "unauthorized", "the API key is not valid (revoked, or mistyped)"
        return None


def _host_name(host_header: str) -> str:
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if ":" in host_header else host_header


def _presented_key(headers: Headers) -> str:
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if headers.get("x-api-key"):
        return headers["x-api-key"].strip()
    cookie = SimpleCookie()
    with contextlib.suppress(Exception):
        cookie.load(headers.get("cookie", ""))
    morsel = cookie.get(KEY_COOKIE)
    return morsel.value if morsel else ""


def build_app(
    backend: MeshBackend,
    *,
    keys: ApiKeyStore | None,
    loopback: bool,
    closing: asyncio.Event,
    origins: OriginPolicy | None = None,
) -> ASGIApp:
    """The ASGI app: every API's routes and the dashboard, with CORS for the allowed
    origins, behind the Guard."""
    origins = origins or OriginPolicy()
    dashboard = Dashboard(backend, keys, closing)
    routes = [
        *openai_api.OpenAIApi(backend).routes(),
        *anthropic_api.AnthropicApi(backend).routes(),
        *ollama_api.OllamaApi(backend).routes(),
        *dashboard.routes(),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            BackendError: _backend_error,
            HTTPException: _http_error,
            ClientGone: _client_gone,
            ClientDisconnect: _client_gone,
            Exception: _unexpected,
        },
    )
    return Guard(origins.wrap(app), keys=keys, loopback=loopback, origins=origins)


@dataclass
class HttpServer:
    """A running HTTP server; `stop()` (asyncio thread) ends it."""

    url: str
    _task: asyncio.Task[None] | None
    _shutdown: asyncio.Event
    _closing: asyncio.Event

    async def stop(self) -> None:
        if self._task is None:
            return
        self._closing.set()  # long-lived streams (the dashboard's) end
        self._shutdown.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), SHUTDOWN_GRACE_S + 2)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        except Exception:
            log.exception("the HTTP server failed while stopping")
        self._task = None


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


async def start_http_server(
    node: Any, bridge: Any, address: str, state_dir: Path, cors_origins: Sequence[str] = ()
) -> HttpServer | None:
    """Listen on `address` and serve (call on the asyncio thread via bridge.run); None if off.
    Browser pages of `cors_origins` (patterns, see `meshd.http.cors`) may call it too."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config as HypercornConfig

    if address == OFF:
        return None
    host, port = split_host_port(address)
    loopback = is_loopback(host)
    keys = None if loopback else ApiKeyStore(state_dir)
    if keys is not None and not keys.keys():
        raise HttpSetupError(
            f"the HTTP API on {address} would be reachable from the network, and this node has "
            f"no API key: create one with `meshd api-key create NAME --state-dir {state_dir}` "
            "(clients send it as a Bearer token), or serve on loopback with "
            "--http 127.0.0.1:52380, or turn HTTP off with --http off"
        )
    try:
        sock = _listen("127.0.0.1" if host == "localhost" else host, port)
    except OSError as exc:
        raise HttpSetupError(
            f"cannot serve HTTP on {address}: {exc.strerror or exc}; choose another address "
            "with --http HOST:PORT (port 0 picks a free one), or --http off"
        ) from exc
    bound_port = sock.getsockname()[1]
    config = HypercornConfig()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = log
    config.graceful_timeout = SHUTDOWN_GRACE_S
    config.include_server_header = False
    closing = asyncio.Event()
    shutdown = asyncio.Event()
    app = build_app(
        MeshBackend(node, bridge),
        keys=keys,
        loopback=loopback,
        closing=closing,
        origins=OriginPolicy(cors_origins),
    )
    task = asyncio.get_running_loop().create_task(
        serve(app, config, shutdown_trigger=shutdown.wait)  # type: ignore[arg-type]
    )
    task.add_done_callback(_report_end)
    url = url_for(host, bound_port)
    log.info("HTTP APIs and dashboard on %s/", url)
    return HttpServer(url, task, shutdown, closing)


def _report_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the HTTP server stopped: %r", task.exception())
