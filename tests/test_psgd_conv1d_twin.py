"""PSGD Kron on GPT-2 style ``Conv1D`` layers (weight stored ``[in, out]``) gives what it gives on
their ``nn.Linear`` twins (the same weights, transposed): the factors, the probes and the choice
of the diagonal side are those of the ``[out, in]`` matrix, whichever way the weight is stored.

Checked end to end in float64 (several preconditioned SGD steps, both models from the same
weights and data): default settings, ``memory_save_mode="one_diag"`` (a square layer's diagonal
factor goes on the output side, as for its twin), the fitted average, the Procrustes-style fit,
the estimated initial scale; layers of one shape are preconditioned together (batched), a
``Conv1D`` beside a ``Linear`` of the same ``[out, in]`` shape too. The preconditioner's state
is saved in the stored layout, as versions before saved it (the format does not depend on the
version, for ``torch.save`` and ``torch.distributed.checkpoint`` alike): the twin's with the
Conv1D weights' factor lists reversed and fitted averages transposed; it is read back in the
twin's layout.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kron_precond import KronPreconditioner
from kron_precond.methods.psgd_layer import PSGDLayer
from state_compare import assert_same

F64 = torch.float64


class Conv1D(nn.Module):
    """A look-alike of Hugging Face's ``Conv1D`` (``y = x @ W + b``, ``W`` stored ``[in, out]``),
    optionally without a bias; the library recognises it by its class name and ``nf``."""

    def __init__(self, nf: int, nx: int, bias: bool = True) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1) if bias else None

    def forward(self, x):
        y = x.reshape(-1, x.shape[-1]) @ self.weight
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.nf)


def hf_conv1d(nf: int, nx: int, bias: bool = True) -> nn.Module:
    if not bias:
        return Conv1D(nf, nx, bias=False)  # transformers' Conv1D always has one
    try:
        from transformers.pytorch_utils import Conv1D as HFConv1D
    except ImportError as err:
        pytest.skip(f"transformers' Conv1D is not importable ({err})")
    layer = HFConv1D(nf, nx)
    with torch.no_grad():
        layer.weight.normal_(std=0.3)
        layer.bias.normal_(std=0.1)
    return layer


# (name, in, out, bias): non-square, two square ones of one shape (batched together), non-square
# without a bias
LAYERS = [("a", 6, 10, True), ("b", 10, 10, True), ("d", 10, 10, True), ("c", 10, 4, False)]


class Net(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        for name, n_in, n_out, bias in LAYERS:
            setattr(self, name, make(name, n_in, n_out, bias))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) + torch.tanh(self.d(h))
        return self.c(h)


def twins(kind: str):
    """A model whose layers are Conv1D (``kind`` "hf" / "own"; "mixed": layer ``d`` is a Linear),
    and its all-Linear twin with the same weights."""
    conv = {"hf": hf_conv1d, "own": Conv1D, "mixed": Conv1D}[kind]

    def make(name, n_in, n_out, bias):
        if kind == "mixed" and name == "d":
            return nn.Linear(n_in, n_out, bias=bias)
        return conv(n_out, n_in, bias=bias)

    model = Net(make).to(F64)
    twin = Net(lambda name, n_in, n_out, bias: nn.Linear(n_in, n_out, bias=bias)).to(F64)
    with torch.no_grad():
        for (name, _, _, _), (_, layer) in zip(LAYERS, twin.named_children()):
            source = getattr(model, name)
            layer.weight.copy_(source.weight if isinstance(source, nn.Linear) else source.weight.T)
            if layer.bias is not None:
                layer.bias.copy_(source.bias)
    return model, twin


def canonical(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter with a Conv1D weight seen as ``[out, in]``."""
    out = {}
    for name, module in model.named_children():
        for pname, p in module.named_parameters():
            transposed = not isinstance(module, nn.Linear) and pname == "weight"
            out[f"{name}.{pname}"] = p.detach().T if transposed else p.detach()
    return out


def relative_difference(model: nn.Module, twin: nn.Module) -> float:
    mine, theirs = canonical(model), canonical(twin)
    return max(((mine[k] - theirs[k]).norm() / theirs[k].norm()).item() for k in theirs)


