"""Steps to a target training loss on the digits (an MLP, mini-batches of 128), shared by
the tests that compare the second-order optimizers with SGD and Adam. Each baseline gets
the best of three learning rates; the loss over the whole training set is checked after
every step."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from lsdl_lab import data, optim
from lsdl_lab.models import MLP

TARGET, MAX_STEPS, BATCH = 0.1, 150, 128


@functools.cache
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    images = data.load_images("digits")
    return images.train_x.reshape(len(images.train_x), -1).float(), images.train_y


def steps_to_loss(make_opt, seed: int = 0) -> int | None:
    """The first step after which the training loss is at most TARGET (None: not within
    MAX_STEPS); ``make_opt(model)`` builds the optimizer, stepped with its ``backward``
    where it has one (K-FAC's sampled-label pass)."""
    x, y = digits()
    torch.manual_seed(seed)
    model = MLP(x.shape[1], 10, hidden=64, depth=2)
    opt = make_opt(model)
    backward = getattr(opt, "backward", lambda loss: loss.backward())
    batches = torch.Generator().manual_seed(seed)
    for t in range(1, MAX_STEPS + 1):
        i = torch.randint(len(x), (BATCH,), generator=batches)
        opt.zero_grad()
        backward(F.cross_entropy(model(x[i]), y[i]))
        opt.step()
        with torch.no_grad():
            if F.cross_entropy(model(x), y).item() <= TARGET:
                return t
    return None


@functools.cache
def best_first_order(seed: int = 0) -> dict[str, int]:
    """SGD (momentum 0.9) and Adam, each with the best of three learning rates."""
    runs = {
        "SGD": [lambda m, lr=lr: optim.SGD(m.parameters(), lr=lr, momentum=0.9)
                for lr in (0.1, 0.2, 0.4)],
        "Adam": [lambda m, lr=lr: optim.Adam(m.parameters(), lr=lr) for lr in (1e-2, 2e-2, 4e-2)],
    }  # fmt: skip
    steps = {}
    for name, makes in runs.items():
        reached = [s for s in (steps_to_loss(make, seed) for make in makes) if s is not None]
        steps[name] = min(reached, default=MAX_STEPS + 1)
    return steps
