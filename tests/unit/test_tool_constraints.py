"""What a Chat's tool calls must be (scheduler_svc.tool_constraints), compiled against a
real vocabulary: REQUIRED's list of declared calls, a named function's arguments, schemas
closed and their references kept, and AUTO's lazy grammar when a tool is strict (free text,
the model's added tokens in it, a call held to its schema once opened)."""

from __future__ import annotations

import json

import llguidance
import pytest
from tokenizers import AddedToken, Tokenizer

from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc.chat_validation import validate_chat
from pagoda.scheduler_svc.constraint_validation import validate_constraint
from pagoda.scheduler_svc.grammars import GrammarCompiler
from pagoda.scheduler_svc.tokenizer import load_tokenizer
from pagoda.scheduler_svc.tool_constraints import closed, tool_constraint
from pagoda.scheduler_svc.tools import ToolFormat, valid_tools
from pagoda.scheduler_svc.validation import ValidationError
from tests.conftest import TINY_VOCAB_SIZE, add_tag_tokens, build_tiny_tokenizer
from tests.unit.test_tools import LIMITS, REQUIRED, TIME, WEATHER, chat, function


@pytest.fixture(scope="module")
def tokens(tiny_llg_tokenizer):
    """Text -> the tiny vocabulary's token ids."""
    return tiny_llg_tokenizer.tokenize_str


def constrained_matcher(tokenizer, compiler, request):
    valid = validate_chat(request, tokenizer, LIMITS)
    grammar = compiler.compile(validate_constraint(request, valid), TINY_VOCAB_SIZE, (2,))
    return grammar.matcher


def test_required_allows_a_list_of_declared_calls_and_nothing_else(tokenizer, compiler, tokens):
    request = chat(tools=[WEATHER, TIME], tool_choice=REQUIRED)
    matcher = constrained_matcher(tokenizer, compiler, request)
    ok = tokens('[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{}}]')
    assert matcher.validate_tokens(ok) == len(ok)
    for wrong in ('[{"name":"get_date"', "[]", '{"name"'):
        wrong_ids = tokens(wrong)
        assert matcher.validate_tokens(wrong_ids) < len(wrong_ids), wrong


def test_a_named_function_allows_its_arguments_alone(tokenizer, compiler, tokens):
    request = chat(tools=[WEATHER, TIME], tool_choice=function("get_weather"))
    matcher = constrained_matcher(tokenizer, compiler, request)
    ok = tokens('{"city":"Paris"}')
    assert matcher.validate_tokens(ok) == len(ok)
    wrong = tokens('{"city":5}')
    assert matcher.validate_tokens(wrong) < len(wrong)


def test_a_bad_schema_is_refused_naming_the_tools(tokenizer, compiler):
    bad = pb.Tool(
        name="f", parameters=json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}})
    )
    request = chat(tools=[bad], tool_choice=REQUIRED)
    with pytest.raises(ValueError, match="^tools is invalid"):
        constrained_matcher(tokenizer, compiler, request)


