"""Factories for the scheduler-core tests: requests, schedulers, a scripted detokenizer,
and a driver that runs a scheduler against the in-process fake worker."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import llguidance
import pytest

from pagoda.common import wire
from pagoda.common.dummy_tokens import dummy_next_token
from pagoda.protos import step_pb2
from pagoda.scheduler_svc.core import (
    FinishReason,
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepOutputs,
    StepPlan,
    StepResult,
    ValidRequest,
    ValidStopping,
    WorkerGeometry,
)
from pagoda.scheduler_svc.core.request import RequestState
from pagoda.scheduler_svc.grammars import GrammarCompiler
from pagoda.scheduler_svc.output_processor import OutputProcessor
from pagoda.scheduler_svc.step_loop import apply_step
from pagoda.scheduler_svc.testing import FakeWorker
from pagoda.scheduler_svc.tokenizer import TextTokenizer, load_tokenizer
from tests.conftest import TINY_VOCAB_SIZE

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def make_sampling(num_logprobs: int = 0, seed: int = 0) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=seed,
        num_logprobs=num_logprobs,
    )


def make_request(
    request_id: str = "r0",
    prompt: Iterable[int] | int = 8,
    *,
    max_new_tokens: int = 4,
    min_new_tokens: int = 0,
    stop_strings: tuple[str, ...] = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    priority: int = 0,
    num_logprobs: int = 0,
) -> ValidRequest:
    """A request; an int prompt means that many tokens (distinct per request id)."""
    if isinstance(prompt, int):
        base = sum(map(ord, request_id)) * 7
        prompt = [(base + index) % 97 + 3 for index in range(prompt)]
    return ValidRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        sampling=make_sampling(num_logprobs),
        stopping=ValidStopping(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            stop_strings=stop_strings,
            stop_token_ids=frozenset(stop_token_ids),
            ignore_eos=ignore_eos,
        ),
        priority=priority,
    )


def make_geometry(
    num_kv_blocks: int = 64,
    block_size: int = 4,
    max_context_tokens: int = 512,
    eos_token_ids: Iterable[int] = (),
    vocab_size: int = 1000,
) -> WorkerGeometry:
    return WorkerGeometry(
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_context_tokens=max_context_tokens,
        eos_token_ids=frozenset(eos_token_ids),
        vocab_size=vocab_size,
    )


def make_hello(**fields) -> step_pb2.Hello:
    """A worker's hello the scheduler accepts; `fields` override its values."""
    values = dict(
        protocol_version=wire.PROTOCOL_VERSION,
        incarnation_id="abc",
        vocab_size=100,
        eos_token_ids=[2],
        max_context_tokens=512,
        block_size=16,
        num_kv_blocks=64,
    )
    values.update(fields)
    return step_pb2.Hello(**values)


class LetterDetokenizer:
    """Token id -> one letter; stands in for a real detokenizer in scheduler tests."""

    whole_texts = ()  # no table to look texts up in: the output processor calls push()

    def push(self, token_id: int) -> str:
        return LETTERS[token_id % 26]

    def flush(self) -> str:
        return ""


class TextScheduler:
    """The core Scheduler as the front and the step loop drive it: a request added to the
    core, then its text state opened; every output it returns given its text by the
    processor at once (a step's right after apply(), with its stop strings ended in the
    core: step_loop.apply_step). Other attributes are the Scheduler's."""

    def __init__(self, scheduler: Scheduler, processor: OutputProcessor) -> None:
        self.core = scheduler
        self.processor = processor

    def __getattr__(self, name: str):
        return getattr(self.core, name)

    def add(self, request: ValidRequest, now: float) -> None:
        self.core.add(request, now)
        self.processor.open(request)

    def apply(self, result: StepResult, now: float) -> StepOutputs:
        return apply_step(self.core, self.processor, result, now)

    def cancel(self, request_id: str, now: float, *args) -> RequestOutput | None:
        output = self.core.cancel(request_id, now, *args)
        return self.processor.process([output])[0] if output is not None else None

    def attach_worker(self, geometry: WorkerGeometry) -> list[RequestOutput]:
        return self.processor.process(self.core.attach_worker(geometry))

    def fail_step(self, plan: StepPlan, error: str, now: float) -> list[RequestOutput]:
        return self.processor.process(self.core.fail_step(plan, error, now))


def make_scheduler(
    geometry: WorkerGeometry | None = None,
    detokenizer_factory: Callable[[], object] = LetterDetokenizer,
    **knobs,
) -> TextScheduler:
    """A Scheduler with a worker of `geometry` (make_geometry() by default) attached, and
    its output processor."""
    scheduler = Scheduler(SchedulerConfig(**knobs))
    processor = OutputProcessor(detokenizer_factory)  # type: ignore[arg-type]
    text_scheduler = TextScheduler(scheduler, processor)
    text_scheduler.attach_worker(geometry or make_geometry())
    return text_scheduler


