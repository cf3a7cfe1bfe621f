"""PreconditionedOptimizer: one torch.optim.Optimizer for loops that only call ``optimizer.step()``.

References: the K-FAC step (with ``kl_clip``) is recomputed densely in float64 from the
layer's recorded input and output gradient; the torch.optim behaviours (schedulers,
closures, hooks, checkpoints) are compared with the two-object loop
``precond.step(); base.step()`` or with the state before a failed load.
"""
from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner, PreconditionedOptimizer

DT = torch.float64


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)


def batch(step, n=16):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g, dtype=DT), torch.randn(n, 3, generator=g, dtype=DT)


def build(method, seed=0, lr=0.05, **kw):
    model = make_model(seed)
    base = torch.optim.AdamW(model.parameters(), lr=lr)
    precond = KronPreconditioner(model, method=method, **kw)
    return model, PreconditionedOptimizer(base, precond)


def train(model, opt, steps, start=0, scheduler=None):
    for step in range(start, start + steps):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


KW = {"kfac": dict(damping=1e-2, inv_update_steps=2, kl_clip=None),
      "psgd": dict(preconditioner_update_probability=0.5)}


# ------------------------------------------------------------------ it is an Optimizer
def test_is_an_optimizer_sharing_the_base_param_groups():
    model, opt = build("kfac", **KW["kfac"])
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state
    assert opt.defaults is opt.optimizer.defaults
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns if the scheduler steps before the optimizer
        train(model, opt, 2, scheduler=sched)
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.25)


@pytest.mark.parametrize("method", ["kfac", "psgd"])
def test_step_equals_preconditioner_step_then_base_step(method):
    model_a, opt = build(method, **KW[method])
    model_b = make_model()
    base_b = torch.optim.AdamW(model_b.parameters(), lr=0.05)
    precond_b = KronPreconditioner(model_b, method=method, **KW[method])
    for step in range(4):
        train(model_a, opt, 1, start=step)
        x, y = batch(step)
        base_b.zero_grad()
        F.mse_loss(model_b(x), y).backward()
        precond_b.step()
        base_b.step()
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    assert opt.preconditioner.steps == 4


def test_zero_grad_and_add_param_group_go_to_the_base_optimizer():
    model, opt = build("kfac", **KW["kfac"])
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    F.mse_loss(model(x), y).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    extra = nn.Parameter(torch.ones(3, dtype=DT))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert len(opt.optimizer.param_groups) == 2 and opt.param_groups[1]["params"][0] is extra
    (F.mse_loss(model(x), y) + extra.sum()).backward()
    opt.step()
    assert not torch.equal(extra.detach(), torch.ones(3, dtype=DT))  # stepped, not preconditioned


