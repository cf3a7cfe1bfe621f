"""Per-rank traffic, memory and refresh work of kron_precond at 8 to 1024 GPUs.

Nothing here is measured and nothing is typed in: the models are built on the ``meta``
device (no memory is allocated), their layers are selected and built by the library's own
method specs (``methods/registry.py``: ``select`` and ``make_layer``), each layer's state is
the library's own ``KFACLayer`` / ``PSGDLayer``
(its ``factor_costs``, ``memory_by_kind``, ``shared_statistics`` and
``refreshed_tensors`` give the sizes), and work is placed on ranks by the library's own
``assign_work``. A cost model for collectives (below) turns sizes into bytes sent.

Cost model (bytes one rank sends; ``k`` ranks in the group, payload ``N`` bytes):

* all-reduce (ring): ``2 (k-1)/k N``;  all-gather of an ``N``-byte result: ``(k-1)/k N``;
* broadcast (pipelined ring, averaged over the group): ``(k-1)/k N``;
* gather of an ``N``-byte tensor to one rank: a non-root sends its ``N/k`` piece;
  scatter from one rank: the root sends ``(k-1)/k N``.

Strategies (``R`` ranks; ``W`` gradient workers per layer, ``C = R / W`` columns):

* ``DDP COMM_OPT`` (W = R), ``DDP HYBRID`` (W = R/2), ``DDP MEM_OPT`` (W = 1): the
  KAISA grid as implemented for DDP. Every rank keeps every layer's factors (statistics
  are all-reduced over R); a layer's decompositions live on its owner's column; plain
  steps broadcast preconditioned gradients along rows (C > 1).
* ``FSDP2`` (1-D mesh over R, MEM_OPT): statistics are reduced to each layer's owner only,
  which alone holds that layer's factors and decompositions; every step each rank sends
  its gradient shard of every layer to the layer's owner (gather), the owner
  preconditions the full gradient and scatters the result back.
* ``HSDP`` (replicate R/8 x shard 8, COMM_OPT grid): every rank all-gathers the full
  gradient within its shard group of 8, preconditions it with locally held state (every
  rank holds all decompositions, factors only on owners), keeps its shard.

Assumptions: float32 gradients, factors and decompositions (the library defaults with a
float32 model), K-FAC EIGEN with the eigenvalue outer product cached, colocated factors,
COMPUTE assignment for DDP rows and MEMORY assignment for FSDP2 (the point of sharding is
memory). K-FAC skips ``lm_head`` (its ``vocab x vocab`` factor alone would be 4-10 GB);
embeddings are not K-FAC layers. "Work" is the library's refresh cost estimate, ``Σ n³``
over the factors a rank owns (K-FAC: one eigendecomposition each), in units of 10^12
(``eigh`` costs about ``9 n³`` flops). The model's own gradient synchronisation (DDP
all-reduce, FSDP reduce-scatter and parameter all-gathers) is not included: it is the same
with or without a preconditioner.

    python benchmarks/scaling_table.py --out docs/scaling.md
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

import torch
from torch import nn

from kron_precond.distributed.assignment import assign_work
from kron_precond.enums import AssignmentStrategy
from kron_precond.methods import registry
from kron_precond.methods.base import tensor_bytes
from kron_precond.modules import compile_skip_patterns, is_skipped
from kron_precond.schedules import StepContext

META = torch.device("meta")


# ----------------------------------------------------------------------------- models
class GPT2Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class GPT2(nn.Module):
    def __init__(self, n_layer: int, d: int, vocab: int, context: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(GPT2Block(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2


class LlamaBlock(nn.Module):
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.input_norm, self.post_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)


class Llama(nn.Module):
    def __init__(self, n_layer: int, d: int, ffn: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d, ffn) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "GPT-2 XL (1.5B)": lambda: GPT2(n_layer=48, d=1600, vocab=50257, context=1024),
    "Llama 7B": lambda: Llama(n_layer=32, d=4096, ffn=11008, vocab=32000),
}
WORLD_SIZES = (8, 64, 1024)
HSDP_SHARD = 8  # one node of 8 GPUs shards, nodes replicate


# ----------------------------------------------------------------------------- layers
@dataclasses.dataclass
class LayerSizes:
    """Sizes of one registered layer, in bytes, from the library's own layer objects."""

    name: str
    costs: dict[str, tuple[float, float]]  # factor_costs(): part -> (n³ work, n² memory)
    grad: int  # its parameters' gradients
    statistics: int  # what a factor step reduces (K-FAC; 0 for PSGD)
    factors: int  # running-average factors (K-FAC; 0 for PSGD)
    refreshed: int  # what a refresh broadcasts to gradient workers
    applied: int  # what a gradient worker holds to apply (refreshed + derived)


