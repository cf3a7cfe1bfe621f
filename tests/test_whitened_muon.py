"""WhitenedMuon against independent references.

- its Newton-Schulz iteration is bitwise torch.optim.Muon's;
- its steps are ``-lr·0.2·sqrt(max(m, n)) · L polar(L M R) R / ||·|| · ||polar||`` with
  ``L, R = (F + λI)^{-1/2}`` of running input / output-gradient covariances, each piece
  computed here in float64 from the layers' inputs and output gradients (scipy's ``sqrtm``
  for the roots, an SVD for the polar factor), over several steps with momentum and decay;
- on 2 and 4 gloo ranks (each a shard of the batch, gradients averaged like DDP) it gives the
  one-process result on the full batch, and the ranks stay identical after every step;
- checkpoints resume exactly; bad arguments fail at construction naming the argument;
  a non-finite gradient leaves the weight and its momentum untouched and is reported.
"""
from __future__ import annotations

import copy
import gc
import itertools
import re
import warnings
import weakref

import numpy as np
import pytest
import torch
import torch.nn as nn
from scipy.linalg import sqrtm

import kron_precond.whitened_muon as wm
from dist_utils import run_workers, step_as_ddp
from kron_precond import WhitenedMuon

LR, WD, MOMENTUM, DAMPING, DECAY = 0.05, 0.1, 0.9, 0.1, 0.95
OUTPUT_DAMPING = 0.03  # the output side's own damping, where a test gives one


DIMS = (5, 7, 4)


class Net(nn.Module):
    def __init__(self, dims=DIMS, bias=(False, False)):
        super().__init__()
        self.a = nn.Linear(dims[0], dims[1], bias=bias[0])
        self.b = nn.Linear(dims[1], dims[2], bias=bias[1])

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def make_net(dtype=torch.float64, dims=DIMS, bias=(False, False)) -> Net:
    torch.manual_seed(0)
    return Net(dims, bias).to(dtype)


def batches(steps: int, dtype=torch.float64, dims=DIMS):
    g = torch.Generator().manual_seed(1)
    scale = torch.logspace(0.5, -1, dims[0], dtype=dtype)  # an ill-conditioned input covariance
    return [(torch.randn(4, 3, dims[0], generator=g, dtype=dtype) * scale,
             torch.randn(4, 3, dims[2], generator=g, dtype=dtype)) for _ in range(steps)]


def loss_of(net, x, y):
    return (net(x) - y).square().mean()


def exact_polar(matrix, steps=5, eps=1e-7, dtype=None, coefficients=None):
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return (u @ vh).to(matrix.dtype)


def inverse_root(factor: np.ndarray, block: int | None = None, damping: float = DAMPING) -> np.ndarray:
    """``(F + λI)^{-1/2}`` by scipy's ``sqrtm``, ``λ = damping · tr(F)/n``; with ``block``, of
    each diagonal block alone."""
    dim = factor.shape[0]
    size = block if block is not None and dim > block and dim % block == 0 else dim
    out = np.zeros_like(factor)
    for s in range(0, dim, size):
        f = factor[s:s + size, s:s + size]
        lam = damping * np.trace(f) / size
        out[s:s + size, s:s + size] = np.linalg.inv(np.real(sqrtm(f + lam * np.eye(size))))
    return out


def match_rms_adamw(shape) -> float:
    return 0.2 * max(shape) ** 0.5


def reference_run(output_side: bool | str, steps: int, dims=DIMS, block: int | None = None,
                  center=(True, True), bias=(False, False), lr_ratio=match_rms_adamw,
                  output_damping: float = DAMPING):
    """The steps written out in float64 with numpy/scipy, statistics on every step; the input
    factor of layer i is the rows' covariance about their mean where ``center[i]``; each
    weight ``[out, in]`` steps by ``LR · lr_ratio((out, in))``; the output factors are damped by
    ``output_damping``."""
    net = make_net(dims=dims, bias=bias)
    weights = [net.a.weight, net.b.weight]
    factors = {}
    buffers = [torch.zeros_like(w) for w in weights]
    history = []
    for x, y in batches(steps, dims=dims):
        h_in = x.reshape(-1, dims[0])
        pre = net.a(x)
        h = torch.tanh(pre)
        out = net.b(h)
        loss = (out - y).square().mean()
        grads = torch.autograd.grad(loss, [pre, out] + weights)
        inputs = [h_in, h.reshape(-1, dims[1])]
        outputs = [grads[0].reshape(-1, dims[1]), grads[1].reshape(-1, dims[2])]
        for i, w in enumerate(weights):
            for side, rows in (("in", inputs[i]), ("out", outputs[i])):
                if side == "in" and center[i]:
                    rows = rows - rows.mean(dim=0)
                batch = (rows.T @ rows / rows.shape[0]).detach().numpy()
                key = (i, side)
                factors[key] = batch if key not in factors else DECAY * factors[key] + (1 - DECAY) * batch
            g = grads[2 + i].detach()
            buffers[i] = MOMENTUM * buffers[i] + (1 - MOMENTUM) * g
            m = ((1 - MOMENTUM) * g + MOMENTUM * buffers[i]).numpy()
            right = inverse_root(factors[(i, "in")], block)
            two_sided = output_side is True or (output_side == "wide" and w.shape[0] > w.shape[1])
            left = inverse_root(factors[(i, "out")], block, output_damping) if two_sided else np.eye(w.shape[0])
            ortho = exact_polar(torch.from_numpy(left @ m @ right)).numpy()
            direction = left @ ortho @ right
            direction *= np.linalg.norm(ortho) / np.linalg.norm(direction)
            with torch.no_grad():
                w.mul_(1 - LR * WD).sub_(torch.from_numpy(direction), alpha=LR * lr_ratio(tuple(w.shape)))
        history.append([w.detach().clone() for w in weights])
    return history


def train_against(net, opt, expected, atol=1e-11):
    """Train ``net`` with ``opt`` on ``batches`` and check each step's weights against ``expected``
    (``atol``: an uncentred factor of biased layers' shifted inputs is less well conditioned)."""
    for step, (x, y) in enumerate(batches(len(expected))):
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()
        for got, want in zip([net.a.weight, net.b.weight], expected[step]):
            torch.testing.assert_close(got.detach(), want, rtol=1e-9, atol=atol)


@pytest.mark.parametrize("root", ["cholesky", "symmetric"])
@pytest.mark.parametrize("output_side", [False, True, "wide"])
@pytest.mark.parametrize("center_inputs", [None, False])
def test_steps_match_the_whitened_steepest_descent_written_out(monkeypatch, output_side, root, center_inputs):
    """With the exact polar factor, both roots give the step written out with symmetric
    inverse roots: ``||ΔW L||_op = ||ΔW A^{1/2}||_op``, the same steepest descent. The net's
    layers have no bias, so by default their input factors are centred. The output factors take
    their own damping (``output_damping``): the 7-wide output side of ``a`` and input side of
    ``b`` are refreshed in one batch, each with its side's damping."""
    monkeypatch.setattr(wm, "msign", exact_polar)  # the whitening algebra, not Newton-Schulz
    steps = 4
    centred = center_inputs is None
    expected = reference_run(output_side, steps, center=(centred, centred), output_damping=OUTPUT_DAMPING)
    other = reference_run(output_side, steps, center=(not centred, not centred), output_damping=OUTPUT_DAMPING)
    net = make_net()
    opt = WhitenedMuon([net.a, net.b], lr=LR, weight_decay=WD, momentum=MOMENTUM, statistics_every=1,
                       damping=DAMPING, factor_decay=DECAY, output_side=output_side, root=root, ns_dtype=torch.float64,
                       output_damping=OUTPUT_DAMPING,
                       center_inputs=center_inputs)
    for step, (x, y) in enumerate(batches(steps)):
        with torch.no_grad():  # an evaluation pass: no statistics
            net(torch.randn(2, 5, dtype=torch.float64) * 100)
        net.eval()
        net(torch.randn(2, 5, dtype=torch.float64) * 100).sum()  # eval mode: no statistics either
        net.train()
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()
        for got, want in zip([net.a.weight, net.b.weight], expected[step]):  # "wide": float64 rounding
            torch.testing.assert_close(got.detach(), want, rtol=1e-9, atol=5e-11 if output_side == "wide" else 1e-11)
    assert not torch.allclose(net.a.weight.detach(), other[-1][0], rtol=1e-4)  # centring mattered


