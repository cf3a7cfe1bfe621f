"""A rejected checkpoint changes nothing: ``load_state_dict`` checks every entry before it
installs any, and raises ``ValueError`` naming the entry and the bad value.

Each test trains an object and an untouched twin alike, takes a checkpoint, trains on, corrupts
one entry of the checkpoint and loads it into the first: the load must raise, every state
tensor and counter must be as before (tensor by tensor), and the next step must equal the twin's.
"""
import copy
import math

import pytest
import torch
from torch import nn

from kron_precond import Kron, KronPreconditioner, WhitenedMuon
from state_compare import assert_same

torch.set_num_threads(1)


def _batches(count, width=4):
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(16, width, generator=gen) for _ in range(count)]




# ---------------------------------------------------------------------- KronPreconditioner
def _preconditioner(method, **settings):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    return model, KronPreconditioner(model, method=method, **settings)


def _precond_step(model, precond, x):
    """One step; the preconditioned gradients."""
    model.zero_grad()
    model(x).square().mean().backward()
    precond.step(lr=0.1)
    return [p.grad.clone() for p in model.parameters()]


def _assert_precond_load_refused(method, corrupt, match, settings=None, error=ValueError):
    """``corrupt(checkpoint)`` makes a checkpoint that ``load_state_dict`` refuses with
    ``error`` matching ``match``, changing nothing."""
    settings = settings or {}
    data = _batches(6)
    model, precond = _preconditioner(method, **settings)
    twin_model, twin = _preconditioner(method, **settings)
    for x in data[:3]:
        _precond_step(model, precond, x)
        _precond_step(twin_model, twin, x)
    checkpoint = copy.deepcopy(precond.state_dict())
    for x in data[3:5]:  # the state now differs from the checkpoint's
        _precond_step(model, precond, x)
        _precond_step(twin_model, twin, x)
    before = copy.deepcopy(precond.state_dict())
    corrupt(checkpoint)
    with pytest.raises(error, match=match):
        precond.load_state_dict(checkpoint)
    assert_same(before, precond.state_dict())
    for ours, theirs in zip(_precond_step(model, precond, data[5]), _precond_step(twin_model, twin, data[5])):
        assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------- optimizers
def _optimizer_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))


def _optimizer_step(model, opt, x):
    """One step; the parameters after it."""
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _assert_optimizer_load_refused(make, corrupt, match, error=ValueError):
    data = _batches(6)
    model, twin_model = _optimizer_model(), _optimizer_model()
    opt, twin = make(model), make(twin_model)
    for x in data[:3]:
        _optimizer_step(model, opt, x)
        _optimizer_step(twin_model, twin, x)
    checkpoint = copy.deepcopy(opt.state_dict())
    for x in data[3:5]:
        _optimizer_step(model, opt, x)
        _optimizer_step(twin_model, twin, x)
    before = copy.deepcopy(opt.state_dict())
    corrupt(checkpoint)
    with pytest.raises(error, match=match):
        opt.load_state_dict(checkpoint)
    assert_same(before, opt.state_dict())
    for ours, theirs in zip(_optimizer_step(model, opt, data[5]), _optimizer_step(twin_model, twin, data[5])):
        assert torch.equal(ours, theirs)


def _kron(model):
    return Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)


def _whitened_muon(model):
    return WhitenedMuon(model, lr=1e-2, statistics_every=1)


# ---------------------------------------------------------------------- 1: the PSGD update schedule
BAD_SCHEDULES = [
    pytest.param({"step": 3, "acc": math.nan}, "acc", id="acc-nan"),
    pytest.param({"step": 3, "acc": math.inf}, "acc", id="acc-inf"),
    pytest.param({"step": 3, "acc": 7.5}, "acc", id="acc-7.5"),
    pytest.param({"step": 3, "acc": 1.0}, "acc", id="acc-1"),
    pytest.param({"step": 3, "acc": -0.25}, "acc", id="acc-negative"),
    pytest.param({"step": 3, "acc": "x"}, "acc", id="acc-str"),
    pytest.param({"step": -4, "acc": 0.0}, "step", id="step-negative"),
    pytest.param({"step": 2.7, "acc": 0.5}, "step", id="step-fractional"),
    pytest.param({"acc": 0.5}, "step", id="step-missing"),
]


