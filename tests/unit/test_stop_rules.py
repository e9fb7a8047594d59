"""Stop rules: the core's check_stop on token ids, the output processor's stop strings, and
a sampled token meeting its request through apply() and the output processor."""

from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.scheduler_svc.core import (
    FinishReason,
    Scheduler,
    SchedulerConfig,
    StepResult,
    ValidStopping,
)
from pagoda.scheduler_svc.core.request import (
    Request,
    check_stop,
    set_stop_rules,
    token_array,
)
from pagoda.scheduler_svc.output_processor import OutputProcessor
from pagoda.scheduler_svc.step_loop import apply_step
from pagoda.scheduler_svc.stop_strings import (
    StopStringMatcher,
    find_stop_string,
    held_back_length,
)
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import (
    TextScheduler,
    apply_scripts,
    check_invariants,
    drive,
    expected_generation,
    make_geometry,
    make_request,
    make_scheduler,
)

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


def token_verdict(
    token_id: int,
    num_generated_tokens: int,
    num_tokens: int,
    stopping: ValidStopping,
    eos_token_ids: frozenset[int],
    max_context_tokens: int,
) -> FinishReason | None:
    """check_stop on a request of `num_tokens` tokens whose last, `token_id`, is its
    `num_generated_tokens`-th generated one, its stop rules set as an admission sets them."""
    valid = make_request()
    token_ids = [7] * (num_tokens - 1) + [token_id]
    request = Request(
        request_id="r0",
        sampling=valid.sampling,
        stopping=stopping,
        priority=0,
        num_prompt_tokens=num_tokens - num_generated_tokens,
        token_ids=token_array(token_ids),
        arrival_s=0.0,
    )
    set_stop_rules(request, eos_token_ids, max_context_tokens)
    return check_stop(request, token_id)


def rules_verdict(
    request: Request, token_id: int, eos_token_ids: frozenset[int], max_context_tokens: int
) -> FinishReason | None:
    """The token-id stop rules read from the request's stopping rules, one by one."""
    stopping = request.stopping
    if token_id in stopping.stop_token_ids or (
        token_id in eos_token_ids and not stopping.ignore_eos
    ):
        return FinishReason.STOP
    num_tokens = len(request.token_ids)
    num_generated = num_tokens - request.num_prompt_tokens
    if num_generated >= stopping.max_new_tokens or num_tokens >= max_context_tokens:
        return FinishReason.LENGTH
    return None


def run_alone(
    pieces: dict[int, str], token_ids: list[int], max_context_tokens: int = 100, **stopping
) -> tuple[list[tuple[str, FinishReason | None]], TextScheduler]:
    """Request "r0" (a 3-token prompt) alone, sampling `token_ids` in order through apply()
    and the output processor: its (text, finish reason) per output, and the scheduler."""
    geometry = make_geometry(max_context_tokens=max_context_tokens, eos_token_ids=[EOS])
    scheduler = make_scheduler(geometry, lambda: ScriptedDetokenizer(pieces))
    scheduler.add(make_request("r0", prompt=[7, 7, 7], **stopping), 0.0)
    events = []
    for token_id in token_ids:
        plan = scheduler.schedule(0.0)
        assert plan is not None, "the request ended before its script"
        assert plan.sample == [True]
        result = StepResult(plan.step_id, plan.seq_ids, [token_id])
        events += [(o.text, o.finish_reason) for o in scheduler.apply(result, 0.0)]
        check_invariants(scheduler)
    return events, scheduler


def feed(
    pieces: dict[int, str], token_ids: list[int], max_context_tokens: int = 100, **stopping
) -> list[tuple[str, FinishReason | None]]:
    return run_alone(pieces, token_ids, max_context_tokens, **stopping)[0]


def test_token_verdict():
    stopping = make_request(max_new_tokens=5, min_new_tokens=1, stop_token_ids=[9]).stopping
    eos = frozenset({EOS})
    # min_new_tokens is the worker's mask: an ending id that arrives ends the request.
    assert token_verdict(EOS, 1, 10, stopping, eos, 100) is FinishReason.STOP
    assert token_verdict(EOS, 2, 10, stopping, eos, 100) is FinishReason.STOP
    assert token_verdict(9, 2, 10, stopping, eos, 100) is FinishReason.STOP
    assert token_verdict(7, 5, 10, stopping, eos, 100) is FinishReason.LENGTH
    assert token_verdict(7, 2, 100, stopping, eos, 100) is FinishReason.LENGTH
    assert token_verdict(EOS, 5, 10, stopping, eos, 100) is FinishReason.STOP  # STOP wins
    ignoring = make_request(max_new_tokens=5, ignore_eos=True).stopping
    assert token_verdict(EOS, 2, 10, ignoring, eos, 100) is None


