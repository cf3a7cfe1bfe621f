"""Hugging Face Accelerate with one ``WhitenedMuon``: ``accelerator.prepare(model, optimizer,
loader, scheduler)`` on CPU, checked against a plain PyTorch loop with the same optimizer on the
same batches (``test_integration_lightning_wmuon.plain_loop``: float64 model, factors and
Newton-Schulz; the comparisons are bitwise -- parameters and every optimizer state tensor --
but the whole-batch one, to rounding).

Accelerate wraps the optimizer in ``AcceleratedOptimizer``, which calls ``WhitenedMuon.step()``
and ``zero_grad()`` only on the micro-batch that ends an accumulation window
(``accelerator.accumulate(model)``); WhitenedMuon reads the statistics of every micro-batch's
forward and backward through its own hooks and takes no accumulation setting (docs/API.md,
"Trainer frameworks"), so the window's step must be the whole batch's.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import test_integration_lightning_wmuon as common
from kron_precond import WhitenedMuon

F64 = torch.float64


def _accelerator(**kwargs):
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not importable")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # a fresh Accelerator per run (its state is a singleton)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, **kwargs)


def fit(kind, steps, *, k=1, clip=None, bf16=False, save_to=None, save_at=None, resume_from=None,
        scheduler=True, micro_batches=None, evaluate=False):
    """``steps`` optimizer steps of ``k`` micro-batches under ``accelerator.accumulate``; the
    optimizer's inner ``step()`` / ``zero_grad()`` calls counted."""
    accelerator = _accelerator(gradient_accumulation_steps=k, mixed_precision="bf16" if bf16 else "no")
    dtype = torch.float32 if bf16 else F64
    model = common.make_model(kind, dtype)
    optimizer = WhitenedMuon(model, **common.settings(dtype))
    calls = {"step": 0, "zero_grad": 0}
    optimizer.register_step_post_hook(lambda *_: calls.__setitem__("step", calls["step"] + 1))
    inner_zero_grad = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        calls["zero_grad"] += 1
        inner_zero_grad(set_to_none=set_to_none)
    optimizer.zero_grad = zero_grad
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, common.warmup if scheduler else lambda _: 1.0)
    loader = DataLoader(common.data(micro_batches or steps * k), batch_size=common.BATCH, shuffle=False)
    model, wrapped, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    assert wrapped.optimizer is optimizer
    done = 0
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        done = save_at
        loader = accelerator.skip_first_batches(loader, save_at * k)
    micro_batches = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = common.lm_loss(model(x), y)
            accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            wrapped.step()
            scheduler.step()
            wrapped.zero_grad()
        micro_batches += 1
        if evaluate:  # an evaluation after every micro-batch: eval mode, inference mode
            model.eval()
            with torch.inference_mode():
                model(x.flip(0))
            model.train()
        if accelerator.sync_gradients:
            done += 1
            assert calls["step"] == calls["zero_grad"] == done - (save_at if resume_from else 0)
            if save_to is not None and done == save_at:
                accelerator.save_state(str(save_to))
        else:  # AcceleratedOptimizer did not call WhitenedMuon on this micro-batch
            assert calls["step"] == calls["zero_grad"] == micro_batches // k
    assert done == steps
    return accelerator.unwrap_model(model), optimizer, calls


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_accelerate_steps_as_the_plain_loop(kind):
    steps = 6
    model, optimizer, calls = fit(kind, steps)
    assert calls["step"] == steps
    reference, ref_opt = common.plain_loop(kind, steps)
    assert common.moved(reference, kind) > 1e-2
    common.assert_bitwise(model, optimizer, reference, ref_opt)


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_accelerate_accumulation_steps_once_per_window_as_the_whole_batch(kind):
    """``gradient_accumulation_steps=2``: WhitenedMuon's ``step()`` and ``zero_grad()`` run once per
    window (counted on every micro-batch); the result equals the plain loop accumulating two
    micro-batches bitwise and the plain loop on the whole batch to rounding, so the hooks read
    both micro-batches' forwards and backwards, once each. An evaluation forward (eval mode,
    inference mode) after every micro-batch adds nothing."""
    steps, k = 5, 2
    model, optimizer, calls = fit(kind, steps, k=k, evaluate=True)
    assert calls == {"step": steps, "zero_grad": steps}
    reference, ref_opt = common.plain_loop(kind, steps, k)
    common.assert_bitwise(model, optimizer, reference, ref_opt)
    whole, _ = common.plain_loop(kind, steps, 1, batch=k * common.BATCH)
    last_only, _ = common.plain_loop(kind, steps, 1)  # as if one micro-batch a step counted
    gap = common.max_relative_gap(model, whole)
    assert gap < 1e-12, f"accumulated two micro-batches vs the whole batch: relative gap {gap:.2e}"
    assert common.max_relative_gap(whole, last_only) > 1e-3


