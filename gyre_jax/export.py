"""``python -m gyre_jax.export``: a run's checkpoint as a Hugging Face directory (or a GGUF file) with its tokenizer
and chat template, loadable by transformers.

    python -m gyre_jax.export --run runs/exp1 [--step 40] --out exported/exp1 [--dtype float32|bfloat16|float16]
    python -m gyre_jax.export --run runs/smollm2 --format gguf --out exported/smollm2.gguf   # a model from a GGUF

The checkpoint is any step the run kept, in either layer layout (``model.scan_layers``), from a run of any number of
processes (a multi-process run's process 0 saves whole arrays): it is restored on one device of this process
(``layer_stack.restore``; the run's device layout is not needed), params only kept.

What is written, by where the run's model came from (``model.checkpoint_dir``):

- a Hugging Face directory: the weights (``save_hf_checkpoint``), the source's ``config.json`` keys kept, its
  tokenizer files copied (``tokenizer.json``, ``tokenizer_config.json`` with its chat template, ...);
- a GGUF file (or ``pkg:`` reference): the weights, ``config.json`` with the file's context length and special
  token ids, ``tokenizer.json`` built from the file's tokenizer metadata (``gguf_tokenizer``: equal to
  transformers' own GGUF conversion), ``tokenizer_config.json`` with the file's chat template and special tokens;
  ``--format gguf`` writes a GGUF file instead (``save_gguf``: F16 or F32, every tokenizer / general key of the
  source copied verbatim, so llama.cpp gets its own tokenizer and template back);
- a random init (the tiny models, byte tokenizer): the weights, ``tokenizer.json`` equal to ``ByteTokenizer``
  (a byte-level BPE with no merges: id b is byte b, the special tokens after), and ``tokenizer_config.json``
  whose chat template renders exactly what the proxy rendered in training (``byte_chat_template``: the official
  Qwen3 template, with the compact tool list when ``tokenizer.tools_format`` is "compact").

A ``config.tokenizer.chat_template`` set in the run (a file or the text) replaces the template written. After
writing, the export is checked (``--no-check`` skips it): the directory is read back with the project's own loader
and its logits on a prompt rendered with the written template compared to the checkpoint's (float32 rounding:
max |difference| / max |logit| < 1e-5 at float32). Exit status 0, 1 when the check fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gyre_jax.checkpoint import Checkpointer
from gyre_jax.commands import CommandError, checkpoint_step, fail, load_config, parse_known, policy_source
from gyre_jax.config import ConfigError
from gyre_jax.model import layer_stack
from gyre_jax.model.checkpoints import Checkpoint, is_gguf, resolve_checkpoint
from gyre_jax.model.config import COMPUTE_FIELDS, ModelConfig, ModelInputError
from gyre_jax.model.sharding import abstract_model, make_mesh
from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.progress import Progress
from gyre_jax.rl.learner import Learner

FORMATS = ("hf", "gguf")
DTYPES = ("float32", "bfloat16", "float16")
CHECK_TOLERANCE = 1e-5  # max |logit difference| / max |logit| of a float32 export read back
EXIT_CHECK_FAILED = 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gyre_jax.export",
        description="Export a run's checkpoint as a Hugging Face directory or a GGUF file (docs/commands.md).",
    )
    parser.add_argument("--run", type=Path, required=True, help="the run directory")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--out", type=Path, required=True, help="the directory (hf) or .gguf file (gguf) to write")
    parser.add_argument("--format", choices=FORMATS, default="hf")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="stored dtype (gguf: float32 or float16)")
    parser.add_argument("--no-check", action="store_true", help="skip reading the export back and comparing logits")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, overrides = parse_known(_parser(), argv)
        args.checkpoint, args.config = None, None
        source = policy_source(args)
        config = load_config(source, None, overrides)
        step = checkpoint_step(args.run, args.step)
        origin = model_origin(config)
        if args.format == "gguf" and origin != "gguf":
            raise CommandError(
                f"--format gguf needs a model that came from a GGUF file (its tokenizer and template are copied from "
                f"it); this run's model.checkpoint_dir is {config.model.checkpoint_dir or 'empty (random init)'!r}: "
                "export --format hf"
            )
        if args.format == "gguf" and args.dtype == "bfloat16":
            raise CommandError("--format gguf stores float16 or float32 (quantize with llama.cpp's llama-quantize)")
    except (CommandError, ConfigError, ModelInputError) as exc:
        return fail(str(exc))
    model_cfg = export_model_config(config)
    with Progress(f"restoring checkpoint {step}", delay_s=2.0):
        params = restore_params(config, model_cfg, args.run, step)
    with Progress(f"writing {args.out}", delay_s=2.0):
        if args.format == "gguf":
            write_gguf(config, model_cfg, params, args.out, args.dtype)
        else:
            write_hf(config, model_cfg, params, args.out, args.dtype)
    print(f"exported {args.run} checkpoint {step} ({model_cfg.num_params / 1e6:.2f}M params) to {args.out}", flush=True)
    if args.no_check or args.format == "gguf":
        return 0
    error = check_export(model_cfg, params, args.out, config)
    tolerance = CHECK_TOLERANCE if args.dtype == "float32" else 2e-2
    ok = error <= tolerance
    print(f"check: {args.out} read back by gyre_jax's loader; logits relative error {error:.2e} "
          f"({'<=' if ok else '>'} {tolerance:g})", flush=True)  # fmt: skip
    return 0 if ok else EXIT_CHECK_FAILED


def model_origin(config) -> str:
    """Where the run's model came from: "hf" (a directory), "gguf" (a file or pkg: reference) or "init"."""
    ref = config.model.checkpoint_dir
    if not ref:
        return "init"
    return "gguf" if is_gguf(ref) else "hf"


