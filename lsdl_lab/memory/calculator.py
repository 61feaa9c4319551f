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

**Beyond the survey** (each an option whose default leaves every count above as it was):

* *Sequence parallelism* (``sequence_parallel=True``, above) changes no byte on the wire:
  each of tensor parallelism's all-reduces of an activation, ``2 (t-1)/t`` of its bytes
  sent by a rank in a ring, becomes an all-gather and a reduce-scatter, ``(t-1)/t`` each
  (Korthikanti et al. 2022, Section 4.2.2; :func:`layer_traffic`).
* *Context parallelism* (``cp`` = c ranks share each sequence; ring attention, Liu et al.
  2023, or DeepSpeed-Ulysses, Jacobs et al. 2023, as :mod:`lsdl_lab.parallel.context`):
  a rank holds s/c positions of every activation, so every term above is counted at s/c
  (the logits too). Both keep no s x s scores (a log-sum-exp per query, as a fused kernel),
  so ``cp > 1`` needs ``attention="fused"``. Their bytes per layer and micro-batch are
  :func:`ring_attention_bytes` of a K shard (``(6c - 4) n`` in one dtype, under 6
  whole-sequence K tensors whatever c; ``(8c - 4) n`` for 16-bit K and V, whose gradients
  accumulate in float32) or :func:`ulysses_attention_bytes` of a Q shard
  (``8 (c-1)/c n``), in :func:`layer_traffic`.
