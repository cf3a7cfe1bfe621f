"""A ``skip_layers`` pattern that matches no module warns, naming it.

Patterns are searched in module names and class names. One that matches none -- a typo, or a
parameter's or an expert's name such as ``experts.down_weight`` (the names the layers are
listed under) -- skips nothing, and the layer it meant trains preconditioned: said at
construction, not silently. A pattern that matches leaves the construction silent.
"""
from __future__ import annotations

import warnings

import pytest
import torch.nn as nn

from kron_precond import KronPreconditioner, WhitenedMuon

BUILDERS = {
    "kfac": lambda model, skip: KronPreconditioner(model, method="kfac", skip_layers=skip, lr=0.1),
    "psgd": lambda model, skip: KronPreconditioner(model, method="psgd", skip_layers=skip),
    "whitened_muon": lambda model, skip: WhitenedMuon(model, lr=0.02, skip_layers=skip),
}


def _model():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("builder", list(BUILDERS))
@pytest.mark.parametrize("skip, missing", [("lm_hed", ["lm_hed"]), (r"\.weight$", [r"\.weight$"]),
                                           (["Tanh", "nomatch", "^2$", "experts.down_weight"],
                                            ["nomatch", "experts.down_weight"])])
def test_patterns_matching_no_module_warn_once_naming_them(builder, skip, missing):
    with pytest.warns(UserWarning, match=r"skip_layers patterns? '.*' match(es)? no module") as caught:
        BUILDERS[builder](_model(), skip)
    messages = [str(w.message) for w in caught if "skip_layers pattern" in str(w.message)]
    assert len(messages) == 1, messages
    named = messages[0].split(" match")[0]
    assert all(repr(p) in named for p in missing) and "'Tanh'" not in named and "'^2$'" not in named, named
    assert all(w.filename == __file__ for w in caught if "skip_layers pattern" in str(w.message))


@pytest.mark.parametrize("builder", list(BUILDERS))
@pytest.mark.parametrize("skip", [None, "^2$", "Tanh", ["Linear"], r"^0$"])
def test_patterns_that_match_a_module_build_silently(builder, skip):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            BUILDERS[builder](_model(), skip)
        except ValueError as err:  # every Linear skipped: nothing left to precondition
            assert skip == ["Linear"], err


@pytest.mark.parametrize("builder", [lambda m, s: KronPreconditioner(m, method="kfac", skip_layers=s),
                                     lambda m, s: WhitenedMuon(m, lr=1e-2, skip_layers=s)],
                         ids=["KronPreconditioner", "WhitenedMuon"])
def test_a_pattern_matches_the_name_without_checkpoint_and_compile_wrappers(builder):
    """torch's checkpoint_wrapper (torchtitan's activation checkpointing) and torch.compile put
    ``_checkpoint_wrapped_module`` / ``_orig_mod`` into module names: an anchored pattern written
    for the model's own names still matches, as checkpoints spell them without those."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential()
    model.add_module("layers", nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)]))
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    model.add_module("head", nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the pattern matches: no "matches no module" warning
        built = builder(model, [r"^layers\.0\.0$"])
    if isinstance(built, KronPreconditioner):
        assert sorted(built.layers) == ["head", "layers.1.0"]
    else:
        whitened = {id(p) for g in built.param_groups if g["algorithm"] == "whitened_muon" for p in g["params"]}
        assert id(model.layers[0]._checkpoint_wrapped_module[0].weight) not in whitened
        assert id(model.layers[1][0].weight) in whitened