@pytest.mark.parametrize("schedule,entry", BAD_SCHEDULES)
def test_psgd_schedule_counter_refused(schedule, entry):
    def corrupt(checkpoint):
        checkpoint["schedule"] = dict(schedule)
    _assert_precond_load_refused("psgd", corrupt, rf"schedule.*{entry}",
                                 settings={"preconditioner_update_probability": 0.5})


@pytest.mark.parametrize("schedule,entry", BAD_SCHEDULES)
def test_kron_schedule_counter_refused_by_the_same_rule(schedule, entry):
    def corrupt(checkpoint):
        checkpoint["kron"]["decider"] = dict(schedule)
    _assert_optimizer_load_refused(_kron, corrupt, rf"kron\.decider.*{entry}")


def test_schedule_counter_in_range_loads():
    """The bounds themselves are what the decider reaches: acc 0 and just below 1, any step >= 0."""
    model, precond = _preconditioner("psgd", preconditioner_update_probability=0.5)
    for x in _batches(2):
        _precond_step(model, precond, x)
    for schedule in ({"step": 0, "acc": 0.0}, {"step": 10**9, "acc": 0.999999}):
        checkpoint = precond.state_dict()
        checkpoint["schedule"] = schedule
        precond.load_state_dict(checkpoint)
        assert precond.state_dict()["schedule"] == schedule


# ---------------------------------------------------------------------- 2: K-FAC / EK-FAC 'seen'
@pytest.mark.parametrize("method", ["kfac", "ekfac"])
@pytest.mark.parametrize("seen", [
    pytest.param(lambda seen: seen.reshape(1, 2), id="shape-1x2"),
    pytest.param(lambda seen: seen.reshape(2, 1), id="shape-2x1"),
    pytest.param(lambda seen: torch.full((2,), math.nan), id="nan"),
    pytest.param(lambda seen: torch.full((2,), -3), id="negative"),
    pytest.param(lambda seen: [True, True], id="list"),
])
def test_kfac_seen_flags_refused_before_any_layer_loads(method, seen):
    """The last layer's flags are bad: the first layer's factors and the counters stay as they were."""
    def corrupt(checkpoint):
        checkpoint["layers"]["2"]["seen"] = seen(checkpoint["layers"]["2"]["seen"])
    _assert_precond_load_refused(method, corrupt, r"state of 2: seen")


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_kfac_refreshed_entry_of_no_factor_is_not_read(method):
    """An entry of ``refreshed`` for no factor was looked up after the other layers had loaded
    (KeyError halfway through): only the factors' entries are checked and loaded."""
    data = _batches(4)
    model, precond = _preconditioner(method)
    for x in data[:3]:
        _precond_step(model, precond, x)
    checkpoint = copy.deepcopy(precond.state_dict())
    extra = copy.deepcopy(checkpoint)
    extra["layers"]["2"]["refreshed"]["X"] = [torch.zeros(3)]
    twin_model, twin = _preconditioner(method)
    twin.load_state_dict(checkpoint)
    precond.load_state_dict(extra)
    assert_same(checkpoint, precond.state_dict())
    twin_model.load_state_dict(model.state_dict())
    for ours, theirs in zip(_precond_step(model, precond, data[3]), _precond_step(twin_model, twin, data[3])):
        assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------- 3: checked before installed
@pytest.mark.parametrize("value,error", [
    pytest.param("x", ValueError, id="str"),
    pytest.param(None, ValueError, id="none"),
    pytest.param(math.nan, ValueError, id="nan"),
    pytest.param(-1.0, ValueError, id="negative"),
    pytest.param(0.5, ValueError, id="below-one"),
])
def test_psgd_uses_per_update_refused_before_counters_load(value, error):
    def corrupt(checkpoint):
        checkpoint["layers"]["2"]["uses_per_update"]["weight"] = value
    _assert_precond_load_refused("psgd", corrupt, r"state of 2: uses_per_update\['weight'\]", error=error)


