"""By hand: a ``python -m gyre_jax.export`` directory loaded by transformers gives the run checkpoint's logits, and
transformers' tokenizer and chat template give the tokens the run's proxy gave. Run with the project's venv:

    python -m gyre_jax.export --run RUN --step K --out EXPORT
    python scripts/check_export_transformers.py --run RUN --step K --export EXPORT --torch-python /tmp/torchvenv/bin/python

``--torch-python``: a Python with torch and transformers (a scratch venv, never a project dependency:
``python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch==2.13.0 transformers``). This script
computes the reference here (the run's checkpoint restored by ``gyre_jax.export.restore_params``, the prompt
rendered by the proxy's own chat format and tokenized by the run's tokenizer), then runs transformers there on
the export (``AutoModelForCausalLM``, ``AutoTokenizer.apply_chat_template``) and compares: the rendered text and
the token ids must be equal, and the logits within float32 rounding (max |difference| / max |logit| < 1e-5).
Prints one JSON object; exit status 0 when everything matched.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MESSAGES = [
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": "Read input.txt and write its digits reversed to answer.txt. Ünïcödé ✓"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "read_file",
                                                                                        "arguments": {"path": "input.txt"}}}]},
    {"role": "tool", "content": "8675309"},
]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]  # fmt: skip

TRANSFORMERS_SIDE = r"""
import json, sys
import numpy as np, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
export, io = sys.argv[1], sys.argv[2]
job = json.load(open(io + "/job.json"))
tok = AutoTokenizer.from_pretrained(export)
text = tok.apply_chat_template(job["messages"], tools=job["tools"], add_generation_prompt=True, tokenize=False)
ids = tok(text, add_special_tokens=False)["input_ids"]
model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(torch.tensor([job["ids"]])).logits[0].numpy()
np.save(io + "/logits.npy", logits.astype(np.float32))
json.dump({"text": text, "ids": ids, "torch": torch.__version__, "transformers": transformers.__version__,
           "architecture": type(model).__name__}, open(io + "/out.json", "w"))
"""


def reference(run: Path, step: int) -> tuple[str, list[int], np.ndarray, dict]:
    """(prompt text, ids, logits [T, V] float32, what) from the run's checkpoint, rendered and tokenized as the run's
    proxy does."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gyre_jax.commands import PolicySource, load_config
    from gyre_jax.export import export_model_config, restore_params
    from gyre_jax.model.attention import segment_causal_mask
    from gyre_jax.model.checkpoints import resolve_checkpoint
    from gyre_jax.model.sharding import abstract_model
    from gyre_jax.model.tokenizer import load_tokenizer
    from gyre_jax.proxy import chat_format

    config = load_config(PolicySource(run=run, step=step), None, [])
    cfg = export_model_config(config)
    params = restore_params(config, cfg, run, step)
    t = config.tokenizer
    ckpt = str(resolve_checkpoint(config.model.checkpoint_dir)) if config.model.checkpoint_dir else None
    tokenizer = load_tokenizer(t.kind, t.path or ckpt, t.gguf_pre)
    fmt = chat_format.for_settings(tokenizer, t.chat_template, t.tools_format, t.tool_format)
    text = fmt.render(MESSAGES, TOOLS, add_generation_prompt=True)
    ids = tokenizer.encode(text)
    cfg32 = dataclasses.replace(cfg, dtype="float32")
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    logits = nnx.merge(abstract_model(cfg32)[0], params)(tokens, positions, segment_causal_mask(jnp.ones_like(tokens)))
    del jax
    return text, ids, np.asarray(logits[0], np.float32), {"model": cfg.family, "params": cfg.num_params}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--torch-python", required=True, help="a Python with torch and transformers")
    args = parser.parse_args()
    text, ids, want, what = reference(args.run, args.step)
    with tempfile.TemporaryDirectory() as io:
        Path(io, "job.json").write_text(json.dumps({"messages": MESSAGES, "tools": TOOLS, "ids": ids}))
        done = subprocess.run([args.torch_python, "-c", TRANSFORMERS_SIDE, str(args.export), io], capture_output=True,
                              text=True)  # fmt: skip
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return 1
        out = json.loads(Path(io, "out.json").read_text())
        got = np.load(Path(io, "logits.npy"))
    error = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
    report = {
        "export": str(args.export), "run": str(args.run), "step": args.step, **what,
        "transformers": out["transformers"], "torch": out["torch"], "architecture": out["architecture"],
        "template_text_equal": out["text"] == text, "token_ids_equal": out["ids"] == ids, "tokens": len(ids),
        "logits_max_abs_diff": float(np.max(np.abs(got - want))), "logits_max_abs": float(np.max(np.abs(want))),
        "logits_relative_error": error, "argmax_equal": bool((got.argmax(-1) == want.argmax(-1)).all()),
    }  # fmt: skip
    print(json.dumps(report, indent=2))
    ok = report["template_text_equal"] and report["token_ids_equal"] and error < 1e-5 and report["argmax_equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
