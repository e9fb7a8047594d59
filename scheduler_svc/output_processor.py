"""The text side of each step: incremental detokenization and stop strings, run by the step
loop once per step right after Scheduler.apply() (and on every other output it publishes).
It comes after the core and never calls it: the loop ends in the core what it ends.

The core streams token ids and ends requests on their ids and lengths alone
(`check_stop`). This module turns each request's tokens into what its client may see:
- whole UTF-8 characters only (IncrementalDetokenizer); a character left incomplete when
  the request ends becomes U+FFFD, as tokenizer.decode does;
- stop strings are matched on the text, across token boundaries. A match ends the request
  with STOP: process_step returns its finishing output, and the step loop ends it in the
  core (Scheduler.stop) before the next schedule(). The token that completed it is
  returned, the stop string and anything after it are not. Text that could be the
  start of a stop string is held back until the next tokens settle it, and released when
  the request ends any other way;
- no stop string counts until min_new_tokens tokens precede the token (as for stop ids);
- a stop token id or EOS ended the request in the core: its text is not streamed;
- a Chat request with tools has its output read for calls (tool_calls.py): text that may
  begin a call is held, and the calls come with the finishing output. Calls that stream
  (ChatRequest.stream_tool_calls) are read at the edge instead (tool_call_stream.py).

One OutputProcessor per scheduler, called from the step loop only; it owns the text state
of every unfinished request, opened by `open` once the scheduler took the request and
dropped with the request's last output (the lanes' processors share one dict of them). A
token of a request with no text state breaks that invariant: the request ends with ERROR
and the step goes on for the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pagoda.scheduler_svc.core import FinishReason, RequestOutput, StepOutputs, ValidRequest
from pagoda.scheduler_svc.core.request import sample_request_ids
from pagoda.scheduler_svc.detokenizer import IncrementalDetokenizer
from pagoda.scheduler_svc.reasoning import Thinking
from pagoda.scheduler_svc.stop_strings import StopStringMatcher
from pagoda.scheduler_svc.tool_calls import ToolCallReader
from pagoda.scheduler_svc.tools import ValidTools

log = logging.getLogger("pagoda.output_processor")

_STOP = FinishReason.STOP
_ERROR = FinishReason.ERROR
_NO_TEXT_STATE = "internal error: the server lost this request's text state"
# How far past the cursor a request is looked for before the dict: the requests that left
# the running set between two steps at that point of the column.
RESYNC_ENTRIES = 4


# A request's text state: its detokenizer, and its matcher: a reader of tool calls (which
# runs the stop strings' matcher first) when its tools are read, else the stop strings'
# matcher, None without stop strings.
Matcher = StopStringMatcher | ToolCallReader
TextState = tuple[IncrementalDetokenizer, Matcher | None]


class OutputProcessor:
    def __init__(
        self,
        detokenizer_factory: Callable[[], IncrementalDetokenizer],
        texts: dict[str, TextState] | None = None,
    ) -> None:
        self._new_detokenizer = detokenizer_factory
        # The text state of each unfinished request, by request id; `texts` when given:
        # the lanes' processors share theirs, so it follows a request from lane to lane.
        self._texts: dict[str, TextState] = texts if texts is not None else {}
        # The last step's column of request ids and their text states, in step: a step's
        # columns come in the running set's order, which only finishes, preemptions and
        # admissions change, so most requests are found by comparing a pointer with the
        # entry at a cursor rather than by a dict lookup (which reads the id's string and
        # the dict's entry: two cache lines a token at hundreds running).
        self._last_ids: list[str] = []
        self._last_detokenizers: list[IncrementalDetokenizer] = []
        self._last_matchers: list[Matcher | None] = []

    def open(self, request: ValidRequest) -> None:
        """Open the text state of `request`, which the scheduler has just taken."""
        stopping, tools = request.stopping, request.tools
        for request_id in sample_request_ids(request.request_id, request.n):  # one per sample
            matcher: Matcher | None = (
                StopStringMatcher(stopping.stop_strings, stopping.min_new_tokens)
                if stopping.stop_strings
                else None
            )
            if isinstance(tools, ValidTools) and tools.reads_calls:
                matcher = _call_reader(tools, matcher, request.thinking)
            self._texts[request_id] = (self._new_detokenizer(), matcher)

    def __len__(self) -> int:
        """Requests whose text state is open."""
        return len(self._texts)

    def process_step(self, step: StepOutputs) -> list[RequestOutput]:
        """Fill in the text of apply()'s outputs, in place, and finish the requests whose
        text reached a stop string: returns their finishing outputs (in `step.outputs`,
        their column entries gone), for the caller to end in the core (Scheduler.stop, or
        cancel with ERROR for one without a text state) before the next schedule()."""
        texts = step.texts
        stopped: list[int] = []
        orphans: list[int] = []  # entries with no text state (an invariant broke)
        last_ids, last_detokenizers, last_matchers = (
            self._last_ids,
            self._last_detokenizers,
            self._last_matchers,
        )
        num_last, cursor = len(last_ids), 0
        detokenizers: list[IncrementalDetokenizer] = []
        matchers: list[Matcher | None] = []
        # The hot loop: one token per running request. The detokenizer's and the
        # matcher's common cases are looked up here rather than called.
        for request_id, token_id in zip(step.request_ids, step.token_ids, strict=True):
            if cursor < num_last and last_ids[cursor] is request_id:
                detokenizer, matcher = last_detokenizers[cursor], last_matchers[cursor]
                cursor += 1
            else:
                detokenizer, matcher, cursor = self._find(request_id, cursor)
                if detokenizer is None:
                    orphans.append(len(texts))
                    detokenizers.append(None)  # type: ignore[arg-type]
                    matchers.append(None)
                    texts.append("")
                    continue
            detokenizers.append(detokenizer)
            matchers.append(matcher)
            # An exception rather than a test for the rare case: a try costs nothing in 3.11.
            try:
                text = detokenizer.whole_texts[token_id]  # ids are unsigned on the wire
            except IndexError:
                text = None  # a character is partial, or the id is beyond the table
            if text is None:
                text = detokenizer.push(token_id)
            if matcher is not None and (
                matcher.held_text or matcher.trigger in text or matcher.num_tokens_inactive
            ):
                text, hit = matcher.push(text)
                if hit:
                    stopped.append(len(texts))  # this entry's index
            texts.append(text)
        ended = [output for output in step.outputs if self._process(output)]
        if orphans:
            stopped = sorted(stopped + orphans)
        if stopped:
            ended += self._end_stopped(step, stopped)
            for index in reversed(stopped):
                del detokenizers[index], matchers[index]
        self._last_ids, self._last_detokenizers, self._last_matchers = (
            step.request_ids,
            detokenizers,
            matchers,
        )
        return ended

    def _find(
        self, request_id: str, cursor: int
    ) -> tuple[IncrementalDetokenizer | None, Matcher | None, int]:
        """The text state of a request not at the cursor, and the cursor after it: a few
        entries ahead when the ones between left the running set, else from the dict (a
        request new to the columns; the cursor stays). None for a request whose text state
        is missing, which must not happen: it is ended (_end_stopped), the others go on."""
        last_ids = self._last_ids
        for ahead in range(cursor + 1, min(cursor + 1 + RESYNC_ENTRIES, len(last_ids))):
            if last_ids[ahead] is request_id:
                return self._last_detokenizers[ahead], self._last_matchers[ahead], ahead + 1
        state = self._texts.get(request_id)
        if state is None:
            log.error("request %r sampled a token but has no text state; it ends", request_id)
            return None, None, cursor
        return state[0], state[1], cursor

    def process(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Fill in the text of outputs from outside a step (cancels, a new worker's
        refusals, a lost step's), in place. They carry no token, so nothing matches."""
        if outputs:
            # A finished id may come back as a new request: the last step's states are
            # no longer to be found by the id alone.
            self._last_ids, self._last_detokenizers, self._last_matchers = [], [], []
        for output in outputs:
            hit = self._process(output)
            assert not hit, "a stop string outside a step"
        return outputs

    def _process(self, output: RequestOutput) -> bool:
        """Fill in the text of one whole output; True if it reached a stop string, which
        makes it a STOP (the request is still to end in the core)."""
        request_id = output.request_id
        state = self._texts.get(request_id)
        if state is None:
            return False  # not opened through this processor
        detokenizer, matcher = state
        reason = output.finish_reason
        token_ids = output.token_ids
        text = ""
        # Several tokens come from a speculative step; a stop token's text is not streamed.
        for index in range(len(token_ids) - 1 if reason is _STOP else len(token_ids)):
            piece = detokenizer.push(token_ids[index])
            if matcher is not None:
                piece, hit = matcher.push(piece)
                if hit:
                    _drop_after(output, index + 1)
                    output.text, output.finish_reason = text + piece, _STOP
                    _end_text(output, matcher)
                    self._close(request_id)
                    return reason is None  # the core ended it already otherwise
            text += piece
        output.text = text
        if reason is not None:
            # Text that waited (a possible stop string's start or tool call, a partial
            # character) is final now.
            _end_text(output, matcher, detokenizer.flush())
            self._close(request_id)
        return False

    def _end_stopped(self, step: StepOutputs, indices: list[int]) -> list[RequestOutput]:
        """Move the column entries at `indices` to finishing outputs, appended to
        `step.outputs` and returned: STOP, with the text before the stop string; ERROR for
        a request without a text state."""
        request_ids, token_ids, texts = step.request_ids, step.token_ids, step.texts
        ended: list[RequestOutput] = []
        for index in reversed(indices):
            request_id = request_ids[index]
            state = self._texts.get(request_id)
            if state is not None:
                output = RequestOutput(
                    request_id, texts[index], [token_ids[index]], None, finish_reason=_STOP
                )
                _end_text(output, state[1])
                self._close(request_id)
            else:
                output = RequestOutput(
                    request_id, "", [], None, finish_reason=_ERROR, error_message=_NO_TEXT_STATE
                )
            ended.append(output)
            del request_ids[index], token_ids[index], texts[index]
        step.outputs += ended
        return ended

    def _close(self, request_id: str) -> None:
        del self._texts[request_id]


