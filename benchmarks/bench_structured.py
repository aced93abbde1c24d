"""Structured outputs on the product: schema-constrained requests through real daemons.

Two loopback ``meshd run`` daemons split the embedded SmolLM2-135M-Instruct (memory strategy:
a stage each), so every mask is computed on the node that holds the head, not on the one the
clients talk to. Two measurements, one run:

* **Validity**: ``--requests`` schema-constrained chat requests (default 50), half through the
  openai SDK (``response_format`` ``json_schema`` with the schema Pydantic writes), half
  through LangChain (``ChatOpenAI(...).with_structured_output(Model)``, its default method:
  ``json_schema``), over five Pydantic models that each nest objects, enums and arrays, five
  prompts each, sampled (temperature 0.7, a seed per request), ``--concurrency`` at a time
  (decode steps batched on the stages). An answer is valid when it parses and validates
  against its model's JSON schema (jsonschema) and the model (Pydantic). Goal: all of them.
* **Speed**: decode tokens/s of one request at a time, streamed (first token to last, over
  the usage's completion tokens), the same prompts constrained (``json_schema``) and free,
  alternating, ``--speed-runs`` each, greedy: the masks' cost per token, in the same run.
  On a shared machine that comparison is noisy, so the masks' own cost is also timed in this
  process: the valid openai answers' tokens replayed through their masks (computed, applied
  to a row of logits, advanced), per token; and the one-time build of the tokenizer's index.

The machine's load average is printed with the numbers (a shared machine: read them with it).

    .venv/bin/python benchmarks/bench_structured.py [--requests 50] [--concurrency 4]
        [--speed-runs 5] [--max-tokens 160]

Needs the ``bench`` extra (``pip install -e .[bench]``: langchain-openai). Daemons announce
on 127.0.0.1 only and talk over loopback; their state and model store are temporary
directories removed at the end, and they are stopped by PID. LangChain's tracing is off.
"""

from __future__ import annotations

import os

os.environ["LANGSMITH_TRACING"] = "false"  # nothing leaves loopback
os.environ["LANGCHAIN_TRACING_V2"] = "false"

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

import jsonschema
import openai
from pydantic import BaseModel, Field

from meshd.api.demo import loopback_args
from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.models.store import ModelStore
from meshd.wire import pb

MODEL = "smollm2-135m-instruct"
# Strings are bounded, as a schema for a small model should be (an unbounded string lets it
# write until max_tokens; the grammar keeps it valid, but cut answers are not).
Short = Annotated[str, Field(max_length=24)]


class Country(StrEnum):
    france = "FR"
    germany = "DE"
    italy = "IT"
    spain = "ES"


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: Short
    country: Country


class Person(BaseModel):
    """A person and where they live."""

    name: Short
    age: int = Field(ge=0, le=120)
    favorite_color: Color
    hobbies: list[Short] = Field(max_length=3)
    address: Address


class Status(StrEnum):
    pending = "pending"
    shipped = "shipped"
    delivered = "delivered"


class Size(StrEnum):
    small = "S"
    medium = "M"
    large = "L"


class Item(BaseModel):
    product: Short
    quantity: int = Field(ge=1, le=10)
    size: Size


class Order(BaseModel):
    """A customer's order."""

    customer: Short
    status: Status
    items: list[Item] = Field(max_length=3)
    shipping: Address


class Sky(StrEnum):
    sunny = "sunny"
    cloudy = "cloudy"
    rainy = "rainy"


class Day(BaseModel):
    weekday: Short
    high_celsius: int = Field(ge=-30, le=50)
    sky: Sky


class Forecast(BaseModel):
    """A weather forecast."""

    city: Short
    days: list[Day] = Field(max_length=3)


class Difficulty(StrEnum):
    easy = "easy"
    medium = "medium"
    hard = "hard"


class Ingredient(BaseModel):
    name: Short
    grams: int = Field(ge=1, le=2000)


class Recipe(BaseModel):
    """A recipe."""

    title: Short
    difficulty: Difficulty
    ingredients: list[Ingredient] = Field(max_length=4)
    steps: list[Short] = Field(max_length=3)


class Role(StrEnum):
    host = "host"
    speaker = "speaker"
    guest = "guest"


class Attendee(BaseModel):
    name: Short
    role: Role


class Venue(BaseModel):
    name: Short
    address: Address


class Event(BaseModel):
    """An event."""

    title: Short
    venue: Venue
    attendees: list[Attendee] = Field(max_length=3)


