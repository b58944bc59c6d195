"""Tests for gyre_jax/config.py: config files, typed command-line overrides and validation errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_jax.config import (
    DEFAULT_CONFIG,
    ConfigError,
    apply_override,
    config_from_dict,
    load_config,
    parse_args,
    to_json_dict,
    validate,
)


@pytest.fixture(scope="module")
def base():
    return load_config([])


def config_error(argv) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    message = str(info.value)
    assert message and "\n" not in message, message  # one line, fit for a terminal
    return message


def test_default_config_loads_and_validates(base):
    validate(base)
    assert base.rl.group_size >= 2 and base.devices.num_cpu_devices == 8
    assert base.mesh.data * base.mesh.fsdp * base.mesh.tensor == 8
    assert isinstance(to_json_dict(base), dict)


def test_overrides_parse_with_the_type_of_the_field_they_replace():
    c = load_config(
        [
            "--config.rl.group_size=4",  # int
            "--config.optimizer.learning_rate=1",  # float field given an integer literal
            "--config.rl.clip_low=2.5e-4",  # float
            "--config.metrics.tensorboard=false",  # bool
            "--config.metrics.progress_bar=1",  # bool from 1
            "--config.workdir=/tmp/gyre run",  # str (kept verbatim)
            "--config.rollout.task_kinds=copy,upper",  # tuple from comma list
            "--config.serving.prefill_buckets=(256, 1536)",  # tuple from a literal
        ]
    )
    assert c.rl.group_size == 4 and type(c.rl.group_size) is int
    assert c.optimizer.learning_rate == 1.0 and type(c.optimizer.learning_rate) is float
    assert c.rl.clip_low == 2.5e-4 and type(c.rl.clip_low) is float
    assert c.metrics.tensorboard is False and c.metrics.progress_bar is True
    assert c.workdir == "/tmp/gyre run"
    assert c.rollout.task_kinds == ("copy", "upper")
    assert c.serving.prefill_buckets == (256, 1536)
    # A single value for a tuple field becomes a one-element tuple.
    assert load_config(["--config.rollout.task_kinds=reverse"]).rollout.task_kinds == ("reverse",)
    # Overrides apply in order: the last one wins; every load starts from the file again.
    assert load_config(["--config.seed=1", "--config.seed=2"]).seed == 2
    assert load_config([]).seed == 0


@pytest.mark.parametrize(
    "text, expected", [("true", True), ("Yes", True), ("1", True), ("FALSE", False), ("no", False), ("0", False)]
)
def test_bool_spellings(text, expected):
    assert load_config([f"--config.metrics.tensorboard={text}"]).metrics.tensorboard is expected


@settings(max_examples=25, deadline=None)
@given(st.integers(-(2**40), 2**40), st.floats(1e-8, 1.0))
def test_int_and_float_overrides_round_trip(seed, lr):
    c = load_config([f"--config.seed={seed}", f"--config.optimizer.learning_rate={lr!r}"])
    assert c.seed == seed and type(c.seed) is int
    assert c.optimizer.learning_rate == lr and type(c.optimizer.learning_rate) is float


def test_space_separated_and_config_path_forms(monkeypatch, tmp_path):
    c = load_config(["--config", "configs/tiny_cpu.py", "--config.rl.group_size", "4", "--config.seed", "-3"])
    assert c.rl.group_size == 4 and c.seed == -3
    assert load_config([f"--config={DEFAULT_CONFIG}"]).rl.group_size == 8
    assert load_config(["-c", str(DEFAULT_CONFIG)]).rl.group_size == 8
    # A relative path is also looked up from the repository root, whatever the working directory.
    monkeypatch.chdir(tmp_path)
    assert load_config(["--config", "configs/tiny_cpu.py"]).rl.group_size == 8
    spec, overrides = parse_args(["--config", "x.py:arg", "--config.a.b", "v", "--config.c=d=e"])
    assert spec == "x.py:arg" and overrides == [("a.b", "v"), ("c", "d=e")]


def test_config_path_with_argument(tmp_path):
    path = tmp_path / "sized.py"
    path.write_text(
        "from gyre_jax.config import load_config\n\n"
        "def get_config(group_size='8'):\n"
        "    c = load_config([])\n"
        "    c.rl.group_size = int(group_size)\n"
        "    return c\n"
    )
    assert load_config(["--config", f"{path}:4"]).rl.group_size == 4
    assert load_config(["--config", str(path)]).rl.group_size == 8
    # Overrides apply after the argument, and validation sees the result.
    assert load_config(["--config", f"{path}:4", "--config.rl.group_size=6"]).rl.group_size == 6
    assert "config.rl.group_size=1" in config_error(["--config", f"{path}:1"])


def test_unknown_key_names_the_key_and_lists_known_ones():
    message = config_error(["--config.rl.grup_size=3"])
    assert "rl.grup_size" in message and "grup_size" in message
    for known in ("group_size", "clip_low", "clip_high", "max_branches", "micro_batch_size"):
        assert known in message
    top = config_error(["--config.nope=1"])
    assert "'nope'" in top and "rl" in top and "optimizer" in top
    assert "seed.x" in config_error(["--config.seed.x=1"])
    section = config_error(["--config.rl=3"])
    assert "section" in section and "group_size" in section


@pytest.mark.parametrize(
    "argv, key, words",
    [
        (["--config.rl.group_size=1"], "rl.group_size", ">= 2"),
        (["--config.mesh.data=2"], "config.mesh", "num_cpu_devices=8"),
        (["--config.cells.num_cells=3"], "cells.num_cells", "divide"),
        (["--config.cells.data=2"], "config.cells", "must equal"),
        (
            ["--config.schedule.policy=elastic", "--config.cells.num_cells=1", "--config.cells.data=8"],
            "schedule.policy",
            "num_cells >= 2",
        ),
        (["--config.schedule.policy=async", "--config.schedule.training_cells=2"], "schedule.training_cells", "[1, 1]"),
        (
            ["--config.schedule.policy=async", "--config.rl.max_staleness=0", "--config.schedule.max_staleness=2"],
            "rl.max_staleness",
            "dispatch bound",
        ),
        (["--config.cells.data=1", "--config.cells.tensor=4"], "model.num_kv_heads", "cannot fit a cell"),
        (
            [
                "--config.cells.data=1",
                "--config.cells.fsdp=4",
                "--config.model.embed_dim=126",
                "--config.model.num_heads=2",
                "--config.model.num_kv_heads=2",
            ],
            "model.embed_dim",
            "cells.fsdp=4",
        ),
        (["--config.schedule.leave_on=never"], "schedule.leave_on", "must be one of"),
        (["--config.trajectory.stream_order=random"], "trajectory.stream_order", "must be one of"),
        (["--config.tokenizer.kind=hf"], "tokenizer.kind", "checkpoint_dir"),
        (["--config.schedule.policy=bogus"], "schedule.policy", "must be one of"),
        (["--config.rl.clip_low=1.0"], "rl.clip_low", "[0, 1)"),
        (["--config.optimizer.learning_rate=inf"], "optimizer.learning_rate", "> 0"),
        (["--config.optimizer.learning_rate=0"], "optimizer.learning_rate", "> 0"),
        (["--config.model.num_kv_heads=3"], "model.num_heads", "multiple"),
        (["--config.model.vocab_size=100"], "model.vocab_size", "byte tokenizer"),
        (["--config.rollout.task_kinds=copy,bogus"], "rollout.task_kinds", "subset"),
        (["--config.serving.max_prefill_length=4096"], "serving.max_prefill_length", "max_seq_len"),
        (["--config.workdir="], "workdir", "non-empty"),
        (["--config.rl.group_size=x"], "rl.group_size", "integer"),
        (["--config.rl.group_size=2.5"], "rl.group_size", "integer"),
        (["--config.metrics.tensorboard=maybe"], "metrics.tensorboard", "boolean"),
        (["--config.optimizer.b1=fast"], "optimizer.b1", "number"),
    ],
)
def test_bad_values_raise_one_line_config_errors_naming_the_key(argv, key, words):
    message = config_error(argv)
    assert key in message and words in message, message


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--config", "no/such/config.py"], "not found"),
        (["--config"], "needs a path"),
        (["--config.rl.group_size"], "needs a value"),
        (["--config.rl.group_size", "--config.seed=1"], "needs a value"),
        (["positional"], "unrecognized argument"),
    ],
)
def test_command_line_errors(argv, words):
    assert words in config_error(argv)


def test_broken_config_files(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config(:\n")
    assert "failed to load" in config_error(["--config", str(broken)])
    no_fn = tmp_path / "nofn.py"
    no_fn.write_text("X = 1\n")
    assert "get_config" in config_error(["--config", str(no_fn)])
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def get_config():\n    return {'seed': 0}\n")
    assert "ConfigDict" in config_error(["--config", str(wrong)])


def test_config_from_dict_applies_python_values_and_validates(base):
    c = config_from_dict(
        base,
        {
            "rl.group_size": 4,
            "optimizer.learning_rate": 1e-4,
            "metrics.tensorboard": False,
            "rollout.task_kinds": ("copy",),
            "workdir": "elsewhere",
        },
    )
    assert (c.rl.group_size, c.optimizer.learning_rate, c.metrics.tensorboard) == (4, 1e-4, False)
    assert c.rollout.task_kinds == ("copy",) and c.workdir == "elsewhere"
    assert base.rl.group_size == 8 and base.workdir != "elsewhere"  # the base is not modified
    with pytest.raises(ConfigError, match="rl.group_size"):
        config_from_dict(base, {"rl.group_size": 1})
    with pytest.raises(ConfigError, match="unknown config key"):
        config_from_dict(base, {"rl.nope": 1})


def test_apply_override_in_place(base):
    c = config_from_dict(base, {})
    apply_override(c, "rl.max_branches", "3")
    assert c.rl.max_branches == 3


def test_argument_to_a_config_without_one_is_a_config_error():
    assert "get_config" in config_error(["--config", "configs/tiny_cpu.py:large"])


def test_tuple_override_with_wrong_element_type_is_a_config_error():
    assert "serving.prefill_buckets" in config_error(["--config.serving.prefill_buckets=abc"])
