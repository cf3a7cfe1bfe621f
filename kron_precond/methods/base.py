"""The two contracts a preconditioning method fulfils; the engine knows nothing else of it.

:class:`MethodSpec` -- the method as a whole, registered by name in
:mod:`kron_precond.methods.registry`: its constructor options, which modules it takes,
whether it needs activations and output gradients from module hooks, whether its statistics
are summed across data-parallel ranks, its step schedule, and how to build a layer.

:class:`LayerMethod` -- the state and math of one registered layer, driven by the engine
through these verbs, each given a :class:`~kron_precond.schedules.StepContext`:

* ``observe_activations`` / ``observe_output_grads`` -- hook statistics (``captures``);
* ``observe_gradients`` -- every step, on every rank, with the raw gradients;
* ``shared_statistics`` -> summed across ranks on statistics steps, then ``fold_statistics``;
* ``refresh(part)`` -- the expensive part, only on the part's owner rank, on refresh steps;
  ``refreshed_tensors(part)`` are then broadcast in place to the layer's gradient workers,
  which call ``finalize_refresh``;
* ``apply`` (or the batched ``apply_batch`` over layers with equal ``batch_key``) -- the
  cheap part, every step, on gradient workers;
* ``factor_costs`` / ``memory_by_kind`` -- estimates for work placement and reporting;
* ``state_dict`` / ``check_state`` / ``load_state_dict``.

A new method is one file with a spec and a layer class, plus one registry entry.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Hashable, Sequence, overload

import torch
from torch import nn

from kron_precond.modules import Selected  # a unit of work, as the module adapters describe it
from kron_precond.schedules import StepContext

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = ["Option", "Selected", "LayerMethod", "MethodSpec", "tensor_bytes", "moved"]


@dataclass(frozen=True)
class Option:
    """A method-specific constructor argument.

    Attributes:
        default: value when the user gives none.
        check: ``check(name, value) -> value`` validates (raising ``ValueError`` /
            ``TypeError`` naming the argument) and normalises one value.
        per_step: ``None`` if fixed at construction; otherwise the argument may also be a
            callable of the step, resolved and checked on the steps named here:
            ``"always"``, ``"statistics"`` or ``"refresh"``.
        collective: changing it changes which collectives run when; ranks must agree on it.
    """

    default: Any
    check: Callable[[str, Any], Any]
    per_step: str | None = None
    collective: bool = False


class LayerMethod(abc.ABC):
    """State and math of one preconditioned layer.

    ``parts`` names the pieces of expensive work (K-FAC: ``("A", "G")``; PSGD: the
    parameter names) that the assignment may place on different ranks.
    """

    parts: tuple[str, ...]
    nonfinite: torch.Tensor  # count of updates skipped for non-finite inputs (on device)
    holds_state: bool = True  # set by the engine: this rank is a gradient worker of the layer
    #: the layer's parameters are preconditioned as one (K-FAC's ``[W | b]``), so a step on
    #: which some of them have no gradient (frozen after construction) cannot be applied: the
    #: engine then passes the layer's gradients through and leaves its state alone. ``False``:
    #: each parameter is preconditioned on its own, one without a gradient is left out.
    joint_gradients: bool = False
    #: :meth:`preconditions` can be false on the ranks that hold the layer while it has a
    #: gradient (ikfac: a layer first called after the last refresh has no inverse until the
    #: next). A rank that does not hold the layer (MEM_OPT, HYBRID_OPT) receives the gradient
    #: handed on with no way to tell it from an update, so its health checks record nothing for
    #: the layer and take the holders' verdict, combined over the ranks at each check
    #: (kron_precond.health). ``False``: every rank judges them alike.
    hands_on_gradients: bool = False

    def preconditions(self) -> bool | torch.Tensor:
        """Whether this rank's state preconditions the layer's gradient now: ``True``, ``False``
        (before its first refresh: the gradient is handed on unchanged), or a one-element tensor
        on the device, non-zero where it does (a validity flag read without a host sync). A
        gradient handed on is no update of the method: the health checks do not take it as the
        reference its first update is measured against. A method whose holders may hand a
        gradient on this way sets :attr:`hands_on_gradients`."""
        return True

    # ------------------------------------------------------------------ statistics
    def observe_activations(self, rows: torch.Tensor) -> Any:
        """Activation rows ``[N, in]`` of one forward call (methods that capture), added at
        once. A value returned (not ``None``) is passed back as ``call`` with the output
        gradient of the same call, so per-row statistics can pair the two (a module may be
        called several times)."""
        return self.add_activation_terms(self.activation_terms(rows))

    def activation_terms(self, rows: torch.Tensor) -> Any:
        """What the activation rows ``[N, in]`` of one forward call add to the statistics,
        computed in the forward (so the rows need not be kept) and added by
        :meth:`add_activation_terms` when a backward reaches the call's output: only calls that
        fed a gradient count. Must not change the method's state."""
        raise NotImplementedError

    def add_activation_terms(self, terms: Any) -> Any:
        """Add what :meth:`activation_terms` computed for one call; returns what
        :meth:`observe_activations` returns for it."""
        raise NotImplementedError

    def observe_output_grads(self, rows: torch.Tensor, scale: float, call: Any = None) -> None:
        """Output-gradient rows ``[N, out]`` of one backward call, to be multiplied by ``scale``;
        ``call`` is what ``observe_activations`` returned for the same call."""
        raise NotImplementedError

    def observe_gradients(self, grads: Sequence[torch.Tensor | None], ctx: StepContext) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """The raw gradients of this step (``None`` where a parameter has none), on every rank."""

    def shared_statistics(self) -> list[torch.Tensor]:
        """Tensors summed across data-parallel ranks on statistics steps (same layout on
        every rank, whether or not it observed data)."""
        return []

    def fold_statistics(self, ctx: StepContext) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Fold this step's (reduced) statistics into the running state."""

    def discard_statistics(self) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Drop the statistics gathered since the last fold (an iteration whose step will not
        happen). Default: a method that gathers none between steps has nothing to drop."""

    def has_pending_statistics(self) -> bool:
        """Whether statistics gathered since the last fold wait for the next step (host read, no
        sync). Default: a method that gathers none between steps has none."""
        return False

    def release_statistics_state(self) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Drop the running statistics state (K-FAC: the factors) on a rank that does not own
        this layer, when the engine reduces statistics to owners only (sharded models).
        ``fold_statistics`` must then discard instead of folding. Default: nothing to drop."""

    def observed(self) -> torch.Tensor | None:
        """0-dim bool tensor: the layer has received statistics (``None``: not applicable)."""
        return None

    # ------------------------------------------------------------------ refresh
    @abc.abstractmethod
    def refresh(self, part: str, grads: Sequence[torch.Tensor | None], ctx: StepContext) -> None:
        """The expensive work of ``part``, on its owner rank only."""

    @abc.abstractmethod
    def refreshed_tensors(self, part: str | None = None) -> list[torch.Tensor]:
        """Tensors the owner of ``part`` (all parts if ``None``) computes in ``refresh`` and
        gradient workers need for ``apply``; broadcast in place, so their shapes are fixed."""

    def statistics_tensors(self, part: str) -> list[torch.Tensor]:
        """Refreshed tensors that every rank needs to gather statistics (e.g. EK-FAC's
        eigenbases, to project its rows); the owner broadcasts them to all ranks when the
        layer has fewer gradient workers than ranks. Fixed shapes; empty by default."""
        return []

    def finalize_refresh(self, ctx: StepContext) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Derive what ``apply`` needs from the refreshed tensors (every gradient worker)."""

    @abc.abstractmethod
    def release_refreshed(self) -> None:
        """Drop refreshed state (on ranks that are not gradient workers of this layer)."""

    # ------------------------------------------------------------------ apply
    @abc.abstractmethod
    def apply(self, grads: list[torch.Tensor], ctx: StepContext) -> list[torch.Tensor]:
        """Return the preconditioned versions of ``grads`` (one per registered parameter)."""

    def batch_key(self) -> Hashable | None:
        """Layers with equal keys (not ``None``) may be preconditioned together by
        :meth:`apply_batch`; the key must change whenever a batch could not be formed."""
        return None

    @classmethod
    def apply_batch(cls, layers: Sequence[Self], grads: Sequence[list[torch.Tensor]],
                    ctx: StepContext, cache: dict, keep: torch.Tensor) -> list[list[torch.Tensor]]:
        """Precondition several layers at once; where ``keep[i]`` is False (a non-finite
        gradient) return layer ``i``'s gradients unchanged. ``cache`` is kept by the engine
        until the next load: stacked state goes there, built once."""
        out = []
        for i, (layer, g) in enumerate(zip(layers, grads)):
            result = layer.apply(g, ctx)
            out.append([torch.where(keep[i], r, x) if r is not x else x for r, x in zip(result, g)])
        return out

    # ------------------------------------------------------------------ estimates, state
    @abc.abstractmethod
    def factor_costs(self) -> dict[str, tuple[float, float]]:
        """Per part: (estimated flops of its refresh, estimated bytes of its state)."""

    @abc.abstractmethod
    def memory_by_kind(self) -> dict[str, int]:
        """Bytes held on this rank, by kind of state."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        ...

    @abc.abstractmethod
    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``state`` cannot be loaded (checked before anything changes)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move all state to ``device``: the engine calls this when it finds the layer's
        parameters moved since the state was made (``model.to(...)`` after construction).
        ``dtype`` is the parameters' new dtype, for state that follows it. State on ``meta``
        never held data and is created afresh (:func:`moved`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot follow its parameters to {device}/{dtype}; "
                                  "build the preconditioner after moving the model")


