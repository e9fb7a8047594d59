"""Structured output end to end (issue 28 item 3): a scheduler, a tiny random-weight model
on a real worker, and the gRPC API. Every output of several schemas over 54 requests,
greedy and sampled, parses and validates; regex and choice constraints match; an invalid
constraint is INVALID_ARGUMENT before any work. All of it with serial steps and with
overlapped ones (the masks of rows planned ahead follow their plan). A random model with
no constraint writes no JSON at all, so each valid output is the mask's doing."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagoda.protos import generation_pb2 as pb
from pagoda.protos import generation_pb2_grpc
from tests.e2e.conftest import running_service

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 96
PROMPTS = ["The quick", "Paris is", "Write a haiku", "Berlin", "brown fox", "salt wind",
           "over the lazy", "capital of", "waves fold"]  # fmt: skip

SCHEMAS = {
    "enum": (
        {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
            "required": ["answer"],
            "additionalProperties": False,
        },
        lambda value: set(value) == {"answer"} and value["answer"] in ("yes", "no", "maybe"),
    ),
    "two fields": (
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
            "required": ["ok", "level"],
            "additionalProperties": False,
        },
        lambda value: (
            set(value) == {"ok", "level"}
            and isinstance(value["ok"], bool)
            and value["level"] in (1, 2, 3)
        ),
    ),
    "array": (
        {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        lambda value: (
            isinstance(value, list)
            and 1 <= len(value) <= 3
            and all(isinstance(v, bool) for v in value)
        ),
    ),
}


@pytest.fixture(scope="module", params=["serial", "overlapped"])
def service(request, tiny_model_factory, tmp_path_factory):
    """Serial steps, and overlapped ones: there a constrained row is planned ahead of its
    token and its mask follows the plan (StepMasks), computed while the worker runs."""
    with running_service(
        tmp_path_factory.mktemp("structured"),
        model=str(tiny_model_factory("llama")),
        scheduler_args=[f"--{'' if request.param == 'overlapped' else 'no-'}overlap-steps"],
    ) as running:
        yield running


def generate(service, constraint: pb.Constraint, prompt: str, sampling: pb.SamplingParams):
    request = pb.GenerateRequest(
        prompt=prompt,
        sampling=sampling,
        stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW_TOKENS),
        constraint=constraint,
    )
    with service.channel() as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300))
    return "".join(r.text for r in responses), responses[-1].finish_reason


def samplings():
    yield "greedy", pb.SamplingParams()
    yield "sampled", pb.SamplingParams(temperature=1.0, seed=7)


def test_every_output_of_several_schemas_is_valid_json(service):
    cases = [
        (name, mode, prompt, sampling)
        for name in SCHEMAS
        for mode, sampling in samplings()
        for prompt in PROMPTS
    ]
    assert len(cases) >= 50

    def run(case):
        name, _, prompt, sampling = case
        constraint = pb.Constraint(json_schema=json.dumps(SCHEMAS[name][0]))
        return generate(service, constraint, prompt, sampling)

    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(run, cases))
    for (name, mode, prompt, _), (text, finish_reason) in zip(cases, outputs, strict=True):
        assert finish_reason == pb.STOP, (name, mode, prompt, text)
        assert SCHEMAS[name][1](json.loads(text)), (name, mode, prompt, text)
    assert len({text for text, _ in outputs}) > len(SCHEMAS)  # not one fixed answer each


def test_regex_choice_and_json_object(service):
    for mode, sampling in samplings():
        text, _ = generate(service, pb.Constraint(regex=r"[0-9]{3}-[a-c]{2}"), "The", sampling)
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", text), (mode, text)
        choices = ["red", "green", "light blue"]
        text, _ = generate(
            service, pb.Constraint(choice=pb.Choices(choices=choices)), "Paris", sampling
        )
        assert text in choices, (mode, text)
        grammar = 'root ::= "x" [0-9] "y"'
        text, _ = generate(service, pb.Constraint(gbnf_grammar=grammar), "Paris", sampling)
        assert re.fullmatch(r"x[0-9]y", text), (mode, text)


def test_json_object_is_an_object_or_runs_out_of_tokens(service):
    text, finish_reason = generate(
        service, pb.Constraint(json_object=True), "The quick", pb.SamplingParams()
    )
    if finish_reason == pb.STOP:  # a random model may keep a string open to the length limit
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize(
    ("constraint", "phrase"),
    [
        (pb.Constraint(json_schema="{not json"), "constraint.json_schema"),
        (pb.Constraint(json_schema='{"type": "nope"}'), "constraint.json_schema"),
        (pb.Constraint(regex="a(b"), "constraint.regex"),
        (pb.Constraint(lark_grammar="start: missing_rule"), "constraint.lark_grammar"),
        (pb.Constraint(choice=pb.Choices()), "constraint.choice"),
    ],
)
def test_an_invalid_constraint_is_invalid_argument(service, constraint, phrase):
    num_steps = service.stats().num_steps
    with pytest.raises(grpc.RpcError) as refused:
        generate(service, constraint, "The", pb.SamplingParams())
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert phrase in refused.value.details()
    assert service.stats().num_steps == num_steps  # refused before any work


def test_each_of_n_constrained_samples_has_its_own_matcher(service):
    schema, valid = SCHEMAS["two fields"]
    request = pb.GenerateRequest(
        prompt="The quick",
        sampling=pb.SamplingParams(temperature=1.0, seed=3),
        stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW_TOKENS),
        constraint=pb.Constraint(json_schema=json.dumps(schema)),
        n=4,
    )
    with service.channel() as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300))
    texts = {index: "" for index in range(4)}
    for response in responses:
        texts[response.index] += response.text
    finals = [r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted((r.index, r.finish_reason) for r in finals) == [(i, pb.STOP) for i in range(4)]
    for text in texts.values():
        assert valid(json.loads(text)), text
