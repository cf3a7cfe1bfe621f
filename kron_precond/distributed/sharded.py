"""FSDP2 / HSDP parameters: which DTensor layouts are supported, and moving gradient shards.

FSDP2 (``fully_shard``) stores each parameter, and after backward its gradient, as a
``DTensor`` sharded on dim 0 over a 1-D device mesh: ``(Shard(0),)``. HSDP uses a 2-D mesh
``(replicate, shard)`` with placements ``(Replicate(), Shard(0))``. The gradient FSDP
leaves in ``.grad`` is already averaged over every data-parallel rank (both mesh
dimensions), exactly like DDP's, so a preconditioner only has to

* assemble a layer's full gradient where its preconditioned value is computed, and
* write back to each rank the rows of the result that its local shard holds.

Two ways are implemented, both on torch.distributed / DTensor only:

* :meth:`ShardedLayout.full` (any supported mesh): ``DTensor.full_tensor()``, an all-gather
  over the shard dimension; every rank then holds the full gradient and keeps its rows.
* :class:`OwnerExchange` (1-D mesh, one gradient worker per layer): each rank sends its
  rows of every layer to that layer's owner (one ``gather`` per owner), the owner
  preconditions and sends every rank its rows back (one ``scatter`` per owner). A rank
  sends ``Σ_{l not owned} n_l / S + Σ_{l owned} n_l (S-1)/S`` elements instead of the
  all-gather's ``Σ_l n_l (S-1)/S``.

Rows are split as ``torch.chunk`` / ``Shard(0)`` split them: ``ceil(n / S)`` rows per rank,
the last ranks get fewer or none; pieces are padded to that size on the wire.
"""
from __future__ import annotations

import functools
import math
from typing import Iterable, Sequence, TypeGuard

import torch
import torch.distributed as dist

try:  # DTensor is public from torch 2.4
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch without distributed tensors
    DTensor = None  # type: ignore[assignment, misc]  # an optional import: callers check for None


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    return DTensor is not None and isinstance(tensor, DTensor)


def refuse_fsdp1(named_parameters: Iterable[tuple[str, torch.Tensor]], owner: str,
                 instead: str = "Shard the model with torch.distributed.fsdp.fully_shard (FSDP2), which it takes"
                 ) -> None:
    """``TypeError`` naming parameters that ``FullyShardedDataParallel`` (FSDP1) flattened: its
    flat parameter, or the views of it it puts in place of the modules' own (``use_orig_params``),
    which on several ranks are 1-D shards. A layer's weight is then not its matrix: its factors
    would be fitted to a shard. ``instead``: what the caller takes in its place."""
    names = [name for name, p in named_parameters
             if getattr(p, "_fsdp_flattened", False) or getattr(p, "_is_flat_param", False)]
    if names:
        listed = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise TypeError(f"{owner} does not support FullyShardedDataParallel (FSDP1), which flattens and shards "
                        f"parameters (got {listed}): a layer's weight is then not its matrix. {instead}")


def _mesh_key(mesh) -> tuple:
    return (mesh.device_type, tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.mesh.shape),
            tuple(mesh.mesh_dim_names or ()))


def _supported(placements) -> bool:
    """``(Shard(0),)``, ``(Replicate(),)``, ``(Replicate(), Shard(0))`` or ``(Replicate(), Replicate())``."""
    if len(placements) not in (1, 2):
        return False
    *outer, inner = placements
    if any(not isinstance(p, Replicate) for p in outer):
        return False
    return isinstance(inner, Replicate) or (isinstance(inner, Shard) and inner.dim == 0)


