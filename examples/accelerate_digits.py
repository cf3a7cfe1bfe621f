"""K-FAC or PSGD inside a Hugging Face Accelerate loop: ``accelerator.prepare`` the
``PreconditionedOptimizer`` like any optimizer, and ``accelerator.accumulate`` decides when
it steps.

    pip install -e ".[trainers]" "torch==$(python -c 'import torch;print(torch.__version__)')"
    python examples/accelerate_digits.py --method kfac --accumulate 2
    accelerate launch --num_processes 2 examples/accelerate_digits.py   # DDP

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

from accelerate import Accelerator  # noqa: E402

from kron_precond import KronPreconditioner, PreconditionedOptimizer  # noqa: E402


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["kfac", "psgd", "adamw"], default="kfac")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)

    from sklearn.datasets import load_digits

    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, cpu=args.cpu)
    torch.manual_seed(0)
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    train = DataLoader(TensorDataset(x[:1440], y[:1440]), batch_size=args.batch_size, shuffle=True)
    x_val, y_val = x[1440:], y[1440:]

    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.method != "adamw":
        # Built on the bare model, before prepare() wraps it (DDP is unwrapped anyway).
        # K-FAC averages statistics over the micro-batches of one step: tell it how many.
        settings = dict(accumulation_steps=args.accumulate, damping=1e-2, inv_update_steps=5) \
            if args.method == "kfac" else {}
        optimizer = PreconditionedOptimizer(optimizer, KronPreconditioner(model, method=args.method, **settings))
    steps = args.epochs * len(train) // args.accumulate
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    model, optimizer, train, scheduler = accelerator.prepare(model, optimizer, train, scheduler)

    for epoch in range(args.epochs):
        model.train()
        for xb, yb in train:
            with accelerator.accumulate(model):  # optimizer.step() is a no-op until the window ends
                loss = F.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            logits = model(x_val.to(accelerator.device))
            val_loss = F.cross_entropy(logits, y_val.to(accelerator.device)).item()
            val_acc = (logits.argmax(1).cpu() == y_val).float().mean().item()
        accelerator.print(f"epoch {epoch + 1}: {args.method} val_loss {val_loss:.4f} val_acc {val_acc:.4f}")
    return {"val_loss": val_loss, "val_acc": val_acc}


if __name__ == "__main__":
    main()
