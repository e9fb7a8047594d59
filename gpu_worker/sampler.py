"""Batched sampling on the device: penalties, temperature, top-k/top-p/min-p, seeded draws.

Order (Hugging Face's): repetition penalty, presence/frequency penalties, the logit
bias, the allowed/banned token ids (-inf outside the one and on the other), the
min_new_tokens mask (-inf on the ending ids until enough tokens were generated), the
structured-output mask (-inf where a constrained row's bitmask says no), then greedy argmax
or temperature -> top-k -> top-p -> min-p -> draw. Logprobs are the log-softmax after
temperature (1 for greedy rows), before any filtering.

A seeded draw is a function of (seed, position of the sampled token) only: one
uniform u = splitmix64(seed, position) picks the token by inverse CDF over the
filtered distribution, always laid out in vocabulary order. The same seed therefore gives the same tokens alone, in any
batch, after a recompute and on any device, and costs one number per row instead
of one per vocabulary entry.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.common.step import SamplingParams
from pagoda.gpu_worker import cpu_kernels
from pagoda.gpu_worker.sampling_columns import SamplingColumns, upload_columns
from pagoda.gpu_worker.step_events import HostCopy

# (seen in prompt or output [S, vocab] bool, generated counts [S, vocab] int32, or None when
# no row has a presence or frequency penalty)
TokenCountRows = tuple[torch.Tensor, torch.Tensor | None]

_MASK64 = (1 << 64) - 1
# A byte of an allowed-token bitmask (little-endian words: token 8j + i is bit i of byte j)
# -> its 8 tokens' additive masks: 0 where allowed, -inf where not.
_BYTE_MASKS = np.array(
    [[0.0 if byte >> bit & 1 else -np.inf for bit in range(8)] for byte in range(256)],
    dtype=np.float32,
)


def splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that depends on (seed, position) only; 24 bits (float32-exact)."""
    mixed = splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (mixed >> 40) / float(1 << 24)


@dataclass(frozen=True, slots=True)
class SampleRow:
    """What sampling one sequence needs: its knobs, token history and sampled position."""

    params: SamplingParams
    # Every token at positions [0, position): prompt + generated; then, for a sample point
    # of a row with drafts, the drafts after it, which its penalties do not count.
    token_ids: list[int]
    num_prompt_tokens: int
    position: int  # position the sampled token will occupy
    # Structured output: ceil(vocab / 32) little-endian 32-bit words; token t may be
    # sampled only when bit t % 32 of word t // 32 is set. None: unconstrained.
    allowed_token_mask: bytes | None = None
    # The sequence's (NewSequence's): these ids are -inf until min_new_tokens were generated.
    min_new_tokens: int = 0
    min_tokens_banned_ids: Collection[int] = ()


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]  # empty unless some row asked for logprobs
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


def counts_from_histories(rows: list[SampleRow], vocab_size: int, device) -> TokenCountRows:
    """(seen anywhere [S, vocab] bool, generated counts [S, vocab]) built from the rows'
    token lists: the definition that pagoda.gpu_worker.token_counts keeps up to date."""
    num_rows = len(rows)
    row_index = [i for i, r in enumerate(rows) for _ in r.token_ids[: r.position]]
    tokens = [t for r in rows for t in r.token_ids[: r.position]]
    seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
    seen[torch.tensor(row_index, device=device), torch.tensor(tokens, device=device)] = True
    generated = [r.token_ids[r.num_prompt_tokens : r.position] for r in rows]
    row_index = [i for i, g in enumerate(generated) for _ in g]
    tokens = [t for g in generated for t in g]
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
    counts.index_put_(
        (torch.tensor(row_index, device=device, dtype=torch.long),
         torch.tensor(tokens, device=device, dtype=torch.long)),
        torch.ones(len(tokens), dtype=torch.int32, device=device),
        accumulate=True,
    )  # fmt: skip
    return seen, counts


