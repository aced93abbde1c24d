"""What the HTTP APIs share: reading bodies, building sampling, errors, streaming."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from meshd.http.backend import BackendError, Event, Finished, Piece
from meshd.inference.grammar import Constraint, check_constraint, json_constraint
from meshd.inference.sampling import SamplingParams

STATUS_OF_KIND = {
    "bad_request": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "too_large": 413,
    "queue_full": 429,
    "internal": 500,
    "unavailable": 503,
}
MAX_BODY_BYTES = 8 * 1024 * 1024
# Deeper nesting than any API's schema needs (tool parameters included): refused with 400.
MAX_JSON_DEPTH = 64
NO_BUFFERING = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")


async def read_json(request: Request) -> dict[str, Any]:
    """The request's JSON object; bad_request (naming what is wrong) otherwise."""
    body = await read_body(request)
    try:
        data = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BackendError("bad_request", f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        data = None  # deeper than Python's parser goes: refused below, as any deep body
        depth = MAX_JSON_DEPTH + 1
    else:
        depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise BackendError(
            "bad_request",
            f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} deep",
        )
    if not isinstance(data, dict):
        raise BackendError("bad_request", "the request body must be a JSON object")
    return data


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request's body, refused (too_large: HTTP 413) as soon as it is known to exceed
    `limit` bytes: a declared Content-Length before anything is read, a chunked body at the
    chunk that passes the limit. So a client cannot make the daemon hold more than `limit`
    bytes of one body (what the server does not read stays in the kernel's buffers and is
    dropped with the connection)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BackendError("too_large", _too_large(f"declares {int(declared)} bytes", limit))
    body = bytearray()
    async with contextlib.aclosing(request.stream()) as chunks:
        async for chunk in chunks:
            body += chunk
            if len(body) > limit:
                raise BackendError("too_large", _too_large(f"passed {len(body)} bytes", limit))
    return bytes(body)


def _too_large(what: str, limit: int) -> str:
    return (
        f"the request body {what}, over this server's limit of {limit} bytes "
        f"({limit // 2**20} MiB); send a shorter prompt or history"
    )


def json_depth(value: Any) -> int:
    """How deep arrays and objects nest in ``value`` (a scalar is 0), without recursion: the
    handlers and the chat templates that walk a body recursively never meet a deeper one."""
    deepest = 0
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        pending.extend((child, depth + 1) for child in children)
    return deepest


def field(
    body: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None
) -> Any:
    """`body[name]` if present and of one of `kinds` (None counts as absent)."""
    value = body.get(name)
    if value is None:
        return default
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in allowed:
        raise BackendError("bad_request", f"{name!r} must be {_kind_names(allowed)}, not a boolean")
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, allowed):
        raise BackendError(
            "bad_request", f"{name!r} must be {_kind_names(allowed)}, got {json.dumps(value)[:80]}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise BackendError("bad_request", f"{name!r} must be a finite number")
    return value


def ranged(
    body: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], low: float, high: float
) -> Any:
    """`field(body, name, kinds)`, refused unless within the API's documented range
    [low, high] (each API documents its own, narrower than what the sampler takes)."""
    value = field(body, name, kinds)
    if value is not None and not low <= value <= high:
        raise BackendError(
            "bad_request", f"{name} must be between {low:g} and {high:g} here, got {value:g}"
        )
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
    names.update({list: "a list", dict: "an object"})
    return " or ".join(names.get(kind, kind.__name__) for kind in kinds)


def stop_strings(value: Any, name: str) -> list[str]:
    """A stop setting: one string or a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise BackendError("bad_request", f"{name!r} must be a string or a list of strings")


def sampling(
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    max_tokens: int | None = None,
    stop: Sequence[str] = (),
    constraint: Constraint | None = None,
    cache_prompt: bool = True,
) -> SamplingParams:
    """The request's sampling settings, checked (one implementation for every API); unset
    values take the daemon's defaults, and an unset max_tokens is lowered to what fits the
    plan's context. ``constraint``: structured output, see :func:`json_output`.
    ``cache_prompt`` False: the request neither starts from a prompt prefix the stages keep
    nor leaves one (llama.cpp's server names the setting so)."""
    values = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "seed": seed,
        "max_tokens": max_tokens,
    }
    given = {name: value for name, value in values.items() if value is not None}
    try:
        return SamplingParams(
            **given,
            stop=tuple(stop),
            constraint=constraint,
            max_tokens_given=max_tokens is not None,
            prefix_cache=cache_prompt,
        )
    except (TypeError, ValueError) as exc:
        raise BackendError("bad_request", str(exc)) from exc


