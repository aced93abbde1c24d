"""Every failure of the request path reaches each HTTP API as its own error shape and status.

The node's request path raises `InferenceError(kind, message)`; here it is made to refuse
with each kind, and the real Starlette app with the real MeshBackend must answer
400/404/429/503 in OpenAI's, Anthropic's and Ollama's shapes. The real queue filling up and
answering 429 through real daemons is tests/test_http_api.py's
``test_a_full_queue_is_refused_with_429_and_the_queue_moves_on``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from meshd.http.backend import MeshBackend
from meshd.http.cors import OriginPolicy
from meshd.http.server import build_app
from meshd.inference.errors import ErrorKind, InferenceError

pytestmark = pytest.mark.unit

CASES = [
    ("BAD_INPUT", 400),
    ("UNKNOWN_MODEL", 404),
    ("OVERLOADED", 429),
    ("NO_PLAN", 503),
    ("UNAVAILABLE", 503),
]


class RefusingRouter:
    """The request path's interface, refusing every request with one error kind."""

    def __init__(self, code: str) -> None:
        self.code = code

    async def stream(self, **kwargs):
        raise InferenceError(ErrorKind[self.code], f"refused with {self.code}")
        yield  # an async generator, like the real one


def client_for(
    code: str, *, model: str = "m", origins: OriginPolicy | None = None, keys=None
) -> TestClient:
    node = SimpleNamespace(
        router=RefusingRouter(code), plans=SimpleNamespace(snapshot=SimpleNamespace(model=model))
    )
    app = build_app(MeshBackend(node, bridge=None), keys=keys, loopback=keys is None,
                    closing=asyncio.Event(), origins=origins)  # fmt: skip
    host = "127.0.0.1" if keys is None else "10.0.0.1"
    return TestClient(app, base_url=f"http://{host}:52380")


def message_of(path: str, reply) -> str:  # type: ignore[no-untyped-def]
    body = reply.json()
    return body["error"] if path.startswith("/api/") else body["error"]["message"]


@pytest.mark.parametrize(("code", "status"), CASES)
def test_each_api_maps_the_refusal(code: str, status: int) -> None:
    client = client_for(code)
    chat = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        reply = client.post("/v1/chat/completions", json={"messages": chat, "stream": stream})
        assert reply.status_code == status, reply.text
        assert reply.json()["error"]["message"] == f"refused with {code}"
        reply = client.post(
            "/v1/messages", json={"messages": chat, "max_tokens": 5, "stream": stream}
        )
        assert reply.status_code == status
        assert reply.json()["type"] == "error" and reply.json()["error"]["type"]
        reply = client.post("/api/chat", json={"messages": chat, "stream": stream})
        assert reply.status_code == status
        assert reply.json() == {"error": f"refused with {code}"}
        # A full queue says when to ask again (the SDKs wait that long before retrying).
        assert (reply.headers.get("retry-after") == "1") == (status == 429), reply.headers