def _run(model: nn.Module, precond: KronPreconditioner, steps: range) -> None:
    """SGD on the preconditioned gradient over ``steps`` (each step's batch drawn from its number:
    a run resumed at a step sees the uninterrupted run's batches)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in steps:
        data = torch.Generator().manual_seed(100 + step)
        x = torch.randn(16, 6, generator=data, dtype=F64)
        y = torch.randn(16, 4, generator=data, dtype=F64)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        precond.step()
        optimizer.step()


def train(model: nn.Module, settings: dict, steps: int = 6) -> KronPreconditioner:
    precond = KronPreconditioner(model, method="psgd", precond_dtype=F64, **settings)
    _run(model, precond, range(steps))
    return precond


SETTINGS = {
    "default": {},
    "one_diag": {"memory_save_mode": "one_diag"},
    "momentum": {"momentum_into_precond_update": True},
    "procrustes": {"precond_update": "procrustes"},
    "estimated_scale": {"precond_init_scale": None},
}


@pytest.mark.parametrize("kind", ["hf", "own", "mixed"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_conv1d_model_steps_as_its_linear_twin(kind, setting, monkeypatch):
    batched = []
    original = PSGDLayer.apply_batch.__func__

    def spy(cls, layers, *args, **kwargs):
        batched.append(len(layers))
        return original(cls, layers, *args, **kwargs)

    monkeypatch.setattr(PSGDLayer, "apply_batch", classmethod(spy))
    model, twin = twins(kind)
    start = copy.deepcopy(twin)
    assert relative_difference(model, twin) == 0.0
    precond = train(model, SETTINGS[setting])
    reference = train(twin, SETTINGS[setting])
    difference = relative_difference(model, twin)
    assert difference < 1e-13, f"Conv1D model and its Linear twin part by {difference:.3g}"
    assert relative_difference(twin, start) > 1e-2  # the steps moved the weights
    assert max(batched) >= 2, "the square layers were not preconditioned together"
    # the twin's state, saved in the stored layout: the Conv1D weights' factors in the reverse
    # order, their fitted average transposed (as versions before wrote it)
    assert_same(precond.state_dict(), _stored_layout(reference.state_dict(), conv1d_layers(model)),
                tolerance=1e-12)


def test_one_diag_square_conv1d_puts_the_diagonal_factor_on_the_output_side():
    model, twin = twins("own")
    precond = train(model, {"memory_save_mode": "one_diag"}, steps=2)
    reference = train(twin, {"memory_save_mode": "one_diag"}, steps=2)
    for name in ("a", "b", "c"):
        mine = [q.shape for q in precond.layers[name].q_factors["weight"]]
        theirs = [q.shape for q in reference.layers[name].q_factors["weight"]]
        assert mine == theirs, (name, mine, theirs)
    assert [q.dim() for q in precond.layers["b"].q_factors["weight"]] == [1, 2]  # [out] diagonal, [in, in]


def conv1d_layers(model: nn.Module) -> dict[str, bool]:
    return {name: not isinstance(getattr(model, name), nn.Linear) for name, *_ in LAYERS}


def _stored_layout(state: dict, transposed: dict[str, bool]) -> dict:
    """The state of a model's Linear twin (``state``) as the format saves it for the model whose
    layers ``transposed`` are Conv1D: the weight's factor lists (``q``, Lipschitz estimates)
    reversed, its fitted average transposed -- built independently of the code under test."""
    old = copy.deepcopy(state)
    for name, layer in old["layers"].items():
        if not transposed[name]:
            continue
        entry = layer["factors"]["weight"]
        entry["q"] = entry["q"][::-1]
        if "lipschitz" in entry:
            entry["lipschitz"] = entry["lipschitz"][::-1]
        if layer["momentum"] is not None:
            layer["momentum"]["weight"] = layer["momentum"]["weight"].T.contiguous()
    return old


#: the entries of a PSGD layer's state as versions before this one wrote them (bf9acaf's
#: PSGDLayer.state_dict), and of each parameter's factors
OLD_LAYER_KEYS = {"factors", "momentum", "momentum_steps", "uses_per_update"}
OLD_FACTOR_KEYS = {"q", "initialized"}  # and "lipschitz" under precond_update="procrustes"


@pytest.mark.parametrize("setting", ["default", "procrustes"])
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_a_layer_state_has_the_entries_earlier_versions_wrote(kind, setting):
    """No entry was added: ``torch.distributed.checkpoint`` loads into this version's own
    state as a template, so an entry an earlier file lacks fails the load."""
    model, twin = twins("own")
    precond = train(twin if kind == "linear" else model, SETTINGS[setting], steps=2)
    extra = {"lipschitz"} if setting == "procrustes" else set()
    for name, layer in precond.state_dict()["layers"].items():
        assert set(layer) == OLD_LAYER_KEYS, (name, sorted(layer))
        for part, entry in layer["factors"].items():
            assert set(entry) == OLD_FACTOR_KEYS | extra, (name, part, sorted(entry))


@pytest.mark.parametrize("setting", ["default", "momentum", "procrustes"])
def test_a_state_in_the_stored_layout_is_read_in_the_twins_layout(setting):
    """The twin's state in the stored layout (what earlier versions saved for the Conv1D model)
    loads into the Conv1D model's preconditioner, which then steps as the twin's."""
    model, twin = twins("own")
    train(model, SETTINGS[setting], steps=3)
    reference = train(twin, SETTINGS[setting], steps=3)
    old = _stored_layout(reference.state_dict(), conv1d_layers(model))
    loaded = KronPreconditioner(model, method="psgd", precond_dtype=F64, **SETTINGS[setting])
    loaded.load_state_dict(copy.deepcopy(old))
    assert_same(loaded.state_dict(), old)
    for name in ("a", "b"):
        mine = loaded.layers[name].q_factors["weight"]
        theirs = reference.layers[name].q_factors["weight"]
        assert all(torch.equal(x, y) for x, y in zip(mine, theirs)), name  # kept in the twin's order


def test_a_stored_layout_state_whose_factors_do_not_fit_is_refused_and_changes_nothing():
    """Under ``one_diag`` a square Conv1D layer's factors were ``[in]`` diagonal and ``[out, out]``
    triangular (the first of the largest dims of ``[in, out]``); now they are ``[out]`` diagonal
    and ``[in, in]``: the old file does not fit (the non-square layers' files do), and the
    error says why."""
    model, twin = twins("own")
    reference = train(twin, {"memory_save_mode": "one_diag"}, steps=2)
    old = _stored_layout(reference.state_dict(), conv1d_layers(model))
    for name in ("b", "d"):  # what the old code saved for them: [in] diagonal first
        q = old["layers"][name]["factors"]["weight"]["q"]
        assert [t.dim() for t in q] == [2, 1]
        old["layers"][name]["factors"]["weight"]["q"] = [q[1], q[0]]
    loaded = train(model, {"memory_save_mode": "one_diag"}, steps=1)
    before = copy.deepcopy(loaded.state_dict())
    with pytest.raises(ValueError, match=r"state of b\.weight: the factor layout of a weight stored \[in, "
                                         r"out\].* changed.*diagonal side now follows the nn\.Linear twin"):
        loaded.load_state_dict(old)
    assert_same(loaded.state_dict(), before)


DCP_SETTINGS = {"momentum_into_precond_update": True, "precond_dtype": F64}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("memory_save_mode", [None, "one_diag"])
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_dcp_round_trip_resumes_as_the_uninterrupted_run(tmp_path, kind, memory_save_mode):
    """``torch.distributed.checkpoint`` loads into the fresh preconditioner's own state (a
    template, in place), then into the preconditioner: the run goes on as if not interrupted
    (a Linear model, and a Conv1D model with square layers)."""
    import torch.distributed.checkpoint as dcp

    model = twins("own")[1 if kind == "linear" else 0]
    settings = dict(DCP_SETTINGS, memory_save_mode=memory_save_mode)
    precond = KronPreconditioner(model, method="psgd", **settings)
    _run(model, precond, range(3))
    resumed = copy.deepcopy(model)
    dcp.save({"precond": precond}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    _run(model, precond, range(3, 5))
    fresh = KronPreconditioner(resumed, method="psgd", **settings)
    dcp.load({"precond": fresh}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    _run(resumed, fresh, range(3, 5))
    assert relative_difference(resumed, model) <= 1e-12


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_state_in_the_stored_layout_loads_and_steps_as_the_twin(tmp_path):
    """A checkpoint in the format earlier versions wrote (here: the Linear twin's state in the
    stored layout, saved with ``torch.distributed.checkpoint``) loads into the Conv1D model's
    preconditioner, square layers included, and the model then steps as its twin."""
    import torch.distributed.checkpoint as dcp

    model, twin = twins("own")
    reference = KronPreconditioner(twin, method="psgd", **DCP_SETTINGS)
    _run(twin, reference, range(3))
    with torch.no_grad():
        for name, *_ in LAYERS:
            getattr(model, name).weight.copy_(getattr(twin, name).weight.T)
            if getattr(twin, name).bias is not None:
                getattr(model, name).bias.copy_(getattr(twin, name).bias)
    old = _stored_layout(reference.state_dict(), conv1d_layers(model))
    dcp.save({"precond": old}, checkpoint_id=tmp_path / "old", no_dist=True)
    loaded = KronPreconditioner(model, method="psgd", **DCP_SETTINGS)
    dcp.load({"precond": loaded}, checkpoint_id=tmp_path / "old", no_dist=True)
    _run(twin, reference, range(3, 5))
    _run(model, loaded, range(3, 5))
    difference = relative_difference(model, twin)
    assert difference <= 1e-12, f"Conv1D model and its Linear twin part by {difference:.3g} after the load"


@pytest.mark.parametrize("settings", [{}, {"momentum_into_precond_update": True}])
def test_conv1d_steps_make_no_host_sync(monkeypatch, settings):
    """Transposing in and out reads nothing back: the refresh (every step here) and the batched
    apply of a Conv1D beside a Linear of one shape included."""
    from test_host_syncs import forbid_host_syncs

    model, _ = twins("mixed")
    precond = KronPreconditioner(model, method="psgd", preconditioner_update_probability=1.0, **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def steps(count):
        for _ in range(count):
            x, y = torch.randn(16, 6, dtype=F64), torch.randn(16, 4, dtype=F64)
            optimizer.zero_grad()
            (model(x) - y).square().mean().backward()
            precond.step()
            optimizer.step()

    steps(2)
    with monkeypatch.context() as m:
        forbid_host_syncs(m, "psgd")
        steps(4)
    assert all(torch.isfinite(p).all() for p in model.parameters())
