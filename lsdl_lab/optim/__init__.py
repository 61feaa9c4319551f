"""The book's optimizers: ``torch.optim.Optimizer`` subclasses, one short update rule each.

Every optimizer takes the same arguments as its torch.optim namesake where one exists,
keeps its state in ``state_dict`` and updates all parameters of a group with multi-tensor
(``torch._foreach_*``) operations. :mod:`lsdl_lab.optim.base` holds what they share,
:mod:`lsdl_lab.optim.pieces` the update steps several of them use (momentum, Adam's moments
and denominator, weight decay), :mod:`lsdl_lab.optim.layerwise` the trust ratio and the
parameter groups of LARS and LAMB.
:class:`Muon` orthogonalizes the hidden matrices' momentum and gives the other parameters to
AdamW (:func:`muon_param_groups` splits a model so). :class:`SOAP` runs AdamW in the
eigenbasis of Shampoo's statistics; :class:`ScheduleFreeAdamW` needs no learning-rate
schedule, and its ``train()`` and ``eval()`` put the parameters where gradients are taken
and at the average that is evaluated.
:class:`SAM` is a wrapper: sharpness-aware minimization around any of them (or any
torch.optim optimizer).
``compile=True`` on any of them runs the same update through ``torch.compile``, each
parameter's operations fused into one pass over memory (:mod:`lsdl_lab.optim.compiled`).
"""

from .adadelta import Adadelta
from .adafactor import Adafactor
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .adam8bit import Adam8bit, AdamW8bit
from .adamax import Adamax
from .base import Optimizer
from .hessian_free import HessianFree
from .kfac import KFAC
from .lamb import LAMB
from .lars import LARS
from .layerwise import param_groups_for_layerwise, trust_ratio
from .muon import Muon, muon_param_groups
from .nadam import NAdam
from .newton import Newton
from .rmsprop import RMSprop
from .sam import SAM
from .schedule_free import ScheduleFreeAdamW
from .sgd import SGD
from .shampoo import Shampoo
from .sm3 import SM3
from .soap import SOAP

__all__ = [
    "SGD",
    "Adagrad",
    "RMSprop",
    "Adadelta",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "LARS",
    "LAMB",
    "SAM",
    "KFAC",
    "Shampoo",
    "Newton",
    "HessianFree",
    "Adafactor",
    "SM3",
    "Muon",
    "SOAP",
    "ScheduleFreeAdamW",
    "Adam8bit",
    "AdamW8bit",
    "Optimizer",
    "param_groups_for_layerwise",
    "muon_param_groups",
    "trust_ratio",
]
