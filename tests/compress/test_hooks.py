"""The compression hooks on a real gloo world of 2: one spawned world trains a small model
under DDP with every hook (compress_hooks_worker.run_hook_checks) and these tests read its
results."""

import math

import compress_hooks_worker as worker  # the ranks import it by name (pytest's pythonpath)
import pytest
import torch

from lsdl_lab.compress import HookState
from lsdl_lab.distributed import spawn

D = 20 * 30 + 30 + 30 * 1 + 1  # the model's parameters, all in DDP's one bucket
K = round(0.1 * D)
PER_STEP = {  # bytes a rank hands to the collectives per step, by the stated formulas
    "sign+ef": math.ceil(D / 8) + 4,
    "terngrad": math.ceil(2 * D / 8) + 4,
    "qsgd4": math.ceil(4 * D / 8) + 4,  # 9 levels -4..4 need 4 bits
    "topk+ef": K * (4 + 4),
    "randomk+ef": K * 4,
    # P and Q of the 30 x 20 weight at rank 2, and the other 61 entries uncompressed
    "powersgd": ((30 + 20) * 2 + 30 + 30 + 1) * 4,
}


@pytest.fixture(scope="module")
def ranks():
    # gloo by name: on a machine with a GPU per rank spawn would pick NCCL, which moves CUDA
    # tensors only, and these ranks train on the CPU (also where CUDA is present)
    return spawn(worker.run_hook_checks, 2, backend="gloo", timeout=60)


def test_every_hook_trains_and_replicas_stay_identical(ranks):
    first, second = ranks
    assert first["world_size"] == 2
    for name, result in first.items():
        if isinstance(result, dict) and "params" in result:
            assert result["after"] < 0.4 * result["before"], name
            assert torch.equal(result["params"], second[name]["params"]), name
            if name != "plain":  # the hook really changed the update
                assert not torch.equal(result["params"], first["plain"]["params"]), name


def test_state_follows_the_parameters_when_ddp_rebuilds_its_buckets(ranks):
    # the first step's single bucket, then at least two smaller ones, each with its residual
    assert all(rank["sign+ef-small-buckets"]["buckets_kept"] >= 3 for rank in ranks)


def test_an_all_zero_bucket_comes_back_zero_not_nan(ranks):
    for rank in ranks:
        assert rank["zeros"] == dict.fromkeys(worker.cases(0), True)


def test_bytes_handed_to_the_collectives_equal_the_formula(ranks):
    # counted by lsdl_lab.distributed.CollectiveBytes around each training (the worker)
    for rank in ranks:
        for name, per_step in PER_STEP.items():
            assert rank[name]["steps"] == worker.STEPS
            assert rank[name]["bytes_sent"] == worker.STEPS * per_step, name
        # the first START steps are all-reduced uncompressed: 4 bytes per parameter
        start = rank["powersgd-start2"]
        expected = worker.START * 4 * D + (worker.STEPS - worker.START) * PER_STEP["powersgd"]
        assert start["bytes_sent"] == expected


def test_torchs_hooks_are_counted_alike_and_its_cpp_reducer_is_not(ranks):
    for rank in ranks:
        # the same counter sees torch's Python hooks: fp16 hands 2 bytes a parameter, and
        # torch's PowerSGD the same P, Q and vectors as ours
        assert rank["torch-fp16"]["bytes_sent"] == worker.STEPS * 2 * D
        assert rank["torch-powersgd"]["bytes_sent"] == rank["powersgd-start2"]["bytes_sent"]
        # without a hook DDP's reducer calls the backend from C++, out of the counter's sight
        assert rank["plain"]["bytes_sent"] == 0


def test_powersgd_hook_trains_like_torchs(ranks):
    # Same start (START uncompressed steps, then the same initial Q): the two differ only by
    # rounding (QR here, Gram-Schmidt in torch; torch re-orthogonalizes the kept Q), a
    # hundred times less than PowerSGD differs from uncompressed training.
    ours, theirs, plain = (
        ranks[0][k]["params"] for k in ("powersgd-start2", "torch-powersgd", "plain")
    )
    gap = (ours - theirs).abs().max()
    assert gap < 1e-3
    assert gap < 0.01 * (ours - plain).abs().max()


def test_torchs_fp16_hook_as_a_reference(ranks):
    fp16, plain = ranks[0]["torch-fp16"]["params"], ranks[0]["plain"]["params"]
    assert torch.allclose(fp16, plain, atol=1e-3)


def test_hooks_refuse_compressors_they_cannot_use(ranks):
    summable, powersgd = ranks[0]["refused"]
    assert "Invalid compressor: ErrorFeedback payloads cannot be summed" in summable
    assert "Invalid make_compressor: returns a SignSGD (expected a PowerSGD)" in powersgd


def test_hook_state_bad_arguments():
    with pytest.raises(TypeError, match="Invalid make_compressor"):
        HookState("sign")
    with pytest.raises(ValueError, match="Invalid start_iter: -1"):
        HookState(lambda: None, start_iter=-1)
