"""The run's checkpoints (lsdl_lab.run.loop.RunCheckpoint): weights_only files; a corrupt,
truncated or foreign file is an error naming it, and a run never restarts from scratch
over it. Sharded checkpoints (checkpoint_format='dcp', torch.distributed.checkpoint):
written at world 2 by DDP, FSDP2, ZeRO-2 and ZeRO-3 (FSDP2 and ZeRO-3 in the background),
each ZeRO rank writing exactly its own half of each unit, resumed at worlds 1 and 4, in
their mode and in another, with the uninterrupted run's losses and weights; a checkpoint
of another model named with what differs; an interrupted save skipped."""

import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_same_tree
from run_workers import CONSTANT, SHARDED, TOL, make, train_in_a_world
from torch.distributed.checkpoint import FileSystemReader

from lsdl_lab.checkpoint import latest_sharded, load, read_sharded
from lsdl_lab.run import CheckpointError, main, train
from lsdl_lab.run.loop import FORMAT, SHARDED_FORMAT
from lsdl_lab.run.parallel import sharded_state

CLOSE = {torch.float64: dict(rtol=0.0, atol=TOL)}


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


# -- sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------
# Written at world 2 (run_workers.SHARDED: DDP, FSDP2, ZeRO-2, and FSDP2 and ZeRO-3 saving in
# the background after every step), resumed at world 1 here and at world 4 in one spawned
# world: every resumed run must compute the losses and weights of one uninterrupted process
# (float64, to run_workers.TOL: the last bits of the ranks' sums), whatever mode resumes it.


def _sharded_weights(out) -> dict:
    path = latest_sharded(Path(out) / "checkpoint.dcp")
    tensors, state = read_sharded(path, SHARDED_FORMAT)
    return state["step"], {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}


