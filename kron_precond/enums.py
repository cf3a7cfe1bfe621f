"""Enumerations accepted (as the enum or its string value) by the public constructors.

``Method`` (which preconditioner a layer uses) is built from the method registry, so it lists
exactly the registered methods; it lives in :mod:`kron_precond.methods.registry` and is
re-exported here and from ``kron_precond``.
"""
from __future__ import annotations

import enum
from typing import Any


class _StrEnum(str, enum.Enum):
    @classmethod
    def parse(cls, value, argument: str):
        """Return the member for ``value`` (member or case-insensitive string)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{argument}={value!r} is not one of {choices}")


class ComputeMethod(_StrEnum):
    """How K-FAC turns its factors into a preconditioner."""

    EIGEN = "eigen"
    INVERSE = "inverse"


class AssignmentStrategy(_StrEnum):
    """What the placement of per-layer work across ranks balances."""

    COMPUTE = "compute"  # estimated time: n^3 per factor
    MEMORY = "memory"  # estimated storage: n^2 per factor


class DistributedStrategy(enum.Enum):
    """Preset fractions of the world that act as gradient workers for each layer."""

    COMM_OPT = 1.0  # every rank keeps every layer's state: no traffic on plain steps
    HYBRID_OPT = 0.5
    MEM_OPT = 0.0  # stands for 1 / world_size: one rank per layer keeps state


def strategy_by_name(value: Any) -> Any:
    """``value``, or the :class:`DistributedStrategy` a string names (case-insensitive):
    ``"comm_opt"``, ``"hybrid_opt"``, ``"mem_opt"``. An unknown name raises ``ValueError``."""
    if not isinstance(value, str):
        return value
    try:
        return DistributedStrategy[value.upper()]
    except KeyError:
        choices = ", ".join(repr(s.name.lower()) for s in DistributedStrategy)
        raise ValueError(f"grad_worker_fraction={value!r} is not one of {choices} or a float") from None


def __getattr__(name: str) -> Any:
    # ``Method`` comes from the registry, whose method modules import this module: resolve it
    # on first use instead of at import time.
    if name == "Method":
        from kron_precond.methods.registry import Method

        return Method
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
