"""The compiled path (``compile=True``, lsdl_lab/optim/compiled.py) against the eager one.

For every first-order optimizer, on a real (small) model in float32 and one in float64
trained side by side by one optimizer (one parameter group: one graph covers both dtypes),
with a learning rate that changes every step (a schedule):

* 100 compiled steps equal 100 eager steps within a stated tolerance (TOLERANCE: the
  compiler fuses and reorders the arithmetic, so results differ by rounding, not bit for
  bit); the state is the same, key for key and type for type;
* one graph is compiled per parameter group, however the learning rate and the step
  count change, and from the third step on every step calls its kernels directly (the one
  private piece the path keeps: a torch that breaks it fails here, not silently);
* every value an update derives from the per-step scalars or from a reduction by a power, a
  square root or a division reaches the loops over the elements through ``computed_once``
  (checked on the graph dynamo traces), and ``computed_once`` does make TorchInductor
  compute a value once rather than in its loops (timed, with a margin of tens);
* a run switches path on resume, either way, through ``state_dict``;
* a changed hyperparameter, other strides, a new state entry, an attribute an update reads
  or a side effect go through dynamo's guards, which compile again where needed;
* where compiling is impossible (an optimizer that declares it, a missing C++ compiler, an
  operation the tracer rejects) one warning gives the reason, and the eager update runs.

Compiling costs seconds per graph (tens of seconds on a loaded machine with an empty
TorchInductor cache), so each optimizer is compiled once per module, for both dtypes, and
every test reads that run. ``LSDL_TEST_COMPILE=all`` adds the resume test of every
optimizer (Adam's runs by default) and K-FAC's compiled momentum. The comparison of the two
paths runs on every device of the ``device`` fixture (TorchInductor's C++ kernels on the
CPU, its Triton kernels on CUDA, within the same tolerance); the tests of the graphs and of
the fallbacks stay on the CPU. No test reads the code TorchInductor generates: it differs
between CPUs of other instruction sets (AVX2, AVX-512), and a test of it passed on one
machine of this project and failed on another.
"""

from __future__ import annotations

import io
import os
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_tree
from torch import fx, nn

from lsdl_lab import optim
from lsdl_lab.models import MLP
from lsdl_lab.optim.compiled import CompiledUpdate, CompileWarning, computed_once, isolated

STEPS = 100
SWITCH = 50  # the step at which a run changes path
DTYPES = (torch.float32, torch.float64)
# Measured largest differences after 100 steps (Adam, SGD, LAMB, Adafactor, NAdam; parameters
# of order 0.1 to 1): float32 9e-8, float64 2e-16. The bounds leave a hundredfold margin for
# other vector widths; a stale learning rate (the schedule moves it 2-10% a step) or step
# count moves parameters by far more.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}

# One option set per optimizer, with every part of its update switched on; LARS and LAMB
# with their two groups (adapted weights; biases without trust ratio and decay).
EVERY = os.environ.get("LSDL_TEST_COMPILE") == "all"
CASES = {
    "SGD": lambda m, c: optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                               weight_decay=1e-3, compile=c),
    "Adagrad": lambda m, c: optim.Adagrad(m.parameters(), lr=0.1, lr_decay=0.01, weight_decay=1e-3,
                                       initial_accumulator_value=0.1, compile=c),
    "RMSprop": lambda m, c: optim.RMSprop(m.parameters(), lr=1e-3, alpha=0.9, weight_decay=1e-3,
                                       momentum=0.5, centered=True, compile=c),
    "Adadelta": lambda m, c: optim.Adadelta(m.parameters(), lr=0.5, rho=0.8, weight_decay=1e-3,
                                         compile=c),
    "Adam": lambda m, c: optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-2, amsgrad=True,
                                 compile=c),
    "AdamW": lambda m, c: optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, compile=c),
    "Adamax": lambda m, c: optim.Adamax(m.parameters(), lr=1e-2, weight_decay=1e-3, compile=c),
    "NAdam": lambda m, c: optim.NAdam(m.parameters(), lr=1e-2, weight_decay=1e-2,
                                   decoupled_weight_decay=True, compile=c),
    "LARS": lambda m, c: optim.LARS(optim.param_groups_for_layerwise(m, 1e-3), lr=2.0,
                                 momentum=0.9, compile=c),
    "LAMB": lambda m, c: optim.LAMB(optim.param_groups_for_layerwise(m, 0.01), lr=1e-2,
                                 compile=c),
    "Adafactor": lambda m, c: optim.Adafactor(m.parameters(), lr=1e-2, beta1=0.9, weight_decay=0.01,
                                           compile=c),
    "SM3": lambda m, c: optim.SM3(m.parameters(), lr=0.05, momentum=0.9, compile=c),
}  # fmt: skip


