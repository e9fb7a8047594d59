"""The peers Pagoda is compared with: plain `transformers` in this process, same model, same prompts.

- `hf generate()`: one request at a time, in arrival order.
- `hf static bN`: left-padded batches of N (`STATIC_BATCH_SIZE`) in arrival order; a batch
  starts when the previous one has finished.
- `hf generate_batch`: transformers' own continuous batching (paged KV cache, one call for the
  whole burst), with a KV cache and step budget sized for the workload (its defaults size the
  cache from free memory, several GiB on a CPU, and are several times slower here).

Every request of a burst arrives at t=0, the moment the peer starts the burst; each token's
time is taken when the peer produced it (a streamer for generate(), transformers' own
per-token timestamps for generate_batch), and becomes a `RequestResult` with one chunk per
token, so `summarize` computes exactly the metrics it computes for Pagoda.

torch and transformers are imported only when a peer runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.scenarios import PEER_CONTINUOUS, PEER_GENERATE, PEER_STATIC, STATIC_BATCH_SIZE
from pagoda.client.bench_config import BenchConfig
from pagoda.client.bench_report import BenchReport, RequestResult, summarize
from pagoda.client.bench_workload import build_prompts
from pagoda.client.results import Usage

# generate_batch's step budget and KV page size (tokens); its cache gets enough pages for the
# whole burst at once.
CONTINUOUS_MAX_BATCH_TOKENS = 512
CONTINUOUS_PAGE_SIZE = 64


def request_result_from_token_times(
    index: int,
    token_times_s: Sequence[float],
    end_s: float,
    num_prompt_tokens: int,
    send_s: float = 0.0,
) -> RequestResult:
    """One peer request as the load generator would have recorded it: one chunk per token.

    Times are seconds since the burst started; `end_s` is when the peer returned it.
    """
    return RequestResult(
        index=index,
        send_s=send_s,
        chunk_times_s=list(token_times_s),
        chunk_num_tokens=[1] * len(token_times_s),
        end_s=max(end_s, token_times_s[-1]) if token_times_s else end_s,
        finish_reason="length",
        usage=Usage(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=len(token_times_s),
            cached_prompt_tokens=0,
        ),
    )


def prompt_token_ids(tokenizer: Any, config: BenchConfig, run_tag: str) -> list[list[int]]:
    """The token ids of the prompts the load generator sends for `config` (every peer is
    given these, so all of them compute the same prompts)."""
    prompts = build_prompts(config, run_tag)
    return [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]


@dataclass(slots=True)
class PeerRun:
    """A peer's report on a workload, with a note when it served only part of it."""

    report: BenchReport
    num_requests_of_workload: int

    @property
    def note(self) -> str | None:
        served = self.report.num_requests_sent
        if served >= self.num_requests_of_workload:
            return None
        return f"first {served} of {self.num_requests_of_workload} requests only"


