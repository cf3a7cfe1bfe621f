"""Everything PSGD Kron keeps for one tensor, shared by the ``Kron`` optimizer and the PSGD
layer method: the whitening factors, the fitted gradient average, probe vectors, periodic
balancing, the cached ``Q_iᵀQ_i`` products and the update-RMS clip.

The math of the factors lives in :mod:`kron_precond.methods.psgd`; this file decides what
is fitted, with which probe, and when to rebalance.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from kron_precond.methods.psgd import PSGDFactors, probe_seed

RMS_CLIP = 1.1  # as kron_torch: a preconditioned update's RMS is capped at 1.1
BALANCE_EVERY = 100  # rebalance factor scales every this many Q updates (numerical hygiene)


def rms_clip_scale(update: torch.Tensor, limit: float = RMS_CLIP) -> torch.Tensor:
    """``min(1, limit / rms(update))`` as a 0-dim tensor in float32 or better (no host sync)."""
    rms = torch.linalg.vector_norm(update.float()) / (update.numel() ** 0.5)
    return (limit / (rms + 1e-12)).clamp(max=1.0)



def momentum_debias(b1: float | torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``1 − b1^t`` in ``steps``' dtype, accurate to its precision: ``−expm1(t · log b1)``, with
    ``log b1`` taken in float64. ``pow`` in float32 rounds ``b1`` first, and the subtraction's
    cancellation magnifies that by ``b1^t / (1 − b1^t)``: 2e-4 of the correction at b1 = 0.9999.
    A ``b1`` held as a 0-dim tensor (a param-group setting) is computed with on its device, in
    ``steps``' dtype, without reading it on the host."""
    if isinstance(b1, torch.Tensor):  # log 0 = −inf: 1 for t ≥ 1; t = 0 is 0 (0·−inf is NaN)
        return torch.where(steps > 0, -torch.expm1(steps * torch.log(b1.to(steps.dtype))), 0.0)
    if b1 == 0.0:  # log 0: 1 − 0^t is 1 for t ≥ 1 and 0 at t = 0
        return (steps > 0).to(steps.dtype)
    return -torch.expm1(steps * math.log(b1))