def compiler_settings() -> tuple:
    """The process's settings that the compiled path sets for its own graphs alone (their
    recompile limit, TorchInductor's size asserts), never for the process."""
    import torch._inductor.config

    return torch._dynamo.config.recompile_limit, torch._inductor.config.size_asserts


SETTINGS = compiler_settings()


def make(name: str, model, compile: bool):
    return CASES[name](model, compile)


def make_model(dtype, device="cpu"):
    torch.manual_seed(0)
    return MLP(6, 3, hidden=12, depth=2).to(device, dtype)


def make_models(device="cpu") -> nn.ModuleList:
    """The same MLP in float32 and in float64, side by side."""
    return nn.ModuleList([make_model(dtype, device) for dtype in DTYPES])


def batch(t: int, dtype):
    g = torch.Generator().manual_seed(1000 + t)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64).to(dtype)
    return x, torch.randint(0, 3, (16,), generator=g)


def loss(models: nn.ModuleList, t: int):
    """The two models' losses on the same batch, summed: each model gets its own gradient."""
    device = next(models.parameters()).device
    return sum(
        F.cross_entropy(m(batch(t, d)[0].to(device)), batch(t, d)[1].to(device))
        for m, d in zip(models, DTYPES)
    )


def schedule(t: int) -> float:
    """A factor on the learning rate that changes every step (warm-up, then decay)."""
    return min(1.0, (t + 1) / 10) / (1 + 0.02 * t)


def train(models, opt, steps):
    for t in steps:
        for group, lr in zip(opt.param_groups, opt.base_lrs):
            group["lr"] = lr * schedule(t)
        opt.zero_grad()
        loss(models, t).backward()
        opt.step()


def checkpoint(models, opt) -> dict:
    buffer = io.BytesIO()
    torch.save(dict(model=models.state_dict(), opt=opt.state_dict()), buffer)
    buffer.seek(0)
    return torch.load(buffer)