* *Experts* (:class:`GPTShape`'s ``experts`` E and ``top_k`` k, as
  :class:`lsdl_lab.moe.MoE`: each block's MLP becomes E copies and a router, E x h without
  bias): parameters ``dense + L ((E-1) FFN + E h)`` with FFN one MLP's parameters;
  :func:`active_parameters`, those a token meets, counts k experts. Expert parallelism
  (``ep`` = e ranks, inside the data-parallel group: GShard, Lepikhin et al. 2021) leaves
  E/e experts on a rank, their states partitioned by ZeRO over the dp/e ranks that hold
  the same experts. Activations: each token's MLP activations k times (its k rows), and
  per token its k gathered inputs, the k outputs (kept for the gates' product) and the k
  weighted outputs (kept by the sum into the token's row, ``index_add``), h wide each,
  and the router's E float32 probabilities; the routing's int64 indices and float32
  gates are left out (the tests bound them), as are the rows dropped over capacity.
  All-to-all bytes per MoE layer and micro-batch (dispatch and combine, forward and
  backward): ``4 k T h p (e-1)/e`` for T tokens a rank (:func:`layer_traffic`, the
  :class:`~lsdl_lab.parallel.AllToAllBytes` a rank hands over less the 1/e it keeps).
* *8-bit Adam* (``optimizer="adam8bit"``, :class:`lsdl_lab.optim.AdamW8bit`, Dettmers et
  al. 2022): a tensor of n >= 4096 values keeps each moment in a byte a value and a
  float32 absmax a block of 2048 values, ``2n + 8 ceil(n/2048)`` bytes; a smaller one
  Adam's two float32 moments, 8n; plus the float32 master weights in mixed precision.
* *FP8 linears* (``fp8=True``, Micikevicius et al. 2022, as
  :class:`lsdl_lab.memory.FP8Linear` and Transformer Engine's ``Linear``): the blocks'
  four linear layers keep their input for the backward pass in FP8, 1 byte, not p (the
  QKV and first MLP layers' inputs, the projection's, the second MLP layer's), and an FP8
  copy of their weight, 1 byte per matrix weight element (on a rank, per layer and
  micro-batch: the library's layer casts it at each call; Transformer Engine can cache one
  copy across micro-batches). What else backward needs stays at p: LayerNorms' and the
  GeLU's inputs, Q, K, V and the attention's output (a fused kernel keeps it beside the
  projection's FP8 copy), the scores. The output layer stays in high precision (as FP8
  recipes keep it). Model states are not changed: the master weights, their gradients
  and the optimizer keep their precision (``precision``); the scales (4 bytes a tensor)
  are left out. At p = 2 and the defaults a layer keeps 7 sbh bytes fewer of inputs (2 sbh
  on every tensor-parallel rank, 5 sbh split over t) and 12 h^2/t more of weights: without
  tensor parallelism FP8 saves activation memory only where s b > 12h/7.

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

import torch

from .._util import check_bool, check_choice, check_int
from .quantize import MIN_8BIT_SIZE, quantized_bytes
from .zero import zero_bytes

__all__ = [
    "ATTENTIONS",
    "CONTEXTS",
    "GPTShape",
    "ResNetShape",
    "OPTIMIZERS",
    "PRECISIONS",
    "RECOMPUTE",
    "activation_bytes",
    "activation_parts",
    "active_parameters",
    "gpt_memory",
    "gpt_param_parts",
    "gpt_param_shapes",
    "layer_traffic",
    "optimizer_state_bytes",
    "resnet_activation_bytes",
    "resnet_memory",
    "resnet_param_shapes",
    "ring_attention_bytes",
    "ulysses_attention_bytes",
]

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd_momentum", "adafactor", "adam8bit")
RECOMPUTE = ("none", "selective", "full")
ATTENTIONS = ("materialized", "fused")
CONTEXTS = ("ring", "ulysses")


@dataclass(frozen=True)
class GPTShape:
    """A GPT and its micro-batch: ``layers`` blocks of width ``hidden`` with ``heads``
    heads, micro-batches of ``micro_batch`` sequences of ``seq_len`` tokens, ``vocab``
    tokens, ``positions`` learned positions (the block size; default ``seq_len``), the
    output layer ``tied`` to the token embedding or not; ``kv_heads`` key and value heads
    (grouped-query attention; default ``heads``), an MLP ``ffn`` wide (default 4
    ``hidden``), ``gated`` (SwiGLU) or not; ``experts`` (0: a dense MLP) copies of the MLP
    with a router sending each token to ``top_k`` of them (:class:`lsdl_lab.moe.MoE`)."""

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
    experts: int = 0
    top_k: int = 2

    def __post_init__(self):
        check_int("experts", self.experts, 0)
        check_int("top_k", self.top_k, 1, self.experts or None)
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


def gpt_param_parts(shape: GPTShape, tp: int = 1, ep: int = 1) -> dict[str, list[tuple[int, ...]]]:
    """The parameter shapes of the GPT held by one of ``tp`` tensor-parallel ranks, by
    part: ``"embedding"`` (tokens, by vocabulary; positions whole), one ``"block"``, one
    block's ``"experts"`` on one of ``ep`` expert-parallel ranks (empty for a dense GPT),
    and the ``"head"`` (the final LayerNorm and, untied, the output layer).

    A block: LayerNorm (h, h), QKV ((h + 2 kv h/a) x h and its bias), projection (h x h, h),
    MLP (ffn x h, ffn, h x ffn, h; a gated MLP's first layer is 2 ffn x h, the gate and the
    up projection), LayerNorm (h, h): 12h² + 13h at the defaults. Megatron-LM's split
    (Shoeybi et al. 2019): QKV and the first MLP layer by rows (with their biases), the
    projection and the second MLP layer by columns, the token embedding by vocabulary;
    LayerNorms, the projection's and second MLP layer's biases and the positions whole on
    every rank. With ``experts`` E, the block's MLP is a router (E x h, no bias, whole on
    every rank) and E/ep experts, each an MLP split over ``tp`` as the dense one.
    """
    if not isinstance(shape, GPTShape):
        raise TypeError(f"Invalid shape: a {type(shape).__name__} (expected a GPTShape)")
    h, t, v = shape.hidden, check_int("tp", tp, 1), shape.vocab
    e = check_int("ep", ep, 1)
    if e > 1 and not shape.experts:
        raise ValueError(f"Invalid ep: {ep} (expected 1 for a dense GPT: it has no experts)")
    if shape.experts % e:
        raise ValueError(f"Invalid ep: {ep} (expected a divisor of experts={shape.experts})")
    qkv = h + 2 * shape.kv * (h // shape.heads)
    up = (2 if shape.gated else 1) * shape.mlp
    if h % t or v % t or qkv % t or shape.mlp % t:
        raise ValueError(
            f"Invalid tp: {tp} (expected a divisor of hidden, vocab, the QKV width {qkv} and "
            f"the MLP width {shape.mlp})"
        )
    block = [(h,), (h,), (qkv // t, h), (qkv // t,), (h, h // t), (h,), (h,), (h,)]
    mlp = [(up // t, h), (up // t,), (h, shape.mlp // t), (h,)]
    experts = mlp * (shape.experts // e)
    block += [(shape.experts, h)] if shape.experts else mlp
    positions = shape.positions or shape.seq_len
    head = [(h,), (h,)] + ([] if shape.tied else [(v // t, h)])
    embedding = [(v // t, h), (positions, h)]
    return {"embedding": embedding, "block": block, "experts": experts, "head": head}


def gpt_param_shapes(shape: GPTShape, tp: int = 1, ep: int = 1) -> list[tuple[int, ...]]:
    """The parameter shapes of the GPT held by one of ``tp`` tensor-parallel ranks (and of
    ``ep`` expert-parallel ranks): the embeddings, ``layers`` blocks (with their experts)
    and the head of :func:`gpt_param_parts`, in order."""
    parts = gpt_param_parts(shape, tp, ep)
    return parts["embedding"] + (parts["block"] + parts["experts"]) * shape.layers + parts["head"]


def active_parameters(shape: GPTShape) -> int:
    """Parameters a token meets: all of a dense GPT's; of an MoE GPT, every layer's router
    and ``top_k`` of its ``experts`` (:meth:`lsdl_lab.moe.MoE.active_parameters`), so
    ``L (E - k)`` experts fewer than it holds."""
    parts = gpt_param_parts(shape)
    total = sum(_numel(s) for s in gpt_param_shapes(shape))
    if not shape.experts:
        return total
    one = sum(_numel(s) for s in parts["experts"]) // shape.experts
    return total - shape.layers * (shape.experts - shape.top_k) * one


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def optimizer_state_bytes(shapes: list[tuple[int, ...]], optimizer: str, precision: str) -> int:
    """Bytes of optimizer state for parameters of these shapes (see the module's text;
    ``"adam8bit"`` counts :class:`lsdl_lab.optim.AdamW8bit`'s state at its defaults)."""
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("precision", precision, PRECISIONS)
    psi = sum(_numel(s) for s in shapes)
    master = 0 if precision == "fp32" else 4 * psi
    if optimizer == "adam":
        return master + 8 * psi
    if optimizer == "sgd_momentum":
        return master + 4 * psi
    if optimizer == "adam8bit":
        # Dettmers et al. 2022: per moment a byte a value and a float32 absmax a block;
        # tensors under MIN_8BIT_SIZE values keep Adam's float32 moments
        return master + sum(
            2 * quantized_bytes(n) if n >= MIN_8BIT_SIZE else 8 * n for n in map(_numel, shapes)
        )
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
    cp: int = 1,
    fp8: bool = False,
) -> dict[str, float]:
    """Bytes of activations kept for the backward pass on one rank, by part: each
    ``"layer"``, the ``"embedding"`` (its dropout mask) and the ``"output"`` (the final
    LayerNorm's and the output layer's inputs, the float32 logits); see the module's text.
    A pipeline stage holds some of them (:mod:`lsdl_lab.plan`). ``cp`` context-parallel
    ranks share each sequence (a rank's positions are s/cp); ``fp8`` keeps the linear
    layers' inputs and weights for the backward pass in FP8."""
    if not isinstance(shape, GPTShape):
        raise TypeError(f"Invalid shape: a {type(shape).__name__} (expected a GPTShape)")
    a, s, b, h, v = shape.heads, shape.seq_len, shape.micro_batch, shape.hidden, shape.vocab
    check_choice("precision", precision, PRECISIONS)
    check_choice("recompute", recompute, RECOMPUTE)
    check_choice("attention", attention, ATTENTIONS)
    t = check_int("tp", tp, 1)
    sp = t if check_bool("sequence_parallel", sequence_parallel) else 1
    m = 1 if check_bool("dropout", dropout) else 0
    s //= _context_degree(shape, cp, attention)
    if check_bool("fp8", fp8) and shape.experts:
        raise ValueError(
            f"Invalid fp8: True with experts={shape.experts} (FP8 experts are not modelled)"
        )
    p = 4 if precision == "fp32" else 2
    q = 1 if fp8 else p  # bytes of a linear layer's input kept for its backward pass
    sbh = s * b * h
    # two LayerNorms' inputs, the QKV and first MLP layers' inputs, two dropout masks
    whole = sbh * (2 * p + 2 * q + 2 * m) / sp
    # queries, keys and values; the projection's input (a fused kernel keeps it too, as its
    # output, in p bytes); the MLP's: 12 sbh at the defaults
    projection = h * q + (h * p if fp8 and attention == "fused" else 0)
    k = shape.top_k if shape.experts else 1
    mlp = k * shape.mlp * ((2 if shape.gated else 1) * p + q)
    split = s * b * ((h + 2 * shape.kv * (h // a)) * p + projection + mlp) / t
    if shape.experts:  # the k gathered inputs, k outputs, k weighted outputs; the softmax
        split += s * b * (3 * k * h * p + 4 * shape.experts)
    if attention == "materialized":
        scores = a * s * s * b * (2 * p + m) / t
    else:
        scores = 4 * a * s * b / t  # the float32 log-sum-exp of each query and head
    qkv = h + 2 * shape.kv * (h // a)
    weights = (h * qkv + h * h + (3 if shape.gated else 2) * h * shape.mlp) / t if fp8 else 0
    if recompute == "none":
        per_layer = whole + split + scores + weights
    elif recompute == "selective":
        per_layer = whole + split + weights
    else:
        per_layer = p * sbh / sp
    return {
        "layer": per_layer,
        "embedding": sbh * m / sp,
        "output": 2 * p * sbh / sp + 4 * s * b * v / t,
    }


def _context_degree(shape: GPTShape, cp, attention: str) -> int:
    """``cp``, checked: a divisor of the sequence, with a fused attention kernel."""
    c = check_int("cp", cp, 1)
    if shape.seq_len % c:
        raise ValueError(f"Invalid cp: {cp} (expected a divisor of seq_len={shape.seq_len})")
    if c > 1 and attention != "fused":
        raise ValueError(
            f"Invalid cp: {cp} with attention={attention!r} (ring attention and Ulysses keep "
            "no s x s scores: expected attention='fused')"
        )
    return c


def activation_bytes(
    shape: GPTShape,
    precision: str = "bf16",
    recompute: str = "none",
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    dropout: bool = True,
    attention: str = "materialized",
    cp: int = 1,
    fp8: bool = False,
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
        cp=cp,
        fp8=fp8,
    )
    return shape.layers * parts["layer"] + parts["embedding"] + parts["output"]


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def ring_attention_bytes(numel: int, p: int, dtype=torch.float32) -> tuple[int, int]:
    """Bytes one rank sends in :func:`~lsdl_lab.parallel.context.ring_attention`,
    ``(forward, backward)``, for shards of ``numel`` entries (``batch * heads * s *
    head_dim``) of ``dtype`` on p ranks.

    Forward: p - 1 hops of k and v, ``2 (p-1) n`` with n the shard's bytes. Backward: the
    same p - 1 hops of k and v, and p hops of dk and dv (the last takes each block's
    gradient home), ``2 (p-1) n + 2 p n_acc`` with ``n_acc`` the bytes of a shard in the
    accumulators' precision (float32 at least). Nothing for p = 1."""
    if p == 1:
        return 0, 0
    n = numel * torch.empty((), dtype=dtype).element_size()
    n_acc = numel * torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    return 2 * (p - 1) * n, 2 * (p - 1) * n + 2 * p * n_acc


def ulysses_attention_bytes(numel: int, p: int, dtype=torch.float32) -> tuple[int, int]:
    """Bytes one rank sends in :func:`~lsdl_lab.parallel.context.ulysses_attention`,
    ``(forward, backward)``, for shards of ``numel`` entries of ``dtype`` on p ranks: each
    all-to-all keeps 1/p of what it is handed and sends the rest. Forward, q, k and v out
    and the output back: ``4 (p-1)/p n``; backward, the gradient of the output out and
    those of q, k, v back: the same (n: a shard's bytes)."""
    n = numel * torch.empty((), dtype=dtype).element_size()
    return 4 * (p - 1) * n // p, 4 * (p - 1) * n // p


def layer_traffic(
    shape: GPTShape,
    precision: str = "bf16",
    recompute: str = "none",
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    context: str = "ring",
    ep: int = 1,
) -> dict[str, float]:
    """Bytes one rank sends per layer and micro-batch, forward and backward, for its
    ``"tp"``, ``"cp"`` and ``"ep"`` collectives (activations of ``precision``; n below is
    one activation of this rank's T = s b / cp tokens, ``T h p`` bytes):

    * tensor parallelism (Shoeybi et al. 2019): two all-reduces of n forward, two
      backward, two more under full recomputation, each ``2 (t-1)/t n`` by a ring; with
      ``sequence_parallel`` each is an all-gather and a reduce-scatter, ``(t-1)/t n``
      each, the same bytes (Korthikanti et al. 2022, Section 4.2.2);
    * context parallelism, ``context="ring"``: :func:`ring_attention_bytes` of one K
      shard (``b kv/t s/cp h/a`` values), ``"ulysses"``: :func:`ulysses_attention_bytes`
      of one Q shard (K and V repeated to every head, as the library's Ulysses takes them;
      ``heads/t`` must divide by ``cp``); full recomputation sends the forward's bytes
      once more;
    * expert parallelism (``tp = 1``): four all-to-alls of the k T rows (dispatch and
      combine, each forward and backward), each keeping 1/e of them:
      ``4 k T h p (e-1)/e``, six under full recomputation; the int64 counts' all-to-all
      (``8 E (e-1)/e`` bytes) left out.
    """
    check_choice("precision", precision, PRECISIONS)
    check_choice("recompute", recompute, RECOMPUTE)
    check_choice("context", context, CONTEXTS)
    check_bool("sequence_parallel", sequence_parallel)
    t, e = check_int("tp", tp, 1), check_int("ep", ep, 1)
    gpt_param_parts(shape, tp, ep)  # the divisibility of heads, widths and experts
    c = _context_degree(shape, cp, "fused")
    p, dtype = (4 if precision == "fp32" else 2), _DTYPES[precision]
    tokens, h, d = shape.seq_len // c * shape.micro_batch, shape.hidden, shape.hidden // shape.heads
    n = tokens * h * p
    full = recompute == "full"
    per_pair = 2 * (t - 1) / t * n  # an all-reduce, or an all-gather and a reduce-scatter
    out = {"tp": (6 if full else 4) * per_pair, "cp": 0.0, "ep": 0.0}
    if c > 1:
        heads = shape.kv if context == "ring" else shape.heads
        if heads % t or (context == "ulysses" and heads // t % c):
            raise ValueError(
                f"Invalid cp: {cp} (expected {'kv_heads' if context == 'ring' else 'heads'}="
                f"{heads} to divide by tp={tp}"
                + (" and then by cp" if context == "ulysses" else "")
                + ")"
            )
        numel = tokens * heads // t * d
        bytes_of = ring_attention_bytes if context == "ring" else ulysses_attention_bytes
        forward, backward = bytes_of(numel, c, dtype)
        out["cp"] = float((2 if full else 1) * forward + backward)
    if e > 1:
        if t > 1:
            raise ValueError(f"Invalid ep: {ep} with tp={tp} (expected tp=1: not modelled)")
        one = shape.top_k * tokens * h * p * (e - 1) / e  # one all-to-all of the k T rows
        out["ep"] = (6 if full else 4) * one
    return out


def gpt_memory(
    shape: GPTShape,
    *,
    precision: str = "bf16",
    optimizer: str = "adam",
    zero_stage: int = 0,
    dp: int = 1,
    tp: int = 1,
    recompute: str = "none",
    ep: int = 1,
    **activation_options,
) -> dict[str, float]:
    """Bytes per rank of ``params``, ``grads``, ``optimizer_state``, ``activations`` and
    their ``total`` for training the GPT ``shape`` (the module's text gives every
    assumption).

    ``dp`` ranks partition the model states by ZeRO ``zero_stage``; ``tp`` ranks split
    the layers (Megatron-LM); ``ep`` of the ``dp`` ranks split an MoE's experts, whose
    states ZeRO partitions over the ``dp/ep`` ranks holding the same ones.
    ``activation_options`` (``sequence_parallel``, ``dropout``, ``attention``, ``cp``,
    ``fp8``) go to :func:`activation_bytes`. Buffers, temporaries, the allocator's
    fragmentation and communication buffers are not counted.
    """
    check_choice("precision", precision, PRECISIONS)
    parts = gpt_param_parts(shape, tp, ep)
    dense = parts["embedding"] + parts["block"] * shape.layers + parts["head"]
    out = _model_states(dense, precision, optimizer, zero_stage, dp)
    if parts["experts"]:
        if check_int("dp", dp, 1) % ep:
            raise ValueError(
                f"Invalid ep: {ep} (expected a divisor of dp={dp}: the expert-parallel ranks "
                "are data-parallel ranks)"
            )
        experts = parts["experts"] * shape.layers
        local = _model_states(experts, precision, optimizer, zero_stage, dp // ep)
        out = {key: out[key] + local[key] for key in out}
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