@pytest.mark.parametrize("change", [
    pytest.param(lambda t: t.reshape(1, 1), id="shape-1x1"),
    pytest.param(lambda t: t.reshape(1), id="shape-1"),
])
def test_psgd_momentum_steps_shape_refused(change):
    """Copied in place into a 0-dim count: another shape failed after the factors had loaded."""
    def corrupt(checkpoint):
        steps = checkpoint["layers"]["2"]["momentum_steps"]
        steps["weight"] = change(steps["weight"])
    _assert_precond_load_refused("psgd", corrupt, r"state of 2: momentum_steps\['weight'\]",
                                 settings={"momentum_into_precond_update": True})


@pytest.mark.parametrize("entry,change", [
    pytest.param("nonfinite_steps", lambda t: t.reshape(1, 1), id="nonfinite_steps-1x1"),
    pytest.param("nonfinite_steps", lambda t: t.unsqueeze(0), id="nonfinite_steps-1"),
    pytest.param("step", lambda t: t.reshape(1, 1), id="step-1x1"),
    pytest.param("uses_per_update", lambda t: "x", id="uses_per_update-str"),
    pytest.param("uses_per_update", lambda t: math.nan, id="uses_per_update-nan"),
])
def test_kron_param_state_refused_before_install(entry, change):
    def corrupt(checkpoint):
        state = checkpoint["state"][2]
        state[entry] = change(state[entry])
    _assert_optimizer_load_refused(_kron, corrupt, rf"state\[2\]: {entry}")


# ---------------------------------------------------------------------- 4: impossible values
def _negate(value):
    return -value.abs() - 1.0


def _one_negative(value):
    value = value.clone()
    value.view(-1)[0] = -0.5
    return value


@pytest.mark.parametrize("change", [_negate, _one_negative], ids=["all", "one"])
@pytest.mark.parametrize("method,settings", [
    pytest.param("second_moment", {}, id="second_moment"),
    pytest.param("ikfac", {"moment_decay": 0.9}, id="ikfac"),
    pytest.param("soap", {}, id="soap"),
])
def test_negative_second_moment_refused(method, settings, change):
    def corrupt(checkpoint):
        checkpoint["layers"]["2"]["moment"] = change(checkpoint["layers"]["2"]["moment"])
    _assert_precond_load_refused(method, corrupt, r"state of 2: moment.*negative", settings=settings)


@pytest.mark.parametrize("change", [_negate, _one_negative], ids=["all", "one"])
@pytest.mark.parametrize("method,settings,factor,index", [
    pytest.param("kfac", {}, "A", 1, id="kfac-A"),
    pytest.param("kfac", {}, "G", 1, id="kfac-G"),
    pytest.param("kfac", {"max_factor_size": 4}, "A", 0, id="kfac-diagonal-A"),
    pytest.param("ekfac", {}, "A", 1, id="ekfac-A"),
    pytest.param("ekfac", {}, "G", 1, id="ekfac-G"),
])
def test_negative_kfac_eigenvalues_refused(method, settings, factor, index, change):
    def corrupt(checkpoint):
        tensors = checkpoint["layers"]["2"]["refreshed"][factor]
        tensors[index] = change(tensors[index])
    _assert_precond_load_refused(method, corrupt, rf"state of 2: refreshed\['{factor}'\]\[{index}\].*negative",
                                 settings=settings)


@pytest.mark.parametrize("change", [_negate, _one_negative], ids=["all", "one"])
@pytest.mark.parametrize("entry", ["scaling", "scaling_weight"])
def test_negative_ekfac_scaling_refused(entry, change):
    def corrupt(checkpoint):
        layer = checkpoint["layers"]["2"]
        assert layer["scaling_held"]  # else the scaling is not loaded at all
        layer[entry] = change(layer[entry])
    _assert_precond_load_refused("ekfac", corrupt, rf"state of 2: {entry}\b.*negative")


@pytest.mark.parametrize("change", [_negate, _one_negative], ids=["all", "one"])
def test_negative_adamw_second_moment_refused_by_whitened_muon(change):
    def corrupt(checkpoint):
        adamw = [key for key, state in checkpoint["state"].items() if "exp_avg_sq" in state]
        assert adamw
        state = checkpoint["state"][adamw[-1]]
        state["exp_avg_sq"] = change(state["exp_avg_sq"])
    _assert_optimizer_load_refused(_whitened_muon, corrupt, r"exp_avg_sq.*negative")
