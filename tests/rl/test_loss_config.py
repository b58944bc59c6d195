"""Tests for gyre_jax/rl/loss_config.py and the loss registry of gyre_jax/rl/losses.py: every loss's defaults
stated once (the registry, docs/learner.md's loss table, the run config all agree), one signature, and the run
config's unset hyperparameters (``config.rl.clip_low = None``: the chosen loss's default)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from gyre_jax.config import ConfigError, RLSection, RunConfig, config_from_dict, load_config
from gyre_jax.rl.loss_config import (
    HYPERPARAMETERS,
    LOSS_PARAMS,
    LOSSES,
    GRPOParams,
    GSPOParams,
    LossConfig,
    LossConfigError,
    hyperparameters,
)
from gyre_jax.rl.losses import POLICY_LOSSES, LossInputs, policy_loss, rl_objective

DOCS = Path(__file__).resolve().parents[2] / "docs" / "learner.md"


def docs_loss_table() -> tuple[list[str], list[list[str]]]:
    """docs/learner.md's loss table: (header cells, rows of cells), the table whose header starts ``loss (`rl.loss`)``."""
    lines = DOCS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| loss (`rl.loss`)"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, rule, *rows = table
    assert set("".join(rule)) <= set("-: "), rule
    return header, rows


def _code(cell: str) -> str | None:
    """The name in a cell that starts with a backticked name (``gspo`` (default) -> gspo), else None."""
    m = re.match(r"`([A-Za-z_][A-Za-z_0-9]*)`", cell)
    return m.group(1) if m else None


def test_every_losss_defaults_in_the_registry_equal_docs_learner_md_table():
    header, rows = docs_loss_table()
    columns = {_code(h): i for i, h in enumerate(header) if _code(h)}  # the hyperparameter columns: `clip_low` ...
    assert set(columns) == set(HYPERPARAMETERS), (columns, HYPERPARAMETERS)  # a column for every hyperparameter
    names = [_code(row[0]) for row in rows]
    assert names == list(LOSSES) == list(POLICY_LOSSES), names  # every registered loss has a row, in order
    assert [row[0] for row in rows if "(default)" in row[0]] == [f"`{LossConfig().loss}` (default)"]
    compared = 0
    for name, row in zip(names, rows):
        entry = POLICY_LOSSES[name]
        assert entry.params is LOSS_PARAMS[name] and _code(row[1]) == entry.params.__name__, (name, row[1])
        defaults = entry.params()  # the registry's defaults: the type's field defaults
        taken = {f.name for f in dataclasses.fields(defaults)}
        for key, col in columns.items():
            if key in taken:
                assert float(row[col]) == getattr(defaults, key), (name, key, row[col], getattr(defaults, key))
                compared += 1
            else:
                assert row[col] == "-", (name, key, row[col])
    assert compared == 2 * len(LOSSES)  # clip_low and clip_high of each of the three
    # and the values the docs promise (the bug this table would have caught: GRPO ran with GSPO's clip)
    assert (GRPOParams().clip_low, GRPOParams().clip_high) == (0.2, 0.28)
    assert (GSPOParams().clip_low, GSPOParams().clip_high) == (3e-4, 4e-4)


def test_every_registered_loss_runs_under_the_one_signature_with_its_defaults():
    rng = np.random.default_rng(0)
    seq_index = np.repeat(np.arange(3, dtype=np.int32), 4)[None]  # [1, 12]: 3 sequences of 4 tokens
    logp = rng.uniform(-3.0, -0.1, (1, 12)).astype(np.float32)
    x = LossInputs(logp, logp - 0.05, np.ones((1, 12), np.float32), seq_index, np.array([1.0, -1.0, 0.5]), np.ones(3))
    for name, entry in POLICY_LOSSES.items():
        assert entry.name == name and entry.fn.__name__ == f"{name}_loss"
        loss, metrics = entry.fn(x, entry.params())
        assert np.isfinite(float(loss)) and set(metrics) == {"clip_fraction", "ratio_mean", "weight_sum"}, name
        # rl_objective runs the registered function with LossConfig's params: the same value
        whole, _ = rl_objective(x, LossConfig(name))
        assert float(whole) == pytest.approx(float(loss), rel=1e-6), name
    jitted = jax.jit(POLICY_LOSSES["grpo"].fn, static_argnums=1)  # LossInputs is a pytree, the params static
    assert float(jitted(x, GRPOParams())[0]) == pytest.approx(float(POLICY_LOSSES["grpo"].fn(x, GRPOParams())[0]))
    assert len(jax.tree.leaves(x)) == 6  # the six arrays; ref_logprobs and whole are None


def test_the_registry_refuses_unknown_and_twice_registered_losses():
    with pytest.raises(ValueError, match="LOSS_PARAMS"):
        policy_loss("ppo")(lambda x, p: (0.0, {}))
    with pytest.raises(ValueError, match="registered twice"):
        policy_loss("grpo")(lambda x, p: (0.0, {}))
    assert POLICY_LOSSES["grpo"].fn.__name__ == "grpo_loss"  # unchanged
    with pytest.raises(TypeError):
        POLICY_LOSSES["new"] = POLICY_LOSSES["grpo"]  # read-only outside @policy_loss


