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
* **and they are computed once per step.** TorchInductor inlines a scalar expression into
  every loop that reads it: left alone, it would recompute ``1 - beta1**t`` for every
  element of every tensor (the C++ compiler may not hoist ``pow`` out of the loop: it can
  set ``errno``), which made Adam's compiled step 4.8x slower than torch's fused kernel;
  LARS's loops recomputed each layer's trust ratio from its norms, a division per element.
  So before compiling, :func:`compute_once` finds the small values the graph computes from
  the per-step inputs (lr and the counts, through any arithmetic on them: computed once per
  group, not once per tensor) or from reductions (norms, means, and any arithmetic on them:
  trust ratios, RMS), and passes each through :func:`computed_once`, which makes
  TorchInductor store it: it is computed once, before the loops, which read it from memory.
  No ``update`` knows of this; each keeps computing its scalars where its equations do.
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

import operator
import time
import warnings
from array import array
from collections.abc import Sequence

import torch
from torch import Tensor, fx

__all__ = ["CompileWarning", "CompiledUpdate", "compute_once", "computed_once"]

# Each graph is cached on the code of ``update``, shared by every instance of a class: a
# process that builds many optimizers of one class (a lab's race, a test file) compiles one
# graph per instance and parameter group, more than torch's default limit of 8
RECOMPILE_LIMIT = 64

# TorchInductor's options for these graphs. Its wrapper checks the size and stride of every
# input before the kernels run (one Python call per tensor: 600 for Adam on a model of 148
# tensors); dynamo's guards have checked the same sizes and strides before the call, so the
# second check only costs time. Applied per compilation, never to the user's process.
INDUCTOR_PATCHES = {"size_asserts": False, "alignment_asserts": False}


class CompileWarning(UserWarning):
    """``compile=True`` could not compile: the optimizer runs its eager update instead."""