def json_output(schema: Any, where: str) -> Constraint:
    """The constraint that holds an answer to JSON valid against ``schema`` (None: any JSON
    object), compiled once here: a schema the grammar engine cannot enforce is a 400 that
    names ``where`` it came from and why, never a request that ignores it."""
    if schema is not None and not isinstance(schema, dict):
        raise BackendError("bad_request", f"{where} must be a JSON schema object")
    return checked(lambda: json_constraint(schema), where)


def checked(build: Callable[[], Constraint], where: str) -> Constraint:
    """The constraint ``build`` makes, compiled once; bad_request naming ``where`` if not."""
    try:
        constraint = build()
        check_constraint(constraint)
    except ValueError as exc:
        raise BackendError("bad_request", f"{where}: {exc}") from exc
    return constraint


def text_of_content(content: Any, where: str) -> str:
    """Message content as text: a string, or a list of text parts (other parts refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BackendError(
                    "bad_request",
                    f"{where} has a content part of type {kind!r}; this mesh takes text only",
                )
        return "".join(texts)
    raise BackendError("bad_request", f"{where} content must be a string or a list of parts")


async def prime(
    events: AsyncIterator[Event], request: Request
) -> tuple[list[Event], AsyncIterator[Event]]:
    """Read events up to the first text or the end, so that a request refused or failing
    before its first token is answered with a proper HTTP status, not a broken stream. A
    client that leaves meanwhile (its request waits in a queue, say) ends it: ClientGone."""
    return await while_connected(request, _prime(events))


async def _prime(events: AsyncIterator[Event]) -> tuple[list[Event], AsyncIterator[Event]]:
    head: list[Event] = []
    try:
        while True:
            event = await events.__anext__()
            head.append(event)
            if isinstance(event, Piece | Finished):
                break
    except StopAsyncIteration:
        pass
    except BaseException:
        with contextlib.suppress(BaseException):
            await events.aclose()  # type: ignore[attr-defined]
        raise
    return head, events


async def replay(head: list[Event], rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """The primed events, then the rest of the stream (closing it when done or abandoned)."""
    async with contextlib.aclosing(rest):  # type: ignore[type-var]
        for event in head:
            yield event
        if head and isinstance(head[-1], Finished):
            return
        async for event in rest:
            yield event


async def collect(
    events: AsyncIterator[Event], request: Request
) -> tuple[list[Event], str, Finished]:
    """A whole request: its events, its text and its final event (for non-streaming calls);
    ClientGone if the client leaves first."""
    return await while_connected(request, _collect(events))


async def while_connected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, unless the client closes the connection first: then `work` is
    cancelled and ClientGone raised.

    Until an answer starts, nothing is sent to the client, so nothing else would notice it
    leave: the ASGI server's `http.disconnect` is awaited meanwhile. Cancelling a request's
    event iterator ends it on every stage, as a stream the client leaves already does."""
    done = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (gone, done):
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
    if gone.done() and not gone.cancelled():
        gone.exception()  # retrieved: a receive that failed leaves no client to answer either
    if done.cancelled():
        raise ClientGone("the client closed the connection before the answer was ready")
    return done.result()


async def _collect(events: AsyncIterator[Event]) -> tuple[list[Event], str, Finished]:
    seen: list[Event] = []
    finished = None
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for event in events:
            seen.append(event)
            if isinstance(event, Finished):
                finished = event
    if finished is None:
        raise BackendError("unavailable", "the request ended without a final event")
    text = "".join(e.text for e in seen if isinstance(e, Piece))
    return seen, text, finished


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the body is read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client left before its answer was ready: there is nobody to answer."""


class NoAnswer(Response):
    """What a request whose client left is answered with: nothing (the connection is gone)."""

    def __init__(self) -> None:
        super().__init__(status_code=499)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return


def stream_response(
    body: AsyncIterator[bytes], media_type: str, status_code: int = 200
) -> StreamingResponse:
    return StreamingResponse(
        body, status_code=status_code, media_type=media_type, headers=NO_BUFFERING
    )


def now_s() -> int:
    return int(time.time())


ErrorShape = Callable[[int, str, str], Response]


def json_error(status: int, kind: str, message: str) -> JSONResponse:
    """Plain JSON error for the dashboard's own endpoints."""
    return JSONResponse({"error": {"kind": kind, "message": message}}, status_code=status)
