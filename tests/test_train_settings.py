"""Every training setting has a domain in one table (issue 36, class 6), and every door goes through it:
``--set key=value``, a ``--config`` file and the dedicated flags. A value outside is one line, exit 2, and
``--print-config`` shows nothing; a setting added without a knob fails here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from flowlift.commands.cli import main
from flowlift.commands.train import _FLAGS
from flowlift.errors import FlowliftError
from flowlift.knobs import Knob
from flowlift.training.config import TRAIN_KNOBS, TrainConfig, apply_overrides, build_config


def _outside(knob: Knob) -> list:
    """Values just outside ``knob``'s domain, derived from the domain itself (never a quoted value)."""
    if knob.kind is bool:
        return ["maybe", "2", 1, 0.5]
    if knob.choices:
        return ["bogus", f" {knob.choices[0]}x", 1]
    if knob.kind is list:
        return [5, [1, "a"], {"a": 1}]
    if knob.kind is str:
        bad: list = [5, ["a"], True]
        if knob.pattern == ".+":  # a name (init, resume): any text but an empty one, which names nothing
            bad += ["", "  "]
        elif knob.pattern != ".*":
            bad += ["bogus", "cpu:3", "cuda:-1", "cuda:x"]
        return bad
    step = 1 if knob.kind is int else 0.5
    bad = ["nan", "inf", "-inf", "x", "", math.nan]
    if knob.low is not None:
        bad.append(knob.low if knob.low_open else knob.low - step)
        bad.append(knob.low - 10**6)
    if knob.high is not None:
        bad.append(knob.high if knob.high_open else knob.high + step)
        bad.append(knob.high * 4 + 10**6)
    if knob.kind is int:
        bad += ["1.5", 2.5, "1e3x", True]
        if knob.multiple:
            bad.append((knob.low or 0) + knob.multiple + 1)
    if not knob.optional:
        bad.append(None)
    return bad


CASES = [(name, value) for name, knob in TRAIN_KNOBS.items() for value in _outside(knob)]


def _text_door(name: str, value) -> bool:
    """Whether ``value`` is one the command line can spell: any text, or a number of a number knob."""
    if isinstance(value, str):
        return True
    numeric = TRAIN_KNOBS[name].kind in (int, float)
    return numeric and isinstance(value, (int, float)) and value is not True and not math.isnan(value)


TEXT_CASES = [(name, value) for name, value in CASES if _text_door(name, value)]


def test_every_training_setting_has_exactly_one_knob_with_its_default():
    fields = [item.name for item in dataclasses.fields(TrainConfig)]
    assert list(TRAIN_KNOBS) == fields  # a new setting without a domain fails here
    for name, knob in TRAIN_KNOBS.items():
        assert knob.default == getattr(TrainConfig(), name)
        assert _outside(knob), f"{name} has no value outside its domain"


@pytest.mark.parametrize(("name", "value"), CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_a_config_file_value_outside_the_domain_is_one_line(tmp_path, name, value):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({name: value}))
    with pytest.raises(FlowliftError) as caught:
        build_config(path, {"data": "d", "output": "o"})
    assert name in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("print_config", [False, True])
def test_a_config_file_value_is_named_as_the_file_spells_it_not_as_a_flag(tmp_path, capsys, print_config):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"lr": -1}))
    args = ["--print-config"] if print_config else ["--data", str(tmp_path / "d"), "--output", str(tmp_path / "o")]
    rc = main(["train", "--config", str(path), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"flowlift train: error: {path}: lr must be in (0, 1], got -1"
    path.write_text(json.dumps({"lrr": 1}))
    rc = main(["train", "--config", str(path), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(f"flowlift train: error: {path}: unknown training setting(s): lrr")


def test_a_yaml_file_or_a_folder_as_config_says_what_it_is(tmp_path, capsys):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("lr: 0.1\n")
    assert main(["train", "--config", str(yaml), "--print-config"]) == 2
    assert "reads JSON (.json) or TOML (.toml) settings, not YAML" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path), "--print-config"]) == 2
    assert f"config {tmp_path} is a folder" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "value"), TEXT_CASES, ids=[f"{n}={v!r}" for n, v in TEXT_CASES])
