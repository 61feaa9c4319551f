"""Tests of lsdl_lab.optim.muon: Muon against torch.optim.Muon (its matrices, bit for bit on
the CPU, under hypothesis), the Newton–Schulz iteration's properties (each singular value
mapped by the quintic polynomial, the band of Jordan et al., orthogonal invariance, its
FLOPs), Liu et al.'s shape scaling (the update's RMS), the AdamW groups against
torch.optim.AdamW, convolution kernels (the step of the flattened matrix, bit for bit), the
split of the book's models, exact resume, the compiled path, and bad input. The contract
(foreach, groups, edges, sparse and complex) is test_contract.py's."""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from lsdl_lab import optim
from lsdl_lab.models import GPT, MLP, ResNet
from lsdl_lab.optim.muon import (
    NS_COEFFICIENTS,
    newton_schulz,
    newton_schulz_flops,
    shape_scale,
)

SHAPES = [(8, 16), (16, 8), (12, 12), (5, 40)]  # wide, tall, square, very wide
# torch.optim.Muon's arithmetic is ours operation for operation: on the CPU the results
# were observed equal bit for bit (torch 2.9 and 2.13); on CUDA the foreach lerp is another
# kernel than torch's per-tensor one, and a difference in the last bit of a direction can
# flip one bfloat16 rounding inside the iteration (2^-8 of one entry of the update)
EXACT = dict(rtol=0.0, atol=0.0)
CUDA_CLOSE = dict(rtol=1e-5, atol=1e-5)


def polynomial(x: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS) -> torch.Tensor:
    """The quintic map of one singular value, ``steps`` times."""
    a, b, c = coefficients
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


# The band of five steps, from the polynomial itself: every normalized singular value
# >= LOW goes into [BAND_LOW, BAND_HIGH] (0.6818, 1.2024), Jordan et al.'s "0.7 to 1.2"
LOW = 0.002
_grid = polynomial(torch.logspace(-2.7, 0, 200_001, dtype=torch.float64))
BAND_LOW, BAND_HIGH = _grid.min().item(), _grid.max().item()


def test_the_band_is_jordan_et_als():
    assert 0.68 < BAND_LOW < 0.69 and 1.20 < BAND_HIGH < 1.21
    assert polynomial(torch.tensor(LOW / 2, dtype=torch.float64)) < 0.6  # below LOW: not yet


# -- against torch.optim.Muon ----------------------------------------------------------------


