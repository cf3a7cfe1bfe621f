"""``nn.MultiheadAttention`` for :class:`~kron_precond.WhitenedMuon`: projections applied functionally.

``nn.MultiheadAttention`` computes its query, key and value inside
``F.multi_head_attention_forward`` from its own weights: no ``nn.Linear`` forward runs, so
the module adapters of :mod:`kron_precond.modules` see none of its projections. Its forward's
arguments are the projections' inputs, though, and that is all an input-side whitening needs:

* ``in_proj_weight`` ``[3E, E]`` (key and value as wide as the query): its three row blocks
  project the query, the key and the value, and are stepped as three parts (a fused
  query/key/value projection). Called as self-attention (``query is key is value``, as
  ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer.self_attn`` call it) the
  blocks read one input: one input whitener, from the query's rows. Called with another key
  or value (cross-attention), each block is whitened by its own input: the query's, the key's
  and the value's rows, a factor per part. A module is taken for self-attention until a call
  shows otherwise; the cross-attention of ``nn.TransformerDecoderLayer`` (``multihead_attn``)
  is known at construction. Orthogonalised whole (``fused_qkv=False``), the three blocks have
  no whitening that serves them in cross-attention: the weight then takes Muon's step
  unwhitened, and a warning names the module.
* ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` (``kdim`` or ``vdim`` set): three
  weights of their own, each whitened by its own argument, so cross-attention too.
* ``out_proj.weight``: its input is the attention's output inside the functional call, which
  no hook sees; it is stepped by Muon unwhitened, as ``torch.optim.Muon`` steps it.

Output gradients of the projections are not observable either (the module's output is
``out_proj``'s; the adapters say so with ``delivers_output_grads = False``), so with
``output_side=True`` these weights keep the identity there, and ``output_side="wide"`` gives
them no output side.
"""
from __future__ import annotations

from typing import Callable, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn

from kron_precond.modules import Selected, overridden_forward, owners_of, tied_elsewhere, usable_parameters

SEPARATE_PROJECTIONS = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


def _arguments(inputs: tuple, kwargs: dict) -> list:
    """``[query, key, value]`` of one ``nn.MultiheadAttention`` call, positional or keyword."""
    names = ("query", "key", "value")
    given = list(inputs[:3])
    return given + [kwargs.get(name) for name in names[len(given):]]


def _same_input(a: object, query: torch.Tensor) -> bool:
    """``a``, another tensor than the query, holds the query: a view of the same elements, or
    equal values (a forward pre-hook that rebuilds the arguments one by one, such as FSDP2's
    mixed-precision cast, hands over three equal tensors). The values are compared, a host read,
    only when the cheaper tests fail, and only on statistics steps (the hook's)."""
    if not isinstance(a, torch.Tensor) or a.shape != query.shape or a.dtype != query.dtype \
            or a.device != query.device:
        return False
    if a.data_ptr() == query.data_ptr() and a.stride() == query.stride():
        return True
    return torch.equal(a, query)


class PackedInputAdapter:
    """The rows of a packed ``in_proj_weight``: a self-attention call's query (slot 0), or, once
    ``separate`` (cross-attention), the query's, the key's and the value's rows (slots 0, 1, 2:
    the parts they project).

    A call with another key or value while not ``separate`` sets ``cross_seen`` and calls
    ``on_cross_attention(weight, name)``, which the optimizer sets; it returns whether the parts
    are now whitened by their own inputs (``separate`` is then set by the optimizer) or the
    call delivers no rows (the weight takes Muon's step unwhitened, or the optimizer refuses the
    call at its next step).

    The call is read on this rank alone: another rank's batch may read otherwise (padding on one
    rank only), or not call the module at all, so no collective can run here. An optimizer whose
    ranks must agree reconciles ``cross_seen`` with :func:`any_rank` at a step every rank
    reaches (``WhitenedMuon``: its next statistics step; ``ikfac``: its next refresh)."""

    def __init__(self, module: nn.MultiheadAttention, name: str, separate: bool = False) -> None:
        self.module, self.name, self.separate = module, name, separate
        # the parameter as the optimizer holds it: during a forward FSDP2 may have put a gathered
        # copy in the module's attribute
        self.weight = module.in_proj_weight
        self.on_cross_attention: Callable[[torch.Tensor, str], bool] | None = None
        self.cross_seen = separate  # a call read as cross-attention (on this rank)

    def forward_rows(self, inputs: tuple, kwargs: dict, output: object):
        query, key, value = _arguments(inputs, kwargs)
        if not isinstance(query, torch.Tensor):
            return None
        if not self.separate and not self._self_attention(query, key, value):
            self.cross_seen = True
            if self.on_cross_attention is None:  # set by the optimizer that placed the hook
                raise RuntimeError(f"nn.MultiheadAttention {self.name!r} was called as cross-attention, and "
                                   "PackedInputAdapter.on_cross_attention is not set")
            if not self.on_cross_attention(self.weight, self.name):
                return None
        if not self.separate:
            return [(0, query.detach().reshape(-1, query.shape[-1]))], 1
        rows = [(slot, x.detach().reshape(-1, x.shape[-1])) for slot, x in enumerate((query, key, value))
                if isinstance(x, torch.Tensor)]
        return rows, 1

    @staticmethod
    def _self_attention(query: torch.Tensor, key: object, value: object) -> bool:
        """Key and value are the query: the same objects, or other tensors of equal values."""
        if key is query and value is query:
            return True
        return _same_input(key, query) and _same_input(value, query)

    delivers_output_grads = False  # the module's output is out_proj's, not the projections'

    def backward_rows(self, grad: torch.Tensor, context: object) -> list:
        return []


