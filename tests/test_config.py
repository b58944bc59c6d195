"""Tests for gyre_jax/config/: config files, typed command-line overrides, the typed ``RunConfig`` tree
(defaults in one place, each section's own checks, the cross-section rules) and its round trips."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layouts import EIGHT_DEVICES
from ml_collections import config_dict

from gyre_jax import config as config_lib
from gyre_jax.config import (
    DEFAULT_CONFIG,
    ConfigError,
    RunConfig,
    apply_override,
    config_from_dict,
    default_config,
    load_config,
    parse_args,
    validate,
)

# The cross-section checks below are written against 8 virtual devices in 2 cells of 4 (the default run has 2 devices).
EIGHT = EIGHT_DEVICES


@pytest.fixture(scope="module")
def base():
    return load_config(EIGHT)


def config_error(argv) -> str:
    with pytest.raises(ConfigError) as info:
        load_config([*EIGHT, *argv])
    message = str(info.value)
    assert message and "\n" not in message, message  # one line, fit for a terminal
    return message


def test_default_config_loads_and_validates(base):
    validate(base)
    assert base.rl.group_size >= 2 and base.devices.num_cpu_devices == 8
    assert base.mesh.data * base.mesh.fsdp * base.mesh.tensor == 8
    assert isinstance(base.to_dict(), dict)
    default = load_config([])  # the default run: 2 virtual devices, 2 cells of 1
    validate(default)
    assert default.devices.num_cpu_devices == 2 and default.mesh.num_devices == 2
    assert default.cells.num_cells == 2 and default.cells.num_devices == 1


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
        "from gyre_jax.config import default_config\n\n"
        "def get_config(group_size='8'):\n"
        "    c = default_config()\n"
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
    for known in ("group_size", "clip_low", "clip_high", "max_branches", "kl_coef"):
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
            [
                "--config.schedule.policy=async",
                "--config.rl.drop_staleness=0",
                "--config.schedule.dispatch_staleness=2",
            ],
            "rl.drop_staleness",
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
        (["--config.serving.warmup=later"], "serving.warmup", "boolean"),
        (["--config.optimizer.b1=fast"], "optimizer.b1", "number"),
    ],
)
def test_bad_values_raise_one_line_config_errors_naming_the_key(argv, key, words):
    message = config_error(argv)
    assert key in message and words in message, message


def test_serving_warmup_is_on_by_default_and_can_be_turned_on_and_off():
    assert RunConfig().serving.warmup is True  # compile every serving shape when a cell's loop is built
    assert load_config([]).serving.warmup is False  # tiny_cpu.py: many short CPU runs (see its comment)
    assert load_config(["--config.serving.warmup=true"]).serving.warmup is True
    assert config_from_dict(RunConfig(), {"serving.warmup": False}).serving.warmup is False


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
    c = base.to_config_dict()
    apply_override(c, "rl.max_branches", "3")
    assert c.rl.max_branches == 3 and RunConfig.from_config_dict(c).rl.max_branches == 3


def test_argument_to_a_config_without_one_is_a_config_error():
    assert "get_config" in config_error(["--config", "configs/tiny_cpu.py:large"])


def test_tuple_override_with_wrong_element_type_is_a_config_error():
    assert "serving.prefill_buckets" in config_error(["--config.serving.prefill_buckets=abc"])


# -- the typed tree ------------------------------------------------------------------------------------------
SECTIONS = {
    "devices": config_lib.DevicesSection,
    "mesh": config_lib.MeshSection,
    "cells": config_lib.CellsSection,
    "model": config_lib.ModelSection,
    "tokenizer": config_lib.TokenizerSection,
    "serving": config_lib.ServingSection,
    "proxy": config_lib.ProxySection,
    "rollout": config_lib.RolloutSection,
    "rl": config_lib.RLSection,
    "trajectory": config_lib.TrajectorySection,
    "optimizer": config_lib.OptimizerSection,
    "warm_start": config_lib.WarmStartSection,
    "eval": config_lib.EvalSection,
    "schedule": config_lib.ScheduleSection,
    "distributed": config_lib.DistributedSection,
    "metrics": config_lib.MetricsSection,
}


def test_every_section_is_a_typed_frozen_dataclass_at_its_key_path(base):
    assert isinstance(base, RunConfig)
    assert [f.name for f in dataclasses.fields(RunConfig)] == [
        "seed",
        "workdir",
        "total_steps",
        "checkpoint_every",
        "keep_checkpoints",
        "devices",
        "mesh",
        "cells",
        "sharding_rules",
        *list(SECTIONS)[3:],
    ]
    for name, cls in SECTIONS.items():
        section = getattr(base, name)
        assert type(section) is cls and section.key("x") == f"{name}.x"
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, dataclasses.fields(section)[0].name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.seed = 1
    # Field values have their field's type (ints in float fields become floats, sequences tuples).
    assert type(base.optimizer.learning_rate) is float and type(base.rollout.timeout_s) is float
    assert base.serving.prefill_buckets == (128, 256, 512, 1024) and isinstance(base.rollout.task_kinds, tuple)


def test_sections_reuse_the_component_dataclasses_they_are(base):
    from gyre_jax.model.config import ModelConfig
    from gyre_jax.rl.learner import OptimizerConfig, make_optimizer

    assert isinstance(base.optimizer, OptimizerConfig)
    make_optimizer(base.optimizer)  # the section is what the learner takes
    assert isinstance(base.model, ModelConfig) and base.model.num_params > 0
    arch = base.model_config()
    assert type(arch) is ModelConfig and not hasattr(arch, "checkpoint_dir")
    assert all(getattr(arch, f.name) == getattr(base.model, f.name) for f in dataclasses.fields(ModelConfig))


def test_each_component_config_is_derived_by_one_method(base):
    from gyre_jax.elastic.controller import ControllerConfig
    from gyre_jax.rl.losses import GRPOParams, LossConfig
    from gyre_jax.trajectory.pipeline import TrajectoryConfig

    c = config_from_dict(
        base,
        {
            "rl.loss": "grpo",
            "rl.clip_low": 0.2,
            "rl.kl_coef": 0.01,
            "rl.is_token_mask": 2.0,
            "rl.is_sequence_mask": 1.5,
            "rl.drop_staleness": 2,
            "cells.sessions_per_cell": 3,
        },
    )
    assert c.loss_config() == LossConfig(  # clip_high unset: GRPO's own default (it was GSPO's 4e-4 before)
        loss="grpo", params=GRPOParams(0.2, 0.28), kl_coef=0.01, is_token_mask=2.0, is_sequence_mask=1.5
    )
    ctl = c.controller_config()
    assert type(ctl) is ControllerConfig and (ctl.tasks_per_step, ctl.group_size) == (4, 8)
    assert (ctl.sessions_per_cell, ctl.max_branches, ctl.micro_step_slots) == (3, 5, 4 * 8 * 5)
    assert (c.drop_bound, base.drop_bound) == (2, 4)  # the ledger's drop bound (-1: None)
    assert config_from_dict(base, {"rl.drop_staleness": -1}).drop_bound is None
    assert base.controller_config().sessions_per_cell == base.serving.max_concurrent_decodes  # 0: the decode slots
    traj = c.trajectory_config()
    assert type(traj) is TrajectoryConfig and (traj.rows, traj.open_micro_batches, traj.max_branches) == (2, 4, 5)
    assert c.trajectory_config(message_end_id=7).message_end_id == 7
    # The classmethods that read the untyped config are gone: each derivation exists once.
    from gyre_jax.rl.learner import Learner, OptimizerConfig

    for cls in (Learner, TrajectoryConfig, ControllerConfig):
        assert not hasattr(cls, "from_config")
    assert not hasattr(OptimizerConfig, "from_config_dict")


def test_defaults_live_in_the_dataclasses_and_tiny_cpu_is_them():
    # tiny_cpu.py is the defaults but serving.warmup, off there (its comment says why)
    assert load_config(["--config.serving.warmup=true"]) == RunConfig()
    tiny = config_lib.base_config(DEFAULT_CONFIG)
    assert tiny.serving.warmup is False
    tiny.serving.warmup = True
    assert tiny == default_config()
    assert default_config() == RunConfig().to_config_dict()
    # Every field of every section has a default, and the ConfigDict carries every key (so any key can be
    # overridden, with the type of its default), optional ones included.
    for section in (RunConfig, *SECTIONS.values()):
        for f in dataclasses.fields(section):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
    d = default_config()
    assert (d.mesh.expert, d.cells.expert, d.trajectory.open_micro_batches, d.optimizer.schedule) == (
        1,
        1,
        4,
        "constant",
    )
    assert d.model.checkpoint_dir == "" and d.distributed.enabled is False
    assert type(d.optimizer.learning_rate) is float and type(d.rollout.timeout_s) is float
    # The run's optimizer defaults differ from OptimizerConfig's own in the two fields the section sets.
    from gyre_jax.rl.learner import OptimizerConfig

    assert dataclasses.replace(RunConfig().optimizer, learning_rate=1.0, warmup_steps=0).__dict__ == (
        OptimizerConfig(1.0).__dict__
    )


def test_a_file_that_leaves_keys_out_gets_their_defaults_and_overrides_still_reach_them(tmp_path):
    path = tmp_path / "partial.py"
    path.write_text(
        "from ml_collections import config_dict\n\n"
        "def get_config():\n"
        "    c = config_dict.ConfigDict()\n"
        "    c.seed = 3\n"
        "    c.rl = config_dict.ConfigDict()\n"
        "    c.rl.group_size = 4\n"
        "    return c\n"
    )
    c = load_config(["--config", str(path), "--config.distributed.shutdown_timeout_s=5", "--config.mesh.expert=1"])
    assert (c.seed, c.rl.group_size, c.rl.clip_low) == (3, 4, RunConfig().rl.clip_low)
    assert c.distributed.shutdown_timeout_s == 5.0 and c.trajectory == RunConfig().trajectory


def _file(tmp_path, body: str) -> str:
    path = tmp_path / "cfg.py"
    path.write_text(
        "from gyre_jax.config import default_config\n\ndef get_config():\n    c = default_config()\n"
        + "".join(f"    {line}\n" for line in body.splitlines())
        + "    return c\n"
    )
    return str(path)


def test_unknown_keys_in_a_file_are_refused_with_the_known_ones_listed(tmp_path):
    message = config_error(["--config", _file(tmp_path, "c.rl.grup_size = 3")])
    assert "unknown config key 'rl.grup_size'" in message and "group_size" in message and "drop_staleness" in message
    message = config_error(["--config", _file(tmp_path, "c.extra = 1")])
    assert "unknown config key 'extra'" in message and "schedule" in message
    message = config_error(["--config", _file(tmp_path, "c.distributed.coordinatoraddress = 'h:1'")])
    assert "'distributed.coordinatoraddress'" in message and "coordinator_address" in message
    with pytest.raises(ConfigError, match="unknown config key 'serving.slots'"):
        RunConfig.from_config_dict({"serving": {"slots": 3}})


def test_values_of_the_wrong_type_in_a_file_name_the_key(tmp_path):
    # (the defaults' ConfigDict refuses a value of another type itself; a file may build its own ConfigDict)
    path = tmp_path / "typed.py"
    path.write_text(
        "from ml_collections import config_dict\n\n"
        "def get_config():\n"
        "    return config_dict.ConfigDict({'rl': {'group_size': '8'}})\n"
    )
    assert "config.rl.group_size='8' must be an integer" in config_error(["--config", str(path)])
    for values, words in [
        ({"metrics": {"tensorboard": 1}}, "config.metrics.tensorboard=1 must be true or false"),
        (
            {"rollout": {"task_kinds": ("copy", 3)}},
            "config.rollout.task_kinds=('copy', 3) must be a sequence of strings",
        ),
        ({"rollout": {"timeout_s": True}}, "config.rollout.timeout_s=True must be a number"),
        ({"serving": 3}, "config.serving is a section"),
        ({"sharding_rules": (("batch",),)}, "sequence of (logical_axis, mesh_axes) pairs"),
        ({"sharding_rules": (("batch", "pipe"),)}, "'batch' maps to unknown mesh axis 'pipe'"),
    ]:
        with pytest.raises(ConfigError) as info:
            RunConfig.from_config_dict(values)
        assert words in str(info.value), str(info.value)


DROP = (
    "config.rl.max_staleness was renamed: use config.rl.drop_staleness "
    "(the drop bound: executions more policy versions behind are dropped)"
)
DISPATCH = (
    "config.schedule.max_staleness was renamed: use config.schedule.dispatch_staleness "
    "(the dispatch bound eta: executions may start at most this many policy versions ahead)"
)


@pytest.mark.parametrize("old, message", [("rl.max_staleness", DROP), ("schedule.max_staleness", DISPATCH)])
def test_the_old_staleness_keys_are_refused_with_the_new_name(tmp_path, base, old, message):
    assert config_error([f"--config.{old}=2"]) == message
    assert config_error(["--config", _file(tmp_path, f"c.{old} = 2")]) == message
    with pytest.raises(ConfigError) as info:
        config_from_dict(base, {old: 2})
    assert str(info.value) == message
    section, key = old.split(".")
    values = base.to_dict()
    values[section][key] = 2
    with pytest.raises(ConfigError, match="was renamed"):
        RunConfig.from_config_dict(values)
    assert config_lib.RENAMED_KEYS[old][0] in (f"{section}.drop_staleness", f"{section}.dispatch_staleness")


def test_a_removed_key_is_refused_with_what_sets_it_now(tmp_path):
    """``rl.micro_batch_size`` was validated but read by nothing: a key that does nothing is refused."""
    message = config_error(["--config.rl.micro_batch_size=8"])
    assert message == (
        "config.rl.micro_batch_size was removed: micro-batches are config.trajectory.tokens_per_micro_batch "
        "tokens (it did nothing)"
    )
    assert config_error(["--config", _file(tmp_path, "c.rl.micro_batch_size = 8")]) == message


# Each section checks its own fields when it is built: (section, field, bad value, words in the message).
SECTION_CHECKS = [
    ("devices", "platform", "fpga", "config.devices.platform='fpga' must be one of"),
    ("devices", "num_cpu_devices", 0, "config.devices.num_cpu_devices=0 must be >= 1"),
    ("mesh", "fsdp", 0, "config.mesh.fsdp=0 must be >= 1"),
    ("mesh", "expert", 0, "config.mesh.expert=0 must be >= 1"),
    ("cells", "num_cells", 0, "config.cells.num_cells=0 must be >= 1"),
    ("cells", "tensor", 0, "config.cells.tensor=0 must be >= 1"),
    ("cells", "sessions_per_cell", -1, "config.cells.sessions_per_cell=-1 must be >= 0"),
    ("model", "num_layers", 0, "config.model.num_layers=0 must be >= 1"),
    ("model", "head_dim", 31, "config.model.head_dim=31 must be even"),
    ("model", "dtype", "float16", "config.model.dtype='float16' must be one of"),
    ("model", "remat_policy", "everything", "config.model.remat_policy='everything' must be one of"),
    ("model", "attention_impl", "blockwise", None),
    ("model", "attention_impl", "flash", "config.model.attention_impl='flash' must be one of ('xla', 'cudnn', 'bl"),
    ("model", "attention_block_q", 0, "config.model.attention_block_q=0 must be >= 1"),
    ("model", "checkpoint_dir", "/no/such/dir", "has no config.json"),
    (
        "tokenizer",
        "kind",
        "sentencepiece",
        "config.tokenizer.kind='sentencepiece' must be one of ('byte', 'hf', 'gguf')",
    ),
    ("tokenizer", "tools_format", "xml", "config.tokenizer.tools_format='xml' must be one of"),
    ("serving", "max_concurrent_decodes", 0, "config.serving.max_concurrent_decodes=0 must be >= 1"),
    ("serving", "max_seq_len", 8, "config.serving.max_seq_len=8 must be >= 16"),
    ("serving", "prefill_buckets", (256, 128), "must be a non-empty increasing sequence"),
    ("serving", "prefill_buckets", (64, 128), "the largest bucket must be >="),
    ("serving", "page_size", 48, "config.serving.page_size=48 must be >= 1 and divide"),
    ("serving", "kv_pages", -1, "config.serving.kv_pages=-1 must be >= 0"),
    ("serving", "on_weight_update", "drop", "config.serving.on_weight_update='drop' must be"),
    ("serving", "reuse_stale_kv", True, None),  # valid alone; with on_weight_update=recompute: below
    ("proxy", "port", 70000, "config.proxy.port=70000 must be in [0, 65535]"),
    ("proxy", "max_request_bytes", 10, "config.proxy.max_request_bytes=10 must be >= 1024"),
    ("rollout", "suite", "swe", "expected 'builtin', 'harbor:"),
    ("rollout", "suite", "harbor:/no/such/dir", None),  # the name only: the builder reads the suite (below)
    ("rollout", "harness", "cursor", "unknown harness 'cursor'"),
    ("rollout", "harness", "command", "needs rollout.harness_cmd"),
    ("rollout", "harness_cmd", "echo {nope}", "placeholder {nope} in argv is not filled"),
    ("rollout", "harness_env", ("NOEQ",), "must be 'KEY=VALUE'"),
    ("rollout", "sandbox", "vm", "config.rollout.sandbox='vm' must be one of"),
    ("rollout", "heldout_fraction", 1.0, "heldout_fraction=1.0 must be in [0, 1)"),
    ("rollout", "alphabet", "greek", "config.rollout.alphabet='greek' must be one of"),
    ("rollout", "input_min_len", 3, "must satisfy 1 <= min <= max"),
    ("rollout", "num_tasks", -1, "config.rollout.num_tasks=-1 must be >= 0"),
    ("rollout", "tasks_per_step", 0, "config.rollout.tasks_per_step=0 must be >= 1"),
    ("rollout", "timeout_s", 0.0, "config.rollout.timeout_s=0.0 must be > 0"),
    ("rollout", "max_tokens_per_call", 0, "config.rollout.max_tokens_per_call=0 must be >= 1"),
    ("rollout", "temperature", 0.0, "RL needs sampling"),
    ("rollout", "tool_latency_sigma", -1.0, "config.rollout.tool_latency_sigma=-1.0 must be >= 0"),
    ("rl", "loss", "ppo", "config.rl.loss='ppo' must be one of"),
    ("rl", "group_size", 1, "config.rl.group_size=1 must be >= 2"),
    ("rl", "clip_high", -0.1, "config.rl.clip_high=-0.1 must be >= 0"),
    ("rl", "max_branches", 0, "config.rl.max_branches=0 must be >= 1"),
    ("rl", "kl_coef", -1.0, "config.rl.kl_coef=-1.0 must be >= 0"),
    ("rl", "behaviour_is_cap", 2.0, "needs config.rl.recompute_behaviour=True"),
    ("rl", "is_token_mask", 1.0, "config.rl.is_token_mask=1.0 must be 0 (off) or a cap > 1"),
    ("rl", "is_token_mask", -2.0, "config.rl.is_token_mask=-2.0 must be 0 (off) or a cap > 1"),
    ("rl", "is_sequence_mask", 0.5, "config.rl.is_sequence_mask=0.5 must be 0 (off) or a cap > 1"),
    ("rl", "drop_staleness", -2, "config.rl.drop_staleness=-2 must be >= 0 (or -1: no bound)"),
    ("rl", "micro_steps_per_step", -1, "config.rl.micro_steps_per_step=-1 must be >= 0"),
    ("trajectory", "packing", "dense", "config.trajectory.packing='dense' must be 'tree' or 'plain'"),
    ("trajectory", "tokens_per_micro_batch", 1500, "must be a positive multiple of"),
    ("trajectory", "open_micro_batches", 0, "config.trajectory.open_micro_batches=0 must be >= 1"),
    ("trajectory", "max_sequences_per_micro_batch", 0, "max_sequences_per_micro_batch=0 must be >= 1"),
    ("trajectory", "stream_order", "random", "config.trajectory.stream_order='random' must be one of"),
    ("optimizer", "learning_rate", 0.0, "config.optimizer.learning_rate=0.0 must be > 0"),
    ("optimizer", "b2", 1.0, "must be in [0, 1)"),
    ("optimizer", "weight_decay", -1.0, "config.optimizer.weight_decay=-1.0 must be >= 0"),
    ("optimizer", "grad_clip_norm", 0.0, "config.optimizer.grad_clip_norm=0.0 must be > 0"),
    ("optimizer", "schedule", "cosine", "needs config.optimizer.decay_steps >= 1"),
    ("optimizer", "schedule", "step", "config.optimizer.schedule='step' must be one of"),
    ("optimizer", "min_lr_ratio", 2.0, "config.optimizer.min_lr_ratio=2.0 must be in [0, 1]"),
    ("serving", "decode_steps", 0, "config.serving.decode_steps=0 must be >= 1"),
    ("serving", "decode_lookahead", 0, "config.serving.decode_lookahead=0 must be >= 1"),
    ("serving", "kv_layout", "radix", "config.serving.kv_layout='radix' must be one of ('dense', 'paged')"),
    ("warm_start", "steps", -1, "config.warm_start.steps=-1 must be >= 0"),
    ("warm_start", "target_loss", -0.5, "config.warm_start.target_loss=-0.5 must be >= 0"),
    ("warm_start", "batch_size", 0, "config.warm_start.batch_size=0 must be >= 1"),
    ("warm_start", "learning_rate", 0.0, "config.warm_start.learning_rate=0.0 must be > 0"),
    ("warm_start", "schedule", "step", "config.warm_start.schedule='step' must be one of"),
    ("warm_start", "min_lr_ratio", -0.5, "config.warm_start.min_lr_ratio=-0.5 must be in [0, 1]"),
    ("eval", "split", "test", "config.eval.split='test' must be one of ('train', 'heldout', 'both')"),
    ("eval", "num_tasks", 0, "config.eval.num_tasks=0 must be >= 1"),
    ("eval", "samples_per_task", -1, "(0 disables eval)"),
    ("schedule", "policy", "bogus", "config.schedule.policy='bogus' must be one of"),
    ("schedule", "dispatch_staleness", -1, "config.schedule.dispatch_staleness=-1 must be >= 0"),
    ("schedule", "leave_on", "never", "config.schedule.leave_on='never' must be one of"),
    ("schedule", "idle_before_return_s", -1.0, "config.schedule.idle_before_return_s=-1.0 must be >= 0"),
    ("schedule", "partial_rollouts", True, "config.schedule.partial_rollouts=True: not supported yet in real runs"),
    ("schedule", "admission", "shortest", "config.schedule.admission='shortest' must be one of"),
    ("distributed", "coordinator_address", "localhost", "must be 'host:port'"),
    ("distributed", "num_processes", -1, "config.distributed.num_processes=-1 must be >= 1, or 0 to auto-detect"),
    ("distributed", "process_id", -2, "config.distributed.process_id=-2 must be >= 0, or -1"),
    ("distributed", "local_device_ids", (0, 0), "must be distinct device ids"),
    ("distributed", "heartbeat_timeout_s", 0.5, "heartbeat_timeout_s=0.5 must be a number of seconds >= 1"),
    ("distributed", "num_processes", 2, "config.distributed.enabled is false; set enabled=true"),
    ("metrics", "tensorboard", "yes", "config.metrics.tensorboard='yes' must be true or false"),
]


@pytest.mark.parametrize("section, key, value, words", SECTION_CHECKS, ids=lambda x: str(x)[:30])
def test_each_section_checks_its_own_fields_when_built(base, section, key, value, words):
    current = getattr(base, section)
    if words is None:
        dataclasses.replace(current, **{key: value})
        return
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(current, **{key: value})  # the section alone: no other section is needed
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    # The same error stops a whole config, built from a file or overrides.
    with pytest.raises(ConfigError) as info:
        RunConfig.from_config_dict({section: {key: value}})
    assert words in str(info.value)


def test_the_config_names_the_suite_and_the_run_builder_loads_it():
    """A config is data: building it reads no file, so a suite that is not there is still a well-formed config; the
    run's builder (``build.make_suite``, which ``python -m gyre_jax.train`` calls before any work) loads it and
    refuses it with one line naming the key (tests/test_train.py: exit 2 before any work)."""
    from gyre_jax import build

    config = load_config(["--config.rollout.suite=harbor:/no/such/dir", "--config.warm_start.steps=0"])
    assert config.rollout.suite == "harbor:/no/such/dir"
    with pytest.raises(ConfigError) as info:
        build.make_suite(config)
    message = str(info.value)
    assert message.startswith("config.rollout.suite='harbor:/no/such/dir': ") and "\n" not in message
    assert "suite directory /no/such/dir does not exist" in message


def test_every_section_has_its_own_checks():
    checked = {section for section, *_ in SECTION_CHECKS}
    assert checked == set(SECTIONS)
    with pytest.raises(ConfigError, match="contradicts on_weight_update='recompute'"):
        config_lib.ServingSection(on_weight_update="recompute", reuse_stale_kv=True)
    with pytest.raises(ConfigError, match="process_id=2 must be < num_processes=2"):
        config_lib.DistributedSection(enabled=True, num_processes=2, process_id=2)


# Rules across sections, checked by validate() once every section is valid: (overrides, words).
CROSS_SECTION = [
    ({"mesh.data": 2}, "must equal config.devices.num_cpu_devices=8"),
    ({"cells.num_cells": 3}, "config.cells.num_cells=3 must divide the 8 devices"),
    ({"cells.data": 2}, "must equal the 4 devices of each of the 2 cells"),
    ({"cells.data": 1, "cells.tensor": 4}, "config.model.num_kv_heads=2 does not split over config.cells.tensor=4"),
    ({"cells.data": 1, "cells.fsdp": 4, "model.embed_dim": 126}, "config.model.embed_dim=126 does not split"),
    (
        {
            **{"mesh.data": 2, "mesh.expert": 2, "cells.data": 2, "cells.expert": 2},
            **{"model.num_experts": 3, "model.num_experts_per_tok": 1, "model.moe_mlp_dim": 64},
        },
        "config.model.num_experts=3 does not split over config.cells.expert=2",
    ),
    ({"model.vocab_size": 100}, "config.model.vocab_size=100 must be >= 265 for the byte tokenizer"),
    ({"tokenizer.kind": "hf"}, "needs config.model.checkpoint_dir"),
    (
        {"rollout.max_tokens_per_call": 1024},
        "config.rollout.max_tokens_per_call=1024 must be in [1, serving.max_seq_len",
    ),
    (  # a row length set apart from the serving length (derived, it follows serving.max_seq_len)
        {"serving.max_seq_len": 2048, "trajectory.row_length": 1024},
        "config.trajectory.row_length=1024 must be >= serving.max_seq_len=2048",
    ),
    ({"rollout.num_tasks": 0}, "config.eval.split='both' evaluates the training set, which needs a fixed one"),
    (
        {"schedule.policy": "elastic", "cells.num_cells": 1, "cells.data": 8},
        "config.schedule.policy='elastic' needs config.cells.num_cells >= 2",
    ),
    (
        {"schedule.policy": "async", "rl.drop_staleness": 1, "schedule.dispatch_staleness": 2},
        "config.rl.drop_staleness=1 (the drop bound) must be >= config.schedule.dispatch_staleness=2",
    ),
    ({"schedule.training_cells": 2}, "config.schedule.training_cells=2 must be 0 (half the cells) or in [1, 1]"),
    ({"distributed.enabled": True}, "config.distributed.num_processes must be set on cpu"),
    ({"distributed.enabled": True, "distributed.num_processes": 3}, "must be a multiple of"),
    (
        {"distributed.enabled": True, "distributed.num_processes": 2, "distributed.local_device_ids": (0,)},
        "leave it () on cpu",
    ),
]


@pytest.mark.parametrize("overrides, words", CROSS_SECTION, ids=lambda x: str(x)[:40])
def test_cross_section_rules(base, overrides, words):
    changes: dict[str, dict] = {}
    for key, value in overrides.items():
        section, field = key.split(".")
        changes.setdefault(section, {})[field] = value
    for section, fields in changes.items():  # each section alone is valid
        dataclasses.replace(getattr(base, section), **fields)
    with pytest.raises(ConfigError) as info:
        config_from_dict(base, overrides)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_cross_section_rules_hold_for_replaced_configs_too(base):
    # dataclasses.replace re-validates: a RunConfig is always a valid config.
    c = dataclasses.replace(base, rl=dataclasses.replace(base.rl, group_size=4))
    assert c.rl.group_size == 4 and base.rl.group_size == 8
    with pytest.raises(ConfigError, match="num_cpu_devices=8"):
        dataclasses.replace(base, mesh=dataclasses.replace(base.mesh, data=2))
    # The drop bound may be below the dispatch bound only when nothing is dispatched ahead (colocated) ...
    assert config_from_dict(base, {"rl.drop_staleness": 0, "schedule.dispatch_staleness": 2}).rl.drop_staleness == 0
    # ... or when there is no drop bound.
    unbounded = {"schedule.policy": "elastic", "rl.drop_staleness": -1, "schedule.dispatch_staleness": 3}
    assert config_from_dict(base, unbounded).schedule.dispatch_staleness == 3


def test_policy_options_come_from_the_schedule_section(base):
    assert config_lib.policy_options(base) == {}
    a = config_from_dict(base, {"schedule.policy": "async", "schedule.dispatch_staleness": 2})
    assert config_lib.policy_options(a) == {"dispatch_staleness": 2} == a.schedule.policy_options()
    e = config_from_dict(base, {"schedule.policy": "elastic", "schedule.idle_before_return_s": 3})
    assert e.schedule.policy_options() == {
        "dispatch_staleness": 1,
        "leave_on": "waterlevel",
        "idle_before_return_s": 3.0,
    }
    from gyre_jax.elastic.policies import make_policy

    for c in (base, a, e):
        make_policy(c.schedule.policy, c.cells.num_cells, **config_lib.policy_options(c))


def test_the_config_constants_are_the_components_own():
    from gyre_jax.elastic.ledger import STREAM_ORDERS
    from gyre_jax.elastic.policies import ElasticPolicy
    from gyre_jax.model.sharding import ALL_MESH_AXES
    from gyre_jax.rl.learner import SCHEDULES
    from gyre_jax.rl.losses import POLICY_LOSSES
    from gyre_jax.trajectory.pipeline import PACKING

    assert set(config_lib.LOSSES) == set(POLICY_LOSSES) and config_lib.STREAM_ORDERS == STREAM_ORDERS
    assert set(config_lib.LEAVE_RULES) == set(ElasticPolicy.LEAVE_RULES)
    assert config_lib.training.PACKINGS == PACKING and config_lib.training.SCHEDULES == SCHEDULES
    assert config_lib.MESH_AXES + config_lib.OPTIONAL_MESH_AXES == tuple(ALL_MESH_AXES)


@pytest.mark.parametrize("path", ["configs/gpu_single_host.py", "configs/gpu_cluster.py", "configs/tpu_pod.py"])
def test_presets_load_on_the_defaults(path):
    c = load_config(["--config", path])
    assert c.devices.platform in ("gpu", "tpu") and c.model.dtype == "bfloat16" and c.warm_start.steps == 0
    assert c.rl.group_size == 16 and c.rl.drop_staleness == RunConfig().rl.drop_staleness  # the rest: defaults
    assert c.serving.warmup is True  # the default, not tiny_cpu.py's CPU-only choice: no first-request compiles
    assert RunConfig.from_config_dict(c.to_config_dict()) == c


def test_to_dict_is_json_and_reads_back(base):
    d = base.to_dict()
    assert json.loads(json.dumps(d)) == d  # plain JSON types: tuples are lists
    assert d["rl"]["drop_staleness"] == 4 and d["schedule"]["dispatch_staleness"] == 1
    assert "max_staleness" not in d["rl"] and "max_staleness" not in d["schedule"]
    assert RunConfig.from_config_dict(d) == base
    assert RunConfig.from_config_dict(config_dict.ConfigDict(d)) == base


# -- round trips over sampled valid configs --------------------------------------------------------------------
def factors(n: int) -> list[tuple[int, int, int]]:
    """Every (data, fsdp, tensor) with data * fsdp * tensor == n."""
    return [(a, b, n // (a * b)) for a in range(1, n + 1) for b in range(1, n + 1) if n % (a * b) == 0]


@st.composite
def valid_overrides(draw) -> dict:
    """Overrides of the default config that make a valid config (every section touched)."""
    o: dict = {}
    o["seed"] = draw(st.integers(-(2**31), 2**31))
    o["workdir"] = draw(st.text("abcxyz_/-.", min_size=1, max_size=12))
    o["total_steps"], o["checkpoint_every"] = draw(st.integers(0, 500)), draw(st.integers(1, 50))
    o["devices.num_cpu_devices"] = 8
    o["mesh.data"], o["mesh.fsdp"], o["mesh.tensor"] = draw(st.sampled_from(factors(8)))
    num_cells = draw(st.sampled_from([1, 2, 4, 8]))
    per_cell = [f for f in factors(8 // num_cells) if f[2] <= 2]  # the model's 2 KV heads split over tensor
    o["cells.num_cells"] = num_cells
    o["cells.data"], o["cells.fsdp"], o["cells.tensor"] = draw(st.sampled_from(per_cell))
    o["cells.sessions_per_cell"] = draw(st.integers(0, 64))
    o["model.dtype"] = draw(st.sampled_from(config_lib.DTYPES))
    o["model.rope_theta"] = draw(st.floats(1.0, 1e7))
    seq = draw(st.sampled_from([256, 512, 1024, 2048]))
    o["serving.max_seq_len"], o["serving.page_size"] = seq, draw(st.sampled_from([8, 16, 32]))
    o["serving.max_prefill_length"] = prefill = draw(st.integers(1, seq))
    o["serving.prefill_buckets"] = tuple(sorted({prefill, *draw(st.lists(st.integers(1, seq), max_size=3))}))
    o["serving.on_weight_update"] = draw(st.sampled_from(["continue", "recompute"]))
    o["serving.reuse_stale_kv"] = o["serving.on_weight_update"] == "continue" and draw(st.booleans())
    o["proxy.port"] = draw(st.integers(0, 65535))
    o["rollout.task_kinds"] = tuple(draw(st.lists(st.sampled_from(config_lib.TASK_KINDS), min_size=1, max_size=3)))
    o["rollout.max_tokens_per_call"] = draw(st.integers(1, seq - 1))
    o["rollout.temperature"] = draw(st.floats(0.01, 2.0))
    o["rollout.num_tasks"] = draw(st.integers(1, 100))
    o["rl.loss"] = draw(st.sampled_from(config_lib.LOSSES))
    o["rl.group_size"], o["rl.clip_low"] = draw(st.integers(2, 64)), draw(st.floats(0.0, 0.99))
    o["rl.recompute_behaviour"] = draw(st.booleans())
    o["rl.behaviour_is_cap"] = draw(st.floats(0.0, 5.0)) if o["rl.recompute_behaviour"] else 0.0
    o["rl.is_token_mask"] = draw(st.sampled_from([0.0, 1.5, 2.0, 10.0]))
    o["rl.is_sequence_mask"] = draw(st.sampled_from([0.0, 1.01, 3.0]))
    o["rl.drop_staleness"] = drop = draw(st.integers(-1, 8))
    o["schedule.policy"] = draw(st.sampled_from(config_lib.POLICIES if num_cells >= 2 else ("colocated",)))
    o["schedule.dispatch_staleness"] = draw(st.integers(0, drop if drop >= 0 else 8))
    o["schedule.training_cells"] = draw(st.integers(0, num_cells - 1))
    o["schedule.leave_on"] = draw(st.sampled_from(config_lib.LEAVE_RULES))
    o["trajectory.row_length"] = row = seq * draw(st.integers(1, 2))
    o["trajectory.tokens_per_micro_batch"] = row * draw(st.integers(1, 4))
    o["trajectory.stream_order"] = draw(st.sampled_from(config_lib.STREAM_ORDERS))
    o["optimizer.schedule"] = draw(st.sampled_from(["constant", "cosine", "linear"]))
    o["optimizer.decay_steps"] = draw(st.integers(1, 1000))
    o["optimizer.learning_rate"] = draw(st.floats(1e-7, 1.0))
    o["warm_start.steps"] = draw(st.integers(0, 100))
    o["eval.split"] = draw(st.sampled_from(["train", "heldout", "both"]))
    n = draw(st.sampled_from([1, 2, 4, 8]))
    o["distributed.enabled"] = draw(st.booleans())
    o["distributed.num_processes"] = n if o["distributed.enabled"] else draw(st.sampled_from([0, 1]))
    o["distributed.process_id"] = draw(st.integers(-1, max(o["distributed.num_processes"] - 1, 0)))
    o["distributed.coordinator_address"] = draw(st.sampled_from(["", "10.0.0.1:1234", "host:8476"]))
    o["metrics.tensorboard"] = draw(st.booleans())
    return o


@settings(max_examples=40, deadline=None)
@given(valid_overrides())
def test_round_trip_of_sampled_valid_configs(overrides):
    cfg = config_from_dict(default_config(), overrides)
    assert RunConfig.from_config_dict(cfg.to_config_dict()) == cfg
    assert RunConfig.from_config_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # the run's config.json
    assert config_from_dict(cfg, {}) == cfg
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        got = getattr(getattr(cfg, section) if section else cfg, field)
        assert got == (float(value) if isinstance(got, float) else value), key


def test_a_paged_pool_holds_one_session_and_routing_replay_needs_the_dense_layout(base):
    with pytest.raises(ConfigError, match="raise serving.kv_pages to >= 64"):
        dataclasses.replace(base.serving, kv_layout="paged", kv_pages=10)  # 160 tokens < max_seq_len=1024
    dataclasses.replace(base.serving, kv_layout="paged", kv_pages=64)
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_mlp_dim": 32}
    with pytest.raises(ConfigError, match="not supported yet: config.rl.routing_replay='replay' with"):
        RunConfig.from_config_dict(
            {"serving": {"kv_layout": "paged"}, "rl": {"routing_replay": "replay"}, "model": moe}
        )


def test_one_key_sets_the_context_length_and_the_others_derive_from_it_unless_set():
    """``model.max_context`` (docs/harnesses.md, "The context length"): serving.max_seq_len, trajectory.row_length,
    trajectory.tokens_per_micro_batch and model.attention_impl derive from it; a key set keeps its value."""
    from gyre_jax.config import load_config

    def lengths(*args):
        c = load_config(list(args))
        return (c.serving.max_seq_len, c.trajectory.row_length, c.trajectory.tokens_per_micro_batch,
                c.model.attention_impl)  # fmt: skip

    assert lengths() == (1024, 1024, 2048, "xla")  # the defaults, as before the key existed
    assert lengths("--config.model.max_context=4096") == (4096, 4096, 4096, "xla")
    assert lengths("--config.model.max_context=65536") == (65536, 65536, 65536, "blockwise")  # dense masks: too big
    assert lengths("--config.model.max_context=65536", "--config.model.attention_impl=xla")[3] == "xla"  # set: kept
    assert lengths("--config.model.max_context=8192", "--config.trajectory.row_length=16384") == (
        8192, 16384, 16384, "blockwise")  # fmt: skip
    assert lengths("--config.serving.max_seq_len=2048") == (2048, 2048, 2048, "xla")  # the row follows serving
    # presets that set the keys themselves keep their values
    assert lengths("--config", "configs/xlong_cpu.py") == (36864, 36864, 36864, "blockwise")
    assert lengths("--config", "configs/gpu_single_host.py") == (32768, 32768, 32768, "blockwise")
    # the kernel follows the training rows, however they were set (a row set past max_context: blockwise)
    assert lengths("--config.trajectory.row_length=8192", "--config.serving.max_seq_len=8192") == (
        8192, 8192, 8192, "blockwise")  # fmt: skip
    # the config as written keeps the keys to derive: a later max_context reaches them (config files, overrides)
    c = load_config(["--config.model.max_context=8192"])
    written = c.to_config_dict()
    assert (written.serving.max_seq_len, written.trajectory.row_length, written.model.attention_impl) == (0, 0, "auto")
    assert config_from_dict(c, {"model.max_context": 2048}).serving.max_seq_len == 2048
    assert RunConfig.from_config_dict(json.loads(json.dumps(c.to_dict()))) == c  # config.json: derived values
    with pytest.raises(ConfigError, match=r"config.model.max_context=1000 \(serving.max_seq_len derives from it\): "
                                          r"config.serving.page_size=16 must be >= 1 and divide"):  # fmt: skip
        load_config(["--config.model.max_context=1000"])
    with pytest.raises(ConfigError, match="config.model.max_context=8 must be >= 16"):
        load_config(["--config.model.max_context=8"])


def test_sandbox_visible_paths_are_absolute_and_bwrap_only():
    from gyre_jax.config import load_config

    c = load_config(
        ['--config.rollout.sandbox_visible_paths=("/tmp/venv", "/opt/agent")', "--config.rollout.sandbox=bwrap"]
    )
    assert c.rollout.sandbox_visible_paths == ("/tmp/venv", "/opt/agent")
    with pytest.raises(ConfigError, match="entry 'venv' must be an absolute host path"):
        load_config(["--config.rollout.sandbox_visible_paths=venv"])
    with pytest.raises(
        ConfigError, match="not supported yet: config.rollout.sandbox_visible_paths with sandbox='docker'"
    ):
        load_config(["--config.rollout.sandbox_visible_paths=/tmp/venv", "--config.rollout.sandbox=docker"])


def test_tuple_keys_on_the_command_line_a_comma_inside_a_value_needs_the_literal_form():
    """docs/harnesses.md, "Tuple keys on the command line": bare text splits at commas; a Python literal keeps them."""
    from gyre_jax.config import load_config

    c = load_config(["--config.rollout.harness_env=A=1,B=2"])
    assert c.rollout.harness_env == ("A=1", "B=2")
    c = load_config(["--config.rollout.harness_env=('FLAGS=--a,--b', 'B=2')"])
    assert c.rollout.harness_env == ("FLAGS=--a,--b", "B=2")
    c = load_config(['--config.rollout.harness_env=("ONE=x,y",)'])
    assert c.rollout.harness_env == ("ONE=x,y",)
    with pytest.raises(ConfigError, match=r"entry 'y' must be 'KEY=VALUE'.*a comma inside a value"):
        load_config(["--config.rollout.harness_env=ONE=x,y"])
