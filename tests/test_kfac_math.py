"""K-FAC math against independent dense references.

Every expected value here is computed explicitly in the test: activation rows are
built by hand (conv patches with explicit loops over output positions, never
``F.unfold``), output gradients are captured with ``retain_grad`` on the module
output, and the preconditioned gradient comes from a dense solve with
``torch.kron(G, A) + λI``. The library is only ever read, never used as a reference.

Conventions (docs/API.md): ``A = mean_rows(ã ãᵀ)`` with a trailing 1 per row for a
bias; ``G = mean_rows(δ δᵀ)`` with ``δ = grad_output · batch_size · accumulation_steps``;
``∇ = [W.reshape(out, -1) | b]``; EIGEN ``V = (G ⊗ A + λI)⁻¹ vec(∇)`` (row-major vec).
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner

DT = torch.float64
FACTOR_RTOL = 1e-10  # float64 factors: only summation-order rounding
PRECOND_RTOL = 1e-8  # float64 decompositions and float64 dense solve
KL_RTOL = 1e-6  # ν: the library sums ⟨V, ∇⟩ in float32 (by design, see report)


# --------------------------------------------------------------------------- helpers
def kfac(model, **kw):
    """A K-FAC preconditioner that observes and refreshes every step, in float64."""
    cfg = dict(
        factor_update_steps=1,
        inv_update_steps=1,
        kl_clip=None,
        damping=1e-2,
        inv_dtype=DT,
    )
    cfg.update(kw)
    return KronPreconditioner(model, **cfg)


class Recorder:
    """Records each call's input and output of the given modules; outputs retain grad."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.inputs = {n: [] for n in modules}
        self.outputs = {n: [] for n in modules}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name):
        def hook(module, inputs, output):
            self.inputs[name].append(inputs[0].detach().clone())
            if output.requires_grad:
                output.retain_grad()
            self.outputs[name].append(output)

        return hook

    def clear(self):
        for v in itertools.chain(self.inputs.values(), self.outputs.values()):
            v.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


def assert_close(x, ref, rtol, what=""):
    assert x.shape == ref.shape, f"{what}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    err = rel_err(x.to(ref.dtype), ref)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


def with_ones(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)


def mean_outer(rows: torch.Tensor) -> torch.Tensor:
    """mean over rows r of r rᵀ, as an explicit (float64) sum of outer products."""
    return torch.einsum("ni,nj->ij", rows, rows) / rows.shape[0]


def conv_pads(conv: nn.Module) -> list[tuple[int, int]]:
    """(before, after) zero padding per spatial dim, incl. PyTorch's asymmetric 'same'."""
    nd = len(conv.kernel_size)
    if conv.padding == "same":
        pads = []
        for k, d in zip(conv.kernel_size, conv.dilation):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    if conv.padding == "valid":
        return [(0, 0)] * nd
    return [(p, p) for p in conv.padding]


def _padded_index(i: int, size: int, mode: str) -> int | None:
    """Source index of padded position ``i`` (may be out of range) for a padding mode."""
    if 0 <= i < size:
        return i
    if mode == "zeros":
        return None
    if mode == "reflect":  # mirror without repeating the edge
        return -i if i < 0 else 2 * (size - 1) - i
    if mode == "replicate":
        return 0 if i < 0 else size - 1
    if mode == "circular":
        return i % size
    raise AssertionError(mode)


