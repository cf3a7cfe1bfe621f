"""The engine's only door to ``torch.distributed``: reduce, share, receive, gather, agree.

Knows ranks, the worker grid and buckets; knows nothing of what the tensors mean. With one
process (or no initialised process group) every operation is a no-op or a local copy.
Every rank issues the same collectives in the same order: callers pass lists in an order
that is a function of the registration and the step count only.
"""
from __future__ import annotations

import datetime
import hashlib
import secrets
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from kron_precond.distributed import collectives
from kron_precond.distributed.groups import WorkerGrid, spans_the_world
from kron_precond.distributed.sharded import OwnerExchange, ShardedLayout, is_dtensor

#: Seconds a rank that enters a gather every rank must enter (``gather_state_dict()``, and
#: ``PreconditionedOptimizer.state_dict()`` under MEM_OPT / HYBRID_OPT) waits for the other
#: ranks of the group to enter it too; then it raises ``RuntimeError`` instead of entering a
#: gather that would never finish. Read at every call: raise it where a rank may legitimately
#: reach its call much later than the others (e.g. rank 0 writing a large model first).
GATHER_ENTRY_TIMEOUT = 120.0


class Runtime:
    """Placement-aware collectives for one preconditioner.

    Args:
        process_group: the data-parallel group (``None``: the world, if initialised).
        grad_workers: gradient workers per layer (divides the world size).
        bucket_cap_bytes: bucket size of all-reduces and broadcasts (0: one call per tensor).
        symmetric: all-reduce only the upper triangles of square statistics.
    """

    def __init__(self, process_group, *, bucket_cap_bytes: int, symmetric: bool) -> None:
        _check_process_group(process_group)
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(process_group)
            self.rank = dist.get_rank(process_group)
            if self.rank < 0:  # torch's answer for a rank outside the group
                raise ValueError(
                    f"process_group: this process (global rank {dist.get_rank()}) is not a member of the "
                    f"process group given (its global ranks: {dist.get_process_group_ranks(process_group)}); "
                    "build the preconditioner only on the ranks of its process_group, with that group")
        else:
            self.world_size, self.rank = 1, 0
        self.bucket_cap_bytes = bucket_cap_bytes
        self.symmetric = symmetric
        self.grid: WorkerGrid | None = None
        # FSDP2 / HSDP (DTensor parameters): how gradient shards move (docs/design.md, "FSDP2 and HSDP")
        self.sharding: ShardedLayout | None = None
        self.exchange: OwnerExchange | None = None
        # the entry checks of gathers (enter_gather): this preconditioner's name in the group's
        # store (agreed by check_agreement) and how many gathers it entered (the same on every rank)
        self._instance = 0
        self._gathers = 0
        # per rank of the group (check_agreement): how many process groups it had, by the two
        # counts torch names new groups after (None: not gathered)
        self._group_counts: list[tuple[int, int]] | None = None

    # ------------------------------------------------------------------ set-up
    def check_agreement(self, description: str, model: nn.Module) -> None:
        """Fail on every rank (instead of hanging later) if ranks disagree on ``description``
        (registration and settings) or on the model's parameters. Parameters on ``meta`` (a model
        materialised later with ``to_empty``) have no values to compare: the settings still are."""
        if self.world_size == 1:
            return
        fingerprint = int(hashlib.sha256(description.encode()).hexdigest()[:13], 16)
        device = next(iter(model.parameters())).device
        on_meta = any(p.device.type == "meta" for p in model.parameters())
        if device.type == "meta":  # a model to materialise later (to_empty): no values to compare yet;
            device = _collective_device(self.process_group)  # the settings still are
        with torch.no_grad():
            # Position-weighted, so permuted values do not cancel out.
            checksum = torch.zeros((), dtype=torch.float64, device=device)
            for i, param in enumerate(model.parameters()):
                if param.device.type == "meta":
                    continue
                # compare whole values: shards differ by design
                p = param.full_tensor() if is_dtensor(param) else param
                flat = p.detach().double().reshape(-1)
                weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=device)
                checksum += (i + 1) * (flat * weights).sum()
        # and a random name (52 bits: exact in float64) for this preconditioner, rank 0's for all
        nonce = torch.tensor(float(secrets.randbits(52)), dtype=torch.float64, device=device)
        # and the counts torch names the worker grid's new groups after (create_grid compares them)
        groups, world_groups = _process_group_counts()
        local = torch.stack([torch.tensor(float(fingerprint), dtype=torch.float64, device=device), checksum, nonce,
                             torch.tensor(float(groups), dtype=torch.float64, device=device),
                             torch.tensor(float(world_groups), dtype=torch.float64, device=device),
                             torch.tensor(float(on_meta), dtype=torch.float64, device=device)])
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local, group=self.process_group)
        values = torch.stack(gathered).tolist()
        self._instance = int(values[0][2])
        self._group_counts = [(int(v[3]), int(v[4])) for v in values]
        if len({v[0] for v in values}) > 1:
            raise ValueError("ranks registered different layers or use different settings: check "
                             "skip_layers, method, its options (e.g. factor_update_steps, inv_update_steps, "
                             "compute_method, seed, damping), kl_clip, lr, grad_worker_fraction, symmetry_aware, "
                             "allreduce_bucket_cap_mb, colocate_factors and assignment_strategy")
        meta_ranks = [rank for rank, v in enumerate(values) if v[5]]
        if meta_ranks and len(meta_ranks) < len(values):
            raise ValueError(f"the model has parameters on meta on ranks {meta_ranks} (of the process group) and not "
                             f"on the others: build the preconditioner at the same point on every rank (before "
                             f"to_empty, or after it)")
        checksums = [v[1] for v in values]
        if any(c != checksums[0] for c in checksums):
            raise ValueError(f"model parameters differ across ranks (checksums {checksums}); "
                             "initialise every rank from the same seed or broadcast the model first")

    def failed_ranks(self, failed: bool, device: torch.device) -> list[int]:
        """The ranks of the group (in order) that passed ``failed=True``: every rank learns the
        outcome of a check each rank made on its own (one small all-gather). A collective."""
        if self.world_size == 1:
            return [0] if failed else []
        return collectives.failed_ranks(failed, device, self.process_group)

    def create_grid(self, grad_workers: int) -> None:
        """The worker grid; ``ValueError`` on every rank (instead of a hang) where it would create
        process groups whose names differ across ranks (see :meth:`_check_group_names`)."""
        self._check_group_names(grad_workers)
        self.grid = WorkerGrid(self.world_size, self.rank, grad_workers, self.process_group)

    def _check_group_names(self, grad_workers: int) -> None:
        """torch (2.13) names a new process group after a count kept by each process: a group made
        by its members only (``use_local_synchronization=True``) after the number of process groups
        its creator has, one made by every rank after the number of such world-collective groups.
        Ranks whose counts differ name the same group differently and never meet in it: the grid's
        creation would hang (torch's default timeout: 30 minutes). Decided from the counts
        :meth:`check_agreement` gathered (the same on every rank), so every rank raises alike."""
        counts = self._group_counts
        if counts is None or not (1 < grad_workers < self.world_size):
            return  # the grid creates no group (COMM_OPT, MEM_OPT, one rank)
        ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
        whole = spans_the_world(ranks)
        index = 1 if whole else 0  # which count names the groups: see WorkerGrid._create_groups
        seen = [c[index] for c in counts]
        if min(seen) < 0 or len(set(seen)) == 1:
            return  # agreed (or torch keeps no count this version can read: nothing to compare)
        if whole:
            cause = (f"the ranks made different numbers of world-collective process groups before it "
                     f"(torch.distributed.new_group without use_local_synchronization, per rank of the group: "
                     f"{seen}), which every rank of the world must make alike")
        else:
            cause = (f"with a process_group smaller than the world, its ranks create these groups among "
                     f"themselves (use_local_synchronization=True), which torch names after the number of "
                     f"process groups each rank already has, and those differ (per rank of the group: "
                     f"{seen}): e.g. some ranks made a group of their own first")
        raise ValueError(
            f"grad_worker_fraction: {grad_workers} gradient workers of {self.world_size} ranks need process "
            f"groups of their own, and {cause}; the ranks would name them differently and never meet (a hang). "
            "Build the preconditioner before any process group that only some ranks make, make the same "
            "process groups on every rank of the group, or use grad_worker_fraction=DistributedStrategy.COMM_OPT "
            "or DistributedStrategy.MEM_OPT, which create no process groups")

    def _grid(self) -> WorkerGrid:
        """The worker grid, once :meth:`create_grid` made it (placement queries need it)."""
        assert self.grid is not None, "kron_precond: Runtime.create_grid was not called"
        return self.grid

    def _sharding(self) -> ShardedLayout:
        """The DTensor layout :meth:`detect_sharding` found (sharded models only)."""
        assert self.sharding is not None, "kron_precond: no DTensor parameters (detect_sharding found none)"
        return self.sharding

    def _exchange(self) -> OwnerExchange:
        """The owner exchange, once :meth:`use_owner_exchange` turned it on."""
        assert self.exchange is not None, "kron_precond: the owner exchange is off"
        return self.exchange

    def detect_sharding(self, named_params) -> None:
        """Validate DTensor parameters (FSDP2 / HSDP) before anything touches them;
        ``ValueError`` names an unsupported placement or a second mesh."""
        self.sharding = ShardedLayout.detect(list(named_params), self.world_size)

    def use_owner_exchange(self, params) -> bool:
        """After :meth:`create_grid`: with one gradient worker per layer on a 1-D mesh and
        every preconditioned parameter sharded, gradients go to owners and back (gather /
        scatter) instead of being all-gathered everywhere. Returns whether it is on."""
        if (self.sharding is not None and self.world_size > 1 and self.sharding.mesh.ndim == 1
                and self._grid().grad_workers == 1 and all(self.sharding.is_sharded(p) for p in params)
                # owners are named by group rank: the mesh must list the group in order
                and self.sharding.mesh.mesh.reshape(-1).tolist()
                == [self._grid().global_rank(r) for r in range(self.world_size)]):
            self.exchange = OwnerExchange(self.sharding, [self._grid().global_rank(r)
                                                           for r in range(self.world_size)])
        return self.exchange is not None

    # ------------------------------------------------------------------ placement queries
    def is_grad_worker(self, owner: int) -> bool:
        return self._grid().is_grad_worker(owner)

    @property
    def has_receivers(self) -> bool:
        return self._grid().has_receivers

    # ------------------------------------------------------------------ collectives
    def reduce_statistics(self, tensors: Sequence[torch.Tensor]) -> collectives.PendingCollective:
        """Start summing ``tensors`` over the data-parallel group (updated on ``wait()``)."""
        return collectives.all_reduce(tensors, group=self.process_group, cap_bytes=self.bucket_cap_bytes,
                                      symmetric=self.symmetric)

    def reduce_statistics_to_owners(self, by_owner: dict[int, list[torch.Tensor]]
                                    ) -> collectives.PendingCollective:
        """Start summing each owner's tensors onto that owner only (sharded models keep
        factors on owners); elsewhere the tensors' content is unspecified after ``wait()``."""
        return collectives.waiting_all([
            collectives.reduce(tensors, dst=self._grid().global_rank(owner), group=self.process_group,
                               cap_bytes=self.bucket_cap_bytes, symmetric=self.symmetric)
            for owner, tensors in sorted(by_owner.items()) if tensors])

    # ------------------------------------------------------------------ sharded gradients
    def full_gradients(self, grads: dict[str, list]) -> dict[str, list]:
        """Every layer's full gradients on every rank (all-gathers of DTensor shards)."""
        return {name: [None if g is None else self._sharding().full(g) for g in values]
                for name, values in grads.items()}

    def gather_to_owners(self, by_owner: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]]
                         ) -> list[torch.Tensor]:
        """Owner exchange: ``by_owner[r]`` lists ``(param, grad)`` of rank ``r``'s layers; returns
        the full gradients of this rank's own list (zeros where a gradient is missing)."""
        return self._exchange().gather(by_owner).get(self.rank, [])

    def scatter_from_owners(self, by_owner: dict[int, list[torch.Tensor]], mine: list[torch.Tensor]
                            ) -> dict[int, list[torch.Tensor]]:
        """Owner exchange: owners send each rank its rows of their results (``mine``, in the
        order of ``by_owner[self.rank]``); returns this rank's rows per owner."""
        return self._exchange().scatter(by_owner, {self.rank: mine})

    def local(self, tensor) -> torch.Tensor:
        """The writable local piece of a (possibly DTensor) gradient."""
        return self.sharding.local(tensor) if self.sharding is not None else tensor

    def local_rows(self, param, full: torch.Tensor) -> torch.Tensor:
        """The part of a full-size result that this rank's shard of ``param`` holds."""
        return self.sharding.local_rows(param, full) if self.sharding is not None else full

    def sum_over_shards(self, value: torch.Tensor) -> None:
        """In place: sum a per-rank partial value over the ranks that share a model copy."""
        self._sharding().group_sum(value)

    def shares_with(self, owner: int) -> bool:
        """Whether ``owner`` broadcasts refreshed state to a group this rank is in."""
        grid = self._grid()
        return grid.state_group(owner) is not None and grid.is_grad_worker(owner)

    def share_refreshed(self, by_owner: dict[int, list[torch.Tensor]]) -> None:
        """Owners broadcast their refreshed tensors to the gradient workers of their layers.
        ``by_owner`` holds the tensors of every owner this rank :meth:`shares_with`."""
        if self.world_size == 1:
            return
        pending = [collectives.broadcast(tensors, src=self._grid().global_rank(owner),
                                         group=self._grid().state_group(owner), cap_bytes=self.bucket_cap_bytes)
                   for owner, tensors in sorted(by_owner.items())]
        for handle in pending:
            handle.wait()

    def share_with_all(self, by_owner: dict[int, list[torch.Tensor]]) -> None:
        """Owners broadcast tensors to every rank of the group (statistics tensors)."""
        if self.world_size == 1:
            return
        pending = [collectives.broadcast(tensors, src=self._grid().global_rank(owner), group=self.process_group,
                                         cap_bytes=self.bucket_cap_bytes)
                   for owner, tensors in sorted(by_owner.items()) if tensors]
        for handle in pending:
            handle.wait()

    def receive_gradients(self, by_owner: dict[int, list[torch.Tensor]]) -> None:
        """Gradient workers send preconditioned gradients along their row; ``by_owner`` holds
        every layer's output tensors keyed by the layer's owner."""
        by_source: dict[int, list[torch.Tensor]] = {}
        for owner, tensors in by_owner.items():
            by_source.setdefault(self._grid().gradient_source(owner), []).extend(tensors)
        pending = [collectives.broadcast(tensors, src=self._grid().global_rank(source),
                                         group=self._grid().row_group, cap_bytes=self.bucket_cap_bytes)
                   for source, tensors in sorted(by_source.items())]
        for handle in pending:
            handle.wait()

    def enter_gather(self, caller: str, advice: str) -> None:
        """Before a gather that every rank of the group must enter (``caller``): wait, at most
        :data:`GATHER_ENTRY_TIMEOUT` seconds, until every rank has entered it; otherwise raise
        ``RuntimeError`` (``advice`` says what to do) rather than enter a gather that would block
        for good (the usual cause: a trainer that saves on rank 0 only).

        Through the group's key-value store, so it needs no collective of its own and works on
        any backend. Every rank numbers its gathers alike (this preconditioner's count), sets
        ``kron_precond/state_dict/<preconditioner>/<count>/entered/<rank>`` and waits for the
        others' keys. Whether the gather goes ahead is settled once for all ranks (the first
        ``compare_set`` of the verdict key: "go" from a rank that saw every key, else "abort"
        from a rank that gave up), so a rank arriving just as another gives up raises too
        instead of entering the gather alone. The last rank through removes the keys. When
        every rank calls, this is a few store round trips (milliseconds)."""
        if self.world_size == 1:
            return
        store = self._store()
        if store is None:  # a group torch.distributed does not list (nothing to wait with)
            return
        call = self._gathers
        self._gathers += 1
        base = f"kron_precond/state_dict/{self._instance}/{call}"
        entered = [f"{base}/entered/{r}" for r in range(self.world_size)]
        timeout = float(GATHER_ENTRY_TIMEOUT)
        store.set(entered[self.rank], "1")
        try:
            store.wait(entered, datetime.timedelta(seconds=timeout))
            proposal = "go"
        except RuntimeError:  # DistStoreError (FileStore: RuntimeError): a rank is missing
            proposal = f"abort:{self.rank}"
        verdict = store.compare_set(f"{base}/verdict", "", proposal).decode()
        # before this rank counts itself done: the keys stay until every rank is
        missing = [] if verdict == "go" else [r for r in range(self.world_size) if not store.check([entered[r]])]
        if store.add(f"{base}/done", 1) == self.world_size:  # every rank is past the keys
            for key in (*entered, f"{base}/verdict", f"{base}/done"):
                store.delete_key(key)
        if verdict == "go":
            return
        timeout_name = "kron_precond.distributed.runtime.GATHER_ENTRY_TIMEOUT"
        if proposal != "go":  # this rank gave up waiting
            who = f"rank(s) {missing}" if missing else "a rank"
            raise RuntimeError(
                f"{caller} on rank {self.rank}: {who} of the process group did not call it within "
                f"{timeout:g} s ({timeout_name}); it gathers from every rank, so it would never finish (a hang): "
                f"raised instead. {advice} If those ranks were only late (a long save before theirs), raise "
                f"{timeout_name}. This preconditioner's gathers no longer pair up across ranks: end the run.")
        gave_up = int(verdict.split(":", 1)[1])  # this rank was late: it saw every key, after the verdict
        raise RuntimeError(
            f"{caller} on rank {self.rank}: rank(s) [{gave_up}] waited for this rank to call it too "
            f"({timeout_name} seconds) and gave up, so the gather it runs was abandoned: raised here too rather "
            f"than wait for good. {advice} This preconditioner's gathers no longer pair up across ranks: end the run.")

    def _store(self) -> dist.Store | None:
        """The key-value store of the group (``None`` where torch.distributed does not list one)."""
        c10d = dist.distributed_c10d
        try:
            group = self.process_group if self.process_group is not None else c10d._get_default_group()
            return c10d._get_process_group_store(group)
        except (AttributeError, KeyError, ValueError, RuntimeError):
            return None

    def gather_state(self, owner: int, local_state: dict[str, Any] | None) -> dict[str, Any]:
        """The state held by ``owner``'s column, on every rank (moved to the CPU so that it
        unpickles on any device). A collective: every rank calls it for every layer."""
        # after the broadcast: the owner's state (the object it sent, whatever its type)
        payload: list[Any] = [_to_cpu(local_state) if local_state is not None else None]
        dist.broadcast_object_list(payload, src=self._grid().global_rank(owner), group=self.process_group)
        return payload[0]