def export_model_config(config) -> ModelConfig:
    """The run's model: its checkpoint's architecture (metadata only, no tensor read) or ``config.model``'s."""
    if not config.model.checkpoint_dir:
        return config.model_config()
    compute = {name: getattr(config.model, name) for name in COMPUTE_FIELDS}
    with Checkpoint(config.model.checkpoint_dir) as ckpt:
        return ckpt.model_config(num_layers=config.model.checkpoint_layers, **compute)


def restore_params(config, model_cfg: ModelConfig, run: Path, step: int) -> nnx.State:
    """Checkpoint ``step``'s params on one device of this process, in the model's own layer layout."""
    mesh = make_mesh(jax.devices()[:1], {})
    graphdef = abstract_model(model_cfg)[0]
    learner = Learner(model_cfg, graphdef, mesh, config.sharding_rules, config.optimizer, loss_cfg=config.loss_config())
    checkpointer = Checkpointer(run / "checkpoints", max_to_keep=10**6)  # saves nothing: deletes nothing
    try:
        state, _ = layer_stack.restore(checkpointer, step, learner.abstract_state())
    finally:
        checkpointer.close()
    return state.params


# -- writing ---------------------------------------------------------------------------------------------------
def write_hf(config, model_cfg: ModelConfig, params: nnx.State, out: Path, dtype: str) -> None:
    """The HF directory: weights, config.json, tokenizer files and chat template (see the module docstring)."""
    from gyre_jax.model.hf_checkpoint import read_hf_config, save_hf_checkpoint

    origin = model_origin(config)
    out.mkdir(parents=True, exist_ok=True)
    if origin == "hf":
        src = resolve_checkpoint(config.model.checkpoint_dir)
        save_hf_checkpoint(out, model_cfg, params, dtype=dtype, tokenizer_dir=src, base_config=read_hf_config(src))
    elif origin == "gguf":
        from gyre_jax.model.gguf_checkpoint import GGUFFile

        src = resolve_checkpoint(config.model.checkpoint_dir)
        with GGUFFile(src) as gguf_file:
            base = gguf_file.hf_base_config()
        save_hf_checkpoint(out, model_cfg, params, dtype=dtype, base_config=base)
        write_gguf_tokenizer(src, out, config.tokenizer.gguf_pre, base.get("max_position_embeddings", 8192))
    else:
        tok = ByteTokenizer()
        ids = {"eos_token_id": list(tok.eos_ids), "pad_token_id": tok.pad_id, "bos_token_id": None}
        save_hf_checkpoint(out, model_cfg, params, dtype=dtype, base_config=ids)
        write_byte_tokenizer(out, byte_chat_template(config.tokenizer.tools_format), config.serving.max_seq_len)
    override = template_override(config.tokenizer.chat_template)
    if override is not None:
        set_chat_template(out, override)


def write_gguf(config, model_cfg: ModelConfig, params: nnx.State, out: Path, dtype: str) -> None:
    from gyre_jax.model.gguf_checkpoint import save_gguf

    src = resolve_checkpoint(config.model.checkpoint_dir)
    save_gguf(out, model_cfg, params, dtype=dtype, metadata_from=src)


def template_override(chat_template: str) -> str | None:
    """The run's ``tokenizer.chat_template`` when it replaces the checkpoint's ("": the checkpoint's own;
    "builtin": the proxy's built-in renderer, written as ``byte_chat_template``)."""
    if chat_template == "":
        return None
    if chat_template == "builtin":
        return QWEN3_TEMPLATE
    path = Path(chat_template)
    return path.read_text(encoding="utf-8") if path.is_file() else chat_template