def test_closure_runs_once_before_preconditioning_and_its_loss_is_returned():
    model_a, opt = build("kfac", **KW["kfac"])
    model_b, opt_b = build("kfac", **KW["kfac"])
    x, y = batch(0)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = F.mse_loss(model_a(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert len(calls) == 1
    opt_b.zero_grad()
    expected = F.mse_loss(model_b(x), y)
    expected.backward()
    opt_b.step()
    assert torch.equal(loss.detach(), expected.detach())
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)


def test_step_hooks_run():
    model, opt = build("psgd", **KW["psgd"])
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    train(model, opt, 1)
    assert seen == ["pre", "post"]


def test_construction_errors_name_the_argument():
    model = make_model()
    precond = KronPreconditioner(model, **KW["kfac"])
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer"):
        PreconditionedOptimizer(model, precond)
    with pytest.raises(TypeError, match="preconditioner"):
        PreconditionedOptimizer(base, model)
    with pytest.raises(ValueError, match=r"0\.weight"):
        PreconditionedOptimizer(torch.optim.SGD(model[2].parameters(), lr=0.1), precond)



def test_a_base_optimizer_whose_step_needs_a_closure_is_refused_naming_it():
    """LBFGS calls its closure several times per step (line search): the preconditioned
    gradient of the first call is not what its later calls see, so it cannot be wrapped; it
    is refused before anything is built on it."""
    model = make_model()
    precond = KronPreconditioner(model, **KW["kfac"])
    with pytest.raises(TypeError, match=r"LBFGS.*closure"):
        PreconditionedOptimizer(torch.optim.LBFGS(model.parameters()), precond)


# ------------------------------------------------------------------ kl_clip reads the optimizer's lr
def test_kl_clip_uses_the_optimizers_current_lr():
    """One K-FAC step on a single Linear: V = (G⊗A + λI)⁻¹∇ densely in float64, scaled by
    ν = min(1, sqrt(κ / |lr² ⟨V, ∇⟩|)) with lr the *scheduled* learning rate."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 4).to(DT)
    damping, kappa = 1e-2, 1e-4
    precond = KronPreconditioner(layer, damping=damping, kl_clip=kappa, inv_dtype=DT)
    base = torch.optim.SGD(layer.parameters(), lr=0.5)
    opt = PreconditionedOptimizer(base, precond)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.3)  # lr is now 0.15
    lr = opt.param_groups[0]["lr"]
    assert lr == pytest.approx(0.15)

    x = torch.randn(10, 5, dtype=DT)
    out = layer(x)
    out.retain_grad()
    out.square().sum().div(10).backward()
    a = torch.cat([x, torch.ones(10, 1, dtype=DT)], 1)
    d = out.grad * 10
    A, G = a.T @ a / 10, d.T @ d / 10
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
    V = torch.linalg.solve(torch.kron(G, A) + damping * torch.eye(4 * 6, dtype=DT),
                           grad.reshape(-1)).reshape(grad.shape)
    nu = min(1.0, (kappa / abs(lr**2 * (V * grad).sum().item())) ** 0.5)
    assert nu < 0.5  # the clip is active, so the lr matters
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no lr given" fallback warning
        opt.step()
    got = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
    torch.testing.assert_close(got, nu * V, rtol=1e-6, atol=1e-10)


def test_standalone_kl_clip_without_lr_warns_once():
    model = make_model()
    precond = KronPreconditioner(model)  # K-FAC: kl_clip on, no lr
    with pytest.warns(UserWarning, match="kl_clip needs the learning rate"):
        train_standalone(model, precond, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_standalone(model, precond, 1)


def train_standalone(model, precond, step, lr=None):
    x, y = batch(step)
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    precond.step() if lr is None else precond.step(lr=lr)


def test_an_lr_given_to_step_that_the_constructors_overrides_is_said_once():
    """The lr given at construction is the one kl_clip reads (the documented precedence): a
    different lr given to step() (an optimizer's scheduled one) is not followed, which is said
    once rather than left silent."""
    model = make_model()
    precond = KronPreconditioner(model, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_standalone(model, precond, 0, lr=0.1)  # the same: nothing to say
    with pytest.warns(UserWarning, match=r"lr=0\.1 given at construction.*step\(lr=0\.05\)"):
        train_standalone(model, precond, 1, lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_standalone(model, precond, 2, lr=0.02)  # once


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("method", ["kfac", "psgd"])
def test_state_dict_resumes_to_the_same_trajectory(method):
    model, opt = build(method, **KW[method])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    train(model, opt, 3, scheduler=sched)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    train(model, opt, 3, start=3, scheduler=sched)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # what HF Trainer / Accelerate use
    assert "preconditioner" in saved["opt"] and "state" in saved["opt"] and "param_groups" in saved["opt"]
    model2, opt2 = build(method, seed=1, **KW[method])
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.7)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert opt2.preconditioner.steps == 3
    train(model2, opt2, 3, start=3, scheduler=sched2)
    for pa, pb in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_torchs_distributed_state_dict_api_warns_that_it_leaves_the_preconditioner_out():
    """get_optimizer_state_dict keeps only "state" and "param_groups" (what Accelerate's FSDP
    checkpoints save): the preconditioner would be missing from the checkpoint without a word."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt = build("kfac", **KW["kfac"])
    train(model, opt, 2)
    with pytest.warns(UserWarning, match="preconditioner.*not in"):
        saved = get_optimizer_state_dict(model, opt)
    assert "preconditioner" not in saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.state_dict()  # called directly: the preconditioner is in it, nothing to say


def test_torchtitans_flat_state_dict_warns_that_it_leaves_the_preconditioner_out():
    """torchtitan's checkpointer flattens an optimizer's "state" and "param_groups" alone, as
    torch's state-dict API does."""
    utils = pytest.importorskip("torchtitan.components.optimizer.utils",
                                reason="torchtitan is an optional extra ([torchtitan])")
    model = make_model(0)
    opt = PreconditionedOptimizer(torch.optim.AdamW(model.named_parameters(), lr=0.05),
                                  KronPreconditioner(model, method="kfac", **KW["kfac"]))
    train(model, opt, 2)
    with pytest.warns(UserWarning, match="preconditioner.*not in"):
        saved = utils.get_flat_optim_state_dict(opt)
    assert not any("preconditioner" in key for key in saved)


@pytest.mark.parametrize("method", ["kfac", "psgd"])
def test_dcp_resumes_the_base_optimizer_and_the_preconditioner_as_two_entries(tmp_path, method):
    """The documented DCP path: the base optimizer through torch's state-dict API, the
    preconditioner as its own (Stateful) entry; resumed into fresh objects, bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = build(method, **KW[method])
    train(model, opt, 3)
    model_sd, optim_sd = get_state_dict(model, opt.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "precond": opt.preconditioner}, checkpoint_id=tmp_path)
    train(model, opt, 3, start=3)

    model2, opt2 = build(method, seed=1, **KW[method])
    model_sd, optim_sd = get_state_dict(model2, opt2.optimizer)
    state = {"model": model_sd, "optim": optim_sd, "precond": opt2.preconditioner}
    dcp.load(state, checkpoint_id=tmp_path)
    set_state_dict(model2, opt2.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert opt2.preconditioner.steps == 3
    train(model2, opt2, 3, start=3)
    for pa, pb in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def _snapshot(opt):
    return copy.deepcopy(opt.state_dict())


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("broken", ["preconditioner", "base"])
def test_failed_load_changes_nothing(broken):
    model, opt = build("kfac", **KW["kfac"])
    train(model, opt, 3)
    good = _snapshot(opt)
    other_model, other = build("kfac", seed=3, **KW["kfac"])
    train(other_model, other, 2)
    bad = _snapshot(other)
    if broken == "preconditioner":  # valid base part, precond part for another layer shape
        first = next(iter(bad["preconditioner"]["layers"]))
        bad["preconditioner"]["layers"][first]["a_factor"] = torch.zeros(2, 2, dtype=DT)
    else:  # valid precond part, base part for a different set of groups
        bad["param_groups"] = bad["param_groups"] * 2
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    _assert_same(_snapshot(opt), good)


@pytest.mark.parametrize("broken", ["preconditioner", "base"])
def test_a_failed_load_between_backward_and_step_keeps_the_statistics_gathered(broken):
    """A checkpoint refused after ``backward()`` leaves the step that follows as it would have
    been without the attempt: the statistics gathered by that backward are not dropped."""
    results = []
    for attempt in (False, True):
        model, opt = build("kfac", **KW["kfac"])
        train(model, opt, 2)
        other_model, other = build("kfac", seed=3, **KW["kfac"])
        bad = _snapshot(other)  # no step taken: its base optimizer holds no state
        if broken == "preconditioner":
            bad["preconditioner"]["method"] = "psgd"
        else:
            bad["param_groups"] = bad["param_groups"] * 2
        x, y = batch(2)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if attempt:
            with pytest.raises(ValueError):
                opt.load_state_dict(bad)
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _checkpoint_with_some_grad_workers(rank, world, out_dir):
    """grad_worker_fraction=0.5: each rank holds some layers' decompositions; the wrapper's
    state_dict is the whole state on every rank, and loads on every rank."""
    from dist_utils import step_as_ddp  # noqa: F401 - the module sets up the workers' imports
    model = make_model()
    opt = PreconditionedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  KronPreconditioner(model, method="kfac", grad_worker_fraction=0.5,
                                                     inv_update_steps=1, kl_clip=None))
    for step in range(2):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # every rank the same batch: no averaging needed
        opt.step()
    state = opt.state_dict()
    fresh_model = make_model(seed=5)
    fresh_model.load_state_dict(model.state_dict())
    fresh = PreconditionedOptimizer(torch.optim.SGD(fresh_model.parameters(), lr=0.1),
                                    KronPreconditioner(fresh_model, method="kfac", grad_worker_fraction=0.5,
                                                       inv_update_steps=1, kl_clip=None))
    fresh.load_state_dict(state)
    for m, o in ((model, opt), (fresh_model, fresh)):
        x, y = batch(2)
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
    return {"layers": sorted(state["preconditioner"]["layers"]),
            "same": all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))}


def test_state_dict_with_some_grad_workers_is_whole_on_every_rank(tmp_path):
    from dist_utils import run_workers
    results = run_workers(_checkpoint_with_some_grad_workers, 2, tmp_path, timeout=120)
    for result in results:
        assert result["layers"] == ["0", "2"]
        assert result["same"]


def test_load_rejects_a_plain_optimizer_state():
    model, opt = build("kfac", **KW["kfac"])
    with pytest.raises(ValueError, match="preconditioner"):
        opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())



@pytest.mark.parametrize("field, value", [("format", "something.else"), ("format_version", "2"),
                                          ("format_version", 1.5), ("format_version", 2)])
def test_a_load_with_another_format_raises_value_error_naming_it_and_changes_nothing(field, value):
    model, opt = build("kfac", **KW["kfac"])
    train(model, opt, 2)
    good = _snapshot(opt)
    bad = _snapshot(opt)
    bad[field] = value
    with pytest.raises(ValueError, match=field):
        opt.load_state_dict(bad)
    _assert_same(_snapshot(opt), good)



@pytest.mark.parametrize("version", [1, "absent", "numpy", "tensor"])
def test_a_format_version_saved_as_any_integer_or_absent_loads(version):
    import numpy as np

    model, opt = build("kfac", **KW["kfac"])
    train(model, opt, 2)
    state = _snapshot(opt)
    if version == "absent":
        del state["format_version"], state["format"]
    elif version != 1:
        state["format_version"] = np.int64(1) if version == "numpy" else torch.tensor(1)
    opt.load_state_dict(state)


def test_warmup_from_lr_zero_steps_without_clipping():
    """Warm-up schedules start at lr = 0: kl_clip's ν = min(1, sqrt(κ / 0)) = 1."""
    model_a, opt = build("kfac", damping=1e-2, kl_clip=1e-6)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step / 10)  # lr 0 at the first step
    model_b, opt_b = build("kfac", damping=1e-2, kl_clip=None)
    for model, o in ((model_a, opt), (model_b, opt_b)):
        x, y = batch(0)
        o.zero_grad()
        F.mse_loss(model(x), y).backward()
        o.optimizer.step = lambda: None  # keep the preconditioned .grad to compare
        o.step()
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa.grad, pb.grad)


