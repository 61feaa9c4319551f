"""The memory calculator: bytes per rank of each category for training a GPT or a ResNet.

For a GPT-2-style model (pre-norm blocks, learned positions, output layer tied to the
token embedding, as :class:`lsdl_lab.models.GPT`) of ``layers`` blocks of width h with
a heads, trained on micro-batches of b sequences of s tokens over a vocabulary of v:

* **Model states** (parameters, gradients, optimizer state): Psi parameters per
  tensor-parallel rank times the bytes of each, partitioned by :func:`zero_bytes` over
  the data-parallel ranks. Mixed precision (``"bf16"``, ``"fp16"``) keeps 16-bit weights
  and gradients and puts the float32 master weights in the optimizer state
  (Rajbhandari et al. 2020): Adam K = 12, SGD with momentum K = 8, Adafactor 4 + its
  factored second moment (Shazeer & Stern 2018: n + m numbers for an n x m matrix, no
  first moment). ``"fp32"`` keeps 4-byte weights and gradients, Adam K = 8, SGD K = 4,
  Adafactor its factored moment only.

* **Activations** by Korthikanti et al. (2022), Section 4: per layer, with p bytes per
  activation and 1-byte dropout masks, ``sbh(34 + 5as/h)`` bytes for p = 2 (eq. 2), made of
  sbh(4p + 2) kept whole on every tensor-parallel rank (two LayerNorm inputs, the inputs
  of the QKV and first MLP layers, two dropout masks) and 12p·sbh/t + (2p + 1)as²b/t split
  over t ranks (Q, K, V, the projection's input, the GeLU's input and output; the
  attention scores' softmax, its dropout mask and output): ``sbh(10 + 24/t + 5as/(ht))``
  (eq. 3); sequence parallelism splits the rest too, ``sbh/t (34 + 5as/h)`` (eq. 4).
  *Selective* recomputation drops the as² terms (eq. 6, ``34sbh``), *full* recomputation
  keeps only each layer's input, p·sbh (2sbh in the paper). Outside the layers (Section
  4.3, as we read it; the tests hold these terms against measurement, the per-layer ones
  against equations 2-6): the embedding's dropout mask sbh, the final LayerNorm's and
  the output layer's inputs 2p·sbh, and float32 logits for the cross-entropy, 4sbv
  (split over t).

Two switches describe the book's own GPT: ``dropout=False`` (no masks when dropout is 0)
and ``attention="fused"``: ``scaled_dot_product_attention``'s fused kernels
(FlashAttention, Dao et al. 2022) keep no s x s scores; they keep the output (the same
storage as the projection's input here) and a float32 log-sum-exp per query and head,
4abs bytes, and recompute the scores in the backward pass.

Two fields of :class:`GPTShape` describe the shapes of later GPTs (Llama's): ``kv_heads``
(grouped-query attention, Ainslie et al. 2023: K and V have ``kv_heads`` heads of h/a,
so their projections and activations are 2 kv h/a wide, not 2h) and a feed-forward width
``ffn`` (default 4h) with ``gated=True`` for a gated MLP (SwiGLU, Shazeer 2020: a gate and
an up projection, h x ffn each, and a down projection). The split activations above are
the queries, K and V, the projection's input and the MLP's: ``sb(h + 2 kv h/a + h +
2 ffn)`` elements, 12sbh at the defaults (the GeLU's input and output, 2 ffn = 8h), and
3 ffn for a gated MLP (the gate and up projections' outputs and the down projection's
input, as Megatron-LM's fused SwiGLU keeps them).

What the formula leaves out, measured on the book's GPT by the tests (SavedTensorBytes):
LayerNorm's float32 mean and 1/std per token, the int64 token, position and target
indices; and under ``torch.autocast`` with float32 master weights (not Megatron-LM's
16-bit weights), a float32 residual stream at each LayerNorm (4 bytes per element, not
2) and a 16-bit copy of every matrix weight, cast by autocast and kept for the backward
pass: 2 bytes per matrix parameter that the formula does not count.

The book's CIFAR ResNet (:class:`lsdl_lab.models.ResNet`, He et al. 2016, Section 4.2:
depth 6n + 2, widths w, 2w, 4w, 1x1 projection shortcuts, global average pooling) has no
published activation formula; :func:`resnet_activation_bytes` counts what autograd saves
for it, read off :class:`lsdl_lab.memory.SavedTensorBytes` op by op (training mode, the
CPU kernels; each storage once, parameters and buffers excluded). With N images of
S x S pixels and A = N x (the stage's spatial size)^2 positions, p bytes per activation:

* the first convolution saves its input, N c_in S^2 elements (every later convolution's
  input is a ReLU's output, already counted);
* each convolution's output is the input its BatchNorm saves, and BatchNorm also saves
  its batch mean and 1/std, 2c float32 numbers (its weight and running statistics are
  parameters and buffers);
* each ReLU saves its output; the residual addition and the identity shortcut save
  nothing, so a basic block keeps 4cA elements (two BatchNorm inputs, two ReLU
  outputs) and a projection shortcut cA more (its BatchNorm's input);
* global average pooling saves nothing; the classifier saves its input, N x 4w;
* the loss (cross-entropy) saves the float32 log-softmax, 4Nk bytes, the int64 targets
  and a float32 total weight, 8N + 4 bytes.

``"fp32"`` is p = 4. ``"bf16"`` and ``"fp16"`` describe ``torch.autocast`` over float32
weights, as measured on the CPU: every feature map is 16-bit (p = 2; BatchNorm runs on
the 16-bit maps and keeps float32 statistics) and each convolution and the classifier
keep the 16-bit copy of their weight that autocast casts, 2 bytes per weight element. On
CUDA, cuDNN's BatchNorm may keep a reserve buffer that this count leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._util import check_bool, check_choice, check_int
from .zero import zero_bytes

__all__ = [
    "ATTENTIONS",
    "GPTShape",
    "ResNetShape",
    "OPTIMIZERS",
    "PRECISIONS",
    "RECOMPUTE",
    "activation_bytes",
    "activation_parts",
    "gpt_memory",
    "gpt_param_parts",
    "gpt_param_shapes",
    "optimizer_state_bytes",
    "resnet_activation_bytes",
    "resnet_memory",
    "resnet_param_shapes",
]

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd_momentum", "adafactor")
RECOMPUTE = ("none", "selective", "full")
ATTENTIONS = ("materialized", "fused")


@dataclass(frozen=True)
class GPTShape:
    """A GPT and its micro-batch: ``layers`` blocks of width ``hidden`` with ``heads``
    heads, micro-batches of ``micro_batch`` sequences of ``seq_len`` tokens, ``vocab``
    tokens, ``positions`` learned positions (the block size; default ``seq_len``), the
    output layer ``tied`` to the token embedding or not; ``kv_heads`` key and value heads
    (grouped-query attention; default ``heads``), an MLP ``ffn`` wide (default 4
    ``hidden``), ``gated`` (SwiGLU) or not."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch: int
    vocab: int
    positions: int | None = None
    tied: bool = True
    kv_heads: int | None = None
    ffn: int | None = None
    gated: bool = False

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq_len", "micro_batch", "vocab"):
            check_int(name, getattr(self, name), 1)
        for name in ("positions", "kv_heads", "ffn"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_bool("tied", self.tied)
        check_bool("gated", self.gated)
        if self.hidden % self.heads:
            raise ValueError(
                f"Invalid heads: {self.heads} (expected a divisor of hidden={self.hidden})"
            )
        if self.heads % self.kv:
            raise ValueError(
                f"Invalid kv_heads: {self.kv_heads} (expected a divisor of heads={self.heads})"
            )

    @property
    def kv(self) -> int:
        """Key and value heads (``heads`` without grouped-query attention)."""
        return self.kv_heads or self.heads

    @property
    def mlp(self) -> int:
        """The MLP's width (4 ``hidden`` unless ``ffn`` says otherwise)."""
        return self.ffn or 4 * self.hidden


def gpt_param_parts(shape: GPTShape, tp: int = 1) -> dict[str, list[tuple[int, ...]]]:
    """The parameter shapes of the GPT held by one of ``tp`` tensor-parallel ranks, by
    part: ``"embedding"`` (tokens, by vocabulary; positions whole), one ``"block"``, and the
    ``"head"`` (the final LayerNorm and, untied, the output layer).

    A block: LayerNorm (h, h), QKV ((h + 2 kv h/a) x h and its bias), projection (h x h, h),
    MLP (ffn x h, ffn, h x ffn, h; a gated MLP's first layer is 2 ffn x h, the gate and the
    up projection), LayerNorm (h, h): 12h² + 13h at the defaults. Megatron-LM's split
    (Shoeybi et al. 2019): QKV and the first MLP layer by rows (with their biases), the
    projection and the second MLP layer by columns, the token embedding by vocabulary;
    LayerNorms, the projection's and second MLP layer's biases and the positions whole on
    every rank.
    """
    if not isinstance(shape, GPTShape):
        raise TypeError(f"Invalid shape: a {type(shape).__name__} (expected a GPTShape)")
    h, t, v = shape.hidden, check_int("tp", tp, 1), shape.vocab
    qkv = h + 2 * shape.kv * (h // shape.heads)
    up = (2 if shape.gated else 1) * shape.mlp
    if h % t or v % t or qkv % t or shape.mlp % t:
        raise ValueError(
            f"Invalid tp: {tp} (expected a divisor of hidden, vocab, the QKV width {qkv} and "
            f"the MLP width {shape.mlp})"
        )
    block = [(h,), (h,), (qkv // t, h), (qkv // t,), (h, h // t), (h,)]
    block += [(h,), (h,), (up // t, h), (up // t,), (h, shape.mlp // t), (h,)]
    positions = shape.positions or shape.seq_len
    head = [(h,), (h,)] + ([] if shape.tied else [(v // t, h)])
    return {"embedding": [(v // t, h), (positions, h)], "block": block, "head": head}


def gpt_param_shapes(shape: GPTShape, tp: int = 1) -> list[tuple[int, ...]]:
    """The parameter shapes of the GPT held by one of ``tp`` tensor-parallel ranks: the
    embeddings, ``layers`` blocks and the head of :func:`gpt_param_parts`, in order."""
    parts = gpt_param_parts(shape, tp)
    return parts["embedding"] + parts["block"] * shape.layers + parts["head"]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def optimizer_state_bytes(shapes: list[tuple[int, ...]], optimizer: str, precision: str) -> int:
    """Bytes of optimizer state for parameters of these shapes (see the module's text)."""
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("precision", precision, PRECISIONS)
    psi = sum(_numel(s) for s in shapes)
    master = 0 if precision == "fp32" else 4 * psi
    if optimizer == "adam":
        return master + 8 * psi
    if optimizer == "sgd_momentum":
        return master + 4 * psi
    # Adafactor: a row and a column statistic for a matrix (over the last two dimensions
    # of an order-k tensor, as Adafactor factors a convolution's weight), a full one for a
    # vector.
    return master + 4 * sum(
        _numel(s[:-1]) + _numel(s[:-2]) * s[-1] if len(s) >= 2 else _numel(s) for s in shapes
    )


def activation_parts(
    shape: GPTShape,
    precision: str = "bf16",
    recompute: str = "none",
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    dropout: bool = True,
    attention: str = "materialized",
) -> dict[str, float]:
    """Bytes of activations kept for the backward pass on one rank, by part: each
    ``"layer"``, the ``"embedding"`` (its dropout mask) and the ``"output"`` (the final
    LayerNorm's and the output layer's inputs, the float32 logits); see the module's text.
    A pipeline stage holds some of them (:mod:`lsdl_lab.plan`)."""
    if not isinstance(shape, GPTShape):
        raise TypeError(f"Invalid shape: a {type(shape).__name__} (expected a GPTShape)")
    a, s, b, h, v = shape.heads, shape.seq_len, shape.micro_batch, shape.hidden, shape.vocab
    check_choice("precision", precision, PRECISIONS)
    check_choice("recompute", recompute, RECOMPUTE)
    check_choice("attention", attention, ATTENTIONS)
    t = check_int("tp", tp, 1)
    sp = t if check_bool("sequence_parallel", sequence_parallel) else 1
    m = 1 if check_bool("dropout", dropout) else 0
    p = 4 if precision == "fp32" else 2
    sbh = s * b * h
    whole = sbh * (4 * p + 2 * m) / sp
    # queries, keys and values, the projection's input, the MLP's (12 sbh at the defaults)
    width = 2 * h + 2 * shape.kv * (h // a) + (3 if shape.gated else 2) * shape.mlp
    split = s * b * width * p / t
    if attention == "materialized":
        scores = a * s * s * b * (2 * p + m) / t
    else:
        scores = 4 * a * s * b / t  # the float32 log-sum-exp of each query and head
    if recompute == "none":
        per_layer = whole + split + scores
    elif recompute == "selective":
        per_layer = whole + split
    else:
        per_layer = p * sbh / sp
    return {
        "layer": per_layer,
        "embedding": sbh * m / sp,
        "output": 2 * p * sbh / sp + 4 * s * b * v / t,
    }


def activation_bytes(
    shape: GPTShape,
    precision: str = "bf16",
    recompute: str = "none",
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    dropout: bool = True,
    attention: str = "materialized",
) -> float:
    """Bytes of activations kept for the backward pass on one rank (Korthikanti et al.
    2022, eqs. 2-6 and Section 4.3, generalized to p bytes per activation: p = 2 in mixed
    precision, 4 in float32; see the module's text): ``layers`` times each layer's, and
    the terms outside the layers, of :func:`activation_parts`."""
    parts = activation_parts(
        shape,
        precision,
        recompute,
        tp=tp,
        sequence_parallel=sequence_parallel,
        dropout=dropout,
        attention=attention,
    )
    return shape.layers * parts["layer"] + parts["embedding"] + parts["output"]


def gpt_memory(
    shape: GPTShape,
    *,
    precision: str = "bf16",
    optimizer: str = "adam",
    zero_stage: int = 0,
    dp: int = 1,
    tp: int = 1,
    recompute: str = "none",
    **activation_options,
) -> dict[str, float]:
    """Bytes per rank of ``params``, ``grads``, ``optimizer_state``, ``activations`` and
    their ``total`` for training the GPT ``shape`` (the module's text gives every
    assumption).

    ``dp`` ranks partition the model states by ZeRO ``zero_stage``; ``tp`` ranks split
    the layers (Megatron-LM). ``activation_options`` (``sequence_parallel``, ``dropout``,
    ``attention``) go to :func:`activation_bytes`. Buffers, temporaries, the allocator's
    fragmentation and communication buffers are not counted.
    """
    check_choice("precision", precision, PRECISIONS)
    out = _model_states(gpt_param_shapes(shape, tp), precision, optimizer, zero_stage, dp)
    out["activations"] = activation_bytes(shape, precision, recompute, tp=tp, **activation_options)
    out["total"] = sum(out.values())
    return out


def _model_states(shapes, precision: str, optimizer: str, zero_stage: int, dp: int) -> dict:
    """Parameters, gradients and optimizer state per rank (no total) for these shapes."""
    psi = sum(_numel(s) for s in shapes)
    width = 4 if precision == "fp32" else 2
    k = optimizer_state_bytes(shapes, optimizer, precision) / psi
    out = zero_bytes(psi, zero_stage, dp, k, param_bytes=width, grad_bytes=width)
    del out["total"]
    return out


@dataclass(frozen=True)
class ResNetShape:
    """The book's CIFAR ResNet and its micro-batch: ``depth`` = 6n + 2 layers, ``width``
    channels in the first stage, ``num_classes`` outputs, ``in_channels`` input channels
    (the arguments of :class:`lsdl_lab.models.ResNet`), micro-batches of ``micro_batch``
    images of ``image_size`` x ``image_size`` pixels."""

    depth: int
    width: int
    num_classes: int
    in_channels: int
    micro_batch: int
    image_size: int

    def __post_init__(self):
        if check_int("depth", self.depth, 8) % 6 != 2:
            raise ValueError(
                f"Invalid depth: {self.depth} (expected 6n + 2 with n >= 1: 8, 14, 20, ...)"
            )
        check_int("width", self.width, 1)
        check_int("num_classes", self.num_classes, 2)
        check_int("in_channels", self.in_channels, 1)
        check_int("micro_batch", self.micro_batch, 1)
        check_int("image_size", self.image_size, 8)


def _resnet_layout(shape: ResNetShape) -> list[tuple[int, int, int]]:
    """(input channels, output channels, output size) of each basic block, in order."""
    if not isinstance(shape, ResNetShape):
        raise TypeError(f"Invalid shape: a {type(shape).__name__} (expected a ResNetShape)")
    n, w, size = (shape.depth - 2) // 6, shape.width, shape.image_size
    blocks, c_in = [], w
    for stage, c in enumerate((w, 2 * w, 4 * w)):
        for i in range(n):
            if stage > 0 and i == 0:
                size = (size - 1) // 2 + 1  # a stride-2 convolution, padding 1 (3x3) or 0 (1x1)
            blocks.append((c_in, c, size))
            c_in = c
    return blocks


def resnet_param_shapes(shape: ResNetShape) -> list[tuple[int, ...]]:
    """The parameter shapes of the ResNet, in the order of ``ResNet.parameters()``: the
    first 3x3 convolution (no bias) and its BatchNorm (weight, bias); per basic block two
    3x3 convolutions with their BatchNorms and, where the shape changes, a 1x1 projection
    with its BatchNorm; the classifier (weight, bias)."""
    blocks = _resnet_layout(shape)
    w = shape.width
    shapes = [(w, shape.in_channels, 3, 3), (w,), (w,)]
    for c_in, c, _ in blocks:
        shapes += [(c, c_in, 3, 3), (c,), (c,), (c, c, 3, 3), (c,), (c,)]
        if c_in != c:
            shapes += [(c, c_in, 1, 1), (c,), (c,)]
    return shapes + [(shape.num_classes, 4 * w), (shape.num_classes,)]


def resnet_activation_bytes(shape: ResNetShape, precision: str = "fp32") -> int:
    """Bytes autograd saves for the backward pass of one training step of the ResNet and
    its cross-entropy loss (the count per layer type is in the module's text)."""
    blocks = _resnet_layout(shape)
    check_choice("precision", precision, PRECISIONS)
    p = 4 if precision == "fp32" else 2
    b, w, k, size = shape.micro_batch, shape.width, shape.num_classes, shape.image_size
    elements = b * shape.in_channels * size**2 + 2 * b * w * size**2  # input, BN input, ReLU
    statistics = 2 * w  # float32 mean and 1/std of each BatchNorm's channels
    for c_in, c, out in blocks:
        projection = c_in != c
        elements += (4 + projection) * b * c * out**2
        statistics += 2 * c * (2 + projection)
    elements += b * 4 * w  # the classifier's input
    loss = 4 * b * k + 8 * b + 4
    casts = 0
    if p == 2:  # autocast's 16-bit copy of each convolution's and the classifier's weight
        casts = 2 * sum(_numel(s) for s in resnet_param_shapes(shape) if len(s) > 1)
    return p * elements + 4 * statistics + loss + casts


def resnet_memory(
    shape: ResNetShape,
    *,
    precision: str = "fp32",
    optimizer: str = "sgd_momentum",
    zero_stage: int = 0,
    dp: int = 1,
) -> dict[str, float]:
    """Bytes per rank of ``params``, ``grads``, ``optimizer_state``, ``activations`` and
    their ``total`` for training the ResNet ``shape``: model states as for the GPT
    (:func:`gpt_memory`), activations by :func:`resnet_activation_bytes`."""
    check_choice("precision", precision, PRECISIONS)
    out = _model_states(resnet_param_shapes(shape), precision, optimizer, zero_stage, dp)
    out["activations"] = resnet_activation_bytes(shape, precision)
    out["total"] = sum(out.values())
    return out
