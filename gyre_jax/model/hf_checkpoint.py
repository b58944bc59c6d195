"""Hugging Face checkpoint directories <-> sharded params: load tensor by tensor onto a mesh, save back.

A checkpoint directory holds ``config.json``, one ``model.safetensors`` or several shards with
``model.safetensors.index.json``, and the tokenizer files. Loading never builds a host copy of the
model: each parameter is created with ``jax.make_array_from_callback`` on its target sharding, and
each device's block is read from the memory-mapped safetensors file (``safe_open(...).get_slice``)
with only the rows and columns that block needs (``hf_params.read_block``). The checkpoint is checked
against the config before any tensor is read: every missing, unexpected or mis-shaped tensor is named.
``load_params`` does the same over any ``TensorSource`` (tensors by HF name in HF layout): a GGUF file's is
``gguf_checkpoint.GGUFFile``.
Saving streams one tensor (one expert) at a time to disk in HF layout, in shards of at most
``max_shard_bytes``, and writes the index, ``config.json`` and optionally the tokenizer files.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open

from gyre_jax.disk import replacing
from gyre_jax.model import hf_config, hf_params
from gyre_jax.model.config import HF_ARCHITECTURES, ModelConfig, ModelInputError
from gyre_jax.model.sharding import Rules, abstract_model, param_shardings

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Tensors HF itself ignores on load (non-persistent buffers some old exports contain).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16),
    "F64": np.dtype(np.float64),
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointMismatchError(ModelInputError):
    """The checkpoint's tensors do not match the model its config.json describes (names, shapes and dtypes listed),
    or a weights file cannot be read (named)."""


def read_hf_config(path: str | os.PathLike) -> dict:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: a Hugging Face checkpoint directory needs config.json")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelInputError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelInputError(f"{file} holds a JSON {type(config).__name__}, not an object of config keys")
    return config


def read_model_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of the checkpoint at ``path`` (its config.json; ``overrides`` as in ``load_hf_checkpoint``).
    Raises ConfigMismatchError naming the file and the key for a config this implementation cannot compute."""
    return ModelConfig.from_hf_config(read_hf_config(path), source=str(Path(path) / CONFIG_FILE), **overrides)


def _open_safetensors(file: Path):
    """``safe_open`` of one weights file; CheckpointMismatchError naming it when it cannot be read (truncated ...)."""
    try:
        return safe_open(str(file), framework="numpy")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError / OSError, unnamed
        raise CheckpointMismatchError(
            f"{file} is not a readable safetensors file ({type(exc).__name__}: {exc}); it may be truncated "
            f"(an interrupted download or copy: {file.stat().st_size} bytes on disk): download or copy it again"
        ) from None


class TensorSource(Protocol):
    """Read-only tensors by HF name in HF layout, read block by block (a context manager): what ``load_params``
    loads from. ``SafetensorsDir`` (a checkpoint directory) and ``gguf_checkpoint.GGUFFile`` (a GGUF file) are two."""

    path: Path
    supported_dtypes: tuple[str, ...]  # the dtype codes ``read`` can give as floats
    dtype_words: str  # the error's words for the others: "dtypes that are not floating point" ...
    config_hint: str  # what to do when the tensors do not match the config

    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def file(self, name: str) -> Path: ...
    def label(self, name: str) -> str: ...  # the name the file itself uses, for an error
    def dtype_code(self, name: str) -> str: ...
    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray: ...
    def __enter__(self) -> TensorSource: ...
    def __exit__(self, *exc) -> None: ...


