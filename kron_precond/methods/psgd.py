"""PSGD Kron: Xi-Lin Li's Kronecker-factored whitening preconditioner, per tensor.

For a gradient tensor ``G`` of rank ``r`` we keep one factor ``Q_i`` per dimension,
upper-triangular ``[n_i, n_i]`` or diagonal ``[n_i]``, and precondition with

    P = Q_1ᵀQ_1 ⊗ … ⊗ Q_rᵀQ_r,      P G = G ×_1 Q_1ᵀQ_1 … ×_r Q_rᵀQ_r.

One Q update with a fitting gradient ``G`` and a probe ``V ~ N(0, I)`` (:meth:`PSGDFactors.update`):

    A = G ×_i Q_i                    B = V ×_i Q_i^{-T}   (triangular solves)
    T1_i = A_(i) A_(i)ᵀ              T2_i = B_(i) B_(i)ᵀ   (contract all dims but i)
    diagonal:    q_i ← q_i − lr · (T1 − T2) ⊙ q_i / max|T1 + T2|
    triangular:  Q_i ← Q_i − lr · triu(T1 − T2) Q_i / ‖T1 + T2‖₂

whose fixed point is ``P = E[g gᵀ]^{-1/2}`` per Kronecker factor. ``X ×_i M`` means
"apply the matrix ``M`` along dimension ``i``". The code keeps one small function per
formula and never imports ``torch.distributed``; nothing here synchronises with the
host except the one-time scale estimate in :meth:`PSGDFactors.initialize_from`.

Speed: mode products are plain matmuls on a rotating view (:func:`apply_along_dims`), never
one multi-operand ``einsum`` (without ``opt_einsum`` torch contracts those left to right,
through an ``n⁴`` intermediate); the contraction plan and einsum subscripts are built once
per tensor; products with large triangular factors skip their zero blocks.
"""
from __future__ import annotations

import math
import string
from typing import Any, Callable, Sequence

import torch

MEMORY_SAVE_MODES = (None, "smart_one_diag", "one_diag", "all_diag")


# ----------------------------------------------------------------------------- structure
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a bijection on 64-bit integers with good avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def probe_seed(*keys: int) -> int:
    """A 63-bit generator seed determined only by ``keys`` (e.g. seed, tensor id, step).

    Probe vectors drawn from it do not depend on which rank draws them or on any
    generator state, so nothing about them needs saving or synchronising.
    """
    x = 0x2545F4914F6CDD1D
    for key in keys:
        x = _mix64((x + (key & _MASK64) * 0x9E3779B97F4A7C15) & _MASK64)
    return x & ((1 << 63) - 1)


def check_memory_save_mode(memory_save_mode: str | None) -> None:
    """Raise ``ValueError`` unless ``memory_save_mode`` is one of :data:`MEMORY_SAVE_MODES`."""
    if memory_save_mode not in MEMORY_SAVE_MODES:
        raise ValueError(
            f"Invalid memory_save_mode: {memory_save_mode!r}; expected one of {MEMORY_SAVE_MODES}"
        )


def factor_is_diagonal(shape: tuple[int, ...], *, max_size_triangular: int,
                       min_ndim_triangular: int, memory_save_mode: str | None) -> list[bool]:
    """Per dimension of ``shape``: ``True`` if its factor is diagonal, ``False`` if triangular.

    A dim is diagonal if its size is 1, larger than ``max_size_triangular``, the tensor has
    fewer than ``min_ndim_triangular`` dims, or ``memory_save_mode`` asks for it:
    ``'all_diag'`` all dims; ``'one_diag'`` the (first) largest dim; ``'smart_one_diag'``
    the (first) largest dim only if it is strictly larger than the second largest (so a
    rank-1 tensor is untouched by it); ``None`` none.
    """
    check_memory_save_mode(memory_save_mode)
    shape = tuple(int(n) for n in shape)
    rank = len(shape)
    diag = [n == 1 or n > max_size_triangular or rank < min_ndim_triangular for n in shape]
    if rank == 0 or memory_save_mode is None:
        return diag
    largest = max(range(rank), key=lambda i: (shape[i], -i))  # first index of the max size
    if memory_save_mode == "all_diag":
        diag = [True] * rank
    elif memory_save_mode == "one_diag":
        diag[largest] = True
    elif memory_save_mode == "smart_one_diag" and rank > 1:
        first, second = sorted(shape, reverse=True)[:2]
        if first > second:
            diag[largest] = True
    return diag


