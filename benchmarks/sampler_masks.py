"""The worker's structured-output mask on a CPU: mask_disallowed_tokens for N constrained
rows of the default model's vocabulary (49,152 tokens), beside the boolean masked_fill it
replaced there. `python -m benchmarks.sampler_masks [--rows 16] [--repeats 200]`; prints
the median milliseconds per step of each, masks unpacked and applied to [rows, vocab]
float32 logits (half the tokens allowed, at random)."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagoda.common.step import SamplingParams
from pagoda.gpu_worker.sampler import SampleRow, mask_disallowed_tokens

VOCAB = 49152


def median_ms(step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    generator = np.random.default_rng(0)
    bits = generator.integers(0, 2, size=(args.rows, VOCAB), dtype=np.uint8)
    masks = [np.packbits(row, bitorder="little").tobytes() for row in bits]
    rows = [SampleRow(SamplingParams(), [1], 1, 1, mask) for mask in masks]
    logits = torch.randn(args.rows, VOCAB)
    disallowed = torch.from_numpy(bits == 0)

    def table() -> None:
        mask_disallowed_tokens(logits.clone(), rows)

    def masked_fill() -> None:  # what the CPU ran before (unpacking aside)
        logits.clone().masked_fill_(disallowed, float("-inf"))

    table_ms, fill_ms = median_ms(table, args.repeats), median_ms(masked_fill, args.repeats)
    print(
        f"{args.rows} masked rows x {VOCAB} tokens, {torch.get_num_threads()} threads: "
        f"mask_disallowed_tokens {table_ms:.2f} ms, a boolean masked_fill alone {fill_ms:.2f} ms"
    )


if __name__ == "__main__":
    main()
