"""``KronPreconditioner(method="ikfac")``: input-side K-FAC, ``∇ (A + λI)⁻¹``.

Checked against a dense float64 reference built from the activation rows the test itself
records (its own forward hooks), not from the method's state: the running A, the
trace-relative damping, the inverse, the optional second moment after it. Also: statistics
only on statistics steps and no output-gradient hook at all, a checkpoint round trip, bad
options, and two gloo ranks on half batches against one process on the whole batch.
"""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

from dist_utils import run_workers
from kron_precond import KronPreconditioner
from kron_precond import capture as capture_module

F64 = torch.float64


class Net(nn.Module):
    """Equal-shape layers (batched together), a bias-free one and a wider input: [B, T, d]."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.up = nn.Linear(4, 8, bias=False)
        self.down = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) + h
        return self.down(torch.tanh(self.up(h)))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net().to(F64)


def batch(step: int, n: int = 6):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 5, 4, generator=g, dtype=F64), torch.randn(n, 5, 3, generator=g, dtype=F64)


def loss_of(net: nn.Module, x, y) -> torch.Tensor:
    return ((net(x) - y) ** 2).mean()


class Rows:
    """The test's own record of every Linear's input rows, with a ones column for a bias."""

    def __init__(self, net: nn.Module) -> None:
        self.rows: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in net.named_children()]

    def _hook(self, name):
        def hook(module, inputs, output):
            a = inputs[0].detach().reshape(-1, module.in_features).to(F64)
            if module.bias is not None:
                a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
            self.rows[name] = a
        return hook


def grad_matrix(module: nn.Linear) -> torch.Tensor:
    w = module.weight.grad
    return w if module.bias is None else torch.cat([w, module.bias.grad[:, None]], dim=1)


@pytest.mark.parametrize("moment_decay", [None, 0.9])
def test_matches_dense_reference(moment_decay):
    """Statistics every 2 steps, refresh every 4: V = ∇ (A + λI)⁻¹ with the A and λ of the
    last refresh, then (optionally) V / (√(m / (1 − βᵗ)) + ε)."""
    net = make_net()
    damping, decay, eps = 0.3, 0.8, 1e-8
    precond = KronPreconditioner(net, method="ikfac", factor_update_steps=2, inv_update_steps=4,
                                 damping=damping, factor_decay=decay, inv_dtype=F64,
                                 moment_decay=moment_decay, moment_eps=eps)
    rows = Rows(net)
    layers = dict(net.named_children())
    factor = {n: None for n in layers}
    inverse = {n: None for n in layers}
    moment = {n: torch.zeros_like(grad_matrix_shape(m)) for n, m in layers.items()}
    for step in range(9):
        net.zero_grad()
        loss_of(net, *batch(step)).backward()
        raw = {n: grad_matrix(m).clone() for n, m in layers.items()}
        if step % 2 == 0:
            for n in layers:
                a = rows.rows[n]
                new = a.t() @ a / a.shape[0]
                factor[n] = new if factor[n] is None else decay * factor[n] + (1 - decay) * new
        if step % 4 == 0:
            for n in layers:
                dim = factor[n].shape[0]
                ridge = damping * torch.trace(factor[n]) / dim
                inverse[n] = torch.linalg.inv(factor[n] + ridge * torch.eye(dim, dtype=F64))
        precond.step()
        for n, m in layers.items():
            expected = raw[n] @ inverse[n]
            if moment_decay is not None:
                moment[n] = moment_decay * moment[n] + (1 - moment_decay) * expected**2
                corrected = moment[n] / (1 - moment_decay ** (step + 1))
                expected = expected / (corrected.sqrt() + eps)
            torch.testing.assert_close(grad_matrix(m), expected, rtol=1e-9, atol=1e-12, msg=f"{n}, step {step}")


def grad_matrix_shape(module: nn.Linear) -> torch.Tensor:
    cols = module.in_features + int(module.bias is not None)
    return torch.zeros(module.out_features, cols, dtype=F64)


def test_a_wrong_inverse_fails_the_reference():
    """The reference can fail: K-FAC's two-sided inverse is not what ikfac computes."""
    net = make_net()
    precond = KronPreconditioner(net, method="ikfac", damping=0.3, inv_dtype=F64)
    rows = Rows(net)
    loss_of(net, *batch(0)).backward()
    raw = grad_matrix(net.a).clone()
    precond.step()
    a = rows.rows["a"]
    factor = a.t() @ a / a.shape[0]
    ridge = 0.3 * torch.trace(factor) / factor.shape[0]
    wrong = raw @ torch.linalg.inv(factor + 0.3 * torch.eye(factor.shape[0], dtype=F64))  # λ not trace-scaled
    right = raw @ torch.linalg.inv(factor + ridge * torch.eye(factor.shape[0], dtype=F64))
    assert not torch.allclose(grad_matrix(net.a), wrong)
    torch.testing.assert_close(grad_matrix(net.a), right)


