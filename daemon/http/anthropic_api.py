"""Anthropic-compatible endpoint: POST /v1/messages (streaming events and not).

The `anthropic` SDK works with `base_url="http://HOST:PORT"`. The streaming answer is the
event sequence of Anthropic's Messages API: message_start, content_block_start, ping,
content_block_delta..., content_block_stop, message_delta (stop reason, output tokens),
message_stop; an error after the stream began is an `error` event.
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

STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens"}
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
        if body.get("tools"):
            raise BackendError("bad_request", "tools are served on /v1/chat/completions only")
        stops = stop_strings(body.get("stop_sequences"), "stop_sequences")
        settings = sampling(
            temperature=ranged(body, "temperature", float, 0.0, 1.0),
            top_p=ranged(body, "top_p", float, 0.0, 1.0),
            top_k=field(body, "top_k", int),  # >= 0, as the sampler checks
            max_tokens=max_tokens,
            stop=stops,
            cache_prompt=field(body, "cache_prompt", bool, True),
        )
        messages = _messages(body)
        model = self.backend.check_model(field(body, "model", str, ""))
        events = self.backend.generate(sampling=settings, model=model, messages=messages)
        ident = "msg_" + secrets.token_hex(12)
        if not field(body, "stream", bool, False):
            _, text, finished = await collect(events, request)
            return JSONResponse(
                {
                    "id": ident,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [{"type": "text", "text": text}],
                    "stop_reason": STOP_REASONS.get(finished.finish_reason, "end_turn"),
                    "stop_sequence": _stop_sequence(finished.finish_reason, stops),
                    "usage": _usage(finished),
                }
            )
        head, rest = await prime(events, request)
        return stream_response(self._stream(ident, model, stops, head, rest), "text/event-stream")

    async def _stream(
        self,
        ident: str,
        model: str,
        stops: list[str],
        head: list[Event],
        rest: AsyncIterator[Event],
    ) -> AsyncIterator[bytes]:
        started = next((e for e in head if isinstance(e, Routed)), None)
        yield _event(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": ident,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {
                        "input_tokens": started.prompt_tokens if started else 0,
                        "output_tokens": 0,
                    },
                },
            },
        )
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
