"""Tool calls in generated text: split them out of a stream and parse them.

Models that support tools write a call between two markers (for example `<tool_call>` and
`</tool_call>` around a JSON object); mlx-lm's tokenizer wrapper knows a model's markers and
parser from its chat template. `ToolCallSplitter` separates plain text from calls as text
arrives, holding back only what could still be the start of a marker.

A client may force a call (OpenAI's tool_choice "required" or a named function, Anthropic's
{"type": "any"} or {"type": "tool"}): `forced_call` holds the answer to one call of the
allowed tools, in the JSON-between-markers syntax the splitter and `json_tools` read, with
arguments valid against the tool's parameters (a grammar, see meshd.inference.grammar).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from meshd.http.backend import BackendError, ToolFormat
from meshd.http.common import checked
from meshd.inference.grammar import Constraint, tool_call_constraint

log = logging.getLogger("meshd.http")

Part = tuple[Literal["text", "call"], str]


class ToolCallSplitter:
    """Feed generated text; get ("text", s) and ("call", raw call text) parts in order."""

    def __init__(self, fmt: ToolFormat | None) -> None:
        self._fmt = fmt
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[Part]:
        if self._fmt is None:
            return [("text", text)] if text else []
        self._buffer += text
        parts: list[Part] = []
        start, end = self._fmt.start, self._fmt.end
        while True:
            if self._in_call:
                at = self._buffer.find(end)
                if at < 0:
                    return parts
                parts.append(("call", self._buffer[:at]))
                self._buffer = self._buffer[at + len(end) :]
                self._in_call = False
                continue
            at = self._buffer.find(start)
            if at >= 0:
                if at:
                    parts.append(("text", self._buffer[:at]))
                self._buffer = self._buffer[at + len(start) :]
                self._in_call = True
                continue
            keep = _partial_marker(self._buffer, start)
            ready = self._buffer[: len(self._buffer) - keep]
            if ready:
                parts.append(("text", ready))
            self._buffer = self._buffer[len(ready) :]
            return parts

    def finish(self) -> list[Part]:
        """What is left at the end: an unfinished call is still a call (as mlx-lm treats it)."""
        rest, self._buffer = self._buffer, ""
        if not rest:
            return []
        return [("call" if self._in_call else "text", rest)]


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


Tools = Sequence[Mapping[str, Any]] | None
CallParser = Callable[[ToolFormat, str, Tools], "dict[str, Any] | None"]


def function_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The request's tools, each `{"type": "function", "function": {"name": ...}}` (the shape
    OpenAI and Ollama share and chat templates render); bad_request names the first other."""
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type") != "function"
            or not isinstance(function.get("name"), str)
        ):
            raise BackendError(
                "bad_request",
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
            )
    return tools


def template_call(call: Any, index: int) -> dict[str, Any]:
    """An assistant's earlier tool call (OpenAI's arguments as a JSON string, or Ollama's as
    an object), with arguments as an object: what chat templates expect."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BackendError("bad_request", f"messages[{index}] has a malformed tool call")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError as exc:
            raise BackendError(
                "bad_request", f"messages[{index}] tool call arguments are not JSON"
            ) from exc
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _parsed(fmt: ToolFormat, raw: str, tools: Tools) -> tuple[str, Any] | None:
    """The called function's name and arguments, by the model's parser; None if it fails."""
    try:
        parsed = fmt.parse(raw, list(tools or []))
        return str(parsed["name"]), parsed.get("arguments", {})
    except Exception as exc:
        log.info("a tool call did not parse (%s: %s); it is returned as text", type(exc), exc)
        return None


def parse_call(fmt: ToolFormat, raw: str, tools: Tools) -> dict[str, Any] | None:
    """An OpenAI tool call for the model's call text, or None when it does not parse."""
    parsed = _parsed(fmt, raw, tools)
    if parsed is None:
        return None
    name, arguments = parsed
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_ollama_call(fmt: ToolFormat, raw: str, tools: Tools) -> dict[str, Any] | None:
    """An Ollama tool call (`{"function": {"name", "arguments": {...}}}`, the arguments an
    object), or None when the call text does not parse into one."""
    parsed = _parsed(fmt, raw, tools)
    if parsed is None:
        return None
    name, arguments = parsed
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        log.info("a tool call's arguments are not an object; it is returned as text")
        return None
    return {"function": {"name": name, "arguments": arguments}}


