"""A yes/no argument given as anything but a bool is refused at construction, naming it.

``bool("no")`` is ``True``: a string (from a config file or a command line) that was coerced
would silently turn on what the user meant to turn off. Every public yes/no argument of the
torch classes is checked here, each against the class built with a real bool (which works)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from kron_precond import Kron, KronPreconditioner, WhitenedMuon


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


PRECONDITIONER = [("kfac", "symmetry_aware"), ("kfac", "colocate_factors"), ("kfac", "grafting"),
                  ("kfac", "compute_eigenvalue_outer_product"),
                  ("psgd", "momentum_into_precond_update"), ("psgd", "merge_dims"), ("shampoo", "grafting")]


@pytest.mark.parametrize("method, name", PRECONDITIONER)
@pytest.mark.parametrize("bad", ["no", "False", 1, None])
def test_preconditioner_refuses_a_non_bool(method, name, bad):
    KronPreconditioner(_model(), method=method, **{name: False})  # a bool: accepted
    with pytest.raises(TypeError, match=name):
        KronPreconditioner(_model(), method=method, **{name: bad})


@pytest.mark.parametrize("name", ["momentum_into_precond_update", "merge_dims"])
@pytest.mark.parametrize("bad", ["no", 0, None])
def test_kron_refuses_a_non_bool(name, bad):
    Kron(_model().parameters(), lr=1e-3, **{name: False})
    with pytest.raises(TypeError, match=name):
        Kron(_model().parameters(), lr=1e-3, **{name: bad})


@pytest.mark.parametrize("name", ["momentum_into_precond_update", "merge_dims"])
def test_kron_refuses_a_non_bool_in_a_param_group(name):
    opt = Kron(_model().parameters(), lr=1e-3)
    with pytest.raises(TypeError, match=name):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))], name: "no"})


@pytest.mark.parametrize("name", ["nesterov", "output_side", "center_inputs"])
def test_whitened_muon_refuses_a_non_bool(name):
    WhitenedMuon(_model(), lr=1e-3, **{name: False})
    # output_side takes two strings, "wide" and "auto": any other is a ValueError naming it
    with pytest.raises(ValueError if name == "output_side" else TypeError, match=name):
        WhitenedMuon(_model(), lr=1e-3, **{name: "no"})


@pytest.mark.parametrize("bad", ["False", 1, None])
def test_whitened_muon_refuses_an_output_side_that_is_not_a_bool_wide_or_auto(bad):
    WhitenedMuon(_model(), lr=1e-3, output_side="wide")
    WhitenedMuon(_model(), lr=1e-3, output_side="auto")
    with pytest.raises(ValueError if isinstance(bad, str) else TypeError, match="output_side"):
        WhitenedMuon(_model(), lr=1e-3, output_side=bad)


@pytest.mark.parametrize("name", ["max_prob", "min_prob", "decay", "flat_start"])
def test_the_update_probability_schedule_refuses_a_bool_for_a_number(name):
    """``True`` is an int to Python, but no probability, decay or step count is meant by it."""
    from kron_precond import precond_update_prob_schedule

    precond_update_prob_schedule(**{name: 1.0 if name != "min_prob" else 0.0})  # a number: accepted
    with pytest.raises(ValueError, match=name):
        precond_update_prob_schedule(**{name: True})


@pytest.mark.parametrize("value", [True, "0.5", torch.tensor(True)])
def test_an_update_probability_refuses_a_bool_or_a_string_also_when_a_schedule_returns_it(value):
    """``float(True)`` is 1.0 and ``float("0.5")`` 0.5: a schedule returning either (or either
    given as the constant) would refresh on a value the constant form of the setting refuses."""
    from kron_precond.schedules import UpdateDecider

    assert UpdateDecider(lambda step: 0.5)() is False  # a number: accepted
    with pytest.raises(ValueError, match="preconditioner_update_probability"):
        UpdateDecider(lambda step: value)()
    with pytest.raises(ValueError, match="preconditioner_update_probability"):
        UpdateDecider(value)
    model = _model()
    with pytest.raises(ValueError, match="preconditioner_update_probability"):  # step 0's value, at construction
        KronPreconditioner(model, method="psgd", preconditioner_update_probability=lambda step: value)
    precond = KronPreconditioner(model, method="psgd",
                                 preconditioner_update_probability=lambda step: value if step else 1.0)
    model(torch.randn(5, 4)).square().mean().backward()
    precond.step()
    model(torch.randn(5, 4)).square().mean().backward()
    with pytest.raises(ValueError, match="preconditioner_update_probability"):
        precond.step()
    assert precond.steps == 1
