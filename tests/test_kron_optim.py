"""The standalone Kron optimizer (kron_precond/optim.py): torch.optim conventions,
checkpoints, robustness, and small end-to-end training runs."""
import copy
import io
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from kron_precond.optim import Kron
from kron_precond.schedules import UpdateDecider, precond_update_prob_schedule

torch.set_num_threads(1)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(step, n=16):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)


def train_steps(model, opt, start, count):
    for s in range(start, start + count):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def assert_refused_before_anything_moves(model, opt, step, key):
    """``step()`` raises ``ValueError`` naming ``key``, and neither the weights nor the step count moved."""
    before = [p.detach().clone() for p in model.parameters()]
    steps = opt.steps
    with pytest.raises(ValueError, match=key):
        step()
    assert opt.steps == steps
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def assert_load_refused_and_unchanged(opt, saved, match):
    """``load_state_dict(saved)`` raises ``ValueError`` matching ``match``, and every state tensor
    is as it was."""
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    for index, state in before["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                assert torch.equal(after["state"][index][key], value), key


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs,name", [
    (dict(lr=0.0), "lr"), (dict(lr=-1e-3), "lr"),
    (dict(precond_lr=0.0), "precond_lr"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(b1=1.0), "b1"), (dict(b1=-0.1), "b1"),
    (dict(memory_save_mode="half_diag"), "memory_save_mode"),
    (dict(preconditioner_update_probability=1.5), "preconditioner_update_probability"),
    (dict(preconditioner_update_probability=-0.1), "preconditioner_update_probability"),
    (dict(precond_init_scale=0.0), "precond_init_scale"),
    (dict(clipnorm=-1.0), "clipnorm"),
    (dict(clipnorm=1.0, clipvalue=1.0), "clipvalue"),
    (dict(clipvalue=1.0, global_clipnorm=1.0), "global_clipnorm"),
    (dict(precond_dtype=torch.int32), "precond_dtype"),
    # float8 has no matmul or linalg here: refused at construction, not at the first step
    (dict(precond_dtype=torch.float8_e4m3fn), "precond_dtype"),
    (dict(mu_dtype=torch.float8_e5m2), "mu_dtype"),
])
def test_bad_arguments_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Kron(mlp().parameters(), **kwargs)


def test_bad_group_argument_raises():
    model = mlp()
    with pytest.raises(ValueError, match="lr"):
        Kron([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": -1}])


def test_bad_scheduled_probability_raises_at_step():
    decider = UpdateDecider(lambda step: 2.0)
    with pytest.raises(ValueError, match="preconditioner_update_probability"):
        decider()


# ----------------------------------------------------------------------------- conventions
@pytest.mark.parametrize("clip", [{}, dict(clipvalue=0.01), dict(clipnorm=0.01),
                                  dict(global_clipnorm=0.01)])
def test_caller_gradient_not_mutated(clip):
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2, **clip)
    x, y = batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("clip", ["clipvalue", "clipnorm", "global_clipnorm"])
def test_clipping_semantics(clip):
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2, b1=0.9, **{clip: 1e-3})
    x, y = batch(0)
    (100 * nn.functional.mse_loss(model(x), y)).backward()
    opt.step()  # first momentum = (1 - b1) · clipped gradient
    moms = [opt.state[p]["momentum_buffer"] / 0.1 for p in model.parameters()]
    if clip == "clipvalue":
        for p, m in zip(model.parameters(), moms):
            torch.testing.assert_close(m, p.grad.clamp(-1e-3, 1e-3))
    elif clip == "clipnorm":
        assert all(abs(float(m.norm()) - 1e-3) < 1e-8 for m in moms)
    else:
        total = torch.stack([m.norm() for m in moms]).norm()
        assert abs(float(total) - 1e-3) < 1e-8


def test_closure_and_no_print(capsys):
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    x, y = batch(0)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.dim() == 0
    assert capsys.readouterr().out == ""


def test_step_makes_no_host_sync(monkeypatch):
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2, global_clipnorm=1.0)
    train_steps(model, opt, 0, 1)  # step 1 reads the non-finite counters (once per 100)

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync in Kron.step")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    train_steps(model, opt, 1, 5)


def test_lr_scheduler_changes_effective_lr():
    base, halved = mlp(), mlp()
    opt_a = Kron(base.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda step: 0.5)
    opt_b = Kron(halved.parameters(), lr=5e-3)
    assert opt_a.param_groups[0]["lr"] == 5e-3
    train_steps(base, opt_a, 0, 3)
    train_steps(halved, opt_b, 0, 3)
    sched.step()
    for a, b in zip(base.parameters(), halved.parameters()):
        assert torch.equal(a, b)
    before = [p.detach().clone() for p in base.parameters()]
    for group in opt_a.param_groups:
        group["lr"] = 1e-9
    train_steps(base, opt_a, 3, 1)
    assert max(float((p.detach() - b).abs().max())
               for p, b in zip(base.parameters(), before)) < 1e-8


def test_per_group_hyperparameters():
    torch.manual_seed(0)
    w1, w2 = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4, 3))
    w2.data.copy_(w1.data)
    opt = Kron([{"params": [w1]}, {"params": [w2], "lr": 0.2, "weight_decay": 0.5}],
               lr=0.1, preconditioner_update_probability=0.0)  # Q stays at identity
    assert opt.param_groups[1]["lr"] == 0.2 and opt.param_groups[0]["weight_decay"] == 0.0
    start = w1.detach().clone()
    grad = torch.randn(4, 3)
    w1.grad, w2.grad = grad.clone(), grad.clone()
    opt.step()
    u = (start - w1.detach()) / 0.1  # the clipped preconditioned update, no decay
    torch.testing.assert_close(start - w2.detach(), 0.2 * (u + 0.5 * start))


def test_state_dict_round_trip_is_bitwise():
    torch.manual_seed(0)
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.4,
               mu_dtype=torch.float64, precond_init_scale=None)
    train_steps(model, opt, 0, 5)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    train_steps(model, opt, 5, 6)
    expected = [p.detach().clone() for p in model.parameters()]

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model2 = mlp(seed=123)
    model2.load_state_dict(saved["model"])
    opt2 = Kron(model2.parameters(), lr=1e-2, preconditioner_update_probability=0.4,
                mu_dtype=torch.float64, precond_init_scale=None)
    opt2.load_state_dict(saved["opt"])
    p0 = next(iter(model2.parameters()))
    assert opt2.state[p0]["momentum_buffer"].dtype == torch.float64
    assert opt2.state[p0]["Q"][0].dtype == torch.float32
    train_steps(model2, opt2, 5, 6)
    for a, b in zip(model2.parameters(), expected):
        assert torch.equal(a.detach(), b)
    for p, q in zip(model.parameters(), model2.parameters()):
        for qa, qb in zip(opt.state[p]["Q"], opt2.state[q]["Q"]):
            assert torch.equal(qa, qb)


def test_schedule_counter_in_state_dict():
    model = mlp()
    schedule = precond_update_prob_schedule(flat_start=2, decay=0.5, min_prob=0.1)
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=schedule)
    train_steps(model, opt, 0, 7)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["kron"]["decider"]["step"] == 7 == opt.steps
    reference = UpdateDecider(schedule)
    decisions = [reference() for _ in range(20)]
    assert decisions[:3] == [True, True, True] and sum(decisions[3:]) < 17
    resumed = UpdateDecider(schedule)
    resumed.load_state_dict(sd["kron"]["decider"])
    assert [resumed() for _ in range(13)] == decisions[7:]


def test_update_decider_is_a_deterministic_counter():
    d = UpdateDecider(0.25)
    assert [d() for _ in range(8)] == [False, False, False, True] * 2
    d = UpdateDecider(0.1)
    assert sum(d() for _ in range(100)) == 10
    assert UpdateDecider(1.0)() is True
    p = precond_update_prob_schedule()
    assert p(0) == 1.0 == p(500) and abs(p(1000) - 0.6065) < 1e-3 and p(10 ** 6) == 0.03
    with pytest.raises(ValueError, match="min_prob"):
        precond_update_prob_schedule(min_prob=2.0)


