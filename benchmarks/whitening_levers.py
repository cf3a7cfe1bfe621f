"""Which of ``WhitenedMuon``'s whitening pays: the output side at lower cost, an output factor
made from the gradient, and the input side of one shape of weight left out.

``output_side=True`` whitens a weight on both sides, ``-G^{-1/2} msign(G^{-1/2} M A^{-1/2}) A^{-1/2}``,
with ``G`` K-FAC's output-gradient factor: on statistics steps a tensor hook on each layer's
output takes ``statistics_rows`` of the output gradient and adds their products to ``G``.
It saves the most steps of any setting measured, and its step costs the most. Each variant
here changes one thing and nothing else:

- ``input_skip="wide"`` (``"narrow"``, ``"square"``): the weights whose input is wider than
  (narrower than, as wide as) their output keep an identity input whitener; in the GPT the
  MLP's second layer (its first; the attention projections). The identity still costs its
  matmuls: this variant measures steps, not the cost it would save. ``input_skip_names`` (a
  regex on the layer names) does the same for the layers it matches: ``input_no_out_proj``
  leaves the attention's output projection unwhitened, as ``nn.MultiheadAttention``'s is.

- ``input_rank=D``: the input factors as wide as the input of a weight whose input is wider
  than its output (the GPT's MLP second layer; chosen by width) are whitened as if they were
  diagonal plus low rank. The damped factor scaled to unit diagonal, ``C = S^{-1/2} (F + λI)
  S^{-1/2}`` (``S`` its diagonal), keeps its top ``n / D`` eigenpairs, and the rest of its
  spectrum is replaced by their mean: ``C ≈ U Λ Uᵀ + σ² (I - U Uᵀ)``, whitened by
  ``T = (U Λ^{-1/2} Uᵀ + σ^{-1} (I - U Uᵀ)) S^{-1/2}``, applied factored (:class:`LowRankWhitener`):
  ``2 · out · in · n / D`` multiply-adds per application instead of ``out · in²``. Its refresh
  is dearer than the library's (an ``eigh`` in float64, and the dense ``T`` formed for the
  state), so the step time shows what the application saves net of that. ``track_rank=True``
  (``input_rank4_tracked``) solves the ``eigh`` once, then tracks the top ``n / D`` eigenpairs
  from refresh to refresh by one step of subspace iteration (:func:`tracked_lowrank_whitener`:
  two ``n × n × n / D`` products, a thin QR and a small ``eigh``), cheaper than the library's
  inverse Cholesky factor of the whole side.

The others change the output side (they need ``output_side=True``; the input side stays as
the library has it):

- ``output_rows=N``: the output side takes ``N`` rows per call instead of ``statistics_rows``,
  the first ``N`` (``output_spread=False``: the library's rule) or every ``ceil(n / N)``-th
  (``output_spread=True``: rows from every sequence of the batch).
- ``output_block=B``: only the diagonal ``B``-blocks of ``G`` (the library's ``block_size``, on
  the output side alone); ``diag`` is ``B = 1``, each output row scaled by the inverse
  square root of its gradient's (damped) second moment.
- ``output_every=K``: the output side's statistics (and its hook) on every ``K``-th step only, a
  multiple of ``statistics_every`` (``None``: every statistics step); the refreshes in between
  keep the last factor. ``factor_decay`` applies per output refresh, so the output factor
  averages over ``K / statistics_every`` times the input side's horizon.
- ``output_layers="narrow"`` (``"wide"``): the output side only on the weights whose output is
  no wider (wider) than their input. The others keep an identity output whitener, which still
  costs its matmuls: this variant measures steps, not the cost it would save. With
  ``output_elsewhere="none"`` the others have no output side at all (no factor, no refresh, no
  matmuls), so the step time is what the choice would cost as a library setting (``wide_only``).
- ``output_source="gradient"`` (or ``"momentum"``): no hook; ``G`` is made on statistics steps
  from the weight's gradient (or its momentum buffer as the last step left it), whitened on
  the input side first, ``Ĝ = ∇W Tᵀ`` (``T`` the last refresh's input whitener, ``Tᵀ T =
  (A + λI)⁻¹``; none before the first refresh), scaled to ``||Ĝ||_F² = out·in`` and averaged
  over its ``in`` columns, ``G += Ĝ Ĝᵀ / in`` (trace ``out``). This is the left factor of FISMO
  (arXiv 2601.21750), which makes its right factor from the gradient the same way; here the
  input side stays K-FAC's ``A``.

- ``diagonal_damping=True``: each factor damped by its own diagonal, ``T`` with ``Tᵀ T = (F +
  λ diag(F))⁻¹`` (Levenberg-Marquardt's scaling), instead of the library's ``F + λ (tr F / n) I``.
  The library's damping adds the same amount to every coordinate, so a coordinate whose second
  moment is far below the mean is damped to near nothing (its direction barely whitened); the
  diagonal damping inflates each coordinate's variance by the same factor ``1 + λ``, scale-free per
  coordinate. (A coordinate's term is floored at ``10⁻⁶`` of the block's mean diagonal, so one
  that never moved stays finite.)

A variant may also set a library argument away from its default (``statistics_every``, ``block_size``,
``factor_decay``, ``ns_steps``, ``center_inputs``): ``input_every10`` reads statistics on every 10th step with
``factor_decay=0.6`` (the default 25-step horizon from half the statistics steps);
``input_ns4`` and ``both_ns4`` run four Newton-Schulz iterations instead of Muon's five;
``both_every10`` is the output side with ``input_every10``'s statistics (both sides' factors
read on every 10th step); ``input_block512`` whitens the input side in diagonal 512-blocks;
``input_center_all`` (``_none``) centres every input factor (none), and ``input_center_<layers>``
those of the projections ``CENTRED_LAYERS`` names (``qk``: the query and key, ``qk_mlp``: those and
the MLP's gate, up and down projections), as regexes on the module names; ``input_fused_whole``
orthogonalises a fused query/key/value projection (GPT-2's ``c_attn``) as one matrix
(``fused_qkv=False``) instead of three; ``auto_out_damping<value>`` damps the default's output
side by its own ``output_damping``; ``auto_rows_all`` and ``auto_every1`` read every row of each
call, or statistics on every step over the same horizon. ``auto_spread5``
(:class:`SpreadStatistics`) gathers 205 rows per call on every step and refreshes every fifth
from the five steps' rows.

Run as a script, it trains the best Muon of a cell (read from a ``budget_speedup.py`` folder,
to time the step and to check that it reproduces that folder's Muon curve) and the variants
interleaved, per seed at the 1x budget, and reports each variant's budget-equivalent speed-up
over that Muon curve (``benchmarks/budget_speedup.py``'s measure) and its step time
(``--baseline normuon``: the folder's best-tuned NorMuon in Muon's place)::

    OMP_NUM_THREADS=1 python benchmarks/whitening_levers.py --threads 1 --seeds 0,1,2 \\
        --base benchmarks/results/budget_speedup_d64 --lr 0.0452548 --momentum 0.8 \\
        --variants both,first256,spread256 --out benchmarks/results/whitening_levers_d64
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "examples"):
    if str(path) not in sys.path:
        sys.path.append(str(path))

from kron_precond.whitened_muon import WhitenedMuon  # noqa: E402
from kron_precond.whitening import MatrixView, WhiteningStatistics, inverse_cholesky  # noqa: E402

SOURCES = ("activations", "gradient", "momentum")


def _shape_kind(shape: tuple[int, int], side: str) -> str:
    """``"wide"``, ``"narrow"`` or ``"square"``: how ``side`` of an ``[out, in]`` weight compares
    with its other side."""
    out_dim, in_dim = shape
    this, other = (in_dim, out_dim) if side == "input" else (out_dim, in_dim)
    return "wide" if this > other else "narrow" if this < other else "square"


class _VariantStatistics(WhiteningStatistics):
    """``WhiteningStatistics`` with a variant's choice of weights and its output side's rows,
    blocks and interval."""

    output_rows: int | None = None
    output_spread = False
    output_block: int | None = None
    output_every = 1
    output_layers = "all"
    output_elsewhere = "identity"  # the weights output_layers leaves out: "identity" or "none"
    input_skip: str | None = None
    input_skip_names: str | None = None
    input_rank: int | None = None  # D: the wide input factors kept at rank n / D plus a scaled diagonal
    lowrank_widths: frozenset[int] = frozenset()  # the widths of those factors
    track = False  # the low-rank basis tracked from refresh to refresh instead of solved
    tracked: dict[tuple, torch.Tensor]  # a layout's members -> their stacked basis as of the last refresh
    _layout: tuple | None = None  # the members of the layout being refreshed
    from_hook = True  # output rows from the capture hook (False: only those the optimizer adds)
    diagonal_damping = False  # F + λ diag(F) instead of F + λ tr(F)/n I

    def terms(self, unit, side, rows, scale):
        skipped = ((self.input_skip is not None
                    and _shape_kind(self.views[id(unit.param)].shape, "input") == self.input_skip)
                   or (self.input_skip_names is not None and re.search(self.input_skip_names, unit.name)))
        if side == "input" and skipped:
            self.observed.add(id(unit.param))  # seen, and left unwhitened on purpose
            return None  # its factor stays zero: an identity whitener
        return super().terms(unit, side, rows, scale)

    def observe(self, unit, side, rows, scale, *, added: bool = False) -> None:
        if side == "output" and not self.whitens_output(unit.param):
            return
        if side == "output" and added:  # the columns of a whitened gradient: all of them, uncapped
            with _set(self, "statistics_rows", None):
                return super().observe(unit, side, rows, scale)
        if side == "output":
            if not self.from_hook or self.state[unit.param].get("step", 0) % self.output_every:
                return
            if self.output_rows is not None:
                flat = rows.reshape(-1, rows.shape[-1])
                rows = (flat[:: -(-flat.shape[0] // self.output_rows)] if self.output_spread
                        else flat[: self.output_rows])
        super().observe(unit, side, rows, scale)

    def whitens_output(self, param: torch.Tensor) -> bool:
        """``output_layers``: every weight, those whose output is wider than their input, or the others."""
        wide = _shape_kind(self.views[id(param)].shape, "output") == "wide"
        return self.output_layers == "all" or wide == (self.output_layers == "wide")

    # id(param) -> its input side's pieces as of the last refresh (set per instance)
    lowrank: dict[int, LowRankWhitener]
    _pieces: LowRankWhitener | None = None

    def decompose(self, factor, overwrite, damping):
        if self.diagonal_damping:
            return self._diagonally_damped(factor, overwrite, damping)
        if self.input_rank is None or factor.shape[-1] not in self.lowrank_widths:
            return super().decompose(factor, overwrite, damping)
        rank = factor.shape[-1] // self.input_rank
        key = self._layout if self.track else None
        previous = self.tracked.get(key) if key is not None else None
        if previous is not None and previous.shape[:-1] == factor.shape[:-1] and rank < factor.shape[-1]:
            self._pieces = tracked_lowrank_whitener(factor, damping, previous)
        else:  # solved: every refresh, or the first one of a tracked basis
            self._pieces = lowrank_whitener(factor, damping, rank)
        if key is not None:
            self.tracked[key] = self._pieces.basis
        whitener = self._pieces.dense()  # kept in the state, as the library's (checkpoints, tests)
        return whitener, torch.isfinite(whitener.sum(dim=(1, 2)))[:, None, None]

    def _diagonally_damped(self, factor: torch.Tensor, overwrite: bool,
                           damping: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The library's Cholesky whitener of ``F + λ diag(F)`` (floored; the identity for an
        all-zero block), per block of ``factor`` ``[blocks, b, b]``."""
        diagonal = factor.diagonal(dim1=-2, dim2=-1)
        mean = diagonal.mean(-1, keepdim=True)
        added = torch.where(mean > 0, damping * torch.maximum(diagonal, 1e-6 * mean), 1.0)
        safe = factor if overwrite else factor.clone()
        safe.diagonal(dim1=-2, dim2=-1).add_(added)
        whitener, info = inverse_cholesky(safe)
        return whitener, ((info == 0) & torch.isfinite(whitener.sum(dim=(1, 2))))[:, None, None]

    def _refresh_layout(self, members):
        self._pieces = None
        self._layout = tuple((id(state), side) for state, side, *_ in members)
        try:
            super()._refresh_layout(members)
        finally:
            self._layout = None
        if self._pieces is None:
            return
        # decompose saw the members' factors stacked in order, each [units · blocks] matrices
        sizes = [state[f"{side}_factor"][..., 0, 0].numel() for state, side, *_ in members]
        params = {id(state): p for p, state in self.state.items()}
        for (state, *_), pieces in zip(members, self._pieces.split(sizes)):
            self.lowrank[id(params[id(state)])] = pieces

    def side_blocks(self, param, side):
        if side != "output" or self.output_block is None:
            return super().side_blocks(param, side)
        with _set(self, "block_size", self.output_block):
            return super().side_blocks(param, side)


