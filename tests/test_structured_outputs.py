"""Structured outputs at the sampler: llguidance's masks on the embedded SmolLM2's tokenizer.

Checked with the real tokenizer and the real model on a stage engine (the compute side a
last stage runs): every answer held to a JSON schema (nested objects, enums, arrays) or to a
forced tool call is valid and ends right after the value; a resumed request's grammar
follows the tokens it generated before and goes on as the uninterrupted run did; in a
batched decode step each row is masked by its own request's grammar alone; a schema the
engine cannot enforce is refused when the constraint is built; the constraint survives the
data plane's wire form.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_config, load_tokenizer

from meshd.http.tools import JSON_TOOL_FORMAT, ToolCallSplitter
from meshd.inference.grammar import (
    Constraint,
    GrammarMask,
    check_constraint,
    grammar_tokenizer,
    json_constraint,
    tool_call_constraint,
)
from meshd.inference.sampling import SamplingParams, TokenSampler, sampling_from_message
from meshd.inference.sampling import sampling_to_message as to_message
from meshd.inference.stage.engine import StageEngine, StageKey, run_step, run_steps
from meshd.inference.stage_events import Sampled, SamplerSetup, Work
from meshd.models.store import ModelEntry

pytestmark = pytest.mark.unit

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
MAX_STEPS = 160  # random logits under these schemas end well before


@pytest.fixture(scope="module")
def model_dir(default_model_entry: ModelEntry) -> Path:
    return default_model_entry.path


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    """mlx-lm's wrapper, with the model's EOS ids, as a node loads it."""
    return load_tokenizer(model_dir, eos_token_ids=load_config(model_dir).get("eos_token_id"))


@pytest.fixture(scope="module")
def engine(model_dir: Path, tokenizer: Any) -> StageEngine:
    """The whole model as one stage (embedding to head), as a single node runs it."""
    engine = StageEngine(StageKey(model_dir, 0, 30, True, True), max_requests=4)
    engine.load()
    engine.tokenizer = tokenizer
    return engine


def random_run(mask: GrammarMask, vocab: int, seed: int, temperature: float = 1.0) -> list[int]:
    """Tokens drawn from random logits under ``mask`` until an EOS token (or MAX_STEPS)."""
    sampler = TokenSampler(SamplingParams(temperature=temperature, seed=seed), mask)
    tokens: list[int] = []
    for step in range(MAX_STEPS):
        logits = 3.0 * mx.random.normal((1, vocab), key=mx.random.key(seed * 1000 + step))
        tokens.append(sampler.sample(logits, tokens))
        if tokens[-1] in mask_stops(mask):
            return tokens
    raise AssertionError(f"no end after {MAX_STEPS} tokens: {tokens}")


def mask_stops(mask: GrammarMask) -> frozenset[int]:
    return mask._stop_set


def answer_of(tokenizer: Any, tokens: Sequence[int]) -> str:
    """The text of an answer without its EOS token."""
    return tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])


# --- The mask --------------------------------------------------------------------------------


def test_random_logits_under_a_schema_always_give_valid_json(tokenizer: Any) -> None:
    """Whatever the logits, the text is JSON valid against the nested schema with enums and
    arrays, and the request ends with an EOS right after the closing brace."""
    constraint = json_constraint(PERSON)
    check_constraint(constraint)
    vocab = tokenizer.vocab_size
    for seed in range(4):
        mask = GrammarMask(constraint, grammar_tokenizer(tokenizer), tokenizer.eos_token_ids)
        tokens = random_run(mask, vocab, seed)
        assert tokens[-1] in tokenizer.eos_token_ids
        text = answer_of(tokenizer, tokens)
        jsonschema.validate(json.loads(text), PERSON)
        assert text.endswith("}"), text


def test_objects_have_only_the_named_properties_unless_the_schema_opens_them(
    tokenizer: Any,
) -> None:
    """Pydantic's schemas say nothing of other properties (JSON Schema allows them): the
    answer gets only the named ones, and still validates against the schema as written."""
    address = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}}
    open_schema = {
        "$defs": {"Address": address},
        "type": "object",
        "properties": {"home": {"$ref": "#/$defs/Address"}, "n": {"type": "integer"}},
        "required": ["home"],
    }
    llt = grammar_tokenizer(tokenizer)
    for seed in range(3):
        mask = GrammarMask(json_constraint(open_schema), llt, {2})
        answer = json.loads(answer_of(tokenizer, random_run(mask, tokenizer.vocab_size, seed)))
        jsonschema.validate(answer, open_schema)
        assert set(answer) <= {"home", "n"} and set(answer["home"]) <= {"city"}, answer
    opened = {**open_schema, "additionalProperties": {"type": "integer"}}
    mask = GrammarMask(json_constraint(opened), llt, {2})
    for token in tokenizer.encode('{"home": {}, "extra": 1}'):
        mask.accept(token)  # allowed: the schema names what else it takes
    assert mask.complete


def test_any_json_object_and_the_end_allows_only_eos(tokenizer: Any) -> None:
    llt = grammar_tokenizer(tokenizer)
    assert grammar_tokenizer(tokenizer) is llt  # built once per loaded tokenizer
    mask = GrammarMask(json_constraint(None), llt, {2})
    first = np.flatnonzero(mask.allowed(tokenizer.vocab_size))
    assert first.size and all(tokenizer.decode([int(t)]).lstrip().startswith("{") for t in first)
    for token in tokenizer.encode('{"a": [1, 2], "b": {"c": null}}'):
        assert mask.allowed(tokenizer.vocab_size)[token], token
        mask.accept(token)
    assert mask.complete
    assert np.flatnonzero(mask.allowed(tokenizer.vocab_size)).tolist() == [2]
    # A head wider than the tokenizer's vocabulary: the extra tokens are never allowed.
    assert not mask.allowed(tokenizer.vocab_size + 64)[tokenizer.vocab_size :].any()


def test_a_forced_tool_call_is_one_call_of_the_tools_with_valid_arguments(tokenizer: Any) -> None:
    search = {
        "type": "object",
        "properties": {"query": {"type": "string", "maxLength": 10}},
        "additionalProperties": False,
    }
    tools = [("weather", WEATHER), ("search", search)]
    constraint = tool_call_constraint(tools, JSON_TOOL_FORMAT.start, JSON_TOOL_FORMAT.end)
    check_constraint(constraint)
    names = set()
    for seed in range(4):
        mask = GrammarMask(constraint, grammar_tokenizer(tokenizer), tokenizer.eos_token_ids)
        text = answer_of(tokenizer, random_run(mask, tokenizer.vocab_size, seed))
        splitter = ToolCallSplitter(JSON_TOOL_FORMAT)
        parts = [*splitter.feed(text), *splitter.finish()]
        assert [kind for kind, _ in parts] == ["call"], parts
        call = JSON_TOOL_FORMAT.parse(parts[0][1], None)
        names.add(call["name"])
        if call["name"] == "weather":
            jsonschema.validate(call["arguments"], WEATHER)
        else:
            jsonschema.validate(call["arguments"], search)
    assert names <= {"weather", "search"}


def test_a_resumed_mask_follows_the_generated_tokens_first(tokenizer: Any) -> None:
    constraint = json_constraint(PERSON)
    llt = grammar_tokenizer(tokenizer)
    whole = random_run(GrammarMask(constraint, llt, {2}), tokenizer.vocab_size, seed=11)
    cut = len(whole) // 2
    resumed = GrammarMask(constraint, llt, {2}, generated=whole[:cut])
    original = GrammarMask(constraint, llt, {2})
    for token in whole[:cut]:
        original.accept(token)
    for token in whole[cut:]:
        vocab = tokenizer.vocab_size
        assert (resumed.allowed(vocab) == original.allowed(vocab)).all()
        resumed.accept(token)
        original.accept(token)
    with pytest.raises(ValueError, match="do not follow"):
        GrammarMask(constraint, llt, {2}, generated=tokenizer.encode("plain text"))


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"not": {"type": "string"}}, "Unimplemented keys"),
        ({"type": "strng"}, "Invalid type"),
        ({"type": "string", "pattern": "(a"}, "regex"),
        ({"$ref": "https://example.com/schema"}, "example.com"),
    ],
)
def test_a_schema_the_engine_cannot_enforce_is_refused_when_checked(
    schema: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ValueError, match="cannot be enforced") as refused:
        check_constraint(json_constraint(schema))
    assert reason in str(refused.value)
    with pytest.raises(ValueError, match="must be an object"):
        json_constraint(["not", "a", "schema"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at most"):
        Constraint("json_schema", "x" * (300 * 1024))


def test_the_constraint_travels_on_the_data_plane_only() -> None:
    from meshd.wire import dataplane_pb2, pb

    params = SamplingParams(temperature=0.5, seed=3, constraint=json_constraint(WEATHER))
    assert sampling_from_message(to_message(params, dataplane_pb2.Sampling())) == params
    unconstrained = SamplingParams(seed=3)
    message = to_message(unconstrained, dataplane_pb2.Sampling())
    assert not message.HasField("constraint")
    assert sampling_from_message(message).constraint is None
    with pytest.raises(ValueError, match="cannot carry a constraint"):
        to_message(params, pb.Sampling())


# --- On a stage engine, with the model's own logits ----------------------------------------


class Request:
    """One request driven through a stage engine's steps, as a single stage runs them."""

    def __init__(
        self, engine: StageEngine, request_id: str, prompt: list[int], params: SamplingParams
    ) -> None:
        self.engine, self.request_id, self.params = engine, request_id, params
        self.context = list(prompt)
        self.tokens: list[int] = []
        self.eos = frozenset(engine.tokenizer.eos_token_ids)

    def prefill(self, generated: Sequence[int] = ()) -> Work:
        """Run the prompt (and, resumed, each generated token alone); the Work that samples."""
        prompt = self.context
        context = [*prompt, *generated]
        steps = [tuple(prompt[:-1]), *[(t,) for t in context[len(prompt) - 1 : -1]]]
        for index, tokens in enumerate(steps):
            if tokens:
                work = Work("p", self.request_id, index, tokens, None, False, None, 0.0)
                run_step(self.engine, work, 1)
        self.tokens = list(generated)
        setup = SamplerSetup(
            self.params, tuple(context), 0, False, generated=len(generated), eos_ids=self.eos
        )
        return Work("p", self.request_id, len(steps), (context[-1],), None, True, setup, 0.0)

    def next_work(self, step: int) -> Work:
        return Work("p", self.request_id, step, (self.tokens[-1],), None, True, None, 0.0)

    def took(self, result: Any) -> bool:
        """Record a step's token; whether the request goes on."""
        assert isinstance(result, Sampled), result
        self.tokens.append(result.token_id)
        return result.token_id not in self.eos and len(self.tokens) < self.params.max_tokens

    def text(self) -> str:
        return answer_of(self.engine.tokenizer, self.tokens)

    def run_alone(self, generated: Sequence[int] = ()) -> list[int]:
        work = self.prefill(generated)
        step = work.step
        while self.took(run_step(self.engine, work, 1)):
            step += 1
            work = self.next_work(step)
        self.engine.release(self.request_id)
        return self.tokens