# ----------------------------------------------------------------------------- review findings
def _skipped_first_iteration_run(make, skipped: bool, steps: int = 3) -> list[torch.Tensor]:
    """The loop of ``backward(); scaler.step(opt); zero_grad()``, with the very first iteration
    skipped (a GradScaler overflow: ``scaler.step`` calls nothing) when ``skipped``."""
    model, opt = make()
    if skipped:
        x, y = batch(99)
        F.mse_loss(model(x), 1e3 * y).backward()
        opt.zero_grad()  # the step never came: this iteration is abandoned
    for step in range(steps):
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_a_skipped_first_iteration_is_dropped_as_any_other():
    """The first ``zero_grad`` after construction also tells an abandoned iteration: its
    statistics were kept (parameters 0.76 off, and warnings of a changed forward count)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _skipped_first_iteration_run(lambda: build("kfac", **KW["kfac"]), skipped=True)
    want = _skipped_first_iteration_run(lambda: build("kfac", **KW["kfac"]), skipped=False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kl_clip_takes_the_lr_of_the_groups_holding_the_preconditioned_layers():
    """Group 0 may hold only parameters the preconditioner does not touch (an embedding, a head
    at another lr): kl_clip reads the lr its layers are stepped with (it read group 0's: a clip
    51x too strong). Reference: the two-object loop given that lr."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)
        extra = nn.Parameter(torch.zeros(3, dtype=DT))
        return model, extra

    results = []
    for wrapped in (True, False):
        model, extra = make()
        precond = KronPreconditioner(model, method="kfac", kl_clip=1e-3, damping=1e-2, inv_dtype=DT)
        base = torch.optim.SGD([{"params": [extra], "lr": 1.0}, {"params": list(model.parameters()), "lr": 0.01}])
        opt = PreconditionedOptimizer(base, precond) if wrapped else base
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            F.mse_loss(model(x) + extra, y).backward()
            if not wrapped:
                precond.step(lr=0.01)
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _lr_given_to_kl_clip(first_lr, second_lr) -> list:
    """One wrapper step with the two Linear layers in groups of ``first_lr`` and ``second_lr``:
    the lrs the preconditioner's step was given."""
    model = make_model()
    precond = KronPreconditioner(model, method="kfac", kl_clip=1e-3, damping=1e-2, inv_dtype=DT)
    base = torch.optim.SGD([{"params": list(model[0].parameters()), "lr": first_lr},
                            {"params": list(model[2].parameters()), "lr": second_lr}])
    opt = PreconditionedOptimizer(base, precond)
    seen = []
    original = precond.step
    precond.step = lambda **kw: (seen.append(kw.get("lr")), original(**kw))[1]
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    opt.step()
    return seen


