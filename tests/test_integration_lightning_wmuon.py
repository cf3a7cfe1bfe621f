"""PyTorch Lightning with one ``WhitenedMuon`` returned by ``configure_optimizers`` (and a step
LR scheduler in its dict), checked against a plain PyTorch loop with the same optimizer on the
same batches.

Reference: ``plain_loop`` -- ``zero_grad``, ``K`` forward/backward passes of ``loss / K``
(what Lightning's closure computes), ``clip_grad_norm_`` over the param groups' parameters
(what ``gradient_clip_val`` calls), ``step()``, ``scheduler.step()``. float64 models,
factors and Newton-Schulz, so every comparison but the whole-batch one is bitwise: the
parameters and every optimizer state tensor. Under accumulation ``WhitenedMuon`` takes no
setting (docs/API.md, "Trainer frameworks": it scales each step's rows by the step's own
row count); the plain loop on the whole batch, one forward per step, must then agree to
rounding (relative 1e-12) -- also with a validation loop between steps and a
``GradientAccumulationScheduler``. A short last window (an epoch's micro-batches not a multiple
of the count) is the exception: Lightning and Accelerate divide its loss by the count ``k``, not
its ``r`` micro-batches, so the loss is not the mean over the step's rows that the rule needs,
and the output side's new factor term is ``(r / k)²`` of the whole batch's (pinned by
``check_short_last_window``; the input side is unaffected).

Models: a small transformer from torch modules (embedding, ``nn.MultiheadAttention`` in
self-attention, an ungated GELU MLP, whose first layer ``output_side="auto"`` whitens on both
sides) and a 2-layer GPT-2 built from ``GPT2Config`` (``Conv1D`` weights, the fused ``c_attn``
split, the tied head in AdamW).
"""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from kron_precond import WhitenedMuon

VOCAB, SEQ, D, BATCH = 16, 8, 16, 4
F64 = torch.float64


def settings(dtype: torch.dtype) -> dict:
    return dict(lr=0.02, statistics_every=2, factor_decay=0.8, ns_dtype=dtype)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.head = nn.Linear(D, VOCAB)
        self.register_buffer("mask", torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        a = self.norm1(h)
        h = h + self.attn(a, a, a, attn_mask=self.mask, need_weights=False)[0]
        h = h + self.mlp(self.norm2(h))
        return self.head(h)


class GPT2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        transformers.logging.set_verbosity_error()
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         attn_implementation="eager")
        self.lm = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens).logits


MODELS = {"mha": TinyTransformer, "gpt2": GPT2}


def make_model(kind: str, dtype: torch.dtype = F64) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]().to(dtype)


