"""The checkers of Lab 7 accept right answers and reject the usual wrong ones with a hint:
the ring all-reduce on a real world of 3 (the student's source sent to the ranks, the
built-in collectives forbidden and every message counted), the error-feedback step and the
1-bit compressor against lsdl_lab.compress; SentMessages counts and forbids, then restores
torch.distributed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lsdl_lab import check
from lsdl_lab.check import CheckFailed
from lsdl_lab.compress import ErrorFeedback, SignSGD, TopK
from lsdl_lab.distributed import traffic
from lsdl_lab.exercises import lab07


def ring_without_all_gather(tensor, group=None):
    """Only the reduce-scatter: each rank holds one summed chunk."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    chunks = list(torch.tensor_split(tensor.view(-1), p))
    for s in range(p - 1):
        recv = chunks[(r - s - 2) % p]
        incoming = torch.empty_like(recv)
        ops = []
        if chunks[(r - s - 1) % p].numel():
            ops.append(dist.P2POp(dist.isend, chunks[(r - s - 1) % p], (r + 1) % p, group))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, incoming, (r - 1) % p, group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        recv += incoming
    return tensor


def blocking_ring(tensor, group=None):
    r, p = dist.get_rank(group), dist.get_world_size(group)
    incoming = torch.empty_like(tensor)
    dist.send(tensor.clone(), (r + 1) % p)
    dist.recv(incoming, (r - 1) % p)
    return tensor.add_(incoming)


def uses_the_built_in(tensor, group=None):
    dist.all_reduce(tensor, group=group)
    return tensor


def uses_the_built_in_by_its_module(tensor, group=None):
    """torch.distributed's all_reduce, by the name of the module that defines it."""
    dist.distributed_c10d.all_reduce(tensor, group=group)
    return tensor


