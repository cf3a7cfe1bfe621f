"""Preconditioner-update probability schedules evaluated in-graph (``keras.ops``).

The torch optimizer evaluates its schedule in Python; under ``jit`` the step is a traced
tensor, so here a schedule is a callable of the step *tensor* that returns a 0-dim float
tensor -- the same contract as a Keras ``LearningRateSchedule``, which it subclasses so
that Keras serializes it.
"""
from __future__ import annotations

from typing import cast

import keras
from keras import ops

from kron_precond.schedules import _ProbSchedule, precond_update_prob_schedule  # plain Python, no torch math


@keras.saving.register_keras_serializable(package="kron_precond")
class PrecondUpdateProbSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Probability of a PSGD preconditioner update after ``n`` optimizer steps:

        p(n) = clip(max_prob · exp(−decay · (n − flat_start)), min_prob, max_prob)

    the same function as :func:`kron_precond.precond_update_prob_schedule` (default: 1.0
    for 500 steps, then an exponential anneal to 0.03 at about step 4000), computed with
    ``keras.ops`` in float32 so it runs under ``jit``.
    """

    def __init__(self, max_prob: float = 1.0, min_prob: float = 0.03, decay: float = 0.001,
                 flat_start: float = 500):
        # the torch package's schedule checks the arguments (naming the bad one) and normalises them.
        # cast: it returns a _ProbSchedule but is annotated as a plain callable. ignore: it accepts
        # any finite flat_start (and stores float(flat_start)) but annotates it as int.
        checked = cast(_ProbSchedule, precond_update_prob_schedule(
            max_prob, min_prob, decay, flat_start))  # type: ignore[arg-type]
        self.max_prob, self.min_prob = checked.max_prob, checked.min_prob
        self.decay, self.flat_start = checked.decay, checked.flat_start

    def __call__(self, step):
        n = ops.cast(step, "float32")
        # exp(-decay·(n − flat_start)) ≥ 1 before flat_start: clipped to max_prob.
        exponent = ops.minimum(-self.decay * (n - self.flat_start), 0.0)
        p = self.max_prob * ops.exp(exponent)
        return ops.clip(p, self.min_prob, self.max_prob)

    def get_config(self):
        return {"max_prob": self.max_prob, "min_prob": self.min_prob, "decay": self.decay,
                "flat_start": self.flat_start}

    def __repr__(self) -> str:
        return (f"PrecondUpdateProbSchedule(max_prob={self.max_prob}, "
                f"min_prob={self.min_prob}, decay={self.decay}, flat_start={self.flat_start})")


def as_keras_schedule(probability):
    """The torch package's schedule object becomes its in-graph twin; anything else is
    returned unchanged."""
    if isinstance(probability, _ProbSchedule):
        return PrecondUpdateProbSchedule(probability.max_prob, probability.min_prob,
                                         probability.decay, probability.flat_start)
    return probability
