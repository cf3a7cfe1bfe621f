"""benchmarks/layer_levers.py: its plain-Muon weights step as torch.optim.Muon does (an
independent implementation), the rest stay whitened; variants parse or fail naming the fault."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.layer_levers import PartlyWhitenedMuon, parse_variant, variant_contender  # noqa: E402


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.v_proj = nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False)

    def forward(self, x):  # a loss separable in q and v: each weight's gradient is its own
        return torch.tanh(self.q_proj(x)).square().mean() + (self.v_proj(x) - 1).square().mean()


def test_plain_weights_take_torch_muons_step_and_the_others_are_whitened():
    torch.manual_seed(0)
    model = Attention()
    muon_model = copy.deepcopy(model)
    ours = PartlyWhitenedMuon(model, lr=0.05, momentum=0.9, plain="q_proj", statistics_every=1,
                              ns_dtype=torch.bfloat16)  # torch.optim.Muon's iteration, on every CPU
    muon = torch.optim.Muon(muon_model.parameters(), lr=0.05, weight_decay=0.0, momentum=0.9, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    g = torch.Generator().manual_seed(1)
    scale = torch.logspace(0.5, -1, 6)  # an ill-conditioned input: whitening moves the step
    for _ in range(3):
        x = torch.randn(16, 6, generator=g) * scale
        for m, opt in ((model, ours), (muon_model, muon)):
            opt.zero_grad()
            m(x).backward()
            opt.step()
    torch.testing.assert_close(model.q_proj.weight, muon_model.q_proj.weight, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(model.v_proj.weight, muon_model.v_proj.weight, rtol=1e-3, atol=1e-4)


def test_variants_parse_and_bad_ones_name_the_fault():
    name, settings = parse_variant("plain_qk=lr:0.0453,plain:q_proj|k_proj,center:none")
    assert name == "plain_qk" and settings == dict(lr=0.0453, momentum=0.8, plain="q_proj|k_proj",
                                                   center_inputs=False, center_only=None, skip=None)
    assert parse_variant("c=lr:0.1,mom:0.9,center:all")[1]["center_inputs"] is True
    assert parse_variant("c=lr:0.1")[1]["center_inputs"] is None
    with pytest.raises(ValueError, match="lr is required"):
        parse_variant("x=mom:0.9")
    with pytest.raises(ValueError, match="unknown settings"):
        parse_variant("x=lr:0.1,damp:0.2")


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.hidden, self.lm_head = nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 10, bias=False)

    def forward(self, tokens):
        return self.lm_head(torch.relu(self.hidden(self.embed(tokens))))


def test_skip_replaces_the_examples_skip_layers():
    def whitened(variant):
        name, settings = parse_variant(variant)
        optimizer, _ = variant_contender(name, settings, 0.0, ["Embedding", "lm_head"]).build(TinyLM(), None)
        return [n for g in optimizer.param_groups if g["algorithm"] == "whitened_muon" for n in g["param_names"]]
    assert parse_variant("h=lr:0.1,skip:Embedding|norm")[1]["skip"] == ["Embedding", "norm"]
    assert whitened("base=lr:0.1") == ["hidden.weight"]
    assert whitened("head=lr:0.1,skip:Embedding") == ["hidden.weight", "lm_head.weight"]


def test_center_only_centres_the_named_weights_alone():
    """``center_only``: the matching weight's factor is its rows' covariance (numpy's), the
    other's their second moment, though neither layer has a bias."""
    import numpy as np
    torch.manual_seed(0)
    model = Attention()
    opt = PartlyWhitenedMuon(model, lr=0.05, center_only="q_proj", statistics_every=1)
    x = torch.randn(32, 6, dtype=torch.float32) + 2.0
    model(x).backward()
    opt.step()
    rows = x.double().numpy()
    q = opt.state[model.q_proj.weight]["input_factor"][0].double()
    v = opt.state[model.v_proj.weight]["input_factor"][0].double()
    torch.testing.assert_close(q, torch.from_numpy(np.cov(rows, rowvar=False, bias=True)), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(v, torch.from_numpy(rows.T @ rows / 32), rtol=1e-4, atol=1e-5)
