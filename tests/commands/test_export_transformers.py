"""What ``python -m gyre_jax.export`` writes loads in transformers, which computes our logits and renders the chat
template as the proxy does.

``scripts/check_export_transformers.py record`` (run by hand with a Python that has torch and transformers) wrote
each case's export (the tiny model's seeded init with the byte tokenizer and the exported Qwen3 template; a 2-layer
slice of SmolLM2-135M-Instruct's GGUF with the tokenizer and ChatML template from its metadata) with
``gyre_jax.export.write_hf``, loaded it with ``AutoModelForCausalLM`` / ``AutoTokenizer.apply_chat_template`` (a
system turn, a user turn with non-ASCII text, a tool call and its result, a tool list) and recorded what it loaded
(a digest of the directory), its text, token ids, logits and argmax (tests/fixtures/model/
export_transformers_reference.npz). Here, without torch, the same exports are written again: their files must be
the ones transformers loaded, the proxy's text and ids transformers', and our logits transformers' to float32
rounding. A change to the HF writer (a renamed or transposed tensor, a config key, the tokenizer or template files)
fails the digest; a change to the model's computation fails the logits; a change to the proxy's rendering fails
the text.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_export", REPO / "scripts" / "check_export_transformers.py")
check_export = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_export)
REFERENCE = np.load(check_export.REFERENCE)


def test_the_reference_was_recorded_for_every_case_with_its_versions():
    assert str(REFERENCE["versions"]).startswith("torch ") and "transformers " in str(REFERENCE["versions"])
    assert {str(REFERENCE[f"{name}/architecture"]) for name in check_export.CASES} == {
        "Qwen3ForCausalLM",
        "LlamaForCausalLM",
    }


@pytest.mark.parametrize("name", list(check_export.CASES))
def test_our_export_is_the_one_transformers_loaded_and_computes_its_logits(name, tmp_path):
    made = check_export.make_case(name, tmp_path / name)
    assert made["digest"] == str(REFERENCE[f"{name}/digest"]), (
        f"the HF export of {name} differs from the one transformers loaded when the reference was recorded; if the "
        "change is intended, re-record it: python scripts/check_export_transformers.py record --torch-python PY"
    )
    assert made["text"] == str(REFERENCE[f"{name}/text"])  # the proxy renders what apply_chat_template renders
    assert made["ids"] == REFERENCE[f"{name}/ids"].tolist()  # ... and tokenizes it to the same ids
    assert "8675309" in made["text"]  # the tool result was rendered (SmolLM2's ChatML template drops tool calls)
    cols, theirs = REFERENCE[f"{name}/columns"], REFERENCE[f"{name}/logits"]
    ours = made["ours"][:, cols]
    scale = float(np.abs(ours).max())
    assert float(np.abs(ours - theirs).max()) <= check_export.TOLERANCE * scale
    vocab = int(REFERENCE[f"{name}/vocab"])  # the checkpoint's; ours may be padded past it
    np.testing.assert_array_equal(made["ours"][:, :vocab].argmax(-1), REFERENCE[f"{name}/argmax"])
    # the logits vary far more than the tolerance along the sequence: the comparison is not vacuous
    assert float(np.abs(ours[1:] - ours[:-1]).max()) > 1000 * check_export.TOLERANCE * scale
