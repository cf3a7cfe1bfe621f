"""Mixed precision: bf16 autocast and a GradScaler's loss scale.

References are float32 runs of the same model on the same batch, computed independently
of the autocast / scaled path.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import Kron, KronPreconditioner, WhitenedMuon
from kron_precond.methods import registry


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_bf16_autocast_keeps_float32_factors_close_to_the_float32_run():
    x, y = _batch()
    ref_model, amp_model = _model(), _model()
    ref = KronPreconditioner(ref_model, kl_clip=None)
    amp = KronPreconditioner(amp_model, kl_clip=None)
    F.cross_entropy(ref_model(x), y).backward()
    ref.step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(amp_model(x), y)
    loss.backward()
    amp.step()
    for name in ref.layers:
        for attr in ("a_factor", "g_factor"):
            got, want = getattr(amp.layers[name], attr), getattr(ref.layers[name], attr)
            assert got.dtype == torch.float32
            assert torch.isfinite(got).all()
            # bf16 activations carry ~3 significant digits
            assert _rel(got, want) < 3e-2, f"{name}.{attr}: {_rel(got, want):.3g}"
    for p_amp, p_ref in zip(amp_model.parameters(), ref_model.parameters()):
        assert _rel(p_amp.grad, p_ref.grad) < 0.1


def test_grad_scaler_scale_is_divided_out_of_output_gradient_factors():
    x, y = _batch()
    ref_model = _model()
    scaled_model = copy.deepcopy(ref_model)
    ref = KronPreconditioner(ref_model, kl_clip=None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaled = KronPreconditioner(scaled_model, kl_clip=None, grad_scaler=scaler)
    F.cross_entropy(ref_model(x), y).backward()
    ref.step()
    optimizer = torch.optim.SGD(scaled_model.parameters(), lr=0.0)
    scaler.scale(F.cross_entropy(scaled_model(x), y)).backward()
    scaler.unscale_(optimizer)
    scaled.step()
    for name in ref.layers:
        assert _rel(scaled.layers[name].g_factor, ref.layers[name].g_factor) < 1e-5
    for p_scaled, p_ref in zip(scaled_model.parameters(), ref_model.parameters()):
        assert _rel(p_scaled.grad, p_ref.grad) < 1e-4
    # Without the scaler, G would be 2^20 times larger: the check above can fail.
    unscaled_model = copy.deepcopy(ref_model)
    plain = KronPreconditioner(unscaled_model, kl_clip=None)
    (F.cross_entropy(unscaled_model(x), y) * 2.0**10).backward()
    plain.step()
    name = next(iter(ref.layers))
    assert _rel(plain.layers[name].g_factor, ref.layers[name].g_factor) > 1e3


@pytest.mark.parametrize("build", [lambda m, **kw: WhitenedMuon(m, lr=1e-2, statistics_every=1, output_side="wide",
                                                                **kw),
                                   lambda m, **kw: KronPreconditioner(m, kl_clip=None, **kw)],
                         ids=["whitened_muon", "kfac"])
def test_float16_output_gradients_without_a_grad_scaler_warn_once(build):
    """Under float16 autocast the output gradients arrive in float16, nearly always scaled by a
    GradScaler: without ``grad_scaler`` its scale would stay in the output-side statistics, so
    the first such call warns, once; with ``grad_scaler`` (or in bfloat16) nothing is said."""
    x, y = _batch()

    def messages(dtype, scaler=None):
        model = _model()
        step = build(model) if scaler is None else build(model, grad_scaler=scaler)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                with torch.autocast("cpu", dtype=dtype):
                    loss = F.cross_entropy(model(x).float(), y)
                (loss if scaler is None else scaler.scale(loss)).backward()
                step.step()
                model.zero_grad()
        return [str(w.message) for w in caught if "float16" in str(w.message)]

    assert len(messages(torch.float16)) == 1
    assert "grad_scaler=" in messages(torch.float16)[0]
    assert not messages(torch.float16, torch.amp.GradScaler("cpu", init_scale=2.0**10))
    assert not messages(torch.bfloat16)


ACTIVATION_METHODS = {"kfac", "ekfac", "ikfac"}  # the methods with forward (and backward) statistics


def _recording(fn, seen: list):
    def wrapper(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return fn(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("method", list(registry.METHODS))
def test_statistics_and_steps_inside_an_autocast_region_are_full_precision(method):
    """A loop that keeps ``precond.step()`` inside its bf16 autocast region (with forward and
    backward) gets the ``.grad`` of a loop that steps outside it (autocast would cast the
    preconditioner's out-of-place matmuls to bf16: a ~1e-2 error), and every method computes
    its statistics, in forward and in backward hooks, with autocast off."""
    torch.manual_seed(0)
    inside_model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    outside_model = copy.deepcopy(inside_model)
    inside = KronPreconditioner(inside_model, method=method)
    outside = KronPreconditioner(outside_model, method=method)
    seen = []
    for layer in inside._layers:
        for name in ("activation_terms", "add_activation_terms", "observe_output_grads"):
            setattr(layer.method, name, _recording(getattr(layer.method, name), seen))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (inside_model, outside_model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(inside_model(x), y).backward()
            inside.step()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(outside_model(x), y).backward()
        outside.step()
        for p_in, p_out in zip(inside_model.parameters(), outside_model.parameters()):
            torch.testing.assert_close(p_in.grad, p_out.grad, rtol=1e-5, atol=1e-7)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    assert bool(seen) == (method in ACTIVATION_METHODS) and not any(seen)


@pytest.mark.parametrize("optimizer", ["Kron", "WhitenedMuon"])
def test_an_optimizer_stepped_inside_an_autocast_region_is_full_precision(optimizer):
    torch.manual_seed(0)
    inside_model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    outside_model = copy.deepcopy(inside_model)

    def build(model):
        if optimizer == "Kron":
            return Kron(model.parameters(), lr=1e-2)
        return WhitenedMuon([model[0], model[2], model[4]], lr=1e-2, statistics_every=1, ns_dtype=torch.float32)

    inside, outside = build(inside_model), build(outside_model)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
        for model, opt, region in ((inside_model, inside, True), (outside_model, outside, False)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                F.cross_entropy(model(x), y).backward()
                if region:
                    opt.step()
            if not region:
                opt.step()
            opt.zero_grad()
        for p_in, p_out in zip(inside_model.parameters(), outside_model.parameters()):
            torch.testing.assert_close(p_in, p_out, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- PSGD, float16 factors
def _psgd_run(precond_dtype, layers, steps=6, scale=1e5, grad_dtype=torch.float32, **options):
    """``layers`` Linear(4, 3) layers (two or more: preconditioned together by ``apply_batch``)
    whose gradients are ``scale`` times a fixed-seed pattern around 1 on every step, preconditioned
    by PSGD (a Q update on every step unless ``options`` say otherwise). Returns the
    preconditioner, what each step wrote into ``.grad``, the gradients it was given and how many
    layers were preconditioned together."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 3) for _ in range(layers)]).to(grad_dtype)
    options.setdefault("preconditioner_update_probability", 1.0)
    precond = KronPreconditioner(model, method="psgd", precond_dtype=precond_dtype, **options)
    written, raws = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in model.parameters():
            p.grad = (scale * (1.0 + 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64))).to(grad_dtype)
        raws.append([p.grad.clone() for p in model.parameters()])
        precond.step()
        written.append([p.grad.clone() for p in model.parameters()])
    together = max((len(key[2]) for key in precond._apply_cache if key[0] == "batch"), default=0)
    return precond, written, raws, together


