"""Which layers' whitening wins or loses, and what the input centring changes.

Trains, interleaved on the same batches (examples/char_lm.py's ``train_round_robin``), the
best Muon of benchmarks/budget_speedup.py and ``WhitenedMuon`` variants, each a name and its
settings::

    base=lr:0.0453,mom:0.8                       WhitenedMuon at that lr and momentum
    plain_qk=lr:0.0453,plain:q_proj|k_proj       the weights whose name matches the regex
                                                 are stepped as plain Muon (no whitening)
    centred=lr:0.0453,center:all                 center_inputs True ("all"), False ("none"),
                                                 None ("auto": the layers without a bias)
    qk=lr:0.0453,center_only:q_proj|k_proj       centre the input factors of the weights whose
                                                 name matches, and no other
    head=lr:0.0453,skip:Embedding                the skip_layers regexes, '|'-separated, in place
                                                 of the examples' ("Embedding", "lm_head")

and the model can be changed the way the diagnosis needs: ``--arch llama`` with ``--mha``
(as many key/value heads as query heads), ``--rope-theta 1e12`` (rotary angles ~0: no
rotary) or ``--llama-bias`` (biases in every projection); ``--no-bias`` builds every
nn.Linear without a bias. One final held-out loss per variant; read it against the Muon
row of the same process. Results: benchmarks/results/layer_levers.md.

    OMP_NUM_THREADS=1 python benchmarks/layer_levers.py --arch llama --seed 0 \\
        --variants "base=lr:0.0453,center:none;plain_qk=lr:0.0453,plain:q_proj|k_proj,center:none"
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "examples"))

from benchmarks.budget_speedup import EVALS_PER_RUN, WARMUP_FRACTION, contender  # noqa: E402
from benchmarks.regimes import corpus_for  # noqa: E402
from char_lm import Contender, add_training_args, configs_from_args, train_round_robin  # noqa: E402
from kron_examples_common import DistContext, unwrap  # noqa: E402
from kron_precond.whitened_muon import WhitenedMuon  # noqa: E402

CENTER = {"auto": None, "all": True, "none": False}


class PartlyWhitenedMuon(WhitenedMuon):
    """``WhitenedMuon`` whose weights named by ``plain`` (a regex on the qualified name) get
    the identity whitener: plain Muon steps (statistics are still gathered, and unused)."""

    def __init__(self, *args: Any, plain: str | None = None, center_only: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.plain = re.compile(plain) if plain else None
        if center_only:  # read when a statistics step's pending sums are first allocated
            pattern = re.compile(center_only)
            self._statistics.centered = frozenset(i for i, name in self._names.items()
                                                  if i in self._views and pattern.search(name))

    def _is_plain(self, p: torch.nn.Parameter) -> bool:
        return self.plain is not None and bool(self.plain.search(self._names[id(p)]))

    def _layout(self, p: torch.nn.Parameter) -> tuple:
        return super()._layout(p) + (self._is_plain(p),)  # plain weights stack apart

    def _stacked_whiteners(self, params: list[torch.nn.Parameter]) -> tuple:
        return (None, None) if self._is_plain(params[0]) else super()._stacked_whiteners(params)


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``name=key:value,...`` -> (name, settings): lr (required), mom (0.8), plain, center,
    center_only, skip."""
    name, _, spec = text.partition("=")
    items = dict(item.split(":", 1) for item in spec.split(",") if item)
    if "lr" not in items:
        raise ValueError(f"variant {text!r}: lr is required")
    unknown = set(items) - {"lr", "mom", "plain", "center", "center_only", "skip"}
    if unknown:
        raise ValueError(f"variant {text!r}: unknown settings {sorted(unknown)}")
    return name, dict(lr=float(items["lr"]), momentum=float(items.get("mom", 0.8)), plain=items.get("plain"),
                      center_inputs=CENTER[items.get("center", "auto")], center_only=items.get("center_only"),
                      skip=items["skip"].split("|") if "skip" in items else None)


def variant_contender(name: str, settings: dict[str, Any], weight_decay: float, skip: list[str]) -> Contender:
    lr = settings["lr"]

    def build(model, scaler):
        return PartlyWhitenedMuon(unwrap(model), lr, weight_decay, momentum=settings["momentum"],
                                  skip_layers=skip if settings["skip"] is None else settings["skip"],
                                  plain=settings["plain"], center_only=settings["center_only"],
                                  center_inputs=settings["center_inputs"]), None
    return Contender(name, lr, build=build)


def patch_models(args: argparse.Namespace) -> None:
    """The model changes of the diagnosis, applied to the configs the examples build from."""
    if args.mha or args.rope_theta or args.llama_bias:
        from transformers.models.llama.configuration_llama import LlamaConfig
        original = LlamaConfig.__init__

        def patched(self, *a, **kw):
            if args.mha:
                kw["num_key_value_heads"] = kw["num_attention_heads"]
            if args.rope_theta:
                kw["rope_parameters"] = {"rope_theta": args.rope_theta, "rope_type": "default"}
            if args.llama_bias:
                kw["attention_bias"] = kw["mlp_bias"] = True
            original(self, *a, **kw)
        LlamaConfig.__init__ = patched
    if args.no_bias:
        linear_init = torch.nn.Linear.__init__

        def no_bias(self, in_features, out_features, bias=True, **kw):
            linear_init(self, in_features, out_features, bias=False, **kw)
        torch.nn.Linear.__init__ = no_bias


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="per-layer whitening and centring levers (one seed, 1x budget)")
    p.add_argument("--variants", required=True, help="';'-separated name=lr:..,mom:..,plain:..,center:..")
    p.add_argument("--muon-lr", type=float, default=0.032, help="the Muon row's lr (momentum 0.8); 0: none")
    p.add_argument("--mha", action="store_true")
    p.add_argument("--rope-theta", type=float, default=None)
    p.add_argument("--llama-bias", action="store_true")
    p.add_argument("--no-bias", action="store_true")
    add_training_args(p)
    p.set_defaults(d_model=64, batch_size=32, steps=350, eval_seqs=256, corpus_mb=4.0, seed=0)  # budget_speedup
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or 1)
    patch_models(args)
    model, base_train, precond = configs_from_args(args)
    train = replace(base_train, warmup_steps=max(1, round(WARMUP_FRACTION * args.steps)),
                    eval_every=max(1, args.steps // EVALS_PER_RUN), stop_after=0)
    contenders = [contender("muon", 0.8, args.muon_lr, train.weight_decay, precond)] if args.muon_lr > 0 else []
    for text in args.variants.split(";"):
        if text:
            name, settings = parse_variant(text)
            contenders.append(variant_contender(name, settings, train.weight_decay, list(precond.skip_layers)))
    corpus = corpus_for(int(train.corpus_mb * 2**20), model.seq_len)
    results = train_round_robin(contenders, model, train, DistContext(0, 1, torch.device("cpu")),
                                corpus=corpus, progress=False)
    flags = " ".join([f"--{k.replace('_', '-')}" for k in ("mha", "llama_bias", "no_bias") if getattr(args, k)]
                     + ([f"--rope-theta {args.rope_theta:g}"] if args.rope_theta else []))
    for r in results:
        print(f"| {args.arch} {flags} | {args.seed} | {r.name} | {r.eval_losses[-1]:.4f} |", flush=True)


if __name__ == "__main__":
    main()