def test_statistics_only_on_statistics_steps_and_no_backward_hook(monkeypatch):
    def no_output_hook(*args, **kwargs):
        raise AssertionError("ikfac must not hook output gradients")

    monkeypatch.setattr(capture_module, "on_output_grad", no_output_hook)
    net = make_net()
    precond = KronPreconditioner(net, method="ikfac", factor_update_steps=3, inv_update_steps=3)
    seen = []
    for layer in precond.layers.values():
        original = layer.method.observe_activations

        def spy(rows, original=original):
            seen.append(precond.steps)
            return original(rows)

        layer.method.observe_activations = spy
    for step in range(7):
        net.zero_grad()
        loss_of(net, *batch(step)).backward()
        precond.step()
    assert sorted(set(seen)) == [0, 3, 6]
    assert len(seen) == 3 * len(precond.layers)


def test_checkpoint_round_trip():
    """Saved mid-run and loaded into a fresh preconditioner on a copy of the model, the
    continuation gives the same gradients as the uninterrupted run."""
    options = dict(method="ikfac", factor_update_steps=2, inv_update_steps=4, damping=0.2, moment_decay=0.9)
    net = make_net()
    precond = KronPreconditioner(net, **options)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)

    def train(net, precond, optimizer, steps):
        grads = []
        for step in steps:
            optimizer.zero_grad()
            loss_of(net, *batch(step)).backward()
            precond.step()
            grads.append([p.grad.clone() for p in net.parameters()])
            optimizer.step()
        return grads

    train(net, precond, optimizer, range(5))
    buffer = io.BytesIO()
    torch.save({"model": net.state_dict(), "precond": precond.state_dict(), "opt": optimizer.state_dict()}, buffer)
    expected = train(net, precond, optimizer, range(5, 10))

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed = make_net()
    resumed.load_state_dict(saved["model"])
    precond2 = KronPreconditioner(resumed, **options)
    optimizer2 = torch.optim.SGD(resumed.parameters(), lr=0.05)
    precond2.load_state_dict(saved["precond"])
    optimizer2.load_state_dict(saved["opt"])
    got = train(resumed, precond2, optimizer2, range(5, 10))
    for step_expected, step_got in zip(expected, got):
        for e, g in zip(step_expected, step_got):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("name,value", [
    ("damping", -1.0), ("damping", 0.0), ("factor_update_steps", 0), ("inv_update_steps", -2),
    ("factor_decay", 0.0), ("factor_decay", 1.5), ("inv_dtype", torch.float16), ("statistics_rows", 0),
    ("moment_decay", 1.0), ("moment_decay", -0.1), ("moment_eps", 0.0),
])
def test_bad_options_raise_naming_them(name, value):
    with pytest.raises(ValueError, match=name):
        KronPreconditioner(make_net(), method="ikfac", **{name: value})


