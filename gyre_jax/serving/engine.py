"""The serving engine: JetStream's contract (prefill -> insert into a slot -> generate for all slots), plus
the KV movements the serving loop needs (session pages, export/import between meshes).

The engine owns the jitted model calls and the layout of every KV buffer on its mesh; it knows nothing
about requests, queues, sessions or HTTP (that is ``serving.loop``). Shapes are fixed at construction
(``max_concurrent_decodes`` slots of ``max_seq_len`` cached tokens; prefill padded to buckets; pages of
``page_size`` tokens), so serving never recompiles after warm-up, including across weight updates of the
same layout.

KV buffers (per layer, ``LayerCache(k, v)``; K = kv heads, D = head dim):
  - decode state: ``[slots, S, K, D]``, dense per slot, so a generate step is one plain model call;
  - ``Prefix``: ``[1, C, K, D]`` with C a prefill bucket (a fresh prompt) or S (a prompt prefilled on top
    of an existing prefix: chunked prefill, a session-cache hit, a migrated session);
  - page pool: ``[P, page_size, K, D]``, the fixed KV budget of the session prefix cache;
  - ``KVPages``: ``[n, page_size, K, D]``, one session's KV in transit (export -> device_put -> import).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model.attention import LayerCache, cache_causal_mask, init_cache
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import Rules, logical_sharding
from gyre_jax.serving import sampling
from gyre_jax.serving.types import ContextTooLongError, SamplingParams

CACHE_AXES = ("batch", None, "kv_heads", "head_dim")  # decode slots and pages are split like a batch


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """A prefilled prompt: its KV cache [1, C, K, D] per layer, its length and the first sampled token."""

    cache: list[LayerCache]
    length: jax.Array  # [] int32: tokens in the cache (positions 0 .. length-1)
    token: jax.Array  # [] int32: first generated token (not yet in the cache)
    logprob: jax.Array  # [] f32
    key: jax.Array  # [2] uint32: the request's sampling key, advanced past the first token


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """All slots' state. cache: per layer [slots, S, K, D]; the rest [slots] (keys [slots, 2])."""

    cache: list[LayerCache]
    tokens: jax.Array  # int32: last sampled token per slot, fed to the next generate step
    lengths: jax.Array  # int32: tokens already in the slot's cache (= position of ``tokens``)
    active: jax.Array  # bool: the slot holds a request (inactive slots write nothing)
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPages:
    """One sequence's KV in pages: per layer k, v [n, page_size, K, D]; token i is at page i // page_size."""

    pages: list[LayerCache]

    @property
    def num_pages(self) -> int:
        return int(self.pages[0].k.shape[0])


class ResultTokens:
    """One generate step, [slots] each: ``tokens`` (int32, the sampled token), ``valid`` (bool: the slot was
    stepped and its cache had room), ``lengths`` (int32: the slot's cache length after the step), ``logprobs``
    (f32: the token's log-prob). Host numpy arrays; ``generate(..., wait=False)`` returns one still on the
    device (being copied) until ``to_host()``."""

    def __init__(self, *, _ints, _logprobs):
        self._ints = _ints  # [3, slots] int32: tokens, valid, lengths
        self._logprobs = _logprobs  # [slots] f32

    def to_host(self) -> ResultTokens:
        """The host copy (waits for the step to finish)."""
        ints, logprobs = jax.device_get((self._ints, self._logprobs))
        return ResultTokens(_ints=np.asarray(ints), _logprobs=np.asarray(logprobs))

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray(self._ints[0])

    @property
    def valid(self) -> np.ndarray:
        return np.asarray(self._ints[1]).astype(bool)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self._ints[2])

    @property
    def logprobs(self) -> np.ndarray:
        return np.asarray(self._logprobs)


