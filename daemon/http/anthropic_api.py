"""Anthropic-compatible endpoint: POST /v1/messages (streaming events and not).

The `anthropic` SDK works with `base_url="http://HOST:PORT"`. The streaming answer is the
event sequence of Anthropic's Messages API: message_start, content_block_start, ping,
content_block_delta..., content_block_stop, message_delta (stop reason, output tokens),
message_stop; an error after the stream began is an `error` event.

Tools are served where the client forces a call (`tool_choice` {"type": "any"} or {"type":
"tool", "name": ...}, what structured-output helpers send): the answer is held to one call
of the tools by a grammar (meshd.http.tools.forced_call) and comes back as a `tool_use`
block (stop_reason "tool_use"). A free choice of tools is served on /v1/chat/completions.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Mapping
from typing import Any

from sse_starlette.event import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshd.http.backend import BackendError, Event, Finished, MeshBackend, Piece, Routed
from meshd.http.common import (
    STATUS_OF_KIND,
    collect,
    field,
    prime,
    ranged,
    read_json,
    replay,
    sampling,
    stop_strings,
    stream_response,
    text_of_content,
)
from meshd.http.tools import (
    ForcedCall,
    ToolCallSplitter,
    forced_call,
    parse_call,
    with_tool_instructions,
)

STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens"}
TOOL_CHOICES = "{'type': 'any'} or {'type': 'tool', 'name': ...}"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }


def error_response(status: int, kind: str, message: str) -> Response:
    return JSONResponse(error_body(status, message), status_code=status)


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    return ServerSentEvent(data=json.dumps(data, ensure_ascii=False), event=name, sep="\n").encode()


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    """Anthropic's system + messages as chat-template messages (text content only)."""
    out: list[dict[str, str]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": text_of_content(system, "system")})
    messages = field(body, "messages", list)
    if not messages:
        raise BackendError("bad_request", "messages: at least one message is required")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise BackendError("bad_request", f"messages.{i}.role must be 'user' or 'assistant'")
        out.append(
            {
                "role": message["role"],
                "content": text_of_content(message.get("content"), f"messages.{i}"),
            }
        )
    return out


def _forced_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The tools (as OpenAI function tools) ``tool_choice`` forces a call among; [] when the
    request has no tools or tool_choice "none". A free choice is refused: see the module."""
    tools = field(body, "tools", list)
    choice = field(body, "tool_choice", dict, {"type": "auto"})
    if not tools or choice.get("type") == "none":
        return []
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise BackendError("bad_request", f"tools.{i}: a tool needs a 'name'")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise BackendError("bad_request", f"tools.{i}.input_schema: an object is required")
        functions.append(
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool.get("description") or "",
                    "parameters": schema,
                },
            }
        )
    if choice.get("type") == "any":
        return functions
    if choice.get("type") == "tool":
        named = [f for f in functions if f["function"]["name"] == choice.get("name")]
        if not named:
            raise BackendError(
                "bad_request", f"tool_choice.name {choice.get('name')!r} is not one of the tools"
            )
        return named[:1]
    raise BackendError(
        "bad_request",
        f"tools are served here with tool_choice {TOOL_CHOICES} (a forced call); for a free "
        "choice use /v1/chat/completions",
    )


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call (meshd.http.tools.parse_call) as Anthropic's tool_use block."""
    function = call["function"]
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": function["name"],
        "input": json.loads(function["arguments"]),
    }


def _blocks(text: str, forced: ForcedCall | None) -> tuple[list[dict[str, Any]], bool]:
    """The answer's content blocks, and whether it holds a tool call: a forced call is a
    tool_use block, unless it was cut short (max_tokens) and does not parse: it stays text."""
    if forced is None:
        return [{"type": "text", "text": text}], False
    splitter = ToolCallSplitter(forced.fmt)
    blocks: list[dict[str, Any]] = []
    for kind, part in [*splitter.feed(text), *splitter.finish()]:
        call = parse_call(forced.fmt, part, None) if kind == "call" else None
        if call is not None:
            blocks.append(_tool_use(call))
        elif part.strip():
            blocks.append({"type": "text", "text": part})
    called = any(block["type"] == "tool_use" for block in blocks)
    return blocks or [{"type": "text", "text": text}], called


def _stop_sequence(reason: str, stops: list[str]) -> str | None:
    """Which stop sequence ended the answer, where that is known (one was given)."""
    return stops[0] if reason == "stop" and len(stops) == 1 else None


