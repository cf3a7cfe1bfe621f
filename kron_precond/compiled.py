"""Library code that runs eagerly inside a ``torch.compile``-d function (a graph break)."""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

# torch.compiler.disable takes a reason, which dynamo's errors quote, from torch 2.8 on
_TAKES_REASON = "reason" in inspect.signature(torch.compiler.disable).parameters


def run_eagerly(reason: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``torch.compiler.disable`` as a decorator, giving dynamo ``reason`` where this torch takes it."""
    if _TAKES_REASON:
        return torch.compiler.disable(reason=reason)
    return torch.compiler.disable
