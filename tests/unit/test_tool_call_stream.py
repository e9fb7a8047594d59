"""Calls of tools streamed as the model writes them (tool_call_stream.py, sample_edge.py):
a call's pieces come while it is written, they add up to the call the last message
carries, the text outside calls is what a whole reading (tool_calls.py) gives, and where
a piece of text is cut never changes what comes out."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc.call_syntax import read_head
from pagoda.scheduler_svc.chat_validation import validate_chat
from pagoda.scheduler_svc.core import FinishReason, RequestOutput, Usage
from pagoda.scheduler_svc.output_processor import _call_reader
from pagoda.scheduler_svc.reasoning import Thinking
from pagoda.scheduler_svc.responses import to_response
from pagoda.scheduler_svc.sample_edge import SampleEdge
from pagoda.scheduler_svc.stop_strings import StopStringMatcher
from pagoda.scheduler_svc.tool_call_stream import CallPiece, ToolCallStream
from pagoda.scheduler_svc.tool_calls import ToolCallReader
from pagoda.scheduler_svc.tools import ToolFormat, ValidTools
from tests.unit.test_tool_calls import tools
from tests.unit.test_tools import LIMITS, TIME, chat

NAMES = frozenset({"get_weather", "get_time"})


def streamed(choice: str = "auto", fmt: ToolFormat = ToolFormat.HERMES, **options) -> ValidTools:
    return dataclasses.replace(tools(choice, fmt, **options), streams=True)


def stream(
    valid: ValidTools, pieces: list[str], last: str = ""
) -> tuple[list[str], list[list[CallPiece]], ToolCallStream]:
    """Each piece's text and call pieces, the last entry the flush's (of `last`)."""
    reader = ToolCallStream(valid)
    shown, calls = [], []
    for messages in [*map(reader.push, pieces), reader.flush(last)]:
        shown.append("".join(text for text, _ in messages))
        calls.append([piece for _, new in messages for piece in new])
    return shown, calls, reader


def cut(output: str, cuts: list[int]) -> list[str]:
    """`output` in pieces, cut where `cuts` say (modulo its length)."""
    bounds = [0, *sorted(cut % (len(output) + 1) for cut in cuts), len(output)]
    return [output[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def whole(valid: ValidTools, text: str) -> tuple[str, list[tuple[str, str]]]:
    """What a whole reading gives: the text and each call's (name, arguments)."""
    reader = ToolCallReader(dataclasses.replace(valid, streams=False))
    shown = reader.push(text)[0] + reader.flush()
    return shown, [(call.name, call.arguments) for call in reader.calls]


def joined(pieces: list[list[CallPiece]]) -> dict[int, tuple[str, str, str]]:
    """Each call's (id, name, arguments) from its pieces; each piece after the first has
    neither id nor name."""
    calls: dict[int, tuple[str, str, str]] = {}
    for piece in (piece for step in pieces for piece in step):
        if piece.index in calls:
            assert not piece.id and not piece.name
            call_id, name, arguments = calls[piece.index]
            calls[piece.index] = (call_id, name, arguments + piece.arguments)
        else:
            assert piece.index == len(calls) and piece.id.startswith("call_") and piece.name
            calls[piece.index] = (piece.id, piece.name, piece.arguments)
    return calls


def test_a_tagged_call_streams_its_arguments_while_the_model_writes_them():
    pieces = ["Let me ", "look.\n\n<tool", "_call>\n{\"name\": \"get_", "weather\", ",
              '"arguments": {"ci', 'ty": "Par', 'is"}}\n</tool_call>', "\n"]  # fmt: skip
    shown, calls, reader = stream(streamed(), pieces)
    assert shown == ["Let me", " look.", "", "", "", "", "", "", ""]
    assert [len(step) for step in calls] == [0, 0, 0, 0, 1, 1, 1, 0, 0]
    first = calls[4][0]
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"ci')
    assert [step[0].arguments for step in calls[5:7]] == ['ty": "Par', 'is"}']
    (call,) = reader.calls
    assert (call.id, call.name, call.arguments) == (first.id, "get_weather", '{"city": "Paris"}')
    assert not reader.open_call


