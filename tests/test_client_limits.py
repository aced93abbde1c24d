"""What a client cannot do to a daemon: overrun the plan's context, get a cut character,
run unlogged. A real daemon serving a tiny random mistral with a 64-token context (and, for
the log test, one with room for a stream its client leaves mid-way)."""

from __future__ import annotations

import time

import grpc
import pytest

from meshd.api import client
from meshd.wire import pb

pytestmark = pytest.mark.integration

LOOPBACK = ["--no-mdns", "--peer-host", "127.0.0.1", "--peer-port", "0"]
CONTEXT = 64


# Room for a stream the client can leave mid-way: the tiny model makes ~350 tokens a second
# here, so 64 tokens' worth ended (once, in a parallel run) before the client's close came.
ROOMY_CONTEXT = 2048


def context_daemon(daemons, mesh_token, architecture_dir, context: int):
    model = architecture_dir("mistral")
    args = [*LOOPBACK, "--join", mesh_token, "--model", str(model)]
    daemon = daemons([*args, "--context-length", str(context)])
    daemon.wait_for(lambda s: bool(s.agreement.active_plan_id), 60, "a committed plan")
    return daemon


@pytest.fixture
def small_context_daemon(daemons, mesh_token, architecture_dir):
    return context_daemon(daemons, mesh_token, architecture_dir, CONTEXT)


@pytest.fixture
def roomy_context_daemon(daemons, mesh_token, architecture_dir):
    return context_daemon(daemons, mesh_token, architecture_dir, ROOMY_CONTEXT)


def run(daemon, prompt: str, **sampling) -> list[pb.GenerateEvent]:
    request = pb.GenerateRequest(prompt=prompt, sampling=pb.Sampling(**sampling))
    return list(client.stream_generation(daemon.api, request, timeout_s=120))


def test_requests_beyond_the_plans_context_are_refused_at_once(small_context_daemon) -> None:
    daemon = small_context_daemon
    started = time.monotonic()
    with pytest.raises(client.GenerationFailed) as refused:
        run(daemon, "x" * 500)  # byte-level tokenizer: ~500 tokens against 64
    assert time.monotonic() - started < 5
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "leaves no room to generate" in str(refused.value) and "64 tokens" in str(refused.value)

    with pytest.raises(client.GenerationFailed) as refused:
        run(daemon, "y" * 40, max_tokens=40)
    message = str(refused.value)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "and max_tokens (40) need" in message and f"reserves {CONTEXT} per sequence" in message

    # Over the local API's 4 MiB message limit (proto/meshd.proto): gRPC refuses it itself.
    with pytest.raises(client.GenerationFailed) as refused:
        run(daemon, "w" * (4 * 1024 * 1024 + 1))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    # Unset, max_tokens is lowered to what fits after the prompt.
    done = run(daemon, "z" * 40, temperature=0.0)[-1].done
    assert done.prompt_tokens + done.completion_tokens <= CONTEXT
    assert done.completion_tokens > 0


def test_each_request_logs_its_start_and_end_and_shows_in_status(roomy_context_daemon) -> None:
    import threading

    daemon = roomy_context_daemon
    seen: list[pb.RequestStatus] = []
    finished = threading.Event()

    def watch() -> None:
        while not finished.is_set():
            seen.extend(client.fetch_status(daemon.api, 5.0).requests)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        done = run(daemon, "count with me", temperature=0.0, max_tokens=48)[-1].done
    finally:
        finished.set()
        watcher.join()
    assert seen, "the request never showed in Status while it ran"
    assert {r.prompt_tokens for r in seen} == {done.prompt_tokens}
    assert seen[0].max_tokens == 48 and seen[0].plan_id == done.plan_id
    assert not client.fetch_status(daemon.api).requests
    with pytest.raises(client.GenerationFailed):
        run(daemon, "q" * (ROOMY_CONTEXT - 5), max_tokens=10)
    stream = client.stream_generation(
        daemon.api,
        pb.GenerateRequest(prompt="go on", sampling=pb.Sampling(max_tokens=ROOMY_CONTEXT - 16)),
    )
    next(stream)
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30  # the daemon notices at once; a loaded machine is slow
    while "cancelled" not in daemon.log_tail(400) and time.monotonic() < deadline:
        time.sleep(0.1)
    log = daemon.log_tail(400)
    started = [line for line in log.splitlines() if "meshd.requests INFO request" in line]
    assert any(f"{done.prompt_tokens} prompt tokens, max_tokens 48" in line for line in started)
    assert any(
        f"finished ({done.finish_reason}): {done.completion_tokens} tokens" in line
        for line in started
    ), log
    assert any("refused before it started: failed (INVALID_ARGUMENT)" in line for line in started)
    assert any("cancelled" in line for line in started), log
    while client.fetch_status(daemon.api).requests and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.fetch_status(daemon.api).requests


def test_a_chat_to_a_model_without_a_chat_template_is_invalid_argument(
    daemons, mesh_token, architecture_dir, tmp_path
) -> None:
    """A base model has no chat template: a chat (or chat_template=true) is the client's
    mistake, answered in words, not UNKNOWN with a traceback in the daemon's log."""
    import json
    import shutil

    model = tmp_path / "base-model"
    shutil.copytree(architecture_dir("mistral"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    daemon = daemons([*LOOPBACK, "--join", mesh_token, "--model", str(model)])
    daemon.wait_for(lambda s: bool(s.agreement.active_plan_id), 60, "a committed plan")

    chat = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")])
    for call in (
        lambda: list(client.stream_generation(daemon.api, chat, timeout_s=60)),
        lambda: list(
            client.stream_generation(
                daemon.api, pb.GenerateRequest(prompt="hi", chat_template=True), timeout_s=60
            )
        ),
    ):
        with pytest.raises(client.GenerationFailed) as refused:
            call()
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "has no chat template" in str(refused.value), str(refused.value)
    assert run(daemon, "plain text works", max_tokens=3)[-1].done.completion_tokens == 3
    log = daemon.log_tail(400)
    assert "Traceback" not in log and " ERROR " not in log, log
