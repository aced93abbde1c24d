"""Tool calls in generated text are split out of the stream and parsed with mlx-lm's parser
of the model's format, wherever the markers fall between pieces, into OpenAI's shape and
Ollama's."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import json_tools

from meshd.http.backend import BackendError, ToolFormat
from meshd.http.ollama_api import _chat_message, _ToolCalls
from meshd.http.openai_api import _split_calls
from meshd.http.tools import ToolCallSplitter, function_tools, template_call

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


def test_ollama_calls_are_objects_in_their_own_lines_at_any_piece_boundary() -> None:
    """Ollama's shape: `{"function": {"name", "arguments": {...}}}`, the arguments an object,
    streamed as a line of their own between the text lines, and the same whole."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    call = {"function": {"name": "weather", "arguments": {"city": "Paris"}}}
    for size in (1, 2, 5, len(ANSWER)):
        calls = _ToolCalls(FORMAT, tools)
        lines = []
        for start in range(0, len(ANSWER), size):
            lines += calls.feed(ANSWER[start : start + size])
        lines += calls.finish()
        assert [tool_calls for _, tool_calls in lines if tool_calls] == [[call]], (size, lines)
        text = "".join(content for content, _ in lines)
        assert text == "Let me check.  Done <tool", (size, lines)
    assert _ToolCalls(FORMAT, tools).whole(ANSWER) == ("Let me check.  Done <tool", [call])
    assert _ToolCalls(FORMAT, tools).whole("<tool_call>[1, 2]</tool_call>") == ("[1, 2]", [])
    assert _ToolCalls(None, tools).whole("plain") == ("plain", [])


def test_earlier_calls_and_tool_results_reach_the_template_in_either_shape() -> None:
    """An assistant's earlier call as OpenAI sends it (arguments a JSON string) or as Ollama
    does (an object) reaches the chat template with an object; a tool's result keeps its
    tool's name."""
    rendered = {"type": "function", "function": {"name": "weather", "arguments": {"c": 1}}}
    openai_call = {"type": "function", "function": {"name": "weather", "arguments": '{"c": 1}'}}
    ollama_call = {"function": {"name": "weather", "arguments": {"c": 1}}}
    assert template_call(openai_call, 0) == template_call(ollama_call, 0) == rendered
    message = _chat_message({"role": "assistant", "content": "", "tool_calls": [ollama_call]}, 1)
    assert message == {"role": "assistant", "content": "", "tool_calls": [rendered]}
    result = _chat_message({"role": "tool", "content": "18 C", "tool_name": "weather"}, 2)
    assert result == {"role": "tool", "content": "18 C", "name": "weather"}
    with pytest.raises(BackendError, match="tools\\[1\\] must be"):
        function_tools([{"type": "function", "function": {"name": "a"}}, {"type": "function"}])
