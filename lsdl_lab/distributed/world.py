"""Worlds of processes that start, fail and stop cleanly.

A *world* is a ``torch.distributed`` process group: ``world_size`` processes (ranks) that
can talk to each other. There are two ways to be in one:

* :func:`spawn` starts a fresh world from a notebook or a script: it runs
  ``fn(rank, world_size, *args)`` in ``world_size`` new processes and returns what each
  rank returned. A rank that raises stops the whole world and its traceback reaches the
  caller as a :class:`WorkerError` naming the rank; no process is left behind, not after
  an error, not after a ``KeyboardInterrupt``.
* :func:`init_from_env` (or the context :func:`world_from_env`) joins a world that a
  launcher such as ``torchrun`` started, from the environment variables ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; under
  ``torchrun`` each round of workers (after a restart) under its own keys of the
  launcher's store.

Both pass a ``timeout`` to ``init_process_group``: a collective that can never complete
(a peer died, a deadlock) then raises after ``timeout`` seconds instead of hanging
forever.

Where a rank's tensors live decides the backend: :func:`placement` says, for the device
asked (``"cpu"``, ``"cuda"`` or ``"auto"``) and the ranks on this machine, on which device
a rank runs and which backend its world uses: NCCL with one GPU per local rank, gloo on
the CPU otherwise. A world of 2 on a machine with one GPU (Colab) runs on the CPU with
gloo: NCCL refuses two ranks on one GPU, and gloo's CUDA support lacks the all-gather and
reduce-scatter that ZeRO and FSDP need (PyTorch's table of backends, ``torch.distributed``
documentation). Workers whose tensors are on the CPU get gloo whatever the machine has:
``spawn`` and ``init_from_env`` default to the CPU.

A fresh Python per rank (the ``spawn`` start method) costs 1-3 s a world, as each rank
imports torch; the default ``forkserver`` imports torch once and forks the ranks from a
server (0.1-0.3 s a world). Either way, run many checks in one world:
``spawn(call_each, 2, [check_a, check_b])`` returns every check's result from every rank.

The worker must be a function importable from a module: it is pickled by name and each
new rank imports it. A function defined in a notebook
(``__main__``) would make each process re-run the notebook (pytorch issue #20375), and a
lambda or a function defined inside another function cannot be found by name at all;
both are refused with an error that says so.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import math
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import connection, get_all_start_methods, get_context
from typing import NamedTuple

import torch
import torch.distributed as dist

from .._util import check_choice, check_int, check_positive

__all__ = [
    "WorkerError",
    "Placement",
    "call_each",
    "destroy",
    "free_port",
    "init_from_env",
    "placement",
    "spawn",
    "world_from_env",
]

BACKENDS = ("gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
START_METHODS = ("spawn", "forkserver")
# forkserver where the platform has it (Linux, macOS): see spawn's docstring
DEFAULT_START_METHOD = "forkserver" if "forkserver" in get_all_start_methods() else "spawn"
# What the forkserver imports once for every rank it forks: torch (with this module), and
# torch._dynamo, which DistributedDataParallel's constructor imports (it asks dynamo for its
# DDP mode): 2-8 s of every rank of every world that builds a DDP model, measured.
FORKSERVER_PRELOAD = [__name__, "torch._dynamo"]
# After one rank fails, how long the others get to report their own errors (they are
# usually blocked in a collective with the dead rank and fail within milliseconds) and
# then to exit after SIGTERM, before they are killed.
GRACE_S = 2.0


class WorkerError(RuntimeError):
    """A rank of a spawned world raised (or died). ``rank`` is the first rank that failed,
    ``traceback`` its traceback as text, ``others`` the ranks that failed after it (usually
    because their peer was gone), each with the last line of its error."""

    def __init__(self, rank: int, world_size: int, traceback: str, others: dict[int, str]):
        self.rank, self.world_size = rank, world_size
        self.traceback, self.others = traceback, others
        after = "".join(f"\n  rank {r}: {line}" for r, line in sorted(others.items()))
        super().__init__(
            f"rank {rank} of a world of {world_size} failed; its traceback:\n{traceback}"
            + (f"\nother ranks failed after it:{after}" if after else "")
        )


class Placement(NamedTuple):
    """Where one rank runs: its ``device``, its world's ``backend``, and ``reason``, a line
    that says why (a run prints it first)."""

    device: torch.device
    backend: str
    reason: str


def _env_count(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else _env_int(name, 0)


def placement(
    device: str = "auto", local_world_size: int | None = None, local_rank: int | None = None
) -> Placement:
    """The device of a rank and the backend of its world, from what this machine has.

    * ``"cpu"``: the CPU and gloo, whatever GPUs the machine has.
    * ``"cuda"``: GPU ``local_rank`` and NCCL; an error when the machine has fewer GPUs
      than ranks on it (NCCL refuses two ranks on one GPU).
    * ``"auto"``: ``"cuda"`` when there is a GPU for each rank on this machine, else
      ``"cpu"``: a world of 2 on a one-GPU machine runs on its CPU cores with gloo.

    ``local_world_size`` and ``local_rank`` (the ranks on this machine, this rank's index
    among them) default to ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK`` of the environment,
    which ``torchrun`` and :func:`spawn` set, else 1 and 0 (one process).
    """
    check_choice("device", device, DEVICES)
    if local_world_size is None:
        local_world_size = _env_count("LOCAL_WORLD_SIZE", 1)
    if local_rank is None:
        local_rank = _env_count("LOCAL_RANK", 0)
    n = check_int("local_world_size", local_world_size, 1)
    local_rank = check_int("local_rank", local_rank, 0, n - 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = f"{n} rank{'s' if n > 1 else ''} on this machine"
    if device == "cpu":
        return Placement(torch.device("cpu"), "gloo", f"gloo on the CPU, as asked ({ranks})")
    if n <= gpus:
        return Placement(
            torch.device("cuda", local_rank), "nccl", f"NCCL, one GPU per rank ({ranks})"
        )
    if device == "cuda":
        raise ValueError(
            f"Invalid device: 'cuda' for {ranks} with {gpus} GPU(s) (expected one GPU per "
            "rank: NCCL refuses two ranks on one GPU; 'auto' runs such a world on the CPU "
            "with gloo)"
        )
    why = "no GPU" if gpus == 0 else f"{gpus} GPU(s), fewer than the ranks"
    return Placement(torch.device("cpu"), "gloo", f"gloo on the CPU: {why} ({ranks})")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host``, chosen by the operating system (binding port
    0). A fixed port collides with another world on the same machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _env_int(name: str, low: int) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"Environment variable {name} is not set: init_from_env joins a world that a "
            "launcher (torchrun) started; to start one from Python use spawn()"
        )
    try:
        return check_int(name, int(value), low)
    except ValueError:
        raise ValueError(f"Invalid {name}: {value!r} (expected an int >= {low})") from None


def init_from_env(
    backend: str | None = None, timeout: float = 60.0, device: str = "cpu"
) -> tuple[int, int]:
    """Join the world described by the environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, as ``torchrun`` sets them) and return
    ``(rank, world_size)``. Every collective of the group raises after ``timeout`` seconds
    instead of hanging. ``backend`` defaults to that of :func:`placement` for ``device``,
    the device of the tensors the ranks will hand to collectives (default the CPU:
    gloo). With NCCL, the process uses GPU ``LOCAL_RANK``. Under ``torchrun``
    (``TORCHELASTIC_RUN_ID`` set), the ranks of each round of workers find each other
    under keys of their own in the launcher's store, so a restarted world never reads a
    killed rank's address."""
    timeout = check_positive("timeout", timeout)
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0) if "LOCAL_RANK" in os.environ else 0
    if "MASTER_ADDR" not in os.environ:
        raise RuntimeError("Environment variable MASTER_ADDR is not set (torchrun sets it)")
    _env_int("MASTER_PORT", 1)
    if rank >= world_size:
        raise ValueError(f"Invalid RANK: {rank} (expected an int in [0, {world_size - 1}])")
    if backend is None:
        local_world_size = _env_count("LOCAL_WORLD_SIZE", world_size)
        backend = placement(device, local_world_size, local_rank).backend
    check_choice("backend", backend, BACKENDS)
    if dist.is_initialized():
        raise RuntimeError("This process is already in a world; call destroy() first")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    delta = datetime.timedelta(seconds=timeout)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun, which may restart the workers
        store = _round_store(rank, world_size, delta)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=delta
        )
    else:
        dist.init_process_group(
            backend, init_method="env://", rank=rank, world_size=world_size, timeout=delta
        )
    return rank, world_size


