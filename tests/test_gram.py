"""The statistics' row products: ``gram`` by stripes against the dense product in float64, and
the factors ``WhitenedMuon`` builds from them on sides wider than a stripe, with layers that
share an input, a layer called twice, and a call whose rows are not finite."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from kron_precond import WhitenedMuon
from kron_precond.whitening import GRAM_STRIPE, gram


@pytest.mark.parametrize("n", [1, 5, GRAM_STRIPE, 3 * GRAM_STRIPE - 1, 3 * GRAM_STRIPE, 3 * GRAM_STRIPE + 1, 450, 512])
@pytest.mark.parametrize("batch", [1, 3])
def test_gram_is_the_dense_product_and_exactly_symmetric(n, batch):
    g = torch.Generator().manual_seed(n)
    rows = torch.randn(batch, 70, n, generator=g, dtype=torch.float64)
    got = gram(rows)
    torch.testing.assert_close(got, rows.mT @ rows, rtol=1e-12, atol=1e-12)
    assert torch.equal(got, got.mT)
    single = gram(rows.float())
    assert single.dtype == torch.float32 and torch.equal(single, single.mT)
    torch.testing.assert_close(single.double(), rows.mT @ rows, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("stripe", [1, 7, 64, 1000])
def test_every_stripe_width_gives_the_same_product(stripe):
    rows = torch.randn(2, 40, 100, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(gram(rows, stripe=stripe), rows.mT @ rows, rtol=1e-12, atol=1e-12)


def test_gram_of_a_strided_view_as_the_statistics_read_their_rows():
    """``[rows, blocks, b]`` read as ``[blocks, rows, b]``: a transposed, non-contiguous batch."""
    rows = torch.randn(50, 2, 200, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    view = rows.transpose(0, 1)
    torch.testing.assert_close(gram(view), view.mT @ view, rtol=1e-12, atol=1e-12)


WIDTH = 3 * GRAM_STRIPE + 44  # four stripes, the last one narrower


def _covariance(*parts: torch.Tensor) -> torch.Tensor:
    rows = torch.cat([p.reshape(-1, WIDTH) for p in parts]).double()
    return rows.T @ rows / rows.shape[0]


def test_layers_sharing_a_wide_input_and_one_called_twice_get_their_own_rows():
    """q, k and v read one tensor (one product, shared); q is also called on a second tensor in
    the same step. Each factor must hold exactly its own rows: sharing the product must not let
    q's second call reach k's or v's sums."""
    torch.manual_seed(0)
    q, k, v = (nn.Linear(WIDTH, 3, dtype=torch.float64) for _ in range(3))
    opt = WhitenedMuon([q, k, v], lr=0.01, statistics_every=1)
    x = torch.randn(4, 6, WIDTH, dtype=torch.float64)
    extra = torch.randn(5, WIDTH, dtype=torch.float64)
    loss = q(x).sum() + k(x).sum() + v(x).square().sum() + q(extra).sum()
    loss.backward()
    opt.step()
    factor = {name: opt.state[layer.weight]["input_factor"][0] for name, layer in zip("qkv", (q, k, v))}
    torch.testing.assert_close(factor["q"], _covariance(x, extra), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(factor["k"], _covariance(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(factor["v"], _covariance(x), rtol=1e-12, atol=1e-12)


def test_a_call_whose_rows_are_not_finite_is_left_out_and_the_others_count():
    """Two calls of one layer in a step, the second with an infinite row (an overflow): the factor
    is the first call's rows alone, not the step's statistics dropped or a non-finite factor."""
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, 3, dtype=torch.float64)
    opt = WhitenedMuon([layer], lr=0.01, statistics_every=1)
    good = torch.randn(7, WIDTH, dtype=torch.float64)
    bad = torch.randn(3, WIDTH, dtype=torch.float64)
    bad[1, 5] = float("inf")
    (layer(good).sum() + layer(bad).sum()).backward()
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()  # the gradient is not finite either: the weight does not step
    state = opt.state[layer.weight]
    torch.testing.assert_close(state["input_factor"][0], _covariance(good), rtol=1e-12, atol=1e-12)
    assert state["input_seen"].item() == 1
    assert torch.isfinite(state["input_whitener"]).all()
