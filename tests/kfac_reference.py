"""An independent dense K-FAC for ``nn.Linear`` layers, used as the oracle by the
regression tests (tests/test_regressions.py, tests/test_distributed_regressions.py).

Nothing here imports ``kron_precond``. It follows the conventions of docs/API.md written
out with explicit float64 matrices:

* ``A = mean_rows(ã ãᵀ)`` (a trailing 1 per row for the bias) and ``G = mean_rows(δ δᵀ)``
  over every row observed in one factor step, whichever micro-batch / shard it came from;
  a factor step with no rows for a layer leaves its factors unchanged; the first update
  takes the statistics as they are, later ones ``F ← F + (1 − decay)(F_new − F)``;
* refreshes (every ``inv_update_steps``) freeze what ``apply`` uses until the next one;
  a layer is preconditioned only once a refresh saw both factors hold data, otherwise its
  gradient passes through unchanged;
* EIGEN: ``V = (G ⊗ A + λI)⁻¹ vec(∇)`` by a dense solve (row-major vec, ``∇ = [W | b]``);
  INVERSE: ``V = (G + γ_G I)⁻¹ ∇ (A + γ_A I)⁻¹``, ``γ_A = π√λ``, ``γ_G = √λ/π``,
  ``π = √((tr A / dim A) / (tr G / dim G))``;
* ``kl_clip``: every V is scaled by ``min(1, sqrt(κ / |lr² Σ_layers ⟨V, ∇⟩|))``;
* ``max_factor_size``: a factor wider than it is replaced by ``diag(diag(F))`` of the full
  dense factor before either formula (the full factor is still accumulated here);
* ``grafting``: each layer's V is rescaled to ``‖∇‖_F / ‖V‖_F`` (before ``kl_clip``).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

F64 = torch.float64


def with_ones(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)


def grad_matrix(layer: nn.Linear) -> torch.Tensor:
    """``∇ = [W.grad | b.grad]`` (zeros where a gradient is missing)."""
    w = layer.weight.grad if layer.weight.grad is not None else torch.zeros_like(layer.weight)
    if layer.bias is None:
        return w.clone()
    b = layer.bias.grad if layer.bias.grad is not None else torch.zeros_like(layer.bias)
    return torch.cat([w, b[:, None]], dim=1)


def write_grad_matrix(layer: nn.Linear, matrix: torch.Tensor) -> None:
    n = layer.weight.shape[1]
    layer.weight.grad = matrix[:, :n].clone()
    if layer.bias is not None:
        layer.bias.grad = matrix[:, n].clone()


class Capture:
    """Inputs and (grad-retaining) outputs of every call of the given Linear layers."""

    def __init__(self, layers: dict[str, nn.Linear]):
        self.calls: dict[str, list] = {n: [] for n in layers}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in layers.items()]

    def _hook(self, name):
        def hook(module, inputs, output):
            output.retain_grad()
            self.calls[name].append((inputs[0].detach().clone(), output))
        return hook

    def rows(self, name: str, grad_scale: float):
        """``(ã rows, δ rows)`` of every call so far; δ = output.grad · ``grad_scale``."""
        a, g = [], []
        for x, out in self.calls[name]:
            if out.grad is None:
                continue
            a.append(with_ones(x.reshape(-1, x.shape[-1])))
            g.append(out.grad.reshape(-1, out.shape[-1]) * grad_scale)
        return a, g

    def clear(self):
        for calls in self.calls.values():
            calls.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


class DenseKFAC:
    """Dense K-FAC state for named Linear layers (all with a bias)."""

    def __init__(self, names, *, damping: float, factor_decay: float = 0.95,
                 compute_method: str = "eigen", factor_update_steps: int = 1,
                 inv_update_steps: int = 1, kl_clip: float | None = None, lr: float = 0.1,
                 max_factor_size: int | None = None, grafting: bool = False):
        self.names = list(names)
        self.grafting = grafting
        self.max_factor_size = max_factor_size
        self.damping, self.decay = damping, factor_decay
        self.compute_method = compute_method
        self.factor_update_steps, self.inv_update_steps = factor_update_steps, inv_update_steps
        self.kl_clip, self.lr = kl_clip, lr
        self.A = {n: None for n in self.names}
        self.G = {n: None for n in self.names}
        self.frozen = {n: None for n in self.names}  # what apply uses, from the last refresh
        self.pending = {n: ([], []) for n in self.names}
        self.steps = 0

    @property
    def factor_step(self) -> bool:
        return self.steps % self.factor_update_steps == 0

    def observe(self, name: str, a_rows: list[torch.Tensor], g_rows: list[torch.Tensor]) -> None:
        """Rows (ã with the ones column, δ already scaled) seen in this step."""
        self.pending[name][0].extend(r.to(F64) for r in a_rows)
        self.pending[name][1].extend(r.to(F64) for r in g_rows)

    def _fold(self) -> None:
        for n in self.names:
            for store, rows in ((self.A, self.pending[n][0]), (self.G, self.pending[n][1])):
                if not rows:
                    continue  # no rows anywhere: the factor keeps its value
                r = torch.cat(rows)
                new = torch.einsum("ni,nj->ij", r, r) / r.shape[0]
                store[n] = new if store[n] is None else store[n] + (1.0 - self.decay) * (new - store[n])
            self.pending[n] = ([], [])

    def _refresh(self) -> None:
        lam = self.damping
        for n in self.names:
            A, G = self._limited(self.A[n]), self._limited(self.G[n])
            if A is None or G is None:
                self.frozen[n] = None
            elif self.compute_method == "eigen":
                self.frozen[n] = ("eigen", A.clone(), G.clone())
            else:
                ta, tg = torch.trace(A) / A.shape[0], torch.trace(G) / G.shape[0]
                pi = math.sqrt(ta / tg) if ta > 0 and tg > 0 else 1.0
                a_inv = torch.linalg.inv(A + pi * math.sqrt(lam) * torch.eye(A.shape[0], dtype=F64))
                g_inv = torch.linalg.inv(G + math.sqrt(lam) / pi * torch.eye(G.shape[0], dtype=F64))
                self.frozen[n] = ("inverse", a_inv, g_inv)

    def _limited(self, factor: torch.Tensor | None) -> torch.Tensor | None:
        if factor is None or self.max_factor_size is None or factor.shape[0] <= self.max_factor_size:
            return factor
        return torch.diag(torch.diagonal(factor))

    def precondition(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One ``step()``: fold this step's statistics (factor steps), refresh (refresh
        steps), and return the preconditioned gradient matrices."""
        if self.factor_step:
            self._fold()
        else:
            assert all(not a and not g for a, g in self.pending.values()), "rows outside a factor step"
        if self.steps % self.inv_update_steps == 0:
            self._refresh()
        out = {}
        for n, grad in grads.items():
            grad = grad.to(F64)
            frozen = self.frozen[n]
            if frozen is None:
                out[n] = grad.clone()
            elif frozen[0] == "eigen":
                _, A, G = frozen
                M = torch.kron(G, A) + self.damping * torch.eye(A.shape[0] * G.shape[0], dtype=F64)
                out[n] = torch.linalg.solve(M, grad.reshape(-1)).reshape(grad.shape)
            else:
                _, a_inv, g_inv = frozen
                out[n] = g_inv @ grad @ a_inv
            if frozen is not None and self.grafting:
                out[n] = out[n] * (grad.norm() / out[n].norm())
        if self.kl_clip is not None:
            total = sum((out[n] * grads[n].to(F64)).sum() for n in grads)
            nu = min(1.0, math.sqrt(self.kl_clip / abs(self.lr ** 2 * float(total)))) if float(total) else 1.0
            out = {n: v * nu for n, v in out.items()}
        self.steps += 1
        return out
