"""Glue for training frameworks that need more than an optimizer.

Each submodule imports its framework; nothing here is imported by ``import kron_precond``:

* :mod:`kron_precond.integrations.torchtitan` -- torchtitan's optimizer container with a
  preconditioner in front, swapped in with ``--override.imports``.
"""
