"""Reliability, single process: no silent NaN, no silently unpreconditioned
layer, damping that means the same at any batch size and sequence length, atomic and
strict checkpoints, argument checks at construction.

Every item's tests fail on the code without its fix; the few parametrizations
that pass without it are kept as guards of the same contract (boundary values, the
conv half of the damping invariance, loading files from before the version field). Expected values come from dense
float64 formulas written in the test (``kfac_reference``), from facts about the data
(tiled batches have the same per-token mean loss), or from the state before a failing
call -- never from the library's own output for the same input.
"""
from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kfac_reference import F64, Capture, DenseKFAC, grad_matrix
from kron_precond import Kron, KronPreconditioner
from state_compare import assert_same

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LAMBDA = 1e-2


def rel_err(x, ref) -> float:
    return ((x.to(F64) - ref.to(F64)).norm() / ref.to(F64).norm()).item()


class MLP(nn.Module):
    def __init__(self, d_in=4, hidden=5, d_out=3):
        super().__init__()
        self.a = nn.Linear(d_in, hidden)
        self.b = nn.Linear(hidden, hidden)
        self.c = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def make_mlp() -> MLP:
    torch.manual_seed(3)
    return MLP().to(F64)


def batch(step: int, n: int = 8, d_in: int = 4, d_out: int = 3):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(n, d_in, generator=g, dtype=F64), torch.randn(n, d_out, generator=g, dtype=F64)


def runtime_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def snapshot(value):
    """A deep copy of a (nested) state dict, for before/after comparisons."""
    return copy.deepcopy(value)



# ============================================================================ non-finite
def test_nonfinite_grad_in_one_layer_does_not_poison_the_others_under_kl_clip():
    """One NaN in ``b``'s gradient: ``a`` and ``c`` are preconditioned and kl-clipped as if
    ``b`` were absent from the clip sum, ``b``'s gradient passes through unpreconditioned
    (the documented choice: scaled by the same kl_clip factor ν; left exactly as it was is
    accepted too), and a warning names ``b`` on that very step."""
    kl_clip, lr = 1e-4, 0.1  # small enough that the clip is active
    model = make_mlp()
    layers = {"a": model.a, "b": model.b, "c": model.c}
    precond = KronPreconditioner(model, damping=LAMBDA, inv_dtype=F64, kl_clip=kl_clip, lr=lr)
    ref = DenseKFAC(layers, damping=LAMBDA, kl_clip=kl_clip, lr=lr)
    capture = Capture(layers)
    for step in range(3):
        x, y = batch(step)
        model.zero_grad()
        capture.clear()
        F.mse_loss(model(x), y).backward()
        for name in layers:
            ref.observe(name, *capture.rows(name, grad_scale=x.shape[0]))
        bad_step = step == 2
        if bad_step:
            model.b.weight.grad[1, 2] = float("nan")
            raw_b = [model.b.weight.grad.clone(), model.b.bias.grad.clone()]
            good = {n: grad_matrix(layers[n]) for n in ("a", "c")}
            ref.kl_clip = None  # ν over a and c only, computed here
            expected = ref.precondition(good)
            total = sum((expected[n] * good[n]).sum() for n in good)
            nu = min(1.0, math.sqrt(kl_clip / abs(lr ** 2 * float(total))))
            assert nu < 1.0  # the clip is active on this step
            expected = {n: v * nu for n, v in expected.items()}
        else:
            expected = ref.precondition({n: grad_matrix(m) for n, m in layers.items()})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            precond.step()
        for name in ("a", "c"):
            got = grad_matrix(layers[name])
            assert torch.isfinite(got).all(), f"step {step}: {name} poisoned by b's NaN"
            assert rel_err(got, expected[name]) < 1e-8, (step, name)
        if bad_step:
            got_b = [model.b.weight.grad, model.b.bias.grad]
            for scale in (nu, 1.0):
                close = all(torch.equal(torch.isnan(g), torch.isnan(r)) and
                            torch.allclose(torch.nan_to_num(g), torch.nan_to_num(r * scale), rtol=1e-12, atol=0)
                            for g, r in zip(got_b, raw_b))
                if close:
                    break
            assert close, "b's gradient was not passed through"
            assert any("b" in re_names(m) for m in runtime_warnings(caught)), runtime_warnings(caught)
    capture.remove()


