"""Bytes per category (each storage once) and the saved-tensor counter of activations."""

import pytest
import torch
from torch import nn

from lsdl_lab.memory.measure import (
    LargestTensor,
    SavedTensorBytes,
    format_bytes,
    format_table,
    measure,
    measure_by_dtype,
)
from lsdl_lab.models import GPT, count_parameters


def _mlp(device="cpu"):
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def test_measure_counts_params_grads_and_adam_state(device):
    model = _mlp(device)
    n = count_parameters(model)
    opt = torch.optim.Adam(model.parameters())
    assert measure(model, opt) == {
        "params": 4 * n,
        "grads": 0,
        "optimizer_state": 0,
        "total": 4 * n,
    }
    model(torch.randn(5, 8, device=device)).sum().backward()
    opt.step()
    # Adam keeps exp_avg and exp_avg_sq (float32) and a 0-d float32 step per tensor (on the
    # CPU, also for parameters on a GPU).
    tensors = len(list(model.parameters()))
    expected = {"params": 4 * n, "grads": 4 * n, "optimizer_state": 8 * n + 4 * tensors}
    expected["total"] = sum(expected.values())
    assert measure(model, opt) == expected
    assert measure(model) == {"params": 4 * n, "grads": 4 * n, "optimizer_state": 0, "total": 8 * n}


def test_tied_weights_are_counted_once(device):
    gpt = GPT(vocab_size=50, block_size=8, layers=1, heads=2, dim=16).to(device)
    assert gpt.head.weight is gpt.tok.weight
    assert measure(gpt)["params"] == 4 * count_parameters(gpt)
    # Views of one flat buffer hold the buffer's bytes once, not once per view.
    flat = torch.zeros(100, device=device)
    model = nn.Module()
    model.a = nn.Parameter(flat[:60].view(6, 10))
    model.b = nn.Parameter(flat[60:])
    assert measure(model)["params"] == 400


def test_a_dtensor_counts_its_local_shard(tmp_path):
    # FSDP2 and tensor parallelism hold parameters as DTensors, which have no storage of
    # their own: a rank holds its shard. A world of one rank, with a DTensor declared twice
    # as long as its shard (as on rank 0 of two), tells the shard from the whole.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        shard = torch.zeros(3, 4)
        model = nn.Module()
        model.w = nn.Parameter(
            DTensor.from_local(
                shard, mesh, [Shard(0)], run_check=False, shape=(6, 4), stride=(4, 1)
            )
        )
        assert model.w.shape == (6, 4)
        assert measure(model)["params"] == 4 * 12
    finally:
        dist.destroy_process_group()


def test_by_dtype_splits_the_bytes(device):
    model = _mlp(device)
    model[2].to(torch.bfloat16)
    by = measure_by_dtype(model)
    assert by["params"] == {"float32": 4 * (8 * 16 + 16), "bfloat16": 2 * (16 * 4 + 4)}
    assert by["grads"] == {} and by["optimizer_state"] == {}


def test_measure_rejects_bad_arguments():
    with pytest.raises(TypeError, match="Invalid model"):
        measure("model")
    with pytest.raises(TypeError, match="Invalid optimizer"):
        measure(_mlp(), optimizer=[1, 2])


def test_saved_bytes_exclude_parameters_and_count_storages_once(device):
    lin = nn.Linear(10, 30, device=device)
    x = torch.randn(4, 10, device=device, requires_grad=True)  # the weight is saved for x's grad
    with SavedTensorBytes(lin) as c:
        lin(x).sum().backward()
    assert c.total == x.numel() * 4  # the weight (saved too) is a parameter
    with SavedTensorBytes() as everything:
        lin(x).sum().backward()
    assert everything.total == (x.numel() + lin.weight.numel()) * 4

    # q, k and v are views of one projection: one storage, counted once.
    qkv = torch.randn(4, 30, device=device, requires_grad=True)
    with SavedTensorBytes() as c:
        y = qkv * 2.0  # saves nothing (a constant factor)
        q, k, _ = y.split(10, dim=1)
        (q * k).sum().backward()
    assert c.total == 4 * 30 * 4  # the whole storage, once (two views would count 2 * 160)


def test_saved_bytes_peak_and_release(device):
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)])
    blocks, x = blocks.to(device), torch.randn(32, 16).to(device)
    unit = x.numel() * 4
    with SavedTensorBytes(blocks) as c:
        loss = blocks(x).sum()
        at_end_of_forward = c.live
        loss.backward()
    # The input (saved by the first Linear) and each Tanh's output (which the next Linear
    # saves too: the same storage).
    assert at_end_of_forward == c.peak == c.total == 9 * unit
    assert c.live == 0  # backward freed the graph
    with SavedTensorBytes(blocks) as kept:
        blocks(x).sum().backward(retain_graph=True)
    assert kept.live == 9 * unit
    assert kept.allocator_peak is None  # no device given: no allocator to ask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_allocator_peak_on_cuda():
    model = nn.Linear(256, 256).cuda()
    x = torch.randn(512, 256, device="cuda")
    with SavedTensorBytes(model, device="cuda") as c:
        model(x).relu().sum().backward()
    assert c.peak == 2 * x.numel() * 4  # the input and ReLU's output
    assert c.allocator_peak >= c.peak


def test_format_table_one_and_many_ranks():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(1.5 * 2**40) == "1.50 TiB"
    report = {"params": 2**20, "grads": 2**20, "optimizer_state": 2**21, "total": 2**22}
    table = format_table(report).splitlines()
    assert table[0].split() == ["category", "bytes"]
    assert table[2].split() == ["params", "1.00", "MiB"]
    assert table[-1].split() == ["total", "4.00", "MiB"]
    ranks = format_table([report, {**report, "params": 2**10}]).splitlines()
    assert ranks[0].split() == ["category", "rank", "0", "rank", "1"]
    assert ranks[2].split() == ["params", "1.00", "MiB", "1.00", "KiB"]
    with pytest.raises(ValueError, match="Invalid reports"):
        format_table([])


def test_largest_tensor_sees_the_scores_and_the_backward():
    """LargestTensor (a dispatch mode) sees the largest intermediate of a written-out
    attention, its n x n scores, and the operators autograd's backward runs: a tensor that
    only the backward makes (the gradient of a wider input) is seen too."""
    n, d = 24, 4
    q, k = (torch.randn(n, d, requires_grad=True) for _ in range(2))
    with LargestTensor() as seen:
        scores = (q @ k.t()).softmax(-1)
    assert seen.numel == n * n
    wide = torch.randn(3 * n, n, requires_grad=True)
    out = scores.sum(0)  # made outside the block: only its backward runs inside
    with LargestTensor() as backward:
        (wide @ out).sum().backward()
    assert backward.numel == 3 * n * n  # the gradient of `wide`
    with LargestTensor() as nothing:
        pass
    assert nothing.numel == 0