def most_square_split(shape: Sequence[int]) -> tuple[int, int]:
    """Merge ``shape`` into 2-D ``(prod(shape[:k]), prod(shape[k:]))`` with the ``k`` (0 < k <
    rank) that minimises ``|prod(left) − prod(right)|`` (first such ``k`` on ties)."""
    shape = [int(n) for n in shape]
    if len(shape) < 2:
        raise ValueError(f"most_square_split needs at least 2 dims, got shape {tuple(shape)}")
    total = math.prod(shape)
    best = min(range(1, len(shape)),
               key=lambda k: abs(math.prod(shape[:k]) - math.prod(shape[k:])))
    left = math.prod(shape[:best])
    return left, total // left


def gram_subscripts(rank: int, dim: int, diagonal: bool) -> str:
    """Einsum subscripts contracting two rank-``rank`` tensors over every dim but ``dim``:
    ``X_(dim) X_(dim)ᵀ`` (a matrix) or, for a diagonal factor, its diagonal (a vector)."""
    if rank > 24:
        raise ValueError(f"tensors of rank {rank} are not supported (at most 24 dims)")
    letters = string.ascii_lowercase[:rank]
    left = letters[:dim] + "y" + letters[dim + 1:]
    if diagonal:
        return f"{left},{left}->y"
    right = letters[:dim] + "z" + letters[dim + 1:]
    return f"{left},{right}->yz"


# ----------------------------------------------------------------------------- formulas
def apply_along_dims(x: torch.Tensor, maps: Sequence[Callable[[torch.Tensor], torch.Tensor]]
                     ) -> torch.Tensor:
    """Apply ``maps[i]`` along dim ``i`` of ``x``, for every dim.

    Each map takes a ``[rest, n_i]`` matrix whose rows are the mode-``i`` fibres and returns
    ``[rest, n_i]``. Contracting the leading dim and appending the result as the trailing
    dim rotates the dims once per map, so after ``rank`` maps the order is restored with
    no explicit permutes.
    """
    for f in maps:
        n, rest = x.shape[0], x.shape[1:]
        x = f(x.reshape(n, -1).T).reshape(*rest, n)
    return x


