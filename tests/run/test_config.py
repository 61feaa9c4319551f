"""lsdl_lab.run.config: options from YAML and flags, checked with clear errors, all in --help."""

import dataclasses

import pytest

from lsdl_lab.run import Config, load_config, main, parser


def test_defaults_then_file_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: gpt\nsteps: 7\nlr: 1\noptimizer_args:\n  betas: [0.9, 0.95]\nparallel: zero2\n"
    )
    config = load_config(["--config", str(path), "--steps", "9", "--no-progress"])
    assert config.model == "gpt" and config.parallel == "zero2"
    assert config.steps == 9  # the flag overrides the file
    assert config.lr == 1.0 and isinstance(config.lr, float)  # YAML's 1 is an int
    assert config.optimizer_args == {"betas": [0.9, 0.95]}
    assert config.progress is False
    assert config.global_batch == Config().global_batch  # untouched: the default
    flags = load_config(["--optimizer-args", '{"momentum": 0.9}', "--micro-batch", "8"])
    assert flags.optimizer_args == {"momentum": 0.9} and flags.micro_batch == 8
    # the config written by a run reads back equal
    again = tmp_path / "again.yaml"
    again.write_text(config.to_yaml())
    assert Config.from_yaml(again) == config
    assert config.replace(steps=3).steps == 3 and config.steps == 9


def test_describe_prints_every_option():
    text = Config().describe()
    for f in dataclasses.fields(Config):
        assert f"  {f.name} " in text


def test_help_lists_every_option_with_its_range_and_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--config FILE.yaml" in text
    for f in dataclasses.fields(Config):
        assert "--" + f.name.replace("_", "-") in text, f.name
    assert "--parallel PARALLEL data parallelism" in text
    assert "(one of 'ddp', 'zero1', 'zero2', 'zero3', 'fsdp2')" in text
    assert "(range: [1, inf]) [default: 100]" in text  # steps
    assert "--resume, --no-resume" in text


@pytest.mark.parametrize(
    "values, error, message",
    [
        ({"steps": 0}, ValueError, r"Invalid steps: 0 \(expected an int >= 1\)"),
        ({"steps": 2.5}, TypeError, r"Invalid steps: 2.5 \(expected an int >= 1\)"),
        ({"lr": 0.0}, ValueError, r"Invalid lr: 0.0 \(expected a finite number > 0\)"),
        ({"lr": "fast"}, TypeError, "Invalid lr: 'fast'"),
        ({"parallel": "zero4"}, ValueError, r"Invalid parallel: 'zero4' \(expected one of 'ddp'"),
        ({"optimizer": "KFAC"}, ValueError, "Invalid optimizer: 'KFAC' .*'SGD'"),
        ({"compression_ratio": 1.5}, ValueError, r"Invalid compression_ratio: 1.5 .*\(0, 1\]"),
        ({"progress": "yes"}, TypeError, "Invalid progress: 'yes' .*True or False"),
        ({"optimizer_args": [1]}, TypeError, "Invalid optimizer_args: .*mapping"),
        ({"kill_at_step": -2}, ValueError, "Invalid kill_at_step: -2"),
        ({"learning_rate": 0.1}, ValueError, "Invalid option: 'learning_rate' .*lr"),
    ],
)
def test_bad_values_name_the_option_and_the_allowed_range(values, error, message):
    with pytest.raises(error, match=message):
        Config.from_dict(values)


def test_errors_from_a_file_or_a_flag_name_them(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("global_batch: -4\n")
    with pytest.raises(ValueError, match=f"{path}: Invalid global_batch: -4"):
        load_config(["--config", str(path)])
    with pytest.raises(SystemExit):
        parser().parse_args(["--steps", "many"])
    assert "argument --steps: invalid int value: 'many'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Invalid precision: 'fp8'"):
        load_config(["--precision", "fp8"])
