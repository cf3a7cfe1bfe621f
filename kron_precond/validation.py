"""Argument checks shared by the public constructors.

Each check raises ``ValueError`` (or ``TypeError`` for a value of the wrong kind) naming the
argument and the value, and returns the value normalised to a plain Python number, so that
numpy scalars and 0-dim tensors are accepted wherever a number is.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Collection, Mapping, Sequence

import torch


def as_number(name: str, value: Any) -> float | int:
    """``value`` as a Python int or float; bools, strings and tensors of >1 element are refused."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ValueError(f"{name} must be a real number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    elif not isinstance(value, numbers.Real) and hasattr(value, "item"):  # numpy scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """An integer ``>= minimum`` (integral floats such as ``2.0`` are refused: say what you mean)."""
    try:
        number = as_number(name, value)
    except ValueError:
        number = None
    if not isinstance(number, int) or number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def check_finite(name: str, value: Any) -> float:
    number = as_number(name, value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(number)


def check_positive(name: str, value: Any) -> float:
    number = check_finite(name, value)
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number


def check_non_negative(name: str, value: Any) -> float:
    number = check_finite(name, value)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return number


def check_unit_interval(name: str, value: Any, *, low_open: bool, high_open: bool) -> float:
    number = check_finite(name, value)
    low_ok = number > 0 if low_open else number >= 0
    high_ok = number < 1 if high_open else number <= 1
    if not (low_ok and high_ok):
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return number


def check_float_dtype(name: str, value: Any, *, allow_none: bool = False) -> torch.dtype | None:
    if value is None and allow_none:
        return None
    if not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"{name} must be a floating torch.dtype{' or None' if allow_none else ''}, "
                         f"got {value!r}")
    return value


def check_statistics_dtype(name: str, value: Any) -> torch.dtype | None:
    """``None`` or a floating dtype other than float16 for a method's statistics (``factor_dtype``):
    float16's range (6.1e-5 to 65 504) loses a mean of squares at ordinary scales -- inputs of
    size 300 overflow it (non-finite statistics are skipped: the layer is never preconditioned),
    of size 1e-4 round it to 0, with no warning. bfloat16 costs the same with float32's range."""
    value = check_float_dtype(name, value, allow_none=True)
    if value == torch.float16:
        raise ValueError(f"{name} must be None, torch.float32, torch.float64 or torch.bfloat16 (float16's range, "
                         f"6.1e-5 to 65504, loses the statistics: inputs of size 300 overflow them, of size 1e-4 "
                         f"round them to 0), got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


GroupRule = tuple[str, str, Callable[[Any], bool]]  # (setting, what it must be, the test)


def _plain(value: Any) -> Any:
    """A numpy scalar or 0-dim array as its Python number, a 1-dim array as a list (betas);
    anything else as it is."""
    if isinstance(value, torch.Tensor) or not hasattr(value, "ndim") or not hasattr(value, "tolist"):
        return value
    if value.ndim > 1:
        return value
    plain = value.tolist()
    if value.ndim == 1:
        return [_plain(v) for v in plain]
    # a real long double (wider than a Python float) stays a numpy scalar through tolist():
    # rounded to the float the step computes in anyway (a complex one stays refused)
    real_float = getattr(getattr(plain, "dtype", None), "kind", None) == "f"
    return float(plain) if real_float and not isinstance(plain, float) else plain


def check_group_numbers(owner: str, index: int, group: Mapping[str, Any], rules: Sequence[GroupRule],
                        optional: Collection[str] = ()) -> None:
    """``ValueError`` for a value a scheduler or a user set on a param group that the step
    cannot use, before anything moves: a number out of range, or something that is not a
    number (a string, a bool, ``None`` or a callable where the step reads a number, one number
    where it reads a pair). Python and numpy numbers (or pairs of them) are checked; a tensor
    setting is not read, so the check adds no host synchronisation. ``optional``: the keys
    that may be ``None`` (unset)."""
    for key, rule, ok in rules:
        if key not in group or (group[key] is None and key in optional):
            continue
        value = _plain(group[key])
        if isinstance(value, torch.Tensor):
            continue
        pair = isinstance(value, (tuple, list))
        values = [_plain(v) for v in value] if pair else [value]
        if any(isinstance(v, torch.Tensor) for v in values):
            continue
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{owner}: param group {index} has {key}={group[key]!r}, not a number; "
                             f"{key} must be {rule}")
        try:
            usable = all(math.isfinite(v) for v in values) and bool(ok(values if pair else values[0]))
        except TypeError:  # a single number where the rule reads a pair
            usable = False
        if not usable:
            raise ValueError(f"{owner}: param group {index} has {key}={group[key]!r}; {key} must be {rule}")
