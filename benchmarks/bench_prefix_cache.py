"""An agent's conversation on a 2-node mesh, with the prefix cache and without it.

What agents and coding tools send: a long system prompt with tool definitions, then every
turn the whole conversation again plus a few hundred new tokens. Each turn is asked with the
official clients over the HTTP APIs of two real ``meshd run`` daemons (each pinned to one
core, as two machines) and its time to first token measured three ways, in the same run:

* warm: the turn as an agent sends it, the stages' kept prefix reused;
* cold: the same request with ``cache_prompt: false`` (every stage prefills it all);
* new only: a request made of only the turn's new tokens (the floor a cache can reach).

Goals: from turn 2 on, warm TTFT within 1.5x of new-only; warm at least 5x faster than cold
by turn 5. ``--interleaved`` runs two such conversations (openai and anthropic clients)
turn by turn, sharing the system prompt, and reports the cached-token counts each client saw.

    .venv/bin/python benchmarks/bench_prefix_cache.py                   # SmolLM2-135M
    .venv/bin/python benchmarks/bench_prefix_cache.py --interleaved
    .venv/bin/python benchmarks/bench_prefix_cache.py --larger --turns 5  # a 360M-shaped llama
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batching import bench_root, start_mesh

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

MODEL_NAME = ""  # the mesh's model (any name is the one model it runs)
WORDS = [
    "river",
    "mountain",
    "lantern",
    "harbor",
    "quiet",
    "signal",
    "copper",
    "meadow",
    "orbit",
    "canvas",
    "ember",
    "violet",
    "granite",
    "whisper",
    "compass",
    "tundra",
    "saffron",
    "beacon",
    "willow",
    "prism",
]
TOOLS = [
    {
        "name": f"tool_{i}",
        "description": f"Tool {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(30)),
        "parameters": {
            "type": "object",
            "properties": {
                f"arg_{j}": {"type": "string", "description": " ".join(WORDS[j:] + WORDS[:j])}
                for j in range(4)
            },
            "required": ["arg_0"],
        },
    }
    for i in range(12)
]


def text_of(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of prose drawn with ``seed`` (SmolLM2: ~1.3 tokens per word):
    two seeds give texts that part at their first words, as two users' messages do."""
    pick = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pe", "dra", "gon", "fel"]
    words = [
        WORDS[pick.randrange(len(WORDS))]
        if pick.random() < 0.5
        else "".join(pick.choice(syllables) for _ in range(pick.randint(2, 3)))
        for _ in range(int(tokens / 1.85))
    ]
    return " ".join(words) + "."


def system_prompt(tokens: int, count: Callable[[str], int]) -> str:
    """A coding agent's system prompt of about ``tokens`` tokens (by the model's tokenizer,
    ``count``): tool definitions as JSON schemas, then rules."""
    head = f"You are a coding agent. Use the tools below.\nTools:\n{json.dumps(TOOLS, indent=1)}\n"
    rules = max(0, tokens - count(head))
    while True:
        prompt = head + "Rules: " + text_of(rules, seed=1)
        if count(prompt) >= tokens or rules > 4 * tokens:
            return prompt
        rules += max(8, tokens - count(prompt))


def openai_turn(client, messages, max_tokens: int, cache: bool = True) -> tuple[float, str, int]:
    """One streamed chat request: TTFT, the answer, the cached tokens the usage reports."""
    sent = time.perf_counter()
    first = None
    parts: list[str] = []
    cached = 0
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={} if cache else {"cache_prompt": False},
    )
    for chunk in stream:
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = details.cached_tokens if details else 0
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
    return (first or time.perf_counter()) - sent, "".join(parts), cached


