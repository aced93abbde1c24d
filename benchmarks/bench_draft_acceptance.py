"""Would speculative decoding pay on the embedded default? Acceptance of cheap drafts, measured.

Speculative decoding lets the pipeline verify k drafted tokens in one round trip instead of
one token per round trip. It pays only when the drafts are accepted often and cost little. The
embedded default, SmolLM2-135M-Instruct, has no smaller sibling here (no model hub), so this
measures the two drafts a mesh could get without one, on greedy answers of the full model:

- **early exit** (self-speculative): the first n layers + the final norm + the tied head. The
  first stage of a plan holds exactly that (its layers and the embedding, which is the head),
  so it could draft without a byte of extra weights;
- **prompt lookup**: the token that followed the last occurrence of the current two-token
  context in the prompt and answer so far (no model at all); it proposes only where the
  context occurred before (its coverage), one token at a time here.

For each: top-1 agreement with the full model (the acceptance rate alpha of greedy
verification), and what that gives: with k drafts per round, E = (1 - alpha^(k+1)) / (1 - alpha)
tokens per round, against a round's cost of one verification pass over k + 1 rows (measured
here relative to one row) plus k draft steps (early exit: n / layers of a step). The speed-up
column is E / that cost, for one request on one node; a pipeline saves a round trip per
accepted token too, but pays each draft step at the first stage while the others wait.

    .venv/bin/python benchmarks/bench_draft_acceptance.py [--max-tokens 120]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

from meshd.models.store import ModelStore

PROMPTS = [
    "Explain how a bicycle works.",
    "Write a short poem about the sea.",
    "What is the capital of France and why is it famous?",
    "List three uses of Python.",
    "Rewrite this sentence in the passive voice: The cat chased the mouse across the garden.",
]
EXITS = (8, 15, 20, 25)
DRAFTS = (1, 2, 4)


def answer_tokens(model, tokenizer, prompt: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """The chat prompt's ids and the full model's greedy answer's ids."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True
    )
    text = generate(model, tokenizer, prompt=ids, max_tokens=max_tokens, verbose=False)
    return list(ids), tokenizer.encode(text, add_special_tokens=False)


def early_exit_agreement(model, ids: list[int], answer: list[int]) -> dict[int, tuple[int, int]]:
    """For each exit depth: (positions where the early exit's argmax is the answer's next
    token, positions), over the answer (one causal pass over prompt + answer)."""
    inner = model.model
    hidden = inner.embed_tokens(mx.array([ids + answer]))
    mask = create_attention_mask(hidden, None)
    found: dict[int, tuple[int, int]] = {}
    for index, layer in enumerate(inner.layers):
        hidden = layer(hidden, mask, None)
        if index + 1 in EXITS or index + 1 == len(inner.layers):
            logits = inner.embed_tokens.as_linear(inner.norm(hidden))
            guesses = mx.argmax(logits[0, len(ids) - 1 : -1], axis=-1).tolist()
            found[index + 1] = (
                sum(g == a for g, a in zip(guesses, answer, strict=True)),
                len(answer),
            )
    return found


def lookup_agreement(ids: list[int], answer: list[int]) -> tuple[int, int, int]:
    """(right proposals, proposals, positions) of two-token prompt lookup over the answer."""
    right = proposed = 0
    for position in range(len(answer)):
        seen = ids + answer[:position]
        context = tuple(seen[-2:])
        guess = None
        for start in range(len(seen) - 3, -1, -1):
            if tuple(seen[start : start + 2]) == context:
                guess = seen[start + 2]
                break
        if guess is not None:
            proposed += 1
            right += guess == answer[position]
    return right, proposed, len(answer)


def verify_cost(model, rows: int, repeats: int = 20) -> float:
    """Seconds of one forward pass over ``rows`` new tokens after a 64-token context."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * 64]), cache=cache))
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(model(mx.array([[2] * rows]), cache=cache))
        best = min(best, time.perf_counter() - started)
        for layer_cache in cache:
            layer_cache.trim(rows)
    return best


def expected_tokens(alpha: float, drafts: int) -> float:
    return float(drafts + 1) if alpha >= 1.0 else (1 - alpha ** (drafts + 1)) / (1 - alpha)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=120)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="draft-") as root:
        path = ModelStore(Path(root) / "store").ensure_default().path
        model, tokenizer = load(str(path))
        layers = len(model.model.layers)
        exits: dict[int, list[int]] = {}
        lookup = [0, 0, 0]
        for prompt in PROMPTS:
            ids, answer = answer_tokens(model, tokenizer, prompt, args.max_tokens)
            for depth, (right, total) in early_exit_agreement(model, ids, answer).items():
                exits.setdefault(depth, [0, 0])
                exits[depth][0] += right
                exits[depth][1] += total
            for i, value in enumerate(lookup_agreement(ids, answer)):
                lookup[i] += value
        one = verify_cost(model, 1)
        ratios = {k: verify_cost(model, k + 1) / one for k in DRAFTS}
    print(f"SmolLM2-135M-Instruct, {len(PROMPTS)} greedy answers of up to {args.max_tokens} tokens")
    print("verification pass over k+1 rows vs one row: "
          + ", ".join(f"k={k}: {ratios[k]:.2f}x" for k in DRAFTS))  # fmt: skip
    header = (
        "draft".ljust(24) + "alpha".rjust(7) + "".join(f"   k={k}: E / speed-up" for k in DRAFTS)
    )
    print(header)
    for depth, (right, total) in sorted(exits.items()):
        alpha = right / total
        cells = []
        for k in DRAFTS:
            tokens = expected_tokens(alpha, k)
            cost = ratios[k] + k * depth / layers
            cells.append(f"{tokens:11.2f} / {tokens / cost:4.2f}x")
        label = "full model (check)" if depth == layers else f"early exit, {depth} layers"
        print(f"{label:24s}{alpha:7.2f}" + "".join(cells))
    right, proposed, total = lookup
    alpha = right / proposed if proposed else 0.0
    share = proposed / total if total else 0.0
    speed_up = (1 + right / total) / (1 + share * (ratios[1] - 1)) if total else 1.0
    print(f"prompt lookup: proposes at {proposed}/{total} positions, right at {right} "
          f"(alpha {alpha:.2f} where it proposes, {right / total:.2f} overall); one draft "
          f"where it proposes: {speed_up:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
