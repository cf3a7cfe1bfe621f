"""Library code that runs eagerly inside a ``torch.compile``-d function (a graph break).

Nothing here runs at import: ``torch.compiler.disable`` loads ``torch._dynamo``, and loaded
after TensorFlow (Keras users import it first) that aborts the process. Hooks are wrapped
when they are made, an optimizer's ``step`` when its class's first instance is built.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import torch


def _disable() -> Callable[..., Any]:
    compiler = getattr(torch, "compiler", None)  # torch.compiler from torch 2.1; torch._dynamo before
    if compiler is not None and hasattr(compiler, "disable"):
        return compiler.disable
    return importlib.import_module("torch._dynamo").disable


# torch.compiler.disable takes a reason, which dynamo's errors quote, from torch 2.8 on
_TAKES_REASON = "reason" in inspect.signature(_disable()).parameters


def run_eagerly(reason: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``torch.compiler.disable`` as a decorator, giving dynamo ``reason`` where this torch takes it."""
    disable = _disable()
    if _TAKES_REASON:
        return disable(reason=reason)
    return disable


def step_eagerly(cls: type, reason: str) -> None:
    """Make ``cls.step`` run eagerly inside compiled functions (``torch.compile(optimizer.step)``
    or a compiled training step); once per class, from its ``__init__`` before
    ``torch.optim.Optimizer.__init__`` wraps the step in its hooks."""
    if cls.__dict__.get("_steps_eagerly"):
        return
    cls.step = run_eagerly(reason)(cls.__dict__["step"])  # type: ignore[attr-defined]
    cls._steps_eagerly = True  # type: ignore[attr-defined]
