"""Bucketed, asynchronous all-reduce and broadcast on torch.distributed.

Tensors are (optionally triangle-packed and) concatenated into one flat buffer that is
cut into chunks of at most ``cap_bytes``; one collective per chunk, all started before
any is waited on. ``cap_bytes=0`` sends one collective per tensor. The result is
written back into the original tensors when the returned handle is waited on.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


class PendingCollective:
    """Handles of in-flight collectives; ``wait()`` finishes them and unpacks the results."""

    def __init__(self, works: list, finish: Callable[[], None]) -> None:
        self._works = works
        self._finish = finish
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for work in self._works:
            work.wait()
        self._finish()
        self.done = True


_TRIU_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _triu_indices(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    if key not in _TRIU_CACHE:
        _TRIU_CACHE[key] = torch.triu_indices(n, n, device=device)
    return _TRIU_CACHE[key]


def _pack(tensor: torch.Tensor, symmetric: bool) -> torch.Tensor:
    if symmetric and tensor.dim() == 2:
        rows, cols = _triu_indices(tensor.shape[0], tensor.device)
        return tensor[rows, cols]
    # reshape(-1) of a strided 1-D tensor is a strided view, which a collective would read
    # as if it were dense; contiguous() copies only such tensors.
    return tensor.contiguous().reshape(-1)


def _unpack_into(tensor: torch.Tensor, flat: torch.Tensor, symmetric: bool) -> None:
    if symmetric and tensor.dim() == 2:
        rows, cols = _triu_indices(tensor.shape[0], tensor.device)
        tensor[rows, cols] = flat
        tensor[cols, rows] = flat
    else:
        tensor.copy_(flat.view_as(tensor))


def _chunks(flat: torch.Tensor, cap_bytes: int) -> list[torch.Tensor]:
    per_chunk = max(1, cap_bytes // flat.element_size())
    return list(flat.split(per_chunk))


def _grouped_by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _launch(tensors, cap_bytes, symmetric, start, divisor: int = 1) -> PendingCollective:
    """Pack ``tensors`` into buffers, call ``start(buffer)`` per bucket, unpack on wait."""
    works: list[Any] = []
    plans: list[tuple[list[torch.Tensor], list[torch.Tensor], list[int] | None]] = []
    for group in _grouped_by_dtype(tensors).values():
        packed = [_pack(t, symmetric) for t in group]
        if cap_bytes <= 0:
            # Unpacked tensors are sent in place (the flat view shares their storage).
            works.extend(start(p) for p in packed)
            plans.append((group, packed, None))
        else:
            flat = torch.cat(packed)
            works.extend(start(chunk) for chunk in _chunks(flat, cap_bytes))
            plans.append((group, [flat], [p.numel() for p in packed]))

    def finish() -> None:
        for group, buffers, sizes in plans:
            if divisor != 1:
                for buffer in buffers:
                    buffer.div_(divisor)
            pieces = buffers if sizes is None else buffers[0].split(sizes)
            for tensor, piece in zip(group, pieces):
                if piece.data_ptr() != tensor.data_ptr() or piece.numel() != tensor.numel():
                    _unpack_into(tensor, piece, symmetric)

    return PendingCollective(works, finish)


def all_reduce(tensors: Sequence[torch.Tensor], *, group, cap_bytes: int, symmetric: bool = False,
               divisor: int = 1) -> PendingCollective:
    """Start summing ``tensors`` over ``group`` (then dividing by ``divisor``); they are
    updated in place on ``wait()`` and must not be written to before that.

    ``symmetric=True`` sends only the upper triangle of square matrices (which must be
    symmetric) and mirrors it back.
    """
    def start(buffer):
        return dist.all_reduce(buffer, group=group, async_op=True)

    return _launch(tensors, cap_bytes, symmetric, start, divisor=divisor)


def broadcast(tensors: Sequence[torch.Tensor], *, src: int, group, cap_bytes: int) -> PendingCollective:
    """Start broadcasting ``tensors`` from global rank ``src``; receivers update on ``wait()``."""
    def start(buffer):
        return dist.broadcast(buffer, src=src, group=group, async_op=True)

    return _launch(tensors, cap_bytes, False, start)


def reduce(tensors: Sequence[torch.Tensor], *, dst: int, group, cap_bytes: int, symmetric: bool = False
           ) -> PendingCollective:
    """Start summing ``tensors`` over ``group`` onto global rank ``dst`` only; on ``dst`` they
    hold the sum after ``wait()`` (elsewhere their content is unspecified)."""
    def start(buffer):
        return dist.reduce(buffer, dst=dst, group=group, async_op=True)

    return _launch(tensors, cap_bytes, symmetric, start)


def waiting_all(pending: Sequence[PendingCollective]) -> PendingCollective:
    """One handle for several in-flight collectives."""
    def finish() -> None:
        for handle in pending:
            handle.wait()

    return PendingCollective([], finish)


def failed_ranks(failed: bool, device: torch.device, group) -> list[int]:
    """The ranks of ``group`` (``None``: the default group; in group order) that passed
    ``failed=True``: every rank learns the outcome of a check each rank made on its own (one
    small all-gather, a collective). Without several ranks: ``[0]`` or ``[]``, locally."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return [0] if failed else []
    local = torch.tensor([int(failed)], dtype=torch.int32, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return [rank for rank, flag in enumerate(torch.cat(gathered).tolist()) if flag]