def conv_patch_rows(x: torch.Tensor, conv: nn.Module) -> torch.Tensor:
    """Patches [B·L, C·∏k] built with explicit loops over samples and output positions.

    Patch layout is (channel, k_1, ..., k_n), i.e. that of ``weight.reshape(out, -1)``;
    rows are ordered (sample, output position row-major) like ``grad_output``. Padding
    (any ``padding_mode``) is built element by element from explicit index maps.
    """
    assert conv.groups == 1
    B, C = x.shape[:2]
    spatial = x.shape[2:]
    pads = conv_pads(conv)
    padded = x.new_zeros(B, C, *[s + lo + hi for s, (lo, hi) in zip(spatial, pads)])
    maps = [[_padded_index(i - lo, s, conv.padding_mode) for i in range(s + lo + hi)]
            for s, (lo, hi) in zip(spatial, pads)]
    for pos in itertools.product(*[range(len(m)) for m in maps]):
        src = tuple(m[p] for m, p in zip(maps, pos))
        if None not in src:
            padded[(slice(None), slice(None)) + pos] = x[(slice(None), slice(None)) + src]
    k, st, dil = conv.kernel_size, conv.stride, conv.dilation
    out_sizes = [
        (p - d * (kk - 1) - 1) // s + 1 for p, kk, s, d in zip(padded.shape[2:], k, st, dil)
    ]
    rows = []
    for b in range(B):
        for pos in itertools.product(*[range(o) for o in out_sizes]):
            window = [slice(None)]
            for p, kk, s, d in zip(pos, k, st, dil):
                window.append(slice(p * s, p * s + d * (kk - 1) + 1, d))
            patch = padded[b][tuple(window)]
            assert patch.shape[1:] == tuple(k)
            rows.append(patch.reshape(-1))
    return torch.stack(rows)


def output_grad_rows(grad_out: torch.Tensor, conv: bool) -> torch.Tensor:
    """[B, out, *spatial] -> [B·L, out] (conv) or [..., out] -> [N, out] (linear)."""
    if conv:
        return grad_out.movedim(1, -1).reshape(-1, grad_out.shape[1])
    return grad_out.reshape(-1, grad_out.shape[-1])


def reference_factors(module, inputs, outputs, scale=1.0):
    """Independent A and G for one module from recorded calls.

    ``scale`` multiplies δ on top of the per-call normalisation (accumulation steps): the
    number of rows of the call for a Linear, the batch size for a convolution.
    Rows from every recorded call are pooled before taking the mean.
    """
    is_conv = isinstance(module, nn.modules.conv._ConvNd)
    a_rows, g_rows = [], []
    for x, out in zip(inputs, outputs):
        rows = conv_patch_rows(x, module) if is_conv else x.reshape(-1, x.shape[-1])
        w = module.weight.detach().reshape(module.weight.shape[0], -1)
        # Sanity: the hand-built rows reproduce the module's own forward.
        recon = rows @ w.t() + (module.bias.detach() if module.bias is not None else 0)
        got = output_grad_rows(out.detach(), is_conv)
        torch.testing.assert_close(recon, got, rtol=1e-10, atol=1e-10)
        if module.bias is not None:
            rows = with_ones(rows)
        a_rows.append(rows)
        assert out.grad is not None, "output gradient was not captured"
        # δ = grad · rows of the call for a Linear (per-token mean losses), · batch for a conv.
        per_call = x.shape[0] if is_conv else x.numel() // x.shape[-1]
        g_rows.append(output_grad_rows(out.grad, is_conv) * per_call * scale)
    return mean_outer(torch.cat(a_rows)), mean_outer(torch.cat(g_rows))


def grad_matrix(module) -> torch.Tensor:
    g = module.weight.grad.reshape(module.weight.shape[0], -1)
    if module.bias is not None:
        g = torch.cat([g, module.bias.grad.reshape(-1, 1)], dim=1)
    return g.detach().clone()


def dense_eigen(G, A, grad, damping):
    """(G ⊗ A + λI)⁻¹ vec(∇), row-major vec, by a dense solve."""
    n = G.shape[0] * A.shape[0]
    M = torch.kron(G, A) + damping * torch.eye(n, dtype=G.dtype)
    return torch.linalg.solve(M, grad.reshape(-1)).reshape(grad.shape)