class SafetensorsDir:
    """Lazy, read-only view of the safetensors tensors of a checkpoint directory (a context manager)."""

    supported_dtypes = tuple(sorted(_DTYPES))
    dtype_words = "dtypes that are not floating point"
    config_hint = "Check that config.json belongs to these weights."

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map")
            except (json.JSONDecodeError, AttributeError) as exc:
                raise CheckpointMismatchError(f"{index} is not a JSON object with a weight_map: {exc}") from None
            if not isinstance(weight_map, dict):
                raise CheckpointMismatchError(f"{index} has no 'weight_map' object")
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_FILE).is_file():
            files, weight_map = [SINGLE_FILE], None
        else:
            found = sorted(p.name for p in self.path.glob("*.safetensors"))
            if len(found) != 1:
                raise FileNotFoundError(
                    f"{self.path}: expected {SINGLE_FILE}, or {INDEX_FILE} with its shards"
                    + (f" (found {found} without an index)" if found else " (no *.safetensors file)")
                )
            files, weight_map = found, None
        self._handles = {}
        self._where: dict[str, str] = {}
        for name in files:
            if not (self.path / name).is_file():
                raise FileNotFoundError(f"{self.path / name} is listed in {INDEX_FILE} but does not exist")
            handle = _open_safetensors(self.path / name)
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = name
        if weight_map is not None:
            wrong = sorted(k for k, f in weight_map.items() if self._where.get(k) != f)
            if wrong:
                raise CheckpointMismatchError(
                    f"{self.path / INDEX_FILE} lists tensors that are not in the named shard: {_preview(wrong)}"
                )

    def __enter__(self) -> SafetensorsDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()

    def names(self) -> list[str]:
        return sorted(self._where)

    def _slice(self, name: str):
        return self._handles[self._where[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def file(self, name: str) -> Path:
        """The file holding tensor ``name``."""
        return self.path / self._where[name]

    def label(self, name: str) -> str:
        return name

    def dtype_code(self, name: str) -> str:
        """The tensor's safetensors dtype code ("BF16", "F32", "I32" ...)."""
        return self._slice(name).get_dtype()

    def dtype(self, name: str) -> np.dtype:
        code = self.dtype_code(name)
        if code not in _DTYPES:
            raise CheckpointMismatchError(
                f"{self.file(name)}: tensor {name} has dtype {code}; supported: {sorted(_DTYPES)}"
            )
        return _DTYPES[code]

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """tensor[index] as a numpy array (only that block is read from disk)."""
        return np.asarray(self._slice(name)[index])


def _preview(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)})"


def check_tensors(cfg: ModelConfig, ckpt: TensorSource, ignore_unexpected: Iterable[str] = (), note: str = "") -> None:
    """Raises CheckpointMismatchError naming every missing, unexpected, mis-shaped and non-float (or, in a GGUF file,
    not dequantizable) tensor (with its file). ``note``: appended to the message (e.g. which config keys took
    transformers' defaults)."""
    expected = hf_params.hf_tensor_shapes(cfg)
    ignore = set(ignore_unexpected)
    present = [n for n in ckpt.names() if n not in ignore and not n.endswith(IGNORED_SUFFIXES)]
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    common = sorted(set(present) & set(expected))
    misshaped = [f"{ckpt.label(n)}: {list(ckpt.shape(n))} != expected {list(expected[n])} in {ckpt.file(n).name}"
                 for n in common if ckpt.shape(n) != expected[n]]  # fmt: skip
    wrong_dtype = [f"{ckpt.label(n)}: {ckpt.dtype_code(n)} in {ckpt.file(n).name}" for n in common
                   if ckpt.dtype_code(n) not in ckpt.supported_dtypes]  # fmt: skip
    problems = []
    if missing:
        problems.append(f"missing tensors {_preview([_label(ckpt, n) for n in missing])}")
    if unexpected:
        problems.append(f"unexpected tensors {_preview([ckpt.label(n) for n in unexpected])}")
    if misshaped:
        problems.append(f"wrong shapes {_preview(misshaped)}")
    if wrong_dtype:
        problems.append(f"{ckpt.dtype_words} (expected one of {list(ckpt.supported_dtypes)}) {_preview(wrong_dtype)}")
    if problems:
        kind = HF_ARCHITECTURES[cfg.hf_model_type]
        raise CheckpointMismatchError(
            f"checkpoint {ckpt.path} does not match the {kind} its config describes ({cfg.num_layers} layers, "
            f"hidden {cfg.embed_dim}, vocab {cfg.vocab_size}, tie_word_embeddings={cfg.tie_embeddings}"
            + (f", {cfg.num_experts} experts" if cfg.is_moe else "")
            + "): "
            + (f"{note} " if note else "")
            + "; ".join(problems)
            + ". "
            + ckpt.config_hint
        )


def _label(ckpt: TensorSource, name: str) -> str:
    """``ckpt.label(name)`` for a name the file may not hold (a missing tensor): the HF name when it has none."""
    try:
        return ckpt.label(name)
    except KeyError:
        return name


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def defaults_note(path: str | os.PathLike) -> str:
    """Which shape-changing keys config.json lacks (transformers' defaults were used), for a mismatch message."""
    try:
        keys = hf_config.defaulted_shape_keys(read_hf_config(path))
    except (OSError, ModelInputError):
        return ""
    if not keys:
        return ""
    return (
        f"{Path(path) / CONFIG_FILE} has no {', '.join(k.split('=')[0] for k in keys)}: transformers' defaults "
        f"({', '.join(keys)}) were used, as transformers would; add the model's own values;"
    )


def load_hf_params(
    path: str | os.PathLike, cfg: ModelConfig, mesh: Mesh, rules: Rules, *, ignore_unexpected: Iterable[str] = ()
) -> tuple[nnx.GraphDef, nnx.State]:
    """Reads the checkpoint directory at ``path`` into params of ``Transformer(cfg)`` placed with their target
    shardings (``load_params`` over its ``SafetensorsDir``)."""
    with SafetensorsDir(path) as ckpt:
        return load_params(ckpt, cfg, mesh, rules, ignore_unexpected=ignore_unexpected, note=defaults_note(path))


