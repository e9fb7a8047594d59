"""An OpenAI request body -> the gRPC calls that serve it, one per choice.

Pure: no I/O. The `n` choices of each prompt are one Generate (or Chat) call with the gRPC
`n`, so the scheduler computes the prompt once and its samples share its KV blocks; choice
`call.choice_index + chunk.index`; sample i draws with seed + i when a seed is given (the
scheduler's rule). Several prompts in one /v1/completions body are one call each. Every
value is passed on as given and the scheduler validates it (its INVALID_ARGUMENT sentence
becomes the 400); only what the gRPC API cannot express is refused here. Tools are the
gRPC Chat's own fields: function tools, tool_choice, parallel_tool_calls, assistant
messages' calls and tool messages go as they are; the scheduler renders them, reads the
calls from the output and validates everything; a streamed request asks for the calls in
pieces as they are written (stream_tool_calls). So is chat_template_kwargs (vLLM's name),
the template's extra variables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.client.convert import GenerationOptions
from pagoda.openai_front.chat_fields import (
    format_constraint,
    function_tool,
    joined_text,
    not_a_function,
    tool_options,
)
from pagoda.openai_front.errors import FrontError, deprecated, invalid, unsupported
from pagoda.openai_front.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

# OpenAI's default temperature; the gRPC API's own default (0) is greedy.
OPENAI_DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True, slots=True)
class Call:
    """One gRPC request: Chat when `messages` is set, else Generate of `prompt`."""

    choice_index: int  # of its sample 0; sample i (Chunk.index) is choice_index + i
    prompt_index: int
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None  # as client.convert.Message
    options: GenerationOptions
    n: int = 1  # samples of the call (the gRPC n)
    # vLLM's return_token_ids: each choice and stream event lists its token ids.
    return_token_ids: bool = False

    @property
    def choice_indices(self) -> range:
        return range(self.choice_index, self.choice_index + self.n)


@dataclass(frozen=True, slots=True)
class Plan:
    calls: list[Call]
    # Top alternatives per token to report; None: no logprobs at all.
    num_top_logprobs: int | None
    include_usage: bool


def plan_completion(body: CompletionRequest, request_id: str, max_n: int) -> Plan:
    _refuse_common(body)
    if body.echo:
        raise unsupported("echo", "(returning the prompt with its logprobs)")
    if body.suffix:
        raise unsupported("suffix", "(insertion)")
    if body.best_of is not None and body.best_of != body.n:
        raise unsupported("best_of", "other than n")
    prompts = _prompts(body.prompt)
    _check_fan_out(len(prompts) * body.n, max_n)
    options = _options(body, max_tokens=body.max_tokens, num_logprobs=body.logprobs)
    calls = [
        Call(
            prompt_index * body.n,
            prompt_index,
            prompt,
            None,
            _samples(options, body.n, body.seed, f"{request_id}-{prompt_index}"),
            body.n,
            return_token_ids=bool(body.return_token_ids),
        )
        for prompt_index, prompt in enumerate(prompts)
    ]
    return Plan(calls, body.logprobs, _include_usage(body))


def plan_chat(body: ChatCompletionRequest, request_id: str, max_n: int) -> Plan:
    _refuse_common(body)
    if body.functions is not None:
        raise deprecated("functions", "tools")
    if body.function_call is not None:
        raise deprecated("function_call", "tool_choice")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    _check_fan_out(body.n, max_n)
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    options = _options(body, max_tokens=max_tokens, num_logprobs=num_top)
    options.update(_tool_options(body))  # type: ignore[typeddict-item]
    if body.chat_template_kwargs is not None:
        options["chat_template_kwargs"] = body.chat_template_kwargs
    messages = [_message(index, m) for index, m in enumerate(body.messages)]
    calls = [
        Call(
            0,
            0,
            None,
            messages,
            _samples(options, body.n, body.seed, f"{request_id}-0"),
            body.n,
            return_token_ids=bool(body.return_token_ids),
        )
    ]
    return Plan(calls, num_top, _include_usage(body))


def _refuse_common(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")


def _check_fan_out(num_calls: int, max_n: int) -> None:
    if num_calls > max_n:
        raise FrontError(
            400,
            f"n times the number of prompts is {num_calls}, above this server's limit of "
            f"{max_n} (--max-n)",
            param="n",
        )


def _include_usage(body: SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _options(
    body: SamplingFields, *, max_tokens: int | None, num_logprobs: int | None
) -> GenerationOptions:
    temperature = body.temperature
    options: dict[str, Any] = {
        "temperature": OPENAI_DEFAULT_TEMPERATURE if temperature is None else temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "max_new_tokens": max_tokens,
        "min_new_tokens": body.min_tokens,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "cache_salt": body.cache_salt,
        "logit_bias": _logit_bias(body.logit_bias),
        "allowed_token_ids": body.allowed_token_ids,
        "banned_token_ids": body.banned_token_ids,
        "constraint": _constraint(body.response_format),
        # The gRPC API reports logprobs only when asked for at least one alternative; the
        # response keeps the first num_logprobs of them (none for OpenAI's 0).
        "logprobs": None if num_logprobs is None else max(num_logprobs, 1),
    }
    return {name: value for name, value in options.items() if value is not None}  # type: ignore[return-value]


def _constraint(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    response_format = response_format or {}
    spec = response_format.get("json_schema")
    return format_constraint(
        response_format.get("type", "text"),
        spec.get("schema") if isinstance(spec, dict) else None,
        "response_format",
        "response_format.json_schema.schema",
    )


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} as ids; the scheduler checks the ids and the range."""
    if not logit_bias:
        return None
    token_ids = {}
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id < 2**32:
            raise invalid(
                f"logit_bias keys must be token ids (non-negative integers), got {key[:64]!r}",
                "logit_bias",
            )
        token_ids[token_id] = bias
    return token_ids


