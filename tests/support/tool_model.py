"""A tool-calling variant of a ChatML model: its weights (linked, not copied) under a chat
template that renders tools and tool calls, as Qwen2.5's does.

Why: the embedded SmolLM2-135M speaks ChatML but its template has no tools, so the APIs
refuse tools for it; with this template mlx-lm recognises the `<tool_call>` JSON format (its
`json_tools` parser), and the HTTP APIs serve tools on a real model end to end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TOOL_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
{{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and " }}
{{- "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first)
      or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def make_tool_model(source: Path, out: Path) -> Path:
    """`out`: `source`'s files linked, its tokenizer_config.json with TOOL_CHAT_TEMPLATE;
    the store's entry file is left out, so the model is named after `out`."""
    out.mkdir(parents=True)
    for item in source.iterdir():
        if item.name in ("tokenizer_config.json", "meshd-model.json"):
            continue
        os.symlink(item.resolve(), out / item.name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
