"""``python -m gyre_jax.plan``: per-device bytes from the run's own sharding rules on an abstract mesh (no device
touched), checked against what the rules must give on the tiny model, and its errors."""

from __future__ import annotations

import dataclasses
import json

from gyre_jax import config as config_lib
from gyre_jax import plan
from gyre_jax.model import memory
from gyre_jax.model.rules import RULES_DATA, RULES_FSDP_TENSOR

FOUR = ["--config.devices.num_cpu_devices=4", "--config.mesh.data=1", "--config.mesh.fsdp=4",
        "--config.cells.num_cells=1", "--config.cells.fsdp=4"]  # fmt: skip


def test_replicated_weights_are_the_parameter_count_and_fsdp_divides_them():
    c = config_lib.load_config(FOUR)
    cfg = c.model_config()
    [replicated] = plan.plan(dataclasses.replace(c, sharding_rules=RULES_DATA))
    assert replicated.weights == cfg.num_params * 4  # float32 master weights, on every device
    assert replicated.optimizer == cfg.num_params * memory.ADAM_BYTES and replicated.gathered_layer == 0.0
    [split] = plan.plan(dataclasses.replace(c, sharding_rules=RULES_FSDP_TENSOR))
    # every matrix has an embedding axis (split 4 ways); only the q/k norms' head_dim vectors stay whole
    assert cfg.num_params * 4 / 4 <= split.weights < cfg.num_params * 4 / 3.9
    assert split.gathered_layer > 0  # fsdp > 1: one layer's weights are gathered for its forward and backward
    # the micro-step's rows: 2 rows of 1024 tokens; fsdp=4 does not divide 2, so the rules leave the batch whole and
    # every device computes both rows (as the run lays them out)
    row = memory.train_memory(cfg, c.trajectory.row_length).per_token
    assert c.trajectory.tokens_per_micro_batch == 2 * c.trajectory.row_length and split.tokens == 2 * row
    # KV: 16 decode slots of 1024 tokens, 2 layers, 2 KV heads of 32, float32 keys and values, slots over fsdp
    assert split.decode_slots == 2 * 2 * 16 * 2 * 1024 * 32 * 4 / 4


def test_the_command_prints_the_table_writes_json_and_refuses_bad_configs(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan.main([*FOUR, "--device-gib", "0.05", "--json", str(out)]) == 1  # 50 MiB: the core cannot fit
    text = capsys.readouterr().out
    assert "| **total** |" in text and "DOES NOT FIT" in text
    saved = json.loads(out.read_text())
    assert saved["fits"] is False and saved["cells"][0]["role"] == "core" and saved["cells"][0]["total"] > 0.05 * 2**30
    assert plan.main([*FOUR, "--device-gib", "8"]) == 0 and "fits: every cell" in capsys.readouterr().out
    assert plan.main(FOUR) == 0 and "nothing checked" in capsys.readouterr().out  # no budget known
    assert plan.main(["--config.mesh.fsdp=3"]) == plan.EXIT_USAGE
    assert "error: " in capsys.readouterr().err
