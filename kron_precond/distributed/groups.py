"""The grid of gradient-worker and receiver process groups (KAISA).

``R`` ranks, ``W`` gradient workers per layer (``W`` divides ``R``), ``C = R / W``
columns. Rank ``r`` sits at row ``r // C`` and column ``r % C``:

* the *gradient workers* of a layer are the column of its owner: they hold the layer's
  refreshed state (the owner broadcasts it to them) and precondition its gradient;
* every other rank receives that layer's preconditioned gradient from the gradient
  worker in its own row.

COMM_OPT (``W = R``): one column, no gradient traffic. MEM_OPT (``W = 1``): one row,
only the owner holds state and broadcasts the preconditioned gradient every step.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


class WorkerGrid:
    def __init__(self, world_size: int, rank: int, grad_workers: int, process_group=None) -> None:
        if grad_workers < 1 or world_size % grad_workers:
            raise ValueError(f"the number of gradient workers ({grad_workers}) must divide the "
                             f"world size ({world_size})")
        self.world_size = world_size
        self.rank = rank
        self.grad_workers = grad_workers
        self.columns = world_size // grad_workers
        self.process_group = process_group
        self._column_groups: dict[int, object] = {}
        self._row_group: Any = None  # a ProcessGroup (or dist's non-member marker) once built
        if world_size > 1:
            self._create_groups()

    def _create_groups(self) -> None:
        global_ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
        self._global_ranks = global_ranks
        whole = self.process_group if self.process_group is not None else dist.group.WORLD
        my_column, my_row = self.column_of(self.rank), self.row_of(self.rank)
        columns = [[global_ranks[r] for r in range(c, self.world_size, self.columns)] for c in range(self.columns)]
        rows = [[global_ranks[w * self.columns + c] for c in range(self.columns)] for w in range(self.grad_workers)]
        made_by_all = self.creates_groups and spans_the_world(global_ranks)
        if made_by_all:
            # The whole world builds this grid: every rank creates every group, in one order,
            # with torch's world-collective ``new_group``. Its names come from a count every rank
            # advances alike, so they agree whatever other groups single ranks made before (a
            # group made with local synchronisation is named after the number of groups its
            # creator already has, which may differ by rank: such names never met -- a hang).
            made_columns = [dist.new_group(members) for members in columns]
            made_rows = [dist.new_group(members) for members in rows]
        # Otherwise (a sub-group) each rank creates only the groups it belongs to (its column,
        # then its row), with group-local synchronisation: ranks outside ``process_group`` --
        # which never build this grid -- must not be needed, or a sub-group would hang the whole
        # world (torch's default ``new_group`` is collective over every rank of the world). Their
        # names agree only if the ranks have as many process groups each (Runtime.check_agreement).
        if self.grad_workers > 1:
            for column in range(self.columns):
                if self.columns == 1:
                    self._column_groups[column] = whole
                elif made_by_all:
                    self._column_groups[column] = made_columns[column]
                elif column == my_column:
                    self._column_groups[column] = _local_group(columns[column])
                else:  # exists, but this rank is not in it
                    self._column_groups[column] = dist.GroupMember.NON_GROUP_MEMBER
        if self.columns > 1:
            if self.grad_workers == 1:
                self._row_group = whole
            else:
                self._row_group = made_rows[my_row] if made_by_all else _local_group(rows[my_row])

    @property
    def creates_groups(self) -> bool:
        """Whether this grid creates process groups of its own (``1 < grad_workers < world_size``:
        HYBRID_OPT and such fractions); COMM_OPT and MEM_OPT use the process group itself."""
        return self.world_size > 1 and 1 < self.grad_workers < self.world_size

    def row_of(self, rank: int) -> int:
        return rank // self.columns

    def column_of(self, rank: int) -> int:
        return rank % self.columns

    def is_grad_worker(self, owner: int) -> bool:
        """Does this rank hold the state of (and precondition) layers owned by ``owner``?"""
        return self.column_of(self.rank) == self.column_of(owner)

    def state_group(self, owner: int):
        """Group over which ``owner`` broadcasts refreshed state, or ``None`` when it has no
        peers (``GroupMember.NON_GROUP_MEMBER`` when this rank is not in that column)."""
        return self._column_groups.get(self.column_of(owner))

    @property
    def has_receivers(self) -> bool:
        return self.columns > 1

    def gradient_source(self, owner: int) -> int:
        """The gradient worker in this rank's row for layers owned by ``owner``."""
        return self.row_of(self.rank) * self.columns + self.column_of(owner)

    @property
    def row_group(self):
        return self._row_group

    def global_rank(self, rank: int) -> int:
        """Rank in the default group of ``rank`` (a rank of the preconditioner's group)."""
        if self.world_size == 1:
            return rank
        return self._global_ranks[rank]


def spans_the_world(global_ranks: list[int]) -> bool:
    """Whether a group of these global ranks is the whole world (every rank builds its grid)."""
    return len(global_ranks) == dist.get_world_size()


def _local_group(members: list[int]):
    """A new group of the global ranks ``members``, created by those ranks only."""
    return dist.new_group(members, use_local_synchronization=True)
