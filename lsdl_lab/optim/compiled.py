r"""The compiled path: an optimizer's own ``update``, run through ``torch.compile``.

An optimizer step is bound by memory traffic (Chapter 3's roofline): the ``_foreach``
sequence of an ``update`` passes over memory once per line, a fused kernel once per step.
``compile=True`` on any optimizer of :mod:`lsdl_lab.optim` turns the very ``update`` the
chapter prints into fused kernels: ``torch.compile(update, fullgraph=True)`` traces its
operations into one graph (Ansel et al., 2024, "PyTorch 2", ASPLOS), and TorchInductor
fuses each parameter's chain of elementwise operations into one loop that reads every
array once and writes it once. There is no second copy of the mathematics.

What makes one graph serve every step, with torch's public interfaces:

* **Per-step scalars are 0-d tensors.** A Python number in a traced function is a
  constant of the graph: a new learning rate (a schedule) or a new step count (Adam's bias
  corrections) would compile a new graph every step. On the compiled path the group's
  ``lr`` enters as a 0-d tensor and :meth:`~lsdl_lab.optim.base.Optimizer.count_steps`
  returns the counts as 0-d tensors, so every scalar computed from them (bias corrections,
  trust ratios, Adafactor's relative step) is computed inside the graph. The other
  hyperparameters (betas, eps, weight decay, ...) are constants of the graph: changing one
  compiles a new graph (dynamo's guards see the change).
* **and are computed once per step, by construction.** TorchInductor inlines a small value
  into every loop that reads it: left alone, Adam's loops would recompute ``1 - beta1**t``
  and ``sqrt(1 - beta2**t)`` for every eight elements of every tensor (the C++ compiler may
  not hoist ``pow`` out of a loop: it can set ``errno``), LARS's loops each layer's trust
  ratio from its norms, a division per element. So where an update hands such a value to
  the loops, it passes it through :func:`computed_once`, an identity view (``as_strided``)
  that TorchInductor must store before the loops read it: the shared pieces do so
  (:func:`~lsdl_lab.optim.pieces.addcdiv_`'s step sizes, Adam's denominator's correction,
  the decoupled decay factor, :func:`~lsdl_lab.optim.pieces.host_scalars`), and so do the
  updates that compute their own (Adagrad, NAdam, LAMB, Adafactor). Eagerly it returns its
  argument. On Adam at 10M parameters on the CPU, without it (both functions made
  identities) the compiled step took 2.7 times torch's fused kernel's time, with it about
  the fused kernel's (``benchmarks/README.md`` gives the figures and their run).
* **The first step of a group runs eagerly.** It creates the state; every later step finds
  the state it reads, so the graph is the same from step to step. The state stays what the
  eager path keeps (step counts as Python ints): ``state_dict`` is the same on both paths,
  and a run may resume on either.
* **Each optimizer has its own graphs**: ``torch.compile(..., isolate_recompiles=True,
  recompile_limit=64)`` where torch takes them (2.13 and later), so that many optimizers of
  one class in a process (a lab's race, a test file) do not share dynamo's limit of 8
  graphs per function. An older torch has neither argument: there every graph of one
  ``update`` counts against one limit per process, and a ninth would fail to compile (the
  floor torch's run of ``tests/optim/test_compiled.py`` did, at its ninth Adam). So on such
  a torch the limit is raised to :data:`RECOMPILE_LIMIT` while an optimizer's step goes
  through dynamo, and restored after it (``torch._dynamo.config.recompile_limit``, the
  setting torch's troubleshooting guide names; a torch without it fails that test).
* **TorchInductor's options go through torch.compile's own** ``options``: its wrapper's
  size and alignment checks of every input (one Python call per tensor) are off, since
  dynamo's guards, or a direct call's checks, have checked the same before the call.
* **Compilation is counted and timed** (:attr:`CompiledUpdate.compiles`, from dynamo's
  ``guard_filter_fn``, called once per graph; :attr:`CompiledUpdate.compile_seconds`), so
  that benchmarks keep it out of step times. TorchInductor's FX-graph cache keeps the
  compiled kernels on disk: another process that compiles the same update reuses them.

**One private piece remains: warm steps of the library's own updates call the compiled
kernels directly** (:class:`DirectCall`). Every call of a ``torch.compile``\ d function
first evaluates dynamo's guards (is every input still of the type, shape and value the
graph was traced for?) and gathers the graph's inputs, here every state tensor found in
``optimizer.state`` by walking its keys: a fixed cost per step, which weighs most where the
step is short. ``benchmarks/compiled.py`` times both paths, the direct call (*compiled*)
and the same optimizer through torch's public interfaces alone (*compiled, dynamo's
guards*: a class defined outside this package). In the run committed in
``benchmarks/results/compiled.md`` (CPU), through dynamo's guards the four rows of the
fused goal took 1.08 to 1.30 times torch's fused kernels' time on the 1M-parameter ResNet
(65 tensors) and 1.00 to 1.12 on the 10M GPT (148 tensors); with direct calls 0.92 to 1.12
and 0.95 to 1.06 (goal: at most 1.1). So for an optimizer of this package (whose ``update``
reads only its group, parameters, gradients, state and step counts), the graph compiled for
a group is kept with where each of its inputs comes from, and later steps gather the inputs
from the group's lists and call the kernels themselves, after checks that stand for
dynamo's guards: the same hyperparameters, as many state entries, every input tensor of the
dtype, device, shape and strides it was compiled for, the same global state, no
torch-function mode. The piece uses two private interfaces of torch:
``torch._dynamo.lookup_backend("inductor")`` with ``config_patches`` (the composition of
TorchInductor in a custom backend that torch's documentation on custom backends shows: a
backend receives the graph and its inputs, which is how a direct call learns them) and
``torch._C._dynamo.guards.TensorGuards`` (dynamo's own C++ check of the inputs' metadata:
for the 445 inputs of SGD with momentum's graph on the 10M GPT, 33 µs a check, against 195
µs for the same comparisons in Python, measured when it was written). On CUDA the gain is
not measured yet (no GPU run so far; ``make test-gpu`` runs the benchmark's 50M rows
there). A step that fails a check goes through dynamo; so does a graph whose compilation
changed the state's entries (a side effect a direct call would not replay), and every step
of a subclass defined outside this package: the direct call is an optimization, never a
second semantics. Its test (``tests/optim/test_compiled.py``) requires every optimizer of
the package to take it from its third step on, so a torch that breaks either interface
fails the test rather than falling back unseen. (On a torch before 2.13, the recompile
limit above is one more private setting, and its test is the same file's, on the floor
torch.)

Where compiling is impossible (no C++ compiler for TorchInductor's CPU kernels, a
platform torch.compile does not support, an operation the tracer rejects, an optimizer
whose step is not a per-group ``update``), the optimizer warns once, with the reason
(:class:`CompileWarning`), and runs its eager update: the same results, never a crash.
Telling such a failure from an error of the update itself (:func:`is_compile_error`) takes
one more private name, ``torch._dynamo.exc.TorchDynamoException``: torch's public
interface (``torch.compiler``, as of 2.13) exports no exception class, and dynamo raises
every failure of torch.compile as a subclass of this one, its own (tracing) and its
backend's (TorchInductor's ``InductorError``, which carries a C++ compiler's error), on
every torch the package supports.
"""