def test_malformed_requests_are_400_in_the_api_shape() -> None:
    client = client_for("UNAVAILABLE")
    assert client.post("/v1/chat/completions", content=b"{nope").status_code == 400
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                        "content": "x"}], "n": 2})  # fmt: skip
    assert reply.status_code == 400 and "n=2" in reply.json()["error"]["message"]
    reply = client.post("/v1/messages", json={"messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code == 400 and "max_tokens" in reply.json()["error"]["message"]
    reply = client.post("/api/generate", json={"prompt": "x", "options": {"top_p": "high"}})
    assert reply.status_code == 400 and "top_p" in reply.json()["error"]
    assert client.get("/v1/nothing-here").status_code == 404


@pytest.mark.parametrize("depth", [65, 100_000])
def test_deeply_nested_json_is_400_in_the_api_shape(depth: int) -> None:
    """A body nested deeper than any schema needs (100,000 deep overflowed Python's parser,
    answered 500 with a RecursionError traceback) is a client error in each API's shape."""
    client = client_for("UNAVAILABLE")
    nested = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat", "/api/generate"):
        reply = client.post(path, content=nested, headers={"content-type": "application/json"})
        assert reply.status_code == 400, (path, reply.status_code, reply.text[:200])
        body = reply.json()
        message = body["error"] if path.startswith("/api/") else body["error"]["message"]
        assert "more than 64 deep" in message, (path, body)
    shallow = [{"role": "user", "content": "x"}]  # 3 deep: refused only by the router here
    reply = client.post("/v1/chat/completions", json={"messages": shallow})
    assert reply.status_code == 503, reply.text


def test_loading_a_model_needs_a_key_off_loopback(tmp_path) -> None:
    """The dashboard's load and Ollama's pull switch the whole mesh's model: on a network
    address they are refused without a valid key, before the node is asked anything."""
    from meshd.http.keys import ApiKeyStore

    keys = ApiKeyStore(tmp_path)
    keys.create("ops")
    app = build_app(MeshBackend(SimpleNamespace(), bridge=None), keys=keys, loopback=False,
                    closing=asyncio.Event())  # fmt: skip
    client = TestClient(app, base_url="http://10.0.0.1:52380")
    for headers in ({}, {"Authorization": "Bearer msk_wrong"}):
        assert client.get("/meshd/models", headers=headers).status_code == 401
        reply = client.post("/meshd/load", json={"model": "m"}, headers=headers)
        assert reply.status_code == 401 and "key" in reply.json()["error"]["message"]
        reply = client.post("/api/pull", json={"model": "m"}, headers=headers)
        assert reply.status_code == 401 and "key" in reply.json()["error"]


def test_unknown_routes_and_wrong_methods_say_so_in_the_api_shape() -> None:
    """A path no route serves is not a missing model: OpenAI's "Unknown request URL" (type
    invalid_request_error, code unknown_url), Anthropic's not_found_error; a method a route
    does not take is the client's error (405 with Allow), never a server_error."""
    client = client_for("UNAVAILABLE")
    reply = client.post("/v1/chat/completion", json={})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unknown_url"
    assert error["message"].startswith("Unknown request URL: POST /v1/chat/completion")
    reply = client.post("/v1/messagess", json={})
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"
    reply = client.post("/api/chats", json={})
    assert reply.status_code == 404 and "Unknown request URL" in reply.json()["error"]

    for path, shape in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"),
                        ("/api/chat", "ollama")):  # fmt: skip
        reply = client.get(path)
        assert reply.status_code == 405 and reply.headers["allow"] == "POST", path
        assert "GET " + path + ": method not allowed; use POST" in message_of(path, reply)
        if shape != "ollama":
            assert reply.json()["error"]["type"] == "invalid_request_error", reply.json()


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/v1/messages", {"temperature": 5}, "temperature must be between 0 and 1"),
        ("/v1/messages", {"temperature": 1.01}, "temperature must be between 0 and 1"),
        ("/v1/messages", {"top_p": 1.5}, "top_p must be between 0 and 1"),
        ("/v1/messages", {"top_k": -1}, "top_k must be an integer >= 0"),
        ("/v1/chat/completions", {"temperature": 2.5}, "temperature must be between 0 and 2"),
        ("/v1/chat/completions", {"top_p": 1.5}, "top_p must be between 0 and 1"),
        ("/v1/completions", {"temperature": -0.5}, "temperature must be between 0 and 2"),
    ],
)
def test_sampling_settings_outside_the_apis_ranges_are_400(path, body, named) -> None:  # type: ignore[no-untyped-def]
    """Each API's documented ranges (Anthropic: temperature and top_p 0..1, top_k >= 0;
    OpenAI: temperature 0..2, top_p 0..1), refused naming the field and the range; the
    edges pass (to the router, which refuses here with 503)."""
    client = client_for("UNAVAILABLE")
    base = {"messages": [{"role": "user", "content": "x"}], "prompt": "x", "max_tokens": 5}
    reply = client.post(path, json={**base, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert named in error["message"] and error["type"] == "invalid_request_error", error
    edge = {key: 1 if key != "top_k" else 0 for key in body}
    assert client.post(path, json={**base, **edge}).status_code == 503


def test_no_model_selected_is_not_an_error_to_retry() -> None:
    """The mesh runs no model: asking again cannot help until someone loads one, so no API
    answers a status its SDKs retry (429, 5xx); each says how to load one."""
    client = client_for("UNAVAILABLE", model="")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat", "/api/generate"):
        reply = client.post(path, json={**chat, "prompt": "hi"})
        assert reply.status_code == 404, (path, reply.text)
        assert "`meshd load MODEL`" in message_of(path, reply), reply.text
    reply = client.post("/v1/chat/completions", json=chat)
    assert reply.json()["error"]["code"] == "model_not_found"


def test_cross_site_requests_are_refused_unless_their_origin_is_allowed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Closed by default: no CORS header, preflight and request refused. With allowed
    patterns, their pages' preflights are answered (without a key) and their requests carry
    Access-Control-Allow-Origin; other sites stay refused."""
    from meshd.http.keys import ApiKeyStore

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }

    closed = client_for("UNAVAILABLE")
    origin = {"Origin": "http://localhost:5173"}
    reply = closed.options("/v1/chat/completions", headers={**origin, **preflight})
    assert reply.status_code == 403 and "access-control-allow-origin" not in reply.headers
    reply = closed.post("/v1/chat/completions", json=chat, headers=origin)
    assert reply.status_code == 403 and "access-control-allow-origin" not in reply.headers
    assert "--cors-origin" in reply.json()["error"]["message"]

    allowed = client_for("UNAVAILABLE", origins=OriginPolicy(["http://localhost:*", "app://*"]))
    for site in ("http://localhost:5173", "app://obsidian.md"):
        reply = allowed.options("/v1/chat/completions", headers={"Origin": site, **preflight})
        assert reply.status_code == 200, reply.text
        assert reply.headers["access-control-allow-origin"] == site
        assert "x-stainless-os" in reply.headers["access-control-allow-headers"]
        assert "POST" in reply.headers["access-control-allow-methods"]
        reply = allowed.post("/v1/chat/completions", json=chat, headers={"Origin": site})
        assert reply.status_code == 503 and reply.headers["access-control-allow-origin"] == site
    for site in ("http://localhost.evil.example", "https://localhost:5173", "http://evil.example"):
        reply = allowed.options("/v1/chat/completions", headers={"Origin": site, **preflight})
        assert reply.status_code == 403 and "access-control-allow-origin" not in reply.headers
        reply = allowed.post("/v1/chat/completions", json=chat, headers={"Origin": site})
        assert reply.status_code == 403, site

    keys = ApiKeyStore(tmp_path)
    keys.create("web")
    keyed = client_for("UNAVAILABLE", origins=OriginPolicy(["https://chat.example"]), keys=keys)
    site = {"Origin": "https://chat.example"}
    assert keyed.options("/v1/messages", headers={**site, **preflight}).status_code == 200
    reply = keyed.post("/v1/messages", json=chat, headers=site)
    assert reply.status_code == 401  # its page can read why: the key is missing
    assert reply.headers["access-control-allow-origin"] == "https://chat.example"