def muon_runs(device, dtype, steps=6, **options):
    """Our Muon and torch.optim.Muon on the same matrices, fed the same gradients."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen, dtype=dtype) for shape in SHAPES]
    ours_w = [w.clone().to(device).requires_grad_() for w in weights]
    torch_w = [w.clone().to(device).requires_grad_() for w in weights]
    ours = optim.Muon(ours_w, **options)
    theirs = torch.optim.Muon(torch_w, **options)
    for _ in range(steps):
        grads = [torch.randn(shape, generator=gen, dtype=dtype).to(device) for shape in SHAPES]
        for w, v, g in zip(ours_w, torch_w, grads):
            w.grad, v.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    return (ours_w, ours), (torch_w, theirs)


def assert_same_as_torch(a, b, device):
    (ours_w, ours), (torch_w, theirs) = a, b
    tolerance = EXACT if torch.device(device).type == "cpu" else CUDA_CLOSE
    for w, v in zip(ours_w, torch_w, strict=True):
        torch.testing.assert_close(w, v, **tolerance)
        torch.testing.assert_close(
            ours.state[w]["momentum_buffer"], theirs.state[v]["momentum_buffer"], **tolerance
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_optim(device, dtype, adjust_lr_fn, nesterov):
    options = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                   adjust_lr_fn=adjust_lr_fn)  # fmt: skip
    ours, theirs = muon_runs(device, dtype, **options)
    assert_same_as_torch(ours, theirs, device)
    start = muon_runs(device, dtype, steps=0, **options)[0][0]
    assert all(not torch.equal(w, w0) for w, w0 in zip(ours[0], start))  # they did move


@settings(max_examples=25, deadline=None)
@given(
    lr=st.floats(0.0, 0.1),
    momentum=st.floats(0.0, 0.99),
    weight_decay=st.sampled_from([0.0, 1e-3, 0.1]),
    nesterov=st.booleans(),
    ns_steps=st.integers(1, 8),
    adjust_lr_fn=st.sampled_from([None, "original", "match_rms_adamw"]),
    eps=st.sampled_from([1e-7, 1e-3]),
)
def test_matches_torch_optim_for_drawn_hyperparameters(
    lr, momentum, weight_decay, nesterov, ns_steps, adjust_lr_fn, eps
):
    options = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                   ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, eps=eps)  # fmt: skip
    ours, theirs = muon_runs("cpu", torch.float32, steps=3, **options)
    assert_same_as_torch(ours, theirs, "cpu")


# -- the Newton–Schulz iteration -------------------------------------------------------------

shapes = st.tuples(st.integers(2, 48), st.integers(2, 48))


def random_matrix(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31), steps=st.integers(1, 6))
def test_each_singular_value_goes_through_the_polynomial(shape, seed, steps):
    # X_{j+1} = p(X_j) acts on each singular value and keeps the singular vectors, so
    # NS(G) = U p^k(S / ||G||_F) V^T, in float64 to rounding
    G = random_matrix(shape, seed)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    expected = U @ torch.diag(polynomial(S / G.norm(), steps)) @ Vh
    torch.testing.assert_close(newton_schulz(G, steps, dtype=None), expected, rtol=0, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_singular_values_land_in_the_band(shape, seed):
    # Every singular value of G at least LOW * ||G||_F comes out in Jordan et al.'s band: in
    # float64 exactly the polynomial's band, in bfloat16 (the default) within 0.02 of it
    G = random_matrix(shape, seed)
    kept = torch.linalg.svdvals(G) >= LOW * G.norm()
    for X, dtype, slack in ((G, None, 1e-9), (G.float(), torch.bfloat16, 0.02)):
        O = newton_schulz(X, dtype=dtype)
        assert O.dtype == X.dtype and O.shape == G.shape
        s = torch.linalg.svdvals(O.double())[kept]
        assert s.min() >= BAND_LOW - slack and s.max() <= BAND_HIGH + slack, (dtype, s)


@pytest.mark.parametrize("shape", [(6, 20), (20, 6), (16, 16)])
def test_singular_values_land_in_the_band_on_every_device(shape, device):
    G = random_matrix(shape, 0, torch.float32).to(device)
    s = torch.linalg.svdvals(newton_schulz(G).double().cpu())
    assert s.min() >= BAND_LOW - 0.02 and s.max() <= BAND_HIGH + 0.02


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_orthogonal_invariance(shape, seed):
    # NS(U G V) = U NS(G) V for orthogonal U, V: the iteration sees only the singular values
    m, n = shape
    U, _ = torch.linalg.qr(random_matrix((m, m), seed + 1))
    V, _ = torch.linalg.qr(random_matrix((n, n), seed + 2))
    G = random_matrix(shape, seed)
    torch.testing.assert_close(
        newton_schulz(U @ G @ V, dtype=None), U @ newton_schulz(G, dtype=None) @ V,
        rtol=0, atol=1e-10,
    )  # fmt: skip


def test_a_zero_matrix_stays_zero():
    # the norm's floor eps: no division by zero (a layer whose gradient vanishes)
    assert torch.equal(newton_schulz(torch.zeros(3, 5)), torch.zeros(3, 5))


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32), (1, 9)])
@pytest.mark.parametrize("steps", [1, 5])
def test_flops_are_the_stated_count(shape, steps):
    # the docstring's k (4 m^2 n + 2 m^3), m the smaller side, counted by torch's counter:
    # every matrix product of a Muon step is the iteration's
    w = torch.randn(shape, requires_grad=True)
    opt = optim.Muon([w], ns_steps=steps)
    w.grad = torch.randn(shape)
    with FlopCounterMode(display=False) as counter:
        opt.step()
    m, n = sorted(shape)
    assert counter.get_total_flops() == newton_schulz_flops(shape, steps)
    assert newton_schulz_flops(shape, steps) == steps * (4 * m * m * n + 2 * m**3)
    # against the step's elementwise work, about ten FLOPs per element: the ratio the
    # docstring states, k (4 m + 2 m^2 / n) / 10, hundreds for the book's GPT (m = 256)
    assert newton_schulz_flops((256, 256)) / (10 * 256 * 256) == pytest.approx(768)


# -- the shape scaling (Liu et al.) ----------------------------------------------------------


def update_of_one_step(shape, adjust_lr_fn, seed=0):
    """The first step's update of a matrix of ``shape``, divided by the learning rate."""
    w = random_matrix(shape, seed).requires_grad_()
    before = w.detach().clone()
    w.grad = random_matrix(shape, seed + 1)
    optim.Muon([w], lr=1e-3, adjust_lr_fn=adjust_lr_fn, ns_dtype=None).step()
    return (w.detach() - before) / 1e-3


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (64, 64), (16, 256)])
def test_liu_et_als_scaling_gives_every_shape_adamws_rms(shape):
    # RMS(0.2 sqrt(max(m, n)) O) = 0.2 * (RMS of O's singular values): 0.2 for an exact
    # orthogonal factor, and within 0.2 times the band for five steps, whatever the shape
    update = update_of_one_step(shape, "match_rms_adamw")
    rms = update.pow(2).mean().sqrt().item()
    s = torch.linalg.svdvals(update / shape_scale(shape))
    assert rms == pytest.approx(0.2 * s.pow(2).mean().sqrt().item(), rel=1e-12)
    assert 0.2 * BAND_LOW <= rms <= 0.2 * BAND_HIGH