def apply_penalties(
    logits: torch.Tensor,
    rows: list[SampleRow],
    counts: TokenCountRows | None = None,
    columns: SamplingColumns | None = None,
) -> torch.Tensor:
    """Repetition (HF: over prompt + generated) then presence/frequency (generated only).

    `counts`: the rows' (seen, generated counts) from the engine's device-resident
    TokenCounts; None builds them from the rows' token lists (tests, tools). `columns`:
    the rows' uploaded numbers (sampling_columns.py); None uploads them here.
    """
    repetition = [r.params.repetition_penalty for r in rows]
    presence = [r.params.presence_penalty for r in rows]
    frequency = [r.params.frequency_penalty for r in rows]
    needs_repetition = any(p != 1.0 for p in repetition)
    needs_counts = any(presence) or any(frequency)
    if not needs_repetition and not needs_counts:
        return logits
    device = logits.device
    seen, generated = counts or counts_from_histories(rows, logits.shape[-1], device)
    columns = columns or upload_columns(rows, logits.shape[-1], device)
    repetition_t, presence_t, frequency_t = (
        columns.floats(name, logits.dtype)[:, None]
        for name in ("repetition", "presence", "frequency")
    )
    if needs_repetition:
        # transformers' RepetitionPenaltyLogitsProcessor: x * p where x < 0, else x / p. For
        # p >= 1 that is the smaller of the two, for p < 1 the larger: the same numbers,
        # chosen without a branch on the logits' signs (such a where is slow on a CPU).
        scaled_up, scaled_down = logits * repetition_t, logits / repetition_t
        if all(p >= 1.0 for p in repetition):
            penalized = torch.minimum(scaled_up, scaled_down)
        elif all(p <= 1.0 for p in repetition):
            penalized = torch.maximum(scaled_up, scaled_down)
        else:
            penalized = torch.where(
                repetition_t >= 1.0,
                torch.minimum(scaled_up, scaled_down),
                torch.maximum(scaled_up, scaled_down),
            )
        logits = torch.where(seen, penalized, logits)
    if needs_counts:
        generated = generated.to(logits.dtype)
        logits = logits - frequency_t * generated - presence_t * (generated > 0)
    return logits


def apply_logit_bias(
    logits: torch.Tensor, rows: list[SampleRow], columns: SamplingColumns | None = None
) -> torch.Tensor:
    """Adds each row's logit_bias (OpenAI's: +-100 in effect forces or bans a token) to
    its logits, in place with one scatter-add; the rows' ids are distinct (checked by the
    sequence table), so no two additions meet."""
    if not any(r.params.logit_bias_token_ids for r in rows):
        return logits
    columns = columns or upload_columns(rows, logits.shape[-1], logits.device)
    return _put_per_row(
        logits, columns, "bias", columns.floats("bias_values", logits.dtype), accumulate=True
    )


def mask_allowed_and_banned(
    logits: torch.Tensor, rows: list[SampleRow], columns: SamplingColumns | None = None
) -> torch.Tensor:
    """-inf on a row's banned_token_ids and, when it lists allowed_token_ids, on every other
    id, in place; rows with neither are untouched (the sequence table checked the ids)."""
    banned = any(r.params.banned_token_ids for r in rows)
    limited = sum(1 for r in rows if r.params.allowed_token_ids)
    if not banned and not limited:
        return logits
    device = logits.device
    columns = columns or upload_columns(rows, logits.shape[-1], device)
    if banned:
        _put_per_row(logits, columns, "banned", logits.new_full((), float("-inf")), False)
    if not limited:
        return logits
    allowed = torch.zeros(limited, logits.shape[-1], dtype=torch.bool, device=device)
    allowed[columns.longs("allowed_rows"), columns.longs("allowed_tokens")] = True
    index = columns.longs("allowed_limited")
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def mask_disallowed_tokens(
    logits: torch.Tensor, rows: list[SampleRow], columns: SamplingColumns | None = None
) -> torch.Tensor:
    """-inf on the tokens a constrained row's bitmask does not allow (structured output),
    in place; unconstrained rows are untouched. One host-to-device copy of the masked
    rows' words, unpacked to bits on the device."""
    masked = [i for i, r in enumerate(rows) if r.allowed_token_mask is not None]
    if not masked:
        return logits
    device = logits.device
    vocab_size = logits.shape[-1]
    packed = b"".join(rows[i].allowed_token_mask for i in masked)
    columns = columns or upload_columns(rows, vocab_size, device)
    index = columns.longs("masked_rows")
    if device.type == "cpu":
        # A boolean masked_fill of [rows, vocab] is slow on a CPU (2.4 ms for 16 rows of
        # 49,152 tokens, on 2 cores); each mask byte's 8 additive masks from a table, added
        # once per row, give the same floats (x + 0 is x, x + -inf is -inf) in 0.16 ms.
        mask_bytes = np.frombuffer(packed, dtype=np.uint8).reshape(len(masked), -1)
        additive = np.take(_BYTE_MASKS, mask_bytes, axis=0).reshape(len(masked), -1)
        logits.index_add_(0, index, torch.from_numpy(additive[:, :vocab_size]))
        return logits
    words = torch.frombuffer(bytearray(packed), dtype=torch.int32).view(len(masked), -1)
    words = words.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> shifts) & 1).view(len(masked), -1)[:, :vocab_size]
    logits[index] = logits[index].masked_fill(allowed == 0, float("-inf"))
    return logits


