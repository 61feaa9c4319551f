"""lsdl_lab.run.loop: equivalence of the data-parallel runs with one process (with
accumulation and activation checkpointing too), compression, the NaN stop on every rank,
exact resume and ZeRO re-partitioned on resume.

The world-2 runs happen in one spawned world per group of cases (gloo, float64;
run_workers's groups, each a module fixture here): a failure in one group fails that
group's tests only. The one-process references run here.
"""

import functools
import math
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_same_tree
from run_workers import (
    BASE,
    COMPRESSED,
    CONSTANT,
    EQUIVALENT,
    RESUMABLE,
    STOPPED,
    TOL,
    make,
    train_in_a_world_of_two,
)

from lsdl_lab import compress
from lsdl_lab.checkpoint import load
from lsdl_lab.distributed import call_each, free_port, spawn
from lsdl_lab.run import Config, read_metrics, run_rank, train
from lsdl_lab.run.loop import _placement

# two float64 weights agree to TOL (run_workers.TOL: the last bits of two ranks' sums)
CLOSE = {torch.float64: dict(rtol=0.0, atol=TOL)}


def _weights(path) -> dict:
    return load(path / "checkpoint.pt")["model"]


def _world(tmp_path_factory, runs: dict):
    """One world of 2 trains ``runs`` (a group of run_workers): (their folder, each rank's
    results)."""
    root = tmp_path_factory.mktemp("world")
    return root, train_in_a_world_of_two(runs, root)


@pytest.fixture(scope="module")
def equivalent(tmp_path_factory):
    return _world(tmp_path_factory, EQUIVALENT)


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    return _world(tmp_path_factory, COMPRESSED)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    return _world(tmp_path_factory, STOPPED)