@pytest.mark.parametrize("output_side", [False, True])
def test_both_roots_step_alike_through_newton_schulz(output_side):
    """``L⁻ᵀ = (A + λI)^{-1/2} Q`` with ``Q`` orthogonal, and Newton-Schulz's polynomial
    ``p(X Xᵀ) X`` maps ``X Q`` to ``p(X Xᵀ) X Q`` (``Q X`` to ``Q p(X Xᵀ) X`` on the left), its
    Frobenius normalisation included: so the approximate ``msign`` of five iterations, not only
    the exact polar factor, gives the same step under either root, to rounding."""
    nets = [make_net() for _ in range(2)]
    opts = [WhitenedMuon([net.a, net.b], lr=LR, weight_decay=WD, momentum=MOMENTUM, statistics_every=1,
                         damping=DAMPING, factor_decay=DECAY, output_side=output_side, root=root,
                         ns_dtype=torch.float64, center_inputs=False)
            for root, net in zip(("cholesky", "symmetric"), nets)]
    start = nets[0].a.weight.detach().clone()
    for x, y in batches(4):
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            loss_of(net, x, y).backward()
            opt.step()
    for mine, theirs in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)
    assert (nets[0].a.weight - start).abs().max() > 1e-3  # the weights moved
    # the whiteners themselves differ (a triangular factor against a symmetric one)
    chol, sym = (opt.state[net.a.weight]["input_whitener"] for opt, net in zip(opts, nets))
    assert not torch.allclose(chol, sym) and torch.equal(chol, chol.tril())


def test_the_wide_output_side_whitens_and_observes_the_wider_output_alone(monkeypatch):
    """``output_side="wide"``: the weight ``a`` ``[7, 5]`` is whitened on both sides, ``b``
    ``[4, 7]`` on its input side alone. Only ``a``'s output gradients are observed (its
    module alone gets a tensor hook), ``b`` keeps no output state, and ``a`` steps neither as
    the one-sided nor as the two-sided written-out steps (so the reference above tells them apart)."""
    monkeypatch.setattr(wm, "msign", exact_polar)
    observed = []
    observe = wm.UnitObserver.observe_output_grads
    monkeypatch.setattr(wm.UnitObserver, "observe_output_grads",
                        lambda self, *args: (observed.append(self.name), observe(self, *args))[1])
    net = make_net()
    opt = WhitenedMuon([net.a, net.b], lr=LR, weight_decay=WD, momentum=MOMENTUM, statistics_every=1,
                       damping=DAMPING, factor_decay=DECAY, output_side="wide", ns_dtype=torch.float64)
    steps = 3
    for x, y in batches(steps):
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()
    assert observed and set(observed) == {"modules[0]"}
    assert "output_whitener" in opt.state[net.a.weight]
    assert not any(k.startswith("output_") for k in opt.state[net.b.weight])
    for other in (False, True):
        want = reference_run(other, steps)[-1]
        assert not torch.allclose(net.a.weight.detach(), want[0], rtol=1e-6)


@pytest.mark.parametrize("adjust_lr_fn", ["original", None])
def test_original_lr_adjustment_matches_the_steps_written_out(monkeypatch, adjust_lr_fn):
    """``adjust_lr_fn="original"`` (or ``None``, as ``torch.optim.Muon`` reads it) scales a
    weight ``[out, in]``'s step by ``sqrt(max(1, out / in))``, Keller Jordan's Muon, instead of
    ``0.2 · sqrt(max(out, in))``; the whitened direction is the same."""
    monkeypatch.setattr(wm, "msign", exact_polar)
    steps = 3
    expected = reference_run(False, steps, lr_ratio=lambda shape: max(1.0, shape[0] / shape[1]) ** 0.5)
    rms_matched = reference_run(False, steps)
    net = make_net()
    opt = WhitenedMuon([net.a, net.b], lr=LR, weight_decay=WD, momentum=MOMENTUM, statistics_every=1,
                       damping=DAMPING, factor_decay=DECAY, ns_dtype=torch.float64, adjust_lr_fn=adjust_lr_fn)
    train_against(net, opt, expected)
    assert not torch.allclose(net.a.weight.detach(), rms_matched[-1][0], rtol=1e-4)  # the scale mattered


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw", None])
def test_an_unwhitened_weight_steps_as_torch_muon_with_the_same_lr_adjustment(adjust_lr_fn):
    """A weight whose module never runs its forward (applied functionally) keeps the identity
    whitener: its steps are ``torch.optim.Muon``'s, bit for bit, under each ``adjust_lr_fn``."""
    torch.manual_seed(0)
    ours, theirs = nn.Linear(5, 9, bias=False), nn.Linear(5, 9, bias=False)
    theirs.load_state_dict(ours.state_dict())
    opt = WhitenedMuon([ours], lr=LR, weight_decay=WD, momentum=MOMENTUM, adjust_lr_fn=adjust_lr_fn,
                       ns_dtype=torch.bfloat16)  # torch.optim.Muon's iteration, on every CPU
    muon = torch.optim.Muon(theirs.parameters(), lr=LR, weight_decay=WD, momentum=MOMENTUM,
                            adjust_lr_fn=adjust_lr_fn)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(6, 5, generator=g)
        for layer, optimizer in ((ours, opt), (theirs, muon)):
            optimizer.zero_grad()
            nn.functional.linear(x, layer.weight).square().sum().backward()
            optimizer.step()
        assert torch.equal(ours.weight, theirs.weight)


@pytest.mark.parametrize("lr, weight_decay", [(0.03, 0.1), (0.1, 0.07)])
def test_bfloat16_weights_decay_by_the_factor_asked_for(lr, weight_decay):
    """A bfloat16 weight decays by ``1 - lr·weight_decay`` as torch.optim.Muon (and AdamW)
    apply it, a Python number multiplied in float32, not by that factor rounded to bfloat16,
    whose steps below 1 are 2⁻⁸ apart (0.997 would be 0.99609: 30 % more decay than asked)."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    before = layer.weight.detach().clone()
    opt = WhitenedMuon([layer], lr=lr, weight_decay=weight_decay)
    layer.weight.grad = torch.zeros_like(layer.weight)  # a zero direction: the step is the decay alone
    opt.step()
    assert torch.equal(layer.weight, before.mul(1 - lr * weight_decay))
    assert not torch.equal(layer.weight, before.mul(torch.tensor(1 - lr * weight_decay).bfloat16()))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_momentum_is_the_average_of_the_gradients_whatever_the_orthogonalisation_does(nesterov, dtype):
    """The momentum buffer after two steps is ``lerp``'s average of the two gradients: the
    Newton-Schulz iteration normalises a copy. Without Nesterov the update is the buffer
    itself, and in bfloat16 its cast is no copy (torch.optim.Muon 2.13 divides such a buffer
    by its norm in place)."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 8, bias=False).to(dtype)
    opt = WhitenedMuon([layer], lr=0.01, momentum=MOMENTUM, nesterov=nesterov)
    grads = [torch.randn(8, 4).to(dtype) for _ in range(2)]
    expected = torch.zeros_like(grads[0])
    for g in grads:
        layer.weight.grad = g.clone()
        opt.step()
        expected.lerp_(g, 1 - MOMENTUM)
    assert torch.equal(opt.state[layer.weight]["momentum_buffer"], expected)


