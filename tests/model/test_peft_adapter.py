"""The LoRA adapters gyre_jax writes are the ones ``peft`` loads, and peft computes our logits with them.

``scripts/check_peft_adapter.py check --record`` (run by hand in a venv with torch, transformers and peft) loaded
each small fixture model (Qwen3, Qwen3-MoE, Llama, Qwen2) with ``AutoModelForCausalLM`` and the adapter this project
wrote with ``PeftModel.from_pretrained``, and recorded peft's logits with a digest of the adapter directory it loaded
(tests/fixtures/model/peft_reference.npz). Here, without torch, the same deterministic adapter is written again: its
files must be byte-for-byte the ones peft loaded (tensor names, dtypes, shapes, values, adapter_config.json) and our
logits (base + adapter) must equal peft's to float32 rounding. A change to the PEFT export (a renamed tensor, a
transposed A/B, a wrong ``lora_alpha``/``target_modules``) fails the digest; a change to how the adapter enters the
forward fails the logits.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_peft_adapter", REPO / "scripts" / "check_peft_adapter.py")
check_peft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_peft)
REFERENCE = np.load(check_peft.REFERENCE)


def test_the_reference_was_recorded_for_every_small_model_with_its_versions():
    assert str(REFERENCE["versions"]).startswith("torch ") and "peft " in str(REFERENCE["versions"])
    for name in check_peft.RECORDED:
        assert {f"{name}/peft_logits", f"{name}/tokens", f"{name}/digest"} <= set(REFERENCE.files)


@pytest.mark.parametrize("name", check_peft.RECORDED)
def test_our_adapter_is_the_one_peft_loaded_and_our_logits_are_peft_s(name, tmp_path):
    made = check_peft.adapter(name, tmp_path)
    assert check_peft.adapter_digest(tmp_path / "adapter") == str(REFERENCE[f"{name}/digest"]), (
        f"the PEFT adapter written for {name} differs from the one peft loaded when the reference was recorded; if the "
        "change is intended, re-record it: scripts/check_peft_adapter.py (make, then check --record)"
    )
    np.testing.assert_array_equal(made["tokens"], REFERENCE[f"{name}/tokens"])
    theirs = REFERENCE[f"{name}/peft_logits"]
    ours = made["ours"][..., : theirs.shape[-1]]  # our vocab may be padded past the checkpoint's
    scale = float(np.abs(ours).max())
    assert float(np.abs(ours - theirs).max()) <= check_peft.TOLERANCE * scale
    # the adapter moves the logits far more than the tolerance: the comparison is not vacuous
    assert float(np.abs(made["base"][..., : theirs.shape[-1]] - ours).max()) > 1000 * check_peft.TOLERANCE * scale