@pytest.mark.parametrize("shape", [(16, 64), (16, 256), (64, 16)])
def test_jordan_et_als_scaling_leaves_the_rms_to_the_shape(shape):
    # "original", sqrt(max(1, m/n)): the RMS is sqrt(max(1, m/n)) (RMS of O's singular
    # values) / sqrt(max(m, n)), so it falls as 1/sqrt(n) for wide matrices (0.25 times the
    # band at n = 16, 0.0625 times at 256), where Liu et al.'s stays 0.2 times the band
    m, n = shape
    update = update_of_one_step(shape, "original")
    rms = update.pow(2).mean().sqrt().item()
    s = torch.linalg.svdvals(update / shape_scale(shape, "original"))
    scale = max(1, m / n) ** 0.5
    assert rms == pytest.approx(scale * s.pow(2).mean().sqrt().item() / max(m, n) ** 0.5,
                                rel=1e-12)  # fmt: skip
    assert BAND_LOW <= rms * max(m, n) ** 0.5 / scale <= BAND_HIGH
    assert shape_scale((64, 16), "original") == 2.0 and shape_scale((16, 64), None) == 1.0
    assert shape_scale((16, 64)) == pytest.approx(0.2 * 8)


# -- the AdamW groups ------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    lr=st.floats(1e-4, 3e-2),
    betas=st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.9999)),
    eps=st.sampled_from([1e-10, 1e-8, 1e-6]),
    weight_decay=st.sampled_from([0.0, 1e-2, 0.1]),
)
def test_adamw_groups_equal_torch_adamw_bit_for_bit(lr, betas, eps, weight_decay):
    adamw_groups_equal_torch(lr, betas, eps, weight_decay, "cpu")


def test_adamw_groups_equal_torch_adamw_on_every_device(device):
    adamw_groups_equal_torch(1e-2, (0.9, 0.95), 1e-8, 0.1, device)


def adamw_groups_equal_torch(lr, betas, eps, weight_decay, device):
    torch.manual_seed(0)
    model = MLP(6, 3, hidden=12, depth=2).to(device)
    twin = MLP(6, 3, hidden=12, depth=2).to(device)
    twin.load_state_dict(model.state_dict())
    groups = optim.muon_param_groups(model)
    ours = optim.Muon(groups, lr=lr, weight_decay=weight_decay, betas=betas, adamw_eps=eps)
    others = [q for (_, p), q in zip(model.named_parameters(), twin.parameters())
              if any(p is r for _, r in groups[1]["params"])]  # fmt: skip
    theirs = torch.optim.AdamW(others, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                               foreach=True)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(16, 6, generator=gen).to(device), torch.randint(0, 3, (16,)).to(device)
        for m, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        # the same gradients on both sides: copy the twin's Muon layers from ours
        with torch.no_grad():
            for (_, p), q in zip(model.named_parameters(), twin.parameters()):
                if all(q is not r for r in others):
                    q.copy_(p)
    for (_, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q)


