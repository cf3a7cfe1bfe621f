"""PyTorch Lightning: a :class:`PreconditionedOptimizer` returned by ``configure_optimizers``,
with ``accumulate_grad_batches`` (K-FAC and PSGD), on CPU with sklearn digits.

Under accumulation Lightning runs the first K-1 micro-batches' closures itself and passes
the last one to ``optimizer.step(closure)``; the wrapper runs that closure once, then
preconditions and steps. See ``integration_common`` for what is checked.
"""
from __future__ import annotations

import logging
import warnings

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

BATCH, K, STEPS_PER_EPOCH, EPOCHS, LR = 16, 4, 8, 3, 1e-2


def _lightning():
    try:
        pl = require("lightning").pytorch
    except pytest.skip.Exception:
        pl = require("pytorch_lightning")
    for name in ("lightning.pytorch", "pytorch_lightning"):  # its INFO banners, set on import
        logging.getLogger(name).setLevel(logging.WARNING)
    return pl


def _module_class(pl):
    class DigitsModule(pl.LightningModule):
        def __init__(self, method: str, record: bool = False) -> None:
            super().__init__()
            self.net = digits_mlp()
            self.method = method
            self.recorder = RowRecorder(self.net[0]) if record else None
            self.log_factors = None

        def training_step(self, batch, batch_index):
            xb, yb = batch
            return F.cross_entropy(self.net(xb), yb)

        def configure_optimizers(self):
            optimizer = make_optimizer(self.method, self.net, LR, accumulation_steps=K)
            if self.recorder is not None:
                self.log_factors = FactorLog(optimizer, "0")
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return DigitsModule


def _loader():
    x, y = digits(BATCH * K * STEPS_PER_EPOCH)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _trainer(pl, epochs, root, callbacks=()):
    return pl.Trainer(max_epochs=epochs, accumulate_grad_batches=K, accelerator="cpu", devices=1,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
                      default_root_dir=str(root), num_sanity_val_steps=0)


def _fit(method, epochs, root, *, record=False, checkpoint_dir=None, resume_from=None):
    pl = _lightning()
    module = _module_class(pl)(method, record)
    callbacks = []
    if checkpoint_dir is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=str(checkpoint_dir), every_n_epochs=1,
                                                      save_top_k=-1, filename="{epoch}"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|ckpt_path).*")
        _trainer(pl, epochs, root, callbacks).fit(module, _loader(), ckpt_path=resume_from)
    return module


def test_lightning_trains_and_sees_every_micro_batch_once(tmp_path):
    x, y = digits()
    initial = classification_loss(digits_mlp(), x, y)
    losses = {}
    for method in ("adamw", "kfac", "psgd", "wmuon"):
        module = _fit(method, EPOCHS, tmp_path / method, record=method == "kfac")
        losses[method] = classification_loss(module.net, x, y)
        assert module.trainer.global_step == EPOCHS * STEPS_PER_EPOCH
        assert steps_taken(module.trainer.optimizers[0], module.net) == EPOCHS * STEPS_PER_EPOCH
        if method == "kfac":
            check_factors_saw_every_micro_batch_once(module.recorder, module.log_factors, K,
                                                     rows_per_step=K * BATCH)
    print(f"lightning final losses (initial {initial:.3f}):", losses)
    assert_trains_like_adamw(losses, initial)


@pytest.mark.parametrize("method", ["kfac", "psgd", "wmuon"])
def test_lightning_checkpoint_resumes_to_the_same_update(tmp_path, method):
    straight = _fit(method, 2, tmp_path / "a", checkpoint_dir=tmp_path / "ckpt")
    checkpoint = tmp_path / "ckpt" / "epoch=0.ckpt"
    assert checkpoint.exists(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    saved = torch.load(checkpoint, weights_only=True)
    assert ("state" if method == "wmuon" else "preconditioner") in saved["optimizer_states"][0]
    resumed = _fit(method, 2, tmp_path / "b", resume_from=str(checkpoint))
    assert steps_taken(resumed.trainer.optimizers[0], resumed.net) == 2 * STEPS_PER_EPOCH
    assert_same_parameters(straight.net, resumed.net)
