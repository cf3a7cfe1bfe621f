"""Autocast off where the library does its own arithmetic.

``torch.autocast`` casts out-of-place matmuls to its low-precision dtype even when every
input is float32. Inside a user's autocast region (a forward hook always runs there, and a
training loop may call ``step()`` there too) a statistic such as ``Σ x xᵀ`` would be summed in
bfloat16 and a preconditioned gradient rounded to it. In-place ops (``addmm_``) are not cast,
so the loss is silent and only some code paths suffer. Every statistic and every step of the
library runs under :func:`autocast_disabled`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# the device types torch.autocast knows (``torch.is_autocast_enabled`` raises for others)
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "privateuseone")


@contextlib.contextmanager
def autocast_disabled(*device_types: str) -> Iterator[None]:
    """Turn autocast off for ``device_types`` (default: every device type it is on for) and
    restore it on exit. Only a thread-local flag is read: no host synchronisation."""
    with contextlib.ExitStack() as stack:
        for device_type in device_types or _DEVICE_TYPES:
            try:
                enabled = torch.is_autocast_enabled(device_type)
            except RuntimeError:  # a device type autocast does not know (meta): nothing to turn off
                continue
            if enabled:
                stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        yield
