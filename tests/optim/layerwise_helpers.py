"""Explicit parameters and gradients for the LARS, LAMB and layer-wise tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lsdl_lab.models import ResNet
from lsdl_lab.optim import param_groups_for_layerwise

SHAPES = [(6, 5), (5,), (3, 2, 2), (4, 4)]


def tensors(seed: int, scale=1.0, shapes=SHAPES, device="cpu"):
    """Random float64 tensors, drawn on the CPU (the same numbers on every device)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * scale).to(device) for s in shapes]


def params_like(seed=0, shapes=SHAPES, device="cpu"):
    return [w.requires_grad_() for w in tensors(seed, shapes=shapes, device=device)]


def run_grads(opt, params, grads_per_step):
    """Apply the given gradients (copied to the parameters' device), one list per step;
    return each step's update."""
    updates = []
    for grads in grads_per_step:
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g.to(p.device, copy=True)
        opt.step()
        updates.append([p.detach() - b for p, b in zip(params, before)])
    return updates


def resnet_losses(make_optimizer, weight_decay: float, steps: int = 15, device="cpu"):
    """The training losses of a small ResNet (conv kernels, BatchNorm scales and shifts, a
    linear layer) on one fixed batch on ``device``, with ``make_optimizer(layer-wise
    groups)``."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)
    x, y = x.to(device), y.to(device)
    torch.manual_seed(0)
    model = ResNet(8, 4, 10, 1).to(device)
    opt = make_optimizer(param_groups_for_layerwise(model, weight_decay))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
