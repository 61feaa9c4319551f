"""The memory calculator against Korthikanti et al.'s formulas and against measurement."""

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lsdl_lab.distributed.world import free_port
from lsdl_lab.memory.calculator import (
    GPTShape,
    ResNetShape,
    activation_bytes,
    active_parameters,
    gpt_memory,
    gpt_param_parts,
    gpt_param_shapes,
    layer_traffic,
    optimizer_state_bytes,
    resnet_activation_bytes,
    resnet_memory,
    resnet_param_shapes,
)
from lsdl_lab.memory.fp8 import convert_to_fp8
from lsdl_lab.memory.measure import SavedTensorBytes, measure
from lsdl_lab.memory.zero import zero_bytes
from lsdl_lab.models import GPT, ResNet, count_parameters
from lsdl_lab.moe import MoE
from lsdl_lab.optim import AdamW, AdamW8bit
from lsdl_lab.parallel import ExpertParallelMoE
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


# -- beyond the survey: sequence and context parallelism, experts, 8-bit Adam, FP8 -----------


def test_sequence_parallelism_sends_what_tensor_parallelism_sends():
    sbh, t = 2048 * 4 * 6144, 8
    # four all-reduces of a 2-byte activation, 2 (t-1)/t of it each by a ring; sequence
    # parallelism's all-gather and reduce-scatter, (t-1)/t each
    plain = layer_traffic(SHAPE, tp=t)["tp"]
    assert plain == layer_traffic(SHAPE, tp=t, sequence_parallel=True)["tp"]
    assert plain == pytest.approx(4 * 2 * (t - 1) / t * 2 * sbh)
    assert layer_traffic(SHAPE, "bf16", "full", tp=t)["tp"] == pytest.approx(1.5 * plain)
    assert layer_traffic(SHAPE) == {"tp": 0, "cp": 0, "ep": 0}
    # Korthikanti et al. 2022, Table 2: sequence parallelism and full recomputation, 2sbh/t
    assert _per_layer("full", tp=t, sequence_parallel=True) == pytest.approx(2 * sbh / t)


@pytest.mark.parametrize("c, t, sp", [(2, 1, False), (4, 8, True), (8, 8, False)])
def test_context_parallelism_divides_the_activations(c, t, sp):
    s, b, h, a, v = 2048 // c, 4, 6144, 64, 51200  # a rank's positions
    sbh, lse = s * b * h, 4 * a * s * b  # the fused kernel's float32 log-sum-exp
    got = _per_layer("none", attention="fused", tp=t, sequence_parallel=sp, cp=c)
    expected = (34 * sbh + lse) / t if sp else sbh * (10 + 24 / t) + lse / t
    assert got == pytest.approx(expected, rel=1e-12)
    outside = 2 * activation_bytes(replace(SHAPE, layers=1), attention="fused", cp=c, tp=t)
    outside -= activation_bytes(replace(SHAPE, layers=2), attention="fused", cp=c, tp=t)
    assert outside == pytest.approx(sbh * 5 + 4 * s * b * v / t)  # the logits too
    whole = activation_bytes(SHAPE, attention="fused", cp=c)
    assert whole == activation_bytes(replace(SHAPE, seq_len=s), attention="fused")


