"""Bytes per rank of the model states under ZeRO's stages (Rajbhandari et al. 2020).

Mixed-precision training with Adam holds, per parameter, 2 bytes of 16-bit weights, 2
bytes of 16-bit gradients and K = 12 bytes of optimizer state (a float32 master copy of
the weight, Adam's two float32 moments): 16 bytes, or 16Psi for Psi parameters
(Rajbhandari et al. 2020, Section 3.1; the Ultra-Scale Playbook counts the same 16).
Data parallelism replicates all of it on each of N ranks; ZeRO partitions it:

======  ===========================  ======================
stage   partitioned                  bytes per rank
======  ===========================  ======================
0       nothing (plain data par.)    (2 + 2 + K) Psi
1       optimizer state (P_os)       2Psi + 2Psi + K Psi/N
2       + gradients (P_os+g)         2Psi + (2 + K) Psi/N
3       + parameters (P_os+g+p)      (2 + 2 + K) Psi/N
======  ===========================  ======================

(Rajbhandari et al. 2020, Figure 1.) Other counts in the literature differ in their
assumptions, not their arithmetic: DeepSpeed's estimators keep a float32 gradient
partition in place of the 16-bit one (``estimate_zero3_model_states_mem_needs``: 18Psi/N =
(2 + 4 + 12)Psi/N, the 16-bit weights, the float32 gradients, and master weights with
moments; stages 1 and 2: 2Psi + 18Psi/N since DeepSpeed's 2024 estimator, 4Psi + 16Psi/N
before it and on its documentation page; Chapter 8 writes both). "How to Scale Your Model"
is reported to count 10 bytes, which would be 16-bit weights and float32 moments without a
master copy or stored gradients (that breakdown is our reading, not checked against its
text). This module states its assumption in its arguments: ``k`` and the bytes of a 16-bit
weight and gradient.
"""

from __future__ import annotations

from .._util import check_int, check_nonnegative, check_positive

__all__ = ["ZERO_STAGES", "zero_bytes"]

ZERO_STAGES = (0, 1, 2, 3)


def zero_bytes(
    num_params: float,
    stage: int,
    world_size: int,
    k: float = 12,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer state under ZeRO ``stage``.

    ``num_params`` is Psi, ``world_size`` the data-parallel degree N, ``k`` the bytes of
    optimizer state per parameter (12 for mixed-precision Adam: master weight and two
    moments in float32; 8 for mixed-precision SGD with momentum; 8 for float32 Adam, with
    ``param_bytes=grad_bytes=4``). Returns ``{"params", "grads", "optimizer_state",
    "total"}`` in bytes (floats: Psi/N need not be whole; real partitions are padded to
    whole elements, which this formula ignores).
    """
    num_params = check_positive("num_params", num_params)
    stage = check_int("stage", stage, 0, 3)
    n = check_int("world_size", world_size, 1)
    k = check_nonnegative("k", k)
    param_bytes = check_nonnegative("param_bytes", param_bytes)
    grad_bytes = check_nonnegative("grad_bytes", grad_bytes)
    out = {
        "params": param_bytes * num_params / (n if stage >= 3 else 1),
        "grads": grad_bytes * num_params / (n if stage >= 2 else 1),
        "optimizer_state": k * num_params / (n if stage >= 1 else 1),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer_state"]
    return out
