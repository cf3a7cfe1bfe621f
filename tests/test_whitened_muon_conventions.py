"""WhitenedMuon under torch.optim's conventions: param groups added later, checkpoints that do
not fit, copies, and an optimizer the caller drops."""
from __future__ import annotations

import copy
import gc
import pickle
import warnings
import weakref
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn as nn

from kron_precond import WhitenedMuon


def mlp(hidden: int = 16, output_bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4, bias=output_bias))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(32, 8, generator=g)).square().mean().backward()
        opt.step()


def snapshot(opt: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(opt.state_dict())


def assert_same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        sa, sb = a["state"][key], b["state"][key]
        assert sa.keys() == sb.keys(), key
        for name in sa:
            if torch.is_tensor(sa[name]):
                assert torch.equal(sa[name], sb[name]), (key, name)
            else:
                assert sa[name] == sb[name], (key, name)


# -- add_param_group ------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["generator", "list", "named"])
def test_an_added_adamw_group_of_the_list_form_steps_its_parameters(form):
    """A head added later in any form torch.optim accepts (a generator too) is stepped as
    AdamW bitwise, next to the whitened weights."""
    body, head = mlp(), nn.Linear(4, 3)
    opt = WhitenedMuon([body[0], body[2]], lr=1e-2)
    params = {"generator": head.parameters(), "list": list(head.parameters()),
              "named": list(head.named_parameters())}[form]
    opt.add_param_group({"params": params, "algorithm": "adamw"})
    twin = copy.deepcopy(head)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    assert len(opt.param_groups[-1]["params"]) == 2
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(16, 8, generator=g)
        for module, optimizer in ((head, opt), (twin, reference)):
            optimizer.zero_grad()
            module(body(x).detach()).square().mean().backward()
            optimizer.step()
    for a, b in zip(head.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_adamw_groups_are_torchs_adamw_bitwise_in_half_precision_too(dtype):
    """bfloat16 and float16 parameters as float32 ones: the decays (``beta2``, ``1 - lr·wd``)
    multiply as torch.optim.AdamW's single-tensor step multiplies them, in float32 with the
    product rounded once, not with the factor first rounded to the parameter's dtype
    (bfloat16(0.99) is 0.98828125)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(dtype)
    opt = WhitenedMuon(model, lr=1e-2, weight_decay=0.1, adamw_betas=(0.9, 0.99))
    ours = [p for group in opt.param_groups if group["algorithm"] == "adamw" for p in group["params"]]
    twins = [nn.Parameter(p.detach().clone()) for p in ours]
    reference = torch.optim.AdamW(twins, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        opt.zero_grad()
        model(torch.randn(32, 8, generator=g).to(dtype)).float().square().mean().backward()
        for p, twin in zip(ours, twins):
            twin.grad = p.grad.clone()
        opt.step()
        reference.step()
    for p, twin in zip(ours, twins):
        assert torch.equal(opt.state[p]["exp_avg_sq"], reference.state[twin]["exp_avg_sq"])
        assert torch.equal(p, twin)


@pytest.mark.parametrize("form", ["generator", "list"])
def test_an_unnamed_group_added_to_the_model_form_gets_names_and_steps(form):
    """The model form keeps parameter names (for FQN checkpoints); an unnamed group added later
    is named the same way instead of tripping torch.optim's names-or-none rule."""
    model = nn.Sequential(mlp(), nn.Linear(4, 3))
    model[1].requires_grad_(False)  # frozen at construction, unfrozen later
    opt = WhitenedMuon(model, lr=1e-2)
    model[1].requires_grad_(True)
    params = model[1].parameters() if form == "generator" else list(model[1].parameters())
    opt.add_param_group({"params": params, "algorithm": "adamw"})
    assert opt.param_groups[-1]["param_names"] == ["1.weight", "1.bias"]
    before = [p.clone() for p in model[1].parameters()]
    train(model, opt, 2)
    assert all(not torch.equal(a, b) for a, b in zip(before, model[1].parameters()))
    assert "param_names" in opt.state_dict()["param_groups"][-1]


def test_a_group_added_without_an_algorithm_that_holds_no_whitened_weight_is_adamw():
    """Callbacks that unfreeze a backbone (Lightning's ``BackboneFinetuning``) call
    ``add_param_group({"params": ..., "lr": ...})``: weights found at construction frozen have
    no hooks, so the group steps as AdamW (said once), bitwise ``torch.optim.AdamW``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model[0].requires_grad_(False)  # the backbone, frozen at construction
    opt = WhitenedMuon(model, lr=1e-2)
    model[0].requires_grad_(True)
    twin = copy.deepcopy(model[0])
    with pytest.warns(UserWarning, match=r"0\.weight.*AdamW"):
        opt.add_param_group({"params": model[0].parameters(), "lr": 1e-3})
    assert opt.param_groups[-1]["algorithm"] == "adamw"
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=0.0, foreach=False)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        reference.zero_grad()
        model(x).square().mean().backward()
        for a, b in zip(model[0].parameters(), twin.parameters()):
            b.grad = a.grad.clone()
        opt.step()
        reference.step()
    for a, b in zip(model[0].parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_a_whitened_group_of_weights_it_cannot_whiten_is_refused_naming_them_and_the_way_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model[0].requires_grad_(False)
    opt = WhitenedMuon(model, lr=1e-2)
    with pytest.raises(ValueError, match=r"0\.weight.*'algorithm': 'adamw'"):
        opt.add_param_group({"params": model[0].parameters(), "algorithm": "whitened_muon"})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("given", ["parameters", "named_parameters", "groups"])
def test_parameters_in_place_of_the_model_are_refused_saying_to_pass_the_model(given):
    """``WhitenedMuon`` places hooks on modules: parameters (or torch.optim's param-group dicts,
    which the Hugging Face Trainer builds for ``optimizer_cls_and_kwargs``) cannot be whitened."""
    model = mlp()
    params = {"parameters": model.parameters(), "named_parameters": model.named_parameters(),
              "groups": [{"params": list(model.parameters())}]}[given]
    with pytest.raises(TypeError, match=r"WhitenedMuon\(model"):
        WhitenedMuon(params, lr=1e-2)


def test_a_whitened_group_given_as_a_generator_is_added_whole():
    body = mlp()
    opt = WhitenedMuon([body[0], body[2]], lr=1e-2)
    del opt.param_groups[0]["params"][1]  # body[2].weight, to add it back as a group of its own
    opt.add_param_group({"params": (p for p in [body[2].weight]), "lr": 5e-3})
    assert opt.param_groups[-1]["params"] == [body[2].weight]
    before = body[2].weight.clone()
    train(body, opt, 1)
    assert not torch.equal(before, body[2].weight)


# -- load_state_dict -------------------------------------------------------------------------
def test_a_checkpoint_of_another_model_raises_and_changes_nothing():
    """Same number of parameters per group, other widths: refused before anything moves,
    naming the parameter (torch.optim's load would take it and fail at the next step)."""
    a, b = mlp(16), mlp(12)
    opt_a, opt_b = WhitenedMuon(a, lr=1e-2), WhitenedMuon(b, lr=1e-2)
    train(a, opt_a, 6)
    train(b, opt_b, 6)
    before = snapshot(opt_a)
    with pytest.raises(ValueError, match=r"0\.weight.*shape"):
        opt_a.load_state_dict(opt_b.state_dict())
    assert_same_state(before, opt_a.state_dict())
    train(a, opt_a, 1)  # still steps


@pytest.mark.parametrize("key, bad", [("momentum_buffer", torch.zeros(3, 3)),
                                      ("input_factor", torch.zeros(1, 1, 5, 5)),
                                      ("input_whitener", None),  # filled with NaN below
                                      ("exp_avg", torch.zeros(5))])
def test_a_corrupted_checkpoint_raises_and_changes_nothing(key, bad):
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2)
    train(model, opt, 6)
    saved = snapshot(opt)
    index = 2 if key == "exp_avg" else 0  # the first bias is AdamW's (state index 2)
    if bad is None:
        bad = torch.full_like(saved["state"][index][key], float("nan"))
    saved["state"][index][key] = bad
    before = snapshot(opt)
    with pytest.raises(ValueError, match=key):
        opt.load_state_dict(saved)
    assert_same_state(before, opt.state_dict())


HEAD_ONLY = (0, 1, 4, 5)  # steps on which only the AdamW parameters have a gradient


def _with_head_only_steps(total: int, resume_at: int | None = None, dcp_dir=None) -> list[torch.Tensor]:
    """A run whose whitened weight has no gradient on the steps in ``HEAD_ONLY`` (the AdamW
    biases and the skipped last layer train on every step); optionally saved before step
    ``resume_at`` and resumed into a fresh optimizer, through ``state_dict`` or, with
    ``dcp_dir``, torch.distributed.checkpoint (its recipe: the fresh optimizer's template
    taken with the gradients None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = mlp()
    make = lambda: WhitenedMuon(model, lr=1e-2, statistics_every=3, skip_layers=["2"])  # noqa: E731
    opt = make()
    g = torch.Generator().manual_seed(1)
    for step in range(total):
        if step == resume_at:
            if dcp_dir is None:
                saved = copy.deepcopy(opt.state_dict())
                opt.remove()
                opt = make()
                opt.load_state_dict(saved)
            else:
                dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=dcp_dir / str(step))
                opt.remove()
                opt = make()
                opt.zero_grad(set_to_none=True)
                state = {"optim": get_optimizer_state_dict(model, opt)}
                dcp.load(state, checkpoint_id=dcp_dir / str(step))
                set_optimizer_state_dict(model, opt, optim_state_dict=state["optim"])
        opt.zero_grad()
        model(torch.randn(32, 8, generator=g)).square().mean().backward()
        if step in HEAD_ONLY:
            model[0].weight.grad = None
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_resume_at_any_step_around_head_only_phases_continues_the_uninterrupted_run_bitwise():
    """The statistics schedule counts every step() call, also those on which no whitened weight
    had a gradient: a checkpoint saved at any step -- in a head-only phase at the start, before
    the whitened weight has any state, or after one later on -- resumes the uninterrupted run."""
    expected = _with_head_only_steps(10)
    for at in range(1, 10):
        for got, want in zip(_with_head_only_steps(10, resume_at=at), expected):
            assert torch.equal(got, want), at


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch's DCP in one process without a process group
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_dcp_resume_around_head_only_phases_continues_the_uninterrupted_run_bitwise(tmp_path):
    """The same through torch.distributed.checkpoint, which keeps only "state" and "param_groups"
    and loads into a fresh optimizer's template."""
    expected = _with_head_only_steps(10)
    # also before the weight has stepped or has factors: the fresh template holds every entry
    # (DCP refuses a checkpoint without a key of the template)
    for at in range(1, 10):
        for got, want in zip(_with_head_only_steps(10, resume_at=at, dcp_dir=tmp_path), expected):
            assert torch.equal(got, want), at


class _LateBranch(nn.Module):
    """A block the forward takes only from step ``LATE`` on: until then its weight and bias
    (which train) have no gradient and no state."""

    LATE = 3

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x, step):
        h = torch.tanh(self.a(x))
        return self.head(torch.tanh(self.b(h)) if step >= self.LATE else h)


def _late_branch_run(total: int, resume_at: int | None, dcp_dir) -> list[torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _LateBranch()
    make = lambda: WhitenedMuon(model, lr=1e-2, statistics_every=2)  # noqa: E731
    opt = make()
    g = torch.Generator().manual_seed(1)
    for step in range(total):
        if step == resume_at:
            dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=dcp_dir / str(step))
            opt.remove()
            opt = make()
            state = {"optim": get_optimizer_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=dcp_dir / str(step))
            set_optimizer_state_dict(model, opt, optim_state_dict=state["optim"])
        opt.zero_grad()
        model(torch.randn(16, 8, generator=g), step).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_dcp_resume_before_a_branchs_first_gradient_continues_the_uninterrupted_run_bitwise(tmp_path):
    """Saved while a block that trains has had no gradient yet (its first one on a step that is
    not a statistics step), the checkpoint still holds every entry of the fresh template DCP
    loads into -- before, DCP refused it ("Missing key"), and a partial load took the template's
    values (its AdamW count at 1) and drifted -- and the resumed run is the uninterrupted one."""
    expected = _late_branch_run(7, None, tmp_path)
    for at in range(1, 7):
        for got, want in zip(_late_branch_run(7, at, tmp_path), expected):
            assert torch.equal(got, want), at


def test_a_whitened_weights_saved_step_is_the_optimizers_count():
    """Saved, a whitened weight's step is the optimizer's step() count (the running optimizer
    keeps the count when it last stepped); while none has stepped, the first one's entry holds
    it with the zero momentum its first step starts from, and every entry a fresh state has
    (as DCP's template does). The format keeps its keys, and a
    state-dict post-hook sees the state dict as saved."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2, skip_layers=["2"])
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        model[0].weight.grad = None  # head-only: the whitened weight takes no step
        opt.step()
        seen: list[int] = []
        handle = opt.register_state_dict_post_hook(lambda optimizer, sd, seen=seen: seen.append(sd["state"][0]["step"]))
        saved = opt.state_dict()
        handle.remove()
        assert model[0].weight not in opt.state and seen == [step + 1]
        entry = saved["state"][0]  # the whitened weight, first in the first group
        assert entry["step"] == step + 1 and entry.keys() == {"step", "momentum_buffer", "nonfinite_steps",
                                                              "input_factor", "input_seen", "input_whitener"}
        assert not entry["momentum_buffer"].any() and entry["nonfinite_steps"] == 0
        # no refresh has measured the input side: as a refresh without rows leaves it
        assert not entry["input_seen"].any() and not entry["input_factor"].any()
        assert torch.equal(entry["input_whitener"], torch.eye(8).expand_as(entry["input_whitener"]))
    train(model, opt, 1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        model[0].weight.grad = None
        opt.step()
    assert opt.state[model[0].weight]["step"] == 4 and opt.state_dict()["state"][0]["step"] == 6
    assert opt.state[model[0].weight]["step"] == 4


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_dcp_template_taken_after_a_backward_loads_the_state(tmp_path):
    """torch's get_optimizer_state_dict skips its initialising step while a parameter has a
    gradient (its own optimizers' templates are then empty, and DCP loads nothing into them):
    the state dict holds every entry anyway, so the template is whole and the state loads,
    taken after a backward or with the gradients None, and the runs go on alike."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2)
    train(model, opt, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP in one process without a process group
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=tmp_path)
    saved = opt.state_dict()
    for backward_first in (True, False):
        fresh_opt = WhitenedMuon(model, lr=1e-2)
        model(torch.randn(4, 8)).square().mean().backward()
        if not backward_first:
            fresh_opt.zero_grad(set_to_none=True)
        state = {"optim": get_optimizer_state_dict(model, fresh_opt)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=tmp_path)
        set_optimizer_state_dict(model, fresh_opt, optim_state_dict=state["optim"])
        assert fresh_opt._steps == 2 and len(fresh_opt.state) == len(opt.state), backward_first
        assert_same_state(saved, fresh_opt.state_dict())
        fresh_opt.remove()
        model.zero_grad(set_to_none=True)


def test_a_load_creates_no_empty_entries_and_unstepped_parameters_load_as_fresh():
    """An empty state entry makes the state look initialised: a load adds none. A checkpoint
    holds an entry for every parameter (the template DCP loads into does); those of a parameter
    that has not stepped load as what its first step starts from: an AdamW parameter without
    state, a whitened weight with a zero momentum and no factors (refreshed at its first
    statistics step as in the saved run)."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2)
    opt.load_state_dict(WhitenedMuon(mlp(), lr=1e-2).state_dict())
    whitened = {model[0].weight, model[2].weight}
    assert set(opt.state) == whitened
    trained = mlp()
    trained_opt = WhitenedMuon(trained, lr=1e-2)
    trained.zero_grad()
    trained(torch.randn(4, 8)).square().mean().backward()
    trained[0].weight.grad = None  # the first whitened weight takes no step
    trained_opt.step()
    saved = trained_opt.state_dict()
    assert len(saved["state"]) == 4  # every parameter's
    opt.load_state_dict(saved)
    assert len(opt.state) == 4 and all(opt.state.values())
    unstepped = opt.state[model[0].weight]
    assert unstepped.keys() == {"step", "momentum_buffer", "nonfinite_steps"} and not unstepped["momentum_buffer"].any()
    assert opt.state[model[2].weight]["input_seen"].all()


def test_a_rollback_into_the_same_optimizer_drops_the_statistics_of_the_discarded_batch():
    """Loss-spike recovery: forward and backward on a statistics step, then the last checkpoint
    loaded into the same optimizer instead of stepping. The discarded batch's statistics must not
    reach the next refresh: the run goes on as if the batch had never been seen."""
    def run(rollback_at: int | None) -> list[torch.Tensor]:
        model = mlp()
        opt = WhitenedMuon(model, lr=1e-2, statistics_every=3)
        g = torch.Generator().manual_seed(1)
        for step in range(8):
            if step == rollback_at:
                saved = copy.deepcopy(opt.state_dict())
                weights = copy.deepcopy(model.state_dict())
                opt.zero_grad()
                model(torch.randn(32, 8) * 50).square().mean().backward()  # a batch that is thrown away
                model.load_state_dict(weights)
                opt.load_state_dict(saved)
            opt.zero_grad()
            model(torch.randn(32, 8, generator=g)).square().mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    expected = run(None)
    for at in (3, 6):  # statistics steps
        for got, want in zip(run(at), expected):
            assert torch.equal(got, want), at


def _drop(key):
    return lambda entry: entry.pop(key)


@pytest.mark.parametrize("index, corrupt, match", [
    (0, _drop("input_seen"), "without.*input_seen"),
    (0, _drop("input_whitener"), "without.*input_whitener"),
    (0, _drop("momentum_buffer"), "without.*momentum_buffer"),
    (0, _drop("step"), "without.*step"),
    (2, _drop("exp_avg_sq"), "without.*exp_avg_sq"),  # the first bias: AdamW's
    (0, lambda e: e.__setitem__("input_whitener", e["input_whitener"].long()), "input_whitener.*floating"),
    (0, lambda e: e["input_seen"].fill_(5), "input_seen.*0 or 1"),
    (0, lambda e: e["nonfinite_steps"].fill_(-3), "nonfinite_steps.*>= 0"),
    (0, lambda e: e.__setitem__("nonfinite_steps", e["nonfinite_steps"].float()), "nonfinite_steps.*integer"),
    (0, lambda e: e.__setitem__("step", -4), "step"),
    (0, lambda e: e.__setitem__("step", torch.tensor(3.7)), "step"),
    (0, lambda e: e.__setitem__("momentum_buffer", 0.0), "momentum_buffer.*tensor"),
])
def test_a_checkpoint_missing_or_mistyping_an_entry_raises_and_changes_nothing(index, corrupt, match):
    """Entries that a step needs together, counts that must be whole numbers >= 0, tensors that
    must be floating: refused with ValueError naming them, before anything changes (torch.optim's
    load would take them and the next step would raise or step wrongly)."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2)
    train(model, opt, 6)
    saved = snapshot(opt)
    corrupt(saved["state"][index])
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    assert_same_state(before, opt.state_dict())
    train(model, opt, 1)


def test_a_saved_group_without_a_setting_takes_this_optimizers_value():
    """As torch.optim fills the settings an older optimizer did not have: the group steps."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2, momentum=0.8)
    train(model, opt, 3)
    saved = snapshot(opt)
    betas = opt.param_groups[1]["betas"]
    del saved["param_groups"][0]["momentum"], saved["param_groups"][1]["betas"]
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["momentum"] == 0.8 and opt.param_groups[1]["betas"] == betas
    train(model, opt, 1)


def test_load_hooks_run_in_torch_optims_order():
    """A pre-hook adapts the checkpoint before it is checked (here: drops a group this optimizer
    does not have, and halves a factor, which is loaded as the hook left it); a post-hook sees
    the load whole (the saved factors' exact values, the schedule's clock)."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2, statistics_every=3)
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "algorithm": "adamw"})
    train(model, opt, 4)
    saved = snapshot(opt)
    fresh = WhitenedMuon(model, lr=1e-2, statistics_every=3)

    def adapt(optimizer, state_dict):
        state_dict["param_groups"] = state_dict["param_groups"][:-1]
        state_dict["state"][0]["input_factor"] = state_dict["state"][0]["input_factor"] * 0.5
        return state_dict

    seen = {}

    def after(optimizer):
        seen["factor"] = optimizer.state[model[0].weight]["input_factor"].clone()
        seen["clock"] = optimizer._steps

    fresh.register_load_state_dict_pre_hook(adapt)
    fresh.register_load_state_dict_post_hook(after)
    fresh.load_state_dict(copy.deepcopy(saved))
    want = saved["state"][0]["input_factor"] * 0.5
    assert torch.equal(fresh.state[model[0].weight]["input_factor"], want)
    assert torch.equal(seen["factor"], want) and seen["clock"] == 4


