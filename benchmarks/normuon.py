"""NorMuon (Li et al., arXiv 2510.05491): Muon's orthogonalised step, then per-neuron normalisation.

A second baseline for the budget-equivalent speed-up (benchmarks/budget_speedup.py), written
from the paper's Algorithm 1. For a weight ``W`` of shape ``[m, n]`` (``m`` output neurons,
the rows of an ``nn.Linear`` weight) and gradient ``G``:

    M   <- β1 M + (1 - β1) G                 momentum (torch.optim.Muon's, Nesterov by default)
    O   =  NS5(G + β1 (M - G))               Muon's orthogonalised update (Newton-Schulz)
    v   <- β2 v + (1 - β2) mean_j O[:, j]²    one second moment per row (neuron), v ∈ R^m
    Ô   =  O / (sqrt(v) + ε)                  per-row normalisation, broadcast over columns
    Ô  *=  ||O||_F / ||Ô||_F                  keep the norm of Muon's update
    W  <- W (1 - η λ) - η · 0.2 sqrt(max(m, n)) · Ô

The last two lines give Ô exactly the RMS that ``torch.optim.Muon(adjust_lr_fn=
"match_rms_adamw")`` gives ``O`` with the same Newton-Schulz output, so a learning rate
means the same thing for Muon, NorMuon and the AdamW half of the split and the three can
share one lr grid. (The paper writes the scale as ``0.2 η sqrt(mn) / ||Ô||_F``, an update
RMS of exactly 0.2; the authors' code keeps ``||O||_F`` as here. Newton-Schulz's singular
values are not exactly 1, so the two differ by a factor near 1 that the lr sweep absorbs;
keeping Muon's own scale isolates the normalisation as the only change against Muon.)

The momentum update, Nesterov blend, Newton-Schulz iteration (bfloat16, 5 steps, the same
coefficients) and decoupled weight decay are torch.optim.Muon's, so against the Muon
baseline the only difference is the row normalisation. No bias correction on ``v``: it
scales every row alike and the norm-preserving rescale removes it (as in the paper).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

# torch.optim.Muon's quintic Newton-Schulz and its match_rms_adamw factor
from kron_precond.whitened_muon import NS_COEFFICIENTS, lr_ratio, msign

NS_STEPS = 5
NS_EPS = 1e-7
EPS = 1e-10  # the paper's ε, small: v is a mean of squares of an O(1/sqrt(n))-RMS matrix


def newton_schulz(update: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of a 2-D update, in float32.

    Uses torch's own (private) routine when present, so the NorMuon baseline orthogonalises
    bit for bit like the Muon baseline; otherwise the same iteration written out."""
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz
    except ImportError:  # older / newer torch: the same quintic iteration
        return msign(update, NS_STEPS, NS_EPS, dtype=torch.bfloat16).float()  # torch's, bit for bit
    return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, NS_STEPS, NS_EPS).float()


def normalize_rows(ortho: torch.Tensor, second_moment: torch.Tensor, beta2: float,
                   eps: float = EPS) -> torch.Tensor:
    """NorMuon's normalisation of an orthogonalised update ``ortho`` ``[m, n]``.

    Folds the row-wise mean of squares into ``second_moment`` (``[m, 1]``, in place) and
    returns ``ortho / (sqrt(v) + eps)`` rescaled to ``ortho``'s Frobenius norm."""
    second_moment.lerp_(ortho.square().mean(dim=1, keepdim=True), 1 - beta2)
    normalized = ortho / (second_moment.sqrt() + eps)
    return normalized * (ortho.norm() / normalized.norm().clamp(min=eps))


class NorMuon(torch.optim.Optimizer):
    """NorMuon for 2-D weights (the hidden Linear-like weights of a Muon split) and fused
    experts ``[experts, out, in]``, stepped expert by expert as 2-D weights of their own.

    A weight in ``transposed`` is stored ``[in, out]`` (GPT-2's ``Conv1D``): its neurons are
    its columns, and it is stepped as the ``[out, in]`` matrix it holds.
    ``orthogonalize`` replaces the Newton-Schulz iteration (the unit test passes an exact
    polar factor, so it can compare against a float64 reference step by step)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 0.02, weight_decay: float = 0.0,
                 momentum: float = 0.95, beta2: float = 0.95, nesterov: bool = True, eps: float = EPS,
                 orthogonalize: Callable[[torch.Tensor], torch.Tensor] = newton_schulz,
                 transposed: Iterable[torch.nn.Parameter] = ()):
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, beta2=beta2,
                        nesterov=nesterov, eps=eps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() not in (2, 3):
                    raise ValueError(f"NorMuon takes 2-D weights or [experts, out, in] experts, "
                                     f"got shape {tuple(p.shape)}")
        self.orthogonalize = orthogonalize
        self._transposed = {id(p) for p in transposed}
        if not self._transposed <= {id(p) for g in self.param_groups for p in g["params"] if p.dim() == 2}:
            raise ValueError("transposed holds tensors that are not among params' 2-D weights")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                # [out, in] views: the rows are the neurons
                weight, grad = (p.T, p.grad.T) if id(p) in self._transposed else (p, p.grad)
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(weight)
                    state["second_moment"] = torch.zeros(*weight.shape[:-1], 1, dtype=p.dtype, device=p.device)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - mu)
                update = grad.lerp(buf, mu) if group["nesterov"] else buf
                weight.mul_(1 - lr * group["weight_decay"])
                if weight.dim() == 2:
                    self._step_matrix(weight, update, state["second_moment"], group)
                else:  # fused experts: each expert a weight of its own
                    for e in range(weight.shape[0]):
                        self._step_matrix(weight[e], update[e], state["second_moment"][e], group)
        return loss

    def _step_matrix(self, weight: torch.Tensor, update: torch.Tensor, second_moment: torch.Tensor,
                     group: dict) -> None:
        ortho = self.orthogonalize(update).to(weight.dtype)
        direction = normalize_rows(ortho, second_moment, group["beta2"], group["eps"])
        weight.add_(direction, alpha=-group["lr"] * lr_ratio("match_rms_adamw", tuple(weight.shape)))
