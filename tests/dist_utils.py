"""Helpers for multi-process (gloo) tests: free ports, spawning ranks with a hard timeout.

A worker is a module-level function ``worker(rank, world_size, out_dir, *args)`` that runs
inside an initialised gloo process group and returns a picklable result (tensors,
numbers, dicts); :func:`run_workers` returns ``[result of rank 0, result of rank 1, ...]``.

Failure modes are made loud and quick instead of hanging the test session:

* a rank that raises: the others are killed and the rank's traceback is re-raised in
  the test process (``WorkerFailed``);
* a rank that hangs (e.g. a collective the other ranks never issue): every rank is
  killed after ``timeout`` seconds and the test fails with ``WorkerTimeout``, naming
  the ranks that had not finished;
* a rank that exits without writing its result (killed, segfault): ``WorkerFailed``.

Each rank writes its result to ``out_dir/result_<rank>.pt`` (``torch.save``); the
process group uses a fresh free TCP port on 127.0.0.1 for every spawn, and every rank
runs with ``torch.set_num_threads(1)`` (the test machines have two shared cores).
"""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 120.0


class WorkerFailed(RuntimeError):
    """A rank raised or died."""


class WorkerTimeout(RuntimeError):
    """A rank did not finish in time (a hang); all ranks were killed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple,
           collective_timeout: float) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # never an external interface
    import datetime
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout))
    try:
        result = fn(rank, world_size, out_dir, *args)
        # Nobody leaves before everyone is done (a rank's last collective may still be
        # serving a peer).
        dist.barrier()
        torch.save(result, os.path.join(out_dir, f"result_{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
    # Done and saved: leave without the interpreter's shutdown. Rarely (about one spawn in a
    # few hundred here), a rank aborted there with "terminate called without an active
    # exception" -- after every rank had written its result, i.e. after the last collective:
    # a joinable C++ thread destroyed during static destruction, outside the code under test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(fn: Callable, world_size: int, out_dir: str | os.PathLike, *args: Any,
                timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Run ``fn(rank, world_size, out_dir, *args)`` on ``world_size`` gloo ranks.

    Returns the ranks' results in rank order. Raises :class:`WorkerTimeout` if the ranks
    are not all done after ``timeout`` seconds (they are killed first), or
    :class:`WorkerFailed` with the failing rank's traceback. A port taken by someone else
    between choosing and binding it is retried once on a new port.
    """
    try:
        return _run_workers_once(fn, world_size, out_dir, args, timeout)
    except WorkerFailed as err:
        if "EADDRINUSE" not in str(err) and "address already in use" not in str(err).lower():
            raise
    return _run_workers_once(fn, world_size, out_dir, args, timeout)


def _run_workers_once(fn, world_size, out_dir, args, timeout) -> list[Any]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("result_*.pt")) + list(out.glob("error_*.txt")):
        stale.unlink()
    port = free_port()
    context = mp.start_processes(
        _entry, args=(fn, world_size, port, str(out), args, max(timeout, 1.0)),
        nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if context.join(timeout=0.2):
                    break
            except Exception as err:  # ProcessRaisedException / ProcessExitedException
                raise WorkerFailed(_describe_failure(out, world_size, str(err))) from None
            if time.monotonic() > deadline:
                alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                raise WorkerTimeout(
                    f"{fn.__name__} at world size {world_size}: rank(s) {alive} still running after "
                    f"{timeout:.0f} s (a hang?); all ranks killed."
                    + _describe_failure(out, world_size, ""))
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        for process in context.processes:
            process.join(5)
    results = []
    for rank in range(world_size):
        path = out / f"result_{rank}.pt"
        if not path.exists():
            raise WorkerFailed(f"rank {rank} exited without a result" + _describe_failure(out, world_size, ""))
        results.append(torch.load(path, weights_only=False))
    return results


def _describe_failure(out: Path, world_size: int, message: str) -> str:
    parts = [message] if message else []
    for rank in range(world_size):
        path = out / f"error_{rank}.txt"
        if path.exists():
            parts.append(f"--- rank {rank} traceback ---\n{path.read_text()}")
    return "\n".join(parts)


# ---------------------------------------------------------------------- inside a worker
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce",
                "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
                "all_to_all_single", "send", "recv", "isend", "irecv", "barrier",
                "broadcast_object_list", "all_gather_object", "batch_isend_irecv")


class CollectiveCounter:
    """Count the collectives issued through ``torch.distributed.<name>`` (and their bytes).

    The library calls ``dist.all_reduce(...)`` through the module attribute, so patching
    the attribute sees every call. ``original(name)`` is the unpatched function, for the
    test's own traffic (which must not be counted). Use as a context manager; counting
    can be paused with ``counter.enabled = False``.
    """

    def __init__(self) -> None:
        self.originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
        self.enabled = True
        self.reset()

    def reset(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.sizes: dict[str, list[int]] = {}

    def original(self, name: str):
        return self.originals[name]

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            if self.enabled:
                tensor = args[0] if args else kwargs.get("tensor")
                size = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
                self.calls[name] = self.calls.get(name, 0) + 1
                self.bytes[name] = self.bytes.get(name, 0) + size
                self.sizes.setdefault(name, []).append(size)
            return fn(*args, **kwargs)
        return counted

    def __enter__(self) -> "CollectiveCounter":
        for name, fn in self.originals.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.originals.items():
            setattr(dist, name, fn)

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def snapshot(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes), "sizes": {k: list(v) for k, v in self.sizes.items()}}


# ----------------------------------------------------------------------------- trainers' pieces
def average_gradients_by_hand(params: list, world: int, all_reduce: Callable) -> None:
    """DDP's mean of the gradients over ranks, with one flat ``all_reduce`` (the tests' own
    traffic, passed in so that a collective counter can tell it from the library's)."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    all_reduce(flat)
    flat /= world
    for p, piece in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(piece.view_as(p))


def ranks_identical(params: torch.Tensor, world: int, all_gather: Callable) -> bool:
    """Whether every rank holds bitwise the same ``params`` (one ``all_gather``)."""
    gathered = [torch.empty_like(params) for _ in range(world)]
    all_gather(gathered, params)
    return all(torch.equal(g, gathered[0]) for g in gathered)

