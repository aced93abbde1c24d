"""What agent clients expect of the HTTP APIs, checked with the official SDKs (or raw HTTP
where an SDK cannot say it) against one real daemon serving the embedded SmolLM2 under a
chat template with tools (tests/support/tool_model.py).

* A client that gives up on a non-streaming request (its timeout, an SDK's retries), or on a
  stream still waiting in the queue, ends the request on every stage at once, in OpenAI's,
  Anthropic's and Ollama's APIs.
* A body over the limit is refused with 413 before it is read: a declared Content-Length at
  once, a chunked body at the limit; the daemon's memory does not grow by the body.
* The SDKs see out-of-range settings and unknown routes as the client errors they are, once.
* Ollama's /api/chat serves tools in Ollama's shapes, streaming and not.
* Pages of the origins MESHD_CORS_ORIGINS allows may call the APIs; other sites may not.
"""

from __future__ import annotations

import json
import select
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import ollama
import openai
import psutil
import pytest

from meshd.api.launcher import DaemonProcess
from meshd.http.common import MAX_BODY_BYTES
from meshd.models.store import ModelEntry
from tests.support.tool_model import make_tool_model

pytestmark = pytest.mark.integration

LOOPBACK = ["--no-mdns", "--peer-host", "127.0.0.1", "--peer-port", "0"]
MODEL = "smollm2-tools"
STORY = "Write a long story about a lighthouse."
LONG = 1500  # tokens: two minutes of decoding here, were the request left running
GIVE_UP_S = 2.0  # the clients' timeout
GONE_WITHIN_S = 2.0  # how soon after the client left nothing may run any more
ORIGINS = "http://localhost:*,app://*"
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory,
    profile_template: Path,
    model_store: Path,
    default_model_entry: ModelEntry,
) -> Iterator[DaemonProcess]:
    from meshd.mesh import security

    root = tmp_path_factory.mktemp("http-clients")
    model = make_tool_model(default_model_entry.path, root / MODEL)
    state = root / "node"
    state.mkdir()
    shutil.copyfile(profile_template, state / profile_template.name)
    token = security.encode_join_token(security.create_mesh_secret("http-clients"))
    args = [*LOOPBACK, "--join", token, "--model", str(model), "--context-length", "2048"]
    env = {"MESHD_MODEL_STORE": str(model_store), "MESHD_CORS_ORIGINS": ORIGINS}
    process = DaemonProcess(state, args, env=env).start()
    try:
        process.wait_for(lambda s: bool(s.agreement.active_plan_id), 90, "a committed plan")
        yield process
    finally:
        process.kill()


@pytest.fixture(scope="module")
def url(daemon: DaemonProcess) -> str:
    return daemon.status().http_url


def counting_client(sent: list[str], http: Any = httpx) -> Any:
    """An HTTP client for an SDK (of `http`: httpx, or httpx2 for the anthropic SDK) that
    notes every request it sends, retries included."""
    return http.Client(event_hooks={"request": [lambda r: sent.append(f"{r.method} {r.url}")]})


# ---------------------------------------------------------------- clients that leave


def busy(daemon: DaemonProcess, url: str) -> dict[str, int]:
    """What runs on the daemon: its clients' requests (MeshStatus) and the stage's."""
    activity = httpx.get(url + "/meshd/status", timeout=5).json()["activity"]
    return {
        "origin": len(daemon.status().requests),
        "stage": activity["stage_requests"],
        "queued": activity["queued_requests"],
    }


def seconds_until_idle(daemon: DaemonProcess, url: str, limit_s: float = 30.0) -> float:
    left = time.monotonic()
    while any(busy(daemon, url).values()):
        assert time.monotonic() - left < limit_s, busy(daemon, url)
        time.sleep(0.05)
    return time.monotonic() - left


def give_up_openai(url: str, sent: list[str]) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=GIVE_UP_S,
                           max_retries=2, http_client=counting_client(sent))  # fmt: skip
    story = [{"role": "user", "content": STORY}]
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model=MODEL, messages=story, max_tokens=LONG)  # type: ignore[arg-type]


def give_up_anthropic(url: str, sent: list[str]) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="x", timeout=GIVE_UP_S, max_retries=0,
                                 http_client=counting_client(sent, httpx2))  # fmt: skip
    story = [{"role": "user", "content": STORY}]
    with pytest.raises(anthropic.APITimeoutError):
        client.messages.create(model=MODEL, max_tokens=LONG, messages=story)  # type: ignore[arg-type]


def give_up_ollama_chat(url: str, sent: list[str]) -> None:
    client = ollama.Client(host=url, timeout=GIVE_UP_S)
    sent.append("POST /api/chat")
    with pytest.raises(httpx.TimeoutException):
        client.chat(model=MODEL, messages=[{"role": "user", "content": STORY}],
                    options={"num_predict": LONG}, stream=False)  # fmt: skip


def give_up_ollama_generate(url: str, sent: list[str]) -> None:
    client = ollama.Client(host=url, timeout=GIVE_UP_S)
    sent.append("POST /api/generate")
    with pytest.raises(httpx.TimeoutException):
        client.generate(model=MODEL, prompt=STORY, options={"num_predict": LONG}, stream=False)


