"""Shared pieces of the trainer-framework tests (HF Trainer, Lightning, Accelerate).

What every framework test checks, with references independent of kron_precond:

* it trains: the final loss of K-FAC + AdamW and PSGD + AdamW is below AdamW's, or within
  ``NOISE`` of it, from the same initial weights on the same batches;
* the preconditioner saw every micro-batch exactly once: its row counts for A and G are
  ``accumulation_steps × batch × rows per sample`` on every step, and the test's own hooks record the
  input rows and output-gradient rows of one layer in every training forward/backward;
  grouped ``accumulation_steps`` micro-batches per optimizer step, they must give that
  layer's K-FAC factors after every step (``A = mean ã ãᵀ``,
  ``G = mean δδᵀ``, ``δ = grad_output · N · accumulation_steps`` with ``N`` the rows of the
  call -- samples, or tokens for ``[B, T, D]`` inputs -- running average with
  ``factor_decay``), recomputed here in float64;
* a checkpoint saved by the framework resumes to the same parameters as the run that
  was never interrupted.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner, PreconditionedOptimizer, WhitenedMuon

NOISE = 0.10  # relative: a method's final loss may exceed AdamW's by at most this much
FACTOR_DECAY = 0.9
KFAC = dict(damping=1e-2, inv_update_steps=2, factor_decay=FACTOR_DECAY)
PSGD = dict(preconditioner_update_probability=1.0)


def require(module: str, extra: str = "trainers"):
    """Import ``module`` or skip, saying why (only when it truly cannot be imported)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        pytest.skip(f"{module} is not importable ({err}); install it with "
                    f"`pip install -e '.[{extra}]' \"torch==$(python -c 'import torch;print(torch.__version__)')\"`")