# -- which parameters Muon takes -------------------------------------------------------------


def names(group) -> set[str]:
    return {name for name, _ in group["params"]}


def test_the_gpt_gives_muon_its_hidden_matrices_only():
    gpt = GPT(vocab_size=32, block_size=8, layers=2, heads=2, dim=16)
    muon, adamw = optim.muon_param_groups(gpt, betas=(0.9, 0.95))
    assert muon["use_muon"] is True and adamw["use_muon"] is False
    assert adamw["betas"] == (0.9, 0.95) and "betas" not in muon
    assert names(muon) == {f"blocks.{i}.{m}.weight" for i in range(2)
                           for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")}  # fmt: skip
    # the token embedding, which is also the output layer (tied), the positions, the
    # LayerNorms' gains and every bias
    assert {"tok.weight", "pos.weight", "ln.weight", "blocks.0.ln1.bias"} <= names(adamw)
    assert names(muon) | names(adamw) == {name for name, _ in gpt.named_parameters()}
    opt = optim.Muon(optim.muon_param_groups(gpt))  # a valid split: every Muon tensor is 2-D
    assert opt.param_groups[0]["param_names"][0] == "blocks.0.attn.qkv.weight"


def test_the_output_layer_marked_parameters_and_frozen_ones():
    mlp = MLP(6, 3, hidden=12, depth=3)  # hidden net.1, net.3, net.5; the output layer net.7
    muon, adamw = optim.muon_param_groups(mlp)
    assert names(muon) == {"net.1.weight", "net.3.weight", "net.5.weight"}
    assert names(adamw) == {"net.7.weight"} | {f"net.{i}.bias" for i in (1, 3, 5, 7)}
    # marked by a module's name, a parameter's name, or the parameter itself
    (adamw,) = optim.muon_param_groups(mlp, adamw=["net.1", "net.3.weight", mlp.net[5].weight])
    assert len(adamw["params"]) == 8
    mlp.net[5].weight.requires_grad_(False)  # frozen: in neither group
    muon, adamw = optim.muon_param_groups(mlp)
    assert names(muon) == {"net.1.weight", "net.3.weight"} and "net.5.weight" not in names(adamw)


def test_a_resnet_keeps_its_convolutions_and_head_out_of_muon():
    resnet = ResNet(depth=8, width=4)
    (adamw,) = optim.muon_param_groups(resnet)  # 4-D kernels, BatchNorm, the head: AdamW
    assert adamw["use_muon"] is False and "head.weight" in names(adamw)


def test_conv_true_gives_muon_the_kernels_and_changes_nothing_else():
    resnet = ResNet(depth=8, width=4)
    muon, adamw = optim.muon_param_groups(resnet, conv=True, betas=(0.9, 0.95))
    kernels = {name for name, p in resnet.named_parameters() if p.ndim == 4}
    # the stem's, two per block (3 blocks), the 1x1 shortcuts of the two downsampling blocks
    assert len(kernels) == 9 and names(muon) == kernels
    assert "head.weight" in names(adamw) and adamw["betas"] == (0.9, 0.95)
    assert all(p.ndim < 4 for _, p in adamw["params"])
    optim.Muon([muon, adamw])  # every kernel is accepted
    # a GPT has no kernels: the same split either way
    gpt = GPT(vocab_size=32, block_size=8, layers=1, heads=2, dim=16)
    assert [names(g) for g in optim.muon_param_groups(gpt, conv=True)] == [
        names(g) for g in optim.muon_param_groups(gpt)
    ]
    w, b, k = (torch.zeros(s, requires_grad=True) for s in [(3, 4), (3,), (2, 2, 3, 3)])
    muon, adamw = optim.muon_param_groups([w, b, k], conv=True)
    assert list(map(id, muon["params"])) == [id(w), id(k)] and adamw["params"] == [b]
    (adamw,) = optim.muon_param_groups([b, k], adamw=[k], conv=True)  # a mark still wins
    assert len(adamw["params"]) == 2


def test_a_list_of_tensors_is_split_by_its_dimensions():
    w, b, k = (torch.zeros(s, requires_grad=True) for s in [(3, 4), (3,), (2, 2, 3, 3)])
    muon, adamw = optim.muon_param_groups([w, b, k])
    assert list(map(id, muon["params"])) == [id(w)]
    assert list(map(id, adamw["params"])) == [id(b), id(k)]
    (adamw,) = optim.muon_param_groups([w, b], adamw=[w])
    assert len(adamw["params"]) == 2
    muon, adamw = optim.muon_param_groups([("w", w), ("v", w.detach().clone().requires_grad_())],
                                          adamw=["v"])  # fmt: skip
    assert names(muon) == {"w"} and names(adamw) == {"v"}


# -- convolution kernels ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [(6, 2, 3, 3), (20, 2, 1, 3), (4, 3, 5), (3, 4, 1, 1)],  # wide, tall, 3-D, a 1x1 kernel
)
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, None])
@pytest.mark.parametrize("adjust_lr_fn", ["match_rms_adamw", "original"])
def test_a_kernel_steps_as_the_matrix_of_its_numbers(shape, ns_dtype, adjust_lr_fn):
    # viewed as out x (in*kh*kw): the iteration and the scaling of that matrix, bit for bit
    g = torch.Generator().manual_seed(0)
    K = torch.randn(shape, generator=g).requires_grad_()
    K0 = K.detach().clone()
    W = K.detach().flatten(1).clone().requires_grad_()
    options = dict(lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, adjust_lr_fn=adjust_lr_fn)
    kernel_opt, matrix_opt = optim.Muon([K], **options), optim.Muon([W], **options)
    for _ in range(4):
        G = torch.randn(shape, generator=g)
        K.grad, W.grad = G.clone(), G.flatten(1).clone()
        kernel_opt.step()
        matrix_opt.step()
    assert not torch.equal(K.detach(), K0)
    torch.testing.assert_close(K.detach().flatten(1), W.detach(), **EXACT)
    B = kernel_opt.state[K]["momentum_buffer"]
    assert B.shape == K.shape  # the state keeps the kernel's shape: 4 bytes per number
    torch.testing.assert_close(B.flatten(1), matrix_opt.state[W]["momentum_buffer"], **EXACT)


