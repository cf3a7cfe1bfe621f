"""Input-side K-FAC with a second moment (``moment_decay``) under MEM_OPT on real gloo
processes: only a layer's gradient workers apply its moment, so only they keep it (every rank
kept every layer's, and MEM_OPT saved none of that memory). The result is still exactly one
process's on the full batch, the same on every rank after every step, and a gathered
checkpoint resumes on one process."""
from __future__ import annotations

import torch

from dist_utils import run_workers
from kron_precond import DistributedStrategy, KronPreconditioner
from test_second_moment_mem_opt import make_model, run

SETTINGS = dict(method="ikfac", moment_decay=0.9, factor_update_steps=1, inv_update_steps=1,
                inv_dtype=torch.float64)


def _worker(rank, world, out_dir):
    model = make_model()
    precond = KronPreconditioner(model, grad_worker_fraction=DistributedStrategy.MEM_OPT, **SETTINGS)
    params = run(model, precond, rank, world)
    return {"params": params, "held": {layer.name: layer.method.moment.numel() for layer in precond._layers},
            "holds": {layer.name: precond._holds_state(layer) for layer in precond._layers},
            "state": precond.gather_state_dict()}


def test_ikfac_moments_live_on_their_holders_only(tmp_path):
    model = make_model()
    one = KronPreconditioner(model, **SETTINGS)
    reference = run(model, one)
    results = run_workers(_worker, 2, tmp_path, timeout=90.0)
    for rank, result in enumerate(results):
        assert any(result["holds"].values()) and not all(result["holds"].values()), rank
        for name, holds in result["holds"].items():
            assert (result["held"][name] > 0) == holds, (rank, name)
        assert torch.equal(result["params"], results[0]["params"]), rank
        err = ((result["params"] - reference).norm(dim=-1) / reference.norm(dim=-1)).max()
        assert err <= 1e-9, (rank, float(err))
    # the gathered state holds every moment (from its holders): one process's, to rounding
    resumed = make_model()
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), model.parameters()):
            p.copy_(q)
    again = KronPreconditioner(resumed, **SETTINGS)
    again.load_state_dict(results[1]["state"])
    state, expected = again.state_dict(), one.state_dict()
    for name, layer in expected["layers"].items():
        assert torch.allclose(state["layers"][name]["moment"], layer["moment"], rtol=1e-9, atol=0), name
