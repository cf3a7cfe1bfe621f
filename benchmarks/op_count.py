"""Aten ops in one plain ``precond.step()``, against the number of layers.

On a GPU every aten op is (at least) one kernel launch, so a preconditioner whose plain
step issues a fixed number of ops per layer costs launch latency in proportion to depth.
This counts the ops dispatched by one *plain* step -- K-FAC between its statistics and
refresh steps, PSGD on a step without a Q update -- for models of 2, 8 and 32 identical
transformer-ish blocks of ``nn.Linear`` layers, and prints the growth from the smallest
to the largest model (the target: at most 1.2x, i.e. a step whose op count does not
grow with the number of layers).

    python benchmarks/op_count.py                      # K-FAC and PSGD, 2 / 8 / 32 blocks
    python benchmarks/op_count.py --blocks 2,32 --top 10 --methods psgd

Counting uses ``TorchDispatchMode``: every aten op reaching the dispatcher is one count
(views and in-place ops included, as each is a dispatch; on CUDA most are launches).
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

from kron_precond import KronPreconditioner  # noqa: E402

# K-FAC: statistics every 10 steps, refresh every 100; step 5 is neither.
KFAC_INTERVALS = dict(factor_update_steps=10, inv_update_steps=100)
WARMUP_STEPS = 5
# SOAP preconditions a layer on its own while its statistics are rank-deficient (repeated
# zero eigenvalues; docs/design.md): deep layers of this model need more gradients than 5
SOAP_WARMUP_STEPS = 24


def warmup_steps(method: str) -> int:
    return SOAP_WARMUP_STEPS if method == "soap" else WARMUP_STEPS


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name while active."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    """Attention-shaped projections (q, k, v, out) and an MLP, all ``nn.Linear``."""

    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / x.shape[-1] ** 0.5, -1)
        x = x + self.out(scores @ self.v(x))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def make_model(blocks: int, d: int) -> nn.Module:
    return nn.Sequential(*(Block(d) for _ in range(blocks)))


def make_preconditioner(method: str, model: nn.Module) -> KronPreconditioner:
    if method == "kfac":
        return KronPreconditioner(model, method="kfac", **KFAC_INTERVALS)
    if method == "kfac_inverse":  # the main job's K-FAC form (the row cap acts on statistics steps only)
        return KronPreconditioner(model, method="kfac", compute_method="inverse", statistics_rows=64,
                                  **KFAC_INTERVALS)
    if method == "ikfac":  # statistics and refresh on step 0 only: the counted step is plain
        return KronPreconditioner(model, method="ikfac", factor_update_steps=100, inv_update_steps=100)
    if method == "ikfac_moment":
        return KronPreconditioner(model, method="ikfac", factor_update_steps=100, inv_update_steps=100,
                                  moment_decay=0.95)
    if method == "second_moment":
        return KronPreconditioner(model, method="second_moment")
    if method == "soap":  # statistics and bases on the warm-up steps only (full-rank statistics,
        # so layers are batched, not averaged over blocks one by one): the counted step is plain
        every = lambda s: 1 if s < SOAP_WARMUP_STEPS else 1000  # noqa: E731
        return KronPreconditioner(model, method="soap", factor_update_steps=every, inv_update_steps=every)
    # Q updates on the warm-up steps only (probability 1, then 0): the counted step is plain.
    return KronPreconditioner(model, method="psgd",
                              preconditioner_update_probability=lambda s: 1.0 if s < WARMUP_STEPS else 0.0)


def count_plain_step(method: str, blocks: int, d: int, tokens: int, device: torch.device) -> Counter:
    """Aten ops of one plain ``precond.step()`` after the method's warm-up steps."""
    torch.manual_seed(0)
    model = make_model(blocks, d).to(device)
    precond = make_preconditioner(method, model)

    def backward(step: int) -> None:
        # a new batch each step: statistics that keep seeing one batch stay rank-deficient
        x = torch.randn(tokens // 16, 16, d, device=device)
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    ops = ops_of_last_step(precond, backward, warmup_steps(method) + 1)
    precond.remove()
    return ops


def ops_of_last_step(precond: KronPreconditioner, backward: Callable[[int], None], steps: int) -> Counter:
    """Aten ops of the last of ``steps`` ``precond.step()`` calls, each after ``backward(step)``."""
    for step in range(steps - 1):
        backward(step)
        precond.step()
    backward(steps - 1)
    counter = OpCounter()
    with counter:
        precond.step()
    return counter.ops


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--methods", default="kfac,kfac_inverse,psgd",
                   help="comma-separated: kfac, kfac_inverse, psgd, ikfac, ikfac_moment, second_moment, soap")
    p.add_argument("--blocks", default="2,8,32", help="comma-separated block counts")
    p.add_argument("--d", type=int, default=32, help="block width (op counts do not depend on it)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per batch")
    p.add_argument("--top", type=int, default=0, help="also list the N most frequent ops of the largest model")
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[int, int]]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    blocks = [int(b) for b in args.blocks.split(",")]
    device = torch.device(args.device)
    print(f"aten ops in one plain precond.step(), blocks of 6 nn.Linear (d={args.d}), device {device}")
    print(f"{'method':<12} " + " ".join(f"{b:>6} blk" for b in blocks)
          + f"  ops/layer  x{blocks[-1]} vs {blocks[0]} blk")
    totals: dict[str, dict[int, int]] = {}
    for method in args.methods.split(","):
        counts = {b: count_plain_step(method, b, args.d, args.tokens, device) for b in blocks}
        totals[method] = {b: sum(c.values()) for b, c in counts.items()}
        per_layer = (totals[method][blocks[-1]] - totals[method][blocks[0]]) / (6 * (blocks[-1] - blocks[0]))
        growth = totals[method][blocks[-1]] / max(1, totals[method][blocks[0]])
        print(f"{method:<12} " + " ".join(f"{totals[method][b]:>10}" for b in blocks)
              + f"  {per_layer:9.1f}  {growth:6.2f}x (target <= 1.2x: {'met' if growth <= 1.2 else 'missed'})")
        if args.top:
            common = counts[blocks[-1]].most_common(args.top)
            print("    " + ", ".join(f"{name} {n}" for name, n in common))
    return totals


if __name__ == "__main__":
    main()
