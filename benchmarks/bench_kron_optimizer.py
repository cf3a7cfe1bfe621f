"""Step time of kron_precond's ``Kron`` versus ``kron-torch``'s ``Kron`` and ``AdamW``.

A script, not a test. Every optimizer trains its own copy of the same model on the same
fixed batch; measurements are interleaved round by round so that load from other
processes hits all of them alike. Two preconditioner schedules:

* ``p=1``: a Q update on every step;
* ``annealed``: the default schedule (``preconditioner_update_probability=None``, 1 -> 0.03)
  fast-forwarded to step 4000, where it has reached its floor p ≈ 0.03; timed in rounds of
  34 steps so each round holds one Q update.

Reported: the median over rounds of the mean milliseconds per training step (forward,
backward and ``opt.step()``) and per ``opt.step()`` alone.

Usage::

    python benchmarks/bench_kron_optimizer.py [--threads 1] [--device cpu] [--out bench.png]

kron-torch (``pip install --no-deps kron-torch==0.3.3``) is skipped with a message if it is
absent. It multiplies the preconditioner with one multi-operand ``torch.einsum`` that only
has a sane contraction order when ``opt_einsum`` is installed (without it, it tries to
allocate terabytes), so it is skipped with a message in that case too.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kron_precond.optim import Kron  # noqa: E402

ANNEALED_STEP = 4000


# ----------------------------------------------------------------------------- models
class Block(nn.Module):
    """A transformer-shaped block made of Linear layers only (no attention mixing)."""

    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.tanh(q) * k + v)
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


def make_model(name: str, device):
    """``(model, inputs, targets)`` with fixed seeds."""
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 10))
        x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
    else:
        d = 256
        model = nn.Sequential(nn.Linear(64, d), *[Block(d) for _ in range(4)], nn.LayerNorm(d),
                              nn.Linear(d, 10))
        x, y = torch.randn(8, 64, 64), torch.randint(0, 10, (8, 64))
    return model.to(device), x.to(device), y.to(device)


# ----------------------------------------------------------------------------- optimizers
def make_optimizers(hp: dict, schedule: str):
    """name -> optimizer factory over a fresh copy of the parameters."""
    prob = 1.0 if schedule == "p=1" else None
    factories = {
        "AdamW": lambda p: torch.optim.AdamW(p, lr=hp["lr"], betas=(hp["b1"], 0.999),
                                             weight_decay=hp["weight_decay"]),
        "ours": lambda p: _fast_forward_ours(
            Kron(p, lr=hp["lr"], b1=hp["b1"], weight_decay=hp["weight_decay"],
                 precond_lr=hp["precond_lr"], preconditioner_update_probability=prob),
            schedule),
    }
    kron_torch, why = import_kron_torch()
    if kron_torch is not None:
        factories["kron-torch"] = lambda p: _fast_forward_kron_torch(
            kron_torch.Kron(p, lr=hp["lr"], b1=hp["b1"], weight_decay=hp["weight_decay"],
                            precond_lr=hp["precond_lr"], preconditioner_update_probability=prob),
            schedule)
    return factories, why


def import_kron_torch():
    if not torch.backends.opt_einsum.is_available():
        return None, ("kron-torch skipped: opt_einsum is not installed, and kron-torch's "
                      "preconditioner einsum would try to allocate terabytes without it")
    try:
        import kron_torch
    except ImportError:
        return None, ("kron-torch skipped: not installed "
                      "(pip install --no-deps kron-torch==0.3.3)")
    return kron_torch, None


def _fast_forward_ours(opt, schedule):
    if schedule == "annealed":
        opt.update_decider.load_state_dict({"step": ANNEALED_STEP, "acc": 0.0})
    return opt


def _fast_forward_kron_torch(opt, schedule):
    if schedule == "annealed":
        opt._prob_step = torch.tensor(ANNEALED_STEP, dtype=torch.int32)
    return opt


# ----------------------------------------------------------------------------- timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, opt, x, y, device):
    """One training step; returns (seconds for the whole step, seconds in opt.step())."""
    sync(device)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    out = model(x)
    nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
    sync(device)
    t1 = time.perf_counter()
    opt.step()
    sync(device)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def bench(model_name, schedule, hp, args, device):
    factories, why = make_optimizers(hp, schedule)
    runs = {}
    for name, factory in factories.items():
        model, x, y = make_model(model_name, device)
        opt = factory(model.parameters())
        with contextlib.redirect_stdout(io.StringIO()):  # kron-torch prints on its first step
            for _ in range(args.warmup):
                train_step(model, opt, x, y, device)
        runs[name] = dict(model=model, opt=opt, x=x, y=y, step=[], opt_step=[])
    chunk = 1 if schedule == "p=1" else math.ceil(1 / 0.03)
    rounds = args.steps if schedule == "p=1" else args.annealed_rounds
    for _ in range(rounds):
        for r in runs.values():  # interleaved
            total = in_opt = 0.0
            for _ in range(chunk):
                t, o = train_step(r["model"], r["opt"], r["x"], r["y"], device)
                total, in_opt = total + t, in_opt + o
            r["step"].append(total / chunk)
            r["opt_step"].append(in_opt / chunk)
    # Median over rounds: robust to bursts of load from other processes.
    return {name: (1e3 * statistics.median(r["step"]), 1e3 * statistics.median(r["opt_step"]))
            for name, r in runs.items()}, why


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--steps", type=int, default=9, help="timed steps at p=1 (per optimizer)")
    parser.add_argument("--annealed-rounds", type=int, default=3,
                        help="timed rounds of 34 steps each in the annealed setting")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None, help="save a PNG bar chart here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    hp = dict(lr=1e-3, b1=0.9, weight_decay=0.01, precond_lr=0.1)

    rows, notes = [], set()
    for model_name in args.models.split(","):
        model, _, _ = make_model(model_name, device)
        n_params = sum(p.numel() for p in model.parameters())
        for schedule in ("p=1", "annealed"):
            result, why = bench(model_name, schedule, hp, args, device)
            if why:
                notes.add(why)
            for name, (step_ms, opt_ms) in result.items():
                rows.append((f"{model_name} ({n_params / 1e6:.2f}M)", schedule, name, step_ms,
                             opt_ms, step_ms / result["AdamW"][0],
                             opt_ms / result["kron-torch"][1] if "kron-torch" in result else None))

    print(f"torch {torch.__version__}, device {device}, threads {args.threads}, "
          f"hyperparameters {hp}")
    for note in sorted(notes):
        print(note)
    header = (f"{'model':<22}{'schedule':<10}{'optimizer':<12}{'step ms':>10}{'opt.step ms':>13}"
              f"{'step/AdamW':>12}{'opt.step/kron-torch':>21}")
    print(header)
    print("-" * len(header))
    for model_name, schedule, name, step_ms, opt_ms, vs_adamw, vs_kt in rows:
        kt = f"{vs_kt:.2f}" if vs_kt is not None else "-"
        print(f"{model_name:<22}{schedule:<10}{name:<12}{step_ms:>10.1f}{opt_ms:>13.1f}"
              f"{vs_adamw:>12.2f}{kt:>21}")
    if args.out:
        save_png(rows, args.out)
        print(f"saved {args.out}")


def save_png(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    settings = sorted({(m, s) for m, s, *_ in rows}, key=lambda k: [r[:2] for r in rows].index(k))
    names = list(dict.fromkeys(r[2] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        values = [next((r[3] for r in rows if r[:3] == (*s, name)), 0.0) for s in settings]
        ax.bar([i + j * width for i in range(len(settings))], values, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))])
    ax.set_xticklabels([f"{m}\n{s}" for m, s in settings], fontsize=8)
    ax.set_ylabel("ms per training step")
    ax.set_title("Kron step time (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
