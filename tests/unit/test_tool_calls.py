"""Reading calls of tools in a streamed output (tool_calls.py), alone and in the output
processor: what streams, what is held, what the last output carries, and that the text of
an output that is not calls comes back whole."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.scheduler_svc.core import FinishReason, RequestOutput
from pagoda.scheduler_svc.output_processor import OutputProcessor
from pagoda.scheduler_svc.stop_strings import StopStringMatcher
from pagoda.scheduler_svc.tool_calls import ToolCallReader, read_tagged_calls
from pagoda.scheduler_svc.tools import ToolFormat, ValidTools, valid_tools
from tests.unit.conftest import make_request

WEATHER = '{"type": "object", "properties": {"city": {"type": "string"}}}'


def tools(choice: str = "auto", fmt: ToolFormat = ToolFormat.HERMES, **options) -> ValidTools:
    valid = valid_tools(
        [("get_weather", "The weather in a city", WEATHER, False), ("get_time", "", "", False)],
        choice,
        options.get("function_name", ""),
        options.get("parallel", True),
        fmt,
        (),
    )
    assert valid is not None
    return valid


def read(reader: ToolCallReader, pieces: list[str]) -> tuple[list[str], str, bool]:
    """Each piece's visible text, the text at the end, and whether a piece ended it."""
    shown, ended = [], False
    for piece in pieces:
        text, ended = reader.push(piece)
        shown.append(text)
        if ended:
            break
    return shown, reader.flush(), ended


def test_text_before_a_tagged_call_streams_and_the_call_comes_at_the_end():
    reader = ToolCallReader(tools())
    pieces = ["Let me ", "look.<", "tool_", 'call>\n{"name": "get_weather", ',
              '"arguments": {"city": "Paris"}}\n</tool_call>', "\n"]  # fmt: skip
    shown, last, ended = read(reader, pieces)
    assert shown == ["Let me", " look.", "", "", "", ""]  # a blank waits for what follows
    assert (last, ended) == ("", False)
    (call,) = reader.calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24


def test_a_lone_angle_bracket_is_text_once_the_next_piece_settles_it():
    reader = ToolCallReader(tools())
    shown, last, _ = read(reader, ["1 <", " 2", " <tool", "box>"])
    assert "".join(shown) + last == "1 < 2 <toolbox>"
    assert shown == ["1", " < 2", "", " <toolbox>"]
    assert reader.calls == ()


@pytest.mark.parametrize(
    "held",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": ',  # cut short (LENGTH)
        '<tool_call>{"name": "not_a_tool", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": "city"}</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
    ],
)
def test_held_text_that_is_not_calls_comes_back_whole(held):
    reader = ToolCallReader(tools())
    shown, last, _ = read(reader, ["Sure: ", *held])  # one character a piece
    assert "".join(shown) == "Sure:"
    assert last == " " + held
    assert reader.calls == ()


def test_several_calls_text_between_them_and_an_unclosed_last_one():
    text = (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "parameters": "{\\"city\\": \\"Oslo\\"}"}'
    )
    content, calls = read_tagged_calls(text, frozenset({"get_time", "get_weather"}))
    assert content == ""
    assert calls == [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]
    content, _ = read_tagged_calls(
        text.replace("\n", " and then "), frozenset({"get_time", "get_weather"})
    )
    assert content == " and then "


def test_without_parallel_calls_the_first_closed_call_ends_the_sample():
    reader = ToolCallReader(tools(parallel=False))
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    shown, last, ended = read(reader, [call[:20], call[20:], "<tool_call>never read"])
    assert ended and shown == ["", ""] and last == ""
    assert [c.name for c in reader.calls] == ["get_time"]


def test_stop_strings_do_not_cut_constrained_calls():
    processor = OutputProcessor(PieceDetokenizer)  # type: ignore[arg-type]
    request = make_request("r", [1, 2, 3], stop_strings=("name",))
    processor.open(dataclasses.replace(request, tools=tools("required")))
    for token_id in (6, 3, 7):  # [{"name": "get_time", "arguments": {}}]
        output = RequestOutput("r", "", [token_id], None)
        processor.process([output])
        assert output.text == "" and output.finish_reason is None
    final = RequestOutput("r", "", [2], None, finish_reason=FinishReason.STOP)
    processor.process([final])
    assert [call.name for call in final.tool_calls] == ["get_time"]


def test_stop_strings_apply_first_and_their_held_text_is_read_too():
    reader = ToolCallReader(tools(), StopStringMatcher(("END",)))
    shown, last, ended = read(reader, ["a <", "b E", "N", "D more"])
    assert (shown, last, ended) == (["a", " <b", "", ""], " ", True)
    reader = ToolCallReader(tools(), StopStringMatcher(("END",)))
    shown, last, ended = read(reader, ["x EN"])
    assert (shown, last, ended) == (["x"], " EN", False)


def test_json_format_holds_an_answer_that_begins_as_json_and_streams_one_that_does_not():
    reader = ToolCallReader(tools(fmt=ToolFormat.JSON))
    shown, last, _ = read(reader, ["  ", '{"name": "get_time", ', '"parameters": {}}'])
    assert shown == ["", "", ""] and last == ""
    assert [(c.name, c.arguments) for c in reader.calls] == [("get_time", "{}")]
    reader = ToolCallReader(tools(fmt=ToolFormat.JSON))
    shown, last, _ = read(reader, [" ", "\nHello {", "x}"])
    assert (shown, last, reader.calls) == (["", " \nHello {", "x}"], "", ())
    reader = ToolCallReader(tools(fmt=ToolFormat.JSON))
    shown, last, _ = read(
        reader,
        ['[{"name": "get_time", "arguments": {}}, ', '{"name": "get_weather", "arguments": {}}]'],
    )
    assert [c.name for c in reader.calls] == ["get_time", "get_weather"] and last == ""


