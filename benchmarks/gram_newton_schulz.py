"""Whether WhitenedMuon's whitened Newton-Schulz step pays in Gram form.

``WhitenedMuon`` steps a weight ``M`` ``[out, in]`` with its input whitener ``T``
(``Tᵀ T = (A + λI)⁻¹``) by ``D = msign(M Tᵀ) T``, rescaled to ``‖msign(M Tᵀ)‖_F``: two in-wide
products around Muon's Newton-Schulz iteration. Newton-Schulz computes ``msign(X) = q(X Xᵀ) X``
for a fixed polynomial ``q``, so the same step can be written in Gram form (Gram
Newton-Schulz, iterated here through the whitener):

* ``out <= in``: ``D ∝ q(S) M P`` with ``P = Tᵀ T`` (formed once per refresh) and
  ``S = M P Mᵀ``. That is one in-wide product instead of two, and an iteration on
  ``out × out`` matrices. For the MLP's second layer ``[d, 4d]`` it is about 44 d³ multiply-adds
  against 77 d³;
* ``out > in``: ``D ∝ M Tᵀ q(C) T`` with ``C = T Mᵀ M Tᵀ``.

Each iteration updates ``Q = q_k(S)`` and ``R = Q² S`` (``R`` recomputed from ``Q`` and ``S``
once, at ``--restart``, as the Gram Newton-Schulz of Dao et al. restarts). The algebra is
exact; the question is rounding. ``S`` rounded to bfloat16 has eigenvalues off by about
``2⁻⁸ ‖S‖``, and ``q`` grows an eigenvalue of ``S`` pushed below 0 without bound, where the
standard form, which iterates on ``X`` itself, cannot make one negative.

The script trains the main job's model (``examples/char_lm.py``) for ``--steps`` steps of
``WhitenedMuon`` so the momenta and whiteners are a real run's. Then, for each stack of
same-shape weights, it prints:

* the time of the library's step (``WhitenedMuon._direction``: standard form, bfloat16, as
  the optimizer runs it) and of the Gram form in three precisions: all in bfloat16; the
  products with ``M`` in bfloat16 and the ``out × out`` iteration in float32
  (``bf16/fp32``); all in float32;
* each one's relative distance from the same step in float64;
* the share of the whitened momentum's squared singular values below ``2⁻⁸`` of the largest
  (the bfloat16 rounding of ``S``).

    OMP_NUM_THREADS=1 python benchmarks/gram_newton_schulz.py --threads 1 --d-model 256 --steps 150
"""
from __future__ import annotations

import argparse
import math
import sys
import types
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "examples"))  # the examples' modules, imported by file

from benchmarks.refresh_cost import median_ms  # noqa: E402
from kron_precond.whitened_muon import NS_COEFFICIENTS, WhitenedMuon  # noqa: E402

BF16_RESOLUTION = 2.0 ** -8  # bfloat16's spacing relative to a value's magnitude (8 significant bits)


def library_direction(momenta: torch.Tensor, whiteners: torch.Tensor, dtype: torch.dtype,
                      steps: int = 5) -> torch.Tensor:
    """``WhitenedMuon``'s own step direction for a stack ``[k, out, in]`` and its input
    whiteners ``[k, in, in]`` (one block), in ``dtype``: the standard form."""
    optimizer = types.SimpleNamespace(ns_dtype=dtype, ns_steps=steps, ns_coefficients="muon",
                                      _whiten=WhitenedMuon._whiten)
    return WhitenedMuon._direction(optimizer, momenta.to(dtype), None, whiteners.to(dtype)[:, None])


def gram_direction(momenta: torch.Tensor, whiteners: torch.Tensor, precision: torch.Tensor | None,
                   dtype: torch.dtype, iterate_dtype: torch.dtype, steps: int = 5, restart: int = 2) -> torch.Tensor:
    """The same direction in Gram form: the products with the momenta in ``dtype``, the
    ``out × out`` (or ``in × in``) iteration in ``iterate_dtype``. ``precision``: ``Tᵀ T``
    per weight, needed when ``out <= in`` (what a refresh would form once)."""
    a, b, c = NS_COEFFICIENTS
    m = momenta.to(dtype)
    t = whiteners.to(dtype)
    wide = m.shape[-2] <= m.shape[-1]
    if wide:
        assert precision is not None
        y = torch.bmm(m, precision.to(dtype))  # M P
        gram = torch.bmm(y, m.mT)  # M P Mᵀ = X Xᵀ, X = M Tᵀ
    else:
        gram = torch.bmm(torch.bmm(t, torch.bmm(m.mT, m)), t.mT)  # T Mᵀ M Tᵀ = Xᵀ X
    s = gram.to(iterate_dtype)
    trace = s.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]  # ‖X‖²_F
    s = s / trace.clamp(min=torch.finfo(iterate_dtype).tiny)
    eye = torch.eye(s.shape[-1], dtype=iterate_dtype, device=s.device)
    q, r = None, s
    for i in range(steps):
        z = torch.baddbmm(torch.add(eye, r, alpha=b / a), r, r, beta=a, alpha=c)  # a I + b R + c R²
        q = z if q is None else torch.bmm(z, q)
        if i < steps - 1:
            r = torch.bmm(torch.bmm(q, s), q.mT) if i + 1 == restart else torch.bmm(z, torch.bmm(z, r))
    ortho_squared = (torch.bmm(q, s) * q).sum(dim=(-2, -1), keepdim=True)  # ‖q(S) X / ‖X‖‖²_F
    qd = q.to(dtype)
    direction = torch.bmm(qd, y) if wide else torch.bmm(m, torch.bmm(torch.bmm(t.mT, qd), t))
    wide_dtype = torch.promote_types(dtype, torch.float32)
    norm = direction.to(wide_dtype).norm(dim=(-2, -1), keepdim=True).clamp(min=1e-30)
    return direction * (ortho_squared.to(wide_dtype).clamp(min=0).sqrt() / norm).to(dtype)


