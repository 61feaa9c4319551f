"""ZeRO stages 1-3 at world 2 on gloo, in one spawned world (sharded_workers.run_all):
trajectories equal to DDP's and to one process on the global batch (float64), torch's
ZeroRedundancyOptimizer and FSDP2 fully_shard on the same run (bfloat16 mixed precision
and CPU offload too; with micro-batches, where the two round the accumulated gradient
differently, what still holds), bytes per rank equal to zero_bytes (float64 Adam, and
the paper's 2 + 2 + 12 in bfloat16), communication per step equal to 2Psi / 2Psi / 3Psi, and one
loss-scaler skip decision for all ranks. Argument and misuse errors, and micro-batch
accumulation, in a world of one, in this process."""

import pytest
import sharded_workers
import torch
import torch.distributed as dist
from torch import nn

from lsdl_lab import optim
from lsdl_lab.distributed import spawn
from lsdl_lab.memory import ZeroOptimizer, zero_bytes

WORLD = 2
# float64 rounding: the oracle averages 8 rows at once, the ranks two means of 4.
ATOL = 1e-14


@pytest.fixture(scope="module")
def ranks():
    return spawn(sharded_workers.run_all, WORLD, timeout=120)


def max_gap(a, b) -> float:
    assert len(a) == len(b) == sharded_workers.STEPS
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_the_oracle_moves(ranks):
    trajectory = ranks[0]["reference"]
    start = torch.cat([p.detach().reshape(-1) for p in sharded_workers.make_model().parameters()])
    for before, after in zip([start, *trajectory], trajectory):
        assert (after - before).abs().max() > 1e-3  # equal trajectories mean something


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_follows_ddp_and_one_process_on_the_global_batch(ranks, stage):
    for out in ranks:
        trajectory = out[f"zero{stage}"]["trajectory"]
        assert max_gap(trajectory, out["reference"]) <= ATOL
        assert max_gap(trajectory, out["ddp"]) <= ATOL
        assert max_gap(out[f"zero{stage}_torch"], out["reference_torch"]) <= ATOL
    assert (
        max_gap(ranks[0][f"zero{stage}"]["trajectory"], ranks[1][f"zero{stage}"]["trajectory"]) == 0
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_follows_one_process_on_a_model_with_nested_units(ranks, stage):
    # Gained owns a parameter and a child Linear that owns two: the parent's shard is
    # gathered around the child's in forward and backward.
    for out in ranks:
        trajectory = out[f"zero{stage}_nested"]["trajectory"]
        assert max_gap(trajectory, out["reference_nested"]) <= ATOL


def test_stage_3_predicts_as_stage_1_and_frees_each_layer_without_backward(ranks):
    for out in ranks:
        assert torch.equal(out["zero3"]["prediction"], out["zero1"]["prediction"])
        assert out["zero3"]["released"] and not out["zero1"]["released"]


def test_torch_zero_redundancy_optimizer_follows_stage_1_and_fsdp2_stage_3(ranks):
    for out in ranks:
        assert max_gap(out["zero_redundancy"], out["zero1_torch"]) <= ATOL
        assert max_gap(out["fsdp2"], out["zero3_torch"]) <= ATOL


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_per_rank_are_the_formula_for_float64_adam(ranks, stage):
    # float64 Adam: 8-byte parameters and gradients, K = 16 (two 8-byte moments; the
    # library's Adam counts steps in a Python int). The formula holds for the padded Psi.
    for out in ranks:
        run = out[f"zero{stage}"]
        psi, padded = run["numel"], run["padded"]
        assert psi <= padded < psi + 3 * WORLD  # three units, each padded by < N
        bytes_of = zero_bytes(padded, stage, WORLD, k=16, param_bytes=8, grad_bytes=8)
        assert run["held"] == bytes_of
        no_padding = zero_bytes(psi, stage, WORLD, k=16, param_bytes=8, grad_bytes=8)
        assert no_padding["total"] <= run["held"]["total"] < 1.03 * no_padding["total"]
    assert ranks[0]["ddp_bytes"] == zero_bytes(psi, 0, WORLD, k=16, param_bytes=8, grad_bytes=8)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_is_fsdp2_with_bf16_and_holds_2_2_12_bytes(ranks, stage):
    # bfloat16 parameters, gradients and collectives, float32 master weights and moments:
    # FSDP2's MixedPrecisionPolicy(param_dtype=reduce_dtype=bfloat16) does the same
    # arithmetic, so the runs agree bit for bit.
    for out in ranks:
        run = out[f"mixed{stage}"]
        for ours, fsdp in zip(run["trajectory"], out["fsdp2_mixed"], strict=True):
            assert torch.equal(ours, fsdp.bfloat16())
        assert torch.equal(run["masters"], out["fsdp2_mixed"][-1])
        # The paper's 2 + 2 + K with K = 12 (Rajbhandari et al. 2020, Section 3.1), for the
        # padded Psi; torch's Adam adds one 0-d float32 step per shard.
        bytes_of = zero_bytes(run["padded"], stage, WORLD)
        bytes_of["optimizer_state"] += 4 * run["units"]
        bytes_of["total"] += 4 * run["units"]
        assert run["held"] == bytes_of


@pytest.mark.parametrize("stage", [2, 3])
def test_with_micro_batches_the_gradient_is_fsdp2s_rounded_to_bfloat16(ranks, stage):
    # Two backward passes per step: each adds its reduce-scattered bfloat16 shard gradient
    # to the shard's bfloat16 gradient here, to a float32 one in FSDP2 (it casts to the
    # parameters' dtype first). On the first step both start from the same weights, so
    # the gradient stepped here is FSDP2's rounded to bfloat16, not FSDP2's; from then on
    # the master weights part, and the equality of the single-micro-batch runs is lost.
    for out in ranks:
        ours, fsdp = out[f"accumulated{stage}"], out["fsdp2_accumulated"]
        assert torch.equal(ours["gradient"], fsdp["gradient"].bfloat16().float())
        assert not torch.equal(ours["gradient"], fsdp["gradient"])
        for mine, theirs in zip(ours["trajectory"], fsdp["trajectory"], strict=True):
            assert not torch.equal(mine, theirs)
        # ... by rounding only: the runs stay within a hundredth of the parameters' scale.
        last, reference = ours["trajectory"][-1], fsdp["trajectory"][-1]
        assert (last - reference).abs().max() < 1e-2 * reference.abs().max()


def test_offload_is_the_same_arithmetic_as_fsdp2_cpu_offload(ranks):
    # On a CPU-only machine offload moves nothing; what it can show here is that the
    # master copy changes no step (against DDP's run and FSDP2's CPUOffloadPolicy) and is
    # counted as optimizer state: K = 16 + 8 bytes (moments and a float64 master).
    for out in ranks:
        assert max_gap(out["offload1"]["trajectory"], out["ddp"]) <= ATOL
        assert max_gap(out["offload3_torch"]["trajectory"], out["fsdp2_offload"]) <= ATOL
        run = out["offload1"]
        bytes_of = zero_bytes(run["padded"], 1, WORLD, k=24, param_bytes=8, grad_bytes=8)
        assert run["held"] == bytes_of


def test_stages_1_and_2_are_seen_by_measure_on_the_model_stage_3_is_not(ranks):
    # Stage 1's shards are views of the parameters and its gradient shards views of the
    # gradients, so measure(model, optimizer) sees all; stage 2's gradient shards and stage
    # 3's parameter shards live outside the model: held_bytes() counts them.
    run = ranks[0]
    assert run["zero1"]["measure"] == run["zero1"]["held"]
    assert run["zero2"]["measure"]["grads"] == 0 < run["zero2"]["held"]["grads"]
    assert run["zero3"]["measure"]["params"] == 0 < run["zero3"]["held"]["params"]


@pytest.mark.parametrize("stage, gathers", [(1, 1), (2, 1), (3, 2)])
def test_communication_per_step_is_2psi_2psi_3psi(ranks, stage, gathers):
    for out in ranks:
        run = out[f"zero{stage}"]
        padded = run["padded"]
        assert run["counts"] == {"all_gather": gathers * padded, "reduce_scatter": padded}
        total = sum(run["counts"].values())
        assert (gathers + 1) * run["numel"] <= total < (gathers + 1) * (run["numel"] + 3 * WORLD)


def test_loss_scaler_over_the_group_skips_on_every_rank(ranks):
    for out in ranks:
        for stage_result in out["skip_shared"]:
            assert stage_result == {"skipped": True, "scale": 2.0, "unchanged": True}
    # Without the group, only rank 1 (whose shard holds the inf) skips.
    assert [out["skip_unshared"]["skipped"] for out in ranks] == [False, True]
    assert [out["skip_unshared"]["scale"] for out in ranks] == [4.0, 2.0]


def tied() -> nn.Module:
    """An embedding and an output layer that share one weight (as the GPT's)."""
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    return model


@pytest.mark.parametrize(
    "args, kwargs, name, error",
    [
        ((nn.Linear(2, 2).weight, optim.Adam), {}, "model", TypeError),
        ((nn.Linear(2, 2), "Adam"), {}, "optimizer_class", TypeError),
        ((nn.Linear(2, 2), dict), {}, "optimizer_class", TypeError),
        ((nn.Linear(2, 2), optim.Adam), {"stage": 0}, "stage", ValueError),
        ((nn.Linear(2, 2), optim.Adam), {"stage": 4}, "stage", ValueError),
        ((nn.Linear(2, 2), optim.Adam), {"stage": 1.0}, "stage", TypeError),
        ((nn.Linear(2, 2).requires_grad_(False), optim.Adam), {}, "model", ValueError),
        (
            (nn.Linear(2, 2), optim.Adam),
            {"master_dtype": torch.bfloat16},
            "master_dtype",
            ValueError,
        ),
        ((nn.Linear(2, 2), optim.Adam), {"offload": 1}, "offload", TypeError),
        ((nn.ReLU(), optim.Adam), {}, "model", ValueError),
        (
            (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()), optim.Adam),
            {},
            "model",
            ValueError,
        ),
        ((tied(), optim.Adam), {}, "model", ValueError),
    ],
)
def test_bad_arguments(args, kwargs, name, error):
    with pytest.raises(error, match=f"Invalid {name}"):
        ZeroOptimizer(*args, **kwargs)


