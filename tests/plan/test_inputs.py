"""The planner's inputs refuse what they cannot describe, naming the argument."""

import pytest

from lsdl_lab.memory.calculator import GPTShape
from lsdl_lab.plan import Cluster, ModelShape, Techniques

CLUSTER = dict(devices_per_node=8, memory=80e9, intra_bandwidth=300e9, intra_latency=5e-6,
               inter_bandwidth=25e9, inter_latency=1e-5, peak_flops=312e12)  # fmt: skip


def test_model_from_a_calculator_shape():
    shape = GPTShape(layers=4, hidden=256, heads=8, seq_len=128, micro_batch=3, vocab=1000)
    model = ModelShape.from_shape(shape, global_batch=32)
    assert model == ModelShape(4, 256, 8, 128, 1000, 32)
    h = 256  # 12h^2 + 13h per block, token and position embeddings, final LayerNorm
    assert model.params == 4 * (12 * h * h + 13 * h) + 1000 * h + 128 * h + 2 * h
    with pytest.raises(TypeError, match="shape"):
        ModelShape.from_shape((4, 256), global_batch=32)


def test_llama_blocks_grouped_query_attention_and_swiglu():
    # K and V with kv_heads heads of h/a, a gated MLP of three ffn x h matrices: Llama 3
    # 405B (Dubey et al. 2024, Table 3) has 405B parameters; ours, with the book GPT's biases,
    # LayerNorms and learned positions (8192 x 16384), 406.0B.
    llama = ModelShape(126, 16384, 128, 8192, 128000, 2048, tied=False, kv_heads=8,
                       ffn=53248, gated=True)  # fmt: skip
    h, kv, f = 16384, 8 * 128, 53248
    block = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h + 3 * h * f + 2 * f + h + 4 * h
    assert llama.params == 126 * block + 2 * 128000 * h + 8192 * h + 2 * h
    assert llama.params / 1e9 == pytest.approx(405, rel=0.003)
    shape = GPTShape(126, 16384, 128, 8192, 1, 128000, tied=False, kv_heads=8, ffn=53248,
                     gated=True)  # fmt: skip
    assert ModelShape.from_shape(shape, global_batch=2048) == llama
    assert llama.shape(1) == shape
    with pytest.raises(ValueError, match="kv_heads"):
        ModelShape(2, 64, 4, 16, 100, 8, kv_heads=3)


def test_bad_inputs_are_named(a100):
    with pytest.raises(ValueError, match="global_batch"):
        ModelShape(2, 64, 4, 16, 100, 0)
    with pytest.raises(ValueError, match="heads"):
        ModelShape(2, 64, 5, 16, 100, 8)
    with pytest.raises(ValueError, match="efficiency"):
        Cluster(devices=8, **dict(a100, efficiency=1.5))
    with pytest.raises(ValueError, match="efficiency"):
        Cluster(devices=8, **dict(a100, efficiency=0.0))
    with pytest.raises(ValueError, match="devices"):
        Cluster(devices=12, **a100)
    with pytest.raises(ValueError, match="inter_latency"):
        Cluster(devices=8, **dict(a100, inter_latency=-1.0))
    with pytest.raises(ValueError, match="recompute"):
        Techniques(recompute=("some",))
    with pytest.raises(ValueError, match="zero_stages"):
        Techniques(zero_stages=(4,))
    with pytest.raises(ValueError, match="micro_batches"):
        Techniques(micro_batches=())
    with pytest.raises(TypeError, match="tp"):
        Techniques(tp=(2.0,))
    with pytest.raises(ValueError, match="virtual_stages"):
        Techniques(virtual_stages=(0,))
    with pytest.raises(ValueError, match="attention"):
        Techniques(attention="flash")
    with pytest.raises(ValueError, match="grad_bytes"):
        Techniques(grad_bytes=0)
    with pytest.raises(ValueError, match="reduce_bytes"):
        Techniques(reduce_bytes=3)
    with pytest.raises(TypeError, match="overlap"):
        Techniques(overlap="yes")
    with pytest.raises(ValueError, match="optimizer"):
        Techniques(optimizer="lion")
    with pytest.raises(ValueError, match="Invalid cp"):
        Techniques(cp=())
    with pytest.raises(ValueError, match="Invalid cp"):
        Techniques(cp=(0,))
    with pytest.raises(ValueError, match="Invalid context"):
        Techniques(context="tree")
    with pytest.raises(TypeError, match="Invalid fp8"):
        Techniques(fp8=1)
    moe = GPTShape(layers=2, hidden=64, heads=4, seq_len=16, micro_batch=1, vocab=100, experts=4)
    with pytest.raises(ValueError, match="Invalid shape: experts=4"):
        ModelShape.from_shape(moe, global_batch=8)


def test_techniques_say_the_bytes_of_gradients_and_their_reduction():
    assert (Techniques().gradient_bytes, Techniques().reduction_bytes) == (2, 2)
    fp32 = Techniques(precision="fp32")
    assert (fp32.width, fp32.gradient_bytes, fp32.reduction_bytes) == (4, 4, 4)
    bloom = Techniques(grad_bytes=6)  # DeepSpeed's BF16_Optimizer: bf16 + float32 buffer
    assert (bloom.gradient_bytes, bloom.reduction_bytes) == (6, 2)
    assert Cluster(devices=8, **{**CLUSTER, "reserve": 0.25}).usable == 0.75 * CLUSTER["memory"]
