"""The serving engine: JetStream's contract (prefill -> insert into a slot -> generate for all slots), plus
the KV movements the serving loop needs (session pages, export/import between meshes).

The engine owns the jitted model calls and the layout of every KV buffer on its mesh; it knows nothing
about requests, queues, sessions or HTTP (that is ``serving.loop``). Shapes are fixed at construction
(``max_concurrent_decodes`` slots of ``max_seq_len`` cached tokens; prefill padded to buckets; pages of
``page_size`` tokens), so serving never recompiles after warm-up, including across weight updates of the
same layout.

Its parts: the KV buffers as pytrees and their layouts (``kv_cache``: ``Prefix`` [1, C, K, D],
``DecodeState`` blocks [slots, K, n, D], ``KVPages`` [n, page_size, K, D]), the device programs of prefill,
insert and generate (``steps``), and the page operations of the session prefix cache and migration
(``kv_pages``). The engine jits the programs with their donation and shardings and checks every call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import Rules
from gyre_jax.serving import steps
from gyre_jax.serving.kv_cache import (  # noqa: F401 - CACHE_AXES and kv_pages_shardings are importable from here
    CACHE_AXES,
    DecodeState,
    KVPages,
    Prefix,
    decode_blocks,
    decode_state_shardings,
    empty_decode_state,
    empty_prefix,
    kv_pages_shardings,
)
from gyre_jax.serving.kv_pages import PageOps
from gyre_jax.serving.types import ContextTooLongError, SamplingParams


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


class FlatParams:
    """(leaves, treedef) of the params a program is called with, remembered for the last params seen: flattening
    an nnx.State on every call would cost more host time than a tiny model's decode step."""

    def __init__(self):
        self._last: tuple | None = None

    def __call__(self, params) -> tuple[list, object]:
        if self._last is None or self._last[0] is not params:
            leaves, treedef = jax.tree.flatten(params)
            self._last = (params, leaves, treedef)
        return self._last[1], self._last[2]


def check_num_steps(num_steps: int, decode_steps: int) -> None:
    """Raises ValueError unless 1 <= num_steps <= decode_steps (the steps one generate call may run)."""
    if not 1 <= num_steps <= decode_steps:
        raise ValueError(
            f"num_steps={num_steps} must be between 1 and the engine's decode_steps={decode_steps} (raise "
            "serving.decode_steps for longer programs)"
        )


