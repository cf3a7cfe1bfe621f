"""The per-layer contract every preconditioning method fulfils.

The engine (:mod:`kron_precond.preconditioner`) drives each registered layer through
four verbs and never looks inside:

* ``observe`` -- gather statistics (K-FAC: activations and output gradients from
  hooks; PSGD: nothing beyond the gradient itself);
* ``refresh`` -- the expensive part, run only by the layer's owner rank (K-FAC
  eigendecompositions or inverses, one PSGD Q update);
* ``apply`` -- the cheap part, run every step by the layer's gradient workers;
* ``cost`` / ``memory`` -- estimates used to place work across ranks.

The distributed layer moves the tensors named by ``shared_statistics`` (averaged
across ranks) and ``refreshed_tensors`` (broadcast by the owner) without knowing
what they mean, so a new method (EK-FAC, Shampoo, ...) plugs in here only.
"""
from __future__ import annotations

import abc
from typing import Any

import torch


class LayerMethod(abc.ABC):
    """State and math of one preconditioned layer."""

    @abc.abstractmethod
    def shared_statistics(self) -> list[torch.Tensor]:
        """Tensors that must be averaged across data-parallel ranks on statistics steps."""

    @abc.abstractmethod
    def refreshed_tensors(self) -> list[torch.Tensor]:
        """Tensors the owner computes in ``refresh`` and gradient workers need for ``apply``.

        Their shapes are fixed at construction so receivers can pre-allocate them.
        """

    @abc.abstractmethod
    def apply(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Return the preconditioned versions of ``grads`` (one per registered parameter)."""

    @abc.abstractmethod
    def cost(self) -> float:
        """Estimated flops of one ``refresh``."""

    @abc.abstractmethod
    def memory(self) -> int:
        """Bytes held by the preconditioner state of this layer."""

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
