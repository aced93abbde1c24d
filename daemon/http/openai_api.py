"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Requests are translated into the mesh's request path (see `meshd.http.backend`); answers
and errors take OpenAI's shapes, so the `openai` SDK and the tools built on it work
unchanged with `base_url="http://HOST:PORT/v1"`.

Structured outputs: `response_format` {"type": "json_object"} or {"type": "json_schema",
"json_schema": {"schema": ...}} holds the answer's content to JSON (valid against the
schema), and `tool_choice` "required" or {"type": "function", "function": {"name": ...}}
to a call of the tools (of that one): a grammar at the sampler, see meshd.inference.grammar.
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
    json_output,
    now_s,
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
    ToolCallSplitter,
    forced_call,
    function_tools,
    parse_call,
    split_calls,
    template_call,
    with_tool_instructions,
)
from meshd.inference.grammar import Constraint

ROLE_ALIASES = {"developer": "system"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
ERROR_CODES = {404: "model_not_found", 503: "service_unavailable", 429: "rate_limit_exceeded"}
# A path no route serves is OpenAI's "Unknown request URL", not a missing model.
ERROR_CODES_OF_KIND = {"no_route": "unknown_url"}


def error_body(status: int, message: str, kind: str = "") -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": None,
            "code": ERROR_CODES_OF_KIND.get(kind, ERROR_CODES.get(status)),
        }
    }


def error_response(status: int, kind: str, message: str) -> Response:
    return JSONResponse(error_body(status, message, kind), status_code=status)