def digits(n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    return (x[:n], y[:n]) if n else (x, y)


def digits_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


WMUON = dict(statistics_every=2, factor_decay=0.8)


def make_optimizer(method: str, model: nn.Module, lr: float, accumulation_steps: int,
                   kfac: dict | None = None, psgd: dict | None = None,
                   wmuon: dict | None = None) -> torch.optim.Optimizer:
    """AdamW, AdamW behind a K-FAC / PSGD :class:`PreconditionedOptimizer`, or ``WhitenedMuon``
    built from the model (``"wmuon"``: one optimizer, AdamW groups for the rest)."""
    if method == "wmuon":  # on these small models Muon-family steps want about 10x AdamW's lr
        return WhitenedMuon(model, lr=10 * lr, adamw_lr=lr, **WMUON, **(wmuon or {}))
    base = torch.optim.AdamW(model.parameters(), lr=lr)
    if method == "adamw":
        return base
    if method == "kfac":
        precond = KronPreconditioner(model, method="kfac", accumulation_steps=accumulation_steps,
                                     **(kfac if kfac is not None else KFAC))
    else:
        precond = KronPreconditioner(model, method="psgd", **(psgd if psgd is not None else PSGD))
    return PreconditionedOptimizer(base, precond)


def steps_taken(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """Optimizer steps done: the preconditioner's count, WhitenedMuon's per-weight step count
    (of the first whitened weight), or AdamW's per-parameter one."""
    if isinstance(optimizer, PreconditionedOptimizer):
        return optimizer.preconditioner.steps
    first = optimizer.param_groups[0]["params"][0]
    return int(optimizer.state[first]["step"])


class RowRecorder:
    """Records, on its own, the rows K-FAC must see for one Linear-like layer: the input rows
    of every training forward and the output-gradient rows of every backward."""

    def __init__(self, module: nn.Module, transposed: bool = False) -> None:
        self.inputs: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.call_rows: list[int] = []
        self._handle = module.register_forward_hook(self._forward)

    def _forward(self, module, inputs, output):
        if not (module.training and torch.is_grad_enabled()):
            return
        x = inputs[0].detach()
        self.inputs.append(x.reshape(-1, x.shape[-1]).double())
        self.call_rows.append(output.numel() // output.shape[-1])  # rows of this call
        output.register_hook(lambda g: self.grads.append(g.detach().reshape(-1, g.shape[-1]).double()))

    def remove(self) -> None:
        self._handle.remove()


class FactorLog:
    """One layer's K-FAC row counts as the preconditioner's ``step()`` starts (the statistics
    of the step's micro-batches, not yet folded; after a closure passed to the optimizer
    has run) and its factors after every optimizer step."""

    def __init__(self, optimizer: PreconditionedOptimizer, layer_name: str) -> None:
        self.rows: list[list[int]] = []
        self.a: list[torch.Tensor] = []
        self.g: list[torch.Tensor] = []
        precond = optimizer.preconditioner
        layer = precond.layers[layer_name]
        step = precond.step

        def counting_step(*args, **kwargs):  # [rows seen by A, rows seen by G] this step
            self.rows.append([int(n) for n in layer.method.shared_statistics()[-1].tolist()])
            return step(*args, **kwargs)

        def record(*_):
            self.a.append(layer.a_factor.detach().double().clone())
            self.g.append(layer.g_factor.detach().double().clone())

        precond.step = counting_step  # this instance only
        optimizer.register_step_post_hook(record)


def check_factors_saw_every_micro_batch_once(recorder: RowRecorder, log: FactorLog, accumulation_steps: int,
                                             rows_per_step: int, has_bias: bool = True) -> None:
    """The preconditioner counted ``rows_per_step`` rows (``accumulation_steps`` micro-batches)
    for A and G on every step, and its running-average factors equal the ones recomputed from
    the recorded rows, ``accumulation_steps`` micro-batches per step."""
    steps = len(log.a)
    assert steps > 0
    assert log.rows == [[rows_per_step, rows_per_step]] * steps, (
        f"rows counted per step {log.rows}; expected {rows_per_step} for A and G on each of {steps} steps")
    assert len(recorder.inputs) == len(recorder.grads) == steps * accumulation_steps, (
        f"{len(recorder.inputs)} forwards / {len(recorder.grads)} backwards for {steps} optimizer steps "
        f"of {accumulation_steps} micro-batches")
    a_ref = g_ref = None
    for step in range(steps):
        window = slice(step * accumulation_steps, (step + 1) * accumulation_steps)
        xs, gs = recorder.inputs[window], recorder.grads[window]
        sizes = recorder.call_rows[window]
        a_rows = torch.cat(xs)
        if has_bias:
            a_rows = torch.cat([a_rows, a_rows.new_ones(a_rows.shape[0], 1)], 1)
        d_rows = torch.cat([g * b * accumulation_steps for g, b in zip(gs, sizes)])
        a_new = a_rows.T @ a_rows / a_rows.shape[0]
        g_new = d_rows.T @ d_rows / d_rows.shape[0]
        a_ref = a_new if a_ref is None else FACTOR_DECAY * a_ref + (1 - FACTOR_DECAY) * a_new
        g_ref = g_new if g_ref is None else FACTOR_DECAY * g_ref + (1 - FACTOR_DECAY) * g_new
        torch.testing.assert_close(log.a[step], a_ref, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, step=step: f"A after step {step}: {m}")
        torch.testing.assert_close(log.g[step], g_ref, rtol=1e-4, atol=1e-6 * float(g_ref.abs().max()),
                                   msg=lambda m, step=step: f"G after step {step}: {m}")


def assert_trains_like_adamw(losses: dict[str, float], initial: float) -> None:
    assert losses["adamw"] < 0.7 * initial, losses
    for method in set(losses) - {"adamw"}:
        assert losses[method] == losses[method], losses  # not NaN
        assert losses[method] <= losses["adamw"] * (1 + NOISE), (
            f"{method} final loss {losses[method]:.4f} vs AdamW {losses['adamw']:.4f}: {losses}")


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.detach(), pb.detach(), rtol=1e-6, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


@torch.no_grad()
def classification_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    loss = F.cross_entropy(model(x), y).item()
    model.train(was_training)
    return loss
