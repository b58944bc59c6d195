"""The dense KV layout's device programs behind JetStream's functional contract: ``DenseSlots``.

``prefill`` -> ``Prefix`` (a prompt's KV [1, C, K, D] and its first sampled token), ``insert`` it into a slot of a
``DecodeState`` (every slot's dense, heads-first ``BlockedCache`` of ``max_seq_len`` positions), ``generate`` one
step (or ``decode_steps``) for the slots, ``release`` a slot, and the page operations of the session cache and
migration (``kv_pages.PageOps``): pure in the state, every call takes it and returns the new one. Shapes are fixed
at construction (prefill padded to buckets, decode windows, slot buckets), so serving never recompiles after
warm-up, including across weight updates of the same layout.

``engine.Engine`` runs these programs as the dense ``ServingEngine`` (the state, the slots' pending prefixes and
the session pool are its own); the JetStream functional form stays for what drives the device directly: tests of
each program, benchmarks of raw steps, static batches. Each program is jitted once with its donation and
shardings (programs in ``steps``) into this object's ``programs.Programs`` table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import Rules
from gyre_jax.serving import steps
from gyre_jax.serving.engine_api import ResultTokens, check_num_steps
from gyre_jax.serving.kv_cache import (
    DecodeState,
    KVPages,
    Prefix,
    decode_blocks,
    decode_state_shardings,
    empty_decode_state,
    empty_prefix,
)
from gyre_jax.serving.kv_pages import PageOps
from gyre_jax.serving.programs import FlatParams, Programs
from gyre_jax.serving.shapes import bucket, buckets, key_rows, pack_prompts, sampling_args, sampling_rows, slot_buckets
from gyre_jax.serving.types import ContextTooLongError, SamplingParams


def check_sizes(
    max_concurrent_decodes: int, max_seq_len: int, max_prefill_length: int, page_size: int | None, decode_steps: int
) -> int:
    """Raises ValueError for sizes an engine cannot have; returns the page size (default ``gcd(16, max_seq_len)``)."""
    if decode_steps < 1:
        raise ValueError(f"decode_steps={decode_steps} must be >= 1")
    if max_concurrent_decodes < 1:
        raise ValueError(f"max_concurrent_decodes={max_concurrent_decodes} must be >= 1")
    if not 1 <= max_prefill_length <= max_seq_len:
        raise ValueError(f"max_prefill_length={max_prefill_length} must be in [1, max_seq_len={max_seq_len}]")
    page_size = math.gcd(16, max_seq_len) if page_size is None else page_size
    if page_size < 1 or max_seq_len % page_size:
        raise ValueError(f"page_size={page_size} must be >= 1 and divide max_seq_len={max_seq_len}")
    return page_size


class DenseSlots:
    """Prefill / insert / generate over a dense slot-based KV cache on one mesh (a cell), functional in the state."""

    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        mesh: Mesh,
        rules: Rules,
        *,
        max_concurrent_decodes: int,
        max_seq_len: int,
        max_prefill_length: int,
        prefill_buckets: Sequence[int],
        page_size: int | None = None,
        decode_windows: Sequence[int] | None = None,
        decode_slot_buckets: Sequence[int] | None = None,
        record_experts: bool = False,
        decode_steps: int = 1,
    ):
        """``max_prefill_length``: the most tokens one ``prefill`` call takes (longer prompts are prefilled in
        chunks by the caller, each on top of the previous). ``page_size`` (tokens per KV page; default
        ``gcd(16, max_seq_len)``) must divide ``max_seq_len``. ``decode_windows``: cache lengths a generate
        step may attend over (default: the prefill buckets; ``max_seq_len`` is always one). ``decode_slot_buckets``:
        numbers of leading slots a generate step may run over (default: powers of 2 when the slots live on one
        device, else only all of them; ``max_concurrent_decodes`` is always one). One compile per pair in use.
        ``record_experts`` (MoE models only): every generate step also returns the experts each MoE layer
        selected (``ResultTokens.experts``), for routing replay in training (``rl.routing_replay``).
        ``decode_steps``: the most generate steps one ``generate`` call may run in one program (it runs 1 or
        ``decode_steps``: two compiles per window and slot bucket); >1 saves a dispatch per token where the caller
        can wait that many steps between looks at the tokens."""
        page_size = check_sizes(max_concurrent_decodes, max_seq_len, max_prefill_length, page_size, decode_steps)
        if record_experts and not cfg.is_moe:
            raise ValueError(
                "record_experts needs a MoE model (num_experts > 0): a dense model has no experts to record"
            )
        self.cfg, self.graphdef, self.mesh, self.rules, self.decode_steps = cfg, graphdef, mesh, rules, decode_steps
        self.max_concurrent_decodes = slots = max_concurrent_decodes
        self.max_seq_len, self.max_prefill_length, self.page_size = max_seq_len, max_prefill_length, page_size
        self.pages_per_seq = max_seq_len // page_size
        self.prefill_buckets = tuple(sorted(b for b in prefill_buckets if b < max_seq_len)) + (max_seq_len,)
        self.decode_windows = buckets(self.prefill_buckets if decode_windows is None else decode_windows, max_seq_len)
        self.decode_blocks = decode_blocks(self.decode_windows)  # the decode state's cache blocks (kv_cache)
        self.decode_state_shardings = decode_state_shardings(cfg, mesh, rules, slots, self.decode_blocks)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        on_one_device = self.decode_state_shardings.tokens.shard_shape((slots,))[0] == slots  # slots not split
        self.decode_slot_buckets = slot_buckets(decode_slot_buckets, slots, on_one_device)
        self.record_experts = record_experts
        self.programs = Programs()
        self._flat = FlatParams()
        self._jit_programs()
        self.pages = PageOps(cfg, mesh, rules, page_size, max_seq_len, self.programs)

    def _jit_programs(self) -> None:
        """The jit boundaries: every device computation of a dense engine is one of these (programs in ``steps``), or
        one of the page operations' (``kv_pages.PageOps``)."""
        cfg, g, x, add = self.cfg, self.graphdef, self.record_experts, self.programs.add
        state_sh, rep = self.decode_state_shardings, self._replicated
        outputs = (state_sh, rep, rep) + ((rep,) if x else ())
        self.init_program = add(
            "init_decode_state",
            jax.jit(functools.partial(empty_decode_state, cfg, self.max_concurrent_decodes, self.decode_blocks),
                    out_shardings=state_sh),
        )  # fmt: skip
        self.empty_prefix_program = add(
            "empty_prefix", jax.jit(functools.partial(empty_prefix, cfg, self.max_seq_len), out_shardings=rep)
        )
        model = dict(static=(1,), params=0)
        self.prefill_program = add(
            "prefill", jax.jit(functools.partial(steps.prefill, g, cfg, with_experts=x), static_argnums=(1,)), **model
        )
        self.prefill_extend_program = add(
            "prefill_extend",
            jax.jit(functools.partial(steps.prefill_extend, g, self.max_seq_len, with_experts=x), static_argnums=(1,)),
            **model,
        )
        self.prefill_many_program = add(
            "prefill_many",
            jax.jit(functools.partial(steps.prefill_many, g, cfg, with_experts=x), static_argnums=(1,)),
            **model,
        )
        step = functools.partial(steps.decode_step, steps.DenseLayout, g, with_experts=x)
        self.generate_program = add(
            "generate",
            jax.jit(step, donate_argnums=(2,), static_argnums=(1, 3, 4), out_shardings=outputs),
            static=(1, 3, 4), fixed=(2,), params=0,
        )  # fmt: skip
        multi = functools.partial(steps.decode_steps, steps.DenseLayout, g, with_experts=x)
        self.generate_steps_program = add(
            "generate_steps",
            jax.jit(multi, donate_argnums=(2,), static_argnums=(1, 3, 4, 5), out_shardings=outputs),
            static=(1, 3, 4, 5), fixed=(2,), params=0,
        )  # fmt: skip
        self.insert_program = add(
            "insert", jax.jit(steps.insert, donate_argnums=(1,), out_shardings=state_sh), fixed=(1,)
        )
        self.insert_many_program = add(
            "insert_many", jax.jit(steps.insert_many, donate_argnums=(1,), out_shardings=state_sh), fixed=(1,)
        )
        self.release_program = add(
            "release", jax.jit(steps.release, donate_argnums=(0,), out_shardings=state_sh), fixed=(0,)
        )

    # -- state ------------------------------------------------------------------------------------
    def init_decode_state(self) -> DecodeState:
        return self.init_program()

    def empty_prefix(self, key: jax.Array) -> Prefix:
        """A prefix of no tokens with a full-length cache [1, S]: start a prompt that is prefilled in several
        chunks from it, so every chunk runs the same compiled shapes (one per chunk bucket)."""
        return self.empty_prefix_program(key)

    def bucket(self, n: int) -> int:
        """The prefill bucket of a chunk of ``n`` tokens."""
        return bucket(self.prefill_buckets, n)

    def flat_params(self, params) -> tuple[list, object]:
        """(leaves, treedef) of ``params``, as the model programs take them."""
        return self._flat(params)

    # -- prefill ----------------------------------------------------------------------------------
    def prefill(
        self,
        *,
        params: nnx.State,
        tokens: Sequence[int],
        sampling_params: SamplingParams,
        key: jax.Array,
        existing_prefix: Prefix | None = None,
    ) -> Prefix:
        """Prefills ``tokens`` (padded to a length bucket) and samples the next token with ``key``.

        Without ``existing_prefix`` the tokens are a whole prompt (cache [1, bucket]). With one, they are
        placed after it (positions ``existing_prefix.length ...``) and the result's cache is [1, max_seq_len]:
        this is chunked prefill and the continuation of a cached session. The sampled token depends only on
        the full sequence and ``key``, so passing the request's key to every chunk makes chunking invisible.
        With ``record_experts`` the result's ``experts`` [bucket, L_moe, K] int16 are the experts each MoE layer
        selected for these ``tokens`` (rows past ``len(tokens)``: padding).
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("cannot prefill an empty prompt")
        if n > self.max_prefill_length:
            raise ContextTooLongError(
                f"prompt of {n} tokens exceeds max_prefill_length={self.max_prefill_length}; "
                "prefill it in chunks, each on top of the previous (existing_prefix)"
            )
        start = 0 if existing_prefix is None else int(existing_prefix.length)
        if start + n >= self.max_seq_len:
            raise ContextTooLongError(
                f"prompt of {start + n} tokens leaves no room to generate within max_seq_len={self.max_seq_len}"
            )
        padded = np.zeros((1, self.bucket(n)), np.int32)
        padded[0, :n] = tokens
        args = (padded, np.int32(n), *sampling_args(sampling_params), key)
        if existing_prefix is None:
            return self.prefill_program(*self._flat(params), *args)
        existing = dataclasses.replace(existing_prefix, experts=None)  # the earlier chunk's: not an input
        return self.prefill_extend_program(*self._flat(params), existing, *args)

    def prefill_many(
        self, *, params: nnx.State, prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams], keys
    ) -> Prefix:
        """Several whole prompts in one program, packed side by side in rows as wide as the bucket of the longest
        (``shapes.pack_prompts``): entry i of the result (every field has a leading axis of the prompt count's power
        of 2, cache [P, bucket, K, D], entries past the prompts empty) is ``prefill`` of ``prompts[i]`` with
        ``keys[i]`` alone. For ``insert_many``."""
        return self.prefill_packed(params, pack_prompts(prompts, self), sampling, keys)

    def prefill_packed(self, params: nnx.State, packed: tuple[np.ndarray, ...], sampling, keys) -> Prefix:
        """``prefill_many`` of a ``pack_prompts`` layout (``sampling`` and ``keys`` of its first prompts)."""
        count = len(packed[-1])
        args = (*packed, *sampling_rows(sampling, count), key_rows(keys, count))
        return self.prefill_many_program(*self._flat(params), *args)

    # -- insert / release -------------------------------------------------------------------------
    def insert(
        self, prefix: Prefix, decode_state: DecodeState, slot: int, sampling_params: SamplingParams
    ) -> DecodeState:
        """Places a prefilled prompt into decode slot ``slot`` and activates it (donates ``decode_state``)."""
        prefix = dataclasses.replace(prefix, experts=None)  # not part of the slot's state
        return self.insert_program(prefix, decode_state, np.int32(slot), *sampling_args(sampling_params))

    def insert_many(
        self, prefixes: Prefix, decode_state: DecodeState, slots: Sequence[int], sampling: Sequence[SamplingParams]
    ) -> DecodeState:
        """Places rows 0..len(slots)-1 of ``prefill_many``'s result into decode ``slots`` (donates the state); a slot
        of -1 (or past the slots) leaves that row out."""
        rows = prefixes.token.shape[0]
        at = np.full((rows,), self.max_concurrent_decodes, np.int32)  # padding rows: out of range, dropped
        at[: len(slots)] = [s if s >= 0 else self.max_concurrent_decodes for s in slots]
        prefixes = dataclasses.replace(prefixes, experts=None)
        return self.insert_many_program(prefixes, decode_state, at, *sampling_rows(sampling, rows))

    def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Deactivates ``slot`` (its KV stays until the next insert; donates ``decode_state``)."""
        return self.release_program(decode_state, np.int32(slot))

    # -- generate ---------------------------------------------------------------------------------
    def decode_window(self, max_length: int | None) -> int:
        """The decode window (a bucket of ``decode_windows``) for slots holding at most ``max_length`` tokens."""
        if max_length is None:
            return self.max_seq_len
        for w in self.decode_windows:
            if w > max_length:
                return w
        return self.max_seq_len

    def decode_slots(self, slot_limit: int | None) -> int:
        """The slot bucket (of ``decode_slot_buckets``) covering slots [0, slot_limit)."""
        if slot_limit is None:
            return self.max_concurrent_decodes
        for b in self.decode_slot_buckets:
            if b >= slot_limit:
                return b
        return self.max_concurrent_decodes

    def generate(
        self,
        params: nnx.State,
        decode_state: DecodeState,
        max_length: int | None = None,
        slot_limit: int | None = None,
        wait: bool = True,
        num_steps: int = 1,
    ) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot: feeds each slot's last token, samples the next (donates the state).
        ``num_steps`` (1 to the engine's ``decode_steps``): that many steps in one program, the same tokens as
        that many calls; the result's arrays get a leading [num_steps] axis (above 1, one compiled program runs
        any count: its trip count is an argument, not a shape).

        ``wait=False`` returns at once with the result still on the device (its host copy started): the caller
        can dispatch the next step before reading this one (``ResultTokens.to_host()``), as JetStream's
        generate and detokenize threads do.

        Optional hints from a caller that tracks its slots, so that decode cost follows the live load rather than
        the allocated one:
          ``max_length``: the most tokens any active slot holds; the step attends over the smallest decode
            window above it instead of the whole ``max_seq_len`` cache;
          ``slot_limit``: no slot at or above it is active; only the smallest slot bucket covering
            [0, slot_limit) is stepped.
        A slot left out by a wrong hint samples nothing: ``valid`` is False for it and its state is unchanged.
        """
        check_num_steps(num_steps, self.decode_steps)
        leaves = self._flat(params)
        slots = self.decode_slots(slot_limit)
        # the window must hold every step's input token: the longest slot grows by num_steps - 1
        window = self.decode_window(None if max_length is None else max_length + num_steps - 1)
        if num_steps > 1:
            args = (*leaves, decode_state, window, slots, self.decode_steps, np.int32(num_steps))
            state, *outputs = self.generate_steps_program(*args)
        else:
            state, *outputs = self.generate_program(*leaves, decode_state, window, slots)
        return state, ResultTokens.of(outputs, num_steps, wait)

    # -- pages: the session prefix cache's KV budget and KV in transit (kv_pages.PageOps) -----------
    def kv_pages_shardings(self, num_pages: int) -> KVPages:
        """Shardings of a [num_pages, page_size, K, D] page array on this engine's mesh (pages split like slots)."""
        return self.pages.shardings(num_pages)

    def init_page_pool(self, num_pages: int) -> KVPages:
        """A pool of ``num_pages`` pages (zeros): the fixed KV budget of a session prefix cache."""
        return self.pages.init_pool(num_pages)

    def save_slot(self, pool: KVPages, decode_state: DecodeState, slot: int, page_ids: Sequence[int]) -> KVPages:
        """Copies the first ``len(page_ids)`` pages of ``slot``'s KV into pool pages ``page_ids`` (donates ``pool``)."""
        return self.pages.save_slot(pool, decode_state, slot, page_ids)

    def load_prefix(self, pool: KVPages, page_ids: Sequence[int], length: int, key: jax.Array) -> Prefix:
        """A Prefix (cache [1, S]) holding the first ``length`` tokens stored in pool pages ``page_ids``.

        Its ``token`` is unset: prefill the rest of the prompt on top of it (``prefill(existing_prefix=...)``)."""
        return self.pages.load_prefix(pool, page_ids, length, key)

    def export_slot(self, decode_state: DecodeState, slot: int, num_tokens: int) -> KVPages:
        """The first ``num_tokens`` tokens of ``slot``'s KV as pages (page count rounded up to a power of 2)."""
        return self.pages.export(decode_state.cache, slot, num_tokens)

    def export_prefix(self, prefix: Prefix, num_tokens: int, row: int = 0) -> KVPages:
        """The first ``num_tokens`` tokens of a Prefix's KV (row ``row`` of several) as pages (to migrate a partly
        prefilled prompt)."""
        return self.pages.export(prefix.cache, row, num_tokens)

    def export_pages(self, pool: KVPages, page_ids: Sequence[int]) -> KVPages:
        """Pool pages ``page_ids`` gathered into one KVPages (count rounded up to a power of 2 with page 0)."""
        return self.pages.export_pages(pool, page_ids)

    def import_pages(self, pool: KVPages, kv: KVPages, page_ids: Sequence[int]) -> KVPages:
        """Writes the first ``len(page_ids)`` pages of ``kv`` (already on this mesh) into pool pages ``page_ids``."""
        return self.pages.import_pages(pool, kv, page_ids)

    def prefix_from_pages(
        self, kv: KVPages, length: int, key: jax.Array, token: int = 0, logprob: float = 0.0
    ) -> Prefix:
        """A Prefix (cache [1, S]) from a session's KV pages (on this mesh): ``length`` tokens, next ``token``."""
        return self.pages.prefix_from_pages(kv, length, key, token, logprob)

    def check_kv(self, kv: KVPages) -> None:
        """Raises ValueError if ``kv`` was not made by an engine of this KV layout (layers, page size, heads, dim)."""
        self.pages.check(kv)

    def to_mesh(self, kv: KVPages) -> KVPages:
        """Moves ``kv`` (possibly on another mesh) onto this engine's mesh: a device-to-device copy."""
        return self.pages.to_mesh(kv)

    def param_shardings(self, abstract_state):
        from gyre_jax.model.sharding import param_shardings

        return param_shardings(abstract_state, self.rules, self.mesh)
