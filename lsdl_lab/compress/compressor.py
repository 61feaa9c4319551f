"""What every compressor shares: the ``compress``/``decompress`` contract and the bytes of
a payload, measured from its tensors.

A *payload* is a small named tuple: the tensors that go on the wire, plus what every rank
already knows and therefore never sends (the tensor's shape, the step number). So
``nbytes`` is not a formula but a measurement: the sum of ``numel * element_size`` over the
payload's tensors, exactly what a collective is handed.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

import torch


def wire_tensors(payload: NamedTuple) -> list[torch.Tensor]:
    """The fields of ``payload`` that are tensors: the part that is sent."""
    return [field for field in payload if isinstance(field, torch.Tensor)]


def payload_nbytes(payload: NamedTuple) -> int:
    """Bytes on the wire: ``numel * element_size`` summed over the payload's tensors."""
    return sum(t.numel() * t.element_size() for t in wire_tensors(payload))


def with_wire_tensors(payload: NamedTuple, tensors: list[torch.Tensor]) -> NamedTuple:
    """``payload`` with its sent tensors replaced, in order, by ``tensors`` (after a
    collective); the fields that are not sent are kept."""
    replacements = iter(tensors)
    fields = [next(replacements) if isinstance(f, torch.Tensor) else f for f in payload]
    return type(payload)(*fields)


def flatten_payload(payload: NamedTuple) -> torch.Tensor:
    """The payload's tensors as one flat ``uint8`` tensor, their bytes end to end, so one
    collective sends the whole payload whatever its dtypes; :func:`unflatten_payload`
    undoes it."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in wire_tensors(payload)])


def unflatten_payload(flat: torch.Tensor, like: NamedTuple) -> NamedTuple:
    """A payload shaped like ``like`` whose tensors are read back from the bytes ``flat``
    (another rank's :func:`flatten_payload`)."""
    like_tensors = wire_tensors(like)
    chunks = flat.split([t.numel() * t.element_size() for t in like_tensors])
    # clone: a slice at an odd byte offset cannot be viewed as a wider dtype
    tensors = [c.clone().view(t.dtype).reshape(t.shape) for c, t in zip(chunks, like_tensors)]
    return with_wire_tensors(like, tensors)


class Compressor(abc.ABC):
    """A gradient compressor: ``decompress(compress(g))`` approximates ``g``.

    ``summable`` says whether the payloads of several ranks may be *added* on the wire
    (all-reduce) and then decompressed once, which needs ``decompress`` to be linear in the
    sent tensors and every rank to use the same encoding (random-k with a shared seed).
    Packed codes are not summable: they are all-gathered and decompressed one by one.
    """

    summable: bool = False

    @abc.abstractmethod
    def compress(self, tensor: torch.Tensor) -> NamedTuple:
        """The payload that represents ``tensor``."""

    @abc.abstractmethod
    def decompress(self, payload: NamedTuple) -> torch.Tensor:
        """A tensor shaped like the compressed one."""

    def nbytes(self, payload: NamedTuple) -> int:
        """Bytes the payload puts on the wire, measured from its tensors."""
        return payload_nbytes(payload)
