import pytest
import torch

from lsdl_lab.compress import QSGD, ErrorFeedback, PowerSGD, RandomK, SignSGD, TernGrad, TopK

COMPRESSORS = [
    lambda: SignSGD(),
    lambda: TernGrad(seed=0),
    lambda: QSGD(2, seed=0),
    lambda: TopK(0.1),
    lambda: RandomK(0.1, seed=0, scaled=False),
    lambda: RandomK(0.1, seed=0),
    lambda: PowerSGD(1),
]


@pytest.mark.parametrize("make", COMPRESSORS)
def test_error_feedback_telescopes(make, device):
    ef = ErrorFeedback(make())
    grads = [torch.randn(12, 9, dtype=torch.float64).to(device) for _ in range(20)]
    sent = sum(ef.decompress(ef.compress(g)) for g in grads)
    total = sum(grads)
    assert torch.allclose(sent + ef.error, total, rtol=0, atol=1e-12 * total.abs().max())
    assert not torch.allclose(sent, total, atol=1e-3)  # compression did drop something


def test_error_feedback_sends_what_was_dropped_later(device):
    ef = ErrorFeedback(TopK(0.5))
    first = ef.decompress(ef.compress(torch.tensor([4.0, 1.0], device=device)))
    second = ef.decompress(ef.compress(torch.tensor([0.0, 0.0], device=device)))
    assert first.tolist() == [4.0, 0.0] and second.tolist() == [0.0, 1.0]
    assert ef.error.device.type == device.type


def test_error_feedback_is_summable_when_its_compressor_is():
    assert ErrorFeedback(RandomK(0.1)).summable and not ErrorFeedback(TopK(0.1)).summable


def test_bad_arguments():
    with pytest.raises(TypeError, match="Invalid compressor"):
        ErrorFeedback("sign")
    ef = ErrorFeedback(SignSGD())
    ef.compress(torch.randn(3))
    with pytest.raises(ValueError, match=r"Invalid tensor: shape \(4,\)"):
        ef.compress(torch.randn(4))
