"""``KronPreconditioner(method="soap")``: second moments in Shampoo's eigenbasis.

References, none read from the method's state:

* the first step's output is the orthogonal polar factor ``U Wᵀ`` of the gradient matrix
  (from a float64 SVD): with one gradient, ``L`` and ``R`` have the singular vectors as
  eigenvectors, the rotated gradient is ``diag(σ)`` and Adam's first, bias-corrected step
  divides every entry by its own magnitude. Rank-deficient sides (a repeated zero
  eigenvalue) included;
* a dense float64 re-statement of the documented recurrences (statistics, ``eigh`` then
  warm-started QR steps, the moment in the rotated basis) over several steps with changing
  batches;
* after many refreshes on a fixed gradient, warm-started QR has converged and the output is
  the polar factor again.

Also: one-sided bases (``max_factor_size``), non-finite gradients, checkpoints, bad options,
an op count that does not grow with depth, and two gloo ranks against one process.
"""
from __future__ import annotations

import copy
import functools
import io
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import results_of, run_scenarios, run_workers
from kron_precond import KronPreconditioner

F64 = torch.float64
# ε of the moment: small against the gradients' singular values (~1-10), large against the
# rounding left in the rotated gradient's zero entries (~1e-15), which it must not amplify
EPS = 1e-6


def grad_matrix(module: nn.Linear) -> torch.Tensor:
    g = module.weight.grad
    return torch.cat([g, module.bias.grad.unsqueeze(1)], 1) if module.bias is not None else g


