"""TITO records: one per model call, the exact token ids a harness's call was served with.

Serialized form (one JSON object per line in ``<record_dir>/<execution_id>.jsonl``, appended, flushed
and fsynced before the HTTP response is sent), see docs/records.md:

    {"execution_id": str, "call_index": int, "thread_id": str, "request_id": str,
     "prompt_ids": [int], "completion_ids": [int], "completion_logprobs": [float],
     "policy_versions": [int], "finish_reason": "stop" | "length" | "cancelled",
     "temperature": float, "reused_prefix_len": int, "cached_prompt_tokens": int, "t_start": float, "t_end": float,
     "model": str, "api": "chat" | "completions" | "messages" | "responses", "cell": str, "agent_kind": "" | "auxiliary",
     "client_sampling": {"temperature": float, "top_p": float, "top_k": int, "seed": int, "stop": [str],
                         "n": int, "tool_choice": str | object} | null,
     "completion_experts": {"shape": [N, L, K], "dtype": "int8" | "int16", "data": base64} | null,
     "prompt_experts": {"shape": [P, L, K], ...} | null}

``reused_prefix_len`` is how many leading prompt ids were taken verbatim from an earlier call of the
same execution (its prompt + completion): those tokens are exactly what the policy saw and produced,
never re-tokenized. ``cached_prompt_tokens`` is how many leading prompt ids the serving cell did not prefill
because their KV was still held (its session prefix cache, or a session migrated with its KV): what the serving
side reused, where ``reused_prefix_len`` is what the proxy reused (0 in records written before it existed).
``temperature`` is what the call was sampled with: 0.0 means greedy (served under
``proxy.sampling = "client"``): kept for evaluation, never trained on. ``client_sampling`` holds only the
sampling fields the client sent (None: it sent none), whatever the proxy served. ``completion_experts``
(routing replay, only when serving records them: ``rl.routing_replay = "replay"`` on a MoE model) is the
experts each MoE layer selected for each completion token, ``encode_experts`` of an [N, L_moe, K] array
(-1 rows: not known, e.g. the last token, which is never fed back within its call); ``prompt_experts`` the
same for the prompt ids ([P, L_moe, K]; -1 rows for prompt tokens whose KV was reused, not prefilled).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from base64 import b64decode, b64encode
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gyre_jax.disk import append_whole
from gyre_jax.faultpoints import armed, kill_point

logger = logging.getLogger(__name__)
AGENT_KINDS = ("", "auxiliary")  # TitoRecord.agent_kind: the trajectory processor decides | a harness utility call


def encode_experts(ids: np.ndarray) -> dict:
    """[N, L, K] int expert ids (-1 = not known) -> {"shape": [N, L, K], "dtype": "int8" | "int16", "data": base64
    of the little-endian array, row-major}: int8 when every id fits it (up to 127 experts), else int16."""
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise ValueError(f"expert ids must be [tokens, MoE layers, k], got shape {ids.shape}")
    dtype = "<i1" if ids.size == 0 or int(ids.max()) < 128 else "<i2"
    data = b64encode(np.ascontiguousarray(ids.astype(dtype)).tobytes()).decode("ascii")
    return {"shape": list(ids.shape), "dtype": "int8" if dtype == "<i1" else "int16", "data": data}


def decode_experts(obj: dict) -> np.ndarray:
    """The [N, L, K] int16 array of ``encode_experts``'s dict; ValueError naming what is wrong with a bad one."""
    try:
        shape, dtype, data = tuple(int(d) for d in obj["shape"]), obj["dtype"], obj["data"]
        if dtype not in ("int8", "int16") or len(shape) != 3 or min(shape) < 0:
            raise ValueError(f"dtype {dtype!r} must be int8 or int16 and shape {list(shape)} [tokens, layers, k]")
        raw = np.frombuffer(b64decode(data, validate=True), "<i1" if dtype == "int8" else "<i2")
        return raw.reshape(shape).astype(np.int16)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"expert ids are not an encode_experts dict ({exc})") from exc


