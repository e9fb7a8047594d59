"""BatchInvariantLinear (gpu_worker/numerics.py): a row's bits are the same alone and among
any number of rows, on whatever CPU runs the suite. MKL multiplies a few rows with other
kernels than many, and where differs between CPUs (an Intel Xeon parts rows at 1, 2-15
and, for a 1,536 -> 576 layer, 57-192 rows), so the shapes here include the default
model's own."""

from __future__ import annotations

import pytest
import torch

from pagoda.gpu_worker.numerics import ROWS, BatchInvariantLinear, make_batch_invariant

COUNTS = [1, 2, 3, 4, 5, 7, 8, 11, 12, 15, ROWS, ROWS + 1, 31, 57, 64, 100, 130, 193, 200]


@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"),
    [(64, 64, False), (128, 64, True), (576, 1536, False), (1536, 576, False)],
)
def test_a_row_is_the_same_alone_and_among_any_number_of_rows(in_features, out_features, bias):
    generator = torch.Generator().manual_seed(in_features + out_features)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator))
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=generator))
    wrapped = BatchInvariantLinear(layer)
    x = torch.randn(max(COUNTS), in_features, generator=generator)
    with torch.inference_mode():
        alone = torch.cat([wrapped(x[i : i + 1]) for i in range(x.shape[0])])
        for count in COUNTS:
            for start in (0, 3):
                rows = x[start : start + count]
                assert torch.equal(wrapped(rows), alone[start : start + len(rows)]), count
        # Leading dimensions (batch, sequence) are rows too.
        assert torch.equal(wrapped(x[:24].view(2, 12, -1)), alone[:24].view(2, 12, -1))
        assert wrapped(x[:0]).shape == (0, out_features)


def test_the_wrapper_keeps_the_layer_and_wraps_each_linear_once():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    assert make_batch_invariant(model) == 2
    assert make_batch_invariant(model) == 0
    assert model[2].weight is model[2].inner.weight and model[2].out_features == 4
