"""The method-agnostic engine: batched apply against the dense reference, the
checkpoint format's versions, a method plugged in from outside the engine, the non-finite
layer under kl_clip, and the collectives on strided tensors the batched path produces."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dist_utils import run_workers
from kfac_reference import Capture, DenseKFAC, grad_matrix
from kron_precond import KronPreconditioner, validation
from kron_precond.methods import registry
from kron_precond.methods.base import LayerMethod, MethodSpec, Option, Selected
from kron_precond.schedules import IntervalSchedule

F64 = torch.float64
FIXTURES = Path(__file__).parent / "fixtures"


def deep_mlp(blocks: int = 4, width: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(5, width), nn.Tanh()]
    for _ in range(blocks):  # equal shapes: preconditioned together in one batch
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 3))
    return nn.Sequential(*layers).double()


def data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 5, generator=g, dtype=F64), torch.randn(32, 3, generator=g, dtype=F64)


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
@pytest.mark.parametrize("outer", [True, False])
def test_batched_apply_matches_dense_reference(compute_method, outer):
    model = deep_mlp()
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    precond = KronPreconditioner(model, damping=1e-2, kl_clip=1e-3, lr=0.3, inv_dtype=F64,
                                 compute_method=compute_method, compute_eigenvalue_outer_product=outer,
                                 inv_update_steps=2)
    dense = DenseKFAC(linears, damping=1e-2, compute_method=compute_method, kl_clip=1e-3, lr=0.3,
                      inv_update_steps=2)
    for step in range(4):
        capture = Capture(linears)
        model.zero_grad()
        x, y = data(step)
        ((model(x) - y) ** 2).mean().backward()
        for name in linears:
            (a, out), = capture.calls[name]
            dense.observe(name, [torch.cat([a, a.new_ones(a.shape[0], 1)], 1)], [out.grad * a.shape[0]])
        capture.handles and [h.remove() for h in capture.handles]
        expected = dense.precondition({n: grad_matrix(m) for n, m in linears.items()})
        precond.step()
        for name, module in linears.items():
            got = grad_matrix(module)
            err = (got - expected[name]).norm() / expected[name].norm()
            assert err < 1e-9, f"step {step} layer {name}: relative error {err:.2e}"


def test_batched_layers_share_storage_and_keep_updating():
    """After batching, the refreshed state lives in one stack; later refreshes must still reach
    apply (a stale stack would keep using the first decomposition)."""
    model = deep_mlp()
    precond = KronPreconditioner(model, damping=1e-2, kl_clip=None, inv_dtype=F64)
    previous = None
    for step in range(3):
        model.zero_grad()
        x, y = data(step)
        ((model(x) - y) ** 2).mean().backward()
        raw = grad_matrix(model[2]).clone()
        precond.step()
        layer = precond.layers["2"]
        a, g = layer.a_factor, layer.g_factor
        ref = torch.linalg.solve(torch.kron(g, a) + 1e-2 * torch.eye(a.shape[0] * g.shape[0], dtype=F64),
                                 raw.reshape(-1)).reshape(raw.shape)
        assert torch.allclose(grad_matrix(model[2]), ref, rtol=1e-9, atol=1e-12), f"step {step}"
        if previous is not None:
            assert not torch.allclose(a, previous)
        previous = a.clone()


def _kfac_dense(layer, raw: torch.Tensor, damping: float) -> torch.Tensor:
    """K-FAC's exact step for one ``[W | b]`` gradient from the layer's own factors, in float64."""
    a, g = layer.a_factor, layer.g_factor
    eye = torch.eye(a.shape[0] * g.shape[0], dtype=F64)
    return torch.linalg.solve(torch.kron(g, a) + damping * eye, raw.reshape(-1)).reshape(raw.shape)


def test_a_batch_whose_members_change_keeps_using_each_layers_current_state():
    """Equal-shape layers are preconditioned as one stack. A layer without a gradient on one step
    (``zero_grad(set_to_none=True)`` and a branch not taken) changes the stack's members; when
    the old members come back, their gradients must be preconditioned with the current factors,
    not with a stack left from before."""
    model = deep_mlp()
    precond = KronPreconditioner(model, damping=1e-2, kl_clip=None, inv_dtype=F64, factor_update_steps=1,
                                 inv_update_steps=1)
    for step in range(5):
        model.zero_grad(set_to_none=True)
        x, y = data(step)
        ((model(x) - y) ** 2).mean().backward()
        if step == 1:  # layer 4's branch not taken: no gradient on this step
            model[4].weight.grad = model[4].bias.grad = None
        raw = {i: grad_matrix(model[i]).clone() for i in (2, 6) if model[i].weight.grad is not None}
        precond.step()
        for i, gradient in raw.items():
            expected = _kfac_dense(precond.layers[str(i)], gradient, 1e-2)
            err = (grad_matrix(model[i]) - expected).norm() / expected.norm()
            assert err < 1e-9, f"step {step} layer {i}: relative error {err:.2e}"


def test_a_damping_schedule_preconditions_with_each_steps_damping_and_keeps_one_stack():
    """``damping`` as a function of the step: every step's gradient is preconditioned with that
    step's damping (a value seen before must not bring back the stack built for it then), and the
    batched apply keeps one stack of the layers' state, not one per damping value seen."""
    model = deep_mlp()
    schedule = [1e-2, 3e-2, 1e-2, 3e-2, 2e-2, 1e-2]
    precond = KronPreconditioner(model, damping=lambda s: schedule[s], kl_clip=None, inv_dtype=F64,
                                 compute_method="eigen", factor_update_steps=1, inv_update_steps=1)
    for step, damping in enumerate(schedule):
        model.zero_grad()
        x, y = data(step)
        ((model(x) - y) ** 2).mean().backward()
        raw = grad_matrix(model[2]).clone()
        precond.step()
        expected = _kfac_dense(precond.layers["2"], raw, damping)
        err = (grad_matrix(model[2]) - expected).norm() / expected.norm()
        assert err < 1e-9, f"step {step} (damping {damping}): relative error {err:.2e}"
    stacks = [key for key in precond._apply_cache if key[0] == "batch"]
    assert len(stacks) == 3, stacks  # the first layer, the four equal-shape ones, the last


