"""Builds the golden model fixtures under tests/fixtures/model/ with Hugging Face transformers + torch.

Run once by hand, in a throwaway environment (torch and transformers are NOT project dependencies):

    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors
    /tmp/hfvenv/bin/python scripts/make_model_fixtures.py

It writes, for a tiny random Qwen3 (dense) and a tiny random Qwen3-MoE:
- a checkpoint directory exactly as ``save_pretrained`` writes it (bfloat16 safetensors, one file for the
  dense model, several shards + index for the MoE model), with a tiny byte-level BPE tokenizer built
  with Qwen2's pre-tokenizer and Qwen3's special tokens (``tokenizer.json``, ``tokenizer_config.json``);
- ``golden.npz``: input ids [B, T] and HF's fp32 logits [B, T, V] for them (model run in float32 on the
  bf16-representable weights); for MoE also HF's router load-balancing ``aux_loss``;
and ``rope_golden.json`` (HF's inverse frequencies / attention scaling for linear and YaRN scaling) and
``tokenizer_golden.json`` (HF ``AutoTokenizer`` ids and decodes for a set of texts, and every id's bytes).
The test suite reads these with our loader only; it never imports torch.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "model"
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Qwen3's added tokens (ids follow the trained vocabulary): special ones are skipped by decode(skip_special_tokens)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Read input.txt and write the reversed digits to answer.txt; then call the tool.",
    '{"name": "write_file", "arguments": {"path": "answer.txt", "content": "4321"}}',
    "Über naïve café — 日本語のテキスト, emoji 🙂 and tabs\tand   spaces.",
    "assistant user system tool think the and to of in is for with on that",
]
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "<|im_start|>user\nRead input.txt<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>\n<tool_call>{}</tool_call><|im_end|>",
    "Über naïve café — 日本語 🙂",
    "   leading spaces and trailing   \n\n\n",
    "<|im_end|><|endoftext|><think>",
    "numbers 1234567890 and 3.14159",
    "",
]


def build_tokenizer(path: Path) -> int:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False, special_tokens=[]
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [fast.convert_tokens_to_ids("<|im_end|>"), fast.convert_tokens_to_ids("<|endoftext|>")],
                "pad_token_id": fast.convert_tokens_to_ids("<|endoftext|>"),
            },
            indent=2,
        )
    )
    return len(fast)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) logits (HF's init std 0.02 makes every logit ~0), norms around 1, router spread."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm scales and biases
                base = 0.0 if name.endswith("bias") else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * fan_in**-0.5 * (2.0 if "embed" in name else 1.0))
        for p in model.parameters():  # bf16-representable, so the bf16 files hold the exact fp32 weights
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def golden(model, vocab: int, seed: int, batch: int = 2, length: int = 16, moe: bool = False) -> dict:
    ids = np.random.default_rng(seed).integers(0, vocab, size=(batch, length)).astype(np.int64)
    model.eval()
    with torch.no_grad():
        out = model(torch.from_numpy(ids), output_router_logits=moe) if moe else model(torch.from_numpy(ids))
    result = {"input_ids": ids.astype(np.int32), "logits": out.logits.float().numpy()}
    if moe:
        result["aux_loss"] = np.asarray(float(out.aux_loss), np.float32)
        result["router_logits"] = np.stack([r.float().numpy() for r in out.router_logits])  # [L_moe, B*T, X]
    return result


def save(model, path: Path, tokenizer_dir: Path, max_shard_size: str) -> None:
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    for f in tokenizer_dir.iterdir():
        shutil.copyfile(f, path / f.name)


def rope_golden() -> dict:
    cases = {
        "linear": Qwen3Config(
            head_dim=16,
            hidden_size=64,
            num_attention_heads=4,
            rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        ),
        "yarn": Qwen3Config(
            head_dim=128,
            hidden_size=1024,
            num_attention_heads=8,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
                "rope_theta": 1000000.0,
            },
        ),
        "yarn_small": Qwen3Config(
            head_dim=16,
            hidden_size=64,
            num_attention_heads=4,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
                "beta_fast": 16,
                "beta_slow": 2,
            },
        ),
    }
    out = {}
    for name, cfg in cases.items():
        rope_type = cfg.rope_parameters["rope_type"]
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
        out[name] = {
            "config": cfg.to_dict(),
            "inv_freq": inv_freq.float().tolist(),
            "attention_scaling": float(scaling),
        }
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def tokenizer_golden(path: Path) -> dict:
    tok = AutoTokenizer.from_pretrained(path)
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    added = {t.content for t in tok.added_tokens_decoder.values()}
    token_bytes = []
    for i in range(len(tok)):
        piece = tok.convert_ids_to_tokens(i)
        raw = piece.encode("utf-8") if piece in added else bytes(byte_decoder[c] for c in piece)
        token_bytes.append(raw.hex())
    cases = []
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        cases.append(
            {
                "text": text,
                "ids": ids,
                "decoded": tok.decode(ids),
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )
    return {
        "vocab_size": len(tok),
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "cases": cases,
        "token_bytes_hex": token_bytes,
        "transformers_version": transformers.__version__,
    }


def main() -> None:
    torch.manual_seed(0)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    tok_dir = OUT / "_tokenizer"
    n_tokens = build_tokenizer(tok_dir)
    vocab = (n_tokens + 15) // 16 * 16  # like Qwen3, the embedding is larger than the tokenizer

    dense_cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        attn_implementation="eager",
    )
    dense = Qwen3ForCausalLM(dense_cfg).float()
    randomize(dense, 1)
    np.savez(OUT / "qwen3_dense_golden.npz", **golden(dense, vocab, seed=11))
    save(dense, OUT / "qwen3_dense", tok_dir, max_shard_size="5GB")

    moe_cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        attention_bias=True,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
        attn_implementation="eager",
    )
    moe = Qwen3MoeForCausalLM(moe_cfg).float()
    randomize(moe, 2)
    np.savez(OUT / "qwen3_moe_golden.npz", **golden(moe, vocab, seed=12, moe=True))
    save(moe, OUT / "qwen3_moe", tok_dir, max_shard_size="40KB")

    (OUT / "rope_golden.json").write_text(json.dumps(rope_golden(), indent=1))
    (OUT / "tokenizer_golden.json").write_text(
        json.dumps(tokenizer_golden(OUT / "qwen3_dense"), indent=1, ensure_ascii=False)
    )
    shutil.rmtree(tok_dir)
    (OUT / "README.md").write_text(
        "Golden fixtures for tests/model (tiny random Qwen3 / Qwen3-MoE checkpoints, HF logits, tokenizer and RoPE\n"
        f"references). Generated by scripts/make_model_fixtures.py with transformers {transformers.__version__}, "
        f"torch {torch.__version__}. Do not edit by hand; rerun the script.\n"
    )
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1024:.0f} KiB)", file=sys.stderr)


if __name__ == "__main__":
    main()
