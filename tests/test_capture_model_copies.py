"""A copy of the model made after the hooks were placed (an EMA or SWA average, a teacher, a
lookahead) carries the hook functions with it; its forwards must not enter the original's
statistics. The model saved whole (``torch.save(model)``) while the hooks are in place loads
with the same forward, and its hooks feed nothing."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from kron_precond import KronPreconditioner, WhitenedMuon


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def batch(seed: int) -> torch.Tensor:
    return torch.randn(16, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def factor(owner, net) -> torch.Tensor:
    if isinstance(owner, WhitenedMuon):
        return owner.state[net[0].weight]["input_factor"].clone()
    return owner.layers["0"].a_factor.clone()


@pytest.mark.parametrize("kind", ["kfac", "ikfac", "whitened_muon"])
def test_forwards_of_a_deep_copy_of_the_model_stay_out_of_the_statistics(kind):
    factors = []
    for with_copy in (False, True):
        net = model()
        owner = (WhitenedMuon(net, lr=1e-2, statistics_every=1) if kind == "whitened_muon"
                 else KronPreconditioner(net, method=kind, factor_update_steps=1, inv_update_steps=1))
        twin = copy.deepcopy(net)
        for step in range(3):
            if with_copy:  # the copy trains in between, on other data
                twin(batch(100 + step) * 5).square().mean().backward()
            net(batch(step)).square().mean().backward()
            if kind == "whitened_muon":
                owner.step()
            else:
                owner.step(lr=0.1)
            net.zero_grad()
        factors.append(factor(owner, net))
    assert torch.equal(factors[0], factors[1])


@pytest.mark.parametrize("kind", ["kfac", "ikfac", "whitened_muon"])
def test_the_model_saved_whole_loads_and_its_forwards_feed_nothing(kind, tmp_path):
    net = model()
    owner = (WhitenedMuon(net, lr=1e-2, statistics_every=1) if kind == "whitened_muon"
             else KronPreconditioner(net, method=kind, factor_update_steps=1, inv_update_steps=1, lr=0.1))
    net(batch(0)).square().mean().backward()
    owner.step()
    torch.save(net, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert torch.equal(loaded(batch(1)), net(batch(1)))
    before = factor(owner, net)
    loaded(batch(2) * 5).square().mean().backward()  # the loaded copy trains on other data
    assert torch.equal(factor(owner, net), before)
    # the original's own hooks still feed its statistics
    net(batch(3) * 5).square().mean().backward()
    owner.step()
    assert not torch.equal(factor(owner, net), before)


def _replicate(module: nn.Module) -> nn.Module:
    """nn.DataParallel's replicate() on one device (the real one needs CUDA to broadcast): each
    module a ``_replicate_for_data_parallel()`` copy sharing its hooks, parameters as views."""
    replica = module._replicate_for_data_parallel()
    for key, p in module._parameters.items():
        if p is not None:
            setattr(replica, key, p.view_as(p))
    for name, child in module._modules.items():
        replica._modules[name] = _replicate(child)
    return replica


def test_whitened_muon_says_so_when_the_model_runs_as_data_parallel_replicas():
    """nn.DataParallel (Hugging Face's Trainer on several GPUs without torchrun) runs replicas
    that share the modules' hooks; their rows stay out of the statistics, so every weight would
    take Muon's plain step without a word: a warning names DataParallel."""
    from kron_precond import WhitenedMuon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    opt = WhitenedMuon(model, lr=0.01, statistics_every=1)
    with pytest.warns(RuntimeWarning, match="DataParallel"):
        for _ in range(2):
            opt.zero_grad()
            _replicate(model)(torch.randn(32, 8)).pow(2).mean().backward()
            opt.step()
