"""Budget-equivalent speed-up of WhitenedMuon over Muon when fine-tuning LoRA adapters.

The setting most users fine-tune in: a pretrained model, frozen, and low-rank adapters (PEFT's
LoRA) trained on text of another kind. Here the base model is the Llama-style ``--arch llama``
model (RMSNorm, rotary, SwiGLU, grouped-query attention), pretrained once per process with
AdamW on the standard library's Python sources (``--pretrain-steps`` steps of the cell's batch,
warm-up and cosine; seed 0, so every run starts from the same base). Each run then trains
rank-``--lora-rank`` adapters on every projection (``q/k/v/o_proj``, ``gate/up/down_proj``;
``lora_alpha`` twice the rank, no dropout) on English prose: the text of Python's documentation
topics (``pydoc_data.topics``, about 465 KB; the last 10 % held out). Muon
(``torch.optim.Muon``) steps the adapters' matrices, ``WhitenedMuon(model)`` whitens them (the
query's and key's adapters centred, as the projections they wrap); the frozen base takes no
step. Everything else is ``benchmarks/budget_speedup.py``'s measure and tuning, which this
script runs with the model and the corpus replaced (its flags pass through)::

    OMP_NUM_THREADS=1 python benchmarks/lora_finetune.py --threads 1 --seeds 0,1,2 --sweep-ours \\
        --max-extend 6 --baselines muon --lrs 0.016,0.0226274,0.032 --momenta 0.9,0.8 \\
        --out benchmarks/results/lora_finetune
"""
from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "examples"))

import char_lm  # noqa: E402
from benchmarks import budget_speedup  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PRETRAIN_LR = 3e-3


def prose_corpus() -> torch.Tensor:
    """The documentation topics' text, in a fixed order, as bytes."""
    from pydoc_data.topics import topics
    text = "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def pretrained(config: char_lm.ModelConfig, steps: int, batch_size: int) -> dict[str, torch.Tensor]:
    """The base model's weights: ``steps`` AdamW steps on the standard library's sources."""
    torch.manual_seed(0)
    model = char_lm.build_model(config)
    corpus = char_lm.ByteCorpus(char_lm.load_corpus(4 * 2**20), config.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, char_lm.warmup_cosine(max(1, round(0.05 * steps)), steps))
    order = torch.Generator().manual_seed(0)
    for _ in range(steps):
        inputs, targets = corpus.sample_train(batch_size, order)
        optimizer.zero_grad()
        char_lm.lm_loss(model, inputs, targets).backward()
        optimizer.step()
        schedule.step()
    heldout = corpus.heldout_set(64)
    with torch.no_grad():
        loss = F.cross_entropy(model(heldout[0]).flatten(0, 1), heldout[1].flatten()).item()
    print(f"base model: {steps} AdamW steps, held-out loss on its own corpus {loss:.4f}", flush=True)
    return copy.deepcopy(model.state_dict())


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` with LoRA adapters on its projections, everything else frozen."""
    import peft
    model.requires_grad_(False)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS)
    peft.inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def install(args: argparse.Namespace, rank: int, pretrain_steps: int) -> None:
    """Replace the benchmark's model (the pretrained base, adapted) and corpus (the prose)."""
    if args.arch != "llama":
        raise SystemExit("lora_finetune.py fine-tunes the Llama-style model: pass --arch llama")
    config = char_lm.ModelConfig(args.d_model, args.n_layers, args.n_heads, args.seq_len, args.tie_embeddings,
                                 args.arch)
    base = pretrained(config, pretrain_steps, args.batch_size)
    build = char_lm.build_model

    def build_model(model_config: char_lm.ModelConfig) -> torch.nn.Module:
        if replace(model_config) != config:
            raise ValueError(f"the base model was pretrained as {config}, not {model_config}")
        state = torch.get_rng_state()  # the base's construction must not move the adapters' seed
        model = build(model_config)
        torch.set_rng_state(state)
        model.load_state_dict(base)
        return with_lora(model, rank)

    prose = prose_corpus()
    char_lm.build_model = build_model  # train_round_robin builds each run's model through it
    budget_speedup.corpus_for = lambda nbytes, seq_len: char_lm.ByteCorpus(prose, seq_len)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False,
                                usage="%(prog)s [--lora-rank R] [--pretrain-steps N] [budget_speedup.py options]")
    p.add_argument("--lora-rank", type=int, default=8, help="the adapters' rank (default: 8)")
    p.add_argument("--pretrain-steps", type=int, default=350,
                   help="steps of the base model's pretraining on the standard library's sources (default: 350)")
    own, rest = p.parse_known_args(argv)
    if {"-h", "--help"} & set(rest):  # this script's own options, then budget_speedup.py's
        print(p.format_help())
    args = budget_speedup.parse_args(["--arch", "llama", *rest])
    if args.threads:
        torch.set_num_threads(args.threads)
    install(args, own.lora_rank, own.pretrain_steps)
    budget_speedup.main(["--arch", "llama", *rest])


if __name__ == "__main__":
    main()
