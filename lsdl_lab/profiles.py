"""Scale profiles: one notebook, three sizes of experiment.

Every lab reads one :class:`Profile`, so the same notebook is a seconds-long test
(``smoke``), a minutes-long run on a laptop or the book build (``cpu``) and the real
experiment on a GPU (``gpu``). The profile is chosen automatically (CUDA present means
``gpu``, otherwise ``cpu``) and the environment variable ``LSDL_SCALE`` overrides it.

A lab asks the profile for sizes by name (``P.resnet_width``) or picks its own value per
profile with :meth:`Profile.pick`::

    P, device = setup()                    # prints "lsdl_lab: profile 'cpu' on cpu ..."
    epochs = P.pick(smoke=1, cpu=8, gpu=30)

A *dry run* proves a profile on a machine that could not afford it: the project's test
(``tests/test_gpu_profile.py``) runs every lab at ``gpu`` on a CPU with two caps set in
the environment. ``LSDL_MAX_STEPS`` caps the number of iterations of every loop;
``LSDL_MAX_EXAMPLES`` caps the examples of every batch and measured subset. The models,
the sizes of an example (32x32 colour images, contexts of 256 characters) and the code
paths stay those of the profile; only how long each loop runs and how many examples each
batch holds shrink. Neither variable is set at any real profile, where both functions
return their argument.

The library applies the caps in two places: the step counter of
:func:`lsdl_lab.train.fit`, the one training loop (the book's races and workers train
through it, and read from its history how many steps ran), and the batches of
:mod:`lsdl_lab.data` (each batch and evaluation set at most ``LSDL_MAX_EXAMPLES``
examples). What is not training takes its length from an argument (a probe's ``steps``,
a measurement's ``samples``, a timing's repeats), and the code that picks that length, a
lab, a chapter or the book's wing, caps it with :func:`capped_steps` and
:func:`capped_examples` (the book's wing in one place per kind where it can: its timings'
rounds in :func:`lsdl_lab.book.communication_experiments.timed_rounds`).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np
import torch

from ._util import check_choice, check_int

__all__ = [
    "PROFILES",
    "Profile",
    "capped_examples",
    "capped_steps",
    "current",
    "device_for",
    "dry_run",
    "seed_everything",
    "setup",
    "world_profile",
]

T = TypeVar("T")
ENV_VAR = "LSDL_SCALE"
MAX_STEPS_VAR = "LSDL_MAX_STEPS"
MAX_EXAMPLES_VAR = "LSDL_MAX_EXAMPLES"
_AS_CPU: Any = object()  # Profile.pick's gpu left out


@dataclass(frozen=True)
class Profile:
    """The sizes one scale of experiment uses. Frozen: a lab cannot drift from it."""

    name: str
    image_dataset: str  # name understood by lsdl_lab.data.load_images
    text_dataset: str  # name understood by lsdl_lab.data.load_text
    max_train_examples: int | None  # cap on the image training set (None: all of it)
    max_text_chars: int | None  # cap on the character corpus (None: all of it)
    batch_size: int
    epochs: int
    resnet_depth: int  # 6n + 2, as in He et al. (2016), Section 4.2
    resnet_width: int  # channels of the first stage; stages have w, 2w, 4w
    mlp_hidden: int
    gpt_layers: int
    gpt_heads: int
    gpt_dim: int
    block_size: int  # context length of the language model
    lm_steps: int
    eval_batches: int  # how many batches an evaluation reads at most

    def pick(self, *, smoke: T, cpu: T, gpu: T = _AS_CPU) -> T:
        """The value for this profile: ``P.pick(smoke=1, cpu=8, gpu=30)``. ``gpu`` may be
        left out for a size that no GPU makes affordable (the steps of a world whose
        ranks run on the CPU): it is then ``cpu``'s."""
        return {"smoke": smoke, "cpu": cpu, "gpu": cpu if gpu is _AS_CPU else gpu}[self.name]

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


PROFILES: dict[str, Profile] = {
    "smoke": Profile(
        name="smoke",
        image_dataset="digits",
        text_dataset="python_source",
        max_train_examples=512,
        max_text_chars=200_000,
        batch_size=64,
        epochs=2,
        resnet_depth=8,
        resnet_width=8,
        mlp_hidden=64,
        gpt_layers=1,
        gpt_heads=2,
        gpt_dim=32,
        block_size=32,
        lm_steps=30,
        eval_batches=4,
    ),
    "cpu": Profile(
        name="cpu",
        image_dataset="digits",
        text_dataset="python_source",
        max_train_examples=None,
        max_text_chars=2_000_000,
        batch_size=64,
        epochs=12,
        resnet_depth=14,
        resnet_width=16,
        mlp_hidden=256,
        gpt_layers=2,
        gpt_heads=4,
        gpt_dim=128,
        block_size=64,
        lm_steps=600,
        eval_batches=20,
    ),
    "gpu": Profile(
        name="gpu",
        image_dataset="cifar10",
        text_dataset="tiny_shakespeare",
        max_train_examples=None,
        max_text_chars=None,
        batch_size=128,
        epochs=30,
        resnet_depth=20,
        resnet_width=16,
        mlp_hidden=1024,
        gpt_layers=6,
        gpt_heads=6,
        gpt_dim=384,
        block_size=256,
        lm_steps=3000,
        eval_batches=50,
    ),
}


