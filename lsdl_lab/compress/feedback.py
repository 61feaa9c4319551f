"""Error feedback: what compression dropped is added back to the next gradient."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .compressor import Compressor


class ErrorFeedback(Compressor):
    r"""Any compressor with error feedback (Seide et al. 2014; Karimireddy et al. 2019).

    .. math:: p_t = C(g_t + e_t), \qquad e_{t+1} = g_t + e_t - D(p_t)

    The residual :math:`e` keeps what compression dropped and sends it later, so nothing is
    lost: :math:`\sum_t D(p_t) + e_{T} = \sum_t g_t` (the sum telescopes). With a
    :math:`\delta`-contraction ``C`` (scaled sign, top-k, unscaled random-k), EF-SGD
    converges at the rate of SGD (Karimireddy et al. 2019); the biased compressor alone
    may not converge at all. Seide et al.'s 1-bit SGD is :class:`SignSGD` with this
    residual. One residual per stream of tensors: use one ``ErrorFeedback`` per gradient
    (the DDP hooks keep one per bucket).
    """

    def __init__(self, compressor: Compressor):
        if not isinstance(compressor, Compressor):
            raise TypeError(
                f"Invalid compressor: a {type(compressor).__name__} (expected a Compressor)"
            )
        self.compressor = compressor
        self.summable = compressor.summable
        self.error: torch.Tensor | None = None

    def compress(self, tensor: torch.Tensor) -> NamedTuple:
        if self.error is None:
            self.error = torch.zeros_like(tensor)
        elif self.error.shape != tensor.shape:
            raise ValueError(
                f"Invalid tensor: shape {tuple(tensor.shape)} (expected "
                f"{tuple(self.error.shape)}, the shape of the residual this ErrorFeedback keeps)"
            )
        corrected = tensor + self.error
        payload = self.compressor.compress(corrected)
        self.error = corrected - self.compressor.decompress(payload)
        return payload

    def decompress(self, payload: NamedTuple) -> torch.Tensor:
        return self.compressor.decompress(payload)