@pytest.mark.parametrize("momentum", [False, True], ids=["gradient_fit", "momentum_fit"])
@pytest.mark.parametrize("layers", [1, 2], ids=["alone", "batched"])
def test_psgd_float16_factors_compute_in_float32_and_match_the_float64_run(layers, momentum):
    """float16 factors are kept in float16 and computed in float32 (as ``Kron``'s): a gradient of
    1e5, past float16's 65 504 (and, with ``momentum_into_precond_update``, a fitted average past
    it), is preconditioned, alone and batched, as with float64 factors up to the float16 rounding
    of the factors. Before, the gradient and the math were cast to float16: NaN in ``.grad``."""
    options = dict(momentum_into_precond_update=momentum)
    precond, written, _, together = _psgd_run(torch.float16, layers, **options)
    _, reference, _, _ = _psgd_run(torch.float64, layers, **options)
    assert together == layers  # the batched case ran through apply_batch with both layers
    for layer in precond.layers.values():
        assert all(q.dtype == torch.float16 for qs in layer.q_factors.values() for q in qs)
    for step, (got, want) in enumerate(zip(written, reference)):
        for g, w in zip(got, want):
            assert g.dtype == torch.float32 and torch.isfinite(g).all(), f"step {step}: {g}"
            # measured <= 1.3e-3 (the factors' float16 rounding); without the Q updates the last
            # step's tensors are 0.09-0.5 away
            assert _rel(g, w.float()) < 5e-3, f"step {step}: {_rel(g, w.float()):.3g}"