def run(name, compile, steps=range(STEPS), start=None, device="cpu"):
    """Train ``steps`` on ``device``, from ``start`` (a checkpoint) or from the beginning; the
    models, the optimizer, and the checkpoint at step SWITCH when the run passes it."""
    models = make_models(device)
    opt = make(name, models, compile)
    opt.base_lrs = [g["lr"] for g in opt.param_groups]
    if start is not None:
        models.load_state_dict(start["model"])
        opt.load_state_dict(start["opt"])
    saved = None
    if steps.start < SWITCH < steps.stop:
        train(models, opt, range(steps.start, SWITCH))
        saved = checkpoint(models, opt)
        steps = range(SWITCH, steps.stop)
    train(models, opt, steps)
    return models, opt, saved


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    """No compiled graph of this file outlives it (nor one of an earlier file enters it)."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


RUNS = {}


def runs(name, device="cpu"):
    """The eager and the compiled run of ``name`` on ``device``, made once per module."""
    key = (name, str(device))
    if key not in RUNS:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CompileWarning)  # every one of them compiles
            RUNS[key] = run(name, False, device=device), run(name, True, device=device)
    return RUNS[key]


def assert_close_run(a, b):
    (models_a, opt_a), (models_b, opt_b) = a[:2], b[:2]
    params = list(zip(models_a.parameters(), models_b.parameters(), strict=True))
    assert {p.dtype for p, _ in params} == set(DTYPES)
    for pa, pb in params:
        torch.testing.assert_close(pa, pb, **TOLERANCE[pa.dtype])
    assert_same_tree(opt_a.state_dict(), opt_b.state_dict(), tolerance=TOLERANCE)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_equals_eager_with_one_graph_per_group(name, device):
    eager, compiled = runs(name, device)
    assert_close_run(compiled, eager)
    opt = compiled[1]
    assert opt.compiled.failure is None
    # 100 steps, a new learning rate and step count in each: one graph per group, no more
    assert opt.compiled.compiles == len(opt.param_groups)
    # called directly from the third step of each group on (the first creates the state,
    # the second compiles): a torch whose TensorGuards or lookup_backend changed fails here
    assert opt.compiled.no_direct == ""
    assert opt.compiled.direct_steps == len(opt.param_groups) * (STEPS - 2)
    assert opt.compiled.compile_seconds > 0
    assert compiler_settings() == SETTINGS  # the process's settings left as they were
    # and the run moved: a compiled update that did nothing would fail the comparison too,
    # but only if the eager run moved
    start = make_models(device)
    assert any(not torch.allclose(p, q) for p, q in zip(start.parameters(), eager[0].parameters()))


def test_unequal_step_counts_get_their_own_bias_corrections():
    # b misses step 3, so from step 4 on its count is one behind a's: a second graph, with
    # each tensor's corrections from its own count, and the eager path's results
    results = []
    for compile in (False, True):
        torch.manual_seed(0)
        a, b = (nn.Parameter(torch.randn(3, 4, dtype=torch.float64)) for _ in range(2))
        opt = optim.Adam([a, b], lr=0.1, compile=compile)
        for step in range(6):
            for p in (a, b):
                p.grad = None if (p is b and step == 2) else torch.sin(p.detach() * (step + 1))
            opt.step()
        results.append((a.detach(), b.detach(), opt.state[a]["step"], opt.state[b]["step"]))
    assert results[0][2:] == results[1][2:] == (6, 5)
    for x, y in zip(results[0][:2], results[1][:2]):
        torch.testing.assert_close(x, y, **TOLERANCE[torch.float64])
    assert opt.compiled.compiles == 3  # [a, b] equal, [a] alone, [a, b] unequal


# -- per-step scalars computed once: in the graphs, and in TorchInductor's loops -------------

# A tensor of at most this many elements is a "small value" (a scalar, a norm per layer, a
# factor of a matrix's rows); the test models' large tensors have more
SMALL = 4096
# Operations whose result, recomputed for every few elements of a loop, would cost more
# than the memory traffic the loop is bound by
COSTLY = {"pow", "sqrt", "rsqrt", "truediv", "div", "vector_norm", "norm", "mean", "reciprocal"}


def value(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def largest(value) -> int:
    """The elements of a node's value: of its largest tensor, for a list (a foreach op's)."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return max((largest(v) for v in value), default=0)
    return 0