def test_second_moment_method_matches_adam_scaling():
    """``method="second_moment"``: ∇ / (√(m / (1 − βᵗ)) + ε), every step, no hooks."""
    net = make_net()
    precond = KronPreconditioner(net, method="second_moment", moment_decay=0.7, moment_eps=1e-6)
    layers = dict(net.named_children())
    moment = {n: torch.zeros_like(grad_matrix_shape(m)) for n, m in layers.items()}
    for step in range(4):
        net.zero_grad()
        loss_of(net, *batch(step)).backward()
        raw = {n: grad_matrix(m).clone() for n, m in layers.items()}
        precond.step()
        for n, m in layers.items():
            moment[n] = 0.7 * moment[n] + 0.3 * raw[n] ** 2
            expected = raw[n] / ((moment[n] / (1 - 0.7 ** (step + 1))).sqrt() + 1e-6)
            torch.testing.assert_close(grad_matrix(m), expected, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="moment_decay"):
        KronPreconditioner(net, method="second_moment", moment_decay=1.0)


# ---------------------------------------------------------------------- distributed
def _distributed_worker(rank, world_size, out_dir):
    net = make_net()
    precond = KronPreconditioner(net, method="ikfac", factor_update_steps=2, inv_update_steps=2,
                                 damping=0.2, inv_dtype=F64, moment_decay=0.9)
    grads = []
    for step in range(5):
        net.zero_grad()
        x, y = batch(step)
        shard = slice(rank * 3, (rank + 1) * 3)
        loss_of(net, x[shard], y[shard]).backward()
        for p in net.parameters():  # DDP's mean over ranks, by hand
            torch.distributed.all_reduce(p.grad)
            p.grad /= world_size
        precond.step()
        grads.append([p.grad.clone() for p in net.parameters()])
    return grads


def test_two_ranks_equal_one_process_on_the_full_batch(tmp_path):
    results = run_workers(_distributed_worker, 2, tmp_path)
    net = make_net()
    precond = KronPreconditioner(net, method="ikfac", factor_update_steps=2, inv_update_steps=2,
                                 damping=0.2, inv_dtype=F64, moment_decay=0.9)
    for step in range(5):
        net.zero_grad()
        loss_of(net, *batch(step)).backward()
        precond.step()
        for rank_result in results:
            for got, p in zip(rank_result[step], net.parameters()):
                torch.testing.assert_close(got, p.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["ikfac", "ikfac_moment", "second_moment"])
def test_plain_step_op_count_does_not_grow_with_depth(method):
    """One batched matmul per shape group: 2 and 8 blocks of 6 Linears dispatch the same ops."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        from benchmarks.op_count import count_plain_step
    finally:
        sys.path.pop(0)
    small, large = (sum(count_plain_step(method, b, 8, 32, torch.device("cpu")).values()) for b in (2, 8))
    assert large == small, (small, large)


def test_failed_cholesky_keeps_the_previous_inverse(monkeypatch):
    """A refresh whose factorisation fails in float32 and float64 warns, names the layer and
    keeps the last good inverse (the gradient is still preconditioned with it)."""
    net = make_net()
    precond = KronPreconditioner(net, method="ikfac", factor_update_steps=1, inv_update_steps=1, inv_dtype=F64)
    loss_of(net, *batch(0)).backward()
    precond.step()
    before = precond.layers["a"].method.refreshed_tensors()[0].clone()
    real = torch.linalg.cholesky_ex

    def failing(matrix, *args, **kwargs):
        lower, info = real(matrix, *args, **kwargs)
        return lower, torch.ones_like(info)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", failing)
    net.zero_grad()
    loss_of(net, *batch(1)).backward()
    raw = grad_matrix(net.a).clone()
    with pytest.warns(RuntimeWarning, match=r"a\.A \+ λI failed"):
        precond.step()
    assert torch.equal(precond.layers["a"].method.refreshed_tensors()[0], before)
    torch.testing.assert_close(grad_matrix(net.a), raw @ before)