def test_set_outside_the_domain_is_refused_even_by_print_config(capsys, name, value):
    rc = main(["train", "--set", f"{name}={value}", "--print-config"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    err = captured.err.strip()
    assert err.splitlines() == [err] and err.startswith(f"flowlift train: error: --set {name}={value}: {name} must be")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("seed", "-1"),
        ("seed", str(2**64)),
        ("adam_beta1", "1"),
        ("adam_eps", "-1"),
        ("base_channels", "0"),
        ("weight_decay", "-0.01"),
        ("time_limit_s", "-1"),
        ("stop_after", "-3"),
        ("val_count", "-1"),
        ("t_std", "-1"),
        ("t_std", "0"),
        ("time_dim", "7"),
    ],
)
def test_set_is_refused_before_any_work(tmp_path, capsys, name, value):
    out = tmp_path / "run"
    rc = main(["train", "--data", str(tmp_path / "data"), "--output", str(out), "--set", f"{name}={value}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.splitlines() == [err] and f"{name} must be" in err
    assert not out.exists()


def _flag_cases():
    for flag, name in _FLAGS.items():
        knob = TRAIN_KNOBS[name]
        if knob.kind in (int, float):
            for value in _outside(knob):
                if isinstance(value, (str, int, float)) and value is not True and value not in ("", None):
                    if not (isinstance(value, float) and math.isnan(value)):
                        yield flag, str(value)


def _option_of(dest: str) -> str:
    """The long option ``flowlift train`` spells for the setting stored at ``dest`` (``crop``: ``--crop-latent``)."""
    from flowlift.commands import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return next(action.option_strings[-1] for action in parser._actions if action.dest == dest)


@pytest.mark.parametrize(("flag", "value"), list(_flag_cases()))
def test_each_dedicated_flag_takes_the_same_domain(capsys, flag, value):
    option = _option_of(flag)
    with pytest.raises(SystemExit) as caught:
        main(["train", f"{option}={value}", "--print-config"])
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and err.splitlines() == [err] and f"argument {option}" in err


@pytest.mark.parametrize("name", list(TRAIN_KNOBS))
def test_the_domain_edges_and_the_default_are_taken(name):
    knob = TRAIN_KNOBS[name]
    values = [knob.default]
    if knob.kind in (int, float):
        values += [
            v for v, open_ in ((knob.low, knob.low_open), (knob.high, knob.high_open)) if v is not None and not open_
        ]
    for value in values:
        config = apply_overrides(TrainConfig(), {name: value})
        assert getattr(config, name) == value


def test_text_forms_of_switches_lists_and_none():
    config = apply_overrides(
        TrainConfig(),
        {
            "val_images": "a.png, b.png",
            "ema_warmup": "off",
            "stop_after": "none",
            "resume": "null",
            "seed": str(2**64 - 1),
            "device": "cpu:0",
        },
    )
    assert config.val_images == ["a.png", "b.png"] and config.ema_warmup is False
    assert config.stop_after is None and config.resume is None and config.seed == 2**64 - 1


def test_a_config_built_in_python_is_checked_by_validate():
    with pytest.raises(FlowliftError, match="adam_eps must be a number > 0"):
        TrainConfig(data="d", output="o", adam_eps=0.0).validate()
    with pytest.raises(FlowliftError, match="t_low must be at most t_high"):
        TrainConfig(data="d", output="o", t_low=0.8, t_high=0.2).validate()


def test_an_unknown_set_key_names_set_and_the_nearest_setting(capsys):
    assert main(["train", "--set", "val_evry=3", "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "flowlift train: error: --set val_evry=3: unknown training setting(s): val_evry (did you mean val_every?)"
    )


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--data", "d"], "no output folder: set --output"),
        (["--output", "o"], "no training data: set --data (a folder built by `flowlift dataset`)"),
        (
            ["--data", "d", "--output", "o", "--val-every", "5"],
            "validation (--val-every > 0) needs --val-images and --vae",
        ),
    ],
)
def test_a_missing_setting_is_named_as_its_option(argv, line, capsys):
    assert main(["train", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"flowlift train: error: {line}"


@pytest.mark.parametrize("name", ["init", "resume"])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_init_or_resume_names_nothing_at_every_door(tmp_path, capsys, name, value):
    """``init=""`` trained from scratch and ``resume=""`` started a fresh run: an empty name was read as none. None
    (``none`` on the text doors) says that; an empty name is refused by the Python API, the flag and a file."""
    with pytest.raises(FlowliftError, match=f"^{name} must be .*an empty name names nothing") as caught:
        TrainConfig(data="d", output="o", **{name: value}).validate()
    assert caught.value.field == name
    assert getattr(apply_overrides(TrainConfig(), {name: "none"}), name) is None
    try:
        rc = main(["train", "--data", "d", "--output", "o", f"--{name}={value}", "--print-config"])
    except SystemExit as exited:  # argparse refuses --init's value itself (its type: a name or path)
        rc = exited.code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2 and captured.out == "" and err.splitlines() == [err] and f"--{name}" in err and "an empty" in err
    path = tmp_path / "run.toml"
    path.write_text(f'{name} = "{value}"\n')
    with pytest.raises(FlowliftError, match=f"^{path}: {name} must be"):
        build_config(path, {"data": "d", "output": "o"})


def test_a_settings_key_that_is_no_text_is_an_unknown_setting():
    """``{("a",): 1}`` was a TypeError from joining the unknown keys; ``{1: 2, "b": 3}`` one from sorting them."""
    for overrides, named in (({("a",): 1}, "('a',)"), ({1: 2, "b": 3}, "1, b")):
        with pytest.raises(FlowliftError, match=r"^unknown training setting\(s\): ") as caught:
            apply_overrides(TrainConfig(data="d", output="o"), overrides)
        assert named in str(caught.value)


def test_the_dataset_dtype_names_are_the_shards_dtypes():
    """The command's choices and the requests' knobs (torch-free) name exactly the dtypes a shard stores."""
    from flowlift.training.dataset_settings import DTYPE_NAMES, STORAGE_DTYPE, TEACHER_DTYPE
    from flowlift.training.shards import STORAGE_DTYPES

    assert tuple(STORAGE_DTYPES) == DTYPE_NAMES == STORAGE_DTYPE.choices == TEACHER_DTYPE.choices
