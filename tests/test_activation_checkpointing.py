"""``WhitenedMuon`` under activation checkpointing (``torch.utils.checkpoint``), plain and
selective. The forward hooks run again when the region is recomputed in backward; selective
checkpointing replays the ops it saved in the order the original forward ran them, so the
statistics must run the same ops both times (torchtitan's selective checkpointing of its
attention blocks is how users meet this). The factors must still be the covariance of the
inputs (float64, against the dense formula)."""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kron_precond import WhitenedMuon

WIDE = 450  # products by stripes


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDE, 8, dtype=torch.float64)
        self.k = nn.Linear(WIDE, 8, dtype=torch.float64)
        self.out = nn.Linear(8, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.q(x)) * self.k(x))


def _save_compute_intensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's selective policy, simplified: keep the outputs of the compute-intensive ops
    (matmuls, attention), recompute the rest."""
    from torch._functorch.partitioners import get_default_op_list
    saved = {o.default for o in get_default_op_list().compute_intensive_ops}
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_factors_are_the_inputs_covariance_under_activation_checkpointing(mode):
    torch.manual_seed(0)
    block = Block()
    opt = WhitenedMuon(block, lr=0.01, statistics_every=1, factor_decay=0.5, statistics_rows=None)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 5, WIDE, generator=g, dtype=torch.float64) for _ in range(2)]
    hidden = []
    for x in xs:
        with torch.no_grad():
            hidden.append(torch.tanh(block.q(x)) * block.k(x))  # the input of `out`, before this step
        if mode == "none":
            y = block(x)
        else:
            kwargs = {}
            if mode == "selective":
                kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _save_compute_intensive)
            y = checkpoint(block, x, use_reentrant=False, **kwargs)
        y.square().sum().backward()
        opt.step()
        opt.zero_grad()

    def covariance(rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1, rows.shape[-1])
        return flat.T @ flat / flat.shape[0]

    for layer, inputs in ((block.q, xs), (block.k, xs), (block.out, hidden)):
        expected = 0.5 * covariance(inputs[0]) + 0.5 * covariance(inputs[1])
        torch.testing.assert_close(opt.state[layer.weight]["input_factor"][0], expected, rtol=1e-10, atol=1e-12)