@given(
    stopping=st.fixed_dictionaries(
        dict(
            min_new_tokens=st.integers(0, 4),
            max_new_tokens=st.integers(1, 12),
            stop_token_ids=st.sets(st.integers(0, 6), max_size=2),
            ignore_eos=st.booleans(),
        )
    ),
    eos_token_ids=st.frozensets(st.integers(0, 6), max_size=2),
    num_prompt_tokens=st.integers(1, 4),
    spare_context_tokens=st.integers(0, 14),
    tokens=st.lists(st.integers(0, 6), min_size=12, max_size=12),
)
@settings(max_examples=300, deadline=None)
def test_the_stop_fields_set_at_admission_give_the_rules_answer(
    stopping, eos_token_ids, num_prompt_tokens, spare_context_tokens, tokens
):
    """check_stop's two reads of the fields set at admission give what the rules give."""
    valid = make_request(prompt=num_prompt_tokens, **stopping)
    max_context_tokens = num_prompt_tokens + 1 + spare_context_tokens

    def request() -> Request:
        return Request(
            request_id="r0",
            sampling=valid.sampling,
            stopping=valid.stopping,
            priority=0,
            num_prompt_tokens=num_prompt_tokens,
            token_ids=token_array(valid.prompt_token_ids),
            arrival_s=0.0,
        )

    windowed, plain = request(), request()  # plain: never admitted, the rules read one by one
    set_stop_rules(windowed, eos_token_ids, max_context_tokens)
    for token_id in tokens:
        windowed.token_ids.append(token_id)
        plain.token_ids.append(token_id)
        expected = rules_verdict(plain, token_id, eos_token_ids, max_context_tokens)
        assert check_stop(windowed, token_id) is expected
        if expected is not None:
            break


def test_find_stop_string_returns_the_earliest():
    assert find_stop_string("abc STOP x END", ("END", "STOP")) == 4
    assert find_stop_string("nothing", ("END",)) is None


def test_held_back_length_is_the_longest_stop_prefix_suffix():
    stops = ("END", "STOP")
    assert held_back_length("abcEN", stops) == 2
    assert held_back_length("abcE", stops) == 1
    assert held_back_length("abc", stops) == 0
    assert held_back_length("xSTO", stops) == 3
    assert held_back_length("END", stops) == 0  # a whole stop string is a match, not held
    assert held_back_length("aaa", ("aab",)) == 2
    assert held_back_length("E", ("ENDING", "E!")) == 1


@given(
    text=st.text(alphabet="abE", max_size=12),
    stops=st.lists(st.text(alphabet="abE", min_size=1, max_size=5), min_size=1, max_size=4),
)
def test_held_back_length_matches_its_definition(text, stops):
    proper_prefixes = {stop[:n] for stop in stops for n in range(1, len(stop))}
    expected = max((n for n in range(1, len(text) + 1) if text[-n:] in proper_prefixes), default=0)
    assert held_back_length(text, tuple(stops)) == expected


def test_a_matcher_holds_no_table_of_prefixes():
    """16 stop strings of 256 bytes cost 0.87 MB a request in a set of their prefixes,
    for every queued request (security review N5); the strings themselves are 4 KB."""
    stops = tuple(f"{index:02d}" + "s" * 254 for index in range(16))
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        matchers = [StopStringMatcher(stops) for _ in range(100)]
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(matchers) == 100
    assert (after - before) / 100 < 1024, f"{(after - before) / 100:.0f} bytes a matcher"


def test_a_stop_string_across_token_boundaries_is_cut_and_not_returned():
    events, scheduler = run_alone(
        {10: "Hello wo", 11: "rld! E", 12: "ND of it", 13: "more"},
        [10, 11, 12],
        stop_strings=("END",),
        max_new_tokens=10,
    )
    assert events == [("Hello wo", None), ("rld! ", None), ("", FinishReason.STOP)]
    assert not scheduler.has_work()  # ended, blocks free, before the next schedule()


def test_text_that_may_start_a_stop_string_is_held_back_until_settled():
    pieces = {10: "a <", 11: "/", 12: "p", 13: "x"}
    events, scheduler = run_alone(pieces, [10, 11, 12], stop_strings=("</s>",), max_new_tokens=10)
    assert events == [("a ", None), ("", None), ("</p", None)]
    assert scheduler.processor._texts["r0"][1].held_text == ""