def mask_min_new_tokens(
    logits: torch.Tensor, rows: list[SampleRow], columns: SamplingColumns | None = None
) -> torch.Tensor:
    """-inf on the ending ids (EOS, stop ids) of rows that generated fewer than
    min_new_tokens tokens (positions [num_prompt_tokens, position)), as transformers'
    MinNewTokensLengthLogitsProcessor: the request cannot end before then. One pass over
    the rows' numbers, and one scatter when some row is masked, in place: a copy of the
    whole [rows, vocab] block would cost more than the argmax on a CPU."""
    if not any(r.position - r.num_prompt_tokens < r.min_new_tokens for r in rows):
        return logits
    columns = columns or upload_columns(rows, logits.shape[-1], logits.device)
    return _put_per_row(
        logits, columns, "min_tokens", logits.new_full((), float("-inf")), accumulate=False
    )


def _put_per_row(
    logits: torch.Tensor,
    columns: SamplingColumns,
    name: str,
    values: torch.Tensor,
    accumulate: bool,
) -> torch.Tensor:
    """logits[row, t] (+)= value for every (row, t) pair of the columns `name`_rows and
    `name`_tokens, in place with one scatter; `values` is one per pair, or a scalar."""
    return logits.index_put_(
        (columns.longs(f"{name}_rows"), columns.longs(f"{name}_tokens")),
        values,
        accumulate=accumulate,
    )