def test_accelerate_clip_grad_norm_clips_as_the_plain_loop():
    steps, k, clip = 5, 2, 0.05
    model, optimizer, _ = fit("mha", steps, k=k, clip=clip)
    reference, ref_opt = common.plain_loop("mha", steps, k, clip=clip, clip_order="model")
    common.assert_bitwise(model, optimizer, reference, ref_opt)
    unclipped, _ = common.plain_loop("mha", steps, k)
    assert common.max_relative_gap(reference, unclipped) > 1e-6  # the clip changed the run


def test_accelerate_short_last_window():
    """5 micro-batches under ``gradient_accumulation_steps=2``: Accelerate ends the last window
    at the end of the loader, with one micro-batch divided by 2; see
    ``common.check_short_last_window``."""
    model, optimizer, calls = fit("mha", 3, k=2, scheduler=False, micro_batches=common.SHORT_LAST)
    assert calls["step"] == 3
    common.check_short_last_window(model, optimizer)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_accelerate_save_state_load_state_resumes_bitwise(tmp_path, k, kind):
    """``accelerator.save_state`` after step 5 of 8 (statistics every 2 steps: out of phase),
    ``load_state`` into a fresh model, optimizer and scheduler, the loader's first batches
    skipped: bitwise the uninterrupted run, which is the plain loop."""
    steps, save_at = 8, 5
    straight, straight_opt, _ = fit(kind, steps, k=k, save_to=tmp_path / "ckpt", save_at=save_at)
    resumed, resumed_opt, calls = fit(kind, steps, k=k, resume_from=tmp_path / "ckpt", save_at=save_at)
    assert calls["step"] == steps - save_at
    common.assert_bitwise(resumed, resumed_opt, straight, straight_opt)
    reference, ref_opt = common.plain_loop(kind, steps, k)
    common.assert_bitwise(straight, straight_opt, reference, ref_opt)


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_accelerate_bf16_mixed_precision_steps_as_the_autocast_loop(kind):
    """``mixed_precision="bf16"`` on CPU: Accelerate runs the model's forward under CPU autocast and
    casts its outputs to float32; the plain loop does the same by hand. Factors stay float32."""
    steps, k = 4, 2
    model, optimizer, _ = fit(kind, steps, k=k, bf16=True)
    reference, ref_opt = common.plain_loop(kind, steps, k, bf16=True, loss_in_autocast=False)
    factors = [v for entry in optimizer.state.values() for key, v in entry.items()
               if isinstance(v, torch.Tensor) and "factor" in key]
    assert factors and all(f.dtype == torch.float32 and bool(f.isfinite().all()) for f in factors)
    common.assert_bitwise(model, optimizer, reference, ref_opt)
    without_autocast, _ = common.plain_loop(kind, steps, k, dtype=torch.float32)
    assert common.max_relative_gap(reference, without_autocast) > 1e-4  # autocast changed the run
