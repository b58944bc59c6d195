"""The serving engine protocol: what a cell's serving loop needs from the device side, for any KV layout.

JetStream's ``engine_api.Engine`` is the model (prefill, insert into a decode slot, generate one step for every
slot, ``free_resource``); here the engine owns its slots' KV and every call names a slot, because a paged layout
prefills straight into a slot's pages and hands a session's pages to its next request without a copy. Both KV
layouts implement it with the same signatures and semantics: ``engine.Engine`` (a dense ``max_seq_len`` cache
per slot, sessions cached in a page pool beside it) and ``paged.PagedEngine`` (one page pool for slots and
sessions, block tables). ``loop.ServingLoop`` and ``batch.DecodeBatch`` are written against this protocol only.

A slot's life: ``attach`` a session's cached pages or ``import_kv`` KV moved from another cell (optional) ->
``prefill`` the rest of the prompt, one or more chunks (or ``prefill_many``: whole prompts into empty slots,
one program) -> ``start`` (or ``resume`` a request that sampled its next token elsewhere) -> ``generate`` steps
every started slot -> ``release`` (optionally keeping the KV of the first ``keep`` tokens as the session's
pages: ``SlotPages``, handed to ``SessionCache``). KV moves between cells as ``KVPages`` (``export`` /
``import_kv``, and ``export_pages`` / ``import_pages`` for cached sessions). ``warmup`` compiles every program
shape the loop can dispatch before serving; ``programs`` is the table of what the engine compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from gyre_jax.serving.kv_cache import KVPages
from gyre_jax.serving.prefix_cache import PrefixCache
from gyre_jax.serving.programs import Programs
from gyre_jax.serving.types import SamplingParams


@dataclasses.dataclass(frozen=True)
class SlotPages:
    """A session's KV in an engine's page pool: its pages in position order and the tokens they hold (``release``
    with ``keep``; a ``SessionCache`` entry). Give it to ``attach`` (the session goes on in a slot)."""

    pages: tuple[int, ...]
    length: int


@dataclasses.dataclass(frozen=True)
class Sampled:
    """What a prefill sampled after the last token of its prompt(s): ``token`` ([] int32, or [P] for ``prefill_many``:
    entries past the prompts are padding) and its ``logprob`` (f32), device arrays still being computed (read them
    with ``jax.device_get`` when the slot starts: a prefill does not wait); on an engine with ``record_experts`` the
    experts [n, L_moe, K] int16 each MoE layer selected for the prefilled tokens (host; [P, width, L_moe, K] for
    ``prefill_many``, -1 past each prompt), else None."""

    token: jax.Array
    logprob: jax.Array
    experts: np.ndarray | None = None


class ResultTokens:
    """One generate step, [slots] each: ``tokens`` (int32, the sampled token), ``valid`` (bool: the slot was
    stepped and its cache had room), ``lengths`` (int32: the slot's cache length after the step), ``logprobs``
    (f32: the token's log-prob), and on an engine built with ``record_experts`` ``experts`` ([slots, L_moe, K]
    int16: the experts each MoE layer selected for the slot's input token, i.e. the token the step before
    sampled; -1 where not stepped; else None). Several steps in one call (``generate(..., num_steps=n)``, n > 1):
    every array has a leading [n] axis, one row per step in order. Host numpy arrays; ``generate(...,
    wait=False)`` returns one still on the device (being copied) until ``to_host()``."""

    def __init__(self, *, _ints, _logprobs, _experts=None, _rows: int | None = None):
        self._ints = _ints  # [(n,) 3, slots] int32: tokens, valid, lengths
        self._logprobs = _logprobs  # [(n,) slots] f32
        self._experts = _experts  # [(n,) slots, L_moe, K] int16 or None
        self._rows = _rows  # a multi-step program's arrays hold decode_steps rows: the first _rows ran

    @classmethod
    def of(cls, outputs: Sequence, num_steps: int, wait: bool) -> ResultTokens:
        """The result of a generate program's outputs (ints, log-probs[, experts]) that ran ``num_steps`` steps: on
        the host (``wait``), or still on the device with its host copy started."""
        ints, logprobs, *experts = outputs
        result = cls(_ints=ints, _logprobs=logprobs, _experts=experts[0] if experts else None,
                     _rows=None if num_steps == 1 else num_steps)  # fmt: skip
        if wait:
            return result.to_host()
        for array in outputs:
            array.copy_to_host_async()
        return result

    def to_host(self) -> ResultTokens:
        """The host copy (waits for the step to finish); a multi-step result keeps only the steps that ran."""
        ints, logprobs, experts = jax.device_get((self._ints, self._logprobs, self._experts))
        rows = slice(None) if self._rows is None else slice(0, self._rows)
        return ResultTokens(
            _ints=np.asarray(ints)[rows],
            _logprobs=np.asarray(logprobs)[rows],
            _experts=None if experts is None else np.asarray(experts)[rows],
        )

    @property
    def experts(self) -> np.ndarray | None:
        return None if self._experts is None else np.asarray(self._experts)

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray(self._ints[..., 0, :])

    @property
    def valid(self) -> np.ndarray:
        return np.asarray(self._ints[..., 1, :]).astype(bool)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self._ints[..., 2, :])

    @property
    def logprobs(self) -> np.ndarray:
        return np.asarray(self._logprobs)


def check_num_steps(num_steps: int, decode_steps: int) -> None:
    """Raises ValueError unless 1 <= num_steps <= decode_steps (the steps one generate call may run)."""
    if not 1 <= num_steps <= decode_steps:
        raise ValueError(
            f"num_steps={num_steps} must be between 1 and the engine's decode_steps={decode_steps} (raise "
            "serving.decode_steps for longer programs)"
        )


def check_prefill_many(
    slots: Sequence[int], prompts: Sequence, sampling: Sequence, keys: Sequence, check_empty
) -> None:
    """Raises ValueError unless ``prefill_many`` got one distinct slot, sampling and key per prompt, each slot empty
    (``check_empty(slot)`` raises otherwise)."""
    if not len(slots) == len(prompts) == len(sampling) == len(keys) or len(set(slots)) != len(slots):
        raise ValueError("prefill_many takes one distinct slot, sampling and key per prompt")
    for slot in slots:
        check_empty(slot)


class ServingEngine(Protocol):
    """Prefill / start / generate / release over ``max_concurrent_decodes`` slots whose KV the engine holds on
    ``mesh`` (one cell). Not thread-safe: one serving loop's thread drives it."""

    max_concurrent_decodes: int  # decode slots
    max_prefill_length: int  # most tokens of one prefill program (longer prompts: several chunks)
    max_seq_len: int  # most tokens one slot holds (prompt + completion)
    page_size: int  # tokens per KV page (sessions' KV, migration)
    num_pages: int  # pages a session cache on this engine holds (``use_pages``)
    decode_steps: int  # most generate steps one program runs
    record_experts: bool  # routing replay: prefill and generate report the experts each MoE layer selected
    mesh: Mesh
    programs: Programs  # every program shape this engine compiled

    def prefill(
        self,
        params: nnx.State,
        slot: int,
        tokens: Sequence[int],
        sampling: SamplingParams,
        key: jax.Array,
        *,
        final: bool = True,
    ) -> Sampled:
        """Prefills ``tokens`` into ``slot`` after the tokens it holds (none, an attached or imported session's, or
        earlier chunks), in programs of at most ``max_prefill_length`` tokens, each with ``key`` (so chunking is
        invisible: the sampled token depends only on the whole sequence and the key). ``final=False``: more
        tokens of this prompt follow in later calls (the engine may lay the slot out for them). The slot does not
        decode until ``start``. Raises ``ContextTooLongError`` (a ValueError) for tokens the slot cannot hold."""
        ...

    def prefill_many(
        self,
        params: nnx.State,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams],
        keys: Sequence[jax.Array],
    ) -> Sampled:
        """Whole prompts (each at most ``max_prefill_length``), ``prompts[i]`` into empty ``slots[i]`` with
        ``keys[i]``, in one program, packed side by side (``shapes.pack_prompts``): each slot ends as ``prefill``
        of its prompt alone leaves it, to float rounding. Entry i of the result is prompt i's."""
        ...

    def start(self, slots: Sequence[int]) -> None:
        """The prefilled ``slots`` decode from the next ``generate`` on, from the token their prefill sampled."""
        ...

    def resume(self, slot: int, token: int, key: jax.Array, sampling: SamplingParams) -> None:
        """``slot`` (holding a request's KV but its last sampled ``token``) decodes from ``token`` with sampling
        ``key`` [2]: a request that moved between cells or was prefilled again under new weights."""
        ...

    def generate(self, params: nnx.State, *, num_steps: int = 1, wait: bool = True) -> ResultTokens:
        """``num_steps`` (1 to ``decode_steps``) decode steps for every started slot in one program, attending over
        the smallest window that holds the longest (cost follows the live load, not the allocation); a slot whose
        cache is full stops (``valid`` False). ``wait=False`` returns at once, the result on its way to the host:
        dispatch the next step before reading this one (``ResultTokens.to_host``). Raises ValueError if no slot
        decodes."""
        ...

    def release(self, slot: int, keep: int = 0) -> SlotPages | None:
        """Ends ``slot`` (decoding or not). ``keep`` > 0 (a decoding slot, an engine using a session cache's pages):
        the KV of its first ``keep`` tokens stays as a session's pages, returned (None if the pool cannot hold
        them)."""
        ...

    def attach(self, slot: int, pages: SlotPages) -> None:
        """Gives an empty ``slot`` a cached session's KV (pages taken from the session cache: the engine owns them
        now); prefill the session's next tokens on top."""
        ...

    def import_kv(self, slot: int, kv: KVPages, length: int) -> None:
        """Gives an empty ``slot`` ``length`` tokens of a session's ``kv`` (on this mesh: ``to_mesh``)."""
        ...

    def export(self, slot: int, num_tokens: int) -> KVPages:
        """The KV of ``slot``'s first ``num_tokens`` tokens (decoding or prefilled) as pages (page count rounded up
        to a power of 2)."""
        ...

    def slot_length(self, slot: int) -> int:
        """Tokens in ``slot``'s KV (after the steps dispatched so far)."""
        ...

    def keys(self) -> np.ndarray:
        """[slots, 2] each decoding slot's next sampling key (host copy: waits for the programs in flight)."""
        ...

    def use_pages(self, index: PrefixCache) -> None:
        """Sessions' pages come from ``index`` (a ``SessionCache``'s) from now on: a pool of ``index.num_pages``
        pages. Raises ValueError for a pool this engine cannot have."""
        ...

    def export_pages(self, page_ids: Sequence[int]) -> KVPages:
        """Pool pages ``page_ids`` as one ``KVPages`` (count rounded up to a power of 2)."""
        ...

    def import_pages(self, kv: KVPages, page_ids: Sequence[int]) -> None:
        """Writes the first ``len(page_ids)`` pages of ``kv`` (on this mesh) into pool pages ``page_ids``."""
        ...

    def check_kv(self, kv: KVPages) -> None:
        """Raises ValueError if ``kv`` was not made by an engine of this model and page size."""
        ...

    def to_mesh(self, kv: KVPages) -> KVPages:
        """``kv`` (possibly on another mesh) on this engine's mesh: a device-to-device copy."""
        ...

    def warmup(self, params: nnx.State) -> int:
        """Compiles every program shape the serving loop can dispatch on this engine (without running any), so
        that no compile stalls a running cell; returns how many were new (0 when warm)."""
        ...