def name_of(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def is_stored(node: fx.Node) -> bool:
    """Whether ``node`` is :func:`computed_once`'s view: the value TorchInductor stores."""
    return node.op in ("call_method", "call_function") and name_of(node) == "as_strided"


def unstored_costly_values(graph: fx.GraphModule) -> list[tuple[str, str]]:
    """(small value, large operation) pairs of a graph dynamo traced: a small value that a
    power, a square root, a division or a reduction made, from the graph's inputs and other
    small values, and that an operation over a large tensor reads without a stored value
    (:func:`computed_once`) between them. TorchInductor would recompute such a value in the
    loops of the large operation, for every few elements."""
    costly: dict[fx.Node, bool] = {}  # small value -> made by a costly op since a store
    pairs = []
    for node in graph.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        size = largest(value(node))
        ins = node.all_input_nodes
        if "_like" in name_of(node):  # a constant filled by a factory, not a computed value
            continue
        if 0 < size <= SMALL and isinstance(value(node), torch.Tensor):
            costly[node] = not is_stored(node) and (
                name_of(node) in COSTLY
                or any(costly.get(x, False) for x in ins)
                or any(largest(value(x)) > SMALL for x in ins)  # a reduction of a large one
            )
        elif size > SMALL:
            pairs += [(x.name, node.name) for x in ins if costly.get(x, False)]
        else:  # a list of small values (a foreach op's): costly if any is
            costly[node] = any(costly.get(x, False) for x in ins) and not is_stored(node)
    return pairs


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: optim.Adam(ps, lr=1e-2, weight_decay=1e-2, amsgrad=True, compile=True),
        lambda ps: optim.AdamW(ps, lr=1e-2, compile=True),
        lambda ps: optim.Adagrad(ps, lr=0.1, lr_decay=0.01, compile=True),
        lambda ps: optim.Adamax(ps, lr=1e-2, compile=True),
        lambda ps: optim.NAdam(ps, lr=1e-2, compile=True),
        lambda ps: optim.LARS(ps, lr=0.1, weight_decay=1e-4, compile=True),
        lambda ps: optim.LAMB(ps, lr=1e-2, weight_decay=0.01, compile=True),
        lambda ps: optim.Adafactor(ps, lr=1e-2, beta1=0.9, weight_decay=0.01, compile=True),
        lambda ps: optim.Adafactor(ps, lr=1e-2, compile=True),
    ],
    ids=["Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "LARS", "LAMB", "Adafactor-beta1",
         "Adafactor"],
)  # fmt: skip
def test_costly_scalars_reach_the_loops_computed_once(make_opt, monkeypatch):
    # Adam's bias corrections (powers of the step count and a square root), Adagrad's decayed
    # step (a division), NAdam's coefficients, LARS's and LAMB's trust ratios (divisions of
    # norms), Adafactor's relative step, clipping and factor ratios: each reaches the loops
    # over the parameters' elements through computed_once, so TorchInductor computes it
    # once, before them. (Checked on the graph dynamo traces, run by a backend that keeps
    # it, not on the C++ generated from it, which differs between CPUs.)
    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    monkeypatch.setattr(CompiledUpdate, "backend_name", staticmethod(keep))
    torch.manual_seed(0)
    # every parameter larger than SMALL (so that a small value is a scalar, a norm or a
    # factor, never a parameter's own tensor): two matrices and a vector
    params = [nn.Parameter(torch.randn(96, 64)), nn.Parameter(torch.randn(2 * SMALL)),
              nn.Parameter(torch.randn(128, 64))]  # fmt: skip
    opt = make_opt(params)
    for _ in range(3):  # the state, the compilation, a direct call
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert opt.compiled.compiles == len(graphs) == 1 and opt.compiled.direct_steps == 1
    (graph,) = graphs
    assert unstored_costly_values(graph) == []
    assert any(is_stored(node) for node in graph.graph.nodes)


def test_the_check_of_costly_scalars_finds_one_left_in_the_loops():
    # the check above, on a graph whose bias correction reaches the loop unstored: it names
    # the pair (the test would pass vacuously if the check could not see one)
    def update(w, t):
        w.mul_(1 - 0.9**t)

    def stored(w, t):
        w.mul_(computed_once(1 - 0.9**t))

    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    for fn, expected in ((update, 1), (stored, 0)):
        torch.compile(fn, backend=keep, fullgraph=True)(
            torch.ones(96, 64), torch.tensor(3.0, dtype=torch.float64)
        )
        assert len(unstored_costly_values(graphs[-1])) == expected, fn.__name__


