r"""The compiled path: an optimizer's own ``update``, run through ``torch.compile``.

An optimizer step is bound by memory traffic (Chapter 3's roofline): the ``_foreach``
sequence of an ``update`` passes over memory once per line, a fused kernel once per step.
``compile=True`` on any optimizer of :mod:`lsdl_lab.optim` turns the very ``update`` the
chapter prints into fused kernels: ``torch.compile(update, fullgraph=True)`` traces its
operations into one graph (Ansel et al., 2024, "PyTorch 2", ASPLOS), and TorchInductor
fuses each parameter's chain of elementwise operations into one loop that reads every
array once and writes it once. There is no second copy of the mathematics.

What makes one graph serve every step:

* **Per-step scalars are 0-d tensors.** A Python number in a traced function is a
  constant of the graph: a new learning rate (a schedule) or a new step count (Adam's bias
  corrections) would compile a new graph every step. On the compiled path the group's
  ``lr`` enters as a 0-d tensor and :meth:`~lsdl_lab.optim.base.Optimizer.count_steps`
  returns the counts as a tensor, so every scalar computed from them (bias corrections,
  trust ratios, Adafactor's relative step) is computed inside the graph. The other
  hyperparameters (betas, eps, weight decay, ...) are constants of the graph: changing one
  compiles a new graph.
* **The first step of a group runs eagerly.** It creates the state; every later step finds
  the state it reads, so the graph is the same from step to step. The state stays what the
  eager path keeps (step counts as Python ints): ``state_dict`` is the same on both paths,
  and a run may resume on either.
* **Compilation is counted and timed** (:attr:`CompiledUpdate.compiles`,
  :attr:`CompiledUpdate.compile_seconds`), so that benchmarks keep it out of step times.
  TorchInductor's FX-graph cache keeps the compiled kernels on disk: another process that
  compiles the same update reuses them.

Where compiling is impossible (no C++ compiler for TorchInductor's CPU kernels, a
platform torch.compile does not support, an operation the tracer rejects, an optimizer
whose step is not a per-group ``update``), the optimizer warns once, with the reason
(:class:`CompileWarning`), and runs its eager update: the same results, never a crash.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import Tensor

__all__ = ["CompileWarning", "CompiledUpdate"]

# Each graph is cached on the code of ``update``, shared by every instance of a class: a
# process that builds many optimizers of one class (a lab's race, a test file) compiles one
# graph per instance and parameter group, more than torch's default limit of 8
RECOMPILE_LIMIT = 64


class CompileWarning(UserWarning):
    """``compile=True`` could not compile: the optimizer runs its eager update instead."""


class CompiledUpdate:
    """An optimizer's ``update`` through ``torch.compile(fullgraph=True)``, called by the
    base class's ``step`` in place of ``update`` when the optimizer has ``compile=True``.

    ``compiles`` counts the graphs compiled for it and ``compile_seconds`` the time of the
    steps that compiled one (tracing, code generation and the C++ compiler, or the cache);
    ``failure`` is the reason compiling failed (then every step runs eagerly), or None.
    """

    #: TorchInductor: fused C++ (CPU) or Triton (GPU) kernels
    backend_name = "inductor"

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.compiles = 0
        self.compile_seconds = 0.0
        self.failure: str | None = None
        self.warm: set[int] = set()  # ids of the parameters whose state exists
        self.fn = optimizer.update
        if optimizer.not_compilable:
            self.fail(optimizer.not_compilable)
            return
        try:  # torch.compile refuses some platforms (Python versions) outright
            self.fn = torch.compile(optimizer.update, fullgraph=True, backend=self.backend)
        except Exception as error:  # noqa: BLE001 - any refusal falls back, with its reason
            self.fail(f"torch.compile is not available here ({describe(error)})")

    def backend(self, graph, example_inputs):
        compiled = torch._dynamo.lookup_backend(self.backend_name)(graph, example_inputs)
        self.compiles += 1  # counted once it succeeded: dynamo may retry a failed attempt
        return compiled

    def fail(self, reason: str) -> None:
        self.failure = reason
        warnings.warn(
            f"{type(self.optimizer).__name__}(compile=True): {reason}; running the eager "
            "update instead (the same results)",
            CompileWarning,
            stacklevel=4,
        )

    def __call__(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        opt = self.optimizer
        if self.failure is not None or not all(id(p) in self.warm for p in params):
            opt.update(group, params, grads)  # creates the state the graph will read
            self.warm.update(id(p) for p in params)
            return
        device = params[0].device
        counts = "step" in opt.state.get(params[0], {})
        scalars = dict(lr=torch.tensor(float(group["lr"]), dtype=torch.float64, device=device))
        if counts:  # the new counts, stored in the state only once the step has run
            steps = [opt.state[p]["step"] + 1 for p in params]
            opt.step_counts = torch.tensor(steps, dtype=torch.float64, device=device)
        before, start = self.compiles, time.perf_counter()
        try:
            with torch._dynamo.config.patch(
                recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
            ):
                self.fn({**group, **scalars}, params, grads)
        except Exception as error:
            if not is_compile_error(error):  # an error of the update itself: the user's
                raise
            self.fail(f"torch.compile could not compile its update ({describe(error)})")
            opt.update(group, params, grads)
            return
        finally:
            opt.step_counts = None
        if self.compiles > before:
            self.compile_seconds += time.perf_counter() - start
        if counts:
            for p, k in zip(params, steps):
                opt.state[p]["step"] = k


def is_compile_error(error: Exception) -> bool:
    """Whether ``error`` came from compiling (tracing, lowering, the C++ compiler) rather
    than from the update itself: only those fall back to the eager update."""
    kinds = (torch._dynamo.exc.TorchDynamoException,)
    try:
        from torch._inductor.exc import InductorError

        kinds += (InductorError,)
    except ImportError:  # an older torch: its compiler errors are dynamo's
        pass
    return isinstance(error, kinds)


def describe(error: Exception) -> str:
    """The error's type and the first line of its message, for the warning."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"
