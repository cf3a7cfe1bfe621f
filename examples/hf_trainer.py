"""K-FAC or PSGD inside the Hugging Face ``transformers.Trainer``: pass a
``PreconditionedOptimizer`` and its scheduler as ``optimizers=(optimizer, scheduler)``.

A small GPT-2 built from a config (no download) learns the bytes of Python's standard
library. K-FAC preconditions GPT-2's ``Conv1D`` layers; the tied ``lm_head`` is skipped.

    pip install -e ".[trainers]" "torch==$(python -c 'import torch;print(torch.__version__)')"
    python examples/hf_trainer.py --method kfac
    python examples/hf_trainer.py --method psgd --max-steps 200 --grad-accum 2
"""
from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path
from typing import Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: an uninstalled kron_precond
    sys.path.append(str(REPO_ROOT))

import transformers  # noqa: E402

from kron_precond import KronPreconditioner, PreconditionedOptimizer  # noqa: E402


class ByteChunks(torch.utils.data.Dataset):
    """Fixed-length byte sequences of the standard library's ``.py`` files (tokens 0..255)."""

    def __init__(self, seq_len: int, max_bytes: int) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        data = bytearray()
        for path in sorted(root.glob("*.py")):
            data += path.read_bytes()
            if len(data) >= max_bytes:
                break
        tokens = torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()
        self.chunks = tokens[: len(tokens) // seq_len * seq_len].reshape(-1, seq_len)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.chunks[index], "labels": self.chunks[index]}


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["kfac", "psgd", "adamw"], default="kfac")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--out", default="runs/hf_trainer")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    dataset = ByteChunks(args.seq_len, max_bytes=args.max_steps * args.batch_size * args.grad_accum * args.seq_len)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if args.method != "adamw":
        # K-FAC averages statistics over the micro-batches of one step: tell it how many.
        # kl_clip reads the optimizer's (scheduled) lr; no lr= needed here.
        settings = dict(accumulation_steps=args.grad_accum, damping=3e-3, factor_update_steps=2,
                        inv_update_steps=10, skip_layers=["lm_head"]) if args.method == "kfac" else {}
        optimizer = PreconditionedOptimizer(optimizer, KronPreconditioner(model, method=args.method, **settings))
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=args.max_steps // 10,
                                                             num_training_steps=args.max_steps)
    training_args = transformers.TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, logging_steps=max(1, args.max_steps // 10),
        save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=dataset,
                                   optimizers=(optimizer, scheduler))
    result = trainer.train()
    print(f"{args.method}: mean training loss {result.training_loss:.4f} over {result.global_step} steps")
    return {"train_loss": result.training_loss}


if __name__ == "__main__":
    main()