def test_the_lr_adjustment_is_a_param_group_setting_kept_by_checkpoints():
    net = make_net()
    opt = WhitenedMuon([net.a, net.b], lr=LR, adjust_lr_fn="original")
    assert opt.param_groups[0]["adjust_lr_fn"] == "original"
    model_form = WhitenedMuon(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)), lr=LR)
    whitened, adamw = model_form.param_groups
    assert whitened["adjust_lr_fn"] == "match_rms_adamw"  # the default: lr on AdamW's scale
    assert adamw["algorithm"] == "adamw" and "adjust_lr_fn" not in adamw  # a Muon setting only
    saved = opt.state_dict()
    fresh = WhitenedMuon([net.a, net.b], lr=LR)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["adjust_lr_fn"] == "original"
    older = copy.deepcopy(saved)  # a checkpoint from before the setting: it was stepped by the default
    del older["param_groups"][0]["adjust_lr_fn"]
    original = WhitenedMuon([net.a, net.b], lr=LR, adjust_lr_fn="original")
    original.load_state_dict(older)
    assert original.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"


def test_an_unknown_lr_adjustment_in_a_param_group_raises():
    """A value set on a group, or loaded from a checkpoint, is checked as the constructor's
    argument is: an unknown name would otherwise be stepped as ``"original"``. A failed load
    changes nothing."""
    net = make_net()
    opt = WhitenedMuon([net.a], lr=LR, adjust_lr_fn="original")
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0]["adjust_lr_fn"] = "spectral"
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["adjust_lr_fn"] == "original"
    opt.param_groups[0]["adjust_lr_fn"] = "spectral"
    net.a(torch.randn(4, net.a.in_features, dtype=torch.float64)).sum().backward()
    before = net.a.weight.detach().clone()
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        opt.step()
    assert torch.equal(net.a.weight, before) and not opt.state[net.a.weight]  # no momentum, no factor