def _sse(data: Mapping[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return ServerSentEvent(data=text, sep="\n").encode()


# --------------------------------------------------------------------- request parsing


def _options(body: Mapping[str, Any], constraint: Constraint | None) -> dict[str, Any]:
    """Sampling and stream settings shared by chat and text completions (``constraint``: the
    grammar of the response_format or of a forced tool call)."""
    n = field(body, "n", int, 1)
    if n != 1:
        raise BackendError("bad_request", f"n={n} is not supported: this mesh returns one choice")
    for name in ("presence_penalty", "frequency_penalty"):
        if field(body, name, float, 0.0) != 0.0:
            raise BackendError(
                "bad_request", f"{name} is not supported; use repetition_penalty (e.g. 1.1)"
            )
    if body.get("logprobs") not in (None, False, 0):
        raise BackendError("bad_request", "logprobs are not supported by this mesh")
    if field(body, "best_of", int, 1) != 1:
        raise BackendError("bad_request", "best_of is not supported")
    max_tokens = field(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = field(body, "max_tokens", int)
    stream_options = field(body, "stream_options", dict, {})
    return {
        "sampling": sampling(
            temperature=ranged(body, "temperature", float, 0.0, 2.0),
            top_p=ranged(body, "top_p", float, 0.0, 1.0),
            top_k=field(body, "top_k", int),
            min_p=field(body, "min_p", float),
            repetition_penalty=field(body, "repetition_penalty", float),
            seed=field(body, "seed", int),
            max_tokens=max_tokens,
            stop=stop_strings(body.get("stop"), "stop"),
            constraint=constraint,
            cache_prompt=field(body, "cache_prompt", bool, True),
        ),
        "stream": field(body, "stream", bool, False),
        "include_usage": bool(stream_options.get("include_usage")),
        "model": field(body, "model", str, ""),
    }


def response_format(body: Mapping[str, Any]) -> Constraint | None:
    """The grammar ``response_format`` asks for: None for "text" (or none given)."""
    fmt = field(body, "response_format", dict)
    kind = None if fmt is None else fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json_output(None, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BackendError(
                "bad_request",
                "response_format.json_schema must be an object with a 'schema' object",
            )
        return json_output(spec["schema"], "response_format.json_schema.schema")
    raise BackendError(
        "bad_request",
        f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
        "'json_schema'",
    )


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template takes them (text, tool calls, tool results)."""
    messages = field(body, "messages", list)
    if not messages:
        raise BackendError("bad_request", "'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BackendError("bad_request", f"messages[{i}] must be an object")
        role = message.get("role")
        role = ROLE_ALIASES.get(role, role)
        entry: dict[str, Any] = {
            "role": role,
            "content": text_of_content(message.get("content"), f"messages[{i}]"),
        }
        calls = message.get("tool_calls")
        if calls:
            entry["tool_calls"] = [template_call(call, i) for call in calls]
        if role == "tool" and message.get("tool_call_id"):
            entry["tool_call_id"] = str(message["tool_call_id"])
        if message.get("name"):
            entry["name"] = str(message["name"])
        out.append(entry)
    return out


def chat_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools the model may call, or None (no tools, or tool_choice "none")."""
    tools = field(body, "tools", list)
    choice = body.get("tool_choice", "auto")
    if choice == "required" and not tools:
        raise BackendError("bad_request", "tool_choice 'required' needs 'tools'")
    if not tools or choice == "none":
        return None
    return function_tools(tools)


def forced_tools(body: Mapping[str, Any], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools ``tool_choice`` forces a call among: all for "required", the named one for
    {"type": "function", "function": {"name": ...}}, none for "auto"."""
    choice = body.get("tool_choice", "auto")
    if choice in ("auto", None):
        return []
    if choice == "required":
        return tools
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise BackendError(
            "bad_request",
            "tool_choice must be 'auto', 'none', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
        )
    named = [tool for tool in tools if tool["function"]["name"] == name]
    if not named:
        raise BackendError("bad_request", f"tool_choice names {name!r}, which is not in 'tools'")
    return named[:1]


# --------------------------------------------------------------------- answers


def _usage(finished: Finished) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens``: prompt tokens the prefix cache served."""
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finished.usage.cached_tokens},
    }


def _fingerprint(events: list[Event]) -> str | None:
    started = next((e for e in events if isinstance(e, Routed)), None)
    return f"fp_{started.plan_id[:12]}" if started else None


class OpenAIApi:
    def __init__(self, backend: MeshBackend) -> None:
        self.backend = backend

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
        ]

    async def models(self, request: Request) -> Response:
        card = await self.backend.model_card()
        data = [self._model_entry(card)] if card else []
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        card = await self.backend.model_card()
        if card is None or request.path_params["model"] not in (card.name, card.name + ":latest"):
            raise BackendError("not_found", f"model {request.path_params['model']!r} is not served")
        return JSONResponse(self._model_entry(card))

    @staticmethod
    def _model_entry(card: Any) -> dict[str, Any]:
        created = int(card.modified_at) or now_s()
        return {"id": card.name, "object": "model", "created": created, "owned_by": "meshd"}

    # ------------------------------------------------------------ chat

    async def chat_completions(self, request: Request) -> Response:
        body = await read_json(request)
        messages = chat_messages(body)
        tools = chat_tools(body)
        forced = forced_tools(body, tools) if tools else []
        json_content = response_format(body)
        if forced and json_content is not None:
            raise BackendError(
                "bad_request",
                "tool_choice forces a tool call and response_format asks for JSON content: "
                "ask for one of them",
            )
        model = self.backend.check_model(field(body, "model", str, ""))
        fmt = self.backend.tool_format() if tools else None
        call = forced_call(fmt, forced, "tool_choice") if forced else None
        options = _options(body, call.constraint if call else json_content)
        if call is not None:
            fmt = call.fmt
            if not call.in_template:  # the prompt describes the tools, the template cannot
                messages, tools = with_tool_instructions(messages, call, forced), None
        events = self.backend.generate(
            sampling=options["sampling"], model=model, messages=messages, tools=tools
        )
        ident = "chatcmpl-" + secrets.token_hex(12)
        if not options["stream"]:
            seen, text, finished = await collect(events, request)
            content, calls = _split_calls(fmt, text, tools)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            reason = "tool_calls" if calls else FINISH.get(finished.finish_reason, "stop")
            return JSONResponse(
                {
                    "id": ident,
                    "object": "chat.completion",
                    "created": now_s(),
                    "model": model,
                    "system_fingerprint": _fingerprint(seen),
                    "choices": [
                        {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
                    ],
                    "usage": _usage(finished),
                }
            )
        head, rest = await prime(events, request)
        body_stream = self._chat_stream(
            ident, model, head, rest, options["include_usage"], fmt, tools
        )
        return stream_response(body_stream, "text/event-stream")

    async def _chat_stream(
        self,
        ident: str,
        model: str,
        head: list[Event],
        rest: AsyncIterator[Event],
        include_usage: bool,
        fmt: Any,
        tools: list[dict[str, Any]] | None,
    ) -> AsyncIterator[bytes]:
        created = now_s()
        fingerprint = _fingerprint(head)
        splitter = ToolCallSplitter(fmt)
        calls = 0

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            payload: dict[str, Any] = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": fingerprint,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
            if include_usage:
                payload["usage"] = None
            return _sse(payload)

        def deltas(parts: list[tuple[str, str]]) -> list[bytes]:
            nonlocal calls
            out = []
            for kind, text in parts:
                call = parse_call(fmt, text, tools) if kind == "call" else None
                if call is None:
                    out.append(chunk({"content": text}))
                else:
                    out.append(chunk({"tool_calls": [{"index": calls, **call}]}))
                    calls += 1
            return out

        yield chunk({"role": "assistant", "content": ""})
        try:
            async for event in replay(head, rest):
                if isinstance(event, Piece):
                    for data in deltas(splitter.feed(event.text)):
                        yield data
                elif isinstance(event, Finished):
                    for data in deltas(splitter.finish()):
                        yield data
                    reason = "tool_calls" if calls else FINISH.get(event.finish_reason, "stop")
                    yield chunk({}, reason)
                    if include_usage:
                        yield _sse(
                            {
                                "id": ident,
                                "object": "chat.completion.chunk",
                                "created": created,
                                "model": model,
                                "system_fingerprint": fingerprint,
                                "choices": [],
                                "usage": _usage(event),
                            }
                        )
        except BackendError as exc:
            yield _sse(error_body(STATUS_OF_KIND.get(exc.kind, 500), str(exc)))
            return
        yield _sse("[DONE]")

    # ------------------------------------------------------------ text completions

    async def completions(self, request: Request) -> Response:
        body = await read_json(request)
        options = _options(body, response_format(body))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BackendError("bad_request", "'prompt' must be a string (one prompt per request)")
        if body.get("echo") or body.get("suffix"):
            raise BackendError("bad_request", "echo and suffix are not supported by this mesh")
        model = self.backend.check_model(options["model"])
        events = self.backend.generate(
            sampling=options["sampling"], model=model, prompt=prompt, chat_template=False
        )
        ident = "cmpl-" + secrets.token_hex(12)
        created = now_s()

        def payload(text: str, finish: str | None) -> dict[str, Any]:
            return {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
            }

        if not options["stream"]:
            _, text, finished = await collect(events, request)
            answer = payload(text, FINISH.get(finished.finish_reason, "stop"))
            return JSONResponse({**answer, "usage": _usage(finished)})
        head, rest = await prime(events, request)
        include_usage = options["include_usage"]

        async def stream() -> AsyncIterator[bytes]:
            try:
                async for event in replay(head, rest):
                    if isinstance(event, Piece) and event.text:
                        yield _sse(payload(event.text, None))
                    elif isinstance(event, Finished):
                        yield _sse(payload("", FINISH.get(event.finish_reason, "stop")))
                        if include_usage:
                            yield _sse({**payload("", None), "choices": [], "usage": _usage(event)})
            except BackendError as exc:
                yield _sse(error_body(STATUS_OF_KIND.get(exc.kind, 500), str(exc)))
                return
            yield _sse("[DONE]")

        return stream_response(stream(), "text/event-stream")


def _split_calls(
    fmt: Any, text: str, tools: list[dict[str, Any]] | None
) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's text and its parsed tool calls (unparseable calls stay text)."""
    return split_calls(fmt, text, tools, parse_call)