def test_required_and_named_outputs_are_calls_from_the_start():
    reader = ToolCallReader(tools("required"))
    shown, last, _ = read(reader, ['[{"name":"get_weather",', '"arguments":{"city":"Rome"}}]'])
    assert shown == ["", ""] and last == ""
    assert [(c.name, c.arguments) for c in reader.calls] == [("get_weather", '{"city":"Rome"}')]
    reader = ToolCallReader(tools("function", function_name="get_weather"))
    shown, last, _ = read(reader, [' {"city":', '"Rome"}'])
    assert last == "" and [(c.name, c.arguments) for c in reader.calls] == [
        ("get_weather", '{"city":"Rome"}')  # as the model wrote them, as a stream gives them
    ]
    reader = ToolCallReader(tools("function", function_name="get_weather"))
    assert read(reader, ['{"city":'])[1] == '{"city":'  # cut short: text, whole
    assert reader.calls == ()


class PieceDetokenizer:
    """Token id i -> PIECES[i]."""

    whole_texts = ()

    def push(self, token_id: int) -> str:
        return PIECES[token_id]

    def flush(self) -> str:
        return ""


PIECES = [
    "Hi",
    " <",
    "tool_call>",
    '{"name": "get_time", "arguments": {}}',
    "</tool_call>",
    "x",
    "[",
    "]",
]


def test_blanks_before_calls_alone_are_no_text():
    reader = ToolCallReader(tools())
    shown, last, _ = read(reader, ["\n", "\n", "<tool_call>", CALL[len("<tool_call>") :], "\n"])
    assert "".join(shown) + last == "" and [c.name for c in reader.calls] == ["get_time"]


def test_the_output_processor_streams_around_a_call_and_ends_with_it():
    processor = OutputProcessor(PieceDetokenizer)  # type: ignore[arg-type]
    request = make_request("r", [1, 2, 3])
    processor.open(dataclasses.replace(request, tools=tools()))
    texts = []
    for token_id in (0, 1, 2, 3, 4):
        output = RequestOutput("r", "", [token_id], None)
        processor.process([output])
        texts.append(output.text)
    final = RequestOutput("r", "", [5], None, finish_reason=FinishReason.LENGTH)
    processor.process([final])
    assert texts == ["Hi", "", "", "", ""]  # the blank waited: it may precede a call
    assert final.text == " x"  # the text around the call
    assert [call.name for call in final.tool_calls] == ["get_time"]
    assert len(processor) == 0


CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
TEXTS = st.lists(
    st.sampled_from(["Hi", " ", "<", "tool_call>", "</tool_call>", CALL, "{", "}", "\n", "x<t"]),
    max_size=12,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_what_a_reader_returns_does_not_depend_on_how_the_text_was_split(text, cuts):
    """However tokens split the text, the same text shows and the same calls are read; and
    without calls, every character comes back in order."""
    bounds = sorted({0, len(text), *(cut for cut in cuts if cut < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    results = []
    for split in (pieces, [text]):
        reader = ToolCallReader(tools())
        shown = "".join(reader.push(piece)[0] for piece in split) + reader.flush()
        results.append((shown, [(c.name, c.arguments) for c in reader.calls]))
    assert results[0] == results[1]
    shown, calls = results[0]
    if not calls:
        assert shown == text


def test_output_nested_past_jsons_limit_is_text_not_a_crash_of_the_step_loop():
    """json.loads raises RecursionError (not ValueError) past about 1,000 levels: a model
    writing "[[[[..." in a call must not raise out of the text stage."""
    for reader in (ToolCallReader(tools()), ToolCallReader(tools("required"))):
        nested = "<tool_call>" * (reader.tools.choice.value == "auto") + "[" * 5000
        shown, last, _ = read(reader, [nested])
        assert "".join(shown) + last == nested and reader.calls == ()


def test_without_parallel_calls_a_close_tag_split_across_tokens_ends_the_sample():
    reader = ToolCallReader(tools(parallel=False))
    pieces = ['<tool_call>{"name": "get_time", "arguments": {}}</tool', "_ca", "ll>", "more"]
    shown, last, ended = read(reader, pieces)
    assert ended and len(shown) == 3 and [c.name for c in reader.calls] == ["get_time"]


def test_a_close_tag_inside_constrained_or_json_arguments_does_not_end_the_sample():
    """Only the tagged formats under AUTO end a sample at a closing tag: in a constrained
    call or a bare JSON one, "</tool_call>" is a string in the arguments."""
    for choice, fmt, text in (
        (
            "required",
            ToolFormat.HERMES,
            '[{"name":"get_weather","arguments":{"city":"</tool_call>"}}]',
        ),
        ("auto", ToolFormat.JSON, '{"name": "get_weather", "arguments": {"city": "</tool_call>"}}'),
    ):
        reader = ToolCallReader(tools(choice, fmt, parallel=False))
        shown, last, ended = read(reader, [text[:40], text[40:]])
        assert not ended, choice
        assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [
            ("get_weather", {"city": "</tool_call>"})
        ]