@pytest.mark.parametrize("value", ["False", 0, None])
def test_a_non_bool_nesterov_in_a_param_group_raises(value):
    """``nesterov`` set on a group, or loaded from a checkpoint, must be a bool as the
    constructor's is: the string "False" would otherwise be stepped as Nesterov on. A failed
    load and a refused step change nothing."""
    net = make_net()
    opt = WhitenedMuon([net.a], lr=LR, nesterov=False)
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0]["nesterov"] = value
    with pytest.raises(ValueError, match="nesterov"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["nesterov"] is False
    opt.param_groups[0]["nesterov"] = value
    net.a(torch.randn(4, net.a.in_features, dtype=torch.float64)).sum().backward()
    before = net.a.weight.detach().clone()
    with pytest.raises(ValueError, match="nesterov"):
        opt.step()
    assert torch.equal(net.a.weight, before) and not opt.state[net.a.weight]


def test_by_default_only_the_layers_without_a_bias_are_centred(monkeypatch):
    """``center_inputs=None``: the biased layer ``a`` is whitened by its inputs' second moment,
    the bias-free ``b`` by their covariance; ``True`` centres both."""
    monkeypatch.setattr(wm, "msign", exact_polar)
    steps, bias = 3, (True, False)
    for center_inputs, center in ((None, (False, True)), (True, (True, True))):
        expected = reference_run(False, steps, center=center, bias=bias)
        net = make_net(bias=bias)
        opt = WhitenedMuon([net.a, net.b], lr=LR, weight_decay=WD, momentum=MOMENTUM, statistics_every=1,
                           damping=DAMPING, factor_decay=DECAY, ns_dtype=torch.float64, center_inputs=center_inputs)
        assert opt.center_inputs is center_inputs
        train_against(net, opt, expected)


class Renamed(nn.Module):
    """``make_net``'s two layers under other module names (``net.a`` and ``net.b`` stay readable
    for ``train_against`` without being registered twice)."""

    def __init__(self, net: Net, first: str, second: str):
        super().__init__()
        self.layers = nn.ModuleDict({first: net.a, second: net.b})
        object.__setattr__(self, "a", net.a)
        object.__setattr__(self, "b", net.b)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("names, bias, center", [
    (("q_proj", "k_proj"), (False, False), (True, True)),  # a bias-free query and key: those alone
    (("wq", "wk"), (True, False), (False, True)),  # the pair: its bias-free key alone
    (("k_proj", "v_proj"), (False, False), (True, True)),  # a key alone is no pair
    (("a", "b"), (False, False), (True, True)),  # no query or key by name: every bias-free layer
    (("k_proj", "v_proj"), (True, True), (False, False)),
])
def test_by_default_the_bias_free_query_and_key_projections_are_centred(monkeypatch, names, bias, center):
    """``center_inputs=None`` on the model form: where bias-free layers are named as an
    attention's query or key projection, their input factors alone are the rows' covariance and
    every other layer's the second moment; with no such name, every bias-free layer is centred."""
    monkeypatch.setattr(wm, "msign", exact_polar)
    steps = 3
    expected = reference_run(False, steps, center=center, bias=bias)
    model = Renamed(make_net(bias=bias), *names)
    opt = WhitenedMuon(model, lr=LR, weight_decay=WD, momentum=MOMENTUM, statistics_every=1, damping=DAMPING,
                       factor_decay=DECAY, ns_dtype=torch.float64, root="symmetric")
    if any(bias):  # the biases step with AdamW, which the reference does not write out
        for p in (model.a.bias, model.b.bias):
            if p is not None:
                p.requires_grad_(False)
    assert [g["algorithm"] for g in opt.param_groups][0] == "whitened_muon"
    train_against(model, opt, expected, atol=1e-10)


@pytest.mark.parametrize("patterns, center", [
    (["v_proj"], (False, True)),
    (("k_proj", "v_proj"), (True, True)),
    (["^layers\\.k"], (True, False)),  # the qualified module name
    (["Linear"], (True, True)),  # the class name
    ([], (False, False)),
])
def test_center_inputs_as_regexes_centres_exactly_the_layers_they_match(monkeypatch, patterns, center):
    monkeypatch.setattr(wm, "msign", exact_polar)
    steps = 3
    expected = reference_run(False, steps, center=center)
    model = Renamed(make_net(), "k_proj", "v_proj")
    opt = WhitenedMuon(model, lr=LR, weight_decay=WD, momentum=MOMENTUM, statistics_every=1, damping=DAMPING,
                       factor_decay=DECAY, ns_dtype=torch.float64, center_inputs=patterns)
    assert opt.center_inputs == patterns
    train_against(model, opt, expected)


@pytest.mark.parametrize("patterns, skip", [
    (["k_proj", "q_prj"], None),  # a typo: matches no layer
    (["v_proj"], ["v_proj"]),  # matches a skipped layer only (its parameters go to AdamW)
])
def test_a_center_inputs_regex_matching_no_whitened_layer_is_refused_naming_it(patterns, skip):
    model = Renamed(make_net(), "k_proj", "v_proj")
    with pytest.raises(ValueError, match=re.escape(repr(patterns[-1]))):
        WhitenedMuon(model, lr=LR, center_inputs=patterns, skip_layers=skip)


def test_a_centred_factor_is_the_rows_covariance_and_a_mean_shift_does_not_move_it():
    """The first statistics step's input factor against numpy's covariance of the rows; the
    same rows shifted by a constant vector give the same factor (and the same step)."""
    torch.manual_seed(3)
    layer = nn.Linear(6, 3, bias=False).double()
    rows = torch.randn(40, 6, dtype=torch.float64) * torch.linspace(0.2, 2.0, 6, dtype=torch.float64)
    factors = []
    for shift in (0.0, 5.0):
        net = copy.deepcopy(layer)
        opt = WhitenedMuon([net], lr=LR, ns_dtype=torch.float64)
        net(rows + shift).square().sum().backward()
        opt.step()
        factors.append(opt.state[net.weight]["input_factor"][0])
    want = np.cov(rows.numpy(), rowvar=False, bias=True)
    torch.testing.assert_close(factors[0], torch.from_numpy(want), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(factors[1], torch.from_numpy(want), rtol=1e-8, atol=1e-10)


def test_a_float64_factors_running_average_is_taken_in_float64():
    """Two statistics steps of a float64 layer against the running average in float64,
    ``A₁ + (1 − decay)(B₂ − A₁)``: the weight ``1 − decay`` is not rounded to float32 on the way
    (which put the factor 3e-9 off, relatively)."""
    torch.manual_seed(3)
    net = nn.Linear(6, 3, bias=False).double()
    opt = WhitenedMuon([net], lr=LR, ns_dtype=torch.float64, factor_decay=0.9, statistics_every=1,
                       center_inputs=False)
    batches = [torch.randn(40, 6, dtype=torch.float64) for _ in range(2)]
    for rows in batches:
        opt.zero_grad()
        net(rows).square().sum().backward()
        opt.step()
    first, second = (rows.T @ rows / rows.shape[0] for rows in batches)
    want = first + (1 - 0.9) * (second - first)
    torch.testing.assert_close(opt.state[net.weight]["input_factor"].reshape(6, 6), want, rtol=1e-14, atol=0)


@pytest.mark.parametrize("center_inputs", [False, True])
def test_a_call_with_no_rows_adds_nothing_to_the_factor(center_inputs):
    """An empty batch (a rank's last, short micro-batch) enters neither the product nor the
    mean: the factor is that of the other call's rows alone."""
    torch.manual_seed(6)
    layer = nn.Linear(6, 3, bias=False).double()
    opt = WhitenedMuon([layer], lr=LR, statistics_every=1, center_inputs=center_inputs, block_size=3)
    x = torch.randn(20, 6, dtype=torch.float64) + 1.0
    (layer(x).sum() + layer(torch.zeros(0, 6, dtype=torch.float64)).sum()).backward()
    opt.step()
    rows = x - x.mean(dim=0) if center_inputs else x
    full = rows.T @ rows / rows.shape[0]
    want = torch.stack([full[:3, :3], full[3:, 3:]])  # the two 3 x 3 diagonal blocks
    torch.testing.assert_close(opt.state[layer.weight]["input_factor"], want, rtol=1e-10, atol=1e-12)


def test_a_biased_and_a_bias_free_layer_reading_one_tensor_each_get_their_own_factor():
    """q (with a bias) and k (without) read one tensor: the shared row statistics must not
    hand q's second moment to k or k's covariance to q, in either call order."""
    torch.manual_seed(5)
    q, k = nn.Linear(5, 3).double(), nn.Linear(5, 3, bias=False).double()
    opt = WhitenedMuon([q, k], lr=LR, statistics_every=1)
    x = torch.randn(40, 5, dtype=torch.float64) + 2.0
    (q(x).sum() + k(x).sum() + q(x).sum()).backward()  # q, k, then q again on the same tensor
    opt.step()
    rows = torch.cat([x, x]).numpy()  # q saw the rows twice, k once
    second_moment = torch.from_numpy(rows.T @ rows / rows.shape[0])
    covariance = torch.from_numpy(np.cov(x.numpy(), rowvar=False, bias=True))
    torch.testing.assert_close(opt.state[q.weight]["input_factor"][0], second_moment, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(opt.state[k.weight]["input_factor"][0], covariance, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("offset", [1e3, 1e4])
def test_a_centred_factor_of_float32_rows_far_from_the_origin_keeps_its_precision(offset):
    """Rows whose mean is 10^3-10^4 times their spread, in float32, over two calls of one
    statistics step: ``Σ x xᵀ − n x̄ x̄ᵀ`` in float32 would lose every digit (even turn
    indefinite); the factor must still be numpy's float64 covariance of the pooled rows."""
    torch.manual_seed(4)
    layer = nn.Linear(8, 3, bias=False)
    opt = WhitenedMuon([layer], lr=LR, statistics_every=1)
    spread = torch.linspace(0.1, 1.0, 8)
    calls = [torch.randn(300, 8) * spread + offset, torch.randn(200, 8) * spread + offset * 1.001]
    sum(layer(x).square().mean() for x in calls).backward()
    opt.step()
    rows = torch.cat(calls).double().numpy()
    want = torch.from_numpy(np.cov(rows, rowvar=False, bias=True))
    got = opt.state[layer.weight]["input_factor"][0].double()
    assert ((got - want).norm() / want.norm()) < 1e-4
    assert torch.linalg.eigvalsh(got).min() > 0


@pytest.mark.parametrize("root", ["cholesky", "symmetric"])
def test_block_diagonal_factors_match_the_blocked_reference(monkeypatch, root):
    """``block_size=2``: every side (6, 8, 4 wide) is whitened in 2 x 2 diagonal blocks, each
    with its own damping; the reference takes the blocks of the full factors itself."""
    monkeypatch.setattr(wm, "msign", exact_polar)
    dims = (6, 8, 4)
    expected = reference_run(True, 3, dims=dims, block=2)  # centred: the layers have no bias
    whole = reference_run(True, 3, dims=dims)
    net = make_net(dims=dims)
    opt = WhitenedMuon([net.a, net.b], lr=LR, weight_decay=WD, momentum=MOMENTUM, statistics_every=1,
                       damping=DAMPING, factor_decay=DECAY, output_side=True, root=root, block_size=2,
                       ns_dtype=torch.float64)
    blocks = opt._statistics.blocks
    assert opt.state == {} and blocks(8) == 4 and blocks(5) == 1 and blocks(2) == 1
    for step, (x, y) in enumerate(batches(3, dims=dims)):
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()
        for got, want in zip([net.a.weight, net.b.weight], expected[step]):
            torch.testing.assert_close(got.detach(), want, rtol=1e-9, atol=1e-11)
    assert not torch.allclose(net.a.weight.detach(), whole[-1][0], rtol=1e-4)  # blocking mattered


def test_whitening_after_the_orthogonalisation_changes_the_step(monkeypatch):
    """The second whitening is the point: dropping it (the pre-only control) moves the weights
    elsewhere, so the test above would notice it missing."""
    monkeypatch.setattr(wm, "msign", exact_polar)
    expected = reference_run(False, 2)

    class PreOnly(WhitenedMuon):
        def _direction(self, update, left, right):
            return exact_polar(self._whiten(update, left, right, transpose=True))

    net = make_net()
    opt = PreOnly([net.a, net.b], lr=LR, weight_decay=WD, momentum=MOMENTUM, statistics_every=1,
                  damping=DAMPING, factor_decay=DECAY, ns_dtype=torch.float64)
    for x, y in batches(2):
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()
    assert not torch.allclose(net.a.weight.detach(), expected[1][0], rtol=1e-3)


def test_newton_schulz_of_a_stack_is_torch_muons_bitwise_matrix_by_matrix():
    """The optimizer orthogonalises stacks of equal-shape weights; every matrix of a stack,
    whatever its scale, gets torch.optim.Muon's own bfloat16 result."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(0)
    for shape in ((3, 16, 40), (3, 40, 16), (3, 8, 8)):
        stack = torch.randn(*shape) * torch.tensor([1.0, 100.0, 0.01])[:, None, None]
        got = wm.msign(stack)
        for matrix, out in zip(stack, got):
            assert torch.equal(out, _zeropower_via_newtonschulz(matrix, wm.NS_COEFFICIENTS, 5, 1e-7).float())
        assert torch.equal(wm.msign(stack[1]), got[1])  # a lone matrix: the same


@pytest.mark.parametrize("shape", [(128, 512), (512, 128), (96, 200)])
def test_a_weight_alone_in_its_layout_steps_as_it_would_in_a_stack(shape):
    """Weights of one shape are stepped as one stack; a weight with no twin is a stack of one.
    Its whitened direction must not depend on that: bitwise the same as the same matrix's in a
    stack of three (on CPU, ``@`` on a batch of one with a transposed bfloat16 operand takes
    another kernel than ``bmm``, with other rounding, 4-5x slower)."""
    torch.manual_seed(0)
    out_dim, in_dim = shape
    opt = WhitenedMuon([nn.Linear(in_dim, out_dim, bias=False)], lr=LR)
    updates = torch.randn(3, out_dim, in_dim)
    right = torch.linalg.cholesky(torch.cov(torch.randn(in_dim, 4 * in_dim)) + torch.eye(in_dim))
    right = torch.linalg.inv(right).expand(3, 1, in_dim, in_dim).to(torch.bfloat16)
    stacked = opt._direction(updates, None, right)
    alone = opt._direction(updates[1:2], None, right[1:2])
    assert torch.equal(alone[0], stacked[1])
    left = right[..., :out_dim, :out_dim] if out_dim <= in_dim else None
    if left is not None:
        assert torch.equal(opt._direction(updates[1:2], left[1:2], right[1:2])[0],
                           opt._direction(updates, left, right)[1])


def test_statistics_only_on_statistics_steps_and_refresh_then():
    net = make_net()
    opt = WhitenedMuon([net.a, net.b], lr=LR, statistics_every=3)
    seen = []
    for x, y in batches(7):
        opt.zero_grad()
        loss_of(net, x, y).backward()
        seen.append(bool(opt._statistics.pending))
        before = opt.state[net.a.weight].get("input_whitener")
        before = None if before is None else before.clone()
        opt.step()
        after = opt.state[net.a.weight]["input_whitener"]
        seen[-1] = (seen[-1], before is None or not torch.equal(before, after))
    assert seen == [(True, True), (False, False), (False, False), (True, True),
                    (False, False), (False, False), (True, True)]


@pytest.mark.parametrize("center_inputs", [False, None])
def test_layers_fed_one_tensor_get_its_covariance_and_an_in_place_change_is_seen(center_inputs):
    """q / k / v-style layers called on one tensor share its row product; a layer called after
    that tensor changed in place, or on another tensor, gets its own. Each factor is checked
    against ``xᵀx / rows`` written out (centred ``x`` by default: the layers have no bias), over
    two statistics steps (the exponential average), with factors of two widths refreshed in one batch."""
    torch.manual_seed(0)
    q, k, v = (nn.Linear(4, 3, bias=False).double() for _ in range(3))
    other = nn.Linear(4, 2, bias=False).double()
    wide = nn.Linear(6, 2, bias=False).double()
    opt = WhitenedMuon([q, k, v, other, wide], lr=LR, statistics_every=1, factor_decay=0.5, damping=DAMPING,
                       center_inputs=center_inputs)
    expected = {}
    for step in range(2):
        x = torch.randn(5, 4, dtype=torch.float64)
        z = torch.randn(5, 6, dtype=torch.float64)
        shuffled = x[:, [1, 0, 2, 3]]  # another tensor, at the same version as x
        (q(x).sum() + other(shuffled).sum() + k(x).sum()).backward()
        x.mul_(3.0)  # a new version of the tensor k read last: v must read the tripled rows
        (v(x).sum() + wide(z).sum()).backward()
        batch = {"q": x / 3.0, "k": x / 3.0, "v": x, "other": shuffled, "wide": z}
        for name, rows in batch.items():
            if center_inputs is None:
                rows = rows - rows.mean(dim=0)
            current = rows.T @ rows / rows.shape[0]
            expected[name] = current if step == 0 else 0.5 * expected[name] + 0.5 * current
        opt.step()
        opt.zero_grad()
    for name, layer in {"q": q, "k": k, "v": v, "other": other, "wide": wide}.items():
        state = opt.state[layer.weight]
        torch.testing.assert_close(state["input_factor"][0], expected[name], rtol=1e-12, atol=1e-12)
        f = expected[name]
        damped = f + DAMPING * torch.trace(f) / f.shape[0] * torch.eye(f.shape[0], dtype=f.dtype)
        whitener = state["input_whitener"][0]  # Tᵀ T = (F + λI)⁻¹
        torch.testing.assert_close(whitener.T @ whitener, torch.linalg.inv(damped), rtol=1e-10, atol=1e-12)
    # per-parameter state of its own (torch.optim's convention; checkpoints and memory
    # accounting see each whitener's own bytes), though the four 4-wide ones were refreshed as one batch
    whiteners = [opt.state[layer.weight]["input_whitener"] for layer in (q, k, v, other, wide)]
    assert all(w.untyped_storage().nbytes() == w.numel() * w.element_size() for w in whiteners)


def test_an_input_remembered_for_sharing_is_not_kept_alive():
    """The last input per width is remembered for q / k / v sharing by a weak reference: once
    backward has freed the graph, the caller's last reference frees the activation."""
    layer = nn.Linear(4, 3).double()
    opt = WhitenedMuon([layer], lr=LR, statistics_every=1)
    x = torch.randn(5, 4, dtype=torch.float64)
    layer(x).sum().backward()
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None
    opt.step()


def test_checkpoint_resumes_exactly():
    nets = [make_net(torch.float32) for _ in range(2)]
    opts = [WhitenedMuon([n.a, n.b], lr=LR, weight_decay=WD, statistics_every=2, output_side=True) for n in nets]
    data = batches(6, torch.float32)
    for step, (x, y) in enumerate(data):
        if step == 3:  # the second run restarts from a checkpoint, in a new optimizer
            saved = copy.deepcopy(opts[1].state_dict())
            opts[1].remove()
            opts[1] = WhitenedMuon([nets[1].a, nets[1].b], lr=LR, weight_decay=WD, statistics_every=2,
                                   output_side=True)
            opts[1].load_state_dict(saved)
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            loss_of(net, x, y).backward()
            opt.step()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(a, b)


def test_lr_scheduler_changes_the_step():
    net = make_net()
    opt = WhitenedMuon([net.a, net.b], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 1 else 1.0)
    for i, (x, y) in enumerate(batches(3)):
        opt.zero_grad()
        loss_of(net, x, y).backward()
        before = net.a.weight.detach().clone()
        opt.step()
        sched.step()
        assert torch.equal(net.a.weight, before) == (i >= 1)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(lr=0.0), ValueError, "lr"), (dict(lr=-1.0), ValueError, "lr"),
    (dict(damping=0.0), ValueError, "damping"), (dict(momentum=1.0), ValueError, "momentum"),
    (dict(output_damping=0.0), ValueError, "output_damping"),
    (dict(output_damping="0.1"), ValueError, "output_damping"),
    (dict(factor_decay=1.5), ValueError, "factor_decay"), (dict(statistics_every=0), ValueError, "statistics_every"),
    (dict(statistics_rows=0), ValueError, "statistics_rows"), (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(output_side=1), TypeError, "output_side"), (dict(output_side="tall"), ValueError, "output_side"),
    (dict(ns_dtype=torch.int32), ValueError, "ns_dtype"),
    (dict(root="qr"), ValueError, "root"), (dict(block_size=0), ValueError, "block_size"),
    (dict(center_inputs="auto"), TypeError, "center_inputs"), (dict(center_inputs=[1]), TypeError, "center_inputs"),
    (dict(center_inputs=["("]), ValueError, "center_inputs"), (dict(center_inputs=0), TypeError, "center_inputs"),
    (dict(adjust_lr_fn="spectral"), ValueError, "adjust_lr_fn"),
])
def test_bad_arguments_fail_at_construction_naming_them(kwargs, error, name):
    net = make_net()
    with pytest.raises(error, match=name):
        WhitenedMuon([net.a, net.b], **kwargs)


def test_modules_the_adapters_do_not_know_are_refused_at_construction_naming_them():
    """Refused when the optimizer is built, never at the first forward: a norm, an embedding
    (an nn.Embedding weight is [num, dim], applied by lookup, not to the last dim of an input)
    and a grouped convolution are named with their position and kind."""
    with pytest.raises(ValueError, match=r"modules\[1\] \(LayerNorm\)"):
        WhitenedMuon([nn.Linear(3, 3), nn.LayerNorm(3)])
    with pytest.raises(ValueError, match=r"modules\[0\] \(Embedding\)"):
        WhitenedMuon([nn.Embedding(10, 3), nn.Linear(3, 3)])
    with pytest.raises(ValueError, match=r"modules\[0\] \(Conv2d\).*groups=2"):
        WhitenedMuon([nn.Conv2d(4, 4, 3, groups=2)])
    with pytest.raises(TypeError, match=r"modules\[0\]"):
        WhitenedMuon([nn.Linear(3, 3).weight])
    with pytest.raises(ValueError, match="empty"):
        WhitenedMuon([])
    shared = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="twice"):
        WhitenedMuon([shared, shared])
    with pytest.raises(ValueError, match="skip_layers"):
        WhitenedMuon([nn.Linear(3, 3)], skip_layers=["lm_head"])


