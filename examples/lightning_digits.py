"""K-FAC or PSGD inside PyTorch Lightning: ``configure_optimizers`` returns a
``PreconditionedOptimizer``, and Lightning's own loop (closures, ``accumulate_grad_batches``,
checkpoints, LR scheduling) does the rest.

    pip install -e ".[trainers]" "torch==$(python -c 'import torch;print(torch.__version__)')"
    python examples/lightning_digits.py --method kfac --accumulate 2
    python examples/lightning_digits.py --method psgd --epochs 5

Data: scikit-learn's 8x8 digits (shipped with the package, no download).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: an uninstalled kron_precond
    sys.path.append(str(REPO_ROOT))

from kron_precond import KronPreconditioner, PreconditionedOptimizer  # noqa: E402

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name
    import pytorch_lightning as pl


class DigitsClassifier(pl.LightningModule):
    def __init__(self, method: str, lr: float, accumulate: int) -> None:
        super().__init__()
        self.method, self.lr, self.accumulate = method, lr, accumulate
        self.net = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_index):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.net.parameters(), lr=self.lr)
        if self.method != "adamw":
            # K-FAC averages statistics over the micro-batches of one step: tell it how many.
            # kl_clip reads the optimizer's (scheduled) lr; no lr= needed here.
            settings = dict(accumulation_steps=self.accumulate, damping=1e-2, inv_update_steps=5) \
                if self.method == "kfac" else {}
            optimizer = PreconditionedOptimizer(
                optimizer, KronPreconditioner(self.net, method=self.method, **settings))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def load_digits_loaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    split = 1440
    train = DataLoader(TensorDataset(x[:split], y[:split]), batch_size=batch_size, shuffle=True)
    val = DataLoader(TensorDataset(x[split:], y[split:]), batch_size=256)
    return train, val


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["kfac", "psgd", "adamw"], default="kfac")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accumulate", type=int, default=2, help="accumulate_grad_batches")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--out", default="runs/lightning_digits")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    train, val = load_digits_loaders(args.batch_size)
    model = DigitsClassifier(args.method, args.lr, args.accumulate)
    trainer = pl.Trainer(max_epochs=args.epochs, max_steps=args.max_steps, accumulate_grad_batches=args.accumulate,
                         accelerator="auto", devices=1, default_root_dir=args.out, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train, val)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    print(f"{args.method}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))
    return metrics


if __name__ == "__main__":
    main()
