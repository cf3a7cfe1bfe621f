"""The per-step checks of the engine: old and current formulations, timed interleaved.

Every ``precond.step()`` checks each layer's gradient for NaN/Inf and, under ``kl_clip``,
sums ``⟨V, ∇⟩`` over all tensors. This times the formulations on the gradient tensors of
the char-LM's preconditioned layers (Embedding and lm_head skipped), alternating them
round by round so that load on the machine hits all alike, and checks that they agree:

* finiteness: max-abs norms (before) against L2 norms (now), one ``_foreach_norm`` each;
* ``Σ⟨V, ∇⟩``: the products' signed parts through L1 norms (the engine's form) against
  one ``torch.dot`` per tensor (faster on CPU, not adopted: one op per tensor) and the
  L2-norm identity ``2⟨V, ∇⟩ = ‖V + ∇‖² − ‖V‖² − ‖∇‖²`` (not adopted: it cancels where
  ``‖V‖ ≫ ‖∇‖``; here ``V = 3∇ + noise``, a benign case).

    python benchmarks/engine_checks.py --threads 1 --d-model 256
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "examples"))

from char_lm import VOCAB_SIZE, CharTransformer, ModelConfig, lm_loss  # noqa: E402
from kron_precond.apply import _finite_per_layer, _kl_sum  # noqa: E402


def finite_max_abs(grads):
    return torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf"))))


def finite_l2(grads):
    return _finite_per_layer([[g] for g in grads], {})


def kl_dots(values, grads, keep):
    terms = torch.stack([torch.dot(v.reshape(-1), g.reshape(-1)) for v, g in zip(values, grads)])
    return torch.where(keep, terms, torch.zeros(())).sum()


def kl_l2_identity(values, grads, keep):
    def squared(tensors):
        return torch.stack(torch._foreach_norm(tensors, 2)).square()
    terms = (squared(torch._foreach_add(values, grads)) - squared(values) - squared(grads)) * 0.5
    return torch.where(keep, terms, torch.zeros(())).sum()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=ModelConfig.d_model)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig(d_model=args.d_model)
    model = CharTransformer(config)
    tokens = torch.randint(0, VOCAB_SIZE, (64, config.seq_len + 1))
    lm_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
    grads = [p.grad for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
             and "lm_head" not in name for p in module.parameters() if p.grad is not None]
    values = [3.0 * g + 0.1 * torch.randn_like(g) for g in grads]
    keep = torch.ones(len(grads), dtype=torch.bool)
    forms = {
        "finiteness, max-abs norms (before)": lambda: finite_max_abs(grads),
        "finiteness, L2 norms (now)": lambda: finite_l2(grads),
        "kl sum, signed L1 norms (now)": lambda: _kl_sum(values, grads, keep),
        "kl sum, one dot per tensor": lambda: kl_dots(values, grads, keep),
        "kl sum, L2-norm identity": lambda: kl_l2_identity(values, grads, keep),
    }
    assert finite_max_abs(grads).all() and finite_l2(grads).all()
    reference = sum(torch.dot(v.double().reshape(-1), g.double().reshape(-1)) for v, g in zip(values, grads))
    errors = {name: abs(float(f()) - float(reference)) / abs(float(reference))
              for name, f in forms.items() if name.startswith("kl")}
    times = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, f in forms.items():
            start = time.perf_counter()
            f()
            times[name].append(1e3 * (time.perf_counter() - start))
    elements = sum(g.numel() for g in grads)
    print(f"d_model={args.d_model}: {len(grads)} gradient tensors, {elements:,} elements; median of {args.rounds} "
          f"interleaved rounds, {torch.get_num_threads()} thread(s)")
    print(f"{'form':40s} {'ms':>8s} {'x now':>7s} {'rel. error vs float64':>22s}")
    for name in forms:
        now = next(n for n in forms if n.startswith(name.split(",")[0]) and n.endswith("(now)"))
        ms = statistics.median(times[name])
        error = f"{errors[name]:.1e}" if name in errors else ""
        print(f"{name:40s} {ms:8.2f} {ms / statistics.median(times[now]):7.1f} {error:>22s}")


if __name__ == "__main__":
    main()