@dataclasses.dataclass
class LowRankWhitener:
    """``T = (σ⁻¹ I + U diag(c) Uᵀ) diag(s)`` for a batch ``[k]``: ``s`` ``[k, n]`` (``S^{-1/2}``),
    ``basis`` ``U`` ``[k, n, r]``, ``coefficients`` ``c = Λ^{-1/2} - σ⁻¹`` ``[k, r]``,
    ``inverse_sigma`` ``σ⁻¹`` ``[k]``. Applied in ``4 · out · in · r`` multiply-adds per step (two
    products with ``U`` before ``msign`` and two after) instead of the dense ``2 · out · in²``."""
    s: torch.Tensor
    basis: torch.Tensor
    coefficients: torch.Tensor
    inverse_sigma: torch.Tensor

    def to(self, dtype: torch.dtype) -> "LowRankWhitener":
        return LowRankWhitener(*(t.to(dtype) for t in (self.s, self.basis, self.coefficients, self.inverse_sigma)))

    @staticmethod
    def cat(pieces: list["LowRankWhitener"]) -> "LowRankWhitener":
        return LowRankWhitener(*(torch.cat(ts) for ts in zip(*((p.s, p.basis, p.coefficients, p.inverse_sigma)
                                                                for p in pieces))))

    def split(self, sizes: list[int]) -> list["LowRankWhitener"]:
        return [LowRankWhitener(*ts) for ts in zip(*(t.split(sizes) for t in
                                                      (self.s, self.basis, self.coefficients, self.inverse_sigma)))]

    def apply(self, matrix: torch.Tensor, transpose: bool) -> torch.Tensor:
        """``X Tᵀ`` (``transpose``) or ``X T`` for a stack ``X`` ``[k, out, in]``."""
        s = self.s[:, None, :]
        x = matrix * s if transpose else matrix
        x = torch.bmm(torch.bmm(x, self.basis) * self.coefficients[:, None, :], self.basis.mT).add_(
            x * self.inverse_sigma[:, None, None])
        return x if transpose else x * s

    def dense(self) -> torch.Tensor:
        """``T`` ``[k, n, n]``."""
        t = (self.basis * self.coefficients[:, None, :]) @ self.basis.mT
        t.diagonal(dim1=-2, dim2=-1).add_(self.inverse_sigma[:, None])
        return t * self.s[:, None, :]