@pytest.fixture(scope="module")
def resumable(tmp_path_factory):
    return _world(tmp_path_factory, RESUMABLE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the same global batch: the trajectory every world-2 run must follow."""
    root = tmp_path_factory.mktemp("single")
    records = train(make(BASE, out_dir=str(root / "base")))
    return [r["loss"] for r in records], _weights(root / "base")


@pytest.mark.parametrize("name", EQUIVALENT)
def test_every_parallel_mode_follows_the_single_process_trajectory(name, equivalent, reference):
    root, results = equivalent
    ref_losses, ref_weights = reference
    assert ref_losses[0] > ref_losses[-1]  # it trained: not two untouched models compared
    records = results[0][name]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    losses = [r["loss"] for r in records]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL
    assert_same_tree(_weights(root / name), ref_weights, name, CLOSE)
    assert results[1][name] == [], "only rank 0 returns the records"


def test_records_say_what_each_mode_holds_and_sends(equivalent):
    root, results = equivalent
    params = 8 * sum(t.numel() for t in _weights(root / "ddp").values())  # float64 bytes
    last = {name: results[0][name][-1] for name in EQUIVALENT}
    for name, record in last.items():
        assert record["world_size"] == 2 and len(record["memory"]) == 2, name
        assert record["examples_per_s"] > 0 and record["step_time_s"] > 0
    # what each rank holds (measured with the step's gradients present)
    assert last["ddp"]["memory"][0]["params"] == params
    assert last["ddp"]["memory"][0]["grads"] == params
    assert (
        last["zero1"]["memory"][0]["optimizer_state"]
        < 0.6 * last["ddp"]["memory"][0]["optimizer_state"]
    )
    assert last["zero2"]["memory"][0]["grads"] < 0.6 * params
    assert last["zero3"]["memory"][0]["params"] < 0.6 * params
    assert last["fsdp2"]["memory"][0]["params"] < 0.6 * params
    # bytes handed to collectives per step: DDP all-reduces the gradients once; ZeRO-1/2
    # reduce-scatter them (whole) and all-gather the updated shard; ZeRO-3 also gathers
    # the parameters for the forward and backward passes; accumulation over k passes
    # reduce-scatters k times with stage 2
    per_step = {name: r["bytes_per_step"][0] for name, r in last.items()}
    assert per_step["ddp"] == params
    assert per_step["ddp_accumulate"] == params  # no_sync: one all-reduce per step
    assert per_step["zero1"] == pytest.approx(1.5 * params, rel=0.01)
    assert per_step["zero3"] == pytest.approx(2.0 * params, rel=0.01)
    assert per_step["zero2_accumulate"] == pytest.approx(2.5 * params, rel=0.01)


def test_compression_decreases_the_loss_and_logs_the_compressors_bytes(compressed):
    root, results = compressed
    records = results[0]["topk"]
    losses = [r["loss"] for r in records]
    assert sum(losses[-5:]) < 0.85 * sum(losses[:5])  # measured 2.28 -> 1.61 (one process)
    weights = _weights(root / "topk")
    n = sum(t.numel() for t in weights.values())
    # one bucket holds every gradient (a few KB, under DDP's 25 MB cap): per step, the
    # payload of top-k on n float64 entries, as the compressor itself counts it
    payload = compress.TopK(COMPRESSED["topk"]["compression_ratio"]).compress(
        torch.randn(n, dtype=torch.float64)
    )
    expected = compress.payload_nbytes(payload)
    assert expected < 0.3 * 8 * n
    for r in records:
        assert r["bytes_per_step"] == [expected, expected]
    assert records[-1]["bytes_sent"] == [expected * len(records)] * 2


def test_a_nan_loss_on_one_rank_stops_every_rank_naming_the_step(stopped):
    root, results = stopped
    for rank in (0, 1):
        message = results[rank]["nan"]
        assert message.startswith(f"rank {rank}: the training loss became nan at step 2")
    records = read_metrics(root / "nan" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]  # steps 0 and 1 done, step 2 not


def test_zero_state_is_repartitioned_when_resumed_on_another_world_size(resumable, tmp_path):
    root, _ = resumable
    # a 3-step run at world 2, resumed for 5 steps on one process with ZeRO-2
    resumed = tmp_path / "zero2_resumed"
    resumed.mkdir()
    shutil.copy(root / "zero2_3_steps" / "checkpoint.pt", resumed / "checkpoint.pt")
    state = load(resumed / "checkpoint.pt")
    assert state["world_size"] == 2 and state["step"] == 3
    assert "exp_avg" in state["optimizer"]["state"]["net.1.weight"]
    records = train(make(CONSTANT, parallel="zero2", steps=5, out_dir=str(resumed)))
    assert [r["step"] for r in records] == [4, 5]
    assert records[0]["world_size"] == 1
    assert_same_tree(_weights(resumed), _weights(root / "zero2_5_steps"), "zero2", CLOSE)
    # and the same checkpoint resumed without ZeRO (plain, one process)
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(root / "zero2_3_steps" / "checkpoint.pt", plain / "checkpoint.pt")
    train(make(CONSTANT, parallel="ddp", steps=5, out_dir=str(plain)))
    assert_same_tree(_weights(plain), _weights(root / "zero2_5_steps"), "plain", CLOSE)


def test_a_resumed_run_computes_exactly_what_an_uninterrupted_one_does(tmp_path):
    whole = train(make(CONSTANT, steps=5, out_dir=str(tmp_path / "whole")))
    part = tmp_path / "part"
    train(make(CONSTANT, steps=3, out_dir=str(part)))
    resumed = train(make(CONSTANT, steps=5, out_dir=str(part)))
    assert_same_tree(_weights(part), _weights(tmp_path / "whole"))  # bit for bit
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]  # one log, 1..5
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    state = load(part / "checkpoint.pt")
    assert state["step"] == 5 and state["scheduler"]["last_epoch"] == 5
    # a finished run resumed again does nothing
    again = train(make(CONSTANT, steps=5, out_dir=str(part)))
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5]


def test_muon_trains_the_gpts_matrices_and_gives_the_rest_to_adamw(tmp_path):
    # the entry point builds Muon's groups from the model (lsdl_lab.optim.muon_param_groups):
    # the hidden matrices orthogonalized, the embedding, the output layer and the gains and
    # biases by AdamW; the loss falls
    config = make(CONSTANT, model="gpt", optimizer="Muon", steps=8, dtype="float32",
                  out_dir=str(tmp_path))  # fmt: skip
    records = train(config)
    losses = [r["loss"] for r in records]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    groups = load(tmp_path / "checkpoint.pt")["optimizer"]["param_groups"]
    assert [g["use_muon"] for g in groups] == [True, False]
    assert all(g["params"] for g in groups)


def test_mixed_precision_and_activation_checkpointing_train(tmp_path):
    plain = train(make(BASE, steps=3, dtype="float32", out_dir=str(tmp_path / "plain")))
    recompute = train(
        make(
            BASE,
            steps=3,
            dtype="float32",
            activation_checkpoint=2,
            checkpoint_impl="lsdl",
            out_dir=str(tmp_path / "ckpt"),
        )
    )
    # recomputation changes memory, not arithmetic
    assert [r["loss"] for r in recompute] == [r["loss"] for r in plain]
    for precision in ("bf16", "fp16"):
        records = train(
            make(
                BASE,
                steps=3,
                dtype="float32",
                precision=precision,
                out_dir=str(tmp_path / precision),
            )
        )
        losses = [r["loss"] for r in records]
        assert all(math.isfinite(x) for x in losses)
        assert abs(losses[0] - plain[0]["loss"]) < 0.05  # 16-bit forward, same model
        assert ("loss_scale" in records[-1]) == (precision == "fp16")


def test_bad_combinations_are_refused_naming_the_option(tmp_path):
    cases = [
        (dict(micro_batch=5), "Invalid micro_batch: 5 .*divisor of global_batch / world size = 32"),
        (dict(parallel="zero1", micro_batch=8), "Invalid micro_batch: 8 with parallel='zero1'"),
        (dict(parallel="zero2", optimizer="LAMB"), "Invalid optimizer: 'LAMB' with parallel"),
        (dict(parallel="fsdp2", compression="topk"), "Invalid compression: 'topk'"),
        (dict(parallel="fsdp2", optimizer="LARS"), "Invalid optimizer: 'LARS' with parallel"),
        (dict(parallel="zero1", optimizer="Muon"), "Invalid optimizer: 'Muon' with parallel"),
        (dict(parallel="fsdp2", precision="fp16"), "Invalid precision: 'fp16' with parallel"),
        (dict(parallel="zero3", model="gpt"), "Invalid parallel: 'zero3' with model 'gpt'"),
        (
            dict(parallel="fsdp2", activation_checkpoint=2, checkpoint_impl="lsdl"),
            "Invalid checkpoint_impl: 'lsdl' with parallel='fsdp2'",
        ),
        (dict(warmup_steps=4), r"Invalid warmup_steps: 4 \(expected an int in \[0, 3\]"),
        (dict(global_batch=1000), r"Invalid global_batch: 1000 \(expected an int in \[1, 512\]"),
        (dict(optimizer="SM3", weight_decay=0.1), "Invalid weight_decay: 0.1"),
        (dict(data="python_source"), "Invalid data: 'python_source'"),
        (dict(device="cpu", backend="nccl"), "Invalid backend: 'nccl' on cpu"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            train(Config(**{**BASE, **changes, "out_dir": str(tmp_path / "bad")}))


def test_each_round_of_torchrun_workers_joins_under_its_own_keys(tmp_path, monkeypatch):
    """Under torchrun (its agent's store, kept across restarts), every round of workers
    counts itself in the store and keeps its keys under its own prefix
    (lsdl_lab.distributed.init_from_env): a restarted rank cannot read a killed one's address."""
    port = free_port()
    agent = dist.TCPStore(  # stands for torchrun's agent store
        "127.0.0.1", port, 1, is_master=True, multi_tenant=True, timeout=timedelta(seconds=30)
    )
    env = dict(TORCHELASTIC_RUN_ID="test", TORCHELASTIC_USE_AGENT_STORE="True", RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for round_ in range(2):  # the first run and its restart
        records = train(make(CONSTANT, steps=1, out_dir=str(tmp_path / f"round{round_}")))
        assert records[-1]["world_size"] == 1 and not dist.is_initialized()
        assert agent.add("lsdl_lab.distributed/joined", 0) == round_ + 1


def test_a_dry_run_stops_every_rank_at_the_capped_step_with_as_many_micro_batches(
    tmp_path, monkeypatch
):
    # lsdl_lab.profiles's caps, read by each rank from the environment spawn hands it: 2 of
    # the 4 steps, global batches of 8 of the 32 examples (4 per rank); the accumulating
    # run cuts its 4 into 4 micro-batches of 1, as its config cuts 16 into 4 of 4.
    monkeypatch.setenv("LSDL_MAX_STEPS", "2")
    monkeypatch.setenv("LSDL_MAX_EXAMPLES", "8")
    configs = [
        make(BASE, steps=4, out_dir=str(tmp_path / "ddp")),
        make(BASE, steps=4, micro_batch=4, out_dir=str(tmp_path / "accumulate")),
    ]
    runs = [functools.partial(run_rank, config=c) for c in configs]
    whole, accumulated = spawn(call_each, 2, runs, timeout=60)[0]
    for records, c in zip((whole, accumulated), configs, strict=True):
        assert [r["step"] for r in records] == [1, 2]
        assert load(Path(c.out_dir) / "checkpoint.pt")["step"] == 2  # saved at the end
    losses = [r["loss"] for r in whole]
    assert [r["loss"] for r in accumulated] == pytest.approx(losses, rel=TOL, abs=0)


def test_a_world_larger_than_the_machines_gpus_runs_on_the_cpu_and_says_so(
    tmp_path, monkeypatch, capsys
):
    """A rank of two on a machine whose (pretended) one GPU cannot hold both is placed on
    the CPU with gloo (lsdl_lab.distributed.placement); with a GPU per rank it gets its GPU and
    NCCL, or gloo where the config asks. A run's first line says where it runs and why."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    auto = make(BASE, steps=1, warmup_steps=0)
    assert _placement(auto)[:2] == (torch.device("cpu"), "gloo")
    with pytest.raises(ValueError, match="Invalid device: 'cuda' for 2 ranks"):
        _placement(auto.replace(device="cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _placement(auto)[:2] == (torch.device("cuda", 1), "nccl")
    assert _placement(auto.replace(backend="gloo"))[:2] == (torch.device("cuda", 1), "gloo")
    assert _placement(auto.replace(device="cpu"))[:2] == (torch.device("cpu"), "gloo")
    monkeypatch.undo()
    train(auto.replace(out_dir=str(tmp_path / "one"), device="cpu", precision="auto"))
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("lsdl_lab.run: world size 1, ddp, device cpu (no process group: ")
    assert "gloo on the CPU, as asked (1 rank on this machine)" in printed[0]
    # precision auto: float32 on a CPU, said once, and the run records the precision it took
    assert "precision auto: float32: cpu has no fast 16-bit arithmetic" in printed
    assert "precision: none" in (tmp_path / "one" / "config.yaml").read_text()


def test_precision_auto_takes_what_the_gpu_computes_in(monkeypatch):
    """On a (pretended) GPU without bfloat16 arithmetic, auto is fp16 with the scaler, but
    float32 with FSDP2 (which this library runs in bf16 only); with it, bf16."""
    from lsdl_lab.run import loop

    answers = {"t4": ("fp16", "float16 with the loss scaler: T4"), "a100": ("bf16", "A100")}
    for gpu, (precision, why) in answers.items():
        monkeypatch.setattr(loop, "mixed_precision_for", lambda d, a=answers[gpu]: a)
        config = make(BASE, precision="auto")
        assert loop._precision(config, torch.device("cuda", 0)) == (
            config.replace(precision=precision),
            why,
        )
        fsdp2, said = loop._precision(config.replace(parallel="fsdp2"), torch.device("cuda"))
        assert fsdp2.precision == ("none" if gpu == "t4" else "bf16"), said
    assert loop._precision(make(BASE, precision="fp16"), torch.device("cpu"))[1] == ""
