"""What the planner's tests share: an A100 node's figures and a small GPT on 16 GPUs.

An A100 node (DGX A100, Selene) has NVSwitch, 300 GB/s per GPU and direction, and one
200 Gb/s HDR InfiniBand adapter per GPU (25 GB/s); NVLink latency 5 us, network 10 us
(typical NCCL small-message latencies, an assumption). Every A100 runs at the same stated
efficiency, 0.5 of its 312 TFLOP/s bf16 peak, never fitted per run.
"""

import pytest

from lsdl_lab.plan import Cluster, ModelShape

A100 = dict(
    devices_per_node=8,
    memory=80e9,
    intra_bandwidth=300e9,
    intra_latency=5e-6,
    inter_bandwidth=25e9,
    inter_latency=10e-6,
    peak_flops=312e12,
    efficiency=0.5,
)


@pytest.fixture
def a100():
    return dict(A100)


@pytest.fixture
def small():
    return ModelShape(layers=8, hidden=1024, heads=16, seq_len=1024, vocab=32768, global_batch=64)


@pytest.fixture
def small_cluster():
    return Cluster(devices=16, **dict(A100, memory=12e9))
