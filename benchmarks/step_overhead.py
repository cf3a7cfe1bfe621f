"""Time per training step of preconditioned optimizers against the bare optimizer.

Every configuration trains its own copy of the model on the same batches; the
configurations are stepped round-robin (one step each, the starting configuration
rotating every round) so that background load on the machine hits all of them alike.
After a warm-up, each configuration's steps are timed one by one (forward, backward,
``precond.step()``, ``optimizer.step()``):

- the **mean** is the amortised cost: with the default 100 timed steps it contains
  exactly 10 factor updates and 1 eigendecomposition of K-FAC 10/100, and ~3 Q updates
  of PSGD at p=0.03 -- this is the figure the ratios use;
- the **median** is the cost of a typical (plain) step.

    python benchmarks/step_overhead.py                         # all workloads, ~20 min
    python benchmarks/step_overhead.py --workloads digits --steps 50
    python benchmarks/step_overhead.py --out docs/img/step_overhead.png

PSGD's default update probability anneals from 1 (first 500 steps) to 0.03 (from ~4000
steps); "p=1" and "p=0.03" time both ends of that schedule.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: `benchmarks.*`, uninstalled kron_precond
    sys.path.append(str(REPO_ROOT))
# The examples' modules are imported by file from examples/, never through a package named
# `examples` (other wheels, e.g. kfac-pytorch's, install a top-level `examples`).
sys.path.insert(0, str(REPO_ROOT / "examples"))

from benchmarks.peers import ALL_PEERS, DEFAULT_PEERS, available_peers, parse_peers  # noqa: E402
from char_lm import (  # noqa: E402
    SKIP_LAYERS,
    ByteCorpus,
    CharTransformer,
    ModelConfig,
    TrainConfig,
    format_table,
    lm_loss,
    load_corpus,
)
from digits_cnn import DigitsCNN, classification_loss, load_digits_tensors  # noqa: E402
from kron_examples_common import AmpState, PrecondConfig, StepTimer, build_optimizer, build_preconditioner, train_step  # noqa: E402

LR = {"adamw": 1e-3, "sgd": 0.01, "kron": 3e-4}  # timing only: any stable value will do
ANNEALED_P = 0.03  # floor of the default update-probability schedule


@dataclass
class Workload:
    """A model, the batches it trains on, and its loss."""

    name: str
    make_model: Callable[[], nn.Module]
    batches: list[tuple[torch.Tensor, ...]]
    loss_fn: Callable[..., torch.Tensor]
    skip_layers: Sequence[str] = ()


@dataclass
class Config:
    """One timed configuration: how to build (optimizer, precond) and its bare reference."""

    name: str
    reference: str  # name of the bare-optimizer config the ratio divides by
    build: Callable[[nn.Module, Workload], tuple]


@dataclass
class Timing:
    config: Config
    model: nn.Module
    optimizer: torch.optim.Optimizer
    precond: object
    amp: AmpState
    seconds: list[float] = field(default_factory=list)

    @property
    def mean_ms(self) -> float:
        return 1000 * statistics.fmean(self.seconds)

    @property
    def median_ms(self) -> float:
        return 1000 * statistics.median(self.seconds)


# --------------------------------------------------------------------------- workloads
def char_lm_workload(batch_size: int, seq_len: int, device: torch.device, n_batches: int = 4) -> Workload:
    model_config = ModelConfig(seq_len=seq_len)
    corpus = ByteCorpus(load_corpus(2**20), seq_len)
    generator = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(device) for t in corpus.sample_train(batch_size, generator)) for _ in range(n_batches)]
    return Workload(
        name=f"char-LM {batch_size}x{seq_len} tokens",
        make_model=lambda: CharTransformer(model_config).to(device),
        batches=batches, loss_fn=lm_loss, skip_layers=SKIP_LAYERS,
    )


def digits_workload(batch_size: int, device: torch.device, n_batches: int = 4) -> Workload:
    x, y, _, _ = load_digits_tensors()
    batches = [(x[i * batch_size:(i + 1) * batch_size].to(device), y[i * batch_size:(i + 1) * batch_size].to(device))
               for i in range(n_batches)]
    return Workload(name=f"digits CNN batch {batch_size}", make_model=lambda: DigitsCNN().to(device),
                    batches=batches, loss_fn=classification_loss)


# --------------------------------------------------------------------------- configs
def _preconditioned(base: str, kind: str, **overrides) -> Callable:
    def build(model: nn.Module, workload: Workload):
        config = PrecondConfig(skip_layers=workload.skip_layers, **overrides)
        return (build_optimizer(base, model.parameters(), LR[base], 0.0),
                build_preconditioner(kind, model, LR[base], config))

    return build


def _bare(base: str, update_probability: float | None = None) -> Callable:
    def build(model: nn.Module, workload: Workload):
        if base == "kron":  # the library's standalone PSGD optimizer
            from kron_precond import Kron

            return Kron(model.parameters(), lr=LR[base], preconditioner_update_probability=update_probability), None
        return build_optimizer(base, model.parameters(), LR[base], 0.0), None

    return build


def _peer(builder: Callable, update_probability: float) -> Callable:
    def build(model: nn.Module, workload: Workload):
        return builder(model.parameters(), LR["kron"], 0.0, update_probability), None

    return build


def default_configs(peers: Sequence[str]) -> list[Config]:
    kfac_every_step = dict(factor_update_steps=1, inv_update_steps=1)
    kfac_amortised = dict(factor_update_steps=10, inv_update_steps=100)
    configs = [
        Config("AdamW", "AdamW", _bare("adamw")),
        Config("K-FAC 1/1 + AdamW", "AdamW", _preconditioned("adamw", "kfac", **kfac_every_step)),
        Config("K-FAC 10/100 + AdamW", "AdamW", _preconditioned("adamw", "kfac", **kfac_amortised)),
        Config("PSGD p=1 + AdamW", "AdamW", _preconditioned("adamw", "psgd", update_probability=1.0)),
        Config(f"PSGD p={ANNEALED_P} + AdamW", "AdamW",
               _preconditioned("adamw", "psgd", update_probability=ANNEALED_P)),
        Config("SGD", "SGD", _bare("sgd")),
        Config("K-FAC 10/100 + SGD", "SGD", _preconditioned("sgd", "kfac", **kfac_amortised)),
        Config(f"PSGD p={ANNEALED_P} + SGD", "SGD", _preconditioned("sgd", "psgd", update_probability=ANNEALED_P)),
        Config("Kron p=1", "AdamW", _bare("kron", 1.0)),
        Config(f"Kron p={ANNEALED_P}", "AdamW", _bare("kron", ANNEALED_P)),
    ]
    for name, builder in available_peers(peers).items():
        configs.append(Config(f"{name} p=1", "AdamW", _peer(builder, 1.0)))
        configs.append(Config(f"{name} p={ANNEALED_P}", "AdamW", _peer(builder, ANNEALED_P)))
    return configs


# --------------------------------------------------------------------------- timing
def time_workload(workload: Workload, configs: Sequence[Config], steps: int, warmup: int,
                  device: torch.device) -> list[Timing]:
    """Round-robin over ``configs``; returns per-step seconds of the timed steps."""
    timings = []
    for config in configs:
        torch.manual_seed(0)  # identical initial weights
        model = workload.make_model()
        optimizer, precond = config.build(model, workload)
        timings.append(Timing(config, model, optimizer, precond, AmpState.create(False, device)))
    for step in range(warmup + steps):
        batch = workload.batches[step % len(workload.batches)]
        start = step % len(timings)
        for t in timings[start:] + timings[:start]:  # rotate who goes first
            timer = StepTimer(device)
            with timer:
                train_step(t.model, t.optimizer, t.precond, [batch], workload.loss_fn, t.amp)
            if step >= warmup:
                t.seconds.append(timer.seconds)
    for t in timings:
        if t.precond is not None:
            t.precond.remove()
    return timings


def timing_table(timings: Sequence[Timing]) -> str:
    by_name = {t.config.name: t for t in timings}
    rows = []
    for t in timings:
        ref = by_name[t.config.reference]
        rows.append([
            t.config.name, f"{t.mean_ms:.1f}", f"{t.median_ms:.1f}", t.config.reference,
            f"{t.mean_ms / ref.mean_ms:.2f}", f"{t.median_ms / ref.median_ms:.2f}",
        ])
    return format_table(["config", "mean ms/step", "median ms", "vs", "x mean", "x median"], rows)


def plot(results: dict[str, list[Timing]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), sharey=True, squeeze=False)
    for ax, (workload, timings) in zip(axes[0], results.items()):
        by_name = {t.config.name: t for t in timings}
        names = [t.config.name for t in timings]
        ratios = [t.mean_ms / by_name[t.config.reference].mean_ms for t in timings]
        ax.barh(names, ratios, color=["grey" if t.config.name == t.config.reference else "tab:blue" for t in timings])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(workload, fontsize=9)
        ax.set_xlabel("mean step time / bare optimizer")
        ax.tick_params(axis="y", labelsize=7)
    axes[0][0].invert_yaxis()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workloads", default="lm,lm_tiny,digits",
                   help="comma-separated: lm (>= 4096 tokens/step), lm_tiny (one short sequence), digits")
    p.add_argument("--steps", type=int, default=100, help="timed steps per configuration (after warm-up)")
    p.add_argument("--warmup", type=int, default=35,
                   help="untimed steps per configuration first (>= 1/0.03, so every p=0.03 config has made "
                        "its first Q update: kron_torch compiles its update function then)")
    p.add_argument("--lm-batch", type=int, default=TrainConfig.batch_size, help="sequences per step of the lm workload")
    p.add_argument("--seq-len", type=int, default=ModelConfig.seq_len, help="sequence length of the lm workloads")
    p.add_argument("--tiny-batch", type=int, default=1, help="sequences per step of the lm_tiny workload")
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                   help=f"other PSGD implementations to time, from {ALL_PEERS}, or none")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=None, help="save a bar chart of the ratios here (PNG)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, list[Timing]]:
    from kron_examples_common import resolve_device

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    makers = {
        "lm": lambda: char_lm_workload(args.lm_batch, args.seq_len, device),
        "lm_tiny": lambda: char_lm_workload(args.tiny_batch, args.seq_len, device),
        "digits": lambda: digits_workload(64, device),
    }
    configs = default_configs(parse_peers(args.peers))
    print(f"device {device}, {torch.get_num_threads()} threads, {args.steps} timed steps after {args.warmup} warm-up")
    results = {}
    for key in args.workloads.split(","):
        workload = makers[key]()
        timings = time_workload(workload, configs, args.steps, args.warmup, device)
        results[workload.name] = timings
        print(f"\n== {workload.name}\n{timing_table(timings)}", flush=True)
    if args.out:
        plot(results, args.out)
        print(f"saved {args.out}")
    return results


if __name__ == "__main__":
    main()
