"""PSGD Kron (``KronPreconditioner(method="psgd")``) on pointwise convolutions (kernel of size
1 in every dimension, ``[out, in, 1, ...]`` weights) gives what it gives on their ``nn.Linear``
twins: dims of size 1 after the first two (the kernel's) get no factor. A factor of size 1 is
a scalar whose own fit steps the preconditioner's scale each update, so with one per kernel dim
the conv's step drifted from the Linear's (relative differences of 0.4 to 5 after a few
updates). Checked end to end in float64: several preconditioned SGD steps of both models from
the same weights and data, one output channel (``nn.Linear(in, 1)``'s twin) included.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kron_precond import KronPreconditioner
from kron_precond.methods.psgd import PSGDFactors

F64 = torch.float64
SETTINGS = [
    {},
    {"merge_dims": True},
    {"memory_save_mode": "one_diag"},
    {"precond_update": "procrustes"},
    {"momentum_into_precond_update": True},
    {"precond_init_scale": None},
]


def _conv(dims: int, n_in: int, n_out: int, bias: bool) -> nn.Module:
    return {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims](n_in, n_out, 1, bias=bias)


class PointwiseNet(nn.Module):
    """``[B, in]`` rows through pointwise convolutions on a single position (each equal to a
    Linear), or through the Linear layers themselves."""

    def __init__(self, dims: int | None, bias: bool) -> None:
        super().__init__()
        make = (lambda i, o: nn.Linear(i, o, bias=bias)) if dims is None else (lambda i, o: _conv(dims, i, o, bias))
        self.dims = dims
        self.first, self.second, self.head = make(5, 4), make(4, 3), make(3, 1)

    def forward(self, x):
        if self.dims is not None:
            x = x.reshape(*x.shape, *([1] * self.dims))
        x = self.second(torch.tanh(self.first(x)))
        return self.head(x).reshape(x.shape[0], -1)


def _train(model: nn.Module, settings: dict, steps: int = 5) -> list[list[torch.Tensor]]:
    precond = KronPreconditioner(model, method="psgd", preconditioner_update_probability=1.0,
                                 precond_dtype=F64, **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(3)
    seen = []
    for _ in range(steps):
        x = torch.randn(8, 5, generator=generator, dtype=F64)
        y = torch.randn(8, 1, generator=generator, dtype=F64)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        precond.step()
        seen.append([p.grad.reshape(p.shape[0], -1).clone() for p in model.parameters()])
        optimizer.step()
    precond.remove()
    return seen


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "defaults")
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_pointwise_conv_steps_as_its_linear_twin(dims, settings):
    torch.manual_seed(0)
    linear = PointwiseNet(None, bias=True).to(F64)
    conv = PointwiseNet(dims, bias=True).to(F64)
    with torch.no_grad():
        for a, b in zip(conv.parameters(), linear.parameters()):
            a.copy_(b.reshape(a.shape))
    for step, (got, want) in enumerate(zip(_train(conv, settings), _train(linear, settings))):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"step {step}")


def test_only_size_one_dims_after_the_first_two_lose_their_factor():
    shapes = {(3, 4, 1, 1): (3, 4), (1, 4, 1): (1, 4), (1, 6): (1, 6), (3, 1, 1): (3, 1), (3, 4, 1, 5): (3, 4, 5),
              (7,): (7,), (): (1,)}
    for shape, work in shapes.items():
        factors = PSGDFactors(shape, squeeze_dims=True)
        assert factors.work_shape == work, shape
        twin = PSGDFactors(work)  # the twin the squeezed weight is preconditioned as
        assert factors.diagonal == twin.diagonal, shape
        assert [tuple(q.shape) for q in factors.tensors()] == [tuple(q.shape) for q in twin.tensors()], shape
    # without squeezing: a scalar factor per size-1 dim, as kron_torch builds it (the Kron optimizer)
    assert [tuple(q.shape) for q in PSGDFactors((3, 4, 1, 1)).tensors()] == [(3, 3), (4, 4), (1,), (1,)]
    assert PSGDFactors((3, 4, 1, 1), squeeze_dims=True, merge_dims=True).work_shape == (3, 4)


def _conv_preconditioner(probability: float, update: str = "eq") -> tuple[nn.Module, KronPreconditioner]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 3, 1, bias=False)).to(F64)
    return model, KronPreconditioner(model, method="psgd", preconditioner_update_probability=probability,
                                     precond_dtype=F64, precond_update=update)


def _old_layout_state(update: str) -> tuple[dict, torch.Tensor, torch.Tensor, float]:
    """A trained state in the layout files hold (a factor per dim: the two kernel dims' scalar
    factors set to 1.5 and 0.8, as a run that fitted them left them), with its ``Q_out``,
    ``Q_in`` and the scalars' product."""
    model, precond = _conv_preconditioner(1.0, update)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(6, 4, 1, 1, generator=generator, dtype=F64)).square().sum().backward()
        precond.step()
    state = precond.state_dict()
    entry = next(iter(state["layers"].values()))["factors"]["weight"]
    assert [tuple(q.shape) for q in entry["q"]] == [(3, 3), (4, 4), (1,), (1,)]
    entry["q"][2] = torch.tensor([1.5], dtype=F64)
    entry["q"][3] = torch.tensor([0.8], dtype=F64)
    precond.remove()
    return state, entry["q"][0].clone(), entry["q"][1].clone(), 1.5 * 0.8


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("update", ["eq", "procrustes"])
@pytest.mark.parametrize("route", ["load_state_dict", "dcp"])
def test_a_state_with_a_scalar_factor_per_size_one_dim_loads_as_the_preconditioner_it_holds(
        tmp_path, route, update):
    """Files keep one factor per dim (kron_torch's layout, and the one written before the kernel
    dims lost theirs). Loaded through ``load_state_dict`` or a DCP template, such a state
    preconditions with the ``P`` it holds: reference ``(s₂s₃)² Q_outᵀQ_out G Q_inᵀQ_in`` in
    float64, then the RMS clip at 1.1, the factors not updated on that step."""
    state, q_out, q_in, scalars = _old_layout_state(update)
    model, precond = _conv_preconditioner(0.0, update)
    if route == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"precond": state}, checkpoint_id=tmp_path / "old", no_dist=True)
        template = precond.state_dict()  # written in the file layout: the same entries
        dcp.load({"precond": template}, checkpoint_id=tmp_path / "old", no_dist=True)
        state = template
    precond.load_state_dict(state)
    model(torch.randn(6, 4, 1, 1, dtype=F64)).square().sum().backward()
    g = model[0].weight.grad.reshape(3, 4).clone()
    precond.step()
    want = scalars ** 2 * (q_out.T @ q_out) @ g @ (q_in.T @ q_in)
    want = want * min(1.0, 1.1 / float(want.norm() / want.numel() ** 0.5))
    # the clip's RMS is read in float32
    torch.testing.assert_close(model[0].weight.grad.reshape(3, 4), want, rtol=1e-7, atol=1e-12)
    # saved again: the file layout, a scalar factor of 1 per kernel dim (the fold is exact)
    entry = next(iter(precond.state_dict()["layers"].values()))["factors"]["weight"]
    assert [tuple(q.shape) for q in entry["q"]] == [(3, 3), (4, 4), (1,), (1,)]
    assert entry["q"][2].item() == entry["q"][3].item() == 1.0
    precond.remove()