@pytest.fixture
def world_of_one():
    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_misuse_is_an_error_not_a_wrong_step(world_of_one):
    model = sharded_workers.make_model()
    opt = ZeroOptimizer(model, optim.Adam, stage=1, lr=0.1)
    x, y = sharded_workers.global_batches()[0]
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="one backward pass per step"):
        nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    model.zero_grad()  # drops stage 1's flat gradient buffers
    with pytest.raises(RuntimeError, match="reset outside its zero_grad"):
        nn.functional.mse_loss(model(x), y).backward()

    model = sharded_workers.make_model()
    opt = ZeroOptimizer(model, optim.Adam, stage=2, lr=0.1)
    (x @ model[0].weight.T).sum().backward()  # the first layer's bias gets no gradient
    with pytest.raises(RuntimeError, match="without a gradient"):
        opt.step()


@pytest.mark.parametrize("stage", [2, 3])
def test_stages_2_and_3_accumulate_micro_batches(world_of_one, stage):
    # Two backward passes on halves of the batch (each loss halved) take the step of one
    # backward pass on the whole batch.
    x, y = sharded_workers.global_batches()[0]
    reference = sharded_workers.make_model()
    ref_opt = optim.Adam(reference.parameters(), lr=0.1)
    nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    model = sharded_workers.make_model()
    opt = ZeroOptimizer(model, optim.Adam, stage=stage, lr=0.1)
    for half in (slice(0, 4), slice(4, 8)):
        (nn.functional.mse_loss(model(x[half]), y[half]) / 2).backward()
    opt.step()
    for p, q in zip(opt.full_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14)


