"""Pure placement of per-layer work on ranks: greedy longest-processing-time first.

A work item is a layer (``colocate=True``) or one part of a layer, e.g. one K-FAC
factor (``colocate=False``). Its cost is whatever the strategy balances; the caller
supplies both estimates. No process group is needed, so this is unit-testable.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from kron_precond.enums import AssignmentStrategy


@dataclass(frozen=True)
class WorkAssignment:
    """Owner rank of each ``(layer, part)`` and the estimated load of each rank."""

    owners: dict[tuple[str, str], int]
    loads: list[float]
    strategy: AssignmentStrategy
    colocated: bool = True
    layers: dict[str, dict[str, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layers: dict[str, dict[str, int]] = {}
        for (layer, part), rank in self.owners.items():
            layers.setdefault(layer, {})[part] = rank
        object.__setattr__(self, "layers", layers)

    def owner(self, layer: str, part: str) -> int:
        return self.owners[(layer, part)]

    @property
    def imbalance(self) -> float:
        """Max rank load over mean rank load (1.0 is perfect balance); where every load is 0
        (work estimated as free), of the items each rank holds instead."""
        mean = sum(self.loads) / len(self.loads)
        if mean > 0:
            return max(self.loads) / mean
        counts = self.item_counts
        mean = sum(counts) / len(counts)
        return max(counts) / mean if mean > 0 else 1.0

    @property
    def item_counts(self) -> list[int]:
        """Work items (layers, or parts when not colocated) placed on each rank."""
        counts = [0] * len(self.loads)
        items = {layer: next(iter(parts.values())) for layer, parts in self.layers.items()} if self.colocated \
            else {key: rank for key, rank in self.owners.items()}
        for rank in items.values():
            counts[rank] += 1
        return counts

    def summary(self) -> str:
        lines = [f"work assignment ({self.strategy.value}, colocated={self.colocated}, "
                 f"imbalance {self.imbalance:.3f}):"]
        for rank, load in enumerate(self.loads):
            items = [f"{layer}[{part}]" if not self.colocated else layer
                     for (layer, part), r in self.owners.items() if r == rank]
            items = list(dict.fromkeys(items))
            lines.append(f"  rank {rank}: load {load:.3g}, {len(items)} item(s): {', '.join(items)}")
        return "\n".join(lines)


def assign_work(
    costs: dict[str, dict[str, tuple[float, float]]],
    world_size: int,
    strategy: AssignmentStrategy = AssignmentStrategy.COMPUTE,
    colocate: bool = True,
) -> WorkAssignment:
    """Place work on ``world_size`` ranks, balancing the strategy's cost.

    Args:
        costs: ``{layer: {part: (compute_cost, memory_cost)}}`` in registration order.
        world_size: number of ranks.
        strategy: COMPUTE balances the first estimate, MEMORY the second.
        colocate: keep all parts of a layer on one rank.

    Items are placed largest first on the least-loaded rank; equal positive loads go to the
    lowest rank, equal zero loads to the rank holding fewer items (so items estimated as free
    spread over the ranks), and equal costs keep registration order: every rank computes the
    same answer.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    index = 0 if strategy is AssignmentStrategy.COMPUTE else 1
    items: list[tuple[float, int, str, list[str]]] = []
    order = 0
    for layer, parts in costs.items():
        if colocate:
            items.append((sum(c[index] for c in parts.values()), order, layer, list(parts)))
            order += 1
        else:
            for part, cost in parts.items():
                items.append((cost[index], order, layer, [part]))
                order += 1
    items.sort(key=lambda item: (-item[0], item[1]))
    heap = [(0.0, 0, rank) for rank in range(world_size)]
    loads = [0.0] * world_size
    owners: dict[tuple[str, str], int] = {}
    for item_cost, _, layer, item_parts in items:
        load, count, rank = heapq.heappop(heap)
        loads[rank] = load + item_cost
        # ties of zero loads (items of no cost) go to the rank holding fewest items; ties of
        # positive loads to the lowest rank, as they always did (a load never returns to zero)
        heapq.heappush(heap, (loads[rank], count + 1 if loads[rank] == 0 else 0, rank))
        for part in item_parts:
            owners[(layer, part)] = rank
    # Report in registration order, independent of placement order.
    ordered = {key: owners[key] for key in sorted(owners, key=_registration_key(costs))}
    return WorkAssignment(ordered, loads, strategy, colocate)


def _registration_key(costs):
    position = {(layer, part): i for i, (layer, part) in
                enumerate((l, p) for l, parts in costs.items() for p in parts)}
    return position.__getitem__
