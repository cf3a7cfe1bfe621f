"""PSGD Kron factor math in ``keras.ops`` (any Keras 3 backend).

The same formulas as :mod:`kron_precond.methods.psgd` (see its docstring for the
derivation), written functionally: every function takes tensors and returns new tensors,
so the optimizer can run them inside ``keras.ops.cond`` branches and under ``jax.jit`` or
XLA, where assigning variables in a branch is not allowed. Shapes are static Python tuples
carried alongside the tensors, never read from traced values.

Triangular solves use ``keras.ops.solve_triangular`` (checked on the torch, JAX and
TensorFlow backends of Keras 3.15.1, the ``keras>=3.15`` floor of the extra); products
with triangular factors are dense matmuls (the torch engine's zero-block skipping is an
optimisation, not part of the math).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
from keras import ops

_HALF = ("float16", "bfloat16")


def tiny(dtype: str) -> float:
    """Smallest positive normal number of ``dtype`` (guards divisions by zero)."""
    if dtype == "bfloat16":
        return 1.1754943508222875e-38
    return float(np.finfo(np.dtype(dtype)).tiny)


def apply_along_dims(x, shape: Sequence[int], maps: Sequence[Callable]):
    """Apply ``maps[i]`` along dim ``i`` of ``x`` (shape ``shape``), for every dim.

    Each map takes a ``[rest, n_i]`` matrix whose rows are the mode-``i`` fibres. Moving
    the contracted dim to the end after each map rotates the dims once per map, so after
    ``rank`` maps the original order is restored without explicit transposes of ``x``.
    """
    dims = list(shape)
    for f in maps:
        n = dims[0]
        rows = math.prod(dims[1:])
        x = f(ops.transpose(ops.reshape(x, (n, rows))))
        dims = dims[1:] + [n]
        x = ops.reshape(x, tuple(dims))
    return x


def apply_q(q, diagonal: bool):
    """``x ↦ Q x`` on mode fibres (rows of ``x``): ``x Qᵀ``, or ``x ⊙ q`` if diagonal."""
    if diagonal:
        return lambda x: x * q
    return lambda x: ops.matmul(x, ops.transpose(q))


def apply_q_inv_t(q, diagonal: bool, dtype: str):
    """``x ↦ Q^{-T} x`` on mode fibres: ``x Q^{-1}``, i.e. ``X`` with ``X Q = x``, by the
    triangular solve ``Qᵀ Xᵀ = xᵀ`` (lower triangular); ``x / q`` if diagonal."""
    if diagonal:
        return lambda x: x / q

    def solve(x):
        qt, xt = ops.transpose(q), ops.transpose(x)
        if dtype in _HALF:  # no half-precision triangular solve on some backends
            qt, xt = ops.cast(qt, "float32"), ops.cast(xt, "float32")
        out = ops.transpose(ops.solve_triangular(qt, xt, lower=True))
        return ops.cast(out, dtype)

    return solve


def apply_qtq(q, diagonal: bool, form_p: bool):
    """``x ↦ QᵀQ x`` on mode fibres: ``x (QᵀQ)`` if ``form_p`` (cheaper when fibres
    outnumber ``n``), else ``(x Qᵀ) Q``; ``x ⊙ q²`` if diagonal."""
    if diagonal:
        q2 = q * q
        return lambda x: x * q2
    if form_p:
        p = ops.matmul(ops.transpose(q), q)
        return lambda x: ops.matmul(x, p)
    return lambda x: ops.matmul(ops.matmul(x, ops.transpose(q)), q)


def gram(x, shape: Sequence[int], dim: int, diagonal: bool):
    """``X_(dim) X_(dim)ᵀ`` (contract every dim but ``dim``), or its diagonal."""
    rank = len(shape)
    if diagonal:
        other = tuple(i for i in range(rank) if i != dim)
        return ops.sum(x * x, axis=other) if other else x * x
    n = shape[dim]
    if dim != 0:
        x = ops.moveaxis(x, dim, 0)
    x2 = ops.reshape(x, (n, math.prod(shape) // n))
    return ops.matmul(x2, ops.transpose(x2))


def spectral_norm_lower_bound(s, dtype: str):
    """Cheap lower bound of ``‖S‖₂`` for symmetric PSD ``S``: two power iterations from the
    column of largest norm, after dividing by ``max_i S_ii`` so nothing overflows."""
    eps = tiny(dtype)
    scale = ops.maximum(ops.max(ops.diagonal(s)), 0.0) + eps
    s = s / scale
    j = ops.argmax(ops.sqrt(ops.sum(s * s, axis=0)))
    x = ops.take(s, j, axis=1)
    x = ops.matmul(ops.transpose(s), x)
    x = x / (ops.sqrt(ops.sum(x * x)) + eps)
    y = ops.matmul(s, x)
    return ops.sqrt(ops.sum(y * y)) * scale


def diagonal_q_step(q, t1, t2, lr, dtype: str):
    """New diagonal factor ``q − lr (T1 − T2) ⊙ q / max|T1 + T2|``."""
    norm = ops.max(ops.abs(t1 + t2)) + tiny(dtype)
    return q - (lr / norm) * (t1 - t2) * q


def triangular_q_step(q, t1, t2, lr, dtype: str):
    """New triangular factor ``Q − lr triu(T1 − T2) Q / ‖T1 + T2‖₂`` (norm: lower
    bound)."""
    norm = spectral_norm_lower_bound(t1 + t2, dtype) + tiny(dtype)
    step = ops.triu(t1 - t2) * (lr / norm)
    return q - ops.matmul(step, q)


def all_finite(tensors) -> object:
    """0-dim bool tensor: every element of every tensor is finite."""
    ok = None
    for t in tensors:
        fin = ops.all(ops.isfinite(t))
        ok = fin if ok is None else ops.logical_and(ok, fin)
    return ok


def q_update(qs, diagonal, shape, fit, probe, lr, dtype: str):
    """One PSGD Q update: returns the new factors, or the old ones where the fitting
    gradient or any new factor is not finite (``ops.where``, no branching)."""
    a = apply_along_dims(fit, shape, [apply_q(q, d) for q, d in zip(qs, diagonal)])
    b = apply_along_dims(probe, shape,
                         [apply_q_inv_t(q, d, dtype) for q, d in zip(qs, diagonal)])
    new = []
    for i, (q, d) in enumerate(zip(qs, diagonal)):
        t1, t2 = gram(a, shape, i, d), gram(b, shape, i, d)
        step = diagonal_q_step if d else triangular_q_step
        new.append(step(q, t1, t2, lr, dtype))
    ok = all_finite([fit, *new])
    return [ops.where(ok, q_new, q) for q, q_new in zip(qs, new)]


def precondition(qs, diagonal, form_p, shape, x):
    """``P x = x ×_i (Q_iᵀ Q_i)`` for ``x`` of work shape ``shape``."""
    maps = [apply_qtq(q, d, f) for q, d, f in zip(qs, diagonal, form_p)]
    return apply_along_dims(x, shape, maps)


def balance(qs, dtype: str, enabled):
    """Rescale the factors to equal max-abs (their geometric mean) without changing ``P``;
    ``enabled`` (0-dim bool tensor) masks the rescaling off."""
    if len(qs) < 2:
        return list(qs)
    norms = ops.maximum(ops.stack([ops.max(ops.abs(q)) for q in qs]), tiny(dtype))
    factors = ops.exp(ops.mean(ops.log(norms))) / norms
    factors = ops.where(enabled, factors, ops.ones_like(factors))
    return [q * factors[i] for i, q in enumerate(qs)]


def initial_scale(g):
    """``s = (mean |g|⁴)^(-1/8)`` in float32, computed on ``g / max|g|`` so the fourth power
    cannot overflow; not finite (or 0) for an all-zero or non-finite ``g``."""
    g = ops.cast(g, "float32")
    peak = ops.max(ops.abs(g))
    fourth = ops.mean(ops.power(ops.abs(g) / peak, 4.0))
    return ops.power(peak, -0.5) * ops.power(fourth, -0.125)


def factor_init(n: int, diagonal: bool, value, dtype: str):
    """``value·I`` (triangular) or ``value·1`` (diagonal) as a tensor; ``value`` may be a
    0-dim tensor."""
    value = ops.cast(value, dtype)
    if diagonal:
        return ops.ones((n,), dtype=dtype) * value
    return ops.eye(n, dtype=dtype) * value
