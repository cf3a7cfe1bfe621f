"""Nested state comparison for before/after and twin-against-twin checks of state dicts."""
from __future__ import annotations

import math

import torch


def assert_same(a, b, path: str = "state", tolerance: float = 0.0) -> None:
    """``a`` and ``b`` hold the same nested entries: dicts with the same keys, lists / tuples of
    the same type and length, tensors of the same dtype and shape, equal values otherwise (a NaN
    equal to a NaN). Tensors are compared bitwise; with ``tolerance``, floating ones to within
    ``tolerance · max(1, max |b|)`` (a reference computed another way)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        if tolerance and a.is_floating_point():
            bound = tolerance * max(1.0, b.abs().max().item() if b.numel() else 0.0)
            assert a.numel() == 0 or (a - b).abs().max().item() <= bound, f"{path}: {a} != {b}"
        else:
            assert torch.equal(torch.nan_to_num(a, nan=1234.5), torch.nan_to_num(b, nan=1234.5)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]", tolerance)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", tolerance)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