@pytest.mark.parametrize(
    "give_up",
    [give_up_openai, give_up_anthropic, give_up_ollama_chat, give_up_ollama_generate],
    ids=["openai", "anthropic", "ollama-chat", "ollama-generate"],
)
def test_a_client_that_gives_up_ends_its_request_on_every_stage(
    daemon: DaemonProcess, url: str, give_up: Callable[[str, list[str]], None]
) -> None:
    """A non-streaming request sends nothing until its end, so only the connection tells that
    its client left: the daemon cancels it there (the openai SDK's two retries included),
    instead of decoding LONG tokens for nobody."""
    assert not any(busy(daemon, url).values())
    sent: list[str] = []
    cancelled_before = daemon.log_tail(2000).count("cancelled (the client went away)")
    give_up(url, sent)
    took = seconds_until_idle(daemon, url)
    print(f"{give_up.__name__}: nothing runs {took:.2f} s after the client gave up")
    assert took <= GONE_WITHIN_S, took
    deadline = time.monotonic() + 10  # the log file is written a moment later
    while time.monotonic() < deadline:
        cancelled = daemon.log_tail(2000).count("cancelled (the client went away)")
        if cancelled - cancelled_before >= len(sent):
            break
        time.sleep(0.1)
    assert cancelled - cancelled_before == len(sent), (sent, daemon.log_tail(30))


def test_a_streaming_client_that_gives_up_in_the_queue_leaves_it(
    daemon: DaemonProcess, url: str
) -> None:
    """A stream sends nothing before its first token, so a request waiting in the first
    stage's queue (the plan's KV is held by another) must notice its client leave there too:
    it leaves the queue at once, and the request that runs goes on."""
    story = [{"role": "user", "content": STORY}]
    body = {"model": MODEL, "messages": story, "max_tokens": LONG, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as running:
        chunks = running.iter_raw()  # kept: a dropped iterator closes the stream
        next(chunks)  # it runs, holding most of the plan's 2048 KV tokens
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=GIVE_UP_S,
                               max_retries=0)  # fmt: skip
        waiting = threading.Thread(target=give_up_waiting, args=(client, story), daemon=True)
        waiting.start()
        deadline = time.monotonic() + 10
        while busy(daemon, url)["queued"] != 1:
            assert time.monotonic() < deadline, busy(daemon, url)
            time.sleep(0.05)
        waiting.join(30)
        left = time.monotonic()
        while busy(daemon, url) != {"origin": 1, "stage": 1, "queued": 0}:
            assert time.monotonic() - left < GONE_WITHIN_S, busy(daemon, url)
            time.sleep(0.05)
        print(f"the queued request left the queue {time.monotonic() - left:.2f} s after")
        next(chunks)  # the running one goes on
    assert seconds_until_idle(daemon, url) <= GONE_WITHIN_S


def give_up_waiting(client: openai.OpenAI, story: list[dict[str, str]]) -> None:
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model=MODEL, messages=story, max_tokens=LONG, stream=True)  # type: ignore[call-overload]


# ---------------------------------------------------------------- bodies over the limit


def http_exchange(url: str, head: bytes, body_chunks: Iterator[bytes]) -> tuple[bytes, int]:
    """Send `head`, then body chunks until the server answers (or they run out); the answer
    and how many body bytes were sent."""
    host, port = url.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        for chunk in body_chunks:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(chunk)
            except OSError:  # the server answered and closed: read what it said
                break
            sent += len(chunk)
        answer = b""
        deadline = time.monotonic() + 10
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            assert time.monotonic() < deadline, answer
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            answer += data
    return answer, sent


def status_and_body(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def rss_mib(daemon: DaemonProcess) -> float:
    return psutil.Process(daemon.pid).memory_info().rss / 2**20


@pytest.mark.parametrize(
    ("path", "message_of"),
    [
        ("/v1/chat/completions", lambda body: body["error"]["message"]),
        ("/v1/messages", lambda body: body["error"]["message"]),
        ("/api/chat", lambda body: body["error"]),
    ],
)
def test_a_body_over_the_limit_is_refused_before_it_is_read(
    daemon: DaemonProcess, url: str, path: str, message_of: Callable[[dict], str]
) -> None:
    """A 300 MB Content-Length is refused at once (413, in the API's error shape), with only
    its head and 64 KiB sent; a chunked body (no length) at the limit, long before the client
    has sent all of it; the daemon's memory grows by neither."""
    before = rss_mib(daemon)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.removeprefix('http://')}\r\n"
        "Content-Type: application/json\r\nContent-Length: 300000000\r\n\r\n"
    ).encode()
    started = time.monotonic()
    answer, _ = http_exchange(url, head, iter([b'{"messages": "' + b"x" * 65536]))
    status, body = status_and_body(answer)
    assert status == 413 and "declares 300000000 bytes" in message_of(body), answer[:400]
    assert time.monotonic() - started < 5

    chunk = b"x" * 256 * 1024
    chunked = (head.replace(b"Content-Length: 300000000", b"Transfer-Encoding: chunked"),
               (b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(256)))  # fmt: skip
    answer, sent = http_exchange(url, *chunked)  # at most 64 MiB
    status, body = status_and_body(answer)
    assert status == 413 and f"limit of {MAX_BODY_BYTES} bytes" in message_of(body), answer[:400]
    assert sent < 4 * MAX_BODY_BYTES, f"the daemon read on: {sent} bytes sent"
    after = rss_mib(daemon)
    print(f"{path}: RSS {before:.0f} -> {after:.0f} MiB; a chunked body cut after {sent} bytes")
    assert after - before < 2 * MAX_BODY_BYTES / 2**20 + 16, (before, after)
    if path.startswith("/v1/messages"):
        assert body["error"]["type"] == "request_too_large"
    assert httpx.get(url + "/api/version").status_code == 200  # it serves on