# Arguments whose strings hold what a scanner could take for structure.
ARGUMENT_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab {}[]"\\<>,:\n\u00e9'),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
ARGUMENTS = st.dictionaries(st.text(alphabet="abc_", max_size=5), ARGUMENT_VALUES, max_size=4)
CALLS = st.lists(st.tuples(st.sampled_from(sorted(NAMES)), ARGUMENTS), min_size=1, max_size=3)


def call_text(name: str, arguments: dict, compact: bool, key: str = "arguments") -> str:
    separators = (",", ":") if compact else (", ", ": ")
    value = json.dumps(arguments, separators=separators, ensure_ascii=compact)
    return json.dumps({"name": name, key: 0}, separators=separators).replace("0}", value + "}")


OUTPUTS = {
    "tagged": (lambda: streamed(), lambda texts: "Sure.\n" + "\n".join(f"<tool_call>\n{t}\n</tool_call>" for t in texts)),
    "json list": (lambda: streamed(fmt=ToolFormat.JSON), lambda texts: "[" + ", ".join(texts) + "]"),
    "json call": (lambda: streamed(fmt=ToolFormat.JSON), lambda texts: " " + texts[0]),
    "required": (lambda: streamed("required"), lambda texts: "[" + ", ".join(texts) + "]"),
}  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(sorted(OUTPUTS)),
    calls=CALLS,
    compact=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_streamed_calls_are_what_a_whole_reading_gives(kind, calls, compact, cuts):
    make_tools, write = OUTPUTS[kind]
    valid = make_tools()
    if kind == "json call":
        calls = calls[:1]
    key = "parameters" if kind.startswith("json") else "arguments"
    output = write([call_text(name, arguments, compact, key) for name, arguments in calls])
    *texts, last = cut(output, cuts)
    shown, pieces, reader = stream(valid, texts, last)
    text, expected = whole(valid, output)
    assert "".join(shown) == text
    got = joined(pieces)
    assert [(name, arguments) for _, name, arguments in got.values()] == expected
    assert [(c.id, c.name, c.arguments) for c in reader.calls] == list(got.values())
    assert not reader.open_call


