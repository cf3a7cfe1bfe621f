"""``Kron`` preconditions each parameter as one whole tensor: a DTensor parameter (FSDP2,
tensor parallel) holds only this rank's shard, and its step failed deep inside with "mixed
torch.Tensor and DTensor". It is refused at construction and in ``add_param_group``, naming
the parameters and what takes such models (``KronPreconditioner``)."""
from __future__ import annotations

import torch
import torch.nn as nn

from dist_utils import run_workers
from kron_precond import Kron


def refusal_worker(rank: int, world: int, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    plain = nn.Linear(3, 3)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    errors = {}
    for name, build in {
        "named": lambda: Kron(list(model.named_parameters()), lr=1e-3),
        "plain": lambda: Kron(model.parameters(), lr=1e-3),
        "group": lambda: Kron(plain.parameters(), lr=1e-3).add_param_group({"params": list(model.parameters())}),
    }.items():
        try:
            build()
            errors[name] = None
        except TypeError as err:
            errors[name] = str(err)
    Kron(plain.parameters(), lr=1e-3)  # plain tensors: accepted
    return errors


def test_kron_refuses_dtensor_parameters_naming_them(tmp_path):
    errors = run_workers(refusal_worker, 1, tmp_path, timeout=120)[0]
    for name, message in errors.items():
        assert message is not None, f"{name}: DTensor parameters were accepted"
        assert "DTensor" in message and "KronPreconditioner" in message, message
    assert "0.weight" in errors["named"], errors["named"]