class CompiledUpdate:
    """An optimizer's ``update`` through ``torch.compile(fullgraph=True)``, called by the
    base class's ``step`` in place of ``update`` when the optimizer has ``compile=True``.

    ``compiles`` counts the graphs compiled for it and ``compile_seconds`` the time of the
    steps that compiled one (tracing, code generation and the C++ compiler, or the cache);
    ``failure`` is the reason compiling failed (then every step runs eagerly), or None;
    ``graphs`` holds the graphs given to TorchInductor (after :func:`compute_once`).
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
        self.graphs: list[fx.GraphModule] = []
        self.fn = optimizer.update
        if optimizer.not_compilable:
            self.fail(optimizer.not_compilable)
            return
        try:  # torch.compile refuses some platforms (Python versions) outright
            self.fn = torch.compile(optimizer.update, fullgraph=True, backend=self.backend)
        except Exception as error:  # noqa: BLE001 - any refusal falls back, with its reason
            self.fail(f"torch.compile is not available here ({describe(error)})")

    def backend(self, graph, example_inputs):
        graph = compute_once(graph, example_inputs, self.per_step)
        compiled = torch._dynamo.lookup_backend(self.backend_name)(
            graph, example_inputs, config_patches=INDUCTOR_PATCHES
        )
        self.graphs.append(graph)
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
        if self.failure is not None or not self.warm.issuperset(map(id, params)):
            opt.update(group, params, grads)  # creates the state the graph will read
            self.warm.update(map(id, params))
            return
        device = params[0].device
        counts = "step" in opt.state.get(params[0], {})
        scalars = dict(lr=torch.tensor(float(group["lr"]), dtype=torch.float64, device=device))
        if counts:  # the new counts, stored in the state only once the step has run
            # each state dict looked up once: a lookup hashes its tensor in Python
            states = [opt.state[p] for p in params]
            steps = array("d", [state["step"] + 1 for state in states])
            opt.step_counts, count_input = step_counts(steps, device)
        self.per_step = (scalars["lr"], count_input) if counts else (scalars["lr"],)
        before, start = self.compiles, time.perf_counter()
        config = torch._dynamo.config
        limit = config.recompile_limit  # set and restored directly: config.patch costs 40 us
        config.recompile_limit = max(RECOMPILE_LIMIT, limit)
        try:
            self.fn({**group, **scalars}, params, grads)
        except Exception as error:
            if not is_compile_error(error):  # an error of the update itself: the user's
                raise
            self.fail(f"torch.compile could not compile its update ({describe(error)})")
            opt.update(group, params, grads)
            return
        finally:
            config.recompile_limit = limit
            opt.step_counts = None
            self.per_step = ()
        if self.compiles > before:
            self.compile_seconds += time.perf_counter() - start
        if counts:
            for state, k in zip(states, steps):
                state["step"] = int(k)


def step_counts(steps: array, device) -> tuple[list[Tensor] | Tensor, Tensor]:
    """The step counts as the graph reads them (one 0-d tensor per parameter), and the
    tensor they come from. When all counts are equal (the usual case) every parameter gets
    the same 0-d tensor: the graph then has one count and computes each bias correction
    once, not once per tensor (:func:`compute_once` merges the copies). Unequal counts (a
    parameter that missed steps) are the elements of one tensor, and compile a second
    graph."""
    if len(set(steps)) == 1:
        count = torch.tensor(steps[0], dtype=torch.float64, device=device)
        return [count] * len(steps), count
    # from the buffer: 2.5x quicker than torch.tensor reads a list of Python numbers
    counts = torch.frombuffer(steps, dtype=torch.float64).to(device)
    return counts, counts


def computed_once(values: Tensor) -> Tensor:
    """``values`` itself (a view of all of it): in a graph compiled by TorchInductor, a value
    that its loops read from memory, computed once before them, instead of recomputing it
    for every element they visit.

    TorchInductor inlines a pointwise value into each loop that reads it, unless the value is
    *realized* (stored in a buffer of its own); a strided view of a value needs its storage,
    so ``as_strided`` realizes it. Eagerly it is a view, which costs nothing."""
    return values.as_strided(values.shape, values.stride())


# In-place operations whose names do not end in an underscore
IN_PLACE = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
            operator.ipow}  # fmt: skip

# Values of at most this many elements, computed from the per-step inputs or from
# reductions, are computed once (trust ratios, RMS, norms' ratios, factored means)
SMALL = 4096


def compute_once(
    graph: fx.GraphModule, example_inputs: Sequence, per_step: Sequence[Tensor]
) -> fx.GraphModule:
    """``graph`` (traced by dynamo) with its small values computed once, before the loops that
    read them: a new graph, or ``graph`` itself when there are none.

    Two kinds of values, each of at most :data:`SMALL` elements, made by operations that
    change nothing in place:

    * those derived from the tensors ``per_step`` alone (the learning rate, the step counts:
      bias corrections, Adafactor's relative step, NAdam's momentum schedule), through any
      arithmetic on them; the same operation on the same values is kept once
      (:func:`merge_copies`: an update that computes a bias correction per tensor, from one
      count, computes it once);
    * those computed from reductions of the large arrays (norms, means) and from such values:
      LARS's and LAMB's trust ratios, Adafactor's RMS and clipping.

    Each one the rest of the graph reads passes through :func:`computed_once`, and the loops
    read it from memory. A value changed in place later is left as it is: its readers after
    the change must see the change.
    """
    inputs = graph.graph.find_nodes(op="placeholder")
    sources = {node for node, x in zip(inputs, example_inputs) if any(x is y for y in per_step)}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    g.output(g.graph_copy(graph.graph, env))
    sources = {env[node] for node in sources}
    written_nodes = {x for node in g.nodes if mutates(node) for x in written(node)}
    derived = set(sources)  # from the per-step inputs alone
    for node in g.nodes:
        if computes(node) and node.all_input_nodes and set(node.all_input_nodes) <= derived:
            derived.add(node)
    if derived & written_nodes:
        derived = set(sources)  # an update that changes its lr or counts in place
    merge_copies(g, derived - sources)
    once = set(derived)  # and from reductions
    for node in g.nodes:
        if node in once or not computes(node) or not node.all_input_nodes:
            continue
        if reduces(node) or set(node.all_input_nodes) <= once:
            once.add(node)
    once -= written_nodes
    made = []
    for node in [node for node in g.nodes if node in once and node not in sources]:
        readers = [user for user in node.users if user not in once]
        # a reduction's result is in memory already: TorchInductor stores every reduction
        if reduces(node) or not readers or not is_small(node, tensor=True):
            continue
        with g.inserting_after(node):
            stored = g.call_function(computed_once, (node,))
        stored.meta = dict(node.meta)
        node.replace_all_uses_with(stored, lambda user, readers=readers: user in readers)
        made.append(stored)
    if not made:
        return graph
    g.lint()
    return fx.GraphModule(graph, g)


def computes(node: fx.Node) -> bool:
    """Whether ``node`` is an operation that makes a new small value: not in place, not a
    view of another value (a view follows the changes of what it views), and small."""
    return (
        node.op in ("call_function", "call_method")
        and not mutates(node)
        and is_small(node)
        and not (is_view(node) and not all(x.op == "placeholder" for x in node.all_input_nodes))
    )


def reduces(node: fx.Node) -> bool:
    """Whether ``node``'s values have fewer elements than one of its inputs: a reduction (a
    norm, a mean), or an element picked out of a larger tensor."""
    if node.target is operator.getitem:
        return False  # one tensor of a list (or a view: never a new value)
    largest = [max(numels(x), default=0) for x in node.all_input_nodes]
    return max(numels(node), default=0) < max(largest, default=0)


def numels(node: fx.Node) -> list[int]:
    """The number of elements of each tensor in ``node``'s value (a tensor or a list)."""
    value = node.meta.get("example_value")
    values = value if isinstance(value, (list, tuple)) else [value]
    return [x.numel() for x in values if isinstance(x, Tensor)]