def _scaled_damped(factor: torch.Tensor, damping: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C, S^{-1/2})``: ``F + λI`` (``λ = damping · tr(F) / n``) scaled to unit diagonal, ``C =
    S^{-1/2} (F + λI) S^{-1/2}``, for a batch ``[k, n, n]``, in ``factor``'s dtype."""
    n = factor.shape[-1]
    lam = damping * factor.diagonal(dim1=-2, dim2=-1).sum(-1) / n
    lam = torch.where(lam > 0, lam, 1.0)  # an all-zero factor: the identity
    damped = factor + lam[:, None, None] * torch.eye(n, dtype=factor.dtype, device=factor.device)
    scale = damped.diagonal(dim1=-2, dim2=-1).rsqrt()  # S^{-1/2}
    return damped * scale[:, :, None] * scale[:, None, :], scale


def _pieces(scale: torch.Tensor, basis: torch.Tensor, top: torch.Tensor, sigma: torch.Tensor) -> LowRankWhitener:
    """``T = (U Λ^{-1/2} Uᵀ + σ⁻¹ (I - U Uᵀ)) S^{-1/2}`` from ``σ⁻¹`` (``sigma``) and the top pairs."""
    return LowRankWhitener(scale, basis, top.clamp(min=1e-12).rsqrt() - sigma[:, None], sigma)


