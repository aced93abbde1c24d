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
from collections.abc import Mapping, Sequence
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


def parse_call(
    fmt: ToolFormat, raw: str, tools: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any] | None:
    """An OpenAI tool call for the model's call text, or None when it does not parse."""
    try:
        parsed = fmt.parse(raw, list(tools or []))
        name = parsed["name"]
        arguments = parsed.get("arguments", {})
    except Exception as exc:
        log.info("a tool call did not parse (%s: %s); it is returned as text", type(exc), exc)
        return None
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": str(name), "arguments": arguments},
    }


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