# ----------------------------------------------------------------------------- robustness
def test_zero_dim_and_one_dim_params():
    scalar = nn.Parameter(torch.tensor(0.0))
    vector = nn.Parameter(torch.zeros(3))
    opt = Kron([scalar, vector], lr=0.05, weight_decay=0.1)
    target = torch.tensor([1.0, -2.0, 3.0])
    for _ in range(200):
        opt.zero_grad()
        ((scalar - 2.0) ** 2 + (vector - target).square().sum()).backward()
        opt.step()
    assert abs(float(scalar.detach()) - 2.0) < 0.1
    assert float((vector.detach() - target).abs().max()) < 0.1


def test_merge_dims_and_deferred_init_scale():
    conv = nn.Conv2d(3, 8, 3)  # weight [8, 3, 3, 3] -> most square 2-D view [24, 9]
    opt = Kron(conv.parameters(), lr=1e-2, merge_dims=True, precond_init_scale=None)
    conv.weight.grad = torch.zeros_like(conv.weight)  # no scale can be estimated from zeros
    conv.bias.grad = torch.ones(8)
    opt.step()
    state_w, state_b = opt.state[conv.weight], opt.state[conv.bias]
    assert [tuple(q.shape) for q in state_w["Q"]] == [(24, 24), (9, 9)]
    assert not state_w["q_initialized"] and state_b["q_initialized"]
    conv.weight.grad = torch.full_like(conv.weight, 0.5)
    opt.step()
    assert state_w["q_initialized"]
    assert torch.isfinite(conv.weight).all()


def test_nan_gradient_skips_tensor_and_warns():
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    train_steps(model, opt, 0, 2)  # steps 1, 2: no warning check is due at step 2
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    states = [copy.deepcopy(opt.state[p]) for p in params]
    opt.nonfinite_warn_interval = 2  # next check at step 3 (checks at 1, 3, 5, ...)
    x, y = batch(3)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    params[0].grad[0, 0] = float("nan")
    params[2].grad[1, 1] = float("inf")
    with pytest.warns(RuntimeWarning, match=r"parameter 0 \(shape \(8, 6\)\).*parameter 2"):
        opt.step()
    for i in (0, 2):
        assert torch.equal(params[i], before[i])
        assert torch.equal(opt.state[params[i]]["momentum_buffer"], states[i]["momentum_buffer"])
        assert all(torch.equal(a, b) for a, b in zip(opt.state[params[i]]["Q"], states[i]["Q"]))
        assert int(opt.state[params[i]]["nonfinite_steps"]) == 1
    assert not torch.equal(params[1], before[1])  # other tensors still step
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_steps(model, opt, 4, 2)  # finite again: no new warning
    for p in params:
        assert torch.isfinite(p).all()
        assert all(torch.isfinite(t).all() for t in opt.state[p]["Q"])
        assert torch.isfinite(opt.state[p]["momentum_buffer"]).all()


# ----------------------------------------------------------------------------- training
def digits(image: bool):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = perm[:1400], perm[1400:]
    if image:
        x = ((x - x[train].mean()) / x[train].std()).reshape(-1, 1, 8, 8)
    else:
        x = (x - x[train].mean(0)) / (x[train].std(0) + 1e-3)
    return x[train], y[train], x[test], y[test]


def fit_digits(model, lr, epochs, image):
    xtr, ytr, xte, yte = digits(image)
    opt = Kron(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        order = torch.randperm(len(xtr), generator=gen)
        for i in range(0, len(order), 64):
            idx = order[i:i + 64]
            opt.zero_grad()
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
    with torch.no_grad():
        return float((model(xte).argmax(1) == yte).float().mean())


def test_digits_mlp_accuracy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    assert fit_digits(model, lr=3e-3, epochs=5, image=False) >= 0.95


def test_digits_cnn_accuracy():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64, 10))
    assert fit_digits(model, lr=3e-3, epochs=6, image=True) >= 0.95


def fit_least_squares(make_opt, steps=300):
    gen = torch.Generator().manual_seed(0)
    n, d, k = 256, 20, 5
    u, _ = torch.linalg.qr(torch.randn(n, d, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    x = u @ torch.diag(torch.logspace(0, 3, d)) @ v.T  # condition number 1e3
    y = x @ torch.randn(k, d, generator=gen).T
    torch.manual_seed(0)
    model = nn.Linear(d, k, bias=False)
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    with torch.no_grad():
        loss0 = float((model(x) - y).square().mean())
    for _ in range(steps):
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        return float((model(x) - y).square().mean()) / loss0


def test_ill_conditioned_least_squares():
    kron = fit_least_squares(lambda p: Kron(p, lr=0.03))
    adam = fit_least_squares(lambda p: torch.optim.Adam(p, lr=0.03))
    assert kron < 1e-4  # measured 4e-6
    assert kron < adam / 10  # the preconditioner matters here (Adam: 5e-3)


# ------------------------------------------------------------------ conventions (probed)
def test_a_checkpoint_saved_at_a_scheduled_lr_of_zero_loads():
    """A warm-up from 0 or a decay to 0 puts lr = 0 in the first or last checkpoint."""
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1 - step / 3))
    for s in range(3):
        train_steps(model, opt, s, 1)
        schedule.step()
    assert opt.param_groups[0]["lr"] == 0.0
    twin = copy.deepcopy(model)
    resumed = Kron(twin.parameters(), lr=1e-2)
    resumed.load_state_dict(opt.state_dict())
    assert resumed.param_groups[0]["lr"] == 0.0


def test_a_deep_copy_or_pickle_of_model_and_optimizer_continues_bitwise():
    """deepcopy((model, opt)) -- an in-memory checkpoint -- gives a working optimizer on the
    copied parameters that continues exactly as the original (it used to lose its schedule
    and fail at its next step)."""
    import pickle
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
    train_steps(model, opt, 0, 3)
    copies = [copy.deepcopy((model, opt)), pickle.loads(pickle.dumps((model, opt)))]
    train_steps(model, opt, 3, 4)
    for twin, twin_opt in copies:
        train_steps(twin, twin_opt, 3, 4)
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a, b)


def test_a_copy_made_after_a_scheduler_was_attached_steps_its_own_parameters():
    """A scheduler puts its own ``step`` on the optimizer, bound to that optimizer; a copy
    (deepcopy, pickle) leaves it behind, as torch.optim's does: the copy's step moves the
    copy's parameters as the original's would, never the original's, and a scheduler
    attached to the copy drives it."""
    import pickle
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for s in range(2):
        train_steps(model, opt, s, 1)
        schedule.step()
    for copier in (copy.deepcopy, lambda obj: pickle.loads(pickle.dumps(obj))):
        twin, twin_opt = copier((model, opt))
        before = [p.detach().clone() for p in model.parameters()]
        train_steps(twin, twin_opt, 2, 1)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))  # the original is unmoved
        assert not all(torch.equal(a, b) for a, b in zip(twin.parameters(), before))
        original = copy.deepcopy(model)
        original_opt = Kron(original.parameters(), lr=1e-2)
        original_opt.load_state_dict(opt.state_dict())
        train_steps(original, original_opt, 2, 1)  # what the original does on the same gradient
        for a, b in zip(original.parameters(), twin.parameters()):
            assert torch.equal(a, b)
        twin_schedule = torch.optim.lr_scheduler.StepLR(twin_opt, 1, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
            train_steps(twin, twin_opt, 3, 1)
            twin_schedule.step()
        assert twin_opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)


def test_a_checkpoint_loads_into_an_optimizer_of_a_model_on_the_meta_device():
    """As torch.optim's load: the state goes to the parameters' device, the meta device too (a
    model built there before its weights are materialized); nothing is read back from it."""
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    train_steps(model, opt, 0, 2)
    with torch.device("meta"):
        meta_model = mlp()
    meta_opt = Kron(meta_model.parameters(), lr=1e-2)
    meta_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert meta_opt.steps == opt.steps
    assert len(meta_opt.state) == len(opt.state)
    for p, q in zip(model.parameters(), meta_model.parameters()):
        assert meta_opt.state[q].keys() == opt.state[p].keys()
        momentum = meta_opt.state[q]["momentum_buffer"]
        assert momentum.device.type == "meta" and momentum.shape == p.shape


def test_complex_parameters_are_refused():
    """Only the real part would be trained (the imaginary part silently dropped)."""
    p = nn.Parameter(torch.randn(3, 4, dtype=torch.complex64))
    with pytest.raises(TypeError, match="complex"):
        Kron([p], lr=0.1)
    opt = Kron(mlp().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="complex"):
        opt.add_param_group({"params": [p]})


