"""The book's models, sized by the scale profile: an MLP, a CIFAR-style ResNet and a GPT.

Each is a plain ``nn.Module`` in a few dozen lines, in the spirit of nanoGPT's
``model.py``: no framework, configuration as arguments, ``num_parameters()`` on each.
``for_profile`` builds the one a lab needs at the profile's size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._util import check_bool, check_int, check_positive, check_real
from .moe import MoE

__all__ = [
    "GPT",
    "GhostBatchNorm2d",
    "MLP",
    "MoE",
    "ResNet",
    "count_parameters",
    "ghost_batch_norm",
    "gpt_for",
    "resnet_for",
]


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of scalar parameters (each shared tensor counted once)."""
    check_bool("trainable_only", trainable_only)
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


class _Counted(nn.Module):
    def num_parameters(self) -> int:
        return count_parameters(self)


class MLP(_Counted):
    """A multilayer perceptron: ``depth`` hidden layers of width ``hidden`` with ReLU."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 256, depth: int = 2):
        super().__init__()
        check_int("in_features", in_features, 1)
        check_int("num_classes", num_classes, 1)
        check_int("hidden", hidden, 1)
        check_int("depth", depth, 0)
        widths = [in_features] + [hidden] * depth
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class GhostBatchNorm2d(nn.BatchNorm2d):
    """Ghost batch normalization (Hoffer, Hubara & Soudry, 2017, Section 4.1, Algorithm 1).

    In training, the batch is split into *ghost batches* of ``ghost_batch_size`` examples
    (``x.split(ghost_batch_size)``: when the batch size is not a multiple, the last ghost
    batch is the smaller remainder) and each is normalized with its own mean and variance,
    so a large batch sees the normalization noise of small ones, which Hoffer et al. found
    closes part of the generalization gap of large-batch training. The running statistics
    are updated once per ghost batch, with BatchNorm's momentum, as in Hoffer et al.'s
    implementation: a batch of k ghost batches makes k updates (and adds k to
    ``num_batches_tracked``). In evaluation this is exactly ``nn.BatchNorm2d``.

    ``ghost_batch_size >= batch size`` is plain BatchNorm2d. ``ghost_batch_size=1``
    normalizes each image over its own pixels (instance normalization), and fails, as
    BatchNorm2d does, on 1x1 feature maps. ``bn_kwargs`` are BatchNorm2d's (``eps``,
    ``momentum``, ``affine``, ``track_running_stats``, ``device``, ``dtype``).
    """

    def __init__(self, num_features: int, ghost_batch_size: int, **bn_kwargs):
        super().__init__(num_features, **bn_kwargs)
        self.ghost_batch_size = check_int("ghost_batch_size", ghost_batch_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_norm = super().forward
        if not self.training or x.shape[0] <= self.ghost_batch_size:
            return batch_norm(x)
        return torch.cat([batch_norm(chunk) for chunk in x.split(self.ghost_batch_size)])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ghost_batch_size={self.ghost_batch_size}"


def ghost_batch_norm(model: nn.Module, ghost_batch_size: int) -> nn.Module:
    """Replace every ``nn.BatchNorm2d`` of ``model`` by a :class:`GhostBatchNorm2d` with the
    same settings, parameters and running statistics, in place; returns ``model``.

    A GhostBatchNorm2d already there gets the new ``ghost_batch_size``. When ``model`` is
    itself a BatchNorm2d, the replacement is returned (a module cannot replace itself).
    """
    check_int("ghost_batch_size", ghost_batch_size, 1)
    if isinstance(model, nn.BatchNorm2d):
        return _ghost_of(model, ghost_batch_size)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.BatchNorm2d):
                setattr(parent, name, _ghost_of(child, ghost_batch_size))
    return model


def _ghost_of(bn: nn.BatchNorm2d, ghost_batch_size: int) -> GhostBatchNorm2d:
    if isinstance(bn, GhostBatchNorm2d):
        bn.ghost_batch_size = ghost_batch_size
        return bn
    ref = bn.running_mean if bn.running_mean is not None else bn.weight
    ghost = GhostBatchNorm2d(
        bn.num_features,
        ghost_batch_size,
        eps=bn.eps,
        momentum=bn.momentum,
        affine=bn.affine,
        track_running_stats=bn.track_running_stats,
        device=None if ref is None else ref.device,
        dtype=None if ref is None else ref.dtype,
    )
    ghost.load_state_dict(bn.state_dict())
    ghost.train(bn.training)
    return ghost


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with a residual connection (He et al., 2016, Fig. 2).

    When the shape changes, the shortcut is a 1×1 strided convolution (option B of the
    paper), which works for any width; option A's zero padding only for doubling.
    """

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(_Counted):
    """The CIFAR ResNet of He et al. (2016), Section 4.2: depth 6n + 2, widths w, 2w, 4w.

    Three stages of ``n`` basic blocks on feature maps of size s, s/2, s/4, then global
    average pooling, so any input of at least 8×8 pixels works (8×8 digits, 28×28 MNIST,
    32×32 CIFAR-10). ``depth=20, width=16`` is the paper's ResNet-20 (0.27M parameters).
    """

    def __init__(
        self, depth: int = 20, width: int = 16, num_classes: int = 10, in_channels: int = 3
    ):
        super().__init__()
        if check_int("depth", depth) < 8 or (depth - 2) % 6:
            raise ValueError(
                f"Invalid depth: {depth!r} (expected 6n + 2 with n >= 1: 8, 14, 20, ...)"
            )
        check_int("width", width, 1)
        check_int("num_classes", num_classes, 2)
        check_int("in_channels", in_channels, 1)
        n = (depth - 2) // 6
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks, c_in = [], width
        for stage, c_out in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                blocks.append(BasicBlock(c_in, c_out, stride=2 if stage > 0 and i == 0 else 1))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or min(x.shape[-2:]) < 8:
            raise ValueError(
                f"ResNet expects (N, C, H, W) input with H, W >= 8; got {tuple(x.shape)}"
            )
        h = self.blocks(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class TransformerBlock(nn.Module):
    """Pre-norm block (GPT-2, Radford et al. 2019): x + attn(LN(x)), then x + MLP(LN(x)).

    With ``moe_experts > 0`` the MLP is a :class:`~lsdl_lab.moe.MoE` of that many experts,
    each the same MLP, ``moe_top_k`` of them per token (``moe_capacity_factor``)."""

    def __init__(
        self,
        dim: int,
        heads: int,
        dropout: float,
        moe_experts: int = 0,
        moe_top_k: int = 2,
        moe_capacity_factor: float = 1.25,
    ):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        if check_int("moe_experts", moe_experts, 0):
            self.mlp = MoE(dim, 4 * dim, moe_experts, moe_top_k, moe_capacity_factor)
        else:
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(_Counted):
    """A GPT-style causal Transformer language model (Radford et al., 2019), nanoGPT-sized.

    Token and learned position embeddings, ``layers`` pre-norm blocks, a final LayerNorm
    and an output layer tied to the token embedding. ``forward(idx)`` returns logits of
    shape (B, T, vocab_size).

    ``moe_experts > 0`` makes every block's MLP a mixture of experts
    (:class:`~lsdl_lab.moe.MoE`, ``moe_top_k`` experts per token, ``moe_capacity_factor``);
    after a forward, :attr:`aux_loss` sums their load-balancing losses (add ``alpha *
    aux_loss`` to the training loss; Switch's alpha is 0.01).
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        layers: int = 2,
        heads: int = 4,
        dim: int = 128,
        dropout: float = 0.0,
        moe_experts: int = 0,
        moe_top_k: int = 2,
        moe_capacity_factor: float = 1.25,
    ):
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("block_size", block_size),
            ("layers", layers),
            ("heads", heads),
            ("dim", dim),
        ):
            check_int(name, value, 1)
        if dim % heads:
            raise ValueError(f"Invalid heads: {heads} (expected a divisor of dim = {dim})")
        check_real("dropout", dropout, 0.0, 1.0, high_open=True)
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *[
                TransformerBlock(dim, heads, dropout, moe_experts, moe_top_k, moe_capacity_factor)
                for _ in range(layers)
            ]
        )
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying (Press & Wolf, 2017), as in GPT-2
        self.apply(self._init)
        # GPT-2's scaled init of the residual projections: 0.02 / sqrt(2 * layers).
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "mlp.2.weight")) or (
                ".experts." in name and name.endswith(".2.weight")  # each expert's output
            ):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    @property
    def aux_loss(self) -> torch.Tensor:
        """The sum of the MoE layers' load-balancing losses of the last forward (0 for a
        dense GPT)."""
        losses = [m.aux_loss for m in self.blocks.modules() if hasattr(m, "aux_loss")]
        if any(loss is None for loss in losses):
            raise RuntimeError("aux_loss: no forward yet (the MoE layers have no loss to sum)")
        return sum(losses, torch.zeros((), device=self.tok.weight.device))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[-1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        return self.head(self.ln(self.blocks(x)))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``new_tokens`` continuations of ``idx`` (B, T), one token at a time.

        A ``generator`` draws on its own device (a CPU one, as ``lsdl_lab``'s seeded
        generators, also for a model on the GPU); the tokens come back on ``idx``'s."""
        check_int("new_tokens", new_tokens, 0)
        check_positive("temperature", temperature)
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1] / temperature
            probs = logits.softmax(-1)
            if generator is not None:
                probs = probs.to(generator.device)
            nxt = torch.multinomial(probs, 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def resnet_for(profile, num_classes: int, in_channels: int) -> ResNet:
    """The ResNet at the profile's depth and width."""
    return ResNet(profile.resnet_depth, profile.resnet_width, num_classes, in_channels)


def gpt_for(profile, vocab_size: int, dropout: float = 0.0) -> GPT:
    """The GPT at the profile's size."""
    return GPT(
        vocab_size,
        profile.block_size,
        profile.gpt_layers,
        profile.gpt_heads,
        profile.gpt_dim,
        dropout,
    )