def test_held_back_text_is_released_when_the_request_ends_by_length():
    events = feed({10: "a <", 11: "/"}, [10, 11], stop_strings=("</s>",), max_new_tokens=2)
    assert events == [("a ", None), ("</", FinishReason.LENGTH)]


def test_a_stop_string_completed_by_the_last_allowed_token_wins_over_length():
    events = feed({10: "a <", 11: "/s>"}, [10, 11], stop_strings=("</s>",), max_new_tokens=2)
    assert events == [("a ", None), ("", FinishReason.STOP)]


def test_eos_stops_without_its_text_but_its_id_is_returned():
    pieces = {10: "hi", EOS: "<eos>"}
    events, scheduler = run_alone(pieces, [10], max_new_tokens=10)
    plan = scheduler.schedule(0.0)
    (output,) = scheduler.apply(StepResult(plan.step_id, plan.seq_ids, [EOS]), 0.0)
    assert events + [(output.text, output.finish_reason)] == [("hi", None), ("", FinishReason.STOP)]
    assert output.token_ids == [EOS]


def test_ignore_eos_keeps_going():
    events = feed({EOS: "<eos>"}, [EOS, EOS], max_new_tokens=2, ignore_eos=True)
    assert events == [("<eos>", None), ("<eos>", FinishReason.LENGTH)]


def test_a_stop_token_id_stops():
    events = feed({10: "a", 11: "b"}, [10, 11], stop_token_ids=[11], max_new_tokens=10)
    assert events == [("a", None), ("", FinishReason.STOP)]


def test_min_new_tokens_ignores_stop_strings_before_it():
    events = feed(
        {12: "x", 11: "END", 10: "y"},
        [12, 11, 10],
        stop_strings=("END",),
        stop_token_ids=[10],
        min_new_tokens=2,
        max_new_tokens=10,
    )
    # Tokens 1 and 2 may not end it by a stop string; token 3 ends it by its id.
    assert events == [("x", None), ("END", None), ("", FinishReason.STOP)]


def test_min_new_tokens_is_sent_as_the_workers_mask_until_reached():
    """The ending ids (stop ids and EOS unless ignored) go to the worker with the new
    sequence, which masks them out of the logits; check_stop no longer second-guesses
    an ending id (issue 14 item 6). A recompute past min_new_tokens sends no mask."""
    geometry = make_geometry(eos_token_ids=[EOS])
    scheduler = make_scheduler(geometry)
    scheduler.add(
        make_request(
            "r0", prompt=[7, 7, 7], min_new_tokens=3, max_new_tokens=8, stop_token_ids=[9]
        ),
        0.0,
    )
    scheduler.add(make_request("r1", prompt=[7, 7], min_new_tokens=2, ignore_eos=True), 0.0)
    scheduler.add(make_request("r2", prompt=[7], max_new_tokens=3), 0.0)
    plan = scheduler.schedule(0.0)
    masks = [(n.min_new_tokens, n.min_tokens_banned_ids) for n in plan.new_sequences]
    assert masks == [(3, frozenset({9, EOS})), (0, frozenset()), (0, frozenset())]

    # Preempted after 3 generated tokens: the recomputed sequence is not masked.
    scheduler = make_scheduler(geometry)
    scheduler.add(make_request("r0", prompt=[7, 7, 7], min_new_tokens=3, max_new_tokens=8), 0.0)
    for token_id in (5, 6, 5):
        plan = scheduler.schedule(0.0)
        scheduler.apply(StepResult(plan.step_id, plan.seq_ids, [token_id]), 0.0)
    planner = scheduler._planner
    (request,) = planner.running.values()
    planner.preempt(request)
    plan = scheduler.schedule(0.0)
    assert [(n.min_new_tokens, n.min_tokens_banned_ids) for n in plan.new_sequences] == [
        (0, frozenset())
    ]


def test_max_new_tokens_ends_with_length():
    # A full context ends it the same way (test_token_verdict); add() refuses a request
    # whose max_new_tokens the context cannot hold, so here both are reached together.
    assert feed({10: "a"}, [10, 10], max_new_tokens=2)[-1] == ("a", FinishReason.LENGTH)
    events = feed({10: "a"}, [10, 10], max_context_tokens=5, max_new_tokens=2)
    assert events[-1] == ("a", FinishReason.LENGTH)


