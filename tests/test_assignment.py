"""Placement of per-layer work on ranks (``assign_work``) and the KAISA worker grid
(``WorkerGrid``) -- no processes.

``assign_work`` is greedy longest-processing-time (LPT). Oracles: hand-made instances
whose perfect partition LPT finds, Graham's bound ``LPT ≤ (4/3 − 1/(3m))·OPT`` against
a brute-force optimum, and the instance on which that bound is tight.

``WorkerGrid`` needs process groups when ``world_size > 1``; here the module's ``dist``
is replaced by a fake that records the groups it is asked to create, so the grid
arithmetic and group membership of every rank are checked without processes (the real
thing is checked in ``test_distributed.py::test_worker_grid_in_a_process_group``).
"""
from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch.nn as nn

from kron_precond import AssignmentStrategy, DistributedStrategy, KronPreconditioner
from kron_precond.distributed import groups as groups_module
from kron_precond.distributed.assignment import assign_work
from kron_precond.distributed.groups import WorkerGrid

COMPUTE, MEMORY = AssignmentStrategy.COMPUTE, AssignmentStrategy.MEMORY


def single_part(costs, memory=None):
    """``{L<i>: {"all": (compute, memory)}}`` from a list of costs."""
    memory = costs if memory is None else memory
    return {f"L{i}": {"all": (float(c), float(m))} for i, (c, m) in enumerate(zip(costs, memory))}


def makespan(assignment) -> float:
    return max(assignment.loads)


def brute_force_optimum(costs, world) -> float:
    """Smallest makespan over all assignments (the first item on rank 0 w.l.o.g.)."""
    costs = np.asarray(costs, dtype=float)
    rest = np.array(list(itertools.product(range(world), repeat=len(costs) - 1)), dtype=int)
    choice = np.concatenate([np.zeros((len(rest), 1), dtype=int), rest], axis=1)
    loads = np.stack([((choice == r) * costs).sum(1) for r in range(world)], axis=1)
    return float(loads.max(1).min())


def check_consistent(assignment, costs, index=0):
    """Every item has an owner and ``loads`` are the owners' cost sums."""
    expected = [0.0] * len(assignment.loads)
    for (layer, part), rank in assignment.owners.items():
        expected[rank] += costs[layer][part][index]
    assert set(assignment.owners) == {(l, p) for l, parts in costs.items() for p in parts}
    assert assignment.loads == pytest.approx(expected)


# ----------------------------------------------------------------------------- balance
@pytest.mark.parametrize("costs,world,loads", [
    ([5, 4, 3, 3, 2, 1], 2, [9, 9]),
    ([6, 5, 4, 3, 2, 1], 3, [7, 7, 7]),
    ([8, 7, 6, 5, 4, 3, 2, 1], 4, [9, 9, 9, 9]),
    ([1, 2, 3, 4, 5, 6, 7, 8], 4, [9, 9, 9, 9]),  # order of registration does not matter
    ([10, 10, 10, 10, 10, 10], 3, [20, 20, 20]),
])
def test_lpt_finds_a_perfect_partition(costs, world, loads):
    result = assign_work(single_part(costs), world)
    assert sorted(result.loads) == loads
    assert result.imbalance == pytest.approx(1.0)
    check_consistent(result, single_part(costs))


def test_lpt_on_its_tight_instance():
    """[3, 3, 2, 2, 2] on 2 ranks: OPT = 6 (3+3 | 2+2+2), LPT = 7 = (4/3 − 1/6)·OPT."""
    result = assign_work(single_part([3, 3, 2, 2, 2]), 2)
    assert sorted(result.loads) == [5, 7]
    assert brute_force_optimum([3, 3, 2, 2, 2], 2) == 6


@pytest.mark.parametrize("world", [2, 3])
def test_lpt_within_graham_bound_of_optimum(world):
    rng = random.Random(world)
    bound = 4 / 3 - 1 / (3 * world)
    worst = 0.0
    for _ in range(40):
        costs = [rng.choice([rng.randint(1, 10), rng.randint(1, 1000)]) for _ in range(rng.randint(world + 1, 8))]
        result = assign_work(single_part(costs), world)
        check_consistent(result, single_part(costs))
        ratio = makespan(result) / brute_force_optimum(costs, world)
        assert ratio <= bound + 1e-12, f"{costs}: LPT/OPT = {ratio:.4f} > {bound:.4f}"
        worst = max(worst, ratio)
    assert worst >= 1.0


