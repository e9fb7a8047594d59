"""Public chat requests -> ValidRequest: the messages, their roles, the tools and the
rendering through the model's chat template, each refused with one sentence.

The chat part of validation (validation.py holds the fields every request shares, and
finishes a chat request as it does a prompt); it works on pagoda.v1.ChatRequest by its
field names and never builds one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pagoda.scheduler_svc.core import ValidRequest
from pagoda.scheduler_svc.reasoning import thinking_of
from pagoda.scheduler_svc.tokenizer import TEMPLATE_VARIABLES, ChatTemplateError, TextTokenizer
from pagoda.scheduler_svc.tool_templates import template_messages
from pagoda.scheduler_svc.tools import (
    ToolFormat,
    ToolsError,
    ValidTools,
    check_no_special_text,
    valid_tools,
)
from pagoda.scheduler_svc.validation import (
    MAX_PROMPT_BYTES_PER_TOKEN,
    Limits,
    ValidationError,
    check_prompt_text,
    echoed,
    valid_request,
)

MAX_CHAT_MESSAGES = 256
MAX_TEMPLATE_KWARGS_BYTES = 4096


def validate_chat(request, tokenizer: TextTokenizer, limits: Limits) -> ValidRequest:
    """A pagoda.v1.ChatRequest -> ValidRequest, rendered with the model's chat template."""
    if not request.messages:
        raise ValidationError("messages must hold at least one message")
    if len(request.messages) > MAX_CHAT_MESSAGES:
        raise ValidationError(
            f"messages holds {len(request.messages)} messages; at most {MAX_CHAT_MESSAGES}"
        )
    num_chars = sum(num_message_chars(message) for message in request.messages)
    if num_chars > limits.max_context_tokens * MAX_PROMPT_BYTES_PER_TOKEN:
        raise ValidationError(
            f"messages hold {num_chars} characters, far beyond the context of "
            f"{limits.max_context_tokens} tokens"
        )
    for index, message in enumerate(request.messages):
        if message.role not in tokenizer.known_roles:
            roles = ", ".join(sorted(tokenizer.known_roles))
            raise ValidationError(
                f"messages[{index}].role {echoed(message.role)} is not one of: {roles}"
            )
    variables = _template_variables(request.chat_template_kwargs, tokenizer.special_texts)
    try:
        tools = _tools(request, tokenizer)
        conversation = template_messages(request.messages, tools, tokenizer)
    except ToolsError as exc:
        raise ValidationError(str(exc)) from None
    shown_tools = None
    if tools is not None and tokenizer.tool_format is not ToolFormat.GENERIC:
        shown_tools = tools.for_template()
    try:
        rendered = tokenizer.render_chat(conversation, shown_tools, variables)
    except Exception as exc:  # the template's own raise_exception() and jinja errors
        # The template's message may quote the conversation.
        raise ValidationError(
            f"the model's chat template refused the conversation: {echoed(str(exc))}"
        ) from None
    check_prompt_text(rendered, limits)
    # The template already wrote the special tokens (BOS, turn markers); the contents'
    # look-alikes are text.
    contents = [message["content"] for message in conversation]
    try:
        prompt_token_ids = tokenizer.encode_chat(rendered, contents)
    except ChatTemplateError as exc:
        sentence = str(exc)
    else:
        valid = valid_request(request, tuple(prompt_token_ids), limits, tools)
        if not tokenizer.thinks:
            return valid
        return dataclasses.replace(valid, thinking=thinking_of(rendered))
    raise ValidationError(sentence)


def _template_variables(text: str, special_texts: tuple[str, ...]) -> dict[str, Any]:
    """ChatRequest.chat_template_kwargs: a JSON object of the caller's template variables.
    None of its strings may hold a special token's text: a template that prints one would
    write a turn marker where only the template writes them."""
    if not text:
        return {}
    if len(text.encode()) > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValidationError(
            f"chat_template_kwargs must be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes"
        )
    try:
        variables = json.loads(text)
    except (ValueError, RecursionError):
        variables = None
    if not isinstance(variables, dict):
        raise ValidationError("chat_template_kwargs must be a JSON object's text")
    taken = sorted(TEMPLATE_VARIABLES.intersection(variables))
    if taken:
        raise ValidationError(
            f"chat_template_kwargs cannot set {taken[0]}: the server gives the template "
            f"{', '.join(sorted(TEMPLATE_VARIABLES))}"
        )
    pending: list[Any] = [variables]
    while pending:  # iterative: a 4096-byte object may nest past Python's recursion limit
        value = pending.pop()
        if isinstance(value, dict):
            pending += [*value, *value.values()]
        elif isinstance(value, list):
            pending += value
        elif isinstance(value, str):
            try:
                check_no_special_text("chat_template_kwargs", value, special_texts)
            except ToolsError as exc:
                raise ValidationError(str(exc)) from None
    return variables


# ToolChoiceMode's values (pagoda.v1), by number.
_TOOL_CHOICE_MODES = {0: "auto", 1: "none", 2: "required"}


def _tools(request, tokenizer: TextTokenizer) -> ValidTools | None:
    """A ChatRequest's tools, tool_choice, parallel_tool_calls and stream_tool_calls,
    checked."""
    which = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    function_name = ""
    if which == "function_name":
        mode, function_name = "function", request.tool_choice.function_name
    elif which == "mode":
        mode = _TOOL_CHOICE_MODES.get(request.tool_choice.mode)
        if mode is None:
            raise ValidationError(f"tool_choice.mode {request.tool_choice.mode} is unknown")
    else:
        mode = "auto"
    parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
    tools = valid_tools(
        [(tool.name, tool.description, tool.parameters, tool.strict) for tool in request.tools],
        mode,
        function_name,
        parallel,
        tokenizer.tool_format,
        tokenizer.special_texts,
        tokenizer.added_tokens,
    )
    if tools is None or not request.stream_tool_calls:
        return tools
    return dataclasses.replace(tools, streams=True)


def num_message_chars(message) -> int:
    """A chat message's characters, its calls', their answer's ids and its thinking
    included."""
    calls = sum(len(call.id) + len(call.name) + len(call.arguments) for call in message.tool_calls)
    own = len(message.content) + len(message.reasoning_content)
    return own + calls + len(message.tool_call_id) + len(message.name)