def re_names(message: str) -> set[str]:
    """Layer names quoted in a warning (``'b'`` or ``b``-as-a-word)."""
    import re
    return set(re.findall(r"'([^']+)'", message)) | set(re.findall(r"\b(\w+)\b", message))


def _nan_eigh_for(dtypes, real_eigh):
    def eigh(matrix, *args, **kwargs):
        values, vectors = real_eigh(matrix, *args, **kwargs)
        if matrix.dtype in dtypes:
            return values * float("nan"), vectors
        return values, vectors
    return eigh


def test_eigh_returning_nan_is_retried_in_float64(monkeypatch):
    """``eigh`` that returns NaN without raising (seen on GPUs) counts as a failure: the
    float64 retry is used and the result matches the dense reference."""
    model = make_mlp()
    layers = {"a": model.a, "b": model.b, "c": model.c}
    precond = KronPreconditioner(model, damping=LAMBDA, inv_dtype=torch.float32, kl_clip=None)
    ref = DenseKFAC(layers, damping=LAMBDA)
    capture = Capture(layers)
    monkeypatch.setattr(torch.linalg, "eigh", _nan_eigh_for({torch.float32}, torch.linalg.eigh))
    for step in range(2):
        x, y = batch(step)
        model.zero_grad()
        capture.clear()
        F.mse_loss(model(x), y).backward()
        for name in layers:
            ref.observe(name, *capture.rows(name, grad_scale=x.shape[0]))
        expected = ref.precondition({n: grad_matrix(m) for n, m in layers.items()})
        precond.step()
        for name, layer in layers.items():
            assert rel_err(grad_matrix(layer), expected[name]) < 1e-4, (step, name)
    capture.remove()


def test_eigh_returning_nan_in_every_dtype_keeps_the_previous_decomposition(monkeypatch):
    model = make_mlp()
    layers = {"a": model.a, "b": model.b, "c": model.c}
    precond = KronPreconditioner(model, damping=LAMBDA, inv_dtype=F64, kl_clip=None)
    ref = DenseKFAC(layers, damping=LAMBDA)
    capture = Capture(layers)
    real_eigh = torch.linalg.eigh
    for step in range(3):
        if step == 1:  # from now on every eigh "succeeds" with NaN eigenvalues
            monkeypatch.setattr(torch.linalg, "eigh", _nan_eigh_for({torch.float32, F64}, real_eigh))
            ref.inv_update_steps = 10**9  # the reference keeps step 0's decomposition
        x, y = batch(step)
        model.zero_grad()
        capture.clear()
        F.mse_loss(model(x), y).backward()
        for name in layers:
            ref.observe(name, *capture.rows(name, grad_scale=x.shape[0]))
        expected = ref.precondition({n: grad_matrix(m) for n, m in layers.items()})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            precond.step()
        for name, layer in layers.items():
            assert rel_err(grad_matrix(layer), expected[name]) < 1e-8, (step, name)
        if step >= 1:
            assert any("eigendecomposition" in m for m in runtime_warnings(caught)), runtime_warnings(caught)
    capture.remove()


# ============================================================================ capture
class ProjectInPlace(nn.Module):
    """Wav2Vec2-style: a projection of a [B, T, D] input whose output is then modified
    in place (the output of Linear on a 3-D input is a view)."""

    def __init__(self, proj: nn.Module):
        super().__init__()
        self.proj = proj
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        h = self.proj(x)
        h.mul_(2.0)
        return self.head(torch.tanh(h))


