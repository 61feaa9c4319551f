"""lsdl_lab.distributed.traffic: CollectiveBytes against the formulas on a real gloo world of
2 (each collective counts numel * element_size of the tensor this rank hands it, once, and
keeps a record of the call), under both of torch's names of a collective, and its blocks in
one process (reopening refused, nesting, torch's functions restored); SentMessages under
both names, forbidding the collectives under both."""

import pytest
import torch.distributed as dist
import traffic_workers as worker  # the ranks import it by name (pytest's pythonpath)

from lsdl_lab.distributed import CollectiveBytes, call_each, spawn
from lsdl_lab.distributed.traffic import COUNTED

N, W = worker.N, 2


@pytest.fixture(scope="module")
def ranks():
    # gloo by name: the tensors are on the CPU, also on a machine with GPUs
    runs = [worker.every_collective, worker.blocks]
    return spawn(call_each, W, runs, backend="gloo", timeout=60)


def test_every_collective_counts_the_bytes_this_rank_hands_it(ranks):
    for counts, _ in ranks:
        assert counts["all_reduce"] == 4 * N  # n float32: 4n bytes
        assert counts["all_reduce float64 by keyword"] == 8 * N
        assert counts["all_reduce float16 async"] == 2 * N
        assert counts["broadcast"] == 4 * N  # on every rank, the source and the receivers
        assert counts["all_gather"] == 4 * N  # this rank's tensor, not the gathered list
        # the flat forms, under each name this torch has, counted once a call
        gathers = [n for n in worker.FLAT_GATHERS if n in counts]
        scatters = [n for n in worker.FLAT_SCATTERS if n in counts]
        assert gathers and scatters
        for name in gathers:
            assert counts[name] == 4 * N, name  # this rank's shard
        for name in scatters:
            assert counts[name] == 4 * W * N, name  # the whole tensor it reduces
        # and the collectives still computed their results
        assert counts["all_reduce sums"]
        assert counts["all_gather gathers"] == [0.0, 1.0]
        assert all(counts[name + " gathers"] == [0.0, 1.0] for name in gathers)
        assert all(counts[name + " sums"] for name in scatters)
        # all-to-all: the whole input, this rank's own block included, once a call
        assert counts["all_to_all_single"] == 4 * W * N
        assert counts["all_to_all_single moves"]
        if "all_to_all" in counts:  # the list form, where gloo has it
            assert counts["all_to_all"] == 4 * W * N
            assert counts["all_to_all moves"]
        # the library's, from point-to-point messages: W - 1 blocks sent, none collective
        assert counts["library all_to_all"] == (0, 4 * (W - 1) * N, [N] * (W - 1))
        assert counts["library all_to_all moves"]


def test_each_call_is_recorded_with_its_bytes_and_group_size(ranks):
    for counts, _ in ranks:
        recorded = {name: calls for name, calls, _ in counts["calls"]}  # each name's last
        assert set(recorded) == {n for n in COUNTED if n in counts}
        for name, calls, nbytes in counts["calls"]:
            # one call: the collective's own name, the bytes counted, the world's size
            assert calls == [(name, nbytes, W)], name
        assert recorded["all_reduce"] == [("all_reduce", 2 * N, W)]  # the float16 async one
        assert recorded["broadcast"] == [("broadcast", 4 * N, W)]
        assert recorded["all_gather"] == [("all_gather", 4 * N, W)]
        assert recorded["all_to_all_single"] == [("all_to_all_single", 4 * W * N, W)]
        # the group given by position and by keyword: a group of this rank alone
        alone = [("all_reduce", 4 * N, 1), ("all_reduce", 8 * N, 1)]
        assert counts["calls in a group of 1"] == alone


def test_nothing_is_counted_outside_a_block_and_blocks_nest(ranks):
    for _, blocks in ranks:
        assert blocks["one block"] == 4 * N  # not the calls before and after it
        assert blocks["two blocks"] == 4 * N + 8 * N  # a counter's blocks add up
        # the outer counter sees the inner block's call too; the inner only its own
        assert blocks["nested"] == (4 * N + 8 * N + 12 * N, 8 * N)
        assert blocks["failed block"] == 4 * N  # a block that raised closed all the same
        assert blocks["restored"]
        # what it cannot see: a function bound to a name of its own before the block
        assert blocks["bound before the block"] == 0


def test_both_names_of_a_function_are_counted_and_forbidden(ranks):
    for _, blocks in ranks:
        # torch.distributed.distributed_c10d's names, where torch.distributed's come from
        assert blocks["distributed_c10d"] == (4 * N + 4 * N, ["all_reduce", "all_gather"])
        assert blocks["forbidden by distributed_c10d"]
        # send (which calls isend inside torch 2.13: counted once), isend, a P2POp of isend
        # in batch_isend_irecv, all by distributed_c10d's names: delivered and counted
        assert blocks["messages by distributed_c10d"] == [True, True, True, [N, 2 * N, 3 * N]]
        assert blocks["restored"]  # in both modules


def test_the_collectives_it_sees():
    assert {"all_reduce", "broadcast", "all_gather", "all_to_all_single"} <= set(COUNTED)
    assert "all_to_all" in COUNTED  # the list form (which gloo runs on torch 2.13, not 2.9)
    # every name this torch has for the flat forms (2.13 has both, the older one deprecated)
    flat = worker.FLAT_GATHERS + worker.FLAT_SCATTERS
    assert [n for n in flat if hasattr(dist, n)] == [n for n in flat if n in COUNTED]
    assert any(n in COUNTED for n in worker.FLAT_GATHERS)
    assert any(n in COUNTED for n in worker.FLAT_SCATTERS)


def test_a_counter_refuses_to_reopen_its_block():
    torch_all_reduce = dist.all_reduce
    counter = CollectiveBytes()
    with counter:
        assert dist.all_reduce is not torch_all_reduce  # counting
        with pytest.raises(RuntimeError, match="already counting"):
            counter.__enter__()
        assert dist.all_reduce is not torch_all_reduce  # the open block is unharmed
    assert dist.all_reduce is torch_all_reduce
    with counter:  # closed, it opens again
        pass
    assert dist.all_reduce is torch_all_reduce


def test_overlapping_blocks_restore_torchs_functions_when_the_last_closes():
    torch_functions = {name: getattr(dist, name) for name in COUNTED}
    first, second = CollectiveBytes(), CollectiveBytes()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # not the last opened: the other still counts
    assert all(getattr(dist, n) is not fn for n, fn in torch_functions.items())
    second.__exit__(None, None, None)
    assert all(getattr(dist, n) is fn for n, fn in torch_functions.items())
    assert first.bytes == second.bytes == 0
