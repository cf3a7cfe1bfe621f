"""Inside one gloo rank (``dist_utils.run_workers``): torchtitan's ``Trainer`` with
``KronOptimizersContainer`` on the llama3 debug model, configured from the command line as a
user would (``ConfigManager`` + ``--override.imports``).

The CPU workarounds (device type, gloo reductions, SDPA, ``spmd_backend``) come from
``examples/torchtitan_debugmodel.py``, so this test also runs the example's set-up. Each
phase builds a fresh trainer in the same process (imports are the slow part here) and
returns what the test compares: full parameters, logged losses, the preconditioner's
gathered state and registration.
"""
from __future__ import annotations

import os
import time
import warnings

import torch

from example_modules import load

# By path, not as ``examples.torchtitan_debugmodel``: another wheel's top-level ``examples``
# package would shadow the checkout's folder. Loading it here, in every rank, also registers its
# ``@override`` under the module name the test passes to ``--override.imports``.
TITAN_EXAMPLE = load("examples/torchtitan_debugmodel.py")
cpu_workarounds = TITAN_EXAMPLE.cpu_workarounds


def run_phases(rank: int, world: int, out_dir: str, phases: list[tuple[str, dict]]) -> dict:
    # What torchrun sets; torchtitan finds the process group run_workers made and keeps it.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                      HF_DATASETS_CACHE=os.path.join(out_dir, f"hf-cache-{world}-{rank}"))
    torch.autograd.set_multithreading_enabled(False)  # as torchtitan's own init_distributed does
    flags = cpu_workarounds()
    _skip_the_closing_sleep()
    return {name: _phase(rank, phase, flags) for name, phase in phases}


def _skip_the_closing_sleep() -> None:
    """``Trainer.train`` ends with two seconds of ``time.sleep`` on rank 0 ("for other ranks to
    complete"), once per phase: 16 s of the test's run. Every phase here ends in collectives
    (gathered state, full parameters) that wait for all ranks anyway, so the sleep only waits."""
    import torchtitan.trainer

    class _Time:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            pass

    torchtitan.trainer.time = _Time()


def _phase(rank: int, phase: dict, flags: list[str]) -> dict:
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.config import ConfigManager

    started = time.perf_counter()
    config = ConfigManager().parse_args(phase["args"] + flags)
    for group in config.optimizer.param_groups:  # the override keeps these groups
        group.optimizer_kwargs.update(phase.get("optimizer_kwargs", {}))
    trainer = config.build()
    try:
        def params() -> dict[str, torch.Tensor]:  # full values: all-gathers under FSDP2
            return {canonical_fqn(name): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                    for name, p in trainer.model_parts[0].named_parameters()}

        if phase.get("seed_checkpoint"):
            trainer.checkpointer.save(curr_step=0, last_step=True)  # what torchtitan.train does
            return {"params": params()}
        losses: list[float] = []
        log = trainer.metrics_processor.log

        def record(step, loss, *args, **kwargs):
            losses.append(float(loss))
            return log(step, loss, *args, **kwargs)

        trainer.metrics_processor.log = record
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.train()
        except ValueError as err:
            if phase.get("expect_error"):
                return {"error": str(err)}
            raise
        said = [str(w.message) for w in caught if "kron_precond" in str(w.filename) or "Kron" in str(w.message)]
        container = trainer.optimizers
        if not hasattr(container, "preconditioner"):  # WhitenedMuonOptimizersContainer
            optimizer = container.optimizers[0]
            whitened = optimizer.param_groups[0]
            final = params()  # collectives (all-gathers): every rank
            result = {"losses": losses, "container": type(container).__name__,
                      "whitened": list(whitened["param_names"]),
                      "steps": int(optimizer.state[whitened["params"][0]]["step"])}
            if rank == 0:
                result.update(params=final)
            return result
        precond = container.preconditioner
        state = precond.gather_state_dict()  # collectives: every rank
        final = params()  # collectives (all-gathers): every rank
        result = {"losses": losses, "container": type(container).__name__, "method": precond.method,
                  "layers": [canonical_fqn(name) for name in precond.layers], "steps": precond.steps,
                  "accumulation_steps": precond.accumulation_steps, "world_size": precond.world_size,
                  "seconds": time.perf_counter() - started, "warnings": said}
        if rank == 0:
            result.update(params=final, state=state)
        return result
    finally:
        trainer.close()
