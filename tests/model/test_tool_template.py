"""A template that takes tools renders them, and a conversation with calls and answers, as
transformers' apply_chat_template does (the scheduler renders without transformers)."""

from __future__ import annotations

import json
import shutil

import pytest

from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc.chat_validation import validate_chat
from pagoda.scheduler_svc.tokenizer import load_tokenizer
from pagoda.scheduler_svc.tools import ToolFormat
from pagoda.scheduler_svc.validation import Limits

# Hermes-style, as Qwen's: the tools in the system turn, calls in <tool_call> tags, answers
# in a user turn.
TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "A city, e.g. Zürich"}},
    "required": ["city"],
}


@pytest.fixture(scope="module")
def model_dir(tiny_tokenizer_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hermes")
    shutil.copytree(tiny_tokenizer_dir, directory, dirs_exist_ok=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_tools_and_calls_render_as_transformers_renders_them(model_dir):
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.tool_format is ToolFormat.HERMES
    request = pb.ChatRequest(
        messages=[
            pb.ChatMessage(role="system", content="Be brief."),
            pb.ChatMessage(role="user", content="Weather in Zürich?"),
            pb.ChatMessage(
                role="assistant",
                tool_calls=[
                    pb.ToolCall(id="c1", name="get_weather", arguments='{"city": "Zürich"}')
                ],
            ),
            pb.ChatMessage(role="tool", content="18 C", tool_call_id="c1"),
        ],
        tools=[
            pb.Tool(name="get_weather", description="The weather", parameters=json.dumps(WEATHER)),
            pb.Tool(name="get_time"),
        ],
    )
    limits = Limits(4096, tokenizer.vocab_size, 16, 4, 8, 5)
    ours = tokenizer.decode(
        list(validate_chat(request, tokenizer, limits).prompt_token_ids), skip_special_tokens=False
    )
    theirs = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Zürich?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
                    }
                ],
            },
            {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The weather",
                    "parameters": WEATHER,
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "get_time",
                    "description": "",
                    "parameters": {"type": "object"},
                },
            },
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ours == theirs
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in ours