def load_params(
    ckpt: TensorSource,
    cfg: ModelConfig,
    mesh: Mesh,
    rules: Rules,
    *,
    ignore_unexpected: Iterable[str] = (),
    note: str = "",
) -> tuple[nnx.GraphDef, nnx.State]:
    """Reads ``ckpt``'s tensors into params of ``Transformer(cfg)`` placed with their target shardings.

    Each parameter's device blocks are read straight from the source (memory-mapped files: a block shared
    by several devices, e.g. a replicated one, is read once) and cast to ``cfg.param_dtype``. Every tensor's
    name, shape and dtype is checked first (``check_tensors``; ``note`` is added to its message).
    """
    graphdef, abstract_state = abstract_model(cfg)
    shardings = param_shardings(abstract_state, rules, mesh)
    specs = hf_params.model_specs(cfg)
    check_tensors(cfg, ckpt, ignore_unexpected, note=note)

    def load(key_path, var, sharding_var):
        spec = specs.get(_path_key(key_path))
        if spec is None:  # the mapping and the model disagree: a bug here, not in the checkpoint
            raise RuntimeError(f"no checkpoint mapping for parameter {'/'.join(_path_key(key_path))}")
        if tuple(var.shape) != spec.shape:
            raise RuntimeError(f"parameter {'/'.join(spec.path)} has shape {var.shape}, mapping says {spec.shape}")
        blocks: dict[tuple, np.ndarray] = {}

        def block(index):
            key = tuple((s.start, s.stop) for s in index)
            if key not in blocks:
                blocks[key] = hf_params.read_block(spec, ckpt.read, index).astype(var.dtype)
            return blocks[key]

        array = jax.make_array_from_callback(tuple(var.shape), sharding_var.get_value(), block)
        return var.replace(array)

    params = jax.tree_util.tree_map_with_path(
        load, abstract_state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return graphdef, params


def load_hf_checkpoint(
    path: str | os.PathLike, mesh: Mesh, rules: Rules, *, ignore_unexpected: Iterable[str] = (), **overrides
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """config.json + weights -> (ModelConfig, graphdef, sharded params). ``overrides`` set ModelConfig fields
    the checkpoint does not define (``dtype``, ``param_dtype``, ``remat_policy``, ``moe_impl``)."""
    cfg = read_model_config(path, **overrides)
    graphdef, params = load_hf_params(path, cfg, mesh, rules, ignore_unexpected=ignore_unexpected)
    return cfg, graphdef, params


# -- saving ----------------------------------------------------------------------------------------


# One tensor to write: (HF name, HF shape, stored dtype, a function producing its host array in HF layout).
_Entry = tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]


def _nbytes(entry: _Entry) -> int:
    return int(np.prod(entry[1])) * entry[2].itemsize


def _write_safetensors(file: Path, entries: Sequence[_Entry]) -> None:
    """Streams tensors into one safetensors file: header first (from known shapes), then each tensor's bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        name, shape, dtype, _ = entry
        size = _nbytes(entry)
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with replacing(file, "wb") as f:  # renamed over ``file`` once whole and fsynced
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype, produce in entries:
            array = np.ascontiguousarray(produce().astype(dtype))
            if array.shape != tuple(shape):
                raise RuntimeError(f"tensor {name}: produced shape {array.shape}, header says {shape}")
            f.write(array.tobytes())


def _host(array, index: tuple[int, ...]) -> np.ndarray:
    """``array[index]`` (a layer, an expert) as a host array; the whole array for ``()`` (no device copy). An array
    spanning processes is gathered (a collective: every process must ask for the same slices in the same order)."""
    part = array[index] if index else array
    if isinstance(part, jax.Array) and not part.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(part, tiled=True))
    return np.asarray(part)


def _spans_processes(params: nnx.State) -> bool:
    """Whether an array of ``params`` has devices of other processes (a cell over several hosts)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    values = [v.get_value() if isinstance(v, nnx.Variable) else v for v in leaves]
    return any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in values)