def test_a_cancel_releases_held_text_then_pending_bytes():
    _, scheduler = run_alone({10: "a E"}, [10], stop_strings=("END",), max_new_tokens=10)
    scheduler.processor._texts["r0"][0].pending = "\ufffd"
    output = scheduler.cancel("r0", 1.0)
    assert (output.text, output.finish_reason) == ("E\ufffd", FinishReason.CANCELLED)
    assert len(scheduler.processor) == 0


def test_the_matcher_releases_everything_while_inactive():
    matcher = StopStringMatcher(("END",), min_new_tokens=1)
    assert matcher.push("a EN") == ("a EN", False)
    assert matcher.push("D") == ("D", False)


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
def test_every_request_of_a_step_streams_what_it_streams_alone(scripts, spare_context_tokens):
    """apply() takes a step's tokens column-wise and the output processor gives them text
    in one pass; fed the same tokens, each of several requests decoding together must
    stream exactly what it streams alone."""
    max_new = max(stopping["max_new_tokens"] for stopping, _ in scripts)
    max_context_tokens = 3 + max_new + spare_context_tokens  # every prompt is 3
    expected: dict[str, list[tuple[int, str, FinishReason | None]]] = {}
    for index, (stopping, tokens) in enumerate(scripts):
        events = feed(PIECES, tokens[:1], max_context_tokens, **stopping)
        num_tokens = 1
        while events[-1][1] is None:  # one more token until it ends (max_new_tokens does)
            num_tokens += 1
            events = feed(PIECES, tokens[:num_tokens], max_context_tokens, **stopping)
        expected[f"r{index}"] = [
            (token_id, text, reason)
            for token_id, (text, reason) in zip(tokens[: len(events)], events, strict=True)
        ]

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


def test_a_request_id_used_again_after_a_cancel_gets_fresh_text_state():
    """The processor finds most requests by their place in the last step's columns; an id
    that comes back as a new request must not find the old request's matcher there."""
    geometry = make_geometry()
    again = make_request("r0", [30, 31, 32], max_new_tokens=4, ignore_eos=True)
    *_, text = expected_generation(again, geometry)
    scheduler = make_scheduler(geometry)
    # The first "r0" would stop at the second letter the second one streams.
    scheduler.add(make_request("r0", [40, 41], max_new_tokens=8, stop_strings=(text[1],)), 0.0)
    plan = scheduler.schedule(0.0)
    scheduler.apply(FakeWorker(geometry).step(plan), 0.0)
    assert scheduler.cancel("r0", 0.5).finish_reason is FinishReason.CANCELLED
    scheduler.add(again, 1.0)
    streams = drive(scheduler, FakeWorker(geometry))
    assert (streams["r0"].text, streams["r0"].finish_reason) == (text, FinishReason.LENGTH)


def test_the_text_stage_returns_stop_string_hits_and_the_loop_ends_them_in_the_core():
    """Text after the core (issue 25, item 2): the output processor holds no scheduler; it
    returns the outputs its stop strings finished, and apply_step ends them in the core,
    with their usage, before the next schedule()."""
    pieces = {50: "ab", 51: "cd"}
    core = Scheduler(SchedulerConfig())
    core.attach_worker(make_geometry(eos_token_ids=[EOS]))
    processor = OutputProcessor(lambda: ScriptedDetokenizer(pieces))

    def add(request_id: str) -> None:
        request = make_request(request_id, prompt=[7, 7, 7], stop_strings=("c",))
        core.add(request, 0.0)
        processor.open(request)

    def result(token_id: int) -> StepResult:
        plan = core.schedule(0.0)
        return StepResult(plan.step_id, plan.seq_ids, [token_id])

    add("r0")
    step = core.apply(result(50), 0.0)
    assert processor.process_step(step) == [] and step.texts == ["ab"]
    step = core.apply(result(51), 0.0)
    (stopped,) = processor.process_step(step)
    assert (stopped.request_id, stopped.text, stopped.token_ids) == ("r0", "", [51])
    assert stopped.finish_reason is FinishReason.STOP and stopped.usage is None
    assert step.request_ids == [] and step.outputs == [stopped]
    assert core.holds("r0")  # the text stage ended nothing in the core
    core.stop("r0", 0.0)
    add("r1")
    apply_step(core, processor, result(50), 0.0)
    step = apply_step(core, processor, result(51), 0.0)
    (stopped,) = step.outputs
    assert stopped.finish_reason is FinishReason.STOP and stopped.usage is not None
    assert not core.holds("r1")