def test_a_non_finite_gradient_skips_that_weight_and_is_reported():
    net = make_net(torch.float32)
    opt = WhitenedMuon([net.a, net.b], lr=LR, weight_decay=WD, statistics_every=3)
    opt.nonfinite_warn_interval = 3  # the counters are read on steps 1, 4, 7, ...
    data = batches(3, torch.float32)
    for x, y in data[:2]:
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()
    a_before, b_before = net.a.weight.detach().clone(), net.b.weight.detach().clone()
    buf_before = opt.state[net.a.weight]["momentum_buffer"].clone()
    opt.zero_grad()
    loss_of(net, *data[2]).backward()
    net.a.weight.grad[0, 0] = float("nan")
    opt.step()  # the third step: the counters are not read
    assert torch.equal(net.a.weight, a_before)
    assert torch.equal(opt.state[net.a.weight]["momentum_buffer"], buf_before)
    assert not torch.equal(net.b.weight, b_before)  # the other weight stepped
    assert torch.isfinite(net.b.weight).all()
    opt.zero_grad()
    loss_of(net, *data[0]).backward()
    with pytest.warns(RuntimeWarning, match=r"modules\[0\]\.weight \(shape \(7, 5\)\): 1 step"):
        opt.step()  # the fourth step reads them and reports it
    assert torch.isfinite(net.a.weight).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in data * 2:  # reported once, not again (steps 7 and 10 read the counters)
            opt.zero_grad()
            loss_of(net, x, y).backward()
            opt.step()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_in_a_stack_leaves_only_its_own_weight_behind(bad):
    """Weights of one shape step as one stack. The one whose gradient is not finite keeps its
    weight (weight decay included) and momentum bitwise; its twins step bitwise as they do
    in a stack without it."""
    def run(stepped: list[int], spoil: bool):
        torch.manual_seed(0)
        modules = [nn.Linear(6, 6, bias=False) for _ in range(3)]
        opt = WhitenedMuon([modules[i] for i in stepped], lr=LR, weight_decay=WD, momentum=MOMENTUM,
                           statistics_every=2)
        g = torch.Generator().manual_seed(3)
        for step in range(4):
            x = torch.randn(16, 6, generator=g)
            opt.zero_grad()
            sum(m(x).square().mean() for m in modules).backward()
            if spoil and step == 3:
                before = [m.weight.detach().clone() for m in modules]
                momentum = opt.state[modules[1].weight]["momentum_buffer"].clone()
                modules[1].weight.grad[2, 4] = bad
            opt.step()
        if spoil:
            assert torch.equal(modules[1].weight, before[1])
            assert torch.equal(opt.state[modules[1].weight]["momentum_buffer"], momentum)
            assert not torch.equal(modules[0].weight, before[0]) and not torch.equal(modules[2].weight, before[2])
        return modules

    three = run([0, 1, 2], spoil=True)
    two = run([0, 2], spoil=False)
    for i in (0, 2):
        assert torch.equal(three[i].weight, two[i].weight)