class ShardedLayout:
    """The one device mesh of a model's DTensor parameters and how to move their gradients.

    Built by :meth:`detect` at construction; ``ValueError`` names the first parameter whose
    placements are not FSDP2 / HSDP ones, or two parameters on different meshes.
    """

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.shard_dim = mesh.ndim - 1  # HSDP: (replicate, shard); FSDP2: (shard,)
        self.shard_size = mesh.size(self.shard_dim)
        self.shard_rank = mesh.get_local_rank(self.shard_dim)
        self.shard_group = mesh.get_group(self.shard_dim)

    @classmethod
    def detect(cls, named_params: Sequence[tuple[str, torch.Tensor]], world_size: int) -> "ShardedLayout | None":
        """``None`` when no parameter is a DTensor; else the layout, validated."""
        mesh, first = None, None
        for name, param in named_params:
            if not is_dtensor(param):
                continue
            if not _supported(param.placements):
                raise ValueError(
                    f"parameter {name!r} is a DTensor with placements {tuple(param.placements)} on a "
                    f"{param.device_mesh.ndim}-D mesh; kron_precond supports FSDP2 (Shard(0),) and HSDP "
                    "(Replicate(), Shard(0)) parameters only (tensor / sequence parallelism shard a "
                    "layer's gradient along other dims, which its Kronecker factors cannot follow)")
            if mesh is None:
                mesh, first = param.device_mesh, name
            elif _mesh_key(param.device_mesh) != _mesh_key(mesh):
                raise ValueError(
                    f"parameters {first!r} and {name!r} are DTensors on different device meshes "
                    f"({mesh} and {param.device_mesh}); kron_precond needs every FSDP2 module on the "
                    "same mesh (one data-parallel group)")
        if mesh is None:
            return None
        if mesh.size() != world_size:
            raise ValueError(f"the parameters' device mesh {mesh} spans {mesh.size()} ranks but the "
                             f"preconditioner's process group has {world_size}; pass "
                             "process_group= covering exactly the mesh's ranks")
        return cls(mesh)

    # ------------------------------------------------------------------ rows
    def rows(self, total: int, shard_rank: int | None = None) -> tuple[int, int]:
        """``[start, stop)`` of the rows of a ``total``-row tensor held at ``shard_rank``."""
        rank = self.shard_rank if shard_rank is None else shard_rank
        chunk = math.ceil(total / self.shard_size) if total else 0
        start = min(rank * chunk, total)
        return start, min(start + chunk, total)

    def chunk(self, total: int) -> int:
        return math.ceil(total / self.shard_size) if total else 0

    def is_sharded(self, tensor) -> bool:
        return is_dtensor(tensor) and isinstance(tensor.placements[-1], Shard)

    # ------------------------------------------------------------------ gradients
    def full(self, grad) -> torch.Tensor:
        """The full (global) value of ``grad`` on every rank (a collective for sharded ones)."""
        if is_dtensor(grad):
            return grad.full_tensor()
        return grad

    def local(self, tensor) -> torch.Tensor:
        """The local piece of a DTensor (the tensor itself otherwise): writable in place."""
        return tensor.to_local() if is_dtensor(tensor) else tensor

    def local_rows(self, param, full: torch.Tensor) -> torch.Tensor:
        """The rows of the full-size ``full`` that this rank's shard of ``param`` holds."""
        if not self.is_sharded(param):
            return full
        start, stop = self.rows(full.shape[0])
        return full[start:stop]

    def group_sum(self, value: torch.Tensor) -> None:
        """Sum a local partial value (e.g. ``Σ`` over local rows) over the shard dimension."""
        if self.shard_size > 1:
            dist.all_reduce(value, group=self.shard_group)