def test_computed_once_makes_torchinductor_compute_a_value_once():
    # A value made by 8 powers of a 0-d input, read by a loop over 2**20 elements: without
    # computed_once TorchInductor inlines the powers into the loop, for every few elements
    # (about 10 ms here); with it the value is stored before the loop, which then streams
    # (about 1 ms). The margin is tens: the test fails if computed_once stops storing the
    # value, or if TorchInductor learns to hoist it (then computed_once is not needed).
    def costly(t):
        for _ in range(8):
            t = (t * 0.5 + 1.0) ** 1.01
        return t

    def inlined(x, t):
        x.add_(costly(t))

    def stored(x, t):
        x.add_(computed_once(costly(t)))

    x, t = torch.zeros(2**20), torch.tensor(3.0, dtype=torch.float64)
    fns = {f.__name__: torch.compile(f, fullgraph=True, dynamic=False) for f in (inlined, stored)}
    times = {name: [] for name in fns}
    for _ in range(2):  # compile, warm up
        for fn in fns.values():
            fn(x, t)
    for _ in range(7):  # the minimum of alternating runs: the least disturbed one
        for name, fn in fns.items():
            start = time.thread_time()
            fn(x, t)
            times[name].append(time.thread_time() - start)
    ratio = min(times["inlined"]) / min(times["stored"])
    assert ratio > 4, (ratio, times)


def test_a_changed_learning_rate_changes_the_compiled_step():
    # the learning rate is an input of the graph, not a constant baked into it
    eager, compiled = runs("Adam")
    models, opt = compiled[0], compiled[1]
    steps = []
    for lr in (1e-2, 0.0):
        before = [p.detach().clone() for p in models.parameters()]
        opt.param_groups[0]["lr"] = lr
        opt.zero_grad()
        loss(models, 0).backward()
        opt.step()
        steps.append(max((p - b).abs().max().item() for p, b in zip(models.parameters(), before)))
    assert steps[0] > 1e-4 and steps[1] == 0.0
    assert opt.compiled.compiles == 1


# -- the direct call: the compiled kernels without dynamo, after checks that stand for its guards


def twin_runs(make_opt, steps, change=lambda opt, model, step: None):
    """An eager and a compiled run of ``make_opt(params, compile)`` on the same batches, with
    ``change(opt, model, step)`` applied to both before each step's ``opt.step()``."""
    out = []
    for compile in (False, True):
        model = make_model(torch.float32)
        opt = make_opt(model.parameters(), compile)
        for t in range(steps):
            x, y = batch(t, torch.float32)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            change(opt, model, t)
            opt.step()
        out.append((model, opt))
    return out


def test_a_direct_call_gives_way_to_dynamo_when_a_check_fails():
    # three changes a compiled graph must not ignore, and what the direct call then does:
    # a new momentum (a constant of the graph): dynamo compiles a second graph; gradients
    # with other strides (a graph's loops assume their strides): a third; a new state entry:
    # dynamo runs the second graph (its guards allow it). Equal to eager throughout: a
    # direct call that missed a change would step with the old momentum or misread the
    # gradient's elements
    def change(opt, model, step):
        if step == 4:
            opt.param_groups[0]["momentum"] = 0.5
        if step == 6:
            weight = next(model.parameters())
            weight.grad = weight.grad.t().contiguous().t()
        state = opt.state[next(model.parameters())]
        if step == 8:
            state["note"] = torch.zeros(1)
        if step == 9:
            del state["note"]

    (eager, _), (compiled, opt) = twin_runs(
        lambda ps, c: optim.SGD(ps, lr=0.1, momentum=0.9, compile=c), 10, change
    )
    assert_close_models(compiled, eager)
    # step 0 eager; 1, 4 and 6 compile; 8 through dynamo; 2, 3, 5, 7 and 9 direct
    assert opt.compiled.compiles == 3 and opt.compiled.direct_steps == 5


class ScaledSGD(optim.SGD):
    """SGD whose learning rate is scaled by an attribute of the optimizer."""

    scale = 1.0

    def update(self, group, params, grads):
        super().update({**group, "lr": group["lr"] * self.scale}, params, grads)


class NotingSGD(optim.SGD):
    """SGD that notes each step's learning rate in the first parameter's state."""

    def update(self, group, params, grads):
        self.state[params[0]]["last_lr"] = group["lr"] * 1
        super().update(group, params, grads)