@pytest.mark.parametrize("stage", [1, 3])
def test_pieces_are_the_ranks_elements_of_each_parameter_as_views_with_no_collective(
    world_of_one, stage, monkeypatch
):
    # In a world of one the rank holds every element: each piece starts at 0 and is the
    # whole parameter and its state, flattened; the cut at world 2 is checked on the
    # checkpoint it writes (tests/run/test_checkpoint.py).
    model = sharded_workers.make_model(nested=True)
    opt = ZeroOptimizer(model, optim.Adam, stage=stage, lr=0.1)
    x, y = sharded_workers.global_batches()[0]
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    whole, state = opt.full_parameters(), opt.full_state_dict()["state"]

    def no_gather(*args, **kwargs):
        raise AssertionError("pieces() called a collective")

    monkeypatch.setattr("lsdl_lab.memory.sharded.all_gather_single", no_gather)
    pieces = opt.pieces()
    assert [p.shape for p in pieces] == [w.shape for w in whole]  # model.parameters() order
    shards = {u.shard.untyped_storage().data_ptr() for u in opt.units}
    for i, piece in enumerate(pieces):
        assert piece.start == 0 and torch.equal(piece.param, whole[i].reshape(-1))
        assert piece.param.untyped_storage().data_ptr() in shards  # a view, not a copy
        assert set(piece.state) == {"step", "exp_avg", "exp_avg_sq"}
        assert piece.state["step"] == state[i]["step"] == 1  # a number: as it is
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(piece.state[key], state[i][key].reshape(-1)), (i, key)
    opt.state[opt.units[0].stepped]["odd"] = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="state 'odd' is not shaped like its shard"):
        opt.pieces()
