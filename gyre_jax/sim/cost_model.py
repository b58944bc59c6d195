"""The simulator's cost model: what serving, training, role switches and the data pipeline cost in time.

Every number is either configured (a preset derives it from model and hardware specs with
``roofline_cost_model``, stating its assumptions) or measured (``fit_cost_model`` fits it to timings
recorded by a real run). Serialized form (``CostModel.to_json`` / ``CostModel.load``):

    {"format": "gyre-jax/cost-model", "version": 1, "source": "roofline: ..." | "measured: <run>",
     "serving":  {"replica_accelerators": 8, "slots_per_replica": 8,
                  "decode_base_s": ..., "decode_per_seq_s": ..., "decode_per_context_token_s": ...,
                  "prefill_base_s": ..., "prefill_per_token_s": ..., "prefill_per_token_context_s": ...},
     "training": {"flops_per_token": ..., "flops_per_token_sq": ..., "accelerator_flops": ...,
                  "reference_cell_accelerators": 32, "scaling_exponent": 0.95, "min_cell_accelerators": 16,
                  "micro_step_tokens": 262144, "micro_step_overhead_s": ..., "optimizer_step_s": ...,
                  "grad_reduce_s": ..., "warmup_micro_step_s": 0.0, "warmup_optimizer_step_s": 0.0},
     "switch":   {"serving_to_training_s": 8.52, "training_to_serving_s": 3.46, "weight_sync_s": ...,
                  "kv_migration_s_per_token": ...},
     "pipeline": {"processing_s_per_token": ..., "workers": 64, "step_boundary_s": 0.0}}

Formulas (one serving replica decoding B sessions whose contexts sum to X tokens; a cell of n
accelerators holds n / replica_accelerators replicas and n / replica_accelerators * slots_per_replica
sessions):

    decode step (one token for each of the B sessions) = decode_base_s + decode_per_seq_s * B
                                                          + decode_per_context_token_s * X
    prefill of q new tokens onto a context of c tokens  = prefill_base_s + prefill_per_token_s * q
                                                          + prefill_per_token_context_s * q * c
    forward + backward of a branch of l tokens (FLOPs)   = flops_per_token * l + flops_per_token_sq * l^2
    training rate of a cell of n accelerators (FLOP/s)   = accelerator_flops * r * (n / r) ** scaling_exponent,
                                                          r = reference_cell_accelerators
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "gyre-jax/cost-model"
VERSION = 1


class CostModelError(ValueError):
    """A cost model file or value is invalid; the message names the field and what is allowed."""


@dataclass(frozen=True)
class ServingCost:
    replica_accelerators: int
    slots_per_replica: int
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_context_token_s: float
    prefill_base_s: float
    prefill_per_token_s: float
    prefill_per_token_context_s: float

    def decode_step_s(self, batch: float, context_tokens: float) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_context_token_s * context_tokens

    def prefill_s(self, new_tokens, context_tokens):
        """Works on scalars and numpy arrays alike."""
        return (
            self.prefill_base_s
            + self.prefill_per_token_s * new_tokens
            + self.prefill_per_token_context_s * new_tokens * context_tokens
        )


@dataclass(frozen=True)
class TrainingCost:
    flops_per_token: float
    flops_per_token_sq: float
    accelerator_flops: float  # achieved FLOP/s per accelerator in a reference-size cell (peak x MFU)
    reference_cell_accelerators: int
    scaling_exponent: float = 1.0
    min_cell_accelerators: int = 1  # the smallest cell that can hold a training replica
    micro_step_tokens: int = 262_144
    micro_step_overhead_s: float = 0.0
    optimizer_step_s: float = 0.0
    grad_reduce_s: float = 0.0  # summing satellites' gradients onto the core, once per step
    grad_receive_s: float = 0.0  # per satellite that trained in the step: its gradients crossing to the core's hosts
    warmup_micro_step_s: float = 0.0  # a cell's first micro-step takes this much longer (its jit compile)
    warmup_optimizer_step_s: float = 0.0  # the first optimizer step takes this much longer (its jit compile)

    def branch_flops(self, length):
        """Forward + backward FLOPs of a branch of ``length`` tokens (scalar or array)."""
        return self.flops_per_token * length + self.flops_per_token_sq * np.square(length, dtype=np.float64)

    def cell_flops(self, accelerators: int) -> float:
        ref = self.reference_cell_accelerators
        return self.accelerator_flops * ref * (accelerators / ref) ** self.scaling_exponent

    @property
    def micro_step_flops(self) -> float:
        """The work one micro-step carries: ``micro_step_tokens`` tokens of linear cost."""
        return self.flops_per_token * self.micro_step_tokens


@dataclass(frozen=True)
class SwitchCost:
    serving_to_training_s: float
    training_to_serving_s: float
    weight_sync_s: float  # serving cells pause this long for a new policy version; satellites pull it
    kv_migration_s_per_token: float = 0.0  # moving a session's KV cache to another cell


@dataclass(frozen=True)
class PipelineCost:
    processing_s_per_token: float = 0.0  # trajectory processing (trees, selection, packing) on the host
    workers: int = 1  # host processes that process a whole batch in parallel (non-streaming)
    # host time after each optimizer step before the next step's micro-steps can be claimed (the data of
    # the next step that waited for it goes through the pipeline, the step's queue is set up)
    step_boundary_s: float = 0.0


@dataclass(frozen=True)
class CostModel:
    serving: ServingCost
    training: TrainingCost
    switch: SwitchCost
    pipeline: PipelineCost = field(default_factory=PipelineCost)
    source: str = "configured"

    def __post_init__(self) -> None:
        _validate(self)

    # -- serialization ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "source": self.source,
            "serving": dataclasses.asdict(self.serving),
            "training": dataclasses.asdict(self.training),
            "switch": dataclasses.asdict(self.switch),
            "pipeline": dataclasses.asdict(self.pipeline),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "cost model") -> CostModel:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CostModelError(f'{where}: not a cost model (expected "format": "{FORMAT}")')
        if data.get("version") != VERSION:
            raise CostModelError(f"{where}: cost model version {data.get('version')!r} (this reader knows {VERSION})")
        parts = {}
        for name, kind in (
            ("serving", ServingCost),
            ("training", TrainingCost),
            ("switch", SwitchCost),
            ("pipeline", PipelineCost),
        ):
            section = data.get(name, {} if name == "pipeline" else None)
            if not isinstance(section, dict):
                raise CostModelError(f"{where}: missing section {name!r}")
            known = {f.name: f for f in dataclasses.fields(kind)}
            unknown = set(section) - set(known)
            if unknown:
                raise CostModelError(
                    f"{where}: unknown field(s) {sorted(unknown)} in {name!r} (known: {sorted(known)})"
                )
            required = [
                f.name
                for f in known.values()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            ]
            missing = [k for k in required if k not in section]
            if missing:
                raise CostModelError(f"{where}: {name!r} is missing {missing}")
            values = {}
            for key, value in section.items():
                expected = int if known[key].type in ("int", int) else float
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise CostModelError(f"{where}: {name}.{key}={value!r} must be a number")
                if expected is int and value != int(value):
                    raise CostModelError(f"{where}: {name}.{key}={value!r} must be an integer")
                values[key] = expected(value)
            parts[name] = kind(**values)
        return cls(source=str(data.get("source", "configured")), **parts)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostModel:
        path = Path(path)
        if not path.is_file():
            raise CostModelError(f"cost model {path} not found")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise CostModelError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, where=str(path))

    def replace(self, **sections: Any) -> CostModel:
        """A copy with fields replaced per section: ``cm.replace(switch={"weight_sync_s": 1.0})``."""
        parts = {}
        for name, changes in sections.items():
            if name == "source":
                parts[name] = changes
                continue
            current = getattr(self, name)
            parts[name] = dataclasses.replace(current, **changes)
        return dataclasses.replace(self, **parts)


def _validate(cm: CostModel) -> None:
    def positive(section: str, obj: Any, names: Sequence[str], strict: bool = True) -> None:
        for n in names:
            v = getattr(obj, n)
            if not np.isfinite(v) or (v <= 0 if strict else v < 0):
                raise CostModelError(f"cost model {section}.{n}={v!r} must be {'> 0' if strict else '>= 0'}")

    s, t, w, p = cm.serving, cm.training, cm.switch, cm.pipeline
    positive("serving", s, ("replica_accelerators", "slots_per_replica", "decode_base_s"))
    positive(
        "serving",
        s,
        (
            "decode_per_seq_s",
            "decode_per_context_token_s",
            "prefill_base_s",
            "prefill_per_token_s",
            "prefill_per_token_context_s",
        ),
        strict=False,
    )
    positive(
        "training",
        t,
        (
            "flops_per_token",
            "accelerator_flops",
            "reference_cell_accelerators",
            "min_cell_accelerators",
            "micro_step_tokens",
        ),
    )
    positive(
        "training",
        t,
        (
            "flops_per_token_sq",
            "micro_step_overhead_s",
            "optimizer_step_s",
            "grad_reduce_s",
            "grad_receive_s",
            "warmup_micro_step_s",
            "warmup_optimizer_step_s",
        ),
        strict=False,
    )
    if not 0.5 <= t.scaling_exponent <= 1.0:
        raise CostModelError(f"cost model training.scaling_exponent={t.scaling_exponent} must be in [0.5, 1]")
    positive(
        "switch",
        w,
        ("serving_to_training_s", "training_to_serving_s", "weight_sync_s", "kv_migration_s_per_token"),
        strict=False,
    )
    positive("pipeline", p, ("processing_s_per_token", "step_boundary_s"), strict=False)
    positive("pipeline", p, ("workers",))


# -- configured from model and hardware specs ---------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """What the cost formulas need to know about the model."""

    total_params: float
    active_params: float  # per token (MoE: the experts a token uses)
    layers: int
    kv_heads: int
    head_dim: int
    attention_dim: int  # query heads x head dim
    serving_bytes_per_param: float = 1.0  # FP8 serving weights
    kv_bytes_per_element: float = 2.0  # BF16 KV cache
    # Only a LoRA adapter's size needs these (``lora_params``); 0 = not given.
    embed_dim: int = 0  # the residual width
    num_experts: int = 0  # experts per MoE layer (0: dense)
    expert_mlp_dim: int = 0  # each expert's hidden size

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_element


# -- LoRA: what training only an adapter changes ----------------------------------------------------------------------
LORA_SIM_TARGETS = ("attention", "experts")
TRAINED_BYTES_PER_PARAM = 16.0  # BF16 weights, FP32 master weights, gradients and Adam's two moments (4+4+4+2 ~ 16)
FROZEN_BYTES_PER_PARAM = 2.0  # a frozen BF16 base: no master copy, gradient or moments


def lora_params(model: ModelSpec, rank: int, targets: Sequence[str] = ("attention",)) -> float:
    """A LoRA adapter's parameters (rank x (inputs + outputs) per adapted projection, as ``ModelConfig.num_lora_params``
    counts them): ``attention`` = q/k/v/o of every layer, ``experts`` = gate/up/down of every expert of every layer
    (the presets' models are MoE in every layer). Needs ``model.embed_dim`` (and the expert fields for experts)."""
    bad = [t for t in targets if t not in LORA_SIM_TARGETS]
    if bad or model.embed_dim <= 0:
        raise CostModelError(
            f"lora_params: targets {tuple(targets)} must be among {LORA_SIM_TARGETS} and the model needs embed_dim > 0"
        )
    e, a, kv = model.embed_dim, model.attention_dim, model.kv_heads * model.head_dim
    per_layer = 0.0
    if "attention" in targets:
        per_layer += rank * ((e + a) + 2 * (e + kv) + (a + e))
    if "experts" in targets:
        if model.num_experts <= 0 or model.expert_mlp_dim <= 0:
            raise CostModelError("lora_params: targets 'experts' needs num_experts and expert_mlp_dim > 0")
        per_layer += model.num_experts * 3 * rank * (e + model.expert_mlp_dim)
    return model.layers * per_layer


def core_accelerators(model: ModelSpec, hw: HardwareSpec, trained_params: float | None = None) -> int:
    """Accelerators whose memory holds the core's training state (activations not counted, as in the presets' cell
    sizes): every parameter trained at ``TRAINED_BYTES_PER_PARAM``, or (``trained_params``: a LoRA adapter's) a frozen
    BF16 base at ``FROZEN_BYTES_PER_PARAM`` plus the adapter's training state."""
    if trained_params is None:
        need = model.total_params * TRAINED_BYTES_PER_PARAM
    else:
        need = model.total_params * FROZEN_BYTES_PER_PARAM + trained_params * TRAINED_BYTES_PER_PARAM
    return int(np.ceil(need / hw.memory_bytes))


def with_lora(cm: CostModel, adapter_fraction: float, switch_weight_share: float) -> CostModel:
    """``cm`` for training a LoRA adapter of ``adapter_fraction`` x the model's parameters instead of all of them.

    - Role switches and weight syncs move the adapter instead of the weights: of each of ``serving_to_training_s``,
      ``training_to_serving_s`` and ``weight_sync_s``, the share ``switch_weight_share`` is taken as weight movement
      (an assumption: the published switch times do not say) and scales by ``adapter_fraction``; the rest (draining,
      session moves, compiles) stays.
    - ``optimizer_step_s`` and ``grad_reduce_s`` (over the trained parameters' moments and gradients) scale by it.
    - Training FLOPs per token: 6 x active parameters becomes 4 x (forward and the activations' backward) plus 2 x the
      adapter's share (no weight gradient of a frozen weight).
    """
    if not 0 <= adapter_fraction <= 1 or not 0 <= switch_weight_share <= 1:
        raise CostModelError(
            f"with_lora: adapter_fraction={adapter_fraction} and switch_weight_share={switch_weight_share} must be in "
            "[0, 1]"
        )
    keep = lambda seconds: seconds * (1 - switch_weight_share + switch_weight_share * adapter_fraction)  # noqa: E731
    w, t = cm.switch, cm.training
    flops = t.flops_per_token * (4 + 2 * adapter_fraction) / 6
    return cm.replace(
        switch={
            "serving_to_training_s": keep(w.serving_to_training_s),
            "training_to_serving_s": keep(w.training_to_serving_s),
            "weight_sync_s": keep(w.weight_sync_s),
        },
        training={
            "flops_per_token": flops,
            "optimizer_step_s": t.optimizer_step_s * adapter_fraction,
            "grad_reduce_s": t.grad_reduce_s * adapter_fraction,
            "grad_receive_s": t.grad_receive_s * adapter_fraction,
        },
        source=f"{cm.source}; LoRA adapter of {adapter_fraction:.4%} of the parameters",
    )


@dataclass(frozen=True)
class Interconnect:
    """The network between hosts: a cell of ``cell_accelerators`` spans ``ceil(cell / accelerators_per_host)``
    hosts, each sending and receiving ``host_bandwidth`` bytes/s (all its NICs) at ``efficiency`` of it."""

    accelerators_per_host: int
    host_bandwidth: float  # bytes/s per host and direction (e.g. 8 x 400 Gb/s InfiniBand = 400e9)
    efficiency: float = 0.7

    def cell_rate(self, cell_accelerators: int) -> float:
        """Bytes/s a cell moves to or from another: its hosts move their shards in parallel."""
        return math.ceil(cell_accelerators / self.accelerators_per_host) * self.host_bandwidth * self.efficiency


def interhost_costs(
    model: ModelSpec, link: Interconnect, cell_accelerators: int, num_cells: int, grad_bytes_per_param: float = 4.0
) -> dict[str, float]:
    """Seconds of the cell-to-cell moves of a run whose cells span hosts, from the bytes moved and the hosts'
    bandwidth (each move is between two cells; a cell's hosts send or receive their shards in parallel):

    - ``weight_sync_s``: a new policy version from the core to every other cell (serving weights,
      ``serving_bytes_per_param``), bound by the core's egress: ``num_cells - 1`` copies;
    - ``grad_receive_s``: one satellite's gradients (``grad_bytes_per_param``: float32 as this project's learner
      sends them) into the core, per satellite that trained in the step;
    - ``kv_migration_s_per_token``: a session's KV (split over its cell's hosts) to another cell.
    """
    if link.accelerators_per_host < 1 or link.host_bandwidth <= 0 or not 0 < link.efficiency <= 1:
        raise CostModelError(
            f"interconnect: accelerators_per_host={link.accelerators_per_host} must be >= 1, host_bandwidth="
            f"{link.host_bandwidth} > 0 and efficiency={link.efficiency} in (0, 1]"
        )
    rate = link.cell_rate(cell_accelerators)
    return {
        "weight_sync_s": model.total_params * model.serving_bytes_per_param * max(0, num_cells - 1) / rate,
        "grad_receive_s": model.total_params * grad_bytes_per_param / rate,
        "kv_migration_s_per_token": model.kv_bytes_per_token / rate,
    }


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator."""

    name: str
    flops: float  # dense BF16 peak FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory_bytes: float


def _roofline_serving(
    model: ModelSpec,
    hw: HardwareSpec,
    g: int,
    slots_per_replica: int,
    decode_mbu: float,
    prefill_mfu: float,
    decode_overhead_s: float,
) -> ServingCost:
    """One serving replica of ``g`` accelerators: memory-bound decode, compute-bound prefill (see
    ``roofline_cost_model``)."""
    return ServingCost(
        replica_accelerators=g,
        slots_per_replica=slots_per_replica,
        decode_base_s=decode_overhead_s
        + model.total_params * model.serving_bytes_per_param / (g * hw.hbm_bandwidth * decode_mbu),
        decode_per_seq_s=2 * model.active_params / (g * hw.flops * prefill_mfu),
        decode_per_context_token_s=model.kv_bytes_per_token / (g * hw.hbm_bandwidth * decode_mbu),
        prefill_base_s=decode_overhead_s,
        prefill_per_token_s=2 * model.active_params / (g * hw.flops * prefill_mfu),
        prefill_per_token_context_s=4 * model.layers * model.attention_dim / (g * hw.flops * prefill_mfu),
    )


def roofline_cost_model(
    model: ModelSpec,
    hw: HardwareSpec,
    *,
    replica_accelerators: int,
    slots_per_replica: int,
    reference_cell_accelerators: int,
    min_cell_accelerators: int,
    train_mfu: float,
    decode_mbu: float,
    prefill_mfu: float,
    decode_overhead_s: float,
    switch: SwitchCost,
    micro_step_tokens: int = 262_144,
    micro_step_overhead_s: float = 1.0,
    optimizer_step_s: float = 5.0,
    grad_reduce_s: float = 5.0,
    scaling_exponent: float = 0.95,
    pipeline: PipelineCost | None = None,
    source: str = "",
) -> CostModel:
    """A cost model from first principles (memory-bound decode, compute-bound prefill and training).

    - decode step: all serving weights read once per step (an MoE at batch >= 8 touches nearly every
      expert), plus the batch's KV cache, at ``decode_mbu`` of HBM bandwidth, plus a fixed overhead;
      2 * active_params FLOPs per sequence at ``prefill_mfu``.
    - prefill: 2 * active_params FLOPs per token plus attention, 4 * layers * attention_dim FLOPs per
      (new token, context token) pair, at ``prefill_mfu``.
    - training: 6 * active_params FLOPs per token plus causal attention forward + backward,
      6 * layers * attention_dim per token pair, at ``train_mfu``.
    """
    serving = _roofline_serving(
        model, hw, replica_accelerators, slots_per_replica, decode_mbu, prefill_mfu, decode_overhead_s
    )
    training = TrainingCost(
        flops_per_token=6 * model.active_params,
        flops_per_token_sq=6 * model.layers * model.attention_dim,
        accelerator_flops=hw.flops * train_mfu,
        reference_cell_accelerators=reference_cell_accelerators,
        scaling_exponent=scaling_exponent,
        min_cell_accelerators=min_cell_accelerators,
        micro_step_tokens=micro_step_tokens,
        micro_step_overhead_s=micro_step_overhead_s,
        optimizer_step_s=optimizer_step_s,
        grad_reduce_s=grad_reduce_s,
    )
    return CostModel(
        serving=serving,
        training=training,
        switch=switch,
        pipeline=pipeline or PipelineCost(),
        source=source or f"roofline: {hw.name}, {model.total_params / 1e9:.0f}B params",
    )


# -- measured: fitted to a real run's timings -----------------------------------------------------------
def _fit_linear(rows: Sequence[Sequence[float]], features, names: Sequence[str], what: str) -> list[float]:
    """Non-negative least squares by active-set elimination (few features, so this is exact enough)."""
    data = np.asarray(rows, dtype=np.float64)
    if data.ndim != 2 or len(data) < len(names):
        raise CostModelError(f"measurements: {what} needs at least {len(names)} samples, got {len(data)}")
    x = np.stack([f(data) for f in features], axis=1)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-300)  # features differ by orders of magnitude (1 vs FLOPs)
    x = x / scale
    y = data[:, -1]
    active = list(range(len(names)))
    coef = np.zeros(len(names))
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))  # drop the most negative coefficient and refit
    return (coef / scale).tolist()


def _fit_serving(measurements: dict[str, Any]) -> dict[str, float]:
    """``ServingCost`` fields fitted to ``decode_steps`` and ``prefills`` (those measured)."""
    serving: dict[str, float] = {}
    if measurements.get("decode_steps"):
        b, per_seq, per_ctx = _fit_linear(
            measurements["decode_steps"],
            [lambda d: np.ones(len(d)), lambda d: d[:, 0], lambda d: d[:, 1]],
            ("decode_base_s", "decode_per_seq_s", "decode_per_context_token_s"),
            "decode_steps",
        )
        serving.update(decode_base_s=max(b, 1e-9), decode_per_seq_s=per_seq, decode_per_context_token_s=per_ctx)
    if measurements.get("prefills"):
        b, per_tok, per_tok_ctx = _fit_linear(
            measurements["prefills"],
            [lambda d: np.ones(len(d)), lambda d: d[:, 0], lambda d: d[:, 0] * d[:, 1]],
            ("prefill_base_s", "prefill_per_token_s", "prefill_per_token_context_s"),
            "prefills",
        )
        serving.update(prefill_base_s=b, prefill_per_token_s=per_tok, prefill_per_token_context_s=per_tok_ctx)
    return serving


def _fit_training_rate(measurements: dict[str, Any], base: CostModel) -> dict[str, float]:
    """``TrainingCost`` fields fitted to ``micro_steps`` ([FLOPs, seconds] on cells of ``cell_accelerators``)."""
    if not measurements.get("micro_steps"):
        return {}
    cell = int(measurements.get("cell_accelerators", base.training.reference_cell_accelerators))
    d = np.asarray(measurements["micro_steps"], dtype=np.float64)
    if d.ndim == 2 and len(d) and d.shape[1] == 2 and (d[:, 0] > 0).all() and d[:, 0].std() < 0.1 * d[:, 0].mean():
        # Micro-batches of one fixed shape (the FLOPs barely vary): the slope cannot be told from the
        # intercept; the mean rate keeps the total micro-step time.
        overhead, s_per_flop = 0.0, float(d[:, 1].sum() / d[:, 0].sum())
    else:
        overhead, s_per_flop = _fit_linear(
            measurements["micro_steps"],
            [lambda d: np.ones(len(d)), lambda d: d[:, 0]],
            ("micro_step_overhead_s", "seconds_per_flop"),
            "micro_steps",
        )
    if s_per_flop <= 0:
        raise CostModelError("measurements: micro_steps do not grow with their FLOPs; cannot fit a training rate")
    return dict(
        micro_step_overhead_s=overhead,
        reference_cell_accelerators=cell,
        scaling_exponent=1.0,
        accelerator_flops=1.0 / (s_per_flop * cell),
    )


def fit_cost_model(measurements: dict[str, Any], base: CostModel) -> CostModel:
    """A cost model whose measured parts come from a real run; what was not measured stays from ``base``.

    ``measurements`` (JSON written by the controller; every key optional):
      ``decode_steps``: [[batch, context_tokens_in_batch, seconds], ...]  (one serving replica)
      ``prefills``: [[new_tokens, context_tokens, seconds], ...]
      ``micro_steps``: [[flops, seconds], ...]  (on cells of ``cell_accelerators``)
      ``cell_accelerators``: int, ``optimizer_steps``: [seconds], ``serving_to_training``: [seconds],
      ``training_to_serving``: [seconds], ``weight_syncs``: [seconds], ``step_boundaries``: [seconds]
      (host time after an optimizer step before the next step's first micro-step), ``warmup_micro_steps``:
      [seconds] (a cell's first micro-step beyond a steady one: its compile), ``warmup_optimizer_steps``:
      [seconds], ``source``: str
    """
    serving, training = _fit_serving(measurements), _fit_training_rate(measurements, base)
    switch: dict[str, float] = {}
    pipeline: dict[str, float] = {}
    for key, section, name in (
        ("optimizer_steps", training, "optimizer_step_s"),
        ("serving_to_training", switch, "serving_to_training_s"),
        ("training_to_serving", switch, "training_to_serving_s"),
        ("weight_syncs", switch, "weight_sync_s"),
        ("step_boundaries", pipeline, "step_boundary_s"),
        ("warmup_micro_steps", training, "warmup_micro_step_s"),
        ("warmup_optimizer_steps", training, "warmup_optimizer_step_s"),
    ):
        if measurements.get(key):
            section[name] = float(np.mean(measurements[key]))
    source = "measured: " + str(measurements.get("source", "a real run"))
    return base.replace(serving=serving, training=training, switch=switch, pipeline=pipeline, source=source)
