"""HTTP APIs of real daemons, used by the official clients: openai, anthropic, ollama, curl.

Three loopback daemons split the embedded SmolLM2-135M-Instruct (memory strategy: a third
of the layers each); every client talks to one node's HTTP port, and the answers go through
the same request path as the gRPC API. The plan reserves KV for one sequence of
``CONTEXT`` tokens and a queue of one, so a test can fill the queue and see the real 429.
The last test kills a stage while a stream runs: the stream goes on on the survivors.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from meshd.api.launcher import DaemonProcess
from meshd.models.store import ModelEntry
from meshd.wire import pb

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0.0, "max_tokens": 24}
LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
CONTEXT = 512  # KV tokens per sequence; with --concurrency 1 what the requests share
ADMISSION = ["--context-length", str(CONTEXT), "--concurrency", "1", "--queue-limit", "1"]


def committed_over(n: int):
    def check(status: pb.MeshStatus) -> bool:
        view = status.agreement
        return bool(view.active_plan_id and view.plan_json) and len(view.members) == n

    return check


@pytest.fixture(scope="module")
def default_model(default_model_entry: ModelEntry) -> Path:
    return default_model_entry.path


@pytest.fixture(scope="module")
def mesh(default_model, tmp_path_factory, profile_template) -> list[DaemonProcess]:
    """Three loopback daemons serving the default model split over all of them."""
    import shutil

    from meshd.mesh import security

    token = security.encode_join_token(security.create_mesh_secret("http"))
    root = tmp_path_factory.mktemp("http-mesh")
    daemons = []
    for i in range(3):
        state = root / f"n{i}"
        state.mkdir()
        shutil.copyfile(profile_template, state / "profile.json")
        args = [*LOOPBACK, "--join", token, "--name", f"h{i}", "--model", str(default_model),
                "--strategy", "memory", *ADMISSION]  # fmt: skip
        daemons.append(DaemonProcess(state, args).start())
    try:
        for daemon in daemons:
            daemon.wait_for(committed_over(3), 90, "a committed 3-node plan")
        yield daemons
    finally:
        for daemon in daemons:
            daemon.kill()


def url_of(daemon: DaemonProcess) -> str:
    url = daemon.status().http_url
    assert url.startswith("http://127.0.0.1:"), url
    return url


def test_openai_chat_streaming_equals_plain_and_reports_usage(mesh) -> None:
    client = openai.OpenAI(base_url=url_of(mesh[0]) + "/v1", api_key="unused-on-loopback")
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, **GREEDY
    )
    text = reply.choices[0].message.content
    assert "Paris" in text, text
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 5 and reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_openai_completions_models_stop_and_errors(mesh) -> None:
    client = openai.OpenAI(base_url=url_of(mesh[1]) + "/v1", api_key="x", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m-instruct"]
    completion = client.completions.create(
        model="smollm2-135m-instruct", prompt="The capital of France is", **GREEDY
    )
    assert "Paris" in completion.choices[0].text, completion.choices[0].text
    stopped = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": QUESTION}],
        stop=["Paris"],
        seed=7,
        **GREEDY,
    )
    assert "Paris" not in stopped.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smollm2-135m-instruct", messages=[])
    assert "messages" in str(bad.value)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "hi"}],
            temperature=-1,
        )
    with pytest.raises(openai.NotFoundError, match="not loaded in this mesh"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="does not support tools"):
        client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "weather in Paris?"}],
            tools=[{"type": "function", "function": {"name": "weather", "parameters": {}}}],
        )


def test_anthropic_messages_plain_and_streaming(mesh) -> None:
    client = anthropic.Anthropic(base_url=url_of(mesh[2]), api_key="x", max_retries=0)
    message = client.messages.create(
        model="smollm2-135m-instruct",
        max_tokens=24,
        extra_body={"temperature": 0},  # this SDK version no longer names it; the API takes it
        system="You are a helpful assistant.",
        messages=[{"role": "user", "content": QUESTION}],
    )
    text = message.content[0].text
    assert "Paris" in text, text
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 5 and message.usage.output_tokens > 0
    with client.messages.stream(
        model="smollm2-135m-instruct",
        max_tokens=24,
        extra_body={"temperature": 0},  # this SDK version no longer names it; the API takes it
        system="You are a helpful assistant.",
        messages=[{"role": "user", "content": QUESTION}],
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.usage.output_tokens == message.usage.output_tokens
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="claude-opus", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )


SYSTEM = (
    "You are a helpful assistant for a travel agency. Answer in one short sentence, name the "
    "city first, and never add a list. The traveller may ask about capitals, rivers, famous "
    "buildings and the best season to visit; keep every answer under twenty words."
)


def test_a_conversation_reuses_its_prefix_on_every_stage_exactly(mesh) -> None:
    """An agent's second turn sends the first again: every stage starts from the KV it kept
    of it, the clients see the reuse in their own usage fields, and the answer is the one the
    same request gives with the cache off (``cache_prompt: false``). (A re-plan between the
    turns that moves the layers drops what the stages kept: the turns are then asked again.)"""
    url = url_of(mesh[0])
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused-on-loopback", max_retries=0)
    for _ in range(3):
        plan = mesh[0].status().agreement.active_plan_id
        turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        first = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=turn, **GREEDY
        )
        turn += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And the capital of Germany?"},
        ]
        warm = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=turn, **GREEDY
        )
        if mesh[0].status().agreement.active_plan_id == plan:
            break
    cold = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=turn, extra_body={"cache_prompt": False}, **GREEDY
    )
    assert warm.choices[0].message.content == cold.choices[0].message.content
    reused = warm.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens < reused < warm.usage.prompt_tokens, warm.usage
    assert cold.usage.prompt_tokens_details.cached_tokens == 0

    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    message = claude.messages.create(
        model="smollm2-135m-instruct",
        max_tokens=24,
        extra_body={"temperature": 0},
        system=SYSTEM,
        messages=turn[1:],
    )
    assert message.content[0].text == warm.choices[0].message.content
    usage = message.usage
    assert usage.cache_read_input_tokens >= reused, usage
    assert usage.input_tokens + usage.cache_read_input_tokens == warm.usage.prompt_tokens

    for daemon in mesh:  # every stage started from its own kept prefix
        status = daemon.status()
        (cache,) = [c for c in status.prefix_cache if c.plan_id == plan]
        assert cache.hits >= 2 and cache.reused_tokens >= 2 * reused, cache
        assert cache.tokens <= cache.budget_tokens == CONTEXT, cache
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert re.search(
        r"^meshd_prefix_cache_hits_total\{plan=\"\w+\",stage=\"\d\"\} [2-9]", metrics, re.M
    )


def test_ollama_chat_generate_list_show(mesh) -> None:
    client = ollama.Client(host=url_of(mesh[0]))
    names = [m.model for m in client.list().models]
    assert names == ["smollm2-135m-instruct:latest"]
    shown = client.show("smollm2-135m-instruct")
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.block_count"] == 30
    options = {"temperature": 0, "num_predict": 24}
    answer = client.chat(
        model="smollm2-135m-instruct:latest",
        messages=[{"role": "user", "content": QUESTION}],
        options=options,
    )
    assert "Paris" in answer.message.content and answer.done
    assert answer.eval_count > 0 and answer.prompt_eval_count > 5
    pieces = list(
        client.generate(
            model="smollm2-135m-instruct", prompt=QUESTION, options=options, stream=True
        )
    )
    streamed = "".join(p.response for p in pieces)
    assert streamed == answer.message.content
    assert pieces[-1].done and pieces[-1].done_reason == "stop"
    assert httpx.get(url_of(mesh[0]) + "/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="llama3", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.status_code == 404


def test_curl_sees_well_formed_sse_frames(mesh) -> None:
    url = url_of(mesh[1])
    body = json.dumps(
        {"model": "smollm2-135m-instruct", "stream": True, "max_tokens": 12,
         "messages": [{"role": "user", "content": QUESTION}]}
    )  # fmt: skip
    out = subprocess.run(
        ["curl", "-sN", "--max-time", "60", "-H", "Content-Type: application/json",
         "-d", body, url + "/v1/chat/completions"],
        capture_output=True, text=True, timeout=90, check=True,
    ).stdout  # fmt: skip
    frames = out.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]", out[-200:]
    for frame in frames[:-2]:
        assert re.fullmatch(r"data: \{.*\}", frame), frame
        assert json.loads(frame[6:])["object"] == "chat.completion.chunk"
    anthropic_body = json.dumps(
        {"model": "smollm2-135m-instruct", "stream": True, "max_tokens": 12,
         "messages": [{"role": "user", "content": QUESTION}]}
    )  # fmt: skip
    out = subprocess.run(
        ["curl", "-sN", "--max-time", "60", "-d", anthropic_body, url + "/v1/messages"],
        capture_output=True, text=True, timeout=90, check=True,
    ).stdout  # fmt: skip
    names = []
    for frame in out.split("\n\n")[:-1]:
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: "), frame
        assert json.loads(data[6:])["type"] == event[7:]
        names.append(event[7:])
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_requests_from_other_sites_and_foreign_hosts_are_refused(mesh) -> None:
    url = url_of(mesh[0])
    hello = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cross = httpx.post(url + "/v1/chat/completions", json=hello,
                       headers={"Origin": "https://evil.example"})  # fmt: skip
    assert cross.status_code == 403 and "other sites" in cross.json()["error"]["message"]
    rebound = httpx.get(url + "/v1/models", headers={"Host": "evil.example"})
    assert rebound.status_code == 403
    assert httpx.get(url + "/v1/models").status_code == 200


def queued_on(mesh) -> int:
    """Requests waiting for KV memory on the mesh's nodes (each node's dashboard status)."""
    return sum(
        httpx.get(url_of(daemon) + "/meshd/status", timeout=10).json()["activity"][
            "queued_requests"
        ]
        for daemon in mesh
    )


def test_a_full_queue_is_refused_with_429_and_the_queue_moves_on(mesh) -> None:
    """The plan reserves KV for one sequence of CONTEXT tokens: a long answer streaming holds
    most of it, the next request waits in the first stage's queue (status shows it), a third
    finds the queue (one place) full: a real 429 in OpenAI's shape, RESOURCE_EXHAUSTED
    underneath. When the first stream is closed, the waiting request starts."""
    origin = url_of(mesh[0])
    story = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    body = {"stream": True, "max_tokens": 400, "temperature": 0, "messages": story}
    waiting_result: dict[str, object] = {}

    def wait_in_queue() -> None:
        with httpx.stream("POST", origin + "/v1/chat/completions", json=body, timeout=60) as r:
            waiting_result["status"] = r.status_code
            for chunk in r.iter_raw():
                waiting_result["first"] = chunk
                break

    with httpx.stream("POST", origin + "/v1/chat/completions", json=body, timeout=30) as first:
        assert first.status_code == 200
        first_chunks = first.iter_raw()  # kept: a dropped iterator closes the stream
        next(first_chunks)  # it runs, holding 400 + prompt of the CONTEXT tokens
        waiter = threading.Thread(target=wait_in_queue, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 20
        while queued_on(mesh) != 1:
            assert time.monotonic() < deadline, "the second request never showed as queued"
            time.sleep(0.1)
        refused = httpx.post(origin + "/v1/chat/completions", json={**body, "stream": False},
                             timeout=30)  # fmt: skip
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "queue full" in error["message"]
        assert refused.headers["retry-after"] == "1"  # when to ask again, for the SDKs
        assert "first" not in waiting_result  # still waiting behind the first stream
    waiter.join(60)  # closing the first stream ended its request: the waiting one starts
    assert waiting_result.get("status") == 200 and waiting_result.get("first"), waiting_result
    deadline = time.monotonic() + 20
    while queued_on(mesh) != 0:
        assert time.monotonic() < deadline, "the queue never emptied"
        time.sleep(0.1)


def test_a_stage_killed_mid_stream_does_not_interrupt_the_stream(mesh) -> None:
    """Kill a stage while an answer streams from another node: the origin moves the request
    to the survivors' plan and the client's SSE stream goes on to its end with no error frame
    (tests/test_resume_netns.py checks that the text is the uninterrupted run's); a request
    right after is answered by the survivors at once. Kills mesh[2]."""
    origin = url_of(mesh[0])
    story = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    body = {"stream": True, "max_tokens": 48, "temperature": 0, "messages": story}
    raw = bytearray()
    killed_at = resumed_at = None
    with httpx.stream("POST", origin + "/v1/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for chunk in reply.iter_raw():
            raw += chunk
            if killed_at is None and raw.count(b"\n\n") >= 5:
                mesh[2].kill()
                killed_at = time.monotonic()
            elif killed_at is not None and resumed_at is None:
                resumed_at = time.monotonic()
    assert killed_at is not None and resumed_at is not None, bytes(raw)
    frames = bytes(raw).decode().split("\n\n")
    assert frames[-1] == "", "the stream ended inside a frame"
    assert all(f.startswith("data: ") for f in frames[:-1])
    payloads = [f.removeprefix("data: ") for f in frames[:-1]]
    assert payloads[-1] == "[DONE]", payloads[-1]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert not [c for c in chunks if "error" in c], chunks
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    # The survivors' plan serves the stream already: a new request is answered at once.
    answer = httpx.post(origin + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16})  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert "Paris" in answer.json()["choices"][0]["message"]["content"]
    print(f"the stream paused {resumed_at - killed_at:.2f} s at the kill and went on")


def test_requests_do_not_cross_between_the_loops_and_a_plan_change_crosses_once(mesh) -> None:
    """The request path (HTTP or gRPC API, router, origin, stages) stays on the asyncio
    thread: a request costs no crossing to trio that idle time does not; and each plan
    change this node applied crossed to the asyncio side once (docs/architecture.md)."""
    origin = mesh[0]
    client = openai.OpenAI(base_url=url_of(origin) + "/v1", api_key="unused-on-loopback")
    requests = 12

    def crossings_while(work, seconds: float = 0.0) -> tuple[dict[str, int], float]:  # type: ignore[no-untyped-def]
        before = dict(origin.status().loop_crossings)
        began = time.monotonic()
        work()
        time.sleep(max(0.0, seconds - (time.monotonic() - began)))
        after = dict(origin.status().loop_crossings)
        return {key: after[key] - before.get(key, 0) for key in after}, time.monotonic() - began

    def ask() -> None:
        for _ in range(requests):
            client.completions.create(
                model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=4
            )

    busy, took = crossings_while(ask)
    idle, _ = crossings_while(lambda: None, took)  # as long: heartbeats cross as often
    per_request = {
        key: count - idle.get(key, 0)
        for key, count in busy.items()
        if count - idle.get(key, 0) >= requests
    }
    assert not per_request, f"crossings that grew with the requests: {per_request}"

    status = origin.status()
    installed = sum(" ready here: " in line for line in status.events)
    crossings = status.loop_crossings
    assert installed >= 1 and crossings["to asyncio _load_plan"] >= installed, crossings
    plan_sites = {key for key in crossings if key.startswith("to asyncio _") and "plan" in key}
    assert plan_sites <= {"to asyncio _load_plan", "to asyncio _unload_plan"}, plan_sites