def lowrank_whitener(factor: torch.Tensor, damping: float, rank: int) -> LowRankWhitener:
    """The :class:`LowRankWhitener` of a batch of factors ``[k, n, n]``: with ``F + λI``
    (``λ = damping · tr(F) / n``) scaled to unit diagonal, ``C = S^{-1/2} (F + λI) S^{-1/2}``, its
    top ``rank`` eigenpairs ``U Λ Uᵀ`` kept and the rest of the spectrum replaced by its mean
    ``σ²``: ``T = (U Λ^{-1/2} Uᵀ + σ⁻¹ (I - U Uᵀ)) S^{-1/2}``, so that
    ``Tᵀ T = S^{-1/2} (U Λ Uᵀ + σ² (I - U Uᵀ))⁻¹ S^{-1/2}``. ``rank = n``: ``Tᵀ T = (F + λI)⁻¹``.
    Computed in float64 (an ``eigh`` of ``n × n``), returned in ``factor``'s dtype."""
    n = factor.shape[-1]
    scaled, scale = _scaled_damped(factor.double(), damping)
    values, vectors = torch.linalg.eigh(scaled)
    top, basis = values[:, n - rank:], vectors[:, :, n - rank:]  # eigh: ascending
    sigma = values[:, : n - rank].mean(-1).clamp(min=1e-12).rsqrt() if rank < n else torch.ones_like(scale[:, 0])
    return _pieces(scale, basis, top, sigma).to(factor.dtype)


def tracked_lowrank_whitener(factor: torch.Tensor, damping: float, basis: torch.Tensor) -> LowRankWhitener:
    """:func:`lowrank_whitener` with the top ``r`` eigenpairs of ``C`` tracked instead of solved:
    one step of subspace iteration from the last refresh's basis ``U₀`` ``[k, n, r]`` and a
    Rayleigh-Ritz projection, ``Q = qr(C U₀)``, ``Qᵀ C Q = V Λ Vᵀ``, ``U = Q V``. ``C`` has a unit
    diagonal, so the rest of its spectrum has mean ``σ² = (n - Σ Λ) / (n - r)`` without being
    computed. Two ``n × n × r`` products, a thin QR and an ``r × r`` eigh (in float64) instead of
    an ``n × n`` eigh; a fixed point of the iteration is :func:`lowrank_whitener`'s result. The
    products run in ``factor``'s dtype."""
    n, rank = factor.shape[-1], basis.shape[-1]
    scaled, scale = _scaled_damped(factor, damping)
    q = torch.linalg.qr(torch.bmm(scaled, basis.to(factor.dtype)))[0]
    projected = torch.bmm(q.mT, torch.bmm(scaled, q)).double()
    values, vectors = torch.linalg.eigh((projected + projected.mT) / 2)
    top = values.to(factor.dtype)
    sigma = ((n - values.sum(-1)) / (n - rank)).clamp(min=1e-12).rsqrt().to(factor.dtype)
    return _pieces(scale, torch.bmm(q, vectors.to(factor.dtype)), top, sigma)


@contextlib.contextmanager
def _set(obj: Any, name: str, value: Any):
    """``obj.name = value`` for the duration of the block (the base class reads the attribute)."""
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


class _Unit:
    """The observer fields ``WhiteningStatistics.observe`` reads, for rows the optimizer adds."""

    def __init__(self, param: torch.Tensor, index: int) -> None:
        self.param, self.index, self.name = param, index, "gradient"


class SpreadStatistics(WhitenedMuon):
    """``WhitenedMuon`` that gathers its statistics on every step and refreshes every
    ``statistics_every`` steps from all the rows gathered since the last refresh (their mean),
    with ``statistics_rows`` rows per call: a refresh's rows then come from ``statistics_every``
    batches instead of one. With ``statistics_rows`` divided by ``statistics_every`` it forms as
    many products as the library (more calls, each smaller)."""

    _refreshing = False

    def _statistics_step(self) -> bool:  # the capture gathers on every step
        return True

    def _due(self, weight: torch.Tensor) -> bool:
        due = super()._due(weight)
        return due and (not self._refreshing or self._steps % self.statistics_every == 0)

    def _step(self) -> None:
        self._refreshing = True  # step() asks which weights refresh; the hooks, which gather
        try:
            super()._step()
        finally:
            self._refreshing = False