def _check_sizes(
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


def _sampling_args(sp: SamplingParams) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(temperature [] f32, top_k [] int32, top_p [] f32): a request's sampling settings as the programs take them."""
    return jnp.float32(sp.temperature), jnp.int32(sp.top_k), jnp.float32(sp.top_p)


def _sampling_rows(sampling: Sequence[SamplingParams], rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_sampling_args`` of several requests as [rows] arrays, padded to ``rows`` with the first request's."""
    sp = [*sampling, *[sampling[0]] * (rows - len(sampling))]
    return (
        np.asarray([x.temperature for x in sp], np.float32),
        np.asarray([x.top_k for x in sp], np.int32),
        np.asarray([x.top_p for x in sp], np.float32),
    )


def _buckets(sizes: Sequence[int], limit: int) -> tuple[int, ...]:
    """The distinct ``sizes`` in (0, limit), ascending, then ``limit``: the sizes one dimension compiles for."""
    return tuple(sorted({b for b in sizes if 0 < b < limit})) + (limit,)


def _slot_buckets(given: Sequence[int] | None, slots: int, on_one_device: bool) -> tuple[int, ...]:
    """The numbers of leading slots a generate step may run over: ``given``, by default the powers of 2 when the
    slots live on one device (slicing slots split over devices would move them), else only all of them."""
    if given is None:
        given = [2**i for i in range(slots.bit_length())] if on_one_device else []
    return _buckets(given, slots)


def _model_programs(cfg: ModelConfig, graphdef, max_seq_len: int, record_experts: bool, state_shardings, replicated):
    """The jitted programs that run the model: (prefill, prefill on top of a prefix, several whole prompts in one
    prefill, generate, several generate steps in one program). With ``record_experts`` (MoE models only) each
    also returns the experts its MoE layers selected."""
    if record_experts and not cfg.is_moe:
        raise ValueError("record_experts needs a MoE model (num_experts > 0): a dense model has no experts to record")
    prefill = jax.jit(functools.partial(steps.prefill, graphdef, cfg, with_experts=record_experts), static_argnums=(1,))
    prefill_extend = jax.jit(
        functools.partial(steps.prefill_extend, graphdef, max_seq_len, with_experts=record_experts),
        static_argnums=(1,),
    )
    prefill_many = jax.jit(
        functools.partial(steps.prefill_many, graphdef, cfg, with_experts=record_experts), static_argnums=(1,)
    )
    outputs = (state_shardings, replicated, replicated) + ((replicated,) if record_experts else ())
    generate = jax.jit(
        functools.partial(steps.generate, graphdef, with_experts=record_experts),
        donate_argnums=(2,),
        static_argnums=(1, 3, 4),
        out_shardings=outputs,
    )
    generate_steps = jax.jit(
        functools.partial(steps.generate_steps, graphdef, with_experts=record_experts),
        donate_argnums=(2,),
        static_argnums=(1, 3, 4, 5),
        out_shardings=outputs,
    )
    return prefill, prefill_extend, prefill_many, generate, generate_steps


def _slot_programs(state_shardings):
    """The jitted programs that change which slots decode: (insert, insert several, release); each donates the
    decode state."""
    insert = jax.jit(steps.insert, donate_argnums=(1,), out_shardings=state_shardings)
    insert_many = jax.jit(steps.insert_many, donate_argnums=(1,), out_shardings=state_shardings)
    release = jax.jit(steps.release, donate_argnums=(0,), out_shardings=state_shardings)
    return insert, insert_many, release


def prompt_count_bucket(count: int) -> int:
    """The prompts one ``prefill_many`` program takes for ``count`` prompts: the next power of 2."""
    return 1 << (count - 1).bit_length()


def packed_row_buckets(prompts: int) -> tuple[int, ...]:
    """The packed row counts ``prefill_many`` compiles for a ``prompts`` (a power of 2) bucket: half, three quarters
    and all of it (one prompt per row, the most any mix needs; prompts of a quarter to all of the longest's bucket
    need ~0.7 rows each)."""
    return tuple(sorted({max(1, prompts // 2), max(1, 3 * prompts // 4), prompts}))


def _pack_prompts(prompts: Sequence[Sequence[int]], engine: Engine) -> tuple[np.ndarray, ...]:
    """Whole prompts packed side by side in rows as wide as the bucket of the longest (first fit, longest first):
    tokens, positions, segments [rows, width] and each prompt's row, offset and length [P] (``steps.prefill_many``'s
    layout; P = ``prompt_count_bucket``, the padding prompts of length 0; rows the smallest of
    ``packed_row_buckets(P)`` that holds them). Raises for a prompt ``engine.prefill`` would refuse in one call."""
    longest = max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("cannot prefill an empty prompt")
    if longest > engine.max_prefill_length or longest >= engine.max_seq_len:
        raise ContextTooLongError(
            f"prompt of {longest} tokens exceeds max_prefill_length={engine.max_prefill_length} (or leaves no "
            f"room within max_seq_len={engine.max_seq_len}); prefill it alone, in chunks"
        )
    width, count = engine._bucket(longest), prompt_count_bucket(len(prompts))
    used: list[int] = []  # tokens taken in each row so far
    where = np.zeros((2, count), np.int32)  # each prompt's (row, offset)
    for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
        row = next((r for r, u in enumerate(used) if u + len(prompts[i]) <= width), len(used))
        if row == len(used):
            used.append(0)
        where[:, i] = row, used[row]
        used[row] += len(prompts[i])
    rows = next(b for b in packed_row_buckets(count) if b >= len(used))
    tokens, positions, segments = (np.zeros((rows, width), np.int32) for _ in range(3))
    lengths = np.zeros((count,), np.int32)
    for i, p in enumerate(prompts):
        (row, start), n = where[:, i], len(p)
        tokens[row, start : start + n], positions[row, start : start + n] = p, np.arange(n)
        segments[row, start : start + n], lengths[i] = i + 1, n
    return tokens, positions, segments, where[0], where[1], lengths


def _prefill_packed(engine: Engine, params: nnx.State, packed: tuple[np.ndarray, ...], sampling, keys) -> Prefix:
    """``engine.prefill_many`` of a ``_pack_prompts`` layout (``sampling`` and ``keys`` of its first prompts)."""
    count = len(packed[-1])
    k = jnp.stack([*keys, *[keys[0]] * (count - len(keys))])
    args = (*map(jnp.asarray, packed), *_sampling_rows(sampling, count), k)
    return engine._prefill_many_jit(*engine._flat_params(params), *args)


def _one_token_prompts(rows: int, width: int, count: int) -> tuple[np.ndarray, ...]:
    """A ``_pack_prompts`` layout of ``rows`` x ``width`` with one one-token prompt per row and ``count - rows``
    padding prompts (``warmup``: any packed shape, whether or not a prompt mix packs into it)."""
    tokens, positions, segments = (np.zeros((rows, width), np.int32) for _ in range(3))
    segments[:, 0] = np.arange(1, rows + 1)
    row, lengths = np.zeros((count,), np.int32), np.zeros((count,), np.int32)
    row[:rows], lengths[:rows] = np.arange(rows), 1
    return tokens, positions, segments, row, np.zeros((count,), np.int32), lengths


class Engine:
    """Prefill / insert / generate over a slot-based KV cache on one mesh (a cell)."""

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
        page_size = _check_sizes(max_concurrent_decodes, max_seq_len, max_prefill_length, page_size, decode_steps)
        self.cfg, self.graphdef, self._mesh, self.rules, self.decode_steps = cfg, graphdef, mesh, rules, decode_steps
        self._slots = slots = max_concurrent_decodes
        self.max_seq_len = max_seq_len
        self._max_prefill_length = max_prefill_length
        self.page_size = page_size
        self.pages_per_seq = max_seq_len // page_size
        self.prefill_buckets = tuple(sorted(b for b in prefill_buckets if b < max_seq_len)) + (max_seq_len,)
        self.decode_windows = _buckets(self.prefill_buckets if decode_windows is None else decode_windows, max_seq_len)
        self.decode_blocks = decode_blocks(self.decode_windows)  # the decode state's cache blocks (kv_cache)
        self.decode_state_shardings = decode_state_shardings(cfg, mesh, rules, slots, self.decode_blocks)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        on_one_device = self.decode_state_shardings.tokens.shard_shape((slots,))[0] == slots  # slots not split
        self.decode_slot_buckets = _slot_buckets(decode_slot_buckets, slots, on_one_device)
        # jit boundaries: every device computation of serving is one of these (programs in steps.py), or one
        # of the page operations' (kv_pages.PageOps).
        self._init_decode_state_jit = jax.jit(
            functools.partial(empty_decode_state, cfg, slots, self.decode_blocks),
            out_shardings=self.decode_state_shardings,
        )
        self._empty_prefix_jit = jax.jit(
            functools.partial(empty_prefix, cfg, max_seq_len), out_shardings=self._replicated
        )
        self._flat = FlatParams()
        self.record_experts = record_experts
        programs = _model_programs(
            cfg, graphdef, max_seq_len, record_experts, self.decode_state_shardings, self._replicated
        )
        self._prefill_jit, self._prefill_extend_jit, self._prefill_many_jit, *programs = programs
        self._generate_jit, self._generate_steps_jit = programs
        self._insert_jit, self._insert_many_jit, self._release_jit = _slot_programs(self.decode_state_shardings)
        self._pages = PageOps(cfg, mesh, rules, page_size, max_seq_len)

    # -- JetStream's engine properties ------------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    # -- state ------------------------------------------------------------------------------------
    def init_decode_state(self) -> DecodeState:
        return self._init_decode_state_jit()

    def empty_prefix(self, key: jax.Array) -> Prefix:
        """A prefix of no tokens with a full-length cache [1, S]: start a prompt that is prefilled in several
        chunks from it, so every chunk runs the same compiled shapes (one per chunk bucket)."""
        return self._empty_prefix_jit(key)

    def _bucket(self, n: int) -> int:
        for b in self.prefill_buckets:
            if b >= n:
                return b
        raise ContextTooLongError(
            f"prompt chunk of {n} tokens exceeds the largest prefill bucket {self.prefill_buckets[-1]}"
        )

    def _flat_params(self, params) -> tuple[list, object]:
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
        if n > self._max_prefill_length:
            raise ContextTooLongError(
                f"prompt of {n} tokens exceeds max_prefill_length={self._max_prefill_length}; "
                "prefill it in chunks, each on top of the previous (existing_prefix)"
            )
        start = 0 if existing_prefix is None else int(existing_prefix.length)
        if start + n >= self.max_seq_len:
            raise ContextTooLongError(
                f"prompt of {start + n} tokens leaves no room to generate within max_seq_len={self.max_seq_len}"
            )
        bucket = self._bucket(n)
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :n] = tokens
        args = (jnp.asarray(padded), jnp.int32(n), *_sampling_args(sampling_params), key)
        if existing_prefix is None:
            return self._prefill_jit(*self._flat_params(params), *args)
        existing = dataclasses.replace(existing_prefix, experts=None)  # the earlier chunk's: not an input
        return self._prefill_extend_jit(*self._flat_params(params), existing, *args)

    def prefill_many(
        self, *, params: nnx.State, prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams], keys
    ) -> Prefix:
        """Several whole prompts in one program, packed side by side in rows as wide as the bucket of the longest
        (``_pack_prompts``): entry i of the result (every field has a leading axis of the prompt count's power of
        2, cache [P, bucket, K, D], entries past the prompts empty) is ``prefill`` of ``prompts[i]`` with
        ``keys[i]`` alone. For ``insert_many``."""
        return _prefill_packed(self, params, _pack_prompts(prompts, self), sampling, keys)

    # -- insert / release -------------------------------------------------------------------------
    def insert(
        self, prefix: Prefix, decode_state: DecodeState, slot: int, sampling_params: SamplingParams
    ) -> DecodeState:
        """Places a prefilled prompt into decode slot ``slot`` and activates it (donates ``decode_state``)."""
        prefix = dataclasses.replace(prefix, experts=None)  # not part of the slot's state
        return self._insert_jit(prefix, decode_state, jnp.int32(slot), *_sampling_args(sampling_params))

    def insert_many(
        self, prefixes: Prefix, decode_state: DecodeState, slots: Sequence[int], sampling: Sequence[SamplingParams]
    ) -> DecodeState:
        """Places rows 0..len(slots)-1 of ``prefill_many``'s result into decode ``slots`` (donates the state)."""
        rows = prefixes.token.shape[0]
        at = np.full((rows,), self._slots, np.int32)  # padding rows: out of range, dropped
        at[: len(slots)] = slots
        prefixes = dataclasses.replace(prefixes, experts=None)
        return self._insert_many_jit(prefixes, decode_state, jnp.asarray(at), *_sampling_rows(sampling, rows))

    def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Deactivates ``slot`` (its KV stays until the next insert; donates ``decode_state``)."""
        return self._release_jit(decode_state, jnp.int32(slot))

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
            return self._slots
        for b in self.decode_slot_buckets:
            if b >= slot_limit:
                return b
        return self._slots

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

        Optional hints from a caller that tracks its slots (the serving loop does), so that decode cost follows
        the live load rather than the allocated one:
          ``max_length``: the most tokens any active slot holds; the step attends over the smallest decode
            window above it instead of the whole ``max_seq_len`` cache;
          ``slot_limit``: no slot at or above it is active; only the smallest slot bucket covering
            [0, slot_limit) is stepped.
        A slot left out by a wrong hint samples nothing: ``valid`` is False for it and its state is unchanged.
        """
        check_num_steps(num_steps, self.decode_steps)
        leaves = self._flat_params(params)
        slots = self.decode_slots(slot_limit)
        # the window must hold every step's input token: the longest slot grows by num_steps - 1
        window = self.decode_window(None if max_length is None else max_length + num_steps - 1)
        multi = (self.decode_steps, jnp.int32(num_steps)) if num_steps > 1 else ()
        program = self._generate_steps_jit if multi else self._generate_jit
        state, ints, logprobs, *experts = program(*leaves, decode_state, window, slots, *multi)
        rows = num_steps if multi else None
        result = ResultTokens(_ints=ints, _logprobs=logprobs, _experts=experts[0] if experts else None, _rows=rows)
        if wait:
            return state, result.to_host()
        for array in (ints, logprobs, *experts):
            array.copy_to_host_async()
        return state, result

    def warmup(self, params: nnx.State, kv_pages: int = 0) -> int:
        """Compiles every shape the serving loop can dispatch (``warmup``); returns the number compiled."""
        return warmup(self, params, kv_pages)

    def _programs(self) -> list:
        """Every jitted program of this engine that serving dispatches (for ``warmup``'s count)."""
        p = self._pages
        return [
            self._init_decode_state_jit, self._empty_prefix_jit, self._prefill_jit, self._prefill_extend_jit,
            self._prefill_many_jit, self._generate_jit, self._generate_steps_jit, self._insert_jit,
            self._insert_many_jit, self._release_jit, p._save_jit, p._load_jit, *p._init_pool_jits.values(),
        ]  # fmt: skip

    # -- pages: the session prefix cache's KV budget and KV in transit (kv_pages.PageOps) -----------
    def kv_pages_shardings(self, num_pages: int) -> KVPages:
        """Shardings of a [num_pages, page_size, K, D] page array on this engine's mesh (pages split like slots)."""
        return self._pages.shardings(num_pages)

    def init_page_pool(self, num_pages: int) -> KVPages:
        """A pool of ``num_pages`` pages (zeros): the fixed KV budget of a session prefix cache."""
        return self._pages.init_pool(num_pages)

    def save_slot(self, pool: KVPages, decode_state: DecodeState, slot: int, page_ids: Sequence[int]) -> KVPages:
        """Copies the first ``len(page_ids)`` pages of ``slot``'s KV into pool pages ``page_ids`` (donates ``pool``)."""
        return self._pages.save_slot(pool, decode_state, slot, page_ids)

    def load_prefix(self, pool: KVPages, page_ids: Sequence[int], length: int, key: jax.Array) -> Prefix:
        """A Prefix (cache [1, S]) holding the first ``length`` tokens stored in pool pages ``page_ids``.

        Its ``token`` is unset: prefill the rest of the prompt on top of it (``prefill(existing_prefix=...)``)."""
        return self._pages.load_prefix(pool, page_ids, length, key)

    def export_slot(self, decode_state: DecodeState, slot: int, num_tokens: int) -> KVPages:
        """The first ``num_tokens`` tokens of ``slot``'s KV as pages (page count rounded up to a power of 2)."""
        return self._pages.export(decode_state.cache, slot, num_tokens)

    def export_prefix(self, prefix: Prefix, num_tokens: int) -> KVPages:
        """The first ``num_tokens`` tokens of a Prefix's KV as pages (to migrate a partly prefilled prompt)."""
        return self._pages.export(prefix.cache, 0, num_tokens)

    def export_pages(self, pool: KVPages, page_ids: Sequence[int]) -> KVPages:
        """Pool pages ``page_ids`` gathered into one KVPages (count rounded up to a power of 2 with page 0)."""
        return self._pages.export_pages(pool, page_ids)

    def import_pages(self, pool: KVPages, kv: KVPages, page_ids: Sequence[int]) -> KVPages:
        """Writes the first ``len(page_ids)`` pages of ``kv`` (already on this mesh) into pool pages ``page_ids``."""
        return self._pages.import_pages(pool, kv, page_ids)

    def prefix_from_pages(
        self, kv: KVPages, length: int, key: jax.Array, token: int = 0, logprob: float = 0.0
    ) -> Prefix:
        """A Prefix (cache [1, S]) from a session's KV pages (on this mesh): ``length`` tokens, next ``token``."""
        return self._pages.prefix_from_pages(kv, length, key, token, logprob)

    def check_kv(self, kv: KVPages) -> None:
        """Raises ValueError if ``kv`` was not made by an engine of this KV layout (layers, page size, heads, dim)."""
        self._pages.check(kv)

    def to_mesh(self, kv: KVPages) -> KVPages:
        """Moves ``kv`` (possibly on another mesh) onto this engine's mesh: a device-to-device copy."""
        return self._pages.to_mesh(kv)

    def param_shardings(self, abstract_state):
        from gyre_jax.model.sharding import param_shardings

        return param_shardings(abstract_state, self.rules, self._mesh)


def _compiled(programs) -> int:
    """The compiled entries (shapes) of jitted ``programs``, together."""
    return sum(f._cache_size() for f in programs)


def warmup(engine: Engine, params: nnx.State, kv_pages: int = 0) -> int:
    """Compiles every program shape ``engine``'s serving loop can dispatch, by running each once on scratch state
    (never the loop's: a decode state and a page pool of its own, dropped at the end), so that no compile stalls
    a running cell later:

    - one prompt: prefill per bucket up to ``max_prefill_length``'s, fresh and on top of a prefix (a chunk, a
      session-cache hit), and its insert (the prefix is [1, bucket] fresh, [1, max_seq_len] on a prefix);
    - several whole prompts in one program (``batch.prefill_together``): ``prefill_many`` per bucket, power-of-2
      prompt count from 2 up to the one holding every slot and its ``packed_row_buckets``, and ``insert_many``
      per bucket and prompt count;
    - generate per decode window, slot bucket and number of steps (1 and ``decode_steps``); release;
    - ``kv_pages`` > 0 (the loop's session prefix cache of that many pages): the pool, ``save_slot``,
      ``load_prefix`` and a prefill on top of a loaded prefix (in case its sharding, which follows the pool's,
      makes another shape than the empty prefix's).

    Not run: the migration programs (``export_*`` / ``import_pages`` / ``prefix_from_pages``, one shape per
    power-of-2 page count), which compile when a session first moves. Returns the number of program shapes
    compiled (0 when already warm)."""
    greedy = SamplingParams(temperature=0.0)
    key = jnp.zeros((2,), jnp.uint32)
    before = _compiled(engine._programs())
    state = engine.init_decode_state()
    top = engine._bucket(engine.max_prefill_length)
    lengths = [min(b, engine.max_prefill_length, engine.max_seq_len - 1) for b in engine.prefill_buckets if b <= top]
    starts = [engine.empty_prefix(key)]
    pool = None
    if kv_pages > 0:
        pool = engine.init_page_pool(kv_pages)
        pool = engine.save_slot(pool, state, 0, [0])
        starts.append(engine.load_prefix(pool, [0], 1, key))
    for n in lengths:
        for existing in (None, *starts):
            start = 0 if existing is None else int(existing.length)
            m = min(n, engine.max_seq_len - 1 - start)
            if m < 1 or engine._bucket(m) != engine._bucket(n):
                continue  # no prompt of this bucket fits on top of this prefix
            prefix = engine.prefill(
                params=params, tokens=[0] * m, sampling_params=greedy, key=key, existing_prefix=existing
            )
            state = engine.insert(prefix, state, 0, greedy)
    slots = engine.max_concurrent_decodes
    count = 2
    while slots >= 2 and count // 2 < slots:  # prefill_together: 2..slots prompts, packed in rows of each bucket
        for n in lengths:
            for rows in packed_row_buckets(count):
                packed = _one_token_prompts(rows, engine._bucket(n), count)
                batched = _prefill_packed(engine, params, packed, [greedy] * rows, [key] * rows)
            state = engine.insert_many(batched, state, list(range(min(count, slots))), [greedy] * min(count, slots))
        count *= 2
    leaves = engine._flat_params(params)
    for w in engine.decode_windows:
        for k in engine.decode_slot_buckets:
            state, *_ = engine._generate_jit(*leaves, state, w, k)
            if engine.decode_steps > 1:
                state, *_ = engine._generate_steps_jit(*leaves, state, w, k, engine.decode_steps, jnp.int32(1))
    state = engine.release(state, 0)
    jax.block_until_ready((state, pool))
    return _compiled(engine._programs()) - before
