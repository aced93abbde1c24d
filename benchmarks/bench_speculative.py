"""Speculative decoding on the product: `meshd run` daemons, with and without drafts.

Two daemons, each in its own network namespace (tests/netns.py: a bridge inside a namespace
of its own, nothing touches the machine's interfaces) and pinned with taskset to its own core
to stand in for two machines, split the embedded SmolLM2-135M-Instruct in two stages. The same
greedy requests run on a mesh started with ``--draft-tokens 0`` (the baseline, one token per
round trip) and on one started with ``--draft-tokens N`` (the first stage guesses up to N
tokens per step from the prompt and the answer so far; the stages verify them in one pass).
For each prompt: completion tokens, the daemons' own decode tokens/s (final event), and
whether the text is the same. The prompts: two that invite copying (fixing code, editing a
text), two plain chat answers.

    sudo .venv/bin/python benchmarks/bench_speculative.py [--draft-tokens 4] [--runs 3]
        [--max-tokens 96] [--nodes 2]

``--nodes 1``: one daemon pinned to one core holds the whole model (a single stage drafts
on its compute thread, where the token its next step follows is).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

from bench_batching import bench_root, pinned_mesh

from meshd.api import client
from meshd.wire import pb

CODE = "def add_numbers(a, b):\n    reslt = a + b\n    return reslt\n"
PROMPTS = {
    "fix code": f"Fix the typo in this code and show the whole corrected function:\n{CODE}",
    "edit text": "Rewrite this list in alphabetical order: pear, apple, mango, banana, cherry, "
    "grape, kiwi, lemon.",
    "chat: bicycle": "Explain how a bicycle works.",
    "chat: poem": "Write a short poem about the sea.",
}


def run_prompts(api: str, runs: int, max_tokens: int) -> dict[str, tuple[int, float, str]]:
    """Per prompt: completion tokens, median decode tok/s over ``runs`` (after a warm-up),
    and the text."""
    found: dict[str, tuple[int, float, str]] = {}
    for name, content in PROMPTS.items():
        request = pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content=content)],
            sampling=pb.Sampling(temperature=0, max_tokens=max_tokens),
        )
        rates, text, tokens = [], "", 0
        for run in range(runs + 1):
            pieces = []
            for event in client.stream_generation(api, request, timeout_s=300):
                if event.HasField("text"):
                    pieces.append(event.text)
                elif event.HasField("done") and run:
                    rates.append(event.done.decode_tokens_per_s)
                    tokens = event.done.completion_tokens
            text = "".join(pieces)
        found[name] = (tokens, statistics.median(rates), text)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=2)
    args = parser.parse_args()
    from tests.netns import cleanup_stale

    cleanup_stale()
    with bench_root("bench-spec-") as (root, model):
        cpus = ["0", "1"][: args.nodes]

        def measure(api: str) -> dict[str, tuple[int, float, str]]:
            return run_prompts(api, args.runs, args.max_tokens)

        plain = pinned_mesh(root, model, cpus, ["--draft-tokens", "0"], measure)
        drafts = ["--draft-tokens", str(args.draft_tokens)]
        drafted = pinned_mesh(root, model, cpus, drafts, measure)
    split = "15/15 layers" if args.nodes == 2 else "all 30 layers on one node"
    print(f"{args.nodes} pinned netns daemon(s), SmolLM2 {split}, greedy, median of {args.runs}")
    print(f"{'prompt':16s}{'tokens':>8s}{'no drafts':>12s}{f'drafts {args.draft_tokens}':>12s}"
          f"{'speed-up':>10s}  same text")  # fmt: skip
    for name in PROMPTS:
        tokens, base, text = plain[name]
        _, rate, spec_text = drafted[name]
        print(f"{name:16s}{tokens:8d}{base:9.2f} t/s{rate:9.2f} t/s{rate / base:9.2f}x  "
              f"{'yes' if text == spec_text else 'NO'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
