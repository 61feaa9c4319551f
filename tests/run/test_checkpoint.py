"""The run's checkpoints (lsdl_lab.run.loop.RunCheckpoint): weights_only files; a corrupt,
truncated or foreign file is an error naming it, and a run never restarts from scratch
over it."""

import pytest
import torch
from run_workers import CONSTANT, make

from lsdl_lab.checkpoint import load
from lsdl_lab.run import CheckpointError, main, train
from lsdl_lab.run.loop import FORMAT


class _Payload:
    def __reduce__(self):
        return (print, ("this ran while loading a checkpoint",))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    config = make(CONSTANT, steps=2, out_dir=str(out))
    train(config)
    return config, out / "checkpoint.pt"


def test_a_checkpoint_loads_with_weights_only(finished):
    config, path = finished
    state = torch.load(path, weights_only=True)
    assert state["format"] == FORMAT and state["step"] == 2
    assert state["config"] == config.to_dict() and state["world_size"] == 1
    assert set(state["model"]) == {
        "net.1.weight",
        "net.1.bias",
        "net.3.weight",
        "net.3.bias",
        "net.5.weight",
        "net.5.bias",
    }
    assert set(state["optimizer"]["state"]["net.1.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["optimizer"]["param_groups"][0]["params"][0] == "net.1.weight"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "foreign", "code"])
def test_an_unusable_checkpoint_stops_the_run_naming_the_file(finished, tmp_path, damage):
    config, good = finished
    out = tmp_path / damage
    out.mkdir()
    path = out / "checkpoint.pt"
    data = good.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(data[:100] + b"\x00" * 64 + data[164:])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "foreign":
        torch.save({"model": {}}, path)
    else:
        torch.save({"format": FORMAT, "x": _Payload()}, path)
    message = {
        "foreign": "is not a lsdl_lab.run checkpoint",
        "code": "cannot be read: it holds objects other than tensors",
    }.get(damage, "cannot be read: it is corrupt or truncated")
    with pytest.raises(CheckpointError, match=f"checkpoint {path} {message}"):
        load(path, FORMAT)
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=str(path)):
        train(config.replace(out_dir=str(out), steps=4))
    assert path.read_bytes() == before  # not overwritten by a fresh start
    assert not (out / "metrics.jsonl").exists()


def test_the_command_line_says_so_and_exits_1(finished, tmp_path, capsys):
    config, _ = finished
    (tmp_path / "checkpoint.pt").write_bytes(b"PK\x03\x04 half a zip")
    flags = ["--profile", "smoke", "--width", "16", "--no-progress", "--out-dir", str(tmp_path)]
    assert main(flags) == 1
    assert (
        f"rank 0: checkpoint {tmp_path / 'checkpoint.pt'} cannot be read" in capsys.readouterr().err
    )
    assert main(flags + ["--no-resume", "--steps", "1"]) == 0  # asked to start afresh: it does
    assert load(tmp_path / "checkpoint.pt")["step"] == 1
