"""The preconditioning methods by name. Adding a method is one entry here plus its file."""
from __future__ import annotations

import enum

from kron_precond.enums import _StrEnum
from kron_precond.methods.base import MethodSpec
from kron_precond.methods.ekfac import EKFACSpec
from kron_precond.methods.ikfac import InputKFACSpec
from kron_precond.methods.kfac import KFACSpec
from kron_precond.methods.psgd_layer import PSGDSpec
from kron_precond.methods.second_moment import SecondMomentSpec
from kron_precond.methods.shampoo import ShampooSpec
from kron_precond.methods.soap import SOAPSpec

METHODS: dict[str, type[MethodSpec]] = {spec.name: spec for spec in (
    KFACSpec,
    PSGDSpec,
    EKFACSpec,
    ShampooSpec,
    InputKFACSpec,
    SecondMomentSpec,
    SOAPSpec,
)}

# Which Kronecker-factored preconditioner a layer uses: one member per registered method
# (``Method.KFAC.value == "kfac"``); anywhere a method name is accepted, a member is too.
# Built from the registry with the functional Enum API, so that the two cannot disagree. mypy
# cannot follow it: it reads a call of a str-mixin Enum class as the str constructor.
Method: type[_StrEnum] = _StrEnum(  # type: ignore[call-overload]
    "Method", [(name.upper(), name) for name in METHODS], module=__name__, qualname="Method")
Method.__doc__ = "Which Kronecker-factored preconditioner a layer uses (one member per registered method)."


def get(method) -> type[MethodSpec]:
    """The spec registered as ``method`` (a name, case-insensitive, or a :class:`Method` member)."""
    name = method.value if isinstance(method, enum.Enum) else method
    if isinstance(name, str) and name.lower() in METHODS:
        return METHODS[name.lower()]
    choices = ", ".join(repr(n) for n in METHODS)
    raise ValueError(f"method={method!r} is not one of {choices}")


def all_specs() -> list[type[MethodSpec]]:
    return list(METHODS.values())