# ----------------------------------------------------------------------------- distributed
STEPS = 5


# Centred (the default for these bias-free layers: each rank's row sums and mean terms join the
# all-reduce) and uncentred, one side and both: (output_side, center_inputs, output_damping); and
# the output side with a damping of its own, whose refresh decomposes the two sides' runs apart.
DIST_VARIANTS = [*itertools.product((False, True, "wide"), (None, False), (None,)), (True, None, 0.03)]


def _dist_train(rank: int, world: int, output_side: bool | str, center_inputs: bool | None,
                output_damping: float | None) -> dict:
    net = make_net()
    opt = WhitenedMuon([net.a, net.b], lr=LR, weight_decay=WD, statistics_every=2, output_side=output_side,
                       ns_dtype=torch.float64, center_inputs=center_inputs, output_damping=output_damping)
    params = list(net.parameters())
    identical = []
    for x, y in batches(STEPS):
        per = x.shape[0] // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        loss_of(net, x, y).backward()
        identical.append(step_as_ddp(opt, params, world))
    return {"params": [p.detach().clone() for p in params], "identical": identical}


def _dist_worker(rank: int, world: int, out_dir: str) -> dict:
    """Every variant in turn, in one spawn per world size (a spawn costs more than the runs)."""
    return {variant: _dist_train(rank, world, *variant) for variant in DIST_VARIANTS}


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("whitened_muon_worlds")
    return {world: run_workers(_dist_worker, world, out / f"w{world}", timeout=240) for world in (1, 2, 4)}


@pytest.mark.parametrize("variant", DIST_VARIANTS, ids=str)
def test_any_world_size_gives_the_one_process_result(dist_runs, variant):
    single = dist_runs[1][0][variant]
    start = make_net()
    moved = sum((p - q).abs().max() for p, q in zip(single["params"], start.parameters()))
    assert moved > 1e-3  # the steps did something
    for world in (2, 4):
        for rank in dist_runs[world]:
            run = rank[variant]
            assert all(run["identical"])
            for got, want in zip(run["params"], single["params"]):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_failed_cholesky_keeps_the_previous_whitener_and_an_unseen_layer_gets_the_identity():
    net = make_net()
    opt = WhitenedMuon([net.a, net.b], lr=LR)
    good = torch.diag(torch.tensor([4.0, 1, 1, 1, 1], dtype=torch.float64))[None]
    previous = opt._statistics.whitener(good, None)
    lam = DAMPING * 8 / 5
    torch.testing.assert_close(previous[0].T @ previous[0],
                               torch.linalg.inv(good[0] + lam * torch.eye(5, dtype=torch.float64)))
    not_positive = -10 * torch.eye(5, dtype=torch.float64)[None]
    assert torch.equal(opt._statistics.whitener(not_positive, previous), previous)
    assert torch.equal(opt._statistics.whitener(not_positive, None), torch.eye(5, dtype=torch.float64)[None])
    assert torch.equal(opt._statistics.whitener(torch.zeros(1, 5, 5, dtype=torch.float64), None),
                       torch.eye(5, dtype=torch.float64)[None])


def test_the_refresh_keeps_each_whitener_it_cannot_decompose(monkeypatch):
    """The same fallback through the optimizer's batched refresh: the weights of a layout whose
    decomposition fails keep the whitener they had (bitwise), the identity at the first
    refresh; the other layout refreshes (``Tᵀ T = (F + λI)⁻¹`` in float64)."""
    net = make_net()
    opt = WhitenedMuon([net.a, net.b], lr=LR, statistics_every=1, damping=DAMPING, center_inputs=False)
    failing: set[int] = set()  # the input widths whose decomposition fails
    original = opt._statistics.decompose

    def decompose(factor, overwrite, **kwargs):
        width = factor.shape[-1]
        whitener, good = original(factor, overwrite, **kwargs)
        return whitener, (torch.zeros_like(good) if width in failing else good)

    monkeypatch.setattr(opt._statistics, "decompose", decompose)

    def whitener_of(layer):
        return opt.state[layer.weight]["input_whitener"]

    def assert_refreshed(layer):
        factor, t = opt.state[layer.weight]["input_factor"][0], whitener_of(layer)[0]
        size = factor.shape[-1]
        damped = factor + DAMPING * factor.trace() / size * torch.eye(size, dtype=torch.float64)
        torch.testing.assert_close(t.T @ t, torch.linalg.inv(damped), rtol=1e-9, atol=1e-11)

    for step, ((x, y), fails) in enumerate(zip(batches(2), (net.a, net.b))):
        failing.clear()
        failing.add(fails.in_features)
        before = {layer: None if "input_whitener" not in opt.state[layer.weight] else whitener_of(layer).clone()
                  for layer in (net.a, net.b)}
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()
        kept = before[fails] if step else torch.eye(fails.in_features, dtype=torch.float64)[None]
        assert torch.equal(whitener_of(fails), kept)
        refreshed = net.b if fails is net.a else net.a
        assert_refreshed(refreshed)
        assert not torch.equal(whitener_of(refreshed)[0], torch.eye(refreshed.in_features, dtype=torch.float64))