def test_hyperparameters_take_the_defaults_for_what_is_unset():
    assert hyperparameters("grpo") == hyperparameters("grpo", clip_low=None, clip_high=None) == GRPOParams()
    assert hyperparameters("grpo", clip_high=0.3) == GRPOParams(0.2, 0.3)
    assert hyperparameters("gspo_token", clip_low=0.1) == GSPOParams(0.1, 4e-4)
    with pytest.raises(LossConfigError, match="is not a hyperparameter of loss 'gspo'"):
        hyperparameters("gspo", temperature=0.5)
    assert hyperparameters("gspo", temperature=None) == GSPOParams()  # unset: nothing to refuse
    with pytest.raises(LossConfigError, match=r"loss='ppo' must be one of \('gspo', 'gspo_token', 'grpo'\)"):
        hyperparameters("ppo")
    e = LossConfigError("behaviour_is_cap", 2.0, "needs {prefix}recompute_behaviour=True")
    assert str(e) == "behaviour_is_cap=2.0 needs recompute_behaviour=True"
    assert e.message("config.rl.") == "config.rl.behaviour_is_cap=2.0 needs config.rl.recompute_behaviour=True"


def test_the_run_config_has_one_unset_key_per_hyperparameter():
    fields = {f.name: f for f in dataclasses.fields(RLSection)}
    for name in HYPERPARAMETERS:
        assert fields[name].default is None, name
    # the other loss settings' defaults are LossConfig's own
    for f in dataclasses.fields(LossConfig):
        if f.name != "params":
            assert fields[f.name].default == f.default, f.name


@pytest.mark.parametrize("loss", LOSSES)
def test_config_rl_loss_alone_gives_that_losss_registered_defaults(loss):
    c = load_config([f"--config.rl.loss={loss}"])
    assert c.rl.clip_low is None and c.rl.clip_high is None  # unset
    assert c.loss_config() == LossConfig(loss) and c.loss_config().params == LOSS_PARAMS[loss]()


def test_config_rl_loss_grpo_trains_with_grpos_clip_not_gspos():
    """The defaults bug of issue 46: ``--config.rl.loss=grpo`` used GSPO's 3e-4 / 4e-4."""
    params = load_config(["--config.rl.loss=grpo"]).loss_config().params
    assert params == GRPOParams(0.2, 0.28) and params != GSPOParams()
    # explicit keys win, in either order; the other key keeps the loss's default
    for argv in (
        ["--config.rl.clip_high=0.3", "--config.rl.loss=grpo"],
        ["--config.rl.loss=grpo", "--config.rl.clip_high=0.3"],
    ):
        assert load_config(argv).loss_config().params == GRPOParams(0.2, 0.3)
    # None, written out, is unset
    c = load_config(["--config.rl.clip_low=None", "--config.rl.loss=grpo"])
    assert c.rl.clip_low is None and c.loss_config().params == GRPOParams()
    # a config file that names the loss and no clip key (the keys it leaves out are filled in unset)
    assert config_from_dict(RunConfig(), {"rl.loss": "grpo"}).loss_config().params == GRPOParams()


def test_unset_keys_survive_the_runs_config_json_and_a_resume_reads_the_same_objective(tmp_path):
    for argv in (["--config.rl.loss=grpo"], ["--config.rl.loss=grpo", "--config.rl.clip_low=0.1"], []):
        c = load_config(argv)
        path = tmp_path / "config.json"
        path.write_text(json.dumps(c.to_dict(), indent=2, default=str))  # what train.py writes
        back = RunConfig.from_config_dict(json.loads(path.read_text()))  # what a resume / audit reads
        assert back == c and back.loss_config() == c.loss_config()
        saved = json.loads(path.read_text())["rl"]
        assert saved["clip_high"] is None and (saved["clip_low"] is None) == ("--config.rl.clip_low=0.1" not in argv)
        if saved["clip_low"] is None:
            assert "clip_low: null" in str(c.to_config_dict())  # printing the config shows it unset


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config.rl.clip_low=1.5"], "config.rl.clip_low=1.5 must be in [0, 1)"),
        (["--config.rl.loss=grpo", "--config.rl.clip_high=-1"], "config.rl.clip_high=-1.0 must be >= 0"),
        (
            ["--config.rl.clip_low=abc"],
            "config.rl.clip_low='abc' must be a number, or unset (None: the loss's default)",
        ),
        (["--config.rl.clip_high=true"], "config.rl.clip_high='true' must be a number"),
        (["--config.rl.loss=ppo"], "config.rl.loss='ppo' must be one of ('gspo', 'gspo_token', 'grpo')"),
        (["--config.rl.behaviour_is_cap=2"], "config.rl.behaviour_is_cap=2.0 needs config.rl.recompute_behaviour=True"),
        (["--config.rl.is_sequence_mask=0.5"], "config.rl.is_sequence_mask=0.5 must be 0 (off) or a cap > 1"),
    ],
)
def test_a_bad_loss_setting_is_one_line_naming_its_config_key(argv, message):
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text, text


def test_loss_config_checks_are_the_only_checks_of_the_loss_settings():
    """RLSection holds no copy of LossConfig's rules: a value LossConfig refuses, the config refuses with the
    same words (prefixed with its key), and the other way round."""
    cases = [
        ({"clip_low": 1.0}, lambda: LossConfig(params=GSPOParams(clip_low=1.0))),
        ({"loss": "grpo", "clip_high": -0.5}, lambda: LossConfig("grpo", GRPOParams(clip_high=-0.5))),
        ({"kl_coef": -0.5}, lambda: LossConfig(kl_coef=-0.5)),
        ({"is_token_mask": 1.0}, lambda: LossConfig(is_token_mask=1.0)),
        ({"behaviour_is_cap": 3.0}, lambda: LossConfig(behaviour_is_cap=3.0)),
    ]
    for rl, build in cases:
        with pytest.raises(LossConfigError) as direct:
            build()
        with pytest.raises(ConfigError) as via_config:
            RLSection(**rl)
        assert str(via_config.value) == direct.value.message("config.rl."), rl