def dense_inverse(G, A, grad, damping):
    """(G + γ_G I)⁻¹ ∇ (A + γ_A I)⁻¹ with the documented π-split of λ."""
    pi = torch.sqrt((torch.trace(A) / A.shape[0]) / (torch.trace(G) / G.shape[0]))
    gamma_a, gamma_g = pi * damping**0.5, damping**0.5 / pi
    Ad = A + gamma_a * torch.eye(A.shape[0], dtype=A.dtype)
    Gd = G + gamma_g * torch.eye(G.shape[0], dtype=G.dtype)
    return torch.linalg.solve(Gd, grad) @ torch.linalg.inv(Ad)


def kfac_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))}


# --------------------------------------------------------------------------- models
class LinearNet(nn.Module):
    def __init__(self, bias: bool, d_in=5, hidden=7, d_out=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, d_out, bias=bias)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class ConvNet(nn.Module):
    def __init__(self, conv: nn.Module, in_shape, d_out=3):
        super().__init__()
        self.conv = conv
        with torch.no_grad():
            n = conv(torch.zeros(1, *in_shape)).numel()
        self.fc = nn.Linear(n, d_out)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def mse_step(model, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss


LINEAR_CASES = {
    "2d-bias": (True, (16, 5)),
    "2d-nobias": (False, (16, 5)),
    "3d-bias": (True, (4, 6, 5)),
    "3d-nobias": (False, (4, 6, 5)),
}

CONV_CASES = {
    "2d-basic": (lambda: nn.Conv2d(2, 3, 3), (2, 6, 6)),
    "2d-stride-pad": (lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), (2, 7, 6)),
    "2d-rect-kernel-stride": (lambda: nn.Conv2d(2, 4, (2, 3), stride=(2, 1), padding=(1, 0)), (2, 6, 7)),
    "2d-dilation": (lambda: nn.Conv2d(2, 3, 3, dilation=2, padding=1), (2, 7, 7)),
    "2d-same-odd": (lambda: nn.Conv2d(2, 3, 3, padding="same"), (2, 5, 5)),
    "2d-same-even-dilated": (lambda: nn.Conv2d(2, 3, (2, 4), padding="same", dilation=(1, 2)), (2, 5, 6)),
    "2d-nobias": (lambda: nn.Conv2d(2, 3, 3, padding=1, bias=False), (2, 5, 5)),
    "2d-valid-nobias-stride": (lambda: nn.Conv2d(3, 2, 2, stride=2, padding="valid", bias=False), (3, 6, 6)),
    "1d-basic": (lambda: nn.Conv1d(2, 3, 3), (2, 9)),
    "1d-stride-pad-dil": (lambda: nn.Conv1d(2, 3, 3, stride=2, padding=2, dilation=2), (2, 11)),
    "1d-same-even-nobias": (lambda: nn.Conv1d(3, 2, 4, padding="same", bias=False), (3, 8)),
    "2d-reflect": (lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), (2, 5, 5)),
    "2d-replicate-stride": (lambda: nn.Conv2d(2, 3, 3, stride=2, padding=(2, 1), padding_mode="replicate"), (2, 6, 5)),
    "1d-circular": (lambda: nn.Conv1d(2, 3, 3, padding=2, padding_mode="circular"), (2, 7)),
    "3d-stride-pad": (lambda: nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=(0, 1, 1)), (2, 3, 5, 3)),
}


# --------------------------------------------------------------------------- factors
@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_linear_factors(case):
    bias, shape = LINEAR_CASES[case]
    model = LinearNet(bias).to(DT)
    x = torch.randn(*shape, dtype=DT) * 2 + 0.5
    y = torch.randn(*shape[:-1], 3, dtype=DT)
    precond = kfac(model)
    rec = Recorder(kfac_modules(model))
    mse_step(model, x, y)
    precond.step()
    assert set(precond.layers) == {"fc1", "fc2"}
    for name, m in kfac_modules(model).items():
        A_ref, G_ref = reference_factors(m, rec.inputs[name], rec.outputs[name])
        layer = precond.layers[name]
        assert layer.a_factor.shape == A_ref.shape
        assert_close(layer.a_factor, A_ref, FACTOR_RTOL, f"{name}.A")
        assert_close(layer.g_factor, G_ref, FACTOR_RTOL, f"{name}.G")
        if bias:  # the bias entry of A is mean(1·1) = 1 exactly
            assert layer.a_factor[-1, -1].item() == pytest.approx(1.0, rel=1e-12)


@pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_factors(case):
    make, in_shape = CONV_CASES[case]
    model = ConvNet(make(), in_shape).to(DT)
    x = torch.randn(3, *in_shape, dtype=DT) + 0.3
    y = torch.randn(3, 3, dtype=DT)
    precond = kfac(model)
    rec = Recorder(kfac_modules(model))
    mse_step(model, x, y)
    precond.step()
    assert set(precond.layers) == {"conv", "fc"}
    for name, m in kfac_modules(model).items():
        A_ref, G_ref = reference_factors(m, rec.inputs[name], rec.outputs[name])
        assert_close(precond.layers[name].a_factor, A_ref, FACTOR_RTOL, f"{case} {name}.A")
        assert_close(precond.layers[name].g_factor, G_ref, FACTOR_RTOL, f"{case} {name}.G")


def test_unbatched_conv_input_is_one_sample():
    """A conv called on [C, H, W] (no batch dim): rows = output positions, δ = grad · 1."""
    conv = nn.Conv2d(2, 3, 3, padding=1).to(DT)
    model = nn.Sequential(conv)
    precond = kfac(model)
    x = torch.randn(2, 5, 5, dtype=DT)
    out = model(x)
    out.retain_grad()
    (out**3).mean().backward()
    precond.step()
    rows = with_ones(conv_patch_rows(x[None], conv))
    g = output_grad_rows(out.grad[None], conv=True)
    assert_close(precond.layers["0"].a_factor, mean_outer(rows), FACTOR_RTOL, "A")
    assert_close(precond.layers["0"].g_factor, mean_outer(g), FACTOR_RTOL, "G")


def test_factor_dtype_float64_on_float32_model():
    model = LinearNet(True)  # float32 parameters
    precond = kfac(model, factor_dtype=torch.float64)
    rec = Recorder(kfac_modules(model))
    mse_step(model, torch.randn(32, 5), torch.randn(32, 3))
    precond.step()
    for name, m in kfac_modules(model).items():
        x = rec.inputs[name][0].to(DT)
        a = with_ones(x)
        d = rec.outputs[name][0].grad.to(DT) * 32
        layer = precond.layers[name]
        assert layer.a_factor.dtype == DT and layer.g_factor.dtype == DT
        # float32 values are exact in float64: only float64 summation rounding remains
        assert_close(layer.a_factor, mean_outer(a), FACTOR_RTOL, f"{name}.A")
        assert_close(layer.g_factor, mean_outer(d), FACTOR_RTOL, f"{name}.G")
        assert m.weight.grad.dtype == torch.float32


def test_patch_reference_matches_unfold_layout():
    """Self-check of the test's own patch builder on a tiny hand-computable case."""
    conv = nn.Conv2d(1, 1, 2, stride=1, padding=0, bias=False)
    x = torch.arange(9, dtype=DT).reshape(1, 1, 3, 3)
    rows = conv_patch_rows(x, conv)
    expected = torch.tensor([[0, 1, 3, 4], [1, 2, 4, 5], [3, 4, 6, 7], [4, 5, 7, 8]], dtype=DT)
    assert torch.equal(rows, expected)