def gather_everything(tensor, group=None):
    """Right sums, but every rank sends its whole tensor to every other rank."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    others = [torch.empty_like(tensor) for _ in range(p)]
    ops = []
    for q in range(p):
        if q != r:
            ops.append(dist.P2POp(dist.isend, tensor.clone(), q, group))
            ops.append(dist.P2POp(dist.irecv, others[q], q, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for q in range(p):
        if q != r:
            tensor += others[q]
    return tensor


def ring_in_halves(tensor, group=None):
    """A right ring that sends every chunk as two messages: 4(p - 1) of them."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    chunks = list(torch.tensor_split(tensor.view(-1), p))

    def exchange(send, recv):
        ops = []
        for out, into in zip(torch.tensor_split(send, 2), torch.tensor_split(recv, 2)):
            if out.numel():
                ops.append(dist.P2POp(dist.isend, out, (r + 1) % p, group))
            if into.numel():
                ops.append(dist.P2POp(dist.irecv, into, (r - 1) % p, group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    for s in range(p - 1):
        recv = chunks[(r - s - 2) % p]
        incoming = torch.empty_like(recv)
        exchange(chunks[(r - s - 1) % p], incoming)
        recv += incoming
    for s in range(p - 1):
        exchange(chunks[(r - s) % p], chunks[(r - s - 1) % p])
    return tensor


def helper_outside(tensor, group=None):
    return a_helper_the_ranks_do_not_have(tensor)  # noqa: F821


def stub(tensor, group=None):
    raise NotImplementedError("Exercise: write your solution here")


def test_ring_checker_accepts_a_correct_ring(capsys):
    check.checker("lab07.ring_all_reduce")(lab07.ring_all_reduce)
    out = capsys.readouterr().out
    assert "the sum at world 3" in out and "2(p - 1) = 4 messages of one chunk" in out


def test_ring_checker_rejects_the_built_in_all_reduce():
    with pytest.raises(
        CheckFailed, match=r"dist\.all_reduce is a built-in collective, not allowed"
    ):
        check.checker("lab07.ring_all_reduce")(uses_the_built_in)


def test_ring_checker_rejects_a_rank_that_sends_its_whole_tensor():
    # its sums are right: only the count of what it sends catches it (at 2 entries, a
    # message of 2 numbers where a ring's chunks hold ceil(2 / 3) = 1)
    with pytest.raises(CheckFailed, match=r"one message carried 2 numbers; in a ring every"):
        check.checker("lab07.ring_all_reduce")(gather_everything)


def test_ring_checker_rejects_more_messages_than_a_ring_sends():
    with pytest.raises(CheckFailed, match=r"8 messages were sent; a ring sends 2\(p - 1\) = 4"):
        check.checker("lab07.ring_all_reduce")(ring_in_halves)


def test_the_ring_worker_refuses_the_built_in_by_its_modules_name():
    # refused before any message: the worker runs here, without a world (the checker's
    # path from BuiltInCollective to CheckFailed is the test above's)
    source = lab07.ring_source(uses_the_built_in_by_its_module)
    with pytest.raises(traffic.BuiltInCollective, match=r"dist\.all_reduce is a built-in"):
        lab07.run_student_ring(0, 3, source, "uses_the_built_in_by_its_module", [4])
    assert dist.distributed_c10d.all_reduce is dist.all_reduce  # restored after the refusal


def test_sent_messages_forbids_counts_and_restores():
    names = ("send", "isend", "batch_isend_irecv", "P2POp", *traffic.BUILT_IN_COLLECTIVES)
    modules = (dist, dist.distributed_c10d)
    before = {(m, name): getattr(m, name) for m in modules for name in names}
    assert "all_reduce" in traffic.BUILT_IN_COLLECTIVES
    with traffic.SentMessages(forbid=True) as sent:
        for module in modules:  # under both names
            with pytest.raises(traffic.BuiltInCollective, match="dist.all_gather is a built-in"):
                module.all_gather([torch.zeros(1)], torch.zeros(1))
            # the counting isend in both modules, so that torch's check of a P2POp's op
            # (against distributed_c10d's isend) accepts it
            assert module.isend is not before[module, "isend"]
            assert module.isend is dist.isend and module.send is dist.send
        with pytest.raises(RuntimeError, match="already open"):
            traffic.SentMessages().__enter__()
    assert sent.numels == [] and sent.bytes == 0
    assert {(m, name): getattr(m, name) for m in modules for name in names} == before
    with traffic.SentMessages() as counting:  # without forbid the collectives are torch's
        assert dist.all_reduce is before[dist, "all_reduce"]
        assert dist.distributed_c10d.all_reduce is before[dist, "all_reduce"]
    assert counting.bytes == 0


def test_ring_checker_rejects_a_ring_without_its_all_gather():
    with pytest.raises(CheckFailed, match="off by"):
        check.checker("lab07.ring_all_reduce")(ring_without_all_gather)


def test_ring_checker_names_a_deadlock(monkeypatch):
    monkeypatch.setattr(lab07, "RING_TIMEOUT", 2.0)
    with pytest.raises(CheckFailed, match="blocking send before a recv deadlocks"):
        check.checker("lab07.ring_all_reduce")(blocking_ring)


def test_ring_checker_explains_missing_helpers_and_the_stub():
    with pytest.raises(CheckFailed, match="put every helper inside the function"):
        check.checker("lab07.ring_all_reduce")(helper_outside)
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        check.checker("lab07.ring_all_reduce")(stub)


def test_error_feedback_reference_is_the_library():
    g = torch.randn(20, dtype=torch.float64)
    e = torch.randn(20, dtype=torch.float64)
    payload, new_e = lab07.error_feedback_step(g, e, TopK(0.2))
    ef = ErrorFeedback(TopK(0.2))
    ef.error = e.clone()
    expected = ef.decompress(ef.compress(g))
    assert torch.equal(TopK(0.2).decompress(payload), expected)
    assert torch.equal(new_e, ef.error)


def test_error_feedback_checker_accepts_and_rejects(capsys):
    check.checker("lab07.error_feedback_step")(lab07.error_feedback_step)
    assert "telescopes" in capsys.readouterr().out

    def forgets_the_error(grad, error, compressor):  # plain compression
        payload = compressor.compress(grad)
        return payload, grad - compressor.decompress(payload)

    with pytest.raises(CheckFailed, match="what is sent"):
        check.checker("lab07.error_feedback_step")(forgets_the_error)

    def keeps_the_old_error(grad, error, compressor):
        payload = compressor.compress(grad + error)
        return payload, error + grad - compressor.decompress(payload) + error

    with pytest.raises(CheckFailed, match="the new error"):
        check.checker("lab07.error_feedback_step")(keeps_the_old_error)


class MySign:
    """A student's packing (its own bit order) to show that any packing passes."""

    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)

    def compress(self, grad):
        negative = (grad < 0).to(torch.uint8)
        padded = torch.nn.functional.pad(negative, (0, (-grad.numel()) % 8)).view(-1, 8)
        return (padded * self.weights).sum(1).to(torch.uint8), grad.abs().mean()

    def decompress(self, bits, scale, d):
        negative = ((bits[:, None] & self.weights) > 0).view(-1)[:d]
        return scale * (1 - 2 * negative.to(scale.dtype))


def test_sign_checker_accepts_a_packed_sign(capsys):
    check.checker("lab07.sign_compressor")(MySign)
    assert "1 bit per entry" in capsys.readouterr().out
    g = torch.randn(13)
    ref = SignSGD()
    assert torch.equal(
        lab07.sign_compressor.decompress(*lab07.sign_compressor.compress(g), 13),
        ref.decompress(ref.compress(g)),
    )


class BytePerSign(MySign):
    def compress(self, grad):
        return (grad < 0).to(torch.uint8), grad.abs().mean()

    def decompress(self, bits, scale, d):
        return scale * (1 - 2 * bits.to(scale.dtype))


class ZeroAsZero(MySign):
    def decompress(self, bits, scale, d):  # torch.sign(0) = 0: one bit cannot say that
        out = super().decompress(bits, scale, d)
        return out if d != 5 else out * torch.tensor([0.0, 1, 1, 0, 1])


def test_sign_checker_rejects_a_byte_per_sign_and_a_wrong_zero():
    with pytest.raises(CheckFailed, match=r"one bit per entry"):
        check.checker("lab07.sign_compressor")(BytePerSign)
    with pytest.raises(CheckFailed, match="with zeros"):
        check.checker("lab07.sign_compressor")(ZeroAsZero())


def test_ring_sizes_include_sizes_below_the_world():
    assert min(lab07.RING_SIZES) < lab07.RING_WORLD
