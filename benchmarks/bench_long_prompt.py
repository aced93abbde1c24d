"""A long prompt next to a short request, on real daemons serving SmolLM2-135M.

Measures, on a loopback mesh of ``--nodes`` daemons (the memory strategy splits the layers):

* a prompt longer than the plan's context: the error the client gets, and how fast;
* a short request alone: its time to first token (TTFT);
* the same short request sent while a long prompt (most of the context) is being
  prefilled: its TTFT, and the long request's. Prefill chunks take turns with other
  requests' steps on every stage, so the short request should not wait for the whole
  prefill.

    .venv/bin/python benchmarks/bench_long_prompt.py --nodes 2 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

# isort: split
from meshd.api import client
from meshd.api.demo import loopback_args, plan_committed
from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.models.store import ModelStore
from meshd.wire import pb

CONTEXT = 2048
SHORT_PROMPT = "What is the capital of France?"


def long_prompt(words: int) -> str:
    return " ".join(f"item{index % 97}" for index in range(words))


def ttft(api: str, prompt: str, max_tokens: int) -> tuple[float, float, pb.GenerationDone]:
    """Seconds to the first text event and to the end, and the final event."""
    request = pb.GenerateRequest(prompt=prompt, sampling=pb.Sampling(max_tokens=max_tokens))
    started = time.perf_counter()
    first = None
    done = pb.GenerationDone()
    for event in client.stream_generation(api, request, timeout_s=600):
        if event.HasField("text") and first is None:
            first = time.perf_counter() - started
        if event.HasField("done"):
            done = event.done
    total = time.perf_counter() - started
    return (first if first is not None else total), total, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--long-words", type=int, default=700, help="~2 tokens per word")
    args = parser.parse_args()

    store = ModelStore(Path(tempfile.mkdtemp(prefix="bench-long-store-")))
    model = store.ensure_default().path
    root = Path(tempfile.mkdtemp(prefix="bench-long-"))
    token = security.encode_join_token(security.create_mesh_secret("bench-long"))
    extra = ["--context-length", str(CONTEXT), "--http", "off"]
    daemons = [
        DaemonProcess(root / f"n{i}", [*loopback_args(token, f"l{i}", model), *extra]).start()
        for i in range(args.nodes)
    ]
    try:
        for daemon in daemons:
            daemon.wait_for(plan_committed(args.nodes), 180, "a committed plan")
        api = daemons[0].api
        ttft(api, SHORT_PROMPT, 4)  # warm up

        started = time.perf_counter()
        try:
            ttft(api, long_prompt(CONTEXT * 2), 16)
            refusal = {"error": None}
        except client.GenerationFailed as error:
            refusal = {"code": error.code.name, "message": str(error)}
        refusal["seconds"] = round(time.perf_counter() - started, 3)

        alone, together, long_ttfts, long_prompt_tokens = [], [], [], 0
        for _ in range(args.runs):
            alone.append(ttft(api, SHORT_PROMPT, 8)[0])
            long_result: list = []
            runner = threading.Thread(
                target=lambda out=long_result: out.append(
                    ttft(api, long_prompt(args.long_words), 8)
                )
            )
            runner.start()
            time.sleep(0.3)  # the long prompt's prefill is under way
            together.append(ttft(api, SHORT_PROMPT, 8)[0])
            runner.join()
            long_ttfts.append(long_result[0][0])
            long_prompt_tokens = long_result[0][2].prompt_tokens
        report = {
            "nodes": args.nodes,
            "context": CONTEXT,
            "too_long_prompt": refusal,
            "long_prompt_tokens": long_prompt_tokens,
            "short_ttft_alone_s": round(statistics.median(alone), 3),
            "short_ttft_during_long_prefill_s": round(statistics.median(together), 3),
            "short_ttft_during_long_prefill_all_s": [round(t, 3) for t in together],
            "long_ttft_s": round(statistics.median(long_ttfts), 3),
        }
        print(json.dumps(report, indent=2))
    finally:
        for daemon in daemons:
            daemon.terminate()


if __name__ == "__main__":
    main()
