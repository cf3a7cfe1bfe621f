"""Reading numeric arguments the way every public constructor does.

A number may be a Python ``int``/``float``, a NumPy scalar or a 0-dim (1-element) real
tensor; it is returned as a plain Python number so that nothing downstream depends on
the type it came in (and no tensor is kept alive). ``bool`` is never a number here
(``True`` silently meaning 1 hides mistakes), and a float is never truncated to an
integer. Errors are ``ValueError`` naming the argument and the value.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch


def real(name: str, value: Any) -> float:
    """``value`` as a finite Python float, or ``ValueError``."""
    if isinstance(value, bool):
        raise ValueError(f"Invalid {name}: {value!r}; expected a number, not a bool")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"Invalid {name}: {value!r}; expected a number or a 0-dim real tensor")
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"Invalid {name}: {value!r}; expected a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"Invalid {name}: {value!r}; expected a finite number")
    return number


def integer(name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as a Python int (``int``, NumPy integer or integer tensor; never a float
    or a bool), at least ``minimum``, or ``ValueError``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"Invalid {name}: {value!r}; expected an integer")
    number = int(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"Invalid {name}: {value!r}; expected an integer >= {minimum}")
    return number


def positive(name: str, value: Any, *, allow_zero: bool = False, maximum: float | None = None,
             what: str = "") -> float:
    """A finite number ``> 0`` (``>= 0`` with ``allow_zero``), at most ``maximum``."""
    number = real(name, value)
    if number < 0 or (number == 0 and not allow_zero):
        raise ValueError(f"Invalid {name}: {value!r}; expected a number {'>=' if allow_zero else '>'} 0")
    if maximum is not None and number > maximum:
        raise ValueError(f"Invalid {name}: {value!r}; expected at most {maximum:.3g}{what}")
    return number


def is_number(value: Any) -> bool:
    """Whether :func:`real` would accept ``value`` (for APIs that also take callables)."""
    try:
        real("value", value)
    except ValueError:
        return False
    return True
