"""kron_precond: Kronecker-factored preconditioning (K-FAC, PSGD Kron) for any PyTorch optimizer.

    precond = KronPreconditioner(model, method="kfac")
    loss.backward(); precond.step(lr=optimizer.param_groups[0]["lr"]); optimizer.step()

or, for loops that only call ``optimizer.step()`` (HF Trainer, Lightning, Accelerate)::

    optimizer = PreconditionedOptimizer(torch.optim.AdamW(model.parameters()), precond)

``WhitenedMuon`` is Muon whose step is measured in the K-FAC-whitened spectral norm (the
whitening before *and* after the orthogonalisation, which a preconditioner in front of Muon
cannot do).
"""
from kron_precond._version import __version__ as __version__
from kron_precond.enums import AssignmentStrategy, ComputeMethod, DistributedStrategy
from kron_precond.experts import RoutedExperts, RoutedExpertsAdapter  # also registers the experts adapters
from kron_precond.methods.registry import Method
from kron_precond.modules import register_adapter
from kron_precond.optim import Kron
from kron_precond.preconditioner import KronPreconditioner
from kron_precond.schedules import precond_update_prob_schedule
from kron_precond.whitened_muon import WhitenedMuon
from kron_precond.wrapped import PreconditionedOptimizer

__all__ = [
    "KronPreconditioner",
    "PreconditionedOptimizer",
    "Kron",
    "WhitenedMuon",
    "Method",
    "ComputeMethod",
    "AssignmentStrategy",
    "DistributedStrategy",
    "precond_update_prob_schedule",
    "RoutedExperts",
    "RoutedExpertsAdapter",
    "register_adapter",
]
