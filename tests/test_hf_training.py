"""Training from a Hugging Face checkpoint directory: the run's model and tokenizer come from it.

The tiny Qwen3 fixture (tests/fixtures/model/qwen3_dense: config.json, model.safetensors, tokenizer.json)
is loaded by the trainer (``model.checkpoint_dir`` + ``tokenizer.kind=hf``), one RL step runs through the
proxy with the checkpoint's own tokenizer, and the core's params start equal to the checkpoint's tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from timelimits import run_time_limits

from gyre_jax import config as config_lib
from gyre_jax.model.hf_checkpoint import SafetensorsDir
from gyre_jax.model.hf_tokenizer import HFTokenizer

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "model" / "qwen3_dense"


def _config(workdir: Path, *extra: str):
    return config_lib.load_config(
        [
            f"--config.workdir={workdir}",
            f"--config.model.checkpoint_dir={FIXTURE}",
            "--config.tokenizer.kind=hf",
            "--config.total_steps=1",
            "--config.warm_start.steps=0",
            "--config.eval.samples_per_task=0",
            "--config.rollout.tasks_per_step=1",
            "--config.rl.group_size=2",
            "--config.rollout.max_tokens_per_call=16",
            "--config.metrics.progress_bar=False",
            "--config.metrics.tensorboard=False",
            *run_time_limits(),
            *extra,
        ]
    )


def test_a_run_trains_from_a_hugging_face_checkpoint_with_its_tokenizer(tmp_path):
    from gyre_jax.train import build_run

    trainer = build_run(_config(tmp_path))
    tokenizer = trainer.rollouts.proxy.tokenizer  # what the proxy renders and records prompts with
    model_cfg = trainer.controller.training.learner.model_cfg  # what the learner trains
    try:
        assert isinstance(tokenizer, HFTokenizer)
        assert model_cfg.embed_dim == 32 and model_cfg.num_layers == 2  # from config.json
        # the core's params are the checkpoint's tensors (before any RL step)
        with SafetensorsDir(FIXTURE) as ckpt:
            embed = np.asarray(ckpt.read("model.embed_tokens.weight", (slice(None), slice(None))), np.float32)
        ours = np.asarray(jax.device_get(trainer.state.params["embedder"]["table"][...]), np.float32)
        np.testing.assert_array_equal(ours[: embed.shape[0]], embed)
        assert trainer.run() == 1
    finally:
        trainer.close()
    train = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in train if m.get("phase") == "train"]
    assert len(train) == 1 and train[0]["executions"] == 2
    vocab = model_cfg.vocab_size
    for path in (tmp_path / "records").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            assert rec["prompt_ids"] and max(rec["prompt_ids"] + rec["completion_ids"]) < vocab
            # the prompt is the checkpoint tokenizer's rendering: it decodes back to the chat template's text
            assert "<|im_start|>" in tokenizer.decode(rec["prompt_ids"])


def test_a_checkpoint_without_the_hf_tokenizer_is_a_config_error(tmp_path):
    with pytest.raises(config_lib.ConfigError, match="tokenizer.kind='hf'"):
        config_lib.load_config([f"--config.workdir={tmp_path}", f"--config.model.checkpoint_dir={FIXTURE}"])
    with pytest.raises(config_lib.ConfigError, match="no config.json"):
        config_lib.load_config(
            [f"--config.workdir={tmp_path}", f"--config.model.checkpoint_dir={tmp_path}", "--config.tokenizer.kind=hf"]
        )
