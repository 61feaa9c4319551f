import pytest
import torch
import torch.nn.functional as F

from lsdl_lab import profiles


def test_env_override(monkeypatch):
    for name in profiles.PROFILES:
        monkeypatch.setenv("LSDL_SCALE", name)
        assert profiles.current().name == name
    monkeypatch.setenv("LSDL_SCALE", " CPU ")
    assert profiles.current().name == "cpu"


def test_automatic_choice_follows_cuda(monkeypatch):
    monkeypatch.delenv("LSDL_SCALE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert profiles.current().name == "gpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profiles.current().name == "cpu"


def test_unknown_profile_lists_valid_ones(monkeypatch):
    monkeypatch.setenv("LSDL_SCALE", "huge")
    expected = r"\(expected one of 'smoke', 'cpu', 'gpu'\)"
    with pytest.raises(
        ValueError, match=r"Invalid LSDL_SCALE \(environment variable\): 'huge' " + expected
    ):
        profiles.current()
    with pytest.raises(ValueError, match="Invalid name: 'tiny' " + expected):
        profiles.current("tiny")


def test_pick_and_sizes_grow_with_scale():
    P = profiles.PROFILES
    assert P["smoke"].pick(smoke=1, cpu=2, gpu=3) == 1
    assert P["gpu"].pick(smoke=1, cpu=2, gpu=3) == 3
    assert P["gpu"].pick(smoke=1, cpu=2) == 2 and P["smoke"].pick(smoke=1, cpu=2) == 1
    assert P["gpu"].pick(smoke=1, cpu=2, gpu=None) is None  # None is a value, not left out
    for field in ("resnet_depth", "gpt_dim", "block_size", "lm_steps", "epochs"):
        values = [getattr(P[n], field) for n in ("smoke", "cpu", "gpu")]
        assert values == sorted(values), field
    assert P["gpu"].image_dataset == "cifar10" and P["cpu"].image_dataset == "digits"


def test_profile_is_frozen():
    with pytest.raises(AttributeError):
        profiles.PROFILES["cpu"].epochs = 100


def test_setup_prints_profile_and_device(capsys, monkeypatch):
    monkeypatch.setenv("LSDL_SCALE", "smoke")
    P, device = profiles.setup(seed=3)
    out = capsys.readouterr().out
    assert "profile 'smoke'" in out and device.type in out and "seed 3" in out
    a = torch.rand(3)
    profiles.seed_everything(3)
    assert torch.equal(a, torch.rand(3))


@pytest.mark.parametrize(
    "seed,error", [(-1, ValueError), (1.5, TypeError), ("0", TypeError), (True, TypeError)]
)
def test_bad_seed(seed, error):
    with pytest.raises(error, match="Invalid seed"):
        profiles.seed_everything(seed)


# --- the dry run's caps (tests/test_gpu_profile.py) ---------------------------------------


@pytest.fixture
def no_caps(monkeypatch):
    monkeypatch.delenv(profiles.MAX_STEPS_VAR, raising=False)
    monkeypatch.delenv(profiles.MAX_EXAMPLES_VAR, raising=False)


@pytest.fixture
def caps(monkeypatch):
    monkeypatch.setenv(profiles.MAX_STEPS_VAR, "2")
    monkeypatch.setenv(profiles.MAX_EXAMPLES_VAR, "16")


def test_caps_are_the_identity_outside_a_dry_run(no_caps):
    assert profiles.dry_run() is None
    assert profiles.capped_steps(20_000) == 20_000
    assert profiles.capped_examples(4096) == 4096 and profiles.capped_examples(None) is None


def test_caps_of_a_dry_run(caps):
    assert profiles.dry_run() == {"max_steps": 2, "max_examples": 16}
    assert [profiles.capped_steps(n) for n in (0, 1, 2, 20_000)] == [0, 1, 2, 2]
    assert [profiles.capped_examples(n) for n in (8, 16, 4096)] == [8, 16, 16]
    assert profiles.capped_examples(None) is None  # a whole training set keeps its size


@pytest.mark.parametrize("value", ["0", "-3", "two", "1.5"])
def test_a_bad_cap_names_its_variable(monkeypatch, value):
    monkeypatch.setenv(profiles.MAX_STEPS_VAR, value)
    with pytest.raises(ValueError, match=r"Invalid LSDL_MAX_STEPS \(environment variable\)"):
        profiles.capped_steps(10)


def _tiny_classifier():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))