def is_view(node: fx.Node) -> bool:
    """Whether ``node``'s value (or one of its values) is a view of another tensor."""
    value = node.meta.get("example_value")
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(x, Tensor) and x._is_view() for x in values)


def merge_copies(g: fx.Graph, nodes: set[fx.Node]) -> None:
    """Replace each of ``nodes`` that repeats an earlier one (the same operation on the same
    arguments) by that one: an update computes its bias corrections once per tensor, from
    the same count when the counts are equal (:func:`step_counts`)."""
    seen: dict[tuple, fx.Node] = {}
    for node in list(g.nodes):
        if node not in nodes:
            continue
        key = (node.op, node.target, repr(node.args), repr(node.kwargs))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            g.erase_node(node)
            nodes.discard(node)
        else:
            seen[key] = node


def mutates(node: fx.Node) -> bool:
    """Whether ``node`` writes into one of its arguments (``x.add_(y)``, ``out=x``)."""
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if node.target in IN_PLACE or (schema is not None and schema.is_mutable):
            return True
        if getattr(node.target, "__module__", None) in ("operator", "_operator"):
            return False  # operator.and_, operator.or_: x & y, x | y
        name = getattr(node.target, "__name__", "")
    else:
        return False
    return (name.endswith("_") and not name.endswith("__")) or "out" in node.kwargs


def written(node: fx.Node) -> list[fx.Node]:
    """The nodes an in-place ``node`` may write: its first argument and ``out``."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args[:1], node.kwargs.get("out")), found.append)
    return found


def is_small(node: fx.Node, limit: int = SMALL, tensor: bool = False) -> bool:
    """Whether ``node``'s value is a tensor (or, unless ``tensor``, a list of tensors) of at
    most ``limit`` elements each, with a known shape."""
    value = node.meta.get("example_value")
    values = [value] if isinstance(value, Tensor) or tensor else value
    if not isinstance(values, (list, tuple)) or not values:
        return False
    return all(
        isinstance(x, Tensor) and all(isinstance(d, int) for d in x.shape) and x.numel() <= limit
        for x in values
    )


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