TEXTS = st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"', " ", "\n", "a", "<",
                                  '"name": ', '"get_time"', '"arguments": ', ", ", "[", "]"]),
                 max_size=40).map("".join)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from(["hermes", "json", "required", "function"]),
    pieces=st.lists(TEXTS, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_what_comes_out_does_not_depend_on_where_the_text_is_cut(kind, pieces, cuts):
    valid = {
        "hermes": streamed(),
        "json": streamed(fmt=ToolFormat.JSON),
        "required": streamed("required"),
        "function": streamed("function", function_name="get_time"),
    }[kind]
    output = "".join(pieces)
    *texts, last = cut(output, cuts)
    shown, calls, reader = stream(valid, texts, last)
    alone_shown, alone_calls, alone = stream(valid, [output])
    assert "".join(shown) == "".join(alone_shown)
    assert [c[1:] for c in joined(calls).values()] == [c[1:] for c in joined(alone_calls).values()]
    assert reader.open_call == alone.open_call


NOT_CALLS = {
    "an undeclared tool": 'Hi <tool_call>{"name": "nope", "arguments": {}}</tool_call> bye',
    "no JSON": "Hi\n<tool_call>\nnot JSON\n</tool_call>",
    "an unclosed tag": 'I will <tool_call>{"name": "get_time", "argu',
    "half a tag": "Just text <tool_ca",
    "a string's arguments": '<tool_call>{"name": "get_time", "arguments": 5}</tool_call>',
}


@pytest.mark.parametrize("output", NOT_CALLS.values(), ids=list(NOT_CALLS))
def test_what_is_no_call_is_text_as_a_whole_reading_gives_it(output):
    for cut in range(len(output) + 1):
        shown, calls, _ = stream(streamed(), [output[:cut], output[cut:]])
        assert "".join(shown) == whole(streamed(), output)[0] == output
        assert not joined(calls)


@pytest.mark.parametrize(
    "answer", ['{"answer": 1}', "[1, 2]", '[{"name": "get_time"}]', "The time is 5."]
)
def test_a_json_answer_that_is_no_call_is_text_whole(answer):
    shown, calls, _ = stream(streamed(fmt=ToolFormat.JSON), list(answer))
    assert "".join(shown) == answer and not joined(calls)


def test_a_call_written_in_another_order_comes_in_one_piece_when_it_ends():
    body = '{"arguments": {"city":"Oslo"}, "name": "get_weather"}'
    output = f"<tool_call>{body}</tool_call>"
    shown, calls, reader = stream(streamed(), [output[:30], output[30:]])
    assert calls[0] == [] and shown == ["", "", ""]
    ((piece,),) = [step for step in calls if step]
    assert (piece.name, piece.arguments) == ("get_weather", '{"city": "Oslo"}')
    typed = '{"type": "function", "name": "get_time", "parameters": {}}'  # Llama 3.2's
    shown, calls, reader = stream(streamed(fmt=ToolFormat.JSON), [typed])
    assert [(c.name, c.arguments) for c in reader.calls] == [("get_time", "{}")]


def test_a_call_cut_off_stays_a_call_with_the_arguments_written():
    shown, calls, reader = stream(
        streamed(), ['<tool_call>{"name": "get_weather", "arguments": {"city": "Pa']
    )
    assert [(c.name, c.arguments) for c in reader.calls] == [("get_weather", '{"city": "Pa')]
    assert reader.open_call
    shown, calls, reader = stream(
        streamed("required"), ['[{"name": "get_time", "arguments": {}}, {"name"']
    )
    assert [c.name for c in reader.calls] == ["get_time"] and reader.open_call
    assert "".join(shown) == '{"name"'  # the cut head is text


def test_a_tagged_call_whose_json_breaks_ends_at_its_tag():
    output = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>\nDone.'
    shown, _, reader = stream(streamed(), [output])
    assert [c.arguments for c in reader.calls] == ['{"city": "Paris"']
    assert "".join(shown) == "Done." and not reader.open_call


def test_a_named_function_streams_its_arguments_from_the_first_character():
    shown, calls, reader = stream(
        streamed("function", function_name="get_time"), ["", "{", '"tz": "UTC"}']
    )
    assert [[(p.name, p.arguments) for p in step] for step in calls] == [
        [],
        [("get_time", "{")],
        [("", '"tz": "UTC"}')],
        [],
    ]
    assert [c.arguments for c in reader.calls] == ['{"tz": "UTC"}'] and "".join(shown) == ""


def test_without_parallel_calls_a_json_list_keeps_its_first_call():
    output = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {}}]'
    _, _, reader = stream(streamed(fmt=ToolFormat.JSON, parallel=False), [output])
    assert [c.name for c in reader.calls] == ["get_time"]


def test_the_head_says_early_whether_it_is_one():
    assert read_head('{"name": "get_time", "arguments": {', NAMES) == (34, "get_time")
    assert read_head(' { "name" : "get_time" ,"parameters":\n{}', NAMES) == (38, "get_time")
    for undecided in ("", "{", '{"na', '{"name": "get_t', '{"name": "get_time", "arg'):
        assert read_head(undecided, NAMES) is None
    for no in ('{"nom', '{"name": "get_x', '{"name": "get_time", "arguments": "', "[", "a"):
        assert read_head(no, NAMES) is False


def test_the_output_processor_passes_streamed_calls_on():
    stop = StopStringMatcher(("END",), 0)
    assert _call_reader(streamed(), stop, None) is stop
    assert _call_reader(streamed("required"), stop, None) is None
    reader = _call_reader(streamed(parallel=False), stop, None)
    assert isinstance(reader, ToolCallReader)
    pieces = ["Hi <tool_c", 'all>{"name": "get_time", "arguments": {}}</tool', "_call>", "more"]
    assert [reader.push(piece) for piece in pieces[:2]] == [
        ("Hi <tool_c", False),
        (pieces[1], False),
    ]
    assert reader.push("_call>") == ("_call>", True)  # the only call closed: the sample ends


