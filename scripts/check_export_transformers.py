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

Recorded for CI (which has no torch): ``python scripts/check_export_transformers.py record --torch-python PY`` writes
the HF export of each of ``CASES`` (a config's model made deterministically: the tiny model's seeded init, and a
2-layer slice of SmolLM2-135M-Instruct's GGUF) with ``gyre_jax.export.write_hf`` (what the command writes), loads it
in transformers there, checks it as above, and records a digest of the directory transformers loaded, transformers'
text and token ids, its logits on a fixed set of vocabulary columns and its argmax at every position in
``tests/fixtures/model/export_transformers_reference.npz``. tests/commands/test_export_transformers.py writes the
same exports again: their files must be the ones transformers loaded, and the proxy's text, ids and our logits must
be transformers'.
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
    from gyre_jax.commands import PolicySource, load_config
    from gyre_jax.export import export_model_config, restore_params

    config = load_config(PolicySource(run=run, step=step), None, [])
    cfg = export_model_config(config)
    params = restore_params(config, cfg, run, step)
    text, ids = prompt(config)
    return text, ids, logits_of(cfg, params, ids), {"model": cfg.family, "params": cfg.num_params}


# -- recorded for CI ---------------------------------------------------------------------------------------------
CASES = {  # name -> (config file, overrides): the model's origins with a chat template to check
    "tiny_init": ("configs/tiny_cpu.py", []),  # random init, byte tokenizer, the exported Qwen3 template
    "smollm2_2layers": (
        "configs/smollm2_cpu.py",
        ["--config.model.checkpoint_layers=2"],
    ),  # GGUF: its tokenizer, ChatML
}
REFERENCE = REPO / "tests" / "fixtures" / "model" / "export_transformers_reference.npz"
TOLERANCE = 1e-5  # max |difference| / max |logit|: float32 rounding
COLUMNS = 4096  # logits kept per position for a large vocabulary (a seeded sample of columns; the argmax is kept whole)


def export_digest(export: Path) -> str:
    """sha256 of an HF export directory: every tensor of its safetensors files (name, dtype, shape, bytes, in name
    order) and every other file's bytes, by file name."""
    import hashlib

    from safetensors.numpy import load_file

    h = hashlib.sha256()
    for path in sorted(export.iterdir()):
        h.update(path.name.encode())
        if path.suffix == ".safetensors":
            for name, x in sorted(load_file(path).items()):
                h.update(f"{name}:{x.dtype}:{x.shape}".encode())
                h.update(np.ascontiguousarray(x).tobytes())
        else:
            h.update(path.read_bytes())
    return h.hexdigest()


def prompt(config) -> tuple[str, list[int]]:
    """MESSAGES and TOOLS rendered by the proxy's chat format for ``config`` and tokenized by its tokenizer."""
    from gyre_jax.model.checkpoints import resolve_checkpoint
    from gyre_jax.model.tokenizer import load_tokenizer
    from gyre_jax.proxy import chat_format

    t = config.tokenizer
    ckpt = str(resolve_checkpoint(config.model.checkpoint_dir)) if config.model.checkpoint_dir else None
    tokenizer = load_tokenizer(t.kind, t.path or ckpt, t.gguf_pre)
    fmt = chat_format.for_settings(tokenizer, t.chat_template, t.tools_format, t.tool_format)
    text = fmt.render(MESSAGES, TOOLS, add_generation_prompt=True)
    return text, tokenizer.encode(text)


def logits_of(cfg, params, ids: list[int]) -> np.ndarray:
    """The model's float32 logits [T, V] on ``ids``."""
    import dataclasses

    import jax.numpy as jnp
    from flax import nnx

    from gyre_jax.model.attention import segment_causal_mask
    from gyre_jax.model.sharding import abstract_model

    cfg32 = dataclasses.replace(cfg, dtype="float32")
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    logits, _ = nnx.merge(abstract_model(cfg32)[0], params)(
        tokens, positions, segment_causal_mask(jnp.ones_like(tokens))
    )
    return np.asarray(logits[0], np.float32)


def make_case(name: str, out: Path) -> dict:
    """Case ``name``'s export written to ``out`` by ``gyre_jax.export.write_hf`` (float32), with the proxy's text and
    ids for the prompt and our logits on them."""
    import jax

    from gyre_jax import config as config_lib
    from gyre_jax.export import export_model_config, write_hf
    from gyre_jax.model.checkpoints import Checkpoint
    from gyre_jax.model.sharding import init_params, make_mesh

    config_file, overrides = CASES[name]
    config = config_lib.load_config(["--config", str(REPO / config_file), *overrides])
    cfg = export_model_config(config)
    mesh = make_mesh(jax.devices()[:1], {})
    if config.model.checkpoint_dir:
        with Checkpoint(config.model.checkpoint_dir) as ckpt:
            params = ckpt.load_params(cfg, mesh, config.sharding_rules)[1]
    else:
        params = init_params(cfg, mesh, config.sharding_rules, seed=0)[1]
    write_hf(config, cfg, params, out, "float32")
    text, ids = prompt(config)
    return {"text": text, "ids": ids, "ours": logits_of(cfg, params, ids), "digest": export_digest(out)}


def columns(vocab: int) -> np.ndarray:
    """The vocabulary columns whose logits are recorded: all of a small vocabulary, else a seeded sample."""
    if vocab <= COLUMNS:
        return np.arange(vocab)
    return np.sort(np.random.default_rng(0).choice(vocab, COLUMNS, replace=False))


def transformers_side(torch_python: str, export: Path, ids: list[int]) -> tuple[dict, np.ndarray]:
    """Runs ``TRANSFORMERS_SIDE`` on ``export`` in ``torch_python``: (its report, its logits [T, V])."""
    with tempfile.TemporaryDirectory() as io:
        Path(io, "job.json").write_text(json.dumps({"messages": MESSAGES, "tools": TOOLS, "ids": ids}))
        done = subprocess.run([torch_python, "-c", TRANSFORMERS_SIDE, str(export), io], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"transformers failed on {export}:\n{done.stderr[-4000:]}")
        return json.loads(Path(io, "out.json").read_text()), np.load(Path(io, "logits.npy"))


def record(torch_python: str) -> int:
    reference, versions, ok = {}, "", True
    print("| export | architecture | tokens | text, ids equal | max abs diff | relative | argmax equal |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            made = make_case(name, Path(tmp, name))
            out, theirs = transformers_side(torch_python, Path(tmp, name), made["ids"])
            ours = made["ours"][:, : theirs.shape[-1]]  # our vocab may be padded past the checkpoint's
            diff = float(np.abs(theirs - ours).max())
            rel = diff / float(np.abs(ours).max())
            same = out["text"] == made["text"] and out["ids"] == made["ids"]
            argmax = bool((theirs.argmax(-1) == ours.argmax(-1)).all())
            ok = ok and same and argmax and rel <= TOLERANCE
            print(
                f"| {name} | {out['architecture']} | {len(made['ids'])} | {same} | {diff:.2e} | {rel:.2e} | {argmax} |"
            )
            cols = columns(theirs.shape[-1])
            reference |= {f"{name}/digest": np.asarray(made["digest"]), f"{name}/text": np.asarray(out["text"]),
                          f"{name}/ids": np.asarray(out["ids"], np.int32), f"{name}/columns": cols.astype(np.int32),
                          f"{name}/logits": theirs[:, cols].astype(np.float32),
                          f"{name}/argmax": theirs.argmax(-1).astype(np.int32),
                          f"{name}/vocab": np.asarray(theirs.shape[-1]),
                          f"{name}/architecture": np.asarray(out["architecture"])}  # fmt: skip
            versions = f"torch {out['torch']}, transformers {out['transformers']}"
    if not ok:
        print("not recorded: transformers disagrees with the export (see the table)")
        return 1
    np.savez_compressed(REFERENCE, versions=np.asarray(versions), **reference)
    print(f"recorded transformers' view of {', '.join(CASES)} in {REFERENCE} ({versions})")
    return 0


def main() -> int:
    if sys.argv[1:2] == ["record"]:
        parser = argparse.ArgumentParser(description="record transformers' logits of the CASES' exports for CI")
        parser.add_argument("--torch-python", required=True, help="a Python with torch and transformers")
        return record(parser.parse_args(sys.argv[2:]).torch_python)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--torch-python", required=True, help="a Python with torch and transformers")
    args = parser.parse_args()
    text, ids, want, what = reference(args.run, args.step)
    try:
        out, got = transformers_side(args.torch_python, args.export, ids)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
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
