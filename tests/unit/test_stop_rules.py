"""Stop rules: pure helpers, and a sampled token meeting a request (generation.accept_token)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from pagoda.scheduler_svc.core.generation import accept_token, final_text
from pagoda.scheduler_svc.core.request import FinishReason, Request, token_array
from pagoda.scheduler_svc.core.stop_rules import (
    StopStringMatcher,
    find_stop_string,
    held_back_length,
    token_verdict,
)

from tests.unit.conftest import apply_scripts, make_geometry, make_request, make_scheduler

EOS = 2


class ScriptedDetokenizer:
    """Token id -> the text given for it (a dict); '' for unknown ids."""

    def __init__(self, pieces: dict[int, str]) -> None:
        self.pieces = pieces
        self.pending = ""
        # The scheduler looks texts up here and pushes the ids whose entry is None or
        # beyond the end: the empty pieces stand in for partial characters, which a real
        # detokenizer does not offer for lookup.
        self.whole_texts = [pieces.get(token_id) or None for token_id in range(max(pieces))]

    def push(self, token_id: int) -> str:
        return self.pieces.get(token_id, "")

    def flush(self) -> str:
        return self.pending


def make_state(pieces: dict[int, str], **stopping) -> Request:
    valid = make_request(prompt=[7, 7, 7], **stopping)
    return Request(
        request_id=valid.request_id,
        sampling=valid.sampling,
        stopping=valid.stopping,
        priority=0,
        num_prompt_tokens=3,
        token_ids=token_array(valid.prompt_token_ids),
        arrival_s=0.0,
        detokenizer=ScriptedDetokenizer(pieces),  # type: ignore[arg-type]
        stop_matcher=StopStringMatcher(valid.stopping.stop_strings)
        if valid.stopping.stop_strings
        else None,
    )


def feed(
    request: Request, token_ids: list[int], max_context_tokens: int = 100
) -> list[tuple[str, FinishReason | None]]:
    return [accept_token(request, t, frozenset({EOS}), max_context_tokens) for t in token_ids]


def test_token_verdict():
    stopping = make_request(max_new_tokens=5, min_new_tokens=1, stop_token_ids=[9]).stopping
    eos = frozenset({EOS})
    assert token_verdict(EOS, 1, 10, stopping, eos, 100) is None  # before min_new_tokens
    assert token_verdict(EOS, 2, 10, stopping, eos, 100) is FinishReason.STOP
    assert token_verdict(9, 2, 10, stopping, eos, 100) is FinishReason.STOP
    assert token_verdict(7, 5, 10, stopping, eos, 100) is FinishReason.LENGTH
    assert token_verdict(7, 2, 100, stopping, eos, 100) is FinishReason.LENGTH
    assert token_verdict(EOS, 5, 10, stopping, eos, 100) is FinishReason.STOP  # STOP wins


def test_find_stop_string_returns_the_earliest():
    assert find_stop_string("abc STOP x END", ("END", "STOP")) == 4
    assert find_stop_string("nothing", ("END",)) is None


def test_held_back_length_is_the_longest_stop_prefix_suffix():
    prefixes = frozenset({"E", "EN", "S", "ST"})
    assert held_back_length("abcEN", prefixes, 2) == 2
    assert held_back_length("abcE", prefixes, 2) == 1
    assert held_back_length("abc", prefixes, 2) == 0


def test_a_stop_string_across_token_boundaries_is_cut_and_not_returned():
    request = make_state(
        {10: "Hello wo", 11: "rld! E", 12: "ND of it", 13: "more"},
        stop_strings=("END",),
        max_new_tokens=10,
    )
    events = feed(request, [10, 11, 12])
    assert events == [("Hello wo", None), ("rld! ", None), ("", FinishReason.STOP)]


def test_text_that_may_start_a_stop_string_is_held_back_until_settled():
    request = make_state(
        {10: "a <", 11: "/", 12: "p", 13: "x"}, stop_strings=("</s>",), max_new_tokens=10
    )
    assert feed(request, [10, 11, 12]) == [("a ", None), ("", None), ("</p", None)]
    assert request.stop_matcher.held_text == ""


def test_held_back_text_is_released_when_the_request_ends_by_length():
    request = make_state({10: "a <", 11: "/"}, stop_strings=("</s>",), max_new_tokens=2)
    assert feed(request, [10, 11]) == [("a ", None), ("</", FinishReason.LENGTH)]


def test_eos_stops_without_its_text_but_its_id_is_returned_by_the_caller():
    request = make_state({10: "hi", EOS: "<eos>"}, max_new_tokens=10)
    assert feed(request, [10, EOS]) == [("hi", None), ("", FinishReason.STOP)]
    assert request.token_ids[-1] == EOS


def test_ignore_eos_keeps_going():
    request = make_state({EOS: "<eos>"}, max_new_tokens=2, ignore_eos=True)
    assert feed(request, [EOS, EOS]) == [("<eos>", None), ("<eos>", FinishReason.LENGTH)]


def test_a_stop_token_id_stops():
    request = make_state({10: "a", 11: "b"}, stop_token_ids=[11], max_new_tokens=10)
    assert feed(request, [10, 11]) == [("a", None), ("", FinishReason.STOP)]


def test_min_new_tokens_ignores_stops_before_it():
    request = make_state(
        {10: "x", 11: "END"},
        stop_strings=("END",),
        stop_token_ids=[10],
        min_new_tokens=2,
        max_new_tokens=10,
    )
    # Tokens 1 and 2 may not stop (not even the stop token id); token 3 may.
    assert feed(request, [10, 11, 10]) == [("x", None), ("END", None), ("", FinishReason.STOP)]
    request = make_state({EOS: ""}, min_new_tokens=1, max_new_tokens=10)
    assert feed(request, [EOS, EOS]) == [("", None), ("", FinishReason.STOP)]


def test_max_new_tokens_and_a_full_context_end_with_length():
    request = make_state({10: "a"}, max_new_tokens=2)
    assert feed(request, [10, 10])[-1] == ("a", FinishReason.LENGTH)
    request = make_state({10: "a"}, max_new_tokens=50)
    assert feed(request, [10, 10], max_context_tokens=5)[-1] == ("a", FinishReason.LENGTH)


def test_final_text_releases_held_text_then_pending_bytes():
    request = make_state({10: "a E"}, stop_strings=("END",), max_new_tokens=10)
    feed(request, [10])
    request.detokenizer.pending = "\ufffd"
    assert final_text(request) == "E\ufffd"


def test_the_matcher_releases_everything_while_inactive():
    matcher = StopStringMatcher(("END",))
    assert matcher.push("a EN", active=False) == ("a EN", False)
    assert matcher.push("D", active=True) == ("D", False)


PIECES = {10: "ab", 11: "c", 12: "</", 13: "s>", 14: "x</s", 15: "", 16: ">y", EOS: "<e>"}


_stoppings = st.fixed_dictionaries(
    dict(
        min_new_tokens=st.integers(0, 4),
        max_new_tokens=st.integers(1, 10),
        stop_strings=st.sampled_from([(), ("</s>",), ("c<", "y")]),
        stop_token_ids=st.sampled_from([(), (11,), (9, 16)]),
        ignore_eos=st.booleans(),
    )
)
# Ten tokens per request: max_new_tokens ends every request within them.
_token_scripts = st.lists(st.sampled_from(sorted(PIECES) + [9]), min_size=10, max_size=10)


@given(
    scripts=st.lists(st.tuples(_stoppings, _token_scripts), min_size=1, max_size=5),
    spare_context_tokens=st.integers(0, 3),
)
@settings(max_examples=300, deadline=None)
def test_apply_streams_what_accept_token_gives_every_request_of_a_step(
    scripts, spare_context_tokens
):
    """Scheduler.apply takes most tokens of a step column-wise and only the others through
    accept_token; fed the same tokens, each of several requests decoding together must
    stream exactly what accept_token's rules give it alone."""
    max_new = max(stopping["max_new_tokens"] for stopping, _ in scripts)
    max_context_tokens = 3 + max_new + spare_context_tokens  # every prompt is 3
    expected: dict[str, list[tuple[int, str, FinishReason | None]]] = {}
    for index, (stopping, tokens) in enumerate(scripts):
        reference = make_state(PIECES, **stopping)
        stream = expected[f"r{index}"] = []
        for token_id in tokens:
            text, reason = accept_token(reference, token_id, frozenset({EOS}), max_context_tokens)
            stream.append((token_id, text, reason))
            if reason is not None:
                break

    geometry = make_geometry(max_context_tokens=max_context_tokens, eos_token_ids=[EOS])
    scheduler = make_scheduler(geometry, lambda: ScriptedDetokenizer(PIECES))
    for index, (stopping, _) in enumerate(scripts):
        # The first prompt token names the request in the plan.
        scheduler.add(make_request(f"r{index}", prompt=[100 + index, 7, 7], **stopping), 0.0)
    streamed = {
        request_id: [(o.token_ids[0], o.text, o.finish_reason) for o in outputs]
        for request_id, outputs in apply_scripts(scheduler, [t for _, t in scripts]).items()
    }
    assert streamed == expected
