"""Gradient compression with the bytes on the wire measured (Chapter 7.4).

Each compressor is a plain object, usable without a process group::

    payload = compressor.compress(g)        # a small named tuple of the tensors sent
    g_hat = compressor.decompress(payload)  # shaped like g
    compressor.nbytes(payload)              # bytes of the payload's tensors

and, through :mod:`lsdl_lab.compress.hooks`, a DDP communication hook.

| module | names |
|---|---|
| ``bits`` | ``pack_bits``, ``unpack_bits``, ``packed_size``: codes of a few bits in bytes |
| ``compressor`` | ``Compressor`` (the contract), ``payload_nbytes`` and the flat wire format |
| ``quantize`` | ``SignSGD`` (1 bit), ``TernGrad`` (2 bits), ``QSGD(levels)`` |
| ``sparsify`` | ``TopK(ratio)``, ``RandomK(ratio, seed)`` |
| ``lowrank`` | ``PowerSGD(rank)`` |
| ``feedback`` | ``ErrorFeedback(compressor)`` |
| ``hooks`` | ``HookState``, ``allgather_hook``, ``allreduce_hook``, ``powersgd_hook`` |
"""

from .bits import pack_bits, packed_size, unpack_bits
from .compressor import Compressor, payload_nbytes
from .feedback import ErrorFeedback
from .hooks import HookState, allgather_hook, allreduce_hook, powersgd_hook
from .lowrank import PowerSGD
from .quantize import QSGD, SignSGD, TernGrad
from .sparsify import RandomK, TopK

__all__ = [
    "QSGD",
    "Compressor",
    "ErrorFeedback",
    "HookState",
    "PowerSGD",
    "RandomK",
    "SignSGD",
    "TernGrad",
    "TopK",
    "allgather_hook",
    "allreduce_hook",
    "pack_bits",
    "packed_size",
    "payload_nbytes",
    "powersgd_hook",
    "unpack_bits",
]