# ---------------------------------------------------------------- client errors, once


def test_sdks_see_client_errors_at_once_without_retrying(url: str) -> None:
    sent: list[str] = []
    client = anthropic.Anthropic(base_url=url, api_key="x",
                                 http_client=counting_client(sent, httpx2))  # fmt: skip
    hello = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError, match="temperature must be between 0 and 1"):
        client.messages.create(model=MODEL, max_tokens=5, messages=hello,  # type: ignore[arg-type]
                               extra_body={"temperature": 5})  # fmt: skip
    assert len(sent) == 1, sent

    sent.clear()
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", http_client=counting_client(sent))
    with pytest.raises(openai.BadRequestError, match="temperature must be between 0 and 2"):
        oai.chat.completions.create(model=MODEL, messages=hello, temperature=2.5)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError) as unknown:
        oai.post("/chat/completion", body={}, cast_to=object)
    assert unknown.value.code == "unknown_url" and "Unknown request URL" in unknown.value.message
    with pytest.raises(openai.APIStatusError) as wrong_method:
        oai.get("/chat/completions", cast_to=object)
    assert wrong_method.value.status_code == 405
    assert wrong_method.value.type == "invalid_request_error"  # type: ignore[attr-defined]
    assert len(sent) == 3, sent  # one each: none of them retried


# ---------------------------------------------------------------- Ollama's tools


def test_ollama_chat_serves_tools_in_ollamas_shapes(url: str) -> None:
    """The official client's tools, an assistant's earlier call and the tool's result reach
    the chat template (the prompt grows by them); the answer, streamed or not, is a valid
    ChatResponse, whose tool calls (if the model makes one) carry their arguments as an
    object. (Which answer a 135M model gives is its own; the parsing itself is checked
    exactly by tests/test_http_tools.py.)"""
    client = ollama.Client(host=url)
    assert "tools" in client.show(MODEL).capabilities  # type: ignore[operator]
    options = {"temperature": 0, "num_predict": 48}
    question = {"role": "user", "content": "What is the weather in Paris? Use the tool."}
    plain = client.chat(model=MODEL, messages=[question], options=options)
    history = [
        question,
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C and sunny", "tool_name": "weather"},
        {"role": "user", "content": "And in Rome?"},
    ]  # fmt: skip
    answer = client.chat(model=MODEL, messages=history, tools=[WEATHER], options=options)
    assert answer.done and answer.prompt_eval_count > plain.prompt_eval_count + 100
    streamed = list(
        client.chat(model=MODEL, messages=history, tools=[WEATHER], options=options, stream=True)
    )
    assert streamed[-1].done and streamed[-1].eval_count == answer.eval_count
    assert "".join(p.message.content or "" for p in streamed) == (answer.message.content or "")
    calls = [c for p in streamed for c in p.message.tool_calls or []]
    assert calls == list(answer.message.tool_calls or [])
    for call in calls:
        assert call.function.name == "weather" and isinstance(call.function.arguments, dict)
    print(f"the model answered {answer.message.content!r} with {len(calls)} tool call(s)")


# ---------------------------------------------------------------- browsers' origins


def test_pages_of_allowed_origins_may_call_and_others_may_not(url: str) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, authorization"}  # fmt: skip
    hello = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for origin in ("http://localhost:5173", "app://obsidian.md"):
        reply = httpx.options(url + "/v1/chat/completions", headers={"Origin": origin,
                              **preflight})  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.headers["access-control-allow-origin"] == origin
        reply = httpx.post(url + "/v1/chat/completions", json=hello, headers={"Origin": origin},
                           timeout=60)  # fmt: skip
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == origin
    for origin in ("https://evil.example", "http://localhost.evil.example"):
        reply = httpx.options(url + "/v1/chat/completions", headers={"Origin": origin,
                              **preflight})  # fmt: skip
        assert reply.status_code == 403 and "access-control-allow-origin" not in reply.headers
        reply = httpx.post(url + "/api/chat", json=hello, headers={"Origin": origin})
        assert reply.status_code == 403 and "other sites" in reply.json()["error"]