@pytest.mark.parametrize("key,value", [("lr", float("nan")), ("lr", -1.0), ("b1", 1.0),
                                       ("weight_decay", -1.0), ("precond_lr", -1.0),
                                       # not numbers: a string, a bool, a list
                                       ("lr", "0.01"), ("b1", True), ("weight_decay", [0.1]),
                                       ("lr", None), ("precond_lr", lambda step: 0.1), ("lr", Fraction(1, 100))])
def test_a_bad_value_set_on_a_group_raises_at_the_next_step_before_anything_moves(key, value):
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    train_steps(model, opt, 0, 2)
    opt.param_groups[0][key] = value
    assert_refused_before_anything_moves(model, opt, lambda: train_steps(model, opt, 2, 1), key)


@pytest.mark.parametrize("key, bad", [("step", float("nan")), ("step", -3.0), ("step", 2.5), ("step", float("inf")),
                                      ("nonfinite_steps", -1)])
def test_a_checkpoint_with_an_impossible_counter_is_refused_and_changes_nothing(key, bad):
    """The step counter sets the bias correction of every later step: a NaN there would turn
    the weights to NaN, a negative or fractional one would skew them; the non-finite counter
    feeds the warnings. Refused, naming the entry, with the optimizer as it was."""
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    train_steps(model, opt, 0, 2)
    before = copy.deepcopy(opt.state_dict())
    saved = copy.deepcopy(before)  # torch.optim's state_dict holds the live per-parameter dicts
    saved["state"][0][key] = torch.tensor(bad, dtype=saved["state"][0][key].dtype)
    assert_load_refused_and_unchanged(opt, saved, key)
    opt.load_state_dict(before)  # the good checkpoint still loads
    train_steps(model, opt, 2, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_resume_reports_only_the_non_finite_steps_after_the_checkpoint():
    """The saved counters were reported by the run that saved them; after a resume the warning
    names the new ones (and the total), once."""
    def nan_step(model, opt):
        opt.zero_grad()
        x, y = batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        next(model.parameters()).grad[0, 0] = float("nan")
        opt.step()

    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    opt.nonfinite_warn_interval = 1
    with pytest.warns(RuntimeWarning, match="non-finite"):
        nan_step(model, opt)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        nan_step(model, opt)
    saved = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    resumed = Kron(twin.parameters(), lr=1e-2)
    resumed.nonfinite_warn_interval = 1
    resumed.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_steps(twin, resumed, 0, 2)  # no new non-finite step: nothing to report
    with pytest.warns(RuntimeWarning, match=r"1 step\(s\), 3 in total"):
        nan_step(twin, resumed)


# ----------------------------------------------------------------------------- step scalars
# The factors may be kept in bfloat16/float16, but lr, weight decay and the step scale are
# computed in float32 or wider (the parameter's dtype promoted with float32): in bfloat16
# 1 − 1e-4 is 1, in float16 2e-8 is 0. References are float64 formulas.
@pytest.mark.parametrize("param_dtype,precond_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float64, torch.float32)])
def test_decoupled_weight_decay_is_exact_whatever_the_factor_dtype(param_dtype, precond_dtype):
    lr, wd, steps, g = 1e-3, 0.1, 100, 2.0 ** -10
    weight = nn.Parameter(torch.ones(4, 4, dtype=param_dtype))
    opt = Kron([weight], lr=lr, b1=0.0, weight_decay=wd, precond_dtype=precond_dtype,
               preconditioner_update_probability=0.0)
    for _ in range(steps):
        # P = I, m̂ = g (b1 = 0), exact in every dtype and under the RMS clip: the step is lr·g
        # (an all-zero gradient would be no step at all, its decay included)
        weight.grad = torch.full_like(weight, g)
        opt.step()
    expected = 1.0
    for _ in range(steps):  # float64: p ← p·(1 − lr·wd) − lr·g per step
        expected = expected * (1.0 - lr * wd) - lr * g
    # float32 weights round once per step (≤ 6e-8 each); float64 ones far less
    rtol = 1e-5 if param_dtype == torch.float32 else 1e-12
    assert torch.allclose(weight.detach().double(), torch.full((4, 4), expected, dtype=torch.float64),
                          rtol=rtol, atol=0.0), (float(weight[0, 0]), expected)


@pytest.mark.parametrize("precond_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lr", [2e-8, 1e-7, 3e-6])
def test_a_small_learning_rate_survives_half_precision_factors(precond_dtype, lr):
    weight = nn.Parameter(torch.zeros(4, 4))
    opt = Kron([weight], lr=lr, precond_dtype=precond_dtype, preconditioner_update_probability=0.0)
    weight.grad = torch.full((4, 4), 10.0)  # the debiased momentum is 10, exact in every dtype
    opt.step()
    # P = I: the step is lr · m̂ clipped to RMS 1.1, i.e. −lr · 1.1 in every entry (float64)
    expected = torch.full((4, 4), -lr * 1.1, dtype=torch.float64)
    assert torch.allclose(weight.detach().double(), expected, rtol=1e-5, atol=0.0), (float(weight[0, 0]), -lr * 1.1)


def test_a_large_gradient_steps_under_float16_factors():
    """The RMS clip's norm is taken in float32: ‖u‖ of 40 000 entries of 400 is 8e4, past
    float16's 65 504, and an overflowed norm would clip the update to nothing."""
    weight = nn.Parameter(torch.zeros(200, 200))
    opt = Kron([weight], lr=1e-2, precond_dtype=torch.float16, preconditioner_update_probability=0.0)
    weight.grad = torch.full((200, 200), 4000.0)
    opt.step()
    # P = I: m̂ = g, RMS 4000 clipped to 1.1 (float64 reference)
    expected = torch.full((200, 200), -1e-2 * 1.1, dtype=torch.float64)
    assert torch.allclose(weight.detach().double(), expected, rtol=1e-3, atol=0.0), float(weight[0, 0])


def test_a_non_finite_first_gradient_leaves_the_weights_under_float16_factors():
    """Nothing averaged yet: the debias factor is ~0 and 1/debias overflows float16; the
    skipped tensor's zero learning rate must not meet an infinite scale (0·inf = NaN)."""
    weight = nn.Parameter(torch.ones(4, 3))
    opt = Kron([weight], lr=0.1, weight_decay=0.1, precond_dtype=torch.float16)
    weight.grad = torch.full((4, 3), float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert torch.equal(weight.detach(), torch.ones(4, 3))


# ----------------------------------------------------------------------------- state edits
def _replace_state_tensors(opt, how):
    """What checkpoint and device-moving helpers do to ``opt.state``: new tensors, same values."""
    for state in opt.state.values():
        for key, value in list(state.items()):
            if torch.is_tensor(value):
                state[key] = value.clone()
            elif how == "lists_too" and isinstance(value, list):
                state[key] = [t.clone() for t in value]
            elif how == "list_items" and isinstance(value, list):
                for i, t in enumerate(value):
                    value[i] = t.clone()


@pytest.mark.parametrize("rule", ["eq", "procrustes"])
@pytest.mark.parametrize("how", ["tensors", "lists_too", "list_items"])
def test_replacing_the_state_tensors_mid_run_changes_nothing(rule, how):
    """The step uses the tensors in ``opt.state``, not copies it kept: a run whose state
    tensors were replaced by equal new ones ends bitwise equal to one left alone."""
    runs = []
    for replace in (False, True):
        model = mlp()
        opt = Kron(model.parameters(), lr=1e-2, weight_decay=0.1, precond_update=rule,
                   preconditioner_update_probability=0.5)
        train_steps(model, opt, 0, 3)
        if replace:
            _replace_state_tensors(opt, how)
        train_steps(model, opt, 3, 6)
        runs.append((model, opt))
    (model_a, opt_a), (model_b, opt_b) = runs
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(opt_a.state[p]["momentum_buffer"], opt_b.state[q]["momentum_buffer"])
        assert torch.equal(opt_a.state[p]["step"], opt_b.state[q]["step"])
        assert all(torch.equal(x, y) for x, y in zip(opt_a.state[p]["Q"], opt_b.state[q]["Q"]))
    assert float(opt_b.state[next(model_b.parameters())]["step"]) == 9  # the new tensors were used


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("bad, name", [({"step": 1, "acc": float("nan")}, "acc"),
                                       ({"step": 1, "acc": float("inf")}, "acc"),
                                       ({"step": 1, "acc": -0.5}, "acc"),
                                       ({"step": 1, "acc": 1.5}, "acc"),
                                       ({"step": -7, "acc": 0.0}, "step"),
                                       ({"step": 2.5, "acc": 0.0}, "step")])
def test_a_checkpoint_with_a_bad_schedule_counter_is_refused_and_changes_nothing(bad, name):
    """A NaN accumulator would stop every later preconditioner update, a negative step
    count would shift the schedule: refused, naming the counter, with nothing loaded."""
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
    train_steps(model, opt, 0, 3)
    saved = copy.deepcopy(opt.state_dict())
    saved["kron"]["decider"] = bad
    saved["param_groups"][0]["lr"] = 0.5  # would be loaded if anything were
    target = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
    train_steps(model, target, 0, 1)
    before = copy.deepcopy(target.state_dict())
    assert_load_refused_and_unchanged(target, saved, name)
    after = target.state_dict()
    assert after["kron"] == before["kron"] and after["param_groups"][0]["lr"] == 1e-2
    target.load_state_dict(copy.deepcopy(before))  # the good checkpoint still loads


def test_a_set_of_params_in_a_group_is_refused_like_torch():
    """A set's order changes between runs (and with it every per-parameter seed)."""
    weight, bias = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
    with pytest.raises(TypeError, match="ordered collections"):
        torch.optim.AdamW([{"params": {weight, bias}}])  # the behaviour followed
    with pytest.raises(TypeError, match="ordered collections"):
        Kron([{"params": {weight, bias}}], lr=0.1)
    opt = Kron([weight], lr=0.1)
    with pytest.raises(TypeError, match="ordered collections"):
        opt.add_param_group({"params": {bias}})


def test_zero_element_parameters_are_stepped_without_error():
    """Nothing to update, as in torch's optimizers; the other parameters step exactly as
    without them (placed last, so the others keep their probe seeds)."""
    runs = []
    for with_empty in (False, True):
        torch.manual_seed(0)
        weight = nn.Parameter(torch.randn(5, 4))
        empty = [nn.Parameter(torch.zeros(0)), nn.Parameter(torch.zeros(0, 4))]
        opt = Kron([weight, *empty] if with_empty else [weight], lr=1e-2, weight_decay=0.1,
                   global_clipnorm=1.0, preconditioner_update_probability=1.0)
        for step in range(3):
            weight.grad = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            for e in empty:
                e.grad = torch.zeros_like(e)
            opt.step()
        runs.append(weight.detach().clone())
        if with_empty:
            assert [tuple(e.shape) for e in empty] == [(0,), (0, 4)]
            twin = Kron([weight, *empty], lr=1e-2)
            twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert torch.equal(runs[0], runs[1])


def test_a_sparse_gradient_is_refused_before_anything_changes():
    dense = nn.Linear(3, 2)
    emb = nn.Embedding(10, 3, sparse=True)
    opt = Kron([*dense.parameters(), *emb.parameters()], lr=0.1, preconditioner_update_probability=0.5)
    before = [p.detach().clone() for p in (*dense.parameters(), *emb.parameters())]
    (dense(emb(torch.tensor([1, 2]))).sum()).backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert opt.steps == 0 and opt.update_decider.state_dict() == {"step": 0, "acc": 0.0}
    assert len(opt.state) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, (*dense.parameters(), *emb.parameters())))


def test_load_state_dict_pre_hooks_run_before_the_checks():
    """As in torch.optim: a pre-hook may adapt the checkpoint, and what it returns is what
    is checked and loaded."""
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    train_steps(model, opt, 0, 2)
    saved = copy.deepcopy(opt.state_dict())

    def reset_momentum(optimizer, state_dict):
        state_dict = dict(state_dict)
        state_dict["state"] = {k: {**v, "momentum_buffer": torch.zeros_like(v["momentum_buffer"])}
                               for k, v in state_dict["state"].items()}
        state_dict["param_groups"] = [{**g, "lr": 0.5} for g in state_dict["param_groups"]]
        return state_dict

    calls = []
    target = Kron(model.parameters(), lr=1e-2)
    target.register_load_state_dict_pre_hook(reset_momentum)
    target.register_load_state_dict_post_hook(
        lambda o: calls.append(float(o.state[next(model.parameters())]["momentum_buffer"].abs().sum())))
    target.load_state_dict(saved)
    assert target.param_groups[0]["lr"] == 0.5
    assert all(not s["momentum_buffer"].any() for s in target.state.values())
    assert calls == [0.0]  # once, after the per-parameter state is installed

    def bad_b1(optimizer, state_dict):
        state_dict["param_groups"] = [{**g, "b1": 1.5} for g in state_dict["param_groups"]]
        return state_dict

    checked = Kron(model.parameters(), lr=1e-2)
    checked.register_load_state_dict_pre_hook(bad_b1)
    with pytest.raises(ValueError, match="b1"):
        checked.load_state_dict(copy.deepcopy(saved))
    assert checked.param_groups[0]["b1"] == 0.9


def _dcp_model_and_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    gen = torch.Generator().manual_seed(1)
    return model, [(torch.randn(8, 5, generator=gen, dtype=torch.float64),
                    torch.randn(8, 3, generator=gen, dtype=torch.float64)) for _ in range(10)]


def _dcp_train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("update", ["eq", "procrustes"])
def test_a_run_resumed_through_torchs_distributed_checkpoint_api_goes_on_as_the_uninterrupted_one(
        tmp_path, flatten, update):
    """get_optimizer_state_dict keeps only "state" and "param_groups", and its load runs one
    step with zero gradients to create the state: the update schedule's counters ride in each
    parameter's entry, so the resumed run is bitwise the uninterrupted one (probe vectors and
    update decisions follow the counters). With ``flatten_optimizer_state_dict`` every entry
    must be a tensor, a number or a dict: the factors are saved as a dict by position."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    settings = dict(lr=1e-2, precond_dtype=torch.float64, preconditioner_update_probability=0.5,
                    precond_update=update)
    reference, batches = _dcp_model_and_batches()
    _dcp_train(reference, Kron(reference.parameters(), **settings), batches)
    model, _ = _dcp_model_and_batches()
    opt = Kron(model.parameters(), **settings)
    _dcp_train(model, opt, batches[:5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own notices (no process group)
        dcp.save({"optim": get_optimizer_state_dict(model, opt, options=options)}, checkpoint_id=str(tmp_path))
        resumed, _ = _dcp_model_and_batches()
        resumed.load_state_dict(model.state_dict())
        fresh = Kron(resumed.parameters(), **settings)
        template = {"optim": get_optimizer_state_dict(resumed, fresh, options=options)}
        dcp.load(template, checkpoint_id=str(tmp_path))
        set_optimizer_state_dict(resumed, fresh, template["optim"], options=options)
    assert fresh.state_dict()["kron"] == opt.state_dict()["kron"]
    _dcp_train(resumed, fresh, batches[5:])
    for mine, theirs in zip(resumed.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [torch.tensor([1.5, 0.2, 0.0], dtype=torch.float64),
                                 torch.tensor([1.0, float("nan"), 0.0], dtype=torch.float64),
                                 torch.tensor([1.0, 0.2], dtype=torch.float64), "disagree"],
                         ids=["fraction", "nan", "short", "disagree"])
def test_bad_schedule_counters_in_the_entries_are_refused_and_change_nothing(bad):
    model, batches = _dcp_model_and_batches()
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
    _dcp_train(model, opt, batches[:3])
    saved = opt.state_dict()
    del saved["kron"]  # as torch.distributed.checkpoint's API hands it over
    if isinstance(bad, str):  # one entry's counters unlike the others'
        saved["state"][0]["kron_schedule"] = saved["state"][0]["kron_schedule"] + torch.tensor(
            [1.0, 0.0, 0.0], dtype=torch.float64)  # a valid step on its own
    else:
        saved["state"][0]["kron_schedule"] = bad
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="kron"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert after["kron"] == before["kron"]
    for key, entry in before["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(after["state"][key][name], value)


def test_an_optimizer_pickled_without_the_state_bindings_steps_as_the_original():
    """A Kron pickled by an earlier version lacks the record of which state tensors each
    per-parameter preconditioner was built on: it rebuilds them and steps as the original."""
    import pickle

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=1.0)

    def step(m, o, seed):
        o.zero_grad()
        m(torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
        o.step()

    step(model, opt, 0)
    copy_model, copy_opt = pickle.loads(pickle.dumps((model, opt)))
    del copy_opt.__dict__["_bound"]  # as an older version pickled it
    del copy_opt.__dict__["_schedule"]  # and before the schedule's counters rode in the live entries
    for entry in copy_opt.state.values():
        del entry["kron_schedule"]
    copy_opt.__setstate__(copy_opt.__dict__.copy())
    for seed in (1, 2):
        step(model, opt, seed)
        step(copy_model, copy_opt, seed)
    for a, b in zip(model.parameters(), copy_model.parameters()):
        assert torch.equal(a, b)
    # its live entries hold the counters' key again: a flattened checkpoint keeps them
    assert all(entry["kron_schedule"] is copy_opt._schedule for entry in copy_opt.state.values())
    assert copy_opt._schedule.tolist() == opt._schedule.tolist() == [3.0, 0.0, 3.0]


def conv_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2))


def conv_steps(model, opt, start, count, extra=None):
    for s in range(start, start + count):
        gen = torch.Generator().manual_seed(2000 + s)
        opt.zero_grad()
        loss = model(torch.randn(4, 2, 4, 4, generator=gen)).square().mean()
        if extra is not None:
            loss = loss + extra.square().sum()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("key,value", [
    ("precond_dtype", torch.float64), ("mu_dtype", torch.float64), ("merge_dims", True),
    ("max_size_triangular", 2), ("min_ndim_triangular", 3), ("memory_save_mode", "all_diag"),
    ("precond_update", "procrustes")])
@pytest.mark.parametrize("after_load", [False, True])
def test_a_setting_that_shapes_the_state_changed_mid_run_is_refused_before_anything_moves(key, value, after_load):
    """These settings fix the shapes and dtypes of a parameter's factors and momentum when its
    state is made: changed on a group later (by hand or by a scheduler), the step would keep
    the old ones and ignore the new value. It raises, naming the setting, and moves nothing;
    set back, the run goes on."""
    model = conv_model()
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=1.0)
    conv_steps(model, opt, 0, 2)
    if after_load:
        saved = copy.deepcopy(opt.state_dict())
        opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=1.0)
        opt.load_state_dict(saved)
    old = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    steps = opt.steps
    assert_refused_before_anything_moves(model, opt, lambda: conv_steps(model, opt, 2, 1), key)
    opt.param_groups[0][key] = old
    conv_steps(model, opt, 2, 1)
    assert opt.steps == steps + 1


def test_a_group_added_later_takes_its_own_settings():
    """The check concerns a parameter's own state: a new group with other settings is fine."""
    model = conv_model()
    extra = nn.Parameter(torch.randn(3, 2, 2, 2))
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=1.0)
    conv_steps(model, opt, 0, 1)
    opt.add_param_group({"params": [extra], "merge_dims": True, "precond_dtype": torch.float64})
    conv_steps(model, opt, 1, 2, extra)
    assert opt.state[extra]["Q"][0].dtype == torch.float64


