"""Validation of saved per-layer state, run before anything is loaded.

``load_state_dict`` must be all-or-nothing: everything it will copy is checked here
first (presence, type, shape, dtype kind, finiteness, sign), so a bad checkpoint raises a
``ValueError`` naming the layer and the entry, and changes nothing.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from kron_precond import validation


def entry(state: Any, key: str, where: str) -> Any:
    """``state[key]``, or ``ValueError`` if ``state`` is not a mapping holding it."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: expected a dict, got {type(state).__name__}")
    if key not in state:
        raise ValueError(f"{where}: missing entry {key!r}")
    return state[key]


def float_tensor(value: Any, shape: Sequence[int], where: str, *, finite: bool = True,
                 non_negative: bool = False) -> torch.Tensor:
    """Check ``value`` is a floating tensor of ``shape`` (and finite): factors and
    decompositions are never integers, and a NaN would poison every later update.
    ``non_negative``: also refuse a value below 0 (:func:`no_negatives`)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}: expected a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{where}: expected a floating tensor, got dtype {value.dtype}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where}: expected shape {tuple(shape)}, got {tuple(value.shape)}")
    if finite and not bool(torch.isfinite(value).all()):
        raise ValueError(f"{where}: holds NaN or infinite values")
    if non_negative:
        no_negatives(value, where)
    return value


def no_negatives(value: torch.Tensor, where: str) -> None:
    """Refuse a tensor holding a value below 0 (NaN aside: :func:`float_tensor` refuses it): a
    second moment, an eigenvalue of a covariance, a mean of squares are never negative, and the
    square root or the division a step takes of one would be NaN or huge."""
    if value.numel() and bool((value < 0).any()):
        raise ValueError(f"{where}: holds negative values (the least is {value.min().item()!r}); "
                         "it must be >= 0")


def tensor_list(values: Any, shapes: Sequence[Sequence[int]], where: str) -> None:
    if not isinstance(values, (list, tuple)) or len(values) != len(shapes):
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"{where}: expected {len(shapes)} tensors of shapes "
                         f"{[tuple(s) for s in shapes]}, got {got}")
    for i, (value, shape) in enumerate(zip(values, shapes)):
        float_tensor(value, shape, f"{where}[{i}]")


def boolean(value: Any, where: str) -> None:
    if not isinstance(value, bool) and not (isinstance(value, torch.Tensor) and value.numel() == 1):
        raise ValueError(f"{where}: expected a bool, got {value!r}")


def integer(value: Any, where: str, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: expected an integer >= {minimum}, got {value!r}")


def flags(value: Any, shape: Sequence[int], where: str) -> None:
    """Flags kept as a tensor of ``shape`` (bool, or numbers 0 and 1): copied in place into the
    layer's own, so another shape would fail halfway through a load, and a NaN or a -3 would
    read as True."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(f"{where}: expected a tensor of flags of shape {tuple(shape)}, got {got}")
    if value.is_complex() or not bool(((value == 0) | (value == 1)).all()):
        raise ValueError(f"{where}: expected flags (0 or 1), got {value!r}")


def count(value: Any, where: str, shape: Sequence[int] | None = None) -> None:
    """A step counter kept as a 1-element tensor: a whole number >= 0 (a bias correction reads
    it, so a NaN or a negative count would reach the weights). ``shape``: the exact shape it is
    copied into, where a load copies it in place or stacks it with others."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(f"{where} must be a 1-element tensor, got {value!r}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where} must be a tensor of shape {tuple(shape)}, got shape {tuple(value.shape)}")
    number = float(value.reshape(()))
    if not (math.isfinite(number) and number >= 0 and number == int(number)):
        raise ValueError(f"{where} must count steps (a whole number >= 0), got {number!r}")


def number(value: Any, where: str, *, minimum: float) -> float:
    """A finite number >= ``minimum`` (a 0-dim tensor or numpy scalar is read), as a float."""
    try:
        result = validation.check_finite(where, value)
    except ValueError:
        result = math.nan
    if not result >= minimum:  # also NaN: not a finite number
        raise ValueError(f"{where} must be a finite number >= {minimum}, got {value!r}")
    return result