from __future__ import annotations

import inspect
import operator
import time
import warnings
from array import array

import torch
from torch import Tensor

__all__ = ["CompileWarning", "CompiledUpdate", "DirectCall", "computed_once", "map_once"]

# The most graphs one optimizer compiles (one per parameter group, and one more each time a
# group's constants change), where torch.compile takes a limit per function (2.13 and later);
# before, the most graphs of one update in a process
RECOMPILE_LIMIT = 64

# TorchInductor's options for these graphs. Its wrapper checks the size and stride of every
# input before the kernels run (one Python call per tensor: 445 for SGD with momentum on a
# model of 148 tensors); dynamo's guards, or a direct call's checks, have checked the same
# sizes and strides before the call, so the second check only costs time.
INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False}

# The package whose optimizers' warm steps may call their kernels directly (DirectCall)
LIBRARY = __name__.rpartition(".")[0]


class CompileWarning(UserWarning):
    """``compile=True`` could not compile: the optimizer runs its eager update instead."""


def computed_once(values):
    """``values`` (a tensor, a list of tensors or a number), computed once per step on the
    compiled path: TorchInductor stores each tensor in memory before the loops over the
    parameters' elements, which read it from there, instead of recomputing it in every loop
    that reads it. Eagerly, and for Python numbers, ``values`` itself.

    TorchInductor inlines a small value into each loop that reads it unless the value is
    *realized* (stored in a buffer of its own); a strided view of a value refers to its
    storage, so ``as_strided`` realizes it. An update calls this where it hands the loops a
    value computed from the learning rate, the step counts or a reduction."""
    if not torch.compiler.is_compiling():
        return values
    if isinstance(values, Tensor):
        return values.as_strided(values.shape, values.stride())
    if isinstance(values, (list, tuple)):  # the same value, repeated, stored once
        return map_once(lambda x: x, values)
    return values  # a Python number: a constant of the graph


