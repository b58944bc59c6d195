"""Bad Hugging Face checkpoint directories, each a copy of the tiny Qwen3 fixture with one thing wrong (issue 19 item 8).

Shared by ``tests/faults/test_bad_model_input.py`` and ``benchmarks/faults/model_input.py``. Safetensors files
are rewritten at the byte level (8-byte header length, JSON header, raw data), so a tensor can be dropped,
re-shaped or re-typed without numpy knowing bfloat16.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "model" / "qwen3_dense"
WEIGHTS = "model.safetensors"
VICTIM = "model.layers.1.mlp.up_proj.weight"  # [64, 32] bfloat16 in the fixture


def copy_fixture(dest: Path) -> Path:
    """A fresh copy of the fixture checkpoint at ``dest`` (returned)."""
    shutil.copytree(FIXTURE, dest)
    return dest


def read_safetensors(file: Path) -> tuple[dict, dict[str, bytes]]:
    """(header less ``__metadata__``, name -> raw bytes) of a safetensors file."""
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n :]
    return header, {k: data[v["data_offsets"][0] : v["data_offsets"][1]] for k, v in header.items()}


def write_safetensors(file: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Writes name -> (dtype code, shape, raw bytes) as a safetensors file."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    file.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _edit_tensors(ckpt: Path, edit: Callable[[dict], None]) -> None:
    header, data = read_safetensors(ckpt / WEIGHTS)
    tensors = {k: (v["dtype"], v["shape"], data[k]) for k, v in header.items()}
    edit(tensors)
    write_safetensors(ckpt / WEIGHTS, tensors)


def missing_tensor(ckpt: Path) -> None:
    _edit_tensors(ckpt, lambda t: t.pop(VICTIM))


def misshaped_tensor(ckpt: Path) -> None:
    def edit(t):
        dtype, _, blob = t[VICTIM]
        t[VICTIM] = (dtype, [32, 64], blob)  # same bytes, transposed shape

    _edit_tensors(ckpt, edit)


def int32_tensor(ckpt: Path) -> None:
    def edit(t):
        _, shape, blob = t[VICTIM]
        t[VICTIM] = ("I32", shape, blob * 2)  # 4 bytes per element

    _edit_tensors(ckpt, edit)


def truncated_shard(ckpt: Path) -> None:
    raw = (ckpt / WEIGHTS).read_bytes()
    (ckpt / WEIGHTS).write_bytes(raw[: len(raw) * 2 // 3])  # an interrupted download


def truncated_header(ckpt: Path) -> None:
    raw = (ckpt / WEIGHTS).read_bytes()
    (ckpt / WEIGHTS).write_bytes(raw[:100])


def big_tokenizer(ckpt: Path, extra: int = 30) -> None:
    """tokenizer.json with ``extra`` added tokens past the model's 352-row vocabulary (ids 339 .. 338 + extra)."""
    file = ckpt / "tokenizer.json"
    tok = json.loads(file.read_text())
    first = max(t["id"] for t in tok["added_tokens"]) + 1
    for i in range(extra):
        tok["added_tokens"].append(
            {"id": first + i, "content": f"<|extra_{i}|>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
        )  # fmt: skip
    file.write_text(json.dumps(tok))


def edit_config(ckpt: Path, drop: tuple[str, ...] = (), **values) -> None:
    """config.json without the keys ``drop`` and with ``values`` set."""
    file = ckpt / "config.json"
    cfg = json.loads(file.read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(values)
    file.write_text(json.dumps(cfg, indent=2))


def no_heads(ckpt: Path) -> None:
    edit_config(ckpt, drop=("num_attention_heads",))


def no_head_dim(ckpt: Path) -> None:
    edit_config(ckpt, drop=("head_dim",))


def linear_rope_without_factor(ckpt: Path) -> None:
    edit_config(ckpt, drop=("rope_parameters",), rope_scaling={"rope_type": "linear"})


def yarn_without_original_max(ckpt: Path) -> None:
    """An older YaRN spelling: no ``original_max_position_embeddings`` (transformers uses max_position_embeddings)."""
    edit_config(ckpt, drop=("rope_parameters",), rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0})


def not_a_number(ckpt: Path) -> None:
    edit_config(ckpt, num_attention_heads="four")


# name -> (what is wrong, how to make it, what the one line must contain). An empty list of expected words means
# the checkpoint loads (transformers loads it too).
BAD_INPUTS: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "tokenizer_larger_than_vocab": (big_tokenizer, ["tokenizer.json", "369", "352"]),
    "missing_tensor": (missing_tensor, [VICTIM, "missing"]),
    "misshaped_tensor": (misshaped_tensor, [VICTIM, "[32, 64]", "[64, 32]"]),
    "int32_tensor": (int32_tensor, [VICTIM, "I32", WEIGHTS]),
    "truncated_shard": (truncated_shard, [WEIGHTS, "truncated"]),
    "truncated_header": (truncated_header, [WEIGHTS, "truncated"]),
    "config_no_num_attention_heads": (no_heads, ["num_attention_heads", "config.json"]),
    "config_heads_not_a_number": (not_a_number, ["num_attention_heads", "'four'", "config.json"]),
    "config_no_head_dim": (no_head_dim, ["head_dim", "128", "config.json"]),
    "config_linear_rope_no_factor": (linear_rope_without_factor, ["factor", "linear", "config.json"]),
    "config_yarn_no_original_max": (yarn_without_original_max, []),
}