def test_more_ranks_than_items():
    result = assign_work(single_part([4, 2]), 4)
    assert result.loads == [4, 2, 0, 0]
    assert result.imbalance == pytest.approx(4 / 1.5)


def test_world_size_one_and_invalid():
    costs = {"a": {"A": (8.0, 4.0), "G": (1.0, 1.0)}, "b": {"A": (27.0, 9.0), "G": (8.0, 4.0)}}
    result = assign_work(costs, 1)
    assert set(result.owners.values()) == {0}
    assert result.loads == [44.0]
    assert result.imbalance == 1.0
    assert assign_work(costs, 1, MEMORY).loads == [18.0]
    with pytest.raises(ValueError, match="world_size"):
        assign_work(costs, 0)


def test_imbalance_is_max_over_mean():
    result = assign_work(single_part([3, 1]), 2)
    assert result.loads == [3, 1] and result.imbalance == pytest.approx(1.5)
    assert assign_work(single_part([0, 0]), 2).imbalance == 1.0  # no work at all


# ----------------------------------------------------------------------------- strategies
def test_memory_and_compute_balance_different_entries():
    # compute ranks A > C > B, memory ranks B > C > A.
    costs = {"A": {"all": (10.0, 1.0)}, "B": {"all": (1.0, 10.0)}, "C": {"all": (6.0, 6.0)}}
    by_compute = assign_work(costs, 2, COMPUTE)
    by_memory = assign_work(costs, 2, MEMORY)
    assert by_compute.layers == {"A": {"all": 0}, "B": {"all": 1}, "C": {"all": 1}}
    assert by_memory.layers == {"A": {"all": 1}, "B": {"all": 0}, "C": {"all": 1}}
    assert by_compute.loads == [10.0, 7.0] and by_memory.loads == [10.0, 7.0]
    check_consistent(by_compute, costs, 0)
    check_consistent(by_memory, costs, 1)
    assert by_compute.strategy is COMPUTE and by_memory.strategy is MEMORY


def test_kfac_costs_are_cubic_for_compute_and_quadratic_for_memory():
    model = nn.Sequential(nn.Linear(7, 3), nn.Linear(3, 11, bias=False))
    precond = KronPreconditioner(model)
    costs = {name: layer.method.factor_costs() for name, layer in precond.layers.items()}
    assert costs == {"0": {"A": (8.0**3, 8.0**2), "G": (3.0**3, 3.0**2)},
                     "1": {"A": (3.0**3, 3.0**2), "G": (11.0**3, 11.0**2)}}
    assert precond.assignment.loads == [8.0**3 + 27 + 27 + 11.0**3]  # world 1, compute


def transformer_blocks(blocks=8, d=64) -> nn.Module:
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d),
                   nn.Linear(d, 4 * d), nn.Linear(4 * d, d)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("strategy", [COMPUTE, MEMORY])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("colocate", [True, False])
def test_transformer_stack_is_balanced(strategy, world, colocate):
    """The benchmark's target: imbalance ≤ 1.15 on an 8-block transformer-like stack."""
    precond = KronPreconditioner(transformer_blocks())
    costs = {name: layer.method.factor_costs() for name, layer in precond.layers.items()}
    result = assign_work(costs, world, strategy, colocate)
    check_consistent(result, costs, 0 if strategy is COMPUTE else 1)
    assert result.imbalance <= 1.15, result.summary()


# ----------------------------------------------------------------------------- colocation
def test_colocation_keeps_a_layer_together():
    costs = {"big": {"A": (8.0, 1.0), "G": (8.0, 1.0)}, "small": {"A": (1.0, 1.0), "G": (1.0, 1.0)}}
    together = assign_work(costs, 2, colocate=True)
    assert together.layers == {"big": {"A": 0, "G": 0}, "small": {"A": 1, "G": 1}}
    assert together.loads == [16.0, 2.0] and together.colocated
    split = assign_work(costs, 2, colocate=False)
    assert split.layers["big"] == {"A": 0, "G": 1}  # the two big factors go to different ranks
    assert split.loads == [9.0, 9.0] and not split.colocated
    check_consistent(split, costs)