def test_a_subclass_from_outside_the_package_runs_through_dynamos_guards():
    # a subclass's update may read anything (an attribute of the optimizer) and change
    # anything (a state entry): it runs on torch's public path alone, every step through
    # dynamo, whose guards see the attribute change and compile again, and which sets the
    # entry after its graph ran
    def change(opt, model, step):
        if step == 4:
            opt.scale = 0.0

    (eager, _), (compiled, opt) = twin_runs(
        lambda ps, c: ScaledSGD(ps, lr=0.1, momentum=0.9, compile=c), 6, change
    )
    # steps 4 and 5 leave the model as it was: two steps of a stale scale would move it
    assert_close_models(compiled, eager)
    assert "ScaledSGD is not lsdl_lab.optim's" in opt.compiled.no_direct
    assert opt.compiled.direct_steps == 0 and opt.compiled.compiles == 2
    (eager, eager_opt), (compiled, opt) = twin_runs(
        lambda ps, c: NotingSGD(ps, lr=0.1, compile=c), 4
    )
    assert opt.compiled.direct_steps == 0 and opt.compiled.compiles == 1
    first = next(compiled.parameters())
    assert float(opt.state[first]["last_lr"]) == 0.1
    assert_close_models(compiled, eager)


def test_a_graph_that_creates_state_is_not_called_directly():
    # AMSGrad switched on at step 4: the step's new graph creates the running maximum (a
    # state entry dynamo sets after its graph), which a direct call would not; so that graph
    # runs through dynamo, whose guards compile a third graph once the entry exists, and
    # that one is called directly. Equal to eager: a direct call of the second graph would
    # restart the maximum from zero at every step
    def change(opt, model, step):
        if step == 4:
            opt.param_groups[0]["amsgrad"] = True

    (eager, _), (compiled, opt) = twin_runs(
        lambda ps, c: optim.Adam(ps, lr=0.05, compile=c), 9, change
    )
    assert_close_models(compiled, eager)
    first = next(compiled.parameters())
    assert "max_exp_avg_sq" in opt.state[first]
    # step 0 eager; 1, 4 and 5 compile; 2, 3, 6, 7 and 8 direct
    assert opt.compiled.compiles == 3 and opt.compiled.direct_steps == 5


@pytest.mark.skipif(not isolated(), reason="torch.compile before 2.13 shares one limit")
def test_each_optimizer_has_its_own_graphs_and_limit():
    # ten optimizers of one class in a process (a race): each compiles its own graph, past
    # dynamo's default limit of 8 graphs per function, which they would share without
    # torch.compile's isolate_recompiles
    torch.compiler.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileWarning)
        for k in range(10):
            w = nn.Parameter(torch.ones(4, 4))
            opt = optim.SGD([w], lr=0.1 * (k + 1), momentum=0.9, compile=True)
            for _ in range(3):
                w.grad = torch.ones_like(w)
                opt.step()
            assert opt.compiled.compiles == 1 and opt.compiled.direct_steps == 1
    torch.compiler.reset()


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=() if name == "Adam" or EVERY else pytest.mark.skip(
        reason="compiles each optimizer anew: LSDL_TEST_COMPILE=all")) for name in CASES],
)  # fmt: skip
def test_a_run_switches_path_on_resume(name):
    eager, compiled = runs(name)
    # eager for 50 steps, then compiled; compiled for 50 steps, then eager
    to_compiled = run(name, True, range(SWITCH, STEPS), start=eager[2])
    to_eager = run(name, False, range(SWITCH, STEPS), start=compiled[2])
    assert_close_run(to_compiled, eager)
    assert_close_run(to_eager, eager)
    # the checkpoints of the two paths hold the same state, type for type
    assert_same_tree(compiled[2]["opt"], eager[2]["opt"], tolerance=TOLERANCE)


# -- where compiling is impossible -----------------------------------------------------------