def apply_q(q: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Map ``x ↦ Q x`` on mode fibres (rows of ``x``): ``x Qᵀ``, or ``x ⊙ q`` if diagonal."""
    if q.dim() == 1:
        return lambda x: x * q
    return lambda x: matmul_upper_t(x, q)


def apply_q_inv_t(q: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Map ``x ↦ Q^{-T} x`` on mode fibres: ``x Q^{-1}`` by a triangular solve, or ``x / q``."""
    if q.dim() == 1:
        return lambda x: x / q
    if q.dtype in (torch.float16, torch.bfloat16):  # no half-precision triangular solve
        return lambda x: torch.linalg.solve_triangular(q.float(), x.float(), upper=True,
                                                       left=False).to(x.dtype)
    return lambda x: torch.linalg.solve_triangular(q, x, upper=True, left=False)


def _multiply_by(q: torch.Tensor, product: torch.Tensor | None,
                 dense: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x ↦ QᵀQ x`` on mode fibres, given ``product`` = ``QᵀQ`` / ``q²`` or ``None``
    (then two products with ``Q``: triangular, or ``dense`` for the Procrustes rule's factors)."""
    if product is None:
        if dense:
            return lambda x: (x @ q.T) @ q
        return lambda x: matmul_upper(matmul_upper_t(x, q), q)
    if product.dim() == 1:
        return lambda x: x * product
    return lambda x: x @ product


def apply_qtq(q: torch.Tensor, form_p: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Map ``x ↦ QᵀQ x`` on mode fibres: ``x (QᵀQ)`` if ``form_p`` (cheaper when the fibres
    outnumber ``n``), else the two products ``(x Qᵀ) Q``; ``x ⊙ q²`` if diagonal."""
    if q.dim() == 1:
        q2 = q * q
        return lambda x: x * q2
    if form_p:
        p = upper_gram(q)
        return lambda x: x @ p
    return lambda x: matmul_upper(matmul_upper_t(x, q), q)


# Products with triangular matrices at least this large skip their zero blocks: each level
# of a 2×2 split saves a quarter of the remaining flops (torch has no trmm). Tuned on CPU;
# on accelerators the extra kernel launches only pay off for very large factors (untuned).
BLOCK_MIN_CPU = 256
BLOCK_MIN_ACCELERATOR = 4096


def block_min(device: torch.device) -> int:
    """Smallest triangular factor whose products are blocked, on ``device``."""
    return BLOCK_MIN_CPU if device.type == "cpu" else BLOCK_MIN_ACCELERATOR


def matmul_upper(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``x @ Q`` for upper-triangular ``Q``: ``[x1 Q11, x1 Q12 + x2 Q22]``."""
    n = q.shape[0]
    if n < block_min(q.device):
        return x @ q
    h = n // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    out[:, :h] = matmul_upper(x[:, :h], q[:h, :h])
    out[:, h:] = torch.addmm(matmul_upper(x[:, h:], q[h:, h:]), x[:, :h], q[:h, h:])
    return out


def matmul_upper_t(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``x @ Qᵀ`` for upper-triangular ``Q``: ``[x1 Q11ᵀ + x2 Q12ᵀ, x2 Q22ᵀ]``."""
    n = q.shape[0]
    if n < block_min(q.device):
        return x @ q.T
    h = n // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    out[:, :h] = torch.addmm(matmul_upper_t(x[:, :h], q[:h, :h]), x[:, h:], q[:h, h:].T)
    out[:, h:] = matmul_upper_t(x[:, h:], q[h:, h:])
    return out


def upper_triangular_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for upper-triangular ``a`` and ``b`` (the result is upper triangular)."""
    n = a.shape[0]
    if n < block_min(b.device):
        return a @ b
    h = n // 2
    out = torch.empty_like(b)
    out[h:, :h] = 0
    out[:h, :h] = upper_triangular_matmul(a[:h, :h], b[:h, :h])
    out[:h, h:] = torch.addmm(matmul_upper(a[:h, h:], b[h:, h:]), a[:h, :h], b[:h, h:])
    out[h:, h:] = upper_triangular_matmul(a[h:, h:], b[h:, h:])
    return out


def upper_gram(q: torch.Tensor) -> torch.Tensor:
    """``QᵀQ`` for upper-triangular ``Q`` (symmetric: the lower-left block is mirrored)."""
    n = q.shape[0]
    if n < block_min(q.device):
        return q.T @ q
    h = n // 2
    q11, q12, q22 = q[:h, :h], q[:h, h:], q[h:, h:]
    out = torch.empty_like(q)
    out[:h, :h] = upper_gram(q11)
    out[h:, :h] = matmul_upper(q12.T, q11)  # Q12ᵀ Q11
    out[:h, h:] = out[h:, :h].T
    out[h:, h:] = torch.addmm(upper_gram(q22), q12.T, q12)
    return out


def _dense_fraction(n: int, bmin: int) -> float:
    """Flops of a blocked product with an ``n×n`` triangular matrix, relative to dense."""
    return 1.0 if n < bmin else 0.25 + 0.5 * _dense_fraction(n // 2, bmin)


def _gram_fraction(n: int, bmin: int) -> float:
    """Flops of :func:`upper_gram` relative to a dense ``n×n`` product."""
    h = n // 2
    return 1.0 if n < bmin else (2 * _gram_fraction(h, bmin) + _dense_fraction(h, bmin) + 1) / 8


def spectral_norm_lower_bound(s: torch.Tensor) -> torch.Tensor:
    """A cheap lower bound of ``‖S‖₂`` for a symmetric positive semi-definite ``S``:
    ``‖S y‖`` with the unit vector ``y ∝ S S e_j`` started from the column ``j`` of largest
    norm (two power iterations). ``S`` is first divided by ``max|S_ij| = max_i S_ii`` so the
    products cannot overflow; 0 for ``S = 0``."""
    tiny = torch.finfo(s.dtype).tiny
    scale = torch.diagonal(s).amax().clamp_min(0) + tiny
    s = s / scale
    j = torch.linalg.vector_norm(s, dim=0).argmax()
    x = s.index_select(1, j.reshape(1)).reshape(-1)
    x = s.T @ x
    x = x / (torch.linalg.vector_norm(x) + tiny)
    return torch.linalg.vector_norm(s @ x) * scale


def diagonal_q_step(q: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor,
                    lr: float | torch.Tensor) -> torch.Tensor:
    """New diagonal factor ``q − lr (T1 − T2) ⊙ q / max|T1 + T2|`` (``T`` are vectors)."""
    norm = (t1 + t2).abs().amax() + torch.finfo(q.dtype).tiny
    return q - (lr / norm) * (t1 - t2) * q


def triangular_q_step(q: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor,
                      lr: float | torch.Tensor) -> torch.Tensor:
    """New triangular factor ``Q − lr triu(T1 − T2) Q / ‖T1 + T2‖₂`` (norm: lower bound)."""
    norm = spectral_norm_lower_bound(t1 + t2) + torch.finfo(q.dtype).tiny
    step = torch.triu(t1 - t2).mul_(lr / norm)
    return q - upper_triangular_matmul(step, q)


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-dim bool tensor: every element of every tensor is finite (no host sync)."""
    ok = torch.ones((), dtype=torch.bool, device=tensors[0].device)
    for t in tensors:
        ok = ok & torch.isfinite(torch.linalg.vector_norm(t, float("inf")))
    return ok


def _cheaper_to_form_p(n: int, fibres: int, device: torch.device, uses: float = 1.0) -> bool:
    """Whether forming ``QᵀQ`` once and multiplying ``x (QᵀQ)`` ``uses`` times beats
    ``(x Qᵀ) Q`` as often, for ``fibres`` rows (flop estimate)."""
    bmin = block_min(device)
    form = 2 * n ** 3 * _gram_fraction(n, bmin) + uses * 2 * fibres * n * n
    return form < uses * 4 * fibres * n * n * _dense_fraction(n, bmin)


# ------------------------------------------------------- Procrustes-style update (opt-in)
# Xi-Lin Li's current default fitting rule ("Q0.5EQ1.5", psgd_torch 2025): the factors are
# dense and kept close to symmetric positive definite, the fit uses only matmuls (no
# triangular solves, so it also runs in bfloat16), and the step is normalised by a running
# estimate of the fit's Lipschitz constant instead of ‖T1 + T2‖ of one step:
#
#     h = g + δ v            (δ = 1e-9 + eps·|g|: the damping noise; v the probe)
#     A = P h                 T_i = A_(i) A_(i)ᵀ,   c_i = numel / n_i
#     ℓ_i = ‖T_i‖₂ + c_i      L_i ← max(β L_i + (1 − β) ℓ_i, ℓ_i)
#     Q_i ← Q_i − lr/L_i · (T_i − c_i I) Q_i,   then one online Procrustes rotation of Q_i
#
# At the fixed point E[T_i] = c_i I, i.e. P E[h hᵀ] P = I: the same whitening target as the
# triangular rule. The rotation Q ← U Q with U ≈ exp(aR), R = Qᵀ − Q, moves Q towards the
# symmetric square root of QᵀQ without changing P = QᵀQ to first order.
UPDATE_RULES = ("eq", "procrustes")
PROCRUSTES_BETA = 0.9  # decay of the running Lipschitz estimate (psgd_torch's betaL)
PROCRUSTES_MAX_ROTATION = 0.125  # |a|·‖R‖ bound that keeps the 2nd-order exp(aR) accurate


def check_update_rule(update_rule: str) -> None:
    """Raise ``ValueError`` unless ``update_rule`` is one of :data:`UPDATE_RULES`."""
    if update_rule not in UPDATE_RULES:
        raise ValueError(f"Invalid precond_update: {update_rule!r}; expected one of {UPDATE_RULES}")


def skew_norm_lower_bound(r: torch.Tensor) -> torch.Tensor:
    """A cheap lower bound of ``‖R‖₂`` (any square ``R``): ``‖x R‖ / ‖x‖`` for the row ``x`` of
    largest norm, or that row's norm if larger. 0 for ``R = 0``."""
    tiny = torch.finfo(r.dtype).tiny
    rows = torch.linalg.vector_norm(r, dim=1)
    j = rows.argmax()
    x = r.index_select(0, j.reshape(1))
    row_norm = rows.index_select(0, j.reshape(1)).reshape(())
    return torch.maximum(torch.linalg.vector_norm(x @ r) / (row_norm + tiny), row_norm)


def procrustes_rotation(q: torch.Tensor) -> torch.Tensor:
    """``U Q`` with ``U = I + aR + (aR)²/2 ≈ exp(aR)``, ``R = (Qᵀ − Q)/‖Qᵀ − Q‖``: one step
    towards ``max_U tr(U Q)`` over rotations (the orthogonal Procrustes problem whose answer
    makes ``U Q`` symmetric). ``a`` maximises the quadratic model of ``tr(U Q)`` (capped at
    :data:`PROCRUSTES_MAX_ROTATION`). A symmetric ``Q`` is returned unchanged."""
    r = q.T - q
    r = r / (skew_norm_lower_bound(r) + torch.finfo(q.dtype).tiny)
    rq = r @ q
    rrq = r @ rq
    slope = torch.diagonal(rq).sum()  # d tr(UQ)/da at 0 (>= 0 when Q is close to SPD)
    curvature = torch.diagonal(rrq).sum()  # d² tr(UQ)/da²
    cap = torch.full_like(slope, PROCRUSTES_MAX_ROTATION)
    a = torch.where(curvature < 0, torch.minimum(-slope / curvature.clamp(max=-torch.finfo(q.dtype).tiny), cap), cap)
    return q + a * (rq + (0.5 * a) * rrq)


def procrustes_lipschitz(previous: torch.Tensor, ell: torch.Tensor) -> torch.Tensor:
    """``max(β L + (1 − β) ℓ, ℓ)``: follows a growing ℓ at once, a shrinking one slowly."""
    return torch.maximum(PROCRUSTES_BETA * previous + (1 - PROCRUSTES_BETA) * ell, ell)


# ----------------------------------------------------------------------------- factors
class PSGDFactors:
    """Kronecker whitening factors ``Q_i`` for one tensor (any rank; a 0-dim tensor is
    treated as shape ``(1,)``).

    Args:
        shape: shape of the gradients this preconditions.
        max_size_triangular, min_ndim_triangular, memory_save_mode: which factors are
            diagonal, see :func:`factor_is_diagonal`.
        init_scale: ``s``; every factor starts at ``s^(1/r)·I`` (or ``s^(1/r)·1``), so
            ``P = s²·I``. ``None`` estimates ``s`` from the first gradient
            (:meth:`initialize_from`, called automatically by :meth:`update` /
            :meth:`precondition` if needed).
        dtype, device: of the factors.
        compute_dtype: of the math (default ``dtype``): the factors are cast to it for each
            update and preconditioning, and each update's result is rounded back to
            ``dtype`` (a result that is not finite there is not kept). The ``Kron``
            optimizer computes float16 factors in float32, whose range float16's 65 504 lacks.
        merge_dims: view tensors of rank > 2 as the most square 2-D matrix
            (:func:`most_square_split`), transparently in :meth:`update` / :meth:`precondition`.
        squeeze_dims: give dims of size 1 after the first two no factor (before ``merge_dims``),
            so that a pointwise convolution ``[out, in, 1, 1]`` is preconditioned as its
            ``nn.Linear`` twin ``[out, in]``. A size-1 factor is a scalar that only rescales
            ``P``, and its fit takes its own step on that scale each update; the first two dims
            keep theirs, as a Linear's ``[1, in]`` weight does.
        update_rule: ``'eq'`` (default): upper-triangular factors, ``dQ = E Q`` with
            triangular solves (the module docstring's formula); ``'procrustes'``: dense factors kept near SPD,
            Li's matmul-only ``dQ = Q^0.5 E Q^1.5`` rule (see the section comment above
            :func:`procrustes_rotation`). Both fit the same whitening preconditioner.

    Attributes:
        q: per (possibly merged) dim, an upper-triangular ``[n, n]`` or diagonal ``[n]`` tensor.
        initialized: ``False`` only while ``init_scale is None`` and no gradient was seen.
    """

    def __init__(self, shape: Sequence[int], *, max_size_triangular: int = 8192,
                 min_ndim_triangular: int = 2, memory_save_mode: str | None = None,
                 init_scale: float | None = 1.0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, merge_dims: bool = False,
                 update_rule: str = "eq", compute_dtype: torch.dtype | None = None,
                 squeeze_dims: bool = False):
        check_update_rule(update_rule)
        self.update_rule = update_rule
        self.shape = tuple(int(n) for n in shape)
        work = self.shape or (1,)
        if squeeze_dims:  # a conv's kernel dims of size 1: the first two dims always keep a factor
            work = tuple(n for i, n in enumerate(work) if i < 2 or n != 1)
        if merge_dims and len(work) > 2:
            work = most_square_split(work)
        self.work_shape: tuple[int, ...] = tuple(work)
        self.numel = math.prod(self.work_shape)
        self.diagonal = factor_is_diagonal(
            self.work_shape, max_size_triangular=max_size_triangular,
            min_ndim_triangular=min_ndim_triangular, memory_save_mode=memory_save_mode)
        if init_scale is not None and not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"Invalid precond_init_scale: {init_scale!r}; expected a positive "
                             "finite float or None")
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        rank = len(self.work_shape)
        self._gram_subscripts = [gram_subscripts(rank, i, d) for i, d in enumerate(self.diagonal)]
        self._form_p = [_cheaper_to_form_p(n, self.numel // max(n, 1), self.device)
                        for n in self.work_shape]
        self.q: list[torch.Tensor] = [
            torch.empty(n, dtype=dtype, device=self.device) if d
            else torch.empty(n, n, dtype=dtype, device=self.device)
            for n, d in zip(self.work_shape, self.diagonal)]
        # Running Lipschitz estimates of the Procrustes-style fit (one per factor).
        self.lipschitz: list[torch.Tensor] = (
            [torch.zeros((), dtype=dtype, device=self.device) for _ in self.q]
            if update_rule == "procrustes" else [])
        self._reset(1.0 if init_scale is None else float(init_scale))
        self.initialized = init_scale is not None

    def __repr__(self) -> str:
        kinds = ["diag" if d else "tri" for d in self.diagonal]
        return (f"PSGDFactors(shape={self.shape}, work_shape={self.work_shape}, "
                f"factors={kinds}, dtype={self.dtype})")

    def to(self, device: torch.device | str) -> None:
        """Move the factors to ``device`` (their values and dtype are kept)."""
        self.device = torch.device(device)
        self.q = [q.to(self.device) for q in self.q]
        self._form_p = [_cheaper_to_form_p(n, self.numel // max(n, 1), self.device)
                        for n in self.work_shape]

    # -- initialisation --------------------------------------------------------------
    def _reset(self, scale: float) -> None:
        """Every factor to ``s^(1/r)·I`` (triangular) or ``s^(1/r)·1`` (diagonal)."""
        per_factor = scale ** (1.0 / len(self.q))
        for q in self.q:
            if q.dim() == 1:
                q.fill_(per_factor)
            else:
                torch.nn.init.eye_(q).mul_(per_factor)

    def initialize_from(self, grad: torch.Tensor) -> None:
        """(Re)set the factors to ``s^(1/r)·I`` with ``s = (mean |g|⁴)^(-1/8)`` from ``grad``,
        so that ``P g`` has unit scale. One host sync; ``ValueError`` if ``s`` is not a
        positive finite number (zero, infinite or NaN gradient)."""
        g = grad.detach().to(torch.float64)
        fourth = g.abs().pow(4).mean()
        scale = float(fourth.pow(-0.125))
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(
                f"precond_init_scale=None: cannot estimate the initial scale from a gradient "
                f"with mean|g|^4 = {float(fourth)!r}; pass a positive precond_init_scale")
        self._reset(scale)
        self.initialized = True

    # -- the two verbs ---------------------------------------------------------------
    def _work_view(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if x.numel() != self.numel:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {self.shape}")
        return x.reshape(self.work_shape).to(self.compute_dtype)

    def _computing(self) -> list[torch.Tensor]:
        """The factors in :attr:`compute_dtype` (themselves when it is their dtype)."""
        return [q.to(self.compute_dtype) for q in self.q]

    def _gram(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """``X_(i) X_(i)ᵀ`` (or its diagonal): plain matmuls for the outer dims."""
        if not self.diagonal[i] and i in (0, x.dim() - 1):
            if i == 0:
                x2 = x.reshape(x.shape[0], -1)
                return x2 @ x2.T
            x2 = x.reshape(-1, x.shape[-1])
            return x2.T @ x2
        return torch.einsum(self._gram_subscripts[i], x, x)

    def update(self, fit: torch.Tensor, probe: torch.Tensor,
               lr: float | torch.Tensor, enabled: torch.Tensor | None = None) -> torch.Tensor:
        """One Q update in place with fitting gradient ``fit`` and probe ``probe`` ~ N(0, I)
        (same shape as ``fit``) and step size ``lr``.

        If ``fit`` or any new factor is non-finite, or ``enabled`` (a 0-dim bool tensor) is
        False, every factor (and Lipschitz estimate) is left unchanged (chosen with
        ``torch.where``, no host sync). ``fit`` is never modified. Returns a 0-dim bool
        tensor: ``True`` if the update was applied.
        """
        if not self.initialized:
            self.initialize_from(fit)
        if self.update_rule == "procrustes":
            return self._procrustes_update(fit, probe, lr, enabled)
        g = self._work_view(fit, "fit")
        v = self._work_view(probe, "probe")
        qs = self._computing()
        a = apply_along_dims(g, [apply_q(q) for q in qs])
        b = apply_along_dims(v, [apply_q_inv_t(q) for q in qs])
        new = []
        for i, (q, diag) in enumerate(zip(qs, self.diagonal)):
            t1, t2 = self._gram(a, i), self._gram(b, i)
            step = diagonal_q_step if diag else triangular_q_step
            new.append(step(q, t1, t2, lr).to(self.dtype))
        ok = all_finite([g, *new])
        if enabled is not None:
            ok = ok & enabled
        for q, q_new in zip(self.q, new):
            torch.where(ok, q_new, q, out=q)
        return ok

    def _dense_p_maps(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """``x ↦ QᵀQ x`` on mode fibres for dense (not triangular) factors."""
        maps: list[Callable[..., torch.Tensor]] = []  # each x -> x·(factor), factor bound by default
        for q in self._computing():
            n = q.shape[0]
            fibres = self.numel // n
            if q.dim() == 1:
                q2 = q * q
                maps.append(lambda x, q2=q2: x * q2)
            elif 2 * n ** 3 + 2 * fibres * n * n < 4 * fibres * n * n:  # flops: form P once
                p = q.T @ q
                maps.append(lambda x, p=p: x @ p)
            else:  # (x Qᵀ) Q: two products with the fibres beat forming QᵀQ
                maps.append(lambda x, q=q: (x @ q.T) @ q)
        return maps

    def _procrustes_update(self, fit: torch.Tensor, probe: torch.Tensor,
                           lr: float | torch.Tensor, enabled: torch.Tensor | None) -> torch.Tensor:
        g = self._work_view(fit, "fit")
        v = self._work_view(probe, "probe")
        h = g + (1e-9 + torch.finfo(self.compute_dtype).eps * g.abs()) * v
        a = apply_along_dims(h, self._dense_p_maps())
        new_q, new_l = [], []
        for i, (q, diag) in enumerate(zip(self._computing(), self.diagonal)):
            t = self._gram(a, i)
            c = self.numel / self.work_shape[i]
            previous = self.lipschitz[i].to(self.compute_dtype)
            if diag:
                ell = t.amax() + c
                lip = procrustes_lipschitz(previous, ell)
                new_q.append((q * (1 - (lr / lip) * (t - c))).to(self.dtype))
            else:
                ell = spectral_norm_lower_bound(t) + c
                lip = procrustes_lipschitz(previous, ell)
                step = (t @ q).sub_(q, alpha=c)
                new_q.append(procrustes_rotation(q - (lr / lip) * step).to(self.dtype))
            new_l.append(lip.to(self.dtype))
        ok = all_finite([g, *new_q, *new_l])
        if enabled is not None:
            ok = ok & enabled
        for q, q_new, lip, lip_new in zip(self.q, new_q, self.lipschitz, new_l):
            torch.where(ok, q_new, q, out=q)
            torch.where(ok, lip_new, lip, out=lip)
        return ok

    def preconditioner_products(self, uses: float = 1.0) -> list[torch.Tensor | None]:
        """Per factor, what :meth:`precondition` multiplies by: ``Q_iᵀQ_i`` for a triangular
        factor where forming it is cheaper than two triangular products over ``uses``
        applications (the expected number of steps until the factors change), ``q_i²`` for a
        diagonal one, ``None`` otherwise. Valid until the factors change."""
        out: list[torch.Tensor | None] = []
        for q, n, form_p in zip(self._computing(), self.work_shape, self._form_p):
            if q.dim() == 1:
                out.append(q * q)
            elif self.update_rule == "procrustes":  # dense factors: plain flop count
                fibres = self.numel // max(n, 1)
                if 2 * n ** 3 + uses * 2 * fibres * n * n < uses * 4 * fibres * n * n:
                    out.append(q.T @ q)
                else:
                    out.append(None)
            elif form_p or (uses > 1 and _cheaper_to_form_p(n, self.numel // max(n, 1), self.device, uses)):
                out.append(upper_gram(q))
            else:
                out.append(None)
        return out

    def precondition(self, grad: torch.Tensor,
                     products: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Return ``P grad = grad ×_i (Q_iᵀ Q_i)``: a new tensor of ``grad``'s shape and dtype.
        ``products`` (from :meth:`preconditioner_products`) saves rebuilding them."""
        if not self.initialized:
            self.initialize_from(grad)
        g = self._work_view(grad, "grad")
        if products is None:
            products = self.preconditioner_products()
        dense = self.update_rule == "procrustes"
        # a factor with a product is not read: cast only the others
        maps = [_multiply_by(q if p is not None else q.to(self.compute_dtype), p, dense)
                for q, p in zip(self.q, products)]
        out = apply_along_dims(g, maps)
        return out.reshape(grad.shape).to(grad.dtype)

    def balance(self, enabled: torch.Tensor | None = None) -> None:
        """Rescale the factors to equal max-abs (their geometric mean) without changing
        ``P``; keeps a long run away from under/overflow. ``enabled`` (a 0-dim bool tensor)
        False leaves them exactly as they are. No host sync."""
        if len(self.q) < 2:
            return
        norms = torch.stack([q.abs().amax() for q in self.q]).clamp_min(
            torch.finfo(self.dtype).tiny)
        factors = norms.log().mean().exp() / norms
        if enabled is not None:
            factors = torch.where(enabled, factors, torch.ones_like(factors))
        for q, f in zip(self.q, factors):
            q.mul_(f)

    # -- bookkeeping -----------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """The Q tensors themselves (in-place writes, e.g. a broadcast, update the factors)."""
        return list(self.q)

    def memory(self) -> int:
        """Bytes held by the factors."""
        return sum(q.numel() * q.element_size() for q in self.q)

    def cost(self) -> float:
        """Estimated flops of one update: ``Σ n_i³`` (triangular) + ``Σ n_i`` (diagonal)
        + ``numel · Σ n_i`` (the mode products)."""
        factor = sum(n if d else n ** 3 for n, d in zip(self.work_shape, self.diagonal))
        return float(factor + self.numel * sum(self.work_shape))

    def state_dict(self) -> dict[str, Any]:
        """``{'q': [tensors], 'initialized': bool}`` (references, as torch modules do), plus
        ``'lipschitz'`` under ``update_rule='procrustes'``."""
        state = {"q": list(self.q), "initialized": self.initialized}
        if self.update_rule == "procrustes":
            state["lipschitz"] = list(self.lipschitz)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy saved factors in place (dtype/device converted); ``ValueError`` on a mismatch."""
        qs = list(state_dict["q"])
        expected = [tuple(q.shape) for q in self.q]
        got = [tuple(q.shape) for q in qs]
        if got != expected:
            raise ValueError(f"PSGDFactors.load_state_dict: factor shapes {got} do not match "
                             f"{expected} (tensor shape {self.shape})")
        for q, src in zip(self.q, qs):
            q.copy_(src)
        for lip, src in zip(self.lipschitz, state_dict.get("lipschitz", ())):
            lip.copy_(src)
        self.initialized = bool(state_dict["initialized"])
