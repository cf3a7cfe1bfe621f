"""Models wrapped by ``FullyShardedDataParallel`` (FSDP1) are refused, naming the parameters.

FSDP1 replaces a module's parameters by one flat parameter, or (``use_orig_params=True``) by
views of it, which on several ranks are 1-D shards: a layer's weight is then not its matrix,
and factors fitted to it precondition a shard per rank (``Kron`` ended 2e-2 off one process on
the full batch). ``KronPreconditioner``, ``WhitenedMuon`` and ``Kron`` raise ``TypeError`` at
construction instead; FSDP2 (``fully_shard``) is the sharding they take. Two gloo ranks.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from dist_utils import run_workers


def _worker(rank, world, out_dir):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from kron_precond import Kron, KronPreconditioner, WhitenedMuon
    messages = {}
    for orig in (False, True):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP1's deprecation notice
            model = FSDP(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), device_id=torch.device("cpu"),
                         use_orig_params=orig)
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        builders = {"KronPreconditioner": (KronPreconditioner, model, {"method": "kfac"}),
                    "WhitenedMuon": (WhitenedMuon, model, {"lr": 1e-2}),
                    "WhitenedMuon-list": (WhitenedMuon, linears, {"lr": 1e-2}),
                    "Kron": (Kron, list(model.parameters()), {"lr": 1e-2})}
        for name, (build, target, options) in builders.items():
            try:
                build(target, **options)
                messages[(name, orig)] = None
            except Exception as err:  # noqa: BLE001 -- the type is checked by the test
                messages[(name, orig)] = (type(err).__name__, str(err))
    return messages


def test_fsdp1_models_are_refused_at_construction(tmp_path):
    results = run_workers(_worker, 2, tmp_path, timeout=240)
    kinds = [{key: outcome and outcome[0] for key, outcome in result.items()} for result in results]
    assert kinds[0] == kinds[1]  # every rank refuses alike (a shard's shape may differ in the message)
    for (name, orig), outcome in results[0].items():
        if name == "WhitenedMuon-list" and not orig:
            continue  # the Linear modules hold no parameters of their own then: nothing to whiten
        assert outcome is not None, f"{name} accepted an FSDP1 model (use_orig_params={orig})"
        kind, message = outcome
        assert kind == "TypeError" and "FullyShardedDataParallel (FSDP1)" in message, (name, orig, outcome)
        if name != "Kron":  # which the parameters are (Kron names its list's entries by position)
            assert ("_flat_param" in message) if not orig else ("0].weight" in message or "0.weight" in message), \
                message
