"""torchtitan's own trainer on its llama3 debug model, with K-FAC in front of its AdamW, or
WhitenedMuon in its place.

The route on a GPU machine (torchtitan's tokenizer and c4_test assets in ./tests/assets, as in
its repository) is torchtitan's command plus one override; nothing else changes::

    torchrun --nproc_per_node=8 -m torchtitan.train --module llama3 --config llama3_debugmodel \\
        --override.imports 'kron_precond.integrations.torchtitan.kron_optimizers={"method": "kfac"}'

This script runs the same trainer anywhere, this CPU included, and downloads nothing::

    python examples/torchtitan_debugmodel.py --steps 20                       # one process
    torchrun --nproc_per_node=2 examples/torchtitan_debugmodel.py --steps 20  # FSDP2 over 2 ranks
    python examples/torchtitan_debugmodel.py --method whitened_muon           # the README's WhitenedMuon command
    python examples/torchtitan_debugmodel.py --method none                     # torchtitan's AdamW alone
    python examples/torchtitan_debugmodel.py -- --training.local_batch_size 4  # more torchtitan flags

It writes a word-level tokenizer and a small text dataset (Python's standard-library sources)
under ``--out``, and on a machine without an accelerator applies the workarounds of
:func:`cpu_workarounds` (torchtitan 0.3.0 targets GPUs). ``--settings`` is the JSON of the
optimizer override: for a preconditioner method, the fields of ``KronOptimizersContainer.Config``
plus any ``KronPreconditioner`` option; for ``whitened_muon``, ``skip_layers`` plus any
``WhitenedMuon`` keyword (default: the README's ``{"lr": 0.02, "skip_layers": ["lm_head"]}``).

An ``--override.imports`` among the torchtitan flags after ``--`` joins the script's own entries
(the CPU workarounds' SDPA stays); an entry of ``kron_precond.integrations.torchtitan``
(``kron_optimizers=...``, ``whitened_muon_optimizers=...``) takes the place of ``--method``'s.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import sys
import sysconfig
import types
from pathlib import Path

try:
    import kron_precond  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# torch's compiler stack, and with it triton's LLVM, before torchtitan's data stack: with
# TensorFlow or JAX installed beside it, their LLVM loaded first makes triton abort the process
# ("LLVM ERROR: inconsistency in registered CommandLine options").
import torch._dynamo  # noqa: E402,F401
from torchtitan.config import override  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402

INTEGRATION = "kron_precond.integrations.torchtitan"
OVERRIDE = f"{INTEGRATION}.kron_optimizers"
WMUON_OVERRIDE = f"{INTEGRATION}.whitened_muon_optimizers"
KFAC_SETTINGS = {"damping": 0.003, "factor_update_steps": 1, "inv_update_steps": 10}
WMUON_SETTINGS = {"lr": 0.02, "skip_layers": ["lm_head"]}  # the README's command
BOS, EOS, UNK = "<s>", "</s>", "<unk>"


# ---------------------------------------------------------------------- offline assets
def write_tokenizer(folder: Path, words: list[str]) -> None:
    """A Hugging Face word-level tokenizer (whitespace split) over ``words``, as torchtitan's
    ``HuggingFaceTokenizer`` loads it: ``tokenizer.json`` + ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {UNK: 0, BOS: 1, EOS: 2}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    # torchtitan's dataset adds BOS / EOS itself; the tokenizer must not add them again
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "add_bos_token": False, "add_eos_token": False}))


def write_texts(folder: Path, texts: list[str]) -> None:
    """A dataset folder that torchtitan's ``c4_test`` loader reads (``load_dataset(path,
    split="train")``): one JSON line ``{"text": ...}`` per document, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def stdlib_documents(words_per_doc: int = 200, max_docs: int = 2000) -> list[str]:
    """Python's standard-library sources, whitespace-split, in documents of ``words_per_doc`` words."""
    root = Path(sysconfig.get_paths()["stdlib"])
    words: list[str] = []
    for path in sorted(root.glob("*.py")):
        words.extend(path.read_text(errors="replace").split())
        if len(words) >= words_per_doc * max_docs:
            break
    return [" ".join(words[i:i + words_per_doc]) for i in range(0, len(words) - words_per_doc + 1, words_per_doc)]


