"""The main job: a byte-level transformer language model on Python's standard library.

Trains the same small decoder-only transformer with AdamW, Muon, PSGD (the ``Kron``
optimizer), K-FAC and PSGD in front of Muon, and ``WhitenedMuon`` (``--methods`` picks
others), from the same initial weights, on the same batches, for the same number of
steps, then prints a table per method (held-out loss, steps and seconds to AdamW's final
held-out loss, step time, optimizer + preconditioner state bytes) and saves a plot of
held-out loss against step and against seconds.

The methods are stepped round-robin in one process (step 1 of every method, then step 2,
...) rather than one run after another, so that load from other processes on the
machine slows all of them alike and the wall-clock comparison stays fair.

    python examples/char_lm.py --threads 1                  # ~8 min on a busy 2-core CPU
    python examples/char_lm.py --methods adamw,kfac --steps 200
    torchrun --nproc_per_node=2 examples/char_lm.py         # DDP, gloo on CPU

Data: the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` (site-packages and
test suites excluded), sorted by relative path, concatenated and capped at
``--corpus-mb``; bytes are the tokens (vocabulary 256); the last 10% is held out.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import sysconfig
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: an uninstalled kron_precond
    sys.path.append(str(REPO_ROOT))
# Sibling modules are imported by file from this folder, never through a package named
# `examples` (other wheels, e.g. kfac-pytorch's, install a top-level `examples`).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kron_examples_common import (  # noqa: E402
    METHODS,
    AmpState,
    DistContext,
    PrecondConfig,
    StepTimer,
    all_reduce_mean,
    build_method,
    close_distributed,
    init_distributed,
    state_memory_bytes,
    train_step,
    wrap_ddp,
)
from kron_precond import precond_update_prob_schedule  # noqa: E402

VOCAB_SIZE = 256  # byte-level tokens
HELDOUT_FRACTION = 0.1
# Embeddings are lookups (K-FAC's Linear/Conv maths does not apply) and the output layer
# over the vocabulary is left to the base optimizer, as usual for K-FAC on LMs.
SKIP_LAYERS = ("Embedding", "lm_head")
# --wmuon-output-side's values -> WhitenedMuon's output_side
OUTPUT_SIDES = {"auto": "auto", "wide": "wide", "all": True, "none": False}


# --------------------------------------------------------------------------- data
def stdlib_source_files() -> list[Path]:
    """The standard library's ``*.py`` files in a fixed (sorted) order.

    site-packages holds whatever happens to be installed and the test suites are
    stripped by some distributions, so both are left out to keep the corpus the same
    from machine to machine (for the same Python version).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded_dirs = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    files = [
        path
        for path in root.rglob("*.py")
        if not excluded_dirs.intersection(path.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the concatenated stdlib sources, as uint8."""
    chunks, size = [], 0
    for path in stdlib_source_files():
        chunk = path.read_bytes() + b"\n"
        chunks.append(chunk)
        size += len(chunk)
        if size >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteCorpus:
    """Train / held-out split of a byte stream and the windows drawn from it."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        split = int(len(data) * (1 - HELDOUT_FRACTION))
        self.train, self.heldout = data[:split], data[split:]
        self.seq_len = seq_len

    def _windows(self, source: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = torch.arange(self.seq_len + 1)
        window = source[starts[:, None] + offsets].long()
        return window[:, :-1], window[:, 1:]  # inputs, next-byte targets

    def sample_train(self, batch_size: int, generator: torch.Generator):
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (batch_size,), generator=generator)
        return self._windows(self.train, starts)

    def heldout_set(self, n_seqs: int):
        """``n_seqs`` windows spread evenly over the held-out bytes (the same every call)."""
        last_start = len(self.heldout) - self.seq_len - 1
        starts = torch.linspace(0, last_start, n_seqs).long()
        return self._windows(self.heldout, starts)


# --------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with separate nn.Linear q/k/v/out projections
    (separate layers give K-FAC one Kronecker factor pair per projection)."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, H, T, D/H]
            return t.view(batch, seq, self.n_heads, d_model // self.n_heads).transpose(1, 2)

        attended = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), is_causal=True
        )
        return self.out_proj(attended.transpose(1, 2).reshape(batch, seq, d_model))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


@dataclass
class ModelConfig:
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    tie_embeddings: bool = False
    arch: str = "gpt"  # "gpt": CharTransformer; "llama" / "gpt2" / "mixtral" / "torch": examples/byte_<arch>.py


class CharTransformer(nn.Module):
    """Decoder-only transformer over bytes with learned positional embeddings."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB_SIZE, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config.d_model, config.n_heads) for _ in range(config.n_layers))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, VOCAB_SIZE, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_final(x))


# --arch: the examples' own GPT, or (module, class) of examples/byte_<arch>.py: a model built
# from a transformers config, or ("torch", "seq2seq") from PyTorch's own Transformer layers
BYTE_ARCHS = {"llama": ("byte_llama", "ByteLlama"), "gpt2": ("byte_gpt2", "ByteGPT2"),
              "mixtral": ("byte_mixtral", "ByteMixtral"), "torch": ("byte_torch", "ByteTorchTransformer"),
              "seq2seq": ("byte_seq2seq", "ByteSeq2Seq"), "qwen2": ("byte_qwen2", "ByteQwen2")}
ARCHS = ("gpt", *BYTE_ARCHS)


def build_model(config: ModelConfig) -> nn.Module:
    """The model ``config.arch`` names, on bytes: CharTransformer, the Llama-style ByteLlama,
    Hugging Face's GPT-2 (ByteGPT2), the mixture-of-experts ByteMixtral, the GPT built from
    PyTorch's nn.TransformerEncoderLayer (ByteTorchTransformer), the encoder-decoder built
    from PyTorch's encoder and decoder layers (ByteSeq2Seq), or the Llama-style model as Qwen2
    builds it (ByteQwen2)."""
    if config.arch == "gpt":
        return CharTransformer(config)
    if config.arch not in BYTE_ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {config.arch!r}")
    module, name = BYTE_ARCHS[config.arch]  # imported on use: transformers is an extra
    model_class = getattr(importlib.import_module(module), name)
    return model_class(config.d_model, config.n_layers, config.n_heads, config.seq_len, VOCAB_SIZE,
                       config.tie_embeddings)


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats per byte)."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(), targets.reshape(-1))


# --------------------------------------------------------------------------- training
@dataclass
class TrainConfig:
    steps: int = 600
    batch_size: int = 64  # sequences per optimizer step, over all ranks and micro-batches
    grad_accum: int = 1
    warmup_steps: int = 30
    weight_decay: float = 0.0
    eval_every: int = 10
    eval_seqs: int = 128
    corpus_mb: float = 4.0
    seed: int = 0
    amp: bool = False
    amp_dtype: str = "auto"  # with amp: "float16", "bfloat16", or "auto" (float16 on CUDA, else bfloat16)
    stop_after: int = 0  # > 0: stop after this many steps (the schedule still spans `steps`)


@dataclass
class Contender:
    """One compared run: a row name and how to build its optimizer / preconditioner."""

    name: str
    lr: float
    build: Callable[[nn.Module, torch.amp.GradScaler], tuple]  # (model, scaler) -> (optimizer, precond | None)
    precond_until: float = 1.0  # fraction of the steps after which the preconditioner is removed


@dataclass
class RunResult:
    name: str
    lr: float
    eval_steps: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    eval_train_seconds: list[float] = field(default_factory=list)  # training time so far
    step_seconds: list[float] = field(default_factory=list)
    state_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        return self.eval_losses[-1]

    @property
    def mean_step_seconds(self) -> float:
        return sum(self.step_seconds) / len(self.step_seconds)

    def first_reaching(self, target: float) -> tuple[float, float] | None:
        """(step, training seconds) at which the held-out loss first reaches ``target``,
        interpolated linearly between the last evaluation above it and the first at or
        below it (the loss is taken to fall linearly in both step and seconds between
        evaluations); ``None`` if no evaluation reaches it."""
        previous = None
        for step, loss, seconds in zip(self.eval_steps, self.eval_losses, self.eval_train_seconds):
            if loss <= target:
                if previous is None or previous[1] == loss:
                    return float(step), seconds
                step0, loss0, seconds0 = previous
                fraction = (loss0 - target) / (loss0 - loss)
                return step0 + fraction * (step - step0), seconds0 + fraction * (seconds - seconds0)
            previous = (step, loss, seconds)
        return None


def warmup_cosine(warmup_steps: int, total_steps: int, floor: float = 0.1) -> Callable[[int], float]:
    """LR multiplier: linear warm-up, then cosine decay to ``floor`` of the peak."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return multiplier


@dataclass
class _Live:
    """A contender while it trains."""

    result: RunResult
    model: nn.Module
    optimizer: torch.optim.Optimizer
    precond: object
    scheduler: torch.optim.lr_scheduler.LambdaLR
    amp: AmpState
    train_seconds: float = 0.0
    precond_steps: int | None = None  # steps that call the preconditioner (None: all)


def _shard(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """This rank's contiguous slice of a global batch."""
    per_rank = tensor.shape[0] // ctx.world_size
    return tensor[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]


def _micro_batches(inputs, targets, grad_accum: int, ctx: DistContext):
    inputs, targets = _shard(inputs, ctx).to(ctx.device), _shard(targets, ctx).to(ctx.device)
    return list(zip(inputs.chunk(grad_accum), targets.chunk(grad_accum)))


@torch.no_grad()
def evaluate(model: nn.Module, heldout, ctx: DistContext, amp: AmpState, chunk: int = 32) -> float:
    """Mean held-out loss; each rank scores its shard of the fixed held-out windows."""
    model.eval()
    inputs, targets = _shard(heldout[0], ctx), _shard(heldout[1], ctx)
    losses = []
    for x, y in zip(inputs.split(chunk), targets.split(chunk)):
        with amp.autocast():
            losses.append(lm_loss(model, x.to(ctx.device), y.to(ctx.device)).item() * len(x))
    model.train()
    return all_reduce_mean(sum(losses) / len(inputs), ctx)


def _start(contender: Contender, model_config: ModelConfig, train: TrainConfig, ctx: DistContext) -> _Live:
    torch.manual_seed(train.seed)  # identical initial weights for every contender
    model = wrap_ddp(build_model(model_config).to(ctx.device), ctx)
    amp = AmpState.create(train.amp, ctx.device, train.amp_dtype)
    optimizer, precond = contender.build(model, amp.scaler)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(train.warmup_steps, train.steps))
    until = None if contender.precond_until >= 1.0 else round(contender.precond_until * train.steps)
    return _Live(RunResult(contender.name, contender.lr), model, optimizer, precond, scheduler, amp,
                 precond_steps=until)


def _check_batch_split(train: TrainConfig, ctx: DistContext) -> None:
    if train.batch_size % (ctx.world_size * train.grad_accum):
        raise ValueError(
            f"--batch-size {train.batch_size} must be divisible by world size {ctx.world_size} "
            f"x --grad-accum {train.grad_accum}"
        )


def train_round_robin(
    contenders: Sequence[Contender],
    model_config: ModelConfig,
    train: TrainConfig,
    ctx: DistContext,
    corpus: ByteCorpus | None = None,
    progress: bool = True,
) -> list[RunResult]:
    """Train every contender for ``train.steps`` steps on the same batches, interleaved."""
    _check_batch_split(train, ctx)
    corpus = corpus or ByteCorpus(load_corpus(int(train.corpus_mb * 2**20)), model_config.seq_len)
    heldout = corpus.heldout_set(train.eval_seqs)
    runs = [_start(c, model_config, train, ctx) for c in contenders]
    data_order = torch.Generator().manual_seed(train.seed)  # same on every rank

    def record_eval(step: int) -> None:
        for run in runs:
            run.result.eval_steps.append(step)
            run.result.eval_losses.append(evaluate(run.model, heldout, ctx, run.amp))
            run.result.eval_train_seconds.append(run.train_seconds)

    record_eval(0)
    bar = tqdm(range(1, train.steps + 1), desc="training", disable=not (progress and ctx.is_main))
    for step in bar:
        batch = _micro_batches(*corpus.sample_train(train.batch_size, data_order), train.grad_accum, ctx)
        train_losses = {}
        for run in runs:
            precond = run.precond
            if precond is not None and run.precond_steps is not None and step > run.precond_steps:
                if step == run.precond_steps + 1:
                    precond.remove()  # the base optimizer alone from here on (hooks gone too)
                precond = None  # kept in run.precond for the memory report
            timer = StepTimer(ctx.device)
            with timer:
                train_losses[run.result.name] = train_step(
                    run.model, run.optimizer, precond, batch, lm_loss, run.amp
                )
                run.scheduler.step()
            run.result.step_seconds.append(timer.seconds)
            run.train_seconds += timer.seconds
        bar.set_postfix({name: f"{loss:.3f}" for name, loss in train_losses.items()})
        stopping = 0 < train.stop_after <= step
        if step % train.eval_every == 0 or step == train.steps or stopping:
            record_eval(step)
        if stopping:
            break
    for run in runs:
        run.result.state_bytes = state_memory_bytes(run.optimizer, run.precond)
        if run.precond is not None:
            run.precond.remove()  # unhook, so the model can be reused or freed
    return [run.result for run in runs]


# --------------------------------------------------------------------------- reporting
def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def results_table(results: Sequence[RunResult], reference: RunResult, target: float,
                  muon: RunResult | None = None) -> str:
    """One row per run against ``reference`` (AdamW; the columns name another reference's
    run) and the held-out ``target`` loss; with ``muon``, also the wall-clock to the target
    relative to that Muon run. A ratio to a time of 0 (a target reached at step 0) is "-"."""
    def seconds_to_target(run: RunResult | None) -> float:
        reach = run.first_reaching(target) if run is not None else None
        return reach[1] if reach else float("nan")

    def ratio(value: float, base: float) -> str:  # "-" where the base is 0 (reached at step 0) or unknown
        return f"{value / base:.2f}" if base > 0 and math.isfinite(base) else "-"

    ref_seconds, muon_seconds = seconds_to_target(reference), seconds_to_target(muon)
    # the columns name the reference run's family: AdamW's in the main job, the first run without it
    label = "AdamW" if reference.name.split()[0] == "adamw" else reference.name
    headers = ["run", "lr", "final loss", "steps to target", "s to target", f"x {label} time",
               *(["x Muon time"] if muon is not None else []),
               "ms/step", f"x {label} step", "optimizer state", "precond state"]
    rows = []
    for r in results:
        reach = r.first_reaching(target)
        rows.append([
            r.name,
            f"{r.lr:g}",
            f"{r.final_loss:.4f}",
            f"{reach[0]:.1f}" if reach else "not reached",
            f"{reach[1]:.1f}" if reach else "-",
            ratio(reach[1], ref_seconds) if reach else "-",
            *([ratio(reach[1], muon_seconds) if reach else "-"] if muon is not None else []),
            f"{1000 * r.mean_step_seconds:.1f}",
            ratio(r.mean_step_seconds, reference.mean_step_seconds),
            f"{r.state_bytes['optimizer']:,} B",
            f"{r.state_bytes['preconditioner']:,} B",
        ])
    return format_table(headers, rows)


def plot_curves(results: Sequence[RunResult], target: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for r in results:
        by_step.plot(r.eval_steps, r.eval_losses, marker=".", label=r.name)
        by_time.plot(r.eval_train_seconds, r.eval_losses, marker=".", label=r.name)
    for ax, xlabel in ((by_step, "step"), (by_time, "training seconds (eval excluded)")):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    by_step.set_ylabel("held-out loss (nats/byte)")
    lows = [min(r.eval_losses) for r in results]
    by_step.set_ylim(min(lows) - 0.05, min(lows) + 1.2)  # the interesting end of the curves
    by_time.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI
# Peak learning rates picked by the sweep in benchmarks/results/lab_notebook.md (benchmarks/convergence.py).
# Short runs: the library's default anneal keeps p=1 for 500 steps, i.e. a Q update on
# every step of a 600-step run; this one anneals from step 100 and reaches 0.03 by ~450.
DEFAULT_PSGD_UPDATE_PROB = "anneal:100:0.01"
# AdamW and Muon (what users pick today) next to the library's best configurations.
DEFAULT_METHODS = "adamw,muon,psgd,kfac_muon,psgd_muon,wmuon"
DEFAULT_PSGD_INIT_SCALE = "auto"  # estimated from the first gradient
DEFAULT_PSGD_UPDATE = "eq"
# In front of Muon (benchmarks/results/lab_notebook.md, the fair sweep and seed 1): PSGD at a constant 5 %
# update probability reaches the target 1.14x / 1.05x Muon's wall-clock (seeds 0 / 1)
# against 1.27x / 1.25x with the anneal above, and ends 0.3 % / 2.3 % higher.
# K-FAC on the first 1024 of 4096 rows with the inverse form: 1.09x / 1.10x Muon's
# wall-clock against 1.16x / 1.16x on every row in the eigenbasis, and a lower final loss.
# Both were measured in front of Muon only: "auto" applies them to psgd_muon / kfac_muon
# and keeps the earlier settings for the methods they were not measured with.
MUON_SETTINGS = {"psgd_muon": {"precond_update_probability": 0.05},
                 "kfac_muon": {"compute_method": "inverse", "statistics_rows": 1024}}
AUTO_FALLBACK = {"precond_update_probability": "same", "compute_method": "eigen", "statistics_rows": None}
DEFAULT_PSGD_PRECOND_UPDATE_PROB = "auto"
DEFAULT_KFAC_COMPUTE_METHOD = "auto"
DEFAULT_KFAC_STATISTICS_ROWS = "auto"
DEFAULT_LRS = {"adamw": 2e-3, "kfac": 4e-3, "psgd": 2e-3, "psgd_adamw": 2e-3, "sgd": 0.1, "kfac_sgd": 0.1,
               "psgd_sgd": 0.1, "ekfac": 4e-3, "shampoo": 2e-3,  # these two: not swept
               # Muon at momentum 0.9 (the examples' default) and every method in front of it:
               # Muon, K-FAC + Muon and PSGD + Muon swept 4e-3-3.2e-2 at that momentum on 3 seeds,
               # the others 8e-3 / 1.6e-2 on seed 0, where 1.6e-2 ended lower for every one
               # (benchmarks/results/lab_notebook.md, "Muon's momentum" and "The other Muon-based methods")
               "muon": 1.6e-2, "kfac_muon": 1.6e-2, "psgd_muon": 1.6e-2, "ekfac_muon": 1.6e-2,
               "muon_kron": 1.6e-2, "kfac_muon_kron": 1.6e-2, "ikfac_muon": 1.6e-2, "muon2": 1.6e-2,
               "ikfac_muon2": 1.6e-2, "soap_muon": 1.6e-2, "wmuon": 1.6e-2, "wmuon_pre": 1.6e-2}


def _psgd_update_probability(value: str):
    """``--psgd-update-prob``: a probability; ``anneal`` (the library's default schedule:
    1.0 for 500 steps, 0.03 from ~4000); or ``anneal:FLAT_START:DECAY`` for the same
    exponential anneal with other constants."""
    if value == "anneal":
        return None
    if value.startswith("anneal:"):
        _, flat_start, decay = value.split(":")
        return precond_update_prob_schedule(flat_start=int(flat_start), decay=float(decay))
    return float(value)


def _precond_update_probability(value: str):
    """``--psgd-precond-update-prob``: as ``--psgd-update-prob``, ``same`` or ``auto``."""
    return value if value in ("same", "auto") else _psgd_update_probability(value)


def _optional_rows(value: str) -> int | None | str:
    """``--kfac-statistics-rows``: a row count, ``all`` or ``auto``."""
    return None if value == "all" else value if value == "auto" else int(value)


def resolve_auto(method: str, precond: PrecondConfig) -> PrecondConfig:
    """``precond`` with each ``"auto"`` setting replaced by ``method``'s measured one."""
    chosen = {**AUTO_FALLBACK, **MUON_SETTINGS.get(method, {})}
    return replace(precond, **{k: v for k, v in chosen.items() if getattr(precond, k) == "auto"})


def _psgd_init_scale(value: str) -> float | None:
    """``--psgd-init-scale``: a scale, or ``auto`` to estimate it from the first gradient."""
    return None if value == "auto" else float(value)


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {number}")
        return number
    return parse


def add_training_args(p: argparse.ArgumentParser) -> None:
    """Model, data, schedule and preconditioner flags (shared with benchmarks/convergence.py)."""
    p.add_argument("--steps", type=_count(1), default=TrainConfig.steps, help="optimizer steps per method")
    p.add_argument("--batch-size", type=_count(1), default=TrainConfig.batch_size,
                   help="sequences per optimizer step, summed over ranks and micro-batches")
    p.add_argument("--grad-accum", type=_count(1), default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=_count(2), default=ModelConfig.seq_len, help="tokens (bytes) per sequence")
    p.add_argument("--d-model", type=_count(1), default=ModelConfig.d_model, help="transformer width")
    p.add_argument("--n-layers", type=_count(1), default=ModelConfig.n_layers, help="transformer blocks")
    p.add_argument("--n-heads", type=_count(1), default=ModelConfig.n_heads, help="attention heads")
    p.add_argument("--tie-embeddings", action="store_true", help="share token embedding and lm_head weights")
    p.add_argument("--arch", choices=ARCHS, default=ModelConfig.arch,
                   help="gpt: the byte-level GPT (LayerNorm, learned positions, GELU); llama: a Llama-style "
                        "model from a transformers config (RMSNorm, rotary, SwiGLU, grouped-query attention); "
                        "gpt2: Hugging Face's GPT2LMHeadModel from a config (Conv1D, fused q/k/v); "
                        "mixtral: Mixtral from a config (the Llama-style attention, 4 fused SwiGLU experts, top-2); "
                        "torch: the gpt model from PyTorch's nn.TransformerEncoderLayer (nn.MultiheadAttention); "
                        "seq2seq: an encoder-decoder from PyTorch's encoder and decoder layers, each window's first "
                        "half the source, its second half the target (cross-attention); "
                        "qwen2: the llama model as Qwen2 builds it (biased query, key and value projections)")
    p.add_argument("--weight-decay", type=float, default=TrainConfig.weight_decay, help="decoupled weight decay")
    p.add_argument("--warmup-steps", type=_count(0), default=TrainConfig.warmup_steps, help="linear LR warm-up steps")
    p.add_argument("--damping", type=float, default=PrecondConfig.damping, help="K-FAC damping")
    p.add_argument("--factor-update-steps", type=int, default=PrecondConfig.factor_update_steps,
                   help="K-FAC: steps between factor updates")
    p.add_argument("--inv-update-steps", type=int, default=PrecondConfig.inv_update_steps,
                   help="K-FAC: steps between eigendecompositions")
    p.add_argument("--kfac-compute-method", choices=("auto", "eigen", "inverse"), default=DEFAULT_KFAC_COMPUTE_METHOD,
                   help="K-FAC: 'eigen' (exact damping, 4 matmuls per layer and step), 'inverse' "
                        "(factored damping, 2 matmuls) or 'auto' (inverse for kfac_muon, else eigen)")
    p.add_argument("--kfac-statistics-rows", type=_optional_rows, default=DEFAULT_KFAC_STATISTICS_ROWS,
                   help="K-FAC / EK-FAC: rows per module call entering the factor statistics, 'all', "
                        "or 'auto' (1024 for kfac_muon, else all)")
    p.add_argument("--kl-clip", type=float, default=PrecondConfig.kl_clip, help="K-FAC kl_clip; <= 0 disables")
    p.add_argument("--psgd-update-prob", type=_psgd_update_probability, default=DEFAULT_PSGD_UPDATE_PROB,
                   help="PSGD preconditioner update probability: a number, 'anneal' (library default: "
                        "1.0 for 500 steps, then down to 0.03 by ~4000) or 'anneal:FLAT_START:DECAY'")
    p.add_argument("--psgd-precond-update-prob", type=_precond_update_probability,
                   default=DEFAULT_PSGD_PRECOND_UPDATE_PROB,
                   help="the same for PSGD in front of another optimizer (psgd_muon, psgd_adamw, "
                        "psgd_sgd); 'same': --psgd-update-prob; 'auto': 0.05 for psgd_muon, else same")
    p.add_argument("--psgd-init-scale", type=_psgd_init_scale, default=DEFAULT_PSGD_INIT_SCALE,
                   help="PSGD initial preconditioner scale, or 'auto' (estimated from the first gradient)")
    p.add_argument("--psgd-update", choices=("eq", "procrustes"), default=DEFAULT_PSGD_UPDATE,
                   help="how PSGD fits its factors: 'eq' (triangular Q, triangular solves) or "
                        "'procrustes' (dense near-SPD Q, matmul-only Q0.5EQ1.5 rule)")
    p.add_argument("--ikfac-every", type=int, default=PrecondConfig.ikfac_every,
                   help="input-side K-FAC (ikfac_muon, ikfac_muon2): steps between statistics steps, "
                        "each followed by a Cholesky refresh")
    p.add_argument("--ikfac-damping", type=float, default=PrecondConfig.ikfac_damping,
                   help="input-side K-FAC: damping relative to A's mean eigenvalue, lambda = d * tr(A)/dim")
    p.add_argument("--ikfac-decay", type=float, default=PrecondConfig.ikfac_factor_decay,
                   help="input-side K-FAC: running-average decay of A per statistics step")
    p.add_argument("--ikfac-rows", type=_optional_rows, default=None,
                   help="input-side K-FAC: rows per module call entering A (default: all)")
    p.add_argument("--moment-decay", type=float, default=PrecondConfig.moment_decay,
                   help="second moment (muon2, ikfac_muon2): decay beta of the running mean of squares")
    p.add_argument("--muon-momentum", type=float, default=PrecondConfig.muon_momentum,
                   help="torch.optim.Muon's momentum, for Muon and every method in front of it")
    p.add_argument("--muon-adjust-lr-fn", choices=("match_rms_adamw", "original"),
                   default=PrecondConfig.muon_adjust_lr_fn,
                   help="torch.optim.Muon's adjust_lr_fn, for Muon and WhitenedMuon; with 'original' (torch's "
                        "default) the lr is on Muon's spectral scale: set --muon-rest-lr for the AdamW half")
    p.add_argument("--muon-rest-lr", type=float, default=None,
                   help="peak lr of the AdamW half of Muon's and WhitenedMuon's split (default: the same lr)")
    p.add_argument("--wmuon-every", type=int, default=PrecondConfig.wmuon_every,
                   help="WhitenedMuon (wmuon): statistics_every, steps between statistics steps and refreshes")
    p.add_argument("--wmuon-factor-decay", type=float, default=PrecondConfig.wmuon_factor_decay,
                   help="WhitenedMuon: factor_decay per refresh (horizon: every / (1 - decay) steps)")
    p.add_argument("--wmuon-damping", type=float, default=PrecondConfig.wmuon_damping,
                   help="WhitenedMuon: damping, relative to each factor's mean eigenvalue")
    p.add_argument("--wmuon-output-damping", type=float, default=PrecondConfig.wmuon_output_damping,
                   help="WhitenedMuon: output_damping, the damping of the output side's factors (default: "
                        "--wmuon-damping's)")
    p.add_argument("--wmuon-output-side", nargs="?", const="all", default="auto",
                   choices=("auto", "wide", "all", "none"),
                   help="WhitenedMuon: output_side 'auto' (default: the first layers of ungated MLPs), 'wide' "
                        "(every weight whose output is wider than its input), 'all' (True; also the bare flag) "
                        "or 'none' (False)")
    p.add_argument("--wmuon-center-inputs", choices=("auto", "all", "none"), default="auto",
                   help="WhitenedMuon: center_inputs None (the bias-free query and key projections; every bias-free "
                        "layer where none is named so) / True / False")
    p.add_argument("--wmuon-fused-qkv", choices=("auto", "whole"), default="auto",
                   help="WhitenedMuon: fused_qkv None (a fused query/key/value projection of a known layout, "
                        "GPT-2's c_attn, stepped as three matrices) or 'whole' (False: orthogonalised as one matrix)")
    p.add_argument("--stop-after", type=_count(0), default=0,
                   help="stop after this many steps while the LR schedule still spans --steps "
                        "(time-to-a-fixed---target checks; 'final loss' is then the loss there)")
    p.add_argument("--eval-every", type=_count(1), default=TrainConfig.eval_every,
                   help="steps between held-out evaluations")
    p.add_argument("--eval-seqs", type=_count(1), default=TrainConfig.eval_seqs,
                   help="held-out sequences per evaluation")
    p.add_argument("--corpus-mb", type=float, default=TrainConfig.corpus_mb,
                   help="MiB of stdlib source to use")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the data order")
    p.add_argument("--amp", action="store_true",
                   help="autocast (float16 + GradScaler on CUDA, bfloat16 on CPU; --amp-dtype picks)")
    p.add_argument("--amp-dtype", choices=("auto", "float16", "bfloat16"), default="auto",
                   help="autocast dtype with --amp (float16 runs a GradScaler)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda")
    p.add_argument("--threads", type=_count(0), default=0, help="torch CPU threads per process (0: torch's default)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, from: {', '.join(METHODS)}")
    for method, lr in DEFAULT_LRS.items():
        p.add_argument(f"--lr-{method.replace('_', '-')}", type=float, default=lr,
                       help=f"peak learning rate for {METHODS[method].label}")
    add_training_args(p)
    p.add_argument("--out", type=Path, default=Path("runs/char_lm"), help="directory for the plot and results.json")
    return p.parse_args(argv)


def configs_from_args(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig, PrecondConfig]:
    """The configs ``add_training_args`` flags describe."""
    model = ModelConfig(args.d_model, args.n_layers, args.n_heads, args.seq_len, args.tie_embeddings, args.arch)
    train = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, eval_every=args.eval_every,
        eval_seqs=args.eval_seqs, corpus_mb=args.corpus_mb, seed=args.seed, amp=args.amp, amp_dtype=args.amp_dtype,
        stop_after=args.stop_after,
    )
    precond = PrecondConfig(
        skip_layers=SKIP_LAYERS, factor_update_steps=args.factor_update_steps,
        inv_update_steps=args.inv_update_steps, damping=args.damping,
        kl_clip=args.kl_clip if args.kl_clip > 0 else None,
        update_probability=args.psgd_update_prob, psgd_init_scale=args.psgd_init_scale,
        precond_update_probability=args.psgd_precond_update_prob,
        psgd_update=args.psgd_update,
        compute_method=args.kfac_compute_method, statistics_rows=args.kfac_statistics_rows,
        accumulation_steps=args.grad_accum,
        ikfac_every=args.ikfac_every, ikfac_damping=args.ikfac_damping, ikfac_factor_decay=args.ikfac_decay,
        ikfac_statistics_rows=args.ikfac_rows, moment_decay=args.moment_decay,
        muon_momentum=args.muon_momentum, muon_adjust_lr_fn=args.muon_adjust_lr_fn, muon_rest_lr=args.muon_rest_lr,
        wmuon_every=args.wmuon_every,
        wmuon_factor_decay=args.wmuon_factor_decay, wmuon_both_sides=OUTPUT_SIDES[args.wmuon_output_side],
        wmuon_damping=args.wmuon_damping, wmuon_output_damping=args.wmuon_output_damping,
        wmuon_center_inputs={"auto": None, "all": True, "none": False}[args.wmuon_center_inputs],
        wmuon_fused_qkv={"auto": None, "whole": False}[args.wmuon_fused_qkv],
    )
    return model, train, precond


def method_contender(method: str, lr: float, weight_decay: float, precond: PrecondConfig) -> Contender:
    """A Contender for one of the library's METHODS."""
    precond = resolve_auto(method, precond)
    return Contender(
        name=method, lr=lr,
        build=lambda model, scaler: build_method(method, model, lr, weight_decay, precond, scaler),
        precond_until=precond.precond_until,
    )


def report(results: Sequence[RunResult], model: ModelConfig, train: TrainConfig, ctx: DistContext, out: Path,
           title: str) -> None:
    """Print the table and save plot + JSON (rank 0 only)."""
    if not ctx.is_main:
        return
    reference = next((r for r in results if r.name == "adamw"), results[0])
    target = reference.final_loss
    print(f"\nheld-out target = final loss of {reference.name}: {target:.4f} nats/byte")
    muon = next((r for r in results if r.name == "muon"), None)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.json", "w") as f:  # first: the runs are kept whatever the table meets
        json.dump({"model": asdict(model), "train": asdict(train), "world_size": ctx.world_size,
                   "runs": [asdict(r) for r in results]}, f)
    print(results_table(results, reference, target, muon))
    plot_curves(results, target, out / "char_lm.png", title)
    print(f"saved {out / 'char_lm.png'} and {out / 'results.json'}")


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown --methods {unknown}; choose from {list(METHODS)}")
    repeated = sorted({m for m in methods if methods.count(m) > 1})
    if repeated:
        raise SystemExit(f"--methods lists {repeated} more than once")
    if not args.corpus_mb > 0:
        raise SystemExit(f"--corpus-mb must be positive, got {args.corpus_mb}")
    if args.stop_after > args.steps:
        raise SystemExit(f"--stop-after {args.stop_after} is past --steps {args.steps}")
    if args.device != "auto":
        try:
            torch.device(args.device)
        except RuntimeError:
            raise SystemExit(f"--device {args.device!r} is not a torch device (auto, cpu, cuda, cuda:1, ...)") from None
    ctx = init_distributed(args.device)
    model_config, train, precond = configs_from_args(args)
    lrs = {m: getattr(args, f"lr_{m}") for m in methods}
    contenders = [method_contender(m, lrs[m], train.weight_decay, precond) for m in methods]
    try:  # the settings' own refusals (the batch split, the model's shape) as command-line errors
        _check_batch_split(train, ctx)
        n_params = sum(p.numel() for p in build_model(model_config).parameters())
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    if ctx.is_main:
        tokens = train.batch_size * model_config.seq_len
        print(f"{n_params:,} parameters, {tokens} tokens/step, {train.steps} steps, "
              f"world size {ctx.world_size}, device {ctx.device}, {torch.get_num_threads()} threads")
    results = train_round_robin(contenders, model_config, train, ctx)
    title = (f"char LM on stdlib: d={model_config.d_model} L={model_config.n_layers} "
             f"T={model_config.seq_len} B={train.batch_size}, {train.steps} steps")
    report(results, model_config, train, ctx, args.out, title)
    close_distributed(ctx)
    return results


if __name__ == "__main__":
    main()
