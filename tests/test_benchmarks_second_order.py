"""benchmarks/second_order.py: which steps refresh each preconditioner, the state's bytes,
and a quick run of the table (tiny models)."""

import pytest
import torch

from benchmarks import __main__ as run_all
from benchmarks import second_order
from lsdl_lab.models import MLP

# The state each optimizer recomputes only when it refreshes its preconditioner.
REFRESHED = {
    "K-FAC": lambda key: key.startswith("Q"),  # the factors' eigenvectors
    "Shampoo": lambda key: key == "roots",
    "pytorch-optimizer Shampoo": lambda key: key.startswith("inv_pre_cond"),
}


def snapshot(optimizer, keep) -> list[torch.Tensor]:
    out = []

    def visit(x):
        if isinstance(x, torch.Tensor):
            out.append(x.detach().clone())
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(key, str) and keep(key):
                visit(value)
    return out


@pytest.mark.parametrize("name", list(REFRESHED))
def test_refresh_rule_is_the_step_that_changes_the_preconditioner(name):
    specs = second_order.optimizers(k=3)
    if name not in specs:
        pytest.skip("pytorch-optimizer is not installed")
    make, refreshes = specs[name]
    torch.manual_seed(0)
    model = MLP(64, 10, hidden=8)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    trainer = second_order.Trainer(model, make(model), x, y, timer=lambda: 0.0)
    before = []
    for t in range(1, 9):
        trainer()
        after = snapshot(trainer.optimizer, REFRESHED[name])
        assert after, "the preconditioner's state was not found"
        changed = len(before) != len(after) or any(
            not torch.equal(a, b) for a, b in zip(before, after)
        )
        if t > 1:  # the first step creates the state, whatever it computes
            assert changed == refreshes(t), f"step {t}"
        before = after
    assert trainer.steps == 8 and len(trainer.step_times) == 8


def test_state_bytes_follow_nested_state_and_count_each_storage_once():
    model = MLP(4, 2, hidden=3)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    adam = second_order.optimizers()["Adam"][0](model)
    for p in params:
        p.grad = torch.ones_like(p)
    adam.step()
    assert second_order.state_bytes(adam) == 8 * n  # two float32 moments, step an int

    opt = torch.optim.SGD(params, lr=0.1)
    big = torch.zeros(10, dtype=torch.float64)
    opt.state[params[0]] = {"blocks": [[big, big[:5]], (torch.zeros(3),)], "meta": {"x": big}}
    assert second_order.state_bytes(opt) == 80 + 12


def test_quick_run_has_every_optimizer_and_both_kinds_of_step(capsys):
    text = second_order.main(["--quick"])
    for name in second_order.optimizers():
        assert f"| {name} |" in text
    assert "tiny-mlp" in text and "tiny-resnet" in text
    assert "| 4/2 |" in text  # 6 rounds after 1 warm-up, refresh every 3: steps 4 and 7
    assert "| Adam | " in text and "| 6/0 |" in text


@pytest.mark.parametrize(
    "argv", [["--cases", "vgg"], ["--rounds", "0"], ["--device", "cuda", "--clock", "wall"]]
)
def test_bad_options(argv, capsys):
    with pytest.raises(SystemExit):
        second_order.parse_args(argv)


def test_the_full_run_options_are_accepted():
    _, args = second_order.parse_args(run_all.FULL["second-order"])
    assert not args.quick and args.out is None