def test_a_checkpoint_loads_into_an_optimizer_of_a_model_on_the_meta_device():
    """As torch.optim's load: the state goes to the parameters' device, the meta device too (a
    model built there before its weights are materialized); nothing is read back from it."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2)
    train(model, opt, 2)
    with torch.device("meta"):
        meta_model = mlp()
    meta_opt = WhitenedMuon(meta_model, lr=1e-2)
    meta_opt.load_state_dict(snapshot(opt))
    assert len(meta_opt.state) == len(opt.state)
    for p, q in zip(model.parameters(), meta_model.parameters()):
        assert meta_opt.state[q].keys() == opt.state[p].keys()
        for key, value in meta_opt.state[q].items():
            if torch.is_tensor(value) and key != "step":
                assert value.device.type == "meta" and value.shape == opt.state[p][key].shape, key


def test_a_checkpoint_of_another_block_size_raises_and_changes_nothing():
    model = mlp(16)
    opt = WhitenedMuon(model, lr=1e-2, block_size=8)
    train(model, opt, 6)
    other = WhitenedMuon(model, lr=1e-2)
    other.remove()
    before = snapshot(other)
    with pytest.raises(ValueError, match="input_factor"):
        other.load_state_dict(opt.state_dict())
    assert_same_state(before, other.state_dict())


def test_the_output_side_of_a_checkpoint_is_dropped_by_an_optimizer_without_it():
    """Saved with output_side=True, resumed without: the output factor and whitener are not
    loaded, so the run steps as an input-side-only run from the checkpoint's input state
    (bitwise the same as resuming from a checkpoint without them)."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2, output_side=True)
    train(model, opt, 6)
    saved = snapshot(opt)
    stripped = copy.deepcopy(saved)
    for state in stripped["state"].values():
        for key in [k for k in state if k.startswith("output_")]:
            del state[key]
    runs = []
    for checkpoint in (saved, stripped):
        twin = copy.deepcopy(model)
        resumed = WhitenedMuon(twin, lr=1e-2)
        resumed.load_state_dict(checkpoint)
        assert not any(k.startswith("output_") for s in resumed.state.values() for k in s)
        train(twin, resumed, 7, seed=5)
        runs.append([p.detach().clone() for p in twin.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_wide_output_side_loads_the_output_side_of_the_wide_weight_alone():
    """Saved with output_side=True, resumed with ``"wide"``: the first layer ``[16, 8]`` keeps
    its saved output factor and whitener, the last ``[4, 16]`` drops them, so the run steps
    bitwise as one resumed from a checkpoint holding the wide weight's output side alone."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2, output_side=True)
    train(model, opt, 6)
    saved = snapshot(opt)
    wide_only = copy.deepcopy(saved)
    narrow = wide_only["state"][1]  # model[2].weight (the whitened group's second): its output is narrower
    assert "output_factor" in narrow and narrow["momentum_buffer"].shape == (4, 16)
    for key in [k for k in narrow if k.startswith("output_")]:
        del narrow[key]
    runs = []
    for checkpoint in (saved, wide_only):
        twin = copy.deepcopy(model)
        resumed = WhitenedMuon(twin, lr=1e-2, output_side="wide")
        resumed.load_state_dict(checkpoint)
        assert torch.equal(resumed.state[twin[0].weight]["output_factor"], saved["state"][0]["output_factor"])
        assert not any(k.startswith("output_") for k in resumed.state[twin[2].weight])
        train(twin, resumed, 7, seed=5)
        runs.append([p.detach().clone() for p in twin.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_checkpoint_without_an_output_side_resumes_under_the_default_auto():
    """A checkpoint of ``output_side=False`` on an ungated MLP ``[16, 8]``, GELU, ``[8, 16]``
    loads into the default ``"auto"``, which whitens the first layer's output side: the input
    side and momentum come back as saved, the output side starts at the next statistics step
    from that step's rows alone, as a fresh optimizer's first factor does on the same weights
    and batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    opt = WhitenedMuon(model, lr=1e-2, output_side=False, statistics_every=1)
    train(model, opt, 6)
    saved = snapshot(opt)
    resumed_model, fresh_model = copy.deepcopy(model), copy.deepcopy(model)
    resumed = WhitenedMuon(resumed_model, lr=1e-2, statistics_every=1)
    assert resumed.output_side == "auto"
    resumed.load_state_dict(saved)
    state = resumed.state[resumed_model[0].weight]
    assert torch.equal(state["input_factor"], saved["state"][0]["input_factor"])
    assert torch.equal(state["momentum_buffer"], saved["state"][0]["momentum_buffer"])
    assert not any(k.startswith("output_") for k in state)
    fresh = WhitenedMuon(fresh_model, lr=1e-2, statistics_every=1)
    train(resumed_model, resumed, 1, seed=5)
    train(fresh_model, fresh, 1, seed=5)
    assert torch.equal(resumed.state[resumed_model[0].weight]["output_factor"],
                       fresh.state[fresh_model[0].weight]["output_factor"])
    assert not any(k.startswith("output_") for k in resumed.state[resumed_model[2].weight])


def test_a_reload_on_bfloat16_parameters_keeps_the_factors_values_and_the_counters_dtype():
    """torch.optim's load casts every state tensor to its parameter's dtype: the float32 factors
    and whiteners would come back rounded to bfloat16, the int64 counter as a bfloat16."""
    model = mlp().to(torch.bfloat16)
    opt = WhitenedMuon(model, lr=1e-2, output_side=True)
    g = torch.Generator().manual_seed(1)
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g).to(torch.bfloat16)).float().square().mean().backward()
    opt.step()
    saved = snapshot(opt)
    opt.load_state_dict(saved)
    state, before = opt.state[model[0].weight], saved["state"][0]
    assert state["nonfinite_steps"].dtype == torch.int64
    for key in ("input_factor", "input_whitener", "output_factor", "output_whitener"):
        assert state[key].dtype == torch.float32 and torch.equal(state[key], before[key]), key


