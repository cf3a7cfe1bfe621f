"""``state_dict()`` under MEM_OPT / HYBRID_OPT is a collective: a rank that enters it alone
raises instead of hanging.

With ``grad_worker_fraction < 1`` (not sharded) no rank holds every layer's refreshed state,
so ``PreconditionedOptimizer.state_dict()`` (and ``KronPreconditioner.gather_state_dict()``)
gathers it from the ranks that hold it. A trainer that saves on rank 0 only (the Hugging
Face ``Trainer``: ``if self.args.should_save``) used to leave rank 0 blocked for good in
that gather while rank 1 went on into the next backward's all-reduce. Before gathering, each
rank now checks through the process group's key-value store, with a bounded wait
(``kron_precond.distributed.runtime.GATHER_ENTRY_TIMEOUT``, lowered here), that every rank
entered the gather; otherwise it raises ``RuntimeError`` naming COMM_OPT. When every rank
calls it (Accelerate, Lightning, a hand-written loop), the result is what it was.

References: the refreshed state each rank holds locally (``layer.method.state_dict()`` on
the layer's gradient workers), a run resumed from the checkpoint against the uninterrupted
run (bitwise), and the Hugging Face ``Trainer`` itself for the reviewer's scenario.
"""
from __future__ import annotations

import copy
import datetime
import logging
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import WorkerFailed, run_workers
from kron_precond import DistributedStrategy, KronPreconditioner, PreconditionedOptimizer
from kron_precond.distributed import runtime as runtime_module

DT = torch.float64
ENTRY_TIMEOUT = 4.0  # the lowered bounded wait of the gather's entry check (seconds)
KFAC = dict(method="kfac", damping=1e-2, inv_update_steps=1, kl_clip=None)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _batch(step, n=16):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g, dtype=DT), torch.randn(n, 3, generator=g, dtype=DT)


def _build(strategy, seed=0):
    model = _model(seed)
    opt = PreconditionedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  KronPreconditioner(model, grad_worker_fraction=strategy, **KFAC))
    return model, opt


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        x, y = _batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # every rank the same batch: no averaging needed
        opt.step()


def _store():
    return dist.distributed_c10d._get_default_store()


def _call_both(opt, result: dict) -> None:
    """Call ``state_dict()`` and ``gather_state_dict()``; record what each did and how long it took."""
    for name, call in (("state_dict", opt.state_dict), ("gather_state_dict", opt.preconditioner.gather_state_dict)):
        start = time.monotonic()
        try:
            call()
            result[name] = "returned"
        except RuntimeError as err:
            result[name] = str(err)
        result[f"{name}_seconds"] = time.monotonic() - start


def _leftover_keys() -> list[str]:
    """Keys of the library's entry checks still in the store (they are cleaned up)."""
    return [k for k in _store().list_keys() if "kron_precond" in k]


# ---------------------------------------------------------------------- rank 0 alone
def _rank0_alone(rank, world, out_dir, entry_timeout):
    """Rank 0 calls state_dict() (and gather_state_dict()) alone, as the HF Trainer's save
    does; rank 1 waits on the store (not in a collective) until rank 0 is done, then calls
    state_dict() late."""
    runtime_module.GATHER_ENTRY_TIMEOUT = entry_timeout
    result = {}
    # COMM_OPT: every rank holds every layer, state_dict() is local: rank 0 alone is fine
    model, opt = _build(DistributedStrategy.COMM_OPT)
    _train(model, opt, 2)
    if rank == 0:
        start = time.monotonic()
        state = opt.state_dict()
        result["comm_opt_seconds"] = time.monotonic() - start
        result["comm_opt_layers"] = sorted(state["preconditioner"]["layers"])

    model, opt = _build(DistributedStrategy.MEM_OPT)
    _train(model, opt, 2)
    if rank == 0:
        _call_both(opt, result)
        _store().set("test/rank0_done", "1")
    else:
        _store().wait(["test/rank0_done"], datetime.timedelta(seconds=600))
        # too late: rank 0 gave up on both calls; rank 1 raises at once instead of hanging
        _call_both(opt, result)
        _store().set("test/rank1_done", "1")
    _store().wait(["test/rank0_done", "test/rank1_done"], datetime.timedelta(seconds=600))
    result["leftover_keys"] = _leftover_keys()
    return result


def test_state_dict_on_rank_0_alone_raises_naming_comm_opt_instead_of_hanging(tmp_path):
    started = time.monotonic()
    first, second = run_workers(_rank0_alone, 2, tmp_path, ENTRY_TIMEOUT, timeout=90)
    assert time.monotonic() - started < 80
    # COMM_OPT: local, no wait
    assert first["comm_opt_layers"] == ["0", "2", "4"]
    assert first["comm_opt_seconds"] < 1.0
    for name, caller in (("state_dict", "PreconditionedOptimizer.state_dict()"),
                         ("gather_state_dict", "gather_state_dict()")):
        message = first[name]
        assert message != "returned"
        assert caller in message and "COMM_OPT" in message and "every rank" in message, message
        assert "MEM_OPT" in message and "rank(s) [1]" in message, message
        assert "GATHER_ENTRY_TIMEOUT" in message, message
        # raised after the bounded wait, not much later
        assert ENTRY_TIMEOUT - 0.5 <= first[f"{name}_seconds"] < ENTRY_TIMEOUT + 10, first
        # the late rank raises at once: the gather it would join was abandoned
        late = second[name]
        assert late != "returned"
        assert "gave up" in late and "rank(s) [0]" in late and "COMM_OPT" in late, late
        assert second[f"{name}_seconds"] < 2.0, second
    # both ranks went through both checks: every key was removed
    assert first["leftover_keys"] == [] and second["leftover_keys"] == []


