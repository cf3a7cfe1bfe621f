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
* a rank that exits without writing its result (killed, segfault, abort): ``WorkerFailed``.

Every failure message names each rank's fate (finished, raised, exit code, or the signal
that ended it, e.g. ``SIGABRT``) and includes the failing ranks' stderr: each rank's file
descriptor 2 goes to ``out_dir/stderr_<rank>.txt``, so what C++ writes on its way down
(gloo's errors, libstdc++'s ``terminate called ...``) is kept, not only Python tracebacks.

Each rank writes its result to ``out_dir/result_<rank>.pt`` (``torch.save``); the
process group uses a fresh free TCP port on 127.0.0.1 for every spawn, and every rank
runs with ``torch.set_num_threads(1)`` and, on Linux, the ``SCHED_BATCH`` policy (the test
machines have two shared cores; see ``_batch_scheduling``).
"""
from __future__ import annotations

import os
import signal
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


def _stderr_path(out_dir: str | os.PathLike, rank: int) -> Path:
    return Path(out_dir) / f"stderr_{rank}.txt"


def _capture_stderr(out_dir: str, rank: int) -> None:
    """Send this process's file descriptor 2 to ``stderr_<rank>.txt``: a rank killed by a
    signal leaves no traceback, only what C++ and Python wrote there before it died."""
    sys.stderr.flush()
    fd = os.open(_stderr_path(out_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def _batch_scheduling() -> None:
    """Put this rank under Linux's ``SCHED_BATCH`` (normal priority, no privilege needed).

    The test machines give 3 or 4 ranks 2 cores. Under the default policy a rank woken by a
    peer's message preempts the one running, so the many small collectives of a test spawn turn
    into context switches: about 32,000 a second at 4 ranks, with more system time than user
    time. ``SCHED_BATCH`` lets the running rank finish its slice; a 4-rank spawn of
    ``test_equivalence.py`` took 33 s instead of 60 s, a 3-rank one 21 s instead of 45 s.
    Scheduling only: what the ranks compute, and the hard timeouts, are unchanged."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:  # a platform or sandbox that refuses it: the default policy, slower
            pass