def test_a_kernel_is_scaled_by_its_flattened_shape():
    # Liu et al.'s RMS of 0.2 holds for the kernel's update as for a matrix's
    K = torch.zeros(8, 4, 3, 3, requires_grad=True)
    K.grad = torch.randn(8, 4, 3, 3, generator=torch.Generator().manual_seed(1))
    optim.Muon([K], lr=1.0, ns_dtype=None, momentum=0.0, nesterov=False).step()
    assert shape_scale((8, 36)) == 0.2 * 6.0
    rms = K.detach().pow(2).mean().sqrt().item()
    assert 0.2 * 0.68 < rms < 0.2 * 1.21, rms


# -- exact resume ----------------------------------------------------------------------------


def gpt_run(opt_options, steps, start=None, device="cpu"):
    torch.manual_seed(0)
    gpt = GPT(vocab_size=32, block_size=8, layers=1, heads=2, dim=16).to(device)
    opt = optim.Muon(optim.muon_param_groups(gpt), **opt_options)
    if start is not None:
        gpt.load_state_dict(start["model"])
        opt.load_state_dict(start["opt"])
    for t in steps:
        idx = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(t)).to(device)
        opt.zero_grad()
        logits = gpt(idx[:, :-1])
        F.cross_entropy(logits.reshape(-1, 32), idx[:, 1:].reshape(-1)).backward()
        opt.step()
    return gpt, opt


def test_state_dict_resumes_bit_for_bit(device):
    options = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), momentum=0.9)
    whole, whole_opt = gpt_run(options, range(8), device=device)
    half, half_opt = gpt_run(options, range(4), device=device)
    buffer = io.BytesIO()
    torch.save(dict(model=half.state_dict(), opt=half_opt.state_dict()), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)  # weights_only: tensors, numbers, a dtype (ns_dtype)
    # another optimizer's hyperparameters, replaced by the checkpoint's
    resumed, resumed_opt = gpt_run(dict(lr=1.0, ns_dtype=None), range(4, 8), saved, device)
    assert resumed_opt.param_groups[0]["ns_dtype"] is torch.bfloat16
    for p, q in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    state = resumed_opt.state_dict()["state"]
    assert set(state[0]) == {"momentum_buffer"} and "exp_avg" in state[len(state) - 1]