def map_once(f, xs: list) -> list:
    """``[f(x) for x in xs]``: on the compiled path computed once per distinct ``x`` and
    stored (:func:`computed_once`). The parameters of a group share one count tensor when
    their counts are equal (the usual case), so a bias correction mapped over the counts is
    one value for the group, not one per tensor (each stored value costs the compiled step
    a buffer: measured 0.24 ms a step on Adam's 148 tensors). Eagerly the comprehension
    itself."""
    if not torch.compiler.is_compiling():
        return [f(x) for x in xs]
    out: list = []
    previous = None
    for x in xs:
        out.append(out[-1] if out and x is previous else computed_once(f(x)))
        previous = x
    return out


def isolated() -> dict:
    """torch.compile's arguments that give each optimizer its own graphs and its own limit
    of them, where this torch takes them (2.13 and later); none before."""
    names = inspect.signature(torch.compile).parameters
    if "isolate_recompiles" in names and "recompile_limit" in names:
        return dict(recompile_limit=RECOMPILE_LIMIT, isolate_recompiles=True)
    return {}


class CompiledUpdate:
    """An optimizer's ``update`` through ``torch.compile(fullgraph=True)``, called by the
    base class's ``step`` in place of ``update`` when the optimizer has ``compile=True``.

    ``compiles`` counts the graphs compiled for it and ``compile_seconds`` the time of the
    steps that compiled one (tracing, code generation and the C++ compiler, or the cache);
    ``failure`` is the reason compiling failed (then every step runs eagerly), or None;
    ``direct_steps`` counts the steps that called the compiled kernels directly
    (:class:`DirectCall`), and ``no_direct`` says why the graph compiled last is not called
    so (empty when it is).
    """

    #: TorchInductor: fused C++ (CPU) or Triton (GPU) kernels
    backend_name = "inductor"

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.compiles = 0
        self.compile_seconds = 0.0
        self.failure: str | None = None
        self.warm: set[int] = set()  # ids of the parameters whose state exists
        self.per_step: tuple[Tensor, ...] = ()  # this step's lr and counts, while it runs
        self.direct: dict[int, list[DirectCall]] = {}  # by id of the parameter group
        self.direct_steps = 0
        self.call: tuple = ()  # this step's (group, params, grads, states), while it runs
        self.recorded: list[tuple] = []  # (kernels, where their inputs come from, or why not)
        self.fn = optimizer.update
        self.shared_limit = not isolated()  # before torch 2.13: one limit per process
        # this package's updates read only their arguments, state and counts (DirectCall)
        self.direct_calls = type(optimizer).__module__.startswith(LIBRARY + ".")
        self.no_direct = (
            "" if self.direct_calls else f"{type(optimizer).__name__} is not {LIBRARY}'s"
        )
        if optimizer.not_compilable:
            self.fail(optimizer.not_compilable)
            return
        options: dict = {"guard_filter_fn": self.new_graph}
        if self.direct_calls:
            backend = self.compile_graph
        else:  # torch's public path alone
            backend = self.backend_name
            options.update(INDUCTOR_OPTIONS if backend == "inductor" else {})
        try:  # torch.compile refuses some platforms (Python versions) outright
            self.fn = torch.compile(
                optimizer.update,
                fullgraph=True,
                # never dynamic: a second graph of the same code (other shapes or
                # hyperparameters) is specialized like the first, not made generic
                dynamic=False,
                backend=backend,
                options=options,
                **isolated(),
            )
        except Exception as error:  # noqa: BLE001 - any refusal falls back, with its reason
            self.fail(f"torch.compile is not available here ({describe(error)})")

    def compile_graph(self, graph, example_inputs):
        """The backend of this package's optimizers: TorchInductor's kernels for the graph
        dynamo traced, kept with where each of its inputs comes from (for
        :class:`DirectCall`). Private: ``lookup_backend`` and its ``config_patches``."""
        patches = {"config_patches": INDUCTOR_OPTIONS} if self.backend_name == "inductor" else {}
        kernels = torch._dynamo.lookup_backend(self.backend_name)(graph, example_inputs, **patches)
        self.recorded.append((kernels, sources(example_inputs, self.per_step, *self.call)))
        return kernels

    def new_graph(self, guards) -> list[bool]:
        """dynamo's guards of a graph it just compiled (torch.compile's public
        ``guard_filter_fn``, called once per graph): the graph counted, every guard kept."""
        self.compiles += 1
        return [True] * len(guards)

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
        if self.failure is not None or not self.warm.issuperset(map(id, params)):
            opt.update(group, params, grads)  # creates the state the graph will read
            self.warm.update(map(id, params))
            return
        device = params[0].device
        # each state dict looked up once: a lookup hashes its tensor in Python
        states = [opt.state[p] for p in params]
        counts = "step" in states[0]
        lr = torch.tensor(float(group["lr"]), dtype=torch.float64, device=device)
        if counts:  # the new counts, stored in the state only once the step has run
            steps = array("d", [state["step"] + 1 for state in states])
            opt.step_counts, count_input = step_counts(steps, device)
        self.per_step = (lr, count_input) if counts else (lr,)
        try:
            direct = self.direct.get(id(group), ())
            if any(call(group, params, grads, states, self.per_step) for call in direct):
                self.direct_steps += 1
            else:
                self.compiled_step(group, params, grads, states)
        finally:
            opt.step_counts = None
            self.per_step = ()
        if counts:
            for state, k in zip(states, steps):
                state["step"] = int(k)

    def compiled_step(self, group: dict, params: list, grads: list, states: list) -> None:
        """The step through dynamo (its guards, and a compilation where they fail); a graph
        compiled here is kept for direct calls (:class:`DirectCall`) when it can be."""
        opt = self.optimizer
        before, start = self.compiles, time.perf_counter()
        self.call, self.recorded = (group, params, grads, states), []
        entries = state_entries(states) if self.direct_calls else None
        if self.shared_limit:  # set and restored directly: config.patch costs 40 us a step
            config = torch._dynamo.config
            limit = config.recompile_limit
            config.recompile_limit = max(RECOMPILE_LIMIT, limit)
        try:
            self.fn({**group, "lr": self.per_step[0]}, params, grads)
        except Exception as error:
            if not is_compile_error(error):  # an error of the update itself: the user's
                raise
            self.fail(f"torch.compile could not compile its update ({describe(error)})")
            opt.update(group, params, grads)
            return
        finally:
            self.call = ()
            if self.shared_limit:
                config.recompile_limit = limit
        if self.compiles > before:
            self.compile_seconds += time.perf_counter() - start
            if len(self.recorded) == 1:
                ((kernels, where),) = self.recorded
                if entries is not None and state_entries(states) != entries:
                    where = "its compilation changed the state's entries (a side effect)"
                self.record(kernels, where, group, params, grads, states)
        self.recorded = []

    def record(self, kernels, where, group, params, grads, states) -> None:
        """Keep the graph just compiled for direct calls, or the reason it cannot be."""
        if isinstance(where, str):
            self.no_direct = where
            return
        try:
            call = DirectCall(kernels, where, group, states, self.per_step, params, grads)
        except Exception as error:  # noqa: BLE001 - another torch: dynamo's path; tested
            self.no_direct = describe(error)
            return
        self.no_direct = ""
        self.direct.setdefault(id(group), []).append(call)


