"""Tool calls in generated text are split out of the stream and parsed with mlx-lm's parser
of the model's format, wherever the markers fall between pieces."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import json_tools

from meshd.http.backend import ToolFormat
from meshd.http.openai_api import _split_calls
from meshd.http.tools import ToolCallSplitter

pytestmark = pytest.mark.unit

FORMAT = ToolFormat(
    json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call
)
ANSWER = (
    'Let me check. <tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call> Done <tool"
)


def test_calls_are_split_out_at_any_piece_boundary() -> None:
    for size in (1, 2, 3, 7, len(ANSWER)):
        splitter = ToolCallSplitter(FORMAT)
        parts = []
        for start in range(0, len(ANSWER), size):
            parts += splitter.feed(ANSWER[start : start + size])
        parts += splitter.finish()
        text = "".join(p for kind, p in parts if kind == "text")
        calls = [p for kind, p in parts if kind == "call"]
        assert text == "Let me check.  Done <tool", (size, parts)
        assert len(calls) == 1 and json.loads(calls[0])["name"] == "weather"


def test_whole_answers_become_openai_tool_calls() -> None:
    content, calls = _split_calls(FORMAT, ANSWER, None)
    assert content == "Let me check.  Done <tool"
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    content, calls = _split_calls(FORMAT, "<tool_call>not json</tool_call>", None)
    assert calls == [] and content == "not json"  # an unparseable call stays text
    assert _split_calls(None, "plain <tool_call>", None) == ("plain <tool_call>", [])