class SeparateInputsAdapter:
    """The rows of ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight`` (slots 0, 1, 2):
    the query, the key and the value of each call."""

    def __init__(self, module: nn.MultiheadAttention) -> None:
        self.module = module

    def forward_rows(self, inputs: tuple, kwargs: dict, output: object):
        rows = [(slot, x.detach().reshape(-1, x.shape[-1])) for slot, x in enumerate(_arguments(inputs, kwargs))
                if isinstance(x, torch.Tensor)]
        return (rows, 1) if rows else None

    delivers_output_grads = False  # as PackedInputAdapter's

    def backward_rows(self, grad: torch.Tensor, context: object) -> list:
        return []


def _trainable(param: torch.Tensor | None, owners: dict[int, list[str]], name: str, label: str,
               log: Callable[[str], None]) -> bool:
    """``param`` exists, trains and belongs to this module alone (a tied weight: logged)."""
    if param is None or not param.requires_grad:
        return False
    shared = tied_elsewhere(owners, name, [param])
    if shared:
        log(f"skipping {label}: a parameter is shared with {', '.join(shared)} (tied weights)")
        return False
    return True


def replaced_forward(module: nn.MultiheadAttention) -> str | None:
    """Why ``module``'s forward may not be ``nn.MultiheadAttention``'s own (replaced on the
    instance, overridden in a subclass or patched onto the class), or ``None``: the query, key
    and value it is called with may then not be what the projections multiply."""
    return overridden_forward(module, nn.MultiheadAttention, ("forward",))


def attention_units(name: str, module: nn.MultiheadAttention, *, cross_attention: bool,
                    is_skipped: Callable[[str, nn.Module], bool], owners: dict[int, list[str]],
                    log: Callable[[str], None]) -> tuple[list[Selected], list[Selected]]:
    """(the units whitened from ``module``'s arguments, the units stepped unwhitened) of one
    ``nn.MultiheadAttention`` named ``name``; ``cross_attention``: the module is known to be
    called with another key and value (its packed ``in_proj_weight``'s adapter then starts
    ``separate``).
    ``owners``: the names of the modules holding each parameter (``id``), for tied weights."""
    label = name or "<root>"
    bias = module.in_proj_bias
    biased = [("in_proj_bias", bias)] if bias is not None else []
    observed: list[Selected] = []
    plain: list[Selected] = []
    if module._qkv_same_embed_dim:
        weight = module.in_proj_weight
        if _trainable(weight, owners, name, label, log):
            observed.append(Selected(name, module, [("in_proj_weight", weight), *biased],
                                     PackedInputAdapter(module, label, separate=cross_attention),
                                     has_bias=bool(biased)))
    else:
        adapter = SeparateInputsAdapter(module)
        for slot, attribute in enumerate(SEPARATE_PROJECTIONS):
            weight = getattr(module, attribute)
            if _trainable(weight, owners, name, label, log):
                observed.append(Selected(name, module, [(attribute, weight), *biased], adapter, slot=slot,
                                         has_bias=bool(biased)))
    out = module.out_proj
    out_name = f"{name}.out_proj" if name else "out_proj"
    if is_skipped(out_name, out):
        log(f"skipping {out_name} ({type(out).__name__}): matches skip_layers")
    elif _trainable(out.weight, owners, out_name, out_name, log):
        own = [(n, cast(nn.Parameter, p)) for n, p in (("weight", out.weight), ("bias", out.bias)) if p is not None]
        plain.append(Selected(out_name, out, own, None, has_bias=out.bias is not None))
    return observed, plain


def _known_cross_attention(model: nn.Module) -> set[int]:
    """``id`` of the attention modules known at construction to be called as cross-attention:
    the ``multihead_attn`` of every ``nn.TransformerDecoderLayer``."""
    return {id(m.multihead_attn) for m in model.modules() if isinstance(m, nn.TransformerDecoderLayer)}