class Conv1D(nn.Module):
    """GPT-2 / Hugging Face ``Conv1D``: ``y = x @ W + b`` with ``W`` stored ``[in, out]``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


@pytest.mark.parametrize("kind", ["Linear", "Conv1D"])
def test_inplace_modified_view_output_still_gives_g_statistics(kind):
    torch.manual_seed(0)
    proj = nn.Linear(4, 5) if kind == "Linear" else Conv1D(5, 4)
    model = ProjectInPlace(proj).to(F64)
    precond = KronPreconditioner(model, damping=LAMBDA, inv_dtype=F64, kl_clip=None)
    x = torch.randn(3, 6, 4, dtype=F64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x).pow(2).mean().backward()
        raw = model.proj.weight.grad.clone()
        precond.step()
    assert not runtime_warnings(caught), runtime_warnings(caught)
    # Reference: the same function without the in-place op; δ = ∂loss/∂(projection output).
    out = proj(x).detach().requires_grad_(True)
    model.head(torch.tanh(out * 2.0)).pow(2).mean().backward()
    rows = out.grad.reshape(-1, 5)
    g_ref = rows.T @ rows
    g = precond.layers["proj"].g_factor
    assert g.abs().sum() > 0, "the projection never received output gradients"
    # Compared up to its normalisation (tested separately): the direction of G.
    assert rel_err(g / g.trace(), g_ref / g_ref.trace()) < 1e-10
    assert not torch.allclose(model.proj.weight.grad, raw), "the projection was not preconditioned"


@pytest.mark.parametrize("kind", ["Linear", "Conv1D"])
@pytest.mark.parametrize("join", ["cat0", "stack0", "cat1_batch1"])
def test_an_output_that_is_not_the_first_piece_of_a_concatenation_gives_its_own_g(kind, join):
    """The output's gradient reaches the hook as a slice of the concatenation's gradient (a
    view at a storage offset): a soft prompt or a projector spliced into the sequence, a shared
    block whose calls are stacked. G must be read from the output's own rows."""
    torch.manual_seed(0)
    proj = (nn.Linear(4, 5) if kind == "Linear" else Conv1D(5, 4)).to(F64)
    precond = KronPreconditioner(proj, damping=LAMBDA, inv_dtype=F64, kl_clip=None)
    x = torch.randn(1 if join == "cat1_batch1" else 2, 3, 4, dtype=F64)
    other = torch.full((*x.shape[:-1], 5), 7.0, dtype=F64, requires_grad=True)
    y = proj(x)
    joined = {"cat0": lambda: torch.cat([other, y], 0), "stack0": lambda: torch.stack([other, y], 0),
              "cat1_batch1": lambda: torch.cat([other, y], 1)}[join]()
    weights = torch.randn_like(joined)
    (joined.square() * weights).sum().backward()
    precond.step()
    # Reference: δ = ∂loss/∂y from the same function, y a leaf
    out = y.detach().requires_grad_(True)
    again = {"cat0": lambda: torch.cat([other, out], 0), "stack0": lambda: torch.stack([other, out], 0),
             "cat1_batch1": lambda: torch.cat([other, out], 1)}[join]()
    (again.square() * weights).sum().backward()
    rows = out.grad.reshape(-1, 5)
    g_ref = rows.T @ rows
    g = precond.layers[""].g_factor
    assert rel_err(g / g.trace(), g_ref / g_ref.trace()) < 1e-10


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 5)
        self.c = nn.Linear(5, 3)

    def forward(self, x, use_b=True):
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.c(h)


def test_layer_that_stops_receiving_statistics_is_reported_by_name():
    torch.manual_seed(0)
    model = Branchy().to(F64)
    precond = KronPreconditioner(model, damping=LAMBDA, inv_dtype=F64, kl_clip=None)
    messages = []
    for step in range(5):
        x, y = batch(step)
        model.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            F.mse_loss(model(x, use_b=step < 2), y).backward()
            precond.step()
        messages.append(runtime_warnings(caught))
    assert not any(messages[:2]), messages
    later = [m for ms in messages[2:] for m in ms if "'b'" in m or " b " in m or "b:" in m]
    assert len(later) == 1, messages  # reported once, naming the layer