TASKS: list[tuple[type[BaseModel], list[str]]] = [
    (Person, [
        "Describe Marie, a painter who lives in Paris.",
        "Describe Hans, a baker from Berlin.",
        "Describe Giulia, a student in Rome.",
        "Describe Pablo, a chef in Madrid.",
        "Describe Anna, a nurse who lives in Lyon.",
    ]),
    (Order, [
        "Alice ordered two blue shirts and a hat; they were shipped to Paris.",
        "Bob's order of three mugs is still pending, for delivery in Munich.",
        "Carla received one large coat in Milan.",
        "Dan ordered five small socks and one scarf, to Valencia.",
        "Eve's order of a medium jacket was delivered to Hamburg.",
    ]),
    (Forecast, [
        "Give the weather forecast for Paris for the next three days.",
        "What will the weather be in Berlin this weekend?",
        "Forecast the weather in Rome for Monday and Tuesday.",
        "Weather forecast for Madrid for the next two days.",
        "How will the weather be in Oslo tomorrow?",
    ]),
    (Recipe, [
        "Give me a recipe for pancakes.",
        "How do I cook a tomato soup?",
        "A simple recipe for an omelette.",
        "Write a recipe for chocolate cake.",
        "How do I make a salad?",
    ]),
    (Event, [
        "A jazz concert at the Blue Note in Paris with two musicians.",
        "A team meeting in the Berlin office with a host and a guest.",
        "A football match at the stadium in Rome.",
        "A science talk in Madrid with one speaker.",
        "A book launch in Lyon with the author and a host.",
    ]),
]  # fmt: skip


@dataclass
class Outcome:
    path: str  # "openai" or "langchain"
    schema: str
    valid: bool
    finish: str
    tokens: int
    seconds: float
    error: str = ""
    answer: str = ""  # the JSON text (openai's requests)


def openai_request(
    url: str, model: type[BaseModel], prompt: str, seed: int, max_tokens: int
) -> Outcome:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    schema = model.model_json_schema()
    started = time.perf_counter()
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": model.__name__, "schema": schema},
        },
        temperature=0.7,
        seed=seed,
        max_tokens=max_tokens,
    )
    seconds = time.perf_counter() - started
    choice = reply.choices[0]
    outcome = Outcome("openai", model.__name__, False, choice.finish_reason,
                      reply.usage.completion_tokens, seconds)  # fmt: skip
    outcome.answer = choice.message.content or ""
    try:
        answer = json.loads(outcome.answer)
        jsonschema.validate(answer, schema)
        model.model_validate(answer)
        outcome.valid = True
    except Exception as error:
        outcome.error = f"{type(error).__name__}: {str(error)[:200]}"
    return outcome


def langchain_request(
    url: str, model: type[BaseModel], prompt: str, seed: int, max_tokens: int
) -> Outcome:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=url + "/v1", api_key="unused", model=MODEL, temperature=0.7,
                     seed=seed, max_tokens=max_tokens, max_retries=0, timeout=600)  # fmt: skip
    structured = llm.with_structured_output(model, include_raw=True)
    started = time.perf_counter()
    try:
        result = structured.invoke(prompt)
    except Exception as error:  # e.g. openai's LengthFinishReasonError: cut by max_tokens
        seconds = time.perf_counter() - started
        return Outcome("langchain", model.__name__, False, "error", 0, seconds,
                       f"{type(error).__name__}: {str(error)[:200]}")  # fmt: skip
    seconds = time.perf_counter() - started
    raw = result["raw"]
    meta = raw.response_metadata
    outcome = Outcome("langchain", model.__name__, False, str(meta.get("finish_reason")),
                      int((raw.usage_metadata or {}).get("output_tokens", 0)), seconds)  # fmt: skip
    parsed = result["parsed"]
    if isinstance(parsed, model) and result["parsing_error"] is None:
        try:
            jsonschema.validate(parsed.model_dump(mode="json"), model.model_json_schema())
            outcome.valid = True
        except Exception as error:
            outcome.error = f"{type(error).__name__}: {str(error)[:200]}"
    else:
        outcome.error = f"not parsed: {result['parsing_error']}"[:200]
    return outcome


def validity(
    url: str, requests: int, concurrency: int, max_tokens: int
) -> tuple[dict[str, Any], list[Outcome]]:
    jobs = []
    pairs = [(model, prompt) for model, prompts in TASKS for prompt in prompts]
    for index in range(requests):
        model, prompt = pairs[(index // 2) % len(pairs)]
        run = openai_request if index % 2 == 0 else langchain_request
        jobs.append((run, model, prompt, 1000 + index))
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda job: job[0](url, job[1], job[2], job[3], max_tokens), jobs))
    wall = time.perf_counter() - started
    for outcome in outcomes:
        if not outcome.valid:
            print(f"  invalid ({outcome.path}, {outcome.schema}, {outcome.finish}): "
                  f"{outcome.error}", flush=True)  # fmt: skip
    tokens = sum(o.tokens for o in outcomes)
    summary = {
        "requests": len(outcomes),
        "valid": sum(o.valid for o in outcomes),
        "valid_openai": sum(o.valid for o in outcomes if o.path == "openai"),
        "valid_langchain": sum(o.valid for o in outcomes if o.path == "langchain"),
        "finish_reasons": dict(Counter(o.finish for o in outcomes)),
        "completion_tokens_median": statistics.median(o.tokens for o in outcomes),
        "wall_s": round(wall, 1),
        "aggregate_tokens_per_s": round(tokens / wall, 2),
        "concurrency": concurrency,
    }  # fmt: skip
    return summary, outcomes


