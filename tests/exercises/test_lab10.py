"""The checkers of Lab 10 accept right answers and reject the usual wrong ones with a hint:
the all-to-all on a real world of 3 (the student's source sent to the ranks, the built-in
collectives forbidden and every message counted, the result compared with
dist.all_to_all_single), the online-softmax step against the library's and full
attention, the token dispatch against lsdl_lab.moe.route."""

from __future__ import annotations

import importlib.util
import inspect
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lsdl_lab import check
from lsdl_lab.check import CheckFailed
from lsdl_lab.exercises import lab10
from lsdl_lab.moe import route

# --- the all-to-all ---------------------------------------------------------------------


def pairwise_exchange(output, input, output_split_sizes, input_split_sizes, group=None, bug=None):
    """lab10.all_to_all's pairwise exchange with one planted ``bug`` (None: none):
    ``"own block"`` forgets to copy the rank's own block; ``"swapped splits"`` cuts the
    input by the output's sizes and the output by the input's; ``"wrong source"`` receives
    at step s from r + s, which is sending to r + 2s: a deadlock at p = 3."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    if bug == "swapped splits":
        input_split_sizes, output_split_sizes = output_split_sizes, input_split_sizes
    sends = input.split(list(input_split_sizes))
    receives = output.split(list(output_split_sizes))
    if bug != "own block":
        receives[r].copy_(sends[r])
    for s in range(1, p):
        to, source = (r + s) % p, (r - s) % p
        if bug == "wrong source":
            source = to
        ops = []
        if sends[to].numel():
            ops.append(dist.P2POp(dist.isend, sends[to].contiguous(), to, group))
        if receives[source].numel():
            ops.append(dist.P2POp(dist.irecv, receives[source], source, group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
    return output


def with_bug(bug: str | None, folder: Path):
    """:func:`pairwise_exchange` with ``bug`` planted as its default, as a function of its
    own, named after the bug, in a file of ``folder``: the checker sends the ranks a
    function's source alone and calls it with four arguments."""
    name = "no_bug" if bug is None else bug.replace(" ", "_")
    source = inspect.getsource(pairwise_exchange)
    for old, new in (("def pairwise_exchange(", f"def {name}("), ("bug=None", f"bug={bug!r}")):
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    path = folder / f"{name}.py"
    path.write_text(f"import torch.distributed as dist\n\n\n{source}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def sends_everything(output, input, output_split_sizes, input_split_sizes, group=None):
    """Right blocks, but each rank sends its whole input to every other rank, which picks
    out its block."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    sizes = [torch.zeros(p, dtype=torch.int64) for _ in range(p)]
    whole = [torch.empty(0)] * p
    receives = output.split(list(output_split_sizes))
    receives[r].copy_(input.split(list(input_split_sizes))[r])
    starts = [sum(input_split_sizes[:j]) for j in range(p)]
    for s in range(1, p):
        to, source = (r + s) % p, (r - s) % p
        # the source's input has sum(its splits) rows: ask for them first
        mine = torch.tensor(list(input_split_sizes), dtype=torch.int64)
        ops = [
            dist.P2POp(dist.isend, mine, to, group),
            dist.P2POp(dist.irecv, sizes[source], source, group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        whole[source] = input.new_empty((int(sizes[source].sum()), *input.shape[1:]))
        ops = []
        if input.numel():
            ops.append(dist.P2POp(dist.isend, input, to, group))
        if whole[source].numel():
            ops.append(dist.P2POp(dist.irecv, whole[source], source, group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        start = int(sizes[source][:r].sum())
        receives[source].copy_(whole[source][start : start + int(sizes[source][r])])
    del starts
    return output


def uses_the_built_in(output, input, output_split_sizes, input_split_sizes, group=None):
    dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)
    return output


def stub(output, input, output_split_sizes, input_split_sizes, group=None):
    raise NotImplementedError("Exercise: write your solution here")


def test_all_to_all_checker_accepts_the_reference(capsys, tmp_path):
    # and the planted-bug exchange without its bug: each bug below is then what fails
    for fn in (lab10.all_to_all, with_bug(None, tmp_path)):
        check.checker("lab10.all_to_all")(fn)
        out = capsys.readouterr().out
        assert "equals dist.all_to_all_single at world 3 on 3 cases" in out


def test_all_to_all_checker_rejects_a_rank_that_forgets_its_own_block(tmp_path):
    with pytest.raises(CheckFailed, match="every block is right but the rank's own"):
        check.checker("lab10.all_to_all")(with_bug("own block", tmp_path))


def test_all_to_all_checker_rejects_sending_the_whole_input():
    # its blocks are right: only the count of what it sends catches it
    with pytest.raises(CheckFailed, match="a pairwise exchange sends each block once"):
        check.checker("lab10.all_to_all")(sends_everything)


def test_all_to_all_checker_rejects_swapped_splits(tmp_path):
    with pytest.raises(
        CheckFailed, match=r"(differs from dist\.all_to_all_single|input_split_sizes)"
    ):
        check.checker("lab10.all_to_all")(with_bug("swapped splits", tmp_path))


def test_all_to_all_checker_names_a_deadlock(monkeypatch, tmp_path):
    monkeypatch.setattr(lab10, "A2A_TIMEOUT", 2.0)
    with pytest.raises(CheckFailed, match="receives from r - s"):
        check.checker("lab10.all_to_all")(with_bug("wrong source", tmp_path))


def test_all_to_all_checker_rejects_the_built_in_and_the_stub():
    with pytest.raises(CheckFailed, match=r"dist\.all_to_all_single is a built-in collective"):
        check.checker("lab10.all_to_all")(uses_the_built_in)
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        check.checker("lab10.all_to_all")(stub)


def test_all_to_all_cases_have_empty_and_uneven_blocks():
    rows = [r for r, _ in lab10.A2A_CASES]
    assert any(0 in row for case in rows for row in case)
    assert any(len({n for row in case for n in row}) > 1 for case in rows)
    assert len(rows[0]) == lab10.A2A_WORLD == 3


# --- the online-softmax step -----------------------------------------------------------


def no_rescale_of_acc(acc, m, l, q, k, v, mask=None):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    m_new = torch.maximum(m, s.amax(-1))
    shift = m_new.nan_to_num(neginf=0.0)
    p = torch.exp(s - shift.unsqueeze(-1))
    return acc + p @ v, m_new, l * torch.exp(m - shift) + p.sum(-1)


def no_running_max(acc, m, l, q, k, v, mask=None):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    p = torch.exp(s)
    return acc + p @ v, torch.maximum(m, s.amax(-1)), l + p.sum(-1)


def nan_for_an_unseen_query(acc, m, l, q, k, v, mask=None):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    m_new = torch.maximum(m, s.amax(-1))
    rescale = torch.exp(m - m_new)
    p = torch.exp(s - m_new.unsqueeze(-1))
    return acc * rescale.unsqueeze(-1) + p @ v, m_new, l * rescale + p.sum(-1)


def test_online_softmax_checker_accepts_the_library(capsys):
    check.checker("lab10.online_softmax_step")(lab10.online_softmax_step)
    assert "softmax attention over all the keys" in capsys.readouterr().out


def test_online_softmax_checker_rejects_the_usual_mistakes():
    with pytest.raises(CheckFailed, match="rescale the old acc"):
        check.checker("lab10.online_softmax_step")(no_rescale_of_acc)
    with pytest.raises(CheckFailed, match="subtract the new running maximum"):
        check.checker("lab10.online_softmax_step")(no_running_max)
    with pytest.raises(CheckFailed, match="exp\\(-inf - \\(-inf\\)\\) is NaN"):
        check.checker("lab10.online_softmax_step")(nan_for_an_unseen_query)


def test_softmax_cases_overflow_without_the_max_and_hide_a_query():
    cases = lab10._softmax_cases()
    q, blocks = cases["large scores"]
    scores = q @ blocks[1][0].transpose(-2, -1) / 2
    assert scores.abs().max() > 710  # exp overflows float64 past 709.8
    hidden = cases["masks"][1][0][2]
    assert not hidden[0].any()


# --- the dispatch ----------------------------------------------------------------------


def token_major(logits, top_k, capacity_factor):
    T, E = logits.shape
    gate, expert = logits.double().softmax(-1).topk(top_k, dim=-1)
    if top_k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    C = math.ceil(capacity_factor * T * top_k / E)
    queue = expert.reshape(-1)
    place = F.one_hot(queue, E).cumsum(0).gather(1, queue[:, None]).squeeze(1) - 1
    place = place.view(T, top_k)
    return expert, gate.to(logits.dtype), torch.where(place < C, place, -1)


def floor_capacity(logits, top_k, capacity_factor):
    expert, gate, _ = lab10.dispatch(logits, top_k, capacity_factor)
    T, E = logits.shape
    place = lab10._places(expert, E)
    C = math.floor(capacity_factor * T * top_k / E)
    return expert, gate, torch.where(place < C, place, -1)


def gates_not_renormalized(logits, top_k, capacity_factor):
    expert, _, slot = lab10.dispatch(logits, top_k, capacity_factor)
    gate = logits.softmax(-1).gather(1, expert)
    return expert, gate, slot


def test_dispatch_reference_is_route():
    logits = torch.randn(20, 4, dtype=torch.float64)
    expert, gate, slot = lab10.dispatch(logits, 2, 1.0)
    routing = route(logits, 2, 1.0)
    assert int((slot < 0).sum()) == routing.dropped
    assert torch.equal(torch.bincount(expert.reshape(-1), minlength=4), routing.routed)
    kept = lab10._kept_by_expert(expert, slot, 4)
    assert [t for tokens, _ in kept for t in tokens] == routing.token.tolist()


def test_dispatch_checker_accepts_and_rejects(capsys):
    check.checker("lab10.dispatch")(lab10.dispatch)
    assert "the experts, gates, slots and drops" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="you queued token by token"):
        check.checker("lab10.dispatch")(token_major)
    with pytest.raises(CheckFailed, match=r"C = floor\(\.\.\.\); it is ceil"):
        check.checker("lab10.dispatch")(floor_capacity)
    with pytest.raises(CheckFailed, match="renormalized to add up to 1"):
        check.checker("lab10.dispatch")(gates_not_renormalized)