# ============================================================================ dtypes
@pytest.mark.parametrize("method", ["kfac", "ekfac", "ikfac", "shampoo"])
def test_a_float16_factor_dtype_is_refused_naming_it(method):
    """float16's range (6.1e-5 to 65,504) loses the statistics at ordinary scales: inputs of
    size 300 overflow A (skipped as non-finite: the layer is never preconditioned), of size
    1e-4 round it to 0. bfloat16 stores them at the same cost with float32's range."""
    KronPreconditioner(nn.Linear(3, 2), method=method, factor_dtype=torch.bfloat16)  # accepted
    with pytest.raises(ValueError, match="factor_dtype.*float16"):
        KronPreconditioner(nn.Linear(3, 2), method=method, factor_dtype=torch.float16)


def test_statistics_of_a_float16_model_over_many_rows_do_not_overflow():
    """70,000 rows of |x| ≈ 1 sum past float16's 65,504: a float16 model's factors are
    float32 by default, and the statistics are accumulated in float32."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2).half()
    precond = KronPreconditioner(layer, kl_clip=None)
    x = (torch.rand(70_000, 3) + 0.5).half()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(x).float().pow(2).mean().backward()
        precond.step()
    assert not runtime_warnings(caught), runtime_warnings(caught)
    rows = torch.cat([x.double(), torch.ones(70_000, 1, dtype=F64)], dim=1)
    a_ref = rows.T @ rows / rows.shape[0]
    a = precond.layers[""].a_factor.double()
    assert torch.isfinite(a).all() and rel_err(a, a_ref) < 1e-2


def test_bfloat16_statistics_of_many_calls_are_summed_in_float32():
    """600 one-row calls of x = 1: A = 1 exactly; a bfloat16 running sum stops at 256."""
    layer = nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    precond = KronPreconditioner(layer, kl_clip=None, factor_dtype=torch.bfloat16)
    x = torch.ones(1, 1, dtype=torch.bfloat16)
    loss = sum(layer(x).float().sum() for _ in range(600))
    loss.backward()
    precond.step()
    a = precond.layers[""].a_factor.float()
    assert abs(a.item() - 1.0) < 1e-2, a


# ============================================================================ damping scale
class TokenNet(nn.Module):
    def __init__(self, batch_first=True):
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(4, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def _token_factors(x, y, batch_first=True):
    torch.manual_seed(11)
    model = TokenNet(batch_first).to(F64)
    precond = KronPreconditioner(model, damping=LAMBDA, inv_dtype=F64, kl_clip=None)
    F.mse_loss(model(x), y).backward()  # the per-token mean
    precond.step()
    return {n: (l.a_factor.clone(), l.g_factor.clone()) for n, l in precond.layers.items()}, \
        {n: p.grad.clone() for n, p in model.named_parameters()}


def test_per_token_mean_loss_factors_are_independent_of_batch_and_sequence_length():
    """Tiling a [B, T, D] batch along B or T leaves the per-token mean loss, its gradient
    and -- with G normalised by the rows of the call -- both factors unchanged; the
    factors equal the dense ``G = mean(δδᵀ)`` with ``δ = ∂loss/∂out · rows``."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 4, generator=g, dtype=F64)
    y = torch.randn(2, 3, 3, generator=g, dtype=F64)
    base, base_grads = _token_factors(x, y)
    for name, (xt, yt) in {"batch x2": (x.repeat(2, 1, 1), y.repeat(2, 1, 1)),
                           "time x3": (x.repeat(1, 3, 1), y.repeat(1, 3, 1)),
                           "seq-first": (x.transpose(0, 1), y.transpose(0, 1))}.items():
        factors, grads = _token_factors(xt, yt, batch_first=name != "seq-first")
        for layer in base:
            for i, f in enumerate("AG"):
                assert rel_err(factors[layer][i], base[layer][i]) < 1e-10, (name, layer, f)
        for pname in grads:
            assert rel_err(grads[pname], base_grads[pname]) < 1e-10, (name, pname)
    # Dense reference for the base batch.
    torch.manual_seed(11)
    model = TokenNet().to(F64)
    cap = Capture({"out": model.out})
    F.mse_loss(model(x), y).backward()
    (a_rows,), (g_rows,) = cap.rows("out", grad_scale=x.shape[0] * x.shape[1])
    assert rel_err(base["out"][1], g_rows.T @ g_rows / g_rows.shape[0]) < 1e-10
    assert rel_err(base["out"][0], a_rows.T @ a_rows / a_rows.shape[0]) < 1e-10