def kv_pages_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules, page_size: int, num_pages: int) -> KVPages:
    """``KVPages`` of ``NamedSharding``: a [num_pages, page_size, K, D] page array per layer on ``mesh``, pages
    split like decode slots. Any process can compute it for any cell (no engine needed)."""
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    sh = logical_sharding(CACHE_AXES, rules, mesh, shape)
    return KVPages(pages=[LayerCache(k=sh, v=sh) for _ in range(cfg.num_layers)])


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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
    ):
        """``max_prefill_length``: the most tokens one ``prefill`` call takes (longer prompts are prefilled in
        chunks by the caller, each on top of the previous). ``page_size`` (tokens per KV page; default
        ``gcd(16, max_seq_len)``) must divide ``max_seq_len``. ``decode_windows``: cache lengths a generate
        step may attend over (default: the prefill buckets; ``max_seq_len`` is always one). ``decode_slot_buckets``:
        numbers of leading slots a generate step may run over (default: powers of 2 when the slots live on one
        device, else only all of them; ``max_concurrent_decodes`` is always one). One compile per pair in use."""
        if max_concurrent_decodes < 1:
            raise ValueError(f"max_concurrent_decodes={max_concurrent_decodes} must be >= 1")
        if not 1 <= max_prefill_length <= max_seq_len:
            raise ValueError(f"max_prefill_length={max_prefill_length} must be in [1, max_seq_len={max_seq_len}]")
        page_size = math.gcd(16, max_seq_len) if page_size is None else page_size
        if page_size < 1 or max_seq_len % page_size:
            raise ValueError(f"page_size={page_size} must be >= 1 and divide max_seq_len={max_seq_len}")
        self.cfg = cfg
        self.graphdef = graphdef
        self._mesh = mesh
        self.rules = rules
        self._slots = max_concurrent_decodes
        self.max_seq_len = max_seq_len
        self._max_prefill_length = max_prefill_length
        self.page_size = page_size
        self.pages_per_seq = max_seq_len // page_size
        self.prefill_buckets = tuple(sorted(b for b in prefill_buckets if b < max_seq_len)) + (max_seq_len,)
        windows = self.prefill_buckets if decode_windows is None else decode_windows
        self.decode_windows = tuple(sorted({w for w in windows if 0 < w < max_seq_len})) + (max_seq_len,)
        cache_shape = (self._slots, max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        cache_sharding = logical_sharding(CACHE_AXES, rules, mesh, cache_shape)
        slot_sharding = logical_sharding(("batch",), rules, mesh, (self._slots,))
        key_sharding = logical_sharding(("batch", None), rules, mesh, (self._slots, 2))
        self.decode_state_shardings = DecodeState(
            cache=[LayerCache(k=cache_sharding, v=cache_sharding) for _ in range(cfg.num_layers)],
            tokens=slot_sharding,
            lengths=slot_sharding,
            active=slot_sharding,
            temperature=slot_sharding,
            top_k=slot_sharding,
            top_p=slot_sharding,
            keys=key_sharding,
        )
        self._replicated = NamedSharding(mesh, PartitionSpec())
        if decode_slot_buckets is None:  # slicing slots split over devices would move them: only on one device
            one_device = cache_sharding.shard_shape(cache_shape)[0] == self._slots
            decode_slot_buckets = (
                [2**i for i in range(self._slots.bit_length()) if 2**i < self._slots] if one_device else []
            )
        self.decode_slot_buckets = tuple(sorted({b for b in decode_slot_buckets if 0 < b < self._slots})) + (
            self._slots,
        )
        # jit boundaries: every device computation of serving is one of these.
        self._init_decode_state_jit = jax.jit(self._make_decode_state, out_shardings=self.decode_state_shardings)
        self._empty_prefix_jit = jax.jit(self._make_empty_prefix, out_shardings=self._replicated)
        self._init_pool_jits: dict[int, object] = {}  # num_pages -> jitted pool constructor
        self._flat_cache = None
        self._prefill_jit = jax.jit(self._prefill_impl, static_argnums=(1,))
        self._prefill_extend_jit = jax.jit(self._prefill_extend_impl, static_argnums=(1,))
        self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=self.decode_state_shardings)
        self._release_jit = jax.jit(self._release_impl, donate_argnums=(0,), out_shardings=self.decode_state_shardings)
        self._generate_jit = jax.jit(
            self._generate_impl,
            donate_argnums=(2,),
            static_argnums=(1, 3, 4),
            out_shardings=(self.decode_state_shardings, self._replicated, self._replicated),
        )
        self._save_jit = jax.jit(self._save_impl, donate_argnums=(0,))
        self._load_jit = jax.jit(self._load_impl)
        self._export_jit = jax.jit(self._export_impl, static_argnums=(2,))
        self._export_pages_jit = jax.jit(self._export_pages_impl)
        self._import_pages_jit = jax.jit(self._import_pages_impl, donate_argnums=(0,))
        self._prefix_from_pages_jit = jax.jit(self._prefix_from_pages_impl)

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
    def _make_decode_state(self) -> DecodeState:
        return DecodeState(
            cache=init_cache(self.cfg, self._slots, self.max_seq_len),
            tokens=jnp.zeros((self._slots,), jnp.int32),
            lengths=jnp.zeros((self._slots,), jnp.int32),
            active=jnp.zeros((self._slots,), jnp.bool_),
            temperature=jnp.ones((self._slots,), jnp.float32),
            top_k=jnp.zeros((self._slots,), jnp.int32),
            top_p=jnp.ones((self._slots,), jnp.float32),
            keys=jnp.zeros((self._slots, 2), jnp.uint32),
        )

    def init_decode_state(self) -> DecodeState:
        return self._init_decode_state_jit()

    def _make_empty_prefix(self, key) -> Prefix:
        return Prefix(
            cache=init_cache(self.cfg, 1, self.max_seq_len),
            length=jnp.int32(0),
            token=jnp.int32(0),
            logprob=jnp.float32(0),
            key=key,
        )

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

    # -- prefill ----------------------------------------------------------------------------------
    def _model(self, leaves, treedef):
        """The model inside a jitted function, from parameters passed as flat leaves (cheap to dispatch)."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(treedef, leaves))

    def _flat_params(self, params) -> tuple[list, object]:
        """(leaves, treedef) of ``params``, remembered for the last params seen: flattening an nnx.State on
        every call would cost more host time than a tiny model's decode step."""
        cached = self._flat_cache
        if cached is None or cached[0] is not params:
            leaves, treedef = jax.tree.flatten(params)
            cached = self._flat_cache = (params, leaves, treedef)
        return cached[1], cached[2]

    def _forward_and_sample(self, params, cache, positions, tokens, true_length, temperature, top_k, top_p, key):
        """params: (leaves, treedef); tokens, positions: [1, Tb] (padding rows at an out-of-cache position, so
        their writes drop)."""
        model = self._model(*params)
        mask = cache_causal_mask(positions, cache[0].k.shape[1])
        logits, cache = model(tokens, positions, mask, cache)  # logits: [1, Tb, V]
        last = jax.lax.dynamic_index_in_dim(logits[0], true_length - 1, axis=0, keepdims=True)  # [1, V]
        key, use = sampling.split_keys(key[None])
        token, logprob = sampling.sample(last, use, temperature[None], top_k[None], top_p[None])
        return cache, token[0], logprob[0], key[0]

    def _prefill_impl(self, leaves, treedef, tokens, true_length, temperature, top_k, top_p, key):
        """tokens: [1, Tb] padded; true_length: [] int32. Returns a Prefix whose cache is [1, Tb, K, D]."""
        params = (leaves, treedef)
        tb = tokens.shape[1]
        idx = jnp.arange(tb, dtype=jnp.int32)
        positions = jnp.where(idx < true_length, idx, tb)[None, :]  # padding writes are dropped
        cache, token, logprob, key = self._forward_and_sample(
            params, init_cache(self.cfg, 1, tb), positions, tokens, true_length, temperature, top_k, top_p, key
        )
        return Prefix(cache=cache, length=true_length, token=token, logprob=logprob, key=key)

    def _prefill_extend_impl(
        self, leaves, treedef, existing: Prefix, tokens, true_length, temperature, top_k, top_p, key
    ):
        """Prefills tokens [1, Tb] (true_length real) at positions existing.length ...; cache grows to [1, S]."""
        params = (leaves, treedef)
        s = self.max_seq_len
        cache = [LayerCache(k=self._widen(c.k), v=self._widen(c.v)) for c in existing.cache]
        idx = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        positions = jnp.where(idx < true_length, existing.length + idx, s)[None, :]
        cache, token, logprob, key = self._forward_and_sample(
            params, cache, positions, tokens, true_length, temperature, top_k, top_p, key
        )
        return Prefix(cache=cache, length=existing.length + true_length, token=token, logprob=logprob, key=key)

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
        sp = sampling_params
        args = (
            jnp.asarray(padded),
            jnp.int32(n),
            jnp.float32(sp.temperature),
            jnp.int32(sp.top_k),
            jnp.float32(sp.top_p),
            key,
        )
        if existing_prefix is None:
            return self._prefill_jit(*self._flat_params(params), *args)
        return self._prefill_extend_jit(*self._flat_params(params), existing_prefix, *args)

    # -- insert / release -------------------------------------------------------------------------
    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot, temperature, top_k, top_p) -> DecodeState:
        def put(dst, src):  # dst: [slots, S, K, D]; src: [1, C, K, D] written at [slot, 0:C]
            return jax.lax.dynamic_update_slice(dst, src.astype(dst.dtype), (slot, 0, 0, 0))

        cache = [LayerCache(k=put(s.k, p.k), v=put(s.v, p.v)) for s, p in zip(state.cache, prefix.cache)]
        return DecodeState(
            cache=cache,
            tokens=state.tokens.at[slot].set(prefix.token),
            lengths=state.lengths.at[slot].set(prefix.length),
            active=state.active.at[slot].set(True),
            temperature=state.temperature.at[slot].set(temperature),
            top_k=state.top_k.at[slot].set(top_k),
            top_p=state.top_p.at[slot].set(top_p),
            keys=state.keys.at[slot].set(prefix.key),
        )

    def insert(
        self, prefix: Prefix, decode_state: DecodeState, slot: int, sampling_params: SamplingParams
    ) -> DecodeState:
        """Places a prefilled prompt into decode slot ``slot`` and activates it (donates ``decode_state``)."""
        sp = sampling_params
        return self._insert_jit(
            prefix,
            decode_state,
            jnp.int32(slot),
            jnp.float32(sp.temperature),
            jnp.int32(sp.top_k),
            jnp.float32(sp.top_p),
        )

    def _release_impl(self, state: DecodeState, slot) -> DecodeState:
        return dataclasses.replace(state, active=state.active.at[slot].set(False))

    def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Deactivates ``slot`` (its KV stays until the next insert; donates ``decode_state``)."""
        return self._release_jit(decode_state, jnp.int32(slot))

    # -- generate ---------------------------------------------------------------------------------
    def _generate_impl(self, leaves, treedef, state: DecodeState, window: int, num_slots: int):
        """One step for slots [0, num_slots) over cache positions [0, window) (both static): attention reads
        [num_slots, window] keys; the other slots are left as they are. Returns the new state, ints [3, slots]
        (tokens, valid, lengths) and log-probs [slots] (two arrays: two host copies)."""
        model = self._model(leaves, treedef)
        s, k = self.max_seq_len, num_slots
        lengths = state.lengths[:k]
        ok = state.active[:k] & (lengths < window)  # stepped slots whose next position is inside the window
        positions = jnp.where(ok, lengths, window)[:, None]  # [k, 1]; the others write nothing
        mask = cache_causal_mask(positions, window)
        if k == self._slots and window == s:  # the whole cache, updated in place
            logits, cache = model(state.tokens[:, None], positions, mask, state.cache)
        else:  # attend over a block of the cache, then write the one new KV row per slot back into the cache
            sub = [LayerCache(k=c.k[:k, :window], v=c.v[:k, :window]) for c in state.cache]
            logits, sub = model(state.tokens[:k, None], positions, mask, sub)
            rows = jnp.arange(k)
            read = jnp.minimum(positions[:, 0], window - 1)
            write = jnp.where(ok, lengths, s)  # out of range: dropped

            def put(full, part):  # full: [slots, S, K, D]; part: [k, window, K, D]
                return full.at[rows, write].set(part[rows, read], mode="drop")

            cache = [LayerCache(k=put(c.k, n.k), v=put(c.v, n.v)) for c, n in zip(state.cache, sub)]
        keys, use = sampling.split_keys(state.keys[:k])
        tokens, logprobs = sampling.sample(logits[:, 0], use, state.temperature[:k], state.top_k[:k], state.top_p[:k])
        tokens = jnp.where(ok, tokens, state.tokens[:k])  # a slot that sampled nothing keeps its pending token and key
        keys = jnp.where(ok[:, None], keys, state.keys[:k])
        lengths = jnp.where(ok, lengths + 1, lengths)

        def head(full, part):  # writes part: [k, ...] over full: [slots, ...]
            return jax.lax.dynamic_update_slice(full, part, (0,) * full.ndim)

        new_state = dataclasses.replace(
            state,
            cache=cache,
            tokens=head(state.tokens, tokens),
            lengths=head(state.lengths, lengths),
            keys=head(state.keys, keys),
        )
        pad = self._slots - k
        ints = jnp.stack([new_state.tokens, jnp.pad(ok, (0, pad)).astype(jnp.int32), new_state.lengths])
        return new_state, ints, jnp.pad(logprobs, (0, pad))

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
    ) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot: feeds each slot's last token, samples the next (donates the state).

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
        state, ints, logprobs = self._generate_jit(
            *self._flat_params(params), decode_state, self.decode_window(max_length), self.decode_slots(slot_limit)
        )
        result = ResultTokens(_ints=ints, _logprobs=logprobs)
        if wait:
            return state, result.to_host()
        ints.copy_to_host_async()
        logprobs.copy_to_host_async()
        return state, result

    def warmup(self, params: nnx.State) -> int:
        """Compiles every shape serving can use (prefill per bucket, fresh and on top of a prefix; insert per
        prefix length; generate per decode window and slot bucket) by running each once on scratch state, so
        no compile stalls a running cell later. Returns the number of shapes run."""
        greedy = SamplingParams(temperature=0.0)
        key = jnp.zeros((2,), jnp.uint32)
        state = self.init_decode_state()
        count = 0
        for b in self.prefill_buckets:
            if b > self._bucket(self._max_prefill_length):
                break
            n = min(b, self._max_prefill_length, self.max_seq_len - 1)
            for existing in (None, self.empty_prefix(key)):
                state = self.insert(
                    self.prefill(
                        params=params, tokens=[0] * n, sampling_params=greedy, key=key, existing_prefix=existing
                    ),
                    state,
                    0,
                    greedy,
                )
                count += 1
        for w in self.decode_windows:
            for k in self.decode_slot_buckets:
                state, _, _ = self._generate_jit(*self._flat_params(params), state, w, k)
                count += 1
        jax.block_until_ready(state)
        return count

    # -- pages: the session prefix cache's KV budget and KV in transit ------------------------------
    def kv_pages_shardings(self, num_pages: int) -> KVPages:
        """Shardings of a [num_pages, page_size, K, D] page array on this engine's mesh (pages split like slots)."""
        return kv_pages_shardings(self.cfg, self._mesh, self.rules, self.page_size, num_pages)

    def init_page_pool(self, num_pages: int) -> KVPages:
        """A pool of ``num_pages`` pages (zeros): the fixed KV budget of a session prefix cache."""
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        if num_pages not in self._init_pool_jits:
            self._init_pool_jits[num_pages] = jax.jit(
                lambda: KVPages(pages=init_cache(self.cfg, num_pages, self.page_size)),
                out_shardings=self.kv_pages_shardings(num_pages),
            )
        return self._init_pool_jits[num_pages]()

    def _page_ids(self, page_ids: Sequence[int], count: int, fill: int) -> jax.Array:
        ids = np.full((count,), fill, np.int32)
        ids[: len(page_ids)] = page_ids
        return jnp.asarray(ids)

    def _save_impl(self, pool: KVPages, state: DecodeState, slot, page_ids) -> KVPages:
        """page_ids: [S / page_size]; page j of the slot goes to pool page page_ids[j] (out of range: skipped)."""

        def one(dst, src):  # dst: [P, p, K, D]; src: [slots, S, K, D]
            seq = jax.lax.dynamic_index_in_dim(src, slot, axis=0, keepdims=False)  # [S, K, D]
            return dst.at[page_ids].set(seq.reshape((-1,) + dst.shape[1:]).astype(dst.dtype), mode="drop")

        return KVPages(pages=[LayerCache(k=one(d.k, s.k), v=one(d.v, s.v)) for d, s in zip(pool.pages, state.cache)])

    def save_slot(self, pool: KVPages, decode_state: DecodeState, slot: int, page_ids: Sequence[int]) -> KVPages:
        """Copies the first ``len(page_ids)`` pages of ``slot``'s KV into pool pages ``page_ids`` (donates ``pool``)."""
        num_pool = pool.num_pages
        return self._save_jit(
            pool, decode_state, jnp.int32(slot), self._page_ids(page_ids, self.pages_per_seq, num_pool)
        )

    def _load_impl(self, pool: KVPages, page_ids, length, key) -> Prefix:
        """page_ids: [S / page_size] (padding: any valid id; positions >= length are never attended)."""

        def one(src):  # [P, p, K, D] -> [1, S, K, D]
            return src[page_ids].reshape((1, self.max_seq_len) + src.shape[2:])

        cache = [LayerCache(k=one(c.k), v=one(c.v)) for c in pool.pages]
        return Prefix(cache=cache, length=length, token=jnp.int32(0), logprob=jnp.float32(0), key=key)

    def load_prefix(self, pool: KVPages, page_ids: Sequence[int], length: int, key: jax.Array) -> Prefix:
        """A Prefix (cache [1, S]) holding the first ``length`` tokens stored in pool pages ``page_ids``.

        Its ``token`` is unset: prefill the rest of the prompt on top of it (``prefill(existing_prefix=...)``)."""
        if not 0 < length <= len(page_ids) * self.page_size:
            raise ValueError(f"length={length} must be in [1, {len(page_ids)} pages x {self.page_size} tokens]")
        return self._load_jit(pool, self._page_ids(page_ids, self.pages_per_seq, 0), jnp.int32(length), key)

    def _export_impl(self, cache: list[LayerCache], row, num_pages: int) -> KVPages:
        n = num_pages * self.page_size

        def one(src):  # [B, C, K, D] -> row's first n tokens as [num_pages, p, K, D]
            if src.shape[1] < n:
                src = jnp.pad(src, ((0, 0), (0, n - src.shape[1]), (0, 0), (0, 0)))
            seq = jax.lax.dynamic_slice(src, (row, 0, 0, 0), (1, n) + src.shape[2:])
            return seq.reshape((num_pages, self.page_size) + src.shape[2:])

        return KVPages(pages=[LayerCache(k=one(c.k), v=one(c.v)) for c in cache])

    def _num_export_pages(self, num_tokens: int) -> int:
        """Pages for ``num_tokens`` tokens, rounded up to a power of two (bounds the compiled shapes)."""
        return min(_pow2_at_least(-(-num_tokens // self.page_size)), self.pages_per_seq)

    def export_slot(self, decode_state: DecodeState, slot: int, num_tokens: int) -> KVPages:
        """The first ``num_tokens`` tokens of ``slot``'s KV as pages (page count rounded up to a power of 2)."""
        if not 0 < num_tokens <= self.max_seq_len:
            raise ValueError(f"num_tokens={num_tokens} must be in [1, max_seq_len={self.max_seq_len}]")
        return self._export_jit(decode_state.cache, jnp.int32(slot), self._num_export_pages(num_tokens))

    def export_prefix(self, prefix: Prefix, num_tokens: int) -> KVPages:
        """The first ``num_tokens`` tokens of a Prefix's KV as pages (to migrate a partly prefilled prompt)."""
        if not 0 < num_tokens <= self.max_seq_len:
            raise ValueError(f"num_tokens={num_tokens} must be in [1, max_seq_len={self.max_seq_len}]")
        return self._export_jit(prefix.cache, jnp.int32(0), self._num_export_pages(num_tokens))

    def _widen(self, x: jax.Array) -> jax.Array:  # [1, C, K, D] -> [1, S, K, D] (C <= S)
        grow = self.max_seq_len - x.shape[1]
        return x if grow == 0 else jnp.pad(x, ((0, 0), (0, grow), (0, 0), (0, 0)))

    def _export_pages_impl(self, pool: KVPages, page_ids) -> KVPages:
        return KVPages(pages=[LayerCache(k=c.k[page_ids], v=c.v[page_ids]) for c in pool.pages])

    def export_pages(self, pool: KVPages, page_ids: Sequence[int]) -> KVPages:
        """Pool pages ``page_ids`` gathered into one KVPages (count rounded up to a power of 2 with page 0)."""
        count = self._num_export_pages(len(page_ids) * self.page_size)
        return self._export_pages_jit(pool, self._page_ids(page_ids, count, 0))

    def _import_pages_impl(self, pool: KVPages, kv: KVPages, page_ids) -> KVPages:
        return KVPages(
            pages=[
                LayerCache(
                    k=d.k.at[page_ids].set(s.k.astype(d.k.dtype), mode="drop"),
                    v=d.v.at[page_ids].set(s.v.astype(d.v.dtype), mode="drop"),
                )
                for d, s in zip(pool.pages, kv.pages)
            ]
        )

    def import_pages(self, pool: KVPages, kv: KVPages, page_ids: Sequence[int]) -> KVPages:
        """Writes the first ``len(page_ids)`` pages of ``kv`` (already on this mesh) into pool pages ``page_ids``."""
        self.check_kv(kv)
        if len(page_ids) > kv.num_pages:
            raise ValueError(f"{len(page_ids)} page ids for a KVPages of {kv.num_pages} pages")
        return self._import_pages_jit(pool, kv, self._page_ids(page_ids, kv.num_pages, pool.num_pages))

    def _prefix_from_pages_impl(self, kv: KVPages, length, token, logprob, key) -> Prefix:
        def one(src):  # [n, p, K, D] -> [1, S, K, D]
            return self._widen(src.reshape((1, -1) + src.shape[2:]))

        cache = [LayerCache(k=one(c.k), v=one(c.v)) for c in kv.pages]
        return Prefix(cache=cache, length=length, token=token, logprob=logprob, key=key)

    def prefix_from_pages(
        self, kv: KVPages, length: int, key: jax.Array, token: int = 0, logprob: float = 0.0
    ) -> Prefix:
        """A Prefix (cache [1, S]) from a session's KV pages (on this mesh): ``length`` tokens, next ``token``."""
        self.check_kv(kv)
        if not 0 < length <= min(kv.num_pages * self.page_size, self.max_seq_len - 1):
            raise ContextTooLongError(
                f"a session of {length} cached tokens does not fit this engine "
                f"(max_seq_len={self.max_seq_len}, {kv.num_pages} pages given)"
            )
        return self._prefix_from_pages_jit(kv, jnp.int32(length), jnp.int32(token), jnp.float32(logprob), key)

    def check_kv(self, kv: KVPages) -> None:
        """Raises ValueError if ``kv`` was not made by an engine of this KV layout (layers, page size, heads, dim)."""
        want = (self.page_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        got = tuple(kv.pages[0].k.shape[1:]) if kv.pages else None
        if len(kv.pages) != self.cfg.num_layers or got != want:
            raise ValueError(
                f"KV pages of {len(kv.pages)} layers x [n, {got}] do not match this engine's layout "
                f"({self.cfg.num_layers} layers x [n, {want}] as [n, page_size, kv_heads, head_dim]); "
                "sessions move only between engines of the same model and page size"
            )

    def to_mesh(self, kv: KVPages) -> KVPages:
        """Moves ``kv`` (possibly on another mesh) onto this engine's mesh: a device-to-device copy."""
        self.check_kv(kv)
        return jax.device_put(kv, self.kv_pages_shardings(kv.num_pages))

    def param_shardings(self, abstract_state):
        from gyre_jax.model.sharding import param_shardings

        return param_shardings(abstract_state, self.rules, self._mesh)