# ---------------------------------------------------------------------- every rank
def _every_rank(rank, world, out_dir):
    """Every rank calls state_dict() (twice) and gather_state_dict(): the check passes at
    once, the results are the whole state, and a resumed run follows the original one."""
    runtime_module.GATHER_ENTRY_TIMEOUT = 60.0  # passing checks must not come near it
    model, opt = _build(DistributedStrategy.MEM_OPT)
    precond = opt.preconditioner
    _train(model, opt, 3)
    # snapshots (state dicts hold references to live tensors, which training changes in place)
    held = copy.deepcopy({name: layer.method.state_dict() for name, layer in precond.layers.items()
                          if precond._holds_state(layer)})
    seconds = []
    states = []
    for call in (opt.state_dict, opt.state_dict, precond.gather_state_dict):
        dist.barrier()  # the ranks enter together: what is timed is the call itself
        start = time.monotonic()
        states.append(copy.deepcopy(call()))
        seconds.append(time.monotonic() - start)
    first, second, gathered = states
    dist.barrier()
    leftover = _leftover_keys()

    # resumed from the checkpoint (on every rank) == uninterrupted
    fresh_model, fresh = _build(DistributedStrategy.MEM_OPT, seed=5)
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_state_dict(copy.deepcopy(first))  # load shares its tensors
    _train(model, opt, 2, start=3)
    _train(fresh_model, fresh, 2, start=3)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))
    return {"held": held, "first": first, "second": second, "gathered": gathered, "seconds": seconds,
            "leftover_keys": leftover, "resumed_same": same}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_state_dict_on_every_rank_is_the_whole_state_at_once_and_resumes(tmp_path):
    results = run_workers(_every_rank, 2, tmp_path, timeout=120)
    held_by = {}
    for rank, result in enumerate(results):
        for name in result["held"]:
            held_by.setdefault(name, rank)
    assert sorted(held_by) == ["0", "2", "4"] and set(held_by.values()) == {0, 1}  # no rank holds all
    for result in results:
        first, second, gathered = result["first"], result["second"], result["gathered"]
        assert sorted(first["preconditioner"]["layers"]) == ["0", "2", "4"]
        # each layer's state is what its holder has locally
        for name, rank in held_by.items():
            assert _same(first["preconditioner"]["layers"][name], results[rank]["held"][name]), name
        # a second call (the call counters stay in step) and the explicit gather agree
        assert _same(first, second)
        assert _same(first["preconditioner"], gathered)
        assert _same(first, results[0]["first"])
        assert result["resumed_same"]
        # no wait when every rank calls it (generous bound for a loaded 2-core machine)
        assert max(result["seconds"]) < 2.0, result["seconds"]
        assert result["leftover_keys"] == []


# ---------------------------------------------------------------------- the HF Trainer
class _TrainerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 2)

    def forward(self, x, labels=None):
        out = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return {"loss": F.mse_loss(out, labels), "logits": out}


class _TrainerData(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _hf_trainer(rank, world, out_dir, strategy, entry_timeout):
    """The reviewer's scenario: HF Trainer under DDP (gloo, CPU), saving every 2 steps (the
    Trainer calls optimizer.state_dict() on rank 0 only)."""
    runtime_module.GATHER_ENTRY_TIMEOUT = entry_timeout
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import transformers
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, f"run_{strategy}"), per_device_train_batch_size=8, max_steps=4,
        save_steps=2, save_strategy="steps", logging_steps=100, report_to=[], ddp_backend="gloo",
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False)
    _ = args.device  # the Trainer's distributed state (the group the harness made)
    torch.manual_seed(0)
    model = _TrainerNet()
    precond = KronPreconditioner(model, method="kfac", grad_worker_fraction=strategy, inv_update_steps=2)
    opt = PreconditionedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), precond)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_TrainerData(), optimizers=(opt, None))
    trainer.train()
    return sorted(os.listdir(args.output_dir))


def test_hf_trainer_saving_on_rank_0_raises_under_mem_opt_and_saves_under_comm_opt(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    started = time.monotonic()
    with pytest.raises(WorkerFailed) as failure:
        run_workers(_hf_trainer, 2, tmp_path / "mem", "mem_opt", ENTRY_TIMEOUT, timeout=120)
    message = str(failure.value)
    assert "rank 0: raised" in message, message
    assert "RuntimeError" in message and "COMM_OPT" in message and "Trainer" in message, message
    assert time.monotonic() - started < 100
    # COMM_OPT: every rank holds every layer, state_dict() is local: the Trainer saves
    results = run_workers(_hf_trainer, 2, tmp_path / "comm", "comm_opt", ENTRY_TIMEOUT, timeout=120)
    assert results[0] == ["checkpoint-2", "checkpoint-4"]