def _entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple,
           collective_timeout: float) -> None:
    _capture_stderr(out_dir, rank)
    torch.set_num_threads(1)
    _batch_scheduling()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # never an external interface
    import datetime
    code = 1
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        result = fn(rank, world_size, out_dir, *args)
        # Nobody leaves before everyone is done (a rank's last collective may still be
        # serving a peer).
        dist.barrier()
        torch.save(result, os.path.join(out_dir, f"result_{rank}.pt"))
        code = 0
    except BaseException:  # reported through the file: this process leaves by os._exit below
        with open(os.path.join(out_dir, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on the way out (also: init failed)
            pass
    # Leave without the interpreter's shutdown, on success and on failure alike. With gloo
    # (torch 2.13), destroy_process_group only drops torch.distributed's own references:
    # ProcessGroupGloo has no shutdown of its own, and its worker threads stop only when the
    # last reference to the group goes, which FSDP2's mesh info, a DeviceMesh or the
    # preconditioner's sharded layout may still hold. Finalization then runs beside
    # those threads; rarely (about one spawn in a few hundred here) a rank aborted there
    # ("terminate called without an active exception") after every rank had written its
    # result, i.e. after the last collective, outside the code under test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_scenarios(rank: int, world_size: int, out_dir: str, scenarios: dict[str, Callable]) -> dict:
    """A worker running several scenarios in one spawn (spawning ranks, each importing torch,
    costs more than most scenarios): ``{name: scenario(rank, world_size, out_dir)}``, in order.
    Each scenario seeds and builds its own model, as it would alone; one expected to raise
    catches its error itself (and comes last), so that it cannot take the others down.
    ``scenarios`` is pickled to the ranks: module-level functions or ``functools.partial``."""
    return {name: scenario(rank, world_size, out_dir) for name, scenario in scenarios.items()}


def results_of(ranks: list[dict], name: str) -> list:
    """One scenario's results from :func:`run_scenarios`' per-rank dicts, in rank order."""
    return [r[name] for r in ranks]


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
    for stale in [*out.glob("result_*.pt"), *out.glob("error_*.txt"), *out.glob("stderr_*.txt")]:
        stale.unlink()
    port = free_port()
    context = mp.start_processes(
        _entry, args=(fn, world_size, port, str(out), args, max(timeout, 1.0)),
        nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    failure: Exception | None = None
    timed_out = False
    try:
        while True:
            try:
                if context.join(timeout=0.2):
                    break
            except Exception as err:  # ProcessRaisedException / ProcessExitedException
                failure = err
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
    finally:
        # Ranks the harness ends, reported as such rather than as failures of their own:
        # those still running here, and those torch.multiprocessing's join terminated
        # (SIGTERM, then SIGKILL) when another rank failed.
        killed = {rank for rank, p in enumerate(context.processes) if p.is_alive()}
        first = getattr(failure, "error_index", None)
        killed |= {rank for rank, p in enumerate(context.processes)
                   if first is not None and rank != first and p.exitcode in (-signal.SIGTERM, -signal.SIGKILL)}
        for rank in sorted(killed):
            context.processes[rank].kill()
        for process in context.processes:
            process.join(5)
    if timed_out:
        raise WorkerTimeout(
            f"{fn.__name__} at world size {world_size}: rank(s) {sorted(killed)} still running after "
            f"{timeout:.0f} s (a hang?); all ranks killed.\n" + _describe_ranks(out, context.processes, killed))
    if failure is not None:
        raise WorkerFailed(f"{fn.__name__} at world size {world_size}: {_first_failure(failure)}\n"
                           + _describe_ranks(out, context.processes, killed))
    results = []
    for rank in range(world_size):
        path = out / f"result_{rank}.pt"
        if not path.exists():
            raise WorkerFailed(f"{fn.__name__} at world size {world_size}: rank {rank} exited without a result\n"
                               + _describe_ranks(out, context.processes, killed))
        results.append(torch.load(path, weights_only=False))
    return results


def _first_failure(err: Exception) -> str:
    """The rank torch.multiprocessing saw fail first, and how (its own words otherwise: an
    exception raised before the rank's own reporting was set up)."""
    rank = getattr(err, "error_index", None)
    if rank is not None and getattr(err, "signal_name", None):
        return f"rank {rank} was killed by signal {err.signal_name}"
    if rank is not None and getattr(err, "exit_code", None) is not None:
        return f"rank {rank} exited with code {err.exit_code}"
    return str(err).strip() or type(err).__name__


def _fate(exitcode: int | None, killed_by_harness: bool, raised: bool) -> str:
    if raised and exitcode == 1:
        return "raised (exit code 1; traceback below)"
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        if killed_by_harness:
            return f"killed by the harness ({name}) after another rank failed or the timeout passed"
        return f"killed by signal {name}"
    return "finished" if exitcode == 0 else f"exited with code {exitcode}"


def _tail(text: str, limit: int = 6000) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} characters cut ...]\n{text[-limit:]}"


def _describe_ranks(out: Path, processes: list, killed: set[int]) -> str:
    """One line per rank with its fate, then each rank's traceback (if it raised) and its
    captured stderr (if it wrote any)."""
    parts = []
    for rank, process in enumerate(processes):
        raised = (out / f"error_{rank}.txt").exists()
        parts.append(f"rank {rank}: {_fate(process.exitcode, rank in killed, raised)}")
    for rank in range(len(processes)):
        error = out / f"error_{rank}.txt"
        if error.exists():
            parts.append(f"--- rank {rank} traceback ---\n{error.read_text()}")
        stderr = _stderr_path(out, rank)
        text = stderr.read_text(errors="replace") if stderr.exists() else ""
        if text.strip():
            parts.append(f"--- rank {rank} stderr ({stderr.name}) ---\n{_tail(text)}")
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
        return {"calls": dict(self.calls), "bytes": dict(self.bytes),
                "sizes": {k: list(v) for k, v in self.sizes.items()}}


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


def average_gradients_as_ddp(model: torch.nn.Module, world: int) -> None:
    """DDP's mean over the ranks of every gradient that exists (one all-reduce per parameter;
    a parameter whose ``.grad`` is None, on every rank alike, is left as it is)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def step_as_ddp(optimizer: Any, params: list, world: int) -> bool:
    """Average the gradients over the ranks as DDP would, step, and say whether every rank
    then holds bitwise the same ``params`` (``True`` on one rank)."""
    if world == 1:
        optimizer.step()
        return True
    average_gradients_by_hand(params, world, dist.all_reduce)
    optimizer.step()
    return ranks_identical(torch.cat([p.detach().reshape(-1) for p in params]), world, dist.all_gather)