@pytest.mark.parametrize("kind", ["linear3d", "conv2d"])
def test_duplicated_batch_leaves_factors_unchanged(kind):
    if kind == "linear3d":
        model = LinearNet(True).to(DT)
        x = torch.randn(4, 3, 5, dtype=DT)
        y = torch.randn(4, 3, 3, dtype=DT)
    else:
        model = ConvNet(nn.Conv2d(2, 3, 3, padding=1), (2, 5, 5)).to(DT)
        x = torch.randn(4, 2, 5, 5, dtype=DT)
        y = torch.randn(4, 3, dtype=DT)
    twin = copy.deepcopy(model)
    p1, p2 = kfac(model), kfac(twin)
    mse_step(model, x, y)
    p1.step()
    mse_step(twin, torch.cat([x, x]), torch.cat([y, y]))
    p2.step()
    for name in p1.layers:
        assert_close(p2.layers[name].a_factor, p1.layers[name].a_factor, FACTOR_RTOL, f"{name}.A")
        assert_close(p2.layers[name].g_factor, p1.layers[name].g_factor, FACTOR_RTOL, f"{name}.G")
        # and the factors are not trivially equal for any batch (G really depends on δ)
        assert p1.layers[name].g_factor.abs().max() > 1e-6


def test_factor_decay_running_average():
    d = 0.7
    model = LinearNet(True).to(DT)
    precond = kfac(model, factor_decay=d)
    rec = Recorder(kfac_modules(model))
    refs = []
    for _ in range(2):
        rec.clear()
        model.zero_grad(set_to_none=True)
        mse_step(model, torch.randn(12, 5, dtype=DT), torch.randn(12, 3, dtype=DT))
        refs.append({n: reference_factors(m, rec.inputs[n], rec.outputs[n])
                     for n, m in kfac_modules(model).items()})
        precond.step()
        if len(refs) == 1:  # first update: the batch statistics exactly, no decay
            for n in precond.layers:
                assert_close(precond.layers[n].a_factor, refs[0][n][0], FACTOR_RTOL, f"{n}.A first")
    for n in precond.layers:
        for i, attr in enumerate(("a_factor", "g_factor")):
            expected = d * refs[0][n][i] + (1 - d) * refs[1][n][i]
            assert_close(getattr(precond.layers[n], attr), expected, FACTOR_RTOL, f"{n}.{attr}")
            # discriminates: neither batch alone nor the plain mean
            assert rel_err(0.5 * (refs[0][n][i] + refs[1][n][i]), expected) > 1e-3


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_accumulation_steps_match_concatenated_batch(kind):
    k, micro = 3, 4
    if kind == "linear":
        model = LinearNet(True).to(DT)
        x = torch.randn(k * micro, 5, dtype=DT)
        y = torch.randn(k * micro, 3, dtype=DT)
    else:
        model = ConvNet(nn.Conv2d(2, 3, 3, stride=2, padding=1), (2, 6, 6)).to(DT)
        x = torch.randn(k * micro, 2, 6, 6, dtype=DT)
        y = torch.randn(k * micro, 3, dtype=DT)
    ref_model = copy.deepcopy(model)
    rec = Recorder(kfac_modules(ref_model))
    mse_step(ref_model, x, y)  # the concatenated batch, mean loss
    refs = {n: reference_factors(m, rec.inputs[n], rec.outputs[n]) for n, m in kfac_modules(ref_model).items()}

    precond = kfac(model, accumulation_steps=k)
    for i in range(k):
        sl = slice(i * micro, (i + 1) * micro)
        (F.mse_loss(model(x[sl]), y[sl]) / k).backward()
    precond.step()
    for n in precond.layers:
        assert_close(precond.layers[n].a_factor, refs[n][0], FACTOR_RTOL, f"{n}.A")
        assert_close(precond.layers[n].g_factor, refs[n][1], FACTOR_RTOL, f"{n}.G")


# --------------------------------------------------------------------------- EIGEN
EIGEN_MODELS = {
    "linear-bias": lambda: (LinearNet(True), (24, 5), 3),
    "linear-nobias": lambda: (LinearNet(False), (24, 5), 3),
    "linear3d-bias": lambda: (LinearNet(True), (4, 5, 5), 3),
    "conv2d-bias": lambda: (ConvNet(nn.Conv2d(2, 3, 3, padding=1), (2, 5, 5)), (6, 2, 5, 5), 3),
    "conv2d-nobias": lambda: (ConvNet(nn.Conv2d(2, 3, 3, stride=2, bias=False), (2, 7, 7)), (6, 2, 7, 7), 3),
}