class WhiteningVariant(WhitenedMuon):
    """``WhitenedMuon`` with one change of its input or output side (module docstring)."""

    def __init__(self, params: Any, lr: float, weight_decay: float = 0.0, *, output_rows: int | None = None,
                 output_spread: bool = False, output_block: int | None = None, output_every: int | None = None,
                 output_source: str = "activations", output_layers: str = "all",
                 output_elsewhere: str = "identity", input_skip: str | None = None,
                 input_skip_names: str | None = None, input_rank: int | None = None, track_rank: bool = False,
                 cautious: str | None = None, diagonal_damping: bool = False, head_dim: int | None = None,
                 head_names: str = r"(^|\.)(q|k|v)_proj\.weight$", **kwargs: Any) -> None:
        if output_layers not in ("all", "narrow", "wide"):
            raise ValueError(f"output_layers must be 'all', 'narrow' or 'wide', got {output_layers!r}")
        if output_elsewhere not in ("identity", "none"):
            raise ValueError(f"output_elsewhere must be 'identity' or 'none', got {output_elsewhere!r}")
        if input_skip not in (None, "wide", "narrow", "square"):
            raise ValueError(f"input_skip must be None, 'wide', 'narrow' or 'square', got {input_skip!r}")
        if input_rank is not None and (isinstance(input_rank, bool) or not isinstance(input_rank, int)
                                       or input_rank < 1):
            raise ValueError(f"input_rank must be a positive int (the rank's divisor), got {input_rank!r}")
        if track_rank and input_rank is None:
            raise ValueError("track_rank=True needs an input_rank")
        if not isinstance(diagonal_damping, bool):
            raise TypeError(f"diagonal_damping must be a bool, got {diagonal_damping!r}")
        if diagonal_damping and kwargs.get("root", "cholesky") != "cholesky":
            raise ValueError("diagonal_damping=True needs root='cholesky'")
        if cautious not in (None, "mean", "norm"):
            raise ValueError(f"cautious must be None, 'mean' or 'norm', got {cautious!r}")
        changed = (output_rows is not None or output_spread or output_block is not None or output_every is not None
                   or output_source != "activations" or output_layers != "all" or output_elsewhere != "identity")
        if changed and kwargs.get("output_side", False) is not True:  # "wide" judges weights its own way
            raise ValueError("an output-side change needs output_side=True")
        if output_source not in SOURCES:
            raise ValueError(f"output_source must be one of {SOURCES}, got {output_source!r}")
        every = kwargs.get("statistics_every", inspect.signature(WhitenedMuon).parameters["statistics_every"].default)
        output_every = every if output_every is None else output_every
        if output_every % every:  # checked before the hooks are placed
            raise ValueError(f"output_every ({output_every}) must be a multiple of statistics_every ({every})")
        super().__init__(params, lr, weight_decay, **kwargs)
        if head_dim is not None:  # before any step: the views decide the stacks and their parts
            self._split_heads(head_dim, head_names)
        # WhitenedMuon builds its statistics in __init__; the variant swaps in the subclass
        # that holds its one change, so the library's constructor stays as it is
        statistics_ = self._statistics
        statistics_.__class__ = _VariantStatistics
        assert isinstance(statistics_, _VariantStatistics)
        statistics_.output_rows, statistics_.output_spread = output_rows, output_spread
        statistics_.output_block, statistics_.output_every = output_block, output_every
        statistics_.from_hook = output_source == "activations"
        statistics_.output_layers, statistics_.output_elsewhere = output_layers, output_elsewhere
        statistics_.input_skip, statistics_.input_skip_names = input_skip, input_skip_names
        statistics_.input_rank, statistics_.lowrank = input_rank, {}
        statistics_.track, statistics_.tracked = track_rank, {}
        statistics_.diagonal_damping = diagonal_damping
        if output_elsewhere == "none":  # the others get no output side: the library's per-weight sides
            statistics_.outputs = frozenset(id(p) for p in self._whitened_params() if statistics_.whitens_output(p))
        statistics_.lowrank_widths = frozenset(view.width("input") for view in self._views.values()
                                               if _shape_kind(view.shape, "input") == "wide")
        self.output_source = output_source
        self.cautious = cautious
        self._capture.output_grads = bool(self.output_side) and statistics_.from_hook

    def _split_heads(self, head_dim: int, head_names: str) -> None:
        """The weights whose name matches ``head_names`` stepped as ``out / head_dim`` parts of
        ``head_dim`` rows each (one attention head's projection), each orthogonalised on its own;
        the input whitener stays the weight's, shared by its heads."""
        split = 0
        for p in self._whitened_params():
            view = self._views[id(p)]
            if not re.search(head_names, self._names[id(p)]):
                continue
            if view.parts != 1 or view.units != 1 or view.shape[0] % head_dim:
                raise ValueError(f"{self._names[id(p)]}: a per-head split needs one matrix whose outputs "
                                 f"are a multiple of {head_dim}, got {view.shape}")
            self._views[id(p)] = MatrixView(p, stacked=False, transposed=view.transposed,
                                            parts=view.shape[0] // head_dim)
            split += 1
        if not split:
            raise ValueError(f"head_names {head_names!r} matches no whitened weight")

    def _direction(self, update, left, right):
        """``cautious``: the whitened direction kept only where its sign agrees with the momentum
        it was built from (the step's own descent direction, entry by entry; Cautious Optimizers,
        arXiv 2411.16085), rescaled by the kept fraction (``"mean"``, the paper's: the entries
        kept grow by ``1 / kept``) or to the unmasked direction's Frobenius norm (``"norm"``:
        ``1 / sqrt(kept)`` for entries of one size, Muon's step size kept)."""
        direction = super()._direction(update, left, right)
        if self.cautious is None:
            return direction
        wide = torch.promote_types(direction.dtype, torch.float32)  # sizes of bfloat16 in float32
        agree = (direction * update.to(direction.dtype) > 0).to(direction.dtype)
        masked = direction * agree
        if self.cautious == "mean":
            scale = 1 / agree.to(wide).mean(dim=(-2, -1), keepdim=True).clamp(min=1e-3)
        else:
            scale = (direction.to(wide).norm(dim=(-2, -1), keepdim=True)
                     / masked.to(wide).norm(dim=(-2, -1), keepdim=True).clamp(min=1e-30))
        return masked * scale.to(direction.dtype)

    def _stacked_whiteners(self, params):
        """The input side of a low-rank stack as its :class:`LowRankWhitener` (in ``ns_dtype``)."""
        left, right = super()._stacked_whiteners(params)
        stats = self._statistics
        assert isinstance(stats, _VariantStatistics)
        pieces = [stats.lowrank.get(id(p)) for p in params]
        if right is None or any(piece is None for piece in pieces) or self._views[id(params[0])].parts > 1:
            return left, right
        key = ("lowrank", *(id(p) for p in params))
        if key not in self._casts:
            self._casts[key] = LowRankWhitener.cat([piece for piece in pieces if piece is not None]).to(self.ns_dtype)
        return left, self._casts[key]

    @staticmethod
    def _whiten(matrix, left, right, transpose):
        if isinstance(right, LowRankWhitener):
            return WhitenedMuon._whiten(right.apply(matrix, transpose), left, None, transpose)
        return WhitenedMuon._whiten(matrix, left, right, transpose)

    @torch.no_grad()
    def _step(self) -> None:
        if self.output_source != "activations":
            self._observe_gradients()
        super()._step()
        stats = self._statistics
        assert isinstance(stats, _VariantStatistics)
        # the hook only where the next step gathers the output side (the weights' own step
        # counts, which a checkpoint keeps)
        self._capture.output_grads = bool(self.output_side) and stats.from_hook and any(
            self.state[p].get("step", 0) % stats.output_every == 0 for p in self._whitened_params())

    def _observe_gradients(self) -> None:
        stats = self._statistics
        assert isinstance(stats, _VariantStatistics)
        for p in self._whitened_params():
            if p.grad is None or not self._due(p) or self.state[p].get("step", 0) % stats.output_every:
                continue
            view = self._views[id(p)]
            # "momentum": the buffer as the last step left it (this step's gradient not yet in it)
            source = p.grad if self.output_source == "gradient" else self.state[p].get("momentum_buffer", p.grad)
            matrices = view.matrices(source.unsqueeze(0)).float()  # [k, out, in]
            whitener = self.state[p].get("input_whitener")
            if whitener is not None:
                matrices = self._whiten(matrices, None, whitener.reshape(-1, *whitener.shape[-3:]).float(),
                                        transpose=True)
            norms = matrices.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-30)
            matrices = matrices * (math.sqrt(view.shape[0] * view.shape[1]) / norms)
            for index, matrix in enumerate(matrices):
                stats.observe(_Unit(p, index), "output", matrix.mT, 1.0, added=True)