def streamed_decode(
    url: str, prompt: str, schema: dict[str, Any] | None, max_tokens: int
) -> tuple[float, int]:
    """Decode tokens/s of one greedy streamed request (first token to last) and its tokens."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    extra: dict[str, Any] = {}
    if schema is not None:
        spec = {"name": "answer", "schema": schema}
        extra["response_format"] = {"type": "json_schema", "json_schema": spec}
    first = last = None
    tokens = 0
    for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, **extra,
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None or last is None or tokens < 3 or last <= first:
        return 0.0, tokens
    return (tokens - 1) / (last - first), tokens


def speed(url: str, runs: int, max_tokens: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"constrained": [], "free": []}
    tokens: dict[str, list[int]] = {"constrained": [], "free": []}
    pairs = [(model, prompt) for model, prompts in TASKS for prompt in prompts[:1]]
    for index in range(runs):
        model, prompt = pairs[index % len(pairs)]
        for name, schema in (("constrained", model.model_json_schema()), ("free", None)):
            rate, count = streamed_decode(url, prompt, schema, max_tokens)
            if rate:
                rates[name].append(rate)
                tokens[name].append(count)
    out: dict[str, Any] = {"runs": runs}
    for name in rates:
        out[f"{name}_decode_tokens_per_s_median"] = round(statistics.median(rates[name]), 2)
        out[f"{name}_decode_tokens_per_s_all"] = [round(r, 2) for r in rates[name]]
        out[f"{name}_tokens_median"] = statistics.median(tokens[name])
    out["constrained_over_free"] = round(
        out["constrained_decode_tokens_per_s_median"] / out["free_decode_tokens_per_s_median"], 3
    )
    return out


def mask_cost(model_dir: Path, outcomes: list[Outcome]) -> dict[str, Any]:
    """What the grammar costs per token on its own, in this process: the valid openai answers'
    tokens replayed through their schemas' masks (the mask computed, applied to a row of
    logits, and advanced), as the last stage does at each step."""
    import mlx.core as mx
    from mlx_lm.utils import load_config, load_tokenizer

    from meshd.inference.grammar import GrammarMask, grammar_tokenizer, json_constraint

    tokenizer = load_tokenizer(model_dir, eos_token_ids=load_config(model_dir).get("eos_token_id"))
    started = time.perf_counter()
    index = grammar_tokenizer(tokenizer)
    index_s = time.perf_counter() - started
    schemas = {model.__name__: model.model_json_schema() for model, _ in TASKS}
    logits = mx.zeros((1, tokenizer.vocab_size))
    per_token: list[float] = []
    for outcome in outcomes:
        if not (outcome.valid and outcome.answer):
            continue
        constraint = json_constraint(schemas[outcome.schema])
        mask = GrammarMask(constraint, index, tokenizer.eos_token_ids)
        for token in [*tokenizer.encode(outcome.answer), *sorted(tokenizer.eos_token_ids)[:1]]:
            began = time.perf_counter()
            mx.eval(mask.mask(logits))
            mask.accept(token)
            per_token.append(time.perf_counter() - began)
    return {
        "tokenizer_index_build_s": round(index_s, 3),
        "tokens": len(per_token),
        "mask_ms_per_token_median": round(statistics.median(per_token) * 1e3, 3),
        "mask_ms_per_token_mean": round(statistics.fmean(per_token) * 1e3, 3),
        "mask_ms_per_token_max": round(max(per_token) * 1e3, 3),
    }


def two_stages(status: pb.MeshStatus) -> bool:
    view = status.agreement
    if not (view.active_plan_id and view.plan_json) or len(view.members) != 2:
        return False
    return len(json.loads(view.plan_json)["stages"]) == 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--speed-runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    store = Path(tempfile.mkdtemp(prefix="bench-structured-store-"))
    root = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    model_dir = ModelStore(store).ensure_default().path
    token = security.encode_join_token(security.create_mesh_secret("bench-structured"))
    daemons = [
        DaemonProcess(root / f"n{i}", loopback_args(token, f"s{i}", model_dir)).start()
        for i in range(2)
    ]
    try:
        for daemon in daemons:
            daemon.wait_for(two_stages, 180, "a committed plan of two stages")
        url = daemons[0].status().http_url
        # Warm both paths (the first constrained request builds llguidance's token index).
        streamed_decode(url, "Hello!", None, 8)
        streamed_decode(url, "Hello!", Person.model_json_schema(), 8)
        load_before = os.getloadavg()[0]
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": f"{os.cpu_count()} cores, {os.uname().machine}",
            "load_average_1min": round(load_before, 2),
        }
        result["validity"], outcomes = validity(
            url, args.requests, args.concurrency, args.max_tokens
        )
        result["speed"] = speed(url, args.speed_runs, args.max_tokens)
        result["load_average_1min_after"] = round(os.getloadavg()[0], 2)
        result["mask_cost_in_process"] = mask_cost(model_dir, outcomes)
        print(json.dumps(result, indent=2))
        valid = result["validity"]
        return 0 if valid["valid"] == valid["requests"] else 1
    finally:
        for daemon in daemons:
            daemon.terminate()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