def test_colocated_layers_never_split_on_many_ranks():
    rng = random.Random(0)
    costs = {f"L{i}": {"A": (float(rng.randint(1, 500)), 1.0), "G": (float(rng.randint(1, 500)), 1.0)}
             for i in range(13)}
    for world in (2, 3, 4, 5):
        result = assign_work(costs, world, colocate=True)
        assert all(len(set(parts.values())) == 1 for parts in result.layers.values())
        check_consistent(result, costs)
        split = assign_work(costs, world, colocate=False)
        check_consistent(split, costs)
        assert makespan(split) <= makespan(result) * 4 / 3  # finer items never hurt much


# ----------------------------------------------------------------------------- determinism
def test_deterministic_ties_and_registration_order():
    costs = single_part([1, 1, 1, 1, 1])
    first = assign_work(costs, 2)
    assert [first.owner(f"L{i}", "all") for i in range(5)] == [0, 1, 0, 1, 0]  # ties: lowest rank
    again = assign_work({k: dict(v) for k, v in costs.items()}, 2)
    assert again.owners == first.owners and again.loads == first.loads
    # owners are reported in registration order, whatever the placement order
    costs = {"x": {"A": (1.0, 1.0), "G": (5.0, 1.0)}, "y": {"A": (9.0, 1.0), "G": (2.0, 1.0)}}
    result = assign_work(costs, 3, colocate=False)
    assert list(result.owners) == [("x", "A"), ("x", "G"), ("y", "A"), ("y", "G")]
    assert result.owners == {("y", "A"): 0, ("x", "G"): 1, ("y", "G"): 2, ("x", "A"): 2}
    assert "imbalance" in result.summary() and "rank 2" in result.summary()


# ----------------------------------------------------------------------------- grid
class FakeDist:
    """Stands in for ``torch.distributed`` inside ``groups``: records created groups. The grid's
    group is the first ``world`` ranks of a world ``outside`` ranks larger."""

    def __init__(self, world: int, rank: int, outside: int = 0) -> None:
        self.world, self.rank, self.outside = world, rank, outside
        self.created: list[tuple[tuple[int, ...], bool]] = []
        self.group = SimpleNamespace(WORLD="WORLD")
        self.GroupMember = SimpleNamespace(NON_GROUP_MEMBER="not a member")

    def get_process_group_ranks(self, group):
        assert group == "WORLD"
        return list(range(self.world))

    def get_world_size(self, group=None):
        assert group is None
        return self.world + self.outside

    def new_group(self, members, use_local_synchronization=False):
        self.created.append((tuple(members), use_local_synchronization))
        if self.rank not in members:
            assert not use_local_synchronization  # only the members create a local group
            return self.GroupMember.NON_GROUP_MEMBER
        return ("group", tuple(members))


