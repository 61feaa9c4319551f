"""Starting a run: the command line (:func:`main`) and :func:`launch`, which runs the
same command under ``torchrun`` from Python (a notebook, a test) and returns its metrics;
:func:`spawn_run` runs it in a world of :func:`lsdl_lab.distributed.spawn` instead (ranks forked
from a server that has imported torch once: no torchrun start per run).

The workers of a launched run are new Python processes started by ``torchrun``
(``python -m torch.distributed.run``), exactly as from a shell; nothing of the notebook
is pickled or re-imported (the pitfall of spawning a notebook's function, pytorch issue
#20375). Their output streams into the notebook as it comes; if the run fails,
:class:`LaunchError` carries the return code and the end of the output.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .._util import check_int, check_positive
from ..checkpoint import CheckpointError
from ..distributed.world import spawn
from ..train import NonFiniteLossError
from .config import Config, load_config
from .loop import train
from .metrics import read_metrics

__all__ = ["LaunchError", "launch", "main", "run_rank", "spawn_run", "torchrun_command"]


class LaunchError(RuntimeError):
    """A launched run ended with a non-zero return code (``returncode``); ``output`` is
    what it printed."""

    def __init__(self, returncode: int, output: str, command: list[str]):
        self.returncode, self.output, self.command = returncode, output, command
        tail = "\n".join(output.splitlines()[-30:])
        super().__init__(
            f"the run ended with return code {returncode}: {' '.join(command)}\n"
            f"--- last lines of its output ---\n{tail}"
        )


def main(argv: list[str] | None = None) -> int:
    """The command line: load the config, run it on this process, return the exit code
    (1 after a non-finite loss or an unusable checkpoint, with the reason printed by
    every rank)."""
    config = load_config(argv)
    rank = os.environ.get("RANK", "0")
    try:
        train(config)
    except (NonFiniteLossError, CheckpointError) as e:
        print(f"lsdl_lab.run: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def torchrun_command(
    config_path,
    nproc: int = 2,
    *,
    nnodes: int = 1,
    max_restarts: int = 0,
    rdzv_endpoint: str | None = None,
) -> list[str]:
    """The ``torchrun`` command of a run (as a list for :mod:`subprocess`): one node with
    ``--standalone``, else the c10d rendezvous at ``rdzv_endpoint`` (``host:port``) that
    every node's launch names."""
    nproc = check_int("nproc", nproc, 1)
    nnodes = check_int("nnodes", nnodes, 1)
    max_restarts = check_int("max_restarts", max_restarts, 0)
    command = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1 and rdzv_endpoint is None:
        command.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("Invalid rdzv_endpoint: None (expected host:port with nnodes > 1)")
        command += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d"]
        command += ["--rdzv-endpoint", rdzv_endpoint]
    command += ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)]
    return command + ["-m", "lsdl_lab.run", "--config", str(config_path)]


def _stop(process: subprocess.Popen) -> None:
    """End the launched process group: SIGTERM, then SIGKILL after a grace."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait)


def launch(
    config: Config,
    nproc: int = 2,
    *,
    max_restarts: int = 0,
    timeout: float = 600.0,
    echo: bool = True,
) -> list[dict]:
    """Run ``config`` on ``nproc`` processes of this machine under ``torchrun`` (one
    process without torchrun when ``nproc=1`` and ``max_restarts=0``) and return rank 0's
    metrics records (:mod:`lsdl_lab.run.metrics`).

    The config is written to ``<out_dir>/launch.yaml``; the command run is printed first,
    so it can be copied into a shell. With ``echo`` the workers' output is shown as it
    comes. After ``timeout`` seconds the run is stopped (every process of it) and
    :class:`LaunchError` raised, as when it fails.
    """
    if not isinstance(config, Config):
        raise TypeError(f"Invalid config: a {type(config).__name__} (expected a Config)")
    timeout = check_positive("timeout", timeout)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "launch.yaml"
    path.write_text(config.to_yaml())
    if check_int("nproc", nproc, 1) == 1 and max_restarts == 0:
        command = [sys.executable, "-m", "lsdl_lab.run", "--config", str(path)]
    else:
        command = torchrun_command(path, nproc, max_restarts=max_restarts)
    if echo:
        print("$ " + " ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    chunks, deadline = [], time.monotonic() + timeout
    try:
        os.set_blocking(process.stdout.fileno(), False)
        while True:
            chunk = process.stdout.read()
            if chunk:
                text = chunk.decode(errors="replace")
                chunks.append(text)
                if echo:
                    sys.stdout.write(text)
                    sys.stdout.flush()
            elif process.poll() is not None:
                break
            else:
                time.sleep(0.05)
            if time.monotonic() > deadline:
                _stop(process)
                raise LaunchError(-1, "".join(chunks) + f"\n(stopped after {timeout:g} s)", command)
    finally:
        _stop(process)
        process.stdout.close()
    if process.returncode != 0:
        raise LaunchError(process.returncode, "".join(chunks), command)
    return read_metrics(out / "metrics.jsonl")


def run_rank(rank: int, world_size: int, config: Config) -> list[dict]:
    """One rank of a run of ``config`` in a world started by :func:`lsdl_lab.distributed.spawn`
    (the worker :func:`spawn_run` hands it): :func:`train` joins the spawned world as it
    joins ``torchrun``'s, reading rank and size from its process group; rank 0 returns the
    metrics records, the others an empty list."""
    del rank, world_size  # train reads both from the process group spawn created
    return train(config)


def spawn_run(config: Config, nproc: int = 2, *, timeout: float = 600.0) -> list[dict]:
    """Run ``config`` on ``nproc`` ranks started by :func:`lsdl_lab.distributed.spawn` and return
    rank 0's metrics records: the same :func:`train` as :func:`launch`, without a new
    Python per rank (0.1-0.3 s a world instead of 10-30 s of ``torchrun`` start on a
    loaded machine), for comparing several short runs. A failing rank raises
    :class:`lsdl_lab.distributed.WorkerError` naming it; every collective ends after
    ``config.timeout`` seconds, the whole world after ``timeout``."""
    if not isinstance(config, Config):
        raise TypeError(f"Invalid config: a {type(config).__name__} (expected a Config)")
    nproc = check_int("nproc", nproc, 1)
    timeout = check_positive("timeout", timeout)
    # the world's backend as each rank's train() will place itself (lsdl_lab.distributed.placement)
    backend = None if config.backend == "auto" else config.backend
    return spawn(run_rank, nproc, config, backend=backend, device=config.device, timeout=timeout)[0]
