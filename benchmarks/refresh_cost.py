"""What a WhitenedMuon refresh costs, batched as the library runs it or one factor at a time.

A statistics step of ``WhitenedMuon`` folds the pending row products into the factors and
recomputes every whitener: for each width, the batched inverse Cholesky factor of its
factors, by halves (``inverse_cholesky``: LAPACK only below 96 wide, batched matmuls above; see
``WhiteningStatistics.whitener``). On a GPU
that step cost about 180 ms against about 122 ms for a plain step of the 85.6 M-parameter GPT of
docs/results.md, whose refresh decomposes sixty 768-wide factors and twelve 3,072-wide
ones. Batched calls of cuSOLVER / cuBLAS are built for many small matrices and a loop of
single calls for few large ones, so this script times, per ``width:count``:

* ``library``: the library's batched ``whitener`` on ``count`` factors of ``width``;
* ``one by one``: the same function on each factor alone (``count`` calls);
* ``by halves``: ``inverse_cholesky`` alone (the library's whitener without the damping);
* LAPACK's way, batched and looped: its Cholesky (``cholesky_ex``), then a triangular solve
  against the identity, and the two together (``cholesky + solve``);
* ``product``: a statistics step's row product (``count`` products of 1,024 rows).

It checks that both ways give the same whiteners (relative difference printed) and prints
milliseconds: medians of ``--repeats`` timed calls after warm-up, CUDA events on a GPU.

    python benchmarks/refresh_cost.py --device cuda --widths 768:60,3072:12,1024:24
    python benchmarks/refresh_cost.py --widths 128:8,512:2 --threads 1       # the main job, CPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "examples"))  # the examples' modules, imported by file

from kron_examples_common import StepTimer  # noqa: E402
from kron_precond.whitening import WhiteningStatistics, inverse_cholesky  # noqa: E402

STATISTICS_ROWS = 1024  # WhitenedMuon's default rows per call entering a factor


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with StepTimer(device) as timer:  # CUDA events on a GPU, the host clock elsewhere
            fn()
        times.append(1000 * timer.seconds)
    return statistics.median(times)


def random_factors(width: int, count: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """``count`` covariance-like factors ``XᵀX / n`` of ``n = 2 · width`` Gaussian rows with a
    spread of column scales (as activations have), ``[count, width, width]`` float32."""
    rows = torch.randn(count, 2 * width, width, generator=generator)
    rows = rows * torch.logspace(0, -2, width)  # eigenvalues over about four decades
    return (rows.mT @ rows / (2 * width)).to(device)


def measure(width: int, count: int, device: torch.device, repeats: int, root: str = "cholesky") -> dict:
    """One row: the timings of a ``count x width`` refresh, and how far apart the two ways are."""
    stats = WhiteningStatistics({}, {}, lambda p: False, sides=("input",), damping=0.1, factor_decay=0.8,
                                statistics_rows=None, root=root, block_size=None, process_group=None)
    generator = torch.Generator().manual_seed(width * 1000 + count)
    factors = random_factors(width, count, device, generator)
    eye = torch.eye(width, device=device)
    damped = factors + 0.1 * factors.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * eye
    lower = torch.linalg.cholesky_ex(damped)[0]
    rows = torch.randn(count, STATISTICS_ROWS, width, generator=generator).to(device)

    def one_by_one() -> torch.Tensor:
        return torch.cat([stats.whitener(factors[i:i + 1], None) for i in range(count)])

    batched = stats.whitener(factors, None)
    looped = one_by_one()
    difference = ((batched - looped).norm() / batched.norm()).item()
    return {
        "width": width, "count": count,
        "library": median_ms(lambda: stats.whitener(factors, None), device, repeats),
        "one by one": median_ms(one_by_one, device, repeats),
        "cholesky batched": median_ms(lambda: torch.linalg.cholesky_ex(damped), device, repeats),
        "cholesky looped": median_ms(lambda: [torch.linalg.cholesky_ex(m) for m in damped], device, repeats),
        "by halves": median_ms(lambda: inverse_cholesky(damped), device, repeats),
        "cholesky + solve": median_ms(lambda: torch.linalg.solve_triangular(
            torch.linalg.cholesky_ex(damped)[0], eye.expand_as(damped), upper=False), device, repeats),
        "solve batched": median_ms(
            lambda: torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False), device, repeats),
        "solve looped": median_ms(
            lambda: [torch.linalg.solve_triangular(m, eye, upper=False) for m in lower], device, repeats),
        "product": median_ms(lambda: rows.mT @ rows, device, repeats),
        "relative difference": difference,
    }


COLUMNS = ("library", "one by one", "by halves", "cholesky + solve", "cholesky batched", "cholesky looped",
           "solve batched", "solve looped", "product")


def table(rows: Sequence[dict]) -> str:
    """Markdown table of ``measure`` rows (milliseconds)."""
    lines = ["| width x count | " + " | ".join(f"{c} (ms)" for c in COLUMNS) + " | one by one / library | "
             "relative difference |", "|---" * (len(COLUMNS) + 3) + "|"]
    for r in rows:
        cells = [f"{r['width']} x {r['count']}", *(f"{r[c]:.3f}" for c in COLUMNS),
                 f"{r['one by one'] / r['library']:.2f}", f"{r['relative difference']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _widths(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        width, _, count = item.partition(":")
        pairs.append((int(width), int(count or 1)))
    return pairs


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", type=_widths, default=_widths("768:60,3072:12"),
                   help="width:count pairs: count factors of each width, as one refresh holds them")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per figure (the median is printed)")
    p.add_argument("--root", choices=("cholesky", "symmetric"), default="cholesky", help="WhitenedMuon's root")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, root {args.root}, {args.repeats} repeats", flush=True)
    rows = [measure(w, c, device, args.repeats, args.root) for w, c in args.widths]
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