def _run_one_step(model, x, y, precond):
    """forward/backward, save ∇ per layer, step; returns {name: (∇, V, A, G)}."""
    mods = kfac_modules(model)
    mse_step(model, x, y)
    grads = {n: grad_matrix(m) for n, m in mods.items()}
    precond.step()
    return {
        n: (grads[n], grad_matrix(m), precond.layers[n].a_factor.detach().clone(),
            precond.layers[n].g_factor.detach().clone())
        for n, m in mods.items()
    }


@pytest.mark.parametrize("outer", [True, False], ids=["outer", "no-outer"])
@pytest.mark.parametrize("case", list(EIGEN_MODELS))
def test_eigen_matches_dense_kronecker_solve(case, outer):
    damping = 3e-2
    model, in_shape, d_out = EIGEN_MODELS[case]()
    model = model.to(DT)
    x = torch.randn(*in_shape, dtype=DT)
    y = torch.randn(*in_shape[:-1], d_out, dtype=DT) if "linear" in case else torch.randn(in_shape[0], d_out, dtype=DT)
    precond = kfac(model, damping=damping, compute_method="eigen", compute_eigenvalue_outer_product=outer)
    for name, (grad, v, A, G) in _run_one_step(model, x, y, precond).items():
        ref = dense_eigen(G, A, grad, damping)
        assert_close(v, ref, PRECOND_RTOL, f"{case} {name}")
        # the check discriminates: damping matters and preconditioning is not the identity
        assert rel_err(dense_eigen(G, A, grad, 2 * damping), ref) > 1e3 * PRECOND_RTOL
        assert rel_err(grad / (grad.norm() / ref.norm()), ref) > 1e-2


def test_eigen_on_second_step_uses_running_factors():
    """Step 2 preconditions with the decayed factors (independent references)."""
    d, damping = 0.6, 1e-2
    model = LinearNet(True).to(DT)
    precond = kfac(model, damping=damping, factor_decay=d)
    rec = Recorder(kfac_modules(model))
    refs = []
    for _ in range(2):
        rec.clear()
        model.zero_grad(set_to_none=True)
        mse_step(model, torch.randn(16, 5, dtype=DT), torch.randn(16, 3, dtype=DT))
        refs.append({n: reference_factors(m, rec.inputs[n], rec.outputs[n])
                     for n, m in kfac_modules(model).items()})
        grads = {n: grad_matrix(m) for n, m in kfac_modules(model).items()}
        precond.step()
    for n, m in kfac_modules(model).items():
        A = d * refs[0][n][0] + (1 - d) * refs[1][n][0]
        G = d * refs[0][n][1] + (1 - d) * refs[1][n][1]
        assert_close(grad_matrix(m), dense_eigen(G, A, grads[n], damping), PRECOND_RTOL, n)


# --------------------------------------------------------------------------- INVERSE
@pytest.mark.parametrize("case", ["linear-bias", "linear-nobias", "conv2d-bias", "conv2d-nobias"])
def test_inverse_matches_pi_damped_reference(case):
    damping = 3e-2
    model, in_shape, d_out = EIGEN_MODELS[case]()
    model = model.to(DT)
    x = torch.randn(*in_shape, dtype=DT)
    y = torch.randn(in_shape[0], d_out, dtype=DT)
    precond = kfac(model, damping=damping, compute_method="inverse")
    for name, (grad, v, A, G) in _run_one_step(model, x, y, precond).items():
        ref = dense_inverse(G, A, grad, damping)
        assert_close(v, ref, PRECOND_RTOL, f"{case} {name}")
        # discriminates from the unsplit γ_A = γ_G = √λ and from EIGEN at this damping
        pi = torch.sqrt((torch.trace(A) / A.shape[0]) / (torch.trace(G) / G.shape[0])).item()
        assert abs(pi - 1) > 0.05, "test setup: π ≈ 1 would not test the split"
        I_a, I_g = torch.eye(A.shape[0], dtype=DT), torch.eye(G.shape[0], dtype=DT)
        unsplit = torch.linalg.solve(G + damping**0.5 * I_g, grad) @ torch.linalg.inv(A + damping**0.5 * I_a)
        assert rel_err(unsplit, ref) > 1e3 * PRECOND_RTOL