def _round_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The launcher's store, with the keys of this round of workers under their own prefix.

    torchrun keeps its key-value store across restarts, and the default process group
    finds its peers under the same keys every time: a restarted rank can read the address
    that the killed rank published and fail ("Gloo connectFullMesh failed ... Connection
    refused", seen with torch 2.13 under ``--standalone``). Each round counts itself in
    the store (every rank of round k draws a number in [kW + 1, (k + 1)W]) and keeps its
    keys under that round's prefix. The count, not ``TORCHELASTIC_RESTART_COUNT``: that is
    each node's agent's own count, which need not agree across nodes that joined the job
    at different restarts. (A rank that dies before this point would shift the count; the
    collectives' timeout then ends the round with an error, not a hang.)
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    round_ = (store.add("lsdl_lab.distributed/joined", 1) - 1) // world_size
    return dist.PrefixStore(f"lsdl_lab.distributed/round{round_}/", store)


def destroy() -> None:
    """Leave the world this process is in (nothing happens when it is in none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def world_from_env(
    backend: str | None = None, timeout: float = 60.0, device: str = "cpu"
) -> Iterator[tuple[int, int]]:
    """:func:`init_from_env` for the block, :func:`destroy` after it (also when it raises)::

    with world_from_env() as (rank, world_size):
        ...
    """
    rank_and_size = init_from_env(backend, timeout, device)
    try:
        yield rank_and_size
    finally:
        destroy()


def call_each(rank: int, world_size: int, fns: Sequence[Callable], *args) -> list:
    """A worker for :func:`spawn` that runs ``fn(rank, world_size, *args)`` for each of
    ``fns`` in turn in the same world and returns the list of their results: many checks
    for the price of one spawn."""
    return [fn(rank, world_size, *args) for fn in fns]


def _check_worker(fn) -> None:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    if not callable(inner):
        raise TypeError(f"Invalid fn: {fn!r} (expected a function)")
    module, qualname = getattr(inner, "__module__", None), getattr(inner, "__qualname__", "")
    if module == "__main__":
        raise ValueError(
            f"Invalid fn: {qualname} is defined in __main__ (a notebook or a script). Each "
            "spawned process would import __main__ again and re-run it (pytorch #20375); "
            "define the worker in an importable module (for instance a .py file beside the "
            "notebook) and import it from there"
        )
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ValueError(
            f"Invalid fn: {qualname} is a lambda or a function defined inside another "
            "function; a spawned process finds its worker by module and name, so the worker "
            "must be a top-level function of an importable module"
        )
    found = importlib.import_module(module) if module else None
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not inner:
        raise ValueError(f"Invalid fn: {module}.{qualname} cannot be imported by that name")


def _exit_with_parent(parent_pid: int) -> None:
    # If the parent is killed outright (SIGKILL: no finally runs), its ranks would live on,
    # blocked in a collective until the group's timeout; this thread ends them at once.
    # (Under forkserver the rank's own parent is the server, so ask for the pid itself.)
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        time.sleep(0.5)


def _rank_main(job: bytes, rank, world_size, port, backend, timeout, conn, caller) -> None:
    """One rank. ``job`` pickles ``(fn, args)``; ``caller`` is the caller's pid, environment
    and ``sys.path`` now, set before ``job`` is unpickled: a forkserver was started with
    the caller's state of some time ago, and the worker's module may be on a newer path."""
    parent_pid, environ, path = caller
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    if "OMP_NUM_THREADS" in environ:  # read by a fresh torch at import; the server's is old
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        fn, args = pickle.loads(job)
        init_from_env(backend, timeout)
        # Pickled here by value, not by torch's shared-memory reducers, so the result stays
        # readable after this process has exited.
        message = ("ok", pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 -- KeyboardInterrupt too must reach the parent
        message = ("error", time.monotonic(), traceback.format_exc())
    conn.send(message)  # before leaving the group, which may block if a peer is gone
    conn.close()
    destroy()


def _join_all(processes, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))


def _stop(processes, exiting: bool) -> None:
    """Let ranks that are ``exiting`` (all results in) leave the group and end by
    themselves; then terminate (SIGTERM) what is alive, and kill (SIGKILL) what is still
    alive after a grace."""
    if exiting:
        _join_all(processes, GRACE_S)
    for p in processes:
        if p.is_alive():
            p.terminate()
    _join_all(processes, GRACE_S)
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()


def spawn(
    fn: Callable,
    world_size: int,
    *args,
    backend: str | None = None,
    timeout: float = 60.0,
    start_method: str = DEFAULT_START_METHOD,
    device: str = "cpu",
) -> list:
    """Run ``fn(rank, world_size, *args)`` in a fresh world of ``world_size`` processes and
    return the list of the ranks' return values, ordered by rank.

    ``fn`` must be a top-level function of an importable module (see the module's
    docstring); ``args`` and the return values must pickle (CPU tensors do). ``backend``
    defaults to that of :func:`placement` for ``device``, the device of the tensors the
    workers hand to collectives: gloo for the CPU (the default, whatever GPUs the machine
    has), NCCL with a GPU per rank for ``"cuda"``, and for ``"auto"`` NCCL when there are
    enough GPUs, else gloo. ``timeout`` (seconds) bounds every collective, so a deadlock
    ends in an error. The port is free, chosen per world.

    ``start_method="spawn"`` starts each rank as a new Python, which imports torch: 1-3 s
    per world, 10-15 s measured on 2 loaded cores. ``"forkserver"`` (the default where the
    platform has it) imports torch once, in a server process that the first world starts
    and that lives as long as the caller, and forks each rank from it: 0.1-0.3 s a world
    on the same machine. Like spawn, and unlike fork, the ranks inherit no threads, CUDA
    state or notebook from the caller; each rank takes the caller's environment and
    ``sys.path`` as they are at the call.

    If a rank raises or dies, the other ranks are stopped and :class:`WorkerError` is
    raised with the first failing rank and its traceback. On any exit, a
    ``KeyboardInterrupt`` included, every process of the world has ended.
    """
    _check_worker(fn)
    world_size = check_int("world_size", world_size, 1)
    timeout = check_positive("timeout", timeout)
    if backend is None:
        backend = placement(device, world_size, 0).backend
    check_choice("backend", backend, BACKENDS)
    ctx = get_context(check_choice("start_method", start_method, START_METHODS))
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    port, caller = free_port(), (os.getpid(), dict(os.environ), list(sys.path))
    job = pickle.dumps((fn, args))
    processes, readers, done = [], [], False
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(job, rank, world_size, port, backend, timeout, writer, caller),
                name=f"lsdl-rank-{rank}",
            )
            p.start()
            writer.close()  # the parent keeps only the reading end: EOF when the rank dies
            processes.append(p)
            readers.append(reader)
        results, errors = _collect(processes, readers)
        done = not errors
        if errors:
            first = min(errors, key=lambda r: errors[r][0])
            others = {r: e[1].strip().splitlines()[-1] for r, e in errors.items() if r != first}
            raise WorkerError(first, world_size, errors[first][1], others)
        return [pickle.loads(results[rank]) for rank in range(world_size)]
    finally:
        _stop(processes, exiting=done)
        for reader in readers:
            reader.close()


def _collect(processes, readers) -> tuple[dict[int, bytes], dict[int, tuple[float, str]]]:
    """Read each rank's message as it arrives. After the first error, wait at most
    ``GRACE_S`` for the other ranks' messages, then stop. An error is ``(when, text)``:
    the first failure is a rank that died without a word, if any, else the earliest."""
    results, errors, pending = {}, {}, set(range(len(processes)))
    deadline = None
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = connection.wait([readers[r] for r in pending], left)
        if not ready:
            break
        for reader in ready:
            rank = readers.index(reader)
            pending.discard(rank)
            try:
                message = reader.recv()
            except EOFError:  # the process died without a word (killed, os._exit, segfault)
                processes[rank].join(GRACE_S)
                code = processes[rank].exitcode
                # Its peers' errors ("Connection closed by peer") follow from its death but
                # may be stamped before the parent sees it die: a silent death counts first.
                message = ("error", -math.inf, f"rank {rank} died (exit code {code})\n")
            if message[0] == "ok":
                results[rank] = message[1]
            else:
                errors[rank] = message[1:]
                deadline = deadline or time.monotonic() + GRACE_S
    return results, errors
