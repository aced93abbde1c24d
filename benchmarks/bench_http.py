"""HTTP streaming overhead per token vs the gRPC client API, and time to first byte.

Two measurements, one run:

* **The product**: N loopback daemons (default 2) split the embedded SmolLM2-135M (memory
  strategy); the same greedy chat request (same prompt, same tokens) is streamed from one
  node alternately over the gRPC `Chat` API (the CLI's client) and over HTTP
  (`/v1/chat/completions` with SSE, read by httpx). Reported per transport, as medians over
  the runs: time to the first byte and to the first token, and decode milliseconds per token
  (first token to last token, over the tokens in between). The difference per token is the
  HTTP path's cost as a client sees it; on this machine it is far below the run-to-run noise
  of the decode itself (tens of ms per token), so the next line isolates it.
* **The HTTP layer alone**: the same Starlette app on hypercorn on loopback, read by httpx,
  with a backend that hands it pieces as fast as it takes them (no model): microseconds per
  streamed token of translation, SSE framing, the server and the client together. This is
  an upper bound of what HTTP adds to each token of a real request.

Goal: HTTP adds under 0.2 ms per token.

Run: ``.venv/bin/python benchmarks/bench_http.py [--nodes 2] [--runs 5] [--tokens 96]``
(about a minute and a half on 2 cores).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import AsyncIterator

import httpx

from meshd.api import client
from meshd.api.demo import loopback_args, plan_committed
from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.models.store import ModelStore
from meshd.wire import pb

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def grpc_run(api: str, max_tokens: int) -> dict:
    request = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content=PROMPT)],
        sampling=pb.Sampling(temperature=0, max_tokens=max_tokens),
    )
    started = time.perf_counter()
    arrivals, text, first_byte = [], [], None
    for event in client.stream_generation(api, request, timeout_s=300):
        now = time.perf_counter()
        first_byte = first_byte or now
        if event.HasField("text"):
            arrivals.append(now)
            text.append(event.text)
    return _summary(started, first_byte, arrivals, "".join(text))


def http_run(url: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}  # fmt: skip
    started = time.perf_counter()
    arrivals, text, first_byte = [], [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            now = time.perf_counter()
            first_byte = first_byte or now
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                arrivals.append(now)
                text.append(delta)
    return _summary(started, first_byte, arrivals, "".join(text))


def _summary(started: float, first_byte: float | None, arrivals: list[float], text: str) -> dict:
    pieces = len(arrivals)
    return {
        "ttfb_s": (first_byte or started) - started,
        "ttft_s": arrivals[0] - started if arrivals else 0.0,
        "decode_s_per_token": (arrivals[-1] - arrivals[0]) / (pieces - 1) if pieces > 1 else 0.0,
        "pieces": pieces,
        "text": text,
    }


def product(nodes: int, runs: int, tokens: int) -> dict:
    model = ModelStore(Path(tempfile.mkdtemp(prefix="bench-http-store-"))).ensure_default().path
    root = Path(tempfile.mkdtemp(prefix="bench-http-"))
    token = security.encode_join_token(security.create_mesh_secret("bench-http"))
    daemons = [
        DaemonProcess(root / f"n{i}", loopback_args(token, f"b{i}", model)).start()
        for i in range(nodes)
    ]
    try:
        for daemon in daemons:
            daemon.wait_for(plan_committed(nodes), 120, "a committed plan")
        origin = daemons[0]
        url = origin.status().http_url
        grpc_run(origin.api, 8)  # warm both paths
        http_run(url, 8)
        results: dict[str, list[dict]] = {"grpc": [], "http": []}
        for _ in range(runs):
            results["grpc"].append(grpc_run(origin.api, tokens))
            results["http"].append(http_run(url, tokens))
        texts = {r["text"] for rs in results.values() for r in rs}
        out = {"nodes": nodes, "runs": runs, "same_text_everywhere": len(texts) == 1}
        for name, rs in results.items():
            out[name] = {
                key: statistics.median(r[key] for r in rs)
                for key in ("ttfb_s", "ttft_s", "decode_s_per_token", "pieces")
            }
        return out
    finally:
        for daemon in daemons:
            daemon.terminate()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(model.parent.parent, ignore_errors=True)


class InstantBackend:
    """Hands the HTTP layer `pieces` text pieces as fast as it reads them (no model)."""

    def __init__(self, pieces: int) -> None:
        self.pieces = pieces

    def check_model(self, model: str) -> str:
        return "instant"

    def tool_format(self):
        return None

    async def model_card(self):
        return None

    async def generate(self, **kwargs) -> AsyncIterator:
        from meshd.http.backend import Finished, Piece, Started

        yield Started("plan", "instant", 10)
        for _ in range(self.pieces):
            yield Piece(" word")
        yield Finished("length", 10, self.pieces, 0.0, 0.0, 0.0, 0)


def http_layer(pieces: int, runs: int) -> dict:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from meshd.http.server import _listen, build_app

    sock = _listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        app = build_app(InstantBackend(pieces), keys=None, loopback=True, closing=asyncio.Event())
        loop.run_until_complete(serve(app, config, shutdown_trigger=stop.wait))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(url + "/v1/models", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    per_token = []
    try:
        for _ in range(runs):
            result = http_run(url, pieces)
            assert result["pieces"] == pieces, result["pieces"]
            per_token.append(result["decode_s_per_token"])
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
    return {"pieces": pieces, "runs": runs, "s_per_token": statistics.median(per_token)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    layer = http_layer(2000, 5)
    mesh = product(args.nodes, args.runs, args.tokens)
    g, h = mesh["grpc"], mesh["http"]
    print(f"real mesh: {args.nodes} loopback daemons, SmolLM2-135M, {h['pieces']:.0f} greedy "
          f"tokens, median of {args.runs} alternating runs; same text: "
          f"{mesh['same_text_everywhere']}")  # fmt: skip
    print(f"{'':8}{'first byte':>12}{'first token':>13}{'decode ms/token':>17}")
    for name, row in (("gRPC", g), ("HTTP", h)):
        print(f"{name:8}{row['ttfb_s'] * 1e3:10.1f} ms{row['ttft_s'] * 1e3:11.1f} ms"
              f"{row['decode_s_per_token'] * 1e3:15.2f}")  # fmt: skip
    diff = (h["decode_s_per_token"] - g["decode_s_per_token"]) * 1e3
    print(f"HTTP - gRPC per token: {diff:+.2f} ms (within run-to-run noise of the decode)")
    print(f"HTTP layer alone (server, SSE, client; {layer['pieces']} instant pieces): "
          f"{layer['s_per_token'] * 1e3:.3f} ms per token (goal < 0.2 ms)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"mesh": mesh, "http_layer": layer}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