def eager_and_compiled(make_opt, steps=5):
    """Both paths of ``make_opt(params, compile)``; (models, optimizers, warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = twin_runs(make_opt, steps)
    return out, [w for w in caught if issubclass(w.category, CompileWarning)]


def assert_same_models(a, b):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def assert_close_models(a, b):
    """The same parameters within float32's tolerance (the paths' rounding differs)."""
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOLERANCE[torch.float32])


def test_an_optimizer_that_cannot_compile_warns_once_and_runs_eagerly():
    (eager, compiled), caught = eager_and_compiled(
        lambda ps, c: optim.Shampoo(ps, lr=0.1, compile=c)
    )
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "Shampoo(compile=True)" in message and "eigendecomposition" in message
    assert "running the eager update" in message
    assert_same_models(eager[0], compiled[0])


class RejectedSGD(optim.SGD):
    """SGD whose update reads a value on the host, which ends a graph: fullgraph rejects it."""

    def update(self, group, params, grads):
        if grads[0].norm() > 1e6:  # data-dependent control flow
            raise RuntimeError("exploded")
        super().update(group, params, grads)


def test_an_operation_the_compiler_rejects_warns_once_and_runs_eagerly():
    (eager, compiled), caught = eager_and_compiled(
        lambda ps, c: RejectedSGD(ps, lr=0.1, momentum=0.9, compile=c)
    )
    assert len(caught) == 1
    assert "RejectedSGD(compile=True): torch.compile could not compile" in str(caught[0].message)
    assert compiled[1].compiled.failure is not None and compiled[1].compiled.compiles == 0
    assert compiler_settings() == SETTINGS  # restored after the failed compile too
    assert_same_models(eager[0], compiled[0])


def test_a_missing_cpp_compiler_warns_once_and_runs_eagerly():
    # the config's own patch (monkeypatch deletes the config modules' attributes on undo,
    # which broke every later compile in the process); no cached kernel to reuse
    missing = {"cpp.cxx": ("/nonexistent/c++",), "force_disable_caches": True}
    torch.compiler.reset()
    try:
        with torch._inductor.config.patch(missing):
            (eager, compiled), caught = eager_and_compiled(
                lambda ps, c: optim.SGD(ps, lr=0.1, compile=c)  # the smallest graph: quick
            )
    finally:
        torch.compiler.reset()
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "torch.compile could not compile its update" in str(caught[0].message)
    assert_same_models(eager[0], compiled[0])


@pytest.mark.parametrize("cls", [optim.Newton, optim.HessianFree])
def test_a_second_order_optimizer_warns_once_and_steps_eagerly(cls):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileWarning)
        opt = cls(model.parameters(), lr=0.5, compile=True)
    assert [f"{cls.__name__}(compile=True)" in str(w.message) for w in caught] == [True]
    assert "one system over all parameters" in str(caught[0].message)
    before = model.weight.detach().clone()

    def closure():  # HessianFree's Gauss-Newton products also need the outputs
        out = model(x)
        loss = (out**2).mean()
        return loss if cls is optim.Newton else (loss, out)

    opt.step(closure)
    assert not torch.equal(before, model.weight)


def kfac_run(compile: bool):
    """Twelve K-FAC steps on a small MLP with a schedule, refreshing the factors every 2."""
    torch.manual_seed(0)
    model = MLP(6, 3, hidden=12, depth=2).double()
    opt = optim.KFAC(model, lr=0.05, update_freq=2, seed=0, compile=compile)
    x, y = torch.randn(32, 6, dtype=torch.float64), torch.randint(0, 3, (32,))
    for t in range(12):
        for group in opt.param_groups:
            group["lr"] = 0.05 * (1 + 0.1 * t)
        opt.zero_grad()
        opt.backward(F.cross_entropy(model(x), y))
        opt.step()
    return model, opt


@pytest.mark.skipif(not EVERY, reason="compiles for minutes: LSDL_TEST_COMPILE=all")
def test_kfac_compiles_its_momentum_update_and_equals_eager():
    # K-FAC preconditions eagerly (eigendecompositions); its update, SGD with momentum on the
    # preconditioned gradients, is what compiles
    (eager, _), (compiled, opt) = kfac_run(False), kfac_run(True)
    assert opt.compiled.failure is None and opt.compiled.compiles == len(opt.param_groups)
    for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOLERANCE[torch.float64])
    torch.manual_seed(0)
    start = MLP(6, 3, hidden=12, depth=2).double()  # the runs' first weights: they moved
    assert all(not torch.allclose(p, q) for p, q in zip(start.parameters(), eager.parameters()))
