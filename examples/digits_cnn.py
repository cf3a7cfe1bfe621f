"""A small CNN on scikit-learn's bundled 8x8 digits (no download), optionally preconditioned.

    python examples/digits_cnn.py --method kfac --optimizer sgd
    python examples/digits_cnn.py --method psgd --optimizer adamw --grad-accum 2 --amp

The loop is the library's canonical one: ``backward -> precond.step() -> optimizer.step()``
(with AMP: ``scaler.unscale_(optimizer)`` before ``precond.step()``). K-FAC registers the
two Conv2d layers and both Linear layers.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: an uninstalled kron_precond
    sys.path.append(str(REPO_ROOT))
# Sibling modules are imported by file from this folder, never through a package named
# `examples` (other wheels, e.g. kfac-pytorch's, install a top-level `examples`).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kron_examples_common import (  # noqa: E402
    AmpState,
    PrecondConfig,
    build_optimizer,
    build_preconditioner,
    resolve_device,
    state_memory_bytes,
    train_step,
)

N_CLASSES = 10


def load_digits_tensors(seed: int = 0, test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test); images [N, 1, 8, 8] scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels are 0..16
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=test_fraction, random_state=seed, stratify=labels.numpy()
    )
    return images[train_idx], labels[train_idx], images[test_idx], labels[test_idx]


class DigitsCNN(nn.Module):
    """conv(1->16) -> conv(16->32) -> 2x2 max-pool -> linear(512->64) -> linear(64->10)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(2 * width * 4 * 4, 64)
        self.fc2 = nn.Linear(64, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def classification_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float(), y)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    correct = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train()
    return correct


DEFAULT_LRS = {"sgd": 0.05, "adamw": 3e-3}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", choices=["none", "kfac", "psgd"], default="kfac",
                   help="preconditioner in front of the optimizer (none: the bare optimizer)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd", help="base optimizer")
    p.add_argument("--lr", type=float, default=None, help=f"learning rate (default: {DEFAULT_LRS})")
    p.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=64, help="images per optimizer step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--damping", type=float, default=1e-2, help="K-FAC damping")
    p.add_argument("--factor-update-steps", type=int, default=1, help="K-FAC: steps between factor updates")
    p.add_argument("--inv-update-steps", type=int, default=10, help="K-FAC: steps between eigendecompositions")
    p.add_argument("--amp", action="store_true", help="autocast (float16 + GradScaler on CUDA, bfloat16 on CPU)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the split and the data order")
    return p.parse_args(argv)


def build(args: argparse.Namespace, model: nn.Module, scaler: torch.amp.GradScaler):
    """(optimizer, preconditioner or None) for the command line."""
    lr = args.lr if args.lr is not None else DEFAULT_LRS[args.optimizer]
    optimizer = build_optimizer(args.optimizer, model.parameters(), lr, weight_decay=5e-4)
    if args.method == "none":
        return optimizer, None
    config = PrecondConfig(
        factor_update_steps=args.factor_update_steps, inv_update_steps=args.inv_update_steps,
        damping=args.damping, kl_clip=1e-3, accumulation_steps=args.grad_accum,
    )
    return optimizer, build_preconditioner(args.method, model, lr, config, scaler)


def main(argv: Sequence[str] | None = None) -> float:
    args = parse_args(argv)
    if args.batch_size % args.grad_accum:
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by --grad-accum {args.grad_accum}")
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_digits_tensors(args.seed))
    model = DigitsCNN().to(device)
    amp = AmpState.create(args.amp, device)
    optimizer, precond = build(args, model, amp.scaler)
    if precond is not None:
        print(f"{args.method} preconditions: {', '.join(precond.layers)}")
    order = torch.Generator().manual_seed(args.seed)

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        permutation = torch.randperm(len(y_train), generator=order).to(device)
        losses = []
        # Full batches only, so every step has grad_accum equal micro-batches.
        for batch in permutation.split(args.batch_size)[: len(y_train) // args.batch_size]:
            micro = list(zip(x_train[batch].chunk(args.grad_accum), y_train[batch].chunk(args.grad_accum)))
            losses.append(train_step(model, optimizer, precond, micro, classification_loss, amp))
        print(f"epoch {epoch:2d}  train loss {sum(losses) / len(losses):.4f}  "
              f"test accuracy {accuracy(model, x_test, y_test):.4f}")
    seconds = time.perf_counter() - start
    test_accuracy = accuracy(model, x_test, y_test)
    memory = state_memory_bytes(optimizer, precond)
    print(f"method={args.method} optimizer={args.optimizer}: test accuracy {test_accuracy:.4f} "
          f"in {seconds:.1f} s; state bytes: optimizer {memory['optimizer']:,}, "
          f"preconditioner {memory['preconditioner']:,}")
    return test_accuracy


if __name__ == "__main__":
    main()