class AnthropicApi:
    def __init__(self, backend: MeshBackend) -> None:
        self.backend = backend

    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.messages, methods=["POST"])]

    async def messages(self, request: Request) -> Response:
        body = await read_json(request)
        max_tokens = field(body, "max_tokens", int)
        if max_tokens is None:
            raise BackendError("bad_request", "max_tokens: field required")
        stops = stop_strings(body.get("stop_sequences"), "stop_sequences")
        tools = _forced_tools(body)
        forced = forced_call(self.backend.tool_format(), tools, "tool_choice") if tools else None
        settings = sampling(
            temperature=ranged(body, "temperature", float, 0.0, 1.0),
            top_p=ranged(body, "top_p", float, 0.0, 1.0),
            top_k=field(body, "top_k", int),  # >= 0, as the sampler checks
            max_tokens=max_tokens,
            stop=stops,
            constraint=forced.constraint if forced else None,
            cache_prompt=field(body, "cache_prompt", bool, True),
        )
        messages = _messages(body)
        model = self.backend.check_model(field(body, "model", str, ""))
        template_tools = tools if forced is not None and forced.in_template else None
        if forced is not None and not forced.in_template:
            messages = with_tool_instructions(messages, forced, tools)
        events = self.backend.generate(
            sampling=settings, model=model, messages=messages, tools=template_tools
        )
        ident = "msg_" + secrets.token_hex(12)
        if forced is not None and field(body, "stream", bool, False):
            head, rest = await prime(events, request)
            return stream_response(
                self._tool_stream(ident, model, head, rest, forced), "text/event-stream"
            )
        if not field(body, "stream", bool, False):
            _, text, finished = await collect(events, request)
            content, called = _blocks(text, forced)
            reason = STOP_REASONS.get(finished.finish_reason, "end_turn")
            return JSONResponse(
                {
                    "id": ident,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": content,
                    "stop_reason": "tool_use" if called else reason,
                    "stop_sequence": _stop_sequence(finished.finish_reason, stops),
                    "usage": _usage(finished),
                }
            )
        head, rest = await prime(events, request)
        return stream_response(self._stream(ident, model, stops, head, rest), "text/event-stream")

    async def _tool_stream(
        self,
        ident: str,
        model: str,
        head: list[Event],
        rest: AsyncIterator[Event],
        forced: ForcedCall,
    ) -> AsyncIterator[bytes]:
        """A forced call's stream: its blocks once the call is whole (a tool_use block's input
        arrives as one input_json_delta), then the stop reason."""
        started = next((e for e in head if isinstance(e, Routed)), None)
        yield _event("message_start", _message_start(ident, model, started))
        yield _event("ping", {"type": "ping"})
        pieces: list[str] = []
        try:
            async for event in replay(head, rest):
                if isinstance(event, Piece):
                    pieces.append(event.text)
                elif isinstance(event, Finished):
                    blocks, called = _blocks("".join(pieces), forced)
                    for index, block in enumerate(blocks):
                        for name, data in _block_events(index, block):
                            yield _event(name, data)
                    reason = STOP_REASONS.get(event.finish_reason, "end_turn")
                    yield _event(
                        "message_delta",
                        {
                            "type": "message_delta",
                            "delta": {
                                "stop_reason": "tool_use" if called else reason,
                                "stop_sequence": None,
                            },
                            "usage": _usage(event),
                        },
                    )
                    yield _event("message_stop", {"type": "message_stop"})
        except BackendError as exc:
            yield _event("error", error_body(STATUS_OF_KIND.get(exc.kind, 500), str(exc)))

    async def _stream(
        self,
        ident: str,
        model: str,
        stops: list[str],
        head: list[Event],
        rest: AsyncIterator[Event],
    ) -> AsyncIterator[bytes]:
        started = next((e for e in head if isinstance(e, Routed)), None)
        yield _event("message_start", _message_start(ident, model, started))
        yield _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        )
        yield _event("ping", {"type": "ping"})
        try:
            async for event in replay(head, rest):
                if isinstance(event, Piece) and event.text:
                    yield _event(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": 0,
                            "delta": {"type": "text_delta", "text": event.text},
                        },
                    )
                elif isinstance(event, Finished):
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
                    yield _event(
                        "message_delta",
                        {
                            "type": "message_delta",
                            "delta": {
                                "stop_reason": STOP_REASONS.get(event.finish_reason, "end_turn"),
                                "stop_sequence": _stop_sequence(event.finish_reason, stops),
                            },
                            "usage": _usage(event),
                        },
                    )
                    yield _event("message_stop", {"type": "message_stop"})
        except BackendError as exc:
            yield _event("error", error_body(STATUS_OF_KIND.get(exc.kind, 500), str(exc)))


def _usage(finished: Finished) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` counts the prompt tokens computed, and
    ``cache_read_input_tokens`` those the prefix cache served (their sum is the prompt)."""
    cached = finished.usage.cached_tokens
    return {
        "input_tokens": finished.prompt_tokens - cached,
        "output_tokens": finished.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _message_start(ident: str, model: str, started: Routed | None) -> dict[str, Any]:
    return {
        "type": "message_start",
        "message": {
            "id": ident,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": started.prompt_tokens if started else 0, "output_tokens": 0},
        },
    }


def _block_events(index: int, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """One whole content block as its start, delta and stop events."""
    if block["type"] == "tool_use":
        opened = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    else:
        opened = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": block["text"]}
    return [
        ("content_block_start", {"type": "content_block_start", "index": index,
                                 "content_block": opened}),
        ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}),
        ("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]  # fmt: skip
