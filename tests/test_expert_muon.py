"""examples/expert_muon.py: the Muon baseline's step for fused experts equals
``torch.optim.Muon`` on each expert's matrix as a parameter of its own."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from expert_muon import ExpertMuon  # noqa: E402
from kron_examples_common import expert_weights  # noqa: E402


@pytest.mark.parametrize("nesterov, adjust_lr_fn, weight_decay", [(True, "match_rms_adamw", 0.1),
                                                                   (False, None, 0.0)])
def test_each_expert_steps_as_torch_muon_on_its_own_matrix(nesterov, adjust_lr_fn, weight_decay):
    torch.manual_seed(0)
    stacked = [nn.Parameter(torch.randn(3, 5, 7)), nn.Parameter(torch.randn(3, 7, 5))]  # wide and tall experts
    split = [nn.Parameter(p.detach()[e].clone()) for p in stacked for e in range(3)]
    ours = ExpertMuon(stacked, lr=0.05, weight_decay=weight_decay, momentum=0.9, nesterov=nesterov,
                      adjust_lr_fn=adjust_lr_fn)
    torch_muon = torch.optim.Muon(split, lr=0.05, weight_decay=weight_decay, momentum=0.9, nesterov=nesterov,
                                  adjust_lr_fn=adjust_lr_fn)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in stacked]
        for p, g in zip(stacked, grads):
            p.grad = g.clone()
        for i, p in enumerate(split):
            p.grad = grads[i // 3][i % 3].clone()
        ours.step()
        torch_muon.step()
    for i, p in enumerate(split):
        torch.testing.assert_close(stacked[i // 3][i % 3], p, rtol=0, atol=0)


def test_refuses_what_it_cannot_step():
    with pytest.raises(ValueError, match=r"\[experts, out, in\]"):
        ExpertMuon([nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        ExpertMuon([nn.Parameter(torch.randn(2, 4, 4))], adjust_lr_fn="match_rms")

    class TransposedExperts(nn.Module):  # transformers' experts interface, stored [experts, in, out]
        has_gate, has_bias, is_transposed, num_experts = True, False, True, 2

        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(2, 4, 6))
            self.down_proj = nn.Parameter(torch.randn(2, 3, 4))

    with pytest.raises(ValueError, match="experts"):
        expert_weights(nn.Sequential(TransposedExperts()))
    TransposedExperts.is_transposed = False
    assert len(expert_weights(nn.Sequential(TransposedExperts()))) == 2
    assert expert_weights(nn.Sequential(TransposedExperts()), exclude=["TransposedExperts"]) == []