class Peers:
    """The model and tokenizer loaded once, in float32 on the CPU (bfloat16 on CUDA)."""

    def __init__(self, model_dir: str, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model = model.to(device).eval()
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id

    def prompt_ids(self, config: BenchConfig, run_tag: str) -> list[list[int]]:
        """The token ids of the prompts the load generator sends for `config`."""
        return prompt_token_ids(self.tokenizer, config, run_tag)

    def run(self, peer: str, config: BenchConfig, run_tag: str, max_requests: int) -> PeerRun:
        """Serve the first `max_requests` requests of `config` as one burst with `peer`."""
        runners: dict[str, Callable[[list[list[int]], BenchConfig], list[RequestResult]]] = {
            PEER_GENERATE: self._generate_one_by_one,
            PEER_STATIC: self._static_batches,
            PEER_CONTINUOUS: self._continuous_batching,
        }
        all_ids = self.prompt_ids(config, run_tag)
        ids = all_ids[:max_requests]
        self._warm_up(peer, config)
        start_s = time.perf_counter()
        results = runners[peer](ids, config)
        duration_s = time.perf_counter() - start_s
        report = summarize(config, run_tag, results, duration_s, num_preemptions=None)
        return PeerRun(report, len(all_ids))

    def _warm_up(self, peer: str, config: BenchConfig) -> None:
        # First calls pay one-time costs (allocator, kernels); keep them out of the burst.
        ids = [self.tokenizer(f"[warm-up {n}] the of and", add_special_tokens=True)["input_ids"]
               for n in range(2)]  # fmt: skip
        short = BenchConfig(num_requests=2, max_new_tokens=4, ignore_eos=True)
        if peer == PEER_CONTINUOUS:
            self._continuous_batching(ids, short)
        else:
            self._static_batches(ids, short)

    def _generation_kwargs(self, config: BenchConfig) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "max_new_tokens": config.max_new_tokens,
            "do_sample": False,
            "pad_token_id": self.pad_token_id,
        }
        if config.ignore_eos:
            # EOS can never be sampled before max_new_tokens: the same token count as
            # Pagoda's ignore_eos.
            kwargs["min_new_tokens"] = config.max_new_tokens
        return kwargs

    def _generate_one_by_one(
        self, ids: list[list[int]], config: BenchConfig
    ) -> list[RequestResult]:
        start_s = time.perf_counter()
        results = []
        for index, prompt in enumerate(ids):
            results += self._generate_batch_of(index, [prompt], config, start_s)
        return results

    def _static_batches(self, ids: list[list[int]], config: BenchConfig) -> list[RequestResult]:
        start_s = time.perf_counter()
        results = []
        for first in range(0, len(ids), STATIC_BATCH_SIZE):
            batch = ids[first : first + STATIC_BATCH_SIZE]
            results += self._generate_batch_of(first, batch, config, start_s)
        return results

    def _generate_batch_of(
        self, first_index: int, batch: list[list[int]], config: BenchConfig, start_s: float
    ) -> list[RequestResult]:
        """One left-padded `generate()` call; every row's token k arrives at step k's time."""
        torch = self.torch
        width = max(len(prompt) for prompt in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        streamer = make_step_timer()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                streamer=streamer,
                **self._generation_kwargs(config),
            )
        end_s = time.perf_counter() - start_s
        step_times_s = [t - start_s for t in streamer.step_times_s]
        eos_ids = set() if config.ignore_eos else self._eos_ids()
        results = []
        for row, prompt in enumerate(batch):
            generated = output[row, width:].tolist()
            count = _completion_length(generated, eos_ids)
            results.append(
                request_result_from_token_times(
                    first_index + row, step_times_s[:count], end_s, len(prompt)
                )
            )
        return results

    def _continuous_batching(
        self, ids: list[list[int]], config: BenchConfig
    ) -> list[RequestResult]:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        eos = None if config.ignore_eos else self.tokenizer.eos_token_id
        generation_config = GenerationConfig(
            max_new_tokens=config.max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=self.pad_token_id,
        )
        longest = max(len(p) for p in ids) + config.max_new_tokens
        pages_per_request = -(-longest // CONTINUOUS_PAGE_SIZE)
        batching = ContinuousBatchingConfig(
            page_size=CONTINUOUS_PAGE_SIZE,
            num_blocks=pages_per_request * len(ids) + 1,
            max_batch_tokens=CONTINUOUS_MAX_BATCH_TOKENS,
        )
        start_s = time.perf_counter()
        outputs = self.model.generate_batch(
            inputs=ids,
            generation_config=generation_config,
            continuous_batching_config=batching,
            record_timestamps=True,
            progress_bar=False,
            warmup=False,
        )
        results = []
        # generate_batch returns its outputs in input order.
        for index, (prompt, output) in enumerate(zip(ids, outputs.values(), strict=True)):
            times_s = [t - start_s for t in (output.timestamps or [])]
            end_s = output.lifespan[1] - start_s if output.lifespan[1] > 0 else times_s[-1]
            result = request_result_from_token_times(index, times_s, end_s, len(prompt))
            if output.error is not None:
                result.error_code = "INTERNAL"
            results.append(result)
        return results

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, list) else {eos}


def _completion_length(generated: list[int], eos_ids: set[int]) -> int:
    """Tokens up to and including the first EOS (generate() pads a finished row after it)."""
    for position, token_id in enumerate(generated):
        if token_id in eos_ids:
            return position + 1
    return len(generated)


def make_step_timer():
    """A transformers streamer that records `time.perf_counter()` once per generated step.

    generate() calls `put()` first with the prompt, then once per step with that step's
    tokens (one per batch row); only the steps are timed.
    """
    from transformers.generation.streamers import BaseStreamer

    class StepTimer(BaseStreamer):
        def __init__(self) -> None:
            self.step_times_s: list[float] = []
            self._seen_prompt = False

        def put(self, value) -> None:
            if not self._seen_prompt:
                self._seen_prompt = True
                return
            if getattr(value, "is_cuda", False):
                value.cpu()  # wait for the step's kernels: time their end, not their launch
            self.step_times_s.append(time.perf_counter())

        def end(self) -> None:
            pass

    return StepTimer()