def set_chat_template(out: Path, template: str) -> None:
    """``template`` as the chat template of ``out/tokenizer_config.json`` (and ``chat_template.jinja`` if present)."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {"tokenizer_class": "PreTrainedTokenizerFast"}
    cfg["chat_template"] = template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    if (out / "chat_template.jinja").is_file():
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")


def write_gguf_tokenizer(src: Path, out: Path, pre_mode: str, max_len: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` from a GGUF file's tokenizer metadata."""
    from gyre_jax.model.gguf_tokenizer import gguf_tokenizer

    tok = gguf_tokenizer(src, pre_mode=pre_mode)
    tok._tok.save(str(out / "tokenizer.json"))
    special = dict(tok.special_tokens_map)
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": max_len}
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def byte_tokenizer_json() -> Any:
    """A ``tokenizers.Tokenizer`` that encodes and decodes exactly as ``ByteTokenizer``: a byte-level BPE with no
    merges (id b is byte b, through GPT-2's byte-to-character table) and the special tokens as added tokens after
    it (``<|endoftext|>`` 256 ...)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ByteTokenizer().special_tokens])
    return tok


def write_byte_tokenizer(out: Path, chat_template: str, max_len: int) -> None:
    tok = ByteTokenizer()
    byte_tokenizer_json().save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "bos_token": None, "model_max_length": max_len, "chat_template": chat_template,
           "clean_up_tokenization_spaces": False}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    gen = {"eos_token_id": list(tok.eos_ids), "pad_token_id": tok.pad_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ``ByteLevel`` pre-tokenizers map bytes to)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


# The official Qwen3 chat template (Qwen/Qwen3-0.6B's tokenizer_config.json), which the proxy's built-in renderer
# equals (proxy/chat_template.py); the compact variant lists tools as one-line signatures (tools_format "compact").
QWEN3_TOOLS_HEAD = (
    """    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with """
    """function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within """
    """<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": """
    """<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
"""
)
COMPACT_TOOLS_HEAD = """    {{- "# Tools\\n<tools>\\n" }}
    {%- for tool in tools %}
        {%- set fn = tool.function if tool.function is defined else tool %}
        {%- set params = fn.parameters if fn.parameters is defined and fn.parameters else {} %}
        {%- set required = params.required if params.required is defined and params.required else [] %}
        {{- fn.name }}(
        {%- for name, spec in (params.properties if params.properties is defined and params.properties else {}).items() %}
            {{- ", " if not loop.first }}{{ name }}{{ "" if name in required else "?" }}: {{ spec.type if spec is mapping and spec.type is defined else "any" }}
        {%- endfor %}
        {{- ")" }}
        {%- if fn.description is defined and fn.description %}{{ " - " + fn.description }}{% endif %}
        {{- "\\n" }}
    {%- endfor %}
    {{- "</tools>\\nCall a tool as <tool_call>\\n{\\"name\\": <name>, \\"arguments\\": <object>}\\n</tool_call><|im_end|>\\n" }}
"""
QWEN3_TEMPLATE = (
    """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
"""
    + QWEN3_TOOLS_HEAD
    + """{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
)


def byte_chat_template(tools_format: str) -> str:
    """The Jinja chat template equal to the proxy's built-in renderer with ``tools_format`` ("qwen3": the official
    Qwen3 template; "compact": its tool list as one-line signatures)."""
    if tools_format == "qwen3":
        return QWEN3_TEMPLATE
    if tools_format == "compact":
        return QWEN3_TEMPLATE.replace(QWEN3_TOOLS_HEAD, COMPACT_TOOLS_HEAD)
    raise ValueError(f"tools_format={tools_format!r}: expected 'qwen3' or 'compact'")


# -- the check -------------------------------------------------------------------------------------------------
CHECK_MESSAGES = [
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": "Read input.txt and write its digits reversed to answer.txt. Ünïcödé ✓"},
]


def check_export(model_cfg: ModelConfig, params: nnx.State, out: Path, config) -> float:
    """Reads ``out`` back with the project's loader (weights, config.json, tokenizer.json and its chat template) and
    returns max |logits(export) - logits(checkpoint)| / max |logits(checkpoint)| on a prompt the written template
    renders, tokenized by the written tokenizer."""
    from gyre_jax.model.attention import segment_causal_mask
    from gyre_jax.model.hf_checkpoint import load_hf_checkpoint
    from gyre_jax.model.tokenizer import load_tokenizer
    from gyre_jax.proxy.jinja_template import JinjaChatTemplate

    template = json.loads((out / "tokenizer_config.json").read_text()).get("chat_template")
    text = JinjaChatTemplate.of(template).render(CHECK_MESSAGES, add_generation_prompt=True) if template else "Hello"
    ids = load_tokenizer("hf", out).encode(text)[:256]
    mesh = make_mesh(jax.devices()[:1], {})
    model_cfg = dataclasses.replace(model_cfg, dtype="float32")  # both sides in float32: the weights are compared
    _, graphdef2, params2 = load_hf_checkpoint(out, mesh, config.sharding_rules, dtype="float32",
                                               param_dtype=model_cfg.param_dtype)  # fmt: skip
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    mask = segment_causal_mask(jnp.ones_like(tokens))
    graphdef = abstract_model(model_cfg)[0]
    want = np.asarray(nnx.merge(graphdef, params)(tokens, positions, mask)[0], np.float32)
    got = np.asarray(nnx.merge(graphdef2, params2)(tokens, positions, mask)[0], np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


if __name__ == "__main__":
    sys.exit(main())
