"""GPT-2 style ``Conv1D`` under FSDP2: ``fully_shard(module)`` changes the module's class to one
made on the fly (``FSDPConv1D``, a subclass of ``FSDPModule`` and ``Conv1D``) whose forward is
``Conv1D``'s. The layer is still recognised as a linear map stored ``[in, out]``: PSGD
preconditions it as its ``nn.Linear`` twin's ``[out, in]`` matrix and K-FAC takes it, as on the
unsharded model (one-rank mesh, float64). Also: a registered adapter factory that raises
something other than ``UnsupportedModule`` does not break PSGD, which needs no adapter.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from dist_utils import run_workers
from kron_precond import KronPreconditioner, modules
from kron_precond.modules import register_adapter, stores_weight_transposed

F64 = torch.float64
STEPS = 3


class Conv1D(nn.Module):
    """A look-alike of Hugging Face's ``Conv1D`` (``y = x @ W + b``, ``W`` stored ``[in, out]``)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return (x.reshape(-1, x.shape[-1]) @ self.weight + self.bias).reshape(*x.shape[:-1], self.nf)


def _model() -> nn.Sequential:
    torch.manual_seed(3)  # a non-square and a square layer (its factors' order matters)
    return nn.Sequential(Conv1D(7, 5), nn.Tanh(), Conv1D(7, 7), nn.Tanh(), Conv1D(3, 7)).to(F64)


def _train(model: nn.Module, kwargs: dict) -> tuple[list[torch.Tensor], KronPreconditioner]:
    precond = KronPreconditioner(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(11)
    for _ in range(STEPS):
        x = torch.randn(8, 5, generator=g, dtype=F64)
        y = torch.randn(8, 3, generator=g, dtype=F64)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        precond.step()
        opt.step()
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]
    return params, precond


METHODS = {"kfac": dict(method="kfac", inv_update_steps=2, inv_dtype=F64),
           "psgd": dict(method="psgd", precond_dtype=F64, preconditioner_update_probability=1.0),
           "psgd_one_diag": dict(method="psgd", precond_dtype=F64, memory_save_mode="one_diag")}


def conv1d_worker(rank: int, world: int, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    out = {}
    for name, kwargs in METHODS.items():
        sharded = _model()
        for module in sharded:
            if isinstance(module, Conv1D):
                fully_shard(module, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        classes = [type(m).__name__ for m in sharded if isinstance(m, Conv1D)]
        got, precond = _train(sharded, kwargs)
        expected, reference = _train(_model(), kwargs)
        start = [p.detach() for p in _model().parameters()]
        gap = max(float((a - b).norm() / (b - s).norm()) for a, b, s in zip(got, expected, start))
        layers = sorted(layer.name for layer in precond._layers)
        transposed = {layer.name: getattr(layer.method, "transposed", None) for layer in precond._layers}
        out[name] = dict(gap=gap, layers=layers, reference_layers=sorted(layer.name for layer in reference._layers),
                         transposed=transposed, classes=classes,
                         recognised=[stores_weight_transposed(m) for m in sharded if isinstance(m, Conv1D)])
    return out


def test_fully_sharded_conv1d_is_preconditioned_as_unsharded(tmp_path):
    results = run_workers(conv1d_worker, 1, tmp_path, timeout=240)[0]
    for name, got in results.items():
        assert got["classes"] == ["FSDPConv1D"] * 3, got["classes"]  # what fully_shard makes
        assert got["recognised"] == [True] * 3, name
        assert got["layers"] == got["reference_layers"] == ["0", "2", "4"], (name, got["layers"])
        if name.startswith("psgd"):
            assert all(flags == (True, False) for flags in got["transposed"].values()), got["transposed"]
        assert got["gap"] <= 1e-12, f"{name}: fully_shard'ed Conv1D model differs from unsharded by {got['gap']:.2e}"


def test_fsdp2_class_is_not_an_overridden_forward():
    """The class ``fully_shard`` makes, without a process group: ``FSDPModule`` and ``Conv1D``."""
    from torch.distributed.fsdp import FSDPModule

    layer = Conv1D(4, 3)
    layer.__class__ = type("FSDPConv1D", (FSDPModule, Conv1D), {})
    assert modules.module_class(layer) is Conv1D
    assert modules._is_transposed_linear(layer)
    adapter, reason = modules.kfac_adapter(layer)
    assert isinstance(adapter, modules.TransposedLinearAdapter), reason

    linear = nn.Linear(3, 4)
    linear.__class__ = type("FSDPLinear", (FSDPModule, nn.Linear), {})
    assert type(modules.kfac_adapter(linear)[0]) is modules.KFACAdapter

    class Scaled(nn.Linear):  # a real override stays refused, sharded or not
        def forward(self, x):
            return super().forward(2 * x)

    scaled = Scaled(3, 4)
    scaled.__class__ = type("FSDPScaled", (FSDPModule, Scaled), {})
    adapter, reason = modules.kfac_adapter(scaled)
    assert adapter is None and "Scaled overrides forward" in reason, reason


def test_a_raising_adapter_factory_does_not_break_psgd(monkeypatch, caplog):
    """``kfac_adapter`` lets a factory's own error through (only ``UnsupportedModule`` says
    "skip"); PSGD, which asks only for the weight's layout, falls back to the built-in
    recognition and logs at debug."""
    monkeypatch.setattr(modules, "_ADAPTERS", list(modules._ADAPTERS))

    def broken(module):
        raise RuntimeError("factory bug")

    register_adapter(lambda m: isinstance(m, (Conv1D, nn.Linear)), broken)
    model = nn.Sequential(Conv1D(4, 3), nn.Tanh(), nn.Linear(4, 2)).to(F64)
    with pytest.raises(RuntimeError, match="factory bug"):
        modules.kfac_adapter(model[0])
    with caplog.at_level(logging.DEBUG, logger="kron_precond"):
        precond = KronPreconditioner(model, method="psgd", precond_dtype=F64)
    transposed = {layer.name: layer.method.transposed for layer in precond._layers}
    assert transposed == {"0": (True, False), "2": (False, False)}
    assert any("factory bug" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def skip_worker(rank: int, world: int, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    registered = {}
    for pattern in ("^Conv1D$", "^Tanh$"):
        model = _model()
        for module in model:
            if isinstance(module, Conv1D):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for method in ("kfac", "psgd"):
            try:
                registered[pattern, method] = sorted(KronPreconditioner(model, method=method,
                                                                        skip_layers=[pattern]).layers)
            except ValueError as err:  # nothing left to precondition
                registered[pattern, method] = str(err)
    return registered


def test_skip_layers_matches_the_class_a_sharded_module_was_written_as(tmp_path):
    """``fully_shard`` renames the class (``FSDPConv1D``): an anchored class pattern still
    skips the module, as on the unsharded model."""
    registered = run_workers(skip_worker, 1, tmp_path, timeout=120)[0]
    for method in ("kfac", "psgd"):
        assert not isinstance(registered["^Tanh$", method], str) and registered["^Tanh$", method]
        skipped = registered["^Conv1D$", method]
        assert isinstance(skipped, str) or skipped == [], (method, skipped)