@pytest.mark.parametrize("b1", [0.9, 0.9999, 0.0])
def test_the_momentum_bias_correction_is_exact_to_float32(b1):
    """With a constant gradient g the debiased momentum is g at every step: 1 − b1^t divides
    out exactly what the average built up. In float32 pow rounds b1 first and the subtraction
    magnifies that (2e-4 at b1 = 0.9999): the step must be lr·g to float32's precision."""
    g = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)
    weight = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    lr = 1e-3
    opt = Kron([weight], lr=lr, b1=b1, precond_dtype=torch.float64, preconditioner_update_probability=0.0)
    for _ in range(50):
        before = weight.detach().clone()
        weight.grad = g.clone()
        opt.step()
        step = (before - weight.detach()) / lr
        torch.testing.assert_close(step, g, rtol=1e-6, atol=0)


def test_a_setting_spelled_another_way_with_the_same_effect_is_not_a_change():
    """``mu_dtype=None`` means the parameter's dtype: setting that dtype by name changes nothing."""
    model = conv_model()
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=1.0)
    conv_steps(model, opt, 0, 1)
    opt.param_groups[0]["mu_dtype"] = torch.float32
    conv_steps(model, opt, 1, 1)
    assert opt.steps == 2


@pytest.mark.parametrize("key", ["state", "param_groups"])
def test_a_checkpoint_without_an_entry_raises_and_changes_nothing(key):
    """A dict missing ``state`` (or ``param_groups``) is not an optimizer's checkpoint: refused
    naming the entry, as torch.optim refuses it, not loaded as "no state" over the momenta and
    factors this optimizer holds."""
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=1.0)
    train_steps(model, opt, 0, 3)
    saved = copy.deepcopy(opt.state_dict())
    del saved[key]
    assert_load_refused_and_unchanged(opt, saved, key)
    assert len(opt.state) == len(list(model.parameters()))