def model_attention_units(model: nn.Module, is_skipped: Callable[[str, nn.Module], bool], owners: dict[int, list[str]],
                          log: Callable[[str], None]) -> tuple[list[Selected], list[Selected]]:
    """:func:`attention_units` of every ``nn.MultiheadAttention`` of ``model`` that ``skip_layers``
    does not exclude, in ``model.named_modules()`` order; the ``multihead_attn`` of an
    ``nn.TransformerDecoderLayer`` is known to be cross-attention."""
    cross = _known_cross_attention(model)
    observed: list[Selected] = []
    plain: list[Selected] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.MultiheadAttention):
            continue
        if is_skipped(name, module):
            log(f"skipping {name or '<root>'} ({type(module).__name__}): matches skip_layers")
            continue
        reason = replaced_forward(module)
        if reason:  # its arguments may not be what the projections multiply
            log(f"skipping {name or '<root>'}: {reason}")
            continue
        found, unwhitened = attention_units(name, module, cross_attention=id(module) in cross,
                                            is_skipped=is_skipped, owners=owners, log=log)
        observed.extend(found)
        plain.extend(unwhitened)
    return observed, plain


def input_side_attention_units(model: nn.Module, is_skipped: Callable[[str, nn.Module], bool],
                               log: Callable[[str], None]) -> list[Selected]:
    """The packed ``in_proj`` (and its bias) of every ``nn.MultiheadAttention`` of ``model`` that
    ``skip_layers`` does not exclude, as one Linear-like unit ``[3E, E]`` whose rows are the
    query's: what a method reading only the inputs (``ikfac``) needs of a self-attention.

    Left to the optimizer, each logged: a known cross-attention (the ``multihead_attn`` of an
    ``nn.TransformerDecoderLayer``: its parts read inputs of their own, and the method keeps one
    factor per unit), separate projections (``kdim`` / ``vdim``: three weights and one bias), a
    frozen or tied ``in_proj``. A module taken here that is later called with another key or
    value is refused with ``RuntimeError``, naming it: its factor would read the wrong rows (in
    one process at the first such call the hook reads, on a statistics step; across ranks at the
    next refresh step, on every rank, by the optimizer, which sets ``on_cross_attention`` then).
    The ``out_proj``, whose input no hook sees, is the module search's (which logs it)."""
    owners = owners_of(model)
    cross = _known_cross_attention(model)
    units = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.MultiheadAttention):
            continue
        label = name or "<root>"
        if is_skipped(name, module):
            log(f"skipping {label} ({type(module).__name__}): matches skip_layers")
            continue
        reason = replaced_forward(module)
        if reason:
            log(f"skipping {label}: {reason}")
            continue
        if id(module) in cross:
            log(f"skipping {label}: cross-attention (its query, key and value read inputs of their own, "
                f"and the method keeps one input factor per layer)")
            continue
        if not module._qkv_same_embed_dim:
            log(f"skipping {label}: separate query, key and value projections (kdim / vdim) share one bias")
            continue
        own = [(n, p) for n, p in (("in_proj_weight", module.in_proj_weight), ("in_proj_bias", module.in_proj_bias))
               if p is not None]
        if not usable_parameters(owners, name, label, own, log):
            continue
        adapter = PackedInputAdapter(module, label)
        adapter.on_cross_attention = refuse_cross_attention
        units.append(Selected(name, module, cast(list, own), adapter, has_bias=module.in_proj_bias is not None))
    return units


def several_ranks(group) -> bool:
    """Whether ``group`` (``None``: the default group) spans more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def any_rank(flags: Sequence[bool], device: torch.device, group) -> list[bool]:
    """Per flag, whether any rank of ``group`` set it: one small all-reduce and a host read.
    For decisions every rank must take alike (whether an attention is cross-attention), made
    in an optimizer's step on a schedule every rank shares; a collective in a forward hook
    would go out of step with the ranks that do not call the module or read it otherwise."""
    if not flags or not several_ranks(group):
        return list(flags)
    seen = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in seen.tolist()]


def refuse_cross_attention(weight: torch.Tensor, name: str) -> bool:
    """``RuntimeError`` naming the packed attention ``name``, which a method reading the
    query's rows alone cannot precondition as cross-attention."""
    raise RuntimeError(f"nn.MultiheadAttention {name!r} was called as cross-attention (a key or value other "
                       f"than its query): its preconditioner reads the query's rows alone, which would be the "
                       f"wrong input for the key's and value's parts. Leave it to the optimizer with "
                       f"skip_layers=[{name!r}]")