def test_context_parallel_bytes_are_ring_attentions_and_ulysses():
    # Llama-3-8B-like attention (32 heads of 128, 8 K and V heads) on a 32K sequence
    shape = GPTShape(1, 4096, 32, 32768, 1, 32000, kv_heads=8)
    previous = None
    for c in (2, 4, 8):
        n = 8 * (32768 // c) * 128 * 4  # one float32 K shard of a rank
        ring = layer_traffic(shape, "fp32", cp=c)["cp"]
        # 2 (c-1) n forward; 2 (c-1) n and 2 c n of gradients backward (context.py)
        assert ring == (2 * (c - 1) + 2 * (c - 1) + 2 * c) * n
        assert ring / (c * n) == 6 - 4 / c  # under 6 whole-sequence K tensors, whatever c
        q = 32 * (32768 // c) * 128 * 4
        ulysses = layer_traffic(shape, "fp32", cp=c, context="ulysses")["cp"]
        assert ulysses == 8 * (c - 1) * q // c
        share = ulysses / (c * q)  # of one whole-sequence Q: 8 (c-1)/c^2, falling with c
        assert previous is None or share < previous
        previous = share
    n = 8 * 8192 * 128 * 2  # bf16 K and V; their gradients accumulate in float32
    assert layer_traffic(shape, "bf16", cp=4)["cp"] == 2 * 3 * n + 2 * 3 * n + 2 * 4 * 2 * n
    assert layer_traffic(shape, "bf16", "full", cp=4)["cp"] == 4 * 3 * n + 2 * 3 * n + 16 * n


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"cp": 3}, "cp"),  # not a divisor of 32768
        ({"cp": 0}, "cp"),
        ({"cp": 8, "tp": 8, "context": "ulysses"}, "cp"),  # 32 heads / 8 = 4, not by 8
        ({"cp": 2, "context": "star"}, "context"),
        ({"ep": 2}, "ep"),  # a dense GPT
    ],
)
def test_bad_traffic_arguments(kwargs, name):
    shape = GPTShape(1, 4096, 32, 32768, 1, 32000, kv_heads=8)
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        layer_traffic(shape, **kwargs)
    if "context" not in kwargs and "ep" not in kwargs and kwargs["cp"]:
        with pytest.raises(ValueError, match="Invalid cp"):
            activation_bytes(shape, attention="materialized" if kwargs["cp"] == 8 else "fused",
                             **{k: v for k, v in kwargs.items() if k == "cp"})  # fmt: skip


@pytest.mark.parametrize("experts, top_k", [(4, 1), (4, 2), (8, 2)])
def test_expert_parameters_are_the_book_moe_gpts(experts, top_k):
    gpt = GPT(64, 32, 2, heads=4, dim=64, moe_experts=experts, moe_top_k=top_k)
    shape = GPTShape(2, 64, 4, 32, 1, 64, experts=experts, top_k=top_k)
    total = sum(math.prod(s) for s in gpt_param_shapes(shape))
    assert total == count_parameters(gpt)
    dense = sum(math.prod(s) for s in gpt_param_shapes(replace(shape, experts=0)))
    ffn = 2 * 64 * 256 + 256 + 64  # one MLP, one expert
    assert total == dense + 2 * ((experts - 1) * ffn + experts * 64)  # and an E x h router
    moe = [block.mlp for block in gpt.blocks]
    assert all(isinstance(m, MoE) for m in moe)
    outside = count_parameters(gpt) - sum(sum(p.numel() for p in m.parameters()) for m in moe)
    assert active_parameters(shape) == outside + sum(m.active_parameters() for m in moe)
    assert active_parameters(replace(shape, experts=0)) == dense


def test_expert_parallelism_divides_the_experts_states():
    shape = GPTShape(4, 256, 4, 64, 1, 1024, experts=8, top_k=2)
    ffn = 2 * 256 * 1024 + 1024 + 256
    dense = sum(math.prod(s) for s in gpt_param_shapes(replace(shape, experts=0)))
    dense += 4 * (8 * 256 - ffn)  # a router in place of each layer's MLP
    assert sum(math.prod(s) for s in gpt_param_parts(shape, ep=4)["experts"]) == 2 * ffn
    for stage in range(4):
        got = gpt_memory(shape, zero_stage=stage, dp=8, ep=4)
        # dense states partitioned over the 8 ranks; a rank's 2 experts of each of the 4
        # layers over the 8/4 = 2 ranks that hold them
        here, experts = zero_bytes(dense, stage, 8), zero_bytes(4 * 2 * ffn, stage, 2)
        for key in ("params", "grads", "optimizer_state"):
            assert got[key] == pytest.approx(here[key] + experts[key], rel=1e-12)
    whole = gpt_memory(shape, zero_stage=0, dp=8)
    assert whole["params"] == 2 * (dense + 4 * 8 * ffn)
    assert gpt_memory(shape, dp=8, ep=8)["params"] == 2 * (dense + 4 * ffn)


