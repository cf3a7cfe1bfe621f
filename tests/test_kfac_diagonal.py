"""K-FAC with diagonal factors on wide sides (``max_factor_size``), and grafting.

Oracle: :mod:`kfac_reference`'s dense float64 K-FAC with each factor wider than the limit
replaced by the diagonal of the full factor, ``(G' ⊗ A' + λI)⁻¹ vec(∇)`` by a dense solve
(EIGEN) or the factored-Tikhonov inverses (INVERSE).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from kfac_reference import F64, DenseKFAC, grad_matrix
from kron_precond import KronPreconditioner


def mlp() -> nn.Sequential:
    """Two layers of each shape (batched apply) with every side-width case at limit 10:
    0: A 7 full, G 20 diagonal; 2: A 21 diagonal, G 20 diagonal; 4: A 21 diagonal, G 3 full."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(),
                         nn.Linear(20, 3), nn.Tanh(), nn.Linear(3, 20), nn.Tanh(),
                         nn.Linear(20, 20)).double()


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 6, generator=g, dtype=F64), torch.randn(16, 20, generator=g, dtype=F64)


def run(compute_method: str, max_factor_size, steps: int = 5, fu: int = 1, iu: int = 2, reference_limit="same",
        grafting: bool = False, reference_grafting="same"):
    model = mlp()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    precond = KronPreconditioner(model, damping=3e-2, kl_clip=None, inv_dtype=F64, factor_update_steps=fu,
                                 inv_update_steps=iu, compute_method=compute_method,
                                 max_factor_size=max_factor_size, grafting=grafting)
    dense = DenseKFAC(linears, damping=3e-2, compute_method=compute_method, factor_update_steps=fu,
                      inv_update_steps=iu,
                      max_factor_size=max_factor_size if reference_limit == "same" else reference_limit,
                      grafting=grafting if reference_grafting == "same" else reference_grafting)
    calls = {}

    def keep(name):
        def hook(module, inputs, output):
            output.retain_grad()
            calls[name] = (inputs[0].detach(), output)
        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in linears.items()]
    errors = []
    for step in range(steps):
        model.zero_grad()
        x, y = batch(step)
        ((model(x) - y) ** 2).mean().backward()
        if step % fu == 0:
            for name, (a, out) in calls.items():
                dense.observe(name, [torch.cat([a, a.new_ones(a.shape[0], 1)], 1)], [out.grad * a.shape[0]])
        expected = dense.precondition({n: grad_matrix(m) for n, m in linears.items()})
        precond.step()
        for name, module in linears.items():
            got = grad_matrix(module)
            errors.append(float((got - expected[name]).norm() / expected[name].norm()))
    for h in hooks:
        h.remove()
    return precond, max(errors)


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
@pytest.mark.parametrize("fu,iu", [(1, 1), (1, 2), (2, 4)])
def test_diagonal_sides_match_dense_reference(compute_method, fu, iu):
    precond, error = run(compute_method, 10, steps=6, fu=fu, iu=iu)
    assert error < 1e-9, f"relative error {error:.2e}"
    diagonal = {name: dict(layer.method.diagonal) for name, layer in precond.layers.items()}
    assert diagonal["0"] == {"A": False, "G": True}
    assert diagonal["2"] == {"A": True, "G": True}
    assert diagonal["4"] == {"A": True, "G": False}
    assert diagonal["6"] == {"A": False, "G": True}
    assert precond.layers["0"].method.g_factor.shape == (20,)


def test_the_reference_tells_diagonal_from_full():
    """The comparison can fail: diagonal factors against the full reference differ, and the
    diagonal factor is exactly the full factor's diagonal."""
    _, error = run("eigen", 10, reference_limit=None)
    assert error > 1e-2, f"diagonal and full factors gave the same gradients ({error:.2e})"
    precond_diag, _ = run("eigen", 10)
    precond_full, _ = run("eigen", None)
    a = precond_diag.layers["2"].method
    b = precond_full.layers["2"].method
    torch.testing.assert_close(a.a_factor, torch.diagonal(b.a_factor), rtol=1e-12, atol=0)
    torch.testing.assert_close(a.g_factor, torch.diagonal(b.g_factor), rtol=1e-12, atol=0)


def test_diagonal_state_round_trip_and_shape_check():
    precond, _ = run("eigen", 10, steps=3)
    state = precond.state_dict()
    other, _ = run("eigen", 10, steps=1)
    other.load_state_dict(state)
    for name, layer in precond.layers.items():
        twin = other.layers[name].method
        assert torch.equal(layer.method.g_factor, twin.g_factor)
        for part in ("A", "G"):
            for x, y in zip(layer.method.refreshed_tensors(part), twin.refreshed_tensors(part)):
                assert torch.equal(x, y)
    full, _ = run("eigen", None, steps=1)
    before = {n: l.method.a_factor.clone() for n, l in full.layers.items()}
    with pytest.raises(ValueError, match="a_factor|g_factor|max_factor_size"):
        full.load_state_dict(state)
    for n, l in full.layers.items():
        assert torch.equal(l.method.a_factor, before[n]), "a failed load changed state"


def test_bad_max_factor_size_raises():
    with pytest.raises(ValueError, match="max_factor_size"):
        KronPreconditioner(mlp(), max_factor_size=0)
    with pytest.raises((ValueError, TypeError), match="max_factor_size"):
        KronPreconditioner(mlp(), max_factor_size="wide")
    with pytest.warns(UserWarning, match="max_factor_size"):  # the engine's rule for another method's option
        KronPreconditioner(mlp(), method="ekfac", max_factor_size=10)


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
@pytest.mark.parametrize("limit", [None, 10])
def test_grafting_matches_dense_reference(compute_method, limit):
    """Grafted K-FAC: each layer's V rescaled to its gradient's norm, against the dense
    reference, and different from the ungrafted run (the comparison can fail)."""
    precond, error = run(compute_method, limit, steps=5, grafting=True)
    assert error < 1e-9, f"relative error {error:.2e}"

    _, against_ungrafted = run(compute_method, limit, steps=5, grafting=True, reference_grafting=False)
    assert against_ungrafted > 1e-2, f"grafting changed nothing ({against_ungrafted:.2e})"
    for layer in precond.layers.values():
        assert layer.method.grafting