def test_a_compiled_model_gets_the_eager_steps():
    """The statistics hooks keep working under ``torch.compile`` (they read a step count that
    changes between statistics steps): the compiled run follows the eager one."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    eager, compiled = make(), make()
    opts = [WhitenedMuon([n[0], n[2]], lr=0.02, statistics_every=3, ns_dtype=torch.float32) for n in (eager, compiled)]
    runs = [(eager, opts[0]), (torch.compile(compiled), opts[1])]
    g = torch.Generator().manual_seed(1)
    for _ in range(7):
        x = torch.randn(32, 8, generator=g)
        for net, opt in runs:
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    assert opts[1].state[compiled[0].weight]["step"] == 7
    for layer in (0, 2):  # the hooks fired in the compiled model: the same factors as eager
        got = opts[1].state[compiled[layer].weight]["input_factor"]
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, opts[0].state[eager[layer].weight]["input_factor"], rtol=1e-5, atol=1e-7)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    start = make()
    assert (compiled[0].weight - start[0].weight).abs().max() > 1e-3


def test_autocast_inputs_enter_the_factor_in_float32_and_a_scaler_skipped_step_drops_its_rows():
    """Under bfloat16 autocast a layer after a bf16 matmul gets bf16 inputs: its factor must be
    their (centred) row covariance computed in float32 (a bf16 product would be off by ~1e-2), and the
    weights stay float32. A step that GradScaler skips (an Inf gradient) does not step the
    optimizer, and the ``zero_grad`` after it drops its rows (an abandoned iteration, the very
    first one included): the first refresh averages the next batch's alone."""
    torch.manual_seed(0)
    net = Net(dims=(16, 32, 8))  # float32
    opt = WhitenedMuon([net.a, net.b], lr=LR, statistics_every=1, factor_decay=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    seen = []
    original = net.b.forward

    def recording(x):
        seen.append(x.detach().clone())
        return original(x)

    net.b.forward = recording
    weights = [w.detach().clone() for w in (net.a.weight, net.b.weight)]
    for step in range(2):
        x, y = torch.randn(6, 16), torch.randn(6, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(net, x, y)
        scaler.scale(loss.float()).backward()
        if step == 0:
            net.a.weight.grad[0, 0] = float("inf")  # an overflow: GradScaler skips this step
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step == 0:
            assert all(torch.equal(w, p) for w, p in zip(weights, (net.a.weight, net.b.weight)))
            assert "input_factor" not in opt.state[net.b.weight]
    assert all(x.dtype == torch.bfloat16 for x in seen)  # the input the hook saw: tanh of a bf16 matmul
    rows = seen[1].reshape(-1, 32).double()  # the skipped step's rows were dropped
    rows = rows - rows.mean(dim=0)  # centred (no bias)
    expected = rows.T @ rows / rows.shape[0]
    factor = opt.state[net.b.weight]["input_factor"][0]
    assert factor.dtype == torch.float32 and net.b.weight.dtype == torch.float32
    torch.testing.assert_close(factor.double(), expected, rtol=1e-5, atol=1e-6)
    assert all(torch.isfinite(w).all() for w in (net.a.weight, net.b.weight))
    assert not all(torch.equal(w, p) for w, p in zip(weights, (net.a.weight, net.b.weight)))


def test_non_finite_steps_after_loading_an_earlier_checkpoint_are_reported():
    """Rolling back to an earlier checkpoint lowers the counters below what was reported: the
    non-finite steps after the load must still be reported, not hidden under the old count."""
    net = make_net(torch.float32)
    opt = WhitenedMuon([net.a, net.b], lr=LR)
    opt.nonfinite_warn_interval = 3  # the counters are read on steps 1, 4, 7, ...
    data = batches(2, torch.float32)

    def step(nan: bool) -> None:
        opt.zero_grad()
        loss_of(net, *data[0]).backward()
        if nan:
            net.a.weight.grad[0, 0] = float("nan")
        opt.step()

    step(False)  # step 1
    early = copy.deepcopy(opt.state_dict())
    step(True)
    step(True)
    with pytest.warns(RuntimeWarning, match=r"\(shape \(7, 5\)\): 3 step"):
        step(True)  # step 4 reads the counter: 3
    opt.load_state_dict(early)  # the counter is 0 again
    step(True)
    step(True)
    with pytest.warns(RuntimeWarning, match=r"modules\[0\]\.weight \(shape \(7, 5\)\): [23] step"):
        step(False)  # step 7 reads it: 2 non-finite steps since the load


@pytest.mark.parametrize("names, biased, centred", [
    (("q_proj", "k_proj", "v_proj"), (), {"attn.q_proj", "attn.k_proj"}),  # the pair, not the value
    (("q_proj", "kv_proj", "o_proj"), (), {"attn.q_proj", "attn.kv_proj", "attn.o_proj"}),  # a query alone: all
    (("wq", "wk", "wo"), (), {"attn.wq", "attn.wk"}),
    # Qwen2: the query, key and value have biases, which carry the shift: nothing is centred
    (("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj", "k_proj", "v_proj"), set()),
    (("q_proj", "k_proj", "o_proj"), ("q_proj",), {"attn.k_proj"}),  # of the pair, the bias-free one
])
def test_the_default_centres_a_query_and_key_pair_under_one_module(names, biased, centred):
    """Where an attention's query and key are recognised by name, the bias-free ones of them
    are centred and no other layer; with no pair, every bias-free layer."""
    attn = nn.Module()
    for name in names:
        setattr(attn, name, nn.Linear(4, 4, bias=name in biased))
    model = nn.Module()
    model.attn = attn
    opt = WhitenedMuon(model, lr=LR)
    assert {opt._names[i].removesuffix(".weight") for i in opt._statistics.centered} == centred


def test_a_finite_float16_gradient_with_a_norm_beyond_float16_steps_as_a_small_one():
    """A float16 gradient whose entries are finite but whose Frobenius norm exceeds float16's
    range (a loss summed over a large batch) is stepped, not taken for non-finite: Muon's step
    does not depend on the gradient's scale, so it steps as the same gradient 2**-10 smaller."""
    torch.manual_seed(0)
    net = nn.Linear(64, 96, bias=False).half()
    x = torch.randn(256, 64).half()
    weights = []
    for scale in (1.0, 2.0 ** -10):
        model = copy.deepcopy(net)
        opt = WhitenedMuon(model, lr=1e-2, statistics_every=1, output_side=False, ns_dtype=torch.float32)
        model.weight.grad = None
        (model(x).float().square().sum() * 100 * scale).backward()
        g = model.weight.grad
        assert torch.isfinite(g).all()
        if scale == 1.0:  # its norm overflows float16, its entries do not
            assert not torch.isfinite(torch.linalg.vector_norm(g))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "non-finite gradients" report
            opt.step()
        assert int(opt.state[model.weight]["nonfinite_steps"]) == 0
        weights.append(model.weight.detach().float())
    assert not torch.equal(weights[0], net.weight.float())
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=1e-3)


def test_training_in_eval_mode_is_warned_about_not_stepped_silently_as_muon():
    """Statistics are gathered in training mode only (a validation pass stays out of them). A
    model trained in ``eval()`` mode (dropout off for fine-tuning) would otherwise step every
    weight as plain Muon without a word."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    opt = WhitenedMuon(net, lr=1e-2, statistics_every=1)
    x = torch.randn(32, 8)
    with pytest.warns(RuntimeWarning, match=r"eval\(\) mode.*0\.weight, 2\.weight"):
        net(x).square().mean().backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        # a validation forward in eval() mode beside a training one is no reason to warn
        fresh = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        other = WhitenedMuon(fresh, lr=1e-2, statistics_every=1)
        for _ in range(2):
            fresh.train()
            fresh(x).square().mean().backward()
            fresh.eval()
            fresh(x).square().mean()  # grad enabled, never backpropagated
            other.step()
            other.zero_grad()



def test_a_parameter_frozen_at_construction_and_unfrozen_later_is_warned_about():
    """The model form takes the parameters that train when it is built. One frozen then
    (a backbone frozen for the first steps) and unfrozen later gets gradients that no group
    steps: said once, naming it, instead of a layer that silently never trains."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    for p in net[0].parameters():
        p.requires_grad_(False)
    opt = WhitenedMuon(net, lr=1e-2)
    x = torch.randn(32, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # frozen and without a gradient: nothing to say
        net(x).square().mean().backward()
        opt.step()
    for p in net[0].parameters():
        p.requires_grad_(True)
    opt.step()  # a step with nothing new: the warning comes at the first step with the gradients
    before = net[0].weight.detach().clone()
    with pytest.warns(RuntimeWarning, match=r"0\.weight, 0\.bias.*frozen.*built"):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    assert torch.equal(net[0].weight, before)  # the warning tells the truth: not stepped
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        net(x).square().mean().backward()
        opt.step()
    # added to a group, it steps and is no longer reported
    fresh = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    fresh[0].bias.requires_grad_(False)
    other = WhitenedMuon(fresh, lr=1e-2)
    other.nonfinite_warn_interval = 1
    fresh[0].bias.requires_grad_(True)
    other.add_param_group({"params": [fresh[0].bias], "algorithm": "adamw", "lr": 1e-3})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh(x).square().mean().backward()
        other.step()


def test_a_parameter_swapped_into_a_group_after_construction_is_refused_by_name():
    """A wrapper that replaces the model's parameters after the optimizer was built (Accelerate's
    ``prepare`` with FSDP2 swaps each param-group entry for its sharded replacement) leaves the
    hooks and whiteners on the old parameters: the step says so, before anything changes,
    instead of failing on an internal lookup."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = WhitenedMuon(net, lr=1e-2)
    replacement = nn.Parameter(net[2].weight.detach().clone())
    group = next(g for g in opt.param_groups if g["algorithm"] == "whitened_muon")
    position = next(i for i, q in enumerate(group["params"]) if q is net[2].weight)
    group["params"][position] = replacement
    net[2].weight = replacement
    net(torch.randn(4, 8)).square().mean().backward()
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match=r"not one it was built on.*sharded.*after"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_a_sparse_embedding_is_refused_at_construction_and_a_sparse_gradient_before_anything_moves():
    """Neither half steps sparse gradients (as torch.optim.AdamW): the model form refuses a
    module that makes them, naming it; a sparse gradient that reaches a group anyway (the list
    form with add_param_group) is refused at the step before any weight moves."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8, sparse=True), nn.Linear(8, 8), nn.Linear(8, 2))
    with pytest.raises(TypeError, match=r"sparse.*\b0\b.*sparse=True"):
        WhitenedMuon(model, lr=1e-2)
    model[0].weight.requires_grad_(False)  # a frozen sparse embedding makes no gradient: fine
    WhitenedMuon(model, lr=1e-2)
    model[0].weight.requires_grad_(True)
    opt = WhitenedMuon([model[1], model[2]], lr=1e-2)
    opt.add_param_group({"params": [model[0].weight], "algorithm": "adamw"})
    model(torch.randint(0, 10, (4, 3))).square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="sparse gradients: param group 1"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all("step" not in opt.state[p] for p in model.parameters())


@pytest.mark.parametrize("saved_dtype,loaded_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64)])
def test_a_checkpoint_loads_into_the_model_in_another_dtype_and_steps(saved_dtype, loaded_dtype):
    """Factors and whiteners are made in the parameter's dtype, float32 or wider: loaded into
    the model in another dtype they take this one (its refresh adds this model's statistics
    to them), as a model cast with .to() before the load expects."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(saved_dtype)
    opt = WhitenedMuon(net, lr=1e-2, statistics_every=1)
    x = torch.randn(32, 8)
    for _ in range(2):
        opt.zero_grad()
        net(x.to(saved_dtype)).square().mean().backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    other = copy.deepcopy(net).to(loaded_dtype)
    resumed = WhitenedMuon(other, lr=1e-2, statistics_every=1)
    resumed.load_state_dict(saved)
    factor = resumed.state[other[0].weight]["input_factor"]
    assert factor.dtype == loaded_dtype
    torch.testing.assert_close(factor, saved["state"][0]["input_factor"].to(loaded_dtype))
    for _ in range(2):
        resumed.zero_grad()
        other(x.to(loaded_dtype)).square().mean().backward()
        resumed.step()
    assert all(torch.isfinite(p).all() for p in other.parameters())


def test_a_side_block_size_does_not_divide_is_named_at_construction():
    """``block_size`` blocks only the sides it divides: a wider side it does not divide is
    whitened whole (its factor one ``width x width`` block), and a warning at construction
    names it, so a mistyped size does not silently cost the dense whitener."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 9, bias=False), nn.Linear(9, 8, bias=False), nn.Linear(8, 4, bias=False))
    with pytest.warns(UserWarning, match=r"block_size=4.*'0\.weight'.*output \(9 wide\).*"
                                         r"'1\.weight'.*input \(9 wide\)") as caught:
        opt = WhitenedMuon(net, lr=LR, statistics_every=1, output_side=True, block_size=4)
    message = str(next(w.message for w in caught if "block_size" in str(w.message)))
    assert "2.weight" not in message and "'0.weight' input" not in message  # 12, 8 and 4 wide: divided
    x = torch.randn(16, 12)
    net(x).square().mean().backward()
    opt.step()
    assert opt.state[net[0].weight]["input_factor"].shape == (3, 4, 4)
    assert opt.state[net[0].weight]["output_factor"].shape == (1, 9, 9)  # whole, as the warning says
    assert opt.state[net[1].weight]["input_factor"].shape == (1, 9, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        WhitenedMuon(copy.deepcopy(net), lr=LR, output_side=True, block_size=16)  # no side is wider
        WhitenedMuon(copy.deepcopy(net), lr=LR, output_side=True, block_size=None)


DISAGREEING = {"statistics_every": (2, 3), "damping": (0.1, 0.2), "block_size": (None, 2), "lr": (0.05, 0.06)}


def _agreement_worker(rank, world, out):
    """Each rank builds WhitenedMuon with its own value of each setting in turn (the error text,
    or None), then all with the same values (one spawn: the refusals leave the group usable)."""
    errors = {}
    for setting, values in DISAGREEING.items():
        try:
            WhitenedMuon(make_net(), **{"lr": LR, setting: values[rank]})
            errors[setting] = None
        except ValueError as err:
            errors[setting] = str(err)
    WhitenedMuon(make_net(), lr=LR, statistics_every=2, damping=0.2)
    return errors


def test_ranks_that_disagree_on_a_setting_fail_at_construction_naming_it(tmp_path):
    """A setting that differs across ranks would hang the statistics' all-reduce (another
    interval), abort it (another layout) or let the ranks drift apart silently (another
    damping or lr): every rank refuses it at construction instead, naming it. Ranks that agree
    build as before."""
    ranks = run_workers(_agreement_worker, 2, tmp_path, timeout=120)
    for setting in DISAGREEING:
        assert all(e[setting] is not None and setting in e[setting] and "ranks" in e[setting] for e in ranks), (
            setting, [e[setting] for e in ranks])
