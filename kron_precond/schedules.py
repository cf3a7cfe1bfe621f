"""Hyperparameter schedules: values or callables of the step, and the PSGD update schedule.

Everything here is plain host-side Python: a decision made from these is identical on every
rank by construction (no random draw), and the counters live in a ``state_dict`` so a
resumed run continues the schedule where it stopped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar, Union

from kron_precond import validation

T = TypeVar("T")
ValueOrSchedule = Union[T, Callable[[int], T]]


def resolve(value: ValueOrSchedule, step: int):
    """``value(step)`` if ``value`` is callable, else ``value``."""
    return value(step) if callable(value) else value


def precond_update_prob_schedule(max_prob: float = 1.0, min_prob: float = 0.03,
                                 decay: float = 0.001, flat_start: int = 500
                                 ) -> Callable[[int], float]:
    """Probability of a PSGD preconditioner update after ``n`` steps:

        p(n) = clamp(max_prob · exp(−decay · (n − flat_start)), min_prob, max_prob)

    With the defaults: 1.0 for the first 500 steps, then an exponential anneal that reaches
    0.03 at about step 4000. Returns a picklable callable ``p(n) -> float``.
    """
    # a bool is an int to Python, but True is no probability, decay or step count
    for name, value in (("max_prob", max_prob), ("min_prob", min_prob)):
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0):
            raise ValueError(f"Invalid {name}: {value!r}; expected a probability in [0, 1]")
    if min_prob > max_prob:
        raise ValueError(f"Invalid min_prob: {min_prob!r} > max_prob {max_prob!r}")
    if not (isinstance(decay, (int, float)) and not isinstance(decay, bool) and math.isfinite(decay)
            and decay >= 0):
        raise ValueError(f"Invalid decay: {decay!r}; expected a finite float >= 0")
    if not (isinstance(flat_start, (int, float)) and not isinstance(flat_start, bool) and math.isfinite(flat_start)):
        raise ValueError(f"Invalid flat_start: {flat_start!r}; expected a finite number")
    return _ProbSchedule(float(max_prob), float(min_prob), float(decay), float(flat_start))


class _ProbSchedule:
    """The callable returned by :func:`precond_update_prob_schedule` (a class so it pickles)."""

    def __init__(self, max_prob: float, min_prob: float, decay: float, flat_start: float):
        self.max_prob, self.min_prob = max_prob, min_prob
        self.decay, self.flat_start = decay, flat_start

    def __call__(self, n: int) -> float:
        # exp(-decay·(n − flat_start)) ≥ 1 before flat_start: clamped to max_prob.
        exponent = min(-self.decay * (n - self.flat_start), 0.0)
        p = self.max_prob * math.exp(exponent)
        return min(max(p, self.min_prob), self.max_prob)

    def __repr__(self) -> str:
        return (f"precond_update_prob_schedule(max_prob={self.max_prob}, "
                f"min_prob={self.min_prob}, decay={self.decay}, flat_start={self.flat_start})")


def check_probability(p: Any, name: str = "preconditioner_update_probability") -> float:
    """``float(p)`` if it is a probability in [0, 1], else ``ValueError`` naming ``name``.
    A bool or a string is refused as the constant is, also where a schedule returns it
    (``float(True)`` is 1.0, ``float("0.5")`` 0.5)."""
    if isinstance(p, (bool, str, bytes)) or str(getattr(p, "dtype", "")) in ("bool", "torch.bool"):
        raise ValueError(f"Invalid {name}: {p!r}; expected a float in [0, 1] or a callable "
                         "of the step")
    try:
        value = float(p)
    except (TypeError, ValueError):
        raise ValueError(f"Invalid {name}: {p!r}; expected a float in [0, 1] or a callable "
                         "of the step") from None
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"Invalid {name}: {p!r}; expected a probability in [0, 1]")
    return value


class UpdateDecider:
    """Deterministic "update with probability p" from a counter.

    Each call advances one step: ``acc += p(step)``; if ``acc >= 1`` then ``acc -= 1`` and the
    call returns ``True``. A first call with ``p = 1`` updates; ``p = 0.25`` updates on
    every fourth call exactly. The ``(step, acc)`` pair is the whole state
    (:meth:`state_dict`), so all ranks agree by construction and a resumed run continues
    the schedule.

    Args:
        probability: a float in [0, 1], a callable ``p(step) -> float`` of the number of
            steps so far, or ``None`` for :func:`precond_update_prob_schedule`'s default.
    """

    _EPS = 1e-9  # so that e.g. ten additions of 0.1 count as 1

    def __init__(self, probability: float | Callable[[int], float] | None):
        if probability is None:
            probability = precond_update_prob_schedule()
        elif not callable(probability):
            probability = check_probability(probability)
        self.probability = probability
        self.step = 0
        self.acc = 0.0

    def current_probability(self) -> float:
        """The probability the next call will use."""
        return check_probability(resolve(self.probability, self.step))

    def peek(self) -> bool:
        """Whether the next call will update, without advancing."""
        return self.acc + self.current_probability() >= 1.0 - self._EPS

    def __call__(self) -> bool:
        """Advance one step; return whether to update on it."""
        self.acc += self.current_probability()
        self.step += 1
        if self.acc >= 1.0 - self._EPS:
            self.acc = max(self.acc - 1.0, 0.0)
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "acc": self.acc}

    def load_state_dict(self, state_dict: dict[str, Any], name: str = "decider") -> None:
        """Load :meth:`state_dict`'s counters; ``ValueError`` (naming ``name.step`` or
        ``name.acc``) and nothing changed if they are not counters a decider can hold
        (:meth:`checked_state`)."""
        state = self.checked_state(state_dict, name)
        self.step, self.acc = state["step"], state["acc"]

    @staticmethod
    def checked_state(state_dict: Any, name: str = "decider") -> dict[str, Any]:
        """``state_dict``'s counters, checked, as :meth:`load_state_dict` installs them:
        ``step`` an integer >= 0, ``acc`` a finite number in [0, 1) -- the range a call leaves
        it in (a NaN accumulator never reaches 1 again: no later update would happen, silently;
        one of 7.5 would update on every call until it ran down). ``ValueError`` naming the
        entry otherwise. The one rule for every checkpoint that holds a decider."""
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"{name} must be a dict with 'step' and 'acc', got {state_dict!r}")
        missing = [key for key in ("step", "acc") if key not in state_dict]
        if missing:
            raise ValueError(f"{name} has no {missing} (a decider's state holds 'step' and 'acc')")
        return {"step": validation.check_int(f"{name}.step", state_dict["step"], minimum=0),
                "acc": validation.check_unit_interval(f"{name}.acc", state_dict["acc"],
                                                      low_open=False, high_open=True)}

    def __repr__(self) -> str:
        return f"UpdateDecider(probability={self.probability!r}, step={self.step}, acc={self.acc})"


# ----------------------------------------------------------------------------- step schedules
@dataclass(frozen=True)
class StepContext:
    """What one :meth:`KronPreconditioner.step` does, decided before any state changes.

    Attributes:
        step: number of completed steps before this one.
        statistics: this step folds the statistics gathered since the last one (the
            capture was on during its forward/backward).
        refresh: owners run the expensive refresh on this step.
        refresh_index: refreshes completed before this step.
        statistics_count: statistics steps so far, this one included.
        hparams: the method's and the engine's hyperparameters resolved (and validated)
            for this step; only those this step needs are present.
    """

    step: int
    statistics: bool
    refresh: bool
    refresh_index: int
    statistics_count: int
    hparams: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.hparams[name]


class IntervalSchedule:
    """Statistics every ``statistics_every`` steps, refresh every ``refresh_every`` steps
    (both ints or callables of the step; K-FAC's ``factor_update_steps`` / ``inv_update_steps``).
    Stateless: a function of the step count alone.

    ``warmup=True`` adds a geometric warm-up: steps 1, 2, 4, 8, ... below the longer of the two
    intervals (as resolved at that step) gather statistics and refresh too, so the state the
    first step refreshed from (one batch, possibly an unusual one) is replaced after 1, 2, 4, ...
    steps instead of being applied for a whole interval. With intervals of 32 that is five
    extra statistics steps and refreshes in a run (1, 2, 4, 8, 16), with 100 seven (to 64). Still a
    function of the step alone: identical on every rank, and a resumed run (whose step count
    its checkpoint holds) continues it."""

    def __init__(self, statistics_every, refresh_every, *, names=("factor_update_steps", "inv_update_steps"),
                 check: Callable[[str, Any], int], warmup: bool = False) -> None:
        self.statistics_every = statistics_every
        self.refresh_every = refresh_every
        self.names = names
        self.warmup = warmup
        self._check = check

    def collects(self, step: int) -> bool:
        every = self._check(self.names[0], resolve(self.statistics_every, step))
        return step % every == 0 or self.warming_up(step)

    def refreshes(self, step: int) -> bool:
        """Whether ``step`` refreshes (pure: call :meth:`advance` once the step is committed)."""
        every = self._check(self.names[1], resolve(self.refresh_every, step))
        return step % every == 0 or self.warming_up(step)

    def warming_up(self, step: int) -> bool:
        """Whether ``step`` is a warm-up step: ``warmup`` on and ``step`` a power of two below
        the longer interval."""
        if not self.warmup or step < 1 or step & (step - 1):
            return False
        longest = max(self._check(self.names[0], resolve(self.statistics_every, step)),
                      self._check(self.names[1], resolve(self.refresh_every, step)))
        return step < longest

    def advance(self, step: int) -> None:
        pass

    def hparams(self, step: int) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ProbabilitySchedule:
    """Statistics every step; refresh on the steps an :class:`UpdateDecider` picks (PSGD).
    Its counters are the whole state, so ranks agree and resumed runs continue."""

    def __init__(self, probability) -> None:
        self.decider = UpdateDecider(probability)

    def collects(self, step: int) -> bool:
        return True

    def refreshes(self, step: int) -> bool:
        """Whether ``step`` refreshes (pure: call :meth:`advance` once the step is committed)."""
        return self.decider.peek()

    def hparams(self, step: int) -> dict[str, Any]:
        """Values the step's context carries from the schedule: the update probability."""
        return {"update_probability": self.decider.current_probability()}

    def advance(self, step: int) -> None:
        self.decider()

    def state_dict(self) -> dict[str, Any]:
        return self.decider.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decider.load_state_dict(state, "schedule")
