"""Fused mixture-of-experts modules: one K-FAC unit of work per expert and weight.

Libraries store the experts of an MoE layer stacked: a parameter ``[E, out, in]`` per
weight (``[E, in, out]`` when transposed), every token routed to its top-k experts inside
one module. For K-FAC each expert ``e`` of each weight is a unit of its own (a layer for
the engine, an item for the work assignment), with

    A_e = mean over the rows routed to e of ã ãᵀ      (the inputs expert e saw)
    G_e = mean over the same rows of δ δᵀ             (their output gradients)

where the output gradient carries the routing weight exactly as the model applies it (the
expert's output row is multiplied by it) and ``δ = grad · T · accumulation_steps`` with
``T`` the tokens of the module's call. ``T``, not the expert's own row count, is what the
per-token mean loss divides by: G_e then depends neither on the batch size nor on how many
tokens the router sent to e, and it is the same whether the tokens are split over ranks
or not (a row count that depends on routing would make a rank's G differ from the
single-process one whenever ranks route differently). The expert's block of the
token-averaged Fisher is ``p_e · G_e ⊗ A_e``, ``p_e`` the fraction of tokens routed to e:
like the gradient itself, an expert's step shrinks with the traffic it gets.

An expert is a small MLP, ``y = W_out · combine(W_1 x, ..., W_m x)`` (transformers:
``m = 1`` with a fused gate and up projection and ``combine`` its gated activation;
torchtitan: ``m = 2``, ``silu(w1 x) * (w3 x)``). The module's forward hook sees only the
expert inputs, the routing and the module's output, so on statistics steps the adapter
recomputes, for the routed rows, the first-stage outputs ``z`` (for the input of W_out) and,
in backward, ``∂L/∂h = g_out W_out`` and its pull-back through ``combine`` (the output
gradients of the first-stage weights): about one extra pass through the first stage
forward and one matmul backward, on statistics steps only. This works whichever
implementation the library runs (transformers' ``eager``, ``batched_mm``, ``grouped_mm``).
Splitting rows by expert needs the per-expert counts on the host: one sync per call on
statistics steps (transformers' own eager and grouped fallback paths sync too).

Built in: transformers' ``@use_experts_implementation`` modules (recognised by the
attributes that decorator sets; tested on transformers 5.23.0 with Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE and GPT-OSS) and :class:`RoutedExperts`, the library's own reference module. Other
modules: subclass :class:`RoutedExpertsAdapter` and :func:`~kron_precond.modules.register_adapter`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kron_precond.modules import Selected, UnsupportedModule, register_adapter


@dataclass(frozen=True)
class ExpertWeight:
    """One stacked weight of an experts module.

    Attributes:
        name: attribute of the parameter, ``[E, out, in]`` (``[E, in, out]`` if ``transposed``).
        bias: attribute of its ``[E, out]`` bias, or ``None``.
        transposed: the weight is stored ``[E, in, out]`` (``y = x @ W[e]``).
    """

    name: str
    bias: str | None = None
    transposed: bool = False


class Routing(NamedTuple):
    """Where one call of an experts module sent its tokens.

    Attributes:
        rows: ``[S, in]`` the experts' input rows, grouped by expert (expert 0's rows first).
        counts: rows per expert, ``E`` Python ints summing to ``S``.
        targets: ``[S]`` the row of the module's output that each routed row's expert output
            is added to.
        weights: ``[S]`` the factor multiplying each expert output row (the routing weight),
            or ``None`` when the module applies none.
        scale: what the output gradients are multiplied by (the tokens of the call, for a
            per-token mean loss).
    """

    rows: torch.Tensor
    counts: list[int]
    targets: torch.Tensor
    weights: torch.Tensor | None
    scale: float


class RoutedExpertsAdapter(abc.ABC):
    """The adapter of an experts module whose expert ``e`` computes
    ``W_out[e] · combine(W_1[e] x, ..., W_m[e] x)`` for each routed row ``x``.

    Subclasses give the layout (``inputs``: the first-stage weights, ``output``: the last
    one) and implement :meth:`routing` (from the module's call) and :meth:`combine`.
    Units: for each weight, in the order ``inputs`` then ``output``, one per expert, named
    ``<module>.<weight>.<e>``; slot ``w * E + e``.
    """

    def __init__(self, module: nn.Module, *, num_experts: int, inputs: Sequence[ExpertWeight],
                 output: ExpertWeight) -> None:
        self.module = module
        self.num_experts = int(num_experts)
        self.inputs = tuple(inputs)
        self.output = output
        self.weights = self.inputs + (output,)
        for weight in self.weights:
            for attr in (weight.name, weight.bias):
                if attr is None:
                    continue
                value = getattr(module, attr, None)
                if not isinstance(value, torch.Tensor) or value.shape[0] != self.num_experts:
                    raise UnsupportedModule(f"{type(module).__name__}.{attr} is not a stacked expert tensor "
                                            f"(leading dimension {self.num_experts})")

    # ------------------------------------------------------------------ to implement
    @abc.abstractmethod
    def routing(self, inputs: tuple, kwargs: dict, output: Any) -> Routing | None:
        """The routed rows of one call (``None``: nothing to observe)."""

    @abc.abstractmethod
    def combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The input of the output weight from the first-stage outputs (differentiable)."""

    # ------------------------------------------------------------------ the protocol
    def units(self, name: str, params: list[tuple[str, nn.Parameter]]) -> list[Selected]:
        own = dict(params)
        known = {a for w in self.weights for a in (w.name, w.bias) if a is not None}
        unknown = sorted(set(own) - known)
        if unknown:
            raise UnsupportedModule(f"parameters {unknown} are not part of the expert layout")
        units = []
        for w_index, weight in enumerate(self.weights):
            unit_params = [(weight.name, own[weight.name])]
            if weight.bias is not None:
                unit_params.append((weight.bias, own[weight.bias]))
            for e in range(self.num_experts):
                units.append(Selected(f"{name}.{weight.name}.{e}" if name else f"{weight.name}.{e}", self.module,
                                      unit_params, self, index=e, slot=w_index * self.num_experts + e,
                                      has_bias=weight.bias is not None, weight_transposed=weight.transposed))
        return units

    def forward_rows(self, inputs: tuple, kwargs: dict, output: Any):
        routing = self.routing(inputs, kwargs, output)
        if routing is None:
            return None
        experts, m = self.num_experts, len(self.inputs)
        for weight in self.inputs:  # a layout read with the wrong side as the input: said, by name
            stored = self._param(weight.name).shape
            width = stored[-2] if weight.transposed else stored[-1]
            if routing.rows.shape[-1] != width:
                raise ValueError(
                    f"kron_precond: {type(self.module).__name__}.{weight.name} {tuple(stored)} is given routed rows "
                    f"of width {routing.rows.shape[-1]} but, read as [E, out, in]"
                    f"{' (transposed=True: [E, in, out])' if weight.transposed else ''}, takes inputs of width "
                    f"{width}; check the adapter's ExpertWeight(..., transposed=...) for this layout")
        rows: list[tuple[int, torch.Tensor]] = []
        first: list[list[torch.Tensor] | None] = []
        for e, x in enumerate(routing.rows.split(routing.counts)):
            if x.shape[0] == 0:  # no row: the expert's statistics are left alone
                first.append(None)
                continue
            z = [self._linear(weight, e, x) for weight in self.inputs]
            rows.extend((j * experts + e, x) for j in range(m))
            rows.append((m * experts + e, self.combine(z)))
            first.append(z)
        return rows, (routing, first)

    def backward_rows(self, grad: torch.Tensor, context) -> list[tuple[int, torch.Tensor, float]]:
        routing, first = context
        grad = grad.reshape(-1, grad.shape[-1])[routing.targets]
        if routing.weights is not None:
            grad = grad * routing.weights.to(grad.dtype).unsqueeze(1)
        experts, m = self.num_experts, len(self.inputs)
        rows = []
        for e, g in enumerate(grad.split(routing.counts)):
            if first[e] is None:
                continue
            rows.append((m * experts + e, g, routing.scale))
            w_out = self._param(self.output.name)[e]
            # ∂L/∂h = g W_out (W_out as an [out, in] matrix)
            d_hidden = g @ (w_out.t() if self.output.transposed else w_out).to(g.dtype)
            with torch.enable_grad():
                z = [t.detach().requires_grad_() for t in first[e]]
                d_z = torch.autograd.grad(self.combine(z), z, d_hidden, allow_unused=True)
            for j, (d, t) in enumerate(zip(d_z, z)):
                rows.append((j * experts + e, torch.zeros_like(t) if d is None else d, routing.scale))
        return rows

    # ------------------------------------------------------------------ helpers
    def _param(self, name: str) -> torch.Tensor:
        return getattr(self.module, name)

    def _linear(self, weight: ExpertWeight, e: int, x: torch.Tensor) -> torch.Tensor:
        w = self._param(weight.name)[e]
        b = None if weight.bias is None else self._param(weight.bias)[e]
        w = w.t() if weight.transposed else w
        return F.linear(x.to(w.dtype), w, b)


def top_k_routing(module_name: str, num_experts: int, hidden: Any, index: Any, weights: Any) -> Routing:
    """:class:`Routing` from the usual call ``experts(hidden [T, d], index [T, k], weights [T, k])``:
    token ``t``'s ``j``-th choice goes to expert ``index[t, j]`` and its output is multiplied by
    ``weights[t, j]``. Indices outside ``[0, E)`` (expert-parallel sentinels) are dropped, and so
    are pairs of routing weight 0, whose rows feed no gradient (LongCat-Flash routes a token's
    zero-computation experts to real ones with weight 0, to spread the load)."""
    if not (isinstance(hidden, torch.Tensor) and hidden.dim() == 2 and isinstance(index, torch.Tensor)
            and index.dim() == 2 and index.shape[0] == hidden.shape[0] and not index.is_floating_point()
            and isinstance(weights, torch.Tensor) and weights.shape == index.shape):
        raise RuntimeError(f"kron_precond: {module_name} was called with arguments its experts adapter does not "
                           "understand; expected (hidden [T, d], expert indices [T, k], routing weights [T, k]), "
                           f"got {_describe(hidden)}, {_describe(index)}, {_describe(weights)}")
    tokens, k = index.shape
    experts = index.reshape(-1)
    valid = (experts >= 0) & (experts < num_experts) & (weights.detach().reshape(-1) != 0)
    # invalid pairs sort last and are cut off; the stable sort keeps token order per expert
    order = torch.argsort(torch.where(valid, experts, num_experts), stable=True)
    counts = torch.bincount(experts[valid], minlength=num_experts).tolist()  # the one host sync
    order = order[:sum(counts)]
    targets = order // k
    return Routing(rows=hidden.detach()[targets], counts=counts, targets=targets,
                   weights=weights.detach().reshape(-1)[order], scale=float(tokens))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    return type(value).__name__


def _routing_arguments(inputs: tuple, kwargs: dict) -> list:
    """``(hidden, index, weights)`` of a call: the first three arguments, positional first,
    then keywords in order; index and weights told apart by dtype when given by keyword
    in the other order."""
    hidden, index, weights = ((list(inputs) + list(kwargs.values()))[:3] + [None] * 3)[:3]
    if (isinstance(index, torch.Tensor) and index.is_floating_point() and isinstance(weights, torch.Tensor)
            and not weights.is_floating_point() and len(inputs) < 3):
        index, weights = weights, index
    return [hidden, index, weights]


class TransformersExpertsAdapter(RoutedExpertsAdapter):
    """transformers' fused experts (``@use_experts_implementation``: Mixtral, Qwen2-MoE, ...).

    Relied on (transformers 5.x, tested 5.23.0): the attributes the decorator sets
    (``has_gate``, ``has_bias``, ``is_transposed``, ``has_post_expert_norm``) and
    ``num_experts``; the weights ``gate_up_proj`` (or ``up_proj`` without gate) and
    ``down_proj`` with biases ``<name>_bias``; ``_apply_gate`` (or ``act_fn``) between them;
    the call ``experts(hidden [T, d], top_k_index [T, k], top_k_weights [T, k])`` with the
    routing weight multiplying each expert's output row -- the contract every registered
    experts implementation (eager, batched_mm, grouped_mm) follows.
    """

    def __init__(self, module: nn.Module) -> None:
        if getattr(module, "has_post_expert_norm", False):
            raise UnsupportedModule("a norm between down_proj and the routing weight (has_post_expert_norm) "
                                    "is not supported")
        gated = bool(module.has_gate)
        bias = bool(module.has_bias)
        transposed = bool(module.is_transposed)
        first = "gate_up_proj" if gated else "up_proj"
        super().__init__(module, num_experts=int(module.num_experts),  # type: ignore[arg-type]
                         inputs=[ExpertWeight(first, f"{first}_bias" if bias else None, transposed)],
                         output=ExpertWeight("down_proj", "down_proj_bias" if bias else None, transposed))
        self._gated = gated

    def routing(self, inputs: tuple, kwargs: dict, output: Any) -> Routing:
        hidden, index, weights = _routing_arguments(inputs, kwargs)
        return top_k_routing(type(self.module).__name__, self.num_experts, hidden, index, weights)

    def combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        module: Any = self.module  # transformers' experts module: its own methods
        if self._gated:
            return module._apply_gate(outputs[0])
        return module.act_fn(outputs[0])


def is_transformers_experts(module: nn.Module) -> bool:
    """A transformers ``@use_experts_implementation`` module (duck-typed: transformers is
    never imported here)."""
    down = getattr(module, "down_proj", None)
    return (all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "num_experts"))
            and isinstance(down, nn.Parameter) and down.dim() == 3)


