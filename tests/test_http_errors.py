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


def client_for(code: str) -> TestClient:
    node = SimpleNamespace(
        router=RefusingRouter(code), plans=SimpleNamespace(snapshot=SimpleNamespace(model="m"))
    )
    app = build_app(MeshBackend(node, bridge=None), keys=None, loopback=True,
                    closing=asyncio.Event())  # fmt: skip
    return TestClient(app, base_url="http://127.0.0.1:52380")


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
