"""Tool calls in generated text: split them out of a stream and parse them.

Models that support tools write a call between two markers (for example `<tool_call>` and
`</tool_call>` around a JSON object); mlx-lm's tokenizer wrapper knows a model's markers and
parser from its chat template. `ToolCallSplitter` separates plain text from calls as text
arrives, holding back only what could still be the start of a marker.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from meshd.http.backend import ToolFormat

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