def test_kl_clip_over_groups_of_different_lrs_takes_the_largest_and_says_so():
    with pytest.warns(UserWarning, match=r"kl_clip.*one lr.*0\.01.*0\.03"):
        seen = _lr_given_to_kl_clip(0.01, 0.03)
    assert seen == [0.03]


def test_kl_clip_over_groups_with_a_tensor_lr_takes_the_largest_without_a_host_read():
    seen = _lr_given_to_kl_clip(torch.tensor(0.01, dtype=DT), 0.03)
    assert isinstance(seen[0], torch.Tensor) and float(seen[0]) == pytest.approx(0.03)


@pytest.mark.parametrize("broken", ["preconditioner", "base"])
def test_a_failed_load_keeps_the_base_optimizers_own_objects(broken):
    """A refused load leaves the base optimizer's state and groups the same objects, as torch's
    own failed load does (a held group reference, or tensors a compiled step captured, stay
    live); no copy of the whole base state is made for the rollback."""
    model, opt = build("kfac", **KW["kfac"])
    train(model, opt, 2)
    group, state = opt.param_groups[0], opt.state
    moment = state[next(iter(model.parameters()))]["exp_avg"]
    bad = _snapshot(opt)
    if broken == "preconditioner":
        bad["preconditioner"]["method"] = "psgd"
    else:
        bad["param_groups"] = bad["param_groups"] * 2
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    assert opt.param_groups[0] is group and opt.state is state
    assert opt.state[next(iter(model.parameters()))]["exp_avg"] is moment


