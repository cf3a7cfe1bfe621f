"""Library code that runs eagerly inside a ``torch.compile``-d function (a graph break)."""
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