VARIANTS: dict[str, dict[str, Any]] = {
    "input": dict(output_side=False),  # the library's defaults: the input side alone
    "both": dict(output_side=True),  # output_side=True as the library has it
    "first256": dict(output_side=True, output_rows=256),
    "spread256": dict(output_side=True, output_rows=256, output_spread=True),
    "block64": dict(output_side=True, output_block=64),
    "block32": dict(output_side=True, output_block=32),
    "block128": dict(output_side=True, output_block=128),
    "diag": dict(output_side=True, output_block=1),  # G's diagonal alone: one scale per output row
    "every10": dict(output_side=True, output_every=10),
    "every20": dict(output_side=True, output_every=20),
    "narrow": dict(output_side=True, output_layers="narrow"),
    "wide": dict(output_side=True, output_layers="wide"),
    # the same with no output side elsewhere: its step time is the setting's own
    "wide_only": dict(output_side=True, output_layers="wide", output_elsewhere="none"),
    # the library's output_side="wide": as wide_only, with a fused projection's parts (GPT-2's c_attn:
    # three square matrices) judged by their own shape, so they get no output side
    "output_wide": dict(output_side="wide"),
    "auto": dict(output_side="auto"),  # the library's default side
    "gradient": dict(output_side=True, output_source="gradient"),
    "momentum": dict(output_side=True, output_source="momentum"),
    # the input side alone, with the weights of one input shape left unwhitened (GPT: wide = the
    # MLP's second layer, narrow = its first, square = the attention projections)
    "input_no_wide": dict(output_side=False, input_skip="wide"),
    "input_no_narrow": dict(output_side=False, input_skip="narrow"),
    "input_no_square": dict(output_side=False, input_skip="square"),
    # the attention's output projection unwhitened (Muon's step), as WhitenedMuon steps
    # nn.MultiheadAttention's, whose input no hook sees
    "input_no_out_proj": dict(output_side=False, input_skip_names=r"attn\.out_proj$"),
    # an nn.TransformerDecoderLayer's cross-attention in_proj unwhitened (Muon's step on its three
    # parts), as WhitenedMuon stepped a packed cross-attention before it whitened each part by its input
    "input_no_cross": dict(output_side=False, input_skip_names=r"multihead_attn$"),
    # library settings away from their defaults: half the statistics steps over the same
    # 25-step horizon; one Newton-Schulz iteration fewer than Muon's five
    "input_every10": dict(output_side=False, statistics_every=10, factor_decay=0.6),
    "input_ns4": dict(output_side=False, ns_steps=4),
    # the input side in diagonal 512-blocks: at d_model 256 it splits the MLP's second layer's
    # 1,024-wide input alone (half its products, a fifth of its decomposition)
    "input_block512": dict(output_side=False, block_size=512),
    # the wide input (the MLP's second layer) whitened as diagonal plus rank n/8 or n/4
    "input_rank8": dict(output_side=False, input_rank=8),
    "input_rank4": dict(output_side=False, input_rank=4),
    "both_ns4": dict(output_side=True, ns_steps=4),
    "both_every10": dict(output_side=True, statistics_every=10, factor_decay=0.6),
    # every input factor centred: on a model without biases (Llama-style, Mixtral), what the
    # default did before it centred only the attention's query and key projections
    "input_center_all": dict(output_side=False, center_inputs=True),
    "input_center_none": dict(output_side=False, center_inputs=False),
    # a fused query/key/value projection (GPT-2's c_attn) orthogonalised whole, as the library
    # did before it stepped the three parts as matrices of their own
    "input_fused_whole": dict(output_side=False, fused_qkv=False),
    # the output layer whitened and stepped like the hidden weights instead of by AdamW
    "input_lm_head": dict(output_side=False, whiten_lm_head=True),
    # Newton-Schulz and the whitening in float32: the library's default on a CPU without
    # bfloat16 kernels (the examples pin torch.optim.Muon's bfloat16)
    "input_ns_float32": dict(output_side=False, ns_dtype="float32"),
    # the wide input as diagonal plus rank n/4, in float32 (beside input_ns_float32, on a CPU without
    # bfloat16 kernels, with benchmarks/muon_float32.py's Muon)
    "input_rank4_ns_float32": dict(output_side=False, input_rank=4, ns_dtype="float32"),
    # rank n/4 with its basis tracked (one subspace iteration per refresh) instead of an eigh
    "input_rank4_tracked": dict(output_side=False, input_rank=4, track_rank=True),
    "input_rank4_tracked_ns_float32": dict(output_side=False, input_rank=4, track_rank=True, ns_dtype="float32"),
    # Muon's momentum without Nesterov's look-ahead
    "input_no_nesterov": dict(output_side=False, nesterov=False),
    # the step masked where its sign disagrees with the momentum's, rescaled by the kept fraction
    "input_cautious": dict(output_side=False, cautious="mean"),
    # the same, rescaled to the unmasked step's Frobenius norm instead
    "input_cautious_norm": dict(output_side=False, cautious="norm"),
    # every coordinate damped by its own second moment (F + λ diag F), at the default λ, 3x it and 0.3x it
    "input_diag_damping": dict(output_side=False, diagonal_damping=True),
    "input_diag_damping0.3": dict(output_side=False, diagonal_damping=True, damping=0.3),
    "input_diag_damping0.03": dict(output_side=False, diagonal_damping=True, damping=0.03),
    # each attention head's query/key/value rows (or query/key rows) orthogonalised on their own,
    # the input whitener shared (d_model 64, 4 heads: 16 rows each)
    "input_heads16": dict(output_side=False, head_dim=16),
    "input_heads16_qk": dict(output_side=False, head_dim=16, head_names=r"(^|\.)(q|k)_proj\.weight$"),
    "output_wide_heads16": dict(output_side="wide", head_dim=16),
    # the AdamW half (embeddings, norms, biases, lm_head) at the d_model 64 GPT's best Muon lr,
    # 3.2e-2, whatever --lr the whitened weights take (the library's default: one lr for both)
    "input_adamw_lr0.032": dict(output_side=False, adamw_lr=0.032),
    # the default with every row of each call in the statistics (statistics_rows=None) instead of
    # the first 1,024; with statistics every step over the same 25-step horizon (factor_decay 0.96)
    "auto_rows_all": dict(output_side="auto", statistics_rows=None),
    "auto_every1": dict(output_side="auto", statistics_every=1, factor_decay=0.96),
    # statistics gathered on every step, 205 rows per call (1,024 / 5: as many products as the
    # default), refreshed every 5 steps from the 5 batches' rows
    "auto_spread5": dict(output_side="auto", spread=True, statistics_rows=205),
}
# the default with its output side's factors damped otherwise than its input side's (0.1)
VARIANTS.update({f"auto_out_damping{d}": dict(output_side="auto", output_damping=d)
                 for d in (0.3, 0.1, 0.03, 0.01, 0.003)})
