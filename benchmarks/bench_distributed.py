"""Distributed K-FAC on gloo: communication and time per rank per step.

For each world size (spawned gloo ranks on this machine) and each grid strategy
(COMM_OPT / HYBRID_OPT / MEM_OPT), trains a transformer-like stack (``--blocks`` blocks
of q, k, v, o ``d×d`` Linear layers and an ``d×4d``, ``4d×d`` MLP, with LayerNorms and
real attention) under DDP with ``KronPreconditioner`` and reports, per rank and per step:

* collectives the preconditioner issues (``all_reduce`` / ``broadcast`` calls) and the
  payload bytes handed to them (``torch.distributed`` functions are wrapped; DDP's own
  gradient all-reduce runs in C++ and is not counted);
* time in ``precond.step()`` versus the rest of the step (forward, backward with DDP's
  gradient all-reduce, optimizer step), amortised over whole inverse intervals: the
  measured window is a whole number of ``--inv-steps`` intervals after a warm-up;
* the assignment's load balance ``precond.assignment.imbalance`` (max/mean estimated
  load) for the COMPUTE and MEMORY strategies.

Targets: imbalance ≤ 1.15; amortised preconditioner time per step falling as ranks are
added. Timings are only meaningful when every rank has a core of its own: on a 2-core
machine world 4 is oversubscribed (the script says so).

    python benchmarks/bench_distributed.py --out bench_distributed.png
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import DistributedStrategy, KronPreconditioner

STRATEGIES = ("COMM_OPT", "HYBRID_OPT", "MEM_OPT")


# ----------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (proj(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def make_model(blocks: int, d: int, heads: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(d, heads) for _ in range(blocks)), nn.LayerNorm(d))


# ----------------------------------------------------------------------------- counting
class Counter:
    """Wraps ``dist.all_reduce`` / ``dist.broadcast`` (the library calls them through the
    module attribute) and counts calls and payload bytes while ``enabled``."""

    NAMES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce")

    def __init__(self) -> None:
        self.enabled = False
        self.calls = {n: 0 for n in self.NAMES}
        self.bytes = {n: 0 for n in self.NAMES}
        self.originals = {n: getattr(dist, n) for n in self.NAMES}
        for name, fn in self.originals.items():
            setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def counted(tensor, *args, **kwargs):
            if self.enabled:
                self.calls[name] += 1
                if isinstance(tensor, torch.Tensor):
                    self.bytes[name] += tensor.numel() * tensor.element_size()
            return fn(tensor, *args, **kwargs)
        return counted

    def reset(self) -> None:
        for name in self.NAMES:
            self.calls[name] = self.bytes[name] = 0

    def restore(self) -> None:
        for name, fn in self.originals.items():
            setattr(dist, name, fn)


# ----------------------------------------------------------------------------- worker
def run_strategy(args, rank: int, world: int, strategy: str, counter: Counter) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model = make_model(args.blocks, args.d, args.heads)
    net = DistributedDataParallel(model) if world > 1 else model
    precond = KronPreconditioner(
        net, factor_update_steps=args.factor_steps, inv_update_steps=args.inv_steps,
        grad_worker_fraction=DistributedStrategy[strategy], lr=args.lr)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    per_rank = args.batch // world
    generator = torch.Generator().manual_seed(1 + rank)
    target_weight = torch.randn(args.d, args.d, generator=torch.Generator().manual_seed(7)) / math.sqrt(args.d)

    precond_time = rest_time = precond_cpu = 0.0
    by_kind = {"inverse": [], "factor": [], "plain": []}  # precond.step() seconds per kind of step
    total = args.warmup + args.measure
    for step in range(total):
        measuring = step >= args.warmup
        if step == args.warmup:
            counter.reset()
            if world > 1:
                dist.barrier()
        x = torch.randn(per_rank, args.seq, args.d, generator=generator)
        y = x @ target_weight
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.mse_loss(net(x), y)
        loss.backward()
        t1 = time.perf_counter()
        c1 = time.process_time()
        counter.enabled = measuring
        precond.step()
        counter.enabled = False
        c2 = time.process_time()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if measuring:
            precond_time += t2 - t1
            precond_cpu += c2 - c1
            rest_time += (t1 - t0) + (t3 - t2)
            kind = ("inverse" if step % args.inv_steps == 0 else
                    "factor" if step % args.factor_steps == 0 else "plain")
            by_kind[kind].append(t2 - t1)
    result = {
        "rank": rank, "world": world, "strategy": strategy, "grad_workers": precond.grad_workers,
        "layers": len(precond.layers),
        "precond_ms": 1e3 * precond_time / args.measure, "precond_cpu_ms": 1e3 * precond_cpu / args.measure,
        "rest_ms": 1e3 * rest_time / args.measure,
        "kind_ms": {k: 1e3 * sum(v) / max(len(v), 1) for k, v in by_kind.items()},
        "calls": {k: v / args.measure for k, v in counter.calls.items()},
        "mbytes": {k: v / args.measure / 2**20 for k, v in counter.bytes.items()},
        "imbalance_compute": precond.assignment.imbalance,
        "final_loss": loss.item(),
    }
    precond.remove()
    memory = KronPreconditioner(model, assignment_strategy="memory",
                                grad_worker_fraction=DistributedStrategy[strategy])
    result["imbalance_memory"] = memory.assignment.imbalance
    memory.remove()
    return result


def worker(rank: int, world: int, port: int, out_dir: str, args) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    counter = Counter()
    try:
        strategies = STRATEGIES if world > 1 else ("COMM_OPT",)  # identical at world 1
        results = [run_strategy(args, rank, world, s, counter) for s in strategies]
        counter.restore()
        dist.barrier()
        torch.save(results, os.path.join(out_dir, f"w{world}_r{rank}.pt"))
    finally:
        counter.restore()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------- report
def summarise(rows: list[dict]) -> list[dict]:
    """One line per (world, strategy): time of the slowest rank, per-rank means otherwise."""
    out = []
    keys = sorted({(r["world"], r["strategy"]) for r in rows}, key=lambda k: (k[0], STRATEGIES.index(k[1])))
    for world, strategy in keys:
        group = [r for r in rows if r["world"] == world and r["strategy"] == strategy]
        out.append({
            "world": world, "strategy": strategy if world > 1 else "(any)",
            "grad_workers": group[0]["grad_workers"],
            "ar_calls": sum(r["calls"]["all_reduce"] for r in group) / len(group),
            "bc_calls": sum(r["calls"]["broadcast"] for r in group) / len(group),
            "ar_mb": sum(r["mbytes"]["all_reduce"] for r in group) / len(group),
            "bc_mb": sum(r["mbytes"]["broadcast"] for r in group) / len(group),
            "precond_ms": max(r["precond_ms"] for r in group),
            "precond_cpu_ms": max(r["precond_cpu_ms"] for r in group),
            "rest_ms": max(r["rest_ms"] for r in group),
            "imb_c": group[0]["imbalance_compute"], "imb_m": group[0]["imbalance_memory"],
        })
    return out


def print_tables(rows: list[dict], summary: list[dict], args) -> None:
    print(f"\nper rank, per step (mean over {args.measure} measured steps after {args.warmup} warm-up; "
          f"factors every {args.factor_steps}, inverses every {args.inv_steps} steps). AR/BC: all-reduce/"
          f"broadcast calls and payload MB issued by the preconditioner; precond ms: precond.step() wall time, "
          f"amortised; cpu ms: its CPU time on this rank (all threads), unaffected by waiting for a core; "
          f"rest ms: forward + backward (incl. DDP) + optimizer; inv-step / fac-step / plain: "
          f"precond.step() ms on each kind of step")
    header = (f"{'world':>5} {'strategy':>10} {'rank':>4} {'W':>2} {'AR/step':>8} {'BC/step':>8} "
              f"{'AR MB':>8} {'BC MB':>8} {'precond ms':>10} {'rest ms':>8} {'precond %':>9} {'cpu ms':>7} "
              f"{'inv-step':>8} {'fac-step':>8} {'plain':>7}")
    print(header)
    print("-" * len(header))
    for r in sorted(rows, key=lambda r: (r["world"], STRATEGIES.index(r["strategy"]), r["rank"])):
        share = 100 * r["precond_ms"] / (r["precond_ms"] + r["rest_ms"])
        print(f"{r['world']:>5} {r['strategy'] if r['world'] > 1 else '(any)':>10} {r['rank']:>4} "
              f"{r['grad_workers']:>2} {r['calls']['all_reduce']:>8.2f} {r['calls']['broadcast']:>8.2f} "
              f"{r['mbytes']['all_reduce']:>8.3f} {r['mbytes']['broadcast']:>8.3f} "
              f"{r['precond_ms']:>10.2f} {r['rest_ms']:>8.2f} {share:>8.1f}% {r['precond_cpu_ms']:>7.1f} "
              f"{r['kind_ms']['inverse']:>8.1f} {r['kind_ms']['factor']:>8.1f} {r['kind_ms']['plain']:>7.1f}")
    print("\nsummary (times: slowest rank; calls and MB: mean over ranks; 'vs world 1': speed-up of "
          "precond.step() wall time)")
    header = (f"{'world':>5} {'strategy':>10} {'W':>2} {'AR/step':>8} {'BC/step':>8} {'AR MB':>8} {'BC MB':>8} "
              f"{'precond ms':>10} {'rest ms':>8} {'vs world 1':>10} {'cpu ms':>7} {'imb comp':>8} {'imb mem':>8}")
    print(header)
    print("-" * len(header))
    base = next(s["precond_ms"] for s in summary if s["world"] == 1) if any(s["world"] == 1 for s in summary) else None
    for s in summary:
        speed = f"{base / s['precond_ms']:.2f}x" if base else "-"
        print(f"{s['world']:>5} {s['strategy']:>10} {s['grad_workers']:>2} {s['ar_calls']:>8.2f} {s['bc_calls']:>8.2f} "
              f"{s['ar_mb']:>8.3f} {s['bc_mb']:>8.3f} {s['precond_ms']:>10.2f} {s['rest_ms']:>8.2f} {speed:>10} "
              f"{s['precond_cpu_ms']:>7.1f} "
              f"{s['imb_c']:>8.3f} {s['imb_m']:>8.3f}")


def check_targets(summary: list[dict]) -> bool:
    ok = True
    worst = max(max(s["imb_c"], s["imb_m"]) for s in summary)
    print(f"\ntarget imbalance <= 1.15: worst {worst:.3f} -> {'met' if worst <= 1.15 else 'NOT met'}")
    ok &= worst <= 1.15
    worlds = sorted({s["world"] for s in summary})
    for key, label in (("precond_ms", "wall"), ("precond_cpu_ms", "CPU")):
        for strategy in STRATEGIES:
            times = [next(s[key] for s in summary if s["world"] == w and (s["strategy"] == strategy or w == 1))
                     for w in worlds]
            falling = all(b < a for a, b in zip(times, times[1:]))
            print(f"target precond {label} time per step falling with ranks ({strategy}): "
                  + " -> ".join(f"w{w} {t:.1f} ms" for w, t in zip(worlds, times))
                  + f" -> {'met' if falling else 'NOT met'}")
            if key == "precond_ms":
                ok &= falling
    return ok


def plot(summary: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({s["world"] for s in summary})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.25
    for i, strategy in enumerate(STRATEGIES):
        rows = [next(s for s in summary if s["world"] == w and (s["strategy"] == strategy or w == 1)) for w in worlds]
        xs = [j + (i - 1) * width for j in range(len(worlds))]
        axes[0].bar(xs, [r["precond_ms"] for r in rows], width, label=f"{strategy} precond.step()")
        axes[0].scatter(xs, [r["rest_ms"] for r in rows], color="k", marker="_", s=200,
                        label="rest of step" if i == 0 else None, zorder=3)
        axes[0].scatter(xs, [r["precond_cpu_ms"] for r in rows], color="r", marker="x",
                        label="precond.step() CPU time" if i == 0 else None, zorder=3)
        axes[1].bar(xs, [r["ar_mb"] + r["bc_mb"] for r in rows], width, label=strategy)
    for ax, title, unit in ((axes[0], "amortised time per step (slowest rank)", "ms"),
                            (axes[1], "preconditioner payload per rank per step", "MiB")):
        ax.set_xticks(range(len(worlds)), [f"world {w}" for w in worlds])
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    fig.suptitle("KronPreconditioner (K-FAC) on gloo")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences), split over ranks")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--factor-steps", type=int, default=2)
    parser.add_argument("--inv-steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=20, help="steps before measuring (a whole inverse interval)")
    parser.add_argument("--measure", type=int, default=40, help="measured steps (whole inverse intervals)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--out", default=None, help="save a PNG here")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.measure % args.inv_steps or args.warmup % args.inv_steps:
        parser.error("--warmup and --measure must be multiples of --inv-steps (amortised over whole intervals)")
    if any(args.batch % w for w in worlds):
        parser.error("--batch must be divisible by every world size")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"torch {torch.__version__}, {cores} core(s), gloo, 1 thread per rank; "
          f"{args.blocks} blocks, d={args.d}, batch {args.batch}x{args.seq} tokens")
    for w in worlds:
        if w > cores:
            print(f"WARNING: world {w} > {cores} cores: ranks share cores, so its timings are "
                  f"oversubscribed and do not show scaling")
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for world in worlds:
            start = time.monotonic()
            mp.spawn(worker, args=(world, free_port(), out_dir, args), nprocs=world, join=True)
            print(f"world {world}: {time.monotonic() - start:.1f} s")
            for rank in range(world):
                rows.extend(torch.load(os.path.join(out_dir, f"w{world}_r{rank}.pt")))
    summary = summarise(rows)
    print_tables(rows, summary, args)
    check_targets(summary)
    if args.out:
        plot(summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