class OwnerExchange:
    """Full gradients to their layer's owner (``gather``), preconditioned rows back (``scatter``).

    Only for a 1-D mesh equal to the preconditioner's group (FSDP2 with one gradient worker
    per layer, i.e. ``grad_worker_fraction=MEM_OPT``): owner ranks are then shard ranks.
    """

    def __init__(self, layout: ShardedLayout, global_ranks: Sequence[int]) -> None:
        self.layout = layout
        self.global_ranks = list(global_ranks)

    @staticmethod
    def wire_dtype(params) -> torch.dtype:
        """The dtype one owner's pieces travel in: their parameters' dtypes promoted, the same
        on every rank (a bfloat16 body and a float32 head share one buffer, and every rank's
        buffer must have the owner's dtype or the collective fails on some ranks only)."""
        return functools.reduce(torch.promote_types, (p.dtype for p in params))

    def _padded_local(self, param, grad, dtype: torch.dtype) -> torch.Tensor:
        """This rank's rows of ``grad`` (zeros for ``None``), padded to the chunk size, flat."""
        total = param.shape[0] if param.dim() else 1
        chunk = self.layout.chunk(total)
        rest = tuple(param.shape[1:])
        out = torch.zeros((chunk,) + rest, dtype=dtype, device=param.device)
        if grad is not None:
            local = self.layout.local(grad)
            out[:local.shape[0]] = local
        return out.reshape(-1)

    def gather(self, by_owner: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]]
               ) -> dict[int, list[torch.Tensor]]:
        """For each owner rank (key), ``[(param, grad), ...]`` of its layers' parameters.

        Returns, on this rank only for the owner it is, the full gradients in order.
        """
        S, me = self.layout.shard_size, self.layout.shard_rank
        pending = []
        for owner, items in sorted(by_owner.items()):
            if not items:
                continue
            dtype = self.wire_dtype(p for p, _ in items)
            send = torch.cat([self._padded_local(p, g, dtype) for p, g in items])
            receive = [torch.empty_like(send) for _ in range(S)] if owner == me else None
            work = dist.gather(send, receive, dst=self.global_ranks[owner], group=self.layout.shard_group,
                               async_op=True)
            pending.append((owner, items, receive, work))
        full: dict[int, list[torch.Tensor]] = {}
        for owner, items, receive, work in pending:
            work.wait()
            if owner != me:
                continue
            assert receive is not None  # allocated above for the owner this rank is
            full[owner] = self._unpack_full(items, receive)
        return full

    def _unpack_full(self, items, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [self.layout.chunk(p.shape[0] if p.dim() else 1) * max(1, math.prod(p.shape[1:]))
                 for p, _ in items]
        per_rank = [piece.split(sizes) for piece in pieces]
        out = []
        for index, (param, _) in enumerate(items):
            total = param.shape[0] if param.dim() else 1
            chunk = self.layout.chunk(total)
            rows = [per_rank[r][index].reshape((chunk,) + tuple(param.shape[1:])) for r in range(len(pieces))]
            out.append(torch.cat(rows)[:total].reshape(param.shape).to(param.dtype))
        return out

    def scatter(self, by_owner: dict[int, list[torch.Tensor]], full_out: dict[int, list[torch.Tensor]]
                ) -> dict[int, list[torch.Tensor]]:
        """Send each rank its rows of the owners' results.

        ``by_owner[owner]`` lists the parameters (shape templates) of each owner's layers;
        ``full_out[owner]`` holds, on the owner, the full results in that order. Returns,
        for every owner, this rank's rows of each result (unpadded).
        """
        S, me = self.layout.shard_size, self.layout.shard_rank
        pending = []
        for owner, params in sorted(by_owner.items()):
            if not params:
                continue
            sizes = [self.layout.chunk(p.shape[0] if p.dim() else 1) * max(1, math.prod(p.shape[1:]))
                     for p in params]
            dtype = self.wire_dtype(params)
            receive = torch.empty(sum(sizes), dtype=dtype, device=params[0].device)
            send = None
            if owner == me:
                send = [torch.cat([self._rows_padded(p, full, r).to(dtype) for p, full in zip(params, full_out[owner])])
                        for r in range(S)]
            work = dist.scatter(receive, send, src=self.global_ranks[owner], group=self.layout.shard_group,
                                async_op=True)
            pending.append((owner, params, sizes, receive, work))
        result = {}
        for owner, params, sizes, receive, work in pending:
            work.wait()
            pieces = []
            for p, piece in zip(params, receive.split(sizes)):
                total = p.shape[0] if p.dim() else 1
                start, stop = self.layout.rows(total)
                chunk = self.layout.chunk(total)
                pieces.append(piece.reshape((chunk,) + tuple(p.shape[1:]))[:stop - start].to(p.dtype))
            result[owner] = pieces
        return result

    def _rows_padded(self, param, full: torch.Tensor, shard_rank: int) -> torch.Tensor:
        total = param.shape[0] if param.dim() else 1
        chunk = self.layout.chunk(total)
        start, stop = self.layout.rows(total, shard_rank)
        out = torch.zeros((chunk,) + tuple(param.shape[1:]), dtype=full.dtype, device=full.device)
        out[:stop - start] = full.reshape((total,) + tuple(param.shape[1:]))[start:stop]
        return out.reshape(-1)