def _resume_here(written: Path, root: Path, name: str) -> Path:
    """A fresh run folder holding only the sharded checkpoint of run ``name``."""
    out = root / name
    shutil.copytree(written / name / "checkpoint.dcp", out / "checkpoint.dcp")
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    records = train(make(CONSTANT, steps=5, out_dir=str(out)))
    return [r["loss"] for r in records], load(out / "checkpoint.pt")["model"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    return root, train_in_a_world(SHARDED, root, 2)


@pytest.fixture(scope="module")
def resumed_at_four(sharded, tmp_path_factory):
    """Each world-2 checkpoint resumed for 5 steps in one world of 4, in its own mode and in
    others (DDP's by FSDP2, FSDP2's by DDP and by ZeRO-2, ZeRO-2's by DDP and by FSDP2,
    the ZeRO-3 one saved in the background by ZeRO-1)."""
    written, _ = sharded
    root = tmp_path_factory.mktemp("four")
    runs = {}
    for name, by in [("ddp", "ddp"), ("fsdp2", "fsdp2"), ("zero2", "zero2"),
                     ("fsdp2_async", "fsdp2"), ("ddp", "fsdp2"), ("fsdp2", "ddp"),
                     ("fsdp2", "zero2"), ("zero2", "ddp"), ("zero2", "fsdp2"),
                     ("zero3_async", "zero1")]:  # fmt: skip
        key = f"{name}_by_{by}"
        shutil.copytree(written / name / "checkpoint.dcp", root / key / "checkpoint.dcp")
        runs[key] = dict(SHARDED[name], parallel=by, steps=5, async_checkpoint=False,
                         checkpoint_every=0)  # fmt: skip
    return root, train_in_a_world(runs, root, 4)


def _written(metadata) -> dict:
    """For each tensor of a DCP checkpoint's metadata, the row-major positions of its
    elements in each file: name -> file -> set of positions."""
    out = {}
    for index, where in metadata.storage_data.items():
        tensor = metadata.state_dict_metadata[index.fqn]
        chunk = next(c for c in tensor.chunks if c.offsets == index.offset)
        box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
        positions = torch.arange(tensor.size.numel()).view(tensor.size)[box]
        out.setdefault(index.fqn, {}).setdefault(where.relative_path, set()).update(
            positions.reshape(-1).tolist()
        )
    return out


def _zero_halves(written: dict, weights: dict) -> dict:
    """Per unit (a layer's weight then bias, laid end to end) and per tensor kind, the
    positions in the unit's flat vector that each file holds."""
    out = {}
    for unit in sorted({name.rsplit(".", 1)[0] for name in weights}):
        first = weights[f"{unit}.weight"].numel()
        for kind in ("model.{}", "optimizer.state.{}.exp_avg", "optimizer.state.{}.exp_avg_sq"):
            by_file = out.setdefault((unit, kind), {})
            for field, offset in (("weight", 0), ("bias", first)):
                for file, positions in written[kind.format(f"{unit}.{field}")].items():
                    by_file.setdefault(file, set()).update(p + offset for p in positions)
    return out


def test_each_rank_writes_its_part_and_the_async_save_keeps_the_last_step(sharded, uninterrupted):
    written, results = sharded
    losses, weights = uninterrupted
    numel = sum(t.numel() for t in weights.values())
    for name in SHARDED:
        records = results[0][name]
        assert [r["step"] for r in records] == [1, 2, 3]
        assert max(abs(r["loss"] - x) for r, x in zip(records, losses)) < TOL, name
        steps = sorted(p.name for p in (written / name / "checkpoint.dcp").iterdir())
        assert steps == ["step-00000003"], (name, steps)  # older steps removed once complete
        files = {p.name for p in (written / name / "checkpoint.dcp" / steps[0]).iterdir()}
        assert {".metadata", "state.pt"} <= files
        # DCP's metadata: where each piece of each tensor lies. DDP's tensors are
        # replicated: each is written once, whole; each of FSDP2's is in two pieces, one
        # in each rank's file; ZeRO's rank r writes elements [rS, (r+1)S) of each unit's
        # flat vector (S half of it), cut into boxes wherever a half ends inside a row
        metadata = FileSystemReader(str(written / name / "checkpoint.dcp" / steps[0]))
        metadata = metadata.read_metadata()
        tensors = {k: m for k, m in metadata.state_dict_metadata.items() if hasattr(m, "chunks")}
        assert len(tensors) == 3 * 6, name  # 6 weights and biases, with Adam's 2 moments
        pieces = {k: len(m.chunks) for k, m in tensors.items()}
        held = _written(metadata)
        if name.startswith("fsdp2"):
            assert set(pieces.values()) == {2}, (name, pieces)
            assert all(set(f) == {"__0_0.distcp", "__1_0.distcp"} for f in held.values()), held
        elif name.startswith("zero"):
            # each rank's half of a weight ends inside a row: two boxes a rank, not one piece
            weight_pieces = [pieces[k] for k in tensors if k.endswith("weight")]
            assert min(weight_pieces) > 2, (name, pieces)
            for unit, by_file in _zero_halves(held, weights).items():
                size = sum(weights[f"{unit[0]}.{f}"].numel() for f in ("weight", "bias"))
                half = -(-size // 2)
                assert by_file == {
                    "__0_0.distcp": set(range(half)),
                    "__1_0.distcp": set(range(half, size)),
                }, (name, unit)
        else:
            assert set(pieces.values()) == {1}, (name, pieces)
        assert sum(m.size.numel() for m in tensors.values()) == 3 * numel
        state = load(written / name / "checkpoint.dcp" / steps[0] / "state.pt", SHARDED_FORMAT)
        assert state["world_size"] == 2 and state["step"] == 3 and state["parallel"] in name
    # the background saves ran after every step; the others only at the end
    for name in ("fsdp2_async", "zero3_async"):
        assert all(r["checkpoint_s"] > 0 for r in results[0][name]), name
    assert [("checkpoint_s" in r) for r in results[0]["ddp"]] == [False, False, True]


@pytest.mark.parametrize("name", SHARDED)
def test_a_world_2_checkpoint_resumed_on_one_process_follows_the_uninterrupted_run(
    name, sharded, uninterrupted, tmp_path
):
    written, _ = sharded
    losses, weights = uninterrupted
    out = _resume_here(written, tmp_path, name)
    config = make(SHARDED[name], steps=5, out_dir=str(out))
    records = train(config.replace(async_checkpoint=False, checkpoint_every=0))
    assert [r["step"] for r in records] == [4, 5] and records[0]["world_size"] == 1
    assert max(abs(r["loss"] - x) for r, x in zip(records, losses[3:])) < TOL
    step, resumed = _sharded_weights(out)
    assert step == 5
    assert_same_tree(resumed, weights, name, CLOSE)


def test_a_world_2_checkpoint_resumed_at_world_4_in_any_mode_follows_it(
    resumed_at_four, uninterrupted
):
    root, results = resumed_at_four
    losses, weights = uninterrupted
    assert losses[0] > losses[-1]  # it trains: not two untouched models compared
    for key, records in results[0].items():
        assert [r["step"] for r in records] == [4, 5], key
        assert records[0]["world_size"] == 4
        assert max(abs(r["loss"] - x) for r, x in zip(records, losses[3:])) < TOL, key
        step, resumed = _sharded_weights(root / key)
        assert step == 5
        assert_same_tree(resumed, weights, key, CLOSE)
        state = load(latest_sharded(root / key / "checkpoint.dcp") / "state.pt")
        assert state["world_size"] == 4
    assert all(r == {k: [] for k in results[0]} for r in results[1:])


def test_a_sharded_checkpoint_of_another_model_or_optimizer_is_refused_naming_what_differs(
    sharded, tmp_path
):
    written, _ = sharded
    cases = [
        ("fsdp2", dict(width=32), r"model\.net\.1\.weight \(16, 64\) torch\.float64 \(this "
         r"run: \(32, 64\) torch\.float64\)"),
        ("ddp", dict(optimizer="SGD", optimizer_args={"momentum": 0.9}),
         r"it lacks: optimizer\.state\.net\.1\.bias\.momentum_buffer.*; it has tensors this "
         r"run does not: optimizer\.state\.net\.1\.bias\.exp_avg"),
        ("zero2", dict(width=32), r"model\.net\.1\.weight \(16, 64\)"),
        ("ddp", dict(dtype="float32"), r"model\.net\.1\.bias \(16,\) torch\.float64 \(this run: "
         r"\(16,\) torch\.float32\)"),
    ]  # fmt: skip
    for i, (name, changes, message) in enumerate(cases):
        out = _resume_here(written, tmp_path / str(i), name)
        directory = out / "checkpoint.dcp" / "step-00000003"
        config = make(SHARDED[name], steps=5, out_dir=str(out), **changes)
        with pytest.raises(CheckpointError, match=f"checkpoint {directory} was written by "
                           f"another model or optimizer: .*{message}"):  # fmt: skip
            train(config.replace(async_checkpoint=False))
        assert latest_sharded(out / "checkpoint.dcp") == directory  # untouched


def test_an_interrupted_sharded_save_is_skipped_and_a_damaged_one_named(sharded, tmp_path):
    written, _ = sharded
    out = _resume_here(written, tmp_path, "ddp")
    good = out / "checkpoint.dcp" / "step-00000003"
    # a save of step 4 that died before state.pt: DCP's files there, the run resumes at 3
    shutil.copytree(good, out / "checkpoint.dcp" / "step-00000004")
    (out / "checkpoint.dcp" / "step-00000004" / "state.pt").unlink()
    assert latest_sharded(out / "checkpoint.dcp") == good
    records = train(make(SHARDED["ddp"], steps=4, out_dir=str(out)))
    assert [r["step"] for r in records] == [4]
    assert [p.name for p in (out / "checkpoint.dcp").iterdir()] == ["step-00000004"]
    # a state.pt that is not one: named, never a fresh start
    (out / "checkpoint.dcp" / "step-00000004" / "state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="state.pt cannot be read: it is corrupt"):
        train(make(SHARDED["ddp"], steps=5, out_dir=str(out)))


def test_a_checkpoint_of_the_other_format_is_named_not_started_over(sharded, finished, tmp_path):
    written, _ = sharded
    out = _resume_here(written, tmp_path, "ddp")
    config = make(SHARDED["ddp"], steps=5, out_dir=str(out))
    message = (
        f"{out} holds a checkpoint of checkpoint_format='dcp' .*, and this run's is 'file': "
        "resume with checkpoint_format='dcp'"
    )
    with pytest.raises(CheckpointError, match=message):
        train(config.replace(checkpoint_format="file"))
    _, path = finished
    shutil.copy(path, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="checkpoint_format='file'"):
        train(config.replace(out_dir=str(tmp_path)))
    assert not (tmp_path / "checkpoint.dcp").exists()


def test_the_numbers_of_a_sharded_state_are_copies_as_an_async_save_writes_them_later():
    # state.pt of an asynchronous save is written at the next save, after training has
    # stepped on: torch's Adam counts its step in a 0-d tensor, in place
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    tensors, others, runs = sharded_state(model, optimizer)
    optimizer.step()
    assert optimizer.state[model.weight]["step"] == 2
    assert others["optimizer.state.weight.step"] == 1 and runs == {}
    assert set(tensors) >= {"model.weight", "optimizer.state.weight.exp_avg"}


def test_a_background_save_needs_the_sharded_format():
    with pytest.raises(ValueError, match="Invalid async_checkpoint: True with "
                       "checkpoint_format='file' .expected checkpoint_format='dcp'"):  # fmt: skip
        make(CONSTANT, async_checkpoint=True)