class PSGDTensor:
    """PSGD state of one tensor.

    Args:
        shape: the tensor's shape.
        device: where the state lives.
        seed, key: probe vectors are drawn from ``probe_seed(seed, *key, step)`` -- the same
            whichever rank draws them.
        momentum: keep a running average ``m = b1·m + (1−b1)·g`` of the gradient (the
            ``Kron`` optimizer's momentum; the layer method's fitted average).
        b1, momentum_dtype: its decay and dtype.
        **factor_settings: passed to :class:`PSGDFactors`.

    The tensors (``factors.q``, ``momentum``, ``steps``, ``nonfinite``) may be shared with an
    optimizer's ``state`` dict: everything here updates them in place.
    """

    def __init__(self, shape: Sequence[int], *, device: torch.device, seed: int, key: tuple[int, ...],
                 momentum: bool = False, b1: float | torch.Tensor = 0.9, momentum_dtype: torch.dtype | None = None,
                 **factor_settings) -> None:
        self.factors = PSGDFactors(shape, device=device, **factor_settings)
        self.device = self.factors.device
        self.seed = seed
        self.key = tuple(key)
        self.b1: float | torch.Tensor = b1  # a 0-dim tensor: a param-group setting held as one
        self.momentum = (torch.zeros(tuple(shape), dtype=momentum_dtype or torch.float32, device=self.device)
                         if momentum else None)
        self.steps = torch.zeros((), dtype=torch.float32, device=self.device)  # finite gradients averaged
        self._generator: torch.Generator | None = None
        self._p_cache: list[torch.Tensor | None] | None = None
        self.version = 0  # bumped whenever the factors change (batched apply re-stacks then)
        #: expected applications per factor change (1 / update probability): decides whether
        #: forming ``Q_iᵀQ_i`` pays off
        self.uses_per_update = 1.0

    def to(self, device: torch.device) -> None:
        """Move everything to ``device`` (values and dtypes kept)."""
        self.factors.to(device)
        self.device = self.factors.device
        if self.momentum is not None:
            self.momentum = self.momentum.to(self.device)
        self.steps = self.steps.to(self.device)
        self._generator = None  # tied to its device; reseeded for every probe anyway
        self.invalidate()  # cached products and batched-apply stacks are on the old device

    def is_meta(self) -> bool:
        """Made on the ``meta`` device: it never held values."""
        return self.device.type == "meta"

    # ------------------------------------------------------------------ the fitted average
    def accumulate(self, grad: torch.Tensor, finite: torch.Tensor) -> None:
        """Fold a gradient into the running average; ``finite`` False leaves it exactly
        unchanged (its weight is 0; masked where ``b1`` is a tensor, which may be NaN)."""
        if self.momentum is None:
            return
        m = self.momentum
        g = torch.where(finite, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
        weight = finite.to(m.dtype) * (1.0 - self.b1)
        if isinstance(self.b1, torch.Tensor):
            weight = torch.where(finite, weight, 0.0).to(m.dtype)
        m.lerp_(g.to(m.dtype), weight)
        self.steps.add_(finite.to(self.steps.dtype))

    def debias(self, dtype: torch.dtype) -> torch.Tensor:
        """``1 − b1^t`` for the ``t`` finite gradients averaged so far (at least tiny), in
        ``dtype``; computed in ``dtype`` promoted with float32 (the step count's dtype): a
        float64 correction is not rounded to float32 (1.5e-8 off at t = 1)."""
        wide = torch.promote_types(dtype, self.steps.dtype)
        return momentum_debias(self.b1, self.steps.to(wide)).clamp_min(1e-30).to(dtype)

    def debiased_momentum(self, dtype: torch.dtype) -> torch.Tensor:
        return self.held_momentum().to(dtype) / self.debias(dtype)

    def held_momentum(self) -> torch.Tensor:
        """The running average of a tensor built with ``momentum=True``."""
        assert self.momentum is not None, "kron_precond: this PSGDTensor keeps no momentum (momentum=False)"
        return self.momentum

    # ------------------------------------------------------------------ Q updates
    def probe(self, step: int, dtype: torch.dtype) -> torch.Tensor:
        if self._generator is None:
            self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(probe_seed(self.seed, *self.key, step))
        return torch.randn(self.factors.shape, generator=self._generator, dtype=dtype, device=self.device)

    def update_factors(self, fit: torch.Tensor, lr, *, step: int, update_index: int,
                       enabled: torch.Tensor | None = None) -> torch.Tensor:
        """One Q update fitted to ``fit`` with the probe of ``step``; rebalances the factors
        before every ``BALANCE_EVERY``-th update. ``enabled`` (0-dim bool tensor) False leaves
        the factors exactly as they are, rebalancing included. Returns the applied flag
        (0-dim bool)."""
        if update_index % BALANCE_EVERY == 0:
            self.factors.balance(enabled)
        applied = self.factors.update(fit, self.probe(step, self.factors.dtype), lr, enabled)
        self.invalidate()
        return applied

    # ------------------------------------------------------------------ preconditioning
    def invalidate(self) -> None:
        """Forget the cached ``Q_iᵀQ_i``: call after anything writes the factors in place."""
        self._p_cache = None
        self.version += 1

    def products(self) -> list[torch.Tensor | None]:
        """``Q_iᵀQ_i`` (or ``q_i²``) per factor, cached until the factors change."""
        if self._p_cache is None:
            self._p_cache = self.factors.preconditioner_products(self.uses_per_update)
        return self._p_cache

    def precondition(self, grad: torch.Tensor) -> torch.Tensor:
        """``P grad``, reusing ``Q_iᵀQ_i`` products between factor changes (they change only
        on Q updates, so a plain step does no ``n³`` work)."""
        return self.factors.precondition(grad, products=self.products())

    def cache_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._p_cache or () if p is not None)
