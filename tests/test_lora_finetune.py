"""benchmarks/lora_finetune.py: the pretrained base every run starts from, the adapters, and the
corpus that replaces the benchmark's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")
pytest.importorskip("peft", reason="peft is an optional extra ([trainers])")

import char_lm  # noqa: E402
from benchmarks import budget_speedup as bs  # noqa: E402
from benchmarks import lora_finetune as lf  # noqa: E402
from kron_precond import WhitenedMuon  # noqa: E402

FLAGS = ["--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--seq-len", "8", "--batch-size", "4"]


def test_every_run_starts_from_one_pretrained_base_with_seeded_adapters(monkeypatch):
    monkeypatch.setattr(char_lm, "build_model", char_lm.build_model)  # restored after the test
    monkeypatch.setattr(bs, "corpus_for", bs.corpus_for)
    torch.manual_seed(0)
    fresh = char_lm.build_model(char_lm.ModelConfig(16, 1, 2, 8, False, "llama"))
    args = bs.parse_args(["--arch", "llama", *FLAGS])
    lf.install(args, rank=2, pretrain_steps=3)
    config = char_lm.ModelConfig(16, 1, 2, 8, False, "llama")
    models = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        models.append(char_lm.build_model(config))
    base = {n: p for n, p in models[0].named_parameters() if ".lora_" not in n}
    assert any(not torch.equal(p, dict(fresh.named_parameters())[n]) for n, p in base.items())  # pretrained
    for model in models:
        assert all(torch.equal(p, base[n]) and not p.requires_grad
                   for n, p in model.named_parameters() if ".lora_" not in n)
        lora = {n: p for n, p in model.named_parameters() if ".lora_" in n}
        assert len(lora) == 2 * len(lf.TARGETS) and all(p.requires_grad for p in lora.values())
        assert all(torch.count_nonzero(p) == 0 for n, p in lora.items() if ".lora_B." in n)
    a = [dict(m.named_parameters())["inner.model.layers.0.self_attn.q_proj.lora_A.default.weight"] for m in models]
    assert torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])  # the adapters follow the run's seed
    with pytest.raises(ValueError, match="pretrained as"):
        char_lm.build_model(char_lm.ModelConfig(32, 1, 2, 8, False, "llama"))

    corpus = bs.corpus_for(4 * 2**20, 8)
    prose = lf.prose_corpus()
    assert len(prose) > 300_000 and torch.equal(torch.cat([corpus.train, corpus.heldout]), prose)

    model = models[2]
    optimizer = WhitenedMuon(model, lr=0.02, skip_layers=char_lm.SKIP_LAYERS)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in optimizer.param_groups[0]["params"]} == {
        n for n, p in model.named_parameters() if p.requires_grad}
    assert {names[i].split(".")[-4] for i in optimizer._statistics.centered} == {"q_proj", "k_proj"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs, targets = corpus.sample_train(4, torch.Generator().manual_seed(0))
    for _ in range(2):  # lora_B starts at zero: lora_A's gradient is zero until B has moved
        optimizer.zero_grad()
        char_lm.lm_loss(model, inputs, targets).backward()
        optimizer.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (".lora_" not in n), n
