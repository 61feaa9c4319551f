"""lsdl_lab.run.launch under torchrun: a killed worker restarts the job from its last
checkpoint with the weights of an uninterrupted run; two node launches on localhost with
the c10d rendezvous form one world (and are that uninterrupted run); the launcher's
errors and timeout; the command line's exit code and messages.

Each torchrun costs ~10-30 s on a loaded 2-core machine (it and each worker import
torch): the two node launches run while the restart test runs.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import assert_same_tree
from run_workers import BASE, RESTARTED, TOL, make

from lsdl_lab.checkpoint import load
from lsdl_lab.distributed import free_port
from lsdl_lab.run import (
    Config,
    LaunchError,
    launch,
    main,
    read_metrics,
    run_rank,
    spawn_run,
    torchrun_command,
    train,
)

LIMIT_S = 240  # no launch may hang a test run


def _weights(path) -> dict:
    return load(path / "checkpoint.pt")["model"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two `torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d` launches on this
    machine, started now and collected by the test that needs them."""
    out = tmp_path_factory.mktemp("two_nodes")
    config = make(RESTARTED, out_dir=str(out / "run"))
    path = out / "run.yaml"
    path.write_text(config.to_yaml())
    command = torchrun_command(
        path, 1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: the workers end with it
        )
        for _ in range(2)
    ]
    yield out / "run", nodes, command
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def test_a_killed_worker_restarts_from_the_checkpoint_with_the_same_weights(
    two_nodes, tmp_path, capsys
):
    config = make(
        RESTARTED,
        checkpoint_every=2,
        kill_at_step=3,
        kill_rank=1,
        out_dir=str(tmp_path / "killed"),
    )
    records = launch(config, nproc=2, max_restarts=1, timeout=LIMIT_S)
    output = capsys.readouterr().out
    assert "--standalone --nproc-per-node 2 --max-restarts 1" in output
    assert "-m lsdl_lab.run --config" in output
    assert "rank 1: killing itself (SIGKILL) at step 3" in output
    assert "resumed from" in output and "at step 2 (written at world size 2" in output
    assert (tmp_path / "killed" / "killed_at_step_3.marker").exists()
    # steps 1-2 before the kill, 3-5 after the restart, one log
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]

    # the uninterrupted twin: two nodes of one process each (c10d rendezvous on localhost)
    run, nodes, command = two_nodes
    outputs = [node.communicate(timeout=LIMIT_S)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "--nnodes 2" in " ".join(command) and "--rdzv-backend c10d" in " ".join(command)
    assert any("world size 2, ddp" in text for text in outputs)
    uninterrupted = read_metrics(run / "metrics.jsonl")
    assert [r["loss"] for r in records] == [r["loss"] for r in uninterrupted]
    assert_same_tree(_weights(tmp_path / "killed"), _weights(run))  # bit for bit


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    """sys.executable replaced by a script that prints its arguments, a line on stderr,
    and exits 1 (or sleeps, with LSDL_FAKE_SLEEP): the launcher's plumbing without torch."""
    script = tmp_path / "python"
    script.write_text(
        "#!/bin/sh\n"
        'echo "ran: $@"\n'
        'if [ -n "$LSDL_FAKE_SLEEP" ]; then sleep "$LSDL_FAKE_SLEEP"; fi\n'
        'echo "lsdl_lab.run: rank 0: the training loss became nan at step 1" >&2\n'
        "exit 1\n"
    )
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))
    return script


def test_launch_reports_a_failed_run_with_its_output(fake_python, tmp_path, capsys):
    config = make(BASE, parallel="ddp", out_dir=str(tmp_path / "run"))
    with pytest.raises(LaunchError) as error:
        launch(config, nproc=2, max_restarts=1, timeout=LIMIT_S)
    assert error.value.returncode == 1
    launched = "-m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 "
    launched += f"-m lsdl_lab.run --config {tmp_path / 'run' / 'launch.yaml'}"
    assert f"ran: {launched}" in error.value.output
    assert "rank 0: the training loss became nan at step 1" in error.value.output
    assert "rank 0: the training loss became nan at step 1" in str(error.value)
    assert f"$ {fake_python} {launched}" in capsys.readouterr().out  # echoed
    assert Config.from_yaml(tmp_path / "run" / "launch.yaml") == config
    with pytest.raises(LaunchError, match="lsdl_lab.run --config"):
        launch(config, nproc=1, echo=False)  # one process: no torchrun


def test_launch_stops_a_run_past_its_timeout(fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("LSDL_FAKE_SLEEP", "60")
    config = make(BASE, parallel="ddp", out_dir=str(tmp_path / "run"))
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"stopped after 1 s") as error:
        launch(config, nproc=2, timeout=1, echo=False)
    assert time.monotonic() - start < 30
    assert error.value.returncode == -1 and "ran: " in error.value.output


def test_the_command_line_exits_1_naming_rank_and_step(tmp_path, capsys):
    flags = ["--profile", "smoke", "--width", "8", "--steps", "3", "--global-batch", "16"]
    flags += ["--no-progress", "--out-dir", str(tmp_path / "cli"), "--nan-at-step", "2"]
    assert main(flags) == 1
    err = capsys.readouterr().err
    assert "lsdl_lab.run: rank 0: the training loss became nan at step 2" in err
    assert main(flags[:-2]) == 0  # resumes at step 2 from nowhere: no checkpoint was saved
    assert load(tmp_path / "cli" / "checkpoint.pt")["step"] == 3


def test_spawn_run_is_the_runs_world_of_two_in_spawned_processes(tmp_path):
    """spawn_run's world of 2 is the run's data-parallel world: rank 0's records, at world
    size 2, and the trajectory of one process on the same global batch (to the last bits of
    the two ranks' sums, run_workers.TOL)."""
    ddp = make(BASE, parallel="ddp", out_dir=str(tmp_path / "ddp"))
    records = spawn_run(ddp, 2, timeout=LIMIT_S)
    alone = train(ddp.replace(out_dir=str(tmp_path / "alone")))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["world_size"] == 2 for r in records) and alone[0]["world_size"] == 1
    losses = [r["loss"] for r in records]
    assert losses == pytest.approx([r["loss"] for r in alone], rel=0, abs=TOL)
    assert losses[-1] < losses[0]  # it trained
    close = {torch.float64: dict(rtol=0.0, atol=TOL)}
    assert_same_tree(_weights(tmp_path / "ddp"), _weights(tmp_path / "alone"), tolerance=close)
    with pytest.raises(TypeError, match="Invalid config"):
        spawn_run(dict(BASE), 2)
    with pytest.raises(ValueError, match="Invalid nproc"):
        spawn_run(ddp, 0)
    assert run_rank.__module__ == "lsdl_lab.run.launch"  # spawn finds the worker by name