@dataclass
class TitoRecord:
    execution_id: str
    call_index: int
    thread_id: str
    request_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str
    temperature: float
    reused_prefix_len: int
    t_start: float
    t_end: float
    model: str = ""
    # the API the call came through: chat (OpenAI chat), completions (OpenAI legacy), messages (Anthropic),
    # responses (OpenAI Responses)
    api: str = ""
    cell: str = ""  # the serving cell that produced the completion
    # "" (the trajectory processor decides the agent's label) | "auxiliary" (a harness-side utility call)
    agent_kind: str = ""
    client_sampling: dict | None = None  # the sampling fields the client sent (see the module docstring)
    # routing replay: encode_experts of the [N, L_moe, K] experts of each completion token, or None
    completion_experts: dict | None = None
    prompt_experts: dict | None = None  # ... and of each prompt token ([P, L_moe, K]), or None
    cached_prompt_tokens: int = 0  # leading prompt ids served from KV the cell held (not prefilled)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.completion_logprobs) != n or len(self.policy_versions) != n:
            raise ValueError(
                f"record {self.execution_id}#{self.call_index}: completion_ids ({n}), completion_logprobs "
                f"({len(self.completion_logprobs)}) and policy_versions ({len(self.policy_versions)}) must have equal length"
            )
        for name, ids in (("completion", self.completion_ids), ("prompt", self.prompt_ids)):
            experts = self.experts(name)
            if experts is not None and experts.shape[0] != len(ids):
                raise ValueError(
                    f"record {self.execution_id}#{self.call_index}: {name}_experts has "
                    f"{experts.shape[0]} rows for {len(ids)} {name} ids"
                )

    def experts(self, part: str = "completion") -> np.ndarray | None:
        """The expert ids of the ``part`` ("completion" | "prompt") tokens, [N, L_moe, K] int16 (-1 = not
        known), or None when not recorded."""
        encoded = self.completion_experts if part == "completion" else self.prompt_experts
        return None if encoded is None else decode_experts(encoded)

    def trainable_versions(self) -> list[int]:
        """Policy versions of the call's policy-generated tokens (every completion token; staleness)."""
        return self.policy_versions

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> TitoRecord:
        return cls(**json.loads(line))


class RecordStore:
    """Append-only per-execution record files under one directory. Thread-safe; nothing kept in memory."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def path(self, execution_id: str) -> Path:
        if not execution_id or "/" in execution_id or execution_id.startswith("."):
            raise ValueError(f"invalid execution id {execution_id!r}")
        return self.root / f"{execution_id}.jsonl"

    def append(self, record: TitoRecord) -> None:
        """Appends the record as one line, fsynced; whole or not at all (``DiskFull`` when the disk is full:
        the file is cut back to its last whole line)."""
        data = (record.to_json() + "\n").encode("utf-8")
        path = self.path(record.execution_id)
        with self._lock:
            if armed("record_torn"):  # the fault suite: a kill with half the line written
                with open(path, "ab") as f:
                    f.write(data[: len(data) // 2])
                kill_point("record_torn")
                data = data[len(data) // 2 :]
            append_whole(path, data)
        kill_point("record_write")

    def count(self, execution_id: str) -> int:
        """Number of complete records of an execution, without parsing them (a torn last line is not counted)."""
        path = self.path(execution_id)
        if not path.exists():
            return 0
        with open(path, "rb") as f:
            return sum(1 for line in f if line.endswith(b"\n"))

    def iter(self, execution_id: str):
        """Records of an execution in file order, one at a time (memory: one record)."""
        path = self.path(execution_id)
        if not path.exists():
            return
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    _torn(path, line)
                    return
                yield TitoRecord.from_json(line)

    def read(self, execution_id: str) -> list[TitoRecord]:
        """All records of an execution in call order (a torn last line from a crash is ignored)."""
        path = self.path(execution_id)
        if not path.exists():
            return []
        records = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    _torn(path, line)  # the call never got its response, so it is not part of the execution
                    break
                records.append(TitoRecord.from_json(line))
        records.sort(key=lambda r: r.call_index)
        return records


def _torn(path: Path, line: str) -> None:
    logger.warning(
        "%s: skipped a torn last line (%d characters without a newline: a write cut off by a kill or a full disk)",
        path,
        len(line),
    )