class RoutedExperts(nn.Module):
    """A reference experts module: ``E`` two-layer MLP experts with explicit top-k routing.

    ``forward(x [T, d], index [T, k], weights [T, k])`` returns
    ``y_t = Σ_j weights[t, j] · down_e(act(up_e(x_t)))`` with ``e = index[t, j]``, computed
    by a loop of ``F.linear`` over the experts (a plain, readable implementation, not a
    fast one). Weights are stacked: ``up_weight [E, hidden, d]``, ``down_weight [E, d, hidden]``
    (and ``[E, out]`` biases). The methods that capture statistics (K-FAC, EK-FAC, input-side
    K-FAC) and those that read gradients per layer (SOAP, the second moment) take every expert
    of both weights as a layer of its own.

    Args:
        num_experts: ``E``.
        dim: ``d``, the width of the input and output.
        hidden: the width of each expert's hidden layer.
        bias: whether the experts' layers have biases.
        activation: the function between the two layers.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, *, bias: bool = True,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu, device=None, dtype=None) -> None:
        super().__init__()
        for name, value in (("num_experts", num_experts), ("dim", dim), ("hidden", hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not callable(activation):
            raise TypeError(f"activation must be callable, got {activation!r}")
        kw = dict(device=device, dtype=dtype)
        self.num_experts, self.dim, self.hidden, self.activation = num_experts, dim, hidden, activation
        self.up_weight = nn.Parameter(torch.empty(num_experts, hidden, dim, **kw))
        self.down_weight = nn.Parameter(torch.empty(num_experts, dim, hidden, **kw))
        self.up_bias = nn.Parameter(torch.empty(num_experts, hidden, **kw)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, dim, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert initialised like an ``nn.Linear`` of its shape."""
        for weight, bias in ((self.up_weight, self.up_bias), (self.down_weight, self.down_bias)):
            bound = 1.0 / weight.shape[2] ** 0.5
            nn.init.uniform_(weight, -bound, bound)
            if bias is not None:
                nn.init.uniform_(bias, -bound, bound)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], self.dim, dtype=x.dtype, device=x.device)
        for e in range(self.num_experts):
            token, choice = torch.where(index == e)
            up_b = None if self.up_bias is None else self.up_bias[e]
            down_b = None if self.down_bias is None else self.down_bias[e]
            h = self.activation(F.linear(x[token], self.up_weight[e], up_b))
            y = F.linear(h, self.down_weight[e], down_b) * weights[token, choice].unsqueeze(1)
            out = out.index_add(0, token, y.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}, "
                f"bias={self.up_bias is not None}")


class RoutedExpertsModuleAdapter(RoutedExpertsAdapter):
    """The adapter of :class:`RoutedExperts`."""

    def __init__(self, module: RoutedExperts) -> None:
        bias = module.up_bias is not None
        super().__init__(module, num_experts=module.num_experts,
                         inputs=[ExpertWeight("up_weight", "up_bias" if bias else None)],
                         output=ExpertWeight("down_weight", "down_bias" if bias else None))

    def routing(self, inputs: tuple, kwargs: dict, output: Any) -> Routing:
        x, index, weights = _routing_arguments(inputs, kwargs)
        return top_k_routing(type(self.module).__name__, self.num_experts, x, index, weights)

    def combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        module: Any = self.module  # a RoutedExperts
        return module.activation(outputs[0])


register_adapter(RoutedExperts, RoutedExpertsModuleAdapter, builtin=True)
register_adapter(is_transformers_experts, TransformersExpertsAdapter, builtin=True)
