"""EK-FAC's pooling of ``s`` over clusters of equal eigenvalues (docs/API.md, "EK-FAC"):
it must pool what ``eigh`` cannot tell apart -- a null space, whose basis is arbitrary --
and nothing else, whatever ``inv_dtype`` stores the decomposition in.

Each case runs one ``Linear`` (float32, as most models) for two steps: step 0 measures the
factors and refreshes the bases, step 1 measures ``s`` in them and applies. The reference is
a dense float64 EK-FAC on the same rows, written here without the library's math:
``A₀ = ãᵀã / N``, ``G₀ = δᵀδ / N`` of step 0 (``δ = grad_output · N``), their ``eigh``,
``s = mean_i (Q_Gᵀ δ_i)² (Q_Aᵀ ã_i)²ᵀ`` of step 1's rows and the update
``Q_G [(Q_Gᵀ ∇ Q_A) / (s + λ)] Q_Aᵀ``. Where the reference knows a null space exactly
(fewer rows than ``A``'s width: its ``n − N`` smallest eigenvalues are zero in exact
arithmetic) it averages ``s`` over it, by construction rather than by a tolerance.

* A spectrum decaying as ``k⁻²`` (distinct eigenvalues, 8x more rows than the width): the
  update is plain EK-FAC. Chaining neighbours closer than ``n · eps · max`` pooled most of
  the spectrum (float32: 208 of 256 directions; bfloat16: all of them, ``n · eps ≥ 1``).
* A rank-deficient ``A`` (32 rows, 256 wide): its 224 null directions are pooled, the rest
  kept apart, for every ``inv_dtype``. Before the fix float64 split them over 145 clusters (the largest 112)
  (its own ``eps`` is finer than the rounding of float32 statistics, which spreads the null
  eigenvalues; relative error 0.24) and bfloat16 pooled everything (0.72).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner
from kron_precond.methods.ekfac import eigenvalue_clusters

DT = torch.float64
D_OUT = 8


def _run(d_in: int, rows: int, power: float, damping: float, inv_dtype: torch.dtype):
    """(library update at step 1, dense float64 reference, A's clusters in the library)."""
    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(d_in, d_in, dtype=DT, generator=gen))[0]
    scales = torch.arange(1, d_in + 1, dtype=DT) ** (-power / 2)
    target = torch.randn(D_OUT, d_in, dtype=DT, generator=gen)
    torch.manual_seed(1)
    layer = nn.Linear(d_in, D_OUT, bias=False)
    model = nn.Sequential(layer)
    precond = KronPreconditioner(model, method="ekfac", kl_clip=None, damping=damping, factor_decay=0.95,
                                 factor_update_steps=1, inv_update_steps=2, inv_dtype=inv_dtype)
    captured = []

    def hook(module, inputs, output):
        output.retain_grad()
        captured.append((inputs[0].detach(), output))

    handle = layer.register_forward_hook(hook)
    steps = []
    for _ in range(2):
        x = ((torch.randn(rows, d_in, dtype=DT, generator=gen) * scales) @ basis.t()).float()
        y = (x.to(DT) @ target.t() + 0.1 * torch.randn(rows, D_OUT, dtype=DT, generator=gen)).float()
        model.zero_grad()
        captured.clear()
        F.mse_loss(model(x), y).backward()
        grad = layer.weight.grad.detach().to(DT).clone()
        a, out = captured[0]
        steps.append((a.to(DT), out.grad.detach().to(DT) * rows, grad))
        precond.step()
    handle.remove()
    update = layer.weight.grad.detach().to(DT)
    clusters = precond.layers["0"].method._clusters["A"]
    return update, _dense_ekfac(steps, damping), clusters


def _dense_ekfac(steps, damping: float) -> torch.Tensor:
    (a0, g0, _), (a1, g1, grad) = steps
    d_a, q_a = torch.linalg.eigh(a0.t() @ a0 / a0.shape[0])
    _, q_g = torch.linalg.eigh(g0.t() @ g0 / g0.shape[0])
    s = ((g1 @ q_g) ** 2).t() @ ((a1 @ q_a) ** 2) / a1.shape[0]
    null = max(a0.shape[1] - a0.shape[0], 0)  # eigh is ascending: the null space comes first
    if null > 1:
        s[:, :null] = s[:, :null].mean(dim=1, keepdim=True)
    return q_g @ ((q_g.t() @ grad @ q_a) / (s + damping)) @ q_a.t()


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