def layer_sizes(model: nn.Module, method: str, skip: tuple[str, ...] = ("lm_head",)) -> list[LayerSizes]:
    """Register ``model`` (on ``meta``) as :class:`KronPreconditioner` would and size each layer."""
    kfac = method == "kfac"
    spec_class = registry.get(method)
    settings = {name: option.default for name, option in spec_class.options.items()}
    if kfac:
        settings.update(factor_dtype=torch.float32, inv_dtype=torch.float32)
    spec = spec_class(settings)
    patterns = compile_skip_patterns(list(skip) if kfac else [])
    selected = spec.select(model, lambda name, module: is_skipped(name, module, patterns), lambda *_: None)
    refreshed_ctx = StepContext(step=0, statistics=True, refresh=True, refresh_index=0, statistics_count=1,
                                hparams={"damping": 1e-3})
    sizes = []
    for index, sel in enumerate(selected):
        layer = spec.make_layer(index, sel)
        grad = sum(p.numel() * 4 for _, p in sel.params)
        if kfac:
            statistics = tensor_bytes(layer.shared_statistics())
            factors = layer.memory_by_kind()["factors"]
            refreshed = tensor_bytes(layer.refreshed_tensors())
            layer.finalize_refresh(refreshed_ctx)  # derives the cached outer product, as apply needs
            applied = layer.memory_by_kind()["decompositions"]
        else:
            statistics = factors = 0
            refreshed = applied = tensor_bytes(layer.refreshed_tensors())
        sizes.append(LayerSizes(sel.name, layer.factor_costs(), grad, statistics, factors, refreshed, applied))
    return sizes


# ----------------------------------------------------------------------------- strategies
@dataclasses.dataclass
class Row:
    strategy: str
    world: int
    plain_bytes: float  # preconditioner traffic per rank on a step without statistics/refresh
    factor_bytes: float  # ... on a K-FAC factor (statistics) step
    refresh_bytes: float  # ... on a refresh step (statistics + refresh + apply)
    memory_max: float  # preconditioner state on the fullest rank
    memory_mean: float
    work_max: float  # refresh work (Σ n³ of owned factors) on the busiest rank
    work_mean: float


STRATEGIES = ("DDP COMM_OPT", "DDP HYBRID", "DDP MEM_OPT", "FSDP2", "HSDP")


def _ring(k: int) -> float:
    return (k - 1) / k