# ----------------------------------------------------------------------------- all-zero gradients
def _state_tensors(opt, p):
    """Every tensor of ``p``'s state that a step writes."""
    s = opt.state[p]
    return [s["momentum_buffer"], s["step"], s["nonfinite_steps"], *s["Q"], *s.get("lipschitz", [])]


@pytest.mark.parametrize("rule", ["eq", "procrustes"])
@pytest.mark.parametrize("idle_from_start", [False, True])
def test_an_all_zero_gradient_counts_as_no_gradient(rule, idle_from_start):
    """A parameter whose gradient is zero in every element (``zero_grad(set_to_none=False)``
    on a parameter the loss did not reach, an expert the router sent no token) is not
    stepped: the weight, its decay, momentum, step count and factors stay bitwise as they
    were, as with ``.grad = None``, and the other parameters step exactly as in that run.
    Stepped instead, the factors fit the decaying momentum and the weight drifts linearly.
    The idle stretch covers the 101st preconditioner update, which rebalances the factors."""
    runs = []
    for zeros in (True, False):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(6, 5)), nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
        opt = Kron(params, lr=1e-2, weight_decay=0.1, global_clipnorm=1.0, precond_update=rule,
                   preconditioner_update_probability=1.0)
        idle = range(0, 105) if idle_from_start else range(3, 105)
        history = []
        for step in range(110):
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if step in idle:
                params[1].grad = torch.zeros(4, 3) if zeros else None
            before = [p.detach().clone() for p in params]
            state_before = [t.clone() for t in _state_tensors(opt, params[1])] if params[1] in opt.state else None
            opt.step()
            if zeros and step in idle:
                assert torch.equal(params[1].detach(), before[1]), step
                if state_before is not None:
                    assert all(torch.equal(a, b) for a, b in zip(_state_tensors(opt, params[1]), state_before)), step
                assert int(opt.state[params[1]]["nonfinite_steps"]) == 0  # a zero is no NaN
            history.append(([p.detach().clone() for p in params],
                            {i: [t.clone() for t in _state_tensors(opt, p)]
                             for i, p in enumerate(params) if p in opt.state}))
        runs.append(history)
    for step, ((params_a, state_a), (params_b, state_b)) in enumerate(zip(*runs)):
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b)), step
        for i in state_b:  # the None run has no state for the idle parameter until its first gradient
            assert all(torch.equal(a, b) for a, b in zip(state_a[i], state_b[i])), (step, i)
    assert not torch.equal(runs[0][-1][0][1], runs[0][0][0][1])  # it steps again afterwards