def _samples(options: GenerationOptions, n: int, seed: int | None, call_id: str) -> Any:
    """The options of the one call serving `n` choices of a prompt: its request id, the
    seed (the scheduler gives sample i seed + i) and the gRPC n."""
    call_options = dict(options, request_id=call_id)
    if seed is not None:
        call_options["seed"] = seed
    if n > 1:
        call_options["n"] = n
    return call_options


def _prompts(prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]) -> list:
    """One prompt (text or token ids) or a batch of them, as a list."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [p if isinstance(p, str) else list(p) for p in prompt]


def _tool_options(body: ChatCompletionRequest) -> dict[str, Any]:
    tools = body.tools
    if tools is not None:
        tools = [_tool(index, tool) for index, tool in enumerate(tools)]
    # The client's converter reads tool_choice's forms.
    return tool_options(tools, body.tool_choice, body.parallel_tool_calls, body.stream)


def _tool(index: int, tool: Any) -> dict[str, Any]:
    if tool.type != "function":
        raise not_a_function(f"tools[{index}].type", tool.type)
    function = tool.function
    if function is None:
        raise invalid(f"tools[{index}].function must be given", f"tools[{index}].function")
    return function_tool(
        function.name, function.description, function.parameters, bool(function.strict)
    )


def _message(index: int, message: Any) -> dict[str, Any]:
    content = message.content
    if content is None and message.tool_calls:
        content = ""  # an assistant turn of calls only
    if content is None:
        raise invalid(f"messages[{index}].content must be given", f"messages[{index}].content")
    if isinstance(content, list):
        content = joined_text(content, ("text",), f"messages[{index}].content")
    # OpenAI's newer name for the system instructions, as the Responses API reads it too.
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content}
    if message.tool_calls:
        out["tool_calls"] = [
            _tool_call(index, n, call) for n, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    thought = _thought(index, message)
    if thought:
        out["reasoning_content"] = thought
    return out


def _thought(index: int, message: Any) -> str | None:
    """An assistant message's thinking, under either name clients send it."""
    given = {message.reasoning_content, message.reasoning} - {None, ""}
    if len(given) > 1:
        raise invalid(
            f"messages[{index}] gives reasoning_content and reasoning that differ; give one",
            f"messages[{index}].reasoning",
        )
    return given.pop() if given else None


def _tool_call(index: int, number: int, call: Any) -> dict[str, Any]:
    if call.type != "function":
        raise not_a_function(f"messages[{index}].tool_calls[{number}].type", call.type)
    return {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