def repeating_next_token(
    last_token_id: int, last_position: int, vocab_size: int, banned_token_ids=()
) -> int:
    """A model for FakeWorker whose output repeats itself, so that speculation's drafts
    are often right: the token after the last one in a cycle of five, skipping one at
    every 13th position; banned ids are skipped as dummy_next_token skips them."""
    token_id = (last_token_id + (2 if last_position % 13 == 12 else 1)) % 5
    for _ in range(vocab_size):
        if token_id not in banned_token_ids:
            return token_id
        token_id = (token_id + 1) % vocab_size
    return token_id


def expected_generation(
    request: ValidRequest, geometry: WorkerGeometry, next_token: Callable = dummy_next_token
) -> tuple[list[int], FinishReason, str]:
    """What the model (the dummy's unless `next_token`) streams for `request` alone (token
    ids, finish reason, text with LetterDetokenizer): the reference any schedule must
    reproduce."""
    tokens = list(request.prompt_token_ids)
    stopping = request.stopping
    generated: list[int] = []
    text = ""
    active_from: int | None = None  # where stop strings start counting
    ending_ids = set(stopping.stop_token_ids)
    if not stopping.ignore_eos:
        ending_ids |= geometry.eos_token_ids
    while True:
        # The worker masks the ending ids until min_new_tokens are generated.
        banned = ending_ids if len(generated) < stopping.min_new_tokens else ()
        token_id = next_token(tokens[-1], len(tokens) - 1, geometry.vocab_size, banned)
        tokens.append(token_id)
        generated.append(token_id)
        allowed = len(generated) > stopping.min_new_tokens
        if token_id in ending_ids:
            return generated, FinishReason.STOP, text
        if allowed and active_from is None:
            active_from = len(text)
        text += LETTERS[token_id % 26]
        if active_from is not None:
            starts = [text.find(stop, active_from) for stop in stopping.stop_strings]
            starts = [start for start in starts if start >= 0]
            if starts:
                return generated, FinishReason.STOP, text[: min(starts)]
        if len(generated) >= stopping.max_new_tokens or len(tokens) >= geometry.max_context_tokens:
            return generated, FinishReason.LENGTH, text


@dataclass
class Stream:
    """Everything one request streamed."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    num_events_after_finish: int = 0
    usage: object = None

    def take(self, output: RequestOutput) -> None:
        if self.finish_reason is not None:
            self.num_events_after_finish += 1
        self.token_ids.extend(output.token_ids)
        self.text += output.text
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            self.usage = output.usage


def check_invariants(scheduler: TextScheduler) -> None:
    """Block ownership and request states agree with the allocator, exactly; the output
    processor holds the text of exactly the unfinished requests."""
    state = scheduler.core._planner
    requests = scheduler.core._requests
    assert len(scheduler.processor) == len(requests)
    blocks = state.blocks
    if blocks is None:
        assert not state.running
        return
    allocator = blocks.allocator
    assert (
        allocator.num_used_blocks + allocator.num_free_blocks + allocator.num_retained_blocks
        == allocator.num_total_blocks
    )
    assert blocks.num_cached_free_blocks == allocator.num_retained_blocks
    owners: dict[int, int] = defaultdict(int)
    for seq_id, request in state.running.items():
        assert request.state is RequestState.RUNNING and request.seq_id == seq_id
        assert len(set(request.block_ids)) == len(request.block_ids), "a block owned twice"
        # Exactly the blocks its computed tokens fill: the decode planner relies on it.
        assert len(request.block_ids) == -(-request.num_computed_tokens // blocks.block_size)
        for block_id in request.block_ids:
            owners[block_id] += 1
    for block_id in range(allocator.num_total_blocks):
        assert allocator.ref_count(block_id) == owners.get(block_id, 0), block_id
        if allocator.is_free(block_id):
            assert blocks.block_hash(block_id) is None
    assert sum(1 for _ in owners) == allocator.num_used_blocks
    for request in state.waiting:
        assert request.state is RequestState.WAITING and not request.block_ids
    assert set(state.prefilling) <= set(state.running)
    held = scheduler.core._held
    assert all(request.state is RequestState.HELD for request in held)
    assert len(state.running) + len(state.waiting) + len(held) == len(requests)


def apply_scripts(
    scheduler: TextScheduler, scripts: list[list[int]]
) -> dict[str, list[RequestOutput]]:
    """Run `scheduler` until it has no work, request f"r{i}" sampling `scripts[i]` in order
    (one token per event it streams); each must have been added with a prompt starting with
    100 + i, which names it in the plan. Returns each request's events."""
    index_of_seq: dict[int, int] = {}
    events: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(len(scripts))}
    while (plan := scheduler.schedule(0.0)) is not None:
        sampled_ids, sampled_tokens = [], []
        for i, seq_id in enumerate(plan.seq_ids):
            first_fed = plan.token_ids[plan.token_offsets[i]]
            index = index_of_seq.setdefault(seq_id, first_fed - 100)
            if plan.sample[i]:
                sampled_ids.append(seq_id)
                sampled_tokens.append(scripts[index][len(events[f"r{index}"])])
        for output in scheduler.apply(StepResult(plan.step_id, sampled_ids, sampled_tokens), 0.0):
            assert len(output.token_ids) == 1, output
            events[output.request_id].append(output)
        check_invariants(scheduler)
    return events


