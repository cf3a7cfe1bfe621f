"""The per-layer contract every preconditioning method fulfils.

The engine (:mod:`kron_precond.preconditioner`) drives each registered layer through
four verbs and never looks inside:

* ``observe`` -- gather statistics (K-FAC: activations and output gradients from
  hooks; PSGD: nothing beyond the gradient itself);
* ``refresh`` -- the expensive part, run only by the layer's owner rank (K-FAC
  eigendecompositions or inverses, one PSGD Q update);
* ``apply`` -- the cheap part, run every step by the layer's gradient workers;
* ``factor_costs`` / ``memory_by_kind`` -- estimates used to place work across ranks
  and reported to users.

The distributed layer moves the tensors named by ``shared_statistics`` (summed
across ranks) and ``refreshed_tensors`` (broadcast by the owner) without knowing
what they mean, so a new method (EK-FAC, Shampoo, ...) plugs in here only.
"""
from __future__ import annotations

import abc
from typing import Any

import torch


class LayerMethod(abc.ABC):
    """State and math of one preconditioned layer.

    ``parts`` names the pieces of expensive work (K-FAC: ``("A", "G")``; PSGD: the
    parameter names) that the assignment may place on different ranks.
    """

    parts: tuple[str, ...]
    nonfinite: torch.Tensor  # count of updates skipped for non-finite inputs (on device)

    @abc.abstractmethod
    def shared_statistics(self) -> list[torch.Tensor]:
        """Tensors summed across data-parallel ranks on statistics steps (same layout on
        every rank, whether or not it observed data)."""

    @abc.abstractmethod
    def refreshed_tensors(self, part: str | None = None) -> list[torch.Tensor]:
        """Tensors the owner of ``part`` (all parts if ``None``) computes in ``refresh`` and
        gradient workers need for ``apply``; broadcast in place, so their shapes are fixed."""

    @abc.abstractmethod
    def release_refreshed(self) -> None:
        """Drop refreshed state on ranks that are not gradient workers of this layer."""

    @abc.abstractmethod
    def apply(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Return the preconditioned versions of ``grads`` (one per registered parameter)."""

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


def tensor_bytes(tensors) -> int:
    """Total storage of the given tensors (``None`` entries ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
