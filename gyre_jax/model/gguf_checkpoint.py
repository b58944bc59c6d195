"""GGUF files (llama.cpp's format) <-> sharded params: load a dense Llama / Qwen2 / Qwen3 model tensor by tensor onto a
mesh, dequantized to ``param_dtype``; write a GGUF file (F32 or F16) back.

``GGUFFile`` is a ``hf_checkpoint.TensorSource``: it shows the file's tensors under their HF names in HF layout
(llama.cpp's q/k row permutation undone, ``gguf_config.gguf_rows``), so ``hf_checkpoint.load_params`` loads it as
it loads a checkpoint directory: each device's block is read from the memory-mapped file (``gguf.GGUFReader``),
whole rows of the block's row range (quantization blocks run along a row) dequantized with
``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K), then cut to
the block's columns. The model config comes from the file's metadata (``gguf_config.model_kwargs``). ``save_gguf``
streams one tensor at a time, q/k rows permuted back for llama.cpp, with the source file's ``tokenizer.*`` and
``general.*`` metadata copied through verbatim.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from gyre_jax.model import gguf_config
from gyre_jax.model.config import ConfigMismatchError, ModelConfig
from gyre_jax.model.hf_checkpoint import CheckpointMismatchError, hf_tensor_entries, load_params
from gyre_jax.model.sharding import Rules

GGUF_SUFFIX = ".gguf"
# Tensor types read here (all that gguf.quants dequantizes among llama.cpp's common file types)
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
EXPORT_DTYPES = ("float32", "float16")
# Metadata copied from a source file when exporting: the tokenizer (vocabulary, merges, special ids, chat template)
# and the model card; the architecture keys and the file type are the written model's own.
COPIED_PREFIXES = ("tokenizer.", "general.")
NOT_COPIED = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")
_SMALL_ARRAY = 64  # metadata arrays up to this length are kept in ``GGUFFile.metadata`` (e.g. general.languages)


def _gguf():
    """The ``gguf`` package (llama.cpp's reader), with the error that says how to install it."""
    try:
        import gguf
    except ImportError:  # pragma: no cover - a project dependency
        raise ModuleNotFoundError(
            "reading GGUF files needs the gguf package: pip install 'gguf>=0.19,<0.20' (a project dependency)"
        ) from None
    return gguf


def _open_reader(file: Path):
    gguf = _gguf()
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: a GGUF model file was expected")
    try:
        return gguf.GGUFReader(str(file))
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError / IndexError / struct errors, unnamed
        raise CheckpointMismatchError(
            f"{file} is not a readable GGUF file ({type(exc).__name__}: {exc}); it may be truncated (an interrupted "
            f"download or copy: {file.stat().st_size} bytes on disk): download or copy it again"
        ) from None


def _scalar_metadata(reader) -> dict[str, Any]:
    """The file's metadata as Python values: every scalar and string (a float32 as its shortest decimal), arrays of up
    to ``_SMALL_ARRAY`` items
    (the tokenizer's vocabulary and merges are left out: ``save_gguf`` copies them from the reader's fields)."""
    gguf = _gguf()
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > _SMALL_ARRAY:
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.FLOAT32:  # the shortest decimal of the float32: 1e-05, not
            value = float(str(np.float32(value)))  # 9.999999747378752e-06 (what the converter was given)
        out[key] = value
    return out


class GGUFFile:
    """A GGUF model file as a ``TensorSource``: its tensors by HF name, in HF layout, read block by block."""

    supported_dtypes = SUPPORTED_TYPES
    dtype_words = "tensor types this loader does not dequantize"
    config_hint = (
        "The file's metadata does not describe its tensors: convert the model again with llama.cpp's "
        "convert_hf_to_gguf.py."
    )

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = _open_reader(self.path)
        self.metadata = _scalar_metadata(self.reader)
        self.arch = self.metadata.get("general.architecture")
        self._tensors: dict[str, Any] = {}  # HF name (or the GGUF name when it has none) -> ReaderTensor
        self._gguf_names: dict[str, str] = {}
        self.extra: dict[str, Any] = {}  # GGUF tensors that are no parameter (rope_freqs)
        for t in self.reader.tensors:
            if t.name == gguf_config.ROPE_FREQS:
                self.extra[t.name] = t
                continue
            name = gguf_config.hf_name(t.name) or t.name  # an unknown name is reported as unexpected
            self._tensors[name] = t
            self._gguf_names[name] = t.name

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._tensors.clear()
        self.reader = None

    # -- the model it holds ----------------------------------------------------------------------------------------
    def gguf_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> shape in numpy (HF) order."""
        return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in self.reader.tensors}

    def model_config(self, **overrides) -> ModelConfig:
        """The ``ModelConfig`` its metadata describes (``overrides``: our compute fields, e.g. ``dtype``). Raises
        ConfigMismatchError naming the file and the key for a model this implementation does not compute."""
        source = str(self.path)
        kw = gguf_config.model_kwargs(self.metadata, self.gguf_shapes(), source)
        if gguf_config.ROPE_FREQS in self.extra:
            divisors = np.asarray(self.extra[gguf_config.ROPE_FREQS].data, np.float32).reshape(-1)
            kw.update(gguf_config.rope_from_freqs(divisors, kw, source))
        try:
            return ModelConfig(**{**kw, **overrides})
        except ValueError as exc:
            raise ConfigMismatchError(f"{source} gives an invalid model: {exc}") from None

    @property
    def context_length(self) -> int:
        """``{arch}.context_length`` (HF ``max_position_embeddings``), 0 when absent."""
        return int(self.metadata.get(f"{self.arch}.context_length") or 0)

    def hf_base_config(self) -> dict[str, Any]:
        """The HF ``config.json`` keys its metadata holds beyond the architecture (``save_hf_checkpoint``'s
        ``base_config`` for a GGUF-loaded model): ``max_position_embeddings`` and the special token ids."""
        out: dict[str, Any] = {}
        if self.context_length:
            out["max_position_embeddings"] = self.context_length
        for ours, theirs in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
            value = self.metadata.get(f"tokenizer.ggml.{theirs}_token_id")
            if value is not None:
                out[f"{ours}_token_id"] = int(value)
        return out

    # -- TensorSource --------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def file(self, name: str) -> Path:
        return self.path

    def label(self, name: str) -> str:
        """The GGUF name (``blk.0.attn_q.weight``), with the HF name it stands for."""
        gname = self._gguf_names.get(name) or gguf_config.gguf_name(name)
        return f"{gname} ({name})" if gname != name else name

    def dtype_code(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def _heads(self, name: str) -> int:
        """Heads llama.cpp permuted tensor ``name``'s rows over (0: none), from the file's own head counts."""
        if self.arch not in gguf_config.PERMUTED_QK:
            return 0
        heads = int(self.metadata.get(f"{self.arch}.attention.head_count") or 0)
        kv = int(self.metadata.get(f"{self.arch}.attention.head_count_kv") or heads)
        if ".self_attn.q_proj." in name:
            return heads
        if ".self_attn.k_proj." in name:
            return kv
        return 0

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """tensor[index] (HF layout, float32) dequantizing only the rows the block covers."""
        gguf = _gguf()
        t = self._tensors[name]
        qtype = t.tensor_type
        shape = self.shape(name)
        rows = slice(*index[0].indices(shape[0]))
        heads = self._heads(name)
        if len(shape) == 1:
            if qtype.name not in ("F32", "F16"):  # a quantized vector: its blocks span the whole row
                full = gguf.quants.dequantize(np.asarray(t.data), qtype).reshape(-1)
            else:
                full = np.asarray(t.data, np.float32).reshape(-1)
            if heads:
                full = full[gguf_config.gguf_rows(heads, shape[0])]
            return full[rows].astype(np.float32)
        if heads:  # the HF rows r0..r1 lie at these rows of the file
            which = gguf_config.gguf_rows(heads, shape[0])[rows]
            raw = t.data[which]
        else:
            raw = t.data[rows]
        block = gguf.quants.dequantize(np.asarray(raw), qtype)  # [rows, columns] float32
        return block[(slice(None),) + tuple(index[1:])]


def read_gguf_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of the GGUF file at ``path`` (``overrides`` as in ``load_gguf_checkpoint``)."""
    with GGUFFile(path) as f:
        return f.model_config(**overrides)


def load_gguf_params(
    path: str | os.PathLike, cfg: ModelConfig, mesh: Mesh, rules: Rules, *, ignore_unexpected=()
) -> tuple[nnx.GraphDef, nnx.State]:
    """The GGUF file's tensors as params of ``Transformer(cfg)`` on their target shardings, dequantized to
    ``cfg.param_dtype`` (``hf_checkpoint.load_params`` over a ``GGUFFile``: every name, shape and tensor type is
    checked before any tensor is read)."""
    with GGUFFile(path) as f:
        return load_params(f, cfg, mesh, rules, ignore_unexpected=ignore_unexpected)


def load_gguf_checkpoint(
    path: str | os.PathLike, mesh: Mesh, rules: Rules, **overrides
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """A GGUF file -> (ModelConfig, graphdef, sharded params). ``overrides`` set the compute fields the file does not
    define (``dtype``, ``param_dtype``, ``remat_policy`` ...)."""
    with GGUFFile(path) as f:
        cfg = f.model_config(**overrides)
        graphdef, params = load_params(f, cfg, mesh, rules)
    return cfg, graphdef, params


# -- saving --------------------------------------------------------------------------------------------------------


def _copied_fields(reader) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, array item type) of the ``COPIED_PREFIXES`` metadata of a GGUF file's reader."""
    gguf = _gguf()
    out = []
    for key, field in reader.fields.items():
        if not key.startswith(COPIED_PREFIXES) or key in NOT_COPIED:
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        out.append((key, field.contents(), field.types[0], field.types[-1] if array else None))
    return out


def _add_metadata(writer, meta: Mapping[str, Any], copied: list[tuple[str, Any, Any, Any]]) -> None:
    """``meta`` typed by value (str, float32, else uint32), then the ``copied`` fields with their own types."""
    types = _gguf().GGUFValueType
    for key, value in meta.items():
        kind = types.STRING if isinstance(value, str) else types.FLOAT32 if isinstance(value, float) else types.UINT32
        writer.add_key_value(key, value, kind)
    for key, value, kind, sub in copied:
        writer.add_key_value(key, value, kind, sub_type=sub)


def save_gguf(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: nnx.State,
    *,
    dtype: str = "float16",
    metadata_from: str | os.PathLike | None = None,
    context_length: int = 0,
    extra_metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Writes ``params`` as a GGUF file llama.cpp loads; returns its path.

    dtype: "float16" (matrices F16, norms and biases F32, as llama.cpp's converter's ``--outtype f16``) or "float32".
    ``metadata_from``: a GGUF file whose ``tokenizer.*`` and ``general.*`` keys are copied verbatim (a model loaded
    from GGUF keeps its tokenizer and chat template); ``context_length``: ``{arch}.context_length`` (default: the
    source's, else the RoPE's original length, else 4096); ``extra_metadata``: more string / number keys. Peak host
    memory is one tensor.
    """
    gguf = _gguf()
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"GGUF export dtype={dtype!r} must be one of {EXPORT_DTYPES} (quantize with llama.cpp after)")
    copied = []
    if metadata_from is not None:
        with GGUFFile(metadata_from) as src:
            copied = _copied_fields(src.reader)
            context_length = context_length or src.context_length
    context_length = context_length or cfg.rope_original_max_position or 4096
    meta = gguf_config.gguf_metadata(cfg, context_length)

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), cfg.family)
    meta["general.file_type"] = 1 if dtype == "float16" else 0  # MOSTLY_F16 / ALL_F32
    meta["general.quantization_version"] = gguf.GGML_QUANT_VERSION
    _add_metadata(writer, {**meta, **(extra_metadata or {})}, copied)

    tensors = []  # (GGUF name, numpy dtype, producer) in file order
    for name, shape, _, produce in hf_tensor_entries(cfg, params, np.dtype(np.float32)):
        store = np.dtype(np.float16) if dtype == "float16" and len(shape) == 2 else np.dtype(np.float32)
        heads = gguf_config.qk_heads(cfg.family, name, cfg)
        writer.add_tensor_info(gguf_config.gguf_name(name), shape, store, int(np.prod(shape)) * store.itemsize)
        tensors.append((store, heads, produce, shape))
    if cfg.rope_type == "llama3":
        divisors = gguf_config.llama3_divisors(cfg)
        writer.add_tensor_info(gguf_config.ROPE_FREQS, divisors.shape, divisors.dtype, divisors.nbytes)
        tensors.append((np.dtype(np.float32), 0, lambda d=divisors: d, divisors.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for store, heads, produce, shape in tensors:
        array = np.asarray(produce(), np.float32)
        if heads:  # llama.cpp's q/k row order: GGUF row g holds HF row argsort(gguf_rows)[g]
            array = array[np.argsort(gguf_config.gguf_rows(heads, shape[0]))]
        writer.write_tensor_data(np.ascontiguousarray(array.astype(store)))
    writer.close()
    os.replace(tmp, out)
    return out