# which layers' input factors are centred, by module name (the default: the bias-free q and k)
CENTRED_LAYERS = {"q": "q", "k": "k", "qk": "q|k", "qkv": "q|k|v", "qko": "q|k|o", "qk_mlp": "q|k|gate|up|down",
                  "o_mlp": "o|gate|up|down"}  # o_mlp: Qwen2's bias-free layers, which the earlier default centred
VARIANTS.update({f"input_center_{name}": dict(output_side=False, center_inputs=(rf"\.({names})_proj$",))
                 for name, names in CENTRED_LAYERS.items()})
# variant keys that are the library's own arguments: the cell's PrecondConfig field each
# replaces (None: passed to WhitenedMuon as is)
LIBRARY_SETTINGS = {"statistics_every": "wmuon_every", "factor_decay": "wmuon_factor_decay",
                    "block_size": "wmuon_block_size", "center_inputs": "wmuon_center_inputs", "ns_steps": None,
                    "fused_qkv": None, "nesterov": None, "adamw_lr": "muon_rest_lr", "ns_dtype": "wmuon_ns_dtype",
                    "damping": "wmuon_damping", "statistics_rows": "wmuon_statistics_rows",
                    "output_damping": "wmuon_output_damping"}


def _build(model: nn.Module, scaler, *, lr: float, weight_decay: float, config, variant: dict[str, Any]):
    from kron_examples_common import build_whitened_muon, unwrap
    variant = dict(variant)
    exclude = config.muon_excluded
    if variant.pop("whiten_lm_head", False):
        exclude = tuple(name for name in exclude if name != "lm_head")
    # the variant's side(s) and library settings, whatever the cell's flags say
    fields = {LIBRARY_SETTINGS[k]: v for k, v in variant.items() if LIBRARY_SETTINGS.get(k)}
    config = dataclasses.replace(config, wmuon_both_sides=variant["output_side"], **fields)
    passed = {k: v for k, v in variant.items() if k in LIBRARY_SETTINGS and LIBRARY_SETTINGS[k] is None}
    spread = variant.pop("spread", False)
    changes = {k: v for k, v in variant.items() if k != "output_side" and k not in LIBRARY_SETTINGS}
    # no change of a side: the library's optimizer itself (or SpreadStatistics, its one change)
    base = SpreadStatistics if spread else WhitenedMuon
    cls = functools.partial(WhiteningVariant if changes else base, **changes, **passed)
    return build_whitened_muon(unwrap(model), lr, weight_decay, exclude, config, post=True,
                               optimizer_class=cls), None


