"""``grad_scaler``: a ``torch.amp.GradScaler``, or a callable returning the current loss scale
(what kfac-pytorch users pass); anything else is a ``TypeError`` at construction.

Reference: the same model and batch without any loss scaling.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import results_of, run_scenarios
from kron_precond import KronPreconditioner

SCALE = 2.0**16


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)


@pytest.mark.parametrize("scale_fn", [lambda: SCALE, lambda: torch.tensor(SCALE)],
                         ids=["float", "tensor"])
def test_callable_grad_scaler_divides_its_scale_out_of_g(scale_fn):
    x, y = _batch()
    ref_model = _model()
    scaled_model = copy.deepcopy(ref_model)
    ref = KronPreconditioner(ref_model, kl_clip=None)
    scaled = KronPreconditioner(scaled_model, kl_clip=None, grad_scaler=scale_fn)
    F.cross_entropy(ref_model(x), y).backward()
    ref.step()
    (F.cross_entropy(scaled_model(x), y) * SCALE).backward()
    for p in scaled_model.parameters():  # what scaler.unscale_ does to .grad
        p.grad.div_(SCALE)
    scaled.step()
    for name in ref.layers:
        got, want = scaled.layers[name].g_factor, ref.layers[name].g_factor
        assert ((got - want).norm() / want.norm()).item() < 1e-5, name


@pytest.mark.parametrize("method", ["kfac", "psgd"])
@pytest.mark.parametrize("value", [3.0, object(), "scaler"], ids=["float", "object", "str"])
def test_other_grad_scaler_values_are_rejected_at_construction(method, value):
    with pytest.raises(TypeError, match="grad_scaler"):
        KronPreconditioner(_model(), method=method, grad_scaler=value)


def test_grad_scaler_instance_and_none_are_accepted():
    KronPreconditioner(_model(), grad_scaler=None).remove()
    KronPreconditioner(_model(), grad_scaler=torch.amp.GradScaler("cpu")).remove()


def _overflow_once(model: nn.Module, bad: bool):
    """A hook on the model's output that turns its gradient to inf on a bad iteration: every
    layer's output gradient and weight gradient overflow, as a float16 loss scale does."""
    def hook(grad):
        return grad * float("inf") if bad else grad
    return hook


