"""The examples' WhitenedMuon flags reach the optimizer they build, and their defaults are the
library's (what the benchmarks measure is what a user gets)."""
from __future__ import annotations

import inspect

import pytest
import torch.nn as nn

from example_modules import load
from kron_precond import WhitenedMuon

common = load("examples/kron_examples_common.py")
char_lm = load("examples/char_lm.py")


def _built(argv: list[str]) -> WhitenedMuon:
    _, _, precond = char_lm.configs_from_args(char_lm.parse_args(argv))
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    return common.build_whitened_muon(model, 1e-2, 0.0, [], precond, post=True)


def test_the_flags_reach_the_optimizer():
    opt = _built(["--wmuon-damping", "0.03", "--wmuon-every", "10", "--wmuon-factor-decay", "0.6",
                  "--wmuon-output-side", "--wmuon-center-inputs", "all", "--wmuon-output-damping", "0.2"])
    assert opt.damping == 0.03 and opt.output_damping == 0.2
    assert opt.statistics_every == 10 and opt.factor_decay == 0.6
    assert opt.output_side and opt.center_inputs is True


def test_the_fused_qkv_flag_takes_auto_and_whole():
    assert _built([]).fused_qkv is None
    assert _built(["--wmuon-fused-qkv", "auto"]).fused_qkv is None
    assert _built(["--wmuon-fused-qkv", "whole"]).fused_qkv is False
    with pytest.raises(SystemExit):
        _built(["--wmuon-fused-qkv", "split"])


def test_the_default_fused_qkv_leaves_an_optimizer_class_its_own():
    """``auto`` passes no ``fused_qkv``, so a class built with its own (whitening_levers.py's
    ``input_fused_whole`` variant: ``functools.partial(WhitenedMuon, fused_qkv=False)``) keeps it."""
    import functools

    _, _, precond = char_lm.configs_from_args(char_lm.parse_args([]))
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    opt = common.build_whitened_muon(model, 1e-2, 0.0, [], precond, post=True,
                                     optimizer_class=functools.partial(WhitenedMuon, fused_qkv=False))
    assert opt.fused_qkv is False


def test_the_output_side_flag_takes_auto_wide_all_and_none():
    assert _built([]).output_side == "auto"
    assert _built(["--wmuon-output-side", "auto"]).output_side == "auto"
    assert _built(["--wmuon-output-side", "wide"]).output_side == "wide"
    assert _built(["--wmuon-output-side", "all"]).output_side is True
    assert _built(["--wmuon-output-side"]).output_side is True
    assert _built(["--wmuon-output-side", "none"]).output_side is False
    with pytest.raises(SystemExit):
        _built(["--wmuon-output-side", "tall"])


def test_without_flags_the_examples_build_the_library_defaults():
    opt = _built([])
    defaults = inspect.signature(WhitenedMuon.__init__).parameters
    for name in ("damping", "output_damping", "statistics_every", "factor_decay", "statistics_rows", "output_side",
                 "center_inputs", "fused_qkv", "root", "block_size", "ns_coefficients"):
        assert getattr(opt, name) == defaults[name].default, name


def test_the_examples_pass_their_float16_grad_scaler_to_whitened_muon():
    """``--amp`` in float16 builds a GradScaler; the examples hand it to ``WhitenedMuon``, whose
    default output side (the ungated MLP's first layer here) divides its scale out, so the
    float16 output gradients raise no warning about a missing ``grad_scaler``."""
    import warnings

    import torch

    _, _, precond = char_lm.configs_from_args(char_lm.parse_args([]))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    optimizer, _ = common.build_method("wmuon", model, 1e-2, 0.0, precond, grad_scaler=scaler)
    assert optimizer.output_side == "auto"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 6)).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert "output_factor" in optimizer.state[model[0].weight]
    assert not [w for w in caught if "grad_scaler" in str(w.message)]