@pytest.mark.parametrize(
    "fields, kwargs, name",
    [
        ({}, {"ep": 3, "dp": 3}, "ep"),  # 8 experts
        ({}, {"ep": 4, "dp": 2}, "ep"),  # expert-parallel ranks are data-parallel ranks
        ({"experts": 0}, {"ep": 2, "dp": 2}, "ep"),
        ({"top_k": 9}, {}, "top_k"),
        ({"experts": -1}, {}, "experts"),
        ({}, {"fp8": True}, "fp8"),
    ],
)
def test_bad_expert_arguments(fields, kwargs, name):
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        gpt_memory(GPTShape(2, 64, 4, 32, 1, 64, **{"experts": 8, **fields}), **kwargs)


def _saved(gpt, vocab, seq, batch):
    idx, target = torch.randint(vocab, (batch, seq)), torch.randint(vocab, (batch, seq))
    with SavedTensorBytes(gpt) as saved:
        F.cross_entropy(gpt(idx).flatten(0, 1), target.flatten()).backward()
    return saved.peak


@pytest.mark.parametrize("experts, top_k", [(4, 1), (8, 2)])
def test_expert_activations_against_measurement(experts, top_k):
    vocab, seq, layers, heads, dim, batch = 64, 32, 2, 4, 64, 4
    torch.manual_seed(0)
    # capacity factor E/k: an expert takes every token, none is dropped
    gpt = GPT(vocab, seq, layers, heads, dim, moe_experts=experts, moe_top_k=top_k,
              moe_capacity_factor=experts / top_k)  # fmt: skip
    measured = _saved(gpt, vocab, seq, batch)
    shape = GPTShape(layers, dim, heads, seq, batch, vocab, experts=experts, top_k=top_k)
    calc = activation_bytes(shape, "fp32", dropout=False, attention="fused")
    dense = activation_bytes(replace(shape, experts=0), "fp32", dropout=False, attention="fused")
    assert calc > dense + layers * seq * batch * top_k * 3 * dim * 4
    gap = measured - calc - _left_out(layers, seq, batch)
    # what routing keeps that the count leaves out: int64 indices and float32 gates, a few
    # numbers per assignment (measured: 28 bytes for k = 1, 34 for k = 2)
    assert 0 <= gap <= layers * seq * batch * top_k * 48


def test_all_to_all_bytes_are_the_rows_expert_parallelism_hands_over():
    shape = GPTShape(1, 64, 4, 32, 4, 64, experts=8, top_k=2)
    T = 32 * 4
    for e in (2, 4, 8):
        one = 2 * T * 64 * 4 * (e - 1) / e  # k T rows of h float32, but the 1/e kept
        assert layer_traffic(shape, "fp32", ep=e)["ep"] == pytest.approx(4 * one)
        assert layer_traffic(shape, "fp32", "full", ep=e)["ep"] == pytest.approx(6 * one)
    with pytest.raises(ValueError, match="Invalid ep"):
        layer_traffic(shape, ep=2, tp=2)
    # The library's layer in a world of one: what it hands its all-to-alls (AllToAllBytes:
    # E int64 counts, then dispatch and combine forward, their reverses backward) is the
    # 4 k T rows the formula sends (e-1)/e of.
    torch.manual_seed(0)
    moe = MoE(64, 256, 8, top_k=2, capacity_factor=4.0)  # capacity 4 kT/E = T: no drops
    started = not dist.is_initialized()
    if started:
        store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        layer = ExpertParallelMoE.from_dense(moe)
        layer(torch.randn(4, 32, 64, requires_grad=True)).sum().backward()
    finally:
        if started:
            dist.destroy_process_group()
    assert layer.dropped == 0
    rows = layer.bytes.total - 8 * 8
    e = 4
    assert layer_traffic(shape, "fp32", ep=e)["ep"] == pytest.approx(rows * (e - 1) / e)