def test_a_close_in_the_thinking_ends_nothing():
    reader = _call_reader(streamed(parallel=False), None, Thinking.BEGUN)
    assert reader.push("</tool_call> hm </think>")[1] is False
    assert reader.push('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')[1] is True


def finishing(text: str, reason: FinishReason) -> RequestOutput:
    return RequestOutput("r", text, [1, 2], None, finish_reason=reason)


def test_the_edge_sends_pieces_then_the_calls_whole_on_the_last_message():
    edge = SampleEdge(calls=ToolCallStream(streamed()))
    output = RequestOutput("r", 'Hm.<tool_call>{"name": "get_time", "arguments": {"tz', [1], None)
    (first,) = edge.apply(to_response(output), output)
    assert first.text == "Hm." and first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    (piece,) = first.tool_call_deltas
    assert (piece.index, piece.name, piece.arguments) == (0, "get_time", '{"tz')
    output = finishing('": 1}}</tool_call>', FinishReason.STOP)
    (last,) = edge.apply(to_response(output), output)
    assert [d.arguments for d in last.tool_call_deltas] == ['": 1}']
    assert [(c.id, c.arguments) for c in last.tool_calls] == [(piece.id, '{"tz": 1}')]
    assert last.finish_reason == pb.TOOL_CALLS


def test_a_call_cut_by_the_limit_keeps_length_and_an_error_flushes_nothing():
    edge = SampleEdge(calls=ToolCallStream(streamed()))
    output = finishing('<tool_call>{"name": "get_time", "arguments": {"tz', FinishReason.LENGTH)
    (last,) = edge.apply(to_response(output), output)
    assert last.finish_reason == pb.LENGTH and [c.arguments for c in last.tool_calls] == ['{"tz']
    edge = SampleEdge(calls=ToolCallStream(streamed()))
    output = finishing('<tool_call>{"name": "get_time"', FinishReason.ERROR)
    (failed,) = edge.apply(to_response(output), output)
    assert failed.finish_reason == pb.ERROR and not failed.tool_calls and failed.text == ""


def test_a_message_reads_in_the_order_written_or_is_several():
    """One message: the pieces of a call begun before it, then text, then the calls it
    begins. Text after a call begun in it goes on in a message of its own, which ends the
    sample when this one did."""
    reader = ToolCallStream(streamed())
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert reader.push('<tool_call>{"name": "get_time", "arguments": {"a') == [
        ("", [CallPiece(0, reader.calls[0].id, "get_time", '{"a')])
    ]
    messages = reader.push(f'": 1}}}}</tool_call>\nSo:{call}\nDone.{call}')
    assert [(text, [(p.index, p.arguments) for p in pieces]) for text, pieces in messages] == [
        ("So:", [(0, '": 1}'), (1, "{}")]),
        ("Done.", [(2, "{}")]),  # the blanks after a call are no text
    ]
    edge = SampleEdge(calls=ToolCallStream(streamed()))
    output = finishing(f"{call} Later.", FinishReason.STOP)
    output.usage = Usage(3, 2, 0, 0)
    first, end = edge.apply(to_response(output), output)
    assert (first.text, first.finish_reason, first.HasField("usage")) == ("", 0, False)
    assert [d.name for d in first.tool_call_deltas] == ["get_time"] and list(first.token_ids) == [
        1,
        2,
    ]
    assert (end.text, end.finish_reason, end.usage.completion_tokens) == (
        "Later.",
        pb.TOOL_CALLS,
        2,
    )
    assert [c.name for c in end.tool_calls] == ["get_time"] and not end.token_ids


def test_stream_tool_calls_reaches_the_tools(tokenizer):
    for flag in (False, True):
        valid = validate_chat(chat(tools=[TIME], stream_tool_calls=flag), tokenizer, LIMITS)
        assert valid.tools.streams is flag
