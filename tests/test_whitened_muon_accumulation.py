"""WhitenedMuon under gradient accumulation: a step over micro-batches of any sizes -- a short
last one, a count that changes from step to step (Lightning's GradientAccumulationScheduler,
a resume with another count) -- equals the step on the whole batch.

Reference: the same model stepped on the whole batch, one forward per step. Each micro-batch's
mean loss is weighted by its share of the batch, so the summed gradients are the whole batch's
(the usual accumulation arithmetic, exact for equal micro-batches with ``loss / K``). float64
model, factors and Newton-Schulz: the runs agree to rounding.

The output side's rows carry the loss's ``1/N`` of the step's ``N`` rows; each is scaled back
by the step's row count per module call summed over the micro-batches, not by its own call's.
"""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from kron_precond import RoutedExperts, WhitenedMuon

F64 = torch.float64
ROWS = 12
STEPS = 4


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 10), nn.Tanh(), nn.Linear(10, 3)).double()


class MoE(nn.Module):
    """Fused experts with a fixed routing per token: expert 2 takes only tokens 0-2, so a
    micro-batch without them leaves it idle."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.experts = RoutedExperts(3, 8, 12)
        self.head = nn.Linear(8, 3)
        self.double()

    def forward(self, x, rows):
        h = torch.tanh(self.inp(x))
        index = torch.stack([torch.where(rows < 3, 2, rows % 2), (rows + 1) % 2], dim=1)
        weights = torch.full(index.shape, 0.5, dtype=h.dtype)
        return self.head(self.experts(h, index, weights))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 6, generator=g, dtype=F64), torch.randn(ROWS, 3, generator=g, dtype=F64))
            for _ in range(STEPS)]


def run(make_model, splits, **kwargs) -> list[torch.Tensor]:
    """``splits[step]``: the micro-batch sizes of that step."""
    model = make_model()
    opt = WhitenedMuon(model, lr=0.05, statistics_every=1, ns_dtype=F64, **kwargs)
    for (x, y), sizes in zip(batches(), splits):
        opt.zero_grad()
        start = 0
        for size in sizes:
            rows = torch.arange(start, start + size)
            inputs = (x[rows], rows) if isinstance(model, MoE) else (x[rows],)
            out = model(*inputs)
            (((out - y[rows]) ** 2).mean() * size / ROWS).backward()
            start += size
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


SPLITS = {
    "halves": [[6, 6]] * STEPS,
    "short last": [[9, 3]] * STEPS,
    "count changes": [[12], [9, 3], [4, 4, 4], [12]],
}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("make_model, kwargs", [(mlp, dict(output_side=True)), (MoE, dict(output_side=True))],
                         ids=["mlp", "experts"])
def test_accumulated_micro_batches_step_as_the_whole_batch(make_model, kwargs, split):
    initial = [p.detach().clone() for p in make_model().parameters()]
    whole = run(make_model, [[ROWS]] * STEPS, **kwargs)
    got = run(make_model, SPLITS[split], **kwargs)
    moved = max(float((w - i).abs().max()) for w, i in zip(whole, initial))
    assert moved > 1e-2
    gap = max(float((a - b).abs().max()) for a, b in zip(got, whole))
    assert gap < 1e-10 * moved, f"{split}: {gap:.2e} from the whole batch's step (moved {moved:.2e})"


class Looped(nn.Module):
    """A block applied ``calls`` times per forward (weights shared across depth)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.double()

    checkpoint: bool | None = None  # each application in a region of its own: None, or use_reentrant

    def forward(self, x, calls):
        h = torch.tanh(self.inp(x))
        for _ in range(calls):
            if self.checkpoint is None:
                h = torch.tanh(self.block(h))
            else:
                h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.block(t)), h,
                                                      use_reentrant=self.checkpoint)
        return self.head(h)


@pytest.mark.parametrize("checkpoint", [None, True, False], ids=["plain", "reentrant", "non-reentrant"])
def test_a_block_called_several_times_per_forward_scales_its_rows_by_one_calls_count(checkpoint):
    """Each call's output-gradient rows carry the loss's ``1/n`` of its ``n`` rows, however
    many times the block runs in the forward: its output factor is the mean of ``(n g)(n g)ᵀ``
    over every call's rows (dense float64 reference), also when the number of calls changes
    from step to step (a step's count is one call's rows per backward, not every call's), and
    with each call in an activation-checkpointed region of its own (reentrant checkpointing
    runs each region's backward as a backward of its own, inside the step's)."""
    model, rows, decay = Looped(), 16, 0.8
    model.checkpoint = checkpoint
    opt = WhitenedMuon(model, lr=1e-12, statistics_every=1, ns_dtype=F64, output_side=True, factor_decay=decay)
    g = torch.Generator().manual_seed(2)
    want = None
    for calls in (1, 2, 1, 3):
        x, y = torch.randn(rows, 4, generator=g, dtype=F64), torch.randn(rows, 2, generator=g, dtype=F64)
        outputs: list[torch.Tensor] = []
        def keep(module, args, output, kept=outputs):  # a reentrant checkpoint's first run has no graph
            if output.requires_grad:
                output.retain_grad()
                kept.append(output)

        handle = model.block.register_forward_hook(keep)
        opt.zero_grad()
        ((model(x, calls) - y) ** 2).mean().backward()
        handle.remove()
        reached = [o.grad for o in outputs if o.grad is not None]  # a checkpointed call runs twice
        assert len(reached) == calls
        grads = torch.cat(reached) * rows
        new = grads.T @ grads / grads.shape[0]
        want = new if want is None else want.lerp(new, 1 - decay)
        opt.step()
        got = opt.state[model.block.weight]["output_factor"].reshape(8, 8)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_an_abandoned_iteration_of_non_finite_gradients_adds_no_count():
    """A GradScaler overflow: the iteration's output gradients are not finite and no step()
    comes; its rows are left out of the sums, and so is its count, also when the loop zeroes the
    gradients through the model (``model.zero_grad()``, which the optimizer does not see):
    the output factors are those of the run without that iteration."""
    def run(abandon: bool) -> list[torch.Tensor]:
        model = mlp()
        opt = WhitenedMuon(model, lr=0.05, statistics_every=1, output_side=True, ns_dtype=F64)
        for step, (x, y) in enumerate(batches()):
            model.zero_grad()
            if abandon and step == 1:
                (((model(x) - y) ** 2).mean() * float("inf")).backward()  # the scaler skips step()
                model.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        return [opt.state[p]["output_factor"] for p in model.parameters() if "output_factor" in opt.state[p]]

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_a_skipped_first_iteration_is_dropped_at_the_first_zero_grad():
    """The loop ``backward(); scaler.step(opt); zero_grad()`` with its very first iteration
    skipped (a GradScaler overflow: ``scaler.step`` calls nothing): construction counts as a
    zero_grad, so that iteration's statistics are dropped as any later one's (they were kept).
    Reference: the run without that iteration."""
    results = []
    for skipped in (True, False):
        torch.manual_seed(0)
        model = mlp()
        opt = WhitenedMuon(model, lr=0.02, output_side=True, statistics_every=1)
        data = batches()
        if skipped:
            x, y = data[-1]
            (model(x) - 1e3 * y).square().mean().backward()
            opt.zero_grad()
        for x, y in data[:3]:
            (model(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