def test_8bit_adam_state_is_the_optimizers():
    torch.manual_seed(0)
    for vocab, seq, dim in [(64, 32, 64), (100, 16, 96)]:
        gpt = GPT(vocab, seq, 2, 4, dim)
        shapes = [tuple(p.shape) for p in gpt.parameters()]
        idx = torch.randint(vocab, (2, seq))
        for make, name in [(AdamW8bit, "adam8bit"), (AdamW, "adam")]:
            opt = make(gpt.parameters(), lr=1e-3)
            gpt.zero_grad()
            F.cross_entropy(gpt(idx).flatten(0, 1), idx.flatten()).backward()
            opt.step()
            state = measure(gpt, opt)["optimizer_state"]  # the state's tensors, each once
            assert state == optimizer_state_bytes(shapes, name, "fp32")
        assert any(math.prod(s) >= 4096 for s in shapes)  # some tensors are kept in 8 bits
    # by hand: 8192 values (>= 4096) a byte a moment and 4 blocks of 2048, two float32
    # scales each; 3000 values (< 4096) Adam's two float32 moments
    assert optimizer_state_bytes([(64, 128), (3000,)], "adam8bit", "fp32") == (
        2 * 8192 + 2 * 4 * 4 + 8 * 3000
    )
    shapes = [(4096, 4096)]
    psi = 4096 * 4096
    eight, adam = (optimizer_state_bytes(shapes, o, "bf16") for o in ("adam8bit", "adam"))
    assert eight == 4 * psi + 2 * psi + 8 * psi // 2048  # with the float32 master weights
    assert adam == 12 * psi and (eight - 4 * psi) / (adam - 4 * psi) == (2 + 8 / 2048) / 8


def test_fp8_linears_keep_a_byte_per_input_and_weight():
    s, b, h, a = 2048, 4, 6144, 64
    sbh = s * b * h
    # bf16: the QKV and first MLP inputs, the projection's and the second MLP layer's
    # (4h), 1 byte each instead of 2: 7 sbh saved; the FP8 weights, 12 h^2 bytes
    assert _per_layer("none", fp8=True) == pytest.approx(sbh * 27 + 5 * a * s * s * b + 12 * h * h)
    assert _per_layer("selective", fp8=True) == pytest.approx(27 * sbh + 12 * h * h)
    assert _per_layer("full", fp8=True) == _per_layer("full")
    assert _per_layer("selective", fp8=True, tp=8) == pytest.approx(
        8 * sbh + 19 * sbh / 8 + 12 * h * h / 8
    )
    report = gpt_memory(SHAPE, fp8=True)
    for key in ("params", "grads", "optimizer_state"):  # the master weights keep their bytes
        assert report[key] == gpt_memory(SHAPE)[key]
    with pytest.raises(TypeError, match="Invalid fp8"):
        gpt_memory(SHAPE, fp8="yes")


@pytest.mark.parametrize("vocab, seq, layers, heads, dim, batch", SIZES)
def test_fp8_activations_against_measurement(vocab, seq, layers, heads, dim, batch):
    torch.manual_seed(0)
    gpt = convert_to_fp8(GPT(vocab, seq, layers, heads, dim), keep={"head"})
    measured = _saved(gpt, vocab, seq, batch)
    shape = GPTShape(layers, dim, heads, seq, batch, vocab)
    calc = activation_bytes(shape, "fp32", dropout=False, attention="fused", fp8=True)
    scales = layers * 4 * 2 * 4  # each FP8 linear keeps its input's and weight's float32 scale
    assert measured == calc + _left_out(layers, seq, batch) + scales


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