def best_baseline(base: Path, seed: int, measure: dict, method: str = "muon") -> tuple[float, float]:
    """(momentum, lr) of the best-tuned ``method`` (a baseline of ``base``: Muon, NorMuon) at 1x
    in ``base`` for ``seed``: the lr as its record holds it, not the run name's 6 digits (a
    relative change of 8e-7 in a high lr has moved a run's final loss by 0.017, more than the
    levers measured here)."""
    from benchmarks import budget_speedup as bs
    name = measure["rows"][f"{method} (tuned)"]["run"]  # e.g. "muon{mom=0.8} lr=0.016"
    momentum = float(name.split("mom=")[1].split("}")[0])
    return momentum, next(r["lr"] for r in bs.load_runs(base, seed, 1.0) if r["name"] == name)


def main(argv: list[str] | None = None) -> None:
    from benchmarks import budget_speedup as bs
    from char_lm import Contender
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, required=True, help="a budget_speedup.py folder (its measures.json)")
    p.add_argument("--lr", type=float, required=True, help="WhitenedMuon's lr")
    p.add_argument("--momentum", type=float, required=True, help="WhitenedMuon's momentum")
    p.add_argument("--variants", default="both", help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--seeds", default="0")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--baseline", default="muon",
                   help="the --base record's tuned baseline the variants train beside and are measured "
                        "against (muon, normuon)")
    p.add_argument("--other-machine", action="store_true",
                   help="a Muon that ends off the --base record (another CPU rounds otherwise) is warned "
                        "about, not refused: the variants are then compared with one another, and with "
                        "the record's Muon curve only roughly")
    args, rest = p.parse_known_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    cell = bs.parse_args([*rest, "--out", str(args.out)])
    if cell.threads:
        torch.set_num_threads(cell.threads)
    measures = {m["seed"]: m for m in json.loads((args.base / "measures.json").read_text())}
    label = {"muon": "Muon", "normuon": "NorMuon"}.get(args.baseline, args.baseline)
    _, train, precond = bs.configs_from_args(cell)
    config = dataclasses.replace(precond, muon_momentum=args.momentum)
    weight_decay = train.weight_decay
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        measure = measures[seed]
        base_momentum, base_lr = best_baseline(args.base, seed, measure, args.baseline)
        extra = [Contender(name, args.lr, build=functools.partial(_build, lr=args.lr, weight_decay=weight_decay,
                                                                    config=config, variant=VARIANTS[name]))
                 for name in variants]
        part = "levers_" + ("" if args.baseline == "muon" else f"vs_{args.baseline}_") + "_".join(variants)
        runs = bs.train_part(cell, seed, 1.0, part, [(args.baseline, base_momentum, base_lr)],
                             extra=extra)
        stale = [r["name"] for r in runs[1:] if not math.isclose(r["lr"], args.lr)]
        if stale:  # a record of the same variants at another point
            raise SystemExit(f"seed {seed}: the record of {stale} in {args.out} ran at another lr; "
                             f"give this point an --out of its own")
        baseline = runs[0]
        curve = measure["curves"][args.baseline]
        if not math.isclose(baseline["eval_losses"][-1], curve[0]["loss"], rel_tol=1e-6):
            message = (f"seed {seed}: {label} ends at {baseline['eval_losses'][-1]:.6f} here and at "
                       f"{curve[0]['loss']:.6f} in {args.base}")
            if not args.other_machine:
                raise SystemExit(f"{message}: not the same cell (--other-machine on another CPU)")
            print(f"warning: {message}", flush=True)
        base_step = bs.mean_step([baseline])  # without the first step, as budget_speedup.py's report
        for run in runs[1:]:
            s = bs.speedup([c["steps"] for c in curve], [c["loss"] for c in curve], cell.steps,
                           run["eval_losses"][-1], bs.mean_step([run]), base_step)
            rows.append((run["name"], seed, run["eval_losses"][-1], s))
    print(f"| variant | seed | final loss | × best {label}, steps | step × {label} | × best {label}, wall-clock |")
    print("|---|---|---|---|---|---|")
    for name, seed, loss, s in rows:
        print(f"| {name} | {seed} | {loss:.4f} | {s['steps']:.3f} | {s['step_ratio']:.3f} | {s['wallclock']:.3f} |")
    for name in variants:
        mine = [s for n, _, _, s in rows if n == name]
        if len(mine) > 1:
            steps = bs.mean_spread([s["steps"] for s in mine])
            wall = bs.mean_spread([s["wallclock"] for s in mine])
            ratio = statistics.mean(s["step_ratio"] for s in mine)
            print(f"{name}: steps {steps['mean']:.3f} ± {steps['sd']:.3f}, step {ratio:.3f}, "
                  f"wall-clock {wall['mean']:.3f} ± {wall['sd']:.3f}")


if __name__ == "__main__":
    main()