@pytest.mark.parametrize("method,options", [
    ("kfac", {}), ("ekfac", {"inv_update_steps": 1}), ("ikfac", {"factor_update_steps": 1, "inv_update_steps": 1}),
    ("shampoo", {}), ("soap", {"inv_update_steps": 1}), ("second_moment", {})])
def test_every_method_preconditions_a_layer_alike_whether_batched_or_alone(method, options):
    """A layer's written gradient does not depend on which same-shape layers shared its stack on
    earlier steps: the model with a layer that lacks a gradient on step 1 against the same model
    with that layer left out (``skip_layers``), the other layers' gradients identical in both.
    (PSGD draws random probes per layer, so leaving a layer out changes the others' draws: its
    cache is checked by the factors' versions instead.)"""
    def run(skip: bool) -> list[torch.Tensor]:
        model = deep_mlp()
        precond = KronPreconditioner(model, method=method, kl_clip=None, skip_layers=[r"^4$"] if skip else [],
                                     **options)
        written = []
        for step in range(5):
            model.zero_grad(set_to_none=True)
            x, y = data(step)
            ((model(x) - y) ** 2).mean().backward()
            if step == 1:
                model[4].weight.grad = model[4].bias.grad = None
            precond.step()
            written.append(torch.cat([model[i].weight.grad.flatten() for i in (2, 6)]))
        return written
    for step, (batched, alone) in enumerate(zip(run(False), run(True))):
        torch.testing.assert_close(batched, alone, rtol=1e-10, atol=1e-12, msg=f"{method}, step {step}")


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("case", ["kfac", "kfac-inverse", "psgd"])
def test_version_1_checkpoint_loads_and_continues_like_the_version_that_wrote_it(case):
    """tests/fixtures/v1_checkpoints.pt was written by kron_precond 0.1.0 (commit d5d680c), with
    the gradient that version produced one step after saving (make_v1_checkpoints.py)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_v1", FIXTURES / "make_v1_checkpoints.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    saved = torch.load(FIXTURES / "v1_checkpoints.pt", weights_only=False)[case]
    assert "version" not in saved["precond"], "fixture must be of the unversioned format"
    net = maker.model()
    net.load_state_dict(saved["model"])
    precond = KronPreconditioner(net, **maker.CASES[case])
    precond.load_state_dict(saved["precond"])
    assert precond.steps == 5
    x, y = maker.batch(5)
    ((net(x) - y) ** 2).mean().backward()
    precond.step()
    for p, expected in zip(net.parameters(), saved["next_grads"]):
        err = (p.grad - expected).norm() / expected.norm()
        assert err < 1e-6, f"{case}: relative error {err:.2e} against version 1's own next step"
    state = precond.state_dict()
    assert state["version"] == 2 and state["format"] == "kron_precond"


def test_checkpoint_from_a_newer_version_is_refused_and_changes_nothing():
    model = deep_mlp(1)
    precond = KronPreconditioner(model)
    state = precond.state_dict()
    state["version"] = 99
    with pytest.raises(ValueError, match="newer"):
        precond.load_state_dict(state)


@pytest.mark.parametrize("dropped", ["version", "statistics_steps", "refreshes", "schedule"])
def test_a_versioned_checkpoint_missing_an_entry_is_refused_and_changes_nothing(dropped):
    """A dict with ``"format"`` but no ``"version"`` is damaged (unversioned files never had a
    ``"format"``): it was read as one, its counters set to 0. A version-2 file missing one of
    its counters or its schedule is refused alike, before anything changes."""
    model = deep_mlp(1)
    precond = KronPreconditioner(model, factor_update_steps=1, inv_update_steps=2)
    for _ in range(3):
        model(torch.randn(8, model[0].in_features, dtype=model[0].weight.dtype)).square().mean().backward()
        precond.step()
        model.zero_grad()
    state = precond.state_dict()
    before = precond.state_dict()
    del state[dropped]
    with pytest.raises(ValueError, match=repr(dropped) if dropped != "version" else "no 'version'"):
        precond.load_state_dict(state)
    after = precond.state_dict()
    assert {k: v for k, v in after.items() if k != "layers"} == {k: v for k, v in before.items() if k != "layers"}
    assert after["statistics_steps"] == 3


# ---------------------------------------------------------------------- a method from outside
class _RMSLayer(LayerMethod):
    """Divides each gradient by the root of its running mean square, refreshed every 2 steps."""

    def __init__(self, params, device):
        self.parts = ("all",)
        self.shapes = [p.shape for _, p in params]
        self.mean_square = [torch.zeros(s, dtype=F64, device=device) for s in self.shapes]
        self.frozen = [torch.ones(s, dtype=F64, device=device) for s in self.shapes]
        self.nonfinite = torch.zeros((), dtype=torch.int64)

    def observe_gradients(self, grads, ctx):
        for m, g in zip(self.mean_square, grads):
            m.mul_(0.5).add_(g.square(), alpha=0.5)

    def refresh(self, part, grads, ctx):
        for f, m in zip(self.frozen, self.mean_square):
            f.copy_(m.sqrt() + ctx["eps"])

    def refreshed_tensors(self, part=None):
        return list(self.frozen)

    def release_refreshed(self):
        pass

    def apply(self, grads, ctx):
        return [g / f for g, f in zip(grads, self.frozen)]

    def factor_costs(self):
        return {"all": (1.0, 1.0)}

    def memory_by_kind(self):
        return {}

    def state_dict(self):
        return {"frozen": [f.clone() for f in self.frozen]}

    def check_state(self, state):
        pass

    def load_state_dict(self, state):
        for f, s in zip(self.frozen, state["frozen"]):
            f.copy_(s)


class _RMSSpec(MethodSpec):
    name = "test-rms"
    options = {"eps": Option(1e-3, validation.check_positive, per_step="refresh")}

    def select(self, model, is_skipped, log):
        return [Selected(n, m, list(m.named_parameters(recurse=False)))
                for n, m in model.named_modules() if isinstance(m, nn.Linear) and not is_skipped(n, m)]

    def make_layer(self, index, selected):
        return _RMSLayer(selected.params, selected.params[0][1].device)

    def make_schedule(self):
        return IntervalSchedule(1, 2, check=validation.check_int)


def test_a_method_plugs_in_through_the_registry_alone(monkeypatch):
    monkeypatch.setitem(registry.METHODS, _RMSSpec.name, _RMSSpec)
    model = deep_mlp(1)
    precond = KronPreconditioner(model, method="test-rms", eps=lambda step: 0.1 * (step + 1), skip_layers="^0$")
    assert sorted(precond.layers) == ["2", "4"]
    mean_square = {n: [torch.zeros_like(p) for p in model[int(n)].parameters()] for n in ("2", "4")}
    frozen = {n: [torch.ones_like(p) for p in model[int(n)].parameters()] for n in ("2", "4")}
    for step in range(4):
        model.zero_grad()
        x, y = data(step)
        ((model(x) - y) ** 2).mean().backward()
        raw = {n: [p.grad.clone() for p in model[int(n)].parameters()] for n in ("2", "4")}
        first = model[0].weight.grad.clone()
        precond.step()
        for n in ("2", "4"):
            for i, g in enumerate(raw[n]):
                mean_square[n][i] = 0.5 * mean_square[n][i] + 0.5 * g.square()
                if step % 2 == 0:
                    frozen[n][i] = mean_square[n][i].sqrt() + 0.1 * (step + 1)
                expected = g / frozen[n][i]
                torch.testing.assert_close(list(model[int(n)].parameters())[i].grad, expected)
        assert torch.equal(model[0].weight.grad, first), "a skipped layer must be untouched"
    with pytest.raises(TypeError, match="damping_typo"):
        KronPreconditioner(model, method="test-rms", damping_typo=1.0)


# ---------------------------------------------------------------------- non-finite layer
def test_non_finite_layer_neither_poisons_kl_clip_nor_others():
    model = deep_mlp(2)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    precond = KronPreconditioner(model, damping=1e-2, kl_clip=1e-4, lr=1.0, inv_dtype=F64)
    dense = DenseKFAC([n for n in linears if n != "2"], damping=1e-2, kl_clip=1e-4, lr=1.0)
    capture = Capture(linears)
    x, y = data(0)
    ((model(x) - y) ** 2).mean().backward()
    for name in dense.names:
        (a, out), = capture.calls[name]
        dense.observe(name, [torch.cat([a, a.new_ones(a.shape[0], 1)], 1)], [out.grad * a.shape[0]])
    model[2].weight.grad[1, 2] = float("nan")  # after the hooks: statistics are clean
    bad_raw = grad_matrix(model[2]).clone()
    expected = dense.precondition({n: grad_matrix(linears[n]) for n in dense.names})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        precond.step()
    assert any("2" in str(w.message) and "not finite" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    for name in dense.names:
        got = grad_matrix(linears[name])
        assert torch.isfinite(got).all(), f"layer {name} was poisoned"
        assert torch.allclose(got, expected[name], rtol=1e-9, atol=1e-12), name
    got = grad_matrix(model[2])
    finite = torch.isfinite(bad_raw)
    assert torch.isnan(got[1, 2]) and torch.isfinite(got[finite]).all()
    ratio = got[finite] / bad_raw[finite]  # passed through, scaled like the others
    assert torch.allclose(ratio, ratio[0].expand_as(ratio)) and 0 < float(ratio[0]) <= 1


# ---------------------------------------------------------------------- collectives
def _broadcast_strided(rank, world, out_dir):
    from kron_precond.distributed import collectives
    received = []
    for cap in (0, 1 << 20):
        base = torch.arange(12.0).reshape(3, 4)
        tensor = base[:, 1] if rank == 0 else torch.zeros(3)  # a strided view, as batched biases are
        collectives.broadcast([tensor], src=0, group=None, cap_bytes=cap).wait()
        received.append(tensor.clone())
    return received


def test_broadcast_of_a_strided_tensor_sends_its_values(tmp_path):
    results = run_workers(_broadcast_strided, 2, tmp_path, timeout=60)
    for cap, got in zip((0, 1 << 20), results[1]):
        assert torch.equal(got, torch.tensor([1.0, 5.0, 9.0])), f"cap {cap}: {got}"


def test_batched_psgd_apply_matches_explicit_kronecker_product():
    """Equal-shape layers go through one batched product; each must equal
    ``(Q_0ᵀQ_0 ⊗ Q_1ᵀQ_1) vec(∇)`` built explicitly (float64), clipped to RMS ≤ 1.1."""
    model = deep_mlp(3)
    precond = KronPreconditioner(model, method="psgd", preconditioner_update_probability=0.25,
                                 precond_dtype=F64, precond_lr=0.5)
    for step in range(6):
        model.zero_grad()
        x, y = data(step)
        ((model(x) - y) ** 2).mean().backward()
        raw = {n: [p.grad.clone() for p in m.parameters()] for n, m in model.named_children()
               if isinstance(m, nn.Linear)}
        refreshes = step % 4 == 3  # p = 1/4: the counter reaches 1 on every fourth step
        before = {n: {part: [q.clone() for q in qs] for part, qs in precond.layers[n].q_factors.items()}
                  for n in raw}
        precond.step()
        for name, grads in raw.items():
            qs = precond.layers[name].q_factors if refreshes else before[name]
            for (part, factors), g, p in zip(qs.items(), grads, model.get_submodule(name).parameters()):
                dense = None
                for q in factors:
                    qtq = torch.diag(q * q) if q.dim() == 1 else q.T @ q
                    dense = qtq if dense is None else torch.kron(dense, qtq)
                expected = (dense @ g.reshape(-1)).reshape(g.shape)
                rms = expected.square().mean().sqrt()
                expected = expected * min(1.0, 1.1 / float(rms))
                assert torch.allclose(p.grad, expected, rtol=1e-9, atol=1e-12), (step, name, part)


# ---------------------------------------------------------------------- per-step sums
def test_kl_sum_and_finiteness_match_float64_references():
    """The engine's per-step sums (signed L1 norms for Σ⟨V, ∇⟩, L2 norms for finiteness) against
    float64 dot products and ``isfinite``, in float32, float64 and float16."""
    from kron_precond.apply import _finite_per_layer, _kl_sum
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.float16):
        grads = [torch.randn(64, 48, generator=g).to(dtype) for _ in range(5)]
        values = [(3.0 * x.double() + torch.randn(x.shape, generator=g, dtype=F64)).to(dtype) for x in grads]
        keep = torch.tensor([True, True, False, True, True])
        expected = sum(torch.dot(v.double().reshape(-1), x.double().reshape(-1))
                       for i, (v, x) in enumerate(zip(values, grads)) if keep[i])
        total = _kl_sum(values, grads, keep)
        assert total.dtype == torch.promote_types(dtype, torch.float32)
        tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2}[dtype]
        assert abs(float(total) - float(expected)) <= tolerance * abs(float(expected))
        # finiteness: a NaN, an Inf, and large finite values that would overflow a float16 sum of squares
        layers = [[grads[0], grads[1]], [grads[2]], [grads[3]], [grads[4]]]
        layers[1][0] = layers[1][0].clone()
        layers[1][0][3, 4] = float("nan")
        layers[2][0] = layers[2][0].clone()
        layers[2][0][0, 0] = float("-inf")
        layers[3][0] = torch.full((64, 48), 2000.0, dtype=dtype)  # norm 1.1e5: past float16's max
        assert _finite_per_layer(layers, {}).tolist() == [True, False, False, True]


def test_a_kl_sum_past_float32s_range_clips_to_zero_not_nan():
    """⟨V, ∇⟩ summed as ‖max(x, 0)‖₁ − ‖min(x, 0)‖₁: with both signs past float32's range the
    difference is inf − inf. The sum is then infinite in size, and kl_clip's scale
    min(1, sqrt(κ / |lr² Σ|)) is 0, not NaN (which would turn every layer's update to NaN)."""
    from kron_precond.apply import _kl_clip_factor, _kl_sum

    values = [torch.tensor([3e38, -3e38, 1.0])]
    grads = [torch.tensor([10.0, 10.0, 1.0])]
    total = _kl_sum(values, grads, torch.tensor([True]))
    scale = _kl_clip_factor(total, 1e-3, 0.1)
    assert scale.item() == 0.0
    finite = _kl_clip_factor(torch.tensor(4.0), 1e-3, 0.1)  # sqrt(1e-3 / (0.01 · 4)) = 0.158...
    assert abs(finite.item() - (1e-3 / 0.04) ** 0.5) < 1e-7
