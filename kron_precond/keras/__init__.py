"""PSGD Kron for Keras 3 (TensorFlow, JAX or PyTorch backend), written with ``keras.ops``.

    from kron_precond.keras import Kron
    model.compile(optimizer=Kron(learning_rate=3e-4), loss=..., metrics=[...])

Importing :mod:`kron_precond` itself never imports Keras; only this subpackage does
(install it from the clone with ``pip install -e ".[keras]"``). See ``docs/keras.md``.
"""
from .optimizer import Kron
from .schedules import PrecondUpdateProbSchedule

__all__ = ["Kron", "PrecondUpdateProbSchedule"]