@pytest.mark.parametrize("bias", [True, False])
def test_eigen_and_inverse_agree_at_tiny_damping(bias):
    """Single layer, linear loss with random output weights: G ≈ 2500·I, A ≈ diag(16·I, 1).

    The cross terms γ_G·A + γ_A·G that INVERSE adds are then ≲1e-5 relative to G ⊗ A."""
    damping = 1e-8
    torch.manual_seed(1)
    layer = nn.Linear(6, 4, bias=bias).to(DT)
    B = 400
    x = 4 * torch.randn(B, 6, dtype=DT)
    c = 50 * torch.randn(B, 4, dtype=DT)

    def run(method):
        model = nn.Sequential(copy.deepcopy(layer))
        precond = kfac(model, damping=damping, compute_method=method)
        ((model(x) * c).sum(1).mean()).backward()
        grad = grad_matrix(model[0])
        precond.step()
        return grad, grad_matrix(model[0]), precond.layers["0"].a_factor, precond.layers["0"].g_factor

    grad, v_eig, A, G = run("eigen")
    _, v_inv, _, _ = run("inverse")
    # independent: the two dense references agree here well inside the tolerance
    ref_eig, ref_inv = dense_eigen(G, A, grad, damping), dense_inverse(G, A, grad, damping)
    assert rel_err(ref_inv, ref_eig) < 2e-5
    assert_close(v_eig, ref_eig, PRECOND_RTOL, "eigen")
    assert_close(v_inv, ref_inv, PRECOND_RTOL, "inverse")
    assert_close(v_inv, v_eig, 1e-4, "inverse vs eigen")


# --------------------------------------------------------------------------- kl_clip
@pytest.mark.parametrize("target_nu", [0.35, 1.0])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_kl_clip_scales_all_layers_by_nu(method, target_nu):
    lr, damping = 0.3, 1e-2
    model = ConvNet(nn.Conv2d(2, 3, 3, padding=1), (2, 5, 5)).to(DT)
    x = torch.randn(6, 2, 5, 5, dtype=DT)
    y = torch.randn(6, 3, dtype=DT)
    twin = copy.deepcopy(model)

    # Unclipped V: dense reference from the factors and ∇ of an identical twin run.
    twin_run = _run_one_step(twin, x, y, kfac(twin, damping=damping, compute_method=method))
    dense = dense_eigen if method == "eigen" else dense_inverse
    v_ref = {n: dense(G, A, grad, damping) for n, (grad, _, A, G) in twin_run.items()}
    for n, (_, v_twin, _, _) in twin_run.items():  # the twin itself is unclipped
        assert_close(v_twin, v_ref[n], PRECOND_RTOL, f"unclipped {n}")
    vg = sum(lr**2 * (v_ref[n] * twin_run[n][0]).sum() for n in twin_run).item()
    # κ chosen so that ν = target (ν = 1 case: κ well above lr²|⟨V,∇⟩|).
    kappa = target_nu**2 * abs(vg) if target_nu < 1 else 4 * abs(vg)
    nu = min(1.0, (kappa / abs(vg)) ** 0.5)
    assert nu == pytest.approx(target_nu)

    precond = kfac(model, damping=damping, compute_method=method, kl_clip=kappa, lr=lr)
    clipped = _run_one_step(model, x, y, precond)
    assert set(clipped) == {"conv", "fc"}
    for name, (grad, v, _, _) in clipped.items():
        torch.testing.assert_close(grad, twin_run[name][0], rtol=0, atol=0)
        assert_close(v, nu * v_ref[name], KL_RTOL, name)