def test_conv_per_sample_mean_loss_factors_are_independent_of_batch_size():
    def factors(x, y):
        torch.manual_seed(12)
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(),
                              nn.Linear(3 * 16, 2)).to(F64)
        precond = KronPreconditioner(model, damping=LAMBDA, inv_dtype=F64, kl_clip=None)
        F.cross_entropy(model(x), y).backward()  # mean over samples
        precond.step()
        return {n: (l.a_factor.clone(), l.g_factor.clone()) for n, l in precond.layers.items()}, model

    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 2, 4, 4, generator=g, dtype=F64)
    y = torch.randint(0, 2, (3,), generator=g)
    base, model = factors(x, y)
    tiled, _ = factors(x.repeat(4, 1, 1, 1), y.repeat(4))
    for layer in base:
        for i in range(2):
            assert rel_err(tiled[layer][i], base[layer][i]) < 1e-10, (layer, i)
    # Dense reference: δ = ∂loss/∂out · B per output position.
    torch.manual_seed(12)
    conv = model[0]
    out = conv(x).detach().requires_grad_(True)
    F.cross_entropy(model[3](torch.tanh(out).flatten(1)), y).backward()
    rows = out.grad.movedim(1, -1).reshape(-1, 3) * x.shape[0]
    assert rel_err(base["0"][1], rows.T @ rows / rows.shape[0]) < 1e-10


# ============================================================================ hyperparameters
def test_callable_lr_returning_zero_is_accepted_with_kl_clip():
    model = make_mlp()
    precond = KronPreconditioner(model, damping=LAMBDA, inv_dtype=F64, kl_clip=1e-3,
                                 lr=lambda step: 0.1 * step)  # warm-up from 0
    for step in range(2):
        x, y = batch(step)
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        precond.step()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_callable_precond_lr_returning_zero_is_accepted():
    model = make_mlp()
    precond = KronPreconditioner(model, method="psgd", precond_lr=lambda step: 0.05 * step)
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    precond.step()


@pytest.mark.parametrize("bad", [
    dict(damping=lambda s: -1.0 if s == 2 else LAMBDA),
    dict(lr=lambda s: -1.0 if s == 2 else 0.1, kl_clip=1e-3),
    dict(factor_decay=lambda s: 2.0 if s == 2 else 0.9),
    dict(kl_clip=lambda s: float("nan") if s == 2 else 1e-3),
], ids=["damping", "lr", "factor_decay", "kl_clip"])
def test_step_that_raises_leaves_no_state_half_updated(bad):
    model = make_mlp()
    precond = KronPreconditioner(model, inv_dtype=F64, **{"kl_clip": None, **bad})
    for step in range(3):
        x, y = batch(step)
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        if step < 2:
            precond.step()
            continue
        before = snapshot(precond.state_dict())
        grads = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(ValueError):
            precond.step()
        assert_same(precond.state_dict(), before)
        assert_same([p.grad for p in model.parameters()], grads, "grads")
        assert precond.steps == 2


