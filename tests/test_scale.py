import pytest
import torch

from lsdl_lab import scale


def test_env_override(monkeypatch):
    for name in scale.PROFILES:
        monkeypatch.setenv("LSDL_SCALE", name)
        assert scale.current().name == name
    monkeypatch.setenv("LSDL_SCALE", " CPU ")
    assert scale.current().name == "cpu"


def test_automatic_choice_follows_cuda(monkeypatch):
    monkeypatch.delenv("LSDL_SCALE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert scale.current().name == "gpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert scale.current().name == "cpu"


def test_unknown_profile_lists_valid_ones(monkeypatch):
    monkeypatch.setenv("LSDL_SCALE", "huge")
    expected = r"\(expected one of 'smoke', 'cpu', 'gpu'\)"
    with pytest.raises(
        ValueError, match=r"Invalid LSDL_SCALE \(environment variable\): 'huge' " + expected
    ):
        scale.current()
    with pytest.raises(ValueError, match="Invalid name: 'tiny' " + expected):
        scale.current("tiny")


def test_pick_and_sizes_grow_with_scale():
    P = scale.PROFILES
    assert P["smoke"].pick(smoke=1, cpu=2, gpu=3) == 1
    assert P["gpu"].pick(smoke=1, cpu=2, gpu=3) == 3
    for field in ("resnet_depth", "gpt_dim", "block_size", "lm_steps", "epochs"):
        values = [getattr(P[n], field) for n in ("smoke", "cpu", "gpu")]
        assert values == sorted(values), field
    assert P["gpu"].image_dataset == "cifar10" and P["cpu"].image_dataset == "digits"


def test_profile_is_frozen():
    with pytest.raises(AttributeError):
        scale.PROFILES["cpu"].epochs = 100


def test_setup_prints_profile_and_device(capsys, monkeypatch):
    monkeypatch.setenv("LSDL_SCALE", "smoke")
    P, device = scale.setup(seed=3)
    out = capsys.readouterr().out
    assert "profile 'smoke'" in out and device.type in out and "seed 3" in out
    a = torch.rand(3)
    scale.seed_everything(3)
    assert torch.equal(a, torch.rand(3))


@pytest.mark.parametrize(
    "seed,error", [(-1, ValueError), (1.5, TypeError), ("0", TypeError), (True, TypeError)]
)
def test_bad_seed(seed, error):
    with pytest.raises(error, match="Invalid seed"):
        scale.seed_everything(seed)