def test_loops_and_batches_honour_the_caps(caps):
    # The library caps in two places: fit's step counter (every training, the wing's races
    # included, runs through it) and the batches of lsdl_lab.data (each batch and each
    # evaluation set at most LSDL_MAX_EXAMPLES examples).
    from lsdl_lab import data, train
    from lsdl_lab.book import races

    x, y = torch.randn(200, 4), torch.randint(0, 3, (200,))
    batches = data.ImageBatches(x, y, 64)
    assert batches.steps_per_epoch == 3  # the data set and its epochs keep their sizes
    assert batches(0)[0].shape == (16, 4)
    growing = data.GrowingBatches(x, y, lambda epoch: 32 * (epoch + 1))
    assert growing(0)[0].shape == (16, 4) and growing.epoch_start(1) == 7  # 200 / 32
    model = _tiny_classifier()
    history = train.fit(model, torch.optim.SGD(model.parameters(), 0.1), batches, epochs=30)
    assert [r["step"] for r in history.train] == [1, 2]
    run = races.train_run(
        "SGD", model, torch.optim.SGD(model.parameters(), 0.1), batches, 500, F.cross_entropy
    )
    assert run.steps == 2
    # an evaluation set: its first 16 examples, in batches of the size asked for
    assert [len(b) for b, _ in data.eval_batches(x, y, 50)] == [16]
    assert [len(b) for b, _ in data.eval_batches(x, y, 5)] == [5, 5, 5, 1]
    assert [len(b) for b, _ in data.eval_batches(x, y, 5, max_batches=2)] == [5, 5]
    tokens = torch.arange(1000) % 7
    text = data.TextBatches(tokens, 8, 64)
    assert text(0)[0].shape == (2, 8)  # 16 examples are 16 tokens: two windows of 8
    assert [b.shape for b, _ in data.text_eval_batches(tokens, 8, 64)] == [(2, 8)]
    assert [b.shape for b, _ in data.text_eval_batches(tokens, 4, 3)] == [(3, 4), (1, 4)]
    assert data.TextBatches(tokens, 100, 64)(0)[0].shape == (1, 100)  # one window at least
    assert [b.shape for b, _ in data.text_eval_batches(tokens, 100, 64)] == [(1, 100)]


def test_the_library_caps_in_fit_and_in_the_batches_only():
    # Every other loop of the library takes its length from its caller (a lab, a chapter,
    # the book's wing), which caps it; run/loop.py reads fit's cap to say where it stopped.
    import ast
    from pathlib import Path

    import lsdl_lab

    root = Path(lsdl_lab.__file__).parent
    callers = set()
    for path in root.rglob("*.py"):
        where = path.relative_to(root).as_posix()
        if where.startswith("book/") or where == "profiles.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if name in ("capped_steps", "capped_examples"):
                    callers.add(where)
    assert callers == {"train.py", "data/batches.py", "run/loop.py"}


def test_loops_and_batches_unchanged_without_caps(no_caps):
    from lsdl_lab import data, train

    x, y = torch.randn(200, 4), torch.randint(0, 3, (200,))
    batches = data.ImageBatches(x, y, 64)
    assert batches(0)[0].shape == (64, 4)
    model = _tiny_classifier()
    history = train.fit(
        model, torch.optim.SGD(model.parameters(), 0.1), batches, epochs=3, log_every=1
    )
    assert len(history.train) == 9
    assert [len(b) for b, _ in data.eval_batches(x, y, 50)] == [50] * 4


def test_a_world_on_the_cpu_never_takes_the_gpu_sizes():
    gpu, cpu, smoke = (profiles.PROFILES[n] for n in ("gpu", "cpu", "smoke"))
    assert profiles.world_profile(gpu, "cpu") is cpu
    assert profiles.world_profile(gpu, torch.device("cuda", 1)) is gpu
    assert profiles.world_profile(cpu, "cpu") is cpu
    assert profiles.world_profile(smoke, "cpu") is smoke
    assert profiles.world_profile(smoke, "cuda") is smoke