def hf_tensor_entries(cfg: ModelConfig, params: nnx.State, target: np.dtype | None) -> list[_Entry]:
    """Every HF tensor of ``params`` (a stacked MoE parameter gives one per expert), produced lazily, stored as
    ``target`` (None: each parameter's own dtype), in HF's order whatever our layer layout (``cfg.scan_layers``:
    layer ``i`` of a stacked parameter is its slice ``i``). Raises for params that do not match ``cfg``."""
    by_path = {
        _path_key(p): v
        for p, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    }
    ours = hf_params.model_specs(cfg)
    missing = sorted("/".join(p) for p in set(ours) - set(by_path))
    extra = sorted("/".join(p) for p in set(by_path) - set(ours))
    if missing or extra:
        raise ValueError(f"params do not match the config: missing {missing}, unexpected {extra}")
    entries: list[_Entry] = []
    for spec in hf_params.param_specs(cfg).values():
        stacked = cfg.scan_layers and spec.path[0] == "layers"
        var = by_path[spec.path[:1] + spec.path[2:]] if stacked else by_path[spec.path]
        array = var.get_value() if isinstance(var, nnx.Variable) else var
        lead = (int(spec.path[1]),) if stacked else ()  # the layer's index into a stacked array
        store = target or np.dtype(array.dtype)
        if spec.layout == "stacked":
            for j, name in enumerate(spec.hf_names):
                entries.append(
                    (name, spec.hf_shape, store, lambda a=array, i=lead + (j,), s=spec: hf_params.to_hf(s, _host(a, i)))
                )
        else:
            entries.append(
                (
                    spec.hf_names[0],
                    spec.hf_shape,
                    store,
                    lambda a=array, i=lead, s=spec: hf_params.to_hf(s, _host(a, i)),
                )
            )
    return entries


def _shards(entries: Sequence[_Entry], max_shard_bytes: int) -> list[list[_Entry]]:
    """``entries`` in order, cut into shards of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = _nbytes(entry)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _weight_files(out: Path, count: int) -> list[Path]:
    """The safetensors files of ``count`` shards: one ``model.safetensors``, or numbered shards."""
    if count == 1:
        return [out / SINGLE_FILE]
    return [out / f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write_weights(out: Path, shards: list[list[_Entry]]) -> list[Path]:
    """Replaces the directory's safetensors: one ``model.safetensors``, or numbered shards and their index."""
    for stale in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    files, weight_map = _weight_files(out, len(shards)), {}
    if len(shards) == 1:
        _write_safetensors(files[0], shards[0])
        return files
    for file, shard in zip(files, shards):
        _write_safetensors(file, shard)
        weight_map.update({name: file.name for name, *_ in shard})
    total = sum(_nbytes(e) for shard in shards for e in shard)
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files


def _write_config(out: Path, cfg: ModelConfig, torch_dtype: str, base_config: dict | None) -> None:
    """``config.json``: ``cfg``'s HF config over ``base_config``'s other keys (less those it replaces)."""
    config = {
        k: v
        for k, v in (base_config or {}).items()
        if k not in ("rope_parameters", "num_local_experts", "dtype", "transformers_version")
    }
    config.update(cfg.to_hf_config(torch_dtype=torch_dtype))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def save_hf_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: nnx.State,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 4 * 1024**3,
    tokenizer_dir: str | os.PathLike | None = None,
    base_config: dict | None = None,
) -> list[Path]:
    """Writes ``params`` as a Hugging Face checkpoint directory; returns the safetensors files written. A model with a
    LoRA adapter (``cfg.lora``) is written merged (``lora.merged_params``); ``lora.save_peft_adapter`` writes the
    adapter alone, in PEFT's format.

    dtype: the stored dtype ("bfloat16", "float32", "float16"); None keeps each parameter's own dtype
    (so load -> save -> load is bit-identical). Peak host memory is one tensor (one expert of a MoE
    layer). ``tokenizer_dir``: copy its tokenizer files alongside; ``base_config``: a source
    config.json whose other keys (e.g. ``max_position_embeddings``, token ids) are kept.

    Params spanning several processes (a cell over several hosts): every process calls this with the same
    arguments; each tensor is gathered in turn (peak host memory is still one tensor) and process 0 writes the
    directory (``path`` must be its filesystem's); the others return the paths it writes.
    """
    if cfg.lora.enabled:  # a LoRA model is saved merged (W + scale A B); lora.save_peft_adapter writes the adapter
        from gyre_jax.model.lora import merged_params

        cfg, params = merged_params(cfg, params)
    out = Path(path)
    target = np.dtype(jnp.bfloat16) if dtype == "bfloat16" else np.dtype(dtype) if dtype else None
    entries = hf_tensor_entries(cfg, params, target)
    shards = _shards(entries, max_shard_bytes)
    if jax.process_index() != 0 and _spans_processes(params):  # take part in each tensor's gather, write nothing
        for shard in shards:
            for *_, produce in shard:
                produce()
        return _weight_files(out, len(shards))
    out.mkdir(parents=True, exist_ok=True)
    files = _write_weights(out, shards)
    stored = {np.dtype(jnp.bfloat16): "bfloat16", np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}
    torch_dtype = stored.get(target) if target is not None else stored.get(entries[0][2], cfg.param_dtype)
    _write_config(out, cfg, torch_dtype, base_config)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)
    return files
