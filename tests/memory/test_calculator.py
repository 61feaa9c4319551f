"""The memory calculator against Korthikanti et al.'s formulas and against measurement."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lsdl_lab.memory.calculator import (
    GPTShape,
    ResNetShape,
    activation_bytes,
    gpt_memory,
    gpt_param_shapes,
    optimizer_state_bytes,
    resnet_activation_bytes,
    resnet_memory,
    resnet_param_shapes,
)
from lsdl_lab.memory.measure import SavedTensorBytes, measure
from lsdl_lab.memory.zero import zero_bytes
from lsdl_lab.models import GPT, ResNet, count_parameters
from lsdl_lab.profiles import PROFILES

# GPT-3-like sizes (hidden 6144, 64 heads, 48 layers: the scale Korthikanti et al. study).
SHAPE = GPTShape(layers=48, hidden=6144, heads=64, seq_len=2048, micro_batch=4, vocab=51200)


def _per_layer(recompute, **kw):
    one, two = replace(SHAPE, layers=1), replace(SHAPE, layers=2)
    return activation_bytes(two, recompute=recompute, **kw) - activation_bytes(
        one, recompute=recompute, **kw
    )


def test_korthikanti_per_layer_equations():
    s, b, h, a = 2048, 4, 6144, 64
    sbh = s * b * h
    assert _per_layer("none") == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)  # eq. 2
    assert _per_layer("selective") == 34 * sbh  # eq. 6
    assert _per_layer("full") == 2 * sbh
    t = 8
    assert _per_layer("none", tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert _per_layer("none", tp=t, sequence_parallel=True) == pytest.approx(
        sbh / t * (34 + 5 * a * s / h)
    )  # eq. 4
    assert _per_layer("selective", tp=t, sequence_parallel=True) == pytest.approx(34 * sbh / t)
    # Float32 activations: 16 tensors of sbh elements at 4 bytes, scores 2as²b at 4, masks 1.
    assert _per_layer("none", precision="fp32") == pytest.approx(sbh * (66 + 9 * a * s / h))


def test_outside_the_layers():
    s, b, h, v = 2048, 4, 6144, 51200
    zero_layers = 2 * activation_bytes(replace(SHAPE, layers=1)) - activation_bytes(
        replace(SHAPE, layers=2)
    )
    # Section 4.3: embedding dropout mask sbh, final LayerNorm and output inputs 4sbh,
    # float32 logits for the cross-entropy 4sbv.
    assert zero_layers == s * b * h * (1 + 4) + 4 * s * b * v


def test_parameter_count_is_the_book_gpt():
    for layers, dim, vocab, block in [(2, 64, 64, 32), (3, 96, 100, 16), (1, 128, 65, 8)]:
        gpt = GPT(vocab, block, layers, heads=4, dim=dim)
        shape = GPTShape(layers, dim, 4, block, 1, vocab)
        shapes = gpt_param_shapes(shape)
        assert sum(torch.Size(s).numel() for s in shapes) == count_parameters(gpt)
        untied = gpt_param_shapes(replace(shape, tied=False))
        assert len(untied) == len(shapes) + 1


def test_tensor_parallel_splits_the_matrices():
    shape = GPTShape(layers=4, hidden=256, heads=4, seq_len=128, micro_batch=1, vocab=1024)
    full = sum(torch.Size(s).numel() for s in gpt_param_shapes(shape))
    half = sum(torch.Size(s).numel() for s in gpt_param_shapes(shape, tp=2))
    h = 256
    replicated = 4 * (6 * h) + 128 * h + 2 * h  # LayerNorms, two biases, positions
    assert half == (full - replicated) / 2 + replicated


def test_model_states_follow_zero_and_the_optimizer():
    report = gpt_memory(SHAPE, precision="bf16", optimizer="adam", zero_stage=2, dp=8)
    psi = sum(torch.Size(s).numel() for s in gpt_param_shapes(SHAPE))
    expected = zero_bytes(psi, 2, 8)
    for key in ("params", "grads", "optimizer_state"):
        assert report[key] == pytest.approx(expected[key])
    assert report["total"] == pytest.approx(expected["total"] + report["activations"])
    shapes = [(3, 5), (7,)]
    assert optimizer_state_bytes(shapes, "adam", "fp32") == 8 * 22
    assert optimizer_state_bytes(shapes, "sgd_momentum", "bf16") == 8 * 22
    assert optimizer_state_bytes(shapes, "adafactor", "fp32") == 4 * (3 + 5 + 7)
    assert optimizer_state_bytes(shapes, "adafactor", "fp16") == 4 * 22 + 4 * (3 + 5 + 7)


def _measure_gpt(vocab, seq, layers, heads, dim, batch, optimizer):
    gpt = GPT(vocab, seq, layers, heads, dim)
    idx, target = torch.randint(vocab, (batch, seq)), torch.randint(vocab, (batch, seq))
    with SavedTensorBytes(gpt) as saved:
        F.cross_entropy(gpt(idx).flatten(0, 1), target.flatten()).backward()
    opt = {
        "adam": lambda p: torch.optim.Adam(p),
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adafactor": lambda p: torch.optim.Adafactor(p),
    }[optimizer](gpt.parameters())
    opt.step()
    return measure(gpt, opt), saved.peak, len(list(gpt.parameters()))


def _left_out(layers, s, b):
    """Saved bytes the activation formula leaves out, each explained: every LayerNorm (2
    per layer and the final one) keeps its float32 mean and 1/std per token (2sb floats);
    the embeddings keep their int64 token and position indices, the loss its int64
    targets and a float32 total weight."""
    return (2 * layers + 1) * 2 * s * b * 4 + 8 * s * b + 8 * s + 8 * s * b + 4


SIZES = [(64, 32, 2, 4, 64, 4), (96, 64, 3, 4, 96, 2), (128, 48, 2, 8, 128, 3)]


@pytest.mark.parametrize("vocab, seq, layers, heads, dim, batch", SIZES)
@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum", "adafactor"])
def test_calculator_against_measurement(vocab, seq, layers, heads, dim, batch, optimizer):
    measured, activations, tensors = _measure_gpt(vocab, seq, layers, heads, dim, batch, optimizer)
    shape = GPTShape(layers, dim, heads, seq, batch, vocab)
    options = dict(precision="fp32", optimizer=optimizer, dropout=False)
    calc = gpt_memory(shape, **options, attention="fused")
    assert measured["params"] == calc["params"] and measured["grads"] == calc["grads"]
    # torch.optim keeps a 0-d float32 step count per tensor (none for SGD), not in the formula.
    steps = 0 if optimizer == "sgd_momentum" else 4 * tensors
    assert measured["optimizer_state"] == calc["optimizer_state"] + steps
    assert abs(measured["optimizer_state"] / calc["optimizer_state"] - 1) < 0.10
    s, b = seq, batch
    assert activations == calc["activations"] + _left_out(layers, s, b)
    assert abs(activations / calc["activations"] - 1) < 0.25
    # Korthikanti's formula assumes materialized attention scores (softmax input and
    # output, 2as²b numbers per layer); the book's GPT calls scaled_dot_product_attention,
    # whose fused kernel keeps a log-sum-exp (as b floats) instead.
    materialized = gpt_memory(shape, **options)["activations"]
    assert materialized - calc["activations"] == layers * 4 * (
        2 * heads * s * s * b - heads * s * b
    )


def test_recomputation_lowers_activations_only():
    none, sel, full = (gpt_memory(SHAPE, recompute=r) for r in ("none", "selective", "full"))
    assert none["activations"] > sel["activations"] > full["activations"]
    assert none["params"] == sel["params"] == full["params"]


@pytest.mark.parametrize(
    "kwargs, name, error",
    [
        ({"precision": "fp8"}, "precision", ValueError),
        ({"optimizer": "lion"}, "optimizer", ValueError),
        ({"recompute": "some"}, "recompute", ValueError),
        ({"zero_stage": 4}, "stage", ValueError),
        ({"dp": 0}, "world_size", ValueError),
        ({"tp": 5}, "tp", ValueError),
        ({"attention": "sparse"}, "attention", ValueError),
        ({"dropout": 1}, "dropout", TypeError),
    ],
)
def test_bad_arguments(kwargs, name, error):
    with pytest.raises(error, match=f"Invalid {name}"):
        gpt_memory(SHAPE, **kwargs)


@pytest.mark.parametrize(
    "kwargs, name, error",
    [
        ({"heads": 5}, "heads", ValueError),
        ({"layers": 0}, "layers", ValueError),
        ({"seq_len": 2.0}, "seq_len", TypeError),
        ({"positions": 0}, "positions", ValueError),
        ({"tied": "yes"}, "tied", TypeError),
    ],
)
def test_bad_shapes(kwargs, name, error):
    fields = dict(layers=2, hidden=64, heads=4, seq_len=8, micro_batch=1, vocab=32)
    with pytest.raises(error, match=f"Invalid {name}"):
        GPTShape(**{**fields, **kwargs})
    with pytest.raises(TypeError, match="Invalid shape"):
        gpt_memory(fields)


# -- the ResNet ------------------------------------------------------------------------------

TINY = ResNetShape(depth=8, width=2, num_classes=3, in_channels=1, micro_batch=1, image_size=8)


def test_resnet_formula_by_hand():
    # Blocks (c_in, c, size): (2, 2, 8), (2, 4, 4) and (4, 8, 2), the last two projected.
    stem, blocks = (
        2 * 9 + 4,
        (2 * 2 * 9 * 2 + 8) + (8 * 9 + 16 * 9 + 8 + 24) + (32 * 9 + 64 * 9 + 32 + 48),
    )
    assert sum(map(math.prod, resnet_param_shapes(TINY))) == stem + blocks + 3 * 8 + 3 == 1321
    assert count_parameters(ResNet(8, 2, 3, 1)) == 1321
    # Input 64; stem BN input and ReLU 2 * 128; blocks 4 * 2 * 64, 5 * 4 * 16, 5 * 8 * 4;
    # the classifier's input 8.
    elements = 64 + 256 + 512 + 320 + 160 + 8
    statistics = 2 * 2 + 2 * 2 * 2 + 2 * 4 * 3 + 2 * 8 * 3  # 2c per BatchNorm
    loss = 4 * 3 + 8 + 4
    assert resnet_activation_bytes(TINY) == 4 * elements + 4 * statistics + loss == 5640
    weights = 18 + 36 + 36 + 72 + 144 + 8 + 288 + 576 + 32 + 24
    assert resnet_activation_bytes(TINY, "bf16") == 2 * elements + 4 * statistics + loss + (
        2 * weights
    )


def test_resnet_model_states_follow_zero_and_the_optimizer():
    psi = 1321
    for stage in range(4):
        calc = resnet_memory(TINY, precision="bf16", optimizer="adam", zero_stage=stage, dp=4)
        formula = zero_bytes(psi, stage, 4, 12)
        for key in ("params", "grads", "optimizer_state"):
            assert calc[key] == pytest.approx(formula[key])
        assert calc["total"] == pytest.approx(formula["total"] + calc["activations"])
    # Adafactor factors a convolution's weight (c, c_in, 3, 3) over its last two
    # dimensions: c * c_in * 3 row and c * c_in * 3 column statistics.
    assert optimizer_state_bytes([(4, 2, 3, 3)], "adafactor", "fp32") == 4 * (24 + 24)
    assert optimizer_state_bytes([(5, 7)], "adafactor", "fp32") == 4 * (5 + 7)


def _resnet_sizes():
    # The profiles' ResNets on 8x8 images (smoke's digits) and on 32x32 images, and an odd
    # size whose stride-2 convolutions round up.
    out = []
    for name, images, batch in [("smoke", 8, 4), ("cpu", 32, 2), ("gpu", 32, 2), ("smoke", 11, 3)]:
        p = PROFILES[name]
        out.append((p.resnet_depth, p.resnet_width, images, batch))
    return out


@pytest.mark.parametrize("depth, width, image_size, batch", _resnet_sizes())
def test_resnet_calculator_against_measurement(depth, width, image_size, batch):
    torch.manual_seed(0)
    model = ResNet(depth, width, 10, 3)
    shape = ResNetShape(depth, width, 10, 3, batch, image_size)
    assert [tuple(p.shape) for p in model.parameters()] == resnet_param_shapes(shape)
    x, y = torch.randn(batch, 3, image_size, image_size), torch.randint(10, (batch,))
    for precision in ("fp32", "bf16"):
        with SavedTensorBytes(model) as saved:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
                logits = model(x)
            F.cross_entropy(logits.float(), y).backward()
        calc = resnet_activation_bytes(shape, precision)
        assert saved.peak == calc  # exact: the count is what autograd saves
    tensors = len(list(model.parameters()))
    optimizers = {
        "adam": lambda p: torch.optim.Adam(p),
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adafactor": lambda p: torch.optim.Adafactor(p),
    }
    for name, make in optimizers.items():
        opt = make(model.parameters())
        opt.step()
        measured = measure(model, opt)
        calc = resnet_memory(shape, precision="fp32", optimizer=name)
        assert measured["params"] == calc["params"] and measured["grads"] == calc["grads"]
        # torch.optim keeps a 0-d float32 step count per tensor (none for SGD).
        steps = 0 if name == "sgd_momentum" else 4 * tensors
        # approx: the calculator's K is a ratio (bytes per parameter), rounded in float.
        assert measured["optimizer_state"] == pytest.approx(calc["optimizer_state"] + steps)
        assert abs(measured["optimizer_state"] / calc["optimizer_state"] - 1) < 0.10


@pytest.mark.parametrize(
    "kwargs, name, error",
    [
        ({"depth": 9}, "depth", ValueError),
        ({"depth": 2}, "depth", ValueError),
        ({"width": 0}, "width", ValueError),
        ({"num_classes": 1}, "num_classes", ValueError),
        ({"image_size": 7}, "image_size", ValueError),
        ({"micro_batch": 1.5}, "micro_batch", TypeError),
    ],
)
def test_bad_resnet_shapes(kwargs, name, error):
    fields = dict(depth=8, width=2, num_classes=3, in_channels=1, micro_batch=1, image_size=8)
    with pytest.raises(error, match=f"Invalid {name}"):
        ResNetShape(**{**fields, **kwargs})
    with pytest.raises(TypeError, match="Invalid shape"):
        resnet_memory(fields)
    with pytest.raises(ValueError, match="Invalid precision"):
        resnet_memory(TINY, precision="fp8")
    with pytest.raises(ValueError, match="Invalid optimizer"):
        resnet_memory(TINY, optimizer="lion")
