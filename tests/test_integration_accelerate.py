"""Hugging Face Accelerate: ``accelerator.prepare`` and ``accelerator.accumulate`` with a
:class:`PreconditionedOptimizer` (K-FAC and PSGD), on CPU with sklearn digits.

Accelerate's ``AcceleratedOptimizer`` calls the wrapped ``step()`` / ``zero_grad()`` only on
the micro-batch that ends an accumulation window, so K-FAC (``accumulation_steps=K``)
gathers statistics on all K forward/backward passes of that window. See
``integration_common`` for what is checked.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from integration_common import (
    FactorLog,
    RowRecorder,
    assert_same_parameters,
    assert_trains_like_adamw,
    check_factors_saw_every_micro_batch_once,
    classification_loss,
    digits,
    digits_mlp,
    make_optimizer,
    require,
    steps_taken,
)

BATCH, K, STEPS, LR = 16, 4, 24, 1e-2


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def _fit(method: str, steps: int, *, save_to=None, save_at=None, resume_from=None, record=False):
    accelerate = require("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # a fresh Accelerator per run (the state is a singleton)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=K)
    x, y = digits(BATCH * K * STEPS)
    model = digits_mlp()
    optimizer = make_optimizer(method, model, LR, accumulation_steps=K)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup)
    recorder = log = None
    if record:
        recorder, log = RowRecorder(model[0]), FactorLog(optimizer, "0")
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    done = 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        done = save_at
        loader = accelerator.skip_first_batches(loader, save_at * K)
    for xb, yb in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            done += 1
            if save_to is not None and done == save_at:
                accelerator.save_state(str(save_to))
            if done == steps:
                break
    return accelerator.unwrap_model(model), optimizer, recorder, log, done


def test_accelerate_trains_and_sees_every_micro_batch_once():
    x, y = digits()
    initial = classification_loss(digits_mlp(), x, y)
    losses = {}
    for method in ("adamw", "kfac", "psgd", "wmuon"):
        model, optimizer, recorder, log, done = _fit(method, STEPS, record=method == "kfac")
        assert done == STEPS
        losses[method] = classification_loss(model, x, y)
        assert steps_taken(optimizer.optimizer, model) == STEPS  # AcceleratedOptimizer -> ours
        if method == "kfac":
            check_factors_saw_every_micro_batch_once(recorder, log, K, rows_per_step=K * BATCH)
    print(f"accelerate final losses (initial {initial:.3f}):", losses)
    assert_trains_like_adamw(losses, initial)


@pytest.mark.parametrize("method", ["kfac", "psgd", "wmuon"])
def test_accelerate_checkpoint_resumes_to_the_same_update(tmp_path, method):
    steps, save_at = 8, 5
    straight, *_ = _fit(method, steps, save_to=tmp_path / "ckpt", save_at=save_at)
    resumed, optimizer, *_ , done = _fit(method, steps, resume_from=tmp_path / "ckpt", save_at=save_at)
    assert done == steps and steps_taken(optimizer.optimizer, resumed) == steps
    assert_same_parameters(straight, resumed)
