"""The planner's inputs refuse what they cannot describe, naming the argument."""

import pytest

from lsdl_lab.memory.calculator import GPTShape
from lsdl_lab.plan import Cluster, ModelShape, Techniques


def test_model_from_a_calculator_shape():
    shape = GPTShape(layers=4, hidden=256, heads=8, seq_len=128, micro_batch=3, vocab=1000)
    model = ModelShape.from_shape(shape, global_batch=32)
    assert model == ModelShape(4, 256, 8, 128, 1000, 32)
    h = 256  # 12h^2 + 13h per block, token and position embeddings, final LayerNorm
    assert model.params == 4 * (12 * h * h + 13 * h) + 1000 * h + 128 * h + 2 * h
    with pytest.raises(TypeError, match="shape"):
        ModelShape.from_shape((4, 256), global_batch=32)


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