def _filtered_candidates(
    scaled: torch.Tensor, params: list[SamplingParams], columns: SamplingColumns
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(probs [R, K], their token ids [R, K]) in rank order, or (probs [R, vocab], None)
    in vocabulary order when no row needs ranking. `params` and the columns' top_k,
    top_p and min_p are the drawing rows'."""
    vocab_size = scaled.shape[-1]
    device = scaled.device
    top_ks = [min(p.top_k, vocab_size) for p in params]
    top_ps = [p.top_p for p in params]
    min_ps = [p.min_p for p in params]
    candidate_ids = None
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        # Sorting the whole vocabulary is the costly part; when every row has a top-k,
        # the largest k candidates suffice.
        if all(k > 0 for k in top_ks):
            scaled, candidate_ids = scaled.topk(max(top_ks), dim=-1)
        else:
            scaled, candidate_ids = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(scaled.shape[-1], device=device)[None, :]
        limits = columns.longs("top_k")
        scaled = scaled.masked_fill(ranks >= limits[:, None], float("-inf"))
        if any(p < 1.0 for p in top_ps):
            probs = torch.softmax(scaled, dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
            top_p = columns.floats("top_p", probs.dtype)[:, None]
            # The best token always stays (mass_before is 0 there).
            scaled = scaled.masked_fill(mass_before >= top_p, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(p > 0.0 for p in min_ps):
        min_p = columns.floats("min_p", probs.dtype)[:, None]
        keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs * keep
    return probs, candidate_ids


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: index i with cdf[i - 1] <= u * total < cdf[i]; never a zero-probability entry.

    On CPU the cumsum adds exact zeros, so the cdf is flat over a zero-probability entry and
    searchsorted never lands on one. A parallel scan (CUDA) may let it rise by an ulp there,
    so a pick is moved to the next live entry at or after it (the last live one when none
    follows, which also covers u * total rounding onto the last plateau).
    """
    cdf = probs.cumsum(dim=-1)
    u = uniforms.to(cdf.dtype)[:, None]
    vocab_size = probs.shape[-1]
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab_size - 1)
    live = probs > 0
    positions = torch.arange(vocab_size, device=probs.device).expand_as(probs)
    # next_live[i]: the first live index >= i (vocab_size when none): a reversed running min.
    next_live = torch.where(live, positions, vocab_size).flip(-1).cummin(dim=-1).values.flip(-1)
    moved = next_live.gather(1, picked)[:, 0]
    last_live = vocab_size - 1 - live.flip(-1).int().argmax(dim=-1)
    return torch.where(moved < vocab_size, moved, last_live)


@dataclass(slots=True)
class DeviceSample:
    """A batch's sampled tokens, enqueued: `token_ids` [S] (int64) stays on the device,
    where a step launched ahead takes the tokens it feeds (engine.py), and their copy to
    the host has begun (with the logprobs, when asked, in the same copy)."""

    token_ids: torch.Tensor
    _copy: HostCopy
    # Per row, the top-n asked for; None when the copy holds the tokens alone.
    _num_logprobs: list[int] | None = None

    def done(self) -> bool:
        return self._copy.done()

    def read(self) -> SampleOutput:
        """The tokens (and logprobs) on the host: the step's one wait for its device."""
        values = self._copy.read().tolist()
        if self._num_logprobs is None:
            return SampleOutput(values, [], [], [])
        k = (len(values[0]) - 2) // 2 if values else 0
        output = SampleOutput([], [], [], [])
        for row, n in zip(values, self._num_logprobs, strict=True):
            output.token_ids.append(int(row[0]))
            output.logprobs.append(row[1])
            output.top_token_ids.append([int(t) for t in row[2 : 2 + n]])
            output.top_logprobs.append(row[2 + k : 2 + k + n])
        return output


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), by Pagoda's kernel for float32 rows on the CPU (the same
    index, first among equals; torch's took about 1 ms at 64 x 49,152 on two cores)."""
    kernels = cpu_kernels.for_rows(logits)
    return logits.argmax(dim=-1) if kernels is None else kernels.argmax_rows(logits)


def sample(
    logits: torch.Tensor, rows: list[SampleRow], counts: TokenCountRows | None = None
) -> SampleOutput:
    """sample_on_device, read back at once."""
    return sample_on_device(logits, rows, counts).read()


def sample_on_device(
    logits: torch.Tensor, rows: list[SampleRow], counts: TokenCountRows | None = None
) -> DeviceSample:
    """logits [S, vocab] (one row per sampling sequence, same order as `rows`); consumed:
    the logit bias and the masks may be written into them. `counts`: see
    apply_penalties. The rows' numbers go to the device in one copy (sampling_columns.py)
    and one copy comes back: the tokens, and the logprobs when asked, in one tensor,
    started here and waited for only when read (step_events.HostCopy)."""
    columns = upload_columns(rows, logits.shape[-1], logits.device)
    logits = apply_penalties(logits.float(), rows, counts, columns)
    logits = apply_logit_bias(logits, rows, columns)
    logits = mask_min_new_tokens(mask_allowed_and_banned(logits, rows, columns), rows, columns)
    logits = mask_disallowed_tokens(logits, rows, columns)
    params = [r.params for r in rows]
    token_ids = argmax_rows(logits)
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    num_logprobs = [p.num_logprobs for p in params]
    if not sampled_rows and not any(num_logprobs):
        # all greedy: argmax is all
        return DeviceSample(token_ids, HostCopy(token_ids))

    scaled = logits / columns.floats("temperature")[:, None]
    if sampled_rows:
        index = columns.longs("sampled_rows")
        probs, candidate_ids = _filtered_candidates(
            scaled[index], [params[i] for i in sampled_rows], columns
        )
        if candidate_ids is not None:
            # Draw in vocabulary order, whatever sorting a neighbour's top-k/top-p forced on
            # this row, so that a seeded row's token never depends on the rest of the batch.
            probs = torch.zeros_like(scaled[index]).scatter_(1, candidate_ids, probs)
        token_ids[index] = _draw(probs, columns.floats("uniform"))

    if not any(num_logprobs):
        return DeviceSample(token_ids, HostCopy(token_ids))
    logprobs = torch.log_softmax(scaled, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    top_values, top_ids = logprobs.topk(max(num_logprobs), dim=-1)
    # [S, 2 + 2k] in float64 (exact for any token id): one copy to the host.
    packed = torch.cat(
        [t.double() for t in (token_ids[:, None], chosen, top_ids, top_values)], dim=1
    )
    return DeviceSample(token_ids, HostCopy(packed), num_logprobs)
