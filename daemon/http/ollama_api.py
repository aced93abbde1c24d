"""Ollama-compatible endpoints: /api/chat, /api/generate, /api/tags, /api/show, /api/version,
/api/pull.

Ollama clients (the `ollama` package, Open WebUI, editor plugins) work unchanged with
`host="http://HOST:PORT"`. Streaming is Ollama's: one JSON object per line, the last with
`"done": true`, timings in nanoseconds and token counts. Model names may carry a tag
(`smollm2-135m-instruct:latest`). A chat may offer `tools` (where the model's chat template
has them, as /api/show's capabilities say): the template renders them as for OpenAI's API,
and the calls the model writes come back as `message.tool_calls`, each
`{"function": {"name", "arguments": {...}}}`, in their own line when streaming; `role: "tool"`
messages carry the results back. `format` ("json" or a JSON schema) holds the answer to JSON
by a grammar at the sampler (meshd.inference.grammar).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshd.http.backend import (
    BackendError,
    Event,
    Finished,
    MeshBackend,
    ModelCard,
    Piece,
    ToolFormat,
    canonical_model,
)
from meshd.http.common import (
    STATUS_OF_KIND,
    collect,
    field,
    json_output,
    prime,
    read_json,
    replay,
    sampling,
    stop_strings,
    stream_response,
    text_of_content,
)
from meshd.http.tools import (
    Part,
    ToolCallSplitter,
    function_tools,
    parse_ollama_call,
    split_calls,
    template_call,
)

# The Ollama API version whose request and answer shapes these endpoints follow.
OLLAMA_API_VERSION = "0.9.0"
# How long /api/pull follows a load: until the mesh serves the model, refuses it, or this.
PULL_WAIT_S = 300.0
DONE_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def error_response(status: int, kind: str, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status)


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _format(body: Mapping[str, Any]) -> Any:
    """The grammar ``format`` asks for: "json" any JSON object, an object a JSON schema."""
    fmt = body.get("format")
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return json_output(None, "format")
    if isinstance(fmt, dict):
        return json_output(fmt, "format")
    raise BackendError(
        "bad_request", f'format must be "json" or a JSON schema object, got {json.dumps(fmt)}'
    )


def _sampling(body: Mapping[str, Any]) -> Any:
    options = field(body, "options", dict, {})
    num_predict = field(options, "num_predict", int)
    return sampling(
        temperature=field(options, "temperature", float),
        top_p=field(options, "top_p", float),
        top_k=field(options, "top_k", int),
        min_p=field(options, "min_p", float),
        repetition_penalty=field(options, "repeat_penalty", float),
        seed=field(options, "seed", int),
        max_tokens=num_predict if num_predict is not None and num_predict > 0 else None,
        stop=stop_strings(options.get("stop"), "options.stop"),
        constraint=_format(body),
        cache_prompt=field(body, "cache_prompt", bool, True),
    )


def _final_fields(finished: Finished) -> dict[str, Any]:
    decode_s = max(0.0, finished.total_s - finished.ttft_s)
    return {
        "done": True,
        "done_reason": DONE_REASONS.get(finished.finish_reason, "stop"),
        "total_duration": _ns(finished.total_s),
        "load_duration": 0,
        "prompt_eval_count": finished.prompt_tokens,
        "prompt_eval_duration": _ns(finished.ttft_s),
        "eval_count": finished.completion_tokens,
        "eval_duration": _ns(decode_s),
    }


def _line(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, ensure_ascii=False).encode() + b"\n"


def _details(card: ModelCard) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": card.architecture,
        "families": [card.architecture],
        "parameter_size": f"{card.parameters / 1e6:.0f}M" if card.parameters else "",
        "quantization_level": card.dtype.upper(),
    }


def _download_line(item: Any) -> dict[str, Any]:
    """One file on its way to a node, as Ollama reports a layer being pulled (the digest
    names the node and the file: each node downloads only its stage's files)."""
    return {
        "status": "downloading",
        "digest": f"{item.node}:{item.repo}/{item.file}",
        "total": item.total_bytes,
        "completed": item.done_bytes,
    }


class OllamaApi:
    def __init__(self, backend: MeshBackend) -> None:
        self.backend = backend

    def routes(self) -> list[Route]:
        return [
            Route("/api/chat", self.chat, methods=["POST"]),
            Route("/api/generate", self.generate, methods=["POST"]),
            Route("/api/tags", self.tags, methods=["GET"]),
            Route("/api/show", self.show, methods=["POST"]),
            Route("/api/version", self.version, methods=["GET"]),
            Route("/api/pull", self.pull, methods=["POST"]),
        ]

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION})

    async def tags(self, request: Request) -> Response:
        card = await self.backend.model_card()
        models = []
        if card is not None:
            modified = datetime.fromtimestamp(card.modified_at or time.time(), UTC)
            models.append(
                {
                    "name": card.name + ":latest",
                    "model": card.name + ":latest",
                    "modified_at": modified.isoformat().replace("+00:00", "Z"),
                    "size": card.size_bytes,
                    "digest": hashlib.sha256(
                        json.dumps(dict(card.config), sort_keys=True).encode()
                    ).hexdigest(),
                    "details": _details(card),
                }
            )
        return JSONResponse({"models": models})

    async def show(self, request: Request) -> Response:
        body = await read_json(request)
        name = field(body, "model", str) or field(body, "name", str, "")
        self.backend.check_model(name)
        card = await self.backend.model_card()
        if card is None:
            raise BackendError("not_found", f"model {name!r} is not served")
        arch = card.architecture
        config = card.config
        info = {
            "general.architecture": arch,
            "general.parameter_count": card.parameters,
            f"{arch}.block_count": card.layers,
            f"{arch}.context_length": config.get("max_position_embeddings", 0),
            f"{arch}.embedding_length": config.get("hidden_size", 0),
            f"{arch}.attention.head_count": config.get("num_attention_heads", 0),
            f"{arch}.attention.head_count_kv": config.get("num_key_value_heads", 0),
            f"{arch}.vocab_size": config.get("vocab_size", 0),
        }
        capabilities = ["completion"] + (["tools"] if self.backend.tool_format() else [])
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": "",
                "template": card.chat_template,
                "details": _details(card),
                "model_info": info,
                "capabilities": capabilities,
                "modified_at": _now(),
            }
        )

    async def pull(self, request: Request) -> Response:
        """Ollama's "fetch this model" is the mesh's load: every node downloads its stage's
        files (Hub repositories) and loads them; progress comes from MeshStatus.downloads.
        A model the mesh already serves is not selected again (no re-plan)."""
        body = await read_json(request)
        name = field(body, "model", str) or field(body, "name", str, "")
        wanted = canonical_model(name)
        if wanted != self.backend.served_model():
            wanted = (await self.backend.select_model(wanted)).name
        progress = self.backend.follow_load(wanted, PULL_WAIT_S)
        if not field(body, "stream", bool, True):
            async with contextlib.aclosing(progress):
                async for _ in progress:
                    pass
            return JSONResponse({"status": "success"})

        async def stream() -> AsyncIterator[bytes]:
            yield _line({"status": "pulling manifest"})
            try:
                async with contextlib.aclosing(progress):
                    async for status in progress:
                        for item in status.downloads:
                            yield _line(_download_line(item))
            except BackendError as exc:
                yield _line({"error": str(exc)})
                return
            yield _line({"status": "success"})

        return stream_response(stream(), "application/x-ndjson")

    async def chat(self, request: Request) -> Response:
        body = await read_json(request)
        messages = field(body, "messages", list)
        if not messages:
            raise BackendError("bad_request", "messages: at least one message is required")
        converted = [_chat_message(message, i) for i, message in enumerate(messages)]
        tools = field(body, "tools", list)
        tools = function_tools(tools) if tools else None
        model = self.backend.check_model(field(body, "model", str, ""))
        calls = _ToolCalls(self.backend.tool_format(), tools) if tools else None
        events = self.backend.generate(
            sampling=_sampling(body), model=model, messages=converted, tools=tools
        )
        return await self._answer(request, body, model, events, chat=True, calls=calls)

    async def generate(self, request: Request) -> Response:
        body = await read_json(request)
        prompt = field(body, "prompt", str, "")
        model = self.backend.check_model(field(body, "model", str, ""))
        if not prompt.strip():  # Ollama clients load a model with an empty prompt
            return JSONResponse(
                {
                    "model": body.get("model") or model,
                    "created_at": _now(),
                    "response": "",
                    "done": True,
                    "done_reason": "load",
                }
            )
        if body.get("images"):
            raise BackendError("bad_request", "images are not supported by this mesh")
        raw = field(body, "raw", bool, False)
        system = field(body, "system", str)
        if raw:
            events = self.backend.generate(
                sampling=_sampling(body), model=model, prompt=prompt, chat_template=False
            )
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            events = self.backend.generate(sampling=_sampling(body), model=model, messages=messages)
        return await self._answer(request, body, model, events, chat=False)

    async def _answer(
        self,
        request: Request,
        body: Mapping[str, Any],
        model: str,
        events: AsyncIterator[Event],
        *,
        chat: bool,
        calls: _ToolCalls | None = None,
    ) -> Response:
        name = body.get("model") or model + ":latest"

        def piece(text: str, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if tool_calls:
                    message["tool_calls"] = tool_calls
                return {"model": name, "created_at": _now(), "message": message, "done": False}
            return {"model": name, "created_at": _now(), "response": text, "done": False}

        if not field(body, "stream", bool, True):
            _, text, finished = await collect(events, request)
            if calls is None:
                return JSONResponse({**piece(text), **_final_fields(finished)})
            content, tool_calls = calls.whole(text)
            return JSONResponse({**piece(content, tool_calls), **_final_fields(finished)})
        head, rest = await prime(events, request)

        def lines(text: str, last: bool = False) -> list[bytes]:
            if calls is None:
                return [_line(piece(text))] if text else []
            parts = calls.feed(text) + (calls.finish() if last else [])
            return [_line(piece(content, tool_calls)) for content, tool_calls in parts]

        async def stream() -> AsyncIterator[bytes]:
            try:
                async for event in replay(head, rest):
                    if isinstance(event, Piece) and event.text:
                        for line in lines(event.text):
                            yield line
                    elif isinstance(event, Finished):
                        for line in lines("", last=True):
                            yield line
                        yield _line({**piece(""), **_final_fields(event)})
            except BackendError as exc:
                yield _line({"error": str(exc), "status": STATUS_OF_KIND.get(exc.kind, 500)})

        return stream_response(stream(), "application/x-ndjson")


def _chat_message(message: Any, index: int) -> dict[str, Any]:
    """An Ollama chat message as the chat template takes it: text, an assistant's earlier
    tool calls (arguments as an object), a tool's result (`role: "tool"`, `tool_name`)."""
    if not isinstance(message, dict):
        raise BackendError("bad_request", f"messages[{index}] must be an object")
    if message.get("images"):
        raise BackendError("bad_request", "images are not supported by this mesh")
    role = message.get("role")
    entry: dict[str, Any] = {
        "role": role,
        "content": text_of_content(message.get("content"), f"messages[{index}]"),
    }
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise BackendError("bad_request", f"messages[{index}].tool_calls must be a list")
        entry["tool_calls"] = [template_call(call, index) for call in calls]
    tool_name = message.get("tool_name") or message.get("name")
    if role == "tool" and isinstance(tool_name, str) and tool_name:
        entry["name"] = tool_name
    return entry


class _ToolCalls:
    """The tool calls in one chat's answer, in Ollama's shape: split out of the text as it
    arrives (a streamed answer) or whole, by the model's own markers and parser."""

    def __init__(self, fmt: ToolFormat | None, tools: list[dict[str, Any]]) -> None:
        self._fmt = fmt
        self._tools = tools
        self._splitter = ToolCallSplitter(fmt)

    def whole(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content, calls = split_calls(self._fmt, text, self._tools, parse_ollama_call)
        return content or "", calls

    def feed(self, text: str) -> list[tuple[str, list[dict[str, Any]]]]:
        """What `text` completes: (content, no calls) and ("", [a call]) lines, in order."""
        return self._lines(self._splitter.feed(text))

    def finish(self) -> list[tuple[str, list[dict[str, Any]]]]:
        return self._lines(self._splitter.finish())

    def _lines(self, parts: list[Part]) -> list[tuple[str, list[dict[str, Any]]]]:
        out: list[tuple[str, list[dict[str, Any]]]] = []
        for kind, text in parts:
            call = None
            if kind == "call" and self._fmt is not None:
                call = parse_ollama_call(self._fmt, text, self._tools)
            out.append(("", [call]) if call is not None else (text, []))
        return out
