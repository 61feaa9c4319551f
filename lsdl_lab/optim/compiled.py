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
* **Warm steps call the compiled kernels directly.** Every call of a ``torch.compile``d
  function first evaluates dynamo's guards (is every input still of the type, shape and
  value the graph was traced for?) and then gathers the graph's inputs from the arguments:
  here one entry per tensor and state, each state found in ``optimizer.state`` by walking
  its keys. Measured on 65 tensors of 16 numbers (the 1M model's count) after the caches
  were flushed (as a backward pass flushes them), the compiled graph's own call took 0.3 ms
  of a 1.3 ms SGD step, dynamo's guard check alone 0.35 ms; torch's fused step took 0.7 ms.
  With direct calls the step took 0.9 ms, against 1.5 ms through dynamo and 0.8 ms fused,
  timed alternately in one process. So when a graph has been compiled, :class:`DirectCall`
  records where
  each of its inputs comes from (the lr, the counts, the i-th parameter, gradient or named
  state), and later steps gather the inputs from the group's lists and call the compiled
  kernels themselves, after the checks that stand for dynamo's: the same hyperparameters,
  every tensor of the same dtype, device, shape and strides (checked in C++), no new state
  keys, the same global state (grad mode, default device, no torch-function or dispatch
  mode). A step that fails a check, or a graph whose guards cover anything else (an
  attribute of the optimizer, a global constant) or that has side effects, goes through
  dynamo as before: the direct call is an optimization, never a second semantics.
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
import re
import time
import warnings
from array import array
from collections.abc import Sequence

import torch
from torch import Tensor, fx

__all__ = ["CompileWarning", "CompiledUpdate", "DirectCall", "compute_once", "computed_once"]

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
    ``graphs`` holds the graphs given to TorchInductor (after :func:`compute_once`);
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
        self.graphs: list[fx.GraphModule] = []
        self.direct: dict[int, list[DirectCall]] = {}  # by id of the parameter group
        self.direct_steps = 0  # steps that called the compiled kernels directly
        self.call: tuple = ()  # this step's (group, params, grads, states), while it runs
        self.recorded: list[tuple] = []  # (kernels, where its inputs come from, or why not)
        self.guards: list | None = None  # dynamo's guards of the graph compiled last
        self.no_direct = ""  # why the graph compiled last is not called directly, if it is not
        self.fn = optimizer.update
        if optimizer.not_compilable:
            self.fail(optimizer.not_compilable)
            return
        try:  # torch.compile refuses some platforms (Python versions) outright
            self.fn = torch.compile(
                optimizer.update,
                fullgraph=True,
                # never dynamic: a second graph of the same code (another instance, other
                # shapes or hyperparameters) is specialized like the first, not made generic
                dynamic=False,
                backend=self.backend,
                options={"guard_filter_fn": self.read_guards},
            )
        except Exception as error:  # noqa: BLE001 - any refusal falls back, with its reason
            self.fail(f"torch.compile is not available here ({describe(error)})")

    def backend(self, graph, example_inputs):
        graph = compute_once(graph, example_inputs, self.per_step)
        compiled = torch._dynamo.lookup_backend(self.backend_name)(
            graph, example_inputs, config_patches=INDUCTOR_PATCHES
        )
        self.graphs.append(graph)
        self.compiles += 1  # counted once it succeeded: dynamo may retry a failed attempt
        where = side_effects() or sources(example_inputs, self.per_step, *self.call)
        self.recorded.append((compiled, where))
        return compiled

    def read_guards(self, entries) -> list[bool]:
        """dynamo's guards of a new graph, read (for :class:`DirectCall`), all kept."""
        self.guards = list(entries)
        return [True] * len(entries)

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
            if not any(call(group, params, grads, states, self.per_step) for call in direct):
                self.compiled_step(group, params, grads, states)
            else:
                self.direct_steps += 1
        finally:
            opt.step_counts = None
            self.per_step = ()
        if counts:
            for state, k in zip(states, steps):
                state["step"] = int(k)

    def compiled_step(self, group: dict, params: list, grads: list, states: list) -> None:
        """The step through dynamo (its guards, and a compilation where they fail); a graph
        compiled here is recorded for direct calls (:class:`DirectCall`) when it can be."""
        opt = self.optimizer
        before, start = self.compiles, time.perf_counter()
        config = torch._dynamo.config
        limit = config.recompile_limit  # set and restored directly: config.patch costs 40 us
        config.recompile_limit = max(RECOMPILE_LIMIT, limit)
        self.call, self.recorded, self.guards = (group, params, grads, states), [], None
        try:
            self.fn({**group, "lr": self.per_step[0]}, params, grads)
        except Exception as error:
            if not is_compile_error(error):  # an error of the update itself: the user's
                raise
            self.fail(f"torch.compile could not compile its update ({describe(error)})")
            opt.update(group, params, grads)
            return
        finally:
            config.recompile_limit = limit
            self.call = ()
        if self.compiles > before:
            self.compile_seconds += time.perf_counter() - start
            if len(self.recorded) == 1 and self.guards is not None:
                ((kernels, where),) = self.recorded
                if not isinstance(where, str):
                    where = unchecked(self.guards) or where
                self.record(kernels, where, group, params, grads, states)
        self.recorded, self.guards = [], None

    def record(self, kernels, where, group, params, grads, states) -> None:
        """Keep the graph just compiled for direct calls, or the reason it cannot be."""
        if isinstance(where, str):
            self.no_direct = where
            return
        try:
            call = DirectCall(kernels, where, group, states, self.per_step, params, grads)
        except Exception as error:  # noqa: BLE001 - another torch: dynamo's path, never a crash
            self.no_direct = describe(error)
            return
        self.no_direct = ""
        self.direct.setdefault(id(group), []).append(call)


class DirectCall:
    """A compiled graph of one parameter group, called without dynamo: the inputs gathered
    from the group's lists, after checks that stand for dynamo's guards.

    ``where`` says where each input of the graph comes from: ``("per_step", i)`` (the lr,
    the counts), ``("params", i)``, ``("grads", i)`` or ``("state", i, name)``. The checks,
    each cheap: the group's hyperparameters (other than lr) equal those the graph was traced
    with; each parameter's state has as many entries; the global state dynamo guards (grad
    mode, autocast, deterministic algorithms, default device; no torch-function or dispatch
    mode) is the same; the inputs are distinct tensors; every input has the dtype, device,
    shape and strides the graph was compiled for (dynamo's own C++ tensor check). A call
    that fails one returns False, and the step goes through dynamo.
    """

    def __init__(self, kernels, where, group, states, per_step, params, grads):
        from torch._C._dynamo.guards import GlobalStateGuard, TensorGuards

        self.kernels = kernels
        self.hyper = hyperparameters(group)
        self.lens = list(map(len, states))
        self.default_device = torch.utils._device.CURRENT_DEVICE
        self.global_state = GlobalStateGuard()
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
                or not self.global_state.check()
                or torch.utils._device.CURRENT_DEVICE is not self.default_device
                or torch._C._len_torch_function_stack()
                or torch._C._len_torch_dispatch_stack()
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


# dynamo's guards that a direct call's checks stand for: on the group, the parameters,
# gradients, states and counts (every tensor's metadata, the hyperparameters, the state's
# entries); on the global state (checked as dynamo does); on code (modules, functions,
# classes and their defaults, which a run does not rebind) and on the optimizer's identity
RECHECKED = re.compile(
    r"(group|params|grads|self\.state|self\.step_counts)\b|list\(dict\.keys\(self\.state\)\)"
)
GLOBAL_GUARDS = {"GLOBAL_STATE", "GRAD_MODE", "DETERMINISTIC_ALGORITHMS", "TORCH_FUNCTION_STATE",
                 "DEFAULT_DEVICE", "AUTOGRAD_SAVED_TENSORS_HOOKS", "SHAPE_ENV",
                 "TORCH_FUNCTION_MODE_STACK"}  # fmt: skip
CODE_GUARDS = {"ID_MATCH", "TYPE_MATCH", "CLOSURE_MATCH", "BUILTIN_MATCH", "CLASS_MATCH",
               "MODULE_MATCH", "FUNCTION_MATCH", "DUPLICATE_INPUT", "SEQUENCE_LENGTH",
               "NOT_PRESENT_IN_GENERIC_DICT", "DICT_CONTAINS", "DICT_NOT_CONTAINS"}  # fmt: skip


def unchecked(guards) -> str | None:
    """Why a direct call could not stand for one of dynamo's ``guards`` (the first such
    guard), or None: a guard on an attribute of the optimizer or on a global constant."""
    for guard in guards:
        name, kind = guard.name, guard.guard_type
        if not name:
            ok = kind in GLOBAL_GUARDS
        elif name == "self":
            ok = kind in ("ID_MATCH", "TYPE_MATCH", "NOT_PRESENT_IN_GENERIC_DICT")
        elif RECHECKED.match(name):
            ok = True
        elif name.startswith("self."):
            ok = False  # an attribute of the optimizer: its value may change
        else:  # globals, closures (super's __class__), classes: code, and its defaults
            ok = kind in CODE_GUARDS or "__defaults__" in name
        if not ok:
            return f"dynamo guards {name or kind} ({kind}), which a direct call does not check"
    return None


def side_effects() -> str | None:
    """Why the graph being compiled cannot be called directly because of what dynamo runs
    around it (a change to a Python object: a state entry set, an attribute), or None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        if InstructionTranslator.current_tx().output.side_effects.is_empty():
            return None
        return "the update changes Python objects, which dynamo replays after the graph"
    except Exception as error:  # noqa: BLE001 - another torch: no direct calls, never a crash
        return f"dynamo's side effects are not readable here ({describe(error)})"


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
    r"""``graph`` (traced by dynamo) with its small values computed once, before the loops that
    read them: a new graph, or ``graph`` itself when there are none.

    Two kinds of values, each of at most :data:`SMALL` elements, made by operations that
    change nothing in place:

    * those derived from the tensors ``per_step`` (the learning rate, the step counts: bias
      corrections, Adafactor's relative step, NAdam's momentum schedule) and from states of
      one element (NAdam's running product :math:`\Pi_t`, read after it is updated in
      place), through any arithmetic on them; the same operation on the same values is kept
      once (:func:`merge_copies`: an update that computes a bias correction per tensor,
      from one count, computes it once);
    * those computed from reductions of the large arrays (norms, means) and from such values:
      LARS's and LAMB's trust ratios, Adafactor's RMS and clipping.

    Each one the rest of the graph reads passes through :func:`computed_once`, and the loops
    read it from memory. A value changed in place later is left as it is: its readers after
    the change must see the change. A value stored is computed where the update computes it,
    so a state changed in place gives the values the update reads there.
    """
    inputs = graph.graph.find_nodes(op="placeholder")
    sources = {
        node
        for node, x in zip(inputs, example_inputs)
        if any(x is y for y in per_step) or (isinstance(x, Tensor) and x.numel() == 1)
    }
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    g.output(g.graph_copy(graph.graph, env))
    sources = {env[node] for node in sources}
    position = {node: i for i, node in enumerate(g.nodes)}
    last_write: dict[fx.Node, int] = {}
    for node in g.nodes:
        if mutates(node):
            last_write.update({x: position[node] for x in written(node)})
    written_nodes = set(last_write)

    def derived_from(sources: set) -> set:
        # a value read from a source before the source's last change in place is not the
        # source's value for the rest of the graph: only reads after it count
        derived = set(sources)
        for node in g.nodes:
            ins = node.all_input_nodes
            if computes(node) and ins and set(ins) <= derived:
                if all(last_write.get(x, -1) < position[node] for x in ins if x in sources):
                    derived.add(node)
        return derived

    derived = derived_from(sources)  # from the per-step inputs and one-element states
    # the same operation on the same values is one value only when no value changes between
    clean = derived_from(sources - written_nodes) - sources
    merge_copies(g, {node for node in clean if not set(node.all_input_nodes) & written_nodes})
    derived &= set(g.nodes)  # without the copies merge_copies erased
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
