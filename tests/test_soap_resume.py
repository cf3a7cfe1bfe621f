"""SOAP resumed from a checkpoint at any step goes on as the uninterrupted run, bitwise.

A run saves the model, the preconditioner and the optimizer before step ``k``, builds all
three afresh from the same initialisation, loads them and trains on to step ``N``; for every
``k`` in ``1..N-1`` its parameters equal the uninterrupted run's. Refreshes every 3 or 4 steps,
so most resume points fall between two refreshes. What a step reads beyond the saved tensors
must come back exactly:

* whether a layer had a gradient since its last refresh (``used_since_refresh``): a branch
  used after a refresh and not on the steps up to the next one is moved by that refresh, one
  unused since its last refresh is not;
* the same for an expert of a fused experts module that the router sends no token (a gradient
  of zeros is no gradient);
* the warm-start flags and the clusters the moment is averaged over, derived from the bases:
  a layer never refreshed (a branch not taken yet, an expert idle at the first refresh) keeps
  the identity bases and is not averaged, as in the run that never stopped.

Also: a checkpoint without ``used_since_refresh`` (written before it existed) loads as a layer
without gradients since its last refresh; a bad flag is refused and changes nothing; DCP.
"""
from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from kron_precond import KronPreconditioner, RoutedExperts
from state_compare import assert_same

F64 = torch.float64
N = 12
E, D, HIDDEN, T = 3, 4, 6, 20
# step -> the expert the router sends no token: expert 2 at the first refresh (and after it),
# expert 1 up to and on a refresh step after a gradient, expert 0 across another
IDLE = {0: 2, 1: 2, 2: 1, 3: 1, 4: 1, 5: 2, 7: 0, 8: 0}


class Branched(nn.Module):
    """Two Linear layers and a tanh, the second of two heads chosen by the step: ``c`` is used
    on the steps ``uses_c`` names, ``b`` on the others."""

    def __init__(self, uses_c=()):
        super().__init__()
        self.a = nn.Linear(5, 8, dtype=F64)
        self.b = nn.Linear(8, 3, dtype=F64)
        self.c = nn.Linear(8, 3, dtype=F64)
        self.uses_c = frozenset(uses_c)

    def forward(self, x, step):
        hidden = torch.tanh(self.a(x))
        return self.c(hidden) if step in self.uses_c else self.b(hidden)


CASES = {
    # control: every layer has a gradient on every step
    "mlp": dict(model="branched", uses_c=(), factor_update_steps=1, inv_update_steps=3),
    "mlp_statistics_every_2": dict(model="branched", uses_c=(), factor_update_steps=2, inv_update_steps=4),
    # c first used after the first refresh (resumed before it: never refreshed), then between refreshes
    "branch": dict(model="branched", uses_c=(1, 5, 9), factor_update_steps=1, inv_update_steps=3),
    "branch_refresh_4": dict(model="branched", uses_c=(1, 2, 5, 9), factor_update_steps=1, inv_update_steps=4),
    "experts": dict(model="experts", factor_update_steps=1, inv_update_steps=3),
    "experts_refresh_4": dict(model="experts", factor_update_steps=1, inv_update_steps=4),
    "experts_statistics_every_2": dict(model="experts", factor_update_steps=2, inv_update_steps=4),
}


def build(case: dict):
    torch.manual_seed(0)
    if case["model"] == "experts":
        model: nn.Module = RoutedExperts(E, D, HIDDEN, activation=torch.tanh, dtype=F64)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    else:
        model = Branched(case["uses_c"])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    precond = KronPreconditioner(model, method="soap", kl_clip=None, moment_decay=0.9, factor_decay=0.9,
                                 factor_update_steps=case["factor_update_steps"],
                                 inv_update_steps=case["inv_update_steps"])
    return model, precond, optimizer


def loss(model: nn.Module, case: dict, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    if case["model"] == "experts":
        x, target = torch.randn(T, D, generator=gen, dtype=F64), torch.randn(T, D, generator=gen, dtype=F64)
        scores = torch.rand(T, E, generator=gen)
        if step in IDLE:
            scores[:, IDLE[step]] = -1.0
        index = scores.topk(1, dim=1).indices
        weights = torch.rand(T, 1, generator=gen, dtype=F64) + 0.1
        return (model(x, index, weights) - target).pow(2).mean()
    x, target = torch.randn(6, 5, generator=gen, dtype=F64), torch.randn(6, 3, generator=gen, dtype=F64)
    return (model(x, step) - target).pow(2).mean()


def saved(model, precond, optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "precond": precond.state_dict(), "optimizer": optimizer.state_dict()},
               buffer)
    return buffer.getvalue()


def resumed(case: dict, checkpoint: bytes, edit=None):
    """A fresh model, preconditioner and optimizer loaded from ``checkpoint`` (``edit`` may change
    the preconditioner's state first)."""
    model, precond, optimizer = build(case)
    state = torch.load(io.BytesIO(checkpoint), weights_only=False)
    if edit is not None:
        edit(state["precond"])
    model.load_state_dict(state["model"])
    precond.load_state_dict(state["precond"])
    optimizer.load_state_dict(state["optimizer"])
    return model, precond, optimizer


