"""Hugging Face ``transformers.Trainer`` with ``optimizers=(PreconditionedOptimizer, scheduler)``
(K-FAC and PSGD) on a one-block GPT-2 built from a config (no downloads), trained on the
bytes of Python's ``os.py`` with ``gradient_accumulation_steps``.

K-FAC registers GPT-2's ``Conv1D`` layers (the tied ``lm_head`` is skipped); the Trainer
calls the wrapper's ``step()`` once per accumulation window. See ``integration_common``
for what is checked. The same GPT-2 adapted with PEFT's LoRA is fine-tuned with one
``WhitenedMuon`` (the adapters whitened, the base frozen), against AdamW on the adapters.
"""
from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from integration_common import (
    WMUON,
    FactorLog,
    RowRecorder,
    assert_same_parameters,
    assert_trains_like_adamw,
    check_factors_saw_every_micro_batch_once,
    make_optimizer,
    require,
    steps_taken,
)
from kron_precond import WhitenedMuon

BATCH, K, STEPS, SEQ, LR = 8, 2, 30, 32, 3e-3
KFAC = dict(damping=1e-2, inv_update_steps=2, factor_decay=0.9, skip_layers=["lm_head"])
RECORDED = "transformer.h.0.mlp.c_fc"


def _transformers():
    transformers = require("transformers")
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    return transformers


def _sequences(count: int) -> torch.Tensor:
    data = torch.frombuffer(bytearray(open(os.__file__, "rb").read()), dtype=torch.uint8).long()
    return data[: count * SEQ].reshape(count, SEQ)


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def _model(transformers):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _fit(method, steps, out_dir, *, record=False, save_steps=None, resume_from=None):
    transformers = _transformers()
    model = _model(transformers)
    optimizer = make_optimizer(method, model, LR, accumulation_steps=K, kfac=KFAC, wmuon=dict(skip_layers=["lm_head"]))
    recorder = log = None
    if record:
        recorder = RowRecorder(model.get_submodule(RECORDED))
        log = FactorLog(optimizer, RECORDED)
    trainer = _train(transformers, model, optimizer, steps, out_dir, save_steps, resume_from)
    return model, optimizer, recorder, log, trainer