def data(batches: int) -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (batches * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def plain_loop(kind, steps, k=1, *, batch=BATCH, clip=None, bf16=False, scheduler=True, epochs=1, dtype=None,
               clip_order="optimizer", loss_in_autocast=True):
    """The reference: the same WhitenedMuon and scheduler on the same batches, by hand; ``steps``
    an epoch, the epochs going over the same batches again. ``bf16``: a float32 model, its
    forward (and the loss, ``loss_in_autocast``, as Lightning's training step; else on the
    outputs cast to float32, as Accelerate's wrapped forward) under CPU autocast. ``clip``:
    ``clip_grad_norm_`` over the param groups' parameters (Lightning) or the model's (``"model"``,
    as passed to ``accelerator.clip_grad_norm_``)."""
    dtype = dtype or (torch.float32 if bf16 else F64)
    model = make_model(kind, dtype)
    optimizer = WhitenedMuon(model, **settings(dtype))
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup) if scheduler else None
    x, y = data(steps * k * batch // BATCH).tensors
    for step in list(range(steps)) * epochs:
        optimizer.zero_grad()
        for micro in range(k):
            rows = slice((step * k + micro) * batch, (step * k + micro + 1) * batch)
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                out = model(x[rows])
                if loss_in_autocast:
                    loss = lm_loss(out, y[rows])
            if not loss_in_autocast:
                loss = lm_loss(out.float(), y[rows])
            (loss / k).backward()
        if clip is not None:
            params = (model.parameters() if clip_order == "model" else
                      [p for g in optimizer.param_groups for p in g["params"]])
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        if sched is not None:
            sched.step()
    return model, optimizer


def plain_windows(kind, windows, *, micro_batches=None, scheduler=False):
    """The reference for irregular windows: ``windows[step]`` lists ``(first row, rows, loss weight)``
    of each micro-batch of that step, in a data set of ``micro_batches`` (default: as many as
    the windows hold)."""
    model = make_model(kind)
    optimizer = WhitenedMuon(model, **settings(F64))
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup) if scheduler else None
    x, y = data(micro_batches or sum(n for window in windows for _, n, _ in window) // BATCH).tensors
    for window in windows:
        optimizer.zero_grad()
        for first, n, weight in window:
            (lm_loss(model(x[first:first + n]), y[first:first + n]) * weight).backward()
        optimizer.step()
        if sched is not None:
            sched.step()
    return model, optimizer


SHORT_LAST = 5  # micro-batches of BATCH rows in the epoch: windows of 2, 2 and a short last one of 1


def check_short_last_window(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A run over ``SHORT_LAST`` micro-batches with 2 a window, as Lightning and Accelerate run it:
    each micro-batch's loss divided by 2, the short last window's too (the third step, a
    statistics step). It equals bitwise the plain loop doing the same. Against the plain loop on
    the whole batch of each step (its loss the mean over the step's rows): every input-side
    factor agrees to rounding; the output side's (``mlp.0``, whitened by ``"auto"``) new term of
    the short window is ``(r / k)² = 1/4`` of the whole batch's, since its output-gradient rows
    are scaled by the step's row count and carry ``1 / (k · rows)`` instead of ``1 / rows``."""
    quarter = [[(0, BATCH, 0.5), (BATCH, BATCH, 0.5)], [(2 * BATCH, BATCH, 0.5), (3 * BATCH, BATCH, 0.5)],
               [(4 * BATCH, BATCH, 0.5)]]
    reference, ref_opt = plain_windows("mha", quarter)
    assert_bitwise(model, optimizer, reference, ref_opt)
    whole, whole_opt = plain_windows("mha", [[(0, 2 * BATCH, 1.0)], [(2 * BATCH, 2 * BATCH, 1.0)],
                                             [(4 * BATCH, BATCH, 1.0)]])
    before, before_opt = plain_windows("mha", [[(0, 2 * BATCH, 1.0)], [(2 * BATCH, 2 * BATCH, 1.0)]])
    checked = 0
    for (name, p), q, b in zip(model.named_parameters(), whole.parameters(), before.parameters()):
        for key, value in optimizer.state[p].items():
            if key == "input_factor":
                ref = whole_opt.state[q][key]
                gap = float((value - ref).abs().max() / ref.abs().max())
                assert gap < 1e-12, f"{name} {key}: relative gap {gap:.2e} from the whole batch's"
                checked += 1
            if key == "output_factor":
                decay = settings(F64)["factor_decay"]
                previous, ref = before_opt.state[b][key], whole_opt.state[q][key]
                term = (ref - decay * previous) / (1 - decay)  # the whole batch's new term
                expected = decay * previous + (1 - decay) * term / 4
                assert float((value - expected).abs().max() / expected.abs().max()) < 1e-12, name
                assert float((value - ref).abs().max() / ref.abs().max()) > 1e-2, name
                checked += 1
    assert checked >= 5


def _lightning():
    pl = pytest.importorskip("lightning.pytorch", reason="lightning is not importable")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return pl


def _module(pl, kind, *, bf16=False, scheduler=True):
    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(kind, torch.float32 if bf16 else F64)
            self.inner_steps = 0

        def training_step(self, batch, batch_index):
            x, y = batch
            return lm_loss(self.net(x), y)

        def configure_optimizers(self):
            optimizer = WhitenedMuon(self, **settings(torch.float32 if bf16 else F64))  # the whole LightningModule

            def count(*_):
                self.inner_steps += 1
            optimizer.register_step_post_hook(count)
            if not scheduler:
                return optimizer
            sched = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Module()


def fit(kind, steps_per_epoch, epochs, root, *, k=1, clip=None, bf16=False, scheduler=True,
        callbacks=(), ckpt_path=None, loader_class=DataLoader, micro_batches=None):
    pl = _lightning()
    module = _module(pl, kind, bf16=bf16, scheduler=scheduler)
    trainer = pl.Trainer(max_epochs=epochs, accumulate_grad_batches=k, gradient_clip_val=clip,
                         precision="bf16-mixed" if bf16 else "32-true", accelerator="cpu", devices=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=list(callbacks), default_root_dir=str(root),
                         num_sanity_val_steps=0, deterministic=True)
    loader = loader_class(data(micro_batches or steps_per_epoch * k), batch_size=BATCH, shuffle=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|ckpt_path|"
                                                  "precision|bf16).*")
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, trainer


def assert_bitwise(model_a: nn.Module, opt_a: torch.optim.Optimizer, model_b: nn.Module,
                   opt_b: torch.optim.Optimizer) -> None:
    """Same parameters, and the same optimizer state tensor by tensor, exactly."""
    params_a = list(model_a.parameters())
    assert len(params_a) == len(list(model_b.parameters()))
    for a, (name, b) in zip(params_a, model_b.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), (
            f"{name}: max |diff| {float((a.double() - b.double()).abs().max()):.3e}")
    model_names = {id(p): n for n, p in model_b.named_parameters()}
    names = [model_names[id(p)] for g in opt_b.param_groups for p in g["params"]]  # the state's indices
    def layout(opt):
        return [(g["algorithm"], len(g["params"]), g["lr"]) for g in opt.param_groups]
    assert layout(opt_a) == layout(opt_b)  # the same groups, and the scheduler set the same lr
    state_a = opt_a.state_dict()["state"]
    state_b = opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        assert state_a[index].keys() == state_b[index].keys(), (names[index], state_a[index].keys(),
                                                                 state_b[index].keys())
        for key, value in state_a[index].items():
            other = state_b[index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"{names[index]}[{key}]"
            else:
                assert value == other, f"{names[index]}[{key}]: {value} vs {other}"


@torch.no_grad()
def moved(model: nn.Module, kind: str, dtype=F64) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(model.parameters(), make_model(kind, dtype).parameters()))


@torch.no_grad()
def max_relative_gap(model_a: nn.Module, model_b: nn.Module) -> float:
    """The largest gap of a parameter relative to its largest entry. The key's third of an
    attention's fused bias (``in_proj_bias``, GPT-2's ``c_attn.bias``) is left out: softmax does
    not see it, so its gradient is rounding noise about zero, which AdamW's first steps scale up
    to ``lr · g / (|g| + eps)``."""
    gaps = []
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        if name.endswith(("in_proj_bias", "c_attn.bias")):
            d = a.shape[0] // 3
            a, b = torch.cat([a[:d], a[2 * d:]]), torch.cat([b[:d], b[2 * d:]])
        gaps.append(float((a - b).abs().max() / b.abs().max()))
    return max(gaps)


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_lightning_steps_as_the_plain_loop(tmp_path, kind):
    steps = 6
    module, trainer = fit(kind, steps, 1, tmp_path)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, WhitenedMuon) and trainer.global_step == steps and module.inner_steps == steps
    whitened = [n for n, p in module.named_parameters()
                if any(p is q for g in optimizer.param_groups if g["algorithm"] == "whitened_muon"
                       for q in g["params"])]
    assert len(whitened) >= 4, whitened
    reference, ref_opt = plain_loop(kind, steps)
    assert moved(reference, kind) > 1e-2
    assert_bitwise(module.net, optimizer, reference, ref_opt)


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_lightning_accumulate_grad_batches_steps_as_the_plain_loop_accumulating(tmp_path, kind):
    """``accumulate_grad_batches=2``: Lightning runs the first micro-batch's closure itself and
    passes the second to ``step(closure)``; WhitenedMuon needs no setting for it. Equal bitwise
    to the plain loop accumulating two micro-batches, and to rounding to the whole batch."""
    steps, k = 5, 2
    module, trainer = fit(kind, steps, 1, tmp_path, k=k)
    assert trainer.global_step == steps and module.inner_steps == steps
    reference, ref_opt = plain_loop(kind, steps, k)
    assert_bitwise(module.net, trainer.optimizers[0], reference, ref_opt)
    whole, _ = plain_loop(kind, steps, 1, batch=k * BATCH)
    assert moved(whole, kind) > 1e-2
    gap = max_relative_gap(module.net, whole)
    assert gap < 1e-12, f"accumulated two micro-batches vs the whole batch: relative gap {gap:.2e}"


def test_lightning_gradient_clip_val_clips_as_the_plain_loop(tmp_path):
    steps, k, clip = 5, 2, 0.05
    module, trainer = fit("mha", steps, 1, tmp_path, k=k, clip=clip)
    reference, ref_opt = plain_loop("mha", steps, k, clip=clip)
    assert_bitwise(module.net, trainer.optimizers[0], reference, ref_opt)
    unclipped, _ = plain_loop("mha", steps, k)
    assert max_relative_gap(reference, unclipped) > 1e-6  # the clip changed the run: the check can fail


def test_lightning_validation_and_accumulation_scheduler_step_as_the_plain_loop(tmp_path):
    """A validation loop (the sanity check before training, then every 2 batches: eval mode, no
    gradients) adds nothing to the statistics, and ``GradientAccumulationScheduler`` (2
    micro-batches a step in epoch 0, 1 in epoch 1) needs no setting: bitwise the plain loop
    with those windows and no validation, and to rounding the whole batch of every step."""
    pl = _lightning()
    validated = []

    class Validated(type(_module(pl, "mha"))):
        def validation_step(self, batch, batch_index):
            validated.append(not self.net.training and not torch.is_grad_enabled())
            x, y = batch
            return lm_loss(self.net(x), y)

    module = Validated()
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                         num_sanity_val_steps=2, val_check_interval=2,
                         callbacks=[pl.callbacks.GradientAccumulationScheduler({0: 2, 1: 1})])
    x, y = data(6).tensors
    val_x, val_y = data(8).tensors[0][-8:], data(8).tensors[1][-8:]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
        warnings.filterwarnings("error", module="kron_precond")  # no warning of the optimizer's
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH),
                    DataLoader(TensorDataset(val_x, val_y), batch_size=BATCH))
    assert trainer.global_step == module.inner_steps == 9
    assert len(validated) > 4 and all(validated)
    first = [[(i * 2 * BATCH, BATCH, 0.5), ((i * 2 + 1) * BATCH, BATCH, 0.5)] for i in range(3)]
    second = [[(i * BATCH, BATCH, 1.0)] for i in range(6)]
    reference, ref_opt = plain_windows("mha", first + second, micro_batches=6, scheduler=True)
    assert_bitwise(module.net, trainer.optimizers[0], reference, ref_opt)
    whole, _ = plain_windows("mha", [[(i * 2 * BATCH, 2 * BATCH, 1.0)] for i in range(3)] + second,
                             micro_batches=6, scheduler=True)
    gap = max_relative_gap(module.net, whole)
    assert gap < 1e-12, f"relative gap {gap:.2e} from the whole batches"