def one_step(model, precond, optimizer, case: dict, step: int, *, optimizer_step: bool = True) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss(model, case, step).backward()
    precond.step()
    if optimizer_step:
        optimizer.step()


def train(case: dict, resume_at: int | None = None, edit=None) -> torch.Tensor:
    model, precond, optimizer = build(case)
    for step in range(N):
        if step == resume_at:
            model, precond, optimizer = resumed(case, saved(model, precond, optimizer), edit)
        one_step(model, precond, optimizer, case, step)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("name", sorted(CASES))
def test_resumed_at_any_step_equals_the_uninterrupted_run(name):
    case = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the experts' early rank-deficient statistics may warn
        expected = train(case)
        drifted = {}
        for resume_at in range(1, N):
            got = train(case, resume_at)
            if not torch.equal(got, expected):
                drifted[resume_at] = (got - expected).abs().max().item()
    assert drifted == {}, f"{name}: resumed at step -> largest parameter difference after {N} steps: {drifted}"
    # and through torch.testing's comparison, bitwise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(train(case, resume_at=N // 2), expected, rtol=0, atol=0)


def _drop_flag(precond_state: dict) -> None:
    """The preconditioner's state as written before ``used_since_refresh`` existed."""
    for layer_state in precond_state["layers"].values():
        del layer_state["used_since_refresh"]


def test_a_checkpoint_without_the_flag_loads_as_a_layer_not_used_since_its_last_refresh():
    """Resumed before step 2 (``c`` used on step 1, refreshed on step 3, not used on 2 and 3): the
    flag says the refresh on step 3 moves ``c``; without it ``c`` is left as it was saved there."""
    case = CASES["branch"]
    model, precond, optimizer = build(case)
    for step in range(2):
        one_step(model, precond, optimizer, case, step)
    checkpoint = saved(model, precond, optimizer)
    state = torch.load(io.BytesIO(checkpoint), weights_only=False)["precond"]
    assert state["layers"]["c"]["used_since_refresh"] is True
    assert state["layers"]["a"]["used_since_refresh"] is True
    assert state["version"] == 2

    def continued(edit):
        model, precond, optimizer = resumed(case, checkpoint, edit)
        for step in range(2, 4):  # step 3 refreshes
            one_step(model, precond, optimizer, case, step)
        return precond.state_dict()["layers"]["c"]

    with_flag, without = continued(None), continued(_drop_flag)
    saved_bases = state["layers"]["c"]["bases"]
    assert not torch.equal(with_flag["bases"]["R"][0], saved_bases["R"][0])  # moved by the refresh
    for side in ("L", "R"):  # left as it was
        for got, want in zip(without["bases"][side], saved_bases[side]):
            assert torch.equal(got, want)
    assert without["used_since_refresh"] is False and with_flag["used_since_refresh"] is False


@pytest.mark.parametrize("bad", ["yes", torch.tensor([1.0, 0.0]), None])
def test_a_bad_flag_is_refused_and_changes_nothing(bad):
    case = CASES["branch"]
    model, precond, optimizer = build(case)
    for step in range(2):
        one_step(model, precond, optimizer, case, step, optimizer_step=False)
    state = precond.state_dict()
    state["layers"]["c"]["used_since_refresh"] = bad
    fresh_model, fresh, _ = build(case)
    before = fresh.state_dict()
    with pytest.raises(ValueError, match="used_since_refresh"):
        fresh.load_state_dict(state)
    after = fresh.state_dict()
    for name, layer_state in before["layers"].items():
        assert after["layers"][name]["used_since_refresh"] == layer_state["used_since_refresh"]
        for key in ("moment", "mass"):
            assert torch.equal(after["layers"][name][key], layer_state[key])
    assert fresh.steps == 0


def test_dcp_checkpoint_resumes_bitwise_and_one_without_the_flag_loads(tmp_path):
    """``torch.distributed.checkpoint`` loads into a freshly built preconditioner's entries,
    the flag included. A checkpoint without the flag loads through a partial load, whose
    missing entry keeps the fresh preconditioner's value (False), like the default above."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    case = CASES["branch"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = train(case)
        model, precond, optimizer = build(case)
        for step in range(N):
            if step == 2:
                dcp.save({"precond": precond}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
                old_state = precond.state_dict()
                _drop_flag(old_state)
                dcp.save({"precond": old_state}, checkpoint_id=tmp_path / "old", no_dist=True)
                others = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                uninterrupted = precond.state_dict()
                model, precond, optimizer = build(case)
                model.load_state_dict(others["model"])
                optimizer.load_state_dict(others["optimizer"])
                dcp.load({"precond": precond}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
                assert_same(precond.state_dict(), uninterrupted)
            one_step(model, precond, optimizer, case, step)
    torch.testing.assert_close(torch.cat([p.detach().flatten() for p in model.parameters()]), expected,
                               rtol=0, atol=0)
    _, older, _ = build(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to load in a single process"
        dcp.load({"precond": older}, checkpoint_id=tmp_path / "old", no_dist=True,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    assert older.steps == 2
    assert older.state_dict()["layers"]["c"]["used_since_refresh"] is False