@pytest.mark.parametrize("layers", [1, 2], ids=["alone", "batched"])
def test_psgd_float16_gradients_are_clipped_before_they_are_rounded_to_float16(layers):
    """A float16 model's preconditioned gradient larger than 65 504 (here P = 100·I on gradients
    of 1e4) is RMS-clipped in float32 before it is rounded to the gradient's dtype: before, it
    overflowed first, and the clip made the Inf a NaN."""
    _, written, _, together = _psgd_run(torch.float32, layers, steps=2, scale=1e4, grad_dtype=torch.float16,
                                        precond_init_scale=10.0)
    _, reference, _, _ = _psgd_run(torch.float64, layers, steps=2, scale=1e4, grad_dtype=torch.float64,
                                   precond_init_scale=10.0)
    assert together == layers
    for got, want in zip(written, reference):
        for g, w in zip(got, want):
            assert g.dtype == torch.float16 and torch.isfinite(g).all()
            assert _rel(g.double(), w) < 2e-3  # measured 3.5e-4: float16 rounding of g and P g


@pytest.mark.parametrize("layers", [1, 2], ids=["alone", "batched"])
def test_psgd_update_that_overflows_from_a_finite_gradient_passes_the_gradient_through(layers):
    """A preconditioned gradient that is not finite although the gradient is (P = 1e38·I on
    gradients of 100: past float32's range; no Q update, which would overflow too) is not
    written: the raw gradient passes through, as a non-finite gradient's does, and the skipped
    update is counted and named in a warning (PSGD reads its counters on step 0, then every 100
    steps)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, written, raws, together = _psgd_run(torch.float32, layers, steps=1, scale=100.0,
                                               precond_init_scale=1e19, preconditioner_update_probability=0.0)
    assert together == layers
    for got, raw in zip(written[0], raws[0]):
        assert torch.equal(got, raw)
    skipped = [str(w.message) for w in caught if "non-finite update" in str(w.message)]
    # weight and bias of every layer
    assert sorted(skipped) == [f"kron_precond: skipped 2 non-finite update(s) of {i}; its state was left unchanged"
                               for i in range(layers)], [str(w.message) for w in caught]


def test_psgd_init_scale_beyond_the_factor_dtype_is_refused_at_construction_by_name():
    """``Q = s·I`` is stored in ``precond_dtype``: a scale float16 cannot hold raised torch's
    conversion error at the first step; it is a ``ValueError`` naming the option at
    construction. A scale float16 holds (its square past float16's range: the products are
    computed in float32) trains."""
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"precond_init_scale.*float16"):
        KronPreconditioner(model, method="psgd", precond_dtype=torch.float16, precond_init_scale=1e10)
    precond = KronPreconditioner(model, method="psgd", precond_dtype=torch.float16, precond_init_scale=1e3)
    model(torch.randn(2, 4)).sum().backward()
    precond.step()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