def split_calls(
    fmt: ToolFormat | None, text: str, tools: Tools, parse: CallParser = parse_call
) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's text and its tool calls, each made by `parse` (the API's shape);
    calls that do not parse stay text. The text is None when there are calls and no text."""
    splitter = ToolCallSplitter(fmt)
    content, calls = [], []
    for kind, part in [*splitter.feed(text), *splitter.finish()]:
        call = parse(fmt, part, tools) if kind == "call" and fmt is not None else None
        if call is None:
            content.append(part)
        else:
            calls.append(call)
    joined = "".join(content)
    return (joined if joined or not calls else None), calls


def _parse_json_call(text: str, tools: Any = None) -> Any:
    """mlx-lm's ``json_tools`` parser (without importing mlx-lm here)."""
    return json.loads(text.strip())


# The syntax a forced call is written in: mlx-lm's `json_tools` (Qwen, Hermes and others
# write calls so); also for a model whose chat template knows no tools.
JSON_TOOL_FORMAT = ToolFormat("<tool_call>", "</tool_call>", _parse_json_call)


@dataclass(frozen=True)
class ForcedCall:
    """A request that must answer with one call of ``tools`` (OpenAI function tools)."""

    fmt: ToolFormat  # how the call is written and parsed
    constraint: Constraint  # the grammar that holds the answer to it
    # Whether the model's chat template renders the tools; when not, the prompt describes
    # them (``with_tool_instructions``) and the request goes without tools to the template.
    in_template: bool


def forced_call(
    model_format: ToolFormat | None, tools: Sequence[Mapping[str, Any]], where: str
) -> ForcedCall:
    """The forced call of one of ``tools`` for a model writing calls as ``model_format``
    (None: its template knows no tools). A model whose calls are not JSON between markers
    cannot be forced: bad_request, naming ``where`` the choice came from."""
    if model_format is not None and not _writes_json_calls(model_format):
        raise BackendError(
            "bad_request",
            f"{where}: this model writes tool calls as {model_format.start!r}... in a syntax "
            "a call cannot be forced in (only JSON between markers); use tool_choice 'auto'",
        )
    fmt = model_format or JSON_TOOL_FORMAT
    allowed = [(_function(tool)["name"], _function(tool).get("parameters")) for tool in tools]
    constraint = checked(lambda: tool_call_constraint(allowed, fmt.start, fmt.end), where)
    return ForcedCall(fmt, constraint, in_template=model_format is not None)


def with_tool_instructions(
    messages: Sequence[Mapping[str, Any]], call: ForcedCall, tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``messages`` with the tools described in the system message, for a model whose chat
    template does not render them: the grammar fixes the call's syntax, this tells the model
    what the call is for."""
    described = "\n".join(
        json.dumps(
            {
                "name": _function(tool)["name"],
                "description": _function(tool).get("description", ""),
                "parameters": _function(tool).get("parameters") or {"type": "object"},
            },
            ensure_ascii=False,
        )
        for tool in tools
    )
    note = (
        "Answer with a call of one of these tools, written as "
        f'{call.fmt.start}\n{{"name": NAME, "arguments": ARGUMENTS}}\n{call.fmt.end} where '
        f"ARGUMENTS follow the tool's parameters schema:\n{described}"
    )
    out = [dict(message) for message in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{note}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """An OpenAI tool's function (name, description, parameters)."""
    return tool["function"]


def _writes_json_calls(fmt: ToolFormat) -> bool:
    """Whether calls in ``fmt`` are a JSON object between markers (mlx-lm's json_tools)."""
    module = getattr(fmt.parse, "__module__", "") or ""
    return fmt.parse is _parse_json_call or module.endswith("tool_parsers.json_tools")