def current(name: str | None = None) -> Profile:
    """The profile named ``name``, else ``$LSDL_SCALE``, else ``gpu`` with CUDA, else ``cpu``."""
    if name is not None:
        return PROFILES[check_choice("name", name, list(PROFILES))]
    name = os.environ.get(ENV_VAR, "").strip().lower()
    if not name:
        return PROFILES["gpu" if torch.cuda.is_available() else "cpu"]
    return PROFILES[check_choice(f"{ENV_VAR} (environment variable)", name, list(PROFILES))]


def _cap(var: str) -> int | None:
    value = os.environ.get(var, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < 1:
        raise ValueError(
            f"Invalid {var} (environment variable): {value!r} (expected an integer >= 1, "
            "or unset outside a dry run)"
        )
    return number


def dry_run() -> dict[str, int] | None:
    """The caps of a dry run (``{"max_steps": ..., "max_examples": ...}``, an unset one
    absent), or None outside one. See the module's docstring."""
    caps = {"max_steps": _cap(MAX_STEPS_VAR), "max_examples": _cap(MAX_EXAMPLES_VAR)}
    caps = {k: v for k, v in caps.items() if v is not None}
    return caps or None


def capped_steps(n: T) -> T:
    """``n`` iterations of a loop, or at most ``$LSDL_MAX_STEPS`` of them in a dry run.

    The identity at every real profile. The dry run of ``tests/test_gpu_profile.py``
    executes every loop of the ``gpu`` profile briefly; the loops whose length a lab, a
    chapter or the book's wing picks call this, and only these kinds of loop:

    * the repeats of a timing (the rounds of a measurement kept for its minimum or median:
      :func:`lsdl_lab.book.communication_experiments.timed_rounds` for the book's wing);
    * the iterations of a probe or a measurement (power iterations, Lanczos steps, trace
      samples, the points of a landscape slice or of a grid);
    * the length handed to a library loop that is not training through fit (the
      parameter server's protocol, ``overlap_times``' repeats);
    * the number of steps a caller needs to know *ran*, where it cannot read fit's
      history (``ran = capped_steps(steps)`` beside a spawned world's training).

    A training loop does not call it: training goes through :func:`lsdl_lab.train.fit`,
    whose step counter caps the steps, and a caller that needs the count reads it from
    the history fit returns (``history.train[-1]["step"]``). Two labs still write a loop of
    optimizer steps by hand, to show an algorithm step by step, and cap it here: Lab 5's
    training until a target loss (with SAM's closure) and Lab 10's router trained on its
    balancing loss; no other is to be added."""
    cap = _cap(MAX_STEPS_VAR)
    n = check_int("n", n, 0)
    return n if cap is None else min(n, cap)


def capped_examples(n: T) -> T:
    """``n`` examples (of a batch, an evaluation batch, a measured subset), or at most
    ``$LSDL_MAX_EXAMPLES`` of them in a dry run. The identity at every real profile.
    ``None`` (a whole training set) stays ``None``: a data set keeps its size, so the
    batch sizes and steps per epoch computed from it are the profile's."""
    cap = _cap(MAX_EXAMPLES_VAR)
    if n is None:
        return None
    n = check_int("n", n, 0)
    return n if cap is None else min(n, cap)


def device_for(profile: Profile) -> torch.device:
    """CUDA when present (at any profile: a smoke test on a GPU machine still uses it)."""
    del profile  # every profile runs where it can; the profile sets sizes, not the device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def world_profile(profile: Profile, device: torch.device | str) -> Profile:
    """The profile whose sizes a world of processes on ``device`` can afford: ``profile``
    itself, except that a world on the CPU never takes the ``gpu`` sizes, which assume a
    GPU per rank. A world of 2 on a one-GPU machine runs on its CPU cores (two in Colab:
    :func:`lsdl_lab.distributed.placement`), so its experiments take the ``cpu`` sizes, whatever
    the profile of the rest of the lab."""
    if profile.name == "gpu" and torch.device(device).type != "cuda":
        return PROFILES["cpu"]
    return profile


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    seed = check_int("seed", seed, 0)
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 -- seeds the legacy global generator on purpose
    torch.manual_seed(seed)


def setup(seed: int = 0, profile: str | None = None, verbose: bool = True) -> tuple[Profile, Any]:
    """What every lab does first: choose the profile and device, seed, and say so."""
    P = current(profile)
    device = device_for(P)
    seed_everything(seed)
    if verbose:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(
            f"lsdl_lab: profile {P.name!r} on {device.type} ({where}); "
            f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), seed {seed}"
        )
    return P, device