# -- copies and discarded optimizers -----------------------------------------------------------
@pytest.mark.parametrize("copier", [copy.deepcopy, copy.copy, lambda o: pickle.loads(pickle.dumps(o))])
def test_copying_or_pickling_raises_pointing_to_the_state_dict(copier):
    """The optimizer holds hooks on the model's modules: a copy would not see the model's
    activations. Refused with the way to do it, instead of a copy that fails at its first step."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2)
    with pytest.raises(TypeError, match="state_dict"):
        copier(opt)


def test_a_dropped_optimizer_is_freed_and_its_hooks_removed():
    """An lr sweep that rebuilds the optimizer on one model: the ones dropped are freed and
    leave no statistics hooks behind (they would keep computing x xᵀ on every forward)."""
    model = mlp()
    hooks = (len(model[0]._forward_hooks), len(model[0]._forward_pre_hooks))
    refs = []
    for lr in (1e-3, 3e-3, 1e-2):
        opt = WhitenedMuon(model, lr=lr)
        train(model, opt, 2)
        refs.append(weakref.ref(opt))
        del opt
    gc.collect()
    assert all(r() is None for r in refs)
    assert (len(model[0]._forward_hooks), len(model[0]._forward_pre_hooks)) == hooks
    kept = WhitenedMuon(model, lr=1e-2)
    train(model, kept, 6)  # the one kept still gathers its statistics
    assert kept.state[model[0].weight]["input_seen"].item() == 1


# -- values given and set later ---------------------------------------------------------------
def test_an_lr_given_as_a_numpy_or_tensor_scalar_is_a_float_in_every_group():
    for lr in (np.float32(0.01), torch.tensor(0.01)):
        model = nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4))
        opt = WhitenedMuon(model, lr=lr)
        assert all(type(g["lr"]) is float for g in opt.param_groups), [type(g["lr"]) for g in opt.param_groups]


@pytest.mark.parametrize("algorithm, key, value", [("whitened_muon", "momentum", 1.5),
                                                   ("whitened_muon", "lr", -1.0),
                                                   ("whitened_muon", "weight_decay", -0.1),
                                                   ("adamw", "lr", -1.0),
                                                   ("adamw", "betas", (0.9, 1.5)),
                                                   # not numbers: a string, a bool, one number for a pair
                                                   ("whitened_muon", "momentum", "0.9"),
                                                   ("whitened_muon", "lr", "0.01"),
                                                   ("adamw", "eps", True),
                                                   ("adamw", "betas", 0.9),
                                                   # None, a callable or a Fraction where a number is read
                                                   ("whitened_muon", "lr", None),
                                                   ("whitened_muon", "lr", lambda step: 0.01),
                                                   ("adamw", "lr", None),
                                                   ("adamw", "betas", (Fraction(9, 10), 0.999))])
def test_a_bad_value_set_on_a_group_raises_at_the_next_step_before_anything_moves(algorithm, key, value):
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2)
    train(model, opt, 2)
    group = next(g for g in opt.param_groups if g["algorithm"] == algorithm)
    group[key] = value
    before = [p.detach().clone() for p in model.parameters()]
    state = [t.clone() for entry in opt.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
    with pytest.raises(ValueError, match=key):
        train(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    after = [t for entry in opt.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
    assert len(after) == len(state) and all(torch.equal(a, b) for a, b in zip(state, after))


def test_numpy_values_and_an_unset_weight_decay_set_on_the_groups_step_as_their_python_numbers():
    """numpy scalars, 0-dim arrays and an array of betas, and a whitened group's weight decay
    of None (no decay), step as the Python numbers they hold."""
    results = []
    for numpy in (True, False):
        torch.manual_seed(0)
        model = mlp()
        opt = WhitenedMuon(model, lr=1e-2, weight_decay=0.0)
        whitened, adamw = opt.param_groups
        wrap = np.array if numpy else (lambda v: v)
        whitened.update(lr=wrap(0.02), momentum=np.float32(0.85) if numpy else float(np.float32(0.85)),
                        weight_decay=None if numpy else 0.0)
        adamw.update(lr=wrap(0.003), betas=np.array([0.8, 0.99]) if numpy else (0.8, 0.99))
        train(model, opt, 3)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_lazy_module_is_refused_at_construction_naming_it():
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'0'.*forward"):
        WhitenedMuon(model, lr=1e-2)


def test_a_complex_parameter_is_refused_at_construction_naming_it():
    model = mlp()
    model.register_parameter("phase", nn.Parameter(torch.zeros(3, dtype=torch.complex64)))
    with pytest.raises(TypeError, match="phase"):
        WhitenedMuon(model, lr=1e-2)


@pytest.mark.parametrize("every, decay", [(100, 0.8), (100, 0.0), (10, 0.95), (20, 0.8)])
def test_a_statistics_horizon_of_a_hundred_steps_or_more_is_warned_about(every, decay):
    """Settings brought from a library whose root is refreshed every 100 steps keep the whitener
    stale: said at construction, naming both settings."""
    with pytest.warns(UserWarning, match=f"statistics_every={every} and factor_decay={decay}"):
        WhitenedMuon([nn.Linear(4, 3)], lr=1e-3, statistics_every=every, factor_decay=decay)


@pytest.mark.parametrize("every, decay", [(5, 0.8), (10, 0.6), (1, 0.8), (1, 0.95), (24, 0.0)])
def test_the_defaults_and_short_horizons_are_not_warned_about(every, decay):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        WhitenedMuon([nn.Linear(4, 3)], lr=1e-3, statistics_every=every, factor_decay=decay)


@pytest.mark.parametrize("native", [True, False])
def test_the_default_iteration_dtype_follows_the_cpus_bfloat16_kernels(monkeypatch, native):
    """``ns_dtype=None``: bfloat16 (``torch.optim.Muon``'s) on a CPU with bfloat16 kernels,
    float32 on one without; each default run equals the run that names its dtype, bit for bit,
    and a named dtype is kept whatever the CPU."""
    from kron_precond import whitened_muon

    monkeypatch.setattr(whitened_muon, "_cpu_multiplies_bfloat16", lambda: native)
    expected = torch.bfloat16 if native else torch.float32
    finals = []
    for ns_dtype in (None, expected):
        model = mlp()
        opt = WhitenedMuon(model, lr=0.02, ns_dtype=ns_dtype)
        assert opt.ns_dtype == expected
        train(model, opt, 6)
        finals.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*finals):
        assert torch.equal(a, b)
    other = torch.float32 if native else torch.bfloat16
    assert WhitenedMuon(mlp(), lr=0.02, ns_dtype=other).ns_dtype == other
    model = mlp()
    opt = WhitenedMuon(model, lr=0.02, ns_dtype=other)
    train(model, opt, 6)
    assert any(not torch.equal(a, b) for a, b in zip(finals[0], model.parameters()))  # the dtype matters
    assert whitened_muon.native_ns_dtype(torch.device("meta")) == torch.bfloat16  # an accelerator's default


def test_a_non_float_iteration_dtype_is_refused():
    with pytest.raises(ValueError, match="ns_dtype"):
        WhitenedMuon(mlp(), lr=0.02, ns_dtype=torch.int32)


def test_the_checkpoint_holds_no_keys_beyond_its_format():
    """torch.distributed.checkpoint loads into a template from a fresh optimizer: a key added to
    the state or the param groups would be missing from every checkpoint written before, and DCP
    refuses those. The format's keys, pinned."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2, output_side=True)
    train(model, opt, 3)
    saved = opt.state_dict()
    group_keys = {key for group in saved["param_groups"] for key in group}
    assert group_keys <= {"params", "param_names", "algorithm", "lr", "momentum", "nesterov", "weight_decay",
                          "adjust_lr_fn", "betas", "eps"}, group_keys
    state_keys = {key for entry in saved["state"].values() for key in entry}
    assert state_keys <= {"step", "momentum_buffer", "nonfinite_steps", "exp_avg", "exp_avg_sq",
                          *(f"{side}_{item}" for side in ("input", "output")
                            for item in ("factor", "whitener", "seen"))}, state_keys


class _Named(nn.Module):
    """Two same-shaped whitened weights whose names say which is which."""

    def __init__(self, first: str, second: str):
        super().__init__()
        self.names = (first, second)
        self.add_module(first, nn.Linear(4, 4))
        self.add_module(second, nn.Linear(4, 4))

    def forward(self, x):
        return getattr(self, self.names[1])(torch.tanh(getattr(self, self.names[0])(x)))


def _stepped(model):
    opt = WhitenedMuon(model, lr=1e-2, statistics_every=1)
    for s in range(2):
        model(torch.randn(8, 4, generator=torch.Generator().manual_seed(s))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_a_checkpoint_of_other_parameter_names_is_refused_and_changes_nothing():
    """A checkpoint of another model whose parameters have the same shapes (``wk`` saved where
    this model has ``q``) would load by position into the wrong weights: torch.optim keeps the
    saved ``param_names``, which are compared first. The same names behind DDP's ``module.`` or
    ``torch.compile``'s ``_orig_mod.`` load."""
    torch.manual_seed(0)
    saved = _stepped(_Named("wk", "wq")).state_dict()
    opt = WhitenedMuon(_Named("q", "k"), lr=1e-2)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"'wk\.weight'.*'q\.weight'"):
        opt.load_state_dict(saved)
    assert_same_state(before, opt.state_dict())

    class Wrapped(nn.Module):  # DDP's naming: the model under "module"
        def __init__(self, inner):
            super().__init__()
            self.module = inner

        def forward(self, x):
            return self.module(x)

    torch.manual_seed(0)
    plain = _Named("q", "k")
    checkpoint = _stepped(plain).state_dict()
    wrapped = Wrapped(copy.deepcopy(plain))
    loaded = WhitenedMuon(wrapped, lr=1e-2)
    loaded.load_state_dict(checkpoint)  # "module.q.weight" reads "q.weight"
    assert loaded._steps == 2
    compiled_names = WhitenedMuon(torch.compile(copy.deepcopy(plain)), lr=1e-2)
    assert compiled_names.param_groups[0]["param_names"][0].startswith("_orig_mod.")
    compiled_names.load_state_dict(checkpoint)


def test_an_optimizer_removed_during_a_forward_hook_of_the_same_call_raises_nothing():
    """Freeing an optimizer removes its hooks, possibly while torch runs the module's forward
    hooks (the garbage collector can run inside any hook). torch still calls a hook removed
    during that call's hook loop, without the keyword arguments it was registered with: it
    must take that call (and do nothing harmful) rather than raise."""
    model = mlp()
    dropped = WhitenedMuon(model, lr=1e-3)
    kept = WhitenedMuon(model, lr=1e-3)  # its hook runs first (the library's hooks go first)
    model[0].register_forward_hook(lambda m, args, out: dropped.remove(), prepend=True)
    train(model, kept, 2)
    assert kept.state[model[0].weight]["input_seen"].item() == 1


def _torchtitans_state_creation(model, opt):
    utils = pytest.importorskip("torchtitan.components.optimizer.utils",
                                reason="torchtitan is an optional extra ([torchtitan])")
    utils.init_optim_state(opt)


@pytest.mark.parametrize("caller", ["dcp", "torchtitan"])
@pytest.mark.parametrize("kind", ["whitened_muon", "whitened_muon_output_side", "kron", "preconditioned_adamw",
                                  "preconditioned_sgd_dampening", "preconditioned_nadam"])
def test_torchs_state_dict_api_before_the_first_step_changes_nothing(kind, caller):
    """torch.distributed.checkpoint's ``get_optimizer_state_dict`` on an optimizer that has not
    stepped runs one step at lr 0 with zero gradients to create its state (a trainer building
    a checkpoint template, or saving at step 0); torchtitan's checkpointer does the same with a
    helper of its own (``init_optim_state``). That call is not a step: the run goes on bitwise
    as the run without it (schedule, step counts, AdamW's bias correction); under
    ``PreconditionedOptimizer`` the preconditioner does not step on it either."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from kron_precond import Kron

    create = get_optimizer_state_dict if caller == "dcp" else _torchtitans_state_creation

    def build(model):
        if kind == "kron":
            return Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)
        if kind.startswith("preconditioned"):  # the base's first step (moments, buffers), K-FAC's schedule
            from kron_precond import KronPreconditioner, PreconditionedOptimizer
            base = {"preconditioned_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                    "preconditioned_sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9,
                                                                               dampening=0.5),
                    "preconditioned_nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2)}[kind](model.parameters())
            return PreconditionedOptimizer(base, KronPreconditioner(model, method="kfac", factor_update_steps=2,
                                                                    inv_update_steps=2))
        return WhitenedMuon(model, lr=1e-2, statistics_every=2, output_side=kind.endswith("output_side"))

    runs = []
    for ask_first in (False, True):
        model = mlp()
        opt = build(model)
        if ask_first:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DCP's own notices (no process group)
                create(model, opt)
        train(model, opt, 5)
        runs.append(([p.detach().clone() for p in model.parameters()], opt.state_dict()))
    (reference, reference_state), (asked, asked_state) = runs
    for a, b in zip(asked, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    steps = [[entry.get("step") for entry in state["state"].values()] for state in (asked_state, reference_state)]
    assert steps[0] == steps[1]


def test_a_load_after_torchs_state_creating_call_keeps_the_loaded_state():
    """After torch's state-creating call on a ``PreconditionedOptimizer``, its base optimizer's
    entries are placeholders, dropped at the next step -- unless a load replaced them: a run
    resumed so (the template taken first, the base and the preconditioner loaded directly)
    goes on bitwise as the uninterrupted one."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from kron_precond import KronPreconditioner, PreconditionedOptimizer

    def build(model):
        return PreconditionedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, dampening=0.5),
                                       KronPreconditioner(model, method="kfac", factor_update_steps=2,
                                                          inv_update_steps=2))

    model = mlp()
    opt = build(model)
    train(model, opt, 3)
    base, precond = copy.deepcopy(opt.optimizer.state_dict()), copy.deepcopy(opt.preconditioner.state_dict())
    weights = copy.deepcopy(model.state_dict())
    train(model, opt, 3, seed=2)
    resumed = mlp()
    resumed.load_state_dict(weights)
    fresh = build(resumed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own notices, and the wrapper's about its preconditioner
        get_optimizer_state_dict(resumed, fresh)
    fresh.optimizer.load_state_dict(base)
    fresh.preconditioner.load_state_dict(precond)
    train(resumed, fresh, 3, seed=2)
    for a, b in zip(resumed.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