@pytest.mark.parametrize("whole", [True, False], ids=["whole-world", "sub-group"])
@pytest.mark.parametrize("world,workers", [(4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (2, 1), (2, 2), (3, 1), (3, 3)])
def test_worker_grid_arithmetic(monkeypatch, world, workers, whole):
    columns = world // workers
    created_by_rank = []
    for rank in range(world):
        fake = FakeDist(world, rank, outside=0 if whole else 2)
        monkeypatch.setattr(groups_module, "dist", fake)
        grid = WorkerGrid(world, rank, workers)
        created_by_rank.append(fake.created)
        row = [(rank // columns) * columns + c for c in range(columns)]
        for owner in range(world):
            column = [r for r in range(world) if r % columns == owner % columns]
            assert len(column) == workers
            assert grid.is_grad_worker(owner) == (rank in column)
            source = grid.gradient_source(owner)
            assert source in column and source in row  # a grad worker of the layer, in my row
            group = grid.state_group(owner)
            if workers == 1:
                assert group is None  # MEM_OPT: state stays with the owner
            elif columns == 1:
                assert group == "WORLD"  # COMM_OPT: the whole group
            elif rank in column:
                assert group == ("group", tuple(column))
            else:
                assert group == "not a member"
        assert grid.has_receivers == (columns > 1)
        if columns == 1:
            assert grid.row_group is None
        elif workers == 1:
            assert grid.row_group == "WORLD"
        else:
            assert grid.row_group == ("group", tuple(row))
        assert grid.global_rank(rank) == rank
        assert grid.creates_groups == (workers > 1 and columns > 1)
    makes = workers > 1 and columns > 1
    if whole:
        # the whole world builds the grid: every rank creates every group (world-collective
        # new_group, named by a count every rank advances alike), columns then rows, in one order
        expected = [(tuple(range(c, world, columns)), False) for c in range(columns)] + \
                   [(tuple(range(w * columns, (w + 1) * columns)), False) for w in range(workers)]
        assert all(created == (expected if makes else []) for created in created_by_rank)
    else:
        # a sub-group: every group is created by exactly its members (group-local
        # synchronisation), each rank creating its column's group before its row's
        for rank, created in enumerate(created_by_rank):
            assert all(rank in members and local for members, local in created)
            assert len(created) == makes * 2
        for members in {m for created in created_by_rank for m, _ in created}:
            assert [r for r, created in enumerate(created_by_rank) if (members, True) in created] == list(members)


def test_worker_grid_single_process_and_invalid():
    grid = WorkerGrid(1, 0, 1)  # no process group needed
    assert grid.is_grad_worker(0) and grid.gradient_source(0) == 0
    assert grid.state_group(0) is None and grid.row_group is None and not grid.has_receivers
    for world, workers in [(4, 3), (4, 0), (3, 2)]:
        with pytest.raises(ValueError, match="must divide"):
            WorkerGrid(world, 0, workers)


@pytest.mark.parametrize("fraction,world,workers", [
    (DistributedStrategy.COMM_OPT, 4, 4), (DistributedStrategy.MEM_OPT, 4, 1),
    (DistributedStrategy.HYBRID_OPT, 4, 2), (DistributedStrategy.HYBRID_OPT, 3, 1),
    (DistributedStrategy.HYBRID_OPT, 6, 3), (DistributedStrategy.HYBRID_OPT, 9, 3),
    (DistributedStrategy.HYBRID_OPT, 1, 1), (0.5, 4, 2), (0.25, 4, 1), (1 / 3, 3, 1), (1.0, 3, 3),
])
def test_grad_worker_fraction(fraction, world, workers):
    from kron_precond.preconditioner import _grad_workers
    assert _grad_workers(fraction, world) == workers


@pytest.mark.parametrize("fraction,world", [(0.5, 3), (0.75, 4), (0.3, 2), (0.0, 2), (1.5, 2), (True, 2), ("0.5", 2)])
def test_grad_worker_fraction_rejects_non_divisors(fraction, world):
    from kron_precond.preconditioner import _grad_workers
    with pytest.raises(ValueError, match="grad_worker_fraction"):
        _grad_workers(fraction, world)


# ----------------------------------------------------------------------------- equal costs
def test_items_of_equal_cost_spread_over_the_ranks():
    # zero costs (a method with no refresh work to balance): the load never grows, so the item
    # count breaks the tie -- not always rank 0 (every layer on it: [8, 0, 0, 0])
    result = assign_work(single_part([0] * 8), 4)
    per_rank = [sum(1 for r in result.owners.values() if r == rank) for rank in range(4)]
    assert per_rank == [2, 2, 2, 2]
    assert [result.owner(f"L{i}", "all") for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert result.imbalance == pytest.approx(1.0)


def test_a_tie_of_positive_loads_goes_to_the_lowest_rank_as_before():
    # the item count breaks ties of zero loads only: positive loads keep the placement the
    # library always made (a resumed run places its layers where it did). Costs 6, 5, 3, 1, 1, 1
    # on 2 ranks: after 6 | 5+3, 1 and 1 go to rank 0 (8 | 8), and the last 1 to rank 0 (lowest)
    result = assign_work(single_part([3, 1, 1, 1, 6, 5]), 2)
    assert [result.owner(f"L{i}", "all") for i in range(6)] == [1, 0, 0, 0, 0, 1]


def test_imbalance_of_zero_loads_counts_items():
    # every load 0: balance is judged by the items each rank holds, not reported perfect
    result = assign_work(single_part([0] * 3), 2)
    assert result.loads == [0.0, 0.0]
    assert result.imbalance == pytest.approx(2 / 1.5)
    assert assign_work({}, 2).imbalance == 1.0


def test_second_moment_costs_grow_with_the_moment():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(4, 2, bias=False))
    precond = KronPreconditioner(model, method="second_moment")
    costs = [layer.method.factor_costs()["moment"] for layer in precond._layers]
    sizes = [8 * 9, 4 * 9, 2 * 4]
    assert all(c[0] > 0 for c in costs)
    assert [c[0] / s for c, s in zip(costs, sizes)] == pytest.approx([costs[0][0] / sizes[0]] * 3)
