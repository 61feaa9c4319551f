"""lsdl_lab.run.launch under torchrun: a killed worker restarts the job from its last
checkpoint with the weights of an uninterrupted run; two node launches on localhost with
the c10d rendezvous form one world; the command line's exit code and messages.

Each torchrun costs ~10-30 s on a loaded 2-core machine (it and each worker import
torch): the two node launches run while the restart test runs.
"""

import os
import subprocess

import pytest
import torch
from run_workers import WORLD2, make

from lsdl_lab.dist import free_port
from lsdl_lab.run import LaunchError, launch, main, torchrun_command
from lsdl_lab.run.checkpoint import load

LIMIT_S = 240  # no launch may hang a test run


def _equal_weights(a, b) -> bool:
    a, b = load(a / "checkpoint.pt")["model"], load(b / "checkpoint.pt")["model"]
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two `torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d` launches on this
    machine, started now and collected by the test that needs them."""
    out = tmp_path_factory.mktemp("two_nodes")
    config = make(WORLD2["ddp_restart_reference"], out_dir=str(out / "run"))
    path = out / "run.yaml"
    path.write_text(config.to_yaml())
    command = torchrun_command(
        path, 1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for _ in range(2)
    ]
    yield out / "run", nodes, command
    for node in nodes:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_killed_worker_restarts_from_the_checkpoint_with_the_same_weights(
    two_nodes, world2, tmp_path, capsys
):
    config = make(
        WORLD2["ddp_restart_reference"],
        checkpoint_every=2,
        kill_at_step=3,
        kill_rank=1,
        out_dir=str(tmp_path / "killed"),
    )
    records = launch(config, nproc=2, max_restarts=1, timeout=LIMIT_S)
    output = capsys.readouterr().out
    assert "--max-restarts 1" in output and "-m lsdl_lab.run --config" in output
    assert "rank 1: killing itself (SIGKILL) at step 3" in output
    assert "resumed from" in output and "at step 2 (written at world size 2" in output
    assert (tmp_path / "killed" / "killed_at_step_3.marker").exists()
    # steps 1-2 before the kill, 3-5 after the restart, one log
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    root, results = world2
    uninterrupted = results[0]["ddp_restart_reference"]
    assert [r["loss"] for r in records] == [r["loss"] for r in uninterrupted]
    assert _equal_weights(tmp_path / "killed", root / "ddp_restart_reference")

    # meanwhile, two nodes of one process each (c10d rendezvous on localhost)
    run, nodes, command = two_nodes
    outputs = [node.communicate(timeout=LIMIT_S)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "--nnodes 2" in " ".join(command) and "--rdzv-backend c10d" in " ".join(command)
    assert any("world size 2, ddp" in text for text in outputs)
    assert _equal_weights(run, root / "ddp_restart_reference")


def test_launch_reports_a_failed_run(tmp_path):
    config = make(WORLD2["ddp"], nan_at_step=1, nan_rank=0, out_dir=str(tmp_path / "nan"))
    with pytest.raises(LaunchError) as error:
        launch(config, nproc=1, timeout=LIMIT_S, echo=False)
    assert error.value.returncode == 1
    assert "rank 0: the training loss became nan at step 1" in error.value.output


def test_the_command_line_exits_1_naming_rank_and_step(tmp_path, capsys):
    flags = ["--profile", "smoke", "--width", "8", "--steps", "3", "--global-batch", "16"]
    flags += ["--no-progress", "--out-dir", str(tmp_path / "cli"), "--nan-at-step", "2"]
    assert main(flags) == 1
    err = capsys.readouterr().err
    assert "lsdl_lab.run: rank 0: the training loss became nan at step 2" in err
    assert main(flags[:-2]) == 0  # resumes at step 2 from nowhere: no checkpoint was saved
    assert load(tmp_path / "cli" / "checkpoint.pt")["step"] == 3