# -- the compiled path -----------------------------------------------------------------------


def test_compiled_update_equals_eager():
    # one graph per group (Muon's, AdamW's), with a learning rate that changes every step;
    # the iteration in the parameters' dtypes (in bfloat16 the compiler's fused casts would
    # round otherwise than the eager operations, by bfloat16's 2^-8)
    def run(compile):
        torch.manual_seed(0)
        models = torch.nn.ModuleList(
            [MLP(6, 3, hidden=12, depth=2).to(d) for d in (torch.float32, torch.float64)]
        )
        opt = optim.Muon(optim.muon_param_groups(models), lr=0.02, weight_decay=0.1,
                         ns_dtype=None, compile=compile)  # fmt: skip
        for t in range(6):
            for group in opt.param_groups:
                group["lr"] = 0.02 / (1 + t)
            gen = torch.Generator().manual_seed(t)
            x, y = (
                torch.randn(16, 6, generator=gen, dtype=torch.float64),
                torch.randint(0, 3, (16,)),
            )
            opt.zero_grad()
            sum(
                F.cross_entropy(m(x.to(d)), y)
                for m, d in zip(models, (torch.float32, torch.float64))
            ).backward()
            opt.step()
        return models, opt

    (compiled, opt), (eager, _) = run(True), run(False)
    assert opt.compiled.failure is None and opt.compiled.compiles == 2
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        tolerance = 1e-5 if p.dtype == torch.float32 else 1e-12
        torch.testing.assert_close(p, q, rtol=tolerance, atol=tolerance)


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (dict(lr=-0.1), ValueError, "Invalid learning rate: -0.1 (expected a finite number >= 0)"),
        (dict(momentum=1.0), ValueError,
         "Invalid momentum value: 1.0 (expected a finite number in [0, 1))"),
        (dict(ns_steps=0), ValueError, "Invalid ns_steps: 0 (expected an int >= 1)"),
        (dict(ns_steps=5.0), TypeError, "Invalid ns_steps: 5.0 (expected an int >= 1)"),
        (dict(ns_coefficients=(3.4, -4.8)), ValueError,
         "Invalid ns_coefficients: (3.4, -4.8) (expected three finite numbers (a, b, c))"),
        (dict(adjust_lr_fn="adamw"), ValueError,
         "Invalid adjust_lr_fn: 'adamw' (expected one of None, 'original', 'match_rms_adamw')"),
        (dict(ns_dtype="bfloat16"), TypeError,
         "Invalid ns_dtype: 'bfloat16' (expected a floating torch.dtype or None)"),
    ],
)  # fmt: skip
def test_bad_hyperparameters_name_the_argument_and_its_range(options, error, message):
    w = torch.zeros(3, 4, requires_grad=True)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        optim.Muon([w], **options)


def test_a_vector_or_a_scalar_is_refused_in_a_muon_group():
    w, b = torch.zeros(3, 4, requires_grad=True), torch.zeros(3, requires_grad=True)
    message = (r"Invalid params: a parameter of shape \(3,\) in a group with use_muon=True "
               r"\(expected two dimensions or more.*muon_param_groups does\)$")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        optim.Muon([w, b])
    with pytest.raises(ValueError, match=r"the parameter 'bias' of shape \(3,\)"):
        optim.Muon([("weight", w), ("bias", b)])  # named: the name is in the message
    with pytest.raises(ValueError, match=r"shape \(\) in a group with use_muon=True"):
        optim.Muon([torch.zeros((), requires_grad=True)])
    opt = optim.Muon([w])
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        opt.add_param_group(dict(params=[b]))
    assert len(opt.param_groups) == 1
    opt.add_param_group(dict(params=[torch.zeros(2, 2, 3, 3, requires_grad=True)]))  # a kernel
    opt.add_param_group(dict(params=[b], use_muon=False))  # AdamW's: any shape
    with pytest.raises(TypeError, match=r"Invalid use_muon: 1 \(expected True or False\)"):
        opt.add_param_group(dict(params=[torch.zeros(2, requires_grad=True)], use_muon=1))
    assert len(opt.param_groups) == 3
    with pytest.raises(TypeError, match=r"^Invalid conv: 1 \(expected True or False\)$"):
        optim.muon_param_groups([w], conv=1)