def _call_reader(
    tools: ValidTools, stop: StopStringMatcher | None, thinking: object
) -> Matcher | None:
    """The matcher of a sample whose output is read for calls: a reader, which holds the
    calls' text (or with streamed calls, which the edge reads, passes it and only looks for
    the close that ends the sample); None where nothing is left to do. Constrained calls
    are JSON, not text a stop string could end."""
    if tools.constrained:
        stop = None
    if tools.streams and not tools.ends_at_first_close:
        return stop
    return ToolCallReader(tools, stop, thinking if isinstance(thinking, Thinking) else None)


def _drop_after(output: RequestOutput, num_kept: int) -> None:
    """A stop string ended the text at token `num_kept` of the output's (a speculative
    step's): the tokens after it were never decoded as far as the client knows. They
    leave the output and its usage, and the core drops them (Scheduler.stop)."""
    num_dropped = len(output.token_ids) - num_kept
    if not num_dropped:
        return
    del output.token_ids[num_kept:]
    if output.logprobs is not None:
        del output.logprobs[num_kept:]
    if output.usage is not None:
        output.usage.completion_tokens -= num_dropped
    output.num_dropped_tokens = num_dropped


def _end_text(output: RequestOutput, matcher: Matcher | None, tail: str = "") -> None:
    """Add a request's last text to its finishing output: what its matcher held, then
    `tail` (not matched); and the calls of tools a reader read."""
    if matcher is not None:
        tail = matcher.flush(tail)
    output.text += tail
    if isinstance(matcher, ToolCallReader):
        output.tool_calls = matcher.calls
