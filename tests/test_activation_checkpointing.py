"""``WhitenedMuon`` under activation checkpointing (``torch.utils.checkpoint``), plain and
selective. The forward hooks run again when the region is recomputed in backward; selective
checkpointing replays the ops it saved in the order the original forward ran them, so the
statistics must run the same ops both times and must not write into a matmul's output, which
the checkpoint keeps (torchtitan's selective checkpointing of its blocks is how users meet
this). The factors must still be the covariance of the inputs (float64, against the dense
formula)."""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kron_precond import WhitenedMuon


class Block(nn.Module):
    """A norm in front, as in a transformer block: the checkpoint recomputes every layer's input."""

    def __init__(self, wide: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(wide, dtype=torch.float64)
        self.q = nn.Linear(wide, 8, dtype=torch.float64)
        self.k = nn.Linear(wide, 8, dtype=torch.float64)
        self.out = nn.Linear(8, 4, dtype=torch.float64)

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.norm(x)
        return normed, torch.tanh(self.q(normed)) * self.k(normed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inputs(x)[1])


def _save_compute_intensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's selective policy, simplified: keep the outputs of the compute-intensive ops
    (matmuls, attention), recompute the rest."""
    from torch._functorch.partitioners import get_default_op_list
    saved = {o.default for o in get_default_op_list().compute_intensive_ops}
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("wide", [64, 450])  # one matmul; by stripes
@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_factors_are_the_inputs_covariance_under_activation_checkpointing(mode, wide):
    torch.manual_seed(0)
    block = Block(wide)
    opt = WhitenedMuon([block.q, block.k, block.out], lr=0.01, statistics_every=1, factor_decay=0.5,
                       statistics_rows=None)
    g = torch.Generator().manual_seed(1)
    seen: dict[str, list[torch.Tensor]] = {"q": [], "out": []}
    for _ in range(2):
        x = torch.randn(3, 5, wide, generator=g, dtype=torch.float64)
        with torch.no_grad():  # the layers' inputs at this step's weights
            normed, hidden = block.inputs(x)
        seen["q"].append(normed)
        seen["out"].append(hidden)
        kwargs = {}
        if mode == "selective":
            kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _save_compute_intensive)
        y = block(x) if mode == "none" else checkpoint(block, x, use_reentrant=False, **kwargs)
        y.square().sum().backward()
        opt.step()
        opt.zero_grad()

    def covariance(rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1, rows.shape[-1])
        return flat.T @ flat / flat.shape[0]

    for layer, inputs in ((block.q, seen["q"]), (block.k, seen["q"]), (block.out, seen["out"])):
        expected = 0.5 * covariance(inputs[0]) + 0.5 * covariance(inputs[1])
        torch.testing.assert_close(opt.state[layer.weight]["input_factor"][0], expected, rtol=1e-10, atol=1e-12)