def test_constraints_close_objects_the_schema_leaves_open():
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "$defs": {"d": {"anyOf": [{"properties": {"x": {}}}, {"type": "string"}]}},
    }
    result = closed(schema)
    assert result["additionalProperties"] is False
    properties = result["properties"]
    assert properties["where"]["additionalProperties"] is False
    assert properties["tags"]["items"]["additionalProperties"] is False
    assert properties["open"]["additionalProperties"] is True
    assert result["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the tool's own schema is left as it was


def test_required_keeps_each_tools_own_references(tokenizer, compiler, tokens):
    """A pydantic-style schema ($defs and "#/$defs/..." references) sits under the calls'
    array: its references must still resolve (they did not: "Pointer does not exist")."""
    place = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/Place"}},
        "required": ["where"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
    tool = pb.Tool(name="go", parameters=json.dumps(place))
    matcher = constrained_matcher(
        tokenizer, compiler, chat(tools=[tool, TIME], tool_choice=REQUIRED)
    )
    ok = tokens('[{"name":"go","arguments":{"where":{"city":"Oslo"}}}]')
    assert matcher.validate_tokens(ok) == len(ok)
    wrong = tokens('[{"name":"go","arguments":{"where":{"town":"Oslo"}}}]')
    assert matcher.validate_tokens(wrong) < len(wrong)


STRICT_WEATHER = pb.Tool(
    name=WEATHER.name, description=WEATHER.description, parameters=WEATHER.parameters, strict=True
)
EOS = 2  # the tiny tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    """The tiny tokenizer with Qwen's tags as tokens of their own, and Mistral's special
    [TOOL_CALLS]: (its added tokens' ids by text, the grammar compiler on it, text -> its
    token ids)."""
    directory = build_tiny_tokenizer(tmp_path_factory.mktemp("tagged"))
    ids = add_tag_tokens(directory)
    path = directory / "tokenizer.json"
    with_mistral = Tokenizer.from_file(str(path))
    with_mistral.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    with_mistral.save(str(path))
    added = dict(load_tokenizer(directory).added_tokens)  # <unk>, <|im_start|>, ... the tags
    assert {added[tag] for tag in ids} == set(ids.values())
    text = (directory / "tokenizer.json").read_text()
    llg = llguidance.LLTokenizer(text, n_vocab=TINY_VOCAB_SIZE)
    return added, GrammarCompiler(lambda: text), llg.tokenize_str


def auto_calls(tagged, parallel: bool = True, format: ToolFormat = ToolFormat.HERMES):
    """The matcher of AUTO with a strict get_weather and a lax get_time, on `tagged`."""
    ids, compiler, _ = tagged
    tools = valid_tools(
        [("get_weather", "", WEATHER.parameters, True), ("get_time", "", "", False)],
        "auto", "", parallel, format, (), tuple(ids.items()),
    )  # fmt: skip
    assert tools is not None and tools.holds_auto_calls
    return compiler.compile(tool_constraint(tools), TINY_VOCAB_SIZE, (EOS,)).matcher


def allowed(matcher, ids: list[int]) -> bool:
    return matcher.validate_tokens(ids) == len(ids)


@pytest.mark.parametrize("opening", ["the tag's token", "the tag spelled"])
def test_a_strict_tool_under_auto_holds_each_call_and_leaves_the_text_free(tagged, opening):
    """Free text (EOS wherever it may end) until "<tool_call>", as the model's token or
    spelled; then only a call of a declared tool, the strict one's arguments fitting its
    closed schema, another's any object, written as the tagged templates write calls,
    closed by the tag either way; free text again after it, and another call."""
    ids, _, tokens = tagged
    matcher = auto_calls(tagged)
    text = tokens("Let me look that up: {not a call} [1, 2]")
    assert allowed(matcher, text)
    assert matcher.consume_tokens(text)
    assert allowed(matcher, [EOS])
    if opening == "the tag's token":
        tag = [ids["<tool_call>"]]
    else:  # one byte token a character: no single token of it
        tag = [token for character in "<tool_call>" for token in tokens(character)]
    assert matcher.consume_tokens([*tokens(" "), *tag, *tokens("\n")])
    assert not allowed(matcher, [EOS])  # an open call does not end
    wrong = {
        "an undeclared tool": '{"name": "get_date", "arguments": {}}',
        "arguments outside the schema": '{"name": "get_weather", "arguments": {"city": 5}}',
        "a parameter the schema does not declare": (
            '{"name": "get_weather", "arguments": {"town": "Oslo"}}'
        ),
        "no arguments": '{"name": "get_weather"}',
        "text": "I would call get_weather",
    }
    for what, call in wrong.items():
        assert not allowed(matcher, tokens(call)), what
    assert not allowed(matcher, [ids["<think>"]])  # no added token inside a call
    assert allowed(matcher, tokens('{"name": "get_time", "arguments": {"any": [1, {}]}}'))
    call = tokens('{"name": "get_weather", "arguments": {"city": "Paris"}}\n')
    assert matcher.consume_tokens(call)
    assert allowed(matcher, tokens("</tool_call>")) and allowed(matcher, [ids["</tool_call>"]])
    assert matcher.consume_tokens([ids["</tool_call>"]])
    assert allowed(matcher, [EOS])
    assert matcher.consume_tokens(tokens("\nDone."))
    assert matcher.consume_tokens([ids["<tool_call>"]])  # another call
    assert not allowed(matcher, tokens('{"name": "nope"'))


def test_the_text_holds_the_models_added_tokens_as_without_a_grammar(tagged):
    """Qwen's <think> ... </think>, a stray closing tag, the turn's markers: the text
    allows every added token but the opening tag's, which opens a call."""
    ids, _, tokens = tagged
    matcher = auto_calls(tagged, parallel=False)
    thought = [ids["<think>"], *tokens("Paris, so the weather tool."), ids["</think>"]]
    assert matcher.consume_tokens(thought)
    for token_id in (ids["</tool_call>"], ids["<|im_start|>"], ids["<think>"]):
        assert allowed(matcher, [token_id])
    assert matcher.consume_tokens([ids["<tool_call>"]])
    assert not allowed(matcher, [EOS]) and not allowed(matcher, tokens("Paris"))


def test_in_the_json_format_an_answer_is_text_or_calls_as_a_whole(tagged):
    """Llama 3 and Mistral write calls as the whole answer: text that does not begin with
    "{" or "[" stays free (added tokens and brackets after those), an answer that begins
    so is a call or a list of calls (Llama's "parameters" or "arguments"), after any added
    token (Mistral's [TOOL_CALLS]), and nothing follows the calls but blanks and EOS."""
    ids, _, tokens = tagged
    text = auto_calls(tagged, format=ToolFormat.JSON)
    answer = tokens("  It is sunny in Paris {as always} [1].")
    assert allowed(text, answer) and text.consume_tokens(answer) and allowed(text, [EOS])
    assert text.consume_tokens([ids["<think>"], *tokens('{"no": "call"'), EOS])
    for opened in ("{", " ["):  # a call begun does not end
        assert not allowed(auto_calls(tagged, format=ToolFormat.JSON), [*tokens(opened), EOS])
    for wrong in ('{"name": "get_date"', '[{"name": "get_weather", "arguments": 5'):
        assert not allowed(auto_calls(tagged, format=ToolFormat.JSON), tokens(wrong))
    calls = {
        "Llama's": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "a list": '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
    }
    for what, call in calls.items():
        matcher = auto_calls(tagged, format=ToolFormat.JSON)
        assert matcher.consume_tokens(tokens(call)), what
        assert allowed(matcher, [EOS]) and not allowed(matcher, tokens(" Done")), what
    mistral = auto_calls(tagged, format=ToolFormat.JSON, parallel=False)
    assert mistral.consume_tokens([ids["[TOOL_CALLS]"]])
    assert not allowed(mistral, tokens('[{"foo"'))  # the token leads calls, not free text
    one = tokens('[{"name": "get_time", "arguments": {"any": 1}}')
    assert mistral.consume_tokens(one) and not allowed(mistral, tokens(", {"))


@pytest.mark.parametrize("case", ["no strict tool", "tool_choice NONE"])
def test_auto_calls_are_read_not_held_without_a_strict_tool(tokenizer, case):
    tools = [STRICT_WEATHER, TIME]
    fields = {}
    if case == "no strict tool":
        tools = [WEATHER, TIME]
    else:
        fields["tool_choice"] = pb.ToolChoice(mode=pb.TOOL_CHOICE_NONE)
    request = chat(tools=tools, **fields)
    valid = validate_chat(request, tokenizer, LIMITS)
    assert not valid.tools.holds_auto_calls
    assert validate_constraint(request, valid) is None


def test_strict_auto_calls_take_min_new_tokens_but_not_ignore_eos(tokenizer):
    def constraint(**stopping):
        request = chat(tools=[STRICT_WEATHER], stopping=pb.StoppingCriteria(**stopping))
        return validate_constraint(request, validate_chat(request, tokenizer, LIMITS))

    assert constraint(min_new_tokens=4).kind == "lark_grammar"
    with pytest.raises(ValidationError, match="AUTO with a strict tool.*ignore_eos"):
        constraint(ignore_eos=True)