def strategy_row(strategy: str, layers: list[LayerSizes], world: int) -> Row:
    """Per-rank figures of ``strategy`` at ``world`` ranks for the registered ``layers``."""
    R = world
    memory_strategy = strategy == "FSDP2"
    assignment = assign_work({l.name: l.costs for l in layers}, R,
                             AssignmentStrategy.MEMORY if memory_strategy else AssignmentStrategy.COMPUTE)
    owner = {l.name: assignment.owner(l.name, next(iter(l.costs))) for l in layers}
    work = [0.0] * R
    for l in layers:
        for part, (flops, _) in l.costs.items():
            work[assignment.owner(l.name, part)] += flops
    grads = sum(l.grad for l in layers)
    statistics = sum(l.statistics for l in layers)
    factors_all = sum(l.factors for l in layers)
    owned = lambda attr, r: sum(getattr(l, attr) for l in layers if owner[l.name] == r)  # noqa: E731

    if strategy.startswith("DDP"):
        W = {"DDP COMM_OPT": R, "DDP HYBRID": max(1, _largest_divisor_at_most(R, R // 2)),
             "DDP MEM_OPT": 1}[strategy]
        C = R // W
        columns = [sum(owned("refreshed", r) for r in range(c, R, C)) for c in range(C)]
        applied_col = [sum(owned("applied", r) for r in range(c, R, C)) for c in range(C)]
        plain = _ring(C) * grads if C > 1 else 0.0
        stats = 2 * _ring(R) * statistics
        refresh = _ring(W) * max(columns) if W > 1 else 0.0
        memory = [factors_all + applied_col[r % C] for r in range(R)]
    elif strategy == "FSDP2":
        # gather to the owner + scatter back: a rank sends its 1/R piece of every layer it
        # does not own, and (R-1)/R of every layer it owns.
        sends = [sum(l.grad / R for l in layers if owner[l.name] != r)
                 + _ring(R) * owned("grad", r) for r in range(R)]
        plain = max(sends)
        # reduce to the owner (ring reduce: (k-1)/k N per rank)
        stats = _ring(R) * statistics
        refresh = 0.0  # the owner is the only gradient worker
        memory = [owned("factors", r) + owned("applied", r) for r in range(R)]
    elif strategy == "HSDP":
        S = min(HSDP_SHARD, R)
        plain = _ring(S) * grads  # all-gather of the full gradient in the shard group
        stats = _ring(R) * statistics  # reduce to the owner over all ranks
        refresh = _ring(R) * sum(l.refreshed for l in layers)  # owners broadcast to all
        memory = [owned("factors", r) + sum(l.applied for l in layers) for r in range(R)]
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    has_statistics = statistics > 0
    factor_bytes = plain + stats if has_statistics else plain
    return Row(strategy, R, plain, factor_bytes, factor_bytes + refresh,
               max(memory), sum(memory) / R, max(work), sum(work) / R)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    for d in range(max(limit, 1), 0, -1):
        if n % d == 0:
            return d
    return 1


def table(model_name: str, method: str, model: nn.Module, worlds=WORLD_SIZES,
          strategies=STRATEGIES) -> tuple[list[LayerSizes], list[Row]]:
    layers = layer_sizes(model, method)
    return layers, [strategy_row(s, layers, w) for w in worlds for s in strategies]


# ----------------------------------------------------------------------------- output
def _gb(x: float) -> str:
    return f"{x / 1e9:.3g}"


def markdown(model_name: str, method: str, layers: list[LayerSizes], rows: list[Row]) -> str:
    params = sum(l.grad for l in layers) / 4
    lines = [f"### {model_name}, {method.upper()} ({len(layers)} layers, "
             f"{params / 1e9:.2f} B preconditioned parameters)", "",
             "| GPUs | strategy | sent/rank plain step (GB) | sent/rank factor step (GB) | "
             "sent/rank refresh step (GB) | precond memory/rank max (mean) (GB) | "
             "refresh work/rank max (mean) (Σn³, 1e12) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.world} | {r.strategy} | {_gb(r.plain_bytes)} | {_gb(r.factor_bytes)} | "
                     f"{_gb(r.refresh_bytes)} | {_gb(r.memory_max)} ({_gb(r.memory_mean)}) | "
                     f"{r.work_max / 1e12:.3g} ({r.work_mean / 1e12:.3g}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the tables (markdown) to this file")
    args = parser.parse_args()
    sections = []
    for model_name, build in MODELS.items():
        with torch.device(META):
            model = build()
        for method in ("kfac", "psgd"):
            layers, rows = table(model_name, method, model)
            sections.append(markdown(model_name, method, layers, rows))
    text = "\n".join(sections)
    print(text)
    if args.out:
        _replace_generated(args.out, text)


BEGIN, END = "<!-- BEGIN scaling_table.py -->", "<!-- END scaling_table.py -->"


def _replace_generated(path: str, text: str) -> None:
    """Replace what sits between the markers in ``path`` (the prose around them stays)."""
    with open(path) as f:
        doc = f.read()
    start, stop = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    with open(path, "w") as f:
        f.write(doc[:start] + "\n" + text + doc[stop:])


if __name__ == "__main__":
    main()