def test_zero_grad_without_set_to_none_leaves_an_unused_parameter_alone():
    """The reviewer's case: after 20 real steps, 1000 steps of exact zeros moved the weight by
    20.9 (|w| 0.44) as the preconditioner grew like 1/|m|; it must not move at all."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.zeros(8, 4))
    opt = Kron([weight], lr=0.01, preconditioner_update_probability=1.0)
    for _ in range(20):
        weight.grad = torch.randn(8, 4)
        opt.step()
    after_real = weight.detach().clone()
    momentum = opt.state[weight]["momentum_buffer"].clone()
    opt.zero_grad(set_to_none=False)
    for _ in range(50):
        opt.step()
    assert torch.equal(weight.detach(), after_real)
    assert torch.equal(opt.state[weight]["momentum_buffer"], momentum)
    assert float(opt.state[weight]["step"]) == 20


# ----------------------------------------------------------------------------- float16 factors
def _identity_preconditioner_reference(weight, grads, lr, b1=0.9, weight_decay=0.0):
    """The documented step in float64 with P = I (no Q update): m = b1·m + (1 − b1)·g,
    u = P m scaled by min(1/(1 − b1^t), 1.1/rms(u)), p ← p·(1 − lr·wd) − lr·u."""
    w = weight.detach().double().clone()
    m = torch.zeros_like(w)
    out = []
    for t, g in enumerate(grads, 1):
        m = b1 * m + (1 - b1) * g.double()
        rms = float(m.norm()) / w.numel() ** 0.5
        scale = min(1.0 / (1.0 - b1 ** t), 1.1 / (rms + 1e-12))
        if w.dim() >= 2:
            w = w * (1.0 - lr * weight_decay)
        w = w - lr * scale * m
        out.append(w.clone())
    return out


def test_float16_factors_precondition_a_momentum_past_65504():
    """The momentum of a constant gradient of 1e5 passes float16's 65 504 at step 11: with
    float16 factors ``P m`` is computed in float32 (the factors stay float16), so the weights
    follow the float64 reference instead of turning NaN."""
    weight = nn.Parameter(torch.ones(4, 3))
    opt = Kron([weight], lr=1e-3, precond_dtype=torch.float16, preconditioner_update_probability=0.0)
    grads = [torch.full((4, 3), 1e5)] * 20
    expected = _identity_preconditioner_reference(weight, grads, lr=1e-3)
    for t, (g, w) in enumerate(zip(grads, expected), 1):
        weight.grad = g.clone()
        opt.step()
        got = weight.detach().double()
        assert torch.allclose(got, w, rtol=1e-6, atol=0.0), (t, float(got[0, 0]), float(w[0, 0]))
    assert int(opt.state[weight]["nonfinite_steps"]) == 0
    assert opt.state[weight]["Q"][0].dtype == torch.float16


def test_float16_factors_fit_large_gradients_as_float32_factors_do():
    """The Q update of float16 factors is computed in float32 too: its Gram matrices of a
    gradient of scale 1e4 pass 65 504 (in float16 the update was dropped, or the weights
    turned NaN). The result is the float32-factor run's to float16's rounding."""
    runs = []
    for dtype in (torch.float16, torch.float32):
        torch.manual_seed(0)
        weight = nn.Parameter(torch.randn(6, 5))
        opt = Kron([weight], lr=1e-2, precond_dtype=dtype, preconditioner_update_probability=1.0)
        gen = torch.Generator().manual_seed(1)
        for _ in range(10):
            weight.grad = 1e4 * torch.randn(6, 5, generator=gen)
            opt.step()
        runs.append((weight.detach().clone(), [q.float() for q in opt.state[weight]["Q"]]))
        assert torch.isfinite(weight).all() and int(opt.state[weight]["nonfinite_steps"]) == 0
    (w16, q16), (w32, q32) = runs
    assert all(not torch.equal(q, torch.diag(torch.diagonal(q))) for q in q32)  # the factors learned
    for a, b in zip(q16, q32):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-4 * float(b.abs().max()))
    torch.testing.assert_close(w16, w32, rtol=1e-2, atol=1e-3)


def test_a_finite_gradient_whose_update_overflows_leaves_the_weight_and_is_counted():
    """float64 weights with float32 factors: a gradient of 1e39 is finite, its momentum
    overflows float32. The step writes nothing non-finite: the weight is left as it was and
    the step counted with the non-finite ones (warned about)."""
    weight = nn.Parameter(torch.ones(4, 3, dtype=torch.float64))
    opt = Kron([weight], lr=1e-3, weight_decay=0.1, preconditioner_update_probability=0.0)
    weight.grad = torch.full((4, 3), 1e40, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert torch.equal(weight.detach(), torch.ones(4, 3, dtype=torch.float64))
    assert int(opt.state[weight]["nonfinite_steps"]) == 1


# ----------------------------------------------------------------------------- group settings set later
def _snapshot(model, opt):
    """Untouched copies of the weights and of every state tensor."""
    return ([p.detach().clone() for p in model.parameters()],
            [{k: (v.clone() if torch.is_tensor(v) else [t.clone() for t in v] if isinstance(v, list) else v)
              for k, v in opt.state[p].items()} for p in model.parameters()])


def _assert_same_as(snapshot, model, opt, skip=("nonfinite_steps", "kron_schedule")):
    # the schedule's counters (kron_schedule) are the optimizer's, not the parameter's: the step
    # is counted (with the non-finite ones), as the schedule counts it
    weights, states = snapshot
    for p, w, state in zip(model.parameters(), weights, states):
        assert torch.equal(p, w)
        for key, value in state.items():
            if key in skip:
                continue
            now = opt.state[p][key]
            if torch.is_tensor(value):
                assert torch.equal(now, value), key
            elif isinstance(value, list):
                assert all(torch.equal(a, b) for a, b in zip(now, value)), key
            else:
                assert now == value, key


@pytest.mark.parametrize("key,value", [
    ("lr", float("nan")), ("lr", -1.0), ("lr", float("inf")), ("b1", 1.5), ("b1", 1.0), ("b1", float("nan")),
    ("weight_decay", float("nan")), ("weight_decay", -1.0), ("precond_lr", float("nan")), ("precond_lr", 0.0),
    ("clipnorm", float("nan")), ("clipnorm", -1.0), ("clipvalue", -1.0), ("clipvalue", float("inf"))])
def test_a_bad_tensor_setting_on_a_group_leaves_everything_as_it_was_and_is_counted(key, value):
    """The docs' rule for a bad group setting (nothing moves) holds for one held as a 0-dim
    tensor too, which is checked on the device (no host read) instead of raising."""
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2, weight_decay=0.1, preconditioner_update_probability=1.0)
    train_steps(model, opt, 0, 2)
    opt.param_groups[0][key] = torch.tensor(value)
    before = _snapshot(model, opt)
    counts = [int(opt.state[p]["nonfinite_steps"]) for p in model.parameters()]
    opt.nonfinite_warn_interval = 1
    with pytest.warns(RuntimeWarning, match=f"param group 0: {key} "):
        train_steps(model, opt, 2, 1)
    _assert_same_as(before, model, opt, skip=("kron_schedule",))  # the optimizer's counters: the call counts
    # counted per setting and warned about, not as a non-finite gradient
    assert [int(opt.state[p]["nonfinite_steps"]) for p in model.parameters()] == counts
    opt.param_groups[0][key] = opt.defaults[key] if opt.defaults[key] is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once
        train_steps(model, opt, 3, 1)
    assert not torch.equal(next(model.parameters()), before[0][0])  # and the run goes on


def test_a_good_tensor_setting_steps_as_the_same_number():
    """Valid 0-dim tensor settings give the run of the same Python numbers (bitwise)."""
    runs = []
    for as_tensor in (False, True):
        model = mlp()
        settings = dict(lr=1e-2, b1=0.8, weight_decay=0.1, precond_lr=0.2, clipnorm=0.5)
        opt = Kron(model.parameters(), preconditioner_update_probability=1.0, **settings)
        train_steps(model, opt, 0, 1)
        if as_tensor:
            opt.param_groups[0].update({k: torch.tensor(v) for k, v in settings.items()})
        train_steps(model, opt, 1, 3)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_tensor_settings_make_no_host_sync(monkeypatch):
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2, weight_decay=0.1)
    train_steps(model, opt, 0, 1)
    opt.param_groups[0].update(lr=torch.tensor(1e-2), b1=torch.tensor(0.9), weight_decay=torch.tensor(0.1),
                               precond_lr=torch.tensor(0.1), clipnorm=torch.tensor(1.0))

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync in Kron.step")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    train_steps(model, opt, 1, 3)


def test_a_complex_numpy_value_is_refused():
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    train_steps(model, opt, 0, 1)
    opt.param_groups[0]["lr"] = np.clongdouble(0.02 + 1j)
    assert_refused_before_anything_moves(model, opt, lambda: train_steps(model, opt, 1, 1), "lr")


@pytest.mark.parametrize("value", [torch.tensor([1e-2, 1e-2]), torch.tensor(True), torch.tensor(1)])
def test_a_tensor_setting_that_is_not_one_floating_number_raises(value):
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    train_steps(model, opt, 0, 1)
    opt.param_groups[0]["lr"] = value
    assert_refused_before_anything_moves(model, opt, lambda: train_steps(model, opt, 1, 1), "lr")


def test_numpy_values_set_on_a_group_step_as_their_python_numbers():
    results = []
    for wrap in (np.array, np.longdouble, float):
        torch.manual_seed(0)
        model = mlp()
        opt = Kron(model.parameters(), lr=1e-2)
        opt.param_groups[0].update(lr=wrap(0.02), b1=wrap(0.8), weight_decay=wrap(0.1), clipnorm=None)
        train_steps(model, opt, 0, 3)
        results.append([p.detach().clone() for p in model.parameters()])
    for run in results[:-1]:
        for a, b in zip(run, results[-1]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("key,value", [("clipnorm", -1.0), ("clipnorm", 0.0), ("clipnorm", float("nan")),
                                       ("clipnorm", 1e39), ("clipvalue", -1.0), ("clipvalue", 0.0),
                                       ("clipvalue", float("inf"))])
def test_a_bad_clip_value_set_on_a_group_raises_at_the_next_step_before_anything_moves(key, value):
    """As at construction: a clip value must be > 0 and finite in float32 (clipnorm = −1
    reversed the gradient, clipvalue < 0 replaced it by a constant)."""
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    train_steps(model, opt, 0, 2)
    opt.param_groups[0][key] = value
    assert_refused_before_anything_moves(model, opt, lambda: train_steps(model, opt, 2, 1), key)


def test_two_clips_set_on_a_group_raise_at_the_next_step_before_anything_moves():
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2, clipnorm=1.0)
    train_steps(model, opt, 0, 1)
    opt.param_groups[0]["clipvalue"] = 0.1
    assert_refused_before_anything_moves(model, opt, lambda: train_steps(model, opt, 1, 1), "clipvalue")


def test_a_nan_clipnorm_for_one_step_does_not_poison_the_momentum():
    """The finiteness mask is that of the gradient the step uses (after clipping): a NaN
    clip for one step is a skipped step, and the run goes on after it."""
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2, clipnorm=1.0)
    train_steps(model, opt, 0, 1)
    opt.param_groups[0]["clipnorm"] = torch.tensor(float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_steps(model, opt, 1, 1)
    opt.param_groups[0]["clipnorm"] = 1.0
    before = [p.detach().clone() for p in model.parameters()]
    train_steps(model, opt, 2, 3)
    for p, b in zip(model.parameters(), before):
        assert torch.isfinite(opt.state[p]["momentum_buffer"]).all()
        assert not torch.equal(p, b)


def test_the_momentum_bias_correction_is_exact_to_float64():
    """float64 parameters and factors: 1 − b1^t in float64 (in float32 it was 1.5e-8 off at
    t = 1). With a constant gradient and P = I the step is lr·g (float64 formula)."""
    g = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)
    weight = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    lr = 1e-3
    opt = Kron([weight], lr=lr, b1=0.9, precond_dtype=torch.float64, preconditioner_update_probability=0.0)
    for _ in range(20):
        before = weight.detach().clone()
        weight.grad = g.clone()
        opt.step()
        torch.testing.assert_close((before - weight.detach()) / lr, g, rtol=1e-12, atol=0)


def test_one_cycle_lr_needs_cycle_momentum_false():
    """As docs/API.md says: Kron has no ``momentum`` or ``betas``, so OneCycleLR's default
    cycle_momentum=True raises; with cycle_momentum=False it schedules the lr."""
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="momentum or beta1"):
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10, cycle_momentum=False)
    train_steps(model, opt, 0, 1)
    scheduler.step()
    assert opt.param_groups[0]["lr"] != pytest.approx(0.1 / 25)


@pytest.mark.parametrize("group,setting", [(0, dict(momentum_into_precond_update="no")), (1, dict(lr=-1.0)),
                                           (1, dict(b1=1.0)), (0, dict(precond_dtype=torch.int32)),
                                           (1, dict(memory_save_mode="x"))])
def test_a_checkpoint_with_a_bad_group_setting_raises_value_error_naming_the_group(group, setting):
    model = mlp()
    opt = Kron([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}], lr=1e-2)
    train_steps(model, opt, 0, 2)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][group].update(setting)
    before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    assert_load_refused_and_unchanged(opt, saved, f"param group {group}.*{next(iter(setting))}")
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_a_seed_outside_what_torch_manual_seed_takes_is_refused(seed):
    with pytest.raises(ValueError):
        torch.manual_seed(seed)  # the range this follows
    with pytest.raises(ValueError, match="seed"):
        Kron(mlp().parameters(), seed=seed)


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 2**63])
def test_a_seed_torch_manual_seed_takes_is_accepted(seed):
    torch.manual_seed(seed)
    model = mlp()
    train_steps(model, Kron(model.parameters(), seed=seed), 0, 1)


def test_state_dict_post_hooks_see_the_whole_state_dict():
    model = mlp()
    opt = Kron(model.parameters(), lr=1e-2)
    train_steps(model, opt, 0, 1)
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(sorted(sd)))

    def replace(o, sd):
        return {**sd, "extra": 1}

    opt.register_state_dict_post_hook(replace)
    sd = opt.state_dict()
    assert seen == ["pre", ["kron", "param_groups", "state"]]
    assert sorted(sd) == ["extra", "kron", "param_groups", "state"]  # what a hook returns is returned


def test_a_bad_tensor_setting_on_the_first_step_leaves_the_deferred_scale_unestimated():
    """precond_init_scale=None estimates the scale from the first usable gradient: a step that
    a bad tensor setting skips is not one, so the run then equals one without that step."""
    runs = []
    for skipped in (False, True):
        model = mlp()
        # no Q updates: their probes are drawn by step number, which the skipped step advanced
        opt = Kron(model.parameters(), lr=1e-2, precond_init_scale=None, preconditioner_update_probability=0.0)
        if skipped:
            opt.param_groups[0]["lr"] = torch.tensor(float("nan"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                train_steps(model, opt, 0, 1)
            assert not any(opt.state[p]["q_initialized"] for p in model.parameters())
            opt.param_groups[0]["lr"] = 1e-2
        train_steps(model, opt, 0, 3)
        runs.append([*model.parameters(), *(q for p in model.parameters() for q in opt.state[p]["Q"])])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("probability", [0.5, None])
def test_a_step_with_no_gradient_at_all_is_no_step(probability):
    """A trainer that skips a batch (Lightning's training_step returning None) still calls
    ``step()``, with every ``.grad`` None: as for torch.optim's optimizers, that is no step. The
    run goes on bitwise as a hand loop that skipped the batch (schedule, probes, step count)."""
    kw = {} if probability is None else {"preconditioner_update_probability": probability}
    runs = []
    for empty_step in (False, True):
        model = mlp()
        opt = Kron(model.parameters(), lr=1e-2, **kw)
        train_steps(model, opt, 0, 2)
        if empty_step:
            opt.zero_grad(set_to_none=True)
            opt.step()
        train_steps(model, opt, 2, 4)
        runs.append((model, opt))
    (reference, ref_opt), (model, opt) = runs
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt.steps == ref_opt.steps == 6


def test_a_state_dict_with_the_factors_as_lists_loads_as_the_one_with_them_by_position():
    """Files written before the factors were saved as a dict by position hold them as lists:
    they load, and the run goes on as from the new form."""
    runs = []
    for as_lists in (False, True):
        model, batches = _dcp_model_and_batches()
        opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.5, precond_update="procrustes")
        _dcp_train(model, opt, batches[:4])
        saved = copy.deepcopy(opt.state_dict())
        assert all(isinstance(entry["Q"], dict) for entry in saved["state"].values())
        if as_lists:
            for entry in saved["state"].values():
                for key in ("Q", "lipschitz"):
                    entry[key] = [entry[key][str(i)] for i in range(len(entry[key]))]
        resumed, _ = _dcp_model_and_batches()
        resumed.load_state_dict(model.state_dict())
        fresh = Kron(resumed.parameters(), lr=1e-2, preconditioner_update_probability=0.5,
                     precond_update="procrustes")
        fresh.load_state_dict(saved)
        _dcp_train(resumed, fresh, batches[4:])
        runs.append([p.detach().clone() for p in resumed.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [{"0": "x"}, {"1": None}, {"a": None}, {}], ids=["not-tensor", "gap", "name", "empty"])
def test_factors_by_position_that_are_not_positions_0_to_n_are_refused(bad):
    model, batches = _dcp_model_and_batches()
    opt = Kron(model.parameters(), lr=1e-2)
    _dcp_train(model, opt, batches[:2])
    saved = copy.deepcopy(opt.state_dict())
    first = next(iter(saved["state"].values()))
    q0 = first["Q"]["0"]
    first["Q"] = {k: (q0 if v is None else v) for k, v in bad.items()}
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="Q"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    for x, y in zip(after["state"].values(), before["state"].values()):
        for q, r in zip(x["Q"].values(), y["Q"].values()):
            assert torch.equal(q, r)


def test_a_run_resumed_through_torchtitans_flat_state_dict_goes_on_as_the_uninterrupted_one():
    """torchtitan's checkpointer flattens an optimizer's state by the keys of its live entries
    and creates a fresh one's state with a step of its own before loading: the factors and the
    schedule's counters come back, and the run is bitwise the uninterrupted one."""
    utils = pytest.importorskip("torchtitan.components.optimizer.utils",
                                reason="torchtitan is an optional extra ([torchtitan])")
    settings = dict(lr=1e-2, precond_dtype=torch.float64, preconditioner_update_probability=0.5,
                    precond_update="procrustes")
    reference, batches = _dcp_model_and_batches()
    _dcp_train(reference, Kron(reference.named_parameters(), **settings), batches)
    model, _ = _dcp_model_and_batches()
    opt = Kron(model.named_parameters(), **settings)
    _dcp_train(model, opt, batches[:5])
    flat = utils.get_flat_optim_state_dict(opt)
    resumed, _ = _dcp_model_and_batches()
    resumed.load_state_dict(model.state_dict())
    fresh = Kron(resumed.named_parameters(), **settings)
    utils.init_optim_state(fresh)
    utils.load_flat_optim_state_dict(fresh, flat)
    assert fresh.state_dict()["kron"] == opt.state_dict()["kron"]
    _dcp_train(resumed, fresh, batches[5:])
    for mine, theirs in zip(resumed.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["rewind", "from_another", "from_a_state_dict"])
def test_a_live_entry_put_back_by_hand_keeps_the_optimizers_schedule(how):
    """Writing one parameter's live entry back by hand (a copy saved earlier, or another
    optimizer's) resets that parameter's state only: the update schedule is the optimizer's
    and goes on. (Entries in a checkpoint's form, which ZeroRedundancyOptimizer's load writes
    in, carry the saved schedule instead.)"""
    model, batches = _dcp_model_and_batches()
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
    weight = next(model.parameters())
    if how == "rewind":
        _dcp_train(model, opt, batches[:3])
        saved = copy.deepcopy(opt.state[weight])
        _dcp_train(model, opt, batches[3:9])
    elif how == "from_a_state_dict":  # the checkpoint's form: the factors by position
        _dcp_train(model, opt, batches[:3])
        saved = copy.deepcopy(opt.state_dict())["state"][0]
        _dcp_train(model, opt, batches[3:9])
    else:
        other_model, _ = _dcp_model_and_batches()
        other = Kron(other_model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
        _dcp_train(other_model, other, batches[:9])
        saved = copy.deepcopy(other.state[next(other_model.parameters())])
        _dcp_train(model, opt, batches[:2])
    before = opt.state_dict()["kron"]
    opt.state[weight] = saved
    _dcp_train(model, opt, batches[9:10])
    after = opt.state_dict()["kron"]
    assert after["decider"]["step"] == before["decider"]["step"] + 1
    assert after["q_updates"] in (before["q_updates"], before["q_updates"] + 1)


def test_every_entry_written_in_a_checkpoints_form_brings_the_largest_saved_schedule():
    """As ZeroRedundancyOptimizer's load writes a partition's entries in: their counters are the
    saved schedule. Entries of a partition whose parameters had no gradient on some steps
    (not counted there) differ; the largest step is taken, not refused (a refusal on one rank
    would leave the others waiting in ZeRO's broadcast)."""
    model, batches = _dcp_model_and_batches()
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
    _dcp_train(model, opt, batches[:4])
    saved = copy.deepcopy(opt.state_dict())
    entries = list(saved["state"].values())
    entries[0]["kron_schedule"] = torch.tensor([2.0, 0.0, 1.0], dtype=torch.float64)  # behind the others
    fresh_model, _ = _dcp_model_and_batches()
    fresh = Kron(fresh_model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
    for p, entry in zip(fresh_model.parameters(), entries):
        fresh.state[p] = entry
    _dcp_train(fresh_model, fresh, batches[4:5])
    assert fresh.steps == opt.steps + 1 == 5
    assert all(entry["kron_schedule"] is fresh._schedule for entry in fresh.state.values())


def test_an_entry_written_in_without_the_counters_gets_the_key_back():
    """A flattened checkpoint keeps the counters only under a key every live entry holds."""
    model, batches = _dcp_model_and_batches()
    opt = Kron(model.parameters(), lr=1e-2)
    _dcp_train(model, opt, batches[:2])
    weight = next(model.parameters())
    entry = copy.deepcopy(opt.state[weight])
    del entry["kron_schedule"]
    opt.state[weight] = entry
    _dcp_train(model, opt, batches[2:3])
    assert opt.state[weight]["kron_schedule"] is opt._schedule and opt.steps == 3


def test_counters_written_in_that_are_not_a_schedules_are_said_and_not_raised_on():
    """Each ZeRO rank reads only its own partition's entries: a raise on one rank would leave
    the others waiting in ZeRO's broadcast. Entries whose counters are not finite are left
    out; with none usable, this optimizer's own schedule goes on, said in a warning."""
    model, batches = _dcp_model_and_batches()
    opt = Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
    _dcp_train(model, opt, batches[:4])
    entries = list(copy.deepcopy(opt.state_dict())["state"].values())
    for entry in entries:
        entry["kron_schedule"] = torch.tensor([float("nan"), 0.0, 1.0], dtype=torch.float64)
    fresh_model, _ = _dcp_model_and_batches()
    fresh = Kron(fresh_model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
    _dcp_train(fresh_model, fresh, batches[:2])
    for p, entry in zip(fresh_model.parameters(), entries):
        fresh.state[p] = entry
    with pytest.warns(RuntimeWarning, match="not a schedule's"):
        _dcp_train(fresh_model, fresh, batches[2:3])
    assert fresh.steps == 3
    entries[0]["kron_schedule"] = torch.tensor([3.0, 0.0, 2.0], dtype=torch.float64)  # one usable
    for p, entry in zip(fresh_model.parameters(), entries):
        fresh.state[p] = entry
    _dcp_train(fresh_model, fresh, batches[3:4])
    assert fresh.steps == 4


def test_an_entry_read_before_its_parameters_first_step_stays_empty_until_then():
    """torch.optim's state is a defaultdict: reading ``opt.state[p]`` for a parameter without
    state makes an empty entry, which its first step must still fill."""
    model, batches = _dcp_model_and_batches()
    opt = Kron(model.parameters(), lr=1e-2)
    weight = next(model.parameters())
    assert len(opt.state[weight]) == 0  # made by the read
    _dcp_train(model, opt, batches[:2])
    assert "Q" in opt.state[weight] and opt.steps == 2
    fresh_model, _ = _dcp_model_and_batches()
    fresh = Kron(fresh_model.parameters(), lr=1e-2)
    _dcp_train(fresh_model, fresh, batches[:1])
    entries = {p: copy.deepcopy(fresh.state_dict())["state"][i] for i, p in enumerate(fresh_model.parameters())}
    late = list(fresh_model.parameters())[-1]
    fresh.state.clear()
    for p, entry in entries.items():
        if p is not late:
            fresh.state[p] = entry  # a partition's entries written in, one parameter without any
    assert len(fresh.state[late]) == 0
    _dcp_train(fresh_model, fresh, batches[1:2])
    assert "Q" in fresh.state[late] and fresh.steps == 2
