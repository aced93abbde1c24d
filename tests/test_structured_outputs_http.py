"""Structured outputs through real daemons, with the official clients.

Two loopback daemons split the embedded SmolLM2-135M-Instruct (a stage each), so every
constrained request crosses the network and is masked on the node that holds the head, not
on the one the client talks to. Every answer validates against its schema (nested objects,
enums, arrays): openai's response_format (json_schema, json_object, ``parse`` with a
pydantic model) and forced tool calls, anthropic's forced tool use, ollama's ``format``, in
plain and streaming answers. Schemas the grammar engine cannot enforce, and tool choices that
cannot be served, are refused with a 400 in each API's own error shape. A test's requests go
together, so constrained rows also share batched steps, each masked by its own grammar.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import Any

import anthropic
import jsonschema
import ollama
import openai
import pydantic
import pytest

from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.models.store import ModelEntry
from meshd.wire import pb

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "country": {"type": "string", "enum": ["FR", "DE", "IT"]},
            },
            "required": ["city", "country"],
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
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer", "maximum": 7}, "maxItems": 2},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather by city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]


def at_once(*requests: Callable[[], Any]) -> list[Any]:
    """Results of ``requests`` sent together: their rows share the mesh's batched steps, each
    masked by its own grammar, and the suite waits for one answer instead of several."""
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(request) for request in requests]
        return [future.result() for future in futures]


ASK_PERSON = [{"role": "user", "content": "Describe Marie, a painter who lives in Paris."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Rome for the next days?"}]
MAX_TOKENS = 96  # every answer below ends well before


@pytest.fixture(scope="module")
def mesh(
    default_model_entry: ModelEntry, tmp_path_factory: pytest.TempPathFactory, profile_template
) -> list[DaemonProcess]:
    """Two loopback daemons, the model split over both (a stage each)."""
    token = security.encode_join_token(security.create_mesh_secret("structured"))
    root = tmp_path_factory.mktemp("structured-mesh")
    daemons = []
    for i in range(2):
        state = root / f"n{i}"
        state.mkdir()
        shutil.copyfile(profile_template, state / "profile.json")
        args = [*LOOPBACK, "--join", token, "--name", f"s{i}",
                "--model", str(default_model_entry.path), "--strategy", "memory"]  # fmt: skip
        daemons.append(DaemonProcess(state, args).start())
    try:
        for daemon in daemons:
            daemon.wait_for(split_over_two, 90, "a committed plan of two stages")
        yield daemons
    finally:
        for daemon in daemons:
            daemon.kill()


def split_over_two(status: pb.MeshStatus) -> bool:
    view = status.agreement
    if not (view.active_plan_id and view.plan_json) or len(view.members) != 2:
        return False
    return len(json.loads(view.plan_json)["stages"]) == 2


def url_of(daemon: DaemonProcess) -> str:
    url = daemon.status().http_url
    assert url.startswith("http://127.0.0.1:"), url
    return url


@pytest.fixture(scope="module")
def client(mesh: list[DaemonProcess]) -> openai.OpenAI:
    return openai.OpenAI(base_url=url_of(mesh[0]) + "/v1", api_key="unused", max_retries=0)


# --- OpenAI ----------------------------------------------------------------------------------


def test_openai_json_schema_answers_validate_and_end_with_the_value(
    client: openai.OpenAI,
) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ASK_PERSON,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
            max_tokens=MAX_TOKENS,
            temperature=0.8,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(streamed), PERSON)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens < MAX_TOKENS


class Unit(StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    country: str = pydantic.Field(max_length=12)


class Forecast(pydantic.BaseModel):
    place: Place
    unit: Unit
    days: list[int] = pydantic.Field(max_length=2)


def test_openai_parse_fills_a_pydantic_model_and_json_object_is_an_object(
    client: openai.OpenAI,
) -> None:
    parsed, reply = at_once(
        lambda: client.chat.completions.parse(
            model=MODEL, messages=ASK_WEATHER, response_format=Forecast, max_tokens=MAX_TOKENS
        ),
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Give the name and color of a banana as JSON."}],
            response_format={"type": "json_object"},
            max_tokens=MAX_TOKENS,
        ),
    )
    forecast = parsed.choices[0].message.parsed
    assert isinstance(forecast, Forecast) and isinstance(forecast.unit, Unit), parsed
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_openai_forced_tool_calls_have_valid_arguments(client: openai.OpenAI) -> None:
    """tool_choice "required" and a named function: a tool call every time (this model's
    template knows no tools: the prompt describes them, the grammar writes the call)."""
    named, chunks = at_once(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=OPENAI_TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=MAX_TOKENS,
        ),
        lambda: list(
            client.chat.completions.create(
                model=MODEL,
                messages=ASK_WEATHER,
                tools=OPENAI_TOOLS,
                tool_choice="required",
                max_tokens=MAX_TOKENS,
                temperature=0.7,
                seed=4,
                stream=True,
            )
        ),
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time"), chunks
    tool = next(t for t in OPENAI_TOOLS if t["function"]["name"] == calls[0].function.name)
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_openai_refuses_what_it_cannot_enforce(client: openai.OpenAI) -> None:
    def create(**extra: Any) -> Any:
        return client.chat.completions.create(model=MODEL, messages=ASK_PERSON, **extra)

    unsupported = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    spec = {"name": "x", "schema": unsupported}
    with pytest.raises(openai.BadRequestError, match=r"cannot be enforced.*not") as refused:
        create(response_format={"type": "json_schema", "json_schema": spec})
    assert refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="response_format type"):
        create(response_format={"type": "grammar"})
    with pytest.raises(openai.BadRequestError, match="not in 'tools'"):
        create(tools=OPENAI_TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(openai.BadRequestError, match="ask for one of them"):
        create(tools=OPENAI_TOOLS, tool_choice="required", response_format={"type": "json_object"})


# --- Anthropic -------------------------------------------------------------------------------

ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in OPENAI_TOOLS
]  # fmt: skip


def test_anthropic_forced_tool_use_plain_and_streaming(mesh: list[DaemonProcess]) -> None:
    client = anthropic.Anthropic(base_url=url_of(mesh[1]), api_key="x", max_retries=0)

    def streamed() -> Any:
        with client.messages.stream(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            messages=ASK_WEATHER,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "any"},
        ) as stream:
            return stream.get_final_message()

    message, final = at_once(
        lambda: client.messages.create(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            messages=ASK_WEATHER,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"},
        ),
        streamed,
    )
    assert message.stop_reason == "tool_use", message
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER)
    assert final.stop_reason == "tool_use", final
    (block,) = final.content
    schema = next(t["input_schema"] for t in ANTHROPIC_TOOLS if t["name"] == block.name)
    jsonschema.validate(block.input, schema)
    with pytest.raises(anthropic.BadRequestError, match="forced call") as refused:
        client.messages.create(
            model=MODEL, max_tokens=8, messages=ASK_WEATHER, tools=ANTHROPIC_TOOLS
        )
    assert refused.value.body["error"]["type"] == "invalid_request_error"


# --- Ollama ----------------------------------------------------------------------------------


def test_ollama_format_schema_and_json(mesh: list[DaemonProcess]) -> None:
    client = ollama.Client(host=url_of(mesh[1]))
    other = ollama.Client(host=url_of(mesh[1]))  # one per thread: ollama's does not say it is safe
    reply, streamed = at_once(
        lambda: client.chat(
            model=MODEL,
            messages=ASK_PERSON,
            format=PERSON,
            options={"num_predict": MAX_TOKENS, "temperature": 0},
        ),
        lambda: "".join(
            part.response
            for part in other.generate(
                model=MODEL,
                prompt="Answer in JSON: what is the capital of France?",
                format="json",
                options={"num_predict": MAX_TOKENS},
                stream=True,
            )
        ),
    )
    assert reply.done_reason == "stop", reply
    jsonschema.validate(json.loads(reply.message.content), PERSON)
    assert isinstance(json.loads(streamed), dict), streamed
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=MODEL, messages=ASK_PERSON, format={"type": "object", "if": {}})
    assert refused.value.status_code == 400 and "cannot be enforced" in refused.value.error
