"""Tests for gyre_jax/sim/cost_model.py: the JSON format, validation, roofline numbers, fitting to
measurements."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gyre_jax.sim.config import cost_model, preset
from gyre_jax.sim.cost_model import CostModel, CostModelError, fit_cost_model


@pytest.fixture(scope="module")
def cm():
    return cost_model(preset("deepswe"))


def test_json_round_trip(tmp_path, cm):
    path = tmp_path / "cost.json"
    cm.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "gyre-jax/cost-model" and data["version"] == 1
    assert set(data) == {"format", "version", "source", "serving", "training", "switch", "pipeline"}
    assert CostModel.load(path) == cm


def test_bad_files_say_what_is_wrong(tmp_path, cm):
    good = cm.to_dict()
    cases = [
        ({**good, "format": "other"}, "not a cost model"),
        ({**good, "version": 7}, "version 7"),
        ({k: v for k, v in good.items() if k != "switch"}, "missing section 'switch'"),
        ({**good, "serving": {**good["serving"], "decode_speed": 1.0}}, r"unknown field\(s\) \['decode_speed'\]"),
        (
            {**good, "serving": {k: v for k, v in good["serving"].items() if k != "decode_base_s"}},
            "missing.*decode_base_s",
        ),
        (
            {**good, "serving": {**good["serving"], "slots_per_replica": 2.5}},
            "slots_per_replica=2.5 must be an integer",
        ),
        ({**good, "serving": {**good["serving"], "decode_base_s": "fast"}}, "decode_base_s='fast' must be a number"),
        ({**good, "switch": {**good["switch"], "weight_sync_s": -1.0}}, "weight_sync_s=-1.0 must be >= 0"),
        (
            {**good, "training": {**good["training"], "scaling_exponent": 1.5}},
            r"scaling_exponent=1.5 must be in \[0.5, 1\]",
        ),
    ]
    for data, message in cases:
        with pytest.raises(CostModelError, match=message):
            CostModel.from_dict(data)
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(CostModelError, match="not valid JSON"):
        CostModel.load(path)


def test_roofline_costs_grow_with_load_and_size(cm):
    s, t = cm.serving, cm.training
    assert s.decode_step_s(8, 0) > s.decode_step_s(1, 0) > 0
    assert s.decode_step_s(8, 1e6) > s.decode_step_s(8, 1e5)
    assert s.prefill_s(1000, 100_000) > s.prefill_s(1000, 0) > s.prefill_s(10, 0)
    assert t.branch_flops(2e5) > 2 * t.branch_flops(1e5)  # attention: a long branch costs more than its share
    assert t.cell_flops(64) < 2 * t.cell_flops(32)  # sublinear scaling across cell sizes
    # 122B FP8 on 8 accelerators at 50% of 3.35 TB/s: ~9 ms to read the weights, plus 5 ms overhead
    assert s.decode_base_s == pytest.approx(0.005 + 122e9 / (8 * 3.35e12 * 0.5))


def test_fit_recovers_costs_from_measurements(cm):
    rng = np.random.default_rng(0)
    true_decode = (0.012, 3e-4, 2e-8)
    batch = rng.integers(1, 32, 50)
    ctx = rng.uniform(0, 2e6, 50)
    decode = [[b, x, true_decode[0] + true_decode[1] * b + true_decode[2] * x] for b, x in zip(batch, ctx)]
    new = rng.integers(10, 4000, 40)
    pctx = rng.uniform(0, 1e5, 40)
    prefill = [[q, c, 0.01 + 2e-5 * q + 1e-10 * q * c] for q, c in zip(new, pctx)]
    flops = rng.uniform(1e14, 1e16, 30)
    micro = [[f, 0.3 + f / 4e15] for f in flops]
    fitted = fit_cost_model(
        {
            "decode_steps": decode,
            "prefills": prefill,
            "micro_steps": micro,
            "cell_accelerators": 16,
            "optimizer_steps": [2.0, 4.0],
            "serving_to_training": [5.0],
            "source": "unit test",
        },
        cm,
    )
    s, t = fitted.serving, fitted.training
    assert (s.decode_base_s, s.decode_per_seq_s, s.decode_per_context_token_s) == pytest.approx(true_decode, rel=1e-6)
    assert (s.prefill_base_s, s.prefill_per_token_s, s.prefill_per_token_context_s) == pytest.approx(
        (0.01, 2e-5, 1e-10), rel=1e-6
    )
    assert t.micro_step_overhead_s == pytest.approx(0.3) and t.cell_flops(16) == pytest.approx(4e15)
    assert t.optimizer_step_s == 3.0 and fitted.switch.serving_to_training_s == 5.0
    assert fitted.switch.training_to_serving_s == cm.switch.training_to_serving_s  # not measured: kept
    assert fitted.source == "measured: unit test"
    with pytest.raises(CostModelError, match="decode_steps needs at least 3 samples"):
        fit_cost_model({"decode_steps": decode[:2]}, cm)
    with pytest.raises(CostModelError, match="do not grow with their FLOPs"):
        fit_cost_model({"micro_steps": [[1e15, 2.0], [2e15, 1.0], [3e15, 0.5]]}, cm)


def test_moves_between_cells_take_their_bytes_over_the_hosts_the_cells_span():
    """Cells over hosts (issue 43): weight syncs, a satellite's gradients and KV moves scale with the bytes moved and
    inversely with the hosts a cell spans; the presets derive them (cluster.host_bandwidth) unless it is 0."""
    from gyre_jax.sim.config import cost_model, preset
    from gyre_jax.sim.cost_model import Interconnect, ModelSpec, interhost_costs
    from gyre_jax.sim.presets import QWEN_122B

    model, link = ModelSpec(**QWEN_122B), Interconnect(8, 400e9, 0.7)
    one, four = interhost_costs(model, link, 8, 32), interhost_costs(model, link, 32, 32)
    assert four["grad_receive_s"] == pytest.approx(one["grad_receive_s"] / 4)  # 4 hosts move the same bytes
    assert four["grad_receive_s"] == pytest.approx(122e9 * 4 / (4 * 400e9 * 0.7))  # float32 gradients
    assert four["weight_sync_s"] == pytest.approx(31 * 122e9 * 1.0 / (4 * 400e9 * 0.7))  # FP8 weights to 31 cells
    assert four["kv_migration_s_per_token"] == pytest.approx(model.kv_bytes_per_token / (4 * 400e9 * 0.7))
    c = preset("deepswe")
    derived = cost_model(c)
    assert derived.switch.weight_sync_s == pytest.approx(c.cost.weight_sync_s + four["weight_sync_s"])
    assert derived.training.grad_receive_s == pytest.approx(four["grad_receive_s"])
    c.cluster.host_bandwidth = 0.0  # the constants as given
    given = cost_model(c)
    assert (given.switch.weight_sync_s, given.training.grad_receive_s) == (c.cost.weight_sync_s, 0.0)
    assert given.switch.kv_migration_s_per_token == c.cost.kv_migration_s_per_token
    with pytest.raises(Exception, match="host_bandwidth"):
        interhost_costs(model, Interconnect(8, -1.0), 32, 32)
