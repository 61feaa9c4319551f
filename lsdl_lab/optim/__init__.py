"""The book's optimizers: ``torch.optim.Optimizer`` subclasses, one short update rule each.

Every optimizer takes the same arguments as its torch.optim namesake where one exists,
keeps its state in ``state_dict`` and updates all parameters of a group with multi-tensor
(``torch._foreach_*``) operations. :mod:`lsdl_lab.optim.base` holds what they share.
"""

from .adam import Adam, AdamW
from .base import Optimizer
from .sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]