def polar(matrix: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u @ vh


def one_layer(inputs: int, outputs: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(inputs, outputs, bias=bias).to(F64)


def backward(layer: nn.Module, step: int, rows: int = 7) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(rows, layer.in_features, generator=g, dtype=F64)
    target = torch.randn(rows, layer.out_features, generator=g, dtype=F64)
    layer.zero_grad()
    ((layer(x) - target) ** 2).sum().backward()


@pytest.mark.parametrize("inputs,outputs,bias", [(5, 3, True), (3, 7, True), (4, 5, False), (5, 6, True)])
def test_first_step_is_the_polar_factor(inputs, outputs, bias):
    """Wide, tall (a null space in L or R: pooled) and square gradient matrices."""
    layer = one_layer(inputs, outputs, bias)
    precond = KronPreconditioner(layer, method="soap", moment_eps=EPS)
    backward(layer, 0)
    expected = polar(grad_matrix(layer).clone())
    precond.step()
    torch.testing.assert_close(grad_matrix(layer), expected, rtol=1e-5, atol=1e-6)


def reference_steps(grads: list[torch.Tensor], *, every: int, factor_decay: float, moment_decay: float,
                    eps: float) -> list[np.ndarray]:
    """The documented recurrences in numpy float64, for matrices whose statistics have
    distinct eigenvalues (so every refresh after the first warm-starts), as the SOAP reference
    implementation refreshes: the basis's columns sorted by their estimated eigenvalues
    ``diag(Qᵀ L Q)``, descending, the moment permuted along, then one QR step."""
    out_dim, in_dim = grads[0].shape
    left, right, mass = np.zeros((out_dim, out_dim)), np.zeros((in_dim, in_dim)), 0.0
    q_left = q_right = None
    moment = np.zeros((out_dim, in_dim))
    outputs = []
    for step, grad in enumerate(grads):
        v = grad.numpy()
        left, right, mass = factor_decay * left + v @ v.T, factor_decay * right + v.T @ v, factor_decay * mass + 1
        if step % every == 0:
            if q_left is None:
                q_left = np.linalg.eigh(left / mass)[1][:, ::-1]
                q_right = np.linalg.eigh(right / mass)[1][:, ::-1]
            else:
                order_left = np.argsort(-np.diag(q_left.T @ left @ q_left), kind="stable")
                order_right = np.argsort(-np.diag(q_right.T @ right @ q_right), kind="stable")
                moment = moment[order_left][:, order_right]
                q_left = np.linalg.qr(left / mass @ q_left[:, order_left])[0]
                q_right = np.linalg.qr(right / mass @ q_right[:, order_right])[0]
        rotated = q_left.T @ v @ q_right
        moment = moment_decay * moment + (1 - moment_decay) * rotated**2
        scaled = rotated / (np.sqrt(moment / (1 - moment_decay ** (step + 1))) + eps)
        outputs.append(q_left @ scaled @ q_right.T)
    return outputs


def test_matches_the_dense_recurrences_over_several_steps():
    """Statistics every step, bases every second step (eigh, then warm-started QR), over enough
    steps for the estimated eigenvalues to change order (the refresh then sorts the columns)."""
    layer = one_layer(5, 6)  # [W | b] is 6 x 6: both statistics full rank from the first step
    precond = KronPreconditioner(layer, method="soap", factor_update_steps=1, inv_update_steps=2,
                                 factor_decay=0.8, moment_decay=0.7, moment_eps=1e-3)
    raw, got = [], []
    for step in range(15):
        backward(layer, step, rows=9)
        raw.append(grad_matrix(layer).clone())
        precond.step()
        got.append(grad_matrix(layer).clone())
    expected = reference_steps(raw, every=2, factor_decay=0.8, moment_decay=0.7, eps=1e-3)
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, torch.from_numpy(np.ascontiguousarray(e)), rtol=1e-8, atol=1e-10,
                                   msg=lambda m, step=step: f"step {step}: {m}")
    assert all(precond.layers[""].method._warm.values())  # the later refreshes warm-started


def test_the_reference_can_fail():
    """The recurrences without the warm start (``eigh`` at every refresh) differ from the
    method after its first warm-started refresh: the check above tells the two apart."""
    layer = one_layer(5, 6)
    precond = KronPreconditioner(layer, method="soap", inv_update_steps=2, factor_decay=0.8, moment_decay=0.7)
    raw, got = [], []
    for step in range(3):
        backward(layer, step, rows=9)
        raw.append(grad_matrix(layer).clone())
        precond.step()
        got.append(grad_matrix(layer).clone())
    moment = torch.zeros_like(raw[0])
    left, right, mass = 0, 0, 0.0
    for step, v in enumerate(raw):
        left, right, mass = 0.8 * left + v @ v.T, 0.8 * right + v.T @ v, 0.8 * mass + 1
        if step % 2 == 0:
            q_left = torch.linalg.eigh(left / mass)[1]
            q_right = torch.linalg.eigh(right / mass)[1]
        rotated = q_left.T @ v @ q_right
        moment = 0.7 * moment + 0.3 * rotated**2
        expected = q_left @ (rotated / ((moment / (1 - 0.7 ** (step + 1))).sqrt() + 1e-8)) @ q_right.T
    assert not torch.allclose(got[-1], expected, rtol=1e-4, atol=1e-6)


def test_warm_started_bases_converge_to_the_polar_factor():
    """A fixed gradient, a refresh every step: subspace iteration converges to the singular
    vectors and the (forgetful) moment to the rotated gradient's squares."""
    layer = one_layer(5, 6)
    precond = KronPreconditioner(layer, method="soap", inv_update_steps=1, factor_decay=0.5,
                                 moment_decay=0.5, moment_eps=EPS)
    for _ in range(300):
        backward(layer, 0, rows=9)
        expected = polar(grad_matrix(layer).clone())
        precond.step()
    torch.testing.assert_close(grad_matrix(layer), expected, rtol=1e-4, atol=1e-5)


def test_one_sided_when_a_side_is_too_wide():
    """``max_factor_size`` below the input side: ``R``'s basis stays the identity, so the update
    is ``Q_L (V' / √m̂)`` with ``V' = Q_Lᵀ V`` -- at the first step ``Q_L sign(Q_Lᵀ V)``."""
    layer = one_layer(9, 4)
    precond = KronPreconditioner(layer, method="soap", max_factor_size=8, moment_eps=EPS)
    assert precond.layers[""].method.parts == ("L",)
    backward(layer, 0)
    v = grad_matrix(layer).clone()
    precond.step()
    q = torch.linalg.eigh(v @ v.T)[1]
    rotated = q.T @ v
    torch.testing.assert_close(grad_matrix(layer), q @ (rotated / (rotated.abs() + EPS)), rtol=1e-8, atol=1e-10)


def test_nonfinite_gradient_passes_through_and_poisons_nothing():
    layer = one_layer(5, 6)
    precond = KronPreconditioner(layer, method="soap", inv_update_steps=2)  # step 1: no refresh
    backward(layer, 0, rows=9)
    precond.step()
    method = precond.layers[""].method
    saved = {k: v for k, v in method.state_dict().items()}
    backward(layer, 1, rows=9)
    layer.weight.grad[0, 0] = float("nan")
    bad = grad_matrix(layer).clone()
    precond.step()
    assert torch.equal(torch.isnan(grad_matrix(layer)), torch.isnan(bad))
    after = method.state_dict()
    for key in ("statistics", "bases"):
        for side in saved[key]:
            first, second = saved[key][side], after[key][side]
            assert all(torch.equal(a, b) for a, b in zip(first if isinstance(first, list) else [first],
                                                        second if isinstance(second, list) else [second]))
    assert torch.equal(saved["moment"], after["moment"])
    assert int(method.nonfinite) == 1


def test_checkpoint_round_trip_continues_bitwise_and_bad_state_changes_nothing():
    def run(steps, precond, layer):
        for step in steps:
            backward(layer, step, rows=9)
            precond.step()
        return grad_matrix(layer).clone()

    options = dict(method="soap", inv_update_steps=3, factor_decay=0.9, moment_decay=0.9)
    layer = one_layer(5, 6)
    precond = KronPreconditioner(layer, **options)
    run(range(4), precond, layer)
    buffer = io.BytesIO()
    torch.save(precond.state_dict(), buffer)
    expected = run(range(4, 8), precond, layer)

    resumed_layer = one_layer(5, 6)
    resumed = KronPreconditioner(resumed_layer, **options)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    broken = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    broken["layers"][""]["moment"] = broken["layers"][""]["moment"][:, :2]
    before = resumed.state_dict()
    with pytest.raises(ValueError, match="moment"):
        resumed.load_state_dict(broken)
    assert torch.equal(resumed.state_dict()["layers"][""]["moment"], before["layers"][""]["moment"])
    resumed.load_state_dict(state)
    torch.testing.assert_close(run(range(4, 8), resumed, resumed_layer), expected, rtol=0, atol=0)


def test_a_checkpoint_taken_while_eigenvalues_repeat_resumes_bitwise():
    """A wide layer's first statistics are rank-deficient (fewer rows than its width): its
    eigenvalues repeat (zero), and the moment is averaged over each block of them. A checkpoint
    holds the averaged moment; resumed at any step, the run goes on as the uninterrupted one."""
    options = dict(method="soap", inv_update_steps=3, factor_decay=0.9, moment_decay=0.9)

    def run(total, resume_at=None):
        layer = one_layer(12, 10)
        precond = KronPreconditioner(layer, **options)
        for step in range(total):
            if step == resume_at:
                buffer = io.BytesIO()
                torch.save(precond.state_dict(), buffer)
                layer = copy.deepcopy(layer)
                precond = KronPreconditioner(layer, **options)
                precond.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
            backward(layer, step, rows=3)
            precond.step()
            with torch.no_grad():  # the preconditioned gradient moves the weight: later rows see it
                layer.weight -= 0.1 * layer.weight.grad
                layer.bias -= 0.1 * layer.bias.grad
            layer.zero_grad()
        return torch.cat([layer.weight.detach().flatten(), layer.bias.detach()])

    expected = run(8)
    drifted = [at for at in range(1, 8) if not torch.equal(run(8, resume_at=at), expected)]
    assert drifted == []


def test_failed_decomposition_keeps_the_previous_basis(monkeypatch):
    """``eigh`` failing in float64 (raising) warns, names the side and keeps the last basis;
    the gradient is still rotated with it."""
    layer = one_layer(5, 6)
    precond = KronPreconditioner(layer, method="soap", inv_update_steps=1, factor_decay=0.9)
    backward(layer, 0, rows=9)
    precond.step()
    method = precond.layers[""].method
    before = [t.clone() for t in method.refreshed_tensors()]
    method._warm = {"L": False, "R": False}  # force eigh at the next refresh

    def failing(*args, **kwargs):
        raise torch.linalg.LinAlgError("no convergence")

    monkeypatch.setattr(torch.linalg, "eigh", failing)
    backward(layer, 1, rows=9)
    with pytest.warns(RuntimeWarning, match=r"\.L failed in float64"):
        precond.step()
    assert all(torch.equal(a, b) for a, b in zip(method.refreshed_tensors(), before))


@pytest.mark.parametrize("name,value", [
    ("factor_update_steps", 0), ("inv_update_steps", -1), ("factor_decay", 1.0), ("factor_decay", -0.5),
    ("moment_decay", 1.0), ("moment_eps", 0.0), ("max_factor_size", 0), ("factor_dtype", torch.int32),
])
def test_bad_options_raise_naming_them(name, value):
    with pytest.raises((ValueError, TypeError), match=name):
        KronPreconditioner(one_layer(3, 3), method="soap", **{name: value})


def test_plain_step_op_count_does_not_grow_with_depth():
    """Four batched matmuls per shape group: 2 and 8 blocks dispatch the same ops."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        from benchmarks.op_count import count_plain_step
    finally:
        sys.path.pop(0)
    small, large = (sum(count_plain_step("soap", b, 8, 32, torch.device("cpu")).values()) for b in (2, 8))
    assert large == small, (small, large)


# ---------------------------------------------------------------------- distributed
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.down = nn.Linear(4, 3)

    def forward(self, x):
        return self.down(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _net() -> Net:
    torch.manual_seed(0)
    return Net().to(F64)


def _batch(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(8, 4, generator=g, dtype=F64), torch.randn(8, 3, generator=g, dtype=F64)


SOAP_OPTIONS = dict(method="soap", inv_update_steps=2, factor_decay=0.9, moment_decay=0.9, moment_eps=1e-3)


def _distributed_worker(rank, world_size, out_dir):
    net = _net()
    precond = KronPreconditioner(net, **SOAP_OPTIONS)
    grads = []
    for step in range(6):
        net.zero_grad()
        x, y = _batch(step)
        shard = slice(rank * 4, (rank + 1) * 4)
        ((net(x[shard]) - y[shard]) ** 2).sum().backward()
        for p in net.parameters():
            torch.distributed.all_reduce(p.grad)
        precond.step()
        grads.append([p.grad.clone() for p in net.parameters()])
    return grads


def test_two_ranks_equal_one_process_on_the_full_batch(two_ranks):
    """Two ranks on half batches (a scenario of the shared 2-rank spawn at the end of the file)
    give every step one process's preconditioned gradients on the whole batch."""
    results = results_of(two_ranks, "distributed")
    assert len(results) == 2
    net = _net()
    precond = KronPreconditioner(net, **SOAP_OPTIONS)
    for step in range(6):
        net.zero_grad()
        ((net(_batch(step)[0]) - _batch(step)[1]) ** 2).sum().backward()
        precond.step()
        for rank_result in results:
            for got, p in zip(rank_result[step], net.parameters()):
                torch.testing.assert_close(got, p.grad, rtol=1e-9, atol=1e-12)


def test_a_layer_without_gradients_is_left_as_it_is_by_the_refreshes():
    """Two branches used on alternate steps, a refresh on every step: on the steps branch ``b``
    is not used, its basis, moment and counts stay as they are, so its preconditioned gradients
    equal those of a preconditioner that only ever sees ``b``'s steps."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 4).double(), nn.Linear(6, 4).double()

        def forward(self, x, which):
            return (self.a if which == "a" else self.b)(x)

    torch.manual_seed(1)
    two = Two()
    alone = nn.ModuleDict({"b": copy.deepcopy(two.b)})
    pc_two = KronPreconditioner(two, method="soap", inv_update_steps=1)
    pc_alone = KronPreconditioner(alone, method="soap", inv_update_steps=1)
    opt_two = torch.optim.SGD(two.parameters(), lr=0.05)
    opt_alone = torch.optim.SGD(alone.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(2)
    for step in range(8):
        x, y = torch.randn(10, 6, generator=data).double(), torch.randn(10, 4, generator=data).double()
        which = "a" if step % 2 == 0 else "b"
        opt_two.zero_grad()
        F.mse_loss(two(x, which), y).backward()
        pc_two.step()
        opt_two.step()
        if which == "b":
            opt_alone.zero_grad()
            F.mse_loss(alone["b"](x), y).backward()
            pc_alone.step()
            for got, want in zip(two.b.parameters(), alone["b"].parameters()):
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-14)
            opt_alone.step()


# ---------------------------------------------------------------------- factor_dtype
@pytest.mark.parametrize("value", [torch.float16, torch.bfloat16, torch.int32, "float32"])
def test_a_factor_dtype_other_than_float32_or_float64_is_refused_naming_it(value):
    """Documented rule: ``factor_dtype`` is None, torch.float32 or torch.float64. float16's
    moment underflows (ε = 1e-8 is 0 there) and bfloat16 has no QR on CPU: refused at
    construction, with the option and the value named, before any state exists."""
    with pytest.raises(ValueError, match=rf"factor_dtype.*{re.escape(repr(value))}"):
        KronPreconditioner(one_layer(3, 3), method="soap", factor_dtype=value)


@pytest.mark.parametrize("value", [None, torch.float32, torch.float64])
def test_float32_float64_and_none_factor_dtypes_are_accepted(value):
    KronPreconditioner(one_layer(3, 3), method="soap", factor_dtype=value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("moved_after", [False, True])
def test_a_half_precision_model_with_the_default_factor_dtype_steps_finitely(dtype, moved_after):
    """``factor_dtype=None`` follows the parameters, float32 or better (the documented rule):
    a float16 / bfloat16 model -- made so before the preconditioner, or moved after -- keeps
    float32 statistics, and eight steps through several warm-started QR refreshes give
    finite gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    if not moved_after:
        model = model.to(dtype)
    precond = KronPreconditioner(model, method="soap", inv_update_steps=2)
    if moved_after:
        model = model.to(dtype)
    data = torch.Generator().manual_seed(0)
    for _ in range(8):
        model.zero_grad()
        model(torch.randn(8, 6, generator=data).to(dtype)).float().pow(2).mean().backward()
        precond.step()
        for p in model.parameters():
            assert p.grad.dtype == dtype and bool(torch.isfinite(p.grad).all())
    state = precond.state_dict()["layers"]["0"]
    assert {t.dtype for t in [*state["statistics"].values(), state["moment"]]} == {torch.float32}


# ---------------------------------------------------------------------- non-finite gradients and refreshes
def _layer_zero_updates(mode: str, inv: int, bad_step: int, absent: tuple[int, ...]) -> list[torch.Tensor]:
    """Layer ``0``'s preconditioned gradients after ``bad_step``, where it gets a NaN gradient
    (``mode="nan"``) or none (``"none"``); on the ``absent`` steps it gets none in both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(F64)
    precond = KronPreconditioner(model, method="soap", inv_update_steps=inv, factor_decay=0.9, moment_decay=0.9)
    data = torch.Generator().manual_seed(1)
    out = []
    for step in range(12):
        x = torch.randn(8, 5, generator=data, dtype=F64)
        for p in model.parameters():
            p.grad = None
        model(x).pow(2).mean().backward()
        if step == bad_step and mode == "nan":
            model[0].weight.grad[0, 0] = float("nan")
        elif step == bad_step or step in absent:
            model[0].weight.grad = model[0].bias.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the non-finite gradient's warning
            precond.step()
        if step > bad_step and step not in absent:
            out.append(torch.cat([model[0].weight.grad.flatten(), model[0].bias.grad]))
    return out


@pytest.mark.parametrize("inv,bad_step,absent", [
    (1, 3, ()),  # the NaN on a refresh step
    (2, 3, (4,)),  # on a plain step, and no gradient at the next refresh
    (2, 4, (5,)),  # on the other parity of the schedule
    (3, 4, (5, 6)),  # on a plain step, then a plain step and a refresh without gradients
])
def test_a_nonfinite_gradient_is_as_no_gradient_for_the_refreshes(inv, bad_step, absent):
    """Documented: a non-finite gradient "leaves every state unchanged". The bases included: a
    refresh after it (and no finite gradient since the last one) is the refresh of a layer not
    used, so the run goes on bitwise as one where the layer had no gradient on that step."""
    nan, none = _layer_zero_updates("nan", inv, bad_step, absent), _layer_zero_updates("none", inv, bad_step, absent)
    assert len(nan) == len(none) > 3
    differing = [i for i, (a, b) in enumerate(zip(nan, none)) if not torch.equal(a, b)]
    assert differing == [], [float((nan[i] - none[i]).norm() / none[i].norm()) for i in differing]


def test_a_nonfinite_expert_gradient_is_as_an_idle_expert_for_the_refreshes():
    """The same for one expert of a fused experts module: a NaN in its slice of the stacked
    gradient on a refresh step is as a step where it was idle (an all-zero slice, what the
    router sending it no token gives)."""
    from kron_precond import RoutedExperts

    def run(mode):
        torch.manual_seed(0)
        model = RoutedExperts(3, 4, 6, dtype=F64)
        precond = KronPreconditioner(model, method="soap", kl_clip=None, inv_update_steps=1, moment_decay=0.9)
        data = torch.Generator().manual_seed(3)
        out = []
        for step in range(8):
            x = torch.randn(30, 4, generator=data, dtype=F64)
            index = torch.randint(0, 3, (30, 1), generator=data)
            model.zero_grad()
            model(x, index, torch.ones(30, 1, dtype=F64)).pow(2).mean().backward()
            if step == 3:  # the expert's gradient matrix [W | b]: NaN in one entry, or all zeros
                model.down_weight.grad[1] = float("nan") if mode == "nan" else 0.0
                if mode == "idle":
                    model.down_bias.grad[1] = 0.0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                precond.step()
            if step > 3:
                out.append(model.down_weight.grad[1].clone())
        return out

    nan, idle = run("nan"), run("idle")
    assert [torch.equal(a, b) for a, b in zip(nan, idle)] == [True] * len(idle)


def test_a_checkpoint_after_a_nonfinite_gradient_resumes_bitwise():
    """Saved after a NaN gradient and before the next refresh (no finite gradient since the
    last one): the resumed run leaves the layer at that refresh as the uninterrupted one."""
    options = dict(method="soap", inv_update_steps=3, factor_decay=0.9, moment_decay=0.9)

    def run(resume_at=None):
        layer = one_layer(5, 6)
        precond = KronPreconditioner(layer, **options)
        outs = []
        for step in range(9):
            if step == resume_at:
                buffer = io.BytesIO()
                torch.save(precond.state_dict(), buffer)
                precond = KronPreconditioner(layer, **options)
                precond.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
            backward(layer, step, rows=9)
            if step == 4:
                layer.weight.grad[0, 0] = float("nan")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                precond.step()
            outs.append(grad_matrix(layer).clone())
        return torch.stack(outs[5:])

    expected = run()
    assert all(torch.equal(run(resume_at=at), expected) for at in (4, 5, 6))


def _nonfinite_run(net: nn.Module, precond: KronPreconditioner, mode: str, rank: int = 0, world_size: int = 1
                   ) -> list[torch.Tensor]:
    """Steps 0-7 on ``_batch``, sharded over the ranks; layer ``a`` gets a NaN (``mode="nan"``)
    or no gradient on step 3 (a plain step of ``SOAP_OPTIONS``), and none on step 4 (the next
    refresh). Returns ``a``'s preconditioned gradients of steps 5-7."""
    out = []
    rows = 8 // world_size
    for step in range(8):
        net.zero_grad()
        x, y = _batch(step)
        shard = slice(rank * rows, (rank + 1) * rows)
        ((net(x[shard]) - y[shard]) ** 2).sum().backward()
        if world_size > 1:
            for p in net.parameters():
                torch.distributed.all_reduce(p.grad)
        if step == 3 and mode == "nan":
            net.a.weight.grad[0, 0] = float("nan")
        elif step in (3, 4):
            net.a.weight.grad = net.a.bias.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            precond.step()
        if step > 4:
            out.append(torch.cat([net.a.weight.grad.flatten(), net.a.bias.grad]))
    return out


def _nonfinite_worker(rank, world_size, out_dir, fraction):
    net = _net()
    return _nonfinite_run(net, KronPreconditioner(net, grad_worker_fraction=fraction, **SOAP_OPTIONS), "nan",
                          rank, world_size)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_two_ranks_leave_a_layer_with_a_nonfinite_gradient_as_one_process_without_one(two_ranks, fraction):
    """Over two ranks (every rank a gradient worker of every layer, or one per layer and the
    owner broadcasting), a NaN gradient followed by a refresh leaves the layer as one process
    where it had no gradient on that step; the ranks agree bitwise. (Both fractions: scenarios
    of the shared 2-rank spawn.)"""
    results = results_of(two_ranks, f"nonfinite/{fraction}")
    assert len(results) == 2
    net = _net()
    expected = _nonfinite_run(net, KronPreconditioner(net, **SOAP_OPTIONS), "none")
    for got, other in zip(results[0], results[1]):
        assert torch.equal(got, other)
    for got, want in zip(results[0], expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- the shared 2-rank spawn
# Spawning gloo ranks (each imports torch) costs more than these scenarios: every 2-rank one
# shares one spawn, one after the other, each seeding and building its own model and
# preconditioner as it did alone.
TWO_RANKS = {
    "distributed": _distributed_worker,
    **{f"nonfinite/{fraction}": functools.partial(_nonfinite_worker, fraction=fraction) for fraction in (1.0, 0.5)},
}
TWO_RANKS_TIMEOUT = 3 * 120  # what the spawns it replaces had (dist_utils.DEFAULT_TIMEOUT each)




@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Every 2-rank scenario: per rank, ``{scenario: result}``."""
    return run_workers(run_scenarios, 2, tmp_path_factory.mktemp("w2"), TWO_RANKS, timeout=TWO_RANKS_TIMEOUT)