class GradientMatrix:
    """A Linear / ConvNd-like unit's gradients as one ``[out, in(+1)]`` matrix, the bias (if
    any) as its last column: the form the Kronecker-factored layer methods work on. A weight
    stored ``[in, out]`` (GPT-2's ``Conv1D``) is transposed on the way in and out."""

    joint_gradients = True  # see LayerMethod: [W | b] needs every parameter's gradient

    def set_matrix_layout(self, weight_shape, has_bias: bool, weight_transposed: bool) -> None:
        self.weight_shape = torch.Size(weight_shape)
        self.weight_transposed = weight_transposed
        self.has_bias = has_bias
        out_in = tuple(reversed(self.weight_shape)) if weight_transposed else tuple(self.weight_shape)
        self.g_dim = out_in[0]
        self.a_dim = torch.Size(out_in[1:]).numel() + int(has_bias)

    def check_row_width(self, rows: torch.Tensor, side: str) -> None:
        """``ValueError`` naming the layer when its adapter hands rows of another width than the
        weight's ``side`` (``"input"``: without the bias column; ``"output"``): a factor built
        from them would hold a block of them and zeros (a user adapter's mistake, or a module
        that transforms its input before the weight reads it)."""
        expected = self.a_dim - int(self.has_bias) if side == "input" else self.g_dim
        if rows.shape[-1] != expected:
            raise ValueError(f"kron_precond: {getattr(self, 'name', '?')}: its adapter delivered {side} rows of width "
                             f"{rows.shape[-1]}, expected {expected} for its weight {tuple(self.weight_shape)}")

    @staticmethod
    def add_augmented(a_sum: torch.Tensor, product: torch.Tensor, col_sum: torch.Tensor | None, count: int) -> None:
        """Add one call's ``Σ ã ãᵀ`` to ``a_sum`` from ``Σ a aᵀ``, ``Σ a`` and its row count: the
        ones column of ``ã`` (a bias's, where ``col_sum`` is given) without materialising it."""
        d = product.shape[0]
        a_sum[:d, :d].add_(product)
        if col_sum is not None:
            a_sum[:d, d].add_(col_sum)
            a_sum[d, :d].add_(col_sum)
            a_sum[d, d].add_(count)

    def grads_to_matrix(self, grads: list[torch.Tensor]) -> torch.Tensor:
        weight = grads[0].t() if self.weight_transposed else grads[0].reshape(self.g_dim, -1)
        if self.has_bias:
            return torch.cat([weight, grads[1].reshape(self.g_dim, 1)], dim=1)
        return weight

    def matrix_to_grads(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        weight = matrix[:, :-1] if self.has_bias else matrix
        weight = weight.t().contiguous() if self.weight_transposed else weight.reshape(self.weight_shape)
        return [weight, matrix[:, -1].contiguous()] if self.has_bias else [weight]

    @staticmethod
    def stack_matrices(layers: Sequence["GradientMatrix"], grads: Sequence[list[torch.Tensor]]) -> torch.Tensor:
        """``[k, out, in(+1)]``: the gradient matrices ``[W | b]`` of k layers of one shape, built
        with a fixed number of ops (one stack per parameter kind), whatever k is."""
        first = layers[0]
        weight = torch.stack([g[0] for g in grads])
        weight = weight.transpose(1, 2) if first.weight_transposed else weight.reshape(len(layers), first.g_dim, -1)
        if not first.has_bias:
            return weight
        return torch.cat([weight, torch.stack([g[1] for g in grads]).unsqueeze(2)], dim=2)

    @staticmethod
    def unstack_matrices(layers: Sequence["GradientMatrix"], matrices: torch.Tensor) -> list[list[torch.Tensor]]:
        """The inverse of :meth:`stack_matrices`: per layer, its parameters' gradients (views)."""
        first = layers[0]
        weights = matrices[:, :, :-1] if first.has_bias else matrices
        if first.weight_transposed:
            weights = weights.transpose(1, 2)
        else:
            weights = weights.reshape(len(layers), *first.weight_shape)
        if not first.has_bias:
            return [[w] for w in weights.unbind(0)]
        return [[w, b] for w, b in zip(weights.unbind(0), matrices[:, :, -1].unbind(0))]


class MethodSpec(abc.ABC):
    """A preconditioning method as the engine sees it.

    Class attributes:
        name: the registry name users pass as ``method=``.
        options: method-specific constructor arguments (:class:`Option`).
        captures: needs activation and output-gradient rows from module hooks.
        captures_output_grads: with ``captures``, also the output-gradient rows; ``False``:
            none is read (the hook on a call's output only adds its activation terms).
        reduces_statistics: its ``shared_statistics`` are summed across data-parallel ranks.
        owner_only_statistics: only the owner's ``refresh`` reads the folded statistics.
        apply_reads_statistics: ``apply`` reads state folded from the statistics (EK-FAC's
            scaling), so on statistics steps the engine folds before applying -- at every
            world size, where with several ranks it would otherwise fold lazily, as late as
            the next refresh, to overlap the reduction with other work.
        default_kl_clip: ``kl_clip`` when the user gives none.
    """

    name: ClassVar[str]
    options: ClassVar[dict[str, Option]]
    captures: ClassVar[bool] = False
    captures_output_grads: ClassVar[bool] = True
    reduces_statistics: ClassVar[bool] = False
    #: its folded statistics are read by the layer's owner only (in ``refresh``), so a sharded
    #: model may reduce them to the owner alone and drop them elsewhere (docs/design.md)
    owner_only_statistics: ClassVar[bool] = False
    #: ``apply`` reads what ``fold_statistics`` folded on this very step
    apply_reads_statistics: ClassVar[bool] = False
    default_kl_clip: ClassVar[float | None] = None
    #: steps between reads of the skipped-update counters (``None``: on refresh steps)
    health_check_every: ClassVar[int | None] = None

    def __init__(self, settings: dict[str, Any]) -> None:
        #: every option, validated (fixed ones) or as given (callables of the step)
        self.settings = settings

    @abc.abstractmethod
    def select(self, model: nn.Module, is_skipped: Callable[[str, nn.Module], bool],
               log: Callable[[str], None]) -> list[Selected]:
        """The modules this method preconditions, in ``model.named_modules()`` order."""

    @abc.abstractmethod
    def make_layer(self, index: int, selected: Selected) -> LayerMethod:
        ...

    @abc.abstractmethod
    def make_schedule(self):
        """An object with ``collects(step)``, ``refreshes(step)`` (both pure),
        ``advance(step)``, ``hparams(step)`` (values added to the step's context),
        ``state_dict()`` and ``load_state_dict(state)``."""

    def describe(self) -> dict[str, Any]:
        """Settings shown by the preconditioner's ``repr``."""
        return dict(self.settings)


def tensor_bytes(tensors) -> int:
    """Total storage of the given tensors (``None`` entries ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@overload
def moved(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor: ...
@overload
def moved(tensor: None, device: torch.device, dtype: torch.dtype | None = None) -> None: ...
def moved(tensor: torch.Tensor | None, device: torch.device,
          dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``tensor`` on ``device`` (and ``dtype``); a ``meta`` tensor becomes zeros, which is
    what every piece of state starts as."""
    if tensor is None:
        return None
    if tensor.is_meta:
        return torch.zeros(tensor.shape, dtype=dtype or tensor.dtype, device=device)
    return tensor.to(device=device, dtype=dtype or tensor.dtype)


def graft_to_gradient_norm(updates: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rescale each layer's ``updates`` (all of its parameters together) to the norm of its
    ``grads``; tensors are stacked ``[B, ...]`` over B layers. No host sync."""
    accumulate = torch.promote_types(grads[0].dtype, torch.float32)
    count = grads[0].shape[0]

    def norms(tensors):  # [B]: per layer, over all of its parameters
        squares = [torch.linalg.vector_norm(t.reshape(count, -1), dim=1, dtype=accumulate) ** 2 for t in tensors]
        return torch.stack(squares).sum(0).sqrt()

    grad_norm, update_norm = norms(grads), norms(updates)
    scale = torch.where(update_norm > 0, grad_norm / update_norm.clamp_min(torch.finfo(accumulate).tiny),
                        torch.ones_like(grad_norm))
    return [u * scale.reshape((count,) + (1,) * (u.dim() - 1)).to(u.dtype) for u in updates]
