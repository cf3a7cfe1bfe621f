"""The preconditioner's checkpoint format, versioned.

Version 2 (this one)::

    {"format": "kron_precond", "version": 2, "method": str, "steps": int,
     "statistics_steps": int, "refreshes": int, "schedule": dict,
     "layers": {layer name: the layer method's state_dict()}}

Files written before the format had a version (version 1) hold ``steps``, ``method``,
``decider``, ``factor_steps``, ``psgd_updates`` and ``layers``; :func:`upgrade` reads them.
A checkpoint holds what is needed to resume on any number of ranks, never rank placement.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Mapping

FORMAT = "kron_precond"
VERSION = 2


def pack(*, method: str, steps: int, statistics_steps: int, refreshes: int, schedule: dict,
         layers: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "method": method, "steps": steps,
            "statistics_steps": statistics_steps, "refreshes": refreshes, "schedule": schedule,
            "layers": layers}


def upgrade(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` in the current version's layout (a new dict; ``state`` is not modified).
    ``ValueError`` if it is not a preconditioner checkpoint or comes from a newer version."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict must be a mapping, got {type(state).__name__}")
    if "format" in state and state["format"] != FORMAT:
        raise ValueError(f"state_dict has format {state['format']!r}, expected {FORMAT!r}")
    if "format" in state and "version" not in state:  # version 1 files never had "format"
        raise ValueError("state_dict has a 'format' but no 'version': a damaged checkpoint (its counters "
                         "would be read as an unversioned file's)")
    version = state.get("version", 1)
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"state_dict has an invalid version {version!r}")
    if version > VERSION:
        raise ValueError(f"state_dict was written by a newer kron_precond (format version {version}); "
                         f"this one reads versions up to {VERSION}")
    required = ("method", "steps", "layers") + (("statistics_steps", "refreshes", "schedule") if version >= 2 else ())
    missing = [key for key in required if key not in state]
    if missing:
        raise ValueError(f"state_dict is missing {missing}: not a KronPreconditioner state_dict")
    if version == 1:
        method = state["method"]
        return pack(method=method, steps=int(state["steps"]),
                    statistics_steps=int(state.get("factor_steps", 0)),
                    refreshes=int(state.get("psgd_updates", 0)),
                    schedule=dict(state.get("decider", {})) if method == "psgd" else {},
                    layers=dict(state["layers"]))
    return dict(state)


# The state-dict helpers that create an optimizer's state with a step at lr 0 on zero gradients
# and keep only its "state" and "param_groups": torch.distributed.checkpoint's, and torchtitan's
# own (``init_optim_state`` / ``get_flat_optim_state_dict``, what its checkpointer calls).
_STATE_DICT_API = ("torch.distributed.checkpoint.state_dict", "torchtitan.components.optimizer.utils")


def _called_from(modules: tuple[str, ...], frame: types.FrameType | None, depth: int) -> bool:
    """Whether one of ``depth`` frames from ``frame`` outwards runs code of one of ``modules``."""
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") in modules:
            return True
        frame = frame.f_back
    return False


def called_by_torchs_state_dict_api() -> bool:
    """Whether the caller of the ``state_dict()`` that calls this is torch.distributed.checkpoint's
    state-dict API (``get_state_dict`` / ``get_optimizer_state_dict``) or torchtitan's flat
    optimizer state dict, which keep only
    ``"state"`` and ``"param_groups"`` of an optimizer's state dict: an optimizer with more to
    save warns then, rather than losing it silently."""
    return _called_from(_STATE_DICT_API, sys._getframe(2), 4)  # from the caller of state_dict()


def stepped_by_torchs_state_dict_api() -> bool:
    """Whether the optimizer ``step()`` running this was called by torch.distributed.checkpoint's
    state-dict API: on an optimizer without state, ``get_optimizer_state_dict`` and
    ``set_optimizer_state_dict`` run one step at lr 0 with zero gradients to create the state
    entries (``_init_optim_state``; torchtitan's checkpointer does the same with its own
    ``init_optim_state``). That call is no training step; an optimizer counting its
    steps undoes its counts after it. Read from the frames between (torch.optim's step hooks,
    a compile-disable wrapper): no tensor is read."""
    return _called_from(_STATE_DICT_API, sys._getframe(1), 12)


def run_load_pre_hooks(optimizer, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` as ``optimizer``'s ``register_load_state_dict_pre_hook`` hooks leave it
    (torch.optim runs them first, on a shallow copy, and loads what they return), as a new
    dict the caller may change: an optimizer that checks a checkpoint before loading it
    checks this."""
    state_dict = dict(state_dict)
    for hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return dict(state_dict)