def test_a_parameter_frozen_after_the_preconditioner_was_built_need_not_be_stepped():
    """The usual fine-tuning order: freeze, then build the base over what trains. The frozen
    bias of a registered layer is not a parameter the base must step (the layer passes through
    while it is frozen, as in the two-object loop)."""
    model = make_model()
    precond = KronPreconditioner(model, method="kfac", **KW["kfac"])
    model[0].bias.requires_grad_(False)
    opt = PreconditionedOptimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), precond)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the layer's frozen bias: said by the preconditioner
        train(model, opt, 2)
    with pytest.raises(ValueError, match=r"does not step: \['0\.weight'\]"):
        PreconditionedOptimizer(torch.optim.AdamW(model[2].parameters()), precond)


@pytest.mark.parametrize("method,precond_lr", [("kfac", 0.1), ("psgd", None)])
def test_groups_of_other_lrs_say_nothing_when_kl_clip_reads_no_group(method, precond_lr):
    """kl_clip reads the lr given at construction (K-FAC with lr=) or is off (PSGD): the
    groups' lrs are not picked from, so neither the largest-lr note nor the override warning
    is said."""
    model = make_model()
    base = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.2},
                            {"params": model[2].parameters(), "lr": 0.05}])
    opt = PreconditionedOptimizer(base, KronPreconditioner(model, method=method, lr=precond_lr))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, opt, 2)


@pytest.mark.parametrize("step_lr", [np.array([0.05]), [0.05], "0.05"])
def test_a_step_lr_that_is_not_read_is_not_compared_either(step_lr):
    """With an lr given at construction, step()'s is not read: a value of another kind is not
    converted to compare it (a one-element array raised TypeError)."""
    model = make_model()
    precond = KronPreconditioner(model, lr=0.1)
    train_standalone(model, precond, 0, lr=step_lr)
    assert precond.steps == 1
