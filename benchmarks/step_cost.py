"""Where the time of a preconditioned Muon step goes, on the main job's model.

For Muon alone and K-FAC in front of Muon (eigen / inverse, every row / a prefix of rows in
the statistics) and PSGD in front of Muon, every configuration steps round-robin on the
same batches (so that background load hits them alike) and each step is split into:

* ``fwd+bwd``: forward and backward (K-FAC's hooks run here on statistics steps);
* ``precond``: ``precond.step()`` (statistics fold, refresh, apply);
* ``optim``: ``optimizer.step()`` (Muon on the hidden weights, AdamW on the rest),

reported as medians over statistics steps and over plain steps, and as the mean step time
over every timed step against Muon's: the mean holds the statistics steps (every
``--factor-update-steps``), the refreshes (every ``--inv-update-steps``; the default 100
timed steps hold one) and PSGD's random preconditioner updates in their proportions. On
CUDA the blocks are timed with synchronised CUDA events.

    python benchmarks/step_cost.py --threads 1
    python benchmarks/step_cost.py --d-model 256 --steps 40 --threads 1
    python benchmarks/step_cost.py --arch llama --d-model 64 --batch-size 32 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "examples"))  # the examples' modules, imported by file

from char_lm import ARCHS, SKIP_LAYERS, ByteCorpus, ModelConfig, build_model, lm_loss, load_corpus  # noqa: E402
from kron_examples_common import PrecondConfig, build_method, resolve_device  # noqa: E402

# name -> (method of the examples, PrecondConfig overrides)
CONFIGS = {
    "muon": ("muon", {}),
    "kfac_muon eigen, all rows": ("kfac_muon", {}),
    "kfac_muon inverse, all rows": ("kfac_muon", {"compute_method": "inverse"}),
    "kfac_muon eigen, 1024 rows": ("kfac_muon", {"statistics_rows": 1024}),
    "kfac_muon inverse, 1024 rows": ("kfac_muon", {"compute_method": "inverse", "statistics_rows": 1024}),
    "psgd_muon p=0.05": ("psgd_muon", {"update_probability": 0.05}),
    # sides wider than 512 (the MLPs' 4d side at d = 256) diagonal (names: at most 30 characters)
    "kfac_muon inv 1024r diag>512": ("kfac_muon", {"compute_method": "inverse", "statistics_rows": 1024,
                                                   "kfac_max_size": 512}),
    "kfac_muon eig 1024r diag>512": ("kfac_muon", {"statistics_rows": 1024, "kfac_max_size": 512}),
    "psgd_muon p=0.05 diag>512": ("psgd_muon", {"update_probability": 0.05, "psgd_max_size_triangular": 512}),
    # input-side K-FAC (statistics + Cholesky refresh every ikfac_every steps) and the
    # elementwise second moment
    "ikfac_muon every 32": ("ikfac_muon", {}),
    "ikfac_muon every 10": ("ikfac_muon", {"ikfac_every": 10}),
    "muon2": ("muon2", {}),
    "ikfac_muon2 every 32": ("ikfac_muon2", {}),
    # SOAP-style eigenbasis moments (statistics every soap_statistics_every steps, bases every
    # soap_every), both sides, and one-sided on sides up to 200 wide
    "soap_muon": ("soap_muon", {"soap_statistics_every": 10}),
    "soap_muon one-sided (smax=200)": ("soap_muon", {"soap_statistics_every": 10, "soap_max_size": 200}),
    # WhitenedMuon (an optimizer, not a preconditioner: its time is in "optim"); statistics
    # every wmuon_every steps (the library's default: 5), the output side on the first layers of
    # ungated MLPs (the default, "auto"), the input side alone, both sides on every weight, or
    # both on the wider-output weights (output_side="wide")
    "wmuon (defaults)": ("wmuon", {}),
    "wmuon input side only": ("wmuon", {"wmuon_both_sides": False}),
    "wmuon output side too": ("wmuon", {"wmuon_both_sides": True}),
    "wmuon output side wide": ("wmuon", {"wmuon_both_sides": "wide"}),
    "wmuon every 10": ("wmuon", {"wmuon_every": 10}),
    "wmuon 512 rows": ("wmuon", {"wmuon_statistics_rows": 512}),
    # Newton-Schulz and the whitening in float32 (the library's default on a CPU without
    # bfloat16 kernels), against Muon's bfloat16
    "wmuon float32": ("wmuon", {"wmuon_ns_dtype": "float32"}),
}


def statistics_interval(method: str, overrides: dict, kfac_every: int) -> int:
    """Steps between the statistics steps of a configuration (its "stat" columns)."""
    if method.startswith("ikfac"):
        return overrides.get("ikfac_every", PrecondConfig.ikfac_every)
    if method.startswith("soap"):
        return overrides.get("soap_statistics_every", PrecondConfig.soap_statistics_every)
    if method.startswith("wmuon"):
        return overrides.get("wmuon_every", PrecondConfig.wmuon_every)
    return kfac_every


class Blocks:
    """Elapsed milliseconds of consecutive blocks of one step (CUDA events on a GPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def elapsed_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [1000 * (b - a) for a, b in zip(self.marks, self.marks[1:])]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="timed steps per configuration (after step 1)")
    p.add_argument("--d-model", type=int, default=ModelConfig.d_model)
    p.add_argument("--n-layers", type=int, default=ModelConfig.n_layers,
                   help="transformer blocks (1: the MLP's two weights have no twin of their shape)")
    p.add_argument("--arch", choices=ARCHS, default="gpt",
                   help="the examples' GPT or a model built from a transformers config")
    p.add_argument("--batch-size", type=int, default=64, help="sequences of 64 bytes per step")
    p.add_argument("--factor-update-steps", type=int, default=10, help="K-FAC statistics interval")
    p.add_argument("--inv-update-steps", type=int, default=100, help="K-FAC refresh interval")
    p.add_argument("--only", default="",
                   help="comma-separated substrings: time only the configurations whose name holds one "
                        "(Muon, the reference, always runs); default: all")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model_config = ModelConfig(d_model=args.d_model, n_layers=args.n_layers, arch=args.arch)
    corpus = ByteCorpus(load_corpus(4 * 2**20), model_config.seq_len)
    data_order = torch.Generator().manual_seed(0)
    base = PrecondConfig(skip_layers=SKIP_LAYERS, factor_update_steps=args.factor_update_steps,
                         inv_update_steps=args.inv_update_steps)
    runs = {}
    wanted = [w for w in args.only.split(",") if w]
    chosen = {name: c for name, c in CONFIGS.items()
              if name == "muon" or not wanted or any(w in name for w in wanted)}
    intervals = {name: statistics_interval(method, overrides, args.factor_update_steps)
                 for name, (method, overrides) in chosen.items()}
    for name, (method, overrides) in chosen.items():
        torch.manual_seed(0)
        model = build_model(model_config).to(device)
        optimizer, precond = build_method(method, model, 8e-3, 0.0, replace(base, **overrides))
        runs[name] = (model, optimizer, precond, {"statistics": [], "plain": [], "all": []})
    warmup = 1  # step 1 is a statistics and refresh step that allocates everything
    for step in range(1, warmup + args.steps + 1):
        inputs, targets = (t.to(device) for t in corpus.sample_train(args.batch_size, data_order))
        for name, (model, optimizer, precond, times) in runs.items():
            kind = "statistics" if (step - 1) % intervals[name] == 0 else "plain"
            blocks = Blocks(device)
            optimizer.zero_grad(set_to_none=True)
            blocks.mark()
            lm_loss(model, inputs, targets).backward()
            blocks.mark()
            if precond is not None:
                precond.step(lr=optimizer.param_groups[0]["lr"])  # kl_clip's lr, as train_step passes it
            blocks.mark()
            optimizer.step()
            blocks.mark()
            if step > warmup:
                times[kind].append(blocks.elapsed_ms())
                times["all"].append(sum(times[kind][-1]))

    def median(rows: list[list[float]], i: int) -> float:
        return statistics.median(r[i] for r in rows) if rows else float("nan")

    mean = {name: statistics.fmean(times["all"]) for name, (*_, times) in runs.items()}
    print(f"ms per block (medians), {args.arch}, d_model={args.d_model}, "
          f"{args.batch_size * model_config.seq_len} tokens/step, K-FAC statistics every "
          f"{args.factor_update_steps} / refresh every {args.inv_update_steps} steps (input-side K-FAC: "
          f"as named), {args.steps} timed steps, device {device}")
    print(f"{'configuration':30s} {'stat fwd+bwd':>12s} {'stat precond':>12s} {'fwd+bwd':>8s} "
          f"{'precond':>8s} {'optim':>7s} {'mean step':>9s} {'x Muon':>7s}")
    for name, (*_, times) in runs.items():
        stat, plain = times["statistics"], times["plain"]
        print(f"{name:30s} {median(stat, 0):12.1f} {median(stat, 1):12.1f} {median(plain, 0):8.1f} "
              f"{median(plain, 1):8.1f} {median(plain, 2):7.1f} {mean[name]:9.1f} "
              f"{mean[name] / mean['muon']:7.3f}")


if __name__ == "__main__":
    main()