def test_a_state_whose_factors_do_not_fit_is_refused_and_changes_nothing():
    from state_compare import assert_same

    model, precond = _conv_preconditioner(1.0)
    model(torch.randn(2, 4, 1, 1, dtype=F64)).square().sum().backward()
    precond.step()
    before = precond.state_dict()
    bad = precond.state_dict()
    next(iter(bad["layers"].values()))["factors"]["weight"]["q"].pop()  # three entries for four dims
    with pytest.raises(ValueError, match=r"expected 4 tensors of shapes \[\(3, 3\), \(4, 4\), \(1,\), \(1,\)\], got 3"):
        precond.load_state_dict(bad)
    assert_same(precond.state_dict(), before)
    precond.remove()


@pytest.mark.parametrize("scalar", [300.0, 1e-4])
def test_scalar_factors_whose_product_overflows_the_factor_dtype_are_refused_and_change_nothing(scalar):
    """Each saved factor fits float16 (300, or 1e-4), their product folded into the first factor
    (2.7e7, or 1e-12, below float16's smallest subnormal 6e-8) does not: refused at load, the
    preconditioner unchanged (a zero factor would stop the layer for good)."""
    from state_compare import assert_same

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 3, 1, bias=False))
    precond = KronPreconditioner(model, method="psgd", preconditioner_update_probability=1.0,
                                 precond_dtype=torch.float16)
    before = precond.state_dict()
    state = precond.state_dict()
    entry = next(iter(state["layers"].values()))["factors"]["weight"]
    entry["q"] = [scalar * torch.eye(3, dtype=torch.float16), 300 * torch.eye(4, dtype=torch.float16),
                  torch.full((1,), scalar, dtype=torch.float16), torch.full((1,), scalar, dtype=torch.float16)]
    entry["initialized"] = True
    with pytest.raises(ValueError, match="overflow or underflow torch.float16"):
        precond.load_state_dict(state)
    assert_same(precond.state_dict(), before)
    precond.remove()
