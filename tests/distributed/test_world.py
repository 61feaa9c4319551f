"""Worlds start, return each rank's value, fail with the failing rank's traceback, and leave
no process behind (counted with psutil) after an error or a KeyboardInterrupt."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import dist_workers
import psutil
import pytest
import torch

from lsdl_lab.distributed import WorkerError, init_from_env, placement, spawn

SERVERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def world_processes() -> set[int]:
    """This process's descendants, but multiprocessing's resource tracker and forkserver,
    which live as long as the test process by design (the ranks are the server's
    children, so they are counted)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if not any(server in " ".join(child.cmdline()) for server in SERVERS):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_spawn_returns_every_rank_value_in_rank_order(start_method):
    before = world_processes()
    payload = torch.arange(5, dtype=torch.float64)
    results = spawn(dist_workers.describe, 2, payload, timeout=30, start_method=start_method)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["dist_rank"] == r["rank"] and r["world_size"] == r["dist_world_size"] == 2
        assert r["backend"] == "gloo" and r["total"] == 3.0  # 1 + 2
        assert r["threads"] == 1  # OMP_NUM_THREADS reaches the ranks
        assert torch.equal(r["payload"], payload)
    assert len({r["pid"] for r in results} | {os.getpid()}) == 3
    assert world_processes() == before


def test_failing_rank_surfaces_its_traceback_and_leaves_no_process():
    before = world_processes()
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(dist_workers.fail_on, 2, 1, timeout=30)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1 and err.world_size == 2
    assert "ValueError: deliberate failure on rank 1" in err.traceback
    assert "in fail_on" in err.traceback  # the worker's own frame, not only a summary
    assert "rank 1 of a world of 2 failed" in str(err)
    # rank 0 was blocked in a barrier with the dead rank 1: stopped at once, not after the
    # 30 s timeout
    assert elapsed < 15
    assert world_processes() == before


def test_rank_that_dies_without_a_word_is_reported():
    before = world_processes()
    with pytest.raises(WorkerError, match=r"rank 1 died \(exit code 3\)") as info:
        spawn(dist_workers.die_on, 2, 1, timeout=30)
    assert info.value.rank == 1
    assert world_processes() == before


def test_keyboard_interrupt_in_the_parent_leaves_no_process():
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = world_processes()
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 3.0)
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            spawn(dist_workers.sleep, 2, 60.0, timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - start < 15
    assert world_processes() == before


def test_ranks_see_the_callers_path_and_environment_at_the_call(tmp_path, monkeypatch):
    spawn(dist_workers.square, 2)  # the forkserver, if any, starts before what follows
    (tmp_path / "late_worker.py").write_text(
        "import os\n\ndef work(rank, world_size):\n    return os.environ['LSDL_LATE']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LSDL_LATE", "seen")
    import late_worker

    assert spawn(late_worker.work, 2) == ["seen", "seen"]


def test_spawn_refuses_workers_a_new_process_cannot_import():
    notebook = {"__name__": "__main__"}
    exec("def work(rank, world_size):\n    return rank\n", notebook)  # as a notebook cell
    with pytest.raises(ValueError, match=r"defined in __main__.*#20375"):
        spawn(notebook["work"], 2)

    def local(rank, world_size):
        return rank

    with pytest.raises(ValueError, match="inside another function"):
        spawn(local, 2)
    with pytest.raises(ValueError, match="lambda"):
        spawn(lambda rank, world_size: rank, 2)
    with pytest.raises(TypeError, match="Invalid fn"):
        spawn(42, 2)


def test_spawn_checks_its_arguments():
    with pytest.raises(ValueError, match="Invalid world_size: 0"):
        spawn(dist_workers.square, 0)
    with pytest.raises(TypeError, match="Invalid world_size"):
        spawn(dist_workers.square, 2.0)
    with pytest.raises(ValueError, match="Invalid timeout"):
        spawn(dist_workers.square, 2, timeout=0)
    with pytest.raises(ValueError, match="Invalid backend: 'mpi'"):
        spawn(dist_workers.square, 2, backend="mpi")
    with pytest.raises(ValueError, match="Invalid start_method: 'fork'"):
        spawn(dist_workers.square, 2, start_method="fork")


def test_init_from_env_names_the_missing_variable(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK is not set.*torchrun"):
        init_from_env()
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match=r"Invalid RANK: 2 \(expected an int in \[0, 1\]\)"):
        init_from_env()


def test_a_world_under_torchrun():
    script = Path(__file__).resolve().parent / "torchrun_script.py"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # the two ranks print at once into torchrun's one stream: a line may hold both
    said = sorted(re.findall(r"rank \d of 2: sum \d+ on (?:gloo|nccl)", run.stdout))
    assert said == ["rank 0 of 2: sum 1 on gloo", "rank 1 of 2: sum 1 on gloo"]


def gpus(monkeypatch, n: int) -> None:
    """Make this process see ``n`` GPUs (only placement reads these two answers)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize(
    "machine_gpus, device, ranks, local_rank, expected",
    [
        (0, "auto", 1, 0, ("cpu", "gloo")),
        (0, "auto", 2, 1, ("cpu", "gloo")),
        (1, "auto", 1, 0, ("cuda:0", "nccl")),
        (1, "auto", 2, 1, ("cpu", "gloo")),  # Colab: two ranks, one GPU
        (2, "auto", 2, 1, ("cuda:1", "nccl")),  # Kaggle: a GPU per rank
        (2, "cpu", 2, 1, ("cpu", "gloo")),  # CPU tensors never go to NCCL
        (2, "cuda", 2, 0, ("cuda:0", "nccl")),
        (8, "auto", 4, 3, ("cuda:3", "nccl")),
    ],
)
def test_placement_gives_nccl_only_with_a_gpu_per_rank(
    monkeypatch, machine_gpus, device, ranks, local_rank, expected
):
    gpus(monkeypatch, machine_gpus)
    where = placement(device, ranks, local_rank)
    assert (str(where.device), where.backend) == expected
    assert where.backend in where.reason or "NCCL" in where.reason
    assert f"{ranks} rank" in where.reason


def test_placement_refuses_more_cuda_ranks_than_gpus_and_reads_the_environment(monkeypatch):
    gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match=r"Invalid device: 'cuda' for 2 ranks.*1 GPU"):
        placement("cuda", 2, 0)
    with pytest.raises(ValueError, match="Invalid device: 'tpu'"):
        placement("tpu")
    with pytest.raises(ValueError, match=r"Invalid local_rank: 2 \(expected an int in \[0, 1\]"):
        placement("auto", 2, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert placement("auto") == placement("auto", 2, 1)
    assert placement("auto").device == torch.device("cpu")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_RANK")
    assert placement("auto").device == torch.device("cuda", 0)


def test_spawned_workers_get_gloo_on_a_machine_with_a_gpu_per_rank(monkeypatch):
    """The backend is chosen in the caller: with two GPUs seen there, a world whose
    workers hand CPU tensors to collectives (the default) still gets gloo."""
    gpus(monkeypatch, 2)
    results = spawn(dist_workers.describe, 2, timeout=30)
    assert [r["backend"] for r in results] == ["gloo", "gloo"]
    assert [r["total"] for r in results] == [3.0, 3.0]