def build_assets(folder: Path, vocab_size: int = 2048) -> tuple[Path, Path]:
    """Tokenizer and dataset of :func:`stdlib_documents` under ``folder``; returns their paths.
    The vocabulary is the most frequent words (the debug model has 2048 token ids)."""
    docs = stdlib_documents()
    counts = collections.Counter(word for doc in docs for word in doc.split())
    write_tokenizer(folder / "tokenizer", [w for w, _ in counts.most_common(vocab_size - 3)])
    write_texts(folder / "data", docs)
    return folder / "tokenizer", folder / "data"


# ---------------------------------------------------------------------- CPU workarounds
@override(target=FlexAttention.Config, description="SDPA: FlexAttention has no CPU backward")
def sdpa_attention(cfg: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    """Causal SDPA instead of FlexAttention's block-causal masks (documents packed into one
    sequence then attend across their boundaries; fine for a smoke run)."""
    return ScaledDotProductAttention.Config()


def _cpu_device_module() -> types.SimpleNamespace:
    """What torchtitan asks of ``torch.cuda`` (device selection, memory statistics), for CPU."""
    return types.SimpleNamespace(
        set_device=lambda device: None, current_device=lambda: 0, device_count=lambda: 1,
        synchronize=lambda device=None: None, empty_cache=lambda: None,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(name="cpu", total_memory=1 << 30),
        memory_stats=lambda device=None: {}, reset_peak_memory_stats=lambda device=None: None)


def cpu_workarounds() -> list[str]:
    """Let torchtitan 0.3.0 train on a CPU-only machine with gloo; returns the torchtitan
    flags that go with it. Each works around one obstacle (none is needed on GPUs):

    * torchtitan picks ``cuda`` when no accelerator is present: its modules get ``cpu``;
    * torch 2.13 has no ``torch.distributed.set_timeout``, which the trainer calls after the
      first step to shorten collective timeouts: skipped;
    * gloo has no ``PREMUL_SUM``, which FSDP2 uses once torchtitan sets the gradient divide
      factor to 1: FSDP modules reduce with a plain sum instead (the same result);
    * FlexAttention has no CPU backward: ``--override.imports`` adds :func:`sdpa_attention`;
    * ``fully_shard`` rejects the default ``spmd_types`` backend here ("all parameters must be
      DTensors on the full SPMD mesh"): ``--parallelism.spmd_backend partial_dtensor``.
    """
    import importlib

    import torch.distributed as dist

    cpu = _cpu_device_module()
    for name in ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.distributed.utils",
                 "torchtitan.distributed.parallel_dims", "torchtitan.models.common.token_dispatcher"):
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu
    if not hasattr(dist, "set_timeout"):
        import torchtitan.distributed.utils as titan_dist

        titan_dist.set_pg_timeouts = lambda **kwargs: None
    import torchtitan.distributed.fsdp as titan_fsdp

    divide = titan_fsdp.disable_fsdp_gradient_division
    if not getattr(divide, "kron_example_sum", False):
        def disable_division_and_sum(model):
            divide(model)
            for module in model.modules():
                if isinstance(module, titan_fsdp.FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        disable_division_and_sum.kron_example_sum = True
        titan_fsdp.disable_fsdp_gradient_division = disable_division_and_sum
    return ["--parallelism.spmd_backend", "partial_dtensor"]


def needs_cpu_workarounds() -> bool:
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is None


# ---------------------------------------------------------------------- the command
def default_settings(method: str | None) -> dict:
    """``--settings`` when not given: K-FAC's / EK-FAC's schedule, the README's WhitenedMuon
    settings, else none."""
    if method == "whitened_muon":
        return dict(WMUON_SETTINGS)
    return dict(KFAC_SETTINGS) if method in ("kfac", "ekfac") else {}


def override_entry(method: str, settings: dict) -> str:
    """One ``--override.imports`` token: the optimizer override with its JSON settings
    (``whitened_muon``: WhitenedMuon as the optimizer; else a preconditioner method)."""
    if method == "whitened_muon":
        return f"{WMUON_OVERRIDE}={json.dumps(settings)}"
    return f"{OVERRIDE}={json.dumps({'method': method, **settings})}"


def split_override_imports(extra: list[str]) -> tuple[list[str], list[str]]:
    """(the entries of every ``--override.imports`` in ``extra``, the other flags). torchtitan
    keeps only the last ``--override.imports`` it is given, so the script gathers them into one."""
    imports: list[str] = []
    rest: list[str] = []
    taking = False
    for token in extra:
        if token == "--override.imports":
            taking = True
        elif token.startswith("--override.imports="):
            taking = True
            imports.append(token.partition("=")[2])
        elif taking and not token.startswith("--"):
            imports.append(token)
        else:
            taking = False
            rest.append(token)
    return imports, rest


def _target(entry: str) -> str:
    return entry.partition("=")[0]


def torchtitan_args(*, steps: int, tokenizer: Path, data: Path, dump: Path, method: str | None,
                    settings: dict | None = None, cpu: bool = False, extra: list[str] = ()) -> list[str]:
    """torchtitan's command line for the llama3 debug model on the offline assets. The
    ``--override.imports`` entries in ``extra`` join the script's: an entry of kron_precond's
    torchtitan module replaces ``method``'s, one of the same target as another replaces it."""
    users, extra = split_override_imports(list(extra))
    ours = [override_entry(method, settings or {})] if method else []
    if cpu:
        ours.append(f"{sdpa_attention.__module__}.sdpa_attention")
    targets = {_target(entry) for entry in users}
    replaced = targets | ({OVERRIDE, WMUON_OVERRIDE} if targets & {OVERRIDE, WMUON_OVERRIDE} else set())
    imports = [entry for entry in ours if _target(entry) not in replaced] + users
    args = ["--module", "llama3", "--config", "llama3_debugmodel",
            "--training.steps", str(steps), "--training.seq_len", "128", "--training.local_batch_size", "2",
            "--hf_assets_path", str(tokenizer), "--dataloader.dataset_path", str(data),
            "--dump_folder", str(dump), "--validator.no-enable", "--checkpoint.no-enable"]
    if imports:
        args += ["--override.imports", *imports]
    return args + list(extra)


def _single_process_env() -> None:
    """What torchrun would set, for ``python examples/torchtitan_debugmodel.py``."""
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--method", default="kfac",
                        help="kfac, ekfac, shampoo, psgd (a preconditioner in front of torchtitan's AdamW), "
                             "whitened_muon (WhitenedMuon in its place), or none (AdamW alone)")
    parser.add_argument("--settings", default=None,
                        help="JSON: KronOptimizersContainer.Config fields and KronPreconditioner options, or "
                             "for whitened_muon skip_layers and WhitenedMuon keywords (default for K-FAC / "
                             f"EK-FAC: {json.dumps(KFAC_SETTINGS)}; for whitened_muon: "
                             f"{json.dumps(WMUON_SETTINGS)}; else none)")
    parser.add_argument("--out", default="runs/torchtitan_debugmodel")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    _single_process_env()
    out = Path(args.out).resolve()
    # every rank writes its own copy: no rank waits on another before torchtitan starts
    tokenizer, data = build_assets(out / f"assets-rank{os.environ['LOCAL_RANK']}")
    os.environ.setdefault("HF_DATASETS_CACHE", str(out / f"hf-cache-rank{os.environ['LOCAL_RANK']}"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    cpu = needs_cpu_workarounds()
    if cpu:
        extra = cpu_workarounds() + extra
    method = None if args.method == "none" else args.method
    settings = json.loads(args.settings) if args.settings else default_settings(method)
    sys.argv = [sys.argv[0], *torchtitan_args(steps=args.steps, tokenizer=tokenizer, data=data, dump=out / "dump",
                                              method=method, settings=settings, cpu=cpu,
                                              extra=extra)]
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main()
