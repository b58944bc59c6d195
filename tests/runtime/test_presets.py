"""The GPU / TPU presets in configs/: each loads and validates, names its model preset, and its cells fit the
hosts it is written for (checked with stand-in devices, since this machine has neither GPUs nor TPUs)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from gyre_jax import config as config_lib
from gyre_jax import plan, runtime
from gyre_jax.model.config import QWEN3_1P7B, QWEN3_30B_A3B, QWEN3_235B_A22B

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakes import hosts  # noqa: E402

PRESETS = {
    # file: (platform, hosts, devices per host, model, multi-process, processes holding each cell)
    "configs/gpu_single_host.py": ("gpu", 1, 8, QWEN3_1P7B, False, [[0]] * 4),
    "configs/gpu_cluster.py": ("gpu", 8, 8, QWEN3_30B_A3B, True, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    "configs/gpu_cluster_235b.py": ("gpu", 128, 8, QWEN3_235B_A22B, True, [list(range(k, k + 32)) for k in
                                                                         range(0, 128, 32)]),
    "configs/tpu_pod.py": ("tpu", 16, 4, QWEN3_30B_A3B, True, [list(range(k, k + 4)) for k in range(0, 16, 4)]),
    "configs/tpu_pod_235b.py": ("tpu", 128, 4, QWEN3_235B_A22B, True, [list(range(k, k + 32)) for k in
                                                                      range(0, 128, 32)]),
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(PRESETS))
def test_preset_loads_validates_and_fits_its_hosts(path):
    platform, num_hosts, per_host, model, multi, cell_hosts = PRESETS[path]
    c = config_lib.load_config(["--config", path])  # every section checked, then gyre_jax.config.validate
    assert c.devices.platform == platform
    assert config_lib.device_count(c) == num_hosts * per_host
    assert c.distributed.enabled is multi
    if multi:  # left to JAX's cluster auto-detection (Slurm / Cloud TPU)
        assert (c.distributed.coordinator_address, c.distributed.num_processes, c.distributed.process_id) == ("", 0, -1)
    if platform == "gpu" and multi:  # one process per host drives all its GPUs (not Slurm's one GPU per task)
        assert tuple(c.distributed.local_device_ids) == tuple(range(per_host))

    got = c.model_config()
    run_choices = ("dtype", "param_dtype", "remat_policy", "attention_impl", "logits_chunk")
    assert dataclasses.replace(got, **{k: getattr(model, k) for k in run_choices}) == model
    assert (got.dtype, got.param_dtype) == ("bfloat16", "float32")
    if c.trajectory.row_length > 4096:  # long rows: the attention kernel derives to blockwise, whatever the preset
        assert got.attention_impl == "blockwise" and got.logits_chunk > 0

    devices = hosts(num_hosts, per_host)
    runtime.make_train_mesh(c.mesh.shape(), devices)
    cells = runtime.make_cells(devices, c.cells.num_cells, c.cells.shape())
    assert [list(cell.processes) for cell in cells] == cell_hosts


@pytest.mark.parametrize("path", ["configs/gpu_cluster.py", "configs/tpu_pod.py"])
def test_explicit_launch_values_override_auto_detection(path):
    c = config_lib.load_config(
        [
            "--config",
            path,
            "--config.distributed.coordinator_address=10.0.0.1:8476",
            "--config.distributed.num_processes=4",
            "--config.distributed.process_id=3",
        ]
    )
    assert (c.distributed.coordinator_address, c.distributed.num_processes, c.distributed.process_id) == (
        "10.0.0.1:8476",
        4,
        3,
    )
    with pytest.raises(
        config_lib.ConfigError, match="process_id=4 must be < num_processes=4"
    ):  # the distributed section checks it as it is built
        config_lib.load_config(
            ["--config", path, "--config.distributed.num_processes=4", "--config.distributed.process_id=4"]
        )


@pytest.mark.parametrize("path", [p for p in sorted(PRESETS) if PRESETS[p][4]])
def test_multihost_presets_fit_their_devices_and_one_host_fewer_per_cell_does_not(path, capsys):
    """``python -m gyre_jax.plan`` on each multi-host preset: every cell fits its device's memory (exit 0); the same
    preset with half the hosts per cell (fsdp halved, twice the cells) does not (exit 1): why its cells span the
    hosts they do."""
    assert plan.main(["--config", path]) == 0, capsys.readouterr().out
    assert "fits: every cell's total is within 90%" in capsys.readouterr().out
    c = config_lib.load_config(["--config", path])
    half = [f"--config.cells.fsdp={c.cells.fsdp // 2}", f"--config.cells.num_cells={c.cells.num_cells * 2}",
            f"--config.mesh.fsdp={c.mesh.fsdp // 2}", f"--config.mesh.data={c.mesh.data * 2}"]  # fmt: skip
    assert plan.main(["--config", path, *half]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