def _iterations(model: nn.Module, optimizer, scaler, *, leave_out_first: bool, precond=None) -> None:
    """7 iterations of the AMP loop whose first overflows (the scaler skips it), or without it;
    ``precond``: stepped by hand between ``unscale_`` and the scaler's step."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 5, generator=g, dtype=torch.float64), torch.randn(16, 3, generator=g,
                                                                               dtype=torch.float64))
            for _ in range(7)]
    for i, (x, y) in enumerate(data):
        if leave_out_first and i == 0:
            continue
        optimizer.zero_grad()
        out = model(x) * 1.0  # a tensor after the model's: its hook changes what every layer sees
        out.register_hook(_overflow_once(model, i == 0))
        scaler.scale(F.mse_loss(out, y)).backward()
        if precond is not None:
            scaler.unscale_(optimizer)
            precond.step()
        scaler.step(optimizer)  # unscales if not yet, and skips the step on an overflow
        scaler.update()


def _amp_run(method: str, options: dict, *, wrapped: bool, leave_out_first: bool = False) -> tuple:
    """The documented AMP loop on CPU (a GradScaler; float64 model, so the scale is divided out
    exactly) over 7 iterations whose first overflows, so that the scaler skips it; or, with
    ``leave_out_first``, the same loop without that iteration (its scale already halved, as
    the skipped iteration's update() leaves it)."""
    from kron_precond import PreconditionedOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**9 if leave_out_first else 2.0**10)
    precond = KronPreconditioner(model, method=method, grad_scaler=scaler, **options)
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    optimizer = PreconditionedOptimizer(base, precond) if wrapped else base
    _iterations(model, optimizer, scaler, leave_out_first=leave_out_first, precond=None if wrapped else precond)
    return [p.detach().clone() for p in model.parameters()], precond


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("method, options", [
    ("kfac", dict(factor_update_steps=2, inv_update_steps=4, damping=0.1)),
    ("ekfac", dict(factor_update_steps=2, inv_update_steps=4, damping=0.1)),
    ("shampoo", dict(inv_update_steps=2)),
    ("soap", dict(inv_update_steps=2)),
    ("psgd", {}),
    ("second_moment", {}),
])
def test_a_step_the_scaler_skips_leaves_the_preconditioner_as_if_it_never_happened(method, options, wrapped):
    """An overflow on the first iteration (routine at a float16 run's initial loss scale): the
    scaler skips the optimizer's step, and the preconditioner must neither count the step nor
    keep its statistics, so the first refresh still sees data. The run ends where the run
    without that iteration ends."""
    with_overflow, precond = _amp_run(method, options, wrapped=wrapped)
    assert precond.steps == 6
    without, _ = _amp_run(method, options, wrapped=wrapped, leave_out_first=True)
    for a, b in zip(with_overflow, without):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_an_overflowing_call_is_left_out_of_g_and_the_others_kept():
    """Output-gradient rows that are not finite (one micro-batch of a window overflowed) are left
    out of G call by call: G is the mean over the finite calls' rows, not thrown away whole."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    precond = KronPreconditioner(layer, method="kfac", factor_update_steps=1, inv_update_steps=1,
                                 accumulation_steps=2, kl_clip=None)
    x1, x2 = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    out = layer(x1) * 1.0  # after the layer's output: the layer sees the overflowed gradient
    out.register_hook(lambda grad: grad * float("inf"))
    (out.square().mean() / 2).backward()
    out2 = layer(x2)
    out2.retain_grad()
    (out2.square().mean() / 2).backward()
    precond.step()
    rows = out2.grad * 6 * 2  # δ = grad · n · accumulation steps
    torch.testing.assert_close(precond.layers[""].g_factor, rows.T @ rows / 6, rtol=1e-12, atol=0)


@pytest.mark.parametrize("method", ["shampoo", "soap", "psgd", "second_moment"])
def test_a_gradscaler_applies_to_methods_without_statistics_hooks(method):
    """They read no output gradients, but skip the steps the scaler skips: no warning that it is
    ignored (a callable, a scale alone, still is)."""
    import warnings

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KronPreconditioner(model, method=method, grad_scaler=torch.amp.GradScaler("cpu")).remove()
    with pytest.warns(UserWarning, match="grad_scaler"):
        KronPreconditioner(model, method=method, grad_scaler=lambda: 2.0).remove()


def test_a_second_zero_grad_before_the_backward_keeps_the_iterations_statistics():
    """Tutorials call zero_grad at the top of the loop and again between forward and backward:
    no backward came between the two, so nothing was abandoned, and the statistics stay (the
    preconditioned steps equal those of a loop with one zero_grad)."""
    from kron_precond import PreconditionedOptimizer

    def run(twice: bool) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        precond = KronPreconditioner(model, method="kfac", factor_update_steps=1, inv_update_steps=1, damping=0.1)
        optimizer = PreconditionedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), precond)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(16, 5, generator=g, dtype=torch.float64), torch.randn(16, 3, generator=g,
                                                                                       dtype=torch.float64)
            optimizer.zero_grad()
            out = model(x)
            if twice:
                optimizer.zero_grad()
            F.mse_loss(out, y).backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_with_two_optimizers_on_one_scaler_the_other_ones_overflow_does_not_skip_this_one():
    """torch's AMP recipe for several optimizers shares one GradScaler, which skips each on its
    own. An overflow in the other optimizer's parameters must not skip this preconditioner: its
    optimizer steps, on preconditioned gradients."""
    torch.manual_seed(0)
    body, other = nn.Linear(5, 4).double(), nn.Linear(5, 4).double()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    precond = KronPreconditioner(body, method="kfac", factor_update_steps=1, inv_update_steps=1, damping=0.1,
                                 grad_scaler=scaler)
    opt_a, opt_b = torch.optim.SGD(body.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    x = torch.randn(8, 5, dtype=torch.float64)
    for overflow in (False, True):
        opt_a.zero_grad()
        opt_b.zero_grad()
        loss = body(x).square().mean() + other(x).square().mean()
        scaler.scale(loss).backward()
        if overflow:
            other.weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt_a)
        scaler.unscale_(opt_b)
        raw = body.weight.grad.clone()
        precond.step()
        assert not torch.equal(raw, body.weight.grad)  # preconditioned
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
    assert precond.steps == 2


def _whitened_muon_amp_run(skip_first: bool) -> list:
    from kron_precond import WhitenedMuon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**9 if skip_first else 2.0**10)
    optimizer = WhitenedMuon(model, lr=0.02, statistics_every=2, output_side=True, grad_scaler=scaler,
                             ns_dtype=torch.float64)
    _iterations(model, optimizer, scaler, leave_out_first=skip_first)
    return [p.detach().clone() for p in model.parameters()]


def test_whitened_muon_drops_the_statistics_of_a_step_the_scaler_skipped():
    """scaler.step(optimizer) calls nothing on an overflow: the next zero_grad() sees a backward
    without a step and drops that iteration's rows, so the run ends where the run without it ends."""
    for a, b in zip(_whitened_muon_amp_run(False), _whitened_muon_amp_run(True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def _skipped_step_worker(rank: int, world: int, out_dir: str, wrapped: bool):
    """The AMP loop on ``world`` ranks (gradients averaged as DDP does), the full batch split
    between them; the first iteration overflows on rank 0 only, which the average carries to
    every rank, so every rank's scaler skips it."""
    import torch.distributed as dist

    from dist_utils import average_gradients_by_hand, ranks_identical
    from kron_precond import PreconditionedOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    params = list(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    precond = KronPreconditioner(model, method="kfac", factor_update_steps=2, inv_update_steps=4, damping=0.1,
                                 grad_scaler=scaler)
    base = torch.optim.SGD(params, lr=0.05)
    optimizer = PreconditionedOptimizer(base, precond) if wrapped else base
    g = torch.Generator().manual_seed(1)
    identical = []
    for i in range(6):
        x, y = torch.randn(16, 5, generator=g, dtype=torch.float64), torch.randn(16, 3, generator=g,
                                                                                   dtype=torch.float64)
        rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
        optimizer.zero_grad()
        out = model(x[rows]) * 1.0
        out.register_hook(_overflow_once(model, i == 0 and rank == 0))
        scaler.scale(F.mse_loss(out, y[rows])).backward()
        if world > 1:
            average_gradients_by_hand(params, world, dist.all_reduce)
        scaler.unscale_(optimizer)
        if not wrapped:
            precond.step()
        scaler.step(optimizer)
        scaler.update()
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        identical.append(world == 1 or ranks_identical(flat, world, dist.all_gather))
    return {"params": [p.detach().clone() for p in params], "identical": identical, "steps": precond.steps}


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_step_skipped_on_every_rank_gives_the_one_process_result(wrapped, one_process, two_ranks):
    """An overflow on one rank reaches every rank through DDP's average: every rank skips the
    step (none enters a collective the others skip), the ranks stay identical, and the run ends
    where one process on the full batch ends. (Both ``wrapped`` values: scenarios of the shared
    one-process and 2-rank spawns below.)"""
    single = one_process[f"wrapped={wrapped}"]
    assert single["steps"] == 5
    results = results_of(two_ranks, f"wrapped={wrapped}")
    assert len(results) == 2
    for r in results:
        assert all(r["identical"]) and r["steps"] == 5
        for got, want in zip(r["params"], single["params"]):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- the shared spawns
# Spawning gloo ranks (each imports torch) costs more than these scenarios: both ``wrapped``
# values run at one process (the references) in one spawn, and on 2 ranks in another, one after
# the other, each seeding and building its own model, scaler and optimizer as it did alone.
SCENARIOS = {f"wrapped={wrapped}": functools.partial(_skipped_step_worker, wrapped=wrapped)
             for wrapped in (False, True)}




@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """Every one-process reference: ``{scenario: result}``."""
    from dist_utils import run_workers

    return run_workers(run_scenarios, 1, tmp_path_factory.mktemp("w1"), SCENARIOS, timeout=60 * len(SCENARIOS))[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Every 2-rank scenario: per rank, ``{scenario: result}``."""
    from dist_utils import run_workers

    return run_workers(run_scenarios, 2, tmp_path_factory.mktemp("w2"), SCENARIOS, timeout=90 * len(SCENARIOS))