def test_lightning_short_last_window(tmp_path):
    """An epoch of 5 micro-batches under ``accumulate_grad_batches=2``: see
    ``check_short_last_window``."""
    module, trainer = fit("mha", 3, 1, tmp_path, k=2, scheduler=False, micro_batches=SHORT_LAST)
    assert trainer.global_step == module.inner_steps == 3
    check_short_last_window(module.net, trainer.optimizers[0])


@pytest.mark.parametrize("where", ["epoch_end", "mid_epoch"])
def test_lightning_checkpoint_resumes_bitwise(tmp_path, where):
    """``trainer.save_checkpoint`` mid-run: at the end of epoch 1 of 3 (step 3), or in the middle
    of epoch 2 (step 4, with torchdata's ``StatefulDataLoader``, which Lightning resumes
    mid-epoch). 3 steps an epoch of 2 micro-batches, statistics every 2 steps: the resumes
    start in and out of the statistics phase. A fresh module fitted with ``ckpt_path=`` ends
    bitwise where the uninterrupted run ends, which is the plain loop's."""
    pl = _lightning()
    loader_class = DataLoader
    if where == "mid_epoch":
        loader_class = pytest.importorskip("torchdata.stateful_dataloader",
                                           reason="torchdata is not importable").StatefulDataLoader
    path = tmp_path / "mid.ckpt"
    steps_per_epoch, epochs, k, save_at = 3, 3, 2, 3 if where == "epoch_end" else 4

    class Save(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
            if where == "mid_epoch" and trainer.global_step == save_at and not path.exists():
                trainer.save_checkpoint(str(path))

        def on_train_epoch_end(self, trainer, module):
            if where == "epoch_end" and trainer.global_step == save_at:
                trainer.save_checkpoint(str(path))

    straight, trainer_a = fit("mha", steps_per_epoch, epochs, tmp_path / "a", k=k, callbacks=[Save()],
                              loader_class=loader_class)
    assert path.exists()
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == save_at
    assert {int(e["step"]) for e in saved["optimizer_states"][0]["state"].values()
            if "momentum_buffer" in e} == {save_at}
    resumed, trainer_b = fit("mha", steps_per_epoch, epochs, tmp_path / "b", k=k, ckpt_path=str(path),
                             loader_class=loader_class)
    assert trainer_b.global_step == epochs * steps_per_epoch
    assert resumed.inner_steps == epochs * steps_per_epoch - save_at  # only the remaining steps ran
    assert_bitwise(resumed.net, trainer_b.optimizers[0], straight.net, trainer_a.optimizers[0])
    reference, ref_opt = plain_loop("mha", steps_per_epoch, k, epochs=epochs)
    assert_bitwise(straight.net, trainer_a.optimizers[0], reference, ref_opt)


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_lightning_bf16_mixed_steps_as_the_autocast_loop(tmp_path, kind):
    """``precision="bf16-mixed"``: a float32 model under CPU autocast; the plain loop runs the
    forward and loss under ``torch.autocast("cpu", torch.bfloat16)``. Factors stay float32."""
    steps, k = 4, 2
    module, trainer = fit(kind, steps, 1, tmp_path, k=k, bf16=True)
    optimizer = trainer.optimizers[0]
    reference, ref_opt = plain_loop(kind, steps, k, bf16=True)
    assert moved(reference, kind, torch.float32) > 1e-2
    for name, p in module.net.named_parameters():
        assert p.dtype == torch.float32, name
    factors = [v for entry in optimizer.state.values() for key, v in entry.items()
               if isinstance(v, torch.Tensor) and "factor" in key]
    assert factors and all(f.dtype == torch.float32 and bool(f.isfinite().all()) for f in factors)
    assert_bitwise(module.net, optimizer, reference, ref_opt)
    without_autocast, _ = plain_loop(kind, steps, k, dtype=torch.float32)
    assert max_relative_gap(reference, without_autocast) > 1e-4  # autocast changed the run: the check can fail