def chat(tokenizer: Any, question: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
    )


def test_the_model_answers_valid_json_and_a_resumed_request_goes_on_as_before(
    engine: StageEngine, tokenizer: Any
) -> None:
    prompt = chat(tokenizer, "What is the weather in Paris? Answer in JSON.")
    for temperature in (0.0, 0.7):
        params = SamplingParams(
            temperature=temperature, seed=5, max_tokens=40, constraint=json_constraint(WEATHER)
        )
        whole = Request(engine, f"whole-{temperature}", prompt, params)
        tokens = whole.run_alone()
        assert tokens[-1] in tokenizer.eos_token_ids, whole.text()
        jsonschema.validate(json.loads(whole.text()), WEATHER)
        if temperature == 0.0:  # a replay on a new stage: the grammar follows, then goes on
            resumed = Request(engine, "resumed", prompt, params)
            assert resumed.run_alone(generated=tokens[:5]) == tokens


def test_each_row_of_a_batched_step_is_masked_by_its_own_grammar(
    engine: StageEngine, tokenizer: Any
) -> None:
    held = SamplingParams(max_tokens=60, constraint=json_constraint(WEATHER))
    free = SamplingParams(max_tokens=12)
    question = "What is the weather in Paris?"
    alone = Request(engine, "alone", chat(tokenizer, question), held).run_alone()
    requests = [
        Request(engine, "held", chat(tokenizer, question), held),
        Request(engine, "free", chat(tokenizer, question), free),
    ]
    works = [request.prefill() for request in requests]
    going = list(requests)
    while going:
        results = run_steps(engine, works, 1)
        assert len(results) == len(going)
        step = works[0].step + 1
        going = [request for request, r in zip(going, results, strict=True) if request.took(r)]
        works = [request.next_work(step) for request in going]
    for request in requests:
        engine.release(request.request_id)
    assert engine.batched_steps > 0
    held_request, free_request = requests
    jsonschema.validate(json.loads(held_request.text()), WEATHER)
    assert held_request.tokens == alone  # the same greedy tokens batched as alone
    assert not free_request.text().lstrip().startswith("{"), free_request.text()