def _check_process_group(process_group) -> None:
    """``TypeError`` unless ``process_group`` is ``None`` or a ProcessGroup; ``ValueError`` for
    torch's marker of a group this rank is not in (what ``new_group`` returns there)."""
    if process_group is None:
        return
    if dist.is_available() and isinstance(process_group, dist.ProcessGroup):
        return
    marker = dist.GroupMember.NON_GROUP_MEMBER if dist.is_available() else None
    if (type(process_group) is type(marker) and process_group == marker and dist.is_initialized()):
        raise ValueError(f"process_group: this process (global rank {dist.get_rank()}) is not a member of the "
                         "process group given (torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER "
                         "here); build the preconditioner only on the ranks of its process_group, with that group")
    raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got "
                    f"{type(process_group).__name__} {process_group!r}"[:300])


def _collective_device(group) -> torch.device:
    """A device the collectives of ``group``'s backend take tensors on: the current CUDA device
    for NCCL alone, the CPU otherwise (gloo, or a backend per device type that includes it)."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _process_group_counts() -> tuple[int, int]:
    """This process's count of process groups, and of those made by every rank of the world, as
    torch (2.13) names new groups after them (private state: ``-1`` each where it is not there)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    try:
        return len(world.pg_names), int(world.group_count)  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        return -1, -1


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