def plan_within_budget(plan: StepPlan, config: SchedulerConfig) -> bool:
    """The step's tokens fit max_num_batched_tokens, except an oversize prompt admitted
    whole without chunked prefill (it goes alone among the admissions)."""
    if plan.num_tokens <= config.max_num_batched_tokens:
        return True
    if config.chunked_prefill:
        return False
    step_prefill = min(config.max_num_batched_tokens, config.prefill_max_tokens or 10**9)
    new_ids = {new.seq_id for new in plan.new_sequences}
    sizes = [
        plan.token_offsets[i + 1] - plan.token_offsets[i]
        for i, seq_id in enumerate(plan.seq_ids)
        if seq_id in new_ids
    ]
    return len(sizes) == 1 and sizes[0] > step_prefill


def caps_violated(plan: StepPlan, scheduler: TextScheduler) -> str | None:
    """Which per-step cap of DESIGN §3 this plan breaks, if any (None: all kept)."""
    config = scheduler.config
    if config.max_decode_batch_size and plan.num_decode_tokens > config.max_decode_batch_size:
        return f"{plan.num_decode_tokens} decodes > max_decode_batch_size"
    num_admitted = len(plan.new_sequences)
    if config.prefill_max_batch_size and num_admitted > config.prefill_max_batch_size:
        return f"{num_admitted} admissions > prefill_max_batch_size"
    num_running = len(scheduler.core._planner.running)
    if num_running > config.max_active_requests:
        return f"{num_running} running > max_active_requests"
    step_prefill = min(config.max_num_batched_tokens, config.prefill_max_tokens or 10**9)
    if plan.num_prefill_tokens > step_prefill and (config.chunked_prefill or num_admitted > 1):
        # Only an oversize prompt admitted whole and alone (no chunking) may exceed it.
        return f"{plan.num_prefill_tokens} prefill tokens > {step_prefill}"
    return None


def drive(
    scheduler: TextScheduler,
    worker: FakeWorker,
    streams: dict[str, Stream] | None = None,
    *,
    max_steps: int = 10_000,
    stop_early: bool = False,
    on_step: Callable[[int, StepPlan], None] | None = None,
) -> dict[str, Stream]:
    """Run steps until the scheduler has no work (or `max_steps` with `stop_early`);
    returns each request's stream."""
    streams = streams if streams is not None else defaultdict(Stream)
    for step in range(max_steps):
        plan = scheduler.schedule(now=float(step))
        if plan is None:
            assert not scheduler.has_work(), "work left but nothing scheduled"
            return streams
        assert plan_within_budget(plan, scheduler.config)
        assert caps_violated(plan, scheduler) is None, caps_violated(plan, scheduler)
        if on_step is not None:
            on_step(step, plan)
        for output in scheduler.apply(worker.step(plan), now=float(step) + 0.5):
            streams[output.request_id].take(output)
        check_invariants(scheduler)
    if stop_early:
        return streams
    raise AssertionError(f"not done after {max_steps} steps")


@pytest.fixture(scope="session")
def tokenizer(default_model_dir) -> TextTokenizer:
    """The default model's tokenizer (SmolLM2's; its template takes no tools)."""
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer_dir) -> GrammarCompiler:
    """The structured-output compiler on the tiny tokenizer's vocabulary."""
    return GrammarCompiler(lambda: (tiny_tokenizer_dir / "tokenizer.json").read_text())


@pytest.fixture(scope="module")
def tiny_llg_tokenizer(tiny_tokenizer_dir) -> llguidance.LLTokenizer:
    """llguidance's view of the tiny tokenizer (TINY_VOCAB_SIZE ids)."""
    return llguidance.LLTokenizer(
        (tiny_tokenizer_dir / "tokenizer.json").read_text(), n_vocab=TINY_VOCAB_SIZE
    )