@pytest.mark.parametrize("name", ["lr", "damping"])
def test_a_callable_setting_is_first_called_by_the_step_that_reads_it(name):
    """A callable setting may read an object built after the preconditioner (an optimizer, a
    scheduler): the constructor does not call it; the step that reads it checks its value."""
    model = make_mlp()
    holder = {}
    precond = KronPreconditioner(model, kl_clip=1e-3, **{name: lambda s: holder["optimizer"].param_groups[0]["lr"]})
    holder["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    holder["optimizer"].param_groups[0]["lr"] = -1.0  # refused when read
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(ValueError, match=name):
        precond.step()


# ============================================================================ checkpoints
def _trained_kfac(steps=3, **kw):
    model = make_mlp()
    precond = KronPreconditioner(model, **{"damping": LAMBDA, "inv_dtype": F64, "kl_clip": None, **kw})
    for step in range(steps):
        x, y = batch(step)
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        precond.step()
    return model, precond


def _trained_psgd(steps=3):
    model = make_mlp()
    precond = KronPreconditioner(model, method="psgd", precond_dtype=F64)
    for step in range(steps):
        x, y = batch(step)
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        precond.step()
    return model, precond


def _corrupt(state, how):
    state = snapshot(state)
    layer = state["layers"]["b"]
    if how == "missing-schedule":  # the PSGD update counters (named "decider" before v2)
        state.pop("schedule", None)
        state.pop("decider", None)
    elif how == "missing-layer-key":
        layer.pop("refreshed" if "refreshed" in layer else "factors")
    elif how == "wrong-shape":
        if "refreshed" in layer:
            layer["refreshed"]["G"][0] = torch.zeros(7, 7, dtype=F64)
        else:
            layer["factors"]["weight"]["q"][0] = torch.zeros(7, 7, dtype=F64)
    elif how == "int-dtype":
        if "a_factor" in layer:
            layer["a_factor"] = layer["a_factor"].round().to(torch.int64)
        else:
            q = layer["factors"]["weight"]["q"]
            q[0] = q[0].round().to(torch.int64)
    elif how == "nan":
        if "a_factor" in layer:
            layer["g_factor"][0, 0] = float("nan")
        else:
            layer["factors"]["weight"]["q"][1][0, 0] = float("nan")
    elif how == "wrong-flag-type":
        state["steps"] = "three"
    return state


CORRUPTIONS = ["missing-schedule", "missing-layer-key", "wrong-shape", "int-dtype", "nan", "wrong-flag-type"]


@pytest.mark.parametrize("method", ["kfac", "psgd"])
@pytest.mark.parametrize("how", CORRUPTIONS)
def test_failed_load_changes_nothing(method, how):
    _, saved = (_trained_kfac if method == "kfac" else _trained_psgd)(steps=3)
    _, target = (_trained_kfac if method == "kfac" else _trained_psgd)(steps=1)
    before = snapshot(target.state_dict())
    with pytest.raises((ValueError, KeyError, TypeError)):
        target.load_state_dict(_corrupt(saved.state_dict(), how))
    assert_same(target.state_dict(), before)


@pytest.mark.parametrize("how", ["nan", "int-dtype"])
def test_nan_and_integer_factors_are_rejected_with_value_error(how):
    _, precond = _trained_kfac()
    with pytest.raises(ValueError, match="b"):
        precond.load_state_dict(_corrupt(precond.state_dict(), how))


def test_checkpoint_with_unknown_layers_raises_or_warns_when_not_strict():
    _, big = _trained_kfac()
    state = big.state_dict()
    state["layers"]["extra"] = state["layers"]["c"]
    _, target = _trained_kfac(steps=1)
    before = snapshot(target.state_dict())
    with pytest.raises(ValueError, match="extra"):
        target.load_state_dict(state)
    assert_same(target.state_dict(), before)
    with pytest.warns(UserWarning, match="extra"):
        target.load_state_dict(state, strict=False)
    assert target.steps == big.steps


def test_state_dict_has_a_format_version():
    _, precond = _trained_kfac(steps=1)
    assert isinstance(precond.state_dict().get("version"), int)


def _fixture_model(saved):
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model.load_state_dict(saved["model"])
    return model


def test_unversioned_kfac_checkpoint_still_loads_and_preconditions_like_its_factors():
    saved = torch.load(FIXTURES / "unversioned_kfac.pt", weights_only=False)
    model = _fixture_model(saved)
    kwargs = dict(saved["kwargs"], inv_update_steps=1000)  # no refresh: use the saved one
    precond = KronPreconditioner(model, **kwargs)
    precond.load_state_dict(saved["precond"])
    assert precond.steps == 3
    g = torch.Generator().manual_seed(999)
    x, y = torch.randn(8, 4, generator=g, dtype=F64), torch.randn(8, 3, generator=g, dtype=F64)
    ((model(x) - y) ** 2).mean().backward()
    raw = {n: grad_matrix(model[int(n)]) for n in ("0", "2")}
    precond.step()
    for name in ("0", "2"):
        layer = saved["precond"]["layers"][name]
        a, gf = layer["a_factor"], layer["g_factor"]
        m = torch.kron(gf, a) + 1e-2 * torch.eye(a.shape[0] * gf.shape[0], dtype=F64)
        expected = torch.linalg.solve(m, raw[name].reshape(-1)).reshape(raw[name].shape)
        assert rel_err(grad_matrix(model[int(name)]), expected) < 1e-8, name


def test_unversioned_psgd_checkpoint_still_loads_and_preconditions_like_its_factors():
    saved = torch.load(FIXTURES / "unversioned_psgd.pt", weights_only=False)
    model = _fixture_model(saved)
    kwargs = dict(saved["kwargs"], preconditioner_update_probability=0.0)
    precond = KronPreconditioner(model, method="psgd", **kwargs)
    precond.load_state_dict(saved["precond"])
    g = torch.Generator().manual_seed(999)
    x, y = torch.randn(8, 4, generator=g, dtype=F64), torch.randn(8, 3, generator=g, dtype=F64)
    ((model(x) - y) ** 2).mean().backward()
    raw = model[0].weight.grad.clone()
    precond.step()
    q0, q1 = saved["precond"]["layers"]["0"]["factors"]["weight"]["q"]
    u = (q0.T @ q0) @ raw @ (q1.T @ q1)
    u = u * min(1.0, 1.1 / u.square().mean().sqrt().item())
    assert rel_err(model[0].weight.grad, u) < 1e-8


def _kron_setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return model, Kron(model.parameters(), lr=1e-2)


def _kron_train(model, opt, steps):
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x.float()), y.float()).backward()
        opt.step()