# inv_dtype, damping, bound; the relative errors measured before the fix -> after it:
# float32 4.7e-3 -> 7.1e-4 and 0.30 -> 4.1e-2 (a cluster of 208 of the 256 directions ->
# clusters of at most 103, over the eigenvalues within n · eps(float32) · max of the smallest);
# bfloat16 5.5 -> 6.1e-2 (one cluster, s one scalar; what is left is the bases' 8-bit
# rounding, which no pooling undoes); float64 1.7e-6 -> 6.2e-5 (no cluster -> clusters of at
# most 11 eigenvalues within √n · eps(float32) · max, the rounding of the float32 factor).
DECAYING = [(torch.float32, 1e-3, 2e-3), (torch.float32, 1e-5, 0.1), (torch.bfloat16, 1e-3, 0.2),
            (torch.float64, 1e-3, 2e-4)]


@pytest.mark.parametrize("inv_dtype,damping,bound", DECAYING, ids=lambda v: str(v).removeprefix("torch."))
def test_a_decaying_spectrum_is_not_pooled_across_distinct_eigenvalues(inv_dtype, damping, bound):
    update, expected, (_, sizes) = _run(256, 2048, 2.0, damping, inv_dtype)
    err = _relative_error(update, expected)
    assert err <= bound, f"relative error {err:.2e} (largest cluster of A: {int(sizes.max())} of 256)"


@pytest.mark.parametrize("inv_dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=lambda v: str(v).removeprefix("torch."))
def test_a_rank_deficient_factor_pools_exactly_its_null_space(inv_dtype):
    update, expected, (index, _) = _run(256, 32, 1.0, 1e-3, inv_dtype)
    err = _relative_error(update, expected)
    # the 224 null directions (the smallest eigenvalues) one cluster, the 32 others alone
    assert index.tolist() == [0] * (256 - 32) + list(range(1, 33)), \
        f"{int(index.max()) + 1} clusters (relative error {err:.2e})"
    bound = 2e-2 if inv_dtype == torch.bfloat16 else 1e-4
    assert err <= bound, f"relative error {err:.2e}"


# ------------------------------------------------------------------ the helper itself
def test_clusters_are_anchored_at_their_smallest_member_not_chained():
    """Steps of 0.6 tolerance each: a chain would make one cluster of all of them; anchored,
    a cluster ends once a value is more than the tolerance above its first member."""
    n = 8
    eps = 1e-3
    tolerance = n * eps * 1.0  # the largest eigenvalue is 1
    values = torch.tensor([0.0, 0.6, 1.2, 1.8, 2.4, 3.0, 3.6, 1000.0], dtype=DT) * tolerance
    values[-1] = 1.0
    index, size = eigenvalue_clusters(values, eps)
    assert index.tolist() == [0, 0, 1, 1, 2, 2, 3, 4]
    assert size.tolist() == [2, 2, 2, 1, 1, 1, 1, 1]  # n entries, past the last cluster clamped to 1


def test_clusters_of_repeated_values_and_edge_cases():
    eps = torch.finfo(DT).eps
    index, size = eigenvalue_clusters(torch.tensor([0.0, 0.0, 0.0, 2.0, 2.0, 5.0], dtype=DT), eps)
    assert index.tolist() == [0, 0, 0, 1, 1, 2] and size.tolist()[:3] == [3, 2, 1]
    index, size = eigenvalue_clusters(torch.zeros(5, dtype=DT))  # an all-zero factor: one cluster
    assert index.tolist() == [0] * 5 and size.tolist()[0] == 5
    index, size = eigenvalue_clusters(torch.tensor([3.0], dtype=DT))
    assert index.tolist() == [0] and size.tolist() == [1]
    # bfloat16 values (an inv_dtype; eigh ran in float32) at float32's resolution by default:
    # 1 + 2⁻⁷ is distinct (n · eps(bfloat16) · max would be 0.023)
    index, _ = eigenvalue_clusters(torch.tensor([1.0, 1.0078125, 2.0], dtype=torch.bfloat16))
    assert index.tolist() == [0, 1, 2]


def test_clusters_match_a_python_loop_on_random_spectra():
    """The device version (no host sync) against the plain anchored loop."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        n = int(torch.randint(1, 70, (1,), generator=gen))
        gaps = torch.rand(n, dtype=DT, generator=gen) ** 4  # many small gaps, some large
        values = torch.cumsum(gaps, 0) - gaps[0]
        eps = float(torch.rand((), dtype=DT, generator=gen)) * 1e-2
        tolerance = n * eps * float(values.abs().max())
        expected, start, cluster = [], float(values[0]), 0
        for v in values.tolist():
            if v > start + tolerance:
                cluster, start = cluster + 1, v
            expected.append(cluster)
        index, size = eigenvalue_clusters(values, eps)
        assert index.tolist() == expected, f"trial {trial}"
        counts = torch.bincount(torch.tensor(expected), minlength=n).clamp_min(1)
        assert size.tolist() == counts.tolist(), f"trial {trial}"