def _train(transformers, model, optimizer, steps, out_dir, save_steps, resume_from):
    """The Trainer on os.py's bytes with ``optimizer`` (a 5-step warm-up), trained; returned."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=K, use_cpu=True, report_to=[], seed=0, data_seed=0,
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Dataset(_sequences(BATCH * K * STEPS)),
                                   optimizers=(optimizer, scheduler))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume_from)
    return trainer


@torch.no_grad()
def _lm_loss(model) -> float:
    model.eval()
    tokens = _sequences(BATCH * K * STEPS)
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, 256), tokens[:, 1:].reshape(-1)).item()


def test_hf_trainer_trains_and_sees_every_micro_batch_once(tmp_path):
    transformers = _transformers()
    initial = _lm_loss(_model(transformers))
    losses = {}
    for method in ("adamw", "kfac", "psgd", "wmuon"):
        model, optimizer, recorder, log, trainer = _fit(method, STEPS, tmp_path / method, record=method == "kfac")
        assert trainer.state.global_step == STEPS
        losses[method] = _lm_loss(model)
        assert steps_taken(optimizer, model) == STEPS
        if method == "kfac":
            check_factors_saw_every_micro_batch_once(recorder, log, K, rows_per_step=K * BATCH * SEQ)
    print(f"HF Trainer final losses (initial {initial:.3f}):", losses)
    assert_trains_like_adamw(losses, initial)


@pytest.mark.parametrize("method", ["kfac", "psgd", "wmuon"])
def test_hf_trainer_checkpoint_resumes_to_the_same_update(tmp_path, method):
    steps, save_at = 6, 4
    straight, *_ = _fit(method, steps, tmp_path / "a", save_steps=save_at)
    checkpoint = tmp_path / "a" / f"checkpoint-{save_at}"
    assert checkpoint.is_dir()
    resumed, optimizer, *_ = _fit(method, steps, tmp_path / "b", resume_from=str(checkpoint))
    assert steps_taken(optimizer, resumed) == steps
    assert_same_parameters(straight, resumed)


def _fit_lora(steps, out_dir, *, save_steps=None, resume_from=None, adamw_lr=None):
    """GPT-2 adapted with PEFT's LoRA (its Conv1D projections, fan_in_fan_out), fine-tuned by the
    Trainer with one WhitenedMuon: the adapters whitened, the frozen base left alone."""
    peft = require("peft")
    transformers = _transformers()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, fan_in_fan_out=True,
                             target_modules=["c_attn", "c_proj", "c_fc"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(_model(transformers), config)
    optimizer = (WhitenedMuon(model, lr=10 * LR, **WMUON) if adamw_lr is None else
                 torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=adamw_lr))
    trainer = _train(transformers, model, optimizer, steps, out_dir, save_steps, resume_from)
    return model, optimizer, trainer


def test_hf_trainer_fine_tunes_lora_adapters_with_one_whitened_muon(tmp_path):
    transformers = _transformers()
    base = _model(transformers)
    initial = _lm_loss(base)
    model, optimizer, trainer = _fit_lora(STEPS, tmp_path / "lora")
    assert trainer.state.global_step == STEPS and steps_taken(optimizer, model) == STEPS
    names = {id(p): n for n, p in model.named_parameters()}
    whitened = {names[id(p)] for p in optimizer.param_groups[0]["params"]}
    assert whitened == {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(whitened) == 2 * 4 and all(".lora_" in n for n in whitened)  # A and B of c_attn, 2 c_proj, c_fc
    for name, p in base.named_parameters():  # the base model is frozen: as it was built
        assert torch.equal(model.get_parameter(f"base_model.model.{name}"), p), name
    final = _lm_loss(model)
    # the same adapters trained by AdamW (its lr and 10x it): adapters of a random base learn little
    # in 30 steps (about 0.09 nats for AdamW at any lr), and WhitenedMuon must learn at least as much
    adamw = [_lm_loss(_fit_lora(STEPS, tmp_path / f"adamw{lr}", adamw_lr=lr)[0]) for lr in (LR, 10 * LR)]
    print(f"LoRA under the HF Trainer: {initial:.3f} -> WhitenedMuon {final:.3f}, AdamW {adamw}")
    assert final < min(adamw) < initial
    straight, *_ = _fit_lora(6, tmp_path / "a", save_steps=4)
    resumed, *_ = _fit_lora(6, tmp_path / "b", resume_from=str(tmp_path / "a" / "checkpoint-4"))
    assert_same_parameters(straight, resumed)


def test_a_window_the_grad_scaler_skips_is_dropped_by_the_documented_callback(tmp_path):
    """float16's ``GradScaler`` skips a window whose loss overflowed; the HF ``Trainer`` then
    resets the gradients with ``model.zero_grad()``, which the wrapper never sees, so the
    window's statistics would enter the next step's factors. The callback of docs/API.md drops
    them: the run equals one by hand that never saw that window. The scaler is a CPU one
    (float32 on a CPU), put where ``fp16=True`` puts it (float16 needs a GPU)."""
    transformers = _transformers()
    from kron_precond import KronPreconditioner, PreconditionedOptimizer

    steps, k, batch, seq, poisoned = 5, 2, 4, 8, 2  # micro-batch 2: the first of window 1
    config = transformers.GPT2Config(vocab_size=32, n_positions=seq, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    initial = transformers.GPT2LMHeadModel(config).state_dict()
    tokens = torch.randint(0, 32, (steps * k * batch, seq), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    seen = []

    def collate(items):
        out = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        seen.append({key: value.clone() for key, value in out.items()})
        return out

    settings = dict(accumulation_steps=k, damping=3e-3, factor_update_steps=1, inv_update_steps=2,
                    skip_layers=["lm_head"])

    class Overflowing(transformers.Trainer):
        calls = 0

        def compute_loss(self, model, inputs, **kw):
            loss = super().compute_loss(model, inputs, **kw)
            Overflowing.calls += 1
            return loss * 1e38 if Overflowing.calls - 1 == poisoned else loss

    model = transformers.GPT2LMHeadModel(config)
    model.load_state_dict(initial)
    optimizer = PreconditionedOptimizer(
        torch.optim.SGD(model.parameters(), lr=5e-2),
        KronPreconditioner(model, **settings, grad_scaler=lambda: trainer.accelerator.scaler.get_scale()))

    class DropSkippedStatistics(transformers.TrainerCallback):  # as in docs/API.md
        def on_optimizer_step(self, args, state, control, **kwargs):
            if trainer.accelerator.optimizer_step_was_skipped:
                optimizer.preconditioner.discard_statistics()

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=k,
        logging_steps=100, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=0,
        use_cpu=True, max_grad_norm=0.0)
    trainer = Overflowing(model=model, args=args, train_dataset=dataset, data_collator=collate,
                          optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)),
                          callbacks=[DropSkippedStatistics()])
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert optimizer.preconditioner._steps == steps - 1  # the poisoned window was skipped

    def by_hand(drop_window: bool):
        twin = transformers.GPT2LMHeadModel(config)
        twin.load_state_dict(initial)
        opt = PreconditionedOptimizer(torch.optim.SGD(twin.parameters(), lr=5e-2), KronPreconditioner(twin, **settings))
        for step in range(steps):
            if drop_window and step == poisoned // k:
                continue
            window = seen[step * k:(step + 1) * k]
            items = sum(int(b["labels"].numel()) for b in window)
            opt.zero_grad()
            for b in window:
                twin(**b, num_items_in_batch=torch.tensor(items)).loss.backward()
            opt.step()
        return twin

    def gap(other):
        return max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), other.parameters()))

    assert gap(by_hand(drop_window=True)) < 1e-6
    assert gap(by_hand(drop_window=False)) > 1e-2  # the reference can tell