@pytest.mark.parametrize("how", ["missing-momentum", "wrong-shape-q", "missing-kron"])
def test_failed_kron_load_changes_nothing(how):
    model, opt = _kron_setup()
    _kron_train(model, opt, 3)
    state = snapshot(opt.state_dict())
    bad = snapshot(state)
    last = max(bad["state"])
    if how == "missing-momentum":
        del bad["state"][last]["momentum_buffer"]
    elif how == "wrong-shape-q":
        bad["state"][last]["Q"]["0"] = torch.zeros(9, 9)  # saved by position
    else:
        bad["kron"] = {"decider": {}}
    with pytest.raises((ValueError, KeyError)):
        opt.load_state_dict(bad)
    assert_same(opt.state_dict(), state)


# ============================================================================ arguments
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, True, "1"])
def test_bucket_cap_must_be_a_finite_number(value):
    with pytest.raises(ValueError, match="allreduce_bucket_cap_mb"):
        KronPreconditioner(make_mlp(), allreduce_bucket_cap_mb=value)


def test_numpy_and_zero_dim_tensor_numbers_are_accepted_like_floats():
    def run(kind, convert):
        model = make_mlp()
        kw = dict(damping=convert(LAMBDA), factor_decay=convert(0.9), kl_clip=convert(1e-3), lr=convert(0.1),
                  allreduce_bucket_cap_mb=convert(1.0), inv_dtype=F64)
        if kind == "psgd":
            kw = dict(method="psgd", precond_lr=convert(0.1), precond_b1=convert(0.5), lr=convert(0.1),
                      precond_init_scale=convert(1.0), preconditioner_update_probability=convert(0.5),
                      precond_dtype=F64)
        precond = KronPreconditioner(model, **kw)
        x, y = batch(0)
        F.mse_loss(model(x), y).backward()
        precond.step()
        return [p.grad.clone() for p in model.parameters()]

    for kind in ("kfac", "psgd"):
        expected = run(kind, float)
        for convert in (np.float32, np.float64, lambda v: torch.tensor(v, dtype=F64)):
            got = run(kind, convert)
            for g, e in zip(got, expected):
                assert rel_err(g, e) < 1e-6, (kind, convert)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 4))]
    Kron(params, lr=np.float32(1e-3), b1=np.float32(0.9), weight_decay=np.float32(0.1),
         precond_lr=torch.tensor(0.1), clipnorm=np.float32(1.0), seed=np.int64(3))