class DirectCall:
    """A compiled graph of one parameter group, called without dynamo: the inputs gathered
    from the group's lists, after checks that stand for dynamo's guards (the module
    docstring says why, and what it measured).

    ``where`` says where each input of the graph comes from: ``("per_step", i)`` (the lr,
    the counts), ``("params", i)``, ``("grads", i)`` or ``("state", i, name)``. The checks:
    the group's hyperparameters (all but lr) equal those the graph was traced with; each
    parameter's state has as many entries; grad mode, the default dtype, autocast and
    deterministic algorithms are as they were; no torch-function mode is active (a default
    device set by ``torch.set_default_device`` is one); the inputs are distinct tensors, each
    of the dtype, device, shape and strides the graph was compiled for (dynamo's own C++
    check, ``TensorGuards``). A call that fails one returns False, and the step goes
    through dynamo.
    """

    def __init__(self, kernels, where, group, states, per_step, params, grads):
        from torch._C._dynamo.guards import TensorGuards

        self.kernels = kernels
        self.hyper = hyperparameters(group)
        self.lens = list(map(len, states))
        self.global_state = global_state(params[0].device)
        by_name: dict[str, list[int]] = {}
        for place in where:
            if place[0] == "state":
                by_name.setdefault(place[2], [])
                if place[1] not in by_name[place[2]]:
                    by_name[place[2]].append(place[1])
        self.by_name = by_name
        start = {"per_step": 0, "params": len(per_step), "grads": len(per_step) + len(params)}
        offset, slot = len(per_step) + 2 * len(params), {}
        for name, indices in by_name.items():
            slot.update({(name, i): offset + j for j, i in enumerate(indices)})
            offset += len(indices)
        order = [
            slot[place[2], place[1]] if place[0] == "state" else start[place[0]] + place[1]
            for place in where
        ]
        # itemgetter of one index returns the item, not a tuple
        self.pick = (
            operator.itemgetter(*order) if len(order) > 1 else lambda pool: (pool[order[0]],)
        )
        inputs = self.gather(per_step, params, grads, states)
        self.tensors = TensorGuards(
            *inputs,
            dynamic_dims_sizes=[list(x.shape) for x in inputs],
            dynamic_dims_strides=[list(x.stride()) for x in inputs],
        )

    def gather(self, per_step, params, grads, states) -> tuple:
        pool = [*per_step, *params, *grads]
        for name, indices in self.by_name.items():
            pool += [states[i][name] for i in indices]
        return self.pick(pool)

    def __call__(self, group, params, grads, states, per_step) -> bool:
        """Run the step and return True, or return False when a check fails."""
        try:
            if (
                hyperparameters(group) != self.hyper
                or list(map(len, states)) != self.lens
                or global_state(params[0].device) != self.global_state
                or torch.overrides.has_torch_function_unary(params[0])
            ):
                return False
            inputs = self.gather(per_step, params, grads, states)
            if len(set(map(id, inputs))) < len(inputs) or not self.tensors.check(*inputs):
                return False
        # a state entry gone, another number of tensors, a tensor set as a hyperparameter
        # (compared elementwise): dynamo's path decides
        except (KeyError, IndexError, TypeError, RuntimeError):
            return False
        self.kernels(*inputs)
        return True