def relative_distance(x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((x.double() - reference).norm() / reference.norm()).item()


def trained_stacks(d_model: int, steps: int, batch_size: int, lr: float, momentum: float,
                   seed: int) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """The momenta and input whiteners of the main job's model after ``steps`` steps of
    ``WhitenedMuon``, stacked by weight shape: ``{(out, in): (momenta, whiteners)}``, float32."""
    from char_lm import ByteCorpus, ModelConfig, build_model, lm_loss, load_corpus
    config = ModelConfig(d_model=d_model)
    corpus = ByteCorpus(load_corpus(2 ** 21), config.seq_len)
    torch.manual_seed(seed)
    model = build_model(config)
    optimizer = WhitenedMuon(model, lr=lr, momentum=momentum, skip_layers=["Embedding", "lm_head"])
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = corpus.sample_train(batch_size, generator)
        lm_loss(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    stacks: dict[tuple[int, int], list] = {}
    for p in model.parameters():
        state = optimizer.state.get(p, {})
        if state.get("input_whitener") is None:
            continue
        whitener = state["input_whitener"]
        if whitener.shape[-3] != 1:
            raise ValueError("one block per whitener expected (block_size=None)")
        stacks.setdefault(tuple(p.shape), []).append((state["momentum_buffer"], whitener[0]))
    optimizer.remove()
    return {shape: (torch.stack([m for m, _ in pairs]).float(), torch.stack([w for _, w in pairs]).float())
            for shape, pairs in stacks.items()}


def measure(shape: tuple[int, int], momenta: torch.Tensor, whiteners: torch.Tensor, device: torch.device,
            repeats: int) -> dict:
    """One row: a stack's step timed and checked both ways."""
    momenta, whiteners = momenta.to(device), whiteners.to(device)
    reference = library_direction(momenta.double(), whiteners.double(), torch.float64)
    precision = torch.bmm(whiteners.mT, whiteners)
    bf16 = torch.bfloat16
    cast = (momenta.to(bf16), whiteners.to(bf16), precision.to(bf16))  # the refresh's casts, once

    def standard() -> torch.Tensor:
        return library_direction(cast[0], cast[1], bf16)

    def gram(iterate_dtype: torch.dtype) -> Callable[[], torch.Tensor]:
        return lambda: gram_direction(cast[0], cast[1], cast[2], bf16, iterate_dtype)

    def gram_float32() -> torch.Tensor:
        return gram_direction(momenta, whiteners, precision, torch.float32, torch.float32)

    whitened = torch.bmm(momenta.double(), whiteners.double().mT)
    squared = torch.linalg.svdvals(whitened).square()
    small = (squared < BF16_RESOLUTION * squared[:, :1]).double().mean().item()
    return {
        "shape": shape, "count": momenta.shape[0], "small": small,
        "standard ms": median_ms(standard, device, repeats),
        "gram bf16 ms": median_ms(gram(bf16), device, repeats),
        "gram bf16/fp32 ms": median_ms(gram(torch.float32), device, repeats),
        "gram fp32 ms": median_ms(gram_float32, device, repeats),
        "standard error": relative_distance(standard(), reference),
        "gram bf16 error": relative_distance(gram(bf16)(), reference),
        "gram bf16/fp32 error": relative_distance(gram(torch.float32)(), reference),
        "gram fp32 error": relative_distance(gram_float32(), reference),
    }


COLUMNS = ("standard ms", "gram bf16 ms", "gram bf16/fp32 ms", "gram fp32 ms",
           "standard error", "gram bf16 error", "gram bf16/fp32 error", "gram fp32 error")


def table(rows: list[dict]) -> str:
    lines = ["| weights `[out, in]` x count | squared singular values < 2⁻⁸ of the largest | "
             + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for r in rows:
        cells = [f"{list(r['shape'])} x {r['count']}", f"{r['small']:.0%}",
                 *(f"{r[c]:.2f}" for c in COLUMNS[:4]),
                 *(f"{r[c]:.1e}" if math.isfinite(r[c]) else "not finite" for c in COLUMNS[4:])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--steps", type=int, default=150, help="WhitenedMuon steps before the momenta are read")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.0113137, help="1.4x the best Muon's lr at d_model 256")
    p.add_argument("--momentum", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    stacks = trained_stacks(args.d_model, args.steps, args.batch_size, args.lr, args.momentum, args.seed)
    rows = [measure(shape, m, w, device, args.repeats) for shape, (m, w) in sorted(stacks.items())]
    print(table(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