@pytest.mark.parametrize("make", [
    lambda: KronPreconditioner(make_mlp(), method="psgd", seed=1.7),
    lambda: Kron([nn.Parameter(torch.zeros(2, 2))], seed=1.7),
], ids=["KronPreconditioner", "Kron"])
def test_fractional_seed_is_rejected(make):
    with pytest.raises(ValueError, match="seed"):
        make()


@pytest.mark.parametrize("name", ["lr", "b1", "weight_decay", "precond_lr", "precond_init_scale", "clipnorm",
                                  "clipvalue", "global_clipnorm", "max_size_triangular", "min_ndim_triangular",
                                  "preconditioner_update_probability"])
def test_kron_rejects_bools_for_numbers(name):
    with pytest.raises(ValueError, match=name):
        Kron([nn.Parameter(torch.zeros(2, 2))], **{name: True})


@pytest.mark.parametrize("name", ["precond_init_scale", "clipnorm", "clipvalue", "global_clipnorm"])
def test_kron_rejects_values_that_overflow_at_construction(name):
    with pytest.raises(ValueError, match=name):
        Kron([nn.Parameter(torch.zeros(2, 2))], **{name: 1e308})


def test_preconditioner_rejects_an_init_scale_that_overflows():
    with pytest.raises(ValueError, match="precond_init_scale"):
        KronPreconditioner(make_mlp(), method="psgd", precond_init_scale=1e308)


def test_max_size_triangular_zero_means_all_diagonal_in_both_apis():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(3, 4))
    opt = Kron([weight], max_size_triangular=0)
    weight.grad = torch.randn(3, 4)
    opt.step()
    assert [q.dim() for q in opt.state[weight]["Q"]] == [1, 1]
    model = nn.Linear(4, 3)
    precond = KronPreconditioner(model, method="psgd", max_size_triangular=0)
    assert [q.dim() for q in precond.layers[""].q_factors["weight"]] == [1, 1]


@pytest.mark.parametrize("method, options", [
    ("second_moment", dict(moment_decay=0.9)),
    ("ikfac", dict(moment_decay=0.9, factor_update_steps=100, inv_update_steps=100)),
    ("soap", dict(moment_decay=0.9, inv_update_steps=100)),
])
def test_a_non_finite_step_leaves_the_moments_bias_correction_as_if_it_never_happened(method, options):
    """A non-finite gradient leaves a running second moment unchanged, and its bias correction
    too: the run goes on exactly as the run in which that step never happened (a GradScaler's
    first steps are often inf). One input batch, with targets that change every step: ikfac's
    A, and so its inverse, is then the same in both runs (its warm-up refreshes on steps 1, 2
    and 4 fall on different data steps in the two), and the gradients still differ per step."""
    x = torch.randn(8, 4, dtype=F64, generator=torch.Generator().manual_seed(10))

    def run(with_bad_step: bool) -> torch.Tensor:
        torch.manual_seed(0)
        layer = nn.Linear(4, 3).to(F64)
        precond = KronPreconditioner(layer, method=method, **options)
        for step in range(4):
            if step == 1 and not with_bad_step:
                continue
            y = torch.randn(8, 3, dtype=F64, generator=torch.Generator().manual_seed(20 + step))
            layer.zero_grad()
            (layer(x) - y).pow(2).mean().backward()
            if step == 1:
                layer.weight.grad[0, 0] = float("nan")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the non-finite step is reported
                precond.step()
        return layer.weight.grad.clone()

    torch.testing.assert_close(run(True), run(False), rtol=1e-12, atol=0)


def test_the_moments_bias_correction_is_exact_for_a_decay_near_one():
    """1 − βᵗ cancels most of its digits for β near 1: in float32 it was 1e-5 off at β = 0.999.
    A float32 layer's first step against the float64 formula ∇ / (√(m / (1 − β)) + ε)."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    precond = KronPreconditioner(layer, method="second_moment", moment_decay=0.999)
    layer(torch.randn(16, 6)).square().mean().backward()
    raw = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).double()
    precond.step()
    moment = (1 - 0.999) * raw.square()
    expected = raw / ((moment / (1 - 0.999)).sqrt() + 1e-8)
    got = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).double()
    torch.testing.assert_close(got, expected, rtol=2e-7, atol=0)