def hyperparameters(group: dict) -> dict:
    """The group's entries a graph holds as constants: all but its parameters and lr."""
    return {k: v for k, v in group.items() if k != "params" and k != "lr"}


def global_state(device: torch.device) -> tuple:
    """The process-wide settings that dynamo guards and that could change what a graph
    computes: grad mode, the default dtype, autocast on ``device``'s type, deterministic
    algorithms."""
    return (
        torch.is_grad_enabled(),
        torch.get_default_dtype(),
        torch.is_autocast_enabled(device.type),
        torch.are_deterministic_algorithms_enabled(),
    )


def state_entries(states: list[dict]) -> list[list[tuple]]:
    """Each state's entries, as (name, identity of the value): what an update that changes
    the state (a side effect, which dynamo replays after its graph) changes."""
    return [[(k, id(v)) for k, v in state.items()] for state in states]


def sources(example_inputs, per_step, group, params, grads, states) -> list[tuple] | str:
    """Where each input of a graph comes from (see :class:`DirectCall`), or why one of them
    comes from none of the places a direct call gathers from."""
    if any(isinstance(v, Tensor) for v in hyperparameters(group).values()):
        return "a hyperparameter is a tensor"
    known: dict[int, tuple] = {}
    for i, state in reversed(list(enumerate(states))):
        known.update({id(x): ("state", i, k) for k, x in state.items() if isinstance(x, Tensor)})
    for kind, tensors in (("grads", grads), ("params", params), ("per_step", per_step)):
        known.update({id(x): (kind, i) for i, x in enumerate(tensors)})
    where = [known.get(id(x)) if isinstance(x, Tensor) else None for x in example_inputs]
    if None in where:
        return "an input of the graph is not the lr, a count, a parameter, gradient or state"
    return where


def step_counts(steps: array, device) -> tuple[list[Tensor] | Tensor, Tensor]:
    """The step counts as the graph reads them (one 0-d tensor per parameter), and the
    tensor they come from. When all counts are equal (the usual case) every parameter gets
    the same 0-d tensor: the graph then has one input for them. Unequal counts (a parameter
    that missed steps) are the elements of one tensor, and compile a second graph."""
    if len(set(steps)) == 1:
        count = torch.tensor(steps[0], dtype=torch.float64, device=device)
        return [count] * len(steps), count
    # from the buffer: 2.5x quicker than torch.tensor reads a list of Python numbers
    counts = torch.frombuffer(steps, dtype=torch.float64).to(device)
    return counts, counts


def is_compile_error(error: Exception) -> bool:
    """Whether ``error`` came from compiling (tracing, lowering, the C++ compiler) rather
    than from the update itself: only those fall back to the eager update (which raises an
    error of the update again). Dynamo's base class is private; torch.compile has no
    public one (see the module's text). TorchInductor's ``InductorError`` is one of its
    subclasses (checked on the floor torch, 2.9, and on 2.13)."""
    return isinstance(error, torch._dynamo.exc.TorchDynamoException)


def describe(error: Exception) -> str:
    """The error's type and the first line of its message, for the warning."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    # a wrapped error (a backend's) says what it wraps on its second line
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else "".join(lines[:1])
    return f"{type(error).__name__}: {text[:300]}"