def anthropic_turn(client, system: str, messages, max_tokens: int) -> tuple[float, str, int]:
    sent = time.perf_counter()
    first = None
    with client.messages.stream(
        model=MODEL_NAME,
        system=system,
        messages=messages,
        max_tokens=max_tokens,
        extra_body={"temperature": 0},
    ) as stream:
        parts = []
        for piece in stream.text_stream:
            first = first or time.perf_counter()
            parts.append(piece)
        final = stream.get_final_message()
    cached = final.usage.cache_read_input_tokens or 0
    return (first or time.perf_counter()) - sent, "".join(parts), cached


def conversation_rows(url: str, args: argparse.Namespace, model: Path) -> list[dict]:
    import anthropic
    import openai

    chat = openai.OpenAI(base_url=url + "/v1", api_key="loopback", max_retries=0, timeout=900)
    claude = anthropic.Anthropic(base_url=url, api_key="loopback", max_retries=0, timeout=900)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    system = system_prompt(args.system_tokens, lambda text: len(tokenizer.encode(text).ids))
    names = ["openai", "anthropic"] if args.interleaved else ["openai"]
    history: dict[str, list[dict]] = {name: [] for name in names}
    rows = []
    for turn in range(1, args.turns + 1):
        for index, name in enumerate(names):
            new = text_of(args.turn_tokens, seed=100 * index + turn)
            history[name].append({"role": "user", "content": new})
            if name == "openai":
                messages = [{"role": "system", "content": system}, *history[name]]
                ttft, answer, cached = openai_turn(chat, messages, args.max_tokens)
            else:
                asked = history[name]
                ttft, answer, cached = anthropic_turn(claude, system, asked, args.max_tokens)
            history[name].append({"role": "assistant", "content": answer or "ok"})
            floor, _, _ = openai_turn(chat, [{"role": "user", "content": new}], 1, cache=False)
            cold = None
            if turn in args.cold_turns:
                messages = [{"role": "system", "content": system}, *history[name][:-1]]
                cold, _, _ = openai_turn(chat, messages, 1, cache=False)
            row = {"conversation": name, "turn": turn, "warm_ttft_s": ttft, "cached": cached,
                   "new_only_ttft_s": floor, "cold_ttft_s": cold}  # fmt: skip
            rows.append(row)
            cold_text = f"{cold:6.2f} s ({cold / ttft:4.1f}x)" if cold else "     -        "
            print(
                f"{name:<9} turn {turn:2d}: warm {ttft:6.2f} s, {cached:5d} cached | "
                f"new only {floor:5.2f} s ({ttft / floor:4.2f}x) | cold {cold_text}",
                flush=True,
            )
    return rows


def larger_model(root: Path, smollm2: Path) -> Path:
    """A random-weight llama of SmolLM2-360M's shape (hidden 960, 32 layers) with SmolLM2's
    tokenizer and chat template, from mlx-lm's own classes, float32."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, save_model

    folder = root / "llama-360m-random"
    folder.mkdir()
    config = json.loads((smollm2 / "config.json").read_text())
    config.update(hidden_size=960, num_hidden_layers=32, intermediate_size=2560,
                  num_attention_heads=15, num_key_value_heads=5)  # fmt: skip
    config.pop("quantization", None)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))  # mlx-lm's own random initialisation
    mx.eval(model.parameters())
    save_model(folder, model)
    (folder / "config.json").write_text(json.dumps(config))
    for item in smollm2.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_")):
            shutil.copy(item, folder / item.name)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--turn-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cold-turns", type=int, nargs="*", default=[1, 2, 5, 10])
    parser.add_argument("--interleaved", action="store_true")
    parser.add_argument("--larger", action="store_true", help="a random 360M-shaped llama")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the daemons on a kill too
    with bench_root("meshd-bench-prefix-") as (root, smollm2):
        model = larger_model(root, smollm2) if args.larger else smollm2
        extra = ["--context-length", "8192", "--prefix-cache-sequences", "2"]
        daemons = start_mesh(root, model, ["0", "1"], 1, extra_args=extra)
        try:
            url = daemons[0].status().http_url
            rows = conversation_rows(url, args, model)
        finally:
            for daemon in daemons:
                daemon.kill()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
